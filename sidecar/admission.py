"""Admission: whether a request is served, by which model, decided before any byte of the response.

It refuses while loading or draining, applies the breakers' actions (`critical_only` keeps only
the top class, `shed` refuses sheddable classes), the concurrency limit and unique request ids,
and picks the model (the ladder's fallback while the pool is degraded). It also keeps the table
of requests in flight, which the lifecycle empties on release.

Time-bounded admission (EngineSlots): each model hands vLLM at most a measured number of requests
at once (up to `max_num_seqs`, what it batches; more would wait in vLLM's scheduler, out of
reach); the others wait here, by class priority, then arrival. What waits is bounded by time: a request is admitted only when
its estimated first token (its place in line over the pool's measured rate, plus vLLM's measured
time to a first token) comes within its class's TTFT target, and one that waits is refused as
soon as it no longer can, before vLLM sees it.

vLLM's own queue gates the starts: its stat logger reports, every scheduler step, how many
requests run and how many wait in its scheduler (a full KV cache, preemptions). While any wait
there, no request is started here, and the cap drops at once to what vLLM runs; starts resume
with the first step that shows nothing waiting. A request handed to vLLM then runs in its batch
instead of queueing out of reach (the e2e run at 100x served chats 14.6 s late without this).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from .breakers import Breaker, PoolPolicy, State
from .config import SidecarConfig
from .engines import Ladder, ModelEngine
from .errors import DuplicateRequest, Overloaded, Unavailable
from .requests import GenerationRequest


@dataclass
class Admission:
    """Where an admitted request goes."""

    request_id: str
    engine: ModelEngine
    request_class: str
    """A class of the config (an unknown or missing one is the default class)."""
    degraded: bool
    degraded_reason: str
    target_s: float = math.inf
    """The class's TTFT target (settings.ClassSettings.ttft_target_ms)."""
    waiter: Waiter | None = None
    """Its place at the model's engine slots (time-bounded admission)."""

    @property
    def admitted_for_s(self) -> float:
        """The first token it was admitted for: ADMIT_SHARE of its class's target."""
        return ADMIT_SHARE * self.target_s


EWMA_WEIGHT = 0.2
"""Weight of the newest measurement in the pool's service estimates: about the last ten requests."""


COLD_SHARE = 4
"""A model nothing has been measured on gets max_num_seqs / this at once (the e2e run at 100x that
gave a cold engine all 32 of its slots, with a KV cache for ~8 chats, served chats 17 s late)."""


ADMIT_SHARE = 0.75
"""A request is admitted only when its estimated first token comes within this share of its
class's target: the estimates are running averages of the last ~10 requests, and a first token's
spread around them must fit in the rest (the clean-clone run with the whole target: served p95
1.05 s against a 1 s target)."""


def ewma(average: float | None, sample: float) -> float:
    """The running average with a new sample (the first sample starts it)."""
    return sample if average is None else average + EWMA_WEIGHT * (sample - average)


class TargetUnreachable(Overloaded):
    """Refused by time-bounded admission: the first token could not come within the class's target."""


@dataclass(eq=False)
class Waiter:
    """A request's place at one model's engine slots: holding one, or in line for one."""

    priority: int
    arrived: float
    deadline: float
    """Arrival plus the class's target: its first token is due by then."""

    @property
    def due(self) -> float:
        """The latest estimated first token it may be started for: its arrival plus ADMIT_SHARE of
        its target, as on arrival (`check_arrival`)."""
        return self.arrived + ADMIT_SHARE * (self.deadline - self.arrived)
    started_at: float | None = None
    """When it got its slot (None: still in line, or refused)."""
    ahead: int = 0
    """Requests of its model started before it still without a first token, at its start."""
    prefilling: bool = False
    """Started, and no first token yet."""
    future: asyncio.Future | None = None
    refusal: TargetUnreachable | None = None
    finished: bool = False


