"""The ADS server: Envoy's aggregated discovery stream, state of the world, over grpcio.

It serves whatever snapshot it was last given (`set_snapshot`) and speaks the protocol as Envoy
expects it, per stream and per resource type:

- the first request of a type subscribes it; it is answered unless Envoy already holds the
  current version (a reconnect after a control-plane restart with nothing changed);
- a request carrying the nonce of the latest response is an ACK (or, with `error_detail`, a
  NACK: logged with Envoy's reason and counted; that version is never served again, and if it is
  the one being served, the last snapshot Envoy ACKed (every type of one stream at that
  version) is served again to every stream, at its own version, so Envoy ends up on a config it
  took whole (Envoy may have applied part of a refused update); the next new snapshot is served as usual);
- a request with an older nonce is stale (a newer response is on its way) and is ignored;
- endpoints and routes are asked for by name and answered with those names only, and answered
  again, at the same version, when the names change (a cluster being warmed waits for them);
- a new snapshot is pushed to every stream at once, clusters before endpoints before listeners
  before routes, so nothing points at what Envoy does not have yet;
- a type it does not serve is logged once and left unanswered.

`StreamState` holds those rules with no I/O; `AdsServer` runs one per gRPC stream.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from google.protobuf import any_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from .cp_metrics import ControlPlaneMetrics
from .xds_snapshot import NAMED_TYPES, PUSH_ORDER, Snapshot

log = logging.getLogger("infermesh.xds")


@dataclass
class Subscription:
    """One resource type on one stream."""

    names: frozenset[str] | None
    """The names asked for (endpoints, routes); None for a wildcard type."""
    sent_version: str | None = None
    nonce: str = ""
    """The nonce of the latest response; only a request carrying it can ACK or NACK."""
    nacked_version: str | None = None
    """The version Envoy refused: not sent again on this stream."""
    acked_version: str | None = None
    """The version Envoy last took (ACKed, or named as held when it subscribed)."""


class StreamState:
    """The protocol state of one ADS stream: requests and snapshots in, responses out."""

    def __init__(self, peer: str = "", on_nack: Callable[[str, str | None, str], None] | None = None,
                 on_accept: Callable[[str], None] | None = None):
        self.peer = peer
        self.subscriptions: dict[str, Subscription] = {}
        self._nonce = 0
        self._unknown: set[str] = set()
        self._on_nack = on_nack or (lambda t, version, reason: None)
        """(type, the refused version, Envoy's error_detail message)."""
        self._on_accept = on_accept or (lambda version: None)
        """A version every subscribed type of this stream has ACKed."""

    def on_request(self, req: discovery_pb2.DiscoveryRequest, snap: Snapshot | None) -> list[discovery_pb2.DiscoveryResponse]:
        t = req.type_url
        if t not in PUSH_ORDER:
            if t not in self._unknown:
                self._unknown.add(t)
                log.warning("envoy asked for a type this control plane does not serve", extra={"type": t, "peer": self.peer})
            return []
        names = frozenset(req.resource_names) if t in NAMED_TYPES else None
        sub = self.subscriptions.get(t)
        if sub is None:
            sub = self.subscriptions[t] = Subscription(names, acked_version=req.version_info or None)
            log.info("envoy subscribed", extra={"type": t, "peer": self.peer, "has_version": req.version_info})
            # A reconnecting Envoy names the version it holds; for a wildcard type nothing is new.
            if snap is not None and (names is not None or req.version_info != snap.version):
                return [self._respond(t, snap)]
            return []
        if req.response_nonce != sub.nonce:
            return []  # stale: Envoy has not seen the latest response yet and will answer that one
        if req.HasField("error_detail"):
            sub.nacked_version = sub.sent_version
            sub.names = names
            log.error("envoy rejected a config (NACK)", extra={"type": t, "version": sub.sent_version, "kept": req.version_info,
                                                                "reason": req.error_detail.message, "peer": self.peer})
            self._on_nack(t, sub.sent_version, req.error_detail.message)
            return []
        sub.acked_version = req.version_info
        if req.version_info and all(s.acked_version == req.version_info for s in self.subscriptions.values()):
            self._on_accept(req.version_info)
        names_changed = names != sub.names
        sub.names = names
        if snap is None or snap.version == sub.nacked_version:
            return []
        if names_changed or sub.sent_version != snap.version:
            return [self._respond(t, snap)]
        return []

    def on_snapshot(self, snap: Snapshot) -> list[discovery_pb2.DiscoveryResponse]:
        out = []
        for t in PUSH_ORDER:
            sub = self.subscriptions.get(t)
            if sub is not None and snap.version not in (sub.sent_version, sub.nacked_version):
                out.append(self._respond(t, snap))
        return out

    def _respond(self, t: str, snap: Snapshot) -> discovery_pb2.DiscoveryResponse:
        sub = self.subscriptions[t]
        self._nonce += 1
        sub.nonce, sub.sent_version = str(self._nonce), snap.version
        resources = []
        for m in snap.named(t, sub.names):
            a = any_pb2.Any()
            a.Pack(m)
            resources.append(a)
        return discovery_pb2.DiscoveryResponse(version_info=snap.version, resources=resources, type_url=t, nonce=sub.nonce)


class AdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """Serves the latest snapshot to every connected Envoy; after a NACK of it, the last ACKed one."""

    def __init__(self, metrics: ControlPlaneMetrics | None = None) -> None:
        self.metrics = metrics or ControlPlaneMetrics()
        self.snapshot: Snapshot | None = None
        """The snapshot served."""
        self.accepted: Snapshot | None = None
        """The last snapshot an Envoy ACKed whole (every type of its stream)."""
        self.rejected: set[str] = set()
        """Versions an Envoy refused: never served again (an edit makes a new version)."""
        self.nacks = 0
        self._recent: dict[str, Snapshot] = {}
        """The last few snapshots served, by version: an ACK may come for one just replaced."""
        self._streams: set[asyncio.Event] = set()

    @property
    def version(self) -> str | None:
        return self.snapshot.version if self.snapshot else None

    def set_snapshot(self, snap: Snapshot) -> bool:
        """Serve `snap` from now on (it must be checked); True if it is a new version."""
        if self.snapshot is not None and snap.version == self.snapshot.version:
            return False
        if snap.version in self.rejected:
            log.error("envoy refused this config version before; keeping the one served",
                      extra={"version": snap.version, "kept": self.version})
            return False
        self._serve(snap)
        log.info("config version ready", extra={"version": snap.version})
        return True

    def _serve(self, snap: Snapshot) -> None:
        self.snapshot = snap
        self._recent[snap.version] = snap
        while len(self._recent) > 4:
            del self._recent[next(iter(self._recent))]
        for changed in self._streams:
            changed.set()

    def _accepted(self, version: str) -> None:
        if (snap := self._recent.get(version)) is not None and version not in self.rejected:
            self.accepted = snap

    def _nacked(self, type_url: str, version: str | None, reason: str) -> None:
        self.nacks += 1
        self.metrics.xds_nacks.labels(type_url.rsplit(".", 1)[-1]).inc()
        if version is None:
            return
        self.rejected.add(version)
        if self.accepted is not None and self.accepted.version == version:
            self.accepted = None  # refused after all (e.g. by another Envoy): nothing safe to go back to
        if self.snapshot is None or self.snapshot.version != version:
            return  # an older version: a newer one is already being served
        if self.accepted is None:
            log.error("envoy refused the config and none was ACKed before; it keeps what it has",
                      extra={"version": version, "reason": reason})
            return
        self.metrics.xds_rollbacks.inc()
        log.error("envoy refused the config; serving the last ACKed one again",
                  extra={"version": version, "type": type_url, "reason": reason, "served": self.accepted.version})
        self._serve(self.accepted)

    async def StreamAggregatedResources(self, request_iterator, context):
        async for response in self.stream(request_iterator, context.peer()):
            yield response

    async def stream(self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest], peer: str = "") -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        """One ADS stream: the responses to `requests` and to every new snapshot, until Envoy
        closes its side."""
        state = StreamState(peer, self._nacked, self._accepted)
        out: asyncio.Queue = asyncio.Queue()
        changed = asyncio.Event()
        self._streams.add(changed)

        async def read() -> None:
            try:
                async for req in requests:
                    for r in state.on_request(req, self.snapshot):
                        out.put_nowait(r)
            except Exception:  # noqa: BLE001 — the stream broke (or a bug): Envoy reconnects
                log.exception("ADS stream ended with an error", extra={"peer": peer})
            finally:
                out.put_nowait(None)

        async def push() -> None:
            while True:
                await changed.wait()
                changed.clear()
                if self.snapshot is not None:  # the latest only: versions in between are skipped
                    for r in state.on_snapshot(self.snapshot):
                        out.put_nowait(r)

        tasks = [asyncio.create_task(read()), asyncio.create_task(push())]
        try:
            while (msg := await out.get()) is not None:
                yield msg
        finally:
            for t in tasks:
                t.cancel()
            self._streams.discard(changed)
