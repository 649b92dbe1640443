"""The ADS server: Envoy's aggregated discovery stream, state of the world, over grpcio.

It serves whatever snapshot it was last given (`set_snapshot`) and speaks the protocol as Envoy
expects it, per stream and per resource type:

- the first request of a type subscribes it; it is answered unless Envoy already holds the
  current version (a reconnect after a control-plane restart with nothing changed);
- a request carrying the nonce of the latest response is an ACK (or, with `error_detail`, a
  NACK: logged, and that version is never sent again on this stream; the next snapshot is);
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


class StreamState:
    """The protocol state of one ADS stream: requests and snapshots in, responses out."""

    def __init__(self, peer: str = "", on_nack: Callable[[], None] | None = None):
        self.peer = peer
        self.subscriptions: dict[str, Subscription] = {}
        self._nonce = 0
        self._unknown: set[str] = set()
        self._on_nack = on_nack or (lambda: None)

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
            sub = self.subscriptions[t] = Subscription(names)
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
            self._on_nack()
            log.error("envoy rejected a config (NACK)", extra={"type": t, "version": sub.sent_version, "kept": req.version_info,
                                                                "reason": req.error_detail.message, "peer": self.peer})
            return []
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
    """Serves the latest snapshot to every connected Envoy."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self.nacks = 0
        self._streams: set[asyncio.Event] = set()

    @property
    def version(self) -> str | None:
        return self.snapshot.version if self.snapshot else None

    def set_snapshot(self, snap: Snapshot) -> bool:
        """Serve `snap` from now on (it must be checked); True if it is a new version."""
        if self.snapshot is not None and snap.version == self.snapshot.version:
            return False
        self.snapshot = snap
        log.info("config version ready", extra={"version": snap.version})
        for changed in self._streams:
            changed.set()
        return True

    def _nacked(self) -> None:
        self.nacks += 1

    async def StreamAggregatedResources(self, request_iterator, context):
        async for response in self.stream(request_iterator, context.peer()):
            yield response

    async def stream(self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest], peer: str = "") -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        """One ADS stream: the responses to `requests` and to every new snapshot, until Envoy
        closes its side."""
        state = StreamState(peer, self._nacked)
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
