"""Chart tests: Helm (built from the Go module proxy) and the Kubernetes / Istio / Prometheus
Operator schemas come from scripts/setup-chart-tools.sh, which scripts/test.sh runs first; run
here too, it is a no-op once they are installed (and installs them otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # helm_render and kube_schema, beside this file

from helm_render import REPO, Helm  # noqa: E402
from kube_schema import SchemaSet  # noqa: E402


@pytest.fixture(scope="session")
def chart_tools() -> dict[str, str]:
    r = subprocess.run([str(REPO / "scripts" / "setup-chart-tools.sh")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


@pytest.fixture(scope="session")
def schemas(chart_tools) -> SchemaSet:
    return SchemaSet(Path(chart_tools["SCHEMAS"]))


@pytest.fixture(scope="session")
def helm(chart_tools) -> Helm:
    versions = dict(line.split(" ", 1) for line in (Path(chart_tools["SCHEMAS"]) / "VERSIONS").read_text().splitlines())
    return Helm(chart_tools["HELM"], versions["kubernetes"].lstrip("v"))
