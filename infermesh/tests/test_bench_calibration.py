"""The bench's calibration counts only successful, undegraded answers and refuses to go on when it
cannot get enough; the extreme-overload target. A fake pool (FakeRefusingPool), no mesh."""

from __future__ import annotations

import asyncio

import pytest

from infermesh.bench import BenchOptions, CalibrationError, calibrate_pool
from infermesh.bench_report import build_report, format_report
from infermesh.drill_report import Request


class FakeRefusingPool:
    """Stands in for a drill aimed at a sidecar: answers from a script, each in `latency` s, then
    the last one again: a pool shedding with fast 429s, or one that serves."""

    def __init__(self, script: list[dict], latency: float = 0.004):
        self.script, self.latency = script, latency
        self.requests: list[Request] = []
        self.settled = 0
        self.t = 0.0

    async def send(self) -> None:
        answer = self.script[min(len(self.requests), len(self.script) - 1)]
        r = Request("interactive", self.t)
        self.t += answer.get("latency", self.latency)
        r.done = self.t
        r.status = answer["status"]
        r.complete = answer["status"] == 200
        r.degraded_header = answer.get("degraded", False)
        r.error_code = answer.get("code")
        r.retry_after = answer["status"] in (429, 503)
        self.requests.append(r)

    async def settle(self, *_a) -> int:
        self.settled += 1
        return 0


def run(pool: FakeRefusingPool, opt: BenchOptions | None = None) -> dict:
    return asyncio.run(calibrate_pool(pool, pool.send, "interactive", "interactive", opt or BenchOptions(), pool.settle))


def test_fast_refusals_stop_the_bench_naming_the_pool_and_the_statuses():
    pool = FakeRefusingPool([{"status": 429, "code": "pool_shedding"}])
    with pytest.raises(CalibrationError) as e:
        run(pool)
    msg = str(e.value)
    assert "pool interactive" in msg and "0 successful, undegraded" in msg
    assert "'429 pool_shedding': 20" in msg, msg
    assert len(pool.requests) == BenchOptions().calibration_attempts
    assert pool.settled == 20, "after each refusal it waits for the pool to settle"


def test_degraded_answers_are_not_capacity():
    pool = FakeRefusingPool([{"status": 200, "degraded": True, "latency": 0.01}])
    with pytest.raises(CalibrationError) as e:
        run(pool)
    assert "'200 degraded': 20" in str(e.value)


def test_refusals_among_good_answers_are_reported_and_not_timed():
    script = [{"status": 429, "code": "pool_shedding"}] * 3 + [{"status": 200, "latency": 0.5}]
    pool = FakeRefusingPool(script)
    c = run(pool)
    assert c["one_at_a_time_s"] == 0.5 and c["capacity_rps"] == 2.0
    assert c["outcomes"] == {"429 pool_shedding": 3, "200": 7}
    assert c["timed_ms"] == [500.0] * 5


def window(setup, level, mult, rnd, ttfts, counts, refusals=(), missing_retry=0, seconds=10.0):
    return {"scenario": "overload", "setup": setup, "level": level, "round": rnd, "client": "drill", "seconds": seconds,
            "ttfts": list(ttfts), "itls": [], "interactive": counts, "batch": {}, "multiple": mult,
            "refusal_s": list(refusals), "refusals_without_retry_after": missing_retry}


def extreme_report(lost=0, refusal=0.05, missing=0, goodput_hi=8):
    ws = []
    for s in ("vllm-serve", "envoy-rr", "infermesh"):
        ws.append(window(s, 0.6, 0.5, 0, [0.2] * 5, {"ok": 5}))
        ws.append(window(s, 7.0, 6.0, 0, [0.5] * 60, {"ok": 60}))
    ws.append(window("infermesh", 116.0, 100.0, 0, [0.5] * goodput_hi * 10, {"ok": goodput_hi * 10, "shed": 1000, "lost": lost},
                     refusals=[refusal] * 1000, missing_retry=missing))
    ws.append(window("vllm-serve", 116.0, 100.0, 0, [5.0] * 3, {"ok": 3, "lost": 900}))
    ws.append(window("envoy-rr", 116.0, 100.0, 0, [5.0] * 3, {"ok": 3, "lost": 300}))
    return build_report(ws, 1.0, {"interactive": {"capacity_rps": 1.16, "pool": "interactive", "one_at_a_time_s": 0.86}}, {})


def test_extreme_overload_target_and_the_sweep_target_stays_at_6x():
    rep = extreme_report()
    assert rep["scenarios"]["overload"]["top"] == 7.0
    (sweep, x) = rep["targets"]
    assert sweep["target"].startswith("overload:") and sweep["measured"] == 1.0
    assert x["met"] and x["measured"]["refusal_p99_ms"] == 50.0 and x["measured"]["goodput_rps"] == 8.0
    assert x["measured"]["goodput_rps_mid"] == 6.0 and x["others"]["vllm-serve"]["lost"] == 900
    assert "time to a refusal" in format_report(rep)
    assert not extreme_report(lost=1)["targets"][1]["met"]
    assert not extreme_report(refusal=1.5)["targets"][1]["met"]
    assert not extreme_report(missing=1)["targets"][1]["met"]
    assert not extreme_report(goodput_hi=5)["targets"][1]["met"]


def test_the_sweep_and_quick_reach_100x_and_hold_it_30_s():
    for opt in (BenchOptions(), BenchOptions.quick()):
        assert max(opt.overload_multiples) >= 100 and opt.extreme_window_s >= 30
