"""Pools of many replicas through Istio: what the plain-Envoy control plane emits for them
(weighted round robin on ORCA reports, the retry budget, TTFT deadlines with hedging, the load
report stripped toward clients) in the VirtualService where Istio has the field, and in the pools'
EnvoyFilter where it does not. e2e/test_istiod_e2e.py checks what real istiod makes of them."""

import copy
from pathlib import Path

import pytest

from infermesh.meshconfig import istio
from infermesh.meshconfig.envoy_resources import ORCA_HEADER, TTFT_GIVE_UP_HEADER, WEIGHTED_ROUND_ROBIN, circuit_breakers, route_config
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import load_policy, parse_policy

REPO = Path(__file__).resolve().parents[2]
REPLICAS = load_policy(REPO / "e2e" / "policy-replicas-e2e.yaml")
LOCAL = load_policy(REPO / "mesh-config" / "policies" / "local.yaml")
OPTS = istio.IstioOptions(wasm_url="oci://registry.example.com/infermesh/filter:0.1.0", wasm_sha256="ab" * 32)
PREVIOUS_PRIORITIES = "envoy.retry_priorities.previous_priorities"

# Three replicas, a deadline that hedges and one that does not, no failover pool.
THREE = """
version: 1
default_class: batch
classes:
  chat: {pool: fast, ttft_deadline_ms: 500}
  strict: {pool: fast, ttft_deadline_ms: 2000, hedge: false}
  batch: {pool: slow, sheddable: true}
rules:
  - {name: chat, class: chat, match: {methods: [POST], path: {prefix: /v1/chat/completions}}}
  - {name: strict, class: strict, match: {headers: [{name: x-strict, exact: "1"}]}}
pools:
  fast: {replicas: 3, models: [{name: big}]}
  slow: {models: [{name: small}]}
"""


