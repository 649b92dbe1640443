"""One request's life in the sidecar, from admission to release: the one place both fronts call.

    async with pool.lifecycle(req, Front.GRPC, "generate") as life:   # admits, or raises
        async for ev in life.events():                               # TokenDelta…, then Completion
            ...                                                      # the front formats them

Leaving the block, however it is left (the stream ended, an error, a vanished client, a passed
deadline, a cancelled RPC), releases the request: its slot is freed and, if vLLM may still be
generating, the request is aborted there so its KV cache is freed at once. TTFT, inter-token time,
token counts and the request's outcome are recorded here, once, for both fronts.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

from .admission import Admission
from .errors import DeadlineExceeded, EngineFailed, SidecarError
from .requests import Completion, GenerationRequest, TokenDelta

if TYPE_CHECKING:
    from .pool import Pool


class Front(enum.Enum):
    """Which front a request came through; it names the outcome in its own terms."""

    HTTP = "http"
    GRPC = "grpc"

    @property
    def ok(self) -> str:
        return "200" if self is Front.HTTP else "OK"

    @property
    def gone(self) -> str:
        """The client went away (HTTP: nginx's 499)."""
        return "499" if self is Front.HTTP else "CANCELLED"

    def status(self, error: SidecarError) -> str:
        return str(error.http_status) if self is Front.HTTP else error.grpc_code.name


def refuse(pool: "Pool", front: Front, api: str, request_class: str, error: SidecarError) -> None:
    """Count a request that was refused before it got a lifecycle (bad input) or at admission."""
    pool.metrics.count_rejection(front.value, api, request_class, front.status(error), error)


class RequestLifecycle:
    def __init__(self, pool: "Pool", req: GenerationRequest, front: Front, api: str):
        self.pool, self.req, self.front, self.api = pool, req, front, api
        self.label_class = req.request_class
        """The class as the client sent it: the metrics' label (admission may map it to the default)."""
        self.admission: Admission | None = None
        self.completion: Completion | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._admitted_at = 0.0
        self._submitted = False  # vLLM may hold the request
        self._vllm_done = False  # vLLM has finished or dropped it: nothing to abort
        self._events: AsyncIterator[TokenDelta | Completion] | None = None
        self._closed = False

    # -- entry -------------------------------------------------------------------------------

    def admit(self) -> Admission:
        """Admit the request (once) or raise the error its client gets, counted as a refusal.

        `async with` calls it; the HTTP stream calls it first itself, so that a refusal still
        gets a proper status before the response starts."""
        if self.admission is None:
            try:
                self.admission = self.pool.admission.admit(self.req)
            except SidecarError as e:
                self._closed = True
                refuse(self.pool, self.front, self.api, self.label_class, e)
                raise
            self._admitted_at = self.pool.clock()
            self.pool.load.on_admitted()
        return self.admission

    async def __aenter__(self) -> "RequestLifecycle":
        self.admit()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        await self.close(exc)
        return False

    @property
    def request_id(self) -> str:
        return self.admit().request_id

    # -- the stream --------------------------------------------------------------------------

    def events(self) -> AsyncIterator[TokenDelta | Completion]:
        """The generation: TokenDeltas, then one Completion. Errors are SidecarErrors (a bad prompt,
        context too long, an engine failure)."""
        self._events = self._generate()
        return self._events

    def _pause_s(self) -> float:
        # Under load, let vLLM merge the next steps' tokens into one output (its collector
        # aggregates deltas while nobody reads): fewer, larger messages, so per-message overhead
        # does not cap throughput. The first token never waits.
        s = self.pool.config.server
        if s.stream_coalesce_ms > 0 and len(self.pool.admission.inflight) >= s.stream_coalesce_min_inflight:
            return s.stream_coalesce_ms / 1000.0
        return 0.0

    async def _generate(self) -> AsyncIterator[TokenDelta | Completion]:
        adm = self.admit()
        pool, engine = self.pool, adm.engine
        ids = engine.prompt_ids(self.req)
        params = engine.sampling_params(self.req, len(ids), pool.config.server.default_max_tokens)
        self.prompt_tokens = len(ids)
        priority = pool.config.classes[adm.request_class].vllm_priority or 0
        ttft = pool.metrics.ttft.labels(self.front.value, self.label_class)
        itl = pool.metrics.itl.labels(self.front.value, self.label_class)
        last: float | None = None
        self._submitted = True
        gen = engine.generate(self.req, ids, params, priority, self._pause_s)
        try:
            async for ev in self._first_in_time(gen):
                if isinstance(ev, TokenDelta):
                    now = pool.clock()
                    if last is None:
                        ttft.observe(now - self._admitted_at)
                        pool.window.record_ttft(now - self._admitted_at)
                    else:
                        itl.observe((now - last) / max(1, len(ev.token_ids)))
                    last = now
                    self.completion_tokens += len(ev.token_ids)
                    yield ev
                else:
                    self._vllm_done = True
                    pool.window.record_outcome(failed=False)
                    self.completion = replace(ev, degraded=adm.degraded, degraded_reason=adm.degraded_reason)
                    yield self.completion
        except EngineFailed:
            self._vllm_done = True  # vLLM has already dropped the request
            pool.window.record_outcome(failed=True)
            raise
        finally:
            await gen.aclose()
        if self.completion is None:  # a bug, not the client's fault
            raise SidecarError("generation ended without a result")

    async def _first_in_time(self, gen: AsyncIterator) -> AsyncIterator:
        """`gen`, its first event within the request's TTFT limit (if any) or DeadlineExceeded."""
        limit = self.req.ttft_give_up_s
        if limit is None:
            async for ev in gen:
                yield ev
            return
        remaining = self._admitted_at + limit - self.pool.clock()
        try:
            first = await asyncio.wait_for(anext(gen), max(0.0, remaining))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"no first token within {limit * 1000:.0f} ms", code="ttft_deadline_exceeded",
                                   retry_after_s=1) from None
        yield first
        async for ev in gen:
            yield ev

    # -- exit --------------------------------------------------------------------------------

    async def close(self, error: BaseException | None = None) -> None:
        """Record the outcome and release the request (abort it in vLLM if it may still run).
        Idempotent: the HTTP stream also calls it when its response ends before the body began."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._events is not None:
                await self._events.aclose()
        finally:
            if self.admission is not None:
                self._record(error)
                self.pool.admission.forget(self.admission.request_id)
                if self._submitted and not self._vllm_done:
                    # Shielded: a stream cancelled by its server (Starlette cancels a vanished
                    # client's stream again at every await) must still reach vLLM's abort.
                    await asyncio.shield(asyncio.ensure_future(self.admission.engine.abort(self.admission.request_id)))

    def _record(self, error: BaseException | None) -> None:
        m = self.pool.metrics
        if isinstance(error, SidecarError):
            status = self.front.status(error)
            if error.http_status >= 500:
                self.pool.load.on_failed()
        elif error is None and self.completion is not None:
            status = self.front.ok
        else:  # cancelled, or the consumer stopped reading: the client went away
            status = self.front.gone
        m.requests.labels(self.front.value, self.api, self.label_class, status).inc()
        if self.prompt_tokens:
            model = self.admission.engine.config.name
            m.prompt_tokens.labels(model).inc(self.prompt_tokens)
            m.completion_tokens.labels(model).inc(self.completion_tokens)
