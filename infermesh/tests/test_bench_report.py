"""bench_report.py on hand-made windows (fake measurements, no mesh): percentiles pooled over
rounds, spreads, goodput, the ratios and the targets, the text and the picture."""

from __future__ import annotations

import json
import time

from infermesh.bench import BenchOptions, bench_policy, plain_envoy_bootstrap
from infermesh.bench_report import build_report, figure, format_report, goodput, plot_report, spread

CAL = {"batch": {"pool": "batch", "one_at_a_time_s": 0.25, "capacity_rps": 4.0},
       "interactive": {"pool": "interactive", "one_at_a_time_s": 1.0, "capacity_rps": 1.0}}


def fake_window(scenario, setup, level, rnd, ttfts, client=None, seconds=10.0, **kw):
    client = client or ("vllm-bench" if scenario == "batch-flood" else "drill")
    ok = len(ttfts)
    return {"scenario": scenario, "setup": setup, "level": level, "round": rnd, "client": client, "seconds": seconds,
            "ttfts": ttfts, "itls": kw.get("itls", []),
            "interactive": kw.get("interactive", {"ok": ok, "degraded": 0, "shed": 0, "failed": 0, "lost": 0}),
            "batch": kw.get("batch", {}), "batch_tokens": kw.get("batch_tokens", 0), "kv_max": kw.get("kv_max"), "level_max": None,
            "degraded_after_s": kw.get("degraded_after_s"), "level_at_start": kw.get("level_at_start")}


def fake_flood(unloaded: dict[str, float], flooded: dict[str, float], rounds: int = 2) -> list[dict]:
    """Ten chats per window, all at one TTFT, so every percentile is that TTFT."""
    ws = []
    for r in range(rounds):
        for s in ("vllm-serve", "envoy-rr", "infermesh"):
            ws.append(fake_window("batch-flood", s, 0.0, r, [unloaded[s]] * 10))
            ws.append(fake_window("batch-flood", s, 40.0, r, [flooded[s]] * 10, batch={"ok": 100, "shed": 5}, batch_tokens=2400))
    return ws


def test_figure_pools_rounds_and_states_its_spread():
    a = fake_window("batch-flood", "infermesh", 0.0, 0, [0.1] * 99 + [0.5])
    b = fake_window("batch-flood", "infermesh", 0.0, 1, [0.2] * 100)
    f = figure([a, b], target_s=0.15)
    assert f["n"] == 200 and f["rounds"] == 2
    # Pooled (nearest rank): 99 of 0.1, 100 of 0.2, one 0.5; the 100th smallest is already 0.2, and
    # the 0.5 is above the 198th. Each round alone: p99 0.1 (the 0.5 is its 100th) and 0.2.
    assert f["ttft_ms"] == {"p50": 200.0, "p95": 200.0, "p99": 200.0}
    assert f["ttft_p99_ms_by_round"] == {"median": 150.0, "min": 100.0, "max": 200.0}
    # Goodput per round: 99 met the 150 ms target in round 0, none in round 1 (10 s windows).
    assert f["goodput_rps"] == {"median": 4.95, "min": 0.0, "max": 9.9, "rounds": 2}


def test_goodput_counts_only_chats_that_met_the_target():
    w = fake_window("overload", "vllm-serve", 3.0, 0, [0.5, 0.9, 1.0, 1.1, 7.0], seconds=5.0)
    assert goodput(w, 1.0) == 3 / 5.0
    assert spread([]) == {"median": None, "min": None, "max": None, "rounds": 0}


def test_flood_ratios_and_target():
    ws = fake_flood({"vllm-serve": 0.1, "envoy-rr": 0.1, "infermesh": 0.1}, {"vllm-serve": 2.0, "envoy-rr": 0.9, "infermesh": 0.12})
    rep = build_report(ws, 1.0, CAL, {})
    ratios = rep["scenarios"]["batch-flood"]["ratios"]
    assert ratios["vllm-serve"]["flooded_over_unloaded_p99"] == 20.0
    assert ratios["envoy-rr"]["flooded_over_unloaded_p99"] == 9.0
    assert ratios["infermesh"]["flooded_over_unloaded_p99"] == 1.2
    assert ratios["infermesh"]["by_round"]["rounds"] == 2
    (t,) = rep["targets"]
    assert t["met"] and t["measured"] == 1.2 and "10x" in t["target"] and t["others"]["vllm-serve"] == 20.0
    fig = rep["scenarios"]["batch-flood"]["figures"]["infermesh"]["40.0"]
    assert fig["batch"]["ok"] == 200 and fig["batch"]["shed"] == 10 and fig["batch_tokens_per_s"] == 240.0


