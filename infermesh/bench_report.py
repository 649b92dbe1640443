"""What `infermesh bench` measured, and what it means: figures per set-up and load level, the
ratios the issue asks for, the targets, a text table and a picture.

Pure functions over the windows `infermesh/bench.py` records (plain dicts, as in the JSON), so the
arithmetic is unit-tested on hand-made windows without a mesh.

A figure pools the chats of every round at one (scenario, set-up, level) for its percentiles and
states how many chats it rests on (`n`) and its spread over rounds (each round's own p99 and
goodput, min-max). Goodput is chats per second whose first token came within the stated target.
"""

from __future__ import annotations

import math
import statistics

from .drill_report import percentile

SETUPS = ("vllm-serve", "envoy-rr", "infermesh")
PRIMARY_CLIENT = {"batch-flood": "vllm-bench", "overload": "drill"}
"""Whose measurement a scenario's figures come from (the other client only checks agreement)."""
FLOOD_TARGET = 1.5
"""infermesh's flooded p99 TTFT / its unloaded p99 must stay at or below this."""
OVERLOAD_TARGET = 2.0
"""infermesh's goodput under overload must be at least this many times vllm-serve's."""
OUTCOME_KEYS = ("ok", "degraded", "shed", "failed", "lost")
EXTREME_MULTIPLE = 100.0
"""The overload level (x the interactive pool's capacity) the extreme-overload target is judged at."""
REFUSAL_TARGET_S = 1.0
"""At the extreme level, the p99 time from sending a chat to its whole refusal."""


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def _sum_counts(dicts: list[dict]) -> dict[str, int]:
    out = {k: 0 for k in OUTCOME_KEYS}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def goodput(w: dict, target_s: float) -> float:
    """Chats per second of this window whose TTFT met the target."""
    return sum(1 for t in w["ttfts"] if t <= target_s) / w["seconds"] if w["seconds"] > 0 else 0.0


def spread(values: list[float]) -> dict:
    """Median and range over rounds (None when there is nothing)."""
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "rounds": 0}
    return {"median": round(statistics.median(v), 4), "min": round(min(v), 4), "max": round(max(v), 4), "rounds": len(v)}


def figure(windows: list[dict], target_s: float) -> dict:
    """One (scenario, set-up, level) over its rounds."""
    ttfts = [t for w in windows for t in w["ttfts"]]
    itls = [t for w in windows for t in w.get("itls", [])]
    per_round_p99 = [percentile(w["ttfts"], 99) for w in windows]
    seconds = sum(w["seconds"] for w in windows)
    batch = _sum_counts([w.get("batch") or {} for w in windows])
    kv = [w["kv_max"] for w in windows if w.get("kv_max") is not None]
    levels = [w["level_max"] for w in windows if w.get("level_max") is not None]
    return {
        "n": len(ttfts),
        "rounds": len(windows),
        "ttft_ms": {"p50": _ms(percentile(ttfts, 50)), "p95": _ms(percentile(ttfts, 95)), "p99": _ms(percentile(ttfts, 99))},
        "ttft_p99_ms_by_round": {k: _ms(v) for k, v in spread(per_round_p99).items() if k != "rounds"},
        "itl_ms": {"n": len(itls), "p50": _ms(percentile(itls, 50)), "p99": _ms(percentile(itls, 99))},
        "goodput_rps": spread([goodput(w, target_s) for w in windows]),
        "interactive": _sum_counts([w["interactive"] for w in windows]),
        "batch": batch,
        "batch_tokens_per_s": round(sum(w.get("batch_tokens", 0) for w in windows) / seconds, 1) if seconds else 0.0,
        "kv_cache_max": max(kv) if kv else None,
        "pool_level_max": max(levels) if levels else None,
        "degraded_after_s": spread([w.get("degraded_after_s") for w in windows]),
        "cpu": _mean_cpu([w.get("cpu") or {} for w in windows]),
        "level_at_start_max": max((w["level_at_start"] for w in windows if w.get("level_at_start") is not None), default=None),
        "multiple": max((w["multiple"] for w in windows if w.get("multiple") is not None), default=None),
        "refusal_ms": {"n": len(ref := [t for w in windows for t in w.get("refusal_s", [])]), "p50": _ms(percentile(ref, 50)),
                       "p99": _ms(percentile(ref, 99)), "max": _ms(max(ref, default=None))},
        "refusals_without_retry_after": sum(w.get("refusals_without_retry_after", 0) for w in windows),
    }


