"""infermesh/observe.py without a Prometheus running: the scrape targets of a local mesh and their
labels, the generated config, and the dashboards' queries as Prometheus gets them. The real
Prometheus is e2e/test_observability_e2e.py's."""

from __future__ import annotations

import pytest

from infermesh.meshconfig.local_mesh import LocalMeshPlan, PoolPorts
from infermesh.observe import NAMESPACE, Prometheus, Target, mesh_targets, panel_queries, scrape_config, substitute, without_threshold

PLAN = LocalMeshPlan(listen_port=8080, admin_port=9901, metrics_port=18001,
                     pools=[PoolPorts("interactive", 8101, 8201), PoolPorts("batch", 8102, 8202)])


def test_every_process_of_the_mesh_is_a_target_labelled_as_the_chart_labels_pods():
    targets = mesh_targets(PLAN)
    assert targets == [
        Target("envoy", "127.0.0.1:9901", "/stats/prometheus", {"pod": "envoy"}),
        Target("control-plane", "127.0.0.1:18001", "/metrics", {"pod": "control-plane"}),
        Target("sidecar", "127.0.0.1:8101", "/metrics", {"pool": "interactive", "pod": "sidecar-interactive"}),
        Target("sidecar", "127.0.0.1:8102", "/metrics", {"pool": "batch", "pod": "sidecar-batch"}),
    ]
    cfg = scrape_config(targets)
    assert cfg["global"]["scrape_interval"] == "1s"
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert [s["labels"] for s in jobs["sidecar"]["static_configs"]] == [
        {"namespace": NAMESPACE, "pool": "interactive", "pod": "sidecar-interactive"},
        {"namespace": NAMESPACE, "pool": "batch", "pod": "sidecar-batch"}]


def test_prometheus_listens_on_loopback_with_storage_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr("infermesh.observe.binary", lambda: "/usr/bin/prometheus")
    p = Prometheus(tmp_path / "prom", 19090, mesh_targets(PLAN))
    assert p.write_config().exists() and p.url == "http://127.0.0.1:19090"
    argv = p.argv()
    assert "--web.listen-address=127.0.0.1:19090" in argv
    assert f"--storage.tsdb.path={tmp_path / 'prom' / 'data'}" in argv
    assert f"--config.file={tmp_path / 'prom' / 'prometheus.yml'}" in argv


def test_a_panel_query_as_prometheus_gets_it():
    expr = 'sum by (pool) (rate(x{namespace=~"$namespace", pool=~"${pool}", c=~"$class"}[$__rate_interval]))'
    assert substitute(expr, "10s", {"namespace": "infermesh", "pool": ".*", "class": ".*"}) == \
        'sum by (pool) (rate(x{namespace=~"infermesh", pool=~".*", c=~".*"}[10s]))'
    d = {"title": "d", "panels": [{"title": "p", "targets": [{"refId": "A", "expr": "up{pod=~\"$pool\"}"}]}, {"title": "text"}]}
    q, = panel_queries(d, "10s", {"pool": "a"})
    assert (q.dashboard, q.panel, q.ref, q.expr) == ("d", "p", "A", 'up{pod=~"a"}')


def test_an_alert_without_its_threshold():
    assert without_threshold('max by (pool) (x{n="a"}) > 0') == 'max by (pool) (x{n="a"})'
    assert without_threshold("a\n  / b > 0.05\n") == "a\n  / b"
    assert without_threshold("max(x) >= 3") == "max(x)"
    assert without_threshold("max(x) == 2") == "max(x)"
    assert without_threshold("rate(x[5m])") == "rate(x[5m])"


def test_up_observe_without_prometheus_is_refused_before_anything_starts(tmp_path, monkeypatch):
    from infermesh.launcher import LaunchError, LocalMesh

    monkeypatch.setattr("infermesh.observe.shutil.which", lambda name: None)
    wasm = tmp_path / "infermesh_filter.wasm"
    wasm.write_bytes(b"\0asm")
    mesh = LocalMesh(PLAN, tmp_path / "run", models_dir=tmp_path / "no-models", wasm=wasm, observe=True)
    with pytest.raises(LaunchError, match="prometheus is not installed"):
        mesh.start()
    assert not mesh.children and not (tmp_path / "run").exists()
