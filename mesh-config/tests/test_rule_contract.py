"""The policy refuses what the filter refuses: a corpus of rule sets (and of the other parts of
the filter config), each judged by the policy model (through a policy file, as `infermesh policy
check` reads it) and by the filter's own parser (`FilterConfig::parse`, natively, through
filter/examples/check_config.rs, one cargo run for the whole corpus). Both must give the same
verdict; a refusal must name the same field, and for the filter's own checks (rules, body limit,
trusted sources) the same message.

Field paths: the policy's are pydantic's (`rules.0.match.path`, `filter.body_max_bytes`), the
filter's are `rules[0].match.path`, `body.max_bytes`; `filter_path()` below is the one place that
maps one onto the other. For the errors serde reports (unknown or missing fields, wrong types)
the filter's field is `$` with a position, and check_config names the field at that position
(its `at`); their wording is serde's and pydantic's, not compared.

Limits: every bounded field of the filter config (config.rs `LIMITS`) has its policy field in
BOUNDED below; `filter_limits` asks the filter for its limits and defaults (`cargo run --example
config_limits`) and test_the_policy_holds_the_filters_limits compares them field by field with
the policy model's (its JSON schema, its defaults, its constants), in both directions; the corpus
tries each bound on both parsers at and one past each end (`bound_cases`), and the shared regex
budget on configs of many regexes.

Token budgets (the policy's top-level `budgets`, the filter's `budgets`, docs/token-budgets.md):
the same field paths on both sides; BUDGET_BOUNDED holds every bounded field of config.rs
`BUDGET_LIMITS` to its policy field, `test_the_policy_holds_the_filters_budget_limits` compares
their bounds and defaults, and the corpus tries each at and one past its ends. A class's
`default_max_tokens` is not the policy's to write: it is the class's pool's
`serving.default_max_tokens` (compared with the filter's bound and default there).

Spill (`when_degraded.spill_to`) is not the filter's: Envoy's health check of the sidecars' state
endpoint and priority failover do it, so the filter config never carries it (only the pools that
shed are in `degraded_routing`) and the filter refuses a config that still does (FILTER_ONLY).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from infermesh.meshconfig import content_model as cm, filter_regex
from infermesh.meshconfig.policy import (BUDGET_MAX_TENANTS, BUDGET_MAX_TOKENS_MAX, BUDGET_OTHER, RESERVED_RULE_NAMES, TOKEN_MAX_LEN, Budget,
                                         BudgetCount, BudgetTokens, ClassBudget, DegradedRouting, FilterSpec, PolicyError, PoolStateSpec, PrefixKeySpec,
                                         parse_policy)
from infermesh.settings import LEVEL_DOWN, NAME, ServingSettings

REPO = Path(__file__).resolve().parents[2]
FILTER = REPO / "filter"

CLASSES = {"interactive": {"pool": "interactive"}, "batch": {"pool": "batch"}}
R = {"name": "r", "class": "batch"}  # a rule to put one condition in


def rule(**match) -> list[dict]:
    return [R | {"match": match}]


def body(**conds) -> list[dict]:
    return rule(body=conds)


def header(**h) -> list[dict]:
    return rule(headers=[h])


VALID = {
    "no-rules": [],
    "no-match": [R],
    "empty-match": [R | {"match": {}}],
    "methods": rule(methods=["post", "GET", "PATCH"]),
    "methods-empty": rule(methods=[], headers=[]),
    "path-exact": rule(path={"exact": "/v1/models"}),
    "path-prefix": rule(path={"prefix": "/"}),
    "path-regex": rule(path={"regex": "^/v1/(chat/)?completions$"}),
    "path-regex-relative": rule(path={"regex": "completions"}),
    "path-null": rule(path=None),
    "path-null-siblings": rule(path={"exact": None, "prefix": "/v1/", "regex": None}),
    "header-present": header(name="x-tenant"),
    "header-present-true": header(name="x-tenant", present=True),
    "header-absent": header(name="x-debug", present=False),
    "header-present-null": header(name="x-debug", present=None, exact="1"),
    "header-exact": header(name="x-priority", exact="high"),
    "header-prefix": header(name="x-tenant", prefix="eval-"),
    "header-regex": header(name="x-tenant", regex="^team-[0-9]+$"),
    "header-present-and-value": header(name="x-tenant", present=True, exact="a"),
    "header-punctuation": header(name="x-a.b_c!~"),
    "header-grpc-metadata": rule(path={"exact": "/infermesh.v1.Inference/Generate"}, headers=[{"name": "x-tenant", "regex": "^team-"}]),
    "body-stream": body(stream=False),
    "body-stream-true": body(stream=True),
    "body-stream-null": body(stream=None, n={"min": 2}),
    "body-max-tokens-min": body(max_tokens={"min": 1024}),
    "body-max-tokens-max": body(max_tokens={"max": 16}),
    "body-max-tokens-equal": body(max_tokens={"min": 5, "max": 5}),
    "body-range-u64": body(prompt_chars={"max": 2**64 - 1}),
    "body-range-null-end": body(message_count={"min": None, "max": 3}),
    "body-n": body(n={"min": 4}),
    "body-model": body(model={"prefix": "eval-"}),
    "body-model-regex": body(model={"regex": "^llama-3-(8|70)b$"}),
    "body-message-count": body(message_count={"min": 1, "max": 20}),
    "body-prompt-chars": body(prompt_chars={"min": 10000}),
    "body-priority": body(priority={"exact": "1"}),
    "body-service-tier": body(service_tier={"exact": "priority"}),
    "body-everything": body(stream=False, max_tokens={"min": 1}, n={"max": 1}, model={"exact": "m"}, message_count={"min": 1},
                            prompt_chars={"max": 9}, priority={"prefix": "h"}, service_tier={"regex": "^(flex|priority)$"}),
    "body-empty": body(),
    "several-rules": [{"name": "vip", "class": "interactive", "match": {"headers": [{"name": "x-priority", "exact": "high"}]}},
                      {"name": "chat-bulk", "class": "batch", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"},
                                                                        "body": {"stream": False, "max_tokens": {"min": 1024}}}},
                      {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}}],
    "name-64": [{"name": "a" * 64, "class": "batch"}],
    "name-chars": [{"name": "Chat_bulk-2", "class": "interactive"}],
}

# One defect each: (rule set or case, the policy's field path of the refusal).
INVALID = {
    # a rule
    "rule-unknown-field": ([R | {"nam": "x"}], "rules.0.nam"),
    "rule-missing-name": ([{"class": "batch"}], "rules.0.name"),
    "rule-missing-class": ([{"name": "r"}], "rules.0.class"),
    "rule-name-type": ([{"name": 7, "class": "batch"}], "rules.0.name"),
    "rule-name-empty": ([{"name": "", "class": "batch"}], "rules.0.name"),
    "rule-name-65": ([{"name": "a" * 65, "class": "batch"}], "rules.0.name"),
    "rule-name-space": ([{"name": "chat bulk", "class": "batch"}], "rules.0.name"),
    "rule-name-unicode": ([{"name": "chät", "class": "batch"}], "rules.0.name"),
    "rule-name-default": ([{"name": "default", "class": "batch"}], "rules.0.name"),
    "rule-name-trusted": ([{"name": "trusted", "class": "batch"}], "rules.0.name"),
    "rule-name-duplicate": ([R, {"name": "s", "class": "batch"}, R], "rules.2.name"),
    "rule-class-unknown": ([{"name": "r", "class": "premium"}], "rules.0.class"),
    "rule-class-type": ([{"name": "r", "class": ["batch"]}], "rules.0.class"),
    "rules-not-a-list": ({"name": "r"}, "rules"),
    # its match
    "match-unknown-field": (rule(methds=["GET"]), "rules.0.match.methds"),
    "match-null": ([R | {"match": None}], "rules.0.match"),
    "methods-string": (rule(methods="POST"), "rules.0.match.methods"),
    "methods-item-type": (rule(methods=["GET", 1]), "rules.0.match.methods.1"),
    "methods-null": (rule(methods=None), "rules.0.match.methods"),
    # path
    "path-unknown-key": (rule(path={"suffix": "/x"}), "rules.0.match.path.suffix"),
    "path-two": (rule(path={"exact": "/a", "prefix": "/b"}), "rules.0.match.path"),
    "path-three": (rule(path={"exact": "/a", "prefix": "/b", "regex": "c"}), "rules.0.match.path"),
    "path-none": (rule(path={}), "rules.0.match.path"),
    "path-all-null": (rule(path={"exact": None}), "rules.0.match.path"),
    "path-exact-relative": (rule(path={"exact": "v1/models"}), "rules.0.match.path"),
    "path-prefix-relative": (rule(path={"prefix": ""}), "rules.0.match.path"),
    "path-regex-invalid": (rule(path={"regex": "^/v1/(chat/?"}), "rules.0.match.path.regex"),
    "path-exact-type": (rule(path={"exact": 1}), "rules.0.match.path.exact"),
    "path-string": (rule(path="/v1"), "rules.0.match.path"),
    # headers
    "headers-object": (rule(headers={"name": "x"}), "rules.0.match.headers"),
    "header-missing-name": (rule(headers=[{"exact": "x"}]), "rules.0.match.headers.0.name"),
    "header-name-upper": (rule(headers=[{"name": "x-a"}, {"name": "X-Tenant"}]), "rules.0.match.headers.1.name"),
    "header-name-empty": (header(name=""), "rules.0.match.headers.0.name"),
    "header-name-space": (header(name="x tenant"), "rules.0.match.headers.0.name"),
    "header-name-unicode": (header(name="x-tenänt"), "rules.0.match.headers.0.name"),
    "header-name-del": (header(name="x-\x7f"), "rules.0.match.headers.0.name"),
    "header-name-type": (header(name=1), "rules.0.match.headers.0.name"),
    "header-two-values": (header(name="x-a", exact="a", prefix="b"), "rules.0.match.headers.0"),
    "header-absent-with-value": (header(name="x-a", present=False, regex="."), "rules.0.match.headers.0"),
    "header-absent-with-two": (header(name="x-a", present=False, exact="a", prefix="b"), "rules.0.match.headers.0"),
    "header-present-type": (header(name="x-a", present="yes"), "rules.0.match.headers.0.present"),
    "header-unknown-key": (header(name="x-a", value="b"), "rules.0.match.headers.0.value"),
    "header-regex-invalid": (header(name="x-a", regex="(?=a)"), "rules.0.match.headers.0.regex"),
    "header-exact-type": (header(name="x-a", exact=True), "rules.0.match.headers.0.exact"),
    # body
    "body-unknown-field": (body(max_tokenz={"min": 1}), "rules.0.match.body.max_tokenz"),
    "body-yaml-false-key": (body(**{"false": {"min": 4}}), "rules.0.match.body.false"),
    "body-list": (rule(body=[]), "rules.0.match.body"),
    "body-stream-string": (body(stream="yes"), "rules.0.match.body.stream"),
    "body-stream-int": (body(stream=1), "rules.0.match.body.stream"),
    "body-stream-object": (body(stream={}), "rules.0.match.body.stream"),
    "range-empty": (body(max_tokens={}), "rules.0.match.body.max_tokens"),
    "range-all-null": (body(n={"min": None, "max": None}), "rules.0.match.body.n"),
    "range-inverted": (body(max_tokens={"min": 9, "max": 3}), "rules.0.match.body.max_tokens"),
    "range-negative": (body(max_tokens={"min": -1}), "rules.0.match.body.max_tokens.min"),
    "range-fraction": (body(n={"max": 1.5}), "rules.0.match.body.n.max"),
    "range-float": (body(n={"max": 2.0}), "rules.0.match.body.n.max"),
    "range-over-u64": (body(prompt_chars={"max": 2**64}), "rules.0.match.body.prompt_chars.max"),
    "range-string": (body(message_count={"min": "1"}), "rules.0.match.body.message_count.min"),
    "range-bool": (body(message_count={"min": True}), "rules.0.match.body.message_count.min"),
    "range-int": (body(max_tokens=1024), "rules.0.match.body.max_tokens"),
    "range-unknown-key": (body(n={"minimum": 1}), "rules.0.match.body.n.minimum"),
    "n-inverted": (body(n={"min": 4, "max": 2}), "rules.0.match.body.n"),
    "message-count-inverted": (body(message_count={"min": 4, "max": 2}), "rules.0.match.body.message_count"),
    "prompt-chars-empty": (body(prompt_chars={}), "rules.0.match.body.prompt_chars"),
    "model-two": (body(model={"exact": "m", "prefix": "n"}), "rules.0.match.body.model"),
    "model-none": (body(model={}), "rules.0.match.body.model"),
    "model-string": (body(model="m"), "rules.0.match.body.model"),
    "model-regex-invalid": (body(model={"regex": "a{2,1}"}), "rules.0.match.body.model.regex"),
    "priority-regex-invalid": (body(priority={"regex": "\\1"}), "rules.0.match.body.priority.regex"),
    "priority-two": (body(priority={"exact": "1", "regex": "2"}), "rules.0.match.body.priority"),
    "service-tier-two": (body(service_tier={"exact": "priority", "prefix": "p"}), "rules.0.match.body.service_tier"),
    "service-tier-type": (body(service_tier={"exact": 1}), "rules.0.match.body.service_tier.exact"),
    "service-tier-regex-size": (body(service_tier={"regex": "\\w{1000}"}), "rules.0.match.body.service_tier.regex"),
    # later rules are checked as the first
    "second-rule-bad-path": ([R, {"name": "s", "class": "batch", "match": {"path": {"prefix": "v1"}}}], "rules.1.match.path"),
    "third-rule-bad-header": ([R, {"name": "s", "class": "batch"}, {"name": "t", "class": "batch", "match": {"headers": [{"name": "A"}]}}],
                              "rules.2.match.headers.0.name"),
}

# The filter reads these (serde fills a struct from a JSON array, field by field); the policy
# refuses them on purpose: nobody means `path: ["/v1"]` as `path: {exact: "/v1"}`.
STRICTER = {
    "match-list": ([R | {"match": []}], "rules.0.match"),
    "path-list": (rule(path=["/v1/models", None, None]), "rules.0.match.path"),
    "range-list": (body(max_tokens=[1, 10]), "rules.0.match.body.max_tokens"),
}

# The rest of the filter config: (policy fields, the policy's field path of the refusal).
OTHER_VALID = {
    "trusted": {"filter": {"trusted_cidrs": ["10.0.0.0/8", "::1", "192.168.1.7", "fe80::/10", "0.0.0.0/0", "10.0.0.0/+8", "::ffff:10.1.0.0/128"],
                           "trusted_principals": ["spiffe://cluster.local/ns/gw/sa/gw"]}},
    "body-limit-max": {"filter": {"body_max_bytes": 983040}},
    "body-limit-min": {"filter": {"body_max_bytes": 1}},
    "objective": {"classes": {"interactive": {"pool": "interactive", "objective": "chat-latency"}, "batch": {"pool": "batch"}}},
    "emit-objective": {"filter": {"emit_objective_header": True}},
    "prefix-key": {"classes": CLASSES | {"interactive": {"pool": "interactive", "prefix_key": {"max_keys": 2, "chunk_bytes": 512}},
                                         "batch": {"pool": "batch", "prefix_key": {}}}},
    "when-degraded": {"when_degraded": {"interactive": {"at_level": 2, "spill_to": "batch", "shed_classes": ["batch", "interactive"]}},
                      "filter": {"pool_state": {"probe_interval_ms": 50, "probe_timeout_ms": 60000, "stale_after_ms": 100,
                                                "recover_hold_ms": 0, "retry_after_s": 3600}}},
    "when-degraded-defaults": {"when_degraded": {"batch": {}}},
    "when-degraded-shed-only": {"when_degraded": {"batch": {"shed_classes": ["batch"]}}},
    "when-degraded-spill-only": {"when_degraded": {"interactive": {"at_level": 1, "spill_to": "batch"}}},
    "when-degraded-both": {"when_degraded": {"batch": {"spill_to": "interactive", "shed_classes": ["interactive"]},
                                             "interactive": {"at_level": 1, "spill_to": "batch", "shed_classes": ["batch"]}}},
    "when-degraded-both-spill": {"when_degraded": {"batch": {"spill_to": "interactive"}, "interactive": {"at_level": 1, "spill_to": "batch"}}},
}
# when_degraded in the policy, degraded_routing in the filter config (Policy.degraded_routing): a
# pool that sheds, so that the filter config has degraded_routing (and its pool_state bounds).
WD = {"when_degraded": {"interactive": {"spill_to": "batch", "shed_classes": ["batch"]}}}
OTHER_INVALID = {
    "prefix-key-unknown-field": ({"classes": CLASSES | {"interactive": {"pool": "interactive", "prefix_key": {"max_key": 2}}}},
                                 "classes.interactive.prefix_key.max_key"),
    "body-limit-zero": ({"filter": {"body_max_bytes": 0}}, "filter.body_max_bytes"),
    "body-limit-over": ({"filter": {"body_max_bytes": 983041}}, "filter.body_max_bytes"),
    "cidr-prefix": ({"filter": {"trusted_cidrs": ["10.0.0.0/33"]}}, "filter.trusted_cidrs.0"),
    "cidr-v6-prefix": ({"filter": {"trusted_cidrs": ["::1", "::/129"]}}, "filter.trusted_cidrs.1"),
    "cidr-name": ({"filter": {"trusted_cidrs": ["nope"]}}, "filter.trusted_cidrs.0"),
    "cidr-space": ({"filter": {"trusted_cidrs": ["10.0.0.1 "]}}, "filter.trusted_cidrs.0"),
    "cidr-prefix-space": ({"filter": {"trusted_cidrs": ["10.0.0.0/ 8"]}}, "filter.trusted_cidrs.0"),
    "cidr-zone": ({"filter": {"trusted_cidrs": ["fe80::1%eth0"]}}, "filter.trusted_cidrs.0"),
    "cidr-leading-zero": ({"filter": {"trusted_cidrs": ["010.0.0.1"]}}, "filter.trusted_cidrs.0"),
    "cidr-empty-prefix": ({"filter": {"trusted_cidrs": ["10.0.0.0/"]}}, "filter.trusted_cidrs.0"),
    "principal-empty": ({"filter": {"trusted_principals": ["spiffe://a", ""]}}, "filter.trusted_principals.1"),
    "version": ({"version": 2}, "version"),
    "classes-empty": ({"classes": {}}, "classes"),
    "class-name": ({"classes": {"inter active": {"pool": "interactive"}, "batch": {"pool": "batch"}}}, "classes.inter active"),
    "class-pool-token": ({"classes": {"interactive": {"pool": "gpu a"}, "batch": {"pool": "batch"}}}, "classes.interactive.pool"),
    "class-objective-token": ({"classes": {"interactive": {"pool": "interactive", "objective": "chat latency"}, "batch": {"pool": "batch"}}},
                              "classes.interactive.objective"),
    "class-unknown-field": ({"classes": {"interactive": {"pool": "interactive", "pol": "x"}, "batch": {"pool": "batch"}}}, "classes.interactive.pol"),
    "default-class": ({"default_class": "nope"}, "default_class"),
    "when-degraded-shed-unknown": ({"when_degraded": {"batch": {"shed_classes": ["batch", "nope"]}}}, "pools.batch.when_degraded.shed_classes.1"),
    "when-degraded-level-zero": ({"when_degraded": {"batch": {"at_level": 0, "shed_classes": ["batch"]}}}, "pools.batch.when_degraded.at_level"),
    "pool-state-interval": (WD | {"filter": {"pool_state": {"probe_interval_ms": 49}}}, "filter.pool_state.probe_interval_ms"),
    "pool-state-interval-over": (WD | {"filter": {"pool_state": {"probe_interval_ms": 60001}}}, "filter.pool_state.probe_interval_ms"),
    "pool-state-timeout": (WD | {"filter": {"pool_state": {"probe_timeout_ms": 9}}}, "filter.pool_state.probe_timeout_ms"),
    "pool-state-stale": (WD | {"filter": {"pool_state": {"stale_after_ms": 99}}}, "filter.pool_state.stale_after_ms"),
    "pool-state-hold": (WD | {"filter": {"pool_state": {"recover_hold_ms": 3600001}}}, "filter.pool_state.recover_hold_ms"),
    "pool-state-retry-after": (WD | {"filter": {"pool_state": {"retry_after_s": 0}}}, "filter.pool_state.retry_after_s"),
}

# The policy refuses these; what it refuses never reaches the filter (spill_to is Envoy's failover,
# not part of the filter config), so the filter, given what the policy would write, accepts.
POLICY_ONLY = {
    "when-degraded-spill-self": ({"when_degraded": {"interactive": {"spill_to": "interactive", "shed_classes": ["batch"]}}},
                                 "pools.interactive.when_degraded.spill_to"),
    "when-degraded-spill-unknown": ({"when_degraded": {"interactive": {"spill_to": "gpu"}}}, "pools.interactive.when_degraded.spill_to"),
}


def _with_degraded(pool: dict) -> str:
    """A filter config (as filter_json writes it) whose degraded_routing pool `interactive` is `pool`."""
    cfg = json.loads(filter_json(WD))
    cfg["degraded_routing"]["pools"]["interactive"] = pool
    return json.dumps(cfg)


# Filter configs the policy never writes, given to the filter as they are: (config, the filter's
# field of the refusal or None, the message). An old config that asks the filter to spill is
# refused by name, whatever the value.
FILTER_ONLY = {
    "spill-to": (lambda: _with_degraded({"at_level": 3, "spill_to": "batch", "shed_classes": ["batch"], "probe_cluster": "pool_interactive"}),
                 "degraded_routing.pools.interactive.spill_to", "spill is Envoy's health-check failover now (remove the field)"),
    "spill-to-null": (lambda: _with_degraded({"spill_to": None}),
                      "degraded_routing.pools.interactive.spill_to", "spill is Envoy's health-check failover now (remove the field)"),
    "spill-to-self": (lambda: _with_degraded({"spill_to": "interactive", "shed_classes": ["batch"]}),
                      "degraded_routing.pools.interactive.spill_to", "spill is Envoy's health-check failover now (remove the field)"),
    # A pool that sheds nothing is still a pool the filter can keep state for (at LEVEL_DOWN).
    "no-shed": (lambda: _with_degraded({}), None, None),
}

# Regex syntax (filter_regex.py against the `regex` crate): (pattern, accepted?).
REGEXES = [
    ("", True), ("^/v1/(chat/)?completions$", True), ("(?i)^/V1/", True), ("[0-9a-f]{8}-[0-9a-f]{4}", True),
    ("\\d+\\.\\d+", True), ("^(?P<ver>v[0-9]+)/", True), ("(?<ver>v1)", True), ("a++", True), ("a**", True), ("x{2}{3}", True),
    ("^*", True), ("\\b*", True), ("(?x) a b # comment", True), ("(?U)a*", True), ("(?s-m:a)", True), ("(?R)a", True),
    ("[[:alpha:]]", True), ("[[:^alpha:]]", True), ("[[:foo:]]", True), ("[]a]", True), ("[a-]", True), ("[a&&b]", True),
    ("[a--b]", True), ("[a~~b]", True), ("[a[b]]", True), ("\\x{41}\\u0041\\U0001F600\\x41", True), ("\\<", False),
    ("(?-u)\\w", True), ("(?-u)\\x7F", True), ("a{ 1 }", True), ("(?:)", True), ("|", True), ("()", True), ("\\.", True),
    ("a{1000}", True), (".{500}", True), ("\\w{10}", True), ("\\d{100}", True), ("[a-z]{10000}", True),
    ("(", False), ("a)", False), ("[a", False), ("[]", False), ("*a", False), ("{5}", False), ("a{", False), ("a{,5}", False),
    ("a{2,1}", False), ("a{1,2,3}", False), ("x{a}", False), ("a{4294967296}", False), ("(?=a)", False), ("(?<!a)b", False),
    ("\\1", False), ("\\0", False), ("(?>a)", False), ("(?#c)a", False), ("(?z)a", False), ("(?ii)a", False), ("(?i-)a", False),
    ("(?)", False), ("(?P<a>x)(?<a>y)", False), ("(?P<1a>x)", False), ("(?P<>x)", False), ("(?P<n", False), ("\\pL", False),
    ("\\p{Greek}", False), ("[\\pL]", False), ("\\Q", False), ("\\K", False), ("\\h", False), ("\\e", False), ("\\cA", False),
    ("\\N{x}", False), ("[z-a]", False), ("[a-\\d]", False), ("[\\b]", False), ("\\x{110000}", False), ("\\x{D800}", False),
    ("\\x{}", False), ("\\x4", False), ("a\\", False), ("(?-u).", False), ("(?-u)\\W", False), ("(?-u)[^a]", False),
    ("(?-u)\\xFF", False), ("(?-u)é", False), ("(?-u)[[:^alpha:]]", False),
    ("a{100000}", False), ("(a{1000}){1000}", False), ("\\w{100}", False), ("\\d{1000}", False), (".{10000}", False),
    ("\\W{100}", False), ("\\D{1000}", False), ("(?i)\\w{100}", False),
    ("(" * 250 + "a" + ")" * 250, True), ("(" * 251 + "a" + ")" * 251, False), ("[" * 250 + "a" + "]" * 250, True),
    ("[" * 251 + "a" + "]" * 251, False), ("a" + "*" * 250, True), ("a" + "*" * 251, False),
]


# Every bounded field of the filter config (config.rs LIMITS): (the policy's field path of a
# refusal, the policy model and its field, a case with that field set to v).
BOUNDED = {
    "body.max_bytes": ("filter.body_max_bytes", FilterSpec, "body_max_bytes", lambda v: {"filter": {"body_max_bytes": v}}),
    **{f"degraded_routing.{k}": (f"filter.pool_state.{k}", PoolStateSpec, k, lambda v, k=k: WD | {"filter": {"pool_state": {k: v}}})
       for k in ("probe_interval_ms", "probe_timeout_ms", "stale_after_ms", "recover_hold_ms", "retry_after_s")},
    # A pool that sheds, so that the filter config carries it.
    "degraded_routing.pools.*.at_level": ("pools.batch.when_degraded.at_level", DegradedRouting, "at_level",
                                          lambda v: {"when_degraded": {"batch": {"at_level": v, "shed_classes": ["batch"]}}}),
    # A class's prefix key (docs/prefix-routing.md): the classes go to the filter as written.
    **{f"classes.*.prefix_key.{k}": (f"classes.interactive.prefix_key.{k}", PrefixKeySpec, k,
                                     lambda v, k=k: {"classes": CLASSES | {"interactive": {"pool": "interactive", "prefix_key": {k: v}}}})
       for k in ("max_keys", "chunk_bytes", "load_over_mean_pct", "load_floor_pct", "load_ceiling_pct")},
}

# Defaults that differ on purpose: (the policy's, the filter's, why).
DIFFERENT_DEFAULTS = {
    # The policy writes at_level for every pool it puts in degraded_routing
    # (test_the_policy_writes_every_at_level): the filter's default is for a pool it keeps
    # state for only, which no policy writes.
    "degraded_routing.pools.*.at_level": (3, LEVEL_DOWN, "policy: critical only; filter: a pool kept for its state only"),
}


def policy_bounds(model, name: str) -> tuple[int, int, object]:
    """(min, max, default) of a policy field: its JSON schema's bounds (what `policy check`
    documents and the chart's values schema holds) and its default."""
    prop = model.model_json_schema()["properties"][name]
    return prop["minimum"], prop["maximum"], model.model_fields[name].default


