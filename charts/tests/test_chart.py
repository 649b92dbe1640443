"""The Helm chart: it lints, renders objects that the real Kubernetes / Istio / Prometheus
Operator schemas accept (strictly), matches its golden files, and is the one layout of the Istio
objects: its templates take every decision from the policy model (istio_parts.py, through the
`generated` values the CLI writes and files/istio-decisions.json), no Python module lays one
out, and `infermesh policy render POLICY istio` (istio.py) prints the chart's own objects for
the same values (docs/istio.md). Its routes decide every request of a matrix as the plain-Envoy
routes do. Typos in values and broken objects are rejected by name.

Golden files: charts/tests/golden/SCENARIO.yaml. After an intended change, regenerate them with
    INFERMESH_UPDATE_GOLDEN=1 ~/.cache/infermesh/venv/bin/python -m pytest charts/tests -k golden
and review the diff.
"""

from __future__ import annotations

import ast
import atexit
import copy
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from helm_render import CHART, HERE, NAMESPACE, RELEASE, REPO
from kube_schema import SchemaError
from route_tables import Outcome, Request, envoy_outcome, filter_head_decision, istio_outcome

from infermesh.meshconfig import chart_values, istio, istio_parts
from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.envoy_resources import EDGE_PATHS, STRIP_CLIENT_HEADERS, WASM_FILTER, Routing, is_grpc_method
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import LOCAL_POLICY, Policy, load_policy, parse_policy
from infermesh.sidecar.grpc_api import INFERENCE_SERVICE
from infermesh.sidecar.metrics import SidecarMetrics
from infermesh.sidecar.server import build_parser, config_from_args

PRODUCTION_VALUES = CHART / "examples" / "production-values.yaml"
PRODUCTION_POLICY = REPO / "mesh-config" / "policies" / "production.yaml"
PIN = HERE / "values" / "filter-pin.yaml"
VALUES = HERE / "values"
# Per scenario: the policy (None: the chart's bundled one) and the values files after it.
SCENARIO_INPUTS: dict[str, tuple[Path | None, list[Path]]] = {
    "default": (None, [PIN]),
    "production": (PRODUCTION_POLICY, [PRODUCTION_VALUES]),
    "header-only": (VALUES / "header-only-policy.yaml", [PIN, VALUES / "header-only.yaml"]),
    "native-header-only": (VALUES / "native-header-only-policy.yaml", [PIN]),
}
GENERATED = Path(tempfile.mkdtemp(prefix="infermesh-chart-values-"))
atexit.register(shutil.rmtree, GENERATED, ignore_errors=True)  # made at import: gone with the process


def policy_values(policy_file: Path) -> Path:
    """The values file `infermesh policy render POLICY helm-values` writes for a policy."""
    out = GENERATED / f"{policy_file.stem}-{hashlib.sha256(str(policy_file).encode()).hexdigest()[:8]}.json"
    if not out.exists():
        out.write_text(json.dumps(istio.helm_values(load_policy(policy_file), yaml.safe_load(policy_file.read_text())), indent=2))
    return out


def scenario_files(name: str) -> list[Path]:
    policy, files = SCENARIO_INPUTS[name]
    return ([policy_values(policy)] if policy else []) + files


SCENARIOS = {name: scenario_files(name) for name in SCENARIO_INPUTS}
# Helm's bookkeeping labels, which istio.resources leaves out (its objects are applied without Helm).
CHART_ONLY_LABELS = set(istio.HELM_LABELS)


def merged_values(files: list[Path]) -> dict:
    """The values Helm renders with: values.yaml, then each file merged in, map by map."""
    def merge(base, over):
        if isinstance(base, dict) and isinstance(over, dict):
            return {k: merge(base[k], v) if k in base else v for k, v in over.items()} | {k: v for k, v in base.items() if k not in over}
        return over

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in files:
        values = merge(values, yaml.safe_load(f.read_text()))
    return values


def scenario_policy(values: dict) -> Policy:
    if values["policy"]:
        return Policy.model_validate(values["policy"])
    return load_policy(CHART / "files" / "default-policy.yaml")


def istio_options(values: dict) -> istio.IstioOptions:
    f, ingress = values["filter"], values["ingress"]
    return istio.IstioOptions(
        wasm_url=f["url"], wasm_sha256=f["sha256"], name=RELEASE, namespace=NAMESPACE, cluster_domain=values["clusterDomain"],
        http_port=values["ports"]["http"], grpc_port=values["ports"]["grpc"], fail_strategy=f["failStrategy"],
        filter_namespace=f["namespace"], filter_selector=f["selector"], attach_to=f["attachTo"],
        ingress=ingress["enabled"], hosts=tuple(ingress["hosts"]), ingress_port=ingress["port"], ingress_selector=ingress["selector"],
        tls_credential_name=ingress["tlsCredentialName"],
        image_pull_policy=f["imagePullPolicy"], image_pull_secret=f["imagePullSecret"], traffic_policy=values["trafficPolicy"],
        retry_budget=values["retryBudget"], tracing_provider=values["tracing"]["istioProvider"],
    )


@pytest.fixture(scope="module", params=list(SCENARIOS))
def scenario(request, helm):
    files = SCENARIOS[request.param]
    values = merged_values(files)
    return request.param, files, values, helm.template(files)


def test_lint(helm):
    for files in SCENARIOS.values():
        r = helm.run("lint", str(CHART), "--strict", "--kube-version", helm.kube_version, *[a for f in files for a in ("--values", str(f))])
        assert r.returncode == 0, r.stdout + r.stderr


