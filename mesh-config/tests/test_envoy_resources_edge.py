"""Only the serving API at the edge: every route the resources build (per-pool routes on the
filter's pool header, the class-deadline routes, native rule routes, the filter's routes, the
default, in either filter runtime, static or over xDS) reaches a pool only for the paths the
sidecars serve to clients, and the table ends with a JSON 404. The operational endpoints stay
where they belong: the clusters' health checks and the filter's state probe. (Through the real
Envoy and filter: e2e/test_edge_routes_integration.py; the chart: charts/tests.)"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from infermesh.meshconfig import istio
from infermesh.meshconfig.envoy_resources import (EDGE_PATHS, GRPC_CONTENT_TYPE, GRPC_HEADER, NOT_FOUND_ROUTE, POOL_HEADER, STATE_PATH,
                                                  HeaderCondition, RouteMatch, Routing, edge_match, is_grpc_method, path_regex,
                                                  route_config, state_cluster_name)
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy, parse_policy

PRODUCTION = LOCAL_POLICY.parent / "production.yaml"
NOT_SERVED = ["/metrics", "/health", "/infermesh/state", "/infermesh/state?healthy_below=1", "/admin/state", "/admin/faults/stall",
              "/grpc.health.v1.Health/Check", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
              "/infermesh.v1.Admin/GetState", "/", "/v1/", "/v1/embeddings", "/v1/chat/completionsX", "/v1/chat/completions/",
              "/V1/chat/completions", "/v1//chat/completions", "/v1/chat/completions/../../metrics", "/tokenizer", "/unknown"]


def plans() -> dict[str, LocalMeshPlan]:
    """Every shape of route table: local (body rule, when_degraded: the filter decides batch),
    without when_degraded (native rules), with trusted sources (the filter decides all), the
    filter as the native module, production (trusted principals, replicas) with a deadline that hedges."""
    local = LocalMeshPlan()
    pools = {n: p.model_copy(update={"when_degraded": None}) for n, p in local.policy.pools.items()}
    native = dataclasses.replace(local, policy=local.policy.model_copy(update={"pools": pools}))
    runtime = dataclasses.replace(local, policy=local.policy.model_copy(
        update={"filter": local.policy.filter.model_copy(update={"runtime": "native"})}))
    trusted = dataclasses.replace(local, policy=local.policy.model_copy(
        update={"filter": local.policy.filter.model_copy(update={"trusted_cidrs": ["10.0.0.0/8"]})}))
    # production with a TTFT deadline on interactive (hedging routes per class) and two replicas
    text = PRODUCTION.read_text().replace("interactive: {pool: h100, priority: 0,", "interactive: {pool: h100, priority: 0, ttft_deadline_ms: 800,")
    assert "ttft_deadline_ms: 800" in text
    return {"local": local, "native-rules": native, "native-runtime": runtime, "trusted": trusted,
            "production": LocalMeshPlan(policy=parse_policy(text))}


def table(plan: LocalMeshPlan) -> list[dict]:
    return route_config(plan.listener(Path("/x.wasm")))["virtual_hosts"][0]["routes"]


def takes(route: dict, method: str, path: str, headers: dict[str, str]) -> bool:
    """Whether Envoy's RouteMatch takes the request (path, prefix and safe_regex as Envoy compares
    them: the last two without the query; header matches)."""
    m = route["match"]
    bare = path.split("?", 1)[0]
    if "path" in m and bare != m["path"]:
        return False
    if "prefix" in m and not path.startswith(m["prefix"]):
        return False
    if "safe_regex" in m and not re.fullmatch(m["safe_regex"]["regex"], bare):
        return False
    for h in m.get("headers", []):
        value = method if h["name"] == ":method" else headers.get(h["name"])
        if "present_match" in h:
            if (value is not None) != h["present_match"]:
                return False
            continue
        sm = h["string_match"]
        if value is None:
            return False
        if "exact" in sm and not (value.lower() == sm["exact"].lower() if sm.get("ignore_case") else value == sm["exact"]):
            return False
        if "prefix" in sm and not value.startswith(sm["prefix"]):
            return False
        if "safe_regex" in sm and not re.fullmatch(sm["safe_regex"]["regex"], value):
            return False
    return True


def first(routes: list[dict], method: str, path: str, headers: dict[str, str]) -> dict:
    return next(r for r in routes if takes(r, method, path, headers))


@pytest.mark.parametrize("name", list(plans()))
def test_real_envoy_accepts_every_table(name, tmp_path):
    """The narrowed matches' patterns fit Envoy's RE2 program-size limit (100), in every form."""
    import subprocess

    from infermesh import paths
    from infermesh.meshconfig.envoy_bootstrap import bootstrap

    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(bootstrap(plans()[name].listener(paths.filter_wasm()))))
    if plans()[name].policy.filter.runtime == "native":  # validation loads no dynamic module: its config is checked natively
        doc = json.loads(path.read_text())
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = hcm["http_filters"][1:]
        path.write_text(json.dumps(doc).replace("envoy.filters.http.dynamic_modules", "envoy.filters.http.wasm"))
    r = subprocess.run([str(paths.envoy_binary()), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


@pytest.mark.parametrize("name", list(plans()))
def test_no_route_to_a_pool_is_a_catch_all(name):
    routes = table(plans()[name])
    *to_pools, last = routes
    assert last["name"] == NOT_FOUND_ROUTE and last["match"] == {"prefix": "/"} and "route" not in last
    assert last["direct_response"]["status"] == 404
    body = json.loads(last["direct_response"]["body"]["inline_string"])
    assert body["error"]["code"] == "not_found" and body["error"]["type"] == "invalid_request_error"
    assert last["response_headers_to_add"][0]["header"] == {"key": "content-type", "value": "application/json"}
    # The filter never runs on it: nothing to classify, buffer or shed.
    assert list(last["typed_per_filter_config"].values())[0]["disabled"] is True
    for r in to_pools:
        m = r["match"]
        assert "prefix" not in m, r["name"]  # an exact path or a pattern of serving paths, nothing wider
        grpc = GRPC_CONTENT_TYPE in m.get("headers", [])
        served = [p for p in EDGE_PATHS if is_grpc_method(p) == grpc]
        if "path" in m:
            assert m["path"] in served, r["name"]
        else:
            covered = [p for p in served if re.fullmatch(m["safe_regex"]["regex"], p)]
            assert covered, r["name"]
            assert not [p for p in NOT_SERVED if re.fullmatch(m["safe_regex"]["regex"], p.split("?")[0])], r["name"]


@pytest.mark.parametrize("name", list(plans()))
@pytest.mark.parametrize("path", NOT_SERVED)
def test_what_the_edge_does_not_serve_gets_the_404_whatever_the_headers(name, path):
    routes = table(plans()[name])
    pools = list(plans()[name].policy.pools)
    for method in ("GET", "POST"):
        # The pool header a trusted peer (or the filter) may set, gRPC content types, a rule's header.
        for headers in ({}, {POOL_HEADER: pools[0]}, {POOL_HEADER: pools[-1], "content-type": "application/grpc"},
                        {"content-type": "application/grpc+proto"}, {"x-priority": "high"}):
            assert first(routes, method, path, headers)["name"] == NOT_FOUND_ROUTE, (method, path, headers)


@pytest.mark.parametrize("name", list(plans()))
def test_each_serving_path_reaches_a_pool_on_its_front(name):
    plan = plans()[name]
    routes = table(plan)
    for path in EDGE_PATHS:
        grpc = is_grpc_method(path)
        headers = {"content-type": "application/grpc"} if grpc else {"content-type": "application/json"}
        for query in ("", "?api-version=2"):
            r = first(routes, "POST", path + query, headers)
            assert r["name"] != NOT_FOUND_ROUTE, (path, r)
            assert r["route"]["cluster"].endswith("_grpc") == grpc, (path, r["name"])
        # The filter's decision (its pool header) leads to that pool's route, on the same front.
        for pool in plan.policy.pools:
            r = first(routes, "POST", path, headers | {POOL_HEADER: pool})
            if any(POOL_HEADER in json.dumps(x["match"]) for x in routes):
                assert r["route"]["cluster"] == f"pool_{pool}" + ("_grpc" if grpc else ""), (path, pool, r["name"])
        if grpc:  # a gRPC method's path without a gRPC content type: no HTTP front serves it
            assert first(routes, "POST", path, {"content-type": "application/json"})["name"] == NOT_FOUND_ROUTE, path
        else:  # an HTTP path with a gRPC content type: the HTTP front (its twin would call a method the gRPC front lacks)
            assert not first(routes, "POST", path, {"content-type": "application/grpc"})["route"]["cluster"].endswith("_grpc"), path


def test_shed_and_deadline_routes_stay_for_the_serving_paths():
    """The filter's routes (where it sheds and spills are decided) and the class-deadline routes
    (hedging) are narrowed, not dropped: chat still reaches the filter route, a deadline class's
    pool-and-class route still hedges."""
    local = {r["name"]: r for r in table(plans()["local"])}
    assert local["filter-chat-bulk"]["match"]["path"] == "/v1/chat/completions"
    assert "typed_per_filter_config" not in local["filter-chat-bulk"], "the filter decides (and sheds) chats"
    assert "typed_per_filter_config" not in local["filter-default"], "the filter decides (and sheds) the default class"
    prod = table(plans()["production"])
    hedged = [r for r in prod if "route" in r and r["route"].get("hedge_policy")]
    assert hedged and all("prefix" not in r["match"] for r in hedged)
    assert any(r["name"].startswith("class-") and r["name"].endswith("-grpc") for r in hedged)


def test_health_checks_and_the_state_probe_do_not_go_through_the_edge():
    """The sidecars' operational endpoints are called by the clusters' health checks and the
    filter's probe cluster, which no route names, so the 404 at the edge costs them nothing."""
    plan = plans()["local"]
    from infermesh.meshconfig.envoy_bootstrap import bootstrap

    b = bootstrap(plan.listener(Path("/x.wasm")))
    clusters = {c["name"]: c for c in b["static_resources"]["clusters"]}
    checked = {hc.get("http_health_check", {}).get("path", "").split("?")[0] for c in clusters.values() for hc in c.get("health_checks", [])}
    assert {"/health", STATE_PATH} <= checked
    probe = json.loads(b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
                       ["typed_config"]["config"]["configuration"]["value"])["degraded_routing"]["pools"]
    assert {p["probe_cluster"] for p in probe.values()} <= set(clusters)
    routed = {r["route"]["cluster"] for r in table(plan) if "route" in r}
    assert state_cluster_name("interactive") in clusters and state_cluster_name("interactive") not in routed


