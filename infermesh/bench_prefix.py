"""`infermesh bench --scenario prefix`: picking the replica that holds a conversation's prefix
(docs/prefix-routing.md, issue 30), side by side with load-only picking, on one pool of two replicas.

    infermesh bench --scenario prefix [--quick] [--rounds N] [--json FILE]

One local mesh from e2e/policy-replicas-e2e.yaml (two interactive vLLM replicas, each bound to
its own core as bench_replicas does), the interactive class's `ttft_deadline_ms: 600` replaced by
`prefix_key: {}` (a hedge is a retry, which Envoy sends to the other replica on purpose: no
deadline, so nothing but the picking moves a turn). Four set-ups over the SAME two sidecars:

- `prefix`: the mesh's own Envoy (control plane; the filter names the replica, Envoy's stateful
  session filter routes to it, ORCA weighted round robin otherwise);
- `orca`: today's picking: the same policy without `prefix_key`, as a second, static Envoy from
  its generated resources (checked to carry no stateful session filter);
- `round-robin`: a plain Envoy (`bench.plain_envoy_bootstrap`) over both replicas;
- `one-replica`: a plain Envoy over replica 0 alone: the hit-rate ceiling.

Workload per window: `tenants` conversations, each with its own system prompt, `turns` streamed
chat turns each resending the whole conversation, a `gap_s` pause before each turn,
conversations started `stagger_s` apart so tenants' turns interleave. The models' context is
1024 tokens, so the system prompt is ~550 tokens (not issue 30's 1.4k) and a 5-turn
conversation's last prompt must stay under 1024 with its answer (the report prints the largest
prompt seen). Every window uses
system prompts no other window has used (a fresh nonce leads each), so no set-up inherits
another's cache. `hot` variant: one tenant holds `hot_share` of the conversations (its system
prompt shared by all of them).

vLLM on CPU answers the first request after an idle moment late (~1 s, issue 30). Each window
starts with one short request straight to each replica it uses (before the counters are read),
and every later turn is classed by whether its replica had nothing in flight for `idle_s`
before it was sent (from /admin/state samples): the report gives TTFT over all later turns and
over the warm ones.

Rounds alternate the set-ups' order. Report per set-up and variant, with spreads over rounds
and the n: prefix-cache hit rate (delta of `vllm:prefix_cache_hits` / `_queries` over the
window, summed over the replicas the set-up uses), later turns' TTFT p50/p90/p99, tokens/s, the
in-flight balance (largest per-replica mean in-flight over the mean), and issue 30's targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

POLICY = Path(__file__).resolve().parent.parent / "e2e" / "policy-replicas-e2e.yaml"
DEADLINE_LINE = "  interactive: {pool: interactive, priority: 0, ttft_deadline_ms: 600}"
KEYED_LINE = "  interactive: {pool: interactive, priority: 0, prefix_key: {}}"
UNKEYED_LINE = "  interactive: {pool: interactive, priority: 0}"
CPU_CORES = {"interactive": "0", "interactive.1": "1", "batch": "1"}
"""As bench_replicas: replica 0 on CPU 0, replica 1 on CPU 1, the (idle) batch pool beside replica 1."""
SETUPS = ("prefix", "orca", "round-robin", "one-replica")
VARIANTS = ("spread", "hot")
PREFIX_COUNTERS = ("named", "over_bound", "learned")
TARGETS = {"hit_rate_vs_ceiling_min": 0.9, "later_ttft_p90_prefix_vs_orca_max": 0.5, "hot_inflight_max_over_mean_max": 1.5}


@dataclass
class Options:
    rounds: int = 3
    tenants: int = 8
    turns: int = 5
    system_chars: int = 800
    """~550 tokens with the e2e models' tokenizer (~1.45 characters a token): with 5 turns and
    the random models' answers resent, the last prompt stays under the 1024-token context."""
    max_tokens: int = 12
    gap_s: float = 0.5
    """Pause before each turn (a person reading and typing)."""
    stagger_s: float = 0.3
    """Conversation i starts i x stagger_s into the window."""
    hot_share: float = 0.75
    idle_s: float = 0.5
    """A later turn whose replica had nothing in flight this long before it was sent is 'after idle'."""
    sample_s: float = 0.1

    @classmethod
    def quick(cls) -> "Options":
        return cls(rounds=2, tenants=4, turns=3)


