"""A control plane for plain Envoy: ADS (aggregated discovery, state of the world) over grpcio,
built on the Envoy protobufs from PyPI (xds-protos).

It serves the listener (with the Wasm filter and the per-pool routes inline) and one cluster per
pool, all generated from the policy file — the same generators as the static bootstrap. It
watches the file: a valid edit reaches Envoy as a new version at once; an invalid one is logged
with its file:line: field reasons and Envoy keeps the last good config. Envoy NACKs are logged
and never retried with the same version. If the control plane dies, Envoy keeps serving its last
config and resyncs when the control plane is back.

    python -m infermesh.meshconfig.xds_server --policy FILE --port 18000 \\
        --listen-port 8080 --pool interactive=127.0.0.1:8101 --pool batch=127.0.0.1:8102
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import any_pb2, json_format

# The typed configs inside listeners/clusters must be known to the descriptor pool before
# json_format can pack them into Any.
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from .envoy_bootstrap import ROUTE_CONFIG_NAME, MeshListener, PoolEndpoint, bootstrap, route_config
from .policy import Policy, PolicyError, load_policy

log = logging.getLogger("infermesh.xds")

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
# Clusters before listeners before routes: nothing may point at what Envoy does not have yet.
PUSH_ORDER = {CLUSTER_TYPE: 0, LISTENER_TYPE: 1, ROUTE_TYPE: 2}


@dataclass(frozen=True)
class Snapshot:
    version: str
    resources: dict[str, list]  # type_url -> protobuf messages


@dataclass
class MeshTarget:
    """What the policy does not say: where things run (ports, the module's path)."""

    listen_host: str
    listen_port: int
    wasm_path: Path
    endpoints: dict[str, tuple[str, int]]  # pool -> (host, port)


def build_snapshot(policy: Policy, target: MeshTarget, levels: dict[str, int] | None = None) -> Snapshot:
    spill, shed = policy.degraded_overlay(levels or {})
    missing = set(policy.pools) - set(target.endpoints)
    if missing:
        raise ValueError(f"no endpoint given for pools {sorted(missing)}")
    listener = MeshListener(
        listen_host=target.listen_host,
        listen_port=target.listen_port,
        admin_port=0,
        wasm_path=target.wasm_path,
        filter_config=policy.filter_config(),
        pools=[PoolEndpoint(name, *target.endpoints[name]) for name in policy.pools],
        default_pool=policy.default_pool,
        spill=spill,
        shed_classes=shed,
    )
    static = bootstrap(listener)["static_resources"]
    # Routes over RDS: a route change (a policy edit, a degraded pool) then updates the table in
    # place instead of replacing the listener and draining its connections.
    for l in static["listeners"]:
        hcm = l["filter_chains"][0]["filters"][0]["typed_config"]
        hcm.pop("route_config")
        hcm["rds"] = {"config_source": {"ads": {}, "resource_api_version": "V3"}, "route_config_name": ROUTE_CONFIG_NAME}
    listeners = [json_format.ParseDict(l, listener_pb2.Listener()) for l in static["listeners"]]
    clusters = [json_format.ParseDict(c, cluster_pb2.Cluster()) for c in static["clusters"]]
    routes = [json_format.ParseDict(route_config(listener), route_pb2.RouteConfiguration())]
    digest = hashlib.sha256()
    for m in listeners + clusters + routes:
        digest.update(m.SerializeToString(deterministic=True))
    if spill or shed:
        log.warning("degraded-mode routing", extra={"spill": spill, "shed_classes": shed, "levels": levels})
    return Snapshot(digest.hexdigest()[:12], {LISTENER_TYPE: listeners, CLUSTER_TYPE: clusters, ROUTE_TYPE: routes})


class ControlPlane(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, policy_path: Path, target: MeshTarget, pool_admins: dict[str, str] | None = None):
        self.policy_path = policy_path
        self.target = target
        self.pool_admins = pool_admins or {}
        self.levels: dict[str, int] = {}
        self.policy: Policy | None = None  # the last good one
        self.snapshot: Snapshot | None = None
        self._subscribers: set[asyncio.Queue] = set()
        self._file_sig: tuple | None = None
        self.rejections = 0
        self.nacks = 0

    # -- configuration ------------------------------------------------------------------------

    def file_signature(self) -> tuple | None:
        try:
            st = self.policy_path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def load_policy_file(self) -> bool:
        """Read and validate the policy file; a rejected one leaves the last good policy in use."""
        self._file_sig = self.file_signature()
        try:
            policy = load_policy(self.policy_path)
        except PolicyError as e:
            self.rejections += 1
            log.error("policy rejected; keeping the last good config", extra={"problems": str(e), "kept": self.version})
            return False
        self.policy = policy
        return self.publish()

    def publish(self) -> bool:
        """Rebuild the resources from the last good policy and the pools' levels; push if new."""
        if self.policy is None:
            return False
        try:
            snap = build_snapshot(self.policy, self.target, self.levels)
        except Exception as e:  # a generator bug or a missing endpoint must not take the control plane down
            self.rejections += 1
            log.exception("config generation failed; keeping the last good config", extra={"error": str(e)})
            return False
        if self.snapshot is None or snap.version != self.snapshot.version:
            self.snapshot = snap
            log.info("config version ready", extra={"version": snap.version})
            for q in list(self._subscribers):
                q.put_nowait(snap)
        return True

    @property
    def version(self) -> str | None:
        return self.snapshot.version if self.snapshot else None

    async def watch_file(self, interval: float = 0.1) -> None:
        while True:
            sig = self.file_signature()
            if sig is not None and sig != self._file_sig:
                self.load_policy_file()
            await asyncio.sleep(interval)

    async def watch_pool(self, pool: str, admin_url: str) -> None:
        """Follow one pool's state over its sidecar's admin event stream; re-route on changes."""
        import httpx

        from infermesh.sidecar.breakers import ACTION_ORDER

        while True:
            try:
                async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=60.0)) as client:
                    async with client.stream("GET", admin_url + "/admin/events") as r:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            ev = json.loads(line[6:])
                            level = ev["level"] if "level" in ev else max((ACTION_ORDER[a] for a in ev.get("pool_actions", [])), default=0)
                            if self.levels.get(pool) != level:
                                log.warning("pool level changed", extra={"pool": pool, "level": level})
                                self.levels[pool] = level
                                self.publish()
            except (httpx.HTTPError, OSError, ValueError):
                pass  # the sidecar is starting or restarting: keep the last known level, retry
            await asyncio.sleep(0.5)

    # -- ADS ----------------------------------------------------------------------------------

    async def StreamAggregatedResources(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        updates: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(updates)
        subscribed: set[str] = set()
        sent: dict[str, str] = {}  # type_url -> version sent
        nonce = 0
        peer = context.peer()

        def respond(type_url: str) -> None:
            nonlocal nonce
            snap = self.snapshot
            if snap is None or type_url not in snap.resources:
                return
            nonce += 1
            resources = []
            for m in snap.resources[type_url]:
                a = any_pb2.Any()
                a.Pack(m)
                resources.append(a)
            sent[type_url] = snap.version
            out.put_nowait(discovery_pb2.DiscoveryResponse(
                version_info=snap.version, resources=resources, type_url=type_url, nonce=str(nonce)))

        async def read_requests():
            async for req in request_iterator:
                t = req.type_url
                if req.HasField("error_detail") and req.error_detail.code != 0:
                    self.nacks += 1
                    log.error("envoy rejected a config (NACK)", extra={"type": t, "version": sent.get(t),
                                                                        "kept": req.version_info, "reason": req.error_detail.message})
                    continue
                if t not in subscribed:
                    subscribed.add(t)
                    log.info("envoy subscribed", extra={"type": t, "peer": peer, "has_version": req.version_info})
                if self.snapshot and sent.get(t) != self.snapshot.version and req.version_info != self.snapshot.version:
                    respond(t)
            out.put_nowait(None)

        async def push_updates():
            while True:
                await updates.get()
                # Clusters before listeners: a listener must not point at a cluster Envoy lacks.
                for t in sorted(subscribed, key=lambda x: PUSH_ORDER.get(x, 9)):
                    if self.snapshot and sent.get(t) != self.snapshot.version:
                        respond(t)

        reader = asyncio.create_task(read_requests())
        pusher = asyncio.create_task(push_updates())
        try:
            while True:
                msg = await out.get()
                if msg is None:
                    return
                yield msg
        finally:
            reader.cancel()
            pusher.cancel()
            self._subscribers.discard(updates)


def xds_bootstrap(admin_port: int, xds_host: str, xds_port: int, node_id: str = "infermesh-local") -> dict:
    """Envoy bootstrap that takes listeners and clusters from the control plane (ADS)."""
    from .envoy_bootstrap import FILTER_STATS_TAGS

    return {
        "node": {"id": node_id, "cluster": "infermesh"},
        "stats_config": {"stats_tags": FILTER_STATS_TAGS},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "infermesh_xds"}}],
                "set_node_on_first_message_only": True,
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "static_resources": {
            "clusters": [{
                "name": "infermesh_xds",
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                },
                "load_assignment": {
                    "cluster_name": "infermesh_xds",
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": xds_host, "port_value": xds_port}}}}]}],
                },
            }],
        },
    }


