"""The Istio resources of a policy (`istio.resources`: the chart's templates rendered for it): the
plain-Envoy parts of envoy_resources translated (the same routes in the same order, the same pool
protection), the filter in the form its rules need, and errors that name the field. (charts/tests
checks the chart's routes decide a request matrix as the plain-Envoy routes do.)"""

import json
from pathlib import Path

import pytest

from infermesh import paths
from infermesh.meshconfig import istio
from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.envoy_resources import (EDGE_PATHS, NOT_FOUND_ROUTE, REQUEST_BUFFER_LIMIT_BYTES, STRIP_CLIENT_HEADERS,
                                                  route_config)
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy, parse_policy

PRODUCTION = LOCAL_POLICY.parent / "production.yaml"
SHA = "ab" * 32
OPTS = istio.IstioOptions(wasm_url="oci://registry.example.com/infermesh/filter:0.1.0", wasm_sha256=SHA)


def one(objects, kind, name=None):
    (o,) = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return o


def http_routes(policy, opts=OPTS):
    """The mesh VirtualService's routes."""
    return one(istio.resources(policy, opts), "VirtualService", opts.name)["spec"]["http"]


def filter_object(policy, opts=OPTS):
    return one(istio.resources(policy, opts), istio.parts(policy).filter.form, f"{opts.name}-filter")

HEADER_ONLY = """
version: 1
default_class: bulk
classes:
  chat: {pool: fast}
  bulk: {pool: slow, sheddable: true}
rules:
  - {name: vip, class: chat, match: {headers: [{name: x-priority, exact: high}]}}
  - {name: chat, class: chat, match: {methods: [POST], path: {prefix: /v1/chat/completions}}}
pools:
  fast: {models: [{name: big}]}
  slow: {models: [{name: small}]}
"""
# The same rules with a trusted source: the filter must decide every request (native rules off).
TRUSTED = HEADER_ONLY.replace("pools:", "filter: {trusted_cidrs: [10.0.0.0/8]}\npools:")


def _plain_routes(policy):
    """(route name, gRPC?, pool, routing headers the route sets, filter off?) of the plain-Envoy
    route table the local mesh serves for the policy."""
    out = []
    for r in route_config(LocalMeshPlan(policy=policy).listener(Path("/x.wasm")))["virtual_hosts"][0]["routes"]:
        if "direct_response" in r:  # the edge's 404, last
            out.append((r["name"], 404, r["direct_response"]["body"]["inline_string"]))
            continue
        cluster = r["route"]["cluster"]
        sets = {h["header"]["key"]: h["header"]["value"] for h in r.get("request_headers_to_add", [])}
        out.append((r["name"], cluster.endswith("_grpc"), cluster.removeprefix("pool_").removesuffix("_grpc"), sets,
                    "typed_per_filter_config" in r))
    return out


def _istio_routes(policy, opts=OPTS):
    """The same tuple for the VirtualService's routes and the EnvoyFilter's per-route patches."""
    parts = istio.parts(policy)
    by_host = {f"{opts.name}-{p}.{opts.namespace}.svc.{opts.cluster_domain}": p for p in policy.pools}
    out = []
    *routes, last = http_routes(policy, opts)
    for r, part in zip(routes, parts.routes, strict=True):
        dest = r["route"][0]["destination"]
        grpc = dest["port"]["number"] == opts.grpc_port
        assert grpc == ("content-type" in (r["match"][0].get("headers", {}) if "match" in r else {})), r
        request = r.get("headers", {}).get("request", {})
        out.append((r["name"], grpc, by_host[dest["host"]], {**request.get("set", {}), **request.get("add", {})}, not part.wasm))
    return out + [(last["name"], last["directResponse"]["status"], last["directResponse"]["body"]["string"])]


def _reachable(plain):
    """The plain-Envoy routes a request can reach: without the pool-header routes (`class-…`)
    when no other route runs the filter, the only thing that sets the pool header once the early
    header mutation removed a client's."""
    if any(not r[-1] for r in plain if not r[0].startswith("class-") and r[0] != NOT_FOUND_ROUTE):
        return plain
    return [r for r in plain if not r[0].startswith("class-")]


@pytest.mark.parametrize("policy", [load_policy(LOCAL_POLICY), load_policy(PRODUCTION), parse_policy(HEADER_ONLY), parse_policy(TRUSTED)],
                         ids=["local", "production", "header-only", "trusted"])
def test_the_virtual_service_has_the_plain_envoy_routes_in_their_order(policy):
    """Route for route: name, front, pool, the headers a natively decided route sets, and where
    the filter is off; the routes no request can reach left out. (Whether each match means the
    same: charts/tests, over a request matrix.)"""
    assert _istio_routes(policy) == _reachable(_plain_routes(policy))


