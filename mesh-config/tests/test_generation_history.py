"""What the generators write does not depend on what ran before them in the process: no Envoy
resource, bootstrap or chart value they return holds a dict or list of a module's constants, so
a caller that changes what it got (protobuf's ParseDict deletes and re-adds each Any's "@type"
in the dict it reads) changes no later caller's output. Clean-clone run J wrote
charts/infermesh/files/default-generated.json with a moved "@type" after test_tracing.py had
parsed a listener whose HCM held envoy_resources.STRIP_CLIENT_HEADERS itself."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import yaml

import infermesh.meshconfig as meshconfig
from infermesh.meshconfig import istio
from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.envoy_resources import (cluster, filter_off, http_connection_manager, inline_routes, listener, pool_clusters,
                                                  rds_routes, route_config, state_clusters)
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy
from infermesh.meshconfig.tracing import collector_cluster, hcm_tracing
from infermesh.meshconfig.xds_server import xds_bootstrap
from infermesh.meshconfig.xds_snapshot import discovered_filter
from infermesh.settings import TracingSettings

TRACING = TracingSettings(otlp_endpoint="127.0.0.1:4317", sample_ratio=0.25)


def containers(value, seen: dict[int, object] | None = None) -> dict[int, object]:
    """Every dict and list in `value` (through tuples and dataclass fields too), by id."""
    seen = {} if seen is None else seen
    if isinstance(value, (dict, list)):
        if id(value) in seen:
            return seen
        seen[id(value)] = value
    if isinstance(value, dict):
        for v in value.values():
            containers(v, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            containers(v, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            containers(getattr(value, f.name), seen)
    return seen


def module_constants() -> dict[int, str]:
    """id -> 'module.NAME' (each name it has, an import is one too) of every dict and list that a
    meshconfig module's globals reach."""
    names: dict[int, list[str]] = {}
    for info in pkgutil.iter_modules(meshconfig.__path__):
        module = importlib.import_module(f"{meshconfig.__name__}.{info.name}")
        for name, value in vars(module).items():
            if not name.startswith("__"):
                for i in containers(value):
                    names.setdefault(i, []).append(f"{info.name}.{name}")
    return {i: " = ".join(n) for i, n in names.items()}


def generated() -> dict[str, object]:
    """What every generator returns for the bundled policy, with tracing and the access log on
    (each adds parts of its own): the static bootstrap, the control plane's parts and its
    bootstrap, the Istio parts and the chart's values."""
    policy = load_policy(LOCAL_POLICY)
    m = dataclasses.replace(LocalMeshPlan(policy=policy).listener(Path("/x.wasm")), tracing=TRACING, access_log_path="/tmp/access.log")
    hcm, routes, ecds = discovered_filter(http_connection_manager(m, rds_routes()), route_config(m), m.filter_name)
    return {
        "bootstrap": bootstrap(m),
        "listener": listener(m, http_connection_manager(m, inline_routes(m))),
        "xds listener": listener(m, hcm), "xds routes": routes, "xds filter": ecds,
        "xds clusters": [*(cluster(m, p, grpc, eds=True) for p, grpc in pool_clusters(m)), *state_clusters(m, eds=True)],
        "xds bootstrap": xds_bootstrap(9901, "127.0.0.1", 18000),
        "tracing": [hcm_tracing(TRACING), collector_cluster(TRACING)],
        "filter off": filter_off(m),
        "helm values": istio.helm_values(policy, yaml.safe_load(LOCAL_POLICY.read_text())),
    }


def test_no_generated_dict_or_list_is_a_module_constants():
    constants = module_constants()
    for what, value in generated().items():
        shared = sorted({constants[i] for i in containers(value) if i in constants})
        assert not shared, f"{what} holds {shared} itself: a caller that edits it edits the constant for every later caller"


def test_the_bundled_values_are_the_same_text_after_the_resources_were_parsed():
    """In a fresh interpreter (this one may have run anything): the chart's generated values as
    charts/tests writes them, then every Envoy resource through ParseDict as test_tracing.py and
    the control plane do, then the values again, byte for byte."""
    script = """
import json, sys
import yaml
from google.protobuf import json_format
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import extension_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from infermesh.meshconfig import istio
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy
sys.path.insert(0, sys.argv[1])
import test_generation_history as t

def values():
    policy = load_policy(LOCAL_POLICY)
    return json.dumps(istio.helm_values(policy, yaml.safe_load(LOCAL_POLICY.read_text()))["generated"], indent=2) + "\\n"

before = values()
g = t.generated()
json_format.ParseDict(g["bootstrap"], bootstrap_pb2.Bootstrap())
for key in ("listener", "xds listener"):
    json_format.ParseDict(g[key], listener_pb2.Listener())
json_format.ParseDict(g["xds routes"], route_pb2.RouteConfiguration())
json_format.ParseDict(g["xds filter"], extension_pb2.TypedExtensionConfig())
for c in g["xds clusters"] + [g["tracing"][1]]:
    json_format.ParseDict(c, cluster_pb2.Cluster())
after = values()
print("same" if after == before else "changed")
"""
    r = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "same"
