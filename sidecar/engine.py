"""The engine manager: the one owner of the pool's vLLM engine, shared by the HTTP and gRPC fronts.

It turns a front-neutral `GenerationRequest` into vLLM calls and a stream of `TokenDelta`s ending
with one `Completion`. It also enforces what both fronts share: known models, unique in-flight
request ids, the concurrency limit, and aborting the vLLM request whenever the consumer stops
early (a client that vanished, a cancelled RPC), so its KV cache is freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .config import ModelConfig, SidecarConfig
from .errors import BadRequest, DuplicateRequest, EngineFailed, Overloaded, Unavailable, UnknownModel

log = logging.getLogger("infermesh.sidecar.engine")


@dataclass
class GenerationRequest:
    """What both fronts ask of the engine."""

    model: str | None
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    request_class: str = ""


@dataclass
class TokenDelta:
    text: str
    token_ids: list[int]


@dataclass
class Completion:
    """The last event of every stream."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    degraded: bool = False
    degraded_reason: str = ""


class EngineManager:
    def __init__(self, config: SidecarConfig):
        self.config = config
        self.primary: ModelConfig = config.models[0]
        self._engine = None
        self._tokenizer = None
        self._inflight: set[str] = set()
        self._draining = False
        self.load_seconds: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Load the primary model (blocking: tens of seconds on CPU)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        m = self.primary
        t0 = time.monotonic()
        args = AsyncEngineArgs(
            model=m.path,
            served_model_name=[m.name],
            tokenizer=m.path,
            max_model_len=m.max_model_len,
            kv_cache_memory_bytes=m.kv_cache_bytes,
            max_num_seqs=m.max_num_seqs,
            dtype=m.dtype,
            enforce_eager=True,
            disable_log_stats=False,
        )
        self._engine = AsyncLLM.from_engine_args(args)
        self._tokenizer = self._engine.get_tokenizer()
        self.load_seconds = time.monotonic() - t0
        log.info("engine ready", extra={"model": m.name, "load_seconds": round(self.load_seconds, 2)})

    @property
    def ready(self) -> bool:
        return self._engine is not None and not self._draining

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def begin_drain(self) -> None:
        self._draining = True

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # -- models ------------------------------------------------------------------------------

    def model_ids(self) -> list[str]:
        return [m.name for m in self.config.models]

    def resolve_model(self, name: str | None) -> ModelConfig:
        if not name:
            return self.primary
        for m in self.config.models:
            if name == m.name or name in m.aliases:
                # Until the ladder is live (breakers), every accepted name is served by the primary.
                return self.primary
        raise UnknownModel(name, [n for m in self.config.models for n in (m.name, *m.aliases)])

    # -- generation --------------------------------------------------------------------------

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        tok = self._tokenizer
        if req.messages is not None:
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # a template error is the request's fault (bad roles, …)
                raise BadRequest(f"cannot render messages with the chat template: {e}", param="messages") from e
            return list(tok.encode(text, add_special_tokens=False))
        if req.prompt is None:
            raise BadRequest("a prompt is required", param="prompt")
        return list(tok.encode(req.prompt, add_special_tokens=True))

    def _sampling_params(self, req: GenerationRequest, prompt_len: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        max_model_len = self.primary.max_model_len
        max_tokens = req.max_tokens or min(self.config.server.default_max_tokens, max_model_len - prompt_len)
        if prompt_len + max_tokens > max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        kwargs: dict = {"max_tokens": max_tokens, "output_kind": RequestOutputKind.DELTA}
        if req.temperature is not None:
            kwargs["temperature"] = req.temperature
        if req.top_p is not None:
            kwargs["top_p"] = req.top_p
        if req.seed is not None:
            kwargs["seed"] = req.seed
        if req.stop:
            kwargs["stop"] = list(req.stop)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e)) from e

    def admit(self, req: GenerationRequest) -> tuple[str, ModelConfig]:
        """Check a request before any response is started, so errors get a proper status."""
        if self._engine is None:
            raise Unavailable("the engine is still loading", retry_after_s=5)
        if self._draining:
            raise Unavailable("the sidecar is shutting down", retry_after_s=1)
        model = self.resolve_model(req.model)
        if len(self._inflight) >= self.config.server.max_concurrent_requests:
            raise Overloaded(
                f"more than {self.config.server.max_concurrent_requests} requests in flight", retry_after_s=1
            )
        rid = req.request_id or uuid.uuid4().hex
        if rid in self._inflight:
            raise DuplicateRequest(f"request id {rid!r} is already in flight", param="request_id")
        self._inflight.add(rid)
        req.request_id = rid
        return rid, model

    async def stream(self, req: GenerationRequest, model: ModelConfig) -> AsyncIterator[TokenDelta | Completion]:
        """Generate for an admitted request. Stopping the iteration early aborts it in vLLM."""
        from vllm.inputs import TokensPrompt

        rid = req.request_id
        finished = False
        engine = self._engine
        try:
            ids = self._prompt_ids(req)
            params = self._sampling_params(req, len(ids))
            completion_tokens = 0
            try:
                async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, rid):
                    o = out.outputs[0]
                    completion_tokens += len(o.token_ids)
                    if o.text or o.token_ids:
                        yield TokenDelta(o.text, list(o.token_ids))
                    if out.finished:
                        finished = True
                        yield Completion(o.finish_reason or "stop", len(ids), completion_tokens, model.name)
                        return
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:
                finished = True  # vLLM has already dropped the request
                log.exception("generation failed", extra={"request_id": rid})
                raise EngineFailed(f"generation failed: {type(e).__name__}") from e
        finally:
            if finished:
                self._inflight.discard(rid)
            else:
                await self.release(rid)

    async def release(self, rid: str) -> None:
        """Forget an admitted request and abort it in vLLM if it may still run. Idempotent.

        A front calls it when a response ends in any way: a stream that was never iterated (the
        client left before the first byte) never reaches the generator's `finally`.
        """
        if rid not in self._inflight:
            return
        self._inflight.discard(rid)
        if self._engine is not None:
            try:
                await self._engine.abort(rid)
                log.info("aborted request", extra={"request_id": rid})
            except Exception:  # the engine may be shutting down; nothing is left to free
                log.debug("abort failed", exc_info=True)