def test_pool_header_routes_are_left_out_only_where_the_filter_never_runs():
    """Every header-only rule decided natively: the filter is off on every route, so nothing sets
    the pool header and its routes go. With a body rule, or with trusted sources (no native
    rules, no strip), the filter runs and sends requests to them: they stay."""
    names = [p["http"]["name"] for p in istio.chart_parts(parse_policy(HEADER_ONLY))["routes"]]
    # (No rule-chat-grpc: the chat path is no gRPC method, so no gRPC call can take that route.)
    assert names == ["rule-vip-grpc", "rule-vip", "rule-chat", "default-pool-grpc", "default-pool"]
    body = HEADER_ONLY.replace("rules:\n", "rules:\n  - {name: long, class: bulk, match: {body: {max_tokens: {min: 1024}}}}\n", 1)
    for policy in (parse_policy(body), parse_policy(TRUSTED), load_policy(LOCAL_POLICY)):
        names = [p["http"]["name"] for p in istio.chart_parts(policy)["routes"]]
        assert {f"class-pool-{p}{g}" for p in policy.pools for g in ("", "-grpc")} <= set(names), names


def test_each_routing_header_keeps_the_plain_envoy_routes_append_action():
    """Istio's `add` is APPEND_IF_EXISTS_OR_ADD, `set` OVERWRITE_IF_EXISTS_OR_ADD: the class, pool
    and rule headers of a decided route are appended as in plain Envoy (the early header mutation
    already removed a client's copy, and an overwrite looks the header up first)."""
    plain = {r["name"]: r for r in route_config(LocalMeshPlan(policy=parse_policy(HEADER_ONLY)).listener(Path("/x.wasm")))["virtual_hosts"][0]["routes"]}
    for r in http_routes(parse_policy(HEADER_ONLY))[:-1]:  # (the edge's 404 adds none)
        want = {"add": {}, "set": {}}
        for h in plain[r["name"]].get("request_headers_to_add", []):
            want["add" if h["append_action"] == "APPEND_IF_EXISTS_OR_ADD" else "set"][h["header"]["key"]] = h["header"]["value"]
        assert r["headers"].get("request", {}) == {k: v for k, v in want.items() if v}, r["name"]


def test_native_rules_strip_client_headers_before_routing_and_turn_the_filter_off():
    policy = parse_policy(HEADER_ONLY)
    assert istio.parts(policy).filter.form == "EnvoyFilter" and not policy.needs_body
    patches = filter_object(policy)["spec"]["configPatches"]
    strip = next(p for p in patches if p["applyTo"] == "NETWORK_FILTER")
    assert strip["match"] == {"context": "GATEWAY", "listener": {"filterChain": {"filter": {"name": "envoy.filters.network.http_connection_manager"}}}}
    assert strip["patch"]["value"]["typed_config"]["early_header_mutation_extensions"] == STRIP_CLIENT_HEADERS
    off = {p["match"]["routeConfiguration"]["vhost"]["route"]["name"]: p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_ROUTE"}
    # Every rule and the default decide in a route: the filter is off there (no body: no buffer),
    # and on the edge's 404.
    assert set(off) == {"rule-vip-grpc", "rule-vip", "rule-chat", "default-pool-grpc", "default-pool", NOT_FOUND_ROUTE}
    chain = patches[0]["patch"]["value"]["name"]
    assert all(v == {"typed_per_filter_config": {chain: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}}}
               for v in off.values())
    # One method, matched case-insensitively as the filter does (Istio has no ignore_case).
    chat = next(r for r in http_routes(policy) if r["name"] == "rule-chat")
    # (Its prefix narrowed to the one path of the serving API it covers.)
    assert chat["match"] == [{"uri": {"exact": "/v1/chat/completions"}, "method": {"regex": "[Pp][Oo][Ss][Tt]"}}]
    assert chat["headers"] == {"request": {"add": {"x-infermesh-class": "chat", "x-infermesh-pool": "fast", "x-infermesh-rule": "chat"}},
                               # Decided without the filter: the sidecars' internal headers go too.
                               "response": {"remove": ["endpoint-load-metrics", "x-infermesh-pool-level", "x-infermesh-load"]}}


