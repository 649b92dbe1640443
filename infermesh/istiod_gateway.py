"""Real istiod configuring a real Envoy as the Istio ingress gateway from the chart's own rendered
objects, without Kubernetes: the chart's forms (`FORMS`), their render (`render`), the
ServiceEntries Istio would derive from the pool Services (`pool_service_entries`), and the
istiod + Envoy pair (`start_gateway`).

istiod is Istio's discovery server built from the istio.io/istio module (e2e/istiod, built by
scripts/setup-istiod.sh) reading a directory of YAML; Envoy (upstream, with the compiled filter)
connects as a `router` node carrying the gateway pods' labels. Used by e2e/test_istiod_e2e.py
(which checks what istiod emitted and serves) and by the filter benchmark's Istio form
(filter/bench/istio_form.py, which replays it), so both run exactly the same gateway.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import yaml

from infermesh import paths
from infermesh.chart_render import CHART, Helm, setup_outputs
from infermesh.launcher import _die_with_parent, free_ports, wait_until
from infermesh.meshconfig.xds_server import xds_bootstrap

GATEWAY_NS = "istio-ingress"
GATEWAY_LABELS = {"istio": "ingress"}  # the chart's default filter.selector / ingress.selector
# The Istio version the gateway proxy says it runs (node metadata): the pinned module's.
ISTIO_PROXY_VERSION = "1.31.0"


class PoolPorts(Protocol):
    """A local pool's serving ports (a LocalMesh plan's pool, or the benchmark's sink)."""

    name: str
    http_port: int
    grpc_port: int


def istiod_binary() -> str:
    """The istiod harness, built once by scripts/setup-istiod.sh."""
    return setup_outputs("setup-istiod.sh")["ISTIOD"]