def bound_cases() -> list[tuple[str, dict, bool, str | None]]:
    """Each bounded field at its policy bounds and one past them: the filter must agree."""
    out = []
    for field, (path, model, name, case) in BOUNDED.items():
        lo, hi, _ = policy_bounds(model, name)
        for v in [lo - 1] * (lo > 0) + [lo, hi, hi + 1]:
            ok = lo <= v <= hi
            # at_level is worded as the policy's other when_degraded checks (pydantic's).
            prefix = "when-degraded-bound" if "when_degraded" in path else "bound"
            out.append((f"{prefix}-{field}={v}", case(v), ok, None if ok else path))
    return out


def _rules(n: int, pattern: str, first: dict | None = None) -> list[dict]:
    """n rules, each with a path regex `pattern` ({i}: the rule's index); `first` replaces rule 0's match."""
    rules = [{"name": f"r{i}", "class": "batch", "match": {"path": {"regex": pattern.replace("{i}", str(i))}}} for i in range(n)]
    if first is not None:
        rules[0]["match"] = first
    return rules


# A config's regexes share config.rs REGEX_TOTAL_SIZE_LIMIT: one `a{1000}{10}` is fine alone, a
# hundred are not (each may have 16 MiB / 100); ordinary patterns stay small however many.
REGEX_BUDGET = {
    "regex-budget-path": (_rules(100, "a{1000}{10}"), "rules.0.match.path.regex"),
    "regex-budget-header": (_rules(100, "a{1000}{10}", {"headers": [{"name": "x-a", "regex": "a{1000}{10}"}]}), "rules.0.match.headers.0.regex"),
    "regex-budget-body": (_rules(100, "a{1000}{10}", {"path": {"prefix": "/"}, "body": {"service_tier": {"regex": "a{1000}{10}"}}}),
                          "rules.0.match.body.service_tier.regex"),
    "valid-regex-budget-one": (_rules(1, "a{1000}{10}"), None),
    "valid-regex-budget-ordinary": (_rules(300, "^/v1/m{i}/(chat/)?completions$"), None),
}