def test_a_match_istio_cannot_say_hands_the_rest_to_the_filter():
    """Two conditions on one header (a VirtualService keys header matches by name): from that
    route on the filter decides every request, on a catch-all pair to the default pool."""
    twice = HEADER_ONLY.replace("{headers: [{name: x-priority, exact: high}]}",
                                "{headers: [{name: x-priority, prefix: h}, {name: x-priority, exact: high}]}")
    names = [(p["http"]["name"], p["wasm"], p["pool"]) for p in istio.chart_parts(parse_policy(twice))["routes"]]
    assert names[-2:] == [("filter-vip-grpc", True, "slow"), ("filter-vip", True, "slow")]
    assert [n for n, _, _ in names[:-2]] == ["class-pool-fast-grpc", "class-pool-fast", "class-pool-slow-grpc", "class-pool-slow"]


def test_pool_limits_and_outlier_detection_are_those_of_the_plain_envoy_clusters():
    policy = load_policy(PRODUCTION)
    b = bootstrap(LocalMeshPlan(policy=policy).listener(Path("/x.wasm")))
    route = route_config(LocalMeshPlan(policy=policy).listener(Path("/x.wasm")))["virtual_hosts"][0]["routes"][0]
    for dr in [o for o in istio.resources(policy, OPTS) if o["kind"] == "DestinationRule"]:
        pool = dr["metadata"]["labels"]["infermesh.io/pool"]
        c = next(c for c in b["static_resources"]["clusters"] if c["name"] == f"pool_{pool}")
        t = c["circuit_breakers"]["thresholds"][0]
        od = c["outlier_detection"]
        tp = dr["spec"]["trafficPolicy"]
        assert dr["spec"]["host"] == f"infermesh-{pool}.infermesh.svc.cluster.local"
        assert tp["connectionPool"] == {
            "tcp": {"maxConnections": t["max_connections"], "connectTimeout": c["connect_timeout"]},
            "http": {"http1MaxPendingRequests": t["max_pending_requests"], "http2MaxRequests": t["max_requests"],
                     "maxRetries": t["max_retries"]},
        }
        # Shedding (429/503) is never a fault: 5xx and gateway-error ejection are off in both.
        assert od["enforcing_consecutive_5xx"] == 0 and od["enforcing_consecutive_gateway_failure"] == 0
        assert tp["outlierDetection"] == {
            "splitExternalLocalOriginErrors": od["split_external_local_origin_errors"],
            "consecutiveLocalOriginFailures": od["consecutive_local_origin_failure"],
            "consecutive5xxErrors": 0,
            "interval": od["interval"],
            "baseEjectionTime": od["base_ejection_time"],
            "maxEjectionPercent": od["max_ejection_percent"],
        }
    # Retries: the same conditions, never on a response.
    retry = route["route"]["retry_policy"]
    for r in http_routes(policy)[:-1]:  # (not the edge's 404)
        assert r["retries"] == {"attempts": retry["num_retries"], "retryOn": retry["retry_on"]}
        assert route["route"]["timeout"] == "0s" and "timeout" not in r  # Istio's default: none


def test_services_per_pool_with_both_fronts_and_a_front_service_on_the_default_pool():
    policy = load_policy(PRODUCTION)
    svcs = {s["metadata"]["name"]: s for s in istio.resources(policy, OPTS) if s["kind"] == "Service"}
    assert set(svcs) == {"infermesh", "infermesh-h100", "infermesh-l4"}
    for name in ("infermesh-h100", "infermesh-l4"):
        ports = {p["name"]: (p["port"], p["appProtocol"]) for p in svcs[name]["spec"]["ports"]}
        assert ports == {"http": (8000, "http"), "grpc": (50051, "grpc")}
        assert svcs[name]["spec"]["selector"]["infermesh.io/pool"] == name.removeprefix("infermesh-")
    assert svcs["infermesh"]["spec"]["selector"]["infermesh.io/pool"] == policy.default_pool == "l4"


def test_header_only_rules_the_filter_decides_give_a_wasm_plugin_with_the_policy_filter_config():
    policy = parse_policy(TRUSTED)
    assert not policy.needs_body
    wp = filter_object(policy)
    assert wp["kind"] == "WasmPlugin" and wp["metadata"]["namespace"] == "istio-ingress"
    spec = wp["spec"]
    assert spec["pluginConfig"] == policy.filter_config()
    assert (spec["url"], spec["sha256"], spec["failStrategy"]) == (OPTS.wasm_url, SHA, "FAIL_OPEN")
    assert spec["selector"] == {"matchLabels": {"istio": "ingress"}}
    assert "match" not in spec  # a gateway: all its traffic
    sidecar = filter_object(policy, istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256=SHA, attach_to="sidecar"))
    assert sidecar["spec"]["match"] == [{"mode": "CLIENT"}]


