"""e2e, differential: the same requests to vLLM's own OpenAI server and to the mesh (Envoy + the
compiled filter + the sidecar on vLLM), on the same local model at temperature 0. Same HTTP
status, same text / tool calls / logprobs, same token counts, same error class; what the mesh
adds (x-infermesh-* headers, usage.infermesh) is the only difference allowed. Plus the real
`openai` SDK through Envoy: tool calls, a JSON-schema response, logprobs.

Every request names `tiny-llama-small`: chat is routed to the interactive pool, completions to
the batch pool, and both serve that model (policy-e2e.yaml gives it the hermes tool parser, auto
tool choice and compact JSON on xgrammar, as the reference server's flags do).
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import openai
import pytest

from infermesh.launcher import _http_ok, free_ports, wait_until

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama-small"
HI = [{"role": "user", "content": "Hello! How can I help you today?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def chat(**kw) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "messages": HI, "temperature": 0, "max_tokens": 12} | kw


def cmpl(**kw) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, "prompt": "The quick brown fox", "temperature": 0, "max_tokens": 12} | kw


CASES: dict[str, tuple[str, dict]] = {
    "chat": chat(),
    "chat-stream": chat(stream=True, stream_options={"include_usage": True}),
    "chat-tools-auto": chat(tools=[WEATHER], tool_choice="auto"),
    "chat-tools-named": chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=24),
    "chat-tools-required-stream": chat(tools=[WEATHER], tool_choice="required", max_tokens=24, stream=True),
    "chat-json-object": chat(response_format={"type": "json_object"}, max_tokens=16),
    "chat-json-schema": chat(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}, max_tokens=24),
    # Long enough for the newlines this model prefers between JSON tokens, which compact JSON
    # (the model's disable_any_whitespace) rules out: test_compact_json_is_the_models_setting.
    "chat-json-schema-compact": chat(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
                                     max_tokens=64),
    "chat-logprobs": chat(logprobs=True, top_logprobs=3),
    "chat-penalties": chat(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3),
    "chat-logit-bias": chat(logit_bias={"5": 100}),
    "chat-min-tokens": chat(min_tokens=8, max_tokens=10),
    "chat-top-k-min-p": chat(temperature=0.8, top_k=1, min_p=0.5),
    "chat-stop-token-ids": chat(stop_token_ids=[5, 6, 7]),
    "chat-template-kwargs": chat(chat_template_kwargs={"enable_thinking": False}),
    "chat-content-parts": chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]),
    "chat-n2": chat(n=2),
    "cmpl": cmpl(),
    "cmpl-stream": cmpl(stream=True, stream_options={"include_usage": True}),
    "cmpl-logprobs-echo": cmpl(logprobs=2, echo=True, max_tokens=4),
    "cmpl-token-ids": cmpl(prompt=[5, 6, 7, 8, 9]),
    "cmpl-several-prompts": cmpl(prompt=["Once", "The GPU pool", [10, 11, 12]]),
    "cmpl-several-prompts-stream": cmpl(prompt=["Once", "Envoy runs"], stream=True),
    "cmpl-stop": cmpl(stop=["o"], max_tokens=20),
    "bad-temperature-type": chat(temperature="hot"),
    "bad-stream-options": chat(stream=True, stream_options=5),
    "bad-text-part": chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    "bad-top-logprobs-without-logprobs": chat(top_logprobs=3),
    "bad-top-logprobs-too-many": chat(logprobs=True, top_logprobs=50),
    "bad-context-too-long": chat(max_tokens=100000),
    "bad-response-format": chat(response_format={"type": "yaml"}),
    "bad-tool-choice-unknown-function": chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
    "bad-prompt-type": cmpl(prompt={"a": 1}),
    "bad-messages-missing": ("/v1/chat/completions", {"model": MODEL}),
    "bad-unknown-model": chat(model="gpt-9"),
    "responses": ("/v1/responses", {"model": MODEL, "input": "Hello!", "temperature": 0, "max_output_tokens": 12}),
    "messages": ("/v1/messages", {"model": MODEL, "messages": HI, "temperature": 0, "max_tokens": 12}),
    "messages-tools": ("/v1/messages", {"model": MODEL, "messages": HI, "temperature": 0, "max_tokens": 24,
                                        "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                                        "tool_choice": {"type": "tool", "name": "get_weather"}}),
    "bad-messages-no-max-tokens": ("/v1/messages", {"model": MODEL, "messages": HI}),
}

VOLATILE = {"id", "created", "created_at", "completed_at", "call_id", "signature", "infermesh", "system_fingerprint"}


def _without_volatile(v):
    if isinstance(v, dict):
        return {k: _without_volatile(x) for k, x in v.items() if k not in VOLATILE and not k.endswith("_id")}
    if isinstance(v, list):
        return [_without_volatile(x) for x in v]
    return round(v, 4) if isinstance(v, float) else v


@pytest.fixture(scope="module")
def vllm_serve(local_mesh):
    """vLLM's own OpenAI server on the same checkpoint, with the same vLLM flags as the policy's."""
    (port,) = free_ports(1)
    path = str(local_mesh.models_dir / MODEL)
    local_mesh._spawn("vllm-serve-reference", [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024", "--kv-cache-memory-bytes", str(12 << 20),
        "--enforce-eager", "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--disable-uvicorn-access-log",
        "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})])
    url = f"http://127.0.0.1:{port}"

    def ready():
        c = local_mesh.child("vllm-serve-reference")
        if c.proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited:\n{c.tail()}")
        return _http_ok(url + "/health")

    wait_until(ready, 300, every=0.5, what="vllm serve")
    yield url
    local_mesh.kill("vllm-serve-reference")
    # Leave the mesh as found: the first structured-output requests compile grammars (slow
    # TTFTs), which can open the interactive pool's latency breaker; later tests expect it closed.
    local_mesh.wait_at_rest(120, why="after the differential tests")


def post(base: str, path: str, body: dict, shed_wait_s: float = 0) -> tuple[int, dict | list]:
    """One request; with `shed_wait_s`, a shed answer (429/503 with Retry-After: infermesh's
    protection, e.g. the batch pool's CPU breaker on this busy 2-core machine) is retried after
    its Retry-After for up to that long, so the served answers are what get compared."""
    deadline = time.monotonic() + shed_wait_s
    with httpx.Client(timeout=120) as c:
        r = c.post(base + path, json=body)
        while r.status_code in (429, 503) and "retry-after" in r.headers and time.monotonic() < deadline:
            time.sleep(float(r.headers["retry-after"]))
            r = c.post(base + path, json=body)
        if body.get("stream") and r.headers.get("content-type", "").startswith("text/event-stream"):
            return r.status_code, [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return r.status_code, r.json()


def _calls(calls) -> list:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []]


def _logprobs(lp) -> object:
    """Tokens and values (to 4 places) of a logprobs object, whatever its shape."""
    if isinstance(lp, dict):
        return {k: _logprobs(v) for k, v in lp.items() if k not in ("bytes",)}
    if isinstance(lp, list):
        return [_logprobs(v) for v in lp]
    return round(lp, 4) if isinstance(lp, float) else lp


def essence(status: int, body) -> dict:
    """What must agree: the status, the error class, each choice's text / tool calls / logprobs /
    finish reason, the token counts. Ids, timestamps and the mesh's additions are left out."""
    if status != 200:
        error = body.get("error") if isinstance(body, dict) else None
        return {"status": status, "error": error.get("type") if isinstance(error, dict) else body}
    if isinstance(body, dict) and body.get("object") not in ("chat.completion", "text_completion"):
        return {"status": 200, "body": _without_volatile(body)}  # /v1/responses, /v1/messages: the whole answer
    if isinstance(body, list):  # a stream: fold the chunks per choice
        choices: dict[int, dict] = {}
        usage = None
        for chunk in body:
            if chunk.get("usage"):
                usage = {k: chunk["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
            for ch in chunk.get("choices", []):
                c = choices.setdefault(ch["index"], {"text": "", "calls": {}, "finish": None})
                delta = ch.get("delta", {})
                c["text"] += ch.get("text") or delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    got = c["calls"].setdefault(tc["index"], ["", ""])
                    got[0] += (tc.get("function") or {}).get("name") or ""
                    got[1] += (tc.get("function") or {}).get("arguments") or ""
                c["finish"] = ch.get("finish_reason") or c["finish"]
        return {"status": 200, "usage": usage, "choices": {i: c | {"calls": sorted(map(tuple, c["calls"].values()))}
                                                          for i, c in sorted(choices.items())}}
    out = {"status": 200, "model": body["model"], "object": body["object"],
           "usage": {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    out["choices"] = [{"index": c["index"], "finish": c["finish_reason"], "logprobs": _logprobs(c.get("logprobs")),
                       **({"text": c["text"]} if "text" in c else
                          {"text": c["message"]["content"], "calls": _calls(c["message"].get("tool_calls"))})}
                      for c in body["choices"]]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_mesh_answers_as_vllm_serve_does(local_mesh, vllm_serve, case):
    path, body = CASES[case]
    want = essence(*post(vllm_serve, path, body))
    got_status, got_body = post(local_mesh.base_url, path, body, shed_wait_s=120)
    got = essence(got_status, got_body)
    assert got == want, f"{case}: the mesh differs from vllm serve"
    if got_status == 200 and isinstance(got_body, dict):
        assert got_body["usage"]["infermesh"]["model"] == MODEL


def test_compact_json_is_the_models_setting(local_mesh, vllm_serve):
    """disable_any_whitespace, a per-model setting: no whitespace between JSON tokens from either
    server (a raw newline cannot be inside a JSON string, so none may appear at all)."""
    path, body = CASES["chat-json-schema-compact"]
    for base in (vllm_serve, local_mesh.base_url):
        status, answer = post(base, path, body, shed_wait_s=120)
        assert status == 200, answer
        content = answer["choices"][0]["message"]["content"]
        assert content.startswith("{") and "\n" not in content and not content.startswith("{ "), (base, content)


def test_openai_sdk_tool_calls_json_schema_and_logprobs_through_envoy(local_mesh, vllm_serve):
    # The SDK's own retries honour Retry-After: a request the batch pool's CPU breaker sheds on this
    # busy machine (infermesh's protection, 429 + Retry-After) is sent again, as a real client does.
    client = openai.OpenAI(base_url=local_mesh.base_url + "/v1", api_key="unused", timeout=120, max_retries=20)
    reference = openai.OpenAI(base_url=vllm_serve + "/v1", api_key="unused", timeout=120, max_retries=0)
    city = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"], "additionalProperties": False}}}
    ask = dict(model=MODEL, messages=HI, temperature=0, max_tokens=64, tools=[city],
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = client.chat.completions.create(**ask).choices[0].message.tool_calls
    (want,) = reference.chat.completions.create(**ask).choices[0].message.tool_calls
    # The arguments are vLLM's (on this random-weight model vLLM 0.32 gave `1`, not an object,
    # for a non-strict named tool): the SDK reads the same tool call from both servers.
    assert call.function.name == "get_weather" and call.function.arguments == want.function.arguments
    json.loads(call.function.arguments)
    r = client.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=48,
                                       response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        data = json.loads(content)
        assert set(data) == {"name", "n"} and isinstance(data["n"], int)
    else:  # cut at max_tokens: still a prefix of schema-valid JSON
        assert content.startswith("{")
    r = client.completions.create(model=MODEL, prompt="Once", temperature=0, max_tokens=4, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) == 3 for t in lp.top_logprobs)
    r = client.chat.completions.create(model=MODEL, messages=HI, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2)
    assert len(r.choices[0].logprobs.content) == 4 and all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
