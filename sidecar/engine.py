"""The engine manager: the one owner of the pool's vLLM engines, shared by the HTTP and gRPC fronts.

It turns a front-neutral `GenerationRequest` into vLLM calls and a stream of `TokenDelta`s ending
with one `Completion`, and it enforces what both fronts share: known models, unique in-flight
request ids, the concurrency limit, aborting the vLLM request whenever the consumer stops early
(a vanished client, a cancelled RPC) so its KV cache is freed at once — and the pool's breakers:
which classes are shed, and which model of the ladder serves new requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from .breakers import Breaker, PoolPolicy, State, Transition
from .config import ModelConfig, SidecarConfig
from .errors import BadRequest, DuplicateRequest, EngineFailed, Overloaded, Unavailable, UnknownModel
from .monitors import CpuLoad, EngineStats, Faults, FromFunction, GpuMemory, KvCache, Readings, RequestWindow

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
    n: int = 1
    ignore_eos: bool = False
    request_id: str = ""
    request_class: str = ""


@dataclass
class TokenDelta:
    text: str
    token_ids: list[int]
    index: int = 0
    """Which of the `n` choices these tokens belong to."""


@dataclass
class Completion:
    """The last event of every stream."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    degraded: bool = False
    degraded_reason: str = ""
    finish_reasons: dict[int, str] = field(default_factory=dict)
    """Per choice index (n > 1); `finish_reason` is choice 0's."""


@dataclass
class Admission:
    """Where an admitted request goes, decided once, before any byte of the response."""

    request_id: str
    engine: "ModelEngine"
    request_class: str
    degraded: bool
    degraded_reason: str


class _StatsLogger:
    """A vLLM stat logger that keeps the latest scheduler stats for the monitors."""

    def __init__(self, sink: EngineStats):
        self.sink = sink

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is not None:
            self.sink.kv_cache_usage = scheduler_stats.kv_cache_usage
            self.sink.running = scheduler_stats.num_running_reqs
            self.sink.waiting = scheduler_stats.num_waiting_reqs
            self.sink.updated = time.monotonic()

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, is_awake: int, level: int):
        pass


class ModelEngine:
    """One vLLM AsyncLLM serving one model of the ladder."""

    def __init__(self, config: ModelConfig, priority_scheduling: bool = False):
        self.config = config
        self.priority_scheduling = priority_scheduling
        self.engine = None
        self.tokenizer = None
        self.stats = EngineStats()
        self.load_seconds: float | None = None
        self.inflight = 0
        self.sleeping = False
        self.pids: list[int] = []

    def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        m = self.config
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
            disable_log_stats=True,
            scheduling_policy="priority" if self.priority_scheduling else "fcfs",
        )
        sink = self.stats

        class Logger(_StatsLogger, StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                _StatsLogger.__init__(self, sink)

        before = _child_pids()
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[Logger])
        # vLLM's engine-core process(es) of this model: what a stall fault stops.
        self.pids = sorted(_child_pids() - before)
        self.tokenizer = self.engine.get_tokenizer()
        self.load_seconds = time.monotonic() - t0
        log.info("engine ready", extra={"model": m.name, "load_seconds": round(self.load_seconds, 2)})

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


class EngineStall:
    """A drill fault: the primary model's engine processes are stopped (SIGSTOP) for `duty` of
    every `period_s`, as an overloaded or throttled accelerator would stall them. The slowness is
    real: the sidecar's own TTFT measurements, its breakers and the ladder see it the way they
    would see a slow GPU. It always ends with the processes running (SIGCONT): on expiry, on
    `stop()`, and when the task is cancelled."""

    def __init__(self, pids: list[int], duty: float, duration_s: float, period_s: float, clock: Callable[[], float]):
        self.pids, self.duty, self.period_s, self.clock = pids, duty, period_s, clock
        self.until = clock() + duration_s
        self.task: asyncio.Task | None = None

    def _signal(self, sig) -> None:
        import os

        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    async def run(self) -> None:
        import signal

        try:
            while self.clock() < self.until:
                self._signal(signal.SIGSTOP)
                await asyncio.sleep(self.duty * self.period_s)
                self._signal(signal.SIGCONT)
                await asyncio.sleep((1 - self.duty) * self.period_s)
        finally:
            self._signal(signal.SIGCONT)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        import signal

        if self.task is not None:
            self.task.cancel()
        self._signal(signal.SIGCONT)

    def snapshot(self) -> dict | None:
        remaining = self.until - self.clock()
        if remaining <= 0 or (self.task is not None and self.task.done()):
            return None
        return {"value": self.duty, "period_s": self.period_s, "remaining_s": round(remaining, 2), "pids": self.pids}


