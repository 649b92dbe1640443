"""Resource circuit breakers: degrade on pressure, before the errors, and recover by themselves.

A breaker watches one signal (GPU memory fraction, KV-cache use, CPU load, TTFT, error rate).

    CLOSED ──(signal > trip_above for sustain_s, with >= min_samples)──► OPEN
    OPEN: applies its first action; still over trip_above for another escalate_after_s
          ──► next action on its list (escalation), and so on
    OPEN ──(signal < recover_below for recover_sustain_s)──► one action undone; when none are
          left ──► HALF_OPEN
    HALF_OPEN: normal service for up to half_open_trials requests / half_open_timeout_s
          ──(no min_samples readings in a row above trip_above until then)──► CLOSED
          ──(min_samples readings in a row above trip_above)──► OPEN (first action), no sustain window

Hysteresis (trip above one threshold, recover only below a lower one held for a while) and
the sustain windows keep an oscillating signal from flapping. Time comes from an injected clock,
so tests drive every transition without sleeping.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# The breaker settings and the level order are shared with the mesh policy (infermesh/settings.py).
from infermesh.settings import ACTION_ORDER, Action, BreakerConfig, Signal

__all__ = ["ACTION_ORDER", "Action", "Breaker", "BreakerConfig", "Clock", "PoolPolicy", "Signal", "State", "Transition"]


class Clock(Protocol):
    def __call__(self) -> float: ...


class State(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class Transition:
    breaker: str
    at: float
    from_state: State
    to_state: State
    actions: tuple[str, ...]
    reason: str
    value: float | None


@dataclass
class Breaker:
    """One breaker's state machine. Feed it with `observe(value)`; read `state` and `actions`."""

    name: str
    config: BreakerConfig
    clock: Clock = time.monotonic
    on_transition: Callable[[Transition], None] | None = None

    state: State = State.CLOSED
    level: int = 0  # how many of config.actions are applied
    last_value: float | None = None
    # Runs of consecutive readings on one side of a threshold: (since, samples).
    _above_since: float | None = None
    _above_samples: int = 0
    _below_since: float | None = None
    _below_samples: int = 0
    _level_since: float = 0.0
    _half_open_since: float = 0.0
    _half_open_trials: int = 0
    state_since: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.state_since = self.clock()

    @property
    def actions(self) -> tuple[str, ...]:
        return tuple(self.config.actions[: self.level])

    def _move(self, to: State, reason: str, value: float | None) -> None:
        now = self.clock()
        t = Transition(self.name, now, self.state, to, (), reason, value)
        self.state = to
        self.state_since = now
        t.actions = self.actions
        if self.on_transition:
            self.on_transition(t)

    def _notify_level(self, reason: str, value: float | None) -> None:
        if self.on_transition:
            self.on_transition(Transition(self.name, self.clock(), self.state, self.state, self.actions, reason, value))

    def observe(self, value: float | None) -> None:
        """One reading. `None` means the source has nothing to say (no GPU, no recent traffic).

        While closed, silence is ignored. While open or half-open it counts as no pressure:
        otherwise a breaker opened by, say, high TTFT would hold the pool degraded for as long as
        no traffic arrives to measure it — and degrading itself reduces that traffic.
        """
        if value is None:
            if self.state is State.CLOSED:
                return
            value = 0.0
        now = self.clock()
        cfg = self.config
        self.last_value = value
        if value > cfg.trip_above:
            if self._above_since is None:
                self._above_since, self._above_samples = now, 0
            self._above_samples += 1
        else:
            self._above_since, self._above_samples = None, 0
        if value < cfg.recover_below:
            if self._below_since is None:
                self._below_since, self._below_samples = now, 0
            self._below_samples += 1
        else:
            self._below_since, self._below_samples = None, 0

        sustained_above = (
            self._above_since is not None and now - self._above_since >= cfg.sustain_s and self._above_samples >= cfg.min_samples
        )
        if self.state is State.CLOSED:
            if sustained_above:
                self.level = 1
                self._level_since = now
                self._move(State.OPEN, f"{cfg.signal} {value:.3g} above {cfg.trip_above:g} for {cfg.sustain_s:g}s", value)
        elif self.state is State.OPEN:
            held_below = (
                self._below_since is not None
                and now - self._below_since >= cfg.recover_sustain_s
                and self._below_samples >= cfg.min_samples
            )
            if held_below:
                self.level -= 1
                self._level_since = now
                # Each step back needs its own full hold below the recovery threshold.
                self._below_since, self._below_samples = now, 0
                if self.level == 0:
                    self._half_open_since, self._half_open_trials = now, 0
                    self._move(State.HALF_OPEN, f"{cfg.signal} {value:.3g} below {cfg.recover_below:g}", value)
                else:
                    self._notify_level(f"recovering: {cfg.signal} {value:.3g} below {cfg.recover_below:g}", value)
            elif (
                self._above_since is not None
                and self.level < len(cfg.actions)
                and now - max(self._level_since, self._above_since) >= cfg.escalate_after_s
            ):
                self.level += 1
                self._level_since = now
                self._notify_level(f"escalating: {cfg.signal} {value:.3g} still above {cfg.trip_above:g}", value)
        elif self.state is State.HALF_OPEN:
            if value > cfg.trip_above and self._above_samples >= cfg.min_samples:
                # Pressure is back: no sustain window, the trial failed; but min_samples readings
                # in a row, so one spike of a noisy signal does not re-open it (docs/breakers.md).
                self.level = 1
                self._level_since = now
                self._move(State.OPEN, f"half-open trial failed: {cfg.signal} {value:.3g} above {cfg.trip_above:g}", value)
            else:
                self._maybe_close(now, value)

    def trial_admitted(self) -> None:
        """A request was served normally while half-open."""
        if self.state is State.HALF_OPEN:
            self._half_open_trials += 1
            self._maybe_close(self.clock(), self.last_value)

    def _maybe_close(self, now: float, value: float | None) -> None:
        cfg = self.config
        if self._half_open_trials >= cfg.half_open_trials or now - self._half_open_since >= cfg.half_open_timeout_s:
            self._move(State.CLOSED, f"recovered ({self._half_open_trials} trials)", value)

    def snapshot(self) -> dict:
        return {
            "name": self.name,
            "signal": self.config.signal,
            "state": self.state.value,
            "actions": list(self.actions),
            "value": self.last_value,
            "trip_above": self.config.trip_above,
            "recover_below": self.config.recover_below,
            "since_s": round(self.clock() - self.state_since, 3),
            # How long the signal has been above trip_above without a break (None: it is not):
            # lets a drill tell when the threshold was crossed, as this breaker saw it.
            "above_s": None if self._above_since is None else round(self.clock() - self._above_since, 3),
        }


@dataclass
class PoolPolicy:
    """The union of what the open breakers ask for: the pool's degradation level."""

    breakers: list[Breaker]

    @property
    def actions(self) -> set[str]:
        return {a for b in self.breakers for a in b.actions}

    @property
    def level(self) -> int:
        return max((ACTION_ORDER[a] for a in self.actions), default=0)

    def reasons(self) -> list[str]:
        return [f"{b.name}:{b.config.signal}" for b in self.breakers if b.actions]
