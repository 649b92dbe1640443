"""One request's life in the sidecar, from admission to release: the one object both fronts use,
and the one exit of every request.

    async with RequestLifecycle(pool, req, Front.GRPC, "generate") as life:   # admits, or raises
        async for ev in life.events():                                       # TokenDelta…, then Completion
            ...                                                              # the front formats them

The HTTP front hands generation to vLLM's own serving layer instead: it admits the request
(`admit`), and its answer is built and sent inside `serve`, the lifecycle's exit for a front that
builds its own answer. vLLM's layer, having rendered the prompt and built the SamplingParams, calls
the pool's engine client (vllm_engine_client.py), which runs them through `life.vllm_outputs(...)`:
vLLM's RequestOutputs, with the class's priority, coalescing and the same measurements.

Leaving the block or `serve`, however it is left (the stream ended, an error, a refusal, a vanished
client, a passed deadline, a cancelled RPC), closes the request, in `close` and nowhere else: its
outcome is recorded, its slot is freed and, if vLLM may still be generating, the request is aborted
there so its KV cache is freed at once. TTFT, inter-token time, token counts and the request's
outcome are recorded here, once, for both fronts. A request refused at admission is counted as
refused there and holds nothing.

Between admission and vLLM the request waits for one of its model's engine slots
(admission.EngineSlots); one that can no longer get its first token within its class's target is
refused there (429 `ttft_target_unreachable`, Retry-After), and vLLM never sees it.

The TTFT give-up, in all its forms, is here too (`gave_up` is the error of each):
- the mesh's give-up limit (`x-infermesh-ttft-give-up-ms`): no first token by then, streamed or
  not, and the request ends (504 `ttft_deadline_exceeded`, aborted in vLLM): `first_in_time` for
  a stream (both fronts), `result_in_time` for an HTTP request answered whole;
- on the HTTP front, the class's target is the TTFT limit of a request that has to wait in line at
  admission, when the mesh sent none (one that gets a slot at once has none, and is served however
  late vLLM is, as before). A stream refused while it waited is answered at once (`refused`), with
  Retry-After (vLLM's serving layer, between the front and the engine client, would turn an error
  raised in the wait into a stream's error chunk without one), so such a stream is held there
  while `first_in_time` answers; a non-streamed request's refusal passes through vLLM's layer and
  is answered at once; a stream that reached vLLM without a first token by then gets 503
  `ttft_target_missed` and is aborted there; a non-streamed one, once in vLLM, runs to its end
  (watching its first token would take vLLM's cumulative outputs, a cost on every step);
- an HTTP stream that got a slot at once and has no first token at ADMIT_SHARE of its class's
  target is cut (503 `ttft_target_missed`) while its pool is pressed (`cut_if_pressed`, docs/breakers.md).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import enum
import math

import grpc
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from . import tracing
from .admission import ADMIT_SHARE, Admission, TargetUnreachable
from .errors import DeadlineExceeded, EngineFailed, SidecarError
from .requests import Completion, GenerationRequest, TokenDelta

if TYPE_CHECKING:
    from .pool import Pool


_TOKENIZE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infermesh-tokenize")
"""The gRPC front's tokenization (RequestLifecycle._generate)."""

CUT_CHECK_S = 0.1
"""How often a stream past its target without a first token asks again whether it is to be cut."""

T = TypeVar("T")
R = TypeVar("R")


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


class QueueRefusal(DeadlineExceeded):
    """A request refused while it waited for an engine slot: it never reached vLLM (429). A
    DeadlineExceeded, so that the HTTP front's TTFT-limit paths answer it with Retry-After."""

    http_status = 429
    grpc_code = TargetUnreachable.grpc_code
    openai_type = TargetUnreachable.openai_type


class TargetMissed(DeadlineExceeded):
    """A request vLLM started in time by the estimate that had no first token by its class's
    target: aborted there, 503 with Retry-After (a mesh's own give-up limit stays a 504)."""

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE


_HTTP_REFUSAL: type | None = None


def http_refusal(e: TargetUnreachable) -> Exception:
    """`e` in a form vLLM's serving layer passes on with its status: a DeadlineExceeded to the
    HTTP front's non-streamed path (which answers it with Retry-After), and vLLM's own
    GracefulHTTPError to its stream generator (which answers it with a 429 OpenAI error)."""
    global _HTTP_REFUSAL
    if _HTTP_REFUSAL is None:
        from vllm.exceptions import GracefulHTTPError

        class WaitRefused(QueueRefusal, GracefulHTTPError):
            def __init__(self, message: str, *, code: str | None = None, retry_after_s: float | None = None):
                Exception.__init__(self, message)  # GracefulHTTPError's own wants a status: the class's
                self.message, self.param, self.code, self.retry_after_s = message, None, code, retry_after_s

        _HTTP_REFUSAL = WaitRefused
    out = _HTTP_REFUSAL(e.message, code=e.code, retry_after_s=e.retry_after_s)
    return out


