"""The sidecar's serving ports (8000 HTTP, 50051 gRPC) are defaults in five places: the sidecar's
config model, its command line, the policy's sidecar config and the Istio options all read
settings.HTTP_PORT / GRPC_PORT; the chart's values cannot import them. This test fails on any
difference between them."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import yaml

from infermesh.meshconfig.istio import IstioOptions
from infermesh.meshconfig.policy import Policy
from infermesh.sidecar.config import ServerConfig
from infermesh.sidecar.server import build_parser

REPO = Path(__file__).resolve().parents[2]


def test_every_default_of_the_sidecar_ports_is_the_same():
    args = build_parser().parse_args(["--policy", "p.yaml"])
    istio = {f.name: f.default for f in dataclasses.fields(IstioOptions)}
    sidecar_config = inspect.signature(Policy.sidecar_config).parameters
    chart = yaml.safe_load((REPO / "charts" / "infermesh" / "values.yaml").read_text())["ports"]
    places = {
        "sidecar/config.py ServerConfig": (ServerConfig.model_fields["http_port"].default, ServerConfig.model_fields["grpc_port"].default),
        "sidecar/server.py --http-port/--grpc-port": (args.http_port, args.grpc_port),
        "meshconfig/policy.py Policy.sidecar_config": (sidecar_config["http_port"].default, sidecar_config["grpc_port"].default),
        "meshconfig/istio.py IstioOptions": (istio["http_port"], istio["grpc_port"]),
        "charts/infermesh/values.yaml ports": (chart["http"], chart["grpc"]),
    }
    assert len(set(places.values())) == 1, places
    assert places["sidecar/config.py ServerConfig"] == (8000, 50051)
    from infermesh.settings import GRPC_PORT, HTTP_PORT
    assert (HTTP_PORT, GRPC_PORT) == (8000, 50051)