async def serve(cp: ControlPlane, host: str, port: int) -> int:
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(cp, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    log.info("control plane serving", extra={"port": bound, "policy": str(cp.policy_path), "version": cp.version})
    watcher = asyncio.create_task(cp.watch_file())
    pool_watchers = [asyncio.create_task(cp.watch_pool(pool, url)) for pool, url in cp.pool_admins.items()]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    watcher.cancel()
    for t in pool_watchers:
        t.cancel()
    await server.stop(0.5)
    return 0


def main(argv: list[str] | None = None) -> int:
    from infermesh import paths
    from infermesh.sidecar.server import setup_logging

    ap = argparse.ArgumentParser(prog="infermesh-xds", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18000)
    ap.add_argument("--listen-host", default="127.0.0.1")
    ap.add_argument("--listen-port", type=int, default=8080)
    ap.add_argument("--pool", action="append", default=[], help="NAME=HOST:PORT of a pool's sidecar (repeat)")
    ap.add_argument("--wasm", default=str(paths.filter_wasm()))
    ap.add_argument("--pool-admin", action="append", default=[], help="NAME=URL of a pool sidecar's admin API (repeat): its state drives degraded-mode routing")
    args = ap.parse_args(argv)
    setup_logging({"component": "xds"})
    logging.getLogger("infermesh.xds").setLevel(logging.INFO)
    endpoints = {}
    for spec in args.pool:
        name, _, hostport = spec.partition("=")
        host, _, port = hostport.rpartition(":")
        endpoints[name] = (host, int(port))
    admins = dict(spec.split("=", 1) for spec in args.pool_admin)
    cp = ControlPlane(Path(args.policy), MeshTarget(args.listen_host, args.listen_port, Path(args.wasm), endpoints), admins)
    if not cp.load_policy_file():
        print("infermesh-xds: the policy is not usable at start; see the log", file=sys.stderr)
        return 2
    return asyncio.run(serve(cp, args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
