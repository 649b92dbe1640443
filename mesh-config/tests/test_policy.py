"""The policy file: examples load, errors name the file, line and field, generators agree."""

from pathlib import Path

import pytest

from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import LOCAL_POLICY, PolicyError, load_policy, parse_policy
from infermesh.sidecar.config import SidecarConfig

POLICIES = Path(__file__).resolve().parents[1] / "policies"
E2E_POLICY = Path(__file__).resolve().parents[2] / "e2e" / "policy-e2e.yaml"


@pytest.mark.parametrize("name", ["local.yaml", "production.yaml"])
def test_example_policies_load_and_generate_valid_sidecar_configs(name, tmp_path):
    p = load_policy(POLICIES / name)
    for pool in p.pools:
        cfg = SidecarConfig.model_validate(p.sidecar_config(pool, tmp_path))
        assert cfg.pool == pool and cfg.models[0].name == p.pools[pool].models[0].name
        assert set(cfg.classes) == set(p.classes) and cfg.default_class == p.default_class
    f = p.filter_config()
    assert f["default_class"] == p.default_class
    assert {c: v["pool"] for c, v in f["classes"].items()} == {c: v.pool for c, v in p.classes.items()}
    assert [r["name"] for r in f["rules"]] == [r.name for r in p.rules]


def test_local_plan_is_the_local_policy():
    plan = LocalMeshPlan()
    assert plan.policy == load_policy(LOCAL_POLICY)
    assert [p.name for p in plan.pools] == ["interactive", "batch"]
    assert plan.ladder("interactive") == ["tiny-llama-large", "tiny-llama-small"]
    listener = plan.listener(Path("/x.wasm"))
    assert listener.default_pool == "batch" and listener.filter_config == plan.filter_config()


GOOD = LOCAL_POLICY.read_text()
NO_DEGRADED = "".join(ln for ln in GOOD.splitlines(keepends=True) if "when_degraded" not in ln)


def problems(text: str) -> list[tuple[int | None, str, str]]:
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    assert str(e.value).startswith("p.yaml:")
    return e.value.problems


def line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


def test_field_errors_carry_the_line():
    bad = GOOD.replace("trip_above: 0.90, recover_below: 0.50", "trip_above: 0.40, recover_below: 0.50")
    (line, field, msg), = problems(bad)
    assert field == "pools.interactive.breakers.kv-cache" and "recover_below" in msg
    assert line == line_of(bad, "kv-cache:")


def test_unknown_keys_are_errors():
    bad = GOOD.replace("  batch: {pool: batch, priority: 10, sheddable: true}", "  batch: {pool: batch, priority: 10, shedable: true}")
    (line, field, msg), = problems(bad)
    assert field == "classes.batch.shedable" and line == line_of(bad, "shedable")


def test_cross_references_are_checked():
    (line, field, msg), = problems(GOOD.replace("batch: {pool: batch,", "batch: {pool: bulk,"))
    assert field == "classes.batch.pool" and "bulk" in msg and line is not None
    (line, field, msg), = problems(GOOD.replace("class: interactive\n", "class: chatty\n"))
    assert field == "rules.1.class" and "chatty" in msg
    (line, field, msg), = problems(GOOD.replace("default_class: batch", "default_class: nope"))
    assert field == "default_class"


def test_yaml_syntax_and_shape_errors():
    (line, field, msg), = problems("version: 1\nclasses: {a: {pool: p}\n")
    assert field == "(yaml)" and line == 3
    (line, field, msg), = problems("- just\n- a list\n")
    assert field == "(root)"


def test_missing_file(tmp_path):
    with pytest.raises(PolicyError, match="No such file"):
        load_policy(tmp_path / "nope.yaml")


def test_when_degraded_goes_to_the_filter_as_degraded_routing():
    text = GOOD.replace("  batch:\n    models:", "    when_degraded: {at_level: 2, spill_to: batch, shed_classes: [batch]}\n  batch:\n    models:")
    p = parse_policy(text)
    assert p.filter_config()["degraded_routing"] == {
        # Only the shedding is the filter's; the spill is Envoy's health check + failover, and the
        # probe goes to the pool's own endpoints (its cluster fails over to batch's).
        "pools": {"interactive": {"at_level": 2, "shed_classes": ["batch"], "probe_cluster": "pool_interactive_state"}},
        "probe_interval_ms": 500, "probe_timeout_ms": 400, "stale_after_ms": 5000, "recover_hold_ms": 1000, "retry_after_s": 5,
    }
    assert (p.failover(), p.spill_levels()) == ({"interactive": "batch"}, {"interactive": 2})
    istio = {"interactive": "outbound|8000||x-interactive.ns.svc.cluster.local"}
    assert p.filter_config(istio)["degraded_routing"]["pools"]["interactive"]["probe_cluster"] == istio["interactive"]
    assert "probe_cluster" not in p.filter_config({})["degraded_routing"]["pools"]["interactive"]
    assert "degraded_routing" not in parse_policy(NO_DEGRADED).filter_config()
    # A pool that only spills needs no filter at all; one that only sheds is probed on its own cluster.
    assert "degraded_routing" not in parse_policy(text.replace(", shed_classes: [batch]", "")).filter_config()
    only_shed = parse_policy(text.replace("spill_to: batch, ", "")).filter_config()["degraded_routing"]["pools"]
    assert only_shed == {"interactive": {"at_level": 2, "shed_classes": ["batch"], "probe_cluster": "pool_interactive"}}
    (line, field, msg), = problems(text.replace("spill_to: batch", "spill_to: interactive"))
    assert field == "pools.interactive.when_degraded.spill_to"
    (line, field, msg), = problems(text + "filter: {pool_state: {probe_interval_ms: 10}}\n")
    assert (field, msg) == ("filter.pool_state.probe_interval_ms", "must be between 50 and 60000")


