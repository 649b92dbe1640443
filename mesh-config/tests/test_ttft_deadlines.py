"""TTFT deadlines and hedging in the generated Envoy config: a class's `ttft_deadline_ms` becomes the
per-try timeout of its routes (headers come with the first token, so it is a time-to-first-token
deadline); a hedging class races another replica, then the fallback pool, within a retry budget,
and tells the sidecars when to give up; a class that does not hedge gets a hard 504."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from infermesh import paths
from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.envoy_resources import CLASS_HEADER, POOL_HEADER, TTFT_GIVE_UP_HEADER
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy, parse_policy
from infermesh.meshconfig.xds_snapshot import MeshTarget, build_snapshot


def deadline_policy(tmp_path: Path, batch: str = "ttft_deadline_ms: 2000", replicas: int = 2) -> Path:
    text = LOCAL_POLICY.read_text()
    text = text.replace("  interactive: {pool: interactive, priority: 0}",
                        "  interactive: {pool: interactive, priority: 0, ttft_deadline_ms: 500}")
    text = text.replace("  batch: {pool: batch, priority: 10, sheddable: true}", f"  batch: {{pool: batch, priority: 10, sheddable: true, {batch}}}")
    text = text.replace("  interactive:\n    models:", f"  interactive:\n    replicas: {replicas}\n    models:", 1)
    # No when_degraded: its classes are decided by the filter, and these tests read native routes too.
    text = "".join(ln for ln in text.splitlines(keepends=True) if "when_degraded" not in ln)
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


def _routes(b: dict) -> dict[str, dict]:
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}


def _headers_added(r: dict) -> dict[str, str]:
    return {h["header"]["key"]: h["header"]["value"] for h in r.get("request_headers_to_add", [])}


def pool_clusters_of(b: dict) -> list[dict]:
    """The pools' traffic clusters (not the filter's probe clusters, `pool_NAME_state`)."""
    return [c for c in b["static_resources"]["clusters"] if not c["name"].endswith("_state")]


def test_interactive_hedges_and_batch_does_not_by_default(tmp_path):
    policy = load_policy(deadline_policy(tmp_path))
    assert policy.classes["interactive"].hedges and not policy.classes["batch"].hedges
    assert not load_policy(LOCAL_POLICY).classes["interactive"].hedges  # no deadline, no hedging


def test_a_deadline_out_of_range_is_refused_by_field():
    text = LOCAL_POLICY.read_text().replace("  interactive: {pool: interactive, priority: 0}",
                                            "  interactive: {pool: interactive, priority: 0, ttft_deadline_ms: 0}")
    with pytest.raises(Exception) as e:
        parse_policy(text, "p.yaml")
    assert "classes.interactive.ttft_deadline_ms" in str(e.value)


def test_a_hedging_class_gets_per_try_timeout_hedging_previous_hosts_and_the_fallback(tmp_path):
    plan = LocalMeshPlan(policy_path=deadline_policy(tmp_path))
    routes = _routes(bootstrap(plan.listener(Path("/x.wasm"))))
    # Chats go through the filter (a body rule comes first): the class's route on both headers.
    chat = routes["class-interactive-pool-interactive"]["route"]
    retry = chat["retry_policy"]
    assert retry["per_try_timeout"] == "0.5s"
    assert chat["hedge_policy"] == {"hedge_on_per_try_timeout": True}
    assert chat["timeout"] == "0s"  # long streams are never cut
    assert [p["name"] for p in retry["retry_host_predicate"]] == ["envoy.retry_host_predicates.previous_hosts"]
    # Two replicas, then the batch pool (priority 1): two hedges; the priority is left after two attempts.
    assert retry["num_retries"] == 2
    assert retry["retry_priority"]["typed_config"]["update_frequency"] == 2
    # Each sidecar gives up (504) once every attempt had its deadline.
    assert _headers_added(routes["class-interactive-pool-interactive"])[TTFT_GIVE_UP_HEADER] == "1500"
    names = [h["name"] for h in routes["class-interactive-pool-interactive"]["match"]["headers"]]
    assert names == [POOL_HEADER, CLASS_HEADER]
    # A natively decided rule of the class (gRPC Generate) carries the same deadline.
    native = routes["rule-grpc-generate-grpc"]
    assert native["route"]["hedge_policy"] == {"hedge_on_per_try_timeout": True}
    assert native["route"]["retry_policy"]["per_try_timeout"] == "0.5s"
    assert _headers_added(native)[TTFT_GIVE_UP_HEADER] == "1500" and _headers_added(native)[CLASS_HEADER] == "interactive"
    assert list(routes).index("class-interactive-pool-interactive") < list(routes).index("class-pool-interactive")
    assert "per_try_timeout" not in routes["class-pool-interactive"]["route"]["retry_policy"]


def test_a_class_that_does_not_hedge_gets_a_hard_deadline(tmp_path):
    plan = LocalMeshPlan(policy_path=deadline_policy(tmp_path))
    routes = _routes(bootstrap(plan.listener(Path("/x.wasm"))))
    batch = routes["default-pool"]["route"]  # batch is the default class
    assert batch["retry_policy"]["per_try_timeout"] == "2s"
    assert batch["retry_policy"]["num_retries"] == 0
    assert "hedge_policy" not in batch
    assert TTFT_GIVE_UP_HEADER not in _headers_added(routes["default-pool"])


def test_pool_clusters_carry_a_retry_budget():
    b = bootstrap(LocalMeshPlan().listener(Path("/x.wasm")))
    for c in pool_clusters_of(b):
        budget = c["circuit_breakers"]["thresholds"][0]["retry_budget"]
        assert 0 < budget["budget_percent"]["value"] <= 50 and budget["min_retry_concurrency"] >= 2


def test_a_missed_deadline_is_an_openai_error_with_retry_after():
    b = bootstrap(LocalMeshPlan().listener(Path("/x.wasm")))
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ut = next(m for m in hcm["local_reply_config"]["mappers"] if m["filter"]["response_flag_filter"]["flags"] == ["UT"])
    assert ut["body_format_override"]["json_format"]["error"]["code"] == "ttft_deadline_exceeded"
    assert ut["headers_to_add"][0]["header"]["key"] == "retry-after"


def test_the_give_up_header_is_the_one_the_sidecar_reads():
    from infermesh.sidecar.requests import TTFT_GIVE_UP_HEADER as sidecar_header

    assert sidecar_header == TTFT_GIVE_UP_HEADER


def test_the_snapshot_serves_the_deadline_routes(tmp_path):
    policy = load_policy(deadline_policy(tmp_path))
    target = MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {
        "interactive": [("127.0.0.1", 9001, 9101), ("127.0.0.1", 9002, 9102)], "batch": ("127.0.0.1", 9003, 9103)})
    snap = build_snapshot(policy, target)
    rc = next(iter(snap.resources["type.googleapis.com/envoy.config.route.v3.RouteConfiguration"]))
    chat = next(r for r in rc.virtual_hosts[0].routes if r.name == "class-interactive-pool-interactive")
    assert chat.route.hedge_policy.hedge_on_per_try_timeout
    assert chat.route.retry_policy.per_try_timeout.ToMilliseconds() == 500


def test_real_envoy_validates_deadlines_hedging_and_the_retry_budget(tmp_path):
    plan = LocalMeshPlan(policy_path=deadline_policy(tmp_path))
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(bootstrap(plan.listener(paths.filter_wasm()))))
    r = subprocess.run([str(paths.envoy_binary()), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_istio_routes_carry_the_give_up_limit_only_where_their_patch_hedges(tmp_path):
    """Istio hedges through the pools' EnvoyFilter (test_istio_replicas.py): a route with the
    sidecar's give-up limit has the hedge policy in its patch, and the other way round."""
    from infermesh.meshconfig import istio

    parts = istio.route_parts(load_policy(deadline_policy(tmp_path)))
    give_up = [TTFT_GIVE_UP_HEADER in (p["http"].get("headers") or {}).get("request", {}).get("set", {}) for p in parts]
    assert any(give_up) and give_up == ["hedge_policy" in p["envoyRoute"]["route"] for p in parts]


def test_a_hedge_finds_another_replica_whatever_the_weights():
    """previous_hosts rejects picks of the tried replica; weighted round robin can pick it up to
    the weight ratio times in a row (utilization 2, a queue, against the floor)."""
    from infermesh.meshconfig.envoy_resources import retry_policy
    from infermesh.sidecar.load_report import MIN_UTILIZATION

    assert retry_policy()["host_selection_retry_max_attempts"] >= 2 / MIN_UTILIZATION
