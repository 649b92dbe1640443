"""The generated Envoy bootstrap: routes follow the filter's pool header (gRPC to the pool's gRPC
front), failover endpoints sit at priority 1, and the real Envoy binary accepts the config
(`--mode validate`)."""

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

from infermesh import paths
from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.envoy_resources import (FILTER_STATS_TAGS, GRPC_CONTENT_TYPE, NATIVE_FILTER, NOT_FOUND_ROUTE, POOL_HEADER,
                                                  WASM_FILTER, Routing, cluster_name, native_module_env)
from infermesh.meshconfig.local_mesh import LocalMeshPlan


def _hcm(b: dict) -> dict:
    return b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _route_table(b: dict) -> dict:
    """(pool header value or None, is_grpc) -> cluster; the edge's 404 last."""
    *routes, last = _hcm(b)["route_config"]["virtual_hosts"][0]["routes"]
    assert last["name"] == NOT_FOUND_ROUTE and last["direct_response"]["status"] == 404
    table = {}
    for r in routes:
        headers = r["match"].get("headers", [])
        pool = next((h["string_match"]["exact"] for h in headers if h["name"] == POOL_HEADER), None)
        table[(pool, GRPC_CONTENT_TYPE in headers)] = r["route"]["cluster"]
    return table


def test_http_and_grpc_route_and_cluster_per_pool_plus_default():
    plan = LocalMeshPlan()
    b = bootstrap(dataclasses.replace(plan.listener(Path("/x.wasm")), native_rules=False))
    assert _route_table(b) == {
        ("interactive", True): cluster_name("interactive", grpc=True),
        ("interactive", False): cluster_name("interactive"),
        ("batch", True): cluster_name("batch", grpc=True),
        ("batch", False): cluster_name("batch"),
        # No pool header (the filter failed open): the default class's pool.
        (None, True): cluster_name("batch", grpc=True),
        (None, False): cluster_name("batch"),
    }
    routes = _hcm(b)["route_config"]["virtual_hosts"][0]["routes"]
    assert all("http_filters" not in r for r in routes)
    # gRPC routes come before the HTTP route of the same pool (the HTTP route matches gRPC too).
    names = [r["name"] for r in routes]
    assert names.index("class-pool-interactive-grpc") < names.index("class-pool-interactive")
    for r in routes[:-1]:
        retry = r["route"]["retry_policy"]
        assert set(retry["retry_on"].split(",")) == {"connect-failure", "refused-stream", "reset"}
        assert retry["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
    clusters = {c["name"]: c for c in b["static_resources"]["clusters"]}
    # and the filter's probe cluster of interactive, which fails over (its shedding watches it).
    assert set(clusters) == {"pool_interactive", "pool_interactive_grpc", "pool_batch", "pool_batch_grpc", "pool_interactive_state"}
    # The wasm filter runs before the router and carries the filter config as JSON.
    hcm = _hcm(b)
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.wasm", "envoy.filters.http.router"]
    assert json.loads(hcm["http_filters"][0]["typed_config"]["config"]["configuration"]["value"]) == plan.filter_config()
    assert b["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    for name, c in clusters.items():
        if name.endswith("_state"):
            continue  # the probe cluster: no health check of its own (test_the_spill_pool_backs…)
        hc = c["health_checks"][0]
        spills = name.startswith("pool_interactive")  # its check is the state endpoint's (below)
        if name.endswith("_grpc"):
            assert spills or hc["grpc_health_check"]["service_name"] == "infermesh.v1.Inference"
            assert "http2_protocol_options" in json.dumps(c["typed_extension_protocol_options"])
        else:
            assert spills or hc["http_health_check"]["path"] == "/health"
        # A health change reaches the workers' load balancers at once, not after Envoy's 1 s merge.
        assert c["common_lb_config"]["update_merge_window"] == "0s"
        od = c["outlier_detection"]
        assert od["split_external_local_origin_errors"] and od["enforcing_consecutive_5xx"] == 0, "shedding is not a fault"
        assert c["circuit_breakers"]["thresholds"][0]["max_requests"] > 0


def without_when_degraded(plan: LocalMeshPlan) -> LocalMeshPlan:
    """The plan's policy with no `when_degraded`: every header-only rule can be native."""
    pools = {n: p.model_copy(update={"when_degraded": None}) for n, p in plan.policy.pools.items()}
    return dataclasses.replace(plan, policy=plan.policy.model_copy(update={"pools": pools}))


def test_native_rules_decide_in_the_route_table_and_send_only_body_rules_to_the_filter():
    # local.yaml: chat-bulk (body), chat, grpc-generate (header-only); without when_degraded
    plan = without_when_degraded(LocalMeshPlan())
    b = bootstrap(plan.listener(Path("/x.wasm")))
    hcm = _hcm(b)
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["name"] for r in routes] == [
        "class-pool-interactive-grpc", "class-pool-interactive", "class-pool-batch-grpc", "class-pool-batch",
        "filter-chat-bulk",  # chat is the same match: the filter decides it there (no gRPC twin: no gRPC method)
        "rule-grpc-generate-grpc",  # (no HTTP twin: a gRPC method's path is no HTTP path of the edge)
        "default-pool-grpc", "default-pool", NOT_FOUND_ROUTE,
    ]
    by_name = {r["name"]: r for r in routes}
    chat = by_name["filter-chat-bulk"]
    # The rule's prefix narrowed to the one serving path it covers.
    assert chat["match"]["path"] == "/v1/chat/completions" and "typed_per_filter_config" not in chat, "the filter runs here"
    assert chat["match"]["headers"][0]["name"] == ":method"
    grpc = by_name["rule-grpc-generate-grpc"]
    assert grpc["match"]["path"] == "/infermesh.v1.Inference/Generate"
    assert grpc["route"]["cluster"] == "pool_interactive_grpc"
    assert grpc["typed_per_filter_config"]["envoy.filters.http.wasm"]["disabled"] is True
    added = {h["header"]["key"]: h["header"]["value"] for h in grpc["request_headers_to_add"]}
    assert added == {"x-infermesh-class": "interactive", "x-infermesh-pool": "interactive", "x-infermesh-rule": "grpc-generate"}
    default = {h["header"]["key"]: h["header"]["value"] for h in by_name["default-pool"]["request_headers_to_add"]}
    assert default == {"x-infermesh-class": "batch", "x-infermesh-pool": "batch", "x-infermesh-rule": "default"}
    # Client x-infermesh-* headers go before any route is chosen.
    strip = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"][0]["remove_on_match"]
    assert strip == {"key_matcher": {"prefix": "x-infermesh-"}}
    # The filter is off there: Envoy drops the sidecars' internal pool-level and load headers itself.
    assert by_name["default-pool"]["response_headers_to_remove"] == ["x-infermesh-pool-level", "x-infermesh-load"]
    assert "response_headers_to_remove" not in chat, "where the filter runs, it reads and strips the header"


def test_without_a_filter_route_the_unreachable_pool_header_routes_are_left_out():
    # Header rules only, no when_degraded: nothing runs the filter, so nothing sets the pool header.
    plan = without_when_degraded(LocalMeshPlan())
    rules = [r for r in plan.policy.rules if not r.match.needs_body]
    plan = dataclasses.replace(plan, policy=plan.policy.model_copy(update={"rules": rules}))
    routes = _hcm(bootstrap(plan.listener(Path("/x.wasm"))))["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["name"] for r in routes] == [
        "rule-chat", "rule-grpc-generate-grpc", "default-pool-grpc", "default-pool", NOT_FOUND_ROUTE]
    assert all(r["typed_per_filter_config"]["envoy.filters.http.wasm"]["disabled"] for r in routes)


def test_rules_of_classes_when_degraded_may_shed_are_decided_by_the_filter():
    plan = LocalMeshPlan()  # local.yaml: interactive spills to batch (Envoy's failover), batch is shed
    routes = _hcm(bootstrap(plan.listener(Path("/x.wasm"))))["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["name"] for r in routes] == [
        "class-pool-interactive-grpc", "class-pool-interactive", "class-pool-batch-grpc", "class-pool-batch",
        "filter-chat-bulk", "rule-grpc-generate-grpc", "filter-default-grpc", "filter-default", NOT_FOUND_ROUTE,
    ]
    native = [r for r in routes if r["name"].startswith("rule-")]
    assert all(r["typed_per_filter_config"]["envoy.filters.http.wasm"]["disabled"] for r in native), "interactive only spills"
    assert all("typed_per_filter_config" not in r and "request_headers_to_add" not in r for r in routes[:-1] if r not in native)
    assert routes[-2]["route"]["cluster"] == "pool_batch", "the filter failing open: the default pool"


def test_trusted_sources_keep_the_filter_on_every_request():
    plan = LocalMeshPlan()
    fc = dict(plan.filter_config(), trusted_sources={"cidrs": ["10.0.0.0/8"], "principals": []})
    m = dataclasses.replace(plan.listener(Path("/x.wasm")), filter_config=fc, routing=Routing.from_filter_config(fc))
    hcm = _hcm(bootstrap(m))
    assert "early_header_mutation_extensions" not in hcm, "a trusted peer's headers must reach the filter"
    # (Except the edge's 404: nothing to decide there.)
    assert all("typed_per_filter_config" not in r for r in hcm["route_config"]["virtual_hosts"][0]["routes"][:-1])


def test_the_spill_pool_backs_the_pool_at_priority_one():
    plan = LocalMeshPlan()  # local.yaml: interactive spills to batch
    assert plan.policy.failover() == {"interactive": "batch"}
    b = bootstrap(plan.listener(Path("/x.wasm")))
    clusters = {c["name"]: c for c in b["static_resources"]["clusters"]}
    ports = {p.name: p for p in plan.pools}

    def prio(cluster: str) -> dict[int, list[int]]:
        return {e["priority"]: [lb["endpoint"]["address"]["socket_address"]["port_value"] for lb in e["lb_endpoints"]]
                for e in clusters[cluster]["load_assignment"]["endpoints"]}

    assert prio("pool_interactive") == {0: [ports["interactive"].http_port], 1: [ports["batch"].http_port]}
    assert prio("pool_interactive_grpc") == {0: [ports["interactive"].grpc_port], 1: [ports["batch"].grpc_port]}
    assert prio("pool_batch") == {0: [ports["batch"].http_port]}, "batch has no failover"
    # Its health check asks the state endpoint whether the sidecar is below at_level: failing, the
    # host leaves rotation and the priority load goes to batch. batch's is liveness only.
    (hc,) = clusters["pool_interactive"]["health_checks"]
    assert hc["http_health_check"]["path"] == f"/infermesh/state?healthy_below={plan.policy.spill_levels()['interactive']}"
    assert (hc["interval"], hc["no_traffic_interval"], hc["unhealthy_threshold"], hc["healthy_threshold"]) == ("0.25s", "0.25s", 3, 4)
    assert hc["timeout"] == "2s", "a second's stall of a busy sidecar is no spill"
    (hc,) = clusters["pool_interactive_grpc"]["health_checks"]
    assert hc["grpc_health_check"]["service_name"] == f"infermesh.pool.below_level.{plan.policy.spill_levels()['interactive']}"
    assert clusters["pool_batch"]["health_checks"][0]["http_health_check"]["path"] == "/health"


def test_envoy_local_replies_for_a_missing_upstream_are_openai_errors_with_retry_after():
    b = bootstrap(LocalMeshPlan().listener(Path("/x.wasm")))
    mapper = _hcm(b)["local_reply_config"]["mappers"][0]
    assert "UH" in mapper["filter"]["response_flag_filter"]["flags"]
    assert mapper["headers_to_add"][0]["header"]["key"] == "retry-after"
    assert mapper["body_format_override"]["json_format"]["error"]["code"] == "pool_unavailable"


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


def with_runtime(plan: LocalMeshPlan, runtime: str) -> LocalMeshPlan:
    return dataclasses.replace(plan, policy=plan.policy.model_copy(
        update={"filter": plan.policy.filter.model_copy(update={"runtime": runtime})}))


def test_the_native_runtime_puts_the_dynamic_module_where_the_wasm_filter_was():
    # Without when_degraded, so some routes are decided natively and turn the filter off.
    wasm_plan = without_when_degraded(LocalMeshPlan())
    plan = with_runtime(wasm_plan, "native")
    wasm, native = (bootstrap(p.listener(Path("/x.wasm"))) for p in (wasm_plan, plan))
    hcm = _hcm(native)
    assert [f["name"] for f in hcm["http_filters"]] == [NATIVE_FILTER, "envoy.filters.http.router"]
    typed = hcm["http_filters"][0]["typed_config"]
    assert typed["@type"].endswith("dynamic_modules.v3.DynamicModuleFilter")
    assert typed["dynamic_module_config"] == {"name": "infermesh_filter", "do_not_close": True}
    assert typed["filter_name"] == "infermesh"
    # The same JSON config, byte for byte, as the Wasm filter's.
    assert typed["filter_config"] == _hcm(wasm)["http_filters"][0]["typed_config"]["config"]["configuration"]
    assert json.loads(typed["filter_config"]["value"]) == plan.filter_config()
    # The same routes; natively decided ones turn the filter off under its own name.
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    off = [r for r in routes if "typed_per_filter_config" in r]
    assert off and all(r["typed_per_filter_config"] == {NATIVE_FILTER: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                                                                         "disabled": True}} for r in off)
    as_wasm = json.loads(json.dumps(routes).replace(NATIVE_FILTER, WASM_FILTER))
    assert as_wasm == _hcm(wasm)["route_config"]["virtual_hosts"][0]["routes"]
    assert WASM_FILTER not in json.dumps(native)