def test_every_object_passes_its_schema(scenario, schemas):
    name, _, values, rendered = scenario
    for obj in rendered.objects:
        schemas.validate(obj)
    kinds = sorted({o["kind"] for o in rendered.objects})
    expected = {"ConfigMap", "Deployment", "Service", "DestinationRule", "VirtualService", "PodDisruptionBudget", "AuthorizationPolicy"}
    assert expected <= set(kinds), kinds
    if name == "production":  # everything on: the monitoring objects are checked too
        assert {"ServiceMonitor", "PrometheusRule", "Gateway", "PeerAuthentication", "EnvoyFilter"} <= set(kinds)


def test_golden(scenario):
    name, _, _, rendered = scenario
    golden = HERE / "golden" / f"{name}.yaml"
    if os.environ.get("INFERMESH_UPDATE_GOLDEN"):
        golden.write_text(rendered.text)
    assert golden.exists(), f"no {golden.name}: regenerate with INFERMESH_UPDATE_GOLDEN=1 (see this file's docstring)"
    assert rendered.text == golden.read_text(), f"{golden.name} differs from the render: review, then regenerate (see this file's docstring)"


def _comparable(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    for k in CHART_ONLY_LABELS:
        obj["metadata"]["labels"].pop(k, None)
    return obj


def test_policy_render_istio_gives_the_charts_own_objects(scenario, helm):
    """`infermesh policy render POLICY istio` (istio.resources) is the chart rendered with the
    values its options map to: for each scenario's values, the same Istio objects as the chart's
    whole render, object for object, but Helm's labels."""
    _, _, values, rendered = scenario
    policy = scenario_policy(values)
    objects = istio.resources(policy, istio_options(values), raw_policy=values["policy"] or None, helm=helm.binary)
    assert not {label for o in objects for label in o["metadata"]["labels"]} & CHART_ONLY_LABELS
    _assert_same_istio_objects(rendered.objects, objects)
    # The pools are the policy's, nothing more or less.
    assert {d["metadata"]["labels"]["infermesh.io/pool"] for d in rendered.of("Deployment")} == set(policy.pools)


def _assert_same_istio_objects(objects: list[dict], expected: list[dict]) -> None:
    expected = [_comparable(o) for o in expected]
    kinds = {o["kind"] for o in expected}
    # Of the kinds the whole chart has more of (Services, the pools' AuthorizationPolicy), those `expected` names.
    partial = {"Service", "AuthorizationPolicy"}
    named = {(o["kind"], o["metadata"]["name"]) for o in expected if o["kind"] in partial}
    got = [_comparable(o) for o in objects
           if o["kind"] in kinds and (o["kind"] not in partial or (o["kind"], o["metadata"]["name"]) in named)]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(got, key=key) == sorted(expected, key=key)


def test_the_same_generated_values_serve_any_release_namespace_and_ports(helm):
    """The model's parts hold no release, namespace or port: rendered as another release, in
    another namespace, on other ports (and a module on the proxies' disk, file://), the chart
    renders them, and istio.resources gives the same objects for those options."""
    files = SCENARIOS["native-header-only"]
    r = helm.run("template", "llm", str(CHART), "--namespace", "prod", "--kube-version", helm.kube_version,
                 *[a for f in files for a in ("--values", str(f))], "--set", "ports.http=9000", "--set", "ports.grpc=9001",
                 "--set", "filter.url=file:///var/lib/infermesh/filter.wasm")
    assert r.returncode == 0, r.stderr
    values = merged_values(files)
    values["ports"] |= {"http": 9000, "grpc": 9001}
    values["filter"]["url"] = "file:///var/lib/infermesh/filter.wasm"
    opts = dataclasses.replace(istio_options(values), name="llm", namespace="prod")
    _assert_same_istio_objects([o for o in yaml.safe_load_all(r.stdout) if o],
                                         istio.resources(scenario_policy(values), opts, raw_policy=values["policy"], helm=helm.binary))


def test_the_configmap_carries_the_policy_itself(scenario):
    _, _, values, rendered = scenario
    cm = rendered.one("ConfigMap", f"{RELEASE}-policy")
    assert parse_policy(cm["data"]["policy.yaml"]) == scenario_policy(values)


def test_each_deployment_runs_its_pool_as_the_sidecar_reads_the_command_line(scenario, tmp_path):
    _, _, values, rendered = scenario
    policy = scenario_policy(values)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(rendered.one("ConfigMap", f"{RELEASE}-policy")["data"]["policy.yaml"])
    drain = values["drain"]
    for d in rendered.of("Deployment"):
        pool = d["metadata"]["labels"]["infermesh.io/pool"]
        pod = d["spec"]["template"]["spec"]
        c = next(c for c in pod["containers"] if c["name"] == "sidecar")
        assert c["command"] == ["python", "-m", "infermesh.sidecar.server"]
        args = [a.replace("/etc/infermesh/policy.yaml", str(policy_file)).replace("$(POD_NAME)", f"{d['metadata']['name']}-0") for a in c["args"]]
        cfg = config_from_args(build_parser().parse_args(args))
        assert cfg.pool == pool and cfg.server.host == "0.0.0.0" and cfg.admin.host == "127.0.0.1"
        assert (cfg.server.http_port, cfg.server.grpc_port) == (values["ports"]["http"], values["ports"]["grpc"])
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": cfg.server.http_port, "grpc": cfg.server.grpc_port}
        # The pod outlives the sidecar's drain: preStop, then drain grace, then engine shutdown.
        assert cfg.server.drain_grace_s == drain["graceSeconds"]
        assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == drain["preStopSleepSeconds"]
        assert pod["terminationGracePeriodSeconds"] == drain["preStopSleepSeconds"] + drain["graceSeconds"] + drain["shutdownMarginSeconds"]
        proxy = json.loads(d["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"])
        assert proxy == {"terminationDrainDuration": f"{drain['preStopSleepSeconds'] + drain['graceSeconds']}s"}
        # Probes: grpc.health on the gRPC front (the service the sidecar reports; "" for liveness).
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": cfg.server.grpc_port, "service": INFERENCE_SERVICE}
        assert c["livenessProbe"]["grpc"] == {"port": cfg.server.grpc_port}
        assert d["spec"]["replicas"] == policy.pools[pool].replicas
        assert d["spec"]["template"]["metadata"]["labels"]["sidecar.istio.io/inject"] == "true"
        local = any(m.path is None for m in policy.pools[pool].models)
        assert [i["name"] for i in pod.get("initContainers", [])] == (["models"] if local else [])


def test_gpu_pools_get_their_gpus_nodes_and_tolerations(helm):
    values = merged_values(SCENARIOS["production"])
    rendered = helm.template(SCENARIOS["production"])
    for pool, spec in scenario_policy(values).pools.items():
        pod = rendered.one("Deployment", f"{RELEASE}-{pool}")["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == spec.gpu.count > 0
        assert pod["nodeSelector"] == values["gpuNodeSelectors"][spec.gpu.type]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # A CPU pool asks for no GPU and tolerates nothing; a pool's own settings add to its GPU's.
    cpu = helm.template(SCENARIOS["default"]).one("Deployment", f"{RELEASE}-batch")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"].get("limits", {})
    assert "nodeSelector" not in cpu and "tolerations" not in cpu
    fast = helm.template(SCENARIOS["header-only"]).one("Deployment", f"{RELEASE}-fast")["spec"]["template"]["spec"]
    assert fast["nodeSelector"] == {"topology.kubernetes.io/zone": "us-east-1a", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert [t["key"] for t in fast["tolerations"]] == ["nvidia.com/gpu", "dedicated"]


def test_filter_form_follows_the_rules(helm):
    # The local policy has a body rule (chat-bulk): the EnvoyFilter form, in the gateway.
    ef = helm.template(SCENARIOS["default"]).one("EnvoyFilter", f"{RELEASE}-filter")
    assert ef["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]["allow_on_headers_stop_iteration"] is True
    # Header-only rules decided natively: an EnvoyFilter too (it names the filter the routes turn off).
    assert helm.template(SCENARIOS["native-header-only"]).one("EnvoyFilter", f"{RELEASE}-filter")
    # Header-only rules with a trusted source: the filter decides every request, as a WasmPlugin.
    header_only = helm.template(SCENARIOS["header-only"])
    # (The pools' EnvoyFilter is in every form: test_pools_envoy_filter_says_what_istio_cannot.)
    assert [o["metadata"]["name"] for o in header_only.of("EnvoyFilter")] == [f"{RELEASE}-pools"]
    wp = header_only.one("WasmPlugin")
    assert wp["metadata"]["namespace"] == "apps" and wp["spec"]["match"] == [{"mode": "CLIENT"}]
    # The given labels replace the default ones (a default in values.yaml would be merged in).
    assert wp["spec"]["selector"] == {"matchLabels": {"infermesh.io/client": "true"}}
    assert wp["spec"]["failStrategy"] == "FAIL_CLOSE" and wp["spec"]["imagePullSecret"] == "registry-credentials"
    assert not header_only.of("Gateway") and len(header_only.of("VirtualService")) == 1


def test_secure_by_default(helm):
    rendered = helm.template(SCENARIOS["default"])
    pa = rendered.one("PeerAuthentication")
    assert pa["spec"]["mtls"] == {"mode": "STRICT"}
    az = rendered.one("AuthorizationPolicy", RELEASE)
    assert az["spec"]["action"] == "ALLOW"
    (rule,) = az["spec"]["rules"]
    assert rule["from"] == [{"source": {"principals": ["cluster.local/ns/istio-ingress/sa/istio-ingress"]}}]
    assert rule["to"] == [{"operation": {"ports": ["8000", "50051"]}}]
    sidecar_pods = {"app.kubernetes.io/component": "sidecar"}
    assert sidecar_pods.items() <= pa["spec"]["selector"]["matchLabels"].items()
    assert sidecar_pods.items() <= az["spec"]["selector"]["matchLabels"].items()
    # Only the serving fronts are ports of a container or a Service; the admin API has none.
    for d in rendered.of("Deployment"):
        assert [p["name"] for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]] == ["http", "grpc"]
    for s in rendered.of("Service"):
        assert [p["name"] for p in s["spec"]["ports"]] == ["http", "grpc"]
    # No principals at all: the rule goes, and with namespaces only those remain allowed.
    # (Their proxies run the filter there, filter.attachTo: sidecar: they health-check and probe.)
    ns_only = helm.template(SCENARIOS["header-only"]).one("AuthorizationPolicy")
    assert ns_only["spec"]["rules"] == [{"from": [{"source": {"namespaces": ["apps"]}}], "to": [{"operation": {"ports": ["8000", "50051"]}}]}]


def test_only_the_serving_api_at_the_edge(helm):
    """The VirtualService routes the serving API's paths only and ends with a JSON 404; the
    gateway denies every other path of its hosts; peers of allowedNamespaces reach only those
    paths of the pools, while the gateway's principal (health checks, the filter's probe) reaches
    every path."""
    from infermesh.meshconfig.envoy_resources import NOT_FOUND_ROUTE

    rendered = helm.template(SCENARIOS["production"])
    for vs in rendered.of("VirtualService"):
        *routes, last = vs["spec"]["http"]
        assert last["name"] == NOT_FOUND_ROUTE and "match" not in last and last["directResponse"]["status"] == 404
        assert json.loads(last["directResponse"]["body"]["string"])["error"]["code"] == "not_found"
        for r in routes:  # every route names its paths: none is a catch-all to a pool
            assert r["match"] and all("uri" in m and "prefix" not in m["uri"] for m in r["match"]), r
    edge = rendered.one("AuthorizationPolicy", f"{RELEASE}-edge")
    assert edge["metadata"]["namespace"] == "istio-ingress" and edge["spec"]["action"] == "DENY"
    assert edge["spec"]["selector"] == {"matchLabels": {"istio": "ingress"}}
    values = merged_values(SCENARIOS["production"])
    assert edge["spec"]["rules"] == [{"to": [{"operation": {"hosts": values["ingress"]["hosts"], "notPaths": list(EDGE_PATHS)}}]}]
    pools = rendered.one("AuthorizationPolicy", RELEASE)["spec"]["rules"]
    by_source = {next(iter(r["from"][0]["source"])): r["to"][0]["operation"] for r in pools}
    assert "paths" not in by_source["principals"], "the gateway's health checks and probes reach /health and the state"
    assert by_source["namespaces"]["paths"] == list(EDGE_PATHS)
    # No gateway (ingress off) or the filter in client sidecars: no edge policy at the gateway.
    assert not [o for o in helm.template(SCENARIOS["header-only"]).of("AuthorizationPolicy") if o["metadata"]["name"].endswith("-edge")]


@pytest.mark.parametrize("name", ["production", "header-only"])
def test_alert_rules_load_as_prometheus_loads_a_rule_file(helm, chart_tools, name):
    rule = helm.template(SCENARIOS[name]).one("PrometheusRule")
    rule_file = yaml.safe_dump({"groups": rule["spec"]["groups"]})
    r = subprocess.run([chart_tools["RULECHECK"]], input=rule_file, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # And it does refuse a broken expression.
    broken = rule_file.replace("> 0.8", "> > 0.8")
    r = subprocess.run([chart_tools["RULECHECK"]], input=broken, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "InfermeshModelColdStartSlow" in r.stdout and "parse error" in r.stdout


def test_alerts_watch_metrics_the_sidecar_exports(helm):
    rule = helm.template(SCENARIOS["production"]).one("PrometheusRule")
    exported = {m.name for m in SidecarMetrics("p", "0").registry.collect()}
    # prometheus_client names counters without _total and serves them with it.
    exported |= {n + "_total" for n in exported}
    rules = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert {"InfermeshPoolDegraded", "InfermeshKVCacheHigh", "InfermeshModelColdStartSlow", "InfermeshShedRateHigh"} <= set(rules)
    for r in rules.values():
        used = set(re.findall(r"\binfermesh_[a-z_]+", r["expr"]))
        assert used and used <= exported, f"{r['alert']}: {sorted(used - exported)} are not sidecar metrics"
    assert rules["InfermeshModelColdStartSlow"]["expr"].endswith("> 0.8")


def test_values_schema_is_generated_from_the_policy_model():
    assert (CHART / "values.schema.json").read_text() == chart_values.render(), \
        "regenerate: python -m infermesh.meshconfig.chart_values > charts/infermesh/values.schema.json"


def test_bundled_policy_and_its_generated_values_are_the_repositorys():
    """files/default-policy.yaml is mesh-config/policies/local.yaml, files/default-generated.json
    what the CLI generates for it. The production example holds no policy: the CLI writes it."""
    assert (CHART / "files" / "default-policy.yaml").read_text() == LOCAL_POLICY.read_text(), "copy mesh-config/policies/local.yaml"
    bundled = CHART / "files" / "default-generated.json"
    generated = json.dumps(istio.helm_values(load_policy(LOCAL_POLICY), yaml.safe_load(LOCAL_POLICY.read_text()))["generated"], indent=2) + "\n"
    if os.environ.get("INFERMESH_UPDATE_GOLDEN"):
        bundled.write_text(generated)
    # Byte for byte: the generator's text depends on nothing that ran before it in the process
    # (mesh-config/tests/test_generation_history.py).
    assert bundled.read_text() == generated, \
        f"{bundled.name} is stale: regenerate with INFERMESH_UPDATE_GOLDEN=1 (see this file's docstring)"
    assert "policy" not in yaml.safe_load(PRODUCTION_VALUES.read_text())


def test_the_istio_decisions_file_is_the_models():
    """files/istio-decisions.json is istio_parts.ISTIO_DECISIONS."""
    bundled = CHART / "files" / "istio-decisions.json"
    if os.environ.get("INFERMESH_UPDATE_GOLDEN"):
        bundled.write_text(istio_parts.decisions_file())
    assert bundled.read_text() == istio_parts.decisions_file(), \
        f"{bundled.name} is stale: python -m infermesh.meshconfig.istio_parts > charts/infermesh/files/istio-decisions.json"


# What only the model decides (istio_parts.ISTIO_DECISIONS): as a literal in a template it would
# be a second copy.
DECISION_LITERALS = [r"outbound\|", r"infermesh-spill", r"\bGATEWAY\b", r"SIDECAR_OUTBOUND", r"FAIL_CLOSED", r'"file://"', r'"istio" +"ingress"',
                     r"track_remaining", r"maxConnections", r"http1MaxPendingRequests", r"http2MaxRequests", r"maxRetries", r"\bCLIENT\b",
                     r"\bfilename\b"]


def test_the_templates_take_every_istio_decision_from_the_model():
    for template in sorted((CHART / "templates").iterdir()):
        text = re.sub(r"\{\{-? */\*.*?\*/ *-?\}\}", "", template.read_text(), flags=re.S)  # (not their comments)
        text = re.sub(r"(?m)^ *#.*$", "", text)
        assert not [x for x in DECISION_LITERALS if re.search(x, text)], template.name


# Istio's API groups: an object of one built in Python would be a second layout of a template's.
ISTIO_API_GROUP = re.compile(r"\b(networking|security|extensions)\.istio\.io/")


def test_no_python_module_lays_out_an_istio_object():
    """The chart's templates are the one layout of the Istio objects (docs/istio.md): no module of
    the policy model and its generators (mesh-config/meshconfig) names an Istio API group, an
    apiVersion or a kind; istio.py renders the chart."""
    for path in sorted((REPO / "mesh-config" / "meshconfig").glob("*.py")):
        strings = [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert not [x for x in strings if ISTIO_API_GROUP.search(x) or x in ("apiVersion", "kind")], path.name


@pytest.mark.parametrize("setting, message", [
    ("ingres.enabled=true", "additional properties 'ingres' not allowed"),
    ("policy.pools.h100.replica=2", "at '/policy/pools/h100': additional properties 'replica' not allowed"),
    ("filter.failStrategy=FAIL_SOMETIMES", "at '/filter/failStrategy'"),
    ("filter.sha256=deadbeef", "at '/filter/sha256'"),
    ("policy.pools.Big_Pool.replicas=1", "at '/policy/pools': additional properties 'Big_Pool' not allowed"),
    ("trafficPolicy.outlierDetection.consecutive5xx=3", "'consecutive5xx' not allowed"),
    ("policy.pools.h100.models[0].tool_parser=hermes", "at '/policy/pools/h100/models/0': additional properties 'tool_parser' not allowed"),
    ("policy.pools.h100.models[0].enable_auto_tool_choice=yes", "at '/policy/pools/h100/models/0/enable_auto_tool_choice'"),
    # Istio's proxy cannot load the native dynamic module (plain Envoy only).
    ("policy.filter.runtime=native", "at '/policy/filter/runtime'"),
])
def test_values_typos_are_rejected_by_the_schema(helm, setting, message):
    assert message in helm.template_error(SCENARIOS["production"], [setting])


@pytest.mark.parametrize("setting, message", [
    ('policy.rules[0].match={"headrs": [{"name": "x-priority", "exact": "high"}]}', "at '/policy/rules/0/match': additional properties 'headrs' not allowed"),
    ('policy.rules[1].match.body={"service_tier": {"exact": "priority", "prefix": "p"}}', "at '/policy/rules/1/match/body/service_tier'"),
    ('policy.rules[0].name="default"', "at '/policy/rules/0/name'"),
    # A bare YAML 1.1 n is false: the schema says so instead of the filter never matching.
    ('policy.rules[4].match.body={"false": {"min": 4}}', "at '/policy/rules/4/match/body': additional properties 'false' not allowed"),
])
def test_rule_typos_are_rejected_as_the_filter_would(helm, setting, message):
    assert message in helm.template_error(SCENARIOS["production"], set_json=[setting])


@pytest.mark.parametrize("values, setting, message", [
    # Edited after its generated values were written: the chart's parts would be another policy's.
    (SCENARIOS["production"], 'policy.classes.batch.pool="h100"', "generated.policySha256: written for another policy"),
    ([PIN], "policy=" + json.dumps(yaml.safe_load((VALUES / "header-only-policy.yaml").read_text())), "generated: missing: "),
    (SCENARIOS["production"], 'pools.a10={"nodeSelector": {"x": "y"}}', "pools.a10: not a pool of the policy [h100 l4]"),
    ([], None, "filter.url: required"),
    ([], 'filter.url="oci://r.example/f:1"', "filter.sha256: required"),
])
def test_stale_or_missing_generated_values_and_required_settings_fail_by_name(helm, values, setting, message):
    assert message in helm.template_error(values, set_json=[setting] if setting else [])


@pytest.mark.parametrize("change, message", [
    (("batch: {pool: l4", "batch: {pool: a10"), "classes.batch.pool: 'a10' is not one of the pools ['h100', 'l4']"),
    (("default_class: batch", "default_class: nope"), "default_class: 'nope' is not one of the classes"),
    (("class: premium", "class: vip"), "rules.0.class: unknown class `vip`"),
    (("cpu: {signal: cpu_load, trip_above: 0.95, recover_below: 0.80", "cpu: {signal: cpu_load, trip_above: 0.95, recover_below: 0.99"),
     "pools.h100.breakers.cpu"),
    (("\n  l4:\n", "\n    when_degraded: {spill_to: h100}\n  l4:\n"),
     "pools.h100.when_degraded.spill_to: 'h100' must be another of the pools"),
])
def test_the_policy_model_refuses_what_the_chart_would_take_by_field(tmp_path, capsys, change, message):
    """The chart checks no policy itself: the values it takes are written by the policy model,
    which refuses a broken policy by file, line and field before anything is rendered."""
    from infermesh.cli import main

    bad = tmp_path / "policy.yaml"
    text = PRODUCTION_POLICY.read_text()
    assert change[0] in text
    bad.write_text(text.replace(change[0], change[1], 1))
    assert main(["policy", "render", str(bad), "helm-values"]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:" in err and message in err, err


@pytest.mark.parametrize("kind, break_it, field", [
    ("Deployment", lambda o: o["spec"].update(replica=2), "spec: Additional properties are not allowed ('replica'"),
    ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="http"),
     "spec.template.spec.containers.0.ports.0.containerPort: 'http' is not of type 'integer'"),
    ("Service", lambda o: o["spec"]["ports"][0].pop("port"), "spec.ports.0: 'port' is a required property"),
    ("VirtualService", lambda o: o["spec"]["http"][0]["route"][0]["destination"].update(hots="x"), "spec.http.0.route.0.destination"),
    ("DestinationRule", lambda o: o["spec"]["trafficPolicy"]["outlierDetection"].update(consecutive5xxErrors="five"),
     "spec.trafficPolicy.outlierDetection.consecutive5xxErrors"),
    ("EnvoyFilter", lambda o: o["spec"]["configPatches"][1].update(applyTo="HTTP_FILTERS"), "spec.configPatches.1.applyTo"),
    ("PrometheusRule", lambda o: o["metadata"].update(labelz={}), "metadata: Additional properties are not allowed ('labelz'"),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(intervl="5s"), "spec.endpoints.0"),
])
def test_a_broken_object_fails_its_schema(helm, schemas, kind, break_it, field):
    obj = helm.template(SCENARIOS["production"]).of(kind)[0]
    schemas.validate(obj)
    break_it(obj)
    with pytest.raises(SchemaError) as e:
        schemas.validate(obj)
    assert field in str(e.value)


def test_an_unknown_kind_has_no_schema(schemas):
    with pytest.raises(SchemaError, match="no schema for networking.istio.io/v1 VirtualServce"):
        schemas.validate({"apiVersion": "networking.istio.io/v1", "kind": "VirtualServce", "metadata": {"name": "x"}})


def test_notes_render_and_name_pools_and_filter_form(helm, tmp_path):
    # `helm template` skips NOTES.txt and `helm install --dry-run` needs a cluster. In a copy of
    # the chart, a manifest renders it with `tpl`: the same engine, values and helpers.
    import shutil

    chart = tmp_path / "infermesh"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "files" / "notes.txt")
    (chart / "templates" / "notes-preview.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: {{ tpl (.Files.Get "files/notes.txt") . | quote }}\n')
    r = helm.run("template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", helm.kube_version,
                 *[a for f in SCENARIOS["production"] for a in ("--values", str(f))], "--show-only", "templates/notes-preview.yaml")
    assert r.returncode == 0, r.stderr
    notes = yaml.safe_load(r.stdout)["data"]["notes"]
    assert "  - h100: 2 replica(s), models llama-3-70b -> phi-3-mini" in notes
    assert "  - l4: 4 replica(s), models llama-3-8b" in notes
    assert "Default pool (requests no rule matches): l4" in notes
    assert "an EnvoyFilter (a rule reads the body, or routes decide rules natively)" in notes
    assert "curl -s http://infermesh.infermesh:8000/v1/models" in notes


def test_policy_render_helm_values_gives_a_values_file_for_any_policy(helm, tmp_path, capsys):
    """`infermesh policy render FILE helm-values`: the policy file as chart values, in JSON, so the
    production policy's bare `n` key survives Helm's YAML 1.1 (where it would be false)."""
    from infermesh.cli import main

    production = REPO / "mesh-config" / "policies" / "production.yaml"
    assert main(["policy", "render", str(production), "helm-values"]) == 0
    values = tmp_path / "values.json"
    values.write_text(capsys.readouterr().out)
    assert json.loads(values.read_text()) == json.loads(policy_values(production).read_text())
    rendered = helm.template([PIN, values])
    assert parse_policy(rendered.one("ConfigMap", f"{RELEASE}-policy")["data"]["policy.yaml"]) == load_policy(production)
    assert {d["metadata"]["name"] for d in rendered.of("Deployment")} == {"infermesh-h100", "infermesh-l4"}


MODEL_SERVING = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}", "tool_call_parser": "llama3_json",
                 "enable_auto_tool_choice": True, "reasoning_parser": "deepseek_r1",
                 "default_chat_template_kwargs": {"enable_thinking": False}, "generation_config": "vllm"}


def test_per_model_serving_settings_reach_each_sidecar_through_the_chart(helm, tmp_path, capsys):
    """A model's chat template, parsers, template kwargs and generation config: in the policy, the
    chart's values (its schema takes them), the ConfigMap, and the sidecar config the pod builds."""
    from infermesh.cli import main

    data = yaml.safe_load(PRODUCTION_POLICY.read_text())
    data["pools"]["h100"]["models"][0] |= MODEL_SERVING
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["policy", "render", str(policy_file), "helm-values"]) == 0
    values = tmp_path / "values.json"
    values.write_text(capsys.readouterr().out)
    rendered = helm.template([values, PRODUCTION_VALUES])
    in_pod = tmp_path / "in-pod.yaml"
    in_pod.write_text(rendered.one("ConfigMap", f"{RELEASE}-policy")["data"]["policy.yaml"])
    cfg = config_from_args(build_parser().parse_args(["--policy", str(in_pod), "--pool", "h100"]))
    assert {k: getattr(cfg.models[0], k) for k in MODEL_SERVING} == MODEL_SERVING
    assert cfg.models[1].tool_call_parser is None and cfg.models[1].generation_config == "auto"


def test_plain_helm_template_renders_as_with_an_official_helm(helm):
    """Without --kube-version an official Helm assumes the Kubernetes version of its own client
    libraries, not v1.20: the chart's kubeVersion (>= 1.30) holds. setup-chart-tools.sh builds
    Helm with the flags of Helm's Makefile, which set it (and the version, commit, tree state)."""
    r = helm.run("template", RELEASE, str(CHART), "--values", str(PIN))
    assert r.returncode == 0, r.stderr
    assert {o["kind"] for o in yaml.safe_load_all(r.stdout) if o} >= {"Deployment", "VirtualService", "EnvoyFilter"}
    r = helm.run("version", "--template", "{{ .Version }}|{{ .GitCommit }}|{{ .GitTreeState }}")
    version, commit, tree = r.stdout.strip().split("|")
    # The commit only where the module proxy gave the module's origin (setup-chart-tools.sh).
    assert version.startswith("v3.") and re.fullmatch(r"([0-9a-f]{40})?", commit) and tree == "clean", r.stdout


def _request_matrix() -> list[Request]:
    """Methods (one in lower case), paths (with a query, near misses), the headers the test
    policies' rules read, gRPC, and spoofed routing headers."""
    methods = ["GET", "POST", "post", "HEAD", "PUT"]
    paths = ["/v1/chat/completions", "/v1/chat/completions?api-version=2", "/v1/completions", "/health", "/health?probe=1",
             "/healthz", "/infermesh.v1.Inference/Generate", "/v1/", "/",
             # the edge: the rest of the serving API, and what it must not reach
             "/v1/models", "/tokenize", "/infermesh.v1.Inference/ListModels", "/metrics", "/infermesh/state?healthy_below=1",
             "/admin/state", "/grpc.health.v1.Health/Check", "/v1/chat/completionsX", "/v1/chat/completions/../../metrics"]
    headers = [(), (("x-priority", "high"),), (("x-priority", "low"),), (("x-tenant", "batch-7"),),
               (("x-tenant", "batch-7"), ("x-debug", "1")), (("x-trace-id", "abc"),), (("content-type", "application/grpc"),),
               (("content-type", "application/grpc+proto"), ("x-priority", "high")),
               (("x-infermesh-pool", "fast"), ("x-infermesh-class", "chat")), (("x-infermesh-pool", "slow"),)]
    return [Request(m, p, h) for m in methods for p in paths for h in headers]


@pytest.mark.parametrize("name", list(SCENARIO_INPUTS))
def test_the_charts_routes_decide_every_request_as_the_plain_envoy_routes(helm, name):
    """The chart's VirtualService and EnvoyFilter, read as istiod turns them into Envoy routes,
    against the plain-Envoy route table the local mesh serves for the same policy: for every
    request of a matrix the same pool and front, the same routing headers set by the route, and
    the Wasm filter on exactly where it runs there. Where a route decides, it gives the class and
    rule the filter gives on the headers alone (route_tables.filter_head_decision); where the
    filter runs it decides with the same config and sets the pool header, and both tables then
    send the request to that pool. (The plain-Envoy native routes against the real Envoy and
    filter: e2e/test_native_rules_integration.py; the chart through real istiod:
    e2e/test_istiod_e2e.py.)"""
    files = SCENARIOS[name]
    values, rendered = merged_values(files), helm.template(files)
    policy = scenario_policy(values)
    hcm = bootstrap(LocalMeshPlan(policy=policy).listener(Path("/infermesh.wasm")))["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    plain_routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    plain_config = hcm["http_filters"][0]["typed_config"]["config"]["configuration"]["value"]

    chain = f"{values['filter']['namespace']}.{RELEASE}-filter"
    (ef,) = [o for o in rendered.of("EnvoyFilter") if o["metadata"]["name"] == f"{RELEASE}-filter"] or [None]
    patches = ef["spec"]["configPatches"] if ef else []
    filter_off = {p["match"]["routeConfiguration"]["vhost"]["route"]["name"] for p in patches
                  if p["applyTo"] == "HTTP_ROUTE" and p["patch"]["value"].get("typed_per_filter_config", {}).get(chain, {}).get("disabled")}
    strips = [p for p in patches if p["applyTo"] == "NETWORK_FILTER"
              and p["patch"]["value"]["typed_config"].get("early_header_mutation_extensions") == STRIP_CLIENT_HEADERS]
    assert bool(strips) == ("early_header_mutation_extensions" in hcm)
    # The filter carries the same config, byte for byte where it is a string; degraded-mode
    # routing probes each pool through the cluster Istio gives its HTTP port instead of pool_NAME.
    same = json.loads(plain_config)
    for pool, p in same.get("degraded_routing", {}).get("pools", {}).items():
        p["probe_cluster"] = f"outbound|{values['ports']['http']}||{RELEASE}-{pool}.{NAMESPACE}.svc.{values['clusterDomain']}"
    if ef:
        value = patches[0]["patch"]["value"]["typed_config"]["config"]["configuration"]["value"]
        assert value == plain_config if "degraded_routing" not in same else json.loads(value) == same
    else:
        assert rendered.one("WasmPlugin")["spec"]["pluginConfig"] == same

    http = rendered.one("VirtualService", RELEASE)["spec"]["http"]
    pool_of_host = {f"{RELEASE}-{p}.{NAMESPACE}.svc.{values['clusterDomain']}": p for p in policy.pools}
    grpc_port = values["ports"]["grpc"]

    def both(req: Request, arriving: bool = True) -> Outcome:
        if arriving and strips:
            req = req.stripped()
        plain = envoy_outcome(plain_routes, WASM_FILTER, req)
        mesh = istio_outcome(http, filter_off, pool_of_host, grpc_port, req)
        assert plain is not None and mesh is not None and mesh.decision() == plain.decision(), (req, plain, mesh)
        return plain

    native = served = 0
    degradable = Routing.from_policy(policy).degradable
    for req in _request_matrix():
        outcome = both(req)
        # Only the serving API reaches a pool, whatever the headers say; the rest is the edge's 404.
        # A gRPC method only for a gRPC call; an HTTP path for any (the HTTP front takes it).
        path, grpc_call = req.path.split("?")[0], (req.header("content-type") or "").startswith("application/grpc")
        public = path in EDGE_PATHS and (grpc_call or not is_grpc_method(path))
        assert outcome.not_found == (not public), (req, outcome)
        if outcome.not_found:
            assert both(req.stripped().with_header("x-infermesh-pool", policy.default_pool), arriving=False).not_found
            continue
        served += 1
        if strips:  # native rules: a route decides exactly where the filter would on the headers alone
            head = filter_head_decision(policy, req.stripped())
            # ... unless when_degraded may shed the class: the filter applies it.
            assert outcome.filter_runs == (head is None or head[0] in degradable), (req, outcome, head)
            head = None if outcome.filter_runs else head
            if head is not None:
                sets = dict(outcome.sets)
                cls, rule = head
                assert (sets["x-infermesh-class"], sets["x-infermesh-rule"], sets["x-infermesh-pool"]) == (cls, rule, policy.classes[cls].pool)
                assert outcome.pool == policy.classes[cls].pool
        if outcome.filter_runs:
            for pool in policy.pools:  # the filter's decision, then the route chosen again
                assert both(req.stripped().with_header("x-infermesh-pool", pool), arriving=False).pool == pool
        else:
            native += 1
    if name == "native-header-only":
        assert native == served  # every rule decided by a route: the filter never runs
    elif name == "default":
        # when_degraded sheds batch (the filter decides its requests) and spills interactive, which
        # Envoy does (the health check and aggregate cluster of the pools' EnvoyFilter): the
        # interactive rules the routes can say are decided by them.
        assert 0 < native < served
    else:
        assert native == 0  # trusted sources: only the filter may decide



def test_the_policy_digest_is_the_one_helm_takes(helm, tmp_path):
    """The chart compares `sha256sum (toJson .Values.policy)` with the digest the CLI wrote, so
    Python must write the policy's JSON as Go does: integral floats without a fraction, small
    floats without an exponent, <, > and & escaped, other characters as they are."""
    text = PRODUCTION_POLICY.read_text()
    for old, new in (("path: meta-llama/Meta-Llama-3-8B-Instruct", 'path: "meta-llama/Llama <8B> & Co, Zürich"'),
                     ("recover_sustain_s: 30, actions: [degrade]", "recover_sustain_s: 30.0, actions: [degrade]"),
                     ("sustain_s: 10,", "sustain_s: 0.00001,")):
        assert old in text
        text = text.replace(old, new, 1)
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    assert istio.go_json({"a": [1.0, 1e-05, 0.92, 1e-07, "<&>"]}) == '{"a":[1,0.00001,0.92,1e-7,"\\u003c\\u0026\\u003e"]}'
    rendered = helm.template([policy_values(policy), PIN])
    assert "meta-llama/Llama <8B> & Co, Zürich" in rendered.one("ConfigMap", f"{RELEASE}-policy")["data"]["policy.yaml"]


def test_pools_envoy_filter_says_what_istio_cannot(helm):
    """The pools' EnvoyFilter, in every form: per pool weighted round robin and (retryBudget) the
    threshold with the retry budget, from the DestinationRule's limits with values overrides; per
    route of the VirtualService its retry/hedge patch. istio.resources maps the same options."""
    files = SCENARIOS["production"]
    for sets, budget, max_connections in (([], True, 4096), (["retryBudget=false"], False, None),
                                          (["trafficPolicy.connectionPool.tcp.maxConnections=7"], True, 7)):
        rendered = helm.template(files, sets)
        ef = rendered.one("EnvoyFilter", f"{RELEASE}-pools")
        values = merged_values(files)
        values["retryBudget"] = budget
        if max_connections == 7:
            values["trafficPolicy"] = {"connectionPool": {"tcp": {"maxConnections": 7}}}
        opts = istio_options(values)
        (want,) = [o for o in istio.resources(scenario_policy(values), opts, raw_policy=values["policy"], helm=helm.binary)
                   if o["metadata"]["name"] == f"{RELEASE}-pools"]
        assert ef["spec"] == want["spec"], sets
        patches = ef["spec"]["configPatches"]
        ops = [p["patch"]["operation"] for p in patches if p["applyTo"] == "CLUSTER"]
        assert ops == ["MERGE", "MERGE_AND_REPLACE_LIST"] * 2 if budget else ["MERGE"] * 2, (sets, ops)
        if budget:
            assert {p["patch"]["value"]["circuit_breakers"]["thresholds"][0]["max_connections"]
                    for p in patches if p["patch"]["operation"] == "MERGE_AND_REPLACE_LIST"} == {max_connections}
        routes = [p["match"]["routeConfiguration"]["vhost"]["route"]["name"] for p in patches if p["applyTo"] == "HTTP_ROUTE"]
        # (Not the edge's 404: it goes to no pool.)
        assert routes == [r["name"] for r in rendered.one("VirtualService", RELEASE)["spec"]["http"] if "directResponse" not in r]