def refuse(pool: "Pool", front: Front, api: str, request_class: str, error: SidecarError) -> None:
    """Count a request that was refused before it got a lifecycle (bad input) or at admission."""
    pool.metrics.count_rejection(front.value, api, request_class, front.status(error), error)


@dataclass(frozen=True)
class Outcome:
    """How a front answered a request, as `close` records it: the error it answered with, or the
    status (vLLM's layer's); neither: the generation's own end (ok, or gone without one)."""

    error: BaseException | None = None
    status: str | None = None


class _Refused(Exception):
    """A held stream was refused while it waited for an engine slot (RequestLifecycle.refused)."""


async def cancel(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has unwound (its vLLM generation closed)."""
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


async def _first(stream: AsyncIterator[T]) -> T | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


class RequestLifecycle:
    def __init__(self, pool: "Pool", req: GenerationRequest, front: Front, api: str, headers: Mapping[str, str] | None = None):
        """`headers`: the request's HTTP headers or gRPC metadata (its `traceparent`, read only while tracing is on)."""
        self.pool, self.req, self.front, self.api = pool, req, front, api
        tracer = tracing.active()
        self.trace = tracer.begin(headers, front.value, api, pool.clock()) if tracer is not None else None
        """The request's span (sidecar/tracing.py); None while tracing is off."""
        self.label_class = req.request_class
        """The class as the client sent it: the metrics' label (admission may map it to the default)."""
        self.admission: Admission | None = None
        self.completion: Completion | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._admitted_at = 0.0
        self._submitted = False  # vLLM may hold the request
        self._submitted_at = 0.0  # when it got its engine slot
        self.refusal: TargetUnreachable | None = None
        """Refused while it waited for an engine slot (never reached vLLM)."""
        self.refused = asyncio.Event()
        """Set when a held stream is refused while it waited: answered at once (first_in_time)."""
        self._target_limit = False  # the TTFT limit is the class's target (set at admission), not the mesh's
        self._cut = False  # that limit was set by cut_if_pressed
        self._delta = False  # vLLM's layer streams this request (delta outputs)
        self._vllm_done = False  # vLLM has finished or dropped it: nothing to abort
        self._events: AsyncIterator[TokenDelta | Completion] | None = None
        self._closed = False
        self._vllm_ids: set[str] = set()
        """vLLM requests of this request still running (several prompts in one completion)."""
        self._outputs_done = False  # every vLLM request of vllm_outputs() finished
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        # Looked up once per request, not per streamed message (profiled: docs/sidecar-benchmark.md).
        s = pool.config.server
        self._coalesce_s = s.stream_coalesce_ms / 1000.0 if s.stream_coalesce_ms > 0 else 0.0
        self._coalesce_min_inflight = s.stream_coalesce_min_inflight
        self._itl = None  # the inter-token histogram's child of this front and class, from the first token

    # -- entry -------------------------------------------------------------------------------

    def admit(self) -> Admission:
        """Admit the request (once) or raise the error its client gets, counted as a refusal (the
        request holds nothing, and is closed).

        `async with` calls it; the HTTP front calls it before its answer, so that a refusal gets a
        proper status before any response starts."""
        if self.admission is None:
            try:
                self.admission = self.pool.admission.admit(self.req)
            except SidecarError as e:
                self._closed = True
                refuse(self.pool, self.front, self.api, self.label_class, e)
                if self.trace is not None:
                    self.trace.end(self, self.front.status(e), "shed" if (e.code or "").startswith("pool_") else "refused", e)
                raise
            self._admitted_at = self.pool.clock()
            self.pool.load.on_admitted()
            w = self.admission.waiter
            in_line = w is not None and w.started_at is None
            if self.front is Front.HTTP and in_line and self.req.ttft_give_up_s is None and math.isfinite(self.admission.target_s):
                self.req.ttft_give_up_s = self.admission.target_s
                self._target_limit = True
        return self.admission

    async def __aenter__(self) -> "RequestLifecycle":
        self.admit()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        await self.close(exc)
        return False

    # The request's times on the pool's clock (0 / None: not yet), as its trace writes them.
    admitted_at = property(lambda self: self._admitted_at)
    submitted_at = property(lambda self: self._submitted_at)
    first_token_at = property(lambda self: self._first_token_at)
    last_token_at = property(lambda self: self._last_token_at)

    @property
    def first_token_seen(self) -> bool:
        """For the TTFT limit of a request answered whole: one under its class's target counts
        from the moment vLLM has it (only its wait is limited, see the module's docstring)."""
        return self._first_token_at is not None or (self._target_limit and self._submitted and not self._delta)

    def first_token_deadline(self) -> float:
        """When the request's TTFT limit (`req.ttft_give_up_s`, set) ends, on the pool's clock."""
        return self._admitted_at + (self.req.ttft_give_up_s or 0.0)

    def target_deadline(self) -> float | None:
        """When a stream without a first token may be cut (`cut_if_pressed`), on the pool's clock:
        ADMIT_SHARE of its class's target after admission, the share it was admitted for (None: no target)."""
        adm = self.admit()
        return self._admitted_at + adm.admitted_for_s if math.isfinite(adm.target_s) else None

    def cut_if_pressed(self) -> bool:
        """A stream in vLLM without a first token at ADMIT_SHARE of its class's target (admitted on
        an estimate within that share, it has fallen behind it): cut (then `gave_up`: 503
        `ttft_target_missed`, aborted in vLLM) when its pool has refused a request for time since
        this one was admitted, or has one in line: the compute it holds is wanted by requests that
        can still be on time, and its refusal comes before the target, as a waiter's does.
        Otherwise it is served however late vLLM is."""
        adm = self.admission
        if adm is None or self._first_token_at is not None or not self._submitted or self.req.ttft_give_up_s is not None:
            return False
        if not self.pool.admission.pressed_since(self._admitted_at):
            return False
        self.req.ttft_give_up_s = adm.admitted_for_s
        self._target_limit = True
        self._cut = True
        return True

    def gave_up(self) -> DeadlineExceeded:
        """The error of a request without a first token at its TTFT limit (docs/replicas.md). One
        that never reached vLLM is refused (429, its refusal's Retry-After); one that did is 503
        `ttft_target_missed` under its class's target, 504 `ttft_deadline_exceeded` under the mesh's limit."""
        limit_ms = (self.req.ttft_give_up_s or 0) * 1000
        if not self._submitted:
            why = self.refusal.message if self.refusal is not None else f"waited {limit_ms:.0f} ms for an engine slot, its TTFT limit"
            return QueueRefusal(why, code="ttft_target_unreachable", retry_after_s=self.refusal.retry_after_s if self.refusal else 1)
        if self._target_limit:
            # Its TTFT is at least this long: the latency breaker (ttft_p95) must see a stalled
            # engine's requests, which now end here instead of with a late first token, and so
            # must the engine's slots (its cap and first-token estimate).
            now = self.pool.clock()
            self.pool.window.record_ttft(now - self._admitted_at)
            w = self.admission.waiter
            self.pool.admission.slots[self.admission.engine.config.name].missed_first_token(now - self._submitted_at, self.admission.target_s, w and w.started_at, w.ahead if w else 0)
            cls, target_ms = self.admission.request_class, self.admission.target_s * 1000
            why = (f"no first token within {ADMIT_SHARE:.0%} of the {cls} class's {target_ms:.0f} ms target, while the pool refuses "
                   f"requests for time" if self._cut else f"no first token within the {cls} class's {limit_ms:.0f} ms target")
            return TargetMissed(why, code="ttft_target_missed", retry_after_s=1)
        return DeadlineExceeded(f"no first token within {limit_ms:.0f} ms", code="ttft_deadline_exceeded", retry_after_s=1)

    async def _slot(self) -> None:
        """Wait for the request's engine slot (admission.EngineSlots), or raise its refusal."""
        if self._submitted:
            return
        adm = self.admit()
        if adm.waiter is not None:
            try:
                await self.pool.admission.slots[adm.engine.config.name].acquire(adm.waiter)
            except TargetUnreachable as e:
                self.refusal = e
                raise
        self._submitted = True
        self._submitted_at = self.pool.clock()

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
        if self._coalesce_s and len(self.pool.admission.inflight) >= self._coalesce_min_inflight:
            return self._coalesce_s
        return 0.0

    def _tokens_arrived(self, count: int, ttft_s: float | None = None) -> None:
        """TTFT on the request's first tokens, inter-token time after (per token of a message)."""
        now = self.pool.clock()
        if self._first_token_at is None:
            # vLLM's own figure (`ttft_s`) starts when vLLM got the request: the wait for a slot is added.
            engine_ttft = now - self._submitted_at if ttft_s is None else ttft_s
            ttft = engine_ttft + (self._submitted_at - self._admitted_at)
            adm = self.admission
            w = adm.waiter
            self.pool.admission.slots[adm.engine.config.name].first_token(w, engine_ttft, adm.target_s)
            metrics = self.pool.metrics
            metrics.ttft.labels(self.front.value, self.label_class).observe(ttft)
            self._itl = metrics.itl.labels(self.front.value, self.label_class)
            self.pool.window.record_ttft(ttft)
            self._first_token_at = now
        elif self._last_token_at is not None:
            self._itl.observe((now - self._last_token_at) / max(1, count))
        self._last_token_at = now
        self.completion_tokens += count

    async def vllm_outputs(self, prompt, params, vllm_request_id: str, **kwargs) -> AsyncIterator:
        """vLLM's RequestOutputs for a prompt and SamplingParams that vLLM's serving layer built.

        The priority is the class's (whatever the client asked for); several calls (one per prompt
        of a completion) share the request's slot and measurements; a vLLM failure is counted in
        the error window and re-raised as vLLM raised it, for vLLM's layer to answer."""
        from vllm.sampling_params import RequestOutputKind

        adm = self.admit()
        pool = self.pool
        kwargs["priority"] = pool.config.classes[adm.request_class].vllm_priority or 0
        if self.trace is not None:  # vLLM's span joins this request's trace (sampled or not, as it is)
            kwargs["trace_headers"] = self.trace.trace_headers
        # A non-streamed request under a TTFT give-up limit must show its first token when it
        # comes (the front gives up only without one): vLLM's cumulative outputs, of which only
        # the final one, with every choice (as FINAL_ONLY gathers them), goes on to vLLM's layer.
        gather = (self.req.ttft_give_up_s is not None and not self._target_limit
                  and getattr(params, "output_kind", None) == RequestOutputKind.FINAL_ONLY)
        if gather:
            params.output_kind = RequestOutputKind.CUMULATIVE
        latest: dict[int, object] = {}  # each choice's last output (gather)
        delta = self._delta = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
        try:
            await self._slot()
        except TargetUnreachable as e:
            if self.req.ttft_give_up_s is not None and delta:
                self.refused.set()  # answered now, with its Retry-After (first_in_time)
                await asyncio.Future()  # held, never submitted: vLLM's layer must not make it an error chunk
            raise http_refusal(e) from None  # answered whole: vLLM's layer passes it to the front, answered at once
        self._vllm_ids.add(vllm_request_id)
        counted: dict[int, int] = {}  # tokens of each choice so far (cumulative outputs)
        prompt_counted = False
        gen = adm.engine.engine.generate(prompt, params, vllm_request_id, **kwargs)
        try:
            async for out in gen:
                if not prompt_counted and out.prompt_token_ids is not None:
                    self.prompt_tokens += len(out.prompt_token_ids)
                    prompt_counted = True
                new = 0
                if delta:
                    for o in out.outputs:
                        new += len(o.token_ids)
                else:
                    for o in out.outputs:
                        n = len(o.token_ids)
                        new += n - counted.get(o.index, 0)
                        counted[o.index] = n
                if new:
                    metrics = getattr(out, "metrics", None)
                    ttft = metrics.first_token_latency if not delta and metrics is not None and metrics.first_token_latency else None
                    self._tokens_arrived(new, ttft)
                if out.finished:
                    self._vllm_ids.discard(vllm_request_id)
                    if not self._vllm_ids:
                        self._outputs_done = True
                        pool.window.record_outcome(failed=False)
                if gather:
                    latest.update((o.index, o) for o in out.outputs)
                    if not out.finished:
                        continue
                    out.outputs = [latest[i] for i in sorted(latest)]
                yield out
                if new and delta and not out.finished and (wait := self._pause_s()) > 0:
                    await asyncio.sleep(wait)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            self._vllm_ids.discard(vllm_request_id)  # vLLM has dropped it
            pool.window.record_outcome(failed=True)
            raise
        finally:
            await gen.aclose()

    async def _generate(self) -> AsyncIterator[TokenDelta | Completion]:
        adm = self.admit()
        pool, engine = self.pool, adm.engine
        # Off the event loop, on one thread: a fast tokenizer used from two threads at once can
        # fail ("Already borrowed"); vLLM's renderer also tokenizes in a thread pool.
        ids = await asyncio.get_running_loop().run_in_executor(_TOKENIZE, engine.prompt_ids, self.req)
        params = engine.sampling_params(self.req, len(ids), pool.config.server.default_max_tokens)
        self.prompt_tokens = len(ids)
        priority = pool.config.classes[adm.request_class].vllm_priority or 0
        await self._slot_in_time()
        gen = engine.generate(self.req, ids, params, priority, self._pause_s, self.trace.trace_headers if self.trace is not None else None)
        try:
            ev = await self.first_in_time(gen)
            if ev is not None:
                yield self._arrived(ev)
                async for ev in gen:
                    yield self._arrived(ev)
        except EngineFailed:
            self._vllm_done = True  # vLLM has already dropped the request
            pool.window.record_outcome(failed=True)
            raise
        finally:
            await gen.aclose()
        if self.completion is None:  # a bug, not the client's fault
            raise SidecarError("generation ended without a result")

    def _arrived(self, ev: TokenDelta | Completion) -> TokenDelta | Completion:
        """An event of the gRPC generation, counted: tokens, or the Completion as the request's."""
        if isinstance(ev, TokenDelta):
            self._tokens_arrived(len(ev.token_ids))
            return ev
        self._vllm_done = True
        self.pool.window.record_outcome(failed=False)
        adm = self.admission
        self.completion = replace(ev, degraded=adm.degraded, degraded_reason=adm.degraded_reason)
        return self.completion

    async def _slot_in_time(self) -> None:
        """The engine slot, within the request's TTFT limit (if any)."""
        limit = self.req.ttft_give_up_s
        if limit is None:
            return await self._slot()
        try:
            await asyncio.wait_for(self._slot(), max(0.0, self._admitted_at + limit - self.pool.clock()))
        except asyncio.TimeoutError:
            raise self.gave_up() from None

    # -- the first token in time (both fronts) -------------------------------------------------

    async def first_in_time(self, stream: AsyncIterator[T]) -> T | None:
        """The first item of `stream` (None: it ended without one) or, `stream` closed, the error of
        a request given up before it (`gave_up`): its TTFT limit passed; a held HTTP stream was
        refused while it waited (`refused`: answered at once, not at its limit, so the refusal's
        p99 time is the admission's, docs/breakers.md); an HTTP stream past its class's target was
        cut while its pool is pressed (`cut_if_pressed`). The HTTP front's headers wait for it."""
        if self.req.ttft_give_up_s is not None:
            waiting = self._first_or_refused(stream) if self.front is Front.HTTP else _first(stream)
            first = asyncio.wait_for(waiting, max(0.0, self.first_token_deadline() - self.pool.clock()))
        elif self.front is not Front.HTTP:  # gRPC without a limit: nothing to watch
            return await _first(stream)
        else:
            deadline = self.target_deadline()
            first = _first(stream) if deadline is None else self._first_unless_cut(stream, deadline - self.pool.clock())
        try:
            return await first
        except (asyncio.TimeoutError, _Refused):  # refused in line (429, at once), or the limit passed: 503/504, vLLM aborts
            await stream.aclose()
            raise self.gave_up() from None

    async def result_in_time(self, work: Awaitable[R]) -> R:
        """`work`'s result (vLLM's layer answering the request whole), or the error of a request
        without a first token at its TTFT limit (`gave_up`; `work` cancelled): such an answer sends
        nothing before its end, so the lifecycle's own first token is watched."""
        if self.req.ttft_give_up_s is None:  # nothing to watch: no task of its own (one loop hop less)
            return await work
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task,), timeout=max(0.0, self.first_token_deadline() - self.pool.clock()))
            if not task.done() and not self.first_token_seen:
                raise self.gave_up()
            return await task
        finally:
            if not task.done():
                await cancel(task)

    async def _first_or_refused(self, stream: AsyncIterator[T]) -> T | None:
        """The stream's first item, or _Refused as soon as its wait for a slot is refused."""
        first = asyncio.ensure_future(_first(stream))
        refused = asyncio.ensure_future(self.refused.wait())
        try:
            await asyncio.wait((first, refused), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the TTFT limit (wait_for) or a vanished client: the stream is closed after
            await cancel(first)
            raise
        finally:
            refused.cancel()
        if first.done():
            return first.result()
        await cancel(first)
        raise _Refused

    async def _first_unless_cut(self, stream: AsyncIterator[T], after_s: float) -> T | None:
        """The stream's first item; asyncio.TimeoutError when, past its class's target without one,
        it is cut (`cut_if_pressed`). A timer, not a task of its own: this runs for every stream."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        cut = False
        handle: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal cut, handle
            if self.cut_if_pressed():
                cut = True
                task.cancel()
            else:
                handle = loop.call_later(CUT_CHECK_S, check)

        handle = loop.call_later(max(0.0, after_s), check)
        try:
            return await _first(stream)
        except asyncio.CancelledError:
            if cut and task.uncancel() == 0:
                raise asyncio.TimeoutError from None
            raise
        finally:
            handle.cancel()

    # -- exit --------------------------------------------------------------------------------

    async def serve(self, answer: Awaitable[tuple[R, Outcome | None]], send: Callable[[R], Awaitable[None]]) -> None:
        """The exit of an admitted request whose front builds its answer itself (HTTP; the gRPC
        front's is `async with`). `answer` runs the generation and gives the reply and its outcome.
        A reply sent whole is recorded and the request released before `send` sends it (its load
        report no longer counts the request); a stream (outcome None) keeps the request until it
        has been sent, however its sending ends. An exception or a cancellation closes it without
        an outcome: the client went away (or, had vLLM finished it, ok)."""
        reply, outcome, whole = None, Outcome(), False
        try:
            reply, kept = await answer
            if kept is None:
                await send(reply)
            else:
                outcome, whole = kept, True
        finally:
            await self.close(outcome.error, outcome.status)
        if whole:
            await send(reply)

    async def close(self, error: BaseException | None = None, status: str | None = None) -> None:
        """Record the outcome and release the request (abort it in vLLM if it may still run).
        `status` overrides the outcome (the HTTP status vLLM's layer answered with). Called from
        the two exits, `__aexit__` and `serve`; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._events is not None:
                await self._events.aclose()
        finally:
            if self.admission is not None:
                rid = self.admission.request_id
                status = self._record(error, status)
                if self.trace is not None:
                    self.trace.end(self, status, self._outcome(error, status), error)
                if self.admission.waiter is not None:  # ran: vLLM served it, its time in the slot is a measurement
                    ran = self._submitted and (self.completion is not None or self._outputs_done)
                    self.pool.admission.slots[self.admission.engine.config.name].finish(self.admission.waiter, ran)
                self.pool.admission.forget(rid)
                if self._events is None:  # vLLM's layer ran it: its requests still running
                    left = sorted(self._vllm_ids)
                else:
                    left = [rid] if self._submitted and not self._vllm_done else []
                self._vllm_ids.clear()
                if left:
                    # Shielded: a stream cancelled by its server (Starlette cancels a vanished
                    # client's stream again at every await) must still reach vLLM's abort.
                    engine = self.admission.engine
                    await asyncio.shield(asyncio.ensure_future(engine.abort(left[0] if len(left) == 1 else left)))

    def _outcome(self, error: BaseException | None, status: str) -> str:
        """The request's outcome as its trace names it."""
        if self._cut:
            return "cut"
        if isinstance(error, QueueRefusal) or self.refusal is not None or status in ("429", "RESOURCE_EXHAUSTED"):
            return "refused"
        if isinstance(error, DeadlineExceeded):
            return "gave_up"
        if status == self.front.ok:
            return "degraded" if self.admission.degraded else "ok"
        return "gone" if status == self.front.gone else "error"

    def _record(self, error: BaseException | None, status: str | None = None) -> str:
        """Count the request's outcome; its status, as counted."""
        m = self.pool.metrics
        if status is None and isinstance(error, SidecarError):
            status = self.front.status(error)
            if error.http_status >= 500:
                self.pool.load.on_failed()
        elif status is not None and status.isdigit() and int(status) >= 500:
            self.pool.load.on_failed()  # vLLM's layer answered with a server error
        elif status is None and error is None and (self.completion is not None or self._outputs_done):
            status = self.front.ok
        elif status is None:  # cancelled, or the consumer stopped reading: the client went away
            status = self.front.gone
        m.requests.labels(self.front.value, self.api, self.label_class, status).inc()
        if self.prompt_tokens:
            model = self.admission.engine.config.name
            m.prompt_tokens.labels(model).inc(self.prompt_tokens)
            m.completion_tokens.labels(model).inc(self.completion_tokens)
        return status
