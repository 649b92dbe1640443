"""The generated Envoy bootstrap: routes follow the filter's pool header, and the real Envoy
binary accepts the config (`--mode validate`)."""

import json
import subprocess
from pathlib import Path

from infermesh import paths
from infermesh.meshconfig.envoy_bootstrap import bootstrap, cluster_name
from infermesh.meshconfig.local_mesh import LocalMeshPlan


def test_one_route_and_cluster_per_pool_plus_default():
    plan = LocalMeshPlan()
    b = bootstrap(plan.listener(Path("/x.wasm")))
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    by_pool = {r["match"]["headers"][0]["string_match"]["exact"]: r["route"]["cluster"] for r in routes if "headers" in r["match"]}
    assert by_pool == {"interactive": cluster_name("interactive"), "batch": cluster_name("batch")}
    assert routes[-1]["route"]["cluster"] == cluster_name("batch")  # the default class's pool
    assert {c["name"] for c in b["static_resources"]["clusters"]} == {"pool_interactive", "pool_batch"}
    # The wasm filter runs before the router and carries the filter config as JSON.
    filters = [f["name"] for f in hcm["http_filters"]]
    assert filters == ["envoy.filters.http.wasm", "envoy.filters.http.router"]
    cfg = json.loads(hcm["http_filters"][0]["typed_config"]["config"]["configuration"]["value"])
    assert cfg == plan.filter_config()
    assert b["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    for c in b["static_resources"]["clusters"]:
        assert c["health_checks"][0]["http_health_check"]["path"] == "/health"
        od = c["outlier_detection"]
        assert od["split_external_local_origin_errors"] and od["enforcing_consecutive_5xx"] == 0, "shedding is not a fault"
        assert c["circuit_breakers"]["thresholds"][0]["max_requests"] > 0


def test_real_envoy_validates_the_generated_config(tmp_path):
    plan = LocalMeshPlan()
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(bootstrap(plan.listener(paths.filter_wasm()))))
    r = subprocess.run(
        [str(paths.envoy_binary()), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout + r.stderr
