"""Tokenizing a 4 MiB prompt never stalls the event loop (issue 28): while vLLM's renderer
tokenizes it, the state endpoint (Envoy's spill health check, 2 s timeout) keeps answering.

The prompt is tokenized for real: the small local model's own tokenizer, in vLLM's serving layer
on the HTTP front (conftest.FakeVllmAsyncLLM only stands in for the engine behind it).
`truncate_prompt_tokens` makes vLLM tokenize the whole text and keep its last tokens; without
it, a prompt this far over max_model_len is refused by its length in characters, untokenized.
The body limit (server.max_body_bytes, 4 MiB by default: the whole body, so a 4 MiB prompt
needs a larger one) is raised to 8 MiB here.

The same probe with the tokenizer called on the event loop (the control) must see the stall, so
the bound is known to catch one."""

import asyncio
import json
import time

import httpx
import pytest

from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.http_api import build_app

PROMPT_BYTES = 4 << 20
HEALTH_CHECK_TIMEOUT_S = 2.0
BOUND_S = 1.0
"""The state endpoint's longest wait while the prompt is tokenized: half of Envoy's timeout
(the tokenizer's thread still takes the GIL from the loop now and then; measured in docs/sidecar.md)."""
KEEP_TOKENS = 64

CONFIG = SidecarConfig.model_validate(
    {"pool": "interactive", "models": [{"name": "m-large", "path": "/nonexistent"}],
     "server": {"max_body_bytes": 8 << 20}}
)


def big_body(api: str) -> tuple[str, bytes]:
    words = ("the quick brown fox jumps over the lazy dog " * (PROMPT_BYTES // 40))[:PROMPT_BYTES]
    if api == "chat":
        return "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": words}], "max_tokens": 2,
                                                   "truncate_prompt_tokens": KEEP_TOKENS}).encode()
    return "/v1/completions", json.dumps({"prompt": words, "max_tokens": 2, "truncate_prompt_tokens": KEEP_TOKENS}).encode()


POLL_S = 0.02


async def state_latency_while(app, path: str, body: bytes) -> tuple[httpx.Response, list[float], float]:
    """(the big request's response, the state endpoint's waits meanwhile, the big request's time).

    The client runs on the server's event loop (ASGI, no sockets), so while the loop is stalled
    it cannot send either: a wait is the time from when a check was due (POLL_S after the last
    answer) to its answer, which is what a health check sent at that moment would have waited."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sidecar", timeout=120) as c:
        assert (await c.get("/infermesh/state?healthy_below=1")).status_code == 200
        waits: list[float] = []
        big = asyncio.ensure_future(c.post(path, content=body, headers={"content-type": "application/json"}))
        t0 = last = time.perf_counter()
        while not big.done():
            await asyncio.sleep(POLL_S)
            r = await c.get("/infermesh/state?healthy_below=1")
            now = time.perf_counter()
            waits.append(now - last - POLL_S)
            last = now
            assert r.status_code == 200
        return await big, waits, time.perf_counter() - t0


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_the_state_endpoint_answers_while_a_4mib_prompt_is_tokenized(make_vllm_pool, api):
    pool = make_vllm_pool(CONFIG)
    path, body = big_body(api)
    assert len(body) > PROMPT_BYTES
    r, latencies, took = asyncio.run(state_latency_while(build_app(pool), path, body))
    assert r.status_code == 200, r.text[:300]
    assert len(pool.primary.engine.requests) == 1
    assert r.json()["usage"]["prompt_tokens"] == KEEP_TOKENS, "the whole prompt was tokenized, its last tokens kept"
    print(f"{api}: 4 MiB prompt served in {took:.2f} s; {len(latencies)} state checks meanwhile, longest wait "
          f"{max(latencies) * 1000:.0f} ms, median {sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms")
    assert len(latencies) >= 5, f"tokenizing took {took:.2f} s: too short to measure anything"
    assert max(latencies) < BOUND_S < HEALTH_CHECK_TIMEOUT_S, f"the state endpoint stalled {max(latencies):.2f} s"


def test_the_probe_sees_a_stall_when_the_tokenizer_runs_on_the_event_loop(make_vllm_pool, monkeypatch):
    """The control: vLLM's renderer tokenizes in its executor; called inline instead, the same
    probe must see the state endpoint wait for it."""
    pool = make_vllm_pool(CONFIG)
    renderer = pool.primary.engine.renderer

    async def inline(*args, **kwargs):
        return renderer._tokenize_prompt(*args, **kwargs)

    monkeypatch.setattr(renderer, "_tokenize_prompt_async", inline)
    path, body = big_body("completions")
    r, latencies, took = asyncio.run(state_latency_while(build_app(pool), path, body))
    # Whatever the answer (after a stall this long, admission may refuse it: 429), the loop stalled.
    assert r.status_code in (200, 429), r.text[:300]
    print(f"control (inline tokenizer): {took:.2f} s, longest wait {max(latencies) * 1000:.0f} ms")
    assert max(latencies) > BOUND_S, "the probe must catch a stall of the event loop"