# -- arithmetic (unit-tested: infermesh/tests/test_bench_prefix_report.py) ------------------------

def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (the sample at rank ceil(q*n)), None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))]


def spread(xs: list[float | None]) -> dict:
    """Median, min and max of one figure over rounds, and how many rounds had it."""
    v = [x for x in xs if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(v), 4), "min": round(min(v), 4), "max": round(max(v), 4), "n": len(v)}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def counter_sum(text: str, name: str) -> float:
    """Sum of every series of a Prometheus counter (`name` or `name_total`) in an exposition text."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_:][\w:]*)(\{.*\})?\s+(\S+)", line)
        if m and m.group(1) in (name, name + "_total"):
            total += float(m.group(3))
    return total


def hit_rate(before: dict[str, float], after: dict[str, float]) -> dict:
    """Prefix-cache hit rate over a window from the summed counters read before and after it."""
    q = after["queries"] - before["queries"]
    h = after["hits"] - before["hits"]
    return {"queries": q, "hits": h, "rate": round(h / q, 4) if q > 0 else None}


def inflight_balance(samples: dict[str, list[tuple[float, int]]]) -> dict:
    """In-flight balance over a window from each replica's (time, in_flight) samples: each
    replica's mean in-flight, the largest over the mean of all (1.0: even; with 2 replicas at
    most 2.0), and the peak sampled count."""
    means = {r: statistics.fmean(n for _, n in s) for r, s in samples.items() if s}
    peak = max((n for s in samples.values() for _, n in s), default=0)
    overall = statistics.fmean(means.values()) if means else 0.0
    return {"mean_in_flight": {r: round(m, 3) for r, m in means.items()}, "peak": peak,
            "max_over_mean": round(max(means.values()) / overall, 3) if overall > 0 else None}


def idle_before(samples: list[tuple[float, int]], t: float) -> float | None:
    """How long a replica had had nothing in flight at time `t` (from its samples), None if no
    sample before `t` showed it busy (idle since the window began)."""
    busy = [ts for ts, n in samples if ts <= t and n > 0]
    last = [ts for ts, _ in samples if ts <= t]
    if not last:
        return None
    if last[-1] in busy:
        return 0.0
    return t - busy[-1] if busy else None


def reuse_bound(turns: list[dict], block: int = 16) -> float | None:
    """The hit rate if every later turn found its conversation's previous prompt cached (whole
    16-token blocks; vLLM's block size on CPU): what an unbounded cache gives one conversation
    at a time. The answers are not counted (the random models' text is tokenized anew when
    resent), nor another conversation's shared system prompt (the hot tenant's can beat it)."""
    by_conv: dict[tuple, list[dict]] = {}
    for t in turns:
        by_conv.setdefault((t.get("window"), t["conv"]), []).append(t)
    reused = total = 0
    for conv in by_conv.values():
        conv.sort(key=lambda t: t["turn"])
        if any(t["prompt_tokens"] is None for t in conv):
            return None
        total += sum(t["prompt_tokens"] for t in conv)
        reused += sum(block * (a["prompt_tokens"] // block) for a, b in zip(conv, conv[1:]) if b["turn"] == a["turn"] + 1)
    return round(reused / total, 4) if total else None


def statuses(turns: list[dict]) -> dict[str, int]:
    """How the turns ended: HTTP status (0: no response), `200-no-token` for a 200 without one."""
    out: dict[str, int] = {}
    for t in turns:
        k = "200-no-token" if t["status"] == 200 and t["ttft"] is None else str(t["status"])
        out[k] = out.get(k, 0) + 1
    return out


def summarize(windows: list[dict], opt: Options) -> dict:
    """One set-up's windows (one variant) -> its figures with spreads over rounds and the n."""
    later = [t for w in windows for t in w["turns"] if t["turn"] > 0 and t["ttft"] is not None]
    warm = [t for t in later if not t["after_idle"]]
    ms = lambda xs, q: round(1000 * pct(xs, q), 1) if xs else None  # noqa: E731
    q = sum(w["cache"]["queries"] for w in windows)
    h = sum(w["cache"]["hits"] for w in windows)
    served: dict[str, int] = {}
    for w in windows:
        for t in w["turns"]:
            served[str(t["served_by"])] = served.get(str(t["served_by"]), 0) + 1
    stayed = [t["served_by"] == t["first_served_by"] for w in windows for t in w["turns"] if t["turn"] > 0 and t["ttft"] is not None]
    sent = sum(len(w["turns"]) for w in windows)
    return {
        "windows": len(windows), "turns": sent, "ok": sum(1 for w in windows for t in w["turns"] if t["ttft"] is not None),
        "hit_rate": round(h / q, 4) if q > 0 else None, "cache_queries_tokens": q,
        "reuse_bound": reuse_bound([{**t, "window": i} for i, w in enumerate(windows) for t in w["turns"]]),
        "hit_rate_rounds": spread([w["cache"]["rate"] for w in windows]),
        "later_ttft_ms": {"p50": ms([t["ttft"] for t in later], 0.5), "p90": ms([t["ttft"] for t in later], 0.9),
                          "p99": ms([t["ttft"] for t in later], 0.99), "n": len(later)},
        "later_ttft_p90_ms_rounds": spread([ms([t["ttft"] for t in w["turns"] if t["turn"] > 0 and t["ttft"] is not None], 0.9)
                                            for w in windows]),
        "later_ttft_warm_ms": {"p50": ms([t["ttft"] for t in warm], 0.5), "p90": ms([t["ttft"] for t in warm], 0.9),
                               "p99": ms([t["ttft"] for t in warm], 0.99), "n": len(warm), "after_idle": len(later) - len(warm)},
        "first_ttft_p50_ms": ms([t["ttft"] for w in windows for t in w["turns"] if t["turn"] == 0 and t["ttft"] is not None], 0.5),
        "tokens_per_s_rounds": spread([w["tokens_per_s"] for w in windows]),
        "inflight_max_over_mean_rounds": spread([w["balance"]["max_over_mean"] for w in windows]),
        "inflight_peak": max((w["balance"]["peak"] for w in windows), default=0),
        "later_turns_on_first_turns_replica": round(sum(stayed) / len(stayed), 3) if stayed else None,
        "served_by": served,
        "statuses": statuses([t for w in windows for t in w["turns"]]),
        "filter": ({k: sum(w["filter"][k] for w in windows) for k in PREFIX_COUNTERS}
                   if windows and all(w.get("filter") for w in windows) else None),
        "largest_prompt_tokens": max((t["prompt_tokens"] or 0 for w in windows for t in w["turns"]), default=0) or None,
    }