def one(objects, kind, name):
    (o,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


def http_routes(policy, opts=OPTS):
    """The mesh VirtualService's routes (templates/virtualservice.yaml)."""
    return one(istio.resources(policy, opts), "VirtualService", opts.name)["spec"]["http"]


def routes_by_name(policy):
    return {r["name"]: (r, part) for r, part in zip(http_routes(policy), istio.chart_parts(policy)["routes"])}


def pools_filter(policy, opts=OPTS):
    """The pools' EnvoyFilter (templates/pools-envoyfilter.yaml)."""
    return one(istio.resources(policy, opts), "EnvoyFilter", f"{opts.name}-pools")


def test_a_hedging_deadline_is_a_per_try_timeout_in_the_virtual_service_and_a_hedge_in_the_patch():
    # interactive only spills (Envoy's health check, no filter): its chat rule is a native route.
    r, part = routes_by_name(REPLICAS)["rule-chat"]
    # Istio's own fields: attempts (the other replica, then the spill pool behind the aggregate
    # cluster: 2, plain Envoy's floor too), the conditions, the deadline as the per-try timeout.
    assert r["retries"] == {"attempts": 2, "retryOn": "connect-failure,refused-stream,reset", "perTryTimeout": "0.6s"}
    # The sidecar's own give-up limit: each of the 3 attempts had its deadline.
    assert r["headers"]["request"]["set"][TTFT_GIVE_UP_HEADER] == "1800"
    route = part["envoyRoute"]["route"]
    assert route["hedge_policy"] == {"hedge_on_per_try_timeout": True}
    rp = route["retry_policy"]
    assert rp["per_try_timeout"] == "0.6s" and rp["num_retries"] == 2 and rp["host_selection_retry_max_attempts"] == 50
    assert rp["retry_priority"]["name"] == PREVIOUS_PRIORITIES and rp["retry_priority"]["typed_config"]["update_frequency"] == 2
    # previous_hosts: Istio's own default predicate on a route with attempts (a MERGE would add a second).
    assert "retry_host_predicate" not in rp


def test_the_patch_is_the_plain_envoy_route_policy_without_the_failover_pool():
    """Route for route, the same retry and hedge policy as the local mesh's routes, except where
    the plain-Envoy route counts the failover pool at priority 1, which Istio has not."""
    table = route_config(LocalMeshPlan(policy=parse_policy(THREE)).listener(Path("/x.wasm")))["virtual_hosts"][0]["routes"]
    # The edge's last route answers 404 itself (no pool, no retries): it has no counterpart here.
    assert "direct_response" in table[-1] and "route" not in table[-1]
    plain = {r["name"]: r["route"] for r in table if "route" in r}
    assert set(plain) == set(routes_by_name(parse_policy(THREE)))
    for name, (r, part) in routes_by_name(parse_policy(THREE)).items():
        want = copy.deepcopy(plain[name]["retry_policy"])
        got = copy.deepcopy(part["envoyRoute"]["route"]["retry_policy"])
        if want["num_retries"]:
            want.pop("retry_host_predicate")
        assert got == want, name
        assert ("hedge_policy" in part["envoyRoute"]["route"]) == ("hedge_policy" in plain[name]), name
        # A route decided without the filter also drops what the filter would have stripped.
        whole = next(t for t in table if t["name"] == name)
        assert r["headers"]["response"] == {"remove": [ORCA_HEADER, *whole.get("response_headers_to_remove", [])]}, name


def test_three_replicas_are_each_tried_before_the_next_priority():
    r, part = routes_by_name(parse_policy(THREE))["rule-chat"]
    assert r["retries"]["attempts"] == 2 and r["retries"]["perTryTimeout"] == "0.5s"
    assert part["envoyRoute"]["route"]["retry_policy"]["retry_priority"]["typed_config"]["update_frequency"] == 3
    assert r["headers"]["request"]["set"][TTFT_GIVE_UP_HEADER] == "1500"


def test_a_deadline_without_hedging_is_a_hard_per_try_timeout_that_istio_would_drop():
    """attempts 0 makes istiod emit no retry policy at all, so its per-try timeout (the deadline)
    comes from the patch, with no retry; no give-up header (Envoy answers 504 at the deadline)."""
    r, part = routes_by_name(parse_policy(THREE))["rule-strict"]
    assert r["retries"] == {"attempts": 0}
    rp = part["envoyRoute"]["route"]["retry_policy"]
    assert rp["num_retries"] == 0 and rp["per_try_timeout"] == "2s" and rp["retry_host_predicate"]
    assert "hedge_policy" not in part["envoyRoute"]["route"]
    assert TTFT_GIVE_UP_HEADER not in r["headers"].get("request", {}).get("set", {})


def test_pool_clusters_get_weighted_round_robin_and_the_retry_budget():
    ef = pools_filter(REPLICAS)
    assert ef["metadata"] == {"name": "infermesh-pools", "namespace": "istio-ingress",
                              "labels": {"app.kubernetes.io/name": "infermesh", "app.kubernetes.io/instance": "infermesh"}}
    assert ef["spec"]["workloadSelector"] == {"labels": {"istio": "ingress"}}
    # (the spilling pool's health checks and aggregate clusters: test_istio_spill.py)
    clusters = [p for p in ef["spec"]["configPatches"] if p["applyTo"] == "CLUSTER" and "portNumber" not in p["match"].get("cluster", {"portNumber": 0})]
    services = {p["match"]["cluster"]["service"] for p in clusters}
    assert services == {f"infermesh-{p}.infermesh.svc.cluster.local" for p in REPLICAS.pools}
    for p in clusters:
        assert p["match"]["context"] == "GATEWAY"
        if p["patch"]["operation"] == "MERGE":
            assert p["patch"]["value"] == {"load_balancing_policy": WEIGHTED_ROUND_ROBIN.policy()}
        else:
            assert p["patch"]["operation"] == "MERGE_AND_REPLACE_LIST"
            (t,) = p["patch"]["value"]["circuit_breakers"]["thresholds"]
            plain = circuit_breakers()["thresholds"][0]
            assert t == {k: v for k, v in plain.items() if k != "priority"} | {"track_remaining": True}
    assert len(clusters) == 2 * len(REPLICAS.pools)
    # Every route of the VirtualService to a pool has its patch; the edge's 404 (a directResponse,
    # its last route) reaches no pool, so it has none.
    routes = [p["match"]["routeConfiguration"]["vhost"]["route"]["name"] for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_ROUTE"]
    vs = http_routes(REPLICAS)
    assert "directResponse" in vs[-1] and all("route" in r for r in vs[:-1])
    assert routes == [r["name"] for r in vs[:-1]]


def test_the_threshold_follows_the_values_overrides_and_the_budget_can_be_left_out():
    opts = istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256=OPTS.wasm_sha256, attach_to="sidecar",
                              traffic_policy={"connectionPool": {"tcp": {"maxConnections": 100}}})
    ef = pools_filter(REPLICAS, opts)
    (t,) = next(p for p in ef["spec"]["configPatches"] if p["patch"]["operation"] == "MERGE_AND_REPLACE_LIST")["patch"]["value"]["circuit_breakers"]["thresholds"]
    assert t["max_connections"] == 100 and t["max_requests"] == 4096
    assert {p["match"]["context"] for p in ef["spec"]["configPatches"]} == {"SIDECAR_OUTBOUND"}
    no_budget = istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256=OPTS.wasm_sha256, retry_budget=False)
    assert {p["patch"]["operation"] for p in pools_filter(REPLICAS, no_budget)["spec"]["configPatches"]} == {"MERGE", "ADD"}  # ADD: aggregates
    assert not any(p["patch"]["operation"] == "MERGE_AND_REPLACE_LIST" for p in pools_filter(parse_policy(THREE), no_budget)["spec"]["configPatches"])


