"""The chart tests' names for Helm (infermesh/chart_render.py, where the renderer lives so that the
istiod e2e test and the filter benchmark use it without importing a test module)."""

from __future__ import annotations

from pathlib import Path

from infermesh.chart_render import CHART, NAMESPACE, RELEASE, Helm, Rendered  # noqa: F401 (re-exported)
from infermesh.paths import REPO_ROOT as REPO  # noqa: F401 (re-exported)

HERE = Path(__file__).resolve().parent
