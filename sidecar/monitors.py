"""Where breakers get their readings. Each source returns a value or None (no reading now).

- GPU memory used/total through NVML (nvidia-ml-py), when a GPU is present;
- vLLM's KV-cache use and waiting queue, from the engine's own scheduler stats;
- CPU load averaged over the cores this process may run on (psutil);
- TTFT p95 and error rate from the sidecar's own measurements over a sliding window.

`Readings` puts the drill faults (faults.py) on top: an injected value replaces the real one.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .faults import Faults

log = logging.getLogger("infermesh.sidecar.monitors")


class Source:
    """A reading source. `read()` must be cheap: it runs on the event loop every interval."""

    name = "source"

    def read(self) -> float | None:
        raise NotImplementedError


class CpuLoad(Source):
    """Busy fraction (0-1) of the CPUs in this process's affinity set, averaged over the last
    `window_s` (1 s by default): one monitor interval alone is too noisy for a sustain window
    (docs/breakers.md). Reads /proc/stat (psutil.cpu_times), not psutil.cpu_percent, whose
    since-last-call state is shared by every caller in the process."""

    name = "cpu_load"

    def __init__(self, window_s: float = 1.0, times: Callable[[], list] | None = None, clock: Callable[[], float] = time.monotonic):
        import psutil

        self._times = times or (lambda: psutil.cpu_times(percpu=True))
        self.clock = clock
        self.window_s = window_s
        try:
            self.cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = list(range(psutil.cpu_count() or 1))
        self._snaps: deque[tuple[float, float, float]] = deque()
        self._snap()

    def _snap(self) -> tuple[float, float, float]:
        per = self._times()
        busy = total = 0.0
        for i in self.cpus:
            if i < len(per):
                t = per[i]
                # Linux: iowait is idle time too (psutil and htop count it so).
                idle = t.idle + getattr(t, "iowait", 0.0)
                tot = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
                busy += tot - idle
                total += tot
        snap = (self.clock(), busy, total)
        self._snaps.append(snap)
        return snap

    def read(self) -> float | None:
        now, busy, total = self._snap()
        # Keep the newest snapshot that is at least window_s old as the baseline.
        while len(self._snaps) > 2 and now - self._snaps[1][0] >= self.window_s:
            self._snaps.popleft()
        t0, busy0, total0 = self._snaps[0]
        if total - total0 <= 0:
            return None
        return min(1.0, max(0.0, (busy - busy0) / (total - total0)))


class GpuMemory(Source):
    """Highest used/total memory fraction over the visible NVIDIA GPUs; None without a GPU."""

    name = "gpu_memory"

    def __init__(self, indices: list[int] | None = None):
        self.handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            self._nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in (indices if indices is not None else range(n))]
        except Exception as e:  # no driver, no library, no device: the breaker just gets no readings
            log.info("NVML unavailable; the GPU-memory monitor is off", extra={"reason": str(e)})

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def read(self) -> float | None:
        if not self.handles:
            return None
        worst = 0.0
        for h in self.handles:
            info = self._nvml.nvmlDeviceGetMemoryInfo(h)
            worst = max(worst, info.used / info.total if info.total else 0.0)
        return worst


@dataclass
class EngineStats:
    """Latest scheduler stats of one vLLM engine, pushed by its stat logger every step."""

    kv_cache_usage: float | None = None
    running: int = 0
    waiting: int = 0
    updated: float = 0.0
    kv_steps: deque = field(default_factory=deque)
    """(time, KV-cache use) of every step of the last `KV_STEPS_KEPT_S`: what `KvCache` reads."""
    listeners: list = field(default_factory=list)
    """Called with (running, waiting) at every step: admission.EngineSlots gates starts on vLLM's queue."""
    kv_capacity_tokens: int | None = None
    """The engine's KV cache in tokens (vLLM's num_gpu_blocks x block_size), once vLLM has sized
    it; None: not known (no engine, or vLLM did not say)."""

    def record(self, kv_cache_usage: float, running: int, waiting: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.kv_cache_usage, self.running, self.waiting, self.updated = kv_cache_usage, running, waiting, now
        for fn in self.listeners:
            fn(running, waiting)
        self.kv_steps.append((now, kv_cache_usage))
        while self.kv_steps and self.kv_steps[0][0] < now - KV_STEPS_KEPT_S:
            self.kv_steps.popleft()

    def kv_use(self, now: float, window_s: float, stale_after_s: float) -> float | None:
        """The highest KV-cache use of the steps of the last `window_s` (None: never reported).
        vLLM only reports while it has work: an engine silent for `stale_after_s` with nothing
        running has an empty cache, whatever its last step said."""
        if self.kv_cache_usage is None:
            return None
        if now - self.updated > stale_after_s and self.running == 0:
            return 0.0
        return max((u for t, u in self.kv_steps if t >= now - window_s), default=self.kv_cache_usage)


KV_STEPS_KEPT_S = 5.0


class KvCache(Source):
    """The primary engine's KV-cache use: the highest of its scheduler steps over the last
    `window_s` (1 s). One step's reading is no level to hold for a sustain window: under
    continuous batching a step that finishes a wave of requests frees their blocks before the
    queue refills them, so a full cache reads as a sawtooth (measured on the bench's overload,
    32 MiB cache, 168 chats waiting: 0.46-1.0 every ~2 s, mean 0.75; docs/breakers.md).

    While `holding()` (the kv-cache breaker has moved new requests off the primary) the emptied
    primary's own cache says nothing about whether the load would fit if it came back; read on
    it, the ladder recovered onto a cache the same load refilled at once (three switches in one
    16 s bench window; docs/breakers.md). So the reading is then the higher of two measures of
    the pool's present load in the primary's terms:

    - `held()`: the tokens every engine of the ladder holds now (its windowed use x its cache
      in tokens) over the primary's cache in tokens. It assumes the ladder's models count tokens
      alike (one family, one tokenizer) and that vLLM's block rounding is small; an engine that
      holds KV but whose cache size is unknown leaves the primary's own reading.
    - `projected()`: the first tokens the pool serves per second (`rate()`) times the primary's
      KV use per first token/s learnt in the pressure that made the ladder hold (at most
      `FRESH_S` before the hold began). A faster fallback turns the same load over in fewer
      tokens (the bench's overload: a third of the primary's cache), so `held()` alone stepped
      back onto a primary that refilled within 2 s; a ratio learnt from another load (one long
      prompt at a low rate, minutes before) read light chats as a full primary and never let go."""

    name = "kv_cache"

    LEARN_ABOVE = 0.5
    """The primary's KV use per first token/s is learnt while its own reading is at least this
    (a cache that is only lightly used says little about where it fills)."""
    FRESH_S = 5.0
    """A ratio learnt longer than this before the ladder began to hold is another load's."""

    def __init__(self, stats: Callable[[], EngineStats | None], stale_after_s: float = 2.0, window_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, others: Callable[[], list[EngineStats]] | None = None,
                 rate: Callable[[], float | None] | None = None, holding: Callable[[], bool] | None = None):
        self.stats = stats
        self.stale_after_s = stale_after_s
        self.window_s = window_s
        self.clock = clock
        self.others = others
        """The stats of the ladder's other engines (the fallbacks)."""
        self.rate = rate
        self.holding = holding
        self.kv_per_rate: float | None = None
        """The primary's KV use per first token/s, learnt the last time it was LEARN_ABOVE full
        (at `learnt_at`); kept for a hold only if learnt at most FRESH_S before it began."""
        self.learnt_at = float("-inf")
        self._was_holding = False

    def _use(self, s: EngineStats | None) -> float | None:
        return None if s is None else s.kv_use(self.clock(), self.window_s, self.stale_after_s)

    def held(self) -> float | None:
        """The KV the ladder's engines hold now, as a share of the primary's cache (not capped
        at 1); None: a cache size it needs is unknown."""
        primary = self.stats()
        capacity = primary.kv_capacity_tokens if primary is not None else None
        if not capacity:
            return None
        tokens = 0.0
        for s in [primary, *(self.others() if self.others is not None else [])]:
            use = self._use(s)
            if not use:
                continue  # never reported, or empty: holds nothing
            if not s.kv_capacity_tokens:
                return None
            tokens += use * s.kv_capacity_tokens
        return tokens / capacity

    def projected(self) -> float | None:
        """The KV use the pool's present first-token rate would give the primary, by the ratio
        learnt in the pressure that made the ladder hold (None: none learnt then)."""
        r = self.rate() if self.rate is not None else None
        if r is None or self.kv_per_rate is None:
            return None
        return r * self.kv_per_rate

    def read(self) -> float | None:
        own = self._use(self.stats())
        holding = self.holding is not None and self.holding()
        if holding and not self._was_holding and self.clock() - self.learnt_at > self.FRESH_S:
            self.kv_per_rate = None  # learnt before this pressure: another load's
        self._was_holding = holding
        if not holding:
            r = self.rate() if self.rate is not None else None
            if own is not None and own >= self.LEARN_ABOVE and r:
                self.kv_per_rate, self.learnt_at = own / r, self.clock()
            return own
        readings = [v for v in (self.held(), self.projected()) if v is not None]
        # held() counts the primary's own tokens too; without it, the primary's own reading.
        return min(1.0, max([own or 0.0, *readings])) if readings else own


@dataclass
class RequestWindow:
    """TTFTs and outcomes of recent requests, for the latency and error-rate breakers."""

    window_s: float = 30.0
    min_samples: int = 5
    clock: Callable[[], float] = time.monotonic
    ttfts: deque = field(default_factory=deque)
    outcomes: deque = field(default_factory=deque)

    def _trim(self, q: deque) -> None:
        cutoff = self.clock() - self.window_s
        while q and q[0][0] < cutoff:
            q.popleft()

    def record_ttft(self, seconds: float) -> None:
        self.ttfts.append((self.clock(), seconds))

    def record_outcome(self, failed: bool) -> None:
        self.outcomes.append((self.clock(), failed))

    def first_token_rate(self, over_s: float = 2.0) -> float:
        """First tokens per second over the last `over_s`: the load the pool is serving now
        (requests still queued have none yet, so a full engine reads at what it gets through)."""
        self._trim(self.ttfts)
        cutoff = self.clock() - over_s
        return sum(1 for _ in itertools.takewhile(lambda e: e[0] >= cutoff, reversed(self.ttfts))) / over_s

    def ttft_p95(self) -> float | None:
        self._trim(self.ttfts)
        if len(self.ttfts) < self.min_samples:
            return None
        vals = sorted(v for _, v in self.ttfts)
        return vals[min(len(vals) - 1, int(0.95 * len(vals)))]

    def error_rate(self) -> float | None:
        self._trim(self.outcomes)
        if len(self.outcomes) < self.min_samples:
            return None
        return sum(1 for _, f in self.outcomes if f) / len(self.outcomes)


class FromFunction(Source):
    def __init__(self, name: str, fn: Callable[[], float | None]):
        self.name = name
        self.fn = fn

    def read(self) -> float | None:
        return self.fn()


class Readings:
    """All sources by signal name, with injected faults on top."""

    def __init__(self, sources: dict[str, Source], faults: "Faults"):
        self.sources = sources
        self.faults = faults

    def read(self, signal: str) -> float | None:
        injected = self.faults.get(signal)
        if injected is not None:
            return injected
        src = self.sources.get(signal)
        if src is None:
            return None
        try:
            return src.read()
        except Exception:  # a broken source must not stop the monitor loop
            log.exception("monitor source failed", extra={"signal": signal})
            return None