def _mean_cpu(cpus: list[dict]) -> dict:
    """Each process's CPU figures, averaged over the windows that sampled it."""
    names = sorted({n for c in cpus for n in c})
    return {n: {k: round(statistics.mean(c[n][k] for c in cpus if n in c), 2) for k in ("cpu_pct", "on_cpu0")} for n in names}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 2)


def build_report(windows: list[dict], target_s: float, calibration: dict, meta: dict) -> dict:
    """Figures for every scenario, set-up and level; the ratios; the targets; a JSON-ready dict."""
    rep: dict = {"ttft_target_s": target_s, "calibration": calibration, **meta, "scenarios": {}, "agreement": {}, "targets": []}
    for scenario, client in PRIMARY_CLIENT.items():
        ws = [w for w in windows if w["scenario"] == scenario and w["client"] == client]
        if not ws:
            continue
        levels = sorted({w["level"] for w in ws})
        figs = {s: {str(lv): figure([w for w in ws if w["setup"] == s and w["level"] == lv], target_s)
                    for lv in levels if any(w["setup"] == s and w["level"] == lv for w in ws)} for s in SETUPS}
        rep["scenarios"][scenario] = {"levels": levels, "client": client, "figures": figs, "top": sweep_top(ws, levels),
                                      "ratios": _ratios(scenario, ws, figs, levels, target_s)}
    rep["agreement"] = agreement(windows)
    rep["targets"] = targets(rep)
    return rep


def sweep_top(ws: list[dict], levels: list[float]) -> float:
    """The sweep's highest level below the extreme one (its ratio and target are judged there, as
    before the extreme level was added; the extreme level has its own target)."""
    below = [lv for lv in levels if all((w.get("multiple") or 0) < EXTREME_MULTIPLE - 0.5 for w in ws if w["level"] == lv)]
    return below[-1] if below else levels[-1]


def _ratios(scenario: str, ws: list[dict], figs: dict, levels: list[float], target_s: float) -> dict:
    lo, hi = str(levels[0]), str(sweep_top(ws, levels))
    out = {}
    for s in SETUPS:
        if lo not in figs[s] or hi not in figs[s]:
            continue
        if scenario == "batch-flood":
            # Each round's own ratio too: the spread says how far one round's noise moves it.
            by_round = []
            for r in sorted({w["round"] for w in ws}):
                a = [w for w in ws if w["setup"] == s and w["round"] == r and str(w["level"]) == hi]
                b = [w for w in ws if w["setup"] == s and w["round"] == r and str(w["level"]) == lo]
                if a and b:
                    by_round.append(_ratio(percentile(a[0]["ttfts"], 99), percentile(b[0]["ttfts"], 99)))
            out[s] = {"flooded_over_unloaded_p99": _ratio(figs[s][hi]["ttft_ms"]["p99"], figs[s][lo]["ttft_ms"]["p99"]),
                      "by_round": spread(by_round)}
        else:
            base = figs["vllm-serve"].get(hi, {}).get("goodput_rps", {}).get("median")
            out[s] = {"goodput_vs_vllm_serve": _ratio(figs[s][hi]["goodput_rps"]["median"], base),
                      "goodput_rps": figs[s][hi]["goodput_rps"]["median"]}
    return out


