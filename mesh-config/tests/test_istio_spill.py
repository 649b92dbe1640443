"""Degraded-mode spill through Istio: Envoy's own, as in plain Envoy. The pools' EnvoyFilter gives
a pool with `when_degraded.spill_to` the state endpoint's health check (envoy_resources'
`health_checks(grpc, below_level=at_level)`) on its two Istio clusters, an aggregate cluster per
front (the pool's cluster, then the spill pool's), and sends the pool's routes there; the filter
only sheds, probing through `outbound|PORT||HOST`, whose panic mode the patch turns back on.
e2e/test_istiod_e2e.py checks what real istiod and Envoy make of it."""

import copy
import json

import pytest

from infermesh.meshconfig import istio
from infermesh.meshconfig.envoy_resources import WEIGHTED_ROUND_ROBIN, health_checks
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy

LOCAL = load_policy(LOCAL_POLICY)  # interactive spills to batch at level 3 and sheds batch
PRODUCTION = load_policy(LOCAL_POLICY.parent / "production.yaml")  # no when_degraded
OPTS = istio.IstioOptions(wasm_url="oci://registry.example.com/infermesh/filter:0.1.0", wasm_sha256="ab" * 32)
HOST = "infermesh-{}.infermesh.svc.cluster.local"


def spill_name(port, pool="interactive"):
    return f"infermesh-spill|{port}||{HOST.format(pool)}"


def patches(policy=LOCAL, opts=OPTS):
    """The pools' EnvoyFilter's patches (templates/pools-envoyfilter.yaml)."""
    (ef,) = [o for o in istio.resources(policy, opts) if o["metadata"]["name"] == f"{opts.name}-pools"]
    return ef["spec"]["configPatches"]


def pools_threshold(opts=OPTS):
    """The pool clusters' circuit-breaker threshold (its MERGE_AND_REPLACE_LIST patch)."""
    return next(p for p in patches(opts=opts) if p["patch"]["operation"] == "MERGE_AND_REPLACE_LIST")["patch"]["value"]["circuit_breakers"]["thresholds"]


def test_the_spilling_pools_clusters_health_check_its_state_from_at_level_with_panic_back_on():
    hc = [p for p in patches() if p["applyTo"] == "CLUSTER" and "portNumber" in p["match"].get("cluster", {})]
    assert [(p["match"]["cluster"]["service"], p["match"]["cluster"]["portNumber"]) for p in hc] == [
        (HOST.format("interactive"), 8000), (HOST.format("interactive"), 50051)]
    for p, grpc in zip(hc, (False, True)):
        assert p["match"]["context"] == "GATEWAY" and p["patch"]["operation"] == "MERGE"
        assert p["patch"]["value"] == {"health_checks": health_checks(grpc, below_level=3),
                                       "common_lb_config": {"healthy_panic_threshold": {"value": istio.SPILL_PANIC_THRESHOLD},
                                                            "update_merge_window": "0s"}}
    check = hc[0]["patch"]["value"]["health_checks"][0]
    assert check["http_health_check"]["path"] == "/infermesh/state?healthy_below=3"
    assert hc[1]["patch"]["value"]["health_checks"][0]["grpc_health_check"]["service_name"] == "infermesh.pool.below_level.3"


def test_each_front_gets_an_aggregate_of_the_pool_then_the_spill_pool_with_the_pools_threshold():
    added = [p for p in patches() if p["patch"]["operation"] == "ADD"]
    assert [p["match"] for p in added] == [{"context": "GATEWAY"}] * 2
    threshold = pools_threshold()
    for p, port in zip(added, (8000, 50051)):
        c = p["patch"]["value"]
        assert c["name"] == spill_name(port)
        assert c["lb_policy"] == "CLUSTER_PROVIDED" and c["cluster_type"]["name"] == "envoy.clusters.aggregate"
        assert c["cluster_type"]["typed_config"] == {
            "@type": "type.googleapis.com/envoy.extensions.clusters.aggregate.v3.ClusterConfig",
            "clusters": [f"outbound|{port}||{HOST.format('interactive')}", f"outbound|{port}||{HOST.format('batch')}"]}
        # The router counts retries and hedges against the aggregate's max_retries too.
        assert c["circuit_breakers"] == {"thresholds": threshold}
    no_budget = istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256=OPTS.wasm_sha256, retry_budget=False)
    (t,) = next(p for p in patches(opts=no_budget) if p["patch"]["operation"] == "ADD")["patch"]["value"]["circuit_breakers"]["thresholds"]
    assert "retry_budget" not in t and t["max_retries"] == threshold[0]["max_retries"]


def test_the_pools_routes_go_to_its_aggregate_and_no_others():
    parts = istio.chart_parts(LOCAL)
    by_name = {p["match"]["routeConfiguration"]["vhost"]["route"]["name"]: p["patch"]["value"]["route"]
               for p in patches() if p["applyTo"] == "HTTP_ROUTE"}
    assert list(by_name) == [r["http"]["name"] for r in parts["routes"]]
    for r in parts["routes"]:
        got = by_name[r["http"]["name"]]
        if r["pool"] == "interactive":
            assert got == {**r["envoyRoute"]["route"], "cluster": spill_name(50051 if r["grpc"] else 8000)}, r["http"]["name"]
        else:
            assert got == r["envoyRoute"]["route"], r["http"]["name"]
    assert {r["pool"] for r in parts["routes"]} == {"interactive", "batch"}