def test_path_patterns_are_exact_and_fit_envoys_regex_limit():
    for paths in ([p for p in EDGE_PATHS if not is_grpc_method(p)], [p for p in EDGE_PATHS if is_grpc_method(p)],
                  ["/a", "/ab", "/abc", "/b.c"]):
        rx = path_regex(paths)
        assert all(re.fullmatch(rx, p) for p in paths)
        for near in ("/", "/a/", "/abcd", "/bxc", "/v1/", "/v1/chat", "/v1/completion", "/tokenizer", "/detoken"):
            assert (re.fullmatch(rx, near) is not None) == (near in paths), (rx, near)
    assert edge_match(RouteMatch("prefix", "/v1/chat/"), EDGE_PATHS) == [RouteMatch("exact", "/v1/chat/completions")]
    assert edge_match(RouteMatch("prefix", "/v2/"), EDGE_PATHS) == []
    assert edge_match(RouteMatch("exact", "/v1/hint"), EDGE_PATHS) == []
    assert edge_match(RouteMatch("exact", "/tokenize", (GRPC_HEADER,)), EDGE_PATHS) == []
    wider = EDGE_PATHS + ("/v1/hint",)
    assert edge_match(RouteMatch("exact", "/v1/hint"), wider) == [RouteMatch("exact", "/v1/hint")]
    # A longer list is split over several patterns, each short enough, together exactly the list.
    many = EDGE_PATHS + ("/v1/hint", "/v2/anything", "/v3/after", "/v1/embeddings", "/v1/audio/transcriptions")
    present = HeaderCondition("x-a", "present")
    parts = [p.envoy() for p in edge_match(RouteMatch(headers=(present,)), many)]
    assert len(parts) > 1 and all(p["headers"] == [{"name": "x-a", "present_match": True}] for p in parts)
    http = [p for p in many if not is_grpc_method(p)]
    for probe in http + NOT_SERVED:
        bare = probe.split("?")[0]
        hits = [p for p in parts if p.get("path") == bare or ("safe_regex" in p and re.fullmatch(p["safe_regex"]["regex"], bare))]
        assert len(hits) == (1 if bare in http else 0), probe
    assert all(len(p["safe_regex"]["regex"]) <= 100 for p in parts if "safe_regex" in p)