def agreement(windows: list[dict]) -> dict:
    """vLLM's client against ours, where both ran the same chats (unloaded batch-flood windows)."""
    out = {}
    for s in SETUPS:
        ours = [t for w in windows if w["setup"] == s and w["client"] == "drill" and w["scenario"] == "batch-flood" for t in w["ttfts"]]
        theirs = [t for w in windows if w["setup"] == s and w["client"] == "vllm-bench" and w["scenario"] == "batch-flood"
                  and w["level"] == 0 and w["round"] in {x["round"] for x in windows if x["client"] == "drill"} for t in w["ttfts"]]
        if ours and theirs:
            out[s] = {"drill": {"n": len(ours), "p50_ms": _ms(percentile(ours, 50)), "p95_ms": _ms(percentile(ours, 95))},
                      "vllm_bench": {"n": len(theirs), "p50_ms": _ms(percentile(theirs, 50)), "p95_ms": _ms(percentile(theirs, 95))},
                      "p50_ratio": _ratio(percentile(ours, 50), percentile(theirs, 50))}
    return out


def targets(rep: dict) -> list[dict]:
    out = []
    flood = rep["scenarios"].get("batch-flood")
    if flood:
        levels = flood["levels"]
        mult = levels[-1] / rep["calibration"]["batch"]["capacity_rps"] if rep.get("calibration", {}).get("batch") else None
        r = flood["ratios"].get("infermesh", {}).get("flooded_over_unloaded_p99")
        others = {s: flood["ratios"].get(s, {}).get("flooded_over_unloaded_p99") for s in SETUPS if s != "infermesh"}
        out.append({"target": f"batch flood ({mult:.0f}x capacity): infermesh p99 TTFT <= {FLOOD_TARGET}x unloaded" if mult
                    else f"batch flood: infermesh p99 TTFT <= {FLOOD_TARGET}x unloaded",
                    "met": r is not None and r <= FLOOD_TARGET and (mult is None or mult >= 10 - 1e-9),
                    "measured": r, "others": others})
    over = rep["scenarios"].get("overload")
    if over:
        hi = str(over.get("top", over["levels"][-1]))
        g = over["ratios"].get("infermesh", {}).get("goodput_vs_vllm_serve")
        fig = over["figures"]["infermesh"].get(hi, {})
        counts = fig.get("interactive", {})
        out.append({"target": f"overload: infermesh goodput >= {OVERLOAD_TARGET}x vllm-serve, zero lost, zero failed",
                    "met": g is not None and g >= OVERLOAD_TARGET and counts.get("lost", 1) == 0 and counts.get("failed", 1) == 0,
                    "measured": g, "lost": counts.get("lost"), "failed": counts.get("failed"),
                    "kv_cache_max": {s: over["figures"][s].get(hi, {}).get("kv_cache_max") for s in SETUPS}})
        if (x := extreme(over)) is not None:
            out.append(x)
    return out


def extreme(over: dict) -> dict | None:
    """The extreme-overload target at the first level of >= EXTREME_MULTIPLE x capacity: zero
    lost, p99 time to a refusal within REFUSAL_TARGET_S, goodput no lower than at the level
    nearest 6x, every refusal with Retry-After."""
    figs = over["figures"]["infermesh"]
    by_mult = {lv: f.get("multiple") for lv, f in figs.items() if f.get("multiple") is not None}
    top = [lv for lv, m in by_mult.items() if m >= EXTREME_MULTIPLE - 0.5]
    if not top:
        return None
    hi = min(top, key=float)
    rest = [lv for lv in by_mult if lv not in top]
    mid = min(rest, key=lambda lv: abs(by_mult[lv] - 6.0)) if rest else None
    f = figs[hi]
    g_hi, g_mid = f["goodput_rps"]["median"], figs[mid]["goodput_rps"]["median"] if mid else None
    counts, p99 = f["interactive"], f["refusal_ms"]["p99"]
    met = (counts.get("lost", 1) == 0 and (p99 is None or p99 <= REFUSAL_TARGET_S * 1000) and g_hi is not None
           and (g_mid is None or g_hi >= g_mid) and f["refusals_without_retry_after"] == 0)
    return {"target": f"extreme overload ({by_mult[hi]:.0f}x capacity): infermesh loses none, p99 refusal <= "
                      f"{REFUSAL_TARGET_S * 1000:.0f} ms, goodput >= at {by_mult[mid]:.0f}x, every refusal with Retry-After"
                      if mid else "extreme overload", "met": met,
            "measured": {"goodput_rps": g_hi, "goodput_rps_mid": g_mid, "refusal_p99_ms": p99, "lost": counts.get("lost"),
                         "refusals_without_retry_after": f["refusals_without_retry_after"]},
            "others": {s: {"lost": over["figures"][s].get(hi, {}).get("interactive", {}).get("lost"),
                           "goodput_rps": over["figures"][s].get(hi, {}).get("goodput_rps", {}).get("median")}
                       for s in SETUPS if s != "infermesh"}}