def targets(report: dict) -> dict:
    """Issue 30's target ratios from the summaries (`report[variant][setup]`)."""
    sp, hot = report["spread"], report["hot"]
    out = {
        "hit_rate_prefix_vs_ceiling": ratio(sp["prefix"]["hit_rate"], sp["one-replica"]["hit_rate"]),
        "hit_rate_orca_vs_ceiling": ratio(sp["orca"]["hit_rate"], sp["one-replica"]["hit_rate"]),
        "hit_rate_round_robin_vs_ceiling": ratio(sp["round-robin"]["hit_rate"], sp["one-replica"]["hit_rate"]),
        "hit_rate_prefix_vs_reuse_bound": ratio(sp["prefix"]["hit_rate"], sp["prefix"].get("reuse_bound")),
        "hit_rate_one_replica_vs_reuse_bound": ratio(sp["one-replica"]["hit_rate"], sp["one-replica"].get("reuse_bound")),
        "hot_hit_rate_prefix_vs_ceiling": ratio(hot["prefix"]["hit_rate"], hot["one-replica"]["hit_rate"]),
        "later_ttft_p90_prefix_vs_orca": ratio(sp["prefix"]["later_ttft_ms"]["p90"], sp["orca"]["later_ttft_ms"]["p90"]),
        "later_ttft_warm_p90_prefix_vs_orca": ratio(sp["prefix"]["later_ttft_warm_ms"]["p90"], sp["orca"]["later_ttft_warm_ms"]["p90"]),
        "hot_later_ttft_p90_prefix_vs_orca": ratio(hot["prefix"]["later_ttft_ms"]["p90"], hot["orca"]["later_ttft_ms"]["p90"]),
        "hot_inflight_max_over_mean_prefix": hot["prefix"]["inflight_max_over_mean_rounds"]["max"],
        "hot_inflight_max_over_mean_orca": hot["orca"]["inflight_max_over_mean_rounds"]["max"],
    }
    met = lambda v, ok: None if v is None else ok(v)  # noqa: E731
    out["met"] = {
        "hit_rate_ge_0.9_ceiling": met(out["hit_rate_prefix_vs_ceiling"], lambda v: v >= TARGETS["hit_rate_vs_ceiling_min"]),
        "later_ttft_p90_le_0.5_orca": met(out["later_ttft_p90_prefix_vs_orca"], lambda v: v <= TARGETS["later_ttft_p90_prefix_vs_orca_max"]),
        "hot_inflight_le_1.5_mean": met(out["hot_inflight_max_over_mean_prefix"], lambda v: v <= TARGETS["hot_inflight_max_over_mean_max"]),
    }
    return out


