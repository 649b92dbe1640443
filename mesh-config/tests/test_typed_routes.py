"""The route table is decided once, as typed values (envoy_resources.Route), and both forms read
those values: plain Envoy renders each one (`Route.envoy`), istio_parts translates each one into
the VirtualService's vocabulary without reading an Envoy route dict back. (That the two forms
route alike: test_istio.py and charts/tests.)"""

import ast
import inspect
from pathlib import Path

import pytest

from infermesh.meshconfig import envoy_resources, istio_parts
from infermesh.meshconfig.envoy_resources import (NATIVE_FILTER, WASM_FILTER, Decision, Retries, Route, RouteMatch, not_found_route,
                                                  reachable, route_config, routes)
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy

PRODUCTION = LOCAL_POLICY.parent / "production.yaml"
POLICIES = [pytest.param(LOCAL_POLICY, id="local"), pytest.param(PRODUCTION, id="production")]


def _listener(path: Path, native_rules: bool, runtime: str):
    m = LocalMeshPlan(policy=load_policy(path)).listener(Path("/x.wasm"))
    m.native_rules, m.filter_runtime = native_rules, runtime
    return m


@pytest.mark.parametrize("runtime", ["wasm", "native"])
@pytest.mark.parametrize("native_rules", [True, False], ids=["native-rules", "filter-decides"])
@pytest.mark.parametrize("path", POLICIES)
def test_the_route_table_is_the_typed_routes_rendered_then_the_edge_404(path, native_rules, runtime):
    m = _listener(path, native_rules, runtime)
    table = routes(m)
    assert table and all(isinstance(r, Route) for r in table)
    rendered = route_config(m)["virtual_hosts"][0]["routes"]
    assert rendered == [r.envoy(m.filter_name) for r in reachable(m, table)] + [not_found_route(m)]
    for r, e in zip(reachable(m, table), rendered):
        # Each typed decision is the one Envoy gets.
        assert e["route"]["cluster"] == r.cluster == f"pool_{r.pool}{'_grpc' if r.grpc else ''}"
        assert (m.filter_name not in e.get("typed_per_filter_config", {})) == r.runs_filter
        assert ("hedge_policy" in e["route"]) == r.hedges
        assert e["route"]["retry_policy"]["num_retries"] == r.retries.num_retries
        assert r.match.grpc == r.grpc


def test_a_route_renders_each_decision_once():
    r = Route("rule-chat", RouteMatch("exact", "/v1/chat/completions"), "fast", False, Retries(update_frequency=2),
              give_up_ms=1500, decided=Decision("chat", "chat", objective="latency"))
    e = r.envoy(NATIVE_FILTER)
    assert e["typed_per_filter_config"] == {NATIVE_FILTER: envoy_resources.FILTER_DISABLED}
    assert [(h["header"]["key"], h["append_action"]) for h in e["request_headers_to_add"]] == [
        ("x-infermesh-class", "APPEND_IF_EXISTS_OR_ADD"), ("x-infermesh-pool", "APPEND_IF_EXISTS_OR_ADD"),
        ("x-infermesh-rule", "APPEND_IF_EXISTS_OR_ADD"), ("x-gateway-inference-objective", "APPEND_IF_EXISTS_OR_ADD"),
        ("x-infermesh-ttft-give-up-ms", "OVERWRITE_IF_EXISTS_OR_ADD")]
    assert e["stat_prefix"] == "infermesh.class.chat.pool.fast.rule.chat"
    assert e["route"]["hedge_policy"] == {"hedge_on_per_try_timeout": True}
    assert e["route"]["retry_policy"]["retry_priority"]["typed_config"]["update_frequency"] == 2
    # A route the filter decides: no headers, nothing dropped, the filter on.
    plain = Route("class-pool-fast", RouteMatch(), "fast", True, Retries())
    assert set(plain.envoy(WASM_FILTER)) == {"name", "match", "route"} and plain.runs_filter


ENVOY_ROUTE_READERS = {"route_config", "inline_routes", "retry_policy", "not_found_route", "reachable", "GRPC_CONTENT_TYPE",
                       "FILTER_DISABLED", "filter_off"}
"""envoy_resources' names that hand out Envoy route dicts (or parts of one) to read back."""


def test_istio_parts_reads_the_typed_routes_never_envoy_route_dicts():
    tree = ast.parse(inspect.getsource(istio_parts))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "envoy_resources" for a in n.names}
    assert imported and not imported & ENVOY_ROUTE_READERS, imported & ENVOY_ROUTE_READERS
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for name in ("routes_of", "_route_part", "http_match", "_string_match", "envoy_route_patch"):
        for node in ast.walk(functions[name]):
            # A string key read from a dict: r["match"], match.get("headers"), ... (not the Istio
            # HTTPRoute the function itself builds, `part.http[...]`).
            keyed = (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant)
                     and isinstance(node.slice.value, str) and not (isinstance(node.value, ast.Attribute) and node.value.attr == "http"))
            got = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                   and node.args and isinstance(node.args[0], ast.Constant))
            assert not (keyed or got), f"{name} reads a dict by key: {ast.unparse(node)}"