# -- text and picture --------------------------------------------------------------------------

def _f(x, nd: int = 0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def format_report(rep: dict) -> str:
    lines = [f"infermesh bench (TTFT target for goodput: {rep['ttft_target_s'] * 1000:.0f} ms)"]
    if rep.get("cpu_cores"):
        lines.append("  CPUs: " + ", ".join(f"{k} {v}" for k, v in rep["cpu_cores"].items())
                     + (f" (pinned: {rep['pinned']})" if rep.get("pinned") else ""))
    for kind, c in rep.get("calibration", {}).items():
        lines.append(f"  capacity without queueing, {kind}: {c['capacity_rps']}/s (pool {c['pool']}, one request in {c['one_at_a_time_s'] * 1000:.0f} ms)"
                     + (f"; calibration answers {c['outcomes']}, timed {c.get('timed_ms')} ms" if c.get("outcomes") else ""))
    for scenario, sc in rep["scenarios"].items():
        unit = "batch/s" if scenario == "batch-flood" else "chats/s"
        lines += ["", f"{scenario} (chats measured by {sc['client']}; figures pooled over rounds, p99 range = each round's p99)",
                  f"  {'set-up':<11} {unit:>8} {'n':>4} {'p50':>6} {'p95':>6} {'p99':>6} {'p99 range':>13} {'ITL p50':>7} "
                  f"{'goodput/s':>16} {'ok/deg/shed/fail/lost':>22} {'batch':>14} {'tok/s':>6} {'kv':>4}"]
        for s in SETUPS:
            for lv, f in sc["figures"][s].items():
                t, g, i, b = f["ttft_ms"], f["goodput_rps"], f["interactive"], f["batch"]
                rng = f["ttft_p99_ms_by_round"]
                lines.append(
                    f"  {s:<11} {float(lv):>8.2f} {f['n']:>4} {_f(t['p50']):>6} {_f(t['p95']):>6} {_f(t['p99']):>6} "
                    f"{_f(rng['min']) + '-' + _f(rng['max']):>13} {_f(f['itl_ms']['p50'], 1):>7} "
                    f"{_f(g['median'], 2) + ' (' + _f(g['min'], 2) + '-' + _f(g['max'], 2) + ')':>16} "
                    f"{'/'.join(str(i.get(k, 0)) for k in OUTCOME_KEYS):>22} "
                    f"{('/'.join(str(b.get(k, 0)) for k in OUTCOME_KEYS)) if sum(b.values()) else '-':>14} "
                    f"{_f(f['batch_tokens_per_s']):>6} {_f(f['kv_cache_max'], 2):>4}")
        ladder = [f"{s} {lv}/s: {f['degraded_after_s']['rounds']}/{f['rounds']} windows, after "
                  f"{_f(f['degraded_after_s']['min'], 1)}-{_f(f['degraded_after_s']['max'], 1)} s"
                  for s in SETUPS for lv, f in sc["figures"][s].items() if f.get("degraded_after_s", {}).get("rounds")]
        if ladder:
            lines.append("  interactive pool degraded to its small model (level >= 2): " + "; ".join(ladder))
        unsettled = [f"{s} {lv}/s (level {f['level_at_start_max']})" for s in SETUPS for lv, f in sc["figures"][s].items()
                     if (f.get("level_at_start_max") or 0) >= 1]
        if unsettled:
            lines.append("  windows that began with a pool still shedding or degraded: " + ", ".join(unsettled))
        refusals = [f"{s} {float(lv):g}/s ({f['multiple']:g}x): p50 {_f(f['refusal_ms']['p50'])} / p99 {_f(f['refusal_ms']['p99'])} ms "
                    f"over {f['refusal_ms']['n']}, {f['refusals_without_retry_after']} without Retry-After"
                    for s in SETUPS for lv, f in sc["figures"][s].items() if f.get("multiple") is not None and f["refusal_ms"]["n"]]
        if refusals:
            lines.append("  time to a refusal (429/503): " + "; ".join(refusals))
        top = str(sc["levels"][-1])
        for s in SETUPS:
            cpu = sc["figures"][s].get(top, {}).get("cpu")
            if cpu:
                lines.append(f"  CPU at {float(top):g}/s, {s} (% of one core, share on CPU 0): " + ", ".join(
                    f"{n} {c['cpu_pct']:.0f}% ({c['on_cpu0']:.2f})" for n, c in sorted(cpu.items(), key=lambda kv: -kv[1]["cpu_pct"])
                    if c["cpu_pct"] >= 5))
        lines.append("  ratios: " + "; ".join(f"{s} {v}" for s, v in sc["ratios"].items()))
    if rep.get("agreement"):
        lines += ["", "agreement (unloaded chats, vLLM's client vs ours): " + "; ".join(
            f"{s}: p50 {a['vllm_bench']['p50_ms']} vs {a['drill']['p50_ms']} ms (n {a['vllm_bench']['n']}/{a['drill']['n']})"
            for s, a in rep["agreement"].items())]
    lines.append("")
    for t in rep["targets"]:
        lines.append(f"  [{'MET' if t['met'] else 'MISSED'}] {t['target']}: measured {t['measured']}"
                     + (f" (others: {t['others']})" if "others" in t else f" (lost {t['lost']}, failed {t['failed']}, kv max {t['kv_cache_max']})"))
    return "\n".join(lines)


def plot_report(rep: dict, path: str) -> None:
    """TTFT p99 against batch load (one line per set-up, the bars span the rounds' p99s), and
    goodput against chat load under overload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scs = [s for s in ("batch-flood", "overload") if s in rep["scenarios"]]
    fig, axes = plt.subplots(1, len(scs), figsize=(6.5 * len(scs), 4.6), squeeze=False)
    for ax, scenario in zip(axes[0], scs):
        sc = rep["scenarios"][scenario]
        for s in SETUPS:
            pts = sorted((float(lv), f) for lv, f in sc["figures"][s].items())
            if not pts:
                continue
            xs = [x for x, _ in pts]
            if scenario == "batch-flood":
                ys = [f["ttft_ms"]["p99"] for _, f in pts]
                lo = [max(0, (y or 0) - (f["ttft_p99_ms_by_round"]["min"] or 0)) for y, (_, f) in zip(ys, pts)]
                hi = [max(0, (f["ttft_p99_ms_by_round"]["max"] or 0) - (y or 0)) for y, (_, f) in zip(ys, pts)]
            else:
                ys = [f["goodput_rps"]["median"] for _, f in pts]
                lo = [max(0, (y or 0) - (f["goodput_rps"]["min"] or 0)) for y, (_, f) in zip(ys, pts)]
                hi = [max(0, (f["goodput_rps"]["max"] or 0) - (y or 0)) for y, (_, f) in zip(ys, pts)]
            ax.errorbar(xs, [y if y is not None else float("nan") for y in ys], yerr=[lo, hi], marker="o", capsize=3, label=s)
        if scenario == "batch-flood":
            cap = rep.get("calibration", {}).get("batch", {}).get("capacity_rps")
            ax.set_xlabel("batch completions/s" + (f" (batch pool capacity {cap}/s)" if cap else ""))
            ax.set_ylabel("interactive TTFT p99 (ms)")
            ax.set_title("Batch flood: interactive p99 TTFT")
            ax.set_yscale("log")
        else:
            ax.set_xlabel("interactive chats/s (long prompts)")
            ax.set_ylabel(f"goodput: chats/s with TTFT <= {rep['ttft_target_s'] * 1000:.0f} ms")
            ax.set_title("Overload: interactive goodput")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
