"""The control plane's snapshot: assembled from the Envoy parts in the RDS/EDS form, checked for
consistency before it is served. A pool's level changes no route: the filter applies
`when_degraded` (filter/src/pool_state.rs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from envoy.config.route.v3 import route_pb2

from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy
from infermesh.meshconfig.xds_snapshot import (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, InconsistentSnapshot,
                                               MeshTarget, Snapshot, build_snapshot, resource_name)

POLICY = load_policy(LOCAL_POLICY)
TARGET = MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {"interactive": ("127.0.0.1", 8101, 8201), "batch": ("127.0.0.1", 8102, 8202)})


def _routes(snap: Snapshot) -> dict[str, str]:
    """route name -> cluster (or "429" for a shed route)."""
    vh = snap.resources[ROUTE_TYPE][0].virtual_hosts[0]
    return {r.name: r.route.cluster if r.HasField("route") else str(r.direct_response.status) for r in vh.routes}


def test_the_snapshot_serves_routes_over_rds_and_endpoints_over_eds():
    snap = build_snapshot(POLICY, TARGET)
    clusters = snap.resources[CLUSTER_TYPE]
    # The pools' clusters, then the filter's probe cluster of interactive (which fails over).
    assert [c.name for c in clusters] == ["pool_interactive", "pool_interactive_grpc", "pool_batch", "pool_batch_grpc", "pool_interactive_state"]
    assert all(c.eds_cluster_config.service_name == c.name and not c.HasField("load_assignment") for c in clusters)
    assert sorted(resource_name(e) for e in snap.resources[ENDPOINT_TYPE]) == sorted(c.name for c in clusters)
    assert [r.name for r in snap.resources[ROUTE_TYPE]] == ["infermesh"]
    assert len(snap.resources[LISTENER_TYPE]) == 1
    assert build_snapshot(POLICY, TARGET).version == snap.version, "the same config, the same version"


def test_the_served_routes_never_spill_or_shed_themselves():
    routes = _routes(build_snapshot(POLICY, TARGET))
    assert routes["class-pool-interactive"] == "pool_interactive" and "429" not in routes.values()


def test_a_pool_without_an_endpoint_is_refused_by_name():
    with pytest.raises(ValueError, match="interactive"):
        build_snapshot(POLICY, MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {"batch": ("127.0.0.1", 1, 0)}))


def _without(snap: Snapshot, type_url: str, name: str) -> Snapshot:
    return Snapshot("x", dict(snap.resources, **{type_url: [m for m in snap.resources[type_url] if resource_name(m) != name]}))


@pytest.mark.parametrize("broken, why", [
    (lambda s: _without(s, ENDPOINT_TYPE, "pool_batch_grpc"), r"clusters \['pool_batch_grpc'\] have no endpoints"),
    (lambda s: _without(s, CLUSTER_TYPE, "pool_batch_grpc"), "endpoints .*pool_batch_grpc.* belong to no EDS cluster"),
    (lambda s: _without(_without(s, CLUSTER_TYPE, "pool_batch"), ENDPOINT_TYPE, "pool_batch"), "unknown cluster 'pool_batch'"),
    (lambda s: _without(s, ROUTE_TYPE, "infermesh"), "unknown route table 'infermesh'"),
    (lambda s: Snapshot("x", dict(s.resources, **{CLUSTER_TYPE: s.resources[CLUSTER_TYPE] * 2})), "duplicate names"),
])
def test_an_inconsistent_snapshot_is_refused_before_it_is_served(broken, why):
    with pytest.raises(InconsistentSnapshot, match=why):
        broken(build_snapshot(POLICY, TARGET)).check()


def test_a_route_to_a_cluster_the_snapshot_lacks_is_refused():
    snap = build_snapshot(POLICY, TARGET)
    rc = route_pb2.RouteConfiguration()
    rc.CopyFrom(snap.resources[ROUTE_TYPE][0])
    rc.virtual_hosts[0].routes[0].route.cluster = "pool_nowhere"
    with pytest.raises(InconsistentSnapshot, match="pool_nowhere"):
        Snapshot("x", dict(snap.resources, **{ROUTE_TYPE: [rc]})).check()


def test_building_a_snapshot_leaves_the_shared_parts_as_they_were():
    # protobuf's ParseDict deletes and re-adds an Any's "@type" in the dict it reads; shared
    # constants of the parts came back reordered, and the chart's generated values with them.
    # A fresh interpreter: earlier tests in this one have built snapshots already.
    script = """
import json
from pathlib import Path
from infermesh.meshconfig import istio
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy
from infermesh.meshconfig.xds_snapshot import MeshTarget, build_snapshot
policy = load_policy(LOCAL_POLICY)
before = json.dumps(istio.chart_parts(policy))
build_snapshot(policy, MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {p: ("127.0.0.1", 8101 + i, 8201 + i) for i, p in enumerate(policy.pools)}))
print(json.dumps(istio.chart_parts(policy)) == before)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
