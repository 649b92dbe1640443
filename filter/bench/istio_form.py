"""The filter benchmark's Istio form: Envoy configured exactly as istiod configures the ingress
gateway from the chart's own rendered resources, replayed as a static bootstrap.

`capture()` renders the chart (`helm template`, the forms of infermesh/istiod_gateway.py that
e2e/test_istiod_e2e.py checks), runs the istiod harness (e2e/istiod, built once by
scripts/setup-istiod.sh) on those resources plus the
ServiceEntries that stand in for the pool Services, here with the benchmark's sink as their
endpoints, lets a real Envoy connect to it as the gateway and takes that Envoy's /config_dump
(with EDS); istiod and that Envoy then stop. `static_bootstrap()` turns the dump into an
`envoy -c` config: the gateway listener with its route table inline (it came over RDS), each
filter istiod sent over ECDS inline, the clusters with their endpoints inline (EDS), the
bootstrap's node and stats settings as they were. Nothing else changes but the ports and, for
the baseline, the Wasm filter taken out of the chain, so the measured Envoy runs what istiod
emitted without istiod (a control plane in the middle of a benchmark would only add noise).

The forms (names as in istiod_gateway.FORMS):
  body-rules               the default chart: EnvoyFilter, body rule chat-bulk, native header routes
  header-rules-native      header rules only: EnvoyFilter, the VirtualService decides, filter off there
  header-rules-wasmplugin  header rules with trusted sources: WasmPlugin (a TrafficExtension), the
                           filter decides every request
The baseline, `istio-no-filter`, is the WasmPlugin form's gateway with the filter taken out: the
chart's VirtualService (pool routes on `x-infermesh-pool`, the default pool) and DestinationRules.

`FORM/CHANGE` captures a form with one thing changed before istiod reads it (instructions.py's
Istio profile variants): `no-deadline`, its policy without the interactive class's
`ttft_deadline_ms`; `no-pools`, the chart's output without the pools' EnvoyFilter.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from infermesh import istiod_gateway as gw_harness
from infermesh.chart_render import Helm, setup_outputs
from infermesh.launcher import free_ports

WASM_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
BASELINE_FORM = "header-rules-wasmplugin"


CHANGES = ("no-deadline", "no-pools")


def _form(form_name: str) -> gw_harness.Form:
    """The chart's form `FORM`, or `FORM/CHANGE` (the module docstring)."""
    base, _, change = form_name.partition("/")
    form = next(f for f in gw_harness.FORMS if f.name == base)
    if change == "no-deadline":
        policy = copy.deepcopy(form.policy)
        policy["classes"]["interactive"].pop("ttft_deadline_ms", None)
        return dataclasses.replace(form, policy=policy, deadline_ms=None)
    if change not in ("", "no-pools"):
        raise ValueError(f"{form_name}: unknown change {change!r} (one of {', '.join(CHANGES)})")
    return form


def capture(form_name: str, sink_port: int, work: Path) -> dict:
    """The /config_dump (EDS included) of an Envoy that istiod configured as the gateway from the
    chart's `form_name` form, its pools' endpoints all `sink_port`."""
    form = _form(form_name)
    helm = Helm.from_tools(setup_outputs("setup-chart-tools.sh"))
    istiod = gw_harness.istiod_binary()
    work.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    objects = gw_harness.render(helm, form, port, work)
    if form_name.endswith("/no-pools"):
        objects = [o for o in objects if not (o["kind"] == "EnvoyFilter" and o["metadata"]["name"].endswith("-pools"))]
    pools = [SimpleNamespace(name=o["metadata"]["labels"]["infermesh.io/pool"], http_port=sink_port, grpc_port=sink_port)
             for o in objects if o["kind"] == "Deployment" and "infermesh.io/pool" in o["metadata"].get("labels", {})]
    config = gw_harness.on_loopback(objects, port) + gw_harness.pool_service_entries(objects, pools)
    gw = gw_harness.start_gateway(istiod, form, objects, config, work / "gateway", port)
    try:
        dump = gw.config_dump()
    finally:
        gw.stop()
    return {"form": form_name, "port": port, "dump": dump}


def _of(dump: dict, kind: str) -> dict:
    return next(c for c in dump["configs"] if c["@type"] == f"type.googleapis.com/envoy.admin.v3.{kind}")


def _resource(r: dict) -> dict:
    """A resource of the dump as bootstrap JSON: without the `@type` of the Any it was in."""
    r = copy.deepcopy(r)
    r.pop("@type", None)
    return r


def static_bootstrap(captured: dict, port: int, admin_port: int, *, with_filter: bool = True) -> dict:
    """The captured gateway as a static bootstrap listening on `port` (see the module docstring)."""
    dump, old_port = captured["dump"], captured["port"]
    boot = _of(dump, "BootstrapConfigDump")["bootstrap"]
    listeners = [e["active_state"]["listener"] for e in _of(dump, "ListenersConfigDump").get("dynamic_listeners", []) if "active_state" in e]
    (listener,) = [_resource(lst) for lst in listeners if lst["address"]["socket_address"].get("port_value") == old_port]
    listener["address"]["socket_address"]["port_value"] = port
    routes = {rc["route_config"]["name"]: _resource(rc["route_config"])
              for rc in _of(dump, "RoutesConfigDump").get("dynamic_route_configs", [])}
    ecds = {f["ecds_filter"]["name"]: f["ecds_filter"]["typed_config"]
            for c in dump["configs"] if c["@type"].endswith("EcdsConfigDump") for f in c.get("ecds_filters", [])}
    for chain in listener["filter_chains"]:
        for f in chain["filters"]:
            if f["name"] != "envoy.filters.network.http_connection_manager":
                continue
            hcm = f["typed_config"]
            if "rds" in hcm:
                hcm["route_config"] = routes[hcm.pop("rds")["route_config_name"]]
            chain_filters = []
            for hf in hcm["http_filters"]:
                if "config_discovery" in hf:
                    hf = {"name": hf["name"], "typed_config": ecds[hf["name"]]}
                if not with_filter and hf.get("typed_config", {}).get("@type") == WASM_FILTER_TYPE:
                    continue
                chain_filters.append(hf)
            hcm["http_filters"] = chain_filters
    endpoints = {e["endpoint_config"]["cluster_name"]: _resource(e["endpoint_config"])
                 for e in _of(dump, "EndpointsConfigDump").get("dynamic_endpoint_configs", [])}
    clusters = []
    for entry in _of(dump, "ClustersConfigDump").get("dynamic_active_clusters", []):
        c = _resource(entry["cluster"])
        if c.get("type") == "EDS":
            service = c.pop("eds_cluster_config", {}).get("service_name", c["name"])
            c["type"] = "STATIC"
            c["load_assignment"] = endpoints.get(service, {"cluster_name": service})
        clusters.append(c)
    out = {k: copy.deepcopy(boot[k]) for k in ("node", "stats_config") if k in boot}
    out["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    out["static_resources"] = {"listeners": [listener], "clusters": clusters}
    return out


def capture_all(forms: list[str], sink_port: int) -> dict[str, dict]:
    """`capture()` of each form, in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="infermesh-istio-form-") as tmp:
        return {name: capture(name, sink_port, Path(tmp) / name.replace("/", "-")) for name in forms}


if __name__ == "__main__":  # capture one form and print its static bootstrap (for reading it)
    print(json.dumps(static_bootstrap(capture(sys.argv[1], int(sys.argv[2]), Path(tempfile.mkdtemp())), 10000, 10001), indent=1))
