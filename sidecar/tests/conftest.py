"""Fakes for the sidecar's unit tests: a pool whose engines are scripted stand-ins for vLLM.

Everything above vLLM is real (admission, the lifecycle, the breakers, the metrics registry, the
fronts); the e2e tests run the same code on real vLLM.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.engines import ModelEngine
from infermesh.sidecar.monitors import Readings
from infermesh.sidecar.pool import Pool


class FakeClock:
    """Time that moves only when a test says so."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeTokenizer:
    """One token per character: prompt lengths are easy to reason about."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def __init__(self):
        self.template_calls: list[dict] = []
        """What each apply_chat_template call was given besides the messages."""

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool, chat_template=None, **kwargs) -> str:
        self.template_calls.append({"chat_template": chat_template, **kwargs})
        return "".join(m["content"] for m in messages)


class FakeAsyncLLM:
    """Stands in for vLLM's AsyncLLM: each request streams the words of `reply` (one token each)
    for every choice, then finishes with `finish`.

    `gate`, when set, holds every request after its first step until the test opens it;
    `fail_after`, when set, raises inside generation after that many steps, as a dying engine would;
    `abort_delay` makes abort() take that long (vLLM's abort talks to its engine-core process)."""

    def __init__(self, reply=("Hello", " world", "!"), finish: str = "stop"):
        self.reply, self.finish = list(reply), finish
        self.gate: asyncio.Event | None = None
        self.fail_after: int | None = None
        self.abort_delay = 0.0
        self.unfinished: set[str] = set()
        self.aborted: list[str] = []
        self.priorities: list[int] = []
        self.trace_headers: list[dict | None] = []
        """The `trace_headers` of each generate call (sidecar/tracing.py)."""

    async def generate(self, prompt, params: dict, request_id: str, priority: int = 0, trace_headers: dict | None = None):
        self.priorities.append(priority)
        self.trace_headers.append(trace_headers)
        self.unfinished.add(request_id)
        for step, word in enumerate(self.reply):
            if self.fail_after is not None and step >= self.fail_after:
                self.unfinished.discard(request_id)
                raise RuntimeError("the fake engine died")
            last = step == len(self.reply) - 1
            outs = [SimpleNamespace(index=i, text=word, token_ids=[step], finish_reason=self.finish if last else None)
                    for i in range(params["n"])]
            if last:
                self.unfinished.discard(request_id)
            yield SimpleNamespace(outputs=outs, finished=last)
            if step == 0 and self.gate is not None:
                await self.gate.wait()

    async def abort(self, request_id: str) -> None:
        if self.abort_delay:
            await asyncio.sleep(self.abort_delay)
        self.aborted.append(request_id)
        self.unfinished.discard(request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.unfinished)

    def shutdown(self) -> None:
        pass


class FakeModelEngine(ModelEngine):
    """A ModelEngine on a FakeAsyncLLM: no vLLM import, no processes."""

    def start(self) -> None:
        self.engine = FakeAsyncLLM()
        self.tokenizer = FakeTokenizer()

    def sampling_params(self, req, prompt_len: int, default_max_tokens: int) -> dict:
        return self.sampling_kwargs(req, prompt_len, default_max_tokens)

    def _vllm_prompt(self, prompt_ids):
        return prompt_ids


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_pool():
    """make_pool(config, clock=None, loaded=True) -> a Pool on FakeModelEngines, every model loaded
    (the fallback as a hot standby) and no monitor sources (readings come from faults only)."""

    def make(config: SidecarConfig | dict, clock=None, loaded: bool = True) -> Pool:
        if isinstance(config, dict):
            config = SidecarConfig.model_validate(config)
        pool = Pool(config, clock, make_engine=FakeModelEngine) if clock else Pool(config, make_engine=FakeModelEngine)
        if loaded:
            for m in pool.ladder:
                m.start()
        pool.readings = Readings({}, pool.faults)
        return pool

    return make


# -- vLLM's serving layer on a fake engine (the HTTP front's unit tests) ---------------------------

TINY_MODEL = "tiny-llama-small"


class FakeVllmAsyncLLM(FakeAsyncLLM):
    """A FakeAsyncLLM that vLLM's own serving layer can drive: the real VllmConfig, ModelConfig and
    renderer of a local checkpoint (no engine process), and vLLM's RequestOutputs from
    `generate`, honouring the SamplingParams' n, max_tokens and output kind. Each step is one
    token of `reply` (in the model's own tokenizer); `fail_at`, when set, raises at that step."""

    def __init__(self, vllm_config, renderer):
        super().__init__()
        self.vllm_config, self.model_config, self.renderer = vllm_config, vllm_config.model_config, renderer
        self.input_processor = None
        self.errored = False
        self.requests: list[tuple[str, object, int]] = []
        """(request id, SamplingParams, priority) of each generate call."""
        self.reply_ids = renderer.tokenizer.encode("Hello world!", add_special_tokens=False)

    async def generate(self, prompt, params, request_id: str, priority: int = 0, **kwargs):
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        limit = self.model_config.max_logprobs  # vLLM's engine checks it as it takes the request
        for asked in (params.logprobs, params.prompt_logprobs):
            if asked is not None and asked > limit:
                raise ValueError(f"Requested {asked} logprobs, which is more than the maximum {limit}")
        self.priorities.append(priority)
        self.trace_headers.append(kwargs.get("trace_headers"))
        self.requests.append((request_id, params, priority))
        self.unfinished.add(request_id)
        tok = self.renderer.tokenizer
        prompt_ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else []
        steps = self.reply_ids[: params.max_tokens or len(self.reply_ids)]
        made: dict[int, list[int]] = {i: [] for i in range(params.n)}
        try:
            for step, tid in enumerate(steps):
                if self.fail_after is not None and step >= self.fail_after:
                    raise RuntimeError("the fake engine died")
                last = step == len(steps) - 1
                reason = ("length" if len(steps) < len(self.reply_ids) else "stop") if last else None
                outs = []
                for i in range(params.n):
                    made[i].append(tid)
                    ids = [tid] if params.output_kind == RequestOutputKind.DELTA else list(made[i])
                    outs.append(CompletionOutput(index=i, text=tok.decode(ids), token_ids=ids, cumulative_logprob=None,
                                                 logprobs=self._logprobs(ids, params.logprobs), finish_reason=reason))
                if last:
                    self.unfinished.discard(request_id)
                if params.output_kind != RequestOutputKind.FINAL_ONLY or last:
                    prompt_logprobs = None
                    if params.prompt_logprobs is not None:
                        prompt_logprobs = [None, *self._logprobs(prompt_ids[1:], params.prompt_logprobs)]
                    yield RequestOutput(request_id, None, prompt_ids, prompt_logprobs, outs, last)
                if step == 0 and self.gate is not None:
                    await self.gate.wait()
        finally:
            self.unfinished.discard(request_id)


    def _logprobs(self, ids: list[int], top: int | None):
        """Made-up log probabilities in vLLM's form when the request asked for them (vLLM's layer
        asserts they are there): each token first, then `top` others."""
        from vllm.logprobs import Logprob

        if top is None:
            return None
        top = max(0, top if top >= 0 else 2)
        decode = self.renderer.tokenizer.decode
        out = []
        for tid in ids:
            position = {tid: Logprob(-0.5, 1, decode([tid]))}
            position.update({o: Logprob(-2.0 - o, o + 2, decode([o])) for o in range(top) if o != tid})
            out.append(position)
        return out


_VLLM_CONFIG = {}


def vllm_config_of(name: str = TINY_MODEL):
    """The real VllmConfig and renderer of a local checkpoint (built by the e2e conftest / infermesh.models)."""
    if name not in _VLLM_CONFIG:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.renderers import renderer_from_config

        from infermesh import models

        # Built here when missing (a second or so, no download): a contract test never skips.
        path = str(models.build_model(models.LOCAL_MODELS[name]))
        cfg = AsyncEngineArgs(model=path, served_model_name=[name], max_model_len=1024, enforce_eager=True,
                              kv_cache_memory_bytes=12 << 20).create_engine_config()
        _VLLM_CONFIG[name] = (cfg, renderer_from_config(cfg), path)
    return _VLLM_CONFIG[name]


class FakeVllmModelEngine(ModelEngine):
    """A ModelEngine on a FakeVllmAsyncLLM (its model's real config and tokenizer)."""

    def start(self) -> None:
        cfg, renderer, _ = vllm_config_of()
        self.engine = FakeVllmAsyncLLM(cfg, renderer)
        self.tokenizer = renderer.tokenizer


@pytest.fixture
def make_vllm_pool():
    """make_vllm_pool(config) -> a Pool whose engines are FakeVllmAsyncLLMs (every model loaded)."""

    def make(config: SidecarConfig | dict) -> Pool:
        if isinstance(config, dict):
            config = SidecarConfig.model_validate(config)
        pool = Pool(config, make_engine=FakeVllmModelEngine)
        for m in pool.ladder:
            m.start()
        pool.readings = Readings({}, pool.faults)
        return pool

    return make