def content_model(labels=("code", "chat"), dim=256, **over) -> dict:
    """A content model's JSON (docs/content-classes.md), zero weights of the right length, `over` set as given."""
    obj = {"version": 1, "labels": list(labels), "dim": dim, "word_ngrams": 2, "char_ngrams": [3, 4], "max_text_bytes": 4096,
           "scale": 0.01, "bias": [0.0] * len(labels), "weights": base64.b64encode(bytes(dim * len(labels))).decode()}
    return obj | over


def content_rule(**content) -> list[dict]:
    return rule(content=content)


def with_model(rules: list[dict] | None = None, **model) -> dict:
    return {"content_model": content_model(**model)} | ({"rules": rules} if rules is not None else {})


LABELS_16 = tuple(f"l{i}" for i in range(16))

# The content classifier (issue 32): a policy's top-level `content_model` and rules' `match.content`
# (the filter: content_classifier.rs ContentModel::from_raw, config.rs content_match).
CONTENT_VALID = {
    "content-rule": with_model(content_rule(label="code", min_score=0.6)),
    "content-default-score": with_model(content_rule(label="chat")),
    "content-min-score-int": with_model(content_rule(label="chat", min_score=1)),
    "content-min-score-zero": with_model(content_rule(label="chat", min_score=0)),
    "content-with-other-conditions": with_model(rule(methods=["POST"], path={"prefix": "/v1/"}, body={"stream": False},
                                                     content={"label": "code", "min_score": 0.25})),
    "content-model-unused": with_model(),
    "content-model-null": {"content_model": None},
    "content-model-words-only": with_model(word_ngrams=1, char_ngrams=[0, 0]),
    "content-model-chars-2-6": with_model(char_ngrams=[2, 6]),
    "content-model-chars-one-n": with_model(char_ngrams=[5, 5]),
    "content-model-16-labels": with_model(content_rule(label="l15"), labels=LABELS_16),
    "content-model-label-64": with_model(content_rule(label="a" * 64), labels=("a" * 64, "b-_9Z")),
    "content-model-scale-int": with_model(scale=3, bias=[1, -2]),
    "content-model-tiny-scale": with_model(scale=5e-324),
}
CONTENT_INVALID = {
    "content-no-model": ({"rules": content_rule(label="code")}, "rules.0.match.content"),
    "content-unknown-label": (with_model(content_rule(label="support")), "rules.0.match.content.label"),
    "content-min-score-over": (with_model(content_rule(label="code", min_score=1.5)), "rules.0.match.content.min_score"),
    "content-min-score-negative": (with_model(content_rule(label="code", min_score=-0.1)), "rules.0.match.content.min_score"),
    "content-min-score-string": (with_model(content_rule(label="code", min_score="high")), "rules.0.match.content.min_score"),
    "content-min-score-bool": (with_model(content_rule(label="code", min_score=True)), "rules.0.match.content.min_score"),
    "content-missing-label": (with_model(content_rule(min_score=0.5)), "rules.0.match.content.label"),
    "content-label-type": (with_model(content_rule(label=1)), "rules.0.match.content.label"),
    "content-unknown-key": (with_model(content_rule(label="code", score=0.5)), "rules.0.match.content.score"),
    "content-not-object": (with_model(rule(content="code")), "rules.0.match.content"),
    "content-second-rule": (with_model([R, {"name": "s", "class": "batch", "match": {"content": {"label": "nope"}}}]),
                            "rules.1.match.content.label"),
    "content-model-version": (with_model(version=2), "content_model.version"),
    "content-model-one-label": ({"content_model": content_model(labels=("code",))}, "content_model.labels"),
    "content-model-17-labels": ({"content_model": content_model(labels=LABELS_16 + ("l16",))}, "content_model.labels"),
    "content-model-label-token": ({"content_model": content_model(labels=("code", "chat bot"))}, "content_model.labels.1"),
    "content-model-label-empty": ({"content_model": content_model(labels=("", "chat"))}, "content_model.labels.0"),
    "content-model-label-65": ({"content_model": content_model(labels=("code", "a" * 65))}, "content_model.labels.1"),
    "content-model-label-duplicate": ({"content_model": content_model(labels=("code", "chat", "code"))}, "content_model.labels.2"),
    "content-model-dim-not-power": (with_model(dim=384), "content_model.dim"),
    "content-model-dim-type": ({"content_model": content_model() | {"dim": "256"}}, "content_model.dim"),
    "content-model-char-1": (with_model(char_ngrams=[1, 2]), "content_model.char_ngrams"),
    "content-model-char-0-3": (with_model(char_ngrams=[0, 3]), "content_model.char_ngrams"),
    "content-model-char-7": (with_model(char_ngrams=[2, 7]), "content_model.char_ngrams"),
    "content-model-char-inverted": (with_model(char_ngrams=[4, 3]), "content_model.char_ngrams"),
    "content-model-char-one": (with_model(char_ngrams=[3]), "content_model.char_ngrams"),
    "content-model-char-three": (with_model(char_ngrams=[2, 3, 4]), "content_model.char_ngrams"),
    "content-model-scale-zero": (with_model(scale=0), "content_model.scale"),
    "content-model-scale-negative": (with_model(scale=-0.5), "content_model.scale"),
    "content-model-scale-string": (with_model(scale="0.1"), "content_model.scale"),
    "content-model-bias-short": (with_model(bias=[0.0]), "content_model.bias"),
    "content-model-bias-long": (with_model(bias=[0.0, 0.0, 0.0]), "content_model.bias"),
    "content-model-weights-short": (with_model(weights=base64.b64encode(bytes(511)).decode()), "content_model.weights"),
    "content-model-weights-long": (with_model(weights=base64.b64encode(bytes(513)).decode()), "content_model.weights"),
    "content-model-weights-alphabet": (with_model(weights="!!!!" * 171), "content_model.weights"),
    "content-model-weights-unpadded": (with_model(weights=base64.b64encode(bytes(512)).decode().rstrip("=")), "content_model.weights"),
    "content-model-weights-urlsafe": (with_model(weights=base64.urlsafe_b64encode(b"\xff" * 512).decode()), "content_model.weights"),
    "content-model-weights-type": (with_model(weights=[0] * 512), "content_model.weights"),
    "content-model-unknown-field": (with_model(extra=1), "content_model.extra"),
    "content-model-missing-weights": ({"content_model": {k: v for k, v in content_model().items() if k != "weights"}},
                                      "content_model.weights"),
    "content-model-not-object": ({"content_model": "content-model.json"}, "content_model"),
}


