"""Drill faults, all in one place: injected readings and the engine stall.

- An injected reading replaces a breaker signal's real source for a while (`PUT
  /admin/faults/{signal}`), so a drill can open a breaker on demand.
- The stall (`PUT /admin/faults/stall`) really slows the pool: the primary model's engine
  processes are stopped for part of every period, as an overloaded accelerator would stall them.

The admin API turns them on and off; `admin.allow_faults: false` refuses both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("infermesh.sidecar.faults")

STALL = "stall"
"""The fault name of the engine stall (every other name is a breaker signal)."""


@dataclass
class Fault:
    value: float
    until: float


class EngineStall:
    """Stops (SIGSTOP) the given processes for `duty` of every `period_s` until `duration_s` has
    passed. The slowness is real, so the sidecar's own TTFT, its breakers and the ladder see it as
    they would see a slow GPU. It always ends with the processes running (SIGCONT): on expiry, on
    `stop()`, and when its task is cancelled."""

    def __init__(self, pids: list[int], duty: float, duration_s: float, period_s: float, clock: Callable[[], float]):
        self.pids, self.duty, self.period_s, self.clock = pids, duty, period_s, clock
        self.until = clock() + duration_s
        self.task: asyncio.Task | None = None

    def _signal(self, sig) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    async def run(self) -> None:
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
        if self.task is not None:
            self.task.cancel()
        self._signal(signal.SIGCONT)

    def snapshot(self) -> dict | None:
        remaining = self.until - self.clock()
        if remaining <= 0 or (self.task is not None and self.task.done()):
            return None
        return {"value": self.duty, "period_s": self.period_s, "remaining_s": round(remaining, 2), "pids": self.pids}


class Faults:
    """The faults active on this pool: injected readings by signal, and at most one stall."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.active: dict[str, Fault] = {}
        self.stall: EngineStall | None = None

    def set(self, signal: str, value: float, duration_s: float) -> None:
        """Report `value` for `signal` instead of its real reading for `duration_s`."""
        self.active[signal] = Fault(value, self.clock() + duration_s)

    def get(self, signal: str) -> float | None:
        """The injected reading of `signal`, or None when none is active."""
        f = self.active.get(signal)
        if f is None:
            return None
        if self.clock() >= f.until:
            del self.active[signal]
            return None
        return f.value

    def start_stall(self, pids: list[int], duty: float, duration_s: float, period_s: float = 1.0) -> dict:
        """Stall these engine processes (see EngineStall); replaces a running stall."""
        self.stop_stall()
        if not pids:
            raise RuntimeError("the primary model's engine processes are not known")
        self.stall = EngineStall(pids, duty, duration_s, period_s, self.clock)
        self.stall.start()
        log.warning("engine stall injected", extra={"duty": duty, "duration_s": duration_s, "period_s": period_s, "pids": pids})
        return self.stall.snapshot() or {}

    def stop_stall(self) -> None:
        if self.stall is not None:
            self.stall.stop()
            self.stall = None

    def clear(self, name: str | None = None) -> None:
        """End one fault by name (a signal or `stall`), or every fault."""
        if name is None or name == STALL:
            self.stop_stall()
        if name is None:
            self.active.clear()
        else:
            self.active.pop(name, None)

    def snapshot(self) -> dict:
        now = self.clock()
        out = {k: {"value": f.value, "remaining_s": round(f.until - now, 2)} for k, f in self.active.items() if f.until > now}
        if self.stall is not None and (st := self.stall.snapshot()):
            out[STALL] = st
        return out
