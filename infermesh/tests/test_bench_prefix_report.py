"""The prefix benchmark's report arithmetic (infermesh/bench_prefix.py): percentiles, spreads,
hit-rate deltas from the sidecars' counters, in-flight balance, idle classing, target ratios.
No processes: the windows are built by hand."""

from __future__ import annotations

from infermesh.bench_prefix import (SETUPS, Options, conversation_tenants, counter_sum, filter_counters, hit_rate, http_filter_names, idle_before,
                                    inflight_balance, pct, policies, ratio, reuse_bound, session_filter_in, spread, summarize,
                                    system_prompt, targets)


def test_pct_is_nearest_rank():
    xs = [float(i) for i in range(1, 11)]  # 1..10
    assert pct(xs, 0.5) == 5.0
    assert pct(xs, 0.9) == 9.0
    assert pct(xs, 0.99) == 10.0
    assert pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert pct([7.0], 0.99) == 7.0
    assert pct([], 0.5) is None


def test_spread_over_rounds_skips_missing_rounds():
    assert spread([0.5, None, 0.7, 0.6]) == {"median": 0.6, "min": 0.5, "max": 0.7, "n": 3}
    assert spread([None]) == {"median": None, "min": None, "max": None, "n": 0}


def test_ratio():
    assert ratio(1.0, 3.0) == 0.333
    assert ratio(0.0, 2.0) == 0.0
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None and ratio(1.0, None) is None


METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama-large"} 1200.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama-small"} 34.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama-large"} 640.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny-llama-large"} 1.7e9
vllm:prefix_cache_queries 5
"""


def test_counter_sum_adds_every_series_and_ignores_created():
    assert counter_sum(METRICS, "vllm:prefix_cache_queries") == 1239.0
    assert counter_sum(METRICS, "vllm:prefix_cache_hits") == 640.0
    assert counter_sum(METRICS, "vllm:absent") == 0.0


def test_hit_rate_is_the_delta_over_the_window():
    assert hit_rate({"queries": 1000, "hits": 400}, {"queries": 3000, "hits": 1900}) == {"queries": 2000, "hits": 1500, "rate": 0.75}
    assert hit_rate({"queries": 10, "hits": 1}, {"queries": 10, "hits": 1})["rate"] is None


def test_inflight_balance_uses_each_replicas_mean():
    b = inflight_balance({"a": [(0, 3), (1, 3), (2, 3), (3, 3)], "b": [(0, 1), (1, 1), (2, 0), (3, 0)]})
    assert b["mean_in_flight"] == {"a": 3.0, "b": 0.5}
    assert b["peak"] == 3
    assert b["max_over_mean"] == round(3.0 / 1.75, 3)
    assert inflight_balance({"a": [(0, 2)], "b": [(0, 2)]})["max_over_mean"] == 1.0
    assert inflight_balance({"a": [(0, 0)], "b": []})["max_over_mean"] is None


def test_idle_before():
    s = [(0.0, 0), (0.1, 2), (0.2, 1), (0.3, 0), (0.4, 0), (0.5, 0)]
    assert idle_before(s, 0.25) == 0.0  # busy at the last sample before
    assert abs(idle_before(s, 0.55) - 0.35) < 1e-9  # last busy at 0.2
    assert idle_before(s, -1.0) is None  # no sample yet
    assert idle_before([(0.0, 0), (0.1, 0)], 0.2) is None  # never busy in the window


def test_conversation_tenants():
    assert conversation_tenants(4, "spread", 0.75) == [0, 1, 2, 3]
    assert conversation_tenants(8, "hot", 0.75) == [0, 0, 0, 0, 0, 0, 1, 2]
    assert conversation_tenants(4, "hot", 0.75) == [0, 0, 0, 1]


def test_system_prompts_are_led_by_the_windows_nonce_and_sized():
    a, b = system_prompt("w1", 3, 1200), system_prompt("w2", 3, 1200)
    assert a.startswith("[w1]") and b.startswith("[w2]") and a[4:] == b[4:]
    assert 1200 <= len(a) < 1300


def turn(conv, k, ttft, served, first, after_idle=False, tokens=16):
    return {"conv": conv, "tenant": conv, "turn": k, "ttft": ttft, "served_by": served, "first_served_by": first,
            "after_idle": after_idle, "tokens": tokens, "prompt_tokens": 600 + 40 * k, "status": 200 if ttft else 503}


def win(turns, q, h, tps, mom):
    return {"turns": turns, "cache": {"queries": q, "hits": h, "rate": round(h / q, 4)}, "tokens_per_s": tps,
            "balance": {"max_over_mean": mom, "peak": 4}}


def test_summarize_pools_rounds_and_counts_later_turns_only():
    w1 = win([turn(0, 0, 0.9, "r/0", "r/0"), turn(0, 1, 0.1, "r/0", "r/0"), turn(0, 2, 0.2, "r/1", "r/0", after_idle=True)], 1000, 500, 10.0, 1.2)
    w2 = win([turn(1, 0, 0.8, "r/1", "r/1"), turn(1, 1, 0.3, "r/1", "r/1"), turn(1, 2, None, None, "r/1")], 3000, 2100, 20.0, 1.6)
    s = summarize([w1, w2], Options())
    assert s["hit_rate"] == 0.65  # pooled: 2600 / 4000, not the mean of 0.5 and 0.7
    assert s["hit_rate_rounds"] == {"median": 0.6, "min": 0.5, "max": 0.7, "n": 2}
    assert s["later_ttft_ms"] == {"p50": 200.0, "p90": 300.0, "p99": 300.0, "n": 3}
    assert s["later_ttft_warm_ms"]["n"] == 2 and s["later_ttft_warm_ms"]["after_idle"] == 1
    assert s["first_ttft_p50_ms"] == 800.0
    assert s["turns"] == 6 and s["ok"] == 5
    assert s["later_turns_on_first_turns_replica"] == round(2 / 3, 3)
    assert s["tokens_per_s_rounds"]["median"] == 15.0
    assert s["inflight_max_over_mean_rounds"]["max"] == 1.6
    assert s["largest_prompt_tokens"] == 680
    assert s["statuses"] == {"200": 5, "503": 1}


def test_targets_take_the_issues_ratios():
    def fig(hr, p90, warm, mom):
        return {"hit_rate": hr, "later_ttft_ms": {"p90": p90}, "later_ttft_warm_ms": {"p90": warm},
                "inflight_max_over_mean_rounds": {"max": mom}}
    spread_ = {"prefix": fig(0.72, 100.0, 80.0, 1.1), "orca": fig(0.5, 400.0, 100.0, 1.1),
               "round-robin": fig(0.45, 500.0, 90.0, 1.0), "one-replica": fig(0.8, 60.0, 50.0, 1.0)}
    hot = {**spread_, "prefix": fig(0.7, 150.0, 90.0, 1.6)}
    t = targets({"spread": spread_, "hot": hot})
    assert t["hit_rate_prefix_vs_ceiling"] == 0.9
    assert t["later_ttft_p90_prefix_vs_orca"] == 0.25
    assert t["later_ttft_warm_p90_prefix_vs_orca"] == 0.8
    assert t["hot_inflight_max_over_mean_prefix"] == 1.6
    assert t["met"] == {"hit_rate_ge_0.9_ceiling": True, "later_ttft_p90_le_0.5_orca": True, "hot_inflight_le_1.5_mean": False}


def test_the_policies_key_the_mesh_and_not_the_orca_envoy(tmp_path):
    keyed, unkeyed = policies(tmp_path)
    k, u = keyed.read_text(), unkeyed.read_text()
    assert "prefix_key: {}" in k and "ttft_deadline_ms" not in k
    assert "prefix_key" not in u and "ttft_deadline_ms" not in u
    assert SETUPS == ("prefix", "orca", "round-robin", "one-replica")


def test_the_session_filter_is_found_in_http_filters_only():
    dump = {"configs": [{"bootstrap": {"node": {"extensions": [{"name": "envoy.filters.http.stateful_session"}]}}},
                        {"dynamic_listeners": [{"active_state": {"listener": {"filter_chains": [{"filters": [{"typed_config": {
                            "http_filters": [{"name": "infermesh"}, {"name": "envoy.filters.http.router"}]}}]}]}}}]}]}
    assert http_filter_names(dump) == {"infermesh", "envoy.filters.http.router"}
    assert not session_filter_in(dump)
    dump["configs"][1]["dynamic_listeners"][0]["active_state"]["listener"]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"].insert(1, {"name": "envoy.filters.http.stateful_session"})
    assert session_filter_in(dump)


def test_the_orca_envoys_resources_carry_no_session_filter_and_the_keyed_ones_do(tmp_path):
    from pathlib import Path

    from infermesh.meshconfig.envoy_bootstrap import bootstrap
    from infermesh.meshconfig.local_mesh import LocalMeshPlan

    keyed, unkeyed = policies(tmp_path)
    wasm = Path("/nonexistent/filter.wasm")  # only written into the config, never read
    assert not session_filter_in(bootstrap(LocalMeshPlan(policy_path=unkeyed).listener(wasm)))
    assert session_filter_in(bootstrap(LocalMeshPlan(policy_path=keyed).listener(wasm)))


def test_filter_counters_are_summed_over_envoys_stat_prefixes():
    text = ("wasmcustom.infermesh.prefix_named_total: 7\nwasmcustom.infermesh.prefix_learned_total: 9\n"
            "other.infermesh.prefix_named_total: 1\ninfermesh.prefix_over_bound_total: 2\ncluster.x.prefix_named: 5\n")
    assert filter_counters(text) == {"named": 8, "over_bound": 2, "learned": 9}


def test_reuse_bound_counts_each_later_turns_previous_prompt_in_whole_blocks():
    turns = [{"conv": 0, "turn": 0, "prompt_tokens": 100}, {"conv": 0, "turn": 1, "prompt_tokens": 140},
             {"conv": 1, "turn": 0, "prompt_tokens": 60}]
    # conv 0's turn 1 reuses 96 of turn 0's 100 tokens (6 blocks); conv 1 has no later turn.
    assert reuse_bound(turns) == round(96 / 300, 4)
    assert reuse_bound([{"conv": 0, "turn": 0, "prompt_tokens": None}]) is None
    assert reuse_bound([]) is None
