"""The pool as this sidecar serves it: the model ladder, its breakers fed by the monitors,
admission, the state events and the drill faults. Both fronts and the admin API share one `Pool`;
each request's life in it is a `lifecycle.RequestLifecycle` on the pool (which the pool does not
know of).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .admission import AdmissionControl
from .breakers import Breaker, PoolPolicy, Transition
from .config import SidecarConfig
from .engines import Ladder, ModelEngine
from .events import BreakerChanged, Draining, EventBus
from .faults import Faults
from .load_report import LoadReporter
from .metrics import SidecarMetrics
from .monitors import CpuLoad, FromFunction, GpuMemory, KvCache, Readings, RequestWindow

log = logging.getLogger("infermesh.sidecar.pool")


class Pool:
    def __init__(self, config: SidecarConfig, clock: Callable[[], float] = time.monotonic, metrics: SidecarMetrics | None = None,
                 make_engine: type[ModelEngine] = ModelEngine):
        self.config = config
        self.clock = clock
        self.metrics = metrics or SidecarMetrics.of(config)
        prio = any(c.vllm_priority is not None for c in config.classes.values())
        self.ladder = Ladder(config.models, priority_scheduling=prio, make_engine=make_engine)
        self.faults = Faults(clock)
        self.window = RequestWindow(config.monitor.window_s, clock=clock)
        self.events = EventBus()
        self.events.subscribe(self.metrics.count_transition)
        self.breakers = [Breaker(name, bc, clock, self._on_transition) for name, bc in config.breakers.items()]
        self.policy = PoolPolicy(self.breakers)
        self.admission = AdmissionControl(config, self.ladder, self.breakers, self.policy, clock)
        self.readings: Readings | None = None
        """Set at start, once the engines whose stats they read exist."""
        self.load = LoadReporter(config.models[0].max_num_seqs, lambda: self.inflight, self._kv_cache_usage, clock=clock)
        """The ORCA load report every generation response carries (response_headers.py)."""

    @property
    def primary(self) -> ModelEngine:
        return self.ladder.primary

    # -- start and stop ----------------------------------------------------------------------

    def start(self) -> None:
        """Load the models (blocking: tens of seconds on CPU) and the monitors' sources."""
        self.ladder.start(self.config.standby)
        sources = {
            "kv_cache": KvCache(lambda: self.primary.stats, clock=self.clock, holding=self._kv_holding,
                                others=lambda: [m.stats for m in self.ladder.engines[1:]], rate=self.window.first_token_rate),
            "cpu_load": CpuLoad(),
            "gpu_memory": GpuMemory(),
            "ttft_p95": FromFunction("ttft_p95", self.window.ttft_p95),
            "error_rate": FromFunction("error_rate", self.window.error_rate),
        }
        self.readings = Readings(sources, self.faults)

    def _kv_holding(self) -> bool:
        """A kv-cache breaker has moved new requests off the primary (its recovery then reads
        the pool's present load in the primary's terms, monitors.KvCache)."""
        return any(b.config.signal == "kv_cache" and "degrade" in b.actions for b in self.breakers)

    def _kv_cache_usage(self) -> float | None:
        return self.readings.read("kv_cache") if self.readings is not None else None

    @property
    def ready(self) -> bool:
        return self.primary.engine is not None and not self.admission.draining

    @property
    def inflight(self) -> int:
        return len(self.admission.inflight)

    def begin_drain(self) -> None:
        self.admission.draining = True
        # Watchers (the control plane) take the pool out of routing before the health checks do.
        self.events.publish(Draining(time.time(), sorted(self.policy.actions)))

    def shutdown(self) -> None:
        self.faults.stop_stall()
        self.ladder.shutdown()

    # -- requests ----------------------------------------------------------------------------

    def note_bound_for(self, bound_for: str | None) -> None:
        """Count a generation request the mesh bound for another pool (a spill reaching us)."""
        if bound_for and bound_for != self.config.pool:
            self.metrics.spilled_in.labels(bound_for=bound_for[:64]).inc()

    def model_ids(self) -> list[str]:
        return [m.name for m in self.config.models]

    def serving_model(self) -> ModelEngine:
        """The model new requests for the primary get now."""
        return self.ladder.serving("degrade" in self.policy.actions)

    # -- breakers ----------------------------------------------------------------------------

    def _on_transition(self, t: Transition) -> None:
        event = BreakerChanged(time.time(), t.breaker, t.from_state.value, t.to_state.value, list(t.actions),
                               sorted(self.policy.actions), self.serving_model().config.name, t.reason, t.value)
        log.warning("breaker transition", extra=event.wire())
        self.events.publish(event)

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
            self.metrics.observe_pool(self, values, interval)
            if on_sample:
                on_sample(values)
            await self.ladder.apply_sleep_mode(self.serving_model() is not self.primary)
            await asyncio.sleep(interval)

    def state(self) -> dict:
        return {
            "pool": self.config.pool,
            "served_by": self.config.served_by,
            "ready": self.ready,
            "draining": self.admission.draining,
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
                    "kv_capacity_tokens": m.stats.kv_capacity_tokens,
                    "running": m.stats.running,
                    "waiting": m.stats.waiting,
                    # Time-bounded admission: its engine slots, the line and the measured rate.
                    "slots": self.admission.slots[m.config.name].snapshot(),
                }
                for m in self.ladder
            ],
            "breakers": [b.snapshot() for b in self.breakers],
            "faults": self.faults.snapshot(),
        }
