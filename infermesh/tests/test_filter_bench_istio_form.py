"""The filter benchmark's Istio form: a gateway's /config_dump (what istiod sent over LDS, RDS,
ECDS, CDS and EDS) replayed as a static bootstrap that differs only in its ports and, for the
baseline, the Wasm filter. A hand-written dump of that shape here (a fake: no istiod, no Envoy);
e2e/test_filter_bench_istio_e2e.py runs the real capture and benchmark."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "istio_form", Path(__file__).resolve().parents[2] / "filter" / "bench" / "istio_form.py")
istio_form = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(istio_form)

ADMIN = "type.googleapis.com/envoy.admin.v3."
WASM = {"@type": istio_form.WASM_FILTER_TYPE, "config": {"name": "infermesh"}}
ROUTER = {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def fake_dump(port: int) -> dict:
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "rds": {"config_source": {"ads": {}}, "route_config_name": "http.8080"},
        "http_filters": [
            {"name": "istio-ingress.infermesh-filter", "config_discovery": {"config_source": {"ads": {}}, "type_urls": [WASM["@type"]]}},
            ROUTER,
        ],
    }
    listener = {"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", "name": "0.0.0.0_8080",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}
    other = {**listener, "name": "virtualInbound", "address": {"socket_address": {"address": "0.0.0.0", "port_value": 15006}}}
    cluster = {"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", "name": "outbound|8000||pool", "type": "EDS",
               "eds_cluster_config": {"eds_config": {"ads": {}}, "service_name": "outbound|8000||pool"}, "circuit_breakers": {"x": 1}}
    return {"configs": [
        {"@type": ADMIN + "BootstrapConfigDump", "bootstrap": {
            "node": {"id": "router~x", "metadata": {"LABELS": {"istio": "ingress"}}}, "stats_config": {"stats_tags": []},
            "admin": {"address": {}}, "dynamic_resources": {"ads_config": {}}, "static_resources": {"clusters": [{"name": "xds"}]}}},
        {"@type": ADMIN + "ClustersConfigDump", "dynamic_active_clusters": [{"version_info": "1", "cluster": cluster}]},
        {"@type": ADMIN + "EcdsConfigDump", "ecds_filters": [{"ecds_filter": {"name": "istio-ingress.infermesh-filter", "typed_config": WASM}}]},
        {"@type": ADMIN + "ListenersConfigDump", "dynamic_listeners": [{"name": n["name"], "active_state": {"listener": n}} for n in (other, listener)]},
        {"@type": ADMIN + "RoutesConfigDump", "dynamic_route_configs": [{"route_config": {
            "@type": "type.googleapis.com/envoy.config.route.v3.RouteConfiguration", "name": "http.8080", "virtual_hosts": [{"name": "vh"}]}}]},
        {"@type": ADMIN + "EndpointsConfigDump", "dynamic_endpoint_configs": [{"endpoint_config": {
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment", "cluster_name": "outbound|8000||pool",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9}}}}]}]}}]},
    ]}


def test_the_gateway_listener_with_routes_filter_and_endpoints_inline():
    boot = istio_form.static_bootstrap({"port": 8080, "dump": fake_dump(8080)}, 7000, 7001)
    assert boot["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 7001}
    assert boot["node"]["metadata"]["LABELS"] == {"istio": "ingress"} and "dynamic_resources" not in boot
    (listener,) = boot["static_resources"]["listeners"]
    assert listener["name"] == "0.0.0.0_8080" and listener["address"]["socket_address"]["port_value"] == 7000
    assert "@type" not in listener
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert "rds" not in hcm and hcm["route_config"] == {"name": "http.8080", "virtual_hosts": [{"name": "vh"}]}
    assert hcm["http_filters"] == [{"name": "istio-ingress.infermesh-filter", "typed_config": WASM}, ROUTER]
    (cluster,) = boot["static_resources"]["clusters"]
    assert cluster["type"] == "STATIC" and "eds_cluster_config" not in cluster and cluster["circuit_breakers"] == {"x": 1}
    assert cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"] == 9


def test_the_baseline_is_the_same_gateway_without_the_wasm_filter():
    captured = {"port": 8080, "dump": fake_dump(8080)}
    with_filter = istio_form.static_bootstrap(captured, 7000, 7001)
    without = istio_form.static_bootstrap(captured, 7000, 7001, with_filter=False)
    hcm = without["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["http_filters"] == [ROUTER]
    hcm["http_filters"] = with_filter["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    assert without == with_filter
    assert captured["dump"] == fake_dump(8080)  # the capture is not changed by a conversion