def test_flood_target_missed_when_the_flood_is_under_ten_times_capacity():
    ws = fake_flood({"vllm-serve": 0.1, "envoy-rr": 0.1, "infermesh": 0.1}, {"vllm-serve": 2.0, "envoy-rr": 0.9, "infermesh": 0.1})
    cal = {**CAL, "batch": {**CAL["batch"], "capacity_rps": 8.0}}  # 40/s is 5x of 8/s
    (t,) = build_report(ws, 1.0, cal, {})["targets"]
    assert not t["met"] and "5x" in t["target"]


def test_overload_goodput_ratio_needs_zero_lost_and_failed():
    ws = []
    for r in range(2):
        ws.append(fake_window("overload", "vllm-serve", 6.0, r, [0.5] * 10 + [5.0] * 50, kv_max=1.0))
        ws.append(fake_window("overload", "envoy-rr", 6.0, r, [0.5] * 20 + [5.0] * 40, kv_max=0.97))
        ws.append(fake_window("overload", "infermesh", 6.0, r, [0.5] * 30,
                              interactive={"ok": 10, "degraded": 20, "shed": 30, "failed": 0, "lost": 0}, kv_max=0.93))
    rep = build_report(ws, 1.0, CAL, {})
    ratios = rep["scenarios"]["overload"]["ratios"]
    assert ratios["infermesh"]["goodput_vs_vllm_serve"] == 3.0 and ratios["envoy-rr"]["goodput_vs_vllm_serve"] == 2.0
    (t,) = rep["targets"]
    assert t["met"] and t["kv_cache_max"] == {"vllm-serve": 1.0, "envoy-rr": 0.97, "infermesh": 0.93}
    ws[-1]["interactive"]["lost"] = 1
    (t,) = build_report(ws, 1.0, CAL, {})["targets"]
    assert not t["met"] and t["lost"] == 1


def test_the_report_says_when_the_ladder_acted_and_which_windows_began_degraded():
    ws = [fake_window("overload", "infermesh", 6.0, r, [0.5] * 10, degraded_after_s=d, level_at_start=0)
          for r, d in ((0, 4.2), (1, 6.5), (2, None))]
    ws += [fake_window("overload", "vllm-serve", 6.0, r, [0.5] * 5) for r in range(3)]
    ws.append(fake_window("overload", "envoy-rr", 6.0, 0, [0.5] * 5, level_at_start=2))
    rep = build_report(ws, 1.0, CAL, {})
    f = rep["scenarios"]["overload"]["figures"]["infermesh"]["6.0"]
    assert f["degraded_after_s"] == {"median": 5.35, "min": 4.2, "max": 6.5, "rounds": 2}
    text = format_report(rep)
    assert "infermesh 6.0/s: 2/3 windows, after 4.2-6.5 s" in text
    assert "began with a pool still shedding or degraded: envoy-rr 6.0/s (level 2)" in text


def test_overload_windows_outlast_the_kv_breakers_sustain_and_escalation():
    # local.yaml's interactive kv-cache breaker: sustain 2 s, escalation 0 s, after a fill of ~2 s.
    for opt in (BenchOptions(), BenchOptions.quick()):
        assert opt.overload_window_s >= 4 * (2 + 2)


def test_agreement_compares_both_clients_on_the_same_unloaded_chats():
    ws = fake_flood({"vllm-serve": 0.1, "envoy-rr": 0.1, "infermesh": 0.1}, {"vllm-serve": 2.0, "envoy-rr": 0.9, "infermesh": 0.1})
    ws.append(fake_window("batch-flood", "infermesh", 0.0, 0, [0.11] * 8, client="drill"))
    rep = build_report(ws, 1.0, CAL, {})
    a = rep["agreement"]["infermesh"]
    assert a["drill"]["n"] == 8 and a["vllm_bench"]["n"] == 10 and a["p50_ratio"] == 1.1
    # The drill window is only a check: the figures come from vLLM's client.
    assert rep["scenarios"]["batch-flood"]["figures"]["infermesh"]["0.0"]["n"] == 20


