"""The slow-replica drill's verdicts and its policy check, on hand-made records (no mesh).
The e2e drill (e2e/test_replicas_e2e.py) produces the same records from the real replicas mesh."""

from __future__ import annotations

from pathlib import Path

from infermesh.drill import SCENARIOS, fitting_scenarios
from infermesh.drill_report import Marks, ReplicaSample, Request, format_report, served_by_phases, slow_replica_checks
from infermesh.meshconfig.policy import load_policy

E2E = Path(__file__).resolve().parents[2] / "e2e"
MARKS = Marks(inject=5.0, clear=20.0, end=30.0)
STALLED = "interactive/0"


def chat(t: float, ttft: float, by: str) -> Request:
    return Request("interactive", t, t + ttft + 0.3, 200, "body", True, ttft=ttft, served_by=by)


def good_run():
    """One chat a second; during the stall each is hedged to replica 1 (first token at 0.7 s)."""
    reqs = [chat(float(t), 0.7 if 5 <= t < 20 else 0.1, "interactive/1" if 5 <= t < 20 or t % 2 else STALLED) for t in range(30)]
    # vLLM on the stalled replica holds each losing attempt until just after the hedge won.
    samples = []
    for i in range(300):
        t = i / 10
        held = sum(1 for r in reqs if 5 <= r.sent < 20 and r.sent % 2 == 0 and r.sent <= t <= r.sent + 0.75)
        samples.append(ReplicaSample(t, STALLED, held, held))
        samples.append(ReplicaSample(t, "interactive/1", 1, 1))
    return reqs, samples


def verdicts(reqs, samples, probes=()):
    return {name: (ok, detail) for name, ok, detail in slow_replica_checks(reqs, samples, MARKS, STALLED, 0.6, 0.5, 0.8, list(probes))}


def test_a_good_run_passes_every_check():
    reqs, samples = good_run()
    v = verdicts(reqs, samples)
    assert all(ok for ok, _ in v.values()), v


def test_a_first_token_past_the_deadline_and_margin_fails():
    reqs, samples = good_run()
    reqs[8].ttft = 1.2
    v = verdicts(reqs, samples)
    assert not v["interactive first token within the deadline + margin (1100 ms) during the stall"][0]


def test_the_stalled_replica_serving_the_stall_fails_the_share():
    reqs, samples = good_run()
    for r in reqs[5:10]:
        r.served_by = STALLED  # 5 of 15 stall requests on the stalled replica: 67 % < 80 %
    v = verdicts(reqs, samples)
    assert not v["the pool's other replicas served >= 80% of them"][0]


def test_attempts_left_in_the_stalled_vllm_fail():
    reqs, samples = good_run()
    # Never aborted: vLLM holds every attempt it ever got during the stall.
    leaky = [ReplicaSample(s.t, s.replica, sum(1 for r in reqs if 5 <= r.sent <= s.t and r.sent % 2 == 0) if s.replica == STALLED else 1, 0)
             for s in samples]
    ok, detail = verdicts(reqs, leaky)["the stalled replica's vLLM held no attempt Envoy had given up on"]
    assert not ok and "held more than were waiting" in detail


def test_a_stalled_replica_that_never_serves_again_fails_unless_a_probe_lands_there():
    reqs, samples = good_run()
    for r in reqs[20:]:
        r.served_by = "interactive/1"
    assert not verdicts(reqs, samples)["the stalled replica serves again after the stall"][0]
    assert verdicts(reqs, samples, [chat(31.0, 0.1, STALLED)])["the stalled replica serves again after the stall"][0]


def test_served_by_phases_counts_each_replica_before_during_and_after():
    reqs, _ = good_run()
    per = served_by_phases(reqs, MARKS)["interactive"]
    assert per[STALLED] == {"before": 3, "during": 0, "after": 5}
    assert per["interactive/1"] == {"before": 2, "during": 15, "after": 5}


def test_the_report_shows_per_replica_load():
    rep = {"scenario": "slow-replica", "summary": "s", "requests": {}, "times": {"inject": 5, "clear": 20, "end": 30, "time_to_recover_s": 0.1},
           "level_changes": {}, "interactive_ttft": {}, "checks": [], "passed": True,
           "served_by": {"interactive": {STALLED: {"before": 3, "during": 0, "after": 5}}},
           "replica_load": {STALLED: {"finished": {"200": 8, "499": 7}, "max_unfinished": 1}}}
    text = format_report(rep)
    assert "interactive/0 3/0/5" in text and "200 ×8, 499 ×7" in text


def test_only_a_policy_with_a_hedging_pool_of_replicas_can_run_it():
    said = []
    assert fitting_scenarios(["slow-replica"], load_policy(E2E / "policy-replicas-e2e.yaml"), None, said.append) == ["slow-replica"]
    one = load_policy(E2E / "policy-e2e.yaml")
    assert fitting_scenarios(["slow-replica"], one, None, said.append) is None
    assert "replicas >= 2" in said[-1] and "interactive (1 replica)" in said[-1] and "ttft_deadline_ms" in said[-1]
    # `all` leaves it out, with a note, and runs the rest.
    rest = fitting_scenarios(list(SCENARIOS), one, None, said.append)
    assert rest == [n for n in SCENARIOS if n != "slow-replica"] and said[-1].startswith("skipping slow-replica")
    # --pool naming a pool of one replica.
    assert fitting_scenarios(["slow-replica"], load_policy(E2E / "policy-replicas-e2e.yaml"), "batch", said.append) is None
    assert "pool 'batch'" in said[-1]
