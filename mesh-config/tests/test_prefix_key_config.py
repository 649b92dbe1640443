"""A class's prefix key (docs/prefix-routing.md) in the generated config: the policy writes it
into the filter config, the class's rules become filter routes (the filter must read the body
for the key), client copies of the header are stripped before routing, and the real Envoy with
the compiled filter accepts the whole config. Prefix keys are off in the bundled policies."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from infermesh import paths
from infermesh.meshconfig.envoy_bootstrap import bootstrap
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import PolicyError, load_policy, parse_policy

REPO = Path(__file__).resolve().parents[2]

POLICY = """
version: 1
default_class: batch
classes:
  interactive: {pool: interactive, prefix_key: {max_keys: 3}}
  batch: {pool: batch, sheddable: true}
rules:
  - {name: chat, class: interactive, match: {methods: [POST], path: {prefix: /v1/chat/completions}}}
  - {name: models, class: batch, match: {methods: [GET], path: {prefix: /v1/models}}}
pools:
  interactive: {models: [{name: m}]}
  batch: {models: [{name: m}]}
"""


def _routes(policy) -> list[dict]:
    b = bootstrap(LocalMeshPlan(policy=policy).listener(Path("/x.wasm")))
    hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm, hcm["route_config"]["virtual_hosts"][0]["routes"]


def test_the_policy_writes_the_prefix_key_into_the_filter_config():
    fc = parse_policy(POLICY, "p.yaml").filter_config()
    # The load bound's defaults (docs/prefix-routing.md) go along, so the filter applies what the policy says.
    assert fc["classes"]["interactive"]["prefix_key"] == {"max_keys": 3, "chunk_bytes": 1024, "load_over_mean_pct": 25,
                                                          "load_floor_pct": 50, "load_ceiling_pct": 90}
    own = parse_policy(POLICY.replace("{max_keys: 3}", "{max_keys: 3, load_over_mean_pct: 100, load_ceiling_pct: 95}"), "p.yaml")
    assert own.filter_config()["classes"]["interactive"]["prefix_key"] == {"max_keys": 3, "chunk_bytes": 1024, "load_over_mean_pct": 100,
                                                                           "load_floor_pct": 50, "load_ceiling_pct": 95}
    assert "prefix_key" not in fc["classes"]["batch"]


def test_a_keyed_classs_rules_are_filter_routes_and_the_rest_stay_native():
    hcm, routes = _routes(parse_policy(POLICY, "p.yaml"))
    by_name = {r["name"]: r for r in routes}
    assert "filter-chat" in by_name and "rule-chat" not in by_name, list(by_name)
    assert "typed_per_filter_config" not in by_name["filter-chat"], "the filter runs on the keyed class's requests"
    assert by_name["rule-models"]["typed_per_filter_config"]["envoy.filters.http.wasm"]["disabled"]
    # No client can send the key past the filter's routes either: every x-infermesh-* header is
    # removed before any route is chosen.
    assert hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"] == [
        {"remove_on_match": {"key_matcher": {"prefix": "x-infermesh-"}}}]


@pytest.mark.parametrize("runtime", ["wasm", "native"])
def test_a_keyed_policy_puts_envoys_stateful_session_filter_right_after_the_infermesh_filter(runtime):
    listener = dataclasses.replace(LocalMeshPlan(policy=parse_policy(POLICY, "p.yaml")).listener(Path("/x.wasm")), filter_runtime=runtime)
    hcm = bootstrap(listener)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == [listener.filter_name, "envoy.filters.http.stateful_session", "envoy.filters.http.router"]
    session = hcm["http_filters"][1]["typed_config"]
    # Not strict: a named replica that is gone or unhealthy is passed over for the cluster's pick.
    assert session["strict"] is False
    assert session["session_state"]["typed_config"]["name"] == "x-infermesh-prefix-host"
    # Without a keyed class, no session filter.
    plain = parse_policy(POLICY.replace(", prefix_key: {max_keys: 3}", ""), "p.yaml")
    hcm, _ = _routes(plain)
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.wasm", "envoy.filters.http.router"]


def test_a_policy_refuses_a_bad_prefix_key_naming_its_line_and_field():
    bad = POLICY.replace("prefix_key: {max_keys: 3}", "prefix_key: {max_keys: 9}")
    with pytest.raises(PolicyError) as e:
        parse_policy(bad, "p.yaml")
    line, field, msg = e.value.problems[0]
    assert (line, field, msg) == (5, "classes.interactive.prefix_key.max_keys", "must be between 1 and 8")


@pytest.mark.parametrize("name", ["local.yaml", "production.yaml"])
def test_the_bundled_policies_do_not_key_prefixes_yet(name):
    policy = load_policy(REPO / "mesh-config" / "policies" / name)
    assert all(c.prefix_key is None for c in policy.classes.values())


def test_real_envoy_with_the_compiled_filter_accepts_a_keyed_config(tmp_path):
    wasm = paths.filter_wasm()
    if not wasm.exists():
        pytest.skip("the filter is not built")
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(bootstrap(LocalMeshPlan(policy=parse_policy(POLICY, "p.yaml")).listener(wasm))))
    r = subprocess.run([str(paths.envoy_binary()), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "envoy.filters.http.stateful_session" in path.read_text()