def test_text_json_and_picture(tmp_path):
    ws = fake_flood({"vllm-serve": 0.1, "envoy-rr": 0.1, "infermesh": 0.1}, {"vllm-serve": 2.0, "envoy-rr": 0.9, "infermesh": 0.12})
    ws += [fake_window("overload", s, lv, 0, [0.4] * 5) for s in ("vllm-serve", "envoy-rr", "infermesh") for lv in (0.5, 6.0)]
    rep = build_report(ws, 1.0, CAL, {"cpu_cores": {"interactive": "0"}})
    text = format_report(rep)
    assert "batch-flood" in text and "overload" in text and "[MET]" in text and "infermesh" in text
    json.dumps(rep)
    plot_report(rep, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_plain_envoy_is_one_round_robin_cluster_without_the_filter():
    b = plain_envoy_bootstrap(18080, 19901, [("127.0.0.1", 8101), ("127.0.0.1", 8102)])
    (c,) = b["static_resources"]["clusters"]
    assert c["lb_policy"] == "ROUND_ROBIN" and len(c["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    assert b["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_bench_policy_sets_every_models_kv_cache(tmp_path):
    from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy

    p = load_policy(bench_policy(LOCAL_POLICY, tmp_path / "p.yaml", 32 << 20))
    assert {m.kv_cache_bytes for pool in p.pools.values() for m in pool.models} == {32 << 20}
    assert BenchOptions.quick().rounds == 2 and BenchOptions().flood_multiples[-1] >= 10


def test_cpu_watch_samples_each_process_and_the_report_prints_the_top_flood_level():
    import asyncio
    import os
    from types import SimpleNamespace

    from infermesh.bench import Bench, Window

    b = Bench.__new__(Bench)
    b.mesh = SimpleNamespace(children=[SimpleNamespace(name="sidecar-batch", proc=SimpleNamespace(pid=os.getpid()))])
    w = Window("batch-flood", "infermesh", 40.0, 0, "vllm-bench", 1.0)

    async def run():
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(b._cpu_watch(stop, w, {"flood-client": os.getpid()}))
        t, cpu0 = time.monotonic(), time.process_time()
        while time.monotonic() - t < 1.2:  # busy, so this process has CPU to show
            await asyncio.sleep(0)
        stop.set()
        await task
        return 100 * (time.process_time() - cpu0) / (time.monotonic() - t)

    used_pct = asyncio.run(run())
    assert set(w.cpu) == {"sidecar-batch", "flood-client", "bench-client"}
    # What this process got of a core depends on what else the machine runs (12 % beside an e2e
    # mesh start, ~100 % alone): the samples must show what it used, not a fixed share.
    assert used_pct > 0 and w.cpu["bench-client"]["cpu_pct"] >= 0.5 * used_pct, (w.cpu, used_pct)
    assert 0 <= w.cpu["bench-client"]["on_cpu0"] <= 1
    ws = fake_flood({"vllm-serve": 0.1, "envoy-rr": 0.1, "infermesh": 0.1}, {"vllm-serve": 2.0, "envoy-rr": 0.9, "infermesh": 0.12})
    for x in ws:
        if x["setup"] == "infermesh" and x["level"] == 40.0:
            x["cpu"] = {"sidecar-batch": {"cpu_pct": 80.0 + 10 * x["round"], "on_cpu0": 0.5}, "envoy": {"cpu_pct": 1.0, "on_cpu0": 1.0}}
    rep = build_report(ws, 1.0, CAL, {})
    assert rep["scenarios"]["batch-flood"]["figures"]["infermesh"]["40.0"]["cpu"]["sidecar-batch"] == {"cpu_pct": 85.0, "on_cpu0": 0.5}
    line = next(x for x in format_report(rep).splitlines() if "CPU at 40/s, infermesh" in x)
    assert "sidecar-batch 85% (0.50)" in line and "envoy" not in line  # under 5 % is left out
