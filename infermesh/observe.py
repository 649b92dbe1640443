"""A Prometheus of a local mesh's own (`infermesh up --observe`, e2e/test_observability_e2e.py):
Debian's `prometheus` binary (scripts/setup.sh) on 127.0.0.1 only, its storage in the mesh's run
directory, scraping Envoy's /stats/prometheus, every sidecar's /metrics and the control plane's
/metrics every second. Never the system's Prometheus service.

The targets carry the labels the chart's ServiceMonitor gives the pods in Kubernetes (`namespace`,
`pool`, `pod`), so the chart's alert rules and dashboards (charts/infermesh) read the local mesh's
series unchanged; docs/observability.md.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from infermesh.meshconfig.local_mesh import LocalMeshPlan

NAMESPACE = "infermesh"
"""The `namespace` label of every local target: the chart's own namespace in its tests
(infermesh/chart_render.py), which the PrometheusRule's selectors name."""

SCRAPE_INTERVAL = "1s"
"""Short enough that a breaker trip of a few seconds shows in the series (and in the e2e's window)."""


class PrometheusError(RuntimeError):
    pass


@dataclass(frozen=True)
class Target:
    """One scrape target: its job, `host:port`, metrics path and the labels it gets."""

    job: str
    address: str
    path: str
    labels: dict[str, str] = field(default_factory=dict)


def sidecar_pod(pool: str, replica: int) -> str:
    """A sidecar's `pod` label: its child's name in the launcher (`sidecar-POOL`, `sidecar-POOL.N`)."""
    return f"sidecar-{pool}" if replica == 0 else f"sidecar-{pool}.{replica}"


def mesh_targets(plan: LocalMeshPlan) -> list[Target]:
    """Envoy's admin /stats/prometheus, the control plane's /metrics and each sidecar's /metrics
    (on its serving port, as Envoy's health checks reach it)."""
    out = [Target("envoy", f"127.0.0.1:{plan.admin_port}", "/stats/prometheus", {"pod": "envoy"})]
    if plan.metrics_port:
        out.append(Target("control-plane", f"127.0.0.1:{plan.metrics_port}", "/metrics", {"pod": "control-plane"}))
    for p in plan.pools:
        out.append(Target("sidecar", f"{plan.host}:{p.http_port}", "/metrics", {"pool": p.name, "pod": sidecar_pod(p.name, p.replica)}))
    return out


def scrape_config(targets: list[Target], interval: str = SCRAPE_INTERVAL, namespace: str = NAMESPACE) -> dict:
    """prometheus.yml: one job per target kind, each target with its own labels."""
    jobs: dict[tuple[str, str], list[dict]] = {}
    for t in targets:
        jobs.setdefault((t.job, t.path), []).append({"targets": [t.address], "labels": {"namespace": namespace, **t.labels}})
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": job, "metrics_path": path, "static_configs": statics} for (job, path), statics in jobs.items()],
    }


def binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise PrometheusError("prometheus is not installed (scripts/setup.sh installs Debian's package)")
    return path


