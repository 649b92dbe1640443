"""The drill's verdicts, on hand-made records (no mesh): outcomes, due time, reaction, recovery,
flapping. The e2e drills (e2e/test_drills_e2e.py) produce the same records from the real mesh."""

from __future__ import annotations

from infermesh.drill_report import (
    ROUTE_RECOVERY_S, Expectation, Marks, Request, Sample, build_report, classify, due_time, format_report, plot_report)

HOME = {"interactive": "interactive", "batch": "batch"}


def ok(kind: str, t: float, pool: str | None = None, model: str = "big", degraded: bool = False) -> Request:
    return Request(kind, t, t + 0.3, 200, "body", True, ttft=0.05, served_by=f"{pool or HOME[kind]}/0", model=model, degraded_header=degraded)


def shed(kind: str, t: float) -> Request:
    return Request(kind, t, t + 0.01, 429, "headers", False, retry_after=True, error_code="pool_shedding", served_by=f"{HOME[kind]}/0")


def sample(t: float, pool: str, level: int = 0, state: str = "closed", above: float | None = None, model: str = "big") -> Sample:
    return Sample(t, pool, up=True, level=level, ready=True, serving_model=model, primary_model="big",
                  breakers={"kv": {"name": "kv", "signal": "kv_cache", "state": state, "above_s": above}})


def test_outcomes():
    assert classify(ok("interactive", 1), HOME, None) == "ok"
    assert classify(ok("interactive", 1, degraded=True), HOME, None) == "degraded"
    assert classify(ok("interactive", 1, pool="batch"), HOME, None) == "degraded", "spilled to another pool"
    assert classify(shed("batch", 1), HOME, None) == "shed"
    no_retry_after = shed("batch", 1)
    no_retry_after.retry_after = False
    assert classify(no_retry_after, HOME, None) == "failed", "a 429 without Retry-After is not the documented shed"
    assert classify(Request("batch", 1, 2, None), HOME, None) == "lost"
    cut = Request("interactive", 1.0, 2.0, 200, "body", False, served_by="interactive/0")
    assert classify(cut, HOME, None) == "failed"
    assert classify(cut, HOME, kill_at=1.5) == "interrupted"
    assert classify(cut, HOME, kill_at=2.5) == "failed", "cut after the kill was over: not the kill's doing"
    assert classify(Request("bad:x", 1, 2, 400, expect=(400,)), HOME, None) == "rejected"
    assert classify(Request("bad:x", 1, 2, 500, expect=(400,)), HOME, None) == "failed"


def _kv_drill(degrade_from: float = 7.3, recover_at: float = 20.0, flap_at: float | None = None):
    """A synthetic kv-cache drill: fault 5-15 s, sustain 2 s, reading above from 5.05 s."""
    reqs, samples = [], []
    t = 0.0
    while t < 30:
        degraded = degrade_from <= t < recover_at
        reqs.append(ok("interactive", t, model="small" if degraded else "big", degraded=degraded))
        reqs.append(ok("batch", t + 0.1))
        t += 0.25
    t = 0.0
    while t < 30:
        level = 2 if (7.1 <= t < recover_at) or (flap_at is not None and flap_at <= t < flap_at + 2) else 0
        above = round(t - 5.05, 3) if 5.05 <= t < 15 else None
        samples.append(sample(t, "interactive", level, "open" if level else "closed", above, "small" if level else "big"))
        samples.append(sample(t, "batch"))
        t = round(t + 0.1, 2)
    marks = Marks(inject=5.0, clear=15.0, end=30.0)
    exp = Expectation(degrade=True, fault_pool="interactive", breaker_signal="kv_cache", sustain_s=2.0)
    return exp, reqs, samples, marks