def test_the_filter_only_sheds_probing_the_pools_istio_cluster():
    parts = istio.parts(LOCAL)
    (ef,) = [o for o in istio.resources(LOCAL, OPTS) if o["metadata"]["name"] == "infermesh-filter"]
    cfg = json.loads(ef["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]["configuration"]["value"])
    assert cfg["degraded_routing"]["pools"] == {"interactive": {
        "at_level": 3, "shed_classes": ["batch"], "probe_cluster": f"outbound|8000||{HOST.format('interactive')}"}}
    assert parts.values()["spill"] == {"interactive": {"to": "batch", "atLevel": 3, "cluster": {
        "http": {"health_checks": health_checks(False, below_level=3), "common_lb_config": {"healthy_panic_threshold": {"value": 1}, "update_merge_window": "0s"}},
        "grpc": {"health_checks": health_checks(True, below_level=3), "common_lb_config": {"healthy_panic_threshold": {"value": 1}, "update_merge_window": "0s"}}}}}


def test_a_policy_that_never_spills_gets_none_of_it():
    assert istio.chart_parts(PRODUCTION)["spill"] == {}
    ps = patches(PRODUCTION)
    assert not any(p["patch"]["operation"] == "ADD" or "portNumber" in p["match"].get("cluster", {}) for p in ps)
    assert not any("cluster" in p["patch"]["value"].get("route", {}) for p in ps if p["applyTo"] == "HTTP_ROUTE")


def test_names_follow_the_release_namespace_and_ports():
    opts = istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256=OPTS.wasm_sha256, name="llm-infermesh", namespace="prod",
                              http_port=9000, grpc_port=9001, attach_to="sidecar")
    ps = patches(opts=opts)
    names = [p["patch"]["value"]["name"] for p in ps if p["patch"]["operation"] == "ADD"]
    assert names == ["infermesh-spill|9000||llm-infermesh-interactive.prod.svc.cluster.local",
                     "infermesh-spill|9001||llm-infermesh-interactive.prod.svc.cluster.local"]
    assert {p["match"]["context"] for p in ps} == {"SIDECAR_OUTBOUND"}
    assert [p["match"]["cluster"]["portNumber"] for p in ps if "portNumber" in p["match"].get("cluster", {})] == [9000, 9001]


def _merge(dst: dict, src: dict) -> dict:
    """protobuf's MergeFrom on JSON: maps merged, lists appended, scalars replaced (Istio's MERGE)."""
    out = copy.deepcopy(dst)
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        elif isinstance(v, list) and isinstance(out.get(k), list):
            out[k] = out[k] + copy.deepcopy(v)
        else:
            out[k] = copy.deepcopy(v)
    return out


@pytest.mark.parametrize("retry_budget", [True, False])
def test_real_envoy_accepts_the_spill_patches_merged_into_what_istiod_builds(envoy_accepts, retry_budget):
    """Clusters shaped as istiod builds them (LEAST_REQUEST, outlier detection with panic off, the
    gRPC front on HTTP/2), every CLUSTER MERGE of its service and port merged in, the ADDed
    aggregate clusters beside them, and routes to those aggregates: `envoy --mode validate`."""
    opts = istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256=OPTS.wasm_sha256, retry_budget=retry_budget)
    ps = patches(opts=opts)
    clusters = []
    for pool in LOCAL.pools:
        for port, grpc in ((8000, False), (50051, True)):
            c = {"name": f"outbound|{port}||{HOST.format(pool)}", "type": "STATIC", "connect_timeout": "1s", "lb_policy": "LEAST_REQUEST",
                 "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
                 "outlier_detection": {"consecutive_local_origin_failure": 5, "split_external_local_origin_errors": True},
                 "load_assignment": {"cluster_name": "c", "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9}}}}]}]}}
            if grpc:
                c["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}}}
            for p in ps:
                m = p["match"].get("cluster")
                if p["applyTo"] == "CLUSTER" and m and m["service"] == HOST.format(pool) and m.get("portNumber", port) == port:
                    if p["patch"]["operation"] == "MERGE_AND_REPLACE_LIST":
                        c |= copy.deepcopy(p["patch"]["value"])
                    else:
                        c = _merge(c, p["patch"]["value"])
            if pool == "interactive":
                assert c["health_checks"] and c["common_lb_config"]["healthy_panic_threshold"]["value"] == 1
                assert c["common_lb_config"]["update_merge_window"] == "0s"
                assert c["load_balancing_policy"] == WEIGHTED_ROUND_ROBIN.policy()
            clusters.append(c)
    clusters += [p["patch"]["value"] for p in ps if p["patch"]["operation"] == "ADD"]
    routes = []
    for p in ps:
        if p["applyTo"] != "HTTP_ROUTE":
            continue
        name = p["match"]["routeConfiguration"]["vhost"]["route"]["name"]
        part = next(r for r in istio.chart_parts(LOCAL)["routes"] if r["http"]["name"] == name)
        action = _merge({"cluster": f"outbound|{50051 if part['grpc'] else 8000}||{HOST.format(part['pool'])}"}, p["patch"]["value"]["route"])
        routes.append({"name": name, "match": {"prefix": "/"}, "route": action})
    # Every route of a spilling pool, on both fronts, goes to an aggregate; no other route does.
    spilling = [r for r in istio.chart_parts(LOCAL)["routes"] if (d := LOCAL.pools[r["pool"]].when_degraded) and d.spill_to]
    assert {r["grpc"] for r in spilling} == {False, True}
    assert [r["name"] for r in routes if r["route"]["cluster"].startswith("infermesh-spill|")] == [r["http"]["name"] for r in spilling]
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "t", "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": routes}]},
           "http_filters": [{"name": "envoy.filters.http.router",
                             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    json.dumps(clusters)  # plain JSON, as Istio's patch values are
    envoy_accepts(hcm, clusters)