def test_body_rules_give_an_envoy_filter_that_can_pause_for_the_body():
    policy = load_policy(PRODUCTION)
    assert policy.needs_body
    parts = istio.parts(policy)
    ef = filter_object(policy)
    assert ef["kind"] == "EnvoyFilter"
    patches = ef["spec"]["configPatches"]
    assert [p["applyTo"] for p in patches[:2]] == ["EXTENSION_CONFIG", "HTTP_FILTER"]
    cfg = patches[0]["patch"]["value"]["typed_config"]["config"]
    assert cfg["allow_on_headers_stop_iteration"] is True
    assert json.loads(cfg["configuration"]["value"]) == policy.filter_config()
    assert cfg["vm_config"]["code"]["remote"] == {"http_uri": {"uri": OPTS.wasm_url, "timeout": "30s"}, "sha256": SHA}
    # The filter goes right before the router and points at the extension config by name.
    insert = patches[1]
    assert insert["match"]["context"] == "GATEWAY"
    assert insert["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    assert insert["patch"]["value"]["name"] == patches[0]["patch"]["value"]["name"]
    # Every route of the VirtualService can buffer a body as in plain Envoy.
    buffered = {p["match"]["routeConfiguration"]["vhost"]["route"]["name"]: p["patch"]["value"] for p in patches[2:]}
    *routes, not_found = http_routes(policy)
    assert buffered.pop(not_found["name"]) == {"typed_per_filter_config": {insert["patch"]["value"]["name"]: parts.wasm_off}}
    assert buffered == {r["name"]: {"per_request_buffer_limit_bytes": REQUEST_BUFFER_LIMIT_BYTES} for r in routes}


def test_fail_close_maps_to_envoys_fail_closed():
    opts = istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256=SHA, fail_strategy="FAIL_CLOSE")
    ext = filter_object(load_policy(PRODUCTION), opts)["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]
    assert ext["config"]["failure_policy"] == "FAIL_CLOSED"
    assert filter_object(parse_policy(TRUSTED), opts)["spec"]["failStrategy"] == "FAIL_CLOSE"


def test_ingress_virtual_service_carries_the_same_routes_on_the_gateways():
    policy = load_policy(PRODUCTION)
    opts = istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256=SHA, ingress=True, hosts=("llm.example.com",))
    mesh, ingress = [o for o in istio.resources(policy, opts) if o["kind"] == "VirtualService"]
    assert mesh["spec"]["gateways"] == ["mesh"] and mesh["spec"]["hosts"] == ["infermesh.infermesh.svc.cluster.local"]
    assert ingress["spec"]["gateways"] == ["infermesh/infermesh"] and ingress["spec"]["hosts"] == ["llm.example.com"]
    assert ingress["spec"]["http"] == mesh["spec"]["http"]
    assert len([o for o in istio.resources(policy, OPTS) if o["kind"] == "VirtualService"]) == 1  # no ingress, no second object


@pytest.mark.parametrize("change, field", [
    (lambda t: t.replace("fast:", "Fast_1:").replace("pool: fast", "pool: Fast_1"), "pools.Fast_1:"),
    (lambda t: t.replace("fast:", "f" * 60 + ":").replace("pool: fast", "pool: " + "f" * 60), "longer than 63"),
])
def test_a_pool_name_kubernetes_cannot_take_is_refused_by_name(change, field):
    policy = parse_policy(change(HEADER_ONLY))
    with pytest.raises(istio.IstioConfigError, match=field):
        istio.resources(policy, OPTS)


@pytest.mark.parametrize("opts, field", [
    (istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256="ABC"), "wasm_sha256"),
    (istio.IstioOptions(wasm_url="registry.example.com/f:1", wasm_sha256=SHA), "wasm_url"),
])
def test_an_unpinned_or_schemeless_module_is_refused(opts, field):
    with pytest.raises(istio.IstioConfigError, match=field):
        istio.resources(parse_policy(HEADER_ONLY), opts)


