"""Shared fixtures of the mesh-config tests."""

from __future__ import annotations

import json
import subprocess

import pytest

from infermesh import paths


@pytest.fixture
def envoy_accepts(tmp_path):
    """Asserts that `envoy --mode validate` takes one listener with this HTTP connection manager
    (and these clusters)."""
    def check(hcm: dict, clusters: list[dict] = ()) -> None:
        cfg = {"static_resources": {"clusters": list(clusters), "listeners": [{
            "name": "l", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}]}}
        path = tmp_path / "envoy.json"
        path.write_text(json.dumps(cfg))
        r = subprocess.run([str(paths.envoy_binary()), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    return check