@dataclass
class EngineSlots:
    """One model's engine slots and the line in front of them, with what the pool is measured to serve.

    How many requests vLLM gets at once (`cap`) is measured too: it grows by one with each first
    token that came within half its target and shrinks by a quarter when one came past it (once
    per round: only for a request started after the last cut), between 1 and `slots`. A free
    slot of `max_num_seqs` is not a first token in time: a full KV cache, or a CPU shared with the
    refusals, queues inside vLLM. The rate is cap / the mean time a request holds a slot (Little's
    law), so it follows the model, the prompts, the machine and the batch as they are. The
    decisions (`start_wait`, `check_arrival`, `expire`) read the injected clock and never wait;
    `acquire` is the asyncio glue."""

    slots: int
    """The most vLLM may get at once: the model's `max_num_seqs`."""
    clock: Callable[[], float] = time.monotonic
    hold_s: float | None = None
    """EWMA of how long a request holds a slot (from its start in vLLM to its release)."""
    first_token_s: float | None = None
    """EWMA of vLLM's time to a first token, from the request's start there."""
    prefill_s: float | None = None
    """EWMA of vLLM's time to a first token per request it had to prefill for it: its own and those
    started before it without a first token yet (time to first token / (ahead + 1))."""
    in_prefill: list[Waiter] = field(default_factory=list)
    """Requests started without a first token yet, oldest start first."""
    busy: int = 0
    waiting: list[Waiter] = field(default_factory=list)
    refused_waiting: int = 0
    """Requests refused while they waited (counted for the state endpoint)."""
    limit: float | None = None
    """The measured concurrency (see the class); starts at a quarter of `slots`."""
    engine_waiting: int = 0
    """Requests waiting in vLLM's scheduler at its last step (`engine_stats`)."""
    refused_at: float = -math.inf
    """When it last refused a request for time (on arrival or in line)."""
    _cut_at: float = -math.inf

    def __post_init__(self) -> None:
        if self.limit is None:
            self.limit = float(max(1, self.slots // COLD_SHARE))

    @property
    def prefilling(self) -> int:
        """How many requests started without a first token yet."""
        return len(self.in_prefill)

    # -- measurements ---------------------------------------------------------------------------

    def measured_hold(self, seconds: float) -> None:
        self.hold_s = ewma(self.hold_s, seconds)

    def measured_first_token(self, seconds: float, target_s: float = math.inf, started_at: float | None = None) -> None:
        """vLLM's time to a request's first token (from its start there), and the cap's step."""
        self.first_token_s = ewma(self.first_token_s, seconds)
        if seconds <= target_s / 2:
            self.limit = min(float(self.slots), self.limit + 1.0)
            self._start_next()
        elif seconds > target_s and (started_at is None or started_at > self._cut_at):
            self.limit = max(1.0, self.limit * 0.75)
            self._cut_at = self.clock()

    def first_token(self, w: Waiter | None, seconds: float, target_s: float = math.inf) -> None:
        """`w`'s first token came `seconds` after its start in vLLM: the measurements and the cap's step."""
        if w is not None and w.prefilling:
            self._prefilled(w)
            share = seconds / (w.ahead + 1)
            self.prefill_s = ewma(self.prefill_s, share)
        self.measured_first_token(seconds, target_s, w and w.started_at)

    def _prefilled(self, w: Waiter) -> None:
        if w.prefilling:
            w.prefilling = False
            self.in_prefill.remove(w)

    def missed_first_token(self, seconds: float, target_s: float, started_at: float | None = None, ahead: int = 0) -> None:
        """A request given up at its target without a first token, `seconds` after its start in
        vLLM (`ahead`: Waiter.ahead): its first token would have come later than that (a bound, so
        it only raises the estimates), and when vLLM had it for half its target or more the cap
        shrinks as for a late one."""
        if self.first_token_s is None or seconds > self.first_token_s:
            self.first_token_s = ewma(self.first_token_s, seconds)
        share = seconds / (ahead + 1)
        if self.prefill_s is None or share > self.prefill_s:
            self.prefill_s = ewma(self.prefill_s, share)
        if seconds >= target_s / 2 and (started_at is None or started_at > self._cut_at):
            self.limit = max(1.0, self.limit * 0.75)
            self._cut_at = self.clock()

    def engine_stats(self, running: int, waiting: int) -> None:
        """vLLM's scheduler at a step: requests running, and waiting in its own queue. Any
        waiting: the cap drops at once to what runs (starts pause, see `_queue_in_vllm`); none:
        the line moves on."""
        self.engine_waiting = waiting
        if waiting > 0:
            if running < self.limit:
                self.limit = max(1.0, float(running))
                self._cut_at = self.clock()  # late first tokens of requests started before count as this cut
        else:
            self._start_next()

    @property
    def _queue_in_vllm(self) -> bool:
        # A reading from before the last of our requests left cannot hold vLLM's queue (vLLM
        # takes no step, so sends no new reading, once nothing is left to step).
        return min(self.engine_waiting, self.busy) > 0

    @property
    def cap(self) -> int:
        """Requests vLLM gets at once now."""
        return max(1, min(self.slots, int(self.limit)))

    @property
    def rate(self) -> float | None:
        """Requests the model starts per second while every slot is busy (None: nothing measured yet)."""
        return self.cap / self.hold_s if self.hold_s else None

    # -- decisions ------------------------------------------------------------------------------

    def ahead(self, priority: int) -> int:
        """Requests in line that would start before a new one of this priority."""
        return sum(1 for w in self.waiting if w.priority <= priority)

    def start_wait(self, position: int) -> float | None:
        """Estimated wait for a slot of the request at `position` in line (0: first); None: no
        estimate (no slot free and nothing measured yet)."""
        free = 0 if self._queue_in_vllm else max(0, self.cap - self.busy)
        if position < free:
            return 0.0
        rate = self.rate
        return None if rate is None else (position - free + 1) / rate

    def first_token_estimate(self, wait: float) -> float:
        """Estimated time from a start in vLLM to the first token, for a request that starts after
        `wait`: one that starts now is prefilled after those started without a first token yet
        (each measured at `prefill_s`); one that waits meets a batch as the measurements did."""
        if wait == 0.0 and self.prefill_s is not None:
            return (self.prefilling + 1) * self.prefill_s
        return self.first_token_s or 0.0

    def estimate(self, priority: int) -> float | None:
        """Estimated time to the first token of a request of this priority arriving now."""
        wait = self.start_wait(self.ahead(priority))
        return None if wait is None else wait + self.first_token_estimate(wait)

    def check_arrival(self, target_s: float, priority: int, what: str) -> None:
        """Raise TargetUnreachable when a request arriving now cannot get its first token within
        `target_s`; its Retry-After is how far over the target the estimate is (at least 1 s)."""
        refusal = self.arrival_refusal(target_s, priority, what)
        if refusal is not None:
            self.refuse(refusal)

    def refuse(self, refusal: TargetUnreachable) -> None:
        """Refuse a request for time: raise `refusal`, and mark this engine as refusing (its pool
        is pressed: `AdmissionControl.pressed_since`)."""
        self.refused_at = self.clock()
        raise refusal

    def slow_alone(self, target_s: float) -> bool:
        """Whether vLLM is too slow for `target_s` even for a request started alone now (a
        stalled or starved engine), not because of a line here or a burst of starts (those refuse
        as they should: the fallback would take the same cores): its measured time to one prefill
        is past the admitted share, or a request it is prefilling now has gone past the share
        without a first token (what the running average learns only once that token comes)."""
        share = ADMIT_SHARE * target_s
        lone = self.prefill_s if self.prefill_s is not None else self.first_token_s
        if lone is not None and lone > share:
            return True
        return bool(self.in_prefill) and self.clock() - (self.in_prefill[0].started_at or 0.0) > share

    def arrival_refusal(self, target_s: float, priority: int, what: str) -> TargetUnreachable | None:
        """The refusal a request arriving now gets (None: it is admitted), without marking anything."""
        if self.busy == 0 and not self.waiting:
            return None  # an idle engine starts it at once; this is also how a high first-token estimate is measured again
        position = self.ahead(priority)
        wait = self.start_wait(position)
        if wait is None:  # nothing finished yet to measure a wait by: a line no longer than the cap
            if position < self.cap:
                return None
            return TargetUnreachable(f"{what}: all {self.cap} engine slots are busy, {position} requests wait, and no request "
                                     f"has finished yet to measure a wait by", code="ttft_target_unreachable", retry_after_s=1)
        first = self.first_token_estimate(wait)
        if wait + first <= ADMIT_SHARE * target_s:
            return None
        return TargetUnreachable(
            f"{what}: {position} requests wait for {self.busy}/{self.cap} busy engine slots"
            + (f", started at {self.rate:.2f}/s" if self.rate else "")
            + f", and vLLM takes {first * 1000:.0f} ms to a first token: its first token would come in about "
            f"{(wait + first) * 1000:.0f} ms, past {ADMIT_SHARE:.0%} of its {target_s * 1000:.0f} ms target",
            code="ttft_target_unreachable", retry_after_s=max(1.0, math.ceil(wait + first - target_s)))

    def expire(self) -> list[Waiter]:
        """Refuse every request in line that can no longer be started in time: its estimated start
        (its place in line over the rate) plus vLLM's time to a first token is past its `due`
        (ADMIT_SHARE of its target, as on arrival). Returns them."""
        now = self.clock()
        first = self.first_token_s or 0.0
        refused, kept = [], []
        for w in self.waiting:
            wait = self.start_wait(len(kept))
            eta = now + (wait or 0.0) + first
            if eta >= w.due:
                w.refusal = TargetUnreachable(
                    f"waited {(now - w.arrived) * 1000:.0f} ms for an engine slot; its first token can no longer come "
                    f"within {ADMIT_SHARE:.0%} of its {(w.deadline - w.arrived) * 1000:.0f} ms target", code="ttft_target_unreachable",
                    retry_after_s=max(1.0, math.ceil(eta - w.deadline)))
                w.finished = True
                refused.append(w)
                if w.future is not None and not w.future.done():
                    w.future.set_exception(w.refusal)
            else:
                kept.append(w)
        self.waiting = kept
        self.refused_waiting += len(refused)
        if refused:
            self.refused_at = now
        return refused

    def _start(self, w: Waiter) -> None:
        self.busy += 1
        w.started_at = self.clock()
        w.ahead, w.prefilling = self.prefilling, True
        self.in_prefill.append(w)
        if w.future is not None and not w.future.done():
            w.future.set_result(None)

    def _start_next(self) -> None:
        while self.waiting and self.busy < self.cap and not self._queue_in_vllm:
            self._start(self.waiting.pop(0))

    # -- the line -------------------------------------------------------------------------------

    def enqueue(self, priority: int, target_s: float) -> Waiter:
        """A slot now, or a place in line (by priority, then arrival)."""
        now = self.clock()
        w = Waiter(priority, now, now + target_s)
        if self.busy < self.cap and not self.waiting and not self._queue_in_vllm:
            self._start(w)
            return w
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority > priority:
            i -= 1
        self.waiting.insert(i, w)
        return w

    async def acquire(self, w: Waiter) -> None:
        """Return once `w` holds a slot; raise its refusal (TargetUnreachable) when it cannot meet its target."""
        if w.started_at is not None:
            return
        if w.refusal is not None:
            raise w.refusal
        if w.future is None:
            w.future = asyncio.get_running_loop().create_future()
        while not w.future.done():
            # Woken by a slot, or at the last moment its first token could still come in time,
            # to be refused then; a release that finds the rate too low refuses it earlier.
            timeout = max(0.0, w.due - (self.first_token_s or 0.0) - self.clock())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(w.future), timeout)
            if not w.future.done():
                self.expire()
        w.future.result()

    def finish(self, w: Waiter, ran: bool) -> None:
        """The request is done with its place, however it ended. `ran`: vLLM ran it, so its time
        in the slot is a measurement. Idempotent."""
        if w.finished:
            return
        w.finished = True
        if w.started_at is None:  # still in line: it goes without ever reaching vLLM
            if w in self.waiting:
                self.waiting.remove(w)
            if w.future is not None and not w.future.done():
                w.future.cancel()
            return
        self.busy -= 1
        self._prefilled(w)
        if ran:
            self.measured_hold(self.clock() - w.started_at)
        self.expire()
        self._start_next()

    def snapshot(self) -> dict:
        return {"slots": self.slots, "cap": self.cap, "busy": self.busy, "waiting": len(self.waiting),
                "hold_ms": None if self.hold_s is None else round(self.hold_s * 1000, 1),
                "first_token_ms": None if self.first_token_s is None else round(self.first_token_s * 1000, 1),
                "prefill_ms": None if self.prefill_s is None else round(self.prefill_s * 1000, 1), "prefilling": self.prefilling,
                "rate_per_s": None if self.rate is None else round(self.rate, 2), "refused_waiting": self.refused_waiting,
                "engine_waiting": self.engine_waiting}


SLOW_PRIMARY = "primary_too_slow"
"""The degraded reason of a request the primary could not serve within its class's TTFT target
and the ladder's fallback could (x-infermesh-degraded-reason; docs/breakers.md)."""


class AdmissionControl:
    def __init__(self, config: SidecarConfig, ladder: Ladder, breakers: list[Breaker], policy: PoolPolicy,
                 clock: Callable[[], float] = time.monotonic):
        self.config, self.ladder, self.breakers, self.policy = config, ladder, breakers, policy
        self.inflight: dict[str, ModelEngine] = {}
        self.slots: dict[str, EngineSlots] = {m.config.name: EngineSlots(m.config.max_num_seqs, clock) for m in ladder}
        """Each model's engine slots, by model name."""
        for m in ladder:  # vLLM's scheduler stats, every step, gate the starts (EngineSlots.engine_stats)
            stats = getattr(m, "stats", None)
            if stats is not None and hasattr(stats, "listeners"):
                stats.listeners.append(self.slots[m.config.name].engine_stats)
        self.draining = False
        self.top_class = min(config.classes.items(), key=lambda kv: kv[1].priority)[0]
        """The class `critical_only` keeps."""

    def admit(self, req: GenerationRequest) -> Admission:
        """Admit `req` or raise the SidecarError its client gets; fills in its id and class."""
        cfg = self.config
        if self.ladder.primary.engine is None:
            raise Unavailable("the engine is still loading", retry_after_s=5)
        if self.draining:
            raise Unavailable("the sidecar is shutting down", retry_after_s=1)
        asked = self.ladder.resolve(req.model)
        cls = req.request_class if req.request_class in cfg.classes else cfg.default_class
        actions = self.policy.actions
        if "critical_only" in actions and cls != self.top_class:
            raise Unavailable(
                f"pool {cfg.pool} is protecting itself ({', '.join(self.policy.reasons())}): only {self.top_class} requests are served",
                code="pool_critical_only",
                retry_after_s=5,
            )
        if "shed" in actions and cfg.classes[cls].sheddable:
            raise Overloaded(
                f"pool {cfg.pool} is shedding {cls} requests ({', '.join(self.policy.reasons())})",
                code="pool_shedding",
                retry_after_s=5,
            )
        if len(self.inflight) >= cfg.server.max_concurrent_requests:
            raise Overloaded(f"more than {cfg.server.max_concurrent_requests} requests in flight", retry_after_s=1)
        rid = req.request_id or uuid.uuid4().hex
        if rid in self.inflight:
            raise DuplicateRequest(f"request id {rid!r} is already in flight", param="request_id")
        target, degraded, reason = asked, False, ""
        if asked is self.ladder.primary:
            target = self.ladder.serving("degrade" in actions)
            if target is not asked:
                degraded, reason = True, ",".join(self.policy.reasons())
        if target.engine is None:  # a ladder model that was not loaded as a standby
            raise Unavailable(f"model {target.config.name} is not loaded on this pool", retry_after_s=5)
        policy = cfg.classes[cls]
        slots = self.slots[target.config.name]
        refusal = slots.arrival_refusal(policy.ttft_target_s, policy.priority, f"pool {cfg.pool} cannot serve this {cls} request in time")
        if refusal is not None and target is self.ladder.primary and slots.slow_alone(policy.ttft_target_s):
            # The primary itself is too slow for this target (stalled, starved), before a breaker
            # has judged it: the ladder's loaded fallback serves the request, degraded, when it
            # can in time; only then is the request refused.
            fallback = self.ladder.serving(degrade=True)
            fb_slots = self.slots[fallback.config.name]
            if fallback is not target and fb_slots.arrival_refusal(policy.ttft_target_s, policy.priority, "") is None:
                target, degraded, reason, slots, refusal = fallback, True, SLOW_PRIMARY, fb_slots, None
        if refusal is not None:
            slots.refuse(refusal)
        for b in self.breakers:
            if b.state is State.HALF_OPEN:
                b.trial_admitted()
        self.inflight[rid] = target
        target.inflight += 1
        req.request_id = rid
        req.request_class = cls
        return Admission(rid, target, cls, degraded, reason, policy.ttft_target_s, slots.enqueue(policy.priority, policy.ttft_target_s))

    def pressed_since(self, t: float) -> bool:
        """Whether any engine of the pool has refused a request for time since `t`, or has one in
        line now: compute that a late request holds is wanted by requests that can still be on time."""
        return any(s.refused_at >= t or s.waiting for s in self.slots.values())

    def forget(self, request_id: str) -> None:
        """Free the request's slot. Idempotent."""
        target = self.inflight.pop(request_id, None)
        if target is not None:
            target.inflight -= 1