def test_a_wider_edge_is_split_over_routes_envoy_and_istio_accept(tmp_path):
    """Paths beyond the serving API (a test's echo upstreams, a future endpoint): a catch-all
    narrowed to more paths than one pattern holds becomes several routes of one name in plain
    Envoy (validated by the real Envoy) and one HTTPRoute with a match per pattern in Istio."""
    import subprocess

    from infermesh import paths
    from infermesh.meshconfig.envoy_bootstrap import bootstrap

    wide = EDGE_PATHS + ("/v1/hint", "/v2/anything", "/v3/after", "/v1/embeddings", "/v1/audio/transcriptions")
    m = dataclasses.replace(plans()["native-rules"].listener(paths.filter_wasm()), edge_paths=wide)
    b = bootstrap(m)
    routes = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["name"] for r in routes].count("default-pool") == 2
    for path in wide:
        headers = {"content-type": "application/grpc" if is_grpc_method(path) else "application/json"}
        assert first(routes, "POST", path, headers)["name"] != NOT_FOUND_ROUTE, path
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(b))
    r = subprocess.run([str(paths.envoy_binary()), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_the_serving_paths_are_what_the_sidecar_serves_to_clients():
    """EDGE_PATHS against the sidecar's own routes and the proto: every client-facing endpoint,
    none of the operational ones."""
    from infermesh.sidecar.grpc_api import INFERENCE_SERVICE
    from infermesh.sidecar.http_api import build_app
    from infermesh.sidecar.metrics import SidecarMetrics
    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb

    class FakePool:  # a stand-in: build_app reads only these while it registers its routes
        config = None
        metrics = SidecarMetrics("p", "0")
        ladder = ()

    app = build_app(FakePool())
    served = {r.path for r in app.routes if hasattr(r, "methods")}
    operational = {"/health", "/metrics", STATE_PATH}
    assert operational <= served
    http = {p for p in EDGE_PATHS if not is_grpc_method(p)}
    assert http == served - operational
    methods = {f"/{INFERENCE_SERVICE}/{m.name}" for m in pb.DESCRIPTOR.services_by_name["Inference"].methods}
    assert {p for p in EDGE_PATHS if is_grpc_method(p)} == methods


def test_the_istio_routes_carry_the_same_paths_and_the_gateway_denies_the_rest():
    policy = load_policy(PRODUCTION)
    opts = istio.IstioOptions(wasm_url="oci://r.example/f:1", wasm_sha256="ab" * 32, ingress=True, hosts=("llm.example.com",))
    objects = istio.resources(policy, opts)
    for vs in (o for o in objects if o["kind"] == "VirtualService"):
        *routes, last = vs["spec"]["http"]
        assert last["directResponse"]["status"] == 404 and "match" not in last
        for r in routes:
            for m in r["match"]:
                assert "exact" in m["uri"] or "regex" in m["uri"], r["name"]
    (edge,) = [o for o in objects if o["kind"] == "AuthorizationPolicy"]
    assert edge["metadata"] == {"name": "infermesh-edge", "namespace": "istio-ingress",
                                "labels": {"app.kubernetes.io/name": "infermesh", "app.kubernetes.io/instance": "infermesh"}}
    assert edge["spec"] == {"selector": {"matchLabels": {"istio": "ingress"}}, "action": "DENY",
                            "rules": [{"to": [{"operation": {"hosts": ["llm.example.com"], "notPaths": list(EDGE_PATHS)}}]}]}
    # No gateway, or the filter in client sidecars: nothing to put in a gateway.
    assert not [o for o in istio.resources(policy, dataclasses.replace(opts, ingress=False)) if o["kind"] == "AuthorizationPolicy"]
    assert not [o for o in istio.resources(policy, dataclasses.replace(opts, attach_to="sidecar")) if o["kind"] == "AuthorizationPolicy"]


def test_the_header_only_trusted_policy_keeps_every_pool_route_narrowed():
    policy = parse_policy("""
version: 1
default_class: bulk
classes: {chat: {pool: fast}, bulk: {pool: slow}}
rules:
  - {name: v1, class: chat, match: {path: {prefix: /v1/}}}
filter: {trusted_cidrs: [10.0.0.0/8]}
pools: {fast: {models: [{name: big}]}, slow: {models: [{name: small}]}}
""")
    assert Routing.from_policy(policy).trusted_sources
    routes = table(LocalMeshPlan(policy=policy))
    # A trusted peer's pool header on /metrics: still the 404.
    assert first(routes, "GET", "/metrics", {POOL_HEADER: "fast"})["name"] == NOT_FOUND_ROUTE
    assert first(routes, "POST", "/v1/completions", {POOL_HEADER: "fast"})["route"]["cluster"] == "pool_fast"
