"""What a drill measured, and what it means: request outcomes, the pools' timelines, the checks.

Pure functions over the records a drill collects (`Request`, `Sample`, `Marks`), so the verdict
logic is unit-tested on hand-made records without a mesh. `infermesh/drill.py` collects the
records on the real mesh.

Outcomes of a request (each is counted per traffic kind):

| outcome | meaning |
|---|---|
| `ok` | served completely by its own pool's primary model |
| `degraded` | served completely, but by a fallback model (`x-infermesh-degraded: true`) or by another pool (spilled) |
| `shed` | refused the documented way: 429/503 with `Retry-After` and an OpenAI error body |
| `rejected` | bad input answered with its documented status (400, 404, 405, 413) |
| `abandoned` | the drill's client hung up on purpose (a vanishing client) |
| `interrupted` | a stream cut mid-response because the sidecar serving it was killed (sidecar-kill only, requests in flight at the kill) |
| `failed` | any other answer: an unexpected status, a broken stream, a body that is not what it should be |
| `lost` | no response at all: connection error or timeout before any status |
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from infermesh.meshconfig.envoy_resources import health_checks

OUTCOMES = ("ok", "degraded", "shed", "rejected", "abandoned", "interrupted", "failed", "lost")
SUCCESS = ("ok", "degraded")
TRAFFIC = ("interactive", "batch")
LEVEL_DOWN = 4
LEVEL_NAMES = {0: "normal", 1: "shedding", 2: "fallback model", 3: "critical only", LEVEL_DOWN: "down"}

REACTION_LIMIT_S = 1.0
"""Degradation must show within this long of the threshold being sustained (the issue's bar)."""


def _route_recovery_s() -> float:
    # The state health check puts a recovered replica back after `healthy_threshold` passes in a
    # row (hysteresis by design); the same reaction limit as degrading applies after that.
    hc = health_checks(False, below_level=1)[0]
    return hc["healthy_threshold"] * float(hc["interval"].rstrip("s")) + REACTION_LIMIT_S


ROUTE_RECOVERY_S = _route_recovery_s()
"""Normal service is required from this long after the fault pool is back to normal (2 s)."""
MIN_INTERACTIVE_SUCCESS = 0.99


@dataclass
class Request:
    """One request of the drill's load, as its client saw it."""

    kind: str
    """`interactive` (streaming chat), `batch` (completion) or `bad:NAME` (bad input)."""
    sent: float
    """Seconds since the drill started."""
    done: float | None = None
    status: int | None = None
    stage: str = "connect"
    """How far it got: `connect`, `headers` (a status arrived), `body` (complete or cut)."""
    complete: bool = False
    """The whole response arrived (a stream's `data: [DONE]`, a parsed JSON body)."""
    error: str | None = None
    ttft: float | None = None
    """Time to the first content token (streams)."""
    served_by: str | None = None
    model: str | None = None
    degraded_header: bool = False
    retry_after: bool = False
    error_code: str | None = None
    shed_by: str | None = None
    expect: tuple[int, ...] = ()
    """Bad input: the documented statuses."""
    abandoned: bool = False
    outcome: str = ""
    trace_id: str | None = None
    """The trace id of the traceparent it carried (DrillOptions.trace_requests)."""

    @property
    def pool(self) -> str | None:
        return self.served_by.split("/", 1)[0] if self.served_by else None


@dataclass
class Sample:
    """One reading of a pool sidecar's admin state (or the fact that it did not answer)."""

    t: float
    pool: str
    up: bool
    level: int = LEVEL_DOWN
    ready: bool = False
    serving_model: str | None = None
    primary_model: str | None = None
    breakers: dict[str, dict] = field(default_factory=dict)
    unfinished: int = 0
    faults: dict = field(default_factory=dict)

    @property
    def effective_level(self) -> int:
        return self.level if self.up and self.ready else LEVEL_DOWN

    @property
    def normal(self) -> bool:
        return (self.up and self.ready and self.level == 0 and self.serving_model == self.primary_model
                and all(b["state"] == "closed" for b in self.breakers.values()) and not self.faults)


@dataclass
class Marks:
    """When things happened, in drill seconds."""

    inject: float
    clear: float
    end: float
    kill: float | None = None
    """sidecar-kill: the SIGKILL."""
    baseline: float = 0.0
    """When the baseline load began: the pools were normal then (start-up states before it are not the baseline's)."""
    extra: dict = field(default_factory=dict)


@dataclass
class Expectation:
    """What a scenario must show."""

    degrade: bool
    """True: the fault pool's traffic must be degraded or shed within 1 s of `due`."""
    fault_pool: str | None = None
    breaker_signal: str | None = None
    """The breaker whose sustained threshold makes the degradation due (None: due at the kill)."""
    sustain_s: float = 0.0
    allow_interrupted: bool = False


def classify(r: Request, home: dict[str, str], kill_at: float | None) -> str:
    if r.abandoned:
        return "abandoned"
    if r.status is None:
        return "lost"
    if r.expect:
        return "rejected" if r.status in r.expect else "failed"
    if r.status == 200:
        if not r.complete:
            if kill_at is not None and r.sent <= kill_at <= (r.done or math.inf):
                return "interrupted"
            return "failed"
        spilled = home.get(r.kind) is not None and r.pool is not None and r.pool != home[r.kind]
        return "degraded" if r.degraded_header or spilled else "ok"
    if r.status in (429, 503) and r.retry_after and r.error_code:
        return "shed"
    return "failed"


def home_pools(requests: list[Request], before: float) -> dict[str, str]:
    """Each traffic kind's own pool: the one that served most of it before the fault."""
    counts: dict[str, dict[str, int]] = {}
    for r in requests:
        if r.sent < before and r.kind in TRAFFIC and r.status == 200 and r.pool:
            counts.setdefault(r.kind, {}).setdefault(r.pool, 0)
            counts[r.kind][r.pool] += 1
    return {k: max(c, key=c.get) for k, c in counts.items()}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def due_time(samples: list[Sample], exp: Expectation, marks: Marks) -> float | None:
    """When the degradation became due: the fault pool's breaker on `breaker_signal` had held its
    reading above trip_above for sustain_s (from the breaker's own `above_s`), or the kill."""
    if exp.breaker_signal is None:
        return marks.kill if marks.kill is not None else marks.inject
    last_above: float | None = None
    for s in samples:
        if s.pool != exp.fault_pool or s.t < marks.inject or not s.up:
            continue
        bs = [b for b in s.breakers.values() if b.get("signal") == exp.breaker_signal]
        for b in bs:
            if b.get("above_s") is not None:
                last_above = s.t - b["above_s"]
        if any(b["state"] != "closed" for b in bs):
            return None if last_above is None else last_above + exp.sustain_s
    return None if last_above is None else last_above + exp.sustain_s


def level_changes(samples: list[Sample], pool: str) -> list[tuple[float, int]]:
    out: list[tuple[float, int]] = []
    for s in samples:
        if s.pool == pool and (not out or out[-1][1] != s.effective_level):
            out.append((round(s.t, 2), s.effective_level))
    return out


def recovered_at(samples: list[Sample], after: float, pools: list[str]) -> float | None:
    """The first time after `after` at which every pool was back to normal."""
    latest: dict[str, Sample] = {}
    for s in samples:
        latest[s.pool] = s
        if s.t >= after and all(p in latest and latest[p].normal and latest[p].t >= after - 0.5 for p in pools):
            return s.t
    return None


def _counts(rs: list[Request]) -> dict:
    c = {o: 0 for o in OUTCOMES}
    for r in rs:
        c[r.outcome] += 1
    c["sent"] = len(rs)
    shed = {}
    for r in rs:
        if r.outcome == "shed":
            key = f"{r.status} {r.error_code}"
            shed[key] = shed.get(key, 0) + 1
    c["shed_by_status"] = shed
    return c


def _ttft(rs: list[Request], lo: float, hi: float) -> dict:
    v = [r.ttft for r in rs if r.kind == "interactive" and r.ttft is not None and lo <= r.sent < hi and r.outcome in SUCCESS]
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    return {"n": len(v), "p50_ms": ms(percentile(v, 50)), "p99_ms": ms(percentile(v, 99))}


def build_report(scenario: str, summary: str, exp: Expectation, requests: list[Request], samples: list[Sample],
                 marks: Marks, pools: list[str], extra_checks: list[tuple[str, bool, str]] | None = None) -> dict:
    """Classify every request, derive the times, run the checks; a JSON-ready dict."""
    home = home_pools(requests, marks.inject)
    kill_at = marks.kill if exp.allow_interrupted else None
    for r in requests:
        r.outcome = classify(r, home, kill_at)
    traffic = [r for r in requests if r.kind in TRAFFIC]
    by_kind = {k: _counts([r for r in requests if r.kind == k]) for k in TRAFFIC}
    bad = [r for r in requests if r.kind.startswith("bad:")]
    if bad:
        by_kind["bad"] = _counts(bad)
        by_kind["bad"]["by_case"] = {}
        for r in bad:
            case = by_kind["bad"]["by_case"].setdefault(r.kind[4:], {"sent": 0, "as_documented": 0, "statuses": {}})
            case["sent"] += 1
            case["as_documented"] += r.outcome in ("rejected", "abandoned")
            case["statuses"][str(r.status)] = case["statuses"].get(str(r.status), 0) + 1

    due = due_time(samples, exp, marks) if exp.degrade else None
    affected = [r for r in traffic if exp.fault_pool is not None and home.get(r.kind) == exp.fault_pool]
    first_degraded = min((r.sent for r in affected if r.outcome in ("degraded", "shed") and r.sent >= marks.inject), default=None)
    # The pool's own state changes at once for every new request; the clients see it at their
    # next request (1 s apart at the default rate), so the earlier of the two is the reaction.
    first_level = min((s.t for s in samples if s.pool == exp.fault_pool and s.t >= marks.inject and s.effective_level > 0), default=None)
    evidence = [t for t in (first_level, first_degraded) if t is not None]
    degraded_at = min(evidence) if evidence else None
    rec = recovered_at(samples, marks.clear, pools)
    changes = {p: level_changes(samples, p) for p in pools}

    checks: list[tuple[str, bool, str]] = []
    # Without a normal baseline there is nothing to compare with: the load itself was too much.
    # (Requests still in flight when the fault began are judged with the fault: a stream the
    # sidecar-kill cuts was sent in the baseline.)
    base_bad = [r for r in traffic if r.done is not None and r.done < marks.inject and r.outcome != "ok"]
    base_levels = {s.pool for s in samples if marks.baseline <= s.t < marks.inject and s.effective_level > 0}
    checks.append(("normal service before the fault", not base_bad and not base_levels,
                   f"{len(base_bad)} requests not served normally, pools degraded: {sorted(base_levels) or 'none'}"))
    lost = sum(1 for r in requests if r.outcome == "lost")
    checks.append(("zero lost requests", lost == 0, f"{lost} lost"))
    failed = [r for r in requests if r.outcome == "failed"]
    checks.append(("zero unexpected failures", not failed,
                   f"{len(failed)} failed" + (": " + "; ".join(f"{r.kind} {r.status} {r.error or r.error_code}" for r in failed[:3]) if failed else "")))
    # A SIGKILL cuts the streams in flight at that instant by definition; the next check holds
    # them to exactly those, so the success rate is judged on the rest (with 1 chat/s, one cut
    # stream alone is >1 % of a ~80-request drill).
    inter = [r for r in traffic if r.kind == "interactive"
             and not (exp.allow_interrupted and r.outcome == "interrupted" and r.sent <= (marks.kill or 0))]
    ok = sum(1 for r in inter if r.outcome in SUCCESS)
    rate = ok / len(inter) if inter else 0.0
    checks.append((f"interactive success >= {MIN_INTERACTIVE_SUCCESS:.0%}", bool(inter) and rate >= MIN_INTERACTIVE_SUCCESS,
                   f"{rate:.2%} of {len(inter)}"))
    interrupted = [r for r in requests if r.outcome == "interrupted"]
    if exp.allow_interrupted:
        checks.append(("only streams in flight at the kill were cut", all(r.sent <= (marks.kill or 0) for r in interrupted),
                       f"{len(interrupted)} interrupted"))

    times: dict = {"inject": round(marks.inject, 3), "clear": round(marks.clear, 3), "end": round(marks.end, 3)}
    if exp.degrade:
        times["due"] = None if due is None else round(due, 3)
        times["time_to_degrade_s"] = None if degraded_at is None else round(degraded_at - marks.inject, 3)
        reaction = None if (due is None or degraded_at is None) else degraded_at - due
        times["reaction_s"] = None if reaction is None else round(reaction, 3)
        times["first_degraded_response_s"] = None if (due is None or first_degraded is None) else round(first_degraded - due, 3)
        late = [r for r in affected if due is not None and due + REACTION_LIMIT_S <= r.sent < marks.clear and r.outcome == "ok"]
        checks.append((f"degraded within {REACTION_LIMIT_S:g} s of the sustained threshold",
                       reaction is not None and reaction <= REACTION_LIMIT_S and first_degraded is not None and not late,
                       f"pool reacted {times['reaction_s']} s after it, first degraded response {times['first_degraded_response_s']} s; "
                       f"{len(late)} requests served normally later than {REACTION_LIMIT_S:g} s after it"))
    else:
        degraded = sum(1 for r in traffic if r.outcome in ("degraded", "shed"))
        checks.append(("no degradation (nothing to degrade for)", degraded == 0, f"{degraded} degraded or shed"))
    times["time_to_recover_s"] = None if rec is None else round(rec - marks.clear, 3)
    checks.append(("recovered after the fault ended", rec is not None, f"{times['time_to_recover_s']} s"))
    if rec is not None and exp.fault_pool is not None:
        after = [r for r in affected if r.sent >= rec + ROUTE_RECOVERY_S]
        normal_after = sum(1 for r in after if r.outcome == "ok")
        checks.append(("served normally after recovery", bool(after) and normal_after == len(after), f"{normal_after}/{len(after)}"))
    flaps = []
    # The fault pool (every pool when the fault has none): a neighbour reacting to real side
    # effects of the fault (a restarting sidecar loads the shared CPUs) shows in the report but
    # is not the fault pool flapping.
    watched = [exp.fault_pool] if exp.fault_pool else pools
    for p, ch in changes.items():
        if p not in watched:
            continue
        # After the fault: once back to normal (level 0), a pool must stay there.
        back = next((t for t, lvl in ch if t >= marks.clear and lvl == 0), None)
        again = next((t for t, lvl in ch if back is not None and t > back and lvl > 0), None)
        if again is not None:
            flaps.append(f"{p} degraded again at {again:.1f}s after recovering at {back:.1f}s")
        if exp.degrade and p == exp.fault_pool and due is not None:
            during = [lvl for t, lvl in ch if due + REACTION_LIMIT_S <= t < marks.clear]
            if 0 in during:
                flaps.append(f"{p} recovered while the fault was still on")
    checks.append(("no flapping", not flaps, "; ".join(flaps) or "one degradation, one recovery"))
    checks += extra_checks or []

    served_by = served_by_phases(traffic, marks)
    ttft = {"before": _ttft(traffic, 0, marks.inject), "during": _ttft(traffic, marks.inject, marks.clear),
            "after": _ttft(traffic, rec if rec is not None else marks.clear, math.inf)}
    return {
        "scenario": scenario,
        "summary": summary,
        "passed": all(ok for _, ok, _ in checks),
        "requests": by_kind,
        "home_pools": home,
        "times": times,
        "interactive_ttft": ttft,
        "served_by": served_by,
        "level_changes": {p: ch for p, ch in changes.items()},
        "checks": [{"name": n, "passed": ok, "detail": d} for n, ok, d in checks],
        "marks": asdict(marks),
        "timeline": {
            "requests": [{"kind": r.kind, "sent": round(r.sent, 3), "done": None if r.done is None else round(r.done, 3),
                          "outcome": r.outcome, "status": r.status, "ttft": r.ttft, "model": r.model, "served_by": r.served_by}
                         for r in requests],
            "pools": {p: [(round(s.t, 2), s.effective_level, s.serving_model) for s in samples if s.pool == p] for p in pools},
            "breakers": _breaker_series(samples),
        },
    }


PHASES = ("before", "during", "after")


def served_by_phases(requests: list[Request], marks: Marks) -> dict[str, dict[str, dict[str, int]]]:
    """KIND -> POOL/REPLICA (the `x-infermesh-served-by` the sidecar sent) -> requests answered
    by it, by when they were sent: before, during or after the fault."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in requests:
        if r.served_by is None:
            continue
        phase = "before" if r.sent < marks.inject else "during" if r.sent < marks.clear else "after"
        per = out.setdefault(r.kind, {}).setdefault(r.served_by, {ph: 0 for ph in PHASES})
        per[phase] += 1
    return {k: dict(sorted(v.items())) for k, v in out.items()}


@dataclass
class ReplicaSample:
    """One reading of one replica's admin state (slow-replica samples every replica of its pool)."""

    t: float
    replica: str
    """POOL/N, as in `x-infermesh-served-by`."""
    unfinished: int
    """vLLM's own count of requests it holds (its front end drops an aborted one at once, even
    while the engine process is stopped)."""
    in_flight: int


ABORT_GRACE_S = 0.5
"""After the winning attempt's first token: time for Envoy's reset of the losing attempt to reach
its sidecar and for the sidecar's abort to reach vLLM (and for the sampler's lag)."""


def slow_replica_checks(requests: list[Request], replica_samples: list[ReplicaSample], marks: Marks, stalled: str,
                        deadline_s: float, margin_s: float, min_share: float, probes: list[Request] = ()) -> list[tuple[str, bool, str]]:
    """The slow-replica drill's own verdicts. `stalled` (POOL/N) was stalled from `marks.inject`
    to `marks.clear`; interactive requests carry a TTFT deadline of `deadline_s`; `probes`: the
    chats sent one at a time once the load was over."""
    during = [r for r in requests if r.kind == "interactive" and marks.inject <= r.sent < marks.clear]
    ttfts = [r.ttft for r in during if r.ttft is not None]
    late = [r for r in during if r.ttft is None or r.ttft > deadline_s + margin_s]
    limit_ms = round((deadline_s + margin_s) * 1000)
    checks = [(f"interactive first token within the deadline + margin ({limit_ms} ms) during the stall",
               bool(during) and not late,
               f"{len(during) - len(late)}/{len(during)}; max TTFT {round(max(ttfts) * 1000) if ttfts else None} ms"
               + (f"; late or no token: {[(round(r.sent, 1), r.status, r.ttft and round(r.ttft * 1000)) for r in late[:4]]}" if late else ""))]
    by = {}
    for r in during:
        by[r.served_by] = by.get(r.served_by, 0) + 1
    pool = stalled.split("/", 1)[0]
    others = sum(n for who, n in by.items() if who is not None and who != stalled and who.split("/", 1)[0] == pool)
    share = others / len(during) if during else 0.0
    checks.append((f"the pool's other replicas served >= {min_share:.0%} of them", bool(during) and share >= min_share,
                   f"{share:.0%}: {dict(sorted((str(k), v) for k, v in by.items()))}"))
    # vLLM on the stalled replica may hold a request only while that request still waits for its
    # first token (or streams from the stalled replica itself): everything Envoy gave up on is aborted.
    def held_legitimately(t: float) -> int:
        n = 0
        for r in requests:
            if r.kind != "interactive" or r.sent > t:
                continue
            if r.served_by == stalled or r.ttft is None:
                end = r.done if r.done is not None else math.inf
            else:
                end = r.sent + r.ttft + ABORT_GRACE_S
            n += t <= end
        return n
    stall_samples = [s for s in replica_samples if s.replica == stalled and marks.inject <= s.t < marks.clear]
    excess = [(round(s.t, 1), s.unfinished, held_legitimately(s.t)) for s in stall_samples if s.unfinished > held_legitimately(s.t)]
    peak = max((s.unfinished for s in stall_samples), default=None)
    checks.append(("the stalled replica's vLLM held no attempt Envoy had given up on",
                   bool(stall_samples) and not excess,
                   f"{len(stall_samples)} samples, at most {peak} held" + (f"; held more than were waiting (t, held, waiting): {excess[:4]}" if excess else "")))
    after = [r for r in requests if r.kind == "interactive" and r.sent >= marks.clear] + list(probes)
    back = sum(1 for r in after if r.served_by == stalled)
    checks.append(("the stalled replica serves again after the stall", back > 0, f"{back} of {len(after)} requests sent after it"))
    return checks


BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


def _breaker_series(samples: list[Sample]) -> dict[str, list[tuple[float, int]]]:
    """POOL/BREAKER -> (t, 0 closed | 1 half-open | 2 open) changes, for breakers that left closed."""
    series: dict[str, list[tuple[float, int]]] = {}
    for s in samples:
        for name, b in s.breakers.items():
            key = f"{s.pool}/{name}"
            code = BREAKER_STATES.get(b.get("state"), 0)
            pts = series.setdefault(key, [])
            if not pts or pts[-1][1] != code:
                pts.append((round(s.t, 2), code))
    return {k: v for k, v in series.items() if any(code for _, code in v)}


def format_report(rep: dict) -> str:
    """The human-readable report."""
    lines = [f"drill {rep['scenario']}: {rep['summary']}", ""]
    cols = ("sent",) + OUTCOMES
    lines.append(f"  {'requests':<12}" + "".join(f"{c:>12}" for c in cols))
    for kind, c in rep["requests"].items():
        lines.append(f"  {kind:<12}" + "".join(f"{c[col]:>12}" for col in cols))
        if c["shed_by_status"]:
            lines.append(f"  {'':<12}  shed: " + ", ".join(f"{k} ×{v}" for k, v in c["shed_by_status"].items()))
        for case, v in c.get("by_case", {}).items():
            lines.append(f"  {'':<12}  {case}: {v['as_documented']}/{v['sent']} as documented (statuses {v['statuses']})")
    t = rep["times"]
    lines.append("")
    lines.append(f"  fault: {t['inject']:.1f}s → {t['clear']:.1f}s of the drill (ended at {t['end']:.1f}s)")
    if "due" in t:
        lines.append(f"  time to degrade: {t['time_to_degrade_s']} s after the fault began; {t['reaction_s']} s after the "
                     f"threshold was sustained (due at {t['due']} s); first degraded response {t['first_degraded_response_s']} s after it")
    lines.append(f"  time to recover: {t['time_to_recover_s']} s after the fault ended")
    for p, ch in rep["level_changes"].items():
        lines.append(f"  pool {p}: " + " → ".join(f"{LEVEL_NAMES.get(lvl, lvl)}@{tt:.1f}s" for tt, lvl in ch))
    tt = rep["interactive_ttft"]
    lines.append("  interactive TTFT p50/p99 (ms): " + " · ".join(
        f"{ph} {v['p50_ms']}/{v['p99_ms']} (n={v['n']})" for ph, v in tt.items()))
    for kind, per in rep.get("served_by", {}).items():
        lines.append(f"  {kind} served by (before / during / after the fault): " + " · ".join(
            f"{who} {v['before']}/{v['during']}/{v['after']}" for who, v in per.items()))
    for who, v in rep.get("replica_load", {}).items():
        lines.append(f"  replica {who}, its sidecar's own count of requests finished during the drill by status: "
                     + (", ".join(f"{st} ×{n}" for st, n in v["finished"].items()) or "none")
                     + f"; vLLM held at most {v['max_unfinished']} at once")
    if rep.get("queries"):
        w = rep["window"]
        lines.append("")
        lines.append(f"  the chart's dashboards over the drill ({w['start']} to {w['end']}):")
        for q in rep["queries"]:
            lines.append(f"    {q['panel']}: " + (q["link"] or " ; ".join(q["exprs"])))
    lines.append("")
    for c in rep["checks"]:
        lines.append(f"  [{'pass' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}")
    lines.append("")
    lines.append("PASSED" if rep["passed"] else "FAILED")
    return "\n".join(lines)


OUTCOME_COLORS = {"ok": "#2e7d32", "degraded": "#f9a825", "shed": "#ef6c00", "rejected": "#90a4ae", "abandoned": "#cfd8dc",
                  "interrupted": "#8e24aa", "failed": "#c62828", "lost": "#000000"}


def plot_report(rep: dict, path: str, bucket_s: float = 1.0) -> None:
    """A timeline picture: requests by outcome per second, each pool's level and serving model,
    interactive TTFT by model; the fault window shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = rep["timeline"]["requests"]
    t = rep["times"]
    end = t["end"]
    n = int(math.ceil(end / bucket_s)) + 1
    fig, axes = plt.subplots(5, 1, figsize=(11, 12), sharex=True, gridspec_kw={"height_ratios": [2, 2, 1.4, 1.2, 2]})
    for ax, kind in zip(axes[:2], TRAFFIC):
        bottom = [0] * n
        for outcome in OUTCOMES:
            counts = [0] * n
            for r in reqs:
                if r["kind"] == kind and r["outcome"] == outcome:
                    counts[min(n - 1, int(r["sent"] // bucket_s))] += 1
            if any(counts):
                ax.bar([i * bucket_s for i in range(n)], counts, width=bucket_s, bottom=bottom, align="edge",
                       color=OUTCOME_COLORS[outcome], label=outcome)
                bottom = [a + b for a, b in zip(bottom, counts)]
        ax.set_ylabel(f"{kind}\nrequests/{bucket_s:g}s")
        ax.legend(loc="upper right", fontsize=7, ncol=4)
    ax = axes[2]
    for p, pts in rep["timeline"]["pools"].items():
        if pts:
            ax.step([x[0] for x in pts], [x[1] for x in pts], where="post", label=p)
            last = None
            for x, lvl, model in pts:
                if model != last and model is not None:
                    ax.annotate(model, (x, lvl), fontsize=6, xytext=(2, 4), textcoords="offset points")
                    last = model
    ax.set_yticks(list(LEVEL_NAMES))
    ax.set_yticklabels([LEVEL_NAMES[k] for k in LEVEL_NAMES], fontsize=7)
    ax.set_ylabel("pool level")
    ax.legend(loc="upper right", fontsize=7)
    ax = axes[3]
    for i, (key, pts) in enumerate(sorted(rep["timeline"]["breakers"].items())):
        ax.step([x[0] for x in pts] + [end], [x[1] + 0.06 * i for x in pts] + [pts[-1][1] + 0.06 * i], where="post", label=key)
    ax.set_yticks(list(BREAKER_STATES.values()))
    ax.set_yticklabels(list(BREAKER_STATES), fontsize=7)
    ax.set_ylabel("breakers")
    if rep["timeline"]["breakers"]:
        ax.legend(loc="upper right", fontsize=7, ncol=2)
    ax = axes[4]
    models = sorted({r["model"] or "?" for r in reqs if r["kind"] == "interactive" and r["ttft"] is not None})
    for m in models:
        pts = [(r["sent"], r["ttft"] * 1000) for r in reqs if r["kind"] == "interactive" and r["ttft"] is not None and (r["model"] or "?") == m]
        ax.scatter([x for x, _ in pts], [y for _, y in pts], s=6, label=f"interactive TTFT, {m}")
    lat = [(r["sent"], (r["done"] - r["sent"]) * 1000) for r in reqs if r["kind"] == "batch" and r["outcome"] in SUCCESS and r["done"] is not None]
    if lat:
        ax.scatter([x for x, _ in lat], [y for _, y in lat], s=6, marker="x", color="#757575", label="batch latency (whole completion)")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_xlabel("seconds since the drill started")
    if models or lat:
        ax.legend(loc="upper right", fontsize=7)
    for ax in axes:
        ax.axvspan(t["inject"], t["clear"], color="#e53935", alpha=0.08)
        if t.get("due") is not None:
            ax.axvline(t["due"], color="#e53935", lw=0.8, ls="--")
        if t.get("time_to_recover_s") is not None:
            ax.axvline(t["clear"] + t["time_to_recover_s"], color="#2e7d32", lw=0.8, ls="--")
    top = axes[0]
    top.annotate("fault", (t["inject"], 1.0), xycoords=("data", "axes fraction"), fontsize=7, color="#e53935", xytext=(2, -10), textcoords="offset points")
    if t.get("due") is not None:
        top.annotate("threshold sustained", (t["due"], 1.0), xycoords=("data", "axes fraction"), fontsize=7, color="#e53935",
                     xytext=(2, -20), textcoords="offset points")
    if t.get("time_to_recover_s") is not None:
        top.annotate("recovered", (t["clear"] + t["time_to_recover_s"], 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                     color="#2e7d32", xytext=(2, -10), textcoords="offset points")
    axes[0].set_title(f"infermesh drill {rep['scenario']} — {'passed' if rep['passed'] else 'FAILED'}\n{rep['summary']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