def test_envoy_finds_the_native_module_through_its_environment(tmp_path):
    module = tmp_path / "libinfermesh_filter.so"
    assert native_module_env(module) == {"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(tmp_path)}
    with pytest.raises(ValueError, match="filter.runtime: native: Envoy loads the module as libinfermesh_filter.so, not old.so"):
        native_module_env(tmp_path / "old.so")
    with pytest.raises(ValueError, match="filter.runtime: 'v8' is not one of"):
        dataclasses.replace(LocalMeshPlan().listener(Path("/x.wasm")), filter_runtime="v8")


@pytest.mark.parametrize("namespace", ["wasmcustom", "dynamicmodulescustom"])
def test_the_filters_counters_are_tagged_in_either_runtime(namespace):
    """As Envoy extracts tags: each regex on the full name; its first group leaves the name, the
    second is the tag's value."""
    def tags(name: str) -> tuple[str, dict[str, str]]:
        found, cut = {}, []
        for t in FILTER_STATS_TAGS:
            if m := re.search(t["regex"], name):
                found[t["tag_name"]] = m.group(2)
                cut.append(m.span(1))
        for start, end in sorted(cut, reverse=True):
            name = name[:start] + name[end:]
        return name, found

    assert tags(f"{namespace}.infermesh.requests_total.class.interactive.pool.gpu.rule.chat") == (
        f"{namespace}.infermesh.requests_total", {"class": "interactive", "pool": "gpu", "rule": "chat"})
    assert tags(f"{namespace}.infermesh.shed_requests_total.class.batch") == (f"{namespace}.infermesh.shed_requests_total", {"class": "batch"})
    assert tags(f"{namespace}.infermesh.pool_state_errors_total.reason.garbage")[1] == {"reason": "garbage"}
    assert tags(f"{namespace}.infermesh.body_fallbacks_total.reason.too_large")[1] == {"reason": "too_large"}
