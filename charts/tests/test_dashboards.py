"""The Grafana dashboards the chart ships (charts/infermesh/dashboards, templates/dashboards.yaml):
one ConfigMap for Grafana's sidecar loader when the ServiceMonitor is on, each dashboard whole, its
variables defined, and every panel query valid PromQL as Prometheus parses it. That every query
returns data from a real mesh is e2e/test_observability_e2e.py's."""

from __future__ import annotations

import json
import re
import subprocess

import yaml

from helm_render import CHART
from test_chart import SCENARIOS

from infermesh.observe import panel_queries

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
# What the e2e substitutes too: every pool and class, the chart's namespace.
VARIABLES = {"namespace": "infermesh", "pool": ".*", "class": ".*"}


def dashboards_configmap(rendered) -> dict | None:
    found = [o for o in rendered.of("ConfigMap") if o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert len(found) <= 1
    return found[0] if found else None


def test_the_dashboards_ship_with_the_service_monitor(helm):
    cm = dashboards_configmap(helm.template(SCENARIOS["production"]))
    assert cm is not None and cm["metadata"]["name"] == "infermesh-dashboards"
    assert sorted(cm["data"]) == [p.name for p in DASHBOARDS] and len(DASHBOARDS) >= 3
    for p in DASHBOARDS:
        assert json.loads(cm["data"][p.name]) == json.loads(p.read_text()), f"{p.name} shipped as it is in the chart"
    assert dashboards_configmap(helm.template(SCENARIOS["default"])) is None, "monitoring off: no dashboards"


def test_each_dashboard_is_whole():
    uids = set()
    for p in DASHBOARDS:
        d = json.loads(p.read_text())
        assert d["uid"] not in uids and d["title"].startswith("infermesh / ")
        uids.add(d["uid"])
        defined = {v["name"] for v in d["templating"]["list"]} | {"__rate_interval"}
        for panel in d["panels"]:
            assert panel["title"] and panel["description"] and panel["targets"], (p.name, panel.get("title"))
            assert panel["datasource"]["uid"] == "${datasource}"
            refs = [t["refId"] for t in panel["targets"]]
            assert len(set(refs)) == len(refs)
            for t in panel["targets"]:
                used = set(re.findall(r"\$\{?(\w+)", t["expr"]))
                assert used <= defined, (p.name, panel["title"], used - defined)


def test_every_panel_query_parses_as_promql(chart_tools, tmp_path):
    # Each query as a recording rule: the rule-file parser (charts/tests/rulecheck) parses every
    # expression exactly as Prometheus does.
    rules = [{"record": f"panel:{i}", "expr": q.expr}
             for p in DASHBOARDS for i, q in enumerate(panel_queries(json.loads(p.read_text()), "1m", VARIABLES))]
    assert len(rules) >= 40
    r = subprocess.run([chart_tools["RULECHECK"]], input=yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