# -- the workload ---------------------------------------------------------------------------------

def system_prompt(nonce: str, tenant: int, chars: int) -> str:
    """A tenant's own system prompt, led by the window's nonce (so no other window shares a block)."""
    head = f"[{nonce}] You are the support assistant of tenant {tenant}, who sells item {tenant * 7} in colour {tenant}. "
    parts, j = [head], 0
    while sum(map(len, parts)) < chars:
        parts.append(f"Rule {tenant}.{j}: answer order {tenant * 100 + j} kindly, briefly and exactly. ")
        j += 1
    return "".join(parts)


def conversation_tenants(n: int, variant: str, hot_share: float) -> list[int]:
    """The tenant of each of the window's `n` conversations: one each (`spread`), or tenant 0 for
    `hot_share` of them and one each for the rest (`hot`)."""
    if variant == "spread":
        return list(range(n))
    hot = min(n, max(1, round(n * hot_share)))
    return [0] * hot + list(range(1, n - hot + 1))


async def one_turn(client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    out = {"t_send": t0, "ttft": None, "tokens": 0, "text": "", "served_by": None, "status": 0, "prompt_tokens": None}
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            out["status"], out["served_by"] = r.status_code, r.headers.get("x-infermesh-served-by")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    # The first token: the first content, or the finish of an answer with none
                    # (the e2e models are random weights: an answer can be an immediate EOS).
                    if out["ttft"] is None and (piece or ch.get("finish_reason")):
                        out["ttft"] = time.monotonic() - t0
                    if piece:
                        out["tokens"] += 1
                        out["text"] += piece
                if chunk.get("usage"):
                    out["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
                    out["tokens"] = chunk["usage"].get("completion_tokens") or out["tokens"]
    except (httpx.HTTPError, json.JSONDecodeError):
        pass
    if out["status"] != 200:
        out["ttft"] = None
    return out


async def conversation(client, base: str, conv: int, tenant: int, nonce: str, opt: Options) -> list[dict]:
    await asyncio.sleep(conv * opt.stagger_s)
    messages = [{"role": "system", "content": system_prompt(nonce, tenant, opt.system_chars)}]
    turns, first = [], None
    for k in range(opt.turns):
        await asyncio.sleep(opt.gap_s)
        messages.append({"role": "user", "content": f"Customer {conv}, question {k + 1}: where is my order {conv * 31 + k}?"})
        t = await one_turn(client, base, messages, opt.max_tokens)
        first = first if k else t["served_by"]
        turns.append({"conv": conv, "tenant": tenant, "turn": k, "first_served_by": first,
                      **{key: t[key] for key in ("t_send", "ttft", "tokens", "served_by", "status", "prompt_tokens")}})
        messages.append({"role": "assistant", "content": t["text"] or "."})
    return turns


async def read_cache(client: httpx.AsyncClient, sidecars: list[str]) -> dict[str, float]:
    texts = [(await client.get(u + "/metrics")).text for u in sidecars]
    return {"queries": sum(counter_sum(t, "vllm:prefix_cache_queries") for t in texts),
            "hits": sum(counter_sum(t, "vllm:prefix_cache_hits") for t in texts)}


async def sample_inflight(client: httpx.AsyncClient, admins: dict[str, str], out: dict[str, list], every: float, stop: asyncio.Event):
    while not stop.is_set():
        for name, url in admins.items():
            try:
                out[name].append((time.monotonic(), int((await client.get(url + "/admin/state")).json()["in_flight"])))
            except (httpx.HTTPError, ValueError, KeyError):
                pass
        await asyncio.sleep(every)


def filter_counters(text: str) -> dict[str, int]:
    """The filter's prefix counters (`infermesh.prefix_*_total`) in Envoy's /stats text, summed
    over whatever prefix Envoy gives them."""
    out = {k: 0 for k in PREFIX_COUNTERS}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        for k in PREFIX_COUNTERS:
            if name.endswith(f"infermesh.prefix_{k}_total") and value.strip().isdigit():
                out[k] += int(value)
    return out


async def read_filter(client: httpx.AsyncClient, envoy_admin: str | None) -> dict[str, int] | None:
    return filter_counters((await client.get(envoy_admin + "/stats?filter=prefix_")).text) if envoy_admin else None


async def window(base: str, sidecars: dict[str, str], admins: dict[str, str], variant: str, label: str, opt: Options,
                 envoy_admin: str | None = None) -> dict:
    """One set-up's window: `sidecars`/`admins`: served-by name -> URL of each replica it uses;
    `envoy_admin`: the mesh Envoy's admin, whose filter counters are read over the window."""
    nonce = f"{label}-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        for url in sidecars.values():  # wake each replica (vLLM on CPU answers late after idling)
            await one_turn(client, url, [{"role": "user", "content": f"wake {nonce}"}], 1)
        await asyncio.sleep(1.0)  # vLLM publishes its counters a moment after each step
        before = await read_cache(client, list(sidecars.values()))
        f_before = await read_filter(client, envoy_admin)
        samples: dict[str, list] = {n: [] for n in admins}
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_inflight(client, admins, samples, opt.sample_s, stop))
        tenants = conversation_tenants(opt.tenants, variant, opt.hot_share)
        t0 = time.monotonic()
        convs = await asyncio.gather(*(conversation(client, base, i, t, nonce, opt) for i, t in enumerate(tenants)))
        elapsed = time.monotonic() - t0
        stop.set()
        await sampler
        await asyncio.sleep(1.5)
        after = await read_cache(client, list(sidecars.values()))
        f_after = await read_filter(client, envoy_admin)
    turns = [t for c in convs for t in c]
    for t in turns:
        idle = idle_before(samples.get(str(t["served_by"]), []), t["t_send"])
        t["after_idle"] = idle is not None and idle >= opt.idle_s
        t["t_send"] = round(t["t_send"] - t0, 3)
    return {"label": label, "elapsed_s": round(elapsed, 2), "turns": turns, "cache": hit_rate(before, after),
            "tokens_per_s": round(sum(t["tokens"] for t in turns if t["ttft"] is not None) / elapsed, 2),
            "balance": inflight_balance(samples),
            "filter": {k: f_after[k] - f_before[k] for k in PREFIX_COUNTERS} if f_before and f_after else None}


async def run(urls: dict[str, str], replicas: dict[str, tuple[str, str]], opt: Options, say, mesh_admin: str | None = None) -> dict:
    """`replicas`: served-by name ('interactive/0') -> (sidecar URL, admin URL), replica 0 first."""
    names = list(replicas)
    use = {s: names[:1] if s == "one-replica" else names for s in SETUPS}
    windows: dict[str, dict[str, list[dict]]] = {v: {s: [] for s in SETUPS} for v in VARIANTS}
    for variant in VARIANTS:
        for rnd in range(opt.rounds):
            k = rnd % len(SETUPS)
            for setup in SETUPS[k:] + SETUPS[:k]:
                w = await window(urls[setup], {n: replicas[n][0] for n in use[setup]}, {n: replicas[n][1] for n in use[setup]},
                                 variant, f"{variant}-r{rnd + 1}-{setup}", opt, mesh_admin if setup == "prefix" else None)
                later = [t["ttft"] for t in w["turns"] if t["turn"] > 0 and t["ttft"] is not None]
                say(f"{variant} round {rnd + 1}/{opt.rounds} {setup}: hit rate {w['cache']['rate']}, "
                    f"later-turn p90 {1000 * (pct(later, 0.9) or 0):.0f} ms (n={len(later)}), {w['tokens_per_s']} tok/s, "
                    f"in-flight max/mean {w['balance']['max_over_mean']}, filter {w['filter'] or '-'}, ok {sum(t['ttft'] is not None for t in w['turns'])}/{len(w['turns'])}")
                windows[variant][setup].append(w)
    report: dict = {"options": asdict(opt)}
    for variant in VARIANTS:
        report[variant] = {s: summarize(windows[variant][s], opt) for s in SETUPS}
    report["targets"] = targets(report)
    report["windows"] = {v: {s: [{k: w[k] for k in ("label", "elapsed_s", "cache", "tokens_per_s", "balance", "filter", "turns")} for w in ws]
                             for s, ws in windows[v].items()} for v in VARIANTS}
    return report


# -- the set-ups ----------------------------------------------------------------------------------

def policies(run_dir: Path) -> tuple[Path, Path]:
    """(keyed policy for the mesh, the same without the key for the orca Envoy)."""
    src = POLICY.read_text()
    if DEADLINE_LINE not in src:
        raise RuntimeError(f"{POLICY.name}'s interactive class changed: update bench_prefix.DEADLINE_LINE")
    keyed, unkeyed = run_dir / "policy-prefix.yaml", run_dir / "policy-orca.yaml"
    keyed.write_text(src.replace(DEADLINE_LINE, KEYED_LINE))
    unkeyed.write_text(src.replace(DEADLINE_LINE, UNKEYED_LINE))
    return keyed, unkeyed


def http_filter_names(config: object) -> set[str]:
    """The names of every HTTP filter in a bootstrap or an Envoy /config_dump (its `http_filters`
    lists only: the dump's node also lists every extension compiled in)."""
    found: set[str] = set()
    if isinstance(config, dict):
        for k, v in config.items():
            if k == "http_filters" and isinstance(v, list):
                found |= {f.get("name", "") for f in v if isinstance(f, dict)}
            else:
                found |= http_filter_names(v)
    elif isinstance(config, list):
        for v in config:
            found |= http_filter_names(v)
    return found


def session_filter_in(config: object) -> bool:
    return "envoy.filters.http.stateful_session" in http_filter_names(config)


def run_cli(args: argparse.Namespace) -> int:
    from infermesh import paths
    from infermesh.bench import plain_envoy_bootstrap
    from infermesh.launcher import LaunchError, LocalMesh, _http_ok, free_ports, plan_on_free_ports, wait_until
    from infermesh.meshconfig.envoy_bootstrap import bootstrap
    from infermesh.meshconfig.local_mesh import LocalMeshPlan

    def say(s: str) -> None:
        print(f"[bench-prefix] {s}", file=sys.stderr, flush=True)

    if getattr(args, "policy", None) or getattr(args, "plot", None):
        say("--policy and --plot are not for the prefix scenario (its policy is e2e/policy-replicas-e2e.yaml, keyed)")
        return 2
    opt = Options.quick() if args.quick else Options()
    if getattr(args, "rounds", None):
        opt.rounds = args.rounds
    run_dir = Path(tempfile.mkdtemp(prefix="infermesh-bench-prefix-"))
    keyed, unkeyed = policies(run_dir)
    mesh = LocalMesh(plan_on_free_ports(keyed), run_dir, cpu_cores=CPU_CORES)
    try:
        mesh.start(timeout=600, progress=say)
        reps = mesh.plan.replicas("interactive")
        ports = free_ports(6)
        orca_plan = LocalMeshPlan(policy_path=unkeyed, listen_port=ports[0], admin_port=ports[1], pools=mesh.plan.pools)
        boots = {"orca": bootstrap(orca_plan.listener(paths.filter_wasm())),
                 "round-robin": plain_envoy_bootstrap(ports[2], ports[3], [(mesh.plan.host, r.http_port) for r in reps]),
                 "one-replica": plain_envoy_bootstrap(ports[4], ports[5], [(mesh.plan.host, reps[0].http_port)])}
        if session_filter_in(boots["orca"]):
            raise RuntimeError("the orca Envoy's resources carry the stateful session filter")
        for i, (name, boot) in enumerate(boots.items()):
            path = run_dir / f"envoy-{name}.json"
            path.write_text(json.dumps(boot))
            mesh._spawn(f"envoy-{name}", [str(paths.envoy_binary()), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1",
                                          "--log-level", "warn"])
            wait_until(lambda: _http_ok(f"http://127.0.0.1:{ports[2 * i + 1]}/ready"), 60, what=f"envoy-{name}")
        with httpx.Client(timeout=10, trust_env=False) as c:
            mesh_has = session_filter_in(c.get(f"http://127.0.0.1:{mesh.plan.admin_port}/config_dump").json())
            orca_has = session_filter_in(c.get(f"http://127.0.0.1:{ports[1]}/config_dump").json())
        if not mesh_has or orca_has:
            raise RuntimeError(f"stateful session filter: mesh Envoy {mesh_has} (want True), orca Envoy {orca_has} (want False)")
        say("session filter: in the mesh's Envoy, not in the orca Envoy (config_dump)")
        time.sleep(3)  # the static Envoys' first health checks
        urls = {"prefix": mesh.base_url, "orca": f"http://127.0.0.1:{ports[0]}", "round-robin": f"http://127.0.0.1:{ports[2]}",
                "one-replica": f"http://127.0.0.1:{ports[4]}"}
        replicas = {f"interactive/{r.replica}": (mesh.sidecar_url("interactive", r.replica), mesh.admin_url("interactive", r.replica))
                    for r in reps}
        report = asyncio.run(run(urls, replicas, opt, say, f"http://127.0.0.1:{mesh.plan.admin_port}"))
    except (LaunchError, RuntimeError) as e:
        say(f"stopped: {e} (logs in {run_dir})")
        return 1
    finally:
        mesh.stop()
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if getattr(args, "json", None):
        Path(args.json).write_text(text)
        say(f"JSON in {args.json}")
    say(f"logs and generated configs in {run_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_prefix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 rounds, 4 tenants, 3 turns")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--json", metavar="FILE")
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