def test_a_good_drill_passes_with_the_times_it_measured(tmp_path):
    exp, reqs, samples, marks = _kv_drill()
    assert abs(due_time(samples, exp, marks) - 7.05) < 0.01
    rep = build_report("kv-cache", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
    assert rep["passed"], [c for c in rep["checks"] if not c["passed"]]
    assert rep["times"]["reaction_s"] == 0.05  # the pool's level rose at 7.10
    assert rep["times"]["first_degraded_response_s"] == 0.45  # first degraded request sent at 7.50 (every 0.25 s)
    assert rep["times"]["time_to_recover_s"] is not None and 5.0 <= rep["times"]["time_to_recover_s"] <= 5.2
    assert rep["requests"]["interactive"]["degraded"] > 0 and rep["requests"]["interactive"]["failed"] == 0
    assert "PASSED" in format_report(rep)
    plot_report(rep, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_a_slow_reaction_fails():
    # The pool says it degraded at 7.1 s, but clients were still served normally until 8.5 s.
    exp, reqs, samples, marks = _kv_drill(degrade_from=8.5)
    rep = build_report("kv-cache", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
    check = next(c for c in rep["checks"] if c["name"].startswith("degraded within"))
    assert not check["passed"] and not rep["passed"]


def test_degrading_again_after_recovering_is_flapping():
    exp, reqs, samples, marks = _kv_drill(flap_at=24.0)
    rep = build_report("kv-cache", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
    check = next(c for c in rep["checks"] if c["name"] == "no flapping")
    assert not check["passed"] and "degraded again" in check["detail"]


def test_lost_requests_and_unexpected_failures_fail_the_drill():
    exp, reqs, samples, marks = _kv_drill()
    reqs.append(Request("batch", 10.0, 40.0, None, error="ReadTimeout"))
    reqs.append(Request("interactive", 11.0, 11.1, 502, "headers"))
    rep = build_report("kv-cache", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
    failing = {c["name"] for c in rep["checks"] if not c["passed"]}
    assert {"zero lost requests", "zero unexpected failures"} <= failing


def test_no_recovery_fails():
    exp, reqs, samples, marks = _kv_drill(recover_at=99.0)
    rep = build_report("kv-cache", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
    assert not next(c for c in rep["checks"] if c["name"] == "recovered after the fault ended")["passed"]


def test_only_the_baseline_counts_as_before_the_fault():
    # A pool still shedding from start-up while the drill waited for it (0-1 s) is not the
    # baseline's; shedding once the baseline load began (at 2 s) is.
    exp, reqs, samples, marks = _kv_drill()
    samples = [sample(s.t, s.pool, 3, "open") if s.pool == "batch" and s.t < 1.0 else s for s in samples]
    before = "normal service before the fault"
    marks.baseline = 2.0
    rep = build_report("kv-cache", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
    assert next(c for c in rep["checks"] if c["name"] == before)["passed"]
    marks.baseline = 0.5
    rep = build_report("kv-cache", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
    assert not next(c for c in rep["checks"] if c["name"] == before)["passed"]


def test_streams_cut_by_the_kill_do_not_count_against_interactive_success():
    exp, reqs, samples, marks = _kv_drill()
    exp = Expectation(degrade=True, fault_pool="interactive", breaker_signal="kv_cache", sustain_s=2.0, allow_interrupted=True)
    marks = Marks(inject=5.0, clear=15.0, end=30.0, kill=5.0)
    # three streams in flight at the kill: 3 of 123 would be 97.6 % success
    reqs += [Request("interactive", 4.8 + i * 0.05, 5.5, 200, "body", False, served_by="interactive/0") for i in range(3)]
    rep = build_report("sidecar-kill", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
    checks = {c["name"]: c for c in rep["checks"]}
    assert checks["interactive success >= 99%"]["passed"], checks["interactive success >= 99%"]
    assert checks["only streams in flight at the kill were cut"]["passed"]
    # a stream cut later is no kill's doing: it fails as before
    reqs.append(Request("interactive", 8.0, 8.5, 200, "body", False, served_by="interactive/0"))
    rep = build_report("sidecar-kill", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
    assert "zero unexpected failures" in {c["name"] for c in rep["checks"] if not c["passed"]}


def _degraded_until(reqs: list[Request], start: float, until: float) -> None:
    for i, r in enumerate(reqs):
        if r.kind == "interactive" and start <= r.sent < until:
            reqs[i] = ok("interactive", r.sent, model="small", degraded=True)


def test_normal_service_is_due_once_the_health_checks_hysteresis_and_the_reaction_limit_have_passed():
    # The pool is back at 20.0 s; Envoy's state health check takes it back after 4 passes of
    # 0.25 s (envoy_resources.health_checks), then the 1 s reaction limit: normal from 22.0 s.
    assert ROUTE_RECOVERY_S == 2.0
    for until, passes in ((21.75, True), (22.5, False)):
        exp, reqs, samples, marks = _kv_drill()
        _degraded_until(reqs, 20.0, until)
        rep = build_report("kv-cache", "synthetic", exp, reqs, samples, marks, ["interactive", "batch"])
        check = next(c for c in rep["checks"] if c["name"] == "served normally after recovery")
        assert check["passed"] is passes, (until, check)