def content_bound_cases() -> list[tuple[str, dict, bool, str | None]]:
    """Each bound of a content model, and min_score's, at its ends and one past them."""
    out = []
    for v in (cm.DIM_MIN // 2, cm.DIM_MIN, cm.DIM_MAX, cm.DIM_MAX * 2):
        # Past the bounds the weights are not looked at (both check dim first): keep them small.
        ok = cm.DIM_MIN <= v <= cm.DIM_MAX
        out.append((f"content-bound-dim={v}", with_model(dim=v) if ok else with_model(dim=v, weights=""), ok, None if ok else "content_model.dim"))
    for v in (cm.MAX_TEXT_MIN - 1, cm.MAX_TEXT_MIN, cm.MAX_TEXT_MAX, cm.MAX_TEXT_MAX + 1):
        ok = cm.MAX_TEXT_MIN <= v <= cm.MAX_TEXT_MAX
        out.append((f"content-bound-max_text_bytes={v}", with_model(max_text_bytes=v), ok, None if ok else "content_model.max_text_bytes"))
    for v in (0, 1, 2, 3):
        out.append((f"content-bound-word_ngrams={v}", with_model(word_ngrams=v), 1 <= v <= 2, None if 1 <= v <= 2 else "content_model.word_ngrams"))
    for k in (cm.MIN_LABELS - 1, cm.MIN_LABELS, cm.MAX_LABELS, cm.MAX_LABELS + 1):
        ok = cm.MIN_LABELS <= k <= cm.MAX_LABELS
        out.append((f"content-bound-labels={k}", with_model(labels=tuple(f"l{i}" for i in range(k))), ok, None if ok else "content_model.labels"))
    for lo, hi in ((2, cm.CHAR_NGRAM_MAX), (2, cm.CHAR_NGRAM_MAX + 1), (cm.CHAR_NGRAM_MAX, cm.CHAR_NGRAM_MAX), (1, 1), (0, 0)):
        ok = (lo, hi) == (0, 0) or 2 <= lo <= hi <= cm.CHAR_NGRAM_MAX
        out.append((f"content-bound-char_ngrams={lo},{hi}", with_model(char_ngrams=[lo, hi]), ok, None if ok else "content_model.char_ngrams"))
    for v in (-0.01, 0.0, 1.0, 1.01):
        ok = 0 <= v <= 1
        out.append((f"content-bound-min_score={v}", with_model(content_rule(label="code", min_score=v)), ok,
                    None if ok else "rules.0.match.content.min_score"))
    return out


# Token budgets (docs/token-budgets.md): the policy's `budgets`, the filter's `budgets`.
HDR = {"header": "x-tenant-id"}
TEAM_A_HASH = "8879f6a4ae35c420"  # sha256(b"sk-team-a")[:16]


def budgets(classes: dict, tenant: dict | None = None) -> dict:
    return {"budgets": {"tenant": HDR if tenant is None else tenant, "classes": classes}}


def batch_budget(**cb) -> dict:
    return budgets({"batch": cb})


STREAMS = {"concurrent_streams": 2}
BUDGET_VALID = {
    "budget-design-example": budgets({"batch": {"default": {"tokens": {"per_minute": 200000, "per_day": 20000000}, "count": {"input": 1, "output": 1},
                                                            "concurrent_streams": 16},
                                                "tenants": {"team-a": {"tokens": {"per_minute": 50000}, "concurrent_streams": 4}}}}),
    "budget-streams-only": batch_budget(default=STREAMS),
    "budget-tenants-only": batch_budget(tenants={"team-a": {"tokens": {"per_hour": 10}}}),
    "budget-output-only": batch_budget(default={"tokens": {"per_day": 1}, "count": {"input": 0, "output": 1}}),
    "budget-input-only": batch_budget(default={"tokens": {"per_day": 1}, "count": {"input": 7}}),
    "budget-two-classes": budgets({"batch": {"default": STREAMS}, "interactive": {"tenants": {"team-a": STREAMS, "team_b-2": STREAMS}}}),
    "budget-api-key": budgets({"interactive": {"tenants": {TEAM_A_HASH: {"tokens": {"per_minute": 5}}}, "default": STREAMS}}, {"api_key_hash": True}),
    "budget-tenant-64": batch_budget(tenants={"t" * 64: STREAMS}),
    "budget-null-windows": batch_budget(default={"tokens": {"per_minute": None, "per_hour": 3}}),
    "budget-256-tenants": batch_budget(tenants={f"t{i}": STREAMS for i in range(BUDGET_MAX_TENANTS)}),
}
BUDGET_INVALID = {
    "budget-tenant-none": (budgets({"batch": {"default": STREAMS}}, {}), "budgets.tenant"),
    "budget-tenant-both": (budgets({"batch": {"default": STREAMS}}, {"header": "x-t", "api_key_hash": True}), "budgets.tenant"),
    "budget-tenant-hash-false": (budgets({"batch": {"default": STREAMS}}, {"api_key_hash": False}), "budgets.tenant.api_key_hash"),
    "budget-tenant-header-upper": (budgets({"batch": {"default": STREAMS}}, {"header": "X-Tenant"}), "budgets.tenant.header"),
    "budget-tenant-header-empty": (budgets({"batch": {"default": STREAMS}}, {"header": ""}), "budgets.tenant.header"),
    "budget-tenant-header-type": (budgets({"batch": {"default": STREAMS}}, {"header": 7}), "budgets.tenant.header"),
    "budget-tenant-unknown-key": (budgets({"batch": {"default": STREAMS}}, {"claim": "sub"}), "budgets.tenant.claim"),
    "budget-missing-tenant": ({"budgets": {"classes": {"batch": {"default": STREAMS}}}}, "budgets.tenant"),
    "budget-unknown-field": ({"budgets": {"tenant": HDR, "classes": {"batch": {"default": STREAMS}}, "on_unavailable": "open"}},
                             "budgets.on_unavailable"),
    "budget-no-classes": (budgets({}), "budgets.classes"),
    "budget-class-unknown": (budgets({"premium": {"default": STREAMS}}), "budgets.classes.premium"),
    "budget-class-empty": (batch_budget(), "budgets.classes.batch"),
    "budget-class-unknown-field": (batch_budget(default=STREAMS, defaults=STREAMS), "budgets.classes.batch.defaults"),
    "budget-empty": (batch_budget(default={}), "budgets.classes.batch.default"),
    "budget-count-only": (batch_budget(default={"count": {"input": 1}}), "budgets.classes.batch.default"),
    "budget-tokens-empty": (batch_budget(default={"tokens": {}}), "budgets.classes.batch.default.tokens"),
    "budget-tokens-unknown-window": (batch_budget(default={"tokens": {"per_second": 5}}), "budgets.classes.batch.default.tokens.per_second"),
    "budget-tokens-type": (batch_budget(default={"tokens": {"per_minute": "5"}}), "budgets.classes.batch.default.tokens.per_minute"),
    "budget-tokens-float": (batch_budget(default={"tokens": {"per_minute": 5.0}}), "budgets.classes.batch.default.tokens.per_minute"),
    "budget-tokens-negative": (batch_budget(default={"tokens": {"per_minute": -5}}), "budgets.classes.batch.default.tokens.per_minute"),
    "budget-count-zero": (batch_budget(default={"concurrent_streams": 1, "count": {"input": 0, "output": 0}}), "budgets.classes.batch.default.count"),
    "budget-count-unknown": (batch_budget(default={"concurrent_streams": 1, "count": {"cached": 0}}), "budgets.classes.batch.default.count.cached"),
    "budget-streams-type": (batch_budget(default={"concurrent_streams": True}), "budgets.classes.batch.default.concurrent_streams"),
    "budget-tenant-name": (batch_budget(tenants={"team a": STREAMS}), "budgets.classes.batch.tenants.team a"),
    "budget-tenant-name-65": (batch_budget(tenants={"t" * 65: STREAMS}), "budgets.classes.batch.tenants." + "t" * 65),
    "budget-tenant-other": (batch_budget(tenants={BUDGET_OTHER: STREAMS}), "budgets.classes.batch.tenants.other"),
    "budget-tenant-budget-empty": (batch_budget(tenants={"team-a": {}}), "budgets.classes.batch.tenants.team-a"),
    "budget-tenant-window": (batch_budget(tenants={"team-a": {"tokens": {"per_day": 0}}}), "budgets.classes.batch.tenants.team-a.tokens.per_day"),
    "budget-too-many-tenants": (batch_budget(tenants={f"t{i}": STREAMS for i in range(BUDGET_MAX_TENANTS + 1)}), "budgets.classes.batch.tenants"),
    "budget-api-key-name": (budgets({"batch": {"tenants": {"team-a": STREAMS}}}, {"api_key_hash": True}), "budgets.classes.batch.tenants.team-a"),
    "budget-api-key-upper": (budgets({"batch": {"tenants": {TEAM_A_HASH.upper(): STREAMS}}}, {"api_key_hash": True}),
                             f"budgets.classes.batch.tenants.{TEAM_A_HASH.upper()}"),
    "budget-not-object": ({"budgets": "on"}, "budgets"),
}

# Every bounded field of the filter's budgets (config.rs BUDGET_LIMITS): (the policy's field path
# of a refusal, the policy model and its field, a case with that field set to v). A class's
# default_max_tokens is its pool's serving.default_max_tokens (BUDGET_FROM_THE_POOL).
BUDGET_BOUNDED = {
    **{f"budgets.classes.*.*.tokens.{k}": (f"budgets.classes.batch.default.tokens.{k}", BudgetTokens, k,
                                          lambda v, k=k: batch_budget(default={"tokens": {k: v}}))
       for k in ("per_minute", "per_hour", "per_day")},
    **{f"budgets.classes.*.*.count.{k}": (f"budgets.classes.batch.tenants.team-a.count.{k}", BudgetCount, k,
                                         lambda v, k=k: batch_budget(tenants={"team-a": {"concurrent_streams": 1, "count": {k: v}}}))
       for k in ("input", "output")},
    "budgets.classes.*.*.concurrent_streams": ("budgets.classes.batch.default.concurrent_streams", Budget, "concurrent_streams",
                                               lambda v: batch_budget(default={"concurrent_streams": v})),
}
BUDGET_FROM_THE_POOL = "budgets.classes.*.default_max_tokens"


def budget_bound_cases() -> list[tuple[str, dict, bool, str | None]]:
    out = []
    for field, (path, model, name, case) in BUDGET_BOUNDED.items():
        lo, hi = budget_policy_bounds(model, name)
        for v in [lo - 1] * (lo > 0) + [lo, hi, hi + 1]:
            ok = lo <= v <= hi
            out.append((f"budget-bound-{field}={v}", case(v), ok, None if ok else path))
    return out


def budget_policy_bounds(model, name: str) -> tuple[int, int]:
    """A budget field's bounds from its JSON schema (an optional field's are in its anyOf)."""
    prop = model.model_json_schema()["properties"][name]
    bounded = next(p for p in [prop, *prop.get("anyOf", [])] if "minimum" in p)
    return bounded["minimum"], bounded["maximum"]


def corpus() -> list[tuple[str, dict, bool, str | None]]:
    """(id, case, the filter should accept it, the policy's field of the refusal)."""
    out = [(f"valid-{k}", {"rules": v}, True, None) for k, v in VALID.items()]
    out += [(k, {"rules": v}, False, f) for k, (v, f) in INVALID.items()]
    out += [(f"valid-{k}", v, True, None) for k, v in OTHER_VALID.items()]
    out += [(k, v, False, f) for k, (v, f) in OTHER_INVALID.items()]
    out += [(f"regex-{i}", {"rules": rule(path={"regex": p})}, ok, None if ok else "rules.0.match.path.regex")
            for i, (p, ok) in enumerate(REGEXES)]
    out += [(f"stricter-{k}", {"rules": v}, True, f) for k, (v, f) in STRICTER.items()]
    out += [(f"policy-only-{k}", v, True, f) for k, (v, f) in POLICY_ONLY.items()]
    out += bound_cases()
    out += [(k, {"rules": v}, f is None, f) for k, (v, f) in REGEX_BUDGET.items()]
    out += [(f"valid-{k}", v, True, None) for k, v in CONTENT_VALID.items()]
    out += [(k, v, False, f) for k, (v, f) in CONTENT_INVALID.items()]
    out += content_bound_cases()
    out += [(f"valid-{k}", v, True, None) for k, v in BUDGET_VALID.items()]
    out += [(k, v, False, f) for k, (v, f) in BUDGET_INVALID.items()]
    out += budget_bound_cases()
    return out


def policy_text(case: dict) -> str:
    doc = {
        "version": case.get("version", 1),
        "default_class": case.get("default_class", "batch"),
        "classes": case.get("classes", CLASSES),
        "rules": case.get("rules", []),
        "pools": {n: {"models": [{"name": "m"}]} | ({"when_degraded": case["when_degraded"][n]} if n in case.get("when_degraded", {}) else {})
                  for n in ("interactive", "batch")},
    }
    if "filter" in case:
        doc["filter"] = case["filter"]
    if "content_model" in case:
        doc["content_model"] = case["content_model"]
    if "budgets" in case:
        doc["budgets"] = case["budgets"]
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False, width=2**30)


