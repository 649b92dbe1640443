"""Pool state events and the one bus that carries them to watchers.

A watcher (the admin API's `/admin/events` SSE stream, gRPC `Admin/WatchState`, the metrics)
subscribes a callback; `watch()` wraps that in a queue for async consumers. The JSON each event
writes (`wire()`) is what the control plane and the drills read: its keys must not change.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class BreakerChanged:
    """A breaker moved between states, or applied or undid one of its actions (from == to)."""

    at: float
    """Unix time."""
    breaker: str
    from_state: str
    to_state: str
    actions: list[str]
    """This breaker's actions after the change."""
    pool_actions: list[str]
    """The whole pool's actions after the change, sorted."""
    serving_model: str
    reason: str
    value: float | None

    def wire(self) -> dict:
        return {"at": self.at, "breaker": self.breaker, "from": self.from_state, "to": self.to_state, "actions": self.actions,
                "pool_actions": self.pool_actions, "serving_model": self.serving_model, "reason": self.reason, "value": self.value}


@dataclass(frozen=True)
class Draining:
    """The sidecar stopped taking new requests (SIGTERM): watchers route around it at once."""

    at: float
    pool_actions: list[str]

    def wire(self) -> dict:
        return {"at": self.at, "event": "draining", "ready": False, "draining": True, "pool_actions": self.pool_actions}


PoolEvent = BreakerChanged | Draining


class EventBus:
    """Delivers each published event to every subscriber, in order, on the caller's thread."""

    def __init__(self, history: int = 256):
        self._subscribers: list[Callable[[PoolEvent], None]] = []
        self.recent: deque[PoolEvent] = deque(maxlen=history)
        """The latest events, for tests and debugging."""

    def subscribe(self, callback: Callable[[PoolEvent], None]) -> Callable[[], None]:
        """Call `callback` with every later event; returns the function that unsubscribes it."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def publish(self, event: PoolEvent) -> None:
        self.recent.append(event)
        for cb in list(self._subscribers):
            cb(event)

    @contextlib.contextmanager
    def watch(self) -> Iterator[asyncio.Queue[PoolEvent]]:
        """A queue of the events published while the block runs (unbounded: events are rare)."""
        q: asyncio.Queue[PoolEvent] = asyncio.Queue()
        unsubscribe = self.subscribe(q.put_nowait)
        try:
            yield q
        finally:
            unsubscribe()
