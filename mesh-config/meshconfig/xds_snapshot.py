"""The control plane's snapshot: one consistent set of xDS resources (listener, route table,
clusters, endpoints) for one policy, assembled from the parts of
envoy_resources.py in their dynamic form: routes over RDS (a route change updates the table in
place instead of replacing the listener), endpoints over EDS (a moved sidecar or a failover
change touches no cluster). `Snapshot.check()` refuses a set that points at what it lacks, before
it is ever served.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

# The typed configs inside listeners/clusters must be known to the descriptor pool before
# json_format can pack them into Any.
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import extension_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.dynamic_modules.v3 import dynamic_modules_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import header_mutation_pb2  # noqa: F401
from envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3 import client_side_weighted_round_robin_pb2  # noqa: F401
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401

from .envoy_resources import (
    ADS_SOURCE,
    MeshListener,
    PoolEndpoint,
    Routing,
    cluster,
    http_connection_manager,
    listener,
    load_assignment,
    pool_clusters,
    state_cluster_pools,
    state_clusters,
    state_load_assignment,
    rds_routes,
    route_config,
)
from .policy import Policy

log = logging.getLogger("infermesh.xds")

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
FILTER_TYPE = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
# Clusters, their endpoints, the filter's config (ECDS), listeners, routes: nothing may point at
# what Envoy does not have yet.
PUSH_ORDER = (CLUSTER_TYPE, ENDPOINT_TYPE, FILTER_TYPE, LISTENER_TYPE, ROUTE_TYPE)
# Listeners and clusters are asked for by wildcard; endpoints, the filter's config and routes by name.
NAMED_TYPES = frozenset({ENDPOINT_TYPE, FILTER_TYPE, ROUTE_TYPE})

# The infermesh filter's name in the listener, in either runtime: its config (Wasm or the native
# module, the policy's rules) comes over ECDS, so a filter change never replaces the listener.
# A replaced listener drains and then cuts what is still in flight on its connections, and Envoy
# times that drain from before the new filter chain was built (a Wasm compile of seconds).
FILTER_EXTENSION = "infermesh.filter"
FILTER_TYPE_URLS = [
    "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
    "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
]


class InconsistentSnapshot(ValueError):
    """A snapshot that points at a resource it does not hold; the message names both."""


def discovered_filter(hcm: dict, routes: dict, filter_name: str) -> tuple[dict, dict, dict]:
    """The HCM and route table with the infermesh filter (named `filter_name`) fetched over ECDS
    as FILTER_EXTENSION, and that ECDS resource: (hcm, routes, TypedExtensionConfig)."""
    hcm, routes = copy.deepcopy(hcm), copy.deepcopy(routes)
    [i] = [i for i, f in enumerate(hcm["http_filters"]) if f["name"] == filter_name]
    ecds = {"name": FILTER_EXTENSION, "typed_config": hcm["http_filters"][i]["typed_config"]}
    hcm["http_filters"][i] = {"name": FILTER_EXTENSION, "config_discovery": {"config_source": copy.deepcopy(ADS_SOURCE), "type_urls": list(FILTER_TYPE_URLS)}}
    for vh in routes.get("virtual_hosts", []):
        for r in vh.get("routes", []):
            per = r.get("typed_per_filter_config", {})
            if filter_name in per:
                per[FILTER_EXTENSION] = per.pop(filter_name)
    return hcm, routes, ecds


def resource_name(m) -> str:
    return m.cluster_name if isinstance(m, endpoint_pb2.ClusterLoadAssignment) else m.name


@dataclass(frozen=True)
class Snapshot:
    version: str
    """A digest of every resource: the same config always has the same version."""
    resources: dict[str, list]
    """type_url -> protobuf messages."""

    def named(self, type_url: str, names: frozenset[str] | None = None) -> list:
        """The resources of a type; of a named type, only those in `names` (None: all)."""
        items = self.resources.get(type_url, [])
        return items if names is None else [m for m in items if resource_name(m) in names]

    def check(self) -> "Snapshot":
        """Raise InconsistentSnapshot unless every reference resolves inside the snapshot: each
        route's cluster exists, each EDS cluster has its endpoints, each endpoint set a cluster,
        each listener's RDS name a route table, each discovered filter its config (ECDS), and no name is used twice."""
        names = {}
        for t in PUSH_ORDER:
            got = [resource_name(m) for m in self.resources.get(t, [])]
            dup = {n for n in got if got.count(n) > 1}
            if dup:
                raise InconsistentSnapshot(f"{t.rsplit('.', 1)[-1]}: duplicate names {sorted(dup)}")
            names[t] = set(got)
        eds = set()
        for c in self.resources.get(CLUSTER_TYPE, []):
            if c.type == cluster_pb2.Cluster.EDS:
                eds.add(c.eds_cluster_config.service_name or c.name)
        if eds - names[ENDPOINT_TYPE]:
            raise InconsistentSnapshot(f"clusters {sorted(eds - names[ENDPOINT_TYPE])} have no endpoints")
        if names[ENDPOINT_TYPE] - eds:
            raise InconsistentSnapshot(f"endpoints {sorted(names[ENDPOINT_TYPE] - eds)} belong to no EDS cluster")
        for rc in self.resources.get(ROUTE_TYPE, []):
            for vh in rc.virtual_hosts:
                for r in vh.routes:
                    if r.HasField("route") and r.route.cluster not in names[CLUSTER_TYPE]:
                        raise InconsistentSnapshot(f"route {rc.name}/{r.name} points at the unknown cluster {r.route.cluster!r}")
        for lst in self.resources.get(LISTENER_TYPE, []):
            for chain in lst.filter_chains:
                for f in chain.filters:
                    hcm = http_connection_manager_pb2.HttpConnectionManager()
                    if f.typed_config.Unpack(hcm) and hcm.HasField("rds") and hcm.rds.route_config_name not in names[ROUTE_TYPE]:
                        raise InconsistentSnapshot(f"listener {lst.name} asks for the unknown route table {hcm.rds.route_config_name!r}")
                    for hf in hcm.http_filters if f.typed_config.Unpack(hcm) else ():
                        if hf.HasField("config_discovery") and hf.name not in names[FILTER_TYPE]:
                            raise InconsistentSnapshot(f"listener {lst.name} asks for the unknown filter config {hf.name!r}")
        return self