def _gpu_present() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


class EngineManager:
    def __init__(self, config: SidecarConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        prio = any(c.vllm_priority is not None for c in config.classes.values())
        self.ladder = [ModelEngine(m, prio) for m in config.models]
        self.primary = self.ladder[0]
        self._inflight: dict[str, ModelEngine | None] = {}
        self._draining = False
        self.faults = Faults(clock)
        self.stall: EngineStall | None = None
        self.window = RequestWindow(config.monitor.window_s, clock=clock)
        self.transitions: deque[dict] = deque(maxlen=256)
        self._watchers: set[asyncio.Queue] = set()
        self.on_change: list[Callable[[dict], None]] = []
        self.breakers = [Breaker(name, bc, clock, self._on_transition) for name, bc in config.breakers.items()]
        self.policy = PoolPolicy(self.breakers)
        self._top_class = min(config.classes.items(), key=lambda kv: kv[1].priority)[0]
        self.readings: Readings | None = None
        self._gpu = False  # decided once at start: vLLM's sleep mode needs CUDA

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Load the primary model and, with `standby`, the next one (blocking: tens of seconds on CPU)."""
        self._gpu = _gpu_present()
        self.primary.start()
        if self.config.standby and len(self.ladder) > 1:
            self.ladder[1].start()
        sources = {
            "kv_cache": KvCache(lambda: self.primary.stats),
            "cpu_load": CpuLoad(),
            "gpu_memory": GpuMemory(),
            "ttft_p95": FromFunction("ttft_p95", self.window.ttft_p95),
            "error_rate": FromFunction("error_rate", self.window.error_rate),
        }
        self.readings = Readings(sources, self.faults)

    @property
    def ready(self) -> bool:
        return self.primary.engine is not None and not self._draining

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def begin_drain(self) -> None:
        self._draining = True
        # Watchers (the control plane) take the pool out of routing before the health checks do.
        self._emit({"at": time.time(), "event": "draining", "ready": False, "draining": True,
                    "pool_actions": sorted(self.policy.actions)})

    def shutdown(self) -> None:
        self.stop_stall()
        for m in self.ladder:
            m.shutdown()

    # -- drill faults ------------------------------------------------------------------------

    def start_stall(self, duty: float, duration_s: float, period_s: float = 1.0) -> dict:
        """Stall the primary model's engine processes (see EngineStall); replaces a running stall."""
        self.stop_stall()
        if not self.primary.pids:
            raise RuntimeError("the primary model's engine processes are not known")
        self.stall = EngineStall(self.primary.pids, duty, duration_s, period_s, self.clock)
        self.stall.start()
        log.warning("engine stall injected", extra={"duty": duty, "duration_s": duration_s, "period_s": period_s, "pids": self.primary.pids})
        return self.stall.snapshot() or {}

    def stop_stall(self) -> None:
        if self.stall is not None:
            self.stall.stop()
            self.stall = None

    # -- breakers ----------------------------------------------------------------------------

    def _on_transition(self, t: Transition) -> None:
        event = {
            "at": time.time(),
            "breaker": t.breaker,
            "from": t.from_state.value,
            "to": t.to_state.value,
            "actions": list(t.actions),
            "pool_actions": sorted(self.policy.actions),
            "serving_model": self.serving_model().config.name,
            "reason": t.reason,
            "value": t.value,
        }
        self.transitions.append(event)
        log.warning("breaker transition", extra=event)
        self._emit(event)

    def _emit(self, event: dict) -> None:
        for q in list(self._watchers):
            q.put_nowait(event)
        for cb in self.on_change:
            cb(event)

    def watch(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._watchers.add(q)
        return q

    def unwatch(self, q: asyncio.Queue) -> None:
        self._watchers.discard(q)

    def sample(self) -> dict[str, float | None]:
        """Read every signal a breaker watches and feed it; returns the readings."""
        values: dict[str, float | None] = {}
        if self.readings is None:
            return values
        for b in self.breakers:
            sig = b.config.signal
            if sig not in values:
                values[sig] = self.readings.read(sig)
            b.observe(values[sig])
        return values

    async def monitor_loop(self, on_sample: Callable[[dict], None] | None = None) -> None:
        interval = self.config.monitor.interval_s
        while True:
            values = self.sample()
            if on_sample:
                on_sample(values)
            await self._apply_sleep_mode()
            await asyncio.sleep(interval)

    def serving_model(self) -> ModelEngine:
        """The model new requests for the primary get: the next loaded one while degraded."""
        if "degrade" in self.policy.actions:
            for m in self.ladder[1:]:
                if m.engine is not None:
                    return m
        return self.primary

    async def _apply_sleep_mode(self) -> None:
        # On a GPU, a degraded pool puts the big model to sleep once its in-flight requests are
        # done, so its memory is really freed; it wakes when the pool recovers. On CPU this is
        # off (vLLM's sleep mode needs CUDA).
        if not self._gpu or len(self.ladder) < 2 or self.primary.engine is None:
            return
        degraded = self.serving_model() is not self.primary
        if degraded and not self.primary.sleeping and self.primary.inflight == 0:
            await self.primary.engine.sleep(level=1)
            self.primary.sleeping = True
            log.warning("primary model asleep", extra={"model": self.primary.config.name})
        elif not degraded and self.primary.sleeping:
            await self.primary.engine.wake_up()
            self.primary.sleeping = False
            log.warning("primary model awake", extra={"model": self.primary.config.name})

    def state(self) -> dict:
        return {
            "pool": self.config.pool,
            "served_by": self.config.served_by,
            "ready": self.ready,
            "draining": self._draining,
            "level": self.policy.level,
            "actions": sorted(self.policy.actions),
            "serving_model": self.serving_model().config.name,
            "primary_model": self.primary.config.name,
            "in_flight": self.inflight,
            "engines": [
                {
                    "model": m.config.name,
                    "loaded": m.engine is not None,
                    "in_flight": m.inflight,
                    # vLLM's own count of requests it still holds (KV blocks included).
                    "unfinished": m.engine.get_num_unfinished_requests() if m.engine is not None else 0,
                    "kv_cache_usage": m.stats.kv_cache_usage,
                    "running": m.stats.running,
                    "waiting": m.stats.waiting,
                }
                for m in self.ladder
            ],
            "breakers": [b.snapshot() for b in self.breakers],
            "faults": self.faults.snapshot() | ({"stall": st} if self.stall and (st := self.stall.snapshot()) else {}),
        }

    # -- models ------------------------------------------------------------------------------

    def model_ids(self) -> list[str]:
        return [m.name for m in self.config.models]

    def resolve_model(self, name: str | None) -> ModelEngine:
        if not name:
            return self.primary
        for m in self.ladder:
            if name == m.config.name or name in m.config.aliases:
                return m
        raise UnknownModel(name, [n for m in self.config.models for n in (m.name, *m.aliases)])

    # -- admission ---------------------------------------------------------------------------

    def admit(self, req: GenerationRequest) -> Admission:
        """Check a request before any response is started, so errors get a proper status."""
        if self.primary.engine is None:
            raise Unavailable("the engine is still loading", retry_after_s=5)
        if self._draining:
            raise Unavailable("the sidecar is shutting down", retry_after_s=1)
        asked = self.resolve_model(req.model)
        cls = req.request_class if req.request_class in self.config.classes else self.config.default_class
        policy = self.config.classes[cls]
        actions = self.policy.actions
        if "critical_only" in actions and cls != self._top_class:
            raise Unavailable(
                f"pool {self.config.pool} is protecting itself ({', '.join(self.policy.reasons())}): only {self._top_class} requests are served",
                code="pool_critical_only",
                retry_after_s=5,
            )
        if "shed" in actions and policy.sheddable:
            raise Overloaded(
                f"pool {self.config.pool} is shedding {cls} requests ({', '.join(self.policy.reasons())})",
                code="pool_shedding",
                retry_after_s=5,
            )
        if len(self._inflight) >= self.config.server.max_concurrent_requests:
            raise Overloaded(f"more than {self.config.server.max_concurrent_requests} requests in flight", retry_after_s=1)
        rid = req.request_id or uuid.uuid4().hex
        if rid in self._inflight:
            raise DuplicateRequest(f"request id {rid!r} is already in flight", param="request_id")
        target, degraded, reason = asked, False, ""
        if asked is self.primary:
            target = self.serving_model()
            if target is not self.primary:
                degraded, reason = True, ",".join(self.policy.reasons())
        if target.engine is None:  # a ladder model that was not loaded as a standby
            raise Unavailable(f"model {target.config.name} is not loaded on this pool", retry_after_s=5)
        for b in self.breakers:
            if b.state is State.HALF_OPEN:
                b.trial_admitted()
        self._inflight[rid] = target
        target.inflight += 1
        req.request_id = rid
        req.request_class = cls
        return Admission(rid, target, cls, degraded, reason)

    # -- generation --------------------------------------------------------------------------

    def _prompt_ids(self, req: GenerationRequest, tok) -> list[int]:
        if req.messages is not None:
            try:
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # a template error is the request's fault (bad roles, …)
                raise BadRequest(f"cannot render messages with the chat template: {e}", param="messages") from e
            return list(tok.encode(text, add_special_tokens=False))
        if req.prompt is None:
            raise BadRequest("a prompt is required", param="prompt")
        return list(tok.encode(req.prompt, add_special_tokens=True))

    def _sampling_params(self, req: GenerationRequest, prompt_len: int, model: ModelConfig):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        max_model_len = model.max_model_len
        max_tokens = req.max_tokens or min(self.config.server.default_max_tokens, max_model_len - prompt_len)
        if max_tokens <= 0 or prompt_len + max_tokens > max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the messages, {max(max_tokens, 0)} in the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        kwargs: dict = {"max_tokens": max_tokens, "output_kind": RequestOutputKind.DELTA, "n": req.n, "ignore_eos": req.ignore_eos}
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

    async def stream(self, req: GenerationRequest, adm: Admission) -> AsyncIterator[TokenDelta | Completion]:
        """Generate for an admitted request. Stopping the iteration early aborts it in vLLM."""
        from vllm.inputs import TokensPrompt

        rid = req.request_id
        finished = False
        target = adm.engine
        engine = target.engine
        started = self.clock()
        first = True
        try:
            ids = self._prompt_ids(req, target.tokenizer)
            params = self._sampling_params(req, len(ids), target.config)
            priority = self.config.classes[adm.request_class].vllm_priority or 0
            completion_tokens = 0
            finish: dict[int, str] = {}
            coalesce_s = self.config.server.stream_coalesce_ms / 1000.0
            try:
                async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, rid, priority=priority):
                    produced = False
                    for o in out.outputs:
                        completion_tokens += len(o.token_ids)
                        if o.finish_reason:
                            finish[o.index] = o.finish_reason
                        if o.text or o.token_ids:
                            produced = True
                            if first:
                                first = False
                                self.window.record_ttft(self.clock() - started)
                            yield TokenDelta(o.text, list(o.token_ids), o.index)
                    if out.finished:
                        finished = True
                        self.window.record_outcome(failed=False)
                        yield Completion(
                            finish.get(0, "stop"), len(ids), completion_tokens, target.config.name, adm.degraded,
                            adm.degraded_reason, {i: finish.get(i, "stop") for i in range(req.n)},
                        )
                        return
                    # Under load, let vLLM merge the next steps' tokens into one output (its
                    # collector aggregates deltas while nobody reads): fewer, larger messages, so
                    # per-message overhead does not cap throughput. The first token never waits.
                    if produced and coalesce_s > 0 and len(self._inflight) >= self.config.server.stream_coalesce_min_inflight:
                        await asyncio.sleep(coalesce_s)
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:
                finished = True  # vLLM has already dropped the request
                self.window.record_outcome(failed=True)
                log.exception("generation failed", extra={"request_id": rid})
                raise EngineFailed(f"generation failed: {type(e).__name__}") from e
        finally:
            if finished:
                self._forget(rid)
            else:
                await self.release(rid)

    def _forget(self, rid: str) -> ModelEngine | None:
        target = self._inflight.pop(rid, None)
        if target is not None:
            target.inflight -= 1
        return target

    async def release(self, rid: str) -> None:
        """Forget an admitted request and abort it in vLLM if it may still run. Idempotent.

        A front calls it when a response ends in any way: a stream that was never iterated (the
        client left before the first byte) never reaches the generator's `finally`.
        """
        if rid not in self._inflight:
            return
        target = self._forget(rid)
        if target is not None and target.engine is not None:
            try:
                await target.engine.abort(rid)
                log.info("aborted request", extra={"request_id": rid})
            except Exception:  # the engine may be shutting down; nothing is left to free
                log.debug("abort failed", exc_info=True)
