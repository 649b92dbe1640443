"""The control plane for plain Envoy, as a process: the watchers (watchers.py) report the policy
file and the pools' levels, `ControlPlane` turns the last good policy into a checked snapshot
(xds_snapshot.py), and the ADS server (ads_server.py) serves it to every connected Envoy over gRPC.

A valid edit of the policy file reaches Envoy as a new version once the file is stable (at once
after an atomic rename); an invalid one, or one that cannot be read at all, is logged with its
file:line: field reasons, counted, and Envoy keeps the last good config. A version Envoy refuses
(NACK) is logged with Envoy's reason and counted, and the last version it ACKed is served again.
`--metrics-port` serves those counters (cp_metrics.py) on 127.0.0.1. Degraded-mode routing
(`when_degraded`) is not the control plane's: the filter learns each pool's level from its
sidecars' responses and state endpoint and spills or sheds itself, in plain Envoy and in Istio
alike (docs/filter.md). The pool watchers (`--pool-admin`) only log the levels they see. If the
control plane dies, Envoy keeps serving its last config and resyncs when it is back.

    python -m infermesh.meshconfig.xds_server --policy FILE --port 18000 \\
        --listen-port 8080 --pool interactive=127.0.0.1:8101:8201 --pool batch=127.0.0.1:8102:8202 \\
        [--pool-admin interactive=http://127.0.0.1:8301 ...]

A pool named again in `--pool` (and `--pool-admin`) is its next replica: each replica is an
endpoint of the pool's clusters, and the pool counts as degraded only when every replica it has
been seen with is (the least degraded replica's level).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import signal
import sys
from pathlib import Path

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from infermesh.settings import XDS_PORT

from .ads_server import AdsServer
from .envoy_resources import FILTER_STATS_TAGS, LAYERED_RUNTIME
from .policy import Policy
from .watchers import PolicyFileWatcher, PoolWatcher, ReplicaLevels
from .xds_snapshot import MeshTarget, build_snapshot

log = logging.getLogger("infermesh.xds")


class ControlPlane:
    """The last good policy (every change rebuilds the snapshot; one that cannot be built, or is
    inconsistent, leaves the last good one served) and the pools' levels, logged as they change."""

    def __init__(self, target: MeshTarget, ads: AdsServer | None = None):
        self.target = target
        self.ads = ads or AdsServer()
        self.metrics = self.ads.metrics
        self.policy: Policy | None = None
        self.levels: dict[str, int] = {}
        self.rejections = 0

    @property
    def version(self) -> str | None:
        return self.ads.version

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy
        self.publish()

    def set_level(self, pool: str, level: int) -> None:
        if self.levels.get(pool) != level:
            # `pool_level`, not `level`: that key is the log line's own severity.
            log.warning("pool level changed", extra={"pool": pool, "pool_level": level, "was": self.levels.get(pool)})
            self.levels[pool] = level

    def publish(self) -> bool:
        if self.policy is None:
            return False
        try:
            snap = build_snapshot(self.policy, self.target)
        except Exception as e:  # a generator bug or a missing endpoint must not take the control plane down
            self.rejections += 1
            self.metrics.policy_rejections.labels("build").inc()
            log.exception("config generation failed; keeping the last good config", extra={"error": str(e), "kept": self.version})
            return False
        self.ads.set_snapshot(snap)
        return True


def xds_bootstrap(admin_port: int, xds_host: str, xds_port: int, node_id: str = "infermesh-local") -> dict:
    """Envoy bootstrap that takes listeners and clusters from this control plane (ADS)."""
    return {
        "node": {"id": node_id, "cluster": "infermesh"},
        "stats_config": {"stats_tags": copy.deepcopy(FILTER_STATS_TAGS)},
        "layered_runtime": copy.deepcopy(LAYERED_RUNTIME),
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                # Reconnect quickly after the control plane restarts (Envoy's default back-off
                # grows to 30 s); docs/drills.md, control-plane-kill, has the measured resync.
                "grpc_services": [{"envoy_grpc": {"cluster_name": "infermesh_xds", "retry_policy": {
                    "retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"}}}}],
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


async def serve(ads: AdsServer, watchers: list, host: str, port: int, metrics_port: int | None = None) -> int:
    """Serve ADS on host:port (and the metrics on 127.0.0.1:metrics_port) and run the watchers until SIGTERM/SIGINT."""
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    extra = {"port": bound, "version": ads.version}
    if metrics_port is not None:
        extra["metrics_port"] = ads.metrics.serve("127.0.0.1", metrics_port)
    log.info("control plane serving", extra=extra)
    tasks = [asyncio.create_task(w.run()) for w in watchers]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for t in tasks:
        t.cancel()
    await server.stop(0.5)
    return 0


def main(argv: list[str] | None = None) -> int:
    from infermesh import paths
    from infermesh.logs import setup_logging

    ap = argparse.ArgumentParser(prog="infermesh-xds", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=XDS_PORT)
    ap.add_argument("--listen-host", default="127.0.0.1")
    ap.add_argument("--listen-port", type=int, default=8080)
    ap.add_argument("--pool", action="append", default=[], help="NAME=HOST:HTTP_PORT[:GRPC_PORT] of a pool's sidecar (repeat)")
    ap.add_argument("--wasm", default=str(paths.filter_wasm()))
    ap.add_argument("--native-module", default=str(paths.filter_native_module()),
                    help="the filter as a dynamic module (a policy with filter.runtime: native)")
    ap.add_argument("--pool-admin", action="append", default=[], help="NAME=URL of a pool sidecar's admin API (repeat): its level changes are logged")
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="serve the control plane's Prometheus counters on 127.0.0.1:PORT/metrics (0: a free port, logged)")
    args = ap.parse_args(argv)
    setup_logging({"component": "xds"})
    logging.getLogger("infermesh.xds").setLevel(logging.INFO)
    endpoints: dict[str, list[tuple[str, int, int]]] = {}
    for spec in args.pool:  # a pool named again is its next replica
        name, _, hostports = spec.partition("=")
        host, http_port, grpc_port = (hostports.split(":") + ["0"])[:3]
        endpoints.setdefault(name, []).append((host, int(http_port), int(grpc_port)))
    cp = ControlPlane(MeshTarget(args.listen_host, args.listen_port, Path(args.wasm), endpoints, Path(args.native_module)))
    policy_watch = PolicyFileWatcher(Path(args.policy), cp.set_policy, cp.metrics)
    if not policy_watch.load() or cp.version is None:
        print("infermesh-xds: the policy is not usable at start; see the log", file=sys.stderr)
        return 2
    watchers: list = [policy_watch]
    levels = ReplicaLevels(cp.set_level)
    seen: dict[str, int] = {}
    for spec in args.pool_admin:  # in the order of that pool's --pool replicas
        pool, _, url = spec.partition("=")
        if pool not in endpoints:
            ap.error(f"--pool-admin {spec}: {pool!r} is not one of the --pool names {sorted(endpoints)}")
        i = seen[pool] = seen.get(pool, -1) + 1
        if i >= len(endpoints[pool]):
            ap.error(f"--pool-admin {spec}: more admin URLs than --pool replicas of {pool!r}")
        host, http_port, _ = endpoints[pool][i]
        watchers.append(PoolWatcher(pool, url, f"http://{host}:{http_port}/health", levels.reporter(i)))
    return asyncio.run(serve(cp.ads, watchers, args.host, args.port, args.metrics_port))


if __name__ == "__main__":
    sys.exit(main())
