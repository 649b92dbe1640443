"""Running Helm on the chart (charts/infermesh): `helm template` into objects, or its error, with
the Helm binary and Kubernetes version that scripts/setup-chart-tools.sh installs.

Used by the chart tests (charts/tests), the istiod e2e test and the filter benchmark's Istio form
(both through istiod_gateway.py), so all three render the chart the same way.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from infermesh.paths import REPO_ROOT

CHART = REPO_ROOT / "charts" / "infermesh"
RELEASE = "infermesh"
NAMESPACE = "infermesh"


def setup_outputs(script: str) -> dict[str, str]:
    """Run scripts/SCRIPT (a no-op once what it builds is there) and return the KEY=VALUE lines it
    prints (where it left the tools)."""
    r = subprocess.run([str(REPO_ROOT / "scripts" / script)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


@dataclass(frozen=True)
class Rendered:
    """What one `helm template` gave: the YAML text and its objects."""

    text: str
    objects: list[dict]

    def of(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [o for o in self.of(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"{len(found)} {kind} objects named {name!r}"
        return found[0]


class Helm:
    def __init__(self, binary: str, kube_version: str):
        self.binary = binary
        self.kube_version = kube_version

    @classmethod
    def from_tools(cls, tools: dict[str, str]) -> "Helm":
        """The Helm of setup-chart-tools.sh's output (`setup_outputs`), rendering for the
        Kubernetes version of the schemas it installed."""
        versions = dict(line.split(" ", 1) for line in (Path(tools["SCHEMAS"]) / "VERSIONS").read_text().splitlines())
        return cls(tools["HELM"], versions["kubernetes"].lstrip("v"))

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=120)

    def template_args(self, values: list[Path], sets: list[str], set_json: list[str]) -> list[str]:
        # The Kubernetes version of the schemas, so Capabilities and kubeVersion checks match them.
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", self.kube_version]
        for v in values:
            args += ["--values", str(v)]
        for s in sets:
            args += ["--set", s]
        for s in set_json:
            args += ["--set-json", s]
        return args

    def template(self, values: list[Path] = (), sets: list[str] = (), set_json: list[str] = ()) -> Rendered:
        r = self.run(*self.template_args(list(values), list(sets), list(set_json)))
        assert r.returncode == 0, r.stderr
        return Rendered(r.stdout, [o for o in yaml.safe_load_all(r.stdout) if o])

    def template_error(self, values: list[Path] = (), sets: list[str] = (), set_json: list[str] = ()) -> str:
        """The error of a render that must fail."""
        r = self.run(*self.template_args(list(values), list(sets), list(set_json)))
        assert r.returncode != 0, f"rendered although it should not:\n{r.stdout[:2000]}"
        return r.stderr