def filter_json(case: dict) -> str:
    """The filter config the case stands for, written the way Policy.filter_config() writes it."""
    f = case.get("filter", {})
    cfg = {
        "version": case.get("version", 1),
        "default_class": case.get("default_class", "batch"),
        "classes": case.get("classes", CLASSES),
        "rules": case.get("rules", []),
        "body": {"max_bytes": f.get("body_max_bytes", 262144)},
        "emit_objective_header": f.get("emit_objective_header", False),
    }
    if f.get("trusted_cidrs") or f.get("trusted_principals"):
        cfg["trusted_sources"] = {"cidrs": f.get("trusted_cidrs", []), "principals": f.get("trusted_principals", [])}
    # Only the pools that shed, without spill_to (Envoy's failover); a pool that spills is probed
    # through its state cluster (its own endpoints, no failover), envoy_resources.state_cluster_name.
    shedding = {n: wd for n, wd in case.get("when_degraded", {}).items() if wd.get("shed_classes")}
    if shedding:
        at_level = DegradedRouting.model_fields["at_level"].default
        pools = {n: {"at_level": wd.get("at_level", at_level), "shed_classes": wd["shed_classes"],
                     "probe_cluster": f"pool_{n}_state" if wd.get("spill_to") else f"pool_{n}"} for n, wd in shedding.items()}
        cfg["degraded_routing"] = {"pools": pools, **PoolStateSpec().model_dump(), **f.get("pool_state", {})}
    if case.get("content_model") is not None:
        cfg["content_model"] = case["content_model"]
    if case.get("budgets") is not None:
        cfg["budgets"] = _budgets_json(case["budgets"])
    return json.dumps(cfg)