@dataclass
class MeshTarget:
    """What the policy does not say: where things run (ports, the module's path)."""

    listen_host: str
    listen_port: int
    wasm_path: Path
    endpoints: dict[str, tuple[str, int, int] | list[tuple[str, int, int]]]
    """pool -> (host, HTTP port, gRPC port or 0), or a list of them: one per replica."""
    native_module_path: Path | None = None
    """The filter as a dynamic module, for a policy with `filter.runtime: native` (Envoy loads it
    from its own environment, envoy_resources.native_module_env: this is only checked to exist)."""

    def replicas(self, pool: str) -> list[tuple[str, int, int]]:
        e = self.endpoints[pool]
        return [e] if isinstance(e, tuple) else list(e)


def mesh_listener(policy: Policy, target: MeshTarget) -> MeshListener:
    """The parts' input for a policy and the target. The pools' levels are not in it: the filter
    applies `when_degraded` itself (docs/filter.md), so a degraded pool changes no route."""
    missing = set(policy.pools) - set(target.endpoints)
    if missing:
        raise ValueError(f"no endpoint given for pools {sorted(missing)}")
    native = policy.filter.runtime == "native"
    if native and (target.native_module_path is None or not target.native_module_path.exists()):
        # Checked here, not left to Envoy: a policy that cannot load is refused before it is served.
        raise ValueError(f"filter.runtime: native: the module {target.native_module_path} is missing (build it: scripts/build-native-filter.sh)")
    return MeshListener(
        listen_host=target.listen_host,
        listen_port=target.listen_port,
        admin_port=0,
        wasm_path=target.wasm_path,
        filter_runtime=policy.filter.runtime,
        filter_config=policy.filter_config(),
        pools=[PoolEndpoint.of(name, target.replicas(name)) for name in policy.pools],
        default_pool=policy.default_pool,
        failover=policy.failover(),
        spill_levels=policy.spill_levels(),
        routing=Routing.from_policy(policy),
        tracing=policy.tracing,
    )


def build_snapshot(policy: Policy, target: MeshTarget) -> Snapshot:
    """The checked snapshot for a policy and the target."""
    m = mesh_listener(policy, target)

    # ParseDict deletes and re-adds each Any's "@type" in the dict it reads: the parts are fresh
    # dicts per call, so that stays in these (mesh-config/tests/test_generation_history.py).
    parse = json_format.ParseDict

    hcm, routes, ecds = discovered_filter(http_connection_manager(m, rds_routes()), route_config(m), m.filter_name)
    resources = {
        CLUSTER_TYPE: [parse(c, cluster_pb2.Cluster()) for c in [*(cluster(m, p, grpc, eds=True) for p, grpc in pool_clusters(m)),
                                                                    *state_clusters(m, eds=True)]],
        ENDPOINT_TYPE: [parse(e, endpoint_pb2.ClusterLoadAssignment()) for e in [*(load_assignment(m, p.pool, grpc) for p, grpc in pool_clusters(m)),
                                                                                 *(state_load_assignment(m, p) for p in state_cluster_pools(m))]],
        FILTER_TYPE: [parse(ecds, extension_pb2.TypedExtensionConfig())],
        LISTENER_TYPE: [parse(listener(m, hcm), listener_pb2.Listener())],
        ROUTE_TYPE: [parse(routes, route_pb2.RouteConfiguration())],
    }
    digest = hashlib.sha256()
    for t in (LISTENER_TYPE, CLUSTER_TYPE, ENDPOINT_TYPE, FILTER_TYPE, ROUTE_TYPE):
        for msg in resources[t]:
            digest.update(msg.SerializeToString(deterministic=True))
    return Snapshot(digest.hexdigest()[:12], resources).check()
