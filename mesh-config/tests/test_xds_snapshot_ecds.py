"""The infermesh filter's config travels over ECDS: a filter change (the runtime, the rules, the
classes) never replaces the listener, so Envoy drains nothing and cuts nothing in flight
(issue 28: a replaced listener's drain was timed from before a multi-second Wasm compile and
closed a connection mid-response)."""

from __future__ import annotations

from pathlib import Path

import pytest
from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2

from infermesh.meshconfig.policy import LOCAL_POLICY
from infermesh.meshconfig.watchers import PolicyFileWatcher
from infermesh.meshconfig.xds_server import ControlPlane
from infermesh.meshconfig.xds_snapshot import (FILTER_EXTENSION, FILTER_TYPE, FILTER_TYPE_URLS, LISTENER_TYPE, PUSH_ORDER, ROUTE_TYPE,
                                               InconsistentSnapshot, MeshTarget, Snapshot)

GOOD = LOCAL_POLICY.read_text()
NATIVE = GOOD + "filter:\n  runtime: native\n"


@pytest.fixture
def cp(tmp_path):
    module = tmp_path / "libinfermesh_filter.so"
    module.write_bytes(b"\x7fELF")
    target = MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {"interactive": ("127.0.0.1", 8101, 8201), "batch": ("127.0.0.1", 8102, 8202)},
                        native_module_path=module)
    return ControlPlane(target)


def serve(cp: ControlPlane, tmp_path: Path, text: str) -> Snapshot:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    assert PolicyFileWatcher(path, cp.set_policy).load() and cp.rejections == 0
    return cp.ads.snapshot


def hcm_of(snap: Snapshot) -> http_connection_manager_pb2.HttpConnectionManager:
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert snap.resources[LISTENER_TYPE][0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def filter_type(snap: Snapshot) -> str:
    [ext] = snap.resources[FILTER_TYPE]
    assert isinstance(ext, extension_pb2.TypedExtensionConfig) and ext.name == FILTER_EXTENSION
    return ext.typed_config.type_url


def test_the_listener_names_the_filter_and_its_config_comes_over_ecds(cp, tmp_path):
    snap = serve(cp, tmp_path, GOOD)
    f = hcm_of(snap).http_filters[0]
    assert f.name == FILTER_EXTENSION and not f.HasField("typed_config")
    assert f.config_discovery.config_source.HasField("ads") and list(f.config_discovery.type_urls) == FILTER_TYPE_URLS
    assert filter_type(snap) == "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
    # Envoy gets the filter's config before the listener that asks for it, the routes after.
    assert PUSH_ORDER.index(FILTER_TYPE) < PUSH_ORDER.index(LISTENER_TYPE) < PUSH_ORDER.index(ROUTE_TYPE)


def test_a_runtime_switch_and_a_rule_edit_leave_the_listener_byte_for_byte(cp, tmp_path):
    wasm = serve(cp, tmp_path, GOOD)
    native = serve(cp, tmp_path, NATIVE)
    # A body rule's threshold: decided by the filter, so only its config (ECDS) changes.
    edited = serve(cp, tmp_path, NATIVE.replace("max_tokens: {min: 1024}", "max_tokens: {min: 2048}"))
    assert len({wasm.version, native.version, edited.version}) == 3
    listeners = [s.resources[LISTENER_TYPE][0].SerializeToString(deterministic=True) for s in (wasm, native, edited)]
    assert listeners[0] == listeners[1] == listeners[2], "a filter change must not replace (and drain) the listener"
    assert filter_type(native) == filter_type(edited) == "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
    assert len({s.resources[FILTER_TYPE][0].SerializeToString(deterministic=True) for s in (wasm, native, edited)}) == 3


def test_routes_that_skip_the_filter_name_it_as_the_listener_does(cp, tmp_path):
    for text in (GOOD, NATIVE):
        snap = serve(cp, tmp_path, text)
        keys = {k for vh in snap.resources[ROUTE_TYPE][0].virtual_hosts for r in vh.routes for k in r.typed_per_filter_config}
        assert keys == {FILTER_EXTENSION}, keys  # the local policy has natively decided routes


def test_a_listener_whose_filter_config_is_missing_is_refused(cp, tmp_path):
    snap = serve(cp, tmp_path, GOOD)
    with pytest.raises(InconsistentSnapshot, match=f"unknown filter config '{FILTER_EXTENSION}'"):
        Snapshot("x", dict(snap.resources, **{FILTER_TYPE: []})).check()
    assert snap.check() is snap