def _budgets_json(b):
    """The case's budgets as Policy.budgets_config writes them: each class with its pool's
    default_max_tokens (the cases' pools serve with the default), each budget's `count` complete
    and its windows without nulls; a part of another shape is passed as it is."""
    if not isinstance(b, dict) or not isinstance(b.get("classes"), dict):
        return b

    def budget(x):
        if not isinstance(x, dict):
            return x
        out = dict(x)
        if isinstance(out.get("tokens"), dict):
            out["tokens"] = {k: v for k, v in out["tokens"].items() if v is not None}
        count = out.get("count", {})
        out["count"] = {"input": 1, "output": 1} | count if isinstance(count, dict) else count
        return out

    classes = {}
    for name, c in b["classes"].items():
        if not isinstance(c, dict):
            classes[name] = c
            continue
        entry = {"default_max_tokens": ServingSettings().default_max_tokens} | {k: v for k, v in c.items() if k not in ("default", "tenants")}
        if "default" in c:
            entry["default"] = budget(c["default"])
        if c.get("tenants"):
            entry["tenants"] = {t: budget(x) for t, x in c["tenants"].items()} if isinstance(c["tenants"], dict) else c["tenants"]
        classes[name] = entry
    return {k: v for k, v in b.items() if k != "classes"} | {"classes": classes}


_SECTION = {"filter.body_max_bytes": "body.max_bytes", "filter.trusted_cidrs": "trusted_sources.cidrs",
            "filter.trusted_principals": "trusted_sources.principals", "filter.pool_state": "degraded_routing"}


def filter_path(policy_field: str) -> str:
    """The filter's name for a policy field path: `rules.0.match.headers.1` -> `rules[0].match.headers[1]`,
    the policy's `filter` section -> the filter config's `body` and `trusted_sources`."""
    for ours, theirs in _SECTION.items():
        if policy_field == ours or policy_field.startswith(ours + "."):
            policy_field = theirs + policy_field[len(ours):]
    policy_field = re.sub(r"^pools\.([^.]+)\.when_degraded", r"degraded_routing.pools.\1", policy_field)
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", policy_field)


def policy_verdict(case: dict) -> tuple[bool, str | None, str | None]:
    try:
        parse_policy(policy_text(case), "contract.yaml")
    except PolicyError as e:
        line, field, msg = e.problems[0]
        assert line is not None, e
        return False, field, msg
    return True, None, None


def _cargo() -> str | None:
    # rustup's cargo (the native toolchain); /usr/bin/cargo is Debian's, kept for the wasm32 build.
    home = Path(os.environ.get("CARGO_HOME", Path.home() / ".cargo")) / "bin" / "cargo"
    return str(home) if home.exists() else shutil.which("cargo")