class Prometheus:
    """What runs one local Prometheus (`argv`, written by `write_config`) and reads it over its
    HTTP API. The caller starts the process (the launcher, as one of the mesh's children)."""

    def __init__(self, workdir: Path, port: int, targets: list[Target], interval: str = SCRAPE_INTERVAL):
        self.workdir = workdir
        self.port = port
        self.targets = targets
        self.interval = interval

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / "prometheus.yml"

    def write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        # JSON is YAML: no YAML writer needed.
        self.config_path.write_text(json.dumps(scrape_config(self.targets, self.interval), indent=2))
        return self.config_path

    def argv(self) -> list[str]:
        return [binary(), f"--config.file={self.config_path}", f"--web.listen-address=127.0.0.1:{self.port}",
                f"--storage.tsdb.path={self.workdir / 'data'}", "--storage.tsdb.retention.time=1d", "--log.level=warn"]

    # -- its HTTP API -------------------------------------------------------------------------

    def _get(self, path: str, timeout: float = 10) -> dict:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # a bad query: Prometheus says why in the body
            body = e.read().decode(errors="replace")
            raise PrometheusError(f"{path}: {e.code} {body[:500]}") from e

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _api(self, endpoint: str, **params: str | float) -> dict:
        got = self._get(f"/api/v1/{endpoint}?" + urllib.parse.urlencode(params))
        if got.get("status") != "success":
            raise PrometheusError(f"{endpoint} {params}: {got}")
        return got["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's result (a vector's series, each {metric, value})."""
        return self._api("query", query=expr, **({"time": at} if at is not None else {}))["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        """A range query's series, each {metric, values: [[t, "v"], ...]}."""
        return self._api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def active_targets(self) -> list[dict]:
        return self._get("/api/v1/targets")["data"]["activeTargets"]

    def all_up(self) -> bool:
        """Every target was scraped, and its last scrape succeeded."""
        ts = self.active_targets()
        return len(ts) == len(self.targets) and all(t["health"] == "up" for t in ts)


# -- the chart's dashboards and alerts, as queries ----------------------------------------------

@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str
    """With the dashboard's variables substituted (`substitute`)."""


def substitute(expr: str, rate_interval: str, variables: dict[str, str]) -> str:
    """A Grafana query as Prometheus gets it: `$__rate_interval` and each `$name` / `${name}`
    replaced (a multi-value variable set to All is its `allValue`, `.*`)."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


def panel_queries(dashboard: dict, rate_interval: str, variables: dict[str, str]) -> list[PanelQuery]:
    """Every query of every panel of a Grafana dashboard (its JSON model), substituted."""
    return [PanelQuery(dashboard["title"], p["title"], t["refId"], substitute(t["expr"], rate_interval, variables))
            for p in dashboard["panels"] for t in p.get("targets", [])]


def without_threshold(expr: str) -> str:
    """An alert expression without its final comparison with a number (`x > 0.9` -> `x`): what
    must have data while the mesh is healthy, when the alert itself rightly has none."""
    m = re.fullmatch(r"(?s)\s*(.*?)\s*(?:>=|<=|==|!=|>|<)\s*[-+]?[0-9.eE]+\s*", expr)
    return m.group(1) if m else expr


DASHBOARDS = Path(__file__).resolve().parent.parent / "charts" / "infermesh" / "dashboards"
"""The chart's Grafana dashboards (JSON models): the queries a drill's report links are theirs."""

DRILL_PANELS = (
    ("infermesh-pools", "Degradation level"),
    ("infermesh-pools", "Breaker state"),
    ("infermesh-pools", "Breaker signals"),
    ("infermesh-pools", "KV cache use"),
    ("infermesh-classes", "Requests by class and outcome"),
    ("infermesh-classes", "Time to first token by class (p50, p95, p99)"),
    ("infermesh-classes", "Shed by class"),
    ("infermesh-classes", "Spilled requests"),
)
"""(dashboard file, panel title): what a person reading a drill's report looks at next."""


def load_dashboards(directory: Path = DASHBOARDS) -> dict[str, dict]:
    """The dashboards by file name without `.json`."""
    return {f.stem: json.loads(f.read_text()) for f in sorted(directory.glob("*.json"))}


def graph_link(prometheus_url: str, exprs: list[str], start: float, end: float) -> str:
    """Prometheus' own graph page with `exprs` over [start, end] (wall clock, s): its URL
    parameters (`g0.expr`, `g0.range_input`, `g0.end_input` in UTC)."""
    span = f"{max(1, math.ceil(end - start))}s"
    at = datetime.datetime.fromtimestamp(end, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    params: dict[str, str] = {}
    for i, e in enumerate(exprs):
        params |= {f"g{i}.expr": e, f"g{i}.tab": "0", f"g{i}.range_input": span, f"g{i}.end_input": at}
    return f"{prometheus_url.rstrip('/')}/graph?{urllib.parse.urlencode(params)}"


def drill_queries(start: float, end: float, pool: str, prometheus_url: str | None = None, namespace: str = NAMESPACE,
                  rate_interval: str = "10s", dashboards: dict[str, dict] | None = None) -> list[dict]:
    """The DRILL_PANELS' queries for a drill's window [start, end] (wall clock) on `pool` (the
    pools dashboard's `$pool`; every class), each panel with a link to them in `prometheus_url`'s
    graph page when a Prometheus scrapes the mesh (`infermesh drill --observe`, `--prometheus`)."""
    boards = load_dashboards() if dashboards is None else dashboards
    variables = {"namespace": namespace, "pool": pool, "class": ".*"}
    out = []
    for board, title in DRILL_PANELS:
        exprs = [q.expr for q in panel_queries(boards[board], rate_interval, variables) if q.panel == title]
        if not exprs:
            raise KeyError(f"the chart's {board} dashboard has no panel {title!r} (observe.DRILL_PANELS)")
        out.append({"dashboard": boards[board]["title"], "panel": title, "exprs": exprs,
                    "link": graph_link(prometheus_url, exprs, start, end) if prometheus_url else None})
    return out