def pool_service_entries(rendered: list[dict], pools: Sequence[PoolPorts]) -> list[dict]:
    """The ServiceEntry Istio derives from each pool Service of the chart and its endpoints:
    the Service's ports (name, number, protocol from appProtocol), the pod's container port the
    targetPort names, here the port of that name of the local pool in `pools`."""
    deployments = {d["metadata"]["labels"].get("infermesh.io/pool"): d for d in rendered if d["kind"] == "Deployment"}
    entries = []
    for svc in rendered:
        pool = svc["metadata"]["labels"].get("infermesh.io/pool")
        if svc["kind"] != "Service" or pool is None:
            continue
        local = next(p for p in pools if p.name == pool)
        local_ports = {"http": local.http_port, "grpc": local.grpc_port}
        container = deployments[pool]["spec"]["template"]["spec"]["containers"][0]
        named = {p["name"] for p in container["ports"]}
        ports, targets = [], {}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, f"{svc['metadata']['name']}: targetPort {port['targetPort']} is no container port"
            ports.append({"name": port["name"], "number": port["port"], "protocol": port["appProtocol"].upper()})
            targets[port["name"]] = local_ports[port["targetPort"]]
        entries.append({
            "apiVersion": "networking.istio.io/v1",
            "kind": "ServiceEntry",
            "metadata": {"name": svc["metadata"]["name"], "namespace": svc["metadata"]["namespace"]},
            "spec": {
                "hosts": [f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"],
                "location": "MESH_INTERNAL",
                "resolution": "STATIC",
                "ports": ports,
                "endpoints": [{"address": "127.0.0.1", "ports": targets, "labels": svc["spec"]["selector"]}],
            },
        })
    return entries


def on_loopback(rendered: list[dict], port: int) -> list[dict]:
    """The chart's objects with the one change this machine needs: the Gateway's server bound to
    127.0.0.1 (a real gateway listens on every address of its pod)."""
    out = copy.deepcopy(rendered)
    for o in out:
        if o["kind"] == "Gateway":
            for server in o["spec"]["servers"]:
                assert server["port"]["number"] == port
                server["bind"] = "127.0.0.1"
    return out


@dataclass
class IstioGateway:
    """istiod (from a directory of YAML) and Envoy as the gateway proxy it configures."""

    istiod: subprocess.Popen
    envoy: subprocess.Popen
    run_dir: Path
    port: int
    admin_port: int
    form: "Form"
    objects: list[dict]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config_dump(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/config_dump?include_eds", timeout=10) as r:
            return json.loads(r.read())

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n" + (self.run_dir / n).read_text(errors="replace")[-4000:] for n in ("istiod.log", "envoy.log"))

    def stop(self) -> None:
        for p in (self.envoy, self.istiod):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def start_gateway(istiod_binary: str, form: "Form", objects: list[dict], config: list[dict], run_dir: Path, port: int,
                  mesh: dict | None = None) -> IstioGateway:
    """istiod reading `config` (the chart's `objects` as this machine runs them), then Envoy.
    `mesh`: MeshConfig fields over the harness's defaults, as istiod's `meshConfig` install
    values (extensionProviders, ...)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    conf = run_dir / "config"
    conf.mkdir()
    (conf / "resources.yaml").write_text(yaml.safe_dump_all(config, sort_keys=False))
    xds_port, debug_port, admin_port = free_ports(3)
    mesh_args = []
    if mesh:
        (run_dir / "mesh.yaml").write_text(yaml.safe_dump(mesh, sort_keys=False))
        mesh_args = ["--mesh", str(run_dir / "mesh.yaml")]
    istiod = subprocess.Popen(
        [istiod_binary, "--config", str(conf), "--xds", f"127.0.0.1:{xds_port}", "--debug", f"127.0.0.1:{debug_port}", *mesh_args],
        stdout=subprocess.PIPE, stderr=open(run_dir / "istiod.log", "wb"), stdin=subprocess.DEVNULL, text=True,
        preexec_fn=_die_with_parent,
    )
    first = istiod.stdout.readline()  # "xds ADDR" once pushes are ready, or EOF if it failed
    assert first.startswith("xds "), "istiod did not start:\n" + (run_dir / "istiod.log").read_text(errors="replace")[-6000:]

    boot = xds_bootstrap(admin_port, "127.0.0.1", xds_port, node_id=f"router~127.0.0.1~istio-ingress-e2e.{GATEWAY_NS}~{GATEWAY_NS}.svc.cluster.local")
    # What istio-agent would tell istiod about the gateway pod (Istio's proxy metadata keys).
    boot["node"] = {**boot["node"], "cluster": f"istio-ingress.{GATEWAY_NS}", "metadata": {
        "NAMESPACE": GATEWAY_NS, "CLUSTER_ID": "Kubernetes", "ISTIO_VERSION": ISTIO_PROXY_VERSION, "LABELS": GATEWAY_LABELS,
        "NAME": "istio-ingress-e2e", "WORKLOAD_NAME": "istio-ingress", "SERVICE_ACCOUNT": "istio-ingress", "INSTANCE_IPS": "127.0.0.1",
    }}
    (run_dir / "envoy.json").write_text(json.dumps(boot, indent=2))
    envoy = subprocess.Popen(
        [str(paths.envoy_binary()), "-c", str(run_dir / "envoy.json"), "--use-dynamic-base-id", "--concurrency", "2",
         "--log-level", "warn", "--drain-time-s", "1"],
        stdout=open(run_dir / "envoy.log", "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
    )
    gw = IstioGateway(istiod, envoy, run_dir, port, admin_port, form, objects)

    def serving() -> bool:
        if envoy.poll() is not None or istiod.poll() is not None:
            raise AssertionError("istiod or Envoy exited:\n" + gw.logs())
        try:
            # A serving path: the edge answers only the inference API (issue 28: /health is 404 there).
            return httpx.get(gw.base_url + "/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(serving, 60, every=0.2, what="the gateway listener from istiod to route to the default pool")
    except BaseException:
        gw.stop()
        print(gw.logs())
        raise
    return gw


DEFAULT_POLICY = CHART / "files" / "default-policy.yaml"


def header_only_policy(*, degradable: bool = True, **filter_settings) -> dict:
    """The chart's default policy without its body rule (chat-bulk); `degradable=False` also
    without `when_degraded`, so that no class can be spilled or shed and the header rules can be
    decided by the routes (issue 19 keeps the rules of degradable classes in the filter)."""
    policy = yaml.safe_load(DEFAULT_POLICY.read_text())
    policy["rules"] = [r for r in policy["rules"] if "body" not in r.get("match", {})]
    if not degradable:
        for pool in policy["pools"].values():
            pool.pop("when_degraded", None)
    if filter_settings:
        policy["filter"] = filter_settings
    return policy


@dataclass(frozen=True)
class Form:
    """One way the chart is used: its policy, and what the chart must make of it."""

    name: str
    policy: dict | None  # None: the chart's default values
    kind: str  # the filter object the chart must render
    body_rules: bool
    native: bool  # header rules decided by the routes, the filter off on them
    deadline_ms: int | None = None  # the interactive class's ttft_deadline_ms (it hedges)
    replicas: int = 1  # the interactive pool's replicas

    def __post_init__(self):
        if self.policy is not None and self.deadline_ms is not None:
            self.policy["classes"]["interactive"]["ttft_deadline_ms"] = self.deadline_ms
            self.policy["pools"]["interactive"]["replicas"] = self.replicas


FORMS = [
    Form("body-rules", None, "EnvoyFilter", body_rules=True, native=True),
    # Trusted sources keep every decision in the filter (only it can tell a trusted peer): no
    # native route, so the chart's WasmPlugin.
    Form("header-rules-wasmplugin", header_only_policy(trusted_cidrs=["10.99.0.0/16"]), "WasmPlugin", body_rules=False, native=False),
    # With a pool of replicas and a TTFT deadline: the pools' EnvoyFilter hedges its chats. The
    # deadline is long enough for this machine's one local replica (the hedge it would take goes
    # back to that replica: istiod sends one endpoint per pool here).
    Form("header-rules-native", header_only_policy(degradable=False), "EnvoyFilter", body_rules=False, native=True,
         deadline_ms=8000, replicas=2),
]


def render(helm: Helm, form: Form, port: int, work: Path, sets: Sequence[str] = ()) -> list[dict]:
    """The chart's objects for `form` (its policy through `infermesh policy render … helm-values`,
    as a user runs it), with the compiled filter as a local module, the Gateway on `port`, and
    the chart values `sets` (`KEY=VALUE`)."""
    wasm = paths.filter_wasm()
    values = []
    if form.policy is not None:
        (work / "policy.yaml").write_text(yaml.safe_dump(form.policy, sort_keys=False))
        # The user's path: policy and what the chart derives from it, as values.
        r = subprocess.run([sys.executable, "-m", "infermesh.cli", "policy", "render", str(work / "policy.yaml"), "helm-values"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        (work / "values.json").write_text(r.stdout)
        values.append(work / "values.json")
    sets = [f"filter.url=file://{wasm}", f"filter.sha256={hashlib.sha256(wasm.read_bytes()).hexdigest()}", f"ingress.port={port}", *sets]
    objects = helm.template(values=values, sets=sets).objects
    kinds = {o["kind"] for o in objects}
    assert form.kind in kinds and kinds >= {"Gateway", "VirtualService", "DestinationRule"}, kinds
    return objects
