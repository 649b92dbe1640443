"""Admission: whether a request is served, by which model, decided before any byte of the response.

It refuses while loading or draining, applies the breakers' actions (`critical_only` keeps only
the top class, `shed` refuses sheddable classes), the concurrency limit and unique request ids,
and picks the model (the ladder's fallback while the pool is degraded). It also keeps the table
of requests in flight, which the lifecycle empties on release.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

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


class AdmissionControl:
    def __init__(self, config: SidecarConfig, ladder: Ladder, breakers: list[Breaker], policy: PoolPolicy):
        self.config, self.ladder, self.breakers, self.policy = config, ladder, breakers, policy
        self.inflight: dict[str, ModelEngine] = {}
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
        for b in self.breakers:
            if b.state is State.HALF_OPEN:
                b.trial_admitted()
        self.inflight[rid] = target
        target.inflight += 1
        req.request_id = rid
        req.request_class = cls
        return Admission(rid, target, cls, degraded, reason)

    def forget(self, request_id: str) -> None:
        """Free the request's slot. Idempotent."""
        target = self.inflight.pop(request_id, None)
        if target is not None:
            target.inflight -= 1
