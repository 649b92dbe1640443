"""Pools of many replicas: each replica its own sidecar (ports, `instance`) and its own endpoint of
the pool's clusters, in the static bootstrap and the control plane's snapshot; the pool's level is
its least degraded replica's."""

from __future__ import annotations

from pathlib import Path

from infermesh.launcher import LocalMesh, plan_on_free_ports
from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import LEVEL_DOWN, LOCAL_POLICY, load_policy, parse_policy
from infermesh.meshconfig.watchers import ReplicaLevels
from infermesh.meshconfig.xds_snapshot import ENDPOINT_TYPE, MeshTarget, build_snapshot


def two_replica_policy(tmp_path: Path) -> Path:
    text = LOCAL_POLICY.read_text().replace("  interactive:\n    models:", "  interactive:\n    replicas: 2\n    models:", 1)
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    assert load_policy(path).pools["interactive"].replicas == 2
    return path


def _ports(eps: list[dict]) -> list[int]:
    return [e["endpoint"]["address"]["socket_address"]["port_value"] for e in eps]


def pool_clusters_of(b: dict) -> list[dict]:
    """The pools' traffic clusters (not the filter's probe clusters, `pool_NAME_state`)."""
    return [c for c in b["static_resources"]["clusters"] if not c["name"].endswith("_state")]


def test_each_replica_gets_its_own_ports_instance_and_child(tmp_path):
    path = two_replica_policy(tmp_path)
    plan = LocalMeshPlan(policy_path=path)
    assert [(p.name, p.replica, p.key) for p in plan.pools] == [
        ("interactive", 0, "interactive"), ("interactive", 1, "interactive.1"), ("batch", 0, "batch")]
    ports = [port for p in plan.pools for port in (p.http_port, p.grpc_port, p.admin_port, p.admin_grpc_port)]
    assert len(set(ports)) == len(ports)
    cfgs = [plan.sidecar_config(p, tmp_path) for p in plan.pools]
    assert [(c["pool"], c["instance"]) for c in cfgs] == [("interactive", "0"), ("interactive", "1"), ("batch", "0")]
    assert LocalMesh.sidecar_name("interactive", 0) == "sidecar-interactive"
    assert LocalMesh.sidecar_name("interactive", 1) == "sidecar-interactive.1"
    free = plan_on_free_ports(path)
    assert [(p.name, p.replica) for p in free.pools] == [(p.name, p.replica) for p in plan.pools]


def test_one_replica_is_the_default_and_changes_nothing():
    plan = LocalMeshPlan()
    assert [(p.name, p.replica) for p in plan.pools] == [("interactive", 0), ("batch", 0)]
    assert [len(p.replicas) for p in plan.listener(Path("/x.wasm")).pools] == [1, 1]


def test_replicas_must_be_at_least_one():
    text = LOCAL_POLICY.read_text().replace("  batch:\n    models:", "  batch:\n    replicas: 0\n    models:", 1)
    try:
        parse_policy(text, "p.yaml")
    except Exception as e:  # noqa: BLE001
        assert "pools.batch.replicas" in str(e)
    else:
        raise AssertionError("replicas: 0 was accepted")


def test_every_replica_is_an_endpoint_of_the_pool_and_of_the_failover_priority(tmp_path):
    plan = LocalMeshPlan(policy_path=two_replica_policy(tmp_path))
    b = bootstrap(plan.listener(Path("/x.wasm")))
    clusters = {c["name"]: c for c in b["static_resources"]["clusters"]}
    by_prio = {e.get("priority", 0): e["lb_endpoints"] for e in clusters["pool_interactive"]["load_assignment"]["endpoints"]}
    assert _ports(by_prio[0]) == [p.http_port for p in plan.replicas("interactive")]
    assert _ports(by_prio[1]) == [plan.replica("batch").http_port]  # interactive spills to batch
    grpc = {e.get("priority", 0): e["lb_endpoints"] for e in clusters["pool_interactive_grpc"]["load_assignment"]["endpoints"]}
    assert _ports(grpc[0]) == [p.grpc_port for p in plan.replicas("interactive")]


def test_the_snapshot_serves_one_eds_endpoint_per_replica():
    policy = load_policy(LOCAL_POLICY)
    target = MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {
        "interactive": [("127.0.0.1", 9001, 9101), ("127.0.0.1", 9002, 9102)], "batch": ("127.0.0.1", 9003, 9103)})
    snap = build_snapshot(policy, target)
    cla = {m.cluster_name: m for m in snap.resources[ENDPOINT_TYPE]}
    own = [e.endpoint.address.socket_address.port_value for e in cla["pool_interactive"].endpoints[0].lb_endpoints]
    assert own == [9001, 9002]
    backup = [e.endpoint.address.socket_address.port_value for e in cla["pool_interactive"].endpoints[1].lb_endpoints]
    assert backup == [9003]


def test_a_pool_is_as_degraded_as_its_least_degraded_replica():
    got: list[tuple[str, int]] = []
    levels = ReplicaLevels(lambda pool, level: got.append((pool, level)))
    r0, r1 = levels.reporter(0), levels.reporter(1)
    r0("interactive", LEVEL_DOWN)
    assert got[-1] == ("interactive", LEVEL_DOWN)  # the only replica seen is gone
    r1("interactive", 0)
    assert got[-1] == ("interactive", 0)  # one serves: no spill
    r1("interactive", 3)
    assert got[-1] == ("interactive", 3)
    r0("interactive", 1)
    assert got[-1] == ("interactive", 1)


def test_pool_clusters_balance_by_the_replicas_load_reports_and_the_edge_strips_them():
    from infermesh.meshconfig.envoy_resources import CSWRR_TYPE, ORCA_HEADER

    b = bootstrap(LocalMeshPlan().listener(Path("/x.wasm")))
    for c in pool_clusters_of(b):
        (p,) = c["load_balancing_policy"]["policies"]
        cfg = p["typed_extension_config"]["typed_config"]
        assert cfg["@type"] == CSWRR_TYPE
        assert cfg["blackout_period"] == "1s" and cfg["weight_expiration_period"] == "5s"
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["route_config"]["virtual_hosts"][0]["response_headers_to_remove"] == [ORCA_HEADER]


def test_the_orca_header_is_the_one_the_sidecar_sends():
    from infermesh.meshconfig.envoy_resources import ORCA_HEADER
    from infermesh.sidecar.load_report import ORCA_HEADER as sidecar_header

    assert sidecar_header == ORCA_HEADER