@pytest.mark.parametrize("policy", [load_policy(PRODUCTION), load_policy(LOCAL_POLICY)], ids=["body-buffer", "native-rules"])
def test_real_envoy_accepts_the_envoy_filters_patches(tmp_path, policy, envoy_accepts):
    """The EnvoyFilter's patch values are free-form to Istio's schema; Envoy itself checks them.

    As the Istio agent does, the remote code becomes a local file; the extension config is then
    an HTTP filter of a listener under its name, the NETWORK_FILTER patch merged into the HCM, and
    each HTTP_ROUTE patch merged into a route of its own (the body buffer; the filter off by name).
    """
    patches = filter_object(policy)["spec"]["configPatches"]
    ext = json.loads(json.dumps(patches[0]["patch"]["value"]))
    ext["typed_config"]["config"]["vm_config"]["code"] = {"local": {"filename": str(paths.filter_wasm())}}
    route_patches = [p for p in patches if p["applyTo"] == "HTTP_ROUTE"]
    hcm_patches = [p["patch"]["value"]["typed_config"] for p in patches if p["applyTo"] == "NETWORK_FILTER"]
    assert route_patches and len(hcm_patches) == (policy.filter.trusted_principals == [])
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "t",
        "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
            {"name": p["match"]["routeConfiguration"]["vhost"]["route"]["name"], "match": {"prefix": "/"},
             "direct_response": {"status": 200}, **p["patch"]["value"]} for p in route_patches]}]},
        "http_filters": [ext, {"name": "envoy.filters.http.router",
                               "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    for merge in hcm_patches:
        hcm |= {k: v for k, v in merge.items() if k != "@type"}
    envoy_accepts(hcm)


def test_render_yaml_is_every_object_once(tmp_path):
    import yaml

    docs = list(yaml.safe_load_all(istio.render_yaml(load_policy(PRODUCTION), OPTS)))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Service"] * 3 + ["DestinationRule"] * 2 + ["VirtualService", "EnvoyFilter", "EnvoyFilter"]
    wasm = tmp_path / "f.wasm"
    wasm.write_bytes(b"\0asm")
    assert istio.module_sha256(wasm) == "cd5d4935a48c0672cb06407bb443bc0087aff947c6b864bac886982c73b3027f"


def test_cli_renders_the_istio_objects(capsys):
    import yaml

    from infermesh.cli import main

    assert main(["policy", "render", str(PRODUCTION), "istio", "--wasm-url", OPTS.wasm_url, "--wasm-sha256", SHA,
                 "--namespace", "llm"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "EnvoyFilter"} == {"llm"}
    assert docs == istio.resources(load_policy(PRODUCTION), istio.IstioOptions(wasm_url=OPTS.wasm_url, wasm_sha256=SHA, namespace="llm"))
    assert main(["policy", "render", str(PRODUCTION), "istio", "--wasm-url", OPTS.wasm_url, "--wasm-sha256", "x"]) == 2
    assert "wasm_sha256: 64 lower-case hex digits" in capsys.readouterr().err


def test_a_native_filter_runtime_is_refused_for_istio_naming_the_field_and_line(tmp_path, capsys):
    from infermesh.cli import main

    assert "filter:" not in HEADER_ONLY
    text = HEADER_ONLY + "filter:\n  runtime: native\n"
    policy = parse_policy(text)
    assert policy.filter.runtime == "native"
    for build in (lambda: istio.resources(policy, OPTS), lambda: istio.chart_parts(policy), lambda: istio.helm_values(policy, {})):
        with pytest.raises(istio.IstioConfigError, match="filter.runtime: Istio's proxy runs the filter as Wasm only") as e:
            build()
        assert e.value.field == "filter.runtime"
    path = tmp_path / "native.yaml"
    path.write_text(text)
    line = text.splitlines().index("  runtime: native") + 1
    for what in (["istio", "--wasm-url", OPTS.wasm_url, "--wasm-sha256", SHA], ["helm-values"]):
        assert main(["policy", "render", str(path), *what]) == 2
        assert capsys.readouterr().err.startswith(f"{path}:{line}: filter.runtime: ")


def test_without_helm_the_istio_objects_are_refused_naming_the_ways_to_get_it(tmp_path, monkeypatch, capsys):
    """The objects are the chart's, rendered by Helm: with none found (no $INFERMESH_HELM, none
    built under INFERMESH_HOME, none on PATH) the command says so and how to get one."""
    from infermesh.cli import main

    monkeypatch.delenv(istio.HELM_ENV, raising=False)
    monkeypatch.setenv("INFERMESH_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(istio.HelmMissing, match="scripts/setup-chart-tools.sh"):
        istio.resources(load_policy(PRODUCTION), OPTS)
    assert main(["policy", "render", str(PRODUCTION), "istio", "--wasm-url", OPTS.wasm_url, "--wasm-sha256", SHA]) == 2
    err = capsys.readouterr().err
    assert "rendered with Helm 3, and none was found" in err and istio.HELM_ENV in err


def test_an_error_of_the_chart_comes_back_as_its_own_message():
    policy = parse_policy(HEADER_ONLY.replace("fast:", "f" * 60 + ":").replace("pool: fast", "pool: " + "f" * 60))
    with pytest.raises(istio.IstioConfigError) as e:
        istio.resources(policy, OPTS)
    assert str(e.value) == f'policy.pools.{"f" * 60}: the Service name "infermesh-{"f" * 60}" is longer than 63 characters'
