"""The drill report's links to the chart dashboards' queries (observe.drill_queries)."""

from __future__ import annotations

import urllib.parse

import pytest

from infermesh.drill_report import format_report
from infermesh.observe import DRILL_PANELS, drill_queries, graph_link, load_dashboards

START, END = 1796428000.0, 1796428095.5  # 2026-12-04 23:46:40 UTC, 95.5 s


def params(link: str) -> dict[str, list[str]]:
    return urllib.parse.parse_qs(urllib.parse.urlsplit(link).query)


def test_every_linked_panel_is_a_panel_of_the_charts_dashboards_substituted():
    boards = load_dashboards()
    titles = {(name, p["title"]) for name, d in boards.items() for p in d["panels"]}
    assert set(DRILL_PANELS) <= titles
    qs = drill_queries(START, END, "interactive")
    assert [q["panel"] for q in qs] == [t for _, t in DRILL_PANELS]
    for q in qs:
        assert q["exprs"] and q["link"] is None
        assert not any("$" in e for e in q["exprs"]), q  # every Grafana variable replaced
    level = next(q for q in qs if q["panel"] == "Degradation level")
    assert 'pool=~"interactive"' in level["exprs"][0] and 'namespace=~"infermesh"' in level["exprs"][0]


def test_a_renamed_panel_is_an_error_not_a_silent_gap():
    boards = load_dashboards()
    boards["infermesh-pools"] = {**boards["infermesh-pools"], "panels": []}
    with pytest.raises(KeyError, match="Degradation level"):
        drill_queries(START, END, "interactive", dashboards=boards)


def test_the_link_opens_prometheus_graph_page_on_the_drills_window():
    qs = drill_queries(START, END, "batch", "http://127.0.0.1:9090/", namespace=".*", rate_interval="1m")
    ttft = next(q for q in qs if q["panel"].startswith("Time to first token"))
    assert ttft["link"].startswith("http://127.0.0.1:9090/graph?")
    p = params(ttft["link"])
    assert [p[f"g{i}.expr"][0] for i in range(len(ttft["exprs"]))] == ttft["exprs"]
    assert p["g0.range_input"] == ["96s"] and p["g0.end_input"] == ["2026-12-04 23:48:15"] and p["g0.tab"] == ["0"]
    assert all("[1m]" in e for e in ttft["exprs"])


def test_graph_link_of_no_window_is_at_least_a_second():
    assert params(graph_link("http://p", ["up"], START, START))["g0.range_input"] == ["1s"]


def test_the_text_report_prints_each_panel_with_its_link_or_its_queries():
    base = {"scenario": "kv-cache", "summary": "s", "requests": {}, "times": {"inject": 1.0, "clear": 2.0, "end": 3.0,
            "time_to_recover_s": 1.0}, "level_changes": {}, "interactive_ttft": {}, "checks": [], "passed": True,
            "window": {"start": "2026-12-04T23:46:40+00:00", "end": "2026-12-04T23:48:15+00:00"}}
    linked = format_report(base | {"queries": drill_queries(START, END, "interactive", "http://127.0.0.1:9090")})
    assert "the chart's dashboards over the drill (2026-12-04T23:46:40+00:00 to 2026-12-04T23:48:15+00:00)" in linked
    assert linked.count("http://127.0.0.1:9090/graph?") == len(DRILL_PANELS)
    plain = format_report(base | {"queries": drill_queries(START, END, "interactive")})
    assert "Degradation level: max by (pool, pod) (infermesh_pool_degradation_level" in plain and "/graph?" not in plain