@pytest.fixture(scope="module")
def filter_limits() -> dict:
    """config.rs's limits and defaults, as the filter reports them (config::limits())."""
    cargo = _cargo()
    if cargo is None:
        pytest.skip("no cargo: the filter's parser cannot be built here")
    r = subprocess.run([cargo, "run", "--release", "--quiet", "--example", "config_limits"], cwd=FILTER,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def filter_verdicts() -> dict[str, dict]:
    cargo = _cargo()
    if cargo is None:
        pytest.skip("no cargo: the filter's parser cannot be built here")
    docs = [(cid, filter_json(c)) for cid, c, _, _ in corpus()] + [(f"filter-only-{k}", v[0]()) for k, v in FILTER_ONLY.items()]
    r = subprocess.run([cargo, "run", "--release", "--quiet", "--example", "check_config"], cwd=FILTER,
                       input="".join(doc + "\n" for _, doc in docs), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == len(docs), r.stderr[-3000:]
    return {cid: json.loads(line) for (cid, _), line in zip(docs, lines)}


def _same_message(policy_msg: str, filter_msg: str) -> bool:
    if filter_msg.startswith("invalid regex:"):
        shared = " (the config's regexes share 16 MiB of compiled size)"
        return policy_msg.startswith("invalid regex:") and policy_msg.endswith(shared) == filter_msg.endswith(shared)
    return policy_msg == filter_msg


@pytest.mark.parametrize("cid, case, accepted, field", corpus(), ids=[c[0] for c in corpus()])
def test_policy_and_filter_agree(filter_verdicts, cid, case, accepted, field):
    ours = policy_verdict(case)
    theirs = filter_verdicts[cid]
    assert theirs["ok"] is accepted, f"the corpus expects the filter to {'accept' if accepted else 'refuse'} it: {theirs}"
    if cid.startswith(("stricter-", "policy-only-")):
        assert ours[:2] == (False, field), ours
        return
    assert ours[0] is accepted, f"policy: {ours}"
    if accepted:
        return
    assert ours[1] == field, f"policy names {ours[1]!r}: {ours[2]}"
    assert filter_path(ours[1]) == theirs["at"], f"filter: {theirs}"
    # when_degraded's references and level are worded as the policy's other references (the
    # filter checks what the policy generated, in its own words).
    if theirs["field"] != "$" and not cid.startswith(("version", "class", "default-class", "when-degraded")):
        assert _same_message(ours[2], theirs["message"]), f"policy: {ours[2]!r}, filter: {theirs['message']!r}"


@pytest.mark.parametrize("name", FILTER_ONLY)
def test_the_filter_refuses_what_the_policy_no_longer_writes(filter_verdicts, name):
    _, field, message = FILTER_ONLY[name]
    theirs = filter_verdicts[f"filter-only-{name}"]
    if field is None:
        assert theirs == {"ok": True}, theirs
    else:
        assert theirs == {"ok": False, "field": field, "message": message, "at": field}, theirs


@pytest.mark.parametrize("cid", list(BUDGET_VALID))
def test_budgets_json_is_what_the_policy_writes(cid):
    """filter_json's budgets are Policy.budgets_config's: the corpus gives the filter what the policy would."""
    case = BUDGET_VALID[cid]
    assert parse_policy(policy_text(case), "contract.yaml").filter_config()["budgets"] == json.loads(filter_json(case))["budgets"]


def test_a_policy_without_budgets_writes_none_and_the_chart_schema_leaves_them_out():
    """Budgets are plain Envoy's in this slice: not in the JSON schema the chart's values.schema.json is made from."""
    from infermesh.meshconfig.policy import Policy  # noqa: PLC0415 — the one test that needs the whole model
    assert "budgets" not in parse_policy(policy_text({}), "contract.yaml").filter_config()
    assert "budgets" not in Policy.model_json_schema()["properties"]


def test_the_policy_holds_the_filters_budget_limits(filter_limits):
    """config.rs's budget bounds and defaults are the policy model's, field by field, both ways."""
    theirs = filter_limits["budgets"]
    assert set(theirs["bounded"]) == set(BUDGET_BOUNDED) | {BUDGET_FROM_THE_POOL}
    for field, (_, model, name, _) in BUDGET_BOUNDED.items():
        lo, hi = budget_policy_bounds(model, name)
        t = theirs["bounded"][field]
        assert (lo, hi) == (t["min"], t["max"]), f"{field}: policy {lo}..{hi}, filter {t['min']}..{t['max']}"
        default = model.model_fields[name].default
        # An optional limit is absent (None) in the policy, 0 ("not limited") in the filter's table.
        assert (0 if default is None else default) == t["default"] == theirs["defaults"][field], field
    for model in (BudgetTokens, BudgetCount, Budget):
        bounded = {n for n, p in model.model_json_schema()["properties"].items()
                   if "minimum" in p or any("minimum" in q for q in p.get("anyOf", []))}
        assert bounded == {n for _, m, n, _ in BUDGET_BOUNDED.values() if m is model}, model.__name__
    # default_max_tokens: the pool's serving default, within the filter's bound.
    pool = theirs["bounded"][BUDGET_FROM_THE_POOL]
    assert (pool["min"], pool["max"], pool["default"]) == (1, BUDGET_MAX_TOKENS_MAX, ServingSettings().default_max_tokens)
    assert ServingSettings.model_json_schema()["properties"]["default_max_tokens"]["exclusiveMinimum"] == 0
    assert theirs["defaults"][BUDGET_FROM_THE_POOL] == ServingSettings().default_max_tokens
    assert theirs["defaults"]["budgets.classes.*.tenants"] == len(ClassBudget.model_fields["tenants"].default) == 0
    assert theirs["max_tenants"] == BUDGET_MAX_TENANTS
    assert theirs["reserved_tenant"] == BUDGET_OTHER
    assert set(theirs) == {"bounded", "defaults", "max_tenants", "windows", "message_overhead", "tenant_slots", "reserved_tenant"}
    assert [w for w, _ in theirs["windows"]] == list(BudgetTokens.model_fields)


@pytest.mark.parametrize("cid", [k for k, v in OTHER_VALID.items() if "when_degraded" in v] + list(POLICY_ONLY))
def test_filter_json_is_what_the_policy_writes(cid):
    """filter_json's degraded_routing is Policy.degraded_routing's (for a policy that parses): the
    corpus gives the filter what the policy would."""
    case = OTHER_VALID.get(cid) or POLICY_ONLY[cid][0]
    ours = json.loads(filter_json(case)).get("degraded_routing")
    if cid in POLICY_ONLY:
        assert ours is None or "spill_to" not in json.dumps(ours)
        return
    assert parse_policy(policy_text(case), "contract.yaml").filter_config().get("degraded_routing") == ours
    assert "spill_to" not in json.dumps(ours)


# Each check of config.rs (FilterConfig::parse, string_match, check_range, check_token, Cidr::parse)
# and the corpus cases that exercise it.
BRANCHES = {
    "serde: unknown field": ["rule-unknown-field", "match-unknown-field", "path-unknown-key", "header-unknown-key", "body-unknown-field",
                             "range-unknown-key", "class-unknown-field"],
    "serde: missing field": ["rule-missing-name", "rule-missing-class", "header-missing-name"],
    "serde: wrong type": ["rule-name-type", "rule-class-type", "rules-not-a-list", "match-null", "methods-string", "methods-item-type",
                          "methods-null", "path-exact-type", "path-string", "headers-object", "header-name-type", "header-present-type",
                          "header-exact-type", "body-list", "body-stream-string", "body-stream-int", "body-stream-object", "range-negative",
                          "range-fraction", "range-float", "range-over-u64", "range-string", "range-bool", "range-int", "model-string",
                          "service-tier-type"],
    "version": ["version"],
    "classes empty": ["classes-empty"],
    "check_token classes.NAME / .pool / .objective": ["class-name", "class-pool-token", "class-objective-token"],
    "default_class unknown": ["default-class"],
    "check_token rules[i].name": ["rule-name-empty", "rule-name-65", "rule-name-space", "rule-name-unicode"],
    "reserved rule name": ["rule-name-default", "rule-name-trusted"],
    "duplicate rule name": ["rule-name-duplicate"],
    "rules[i].class unknown": ["rule-class-unknown"],
    "string_match: not exactly one": ["path-two", "path-three", "path-none", "path-all-null", "model-two", "model-none", "priority-two",
                                      "service-tier-two", "header-two-values"],
    "string_match: invalid regex": ["path-regex-invalid", "header-regex-invalid", "model-regex-invalid", "priority-regex-invalid",
                                    "service-tier-regex-size"],
    "path must start with /": ["path-exact-relative", "path-prefix-relative"],
    "header name": ["header-name-upper", "header-name-empty", "header-name-space", "header-name-unicode", "header-name-del"],
    "present: false with a value": ["header-absent-with-value", "header-absent-with-two"],
    "check_range: empty": ["range-empty", "range-all-null", "prompt-chars-empty"],
    "check_range: min above max": ["range-inverted", "n-inverted", "message-count-inverted"],
    "body.max_bytes": ["body-limit-zero", "body-limit-over"],
    "trusted_sources.cidrs": ["cidr-prefix", "cidr-v6-prefix", "cidr-name", "cidr-space", "cidr-prefix-space", "cidr-zone",
                              "cidr-leading-zero", "cidr-empty-prefix"],
    "trusted_sources.principals": ["principal-empty"],
    "string_match: the shared regex budget": ["regex-budget-path", "regex-budget-header", "regex-budget-body"],
    "degraded_routing bounds": ["pool-state-interval", "pool-state-interval-over", "pool-state-timeout", "pool-state-stale",
                                "pool-state-hold", "pool-state-retry-after"]
                               + [c[0] for c in bound_cases() if c[0].startswith("bound-degraded_routing.") and not c[2]],
    "degraded_routing.pools.P.at_level": ["when-degraded-level-zero", f"when-degraded-bound-degraded_routing.pools.*.at_level={LEVEL_DOWN + 1}"],
    "degraded_routing.pools.P.spill_to": ["filter-only-spill-to", "filter-only-spill-to-null", "filter-only-spill-to-self"],
    "degraded_routing.pools.P.shed_classes[i]": ["when-degraded-shed-unknown"],
    "content_match: no content_model": ["content-no-model"],
    "content_match: unknown label": ["content-unknown-label", "content-second-rule"],
    "content_match: min_score": ["content-min-score-over", "content-min-score-negative"],
    "content_model: version": ["content-model-version"],
    "content_model: labels": ["content-model-one-label", "content-model-17-labels"],
    "content_model: labels[i] token": ["content-model-label-token", "content-model-label-empty", "content-model-label-65"],
    "content_model: labels[i] duplicate": ["content-model-label-duplicate"],
    "content_model: dim": ["content-model-dim-not-power", "content-bound-dim=128", "content-bound-dim=524288"],
    "content_model: word_ngrams": ["content-bound-word_ngrams=0", "content-bound-word_ngrams=3"],
    "content_model: char_ngrams": ["content-model-char-1", "content-model-char-0-3", "content-model-char-7", "content-model-char-inverted",
                                   "content-model-char-one", "content-model-char-three"],
    "content_model: max_text_bytes": ["content-bound-max_text_bytes=63", "content-bound-max_text_bytes=65537"],
    "content_model: scale": ["content-model-scale-zero", "content-model-scale-negative"],
    "content_model: bias": ["content-model-bias-short", "content-model-bias-long"],
    "content_model: weights length": ["content-model-weights-short", "content-model-weights-long"],
    "content_model: weights base64": ["content-model-weights-alphabet", "content-model-weights-unpadded", "content-model-weights-urlsafe"],
    "budgets.tenant: exactly one": ["budget-tenant-none", "budget-tenant-both"],
    "budgets.tenant.api_key_hash false": ["budget-tenant-hash-false"],
    "budgets.tenant.header name": ["budget-tenant-header-upper", "budget-tenant-header-empty"],
    "budgets.classes empty": ["budget-no-classes"],
    "budgets.classes.C unknown": ["budget-class-unknown"],
    "budgets.classes.C neither default nor tenants": ["budget-class-empty"],
    "budgets.classes.C.tenants too many": ["budget-too-many-tenants"],
    "budgets.classes.C.tenants.T token": ["budget-tenant-name", "budget-tenant-name-65"],
    "budgets.classes.C.tenants.T other": ["budget-tenant-other"],
    "budgets.classes.C.tenants.T api_key_hash": ["budget-api-key-name", "budget-api-key-upper"],
    "budget: neither tokens nor streams": ["budget-empty", "budget-count-only", "budget-tenant-budget-empty"],
    "budget.tokens: no window": ["budget-tokens-empty"],
    "budget bounds": ["budget-tenant-window"] + [c[0] for c in budget_bound_cases() if not c[2]],
    "budget.count both 0": ["budget-count-zero"],
}


def test_corpus_covers_every_check_of_the_filters_parser():
    ids = {c[0] for c in corpus()} | {f"filter-only-{k}" for k in FILTER_ONLY}
    assert not {i for cases in BRANCHES.values() for i in cases} - ids
    src = (FILTER / "src" / "config.rs").read_text()
    parse = src[src.index("fn string_match("):src.index("#[cfg(test)]")]
    assert parse.count("Err(err(") + parse.count("err(format!(\"{at}") + parse.count("ok_or_else(|| err(") >= 15, \
        "config.rs has new checks: give each a case and a line in BRANCHES"
    # Every optional field of the raw shapes is set somewhere in the corpus (the typed rules know them all).
    raw = src[src.index("struct RawRule"):src.index("struct RawBody {")]
    fields = set(re.findall(r"^\s+(\w+): ", raw, re.M)) - {"matcher"} | {"match"}
    seen = json.dumps([c for _, c, _, _ in corpus()])
    assert not sorted(f for f in fields if f'"{f}"' not in seen)


def test_the_policy_words_the_filters_checks_as_the_filter():
    """The messages of config.rs's checks appear in the policy model (placeholders aside)."""
    src = (FILTER / "src" / "config.rs").read_text()
    src = src[:src.index("#[cfg(test)]")]
    ours = (REPO / "mesh-config" / "meshconfig" / "policy.py").read_text()
    norm = lambda s: re.sub(r"\{[^}]*\}", "{}", s)
    messages = set(re.findall(r'err\([^;]*?,\s*(?:format!\()?"([^"]+)"', src, re.S))
    # The policy words these two as the rest of its own checks (pydantic's bounds of version, classes).
    own = {"unsupported version {} (this filter understands {})", "at least one class is required",
           # degraded_routing is generated from a checked when_degraded: the policy words those
           # checks as its other references (pydantic's bounds); the probe cluster names come from the
           # assembly (envoy_resources, the chart), not from the policy; spill_to is refused
           # because the policy never writes it (Envoy's failover spills).
           "spill is Envoy's health-check failover now (remove the field)",
           "must be a cluster name (1-{PROBE_CLUSTER_MAX_LEN} visible ASCII characters)"}
    assert len(messages) >= 14, messages
    missing = sorted(m for m in messages if norm(m) not in norm(ours) and m not in own)
    assert not missing, missing


# The filter's limits that the policy has no field for: a policy never writes a probe cluster
# (the assembly does: envoy_resources, the chart).
FILTER_ONLY_LIMITS = {"probe_cluster_max_len"}


def test_the_policy_holds_the_filters_limits(filter_limits):
    """Field by field: every bound and default the filter's parser has (config.rs) is the policy
    model's, and every bounded field the policy writes into the filter config is the filter's."""
    assert set(filter_limits) == {"version", "bounded", "defaults", "level_down", "token_max_len", "reserved_rule_names", "regex", "budgets"} \
        | FILTER_ONLY_LIMITS, "config::limits() has a new entry: compare it with the policy here"
    # Both directions: a bounded field on either side without its twin fails.
    assert set(filter_limits["bounded"]) == set(BOUNDED)
    ours = {(model, name) for _, model, name, _ in BOUNDED.values()}
    for model in (FilterSpec, PoolStateSpec, DegradedRouting, PrefixKeySpec):
        props = model.model_json_schema()["properties"]
        bounded = {n for n, p in props.items() if "minimum" in p or "maximum" in p}
        assert bounded <= {n for m, n in ours if m is model}, f"{model.__name__}: bounded fields the filter does not bound"
    assert set(PoolStateSpec.model_fields) == {n for m, n in ours if m is PoolStateSpec}
    compared = 0
    for field, (_, model, name, _) in BOUNDED.items():
        lo, hi, default = policy_bounds(model, name)
        theirs = filter_limits["bounded"][field]
        assert (lo, hi) == (theirs["min"], theirs["max"]), f"{field}: policy {lo}..{hi}, filter {theirs['min']}..{theirs['max']}"
        # The default the filter declares is the one its parser fills in.
        assert theirs["default"] == filter_limits["defaults"][field], field
        if field in DIFFERENT_DEFAULTS:
            assert (default, theirs["default"]) == DIFFERENT_DEFAULTS[field][:2], field
        else:
            assert default == theirs["default"], f"{field}: policy default {default}, filter {theirs['default']}"
        compared += 1
    assert compared == 12
    # The rest of the defaults the filter fills in: the policy's are the same.
    d = filter_limits["defaults"]
    spec = FilterSpec()
    assert d["emit_objective_header"] is spec.emit_objective_header is False
    assert (d["trusted_sources.cidrs"], d["trusted_sources.principals"]) == (len(spec.trusted_cidrs), len(spec.trusted_principals)) == (0, 0)
    assert d["degraded_routing.pools.*.shed_classes"] == len(DegradedRouting.model_fields["shed_classes"].default) == 0
    assert set(d) == set(BOUNDED) | {"emit_objective_header", "trusted_sources.cidrs", "trusted_sources.principals",
                                     "degraded_routing.pools.*.shed_classes"}
    # Levels, names, the config version.
    assert filter_limits["level_down"] == LEVEL_DOWN
    assert filter_limits["version"] == parse_policy(policy_text({}), "contract.yaml").filter_config()["version"]
    assert filter_limits["token_max_len"] == TOKEN_MAX_LEN
    n = TOKEN_MAX_LEN
    assert re.fullmatch(NAME, "a" * n) and not re.fullmatch(NAME, "a" * (n + 1)), "settings.NAME: the classes' and pools' names"
    assert tuple(filter_limits["reserved_rule_names"]) == RESERVED_RULE_NAMES
    # The regex dialect's limits (filter_regex.py models config.rs string_match).
    assert filter_limits["regex"] == {"size_limit": filter_regex.SIZE_LIMIT, "total_size_limit": filter_regex.TOTAL_SIZE_LIMIT,
                                      "nest_limit": filter_regex.NEST_LIMIT}


def test_the_policy_writes_every_at_level():
    """The filter's own default of at_level (DIFFERENT_DEFAULTS) never applies to what a policy writes."""
    case = {"when_degraded": {"batch": {"shed_classes": ["batch"]}, "interactive": {"at_level": 1, "spill_to": "batch", "shed_classes": ["batch"]}}}
    pools = parse_policy(policy_text(case), "contract.yaml").filter_config()["degraded_routing"]["pools"]
    assert {n: p["at_level"] for n, p in pools.items()} == {"batch": DegradedRouting.model_fields["at_level"].default, "interactive": 1}


def test_a_policy_of_many_regexes_is_refused_naming_the_field_and_the_budget():
    """The shared budget in the policy's own words (without the filter: this runs without cargo)."""
    ours = policy_verdict({"rules": REGEX_BUDGET["regex-budget-header"][0]})
    assert ours[:2] == (False, "rules.0.match.headers.0.regex"), ours
    limit = filter_regex.size_limit(100)
    assert ours[2] == (f"invalid regex: Compiled regex exceeds size limit of {limit} bytes. "
                       "(the config's regexes share 16 MiB of compiled size)"), ours
    assert policy_verdict({"rules": _rules(1, "a{1000}{10}")})[0], "alone it is within the per-regex limit"