def test_real_envoy_accepts_the_pools_patches_merged_into_what_istiod_builds(envoy_accepts):
    """A cluster and routes shaped as istiod builds them (LEAST_REQUEST, its threshold, its default
    retry policy with previous_hosts), each patch merged in: `envoy --mode validate` accepts them."""
    ef = pools_filter(parse_policy(THREE))
    lb = next(p["patch"]["value"] for p in ef["spec"]["configPatches"] if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "MERGE")
    cb = next(p["patch"]["value"] for p in ef["spec"]["configPatches"] if p["patch"]["operation"] == "MERGE_AND_REPLACE_LIST")
    cluster = {"name": "outbound|8000||infermesh-fast.infermesh.svc.cluster.local", "type": "STATIC", "connect_timeout": "1s",
               "lb_policy": "LEAST_REQUEST", "common_lb_config": {},
               "load_assignment": {"cluster_name": "c", "endpoints": [{"lb_endpoints": [
                   {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9}}}}]}]}} | lb | cb
    istio_default = {"retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes", "num_retries": 2,
                     "host_selection_retry_max_attempts": 5,
                     "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
                         "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}]}
    routes = []
    for p in ef["spec"]["configPatches"]:
        if p["applyTo"] != "HTTP_ROUTE":
            continue
        action = {"cluster": cluster["name"], "retry_policy": dict(istio_default)}
        patch = p["patch"]["value"]["route"]
        action["retry_policy"] |= patch["retry_policy"]
        if "hedge_policy" in patch:
            action["hedge_policy"] = patch["hedge_policy"]
        routes.append({"name": p["match"]["routeConfiguration"]["vhost"]["route"]["name"], "match": {"prefix": "/"}, "route": action})
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "t", "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": routes}]},
           "http_filters": [{"name": "envoy.filters.http.router",
                             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    envoy_accepts(hcm, [cluster])


@pytest.mark.parametrize(("policy", "name"), [(THREE, "rule-chat"), (THREE, "default-pool-grpc"), (REPLICAS, "rule-chat"),
                                              (REPLICAS, "default-pool-grpc"), (REPLICAS, "default-pool"), (LOCAL, "class-pool-interactive"),
                                              (LOCAL, "class-pool-batch-grpc"), (LOCAL, "filter-chat-bulk")])
def test_no_client_sees_a_load_report_on_any_route(policy, name):
    # THREE and REPLICAS (it only spills) decide every request natively (no pool-header routes);
    # LOCAL's filter decides some (it sheds).
    r, _ = routes_by_name(parse_policy(policy) if isinstance(policy, str) else policy)[name]
    assert ORCA_HEADER in r["headers"]["response"]["remove"]