def test_the_plain_envoy_probe_clusters_are_the_state_clusters_of_the_pools_that_spill():
    from infermesh.meshconfig.envoy_resources import state_cluster_name, state_clusters

    p = load_policy(E2E_POLICY)
    assert {n: d["probe_cluster"] for n, d in p.degraded_routing()["pools"].items()} == {"interactive": state_cluster_name("interactive")}
    plan = LocalMeshPlan(policy_path=E2E_POLICY)
    (probe,) = state_clusters(plan.listener(Path("/x.wasm")), eds=False)
    # The pool's own endpoints only: no failover priority, no health check taking them out.
    assert probe["name"] == "pool_interactive_state" and "health_checks" not in probe
    assert [e["priority"] for e in probe["load_assignment"]["endpoints"]] == [0]


def test_shed_classes_are_decided_by_the_filter_and_no_route_is_rewritten():
    """The routes never change with a pool's level; a rule whose class `when_degraded` may shed
    is a filter route (the filter applies it); a class that only spills is native (Envoy's
    failover spills it); natively decided routes drop the sidecars' pool-level header."""
    from infermesh.meshconfig.envoy_resources import route_config

    plan = LocalMeshPlan(policy_path=E2E_POLICY)
    routes = route_config(plan.listener(Path("/x.wasm")))["virtual_hosts"][0]["routes"]
    # No route answers for a pool level (no 429/503 route); the edge's 404 for paths it does not serve is no shedding.
    assert all(r["direct_response"]["status"] == 404 for r in routes if "direct_response" in r)
    by_pool = {r["match"]["headers"][0]["string_match"]["exact"]: r["route"]["cluster"]
               for r in routes if r["match"].get("headers", [{}])[0].get("name") == "x-infermesh-pool" and len(r["match"]["headers"]) == 1}
    assert by_pool == {"interactive": "pool_interactive", "batch": "pool_batch"}
    # interactive only spills: its rules are native; batch is shed: the filter decides it.
    native_pools = {h["value"] for r in routes for h in (x["header"] for x in r.get("request_headers_to_add", [])) if h["key"] == "x-infermesh-pool"}
    assert native_pools == {"interactive"}
    assert [r["name"] for r in routes if r["name"].startswith("filter-")][-1] == "filter-default"
    # Without when_degraded: native routes, and they drop the pool-level header.
    plain = LocalMeshPlan(policy=parse_policy(NO_DEGRADED))
    native = [r for r in route_config(plain.listener(Path("/x.wasm")))["virtual_hosts"][0]["routes"] if "request_headers_to_add" in r]
    assert native and all(r["response_headers_to_remove"] == ["x-infermesh-pool-level", "x-infermesh-load"] for r in native)


PRODUCTION = POLICIES / "production.yaml"


def test_rules_are_typed_and_written_to_the_filter_as_the_policy_says():
    import yaml

    p = load_policy(PRODUCTION)
    raw = yaml.safe_load(PRODUCTION.read_text())["rules"]
    assert [r.wire() for r in p.rules] == raw == p.filter_config()["rules"]
    vip, tier, _, bulk, *_ = p.rules
    (h,) = vip.match.headers
    assert (h.name, h.value_match.kind, h.value_match.value, h.must_be_absent) == ("x-priority", "exact", "high", False)
    assert vip.class_ == "premium" and not vip.match.needs_body and vip.match.path is None
    assert tier.match.needs_body and tier.match.body.service_tier.exact == "priority"
    assert bulk.match.body.max_tokens.min == 2048 and bulk.match.body.max_tokens.max is None
    assert bulk.match.path.kind == "prefix" and bulk.match.methods == ["POST"]
    assert p.needs_body and p.objective("batch") == "bulk"
    assert not load_policy(LOCAL_POLICY).classes["batch"].objective and load_policy(LOCAL_POLICY).objective("batch") == "batch"


@pytest.mark.parametrize("old, new, field, message", [
    ("path: {prefix: /v1/chat/completions}, body", "path: {prefix: v1/chat/completions}, body", "rules.0.match.path",
     "a path must start with `/`"),
    ("max_tokens: {min: 1024}", "max_tokens: {min: 1024, max: 8}", "rules.0.match.body.max_tokens", "min 1024 is above max 8"),
    ("max_tokens: {min: 1024}", "max_tokenz: {min: 1024}", "rules.0.match.body.max_tokenz", "Extra inputs are not permitted"),
    ("- name: chat\n", "- name: default\n", "rules.1.name", "`default` is reserved"),
    ("- name: chat\n", "- name: chat-bulk\n", "rules.1.name", "duplicate rule name `chat-bulk`"),
    ("path: {exact: /infermesh.v1.Inference/Generate}", "headers: [{name: X-Tenant}]", "rules.2.match.headers.0.name",
     "header names must be non-empty lower-case tokens"),
    ("path: {exact: /infermesh.v1.Inference/Generate}", "path: {regex: '^/(?=infermesh)'}", "rules.2.match.path.regex",
     "invalid regex: regex parse error: look-around, including look-ahead and look-behind, is not supported"),
])
def test_a_rule_the_filter_would_refuse_is_refused_by_line_and_field(old, new, field, message):
    """As the filter words it (filter/src/config.rs); test_rule_contract.py compares the two on a corpus."""
    bad = GOOD.replace(old, new, 1)
    (line, got_field, msg), = problems(bad)
    assert (got_field, msg) == (field, message)
    assert line == GOOD[:GOOD.index(old)].count("\n") + 1, "the line of the changed text"
