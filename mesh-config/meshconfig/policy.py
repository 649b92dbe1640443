"""The mesh policy: one file from which the filter config, each pool's sidecar config and the
Envoy/Istio config are generated. `infermesh policy check FILE` validates it; errors name the
file, the line and the field.

    version: 1
    default_class: batch
    classes:
      interactive: {pool: interactive, priority: 0, objective: chat-latency}
      batch: {pool: batch, priority: 10, sheddable: true, vllm_priority: 5}
    rules:                       # ordered; the first match decides (docs/filter.md)
      - name: chat
        class: interactive
        match: {methods: [POST], path: {prefix: /v1/chat/completions}}
    filter: {body_max_bytes: 262144, trusted_cidrs: [], emit_objective_header: false}
    pools:
      interactive:
        gpu: {type: H100, count: 1}
        models:                  # the ladder: primary first
          - {name: llama-3-70b, path: meta-llama/Meta-Llama-3-70B-Instruct, aliases: [chat], max_num_seqs: 64}
          - {name: phi-3-mini, path: microsoft/Phi-3-mini-4k-instruct}
        serving: {max_concurrent_requests: 256}   # infermesh/settings.py ServingSettings
        breakers: {...}          # infermesh/settings.py BreakerConfig, by name

The typed model, as other modules use it (every object is an immutable pydantic model):

    policy.classes[name]            ClassSpec: .pool .objective .priority .sheddable .vllm_priority
                                    .ttft_deadline_ms .hedge (.hedges: the effective choice)
    policy.rules[i]                 Rule: .name .class_ (YAML `class`) .match .wire()
    rule.match                      Match: .methods .path .headers .body .content .needs_body
    match.path / body.model / …     StringMatch: .exact .prefix .regex, .kind ("exact"|"prefix"|"regex"), .value
    match.headers[j]                HeaderMatch: .name .exact .prefix .regex .present,
                                    .value_match (StringMatch | None), .must_be_absent
    match.body                      BodyMatch: .stream .max_tokens .n .model .message_count
                                    .prompt_chars .priority .service_tier (Range / StringMatch)
    Range                           .min .max (either may be None)
    match.content                   ContentMatch: .label .min_score (the content classifier's verdict)
    policy.content_model            content_model.ContentModel | None (inline, or `{file: PATH}` beside the policy)
    policy.budgets                  BudgetsSpec | None: token budgets per class and tenant (docs/token-budgets.md):
                                    .tenant (BudgetTenant) .classes[name] (ClassBudget: .default .tenants, each a Budget)
    policy.pools[name]              PoolSpec: .models (ModelSpec) .gpu .replicas .serving
                                    .breakers .standby .monitor .when_degraded
    policy.needs_body, policy.default_pool, policy.objective(cls), policy.failover(),
    policy.degraded_routing(), policy.filter_config(), policy.sidecar_config(pool, …)

Rules are checked here with the same fields, limits, field paths and messages as the filter's
own parser (filter/src/config.rs), so `policy check` refuses what the filter would refuse;
mesh-config/tests/test_rule_contract.py holds the two to each other on a corpus. Field paths
here are pydantic's (`rules.0.match.path`), the filter's are `rules[0].match.path`.

The filter's limits are config.rs's (`LIMITS`, `TOKEN_MAX_LEN`, the regex limits, `LEVEL_DOWN`):
what this model writes of them (the bounds and defaults of `filter.body_max_bytes`,
`filter.pool_state.*` and `when_degraded.at_level`, TOKEN_MAX_LEN, RESERVED_RULE_NAMES, the regex
budget in filter_regex.py) is compared field by field with what the filter itself reports
(`cargo run --example config_limits`) by test_rule_contract.py, and every bound is tried on both
parsers at and one past each end: a difference fails there.
"""

from __future__ import annotations

import codecs
import ipaddress
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import (AfterValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, ValidationInfo,
                      WithJsonSchema, field_validator, model_validator)
from pydantic.json_schema import SkipJsonSchema

from infermesh.settings import (GRPC_PORT, HTTP_PORT, LEVEL_DOWN, NAME, ClassSettings, ModelSettings, PoolSettings, ServingSettings,
                                Strict, TracingSettings, check_ladder)

from . import content_model as cm
from .filter_regex import SIZE_LIMIT as REGEX_SIZE_LIMIT, regex_error, size_limit as regex_size_limit

__all__ = [
    "LEVEL_DOWN", "LOCAL_POLICY", "BodyMatch", "ClassSpec", "DegradedRouting", "FilterSpec", "GpuSpec", "HeaderMatch",
    "Match", "ModelSpec", "Policy", "PolicyError", "PoolSpec", "Range", "Rule", "StringMatch", "load_policy",
    "parse_policy", "read_policy_bytes", "decode_policy", "file_signature",
]

RESERVED_RULE_NAMES = ("default", "trusted")
"""Rule names the filter reports itself (classify.rs DEFAULT_RULE, TRUSTED_RULE)."""

MAX_BODY_BYTES = 1024 * 1024 - 64 * 1024
"""The filter's ceiling of `body.max_bytes` (config.rs BODY_MAX_BYTES)."""
MIN_BODY_BYTES = 1

TOKEN_MAX_LEN = 64
"""Class, pool, objective and rule names: 1 to this many of [A-Za-z0-9_-] (config.rs TOKEN_MAX_LEN)."""

U64_MAX = 2**64 - 1


class FieldError(ValueError):
    """A validator's error about `sub` (a dotted path below the object validated, "" for itself)."""

    def __init__(self, sub: str, message: str):
        super().__init__(message)
        self.sub, self.message = sub, message


def _token_error(value: str) -> str | None:
    """config.rs check_token: names end up in header values and metric names."""
    if re.fullmatch(rf"[A-Za-z0-9_-]{{1,{TOKEN_MAX_LEN}}}", value):
        return None
    return f"`{value}` must be 1-{TOKEN_MAX_LEN} characters of [A-Za-z0-9_-]"


# ---- rules: the filter's match language (docs/filter.md) ---------------------------------------

class _Rule(Strict):
    # Field order is the wire order: `wire()` dumps the fields that were set, in this order.
    # (Each model_config below is merged with Strict's.)
    model_config = ConfigDict(populate_by_name=True)


_VALUE_KEYS = ("exact", "prefix", "regex")


def _one_string(keys) -> list[dict]:
    """JSON schema: one subschema per key, matched when that key holds a string (null is unset)."""
    return [{"required": [k], "properties": {k: {"type": "string"}}} for k in keys]


class StringMatch(_Rule):
    """Exactly one of `exact`, `prefix`, `regex` (Rust `regex` syntax, compiled size ≤ 1 MiB)."""
    # A policy's regexes also share 16 MiB (filter_regex.py): Policy checks that budget.

    model_config = ConfigDict(json_schema_extra={"oneOf": _one_string(_VALUE_KEYS)})

    exact: StrictStr | None = None
    prefix: StrictStr | None = None
    regex: StrictStr | None = None

    @model_validator(mode="after")
    def _one(self) -> "StringMatch":
        _check_string_match(self.exact, self.prefix, self.regex)
        return self

    @property
    def kind(self) -> Literal["exact", "prefix", "regex"]:
        return "exact" if self.exact is not None else "prefix" if self.prefix is not None else "regex"

    @property
    def value(self) -> str:
        return getattr(self, self.kind)


def _check_string_match(exact: str | None, prefix: str | None, regex: str | None) -> None:
    if sum(v is not None for v in (exact, prefix, regex)) != 1:
        raise FieldError("", "exactly one of `exact`, `prefix`, `regex` is required")
    if regex is not None and (why := regex_error(regex)):
        raise FieldError("regex", f"invalid regex: {why}")


class Range(_Rule):
    """An inclusive numeric range; either end may be open, not both."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": [k], "properties": {k: {"type": "integer"}}} for k in ("min", "max")]})

    min: Annotated[StrictInt, Field(ge=0, le=U64_MAX)] | None = None
    max: Annotated[StrictInt, Field(ge=0, le=U64_MAX)] | None = None

    @model_validator(mode="after")
    def _bounds(self) -> "Range":
        if self.min is None and self.max is None:
            raise FieldError("", "a range needs `min`, `max` or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise FieldError("", f"min {self.min} is above max {self.max}")
        return self


_HEADER_SCHEMA = {
    # At most one value match; `present: false` (must be absent) takes none.
    "not": {"anyOf": [{"required": list(pair), "properties": {k: {"type": "string"} for k in pair}}
                      for pair in (("exact", "prefix"), ("exact", "regex"), ("prefix", "regex"))]},
    "if": {"required": ["present"], "properties": {"present": {"const": False}}},
    "then": {"not": {"anyOf": _one_string(_VALUE_KEYS)}},
}


class HeaderMatch(_Rule):
    """A header (gRPC metadata too) by lower-case name: a value match, present, or `present: false`."""

    model_config = ConfigDict(json_schema_extra=_HEADER_SCHEMA)

    name: Annotated[StrictStr, Field(json_schema_extra={"pattern": "^[!-@\\[-~]+$", "description": "lower case"})]
    exact: StrictStr | None = None
    prefix: StrictStr | None = None
    regex: StrictStr | None = None
    present: StrictBool | None = None
    """false: the header must be absent; true or unset without a value: it must be present."""

    @model_validator(mode="after")
    def _cond(self) -> "HeaderMatch":
        b = self.name.encode()
        if not b or any(65 <= c <= 90 or c <= 32 or c >= 0x7F for c in b):
            raise FieldError("name", "header names must be non-empty lower-case tokens")
        has_value = any(getattr(self, k) is not None for k in _VALUE_KEYS)
        if self.present is False and has_value:
            raise FieldError("", "`present: false` cannot be combined with a value match")
        if has_value:
            _check_string_match(self.exact, self.prefix, self.regex)
        return self

    @property
    def value_match(self) -> StringMatch | None:
        if all(getattr(self, k) is None for k in _VALUE_KEYS):
            return None
        return StringMatch(exact=self.exact, prefix=self.prefix, regex=self.regex)

    @property
    def must_be_absent(self) -> bool:
        return self.present is False


class BodyMatch(_Rule):
    """Conditions on the OpenAI-style JSON body; a field absent or of the wrong type never matches,
    except `stream` (absent: false) and `n` (absent: 1)."""

    stream: StrictBool | None = None
    max_tokens: Range | None = None
    """On `max_completion_tokens`, else `max_tokens`."""
    n: Range | None = None
    model: StringMatch | None = None
    message_count: Range | None = None
    prompt_chars: Range | None = None
    """Characters of prompt text: all messages' text content plus `prompt`."""
    priority: StringMatch | None = None
    """An integer `priority` is matched as its decimal string."""
    service_tier: StringMatch | None = None


class ContentMatch(_Rule):
    """The content classifier's verdict on the request's text (the policy's `content_model`,
    docs/content-classes.md): its label is `label` with a score of at least `min_score`. A request
    without text never matches."""

    label: Annotated[StrictStr, Field(json_schema_extra={"pattern": cm.LABEL})]
    """One of the model's labels."""
    min_score: Annotated[float, Field(strict=True, json_schema_extra={"minimum": 0, "maximum": 1})] = 0
    """The winning label's softmax probability must be at least this (0..1)."""

    @field_validator("min_score")
    @classmethod
    def _score(cls, v: float) -> float:
        if not 0 <= v <= 1:
            raise FieldError("", "must be between 0 and 1")
        return v


class Match(_Rule):
    """All conditions must hold; an empty match matches every request."""

    methods: list[StrictStr] = []
    """Any of these methods (case-insensitive)."""
    path: StringMatch | None = None
    """The path without the query string; `exact` and `prefix` start with `/`."""
    headers: list[HeaderMatch] = []
    body: BodyMatch | None = None
    content: ContentMatch | None = None
    """The label the policy's `content_model` gives the request's text (it reads the body)."""

    @field_validator("path")
    @classmethod
    def _absolute(cls, p: StringMatch | None) -> StringMatch | None:
        if p is not None and p.kind != "regex" and not p.value.startswith("/"):
            raise FieldError("", "a path must start with `/`")
        return p

    @property
    def needs_body(self) -> bool:
        """Whether the filter must read the body to judge this match."""
        return self.body is not None or self.content is not None

    def regexes(self) -> list[tuple[str, str]]:
        """(field path below the match, pattern) of each regex it compiles, in the filter's order."""
        out = [("path", self.path.regex)] if self.path is not None and self.path.regex is not None else []
        out += [(f"headers.{j}", h.regex) for j, h in enumerate(self.headers) if h.regex is not None]
        if self.body is not None:
            out += [(f"body.{k}", m.regex) for k in ("model", "priority", "service_tier")
                    if (m := getattr(self.body, k)) is not None and m.regex is not None]
        return out


class Rule(_Rule):
    """One ordered rule: the first whose match holds decides the request's class."""

    name: Annotated[StrictStr, Field(json_schema_extra={"pattern": NAME, "not": {"enum": list(RESERVED_RULE_NAMES)}})]
    """Reported in `x-infermesh-rule` and the filter's metrics."""
    class_: Annotated[StrictStr, Field(alias="class")]
    """The class this rule gives a request (one of `classes`)."""
    match: Match = Match()

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if why := _token_error(name):
            raise FieldError("", why)
        if name in RESERVED_RULE_NAMES:
            raise FieldError("", f"`{name}` is reserved")
        return name

    def wire(self) -> dict[str, Any]:
        """The rule as the filter reads it: the fields the policy set, nothing added."""
        return self.model_dump(by_alias=True, exclude_unset=True)


# ---- classes, models, pools -------------------------------------------------------------------

def _bounded(lo: int, hi: int):
    """A bounded integer with the filter's own wording (config.rs `bounded`)."""
    def check(v: int) -> int:
        if not lo <= v <= hi:
            raise FieldError("", f"must be between {lo} and {hi}")
        return v
    return Annotated[StrictInt, AfterValidator(check), Field(json_schema_extra={"minimum": lo, "maximum": hi})]


class PrefixKeySpec(Strict):
    """The prefix key the filter writes for a class's chat and completion requests
    (`x-infermesh-prefix-key`, docs/prefix-routing.md): a chain of keys naming the reusable
    prefix (the system prompt and earlier turns; a prompt's leading chunks). The filter's limits
    and defaults (config.rs PREFIX_MAX_KEYS, PREFIX_CHUNK_BYTES)."""

    max_keys: _bounded(1, 8) = 4
    """Keys in the chain, longest prefix first, ending with the system prompt's (or the first chunk's)."""
    chunk_bytes: _bounded(64, 65536) = 1024
    """A completion prompt is keyed by whole chunks of this many bytes of its JSON string."""
    load_over_mean_pct: _bounded(0, 400) = 25
    """The load bound: the replica that holds the prefix is passed over (the request is picked by
    load) while its utilization is more than this many percent over its pool's mean..."""
    load_floor_pct: _bounded(0, 100) = 50
    """...and at least this high (a replica with a request or two in flight keeps its conversations)..."""
    load_ceiling_pct: _bounded(1, 100) = 90
    """...or, whatever the mean, above this. The utilization is what the replica reports to Envoy
    (ORCA's, docs/replicas.md); docs/prefix-routing.md."""


class ClassSpec(ClassSettings):
    """A semantic class: the pool that serves it and how that pool treats it."""

    pool: Annotated[str, Field(pattern=NAME)]
    """The pool that serves this class."""
    objective: Annotated[str, Field(pattern=NAME)] | None = None
    """Gateway API Inference Extension objective (x-gateway-inference-objective); default: the class name."""
    ttft_deadline_ms: Annotated[int, Field(ge=10, le=600_000)] | None = None
    """Time to first token one attempt gets (Envoy's per-try timeout: a sidecar sends its headers
    with the first token). Past it Envoy hedges to another replica, then to the pool's fallback,
    or (without `hedge`) answers 504. None: no deadline. docs/replicas.md."""
    hedge: bool | None = None
    """Past the deadline keep the first attempt running and race another (the first to send its
    headers wins, Envoy resets the rest); false: the deadline is a hard limit (504 at once).
    Default: true for classes that are not `sheddable` (interactive hedges, batch does not)."""

    prefix_key: PrefixKeySpec | None = None
    """Set: the filter reads this class's chat/completion bodies (up to `filter.body_max_bytes`)
    and writes their prefix key (docs/prefix-routing.md); its rules are then decided by the
    filter, not by Envoy's route table. None: no key."""

    @property
    def hedges(self) -> bool:
        return self.ttft_deadline_ms is not None and (self.hedge if self.hedge is not None else not self.sheddable)


class ModelSpec(ModelSettings):
    path: str | None = None
    """Checkpoint directory or hub id; default: the local model of that name ($INFERMESH_HOME/models)."""


class GpuSpec(Strict):
    type: str = "cpu"
    """Accelerator class of the pool's nodes (H100, A100, L4, A10, cpu): used by the chart."""
    count: Annotated[int, Field(ge=0, le=16)] = 0


class DegradedRouting(Strict):
    """What the mesh does while this pool is degraded (its sidecars report the level)."""

    at_level: Annotated[int, Field(ge=1, le=LEVEL_DOWN)] = 3
    """From this pool level on: 1 shedding, 2 serving a fallback model, 3 critical classes only,
    4 only while its sidecars do not serve. A pool whose sidecar is gone (killed, restarting,
    draining) is at level 4, past every level."""
    spill_to: Annotated[str, Field(pattern=NAME)] | None = None
    """Send this pool's traffic to that pool instead (unless that one is degraded too). Its
    endpoints also stand behind this pool's at priority 1: a request this pool's sidecar refuses
    at the connection level is retried there before anything else has noticed."""
    shed_classes: list[str] = []
    """Answer these classes at the edge with 429 + Retry-After, before they reach any pool."""


class PoolSpec(PoolSettings):
    models: Annotated[list[ModelSpec], Field(min_length=1)]
    """The model ladder: primary first, lighter fallbacks after it (the first is a hot standby)."""
    gpu: GpuSpec = GpuSpec()
    replicas: Annotated[int, Field(ge=1, le=1000)] = 1
    """Sidecars serving this pool: each its own endpoint of the pool's clusters (the local mesh
    runs that many; the chart's Deployment scales to it)."""
    serving: ServingSettings = ServingSettings()
    """Each sidecar's admission limits and streaming."""
    when_degraded: DegradedRouting | None = None

    _unique_names = field_validator("models")(check_ladder)


def _cidr_error(s: str) -> str | None:
    """config.rs Cidr::parse: an IP address, optionally /PREFIX (no zone ids, no spaces)."""
    addr, slash, prefix = s.partition("/")
    try:
        # Python accepts IPv6 zone ids and surrounding spaces; Rust's IpAddr parser does not.
        ip = ipaddress.ip_address(addr) if "%" not in addr and addr.strip() == addr else None
    except ValueError:
        ip = None
    # The prefix is a u8 as Rust parses it: digits with an optional `+`.
    ok = ip is not None and (not slash or (re.fullmatch(r"\+?[0-9]+", prefix) is not None and int(prefix) <= ip.max_prefixlen))
    return None if ok else f"`{s}` is not an IP network"


class PoolStateSpec(Strict):
    """How the filter learns each pool's level and applies `when_degraded` (docs/filter.md,
    "Degraded-mode routing"). The filter's limits and defaults (config.rs)."""

    probe_interval_ms: _bounded(50, 60_000) = 500
    """How often the filter probes the state endpoint of a pool whose readings traffic does not keep fresh."""
    probe_timeout_ms: _bounded(10, 60_000) = 400
    """A probe with no answer by then counts as failed (and changes nothing)."""
    stale_after_ms: _bounded(100, 3_600_000) = 5000
    """A replica's reading older than this is ignored; no fresh reading: normal routing (fail open)."""
    recover_hold_ms: _bounded(0, 3_600_000) = 1000
    """A replica that drops below `at_level` counts as degraded for this long after its last such report (no flapping)."""
    retry_after_s: _bounded(1, 3600) = 5
    """Retry-After of the 429 that sheds a class at the edge."""


# ---- token budgets (docs/token-budgets.md; the filter: config.rs `budgets`, token_budget.rs) -------

BUDGET_TOKENS_MAX = 10**12
"""A window's limit: 1 to this many tokens (config.rs BUDGET_PER_MINUTE, _HOUR, _DAY)."""
BUDGET_WEIGHT_MAX = 1000
"""`count.input` / `count.output`: 0 to this (config.rs BUDGET_COUNT_INPUT, _OUTPUT)."""
BUDGET_STREAMS_MAX = 1_000_000
"""`concurrent_streams`: 1 to this (config.rs BUDGET_CONCURRENT_STREAMS)."""
BUDGET_MAX_TOKENS_MAX = 2**32 - 1
"""The filter's bound of a class's `default_max_tokens` (its pool's `serving.default_max_tokens`)."""
BUDGET_MAX_TENANTS = 256
"""Tenants one class's budget may list: each is a metric label (config.rs BUDGET_MAX_TENANTS)."""
BUDGET_OTHER = "other"
"""The tenant of a request whose tenant the filter may not believe, and the label of every tenant not listed."""


class BudgetTenant(Strict):
    """Where a request's tenant comes from: exactly one of `header`, `api_key_hash`."""

    header: StrictStr | None = None
    """A header an authenticating hop before the mesh sets (Istio's RequestAuthentication
    `outputClaimToHeaders`, an API gateway). The filter reads it only from a source it trusts
    (`filter.trusted_cidrs` / `trusted_principals`); from any other it removes it and the request
    is the tenant `other`."""
    api_key_hash: StrictBool | None = None
    """true: the tenant is the first 16 hex digits of the SHA-256 of the API key (`authorization:
    Bearer KEY`, else `x-api-key: KEY`); listed tenants are named so. No trust needed: a client
    that can send a tenant's key is that tenant."""

    @model_validator(mode="after")
    def _one(self) -> "BudgetTenant":
        if (self.header is None) == (self.api_key_hash is None):
            raise FieldError("", "exactly one of `header`, `api_key_hash` is required")
        if self.api_key_hash is False:
            raise FieldError("api_key_hash", "must be true (or name a `header`)")
        if self.header is not None:
            b = self.header.encode()
            if not b or any(65 <= c <= 90 or c <= 32 or c >= 0x7F for c in b):
                raise FieldError("header", "header names must be non-empty lower-case tokens")
        return self


class BudgetTokens(Strict):
    """Tokens per fixed window (aligned to the clock's minute, hour, day); at least one."""

    per_minute: _bounded(1, BUDGET_TOKENS_MAX) | None = None
    per_hour: _bounded(1, BUDGET_TOKENS_MAX) | None = None
    per_day: _bounded(1, BUDGET_TOKENS_MAX) | None = None

    @model_validator(mode="after")
    def _some(self) -> "BudgetTokens":
        if self.per_minute is None and self.per_hour is None and self.per_day is None:
            raise FieldError("", "`tokens` needs `per_minute`, `per_hour`, `per_day` or several")
        return self


class BudgetCount(Strict):
    """What a request is charged: `input` x prompt tokens + `output` x completion tokens."""

    input: _bounded(0, BUDGET_WEIGHT_MAX) = 1
    output: _bounded(0, BUDGET_WEIGHT_MAX) = 1

    @model_validator(mode="after")
    def _charged(self) -> "BudgetCount":
        if self.input == 0 and self.output == 0:
            raise FieldError("", "`input` and `output` cannot both be 0 (nothing would be charged)")
        return self


class Budget(Strict):
    """One budget: tokens per window, how they are counted, streams in flight. A listed tenant's
    budget is whole (nothing is inherited from the class's `default`)."""

    tokens: BudgetTokens | None = None
    count: BudgetCount = BudgetCount()
    concurrent_streams: _bounded(1, BUDGET_STREAMS_MAX) | None = None
    """Streams (requests) in flight at once; a stream's end, a vanished client's included, frees its slot."""

    @model_validator(mode="after")
    def _limits(self) -> "Budget":
        if self.tokens is None and self.concurrent_streams is None:
            raise FieldError("", "a budget needs `tokens`, `concurrent_streams` or both")
        return self

    def wire(self) -> dict[str, Any]:
        """The budget as the filter reads it."""
        out: dict[str, Any] = {}
        if self.tokens is not None:
            out["tokens"] = self.tokens.model_dump(exclude_none=True)
        out["count"] = self.count.model_dump()
        if self.concurrent_streams is not None:
            out["concurrent_streams"] = self.concurrent_streams
        return out


class ClassBudget(Strict):
    """One class's budgets: a default for each tenant not listed, and listed tenants."""

    default: Budget | None = None
    """Each tenant not listed, and `other`, gets this budget (its own count of it); None: they are not limited."""
    tenants: dict[StrictStr, Budget] = {}
    """Tenants by name (the `header`'s value, or the key's hash with `api_key_hash`): metric labels."""

    @field_validator("tenants")
    @classmethod
    def _names(cls, tenants: dict[str, Budget]) -> dict[str, Budget]:
        if len(tenants) > BUDGET_MAX_TENANTS:
            raise FieldError("", f"at most {BUDGET_MAX_TENANTS} tenants per class")
        for name in tenants:
            if why := _token_error(name):
                raise FieldError(name, why)
            if name == BUDGET_OTHER:
                raise FieldError(name, "`other` is reserved (tenants not listed are counted as `other`)")
        return tenants

    @model_validator(mode="after")
    def _some(self) -> "ClassBudget":
        if self.default is None and not self.tenants:
            raise FieldError("", "a class's budget needs a `default`, `tenants` or both")
        return self


class BudgetsSpec(Strict):
    """Token budgets per class and tenant, enforced by the filter (docs/token-budgets.md): a
    request reserves an upper bound of its tokens on arrival (prompt bytes + 8 per message +
    `max_tokens` or its pool's `serving.default_max_tokens`, per choice) or is refused with 429;
    an upstream error gives the reservation back. Counted per gateway, shared by its workers."""

    tenant: BudgetTenant
    classes: dict[StrictStr, ClassBudget]
    """Budgeted classes (any of `classes`); a class not here is not limited."""

    @field_validator("classes")
    @classmethod
    def _some(cls, classes: dict[str, ClassBudget]) -> dict[str, ClassBudget]:
        if not classes:
            raise FieldError("", "a budget needs at least one class")
        return classes


class FilterSpec(Strict):
    runtime: Literal["wasm", "native"] = "wasm"
    """How Envoy runs the filter: `wasm` (proxy-wasm, V8: plain Envoy and Istio) or `native` (the
    same code as an Envoy dynamic module, plain Envoy only: no VM, cheaper per request; the
    module is built for the pinned Envoy's ABI, docs/filter-native-module.md)."""
    body_max_bytes: Annotated[int, Field(json_schema_extra={"minimum": MIN_BODY_BYTES, "maximum": MAX_BODY_BYTES})] = 262144
    """Bodies up to this size are buffered when a rule needs them (below Envoy's 1 MiB per-connection buffer)."""
    trusted_cidrs: list[str] = []
    """Peers whose x-infermesh-* headers are kept: an upstream infermesh hop already decided."""
    trusted_principals: list[Annotated[str, Field(json_schema_extra={"minLength": 1})]] = []
    """mTLS peer identities (URI SANs) whose x-infermesh-* headers are kept."""
    emit_objective_header: bool = False
    """Also set x-gateway-inference-objective (Gateway API Inference Extension / llm-d)."""
    pool_state: PoolStateSpec = PoolStateSpec()
    """Degraded-mode routing in the filter: probing, staleness, hysteresis, the shed answer."""

    # The filter's checks and wording (config.rs), so `policy check` reads like the filter's log.
    @field_validator("body_max_bytes")
    @classmethod
    def _body_limit(cls, n: int) -> int:
        lo, hi = MIN_BODY_BYTES, MAX_BODY_BYTES
        if not lo <= n <= hi:
            raise FieldError("", f"must be between {lo} and {hi} (below Envoy's 1 MiB per-connection buffer)")
        return n

    @field_validator("trusted_cidrs")
    @classmethod
    def _cidrs(cls, cidrs: list[str]) -> list[str]:
        for i, c in enumerate(cidrs):
            if why := _cidr_error(c):
                raise FieldError(str(i), why)
        return cidrs

    @field_validator("trusted_principals")
    @classmethod
    def _principals(cls, principals: list[str]) -> list[str]:
        for i, p in enumerate(principals):
            if not p:
                raise FieldError(str(i), "must not be empty")
        return principals


_CONTENT_MODEL_SCHEMA = {
    "description": "The content classifier (docs/content-classes.md): the model `infermesh classes train` writes, "
                   "inline or as `{file: PATH}` (relative to the policy file)",
    "oneOf": [
        {"type": "object", "additionalProperties": False, "required": ["file"], "properties": {"file": {"type": "string", "minLength": 1}}},
        {"type": "object", "additionalProperties": False, "required": list(cm.MODEL_FIELDS), "properties": {
            "version": {"const": cm.VERSION},
            "labels": {"type": "array", "minItems": cm.MIN_LABELS, "maxItems": cm.MAX_LABELS, "items": {"type": "string", "pattern": cm.LABEL}},
            "dim": {"type": "integer", "minimum": cm.DIM_MIN, "maximum": cm.DIM_MAX},
            "word_ngrams": {"type": "integer", "minimum": 1, "maximum": 2},
            "char_ngrams": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": cm.CHAR_NGRAM_MAX}},
            "max_text_bytes": {"type": "integer", "minimum": cm.MAX_TEXT_MIN, "maximum": cm.MAX_TEXT_MAX},
            "scale": {"type": "number", "exclusiveMinimum": 0},
            "bias": {"type": "array", "items": {"type": "number"}},
            "weights": {"type": "string"}}},
    ],
}


class Policy(Strict):
    version: Annotated[int, Field(ge=1, le=1)] = 1
    default_class: str
    classes: Annotated[dict[Annotated[str, Field(pattern=NAME)], ClassSpec], Field(min_length=1)]
    rules: list[Rule] = []
    """Ordered: the first rule whose match holds decides (docs/filter.md)."""
    content_model: Annotated[Any, WithJsonSchema(_CONTENT_MODEL_SCHEMA)] = None
    """The content classifier that rules' `match.content` ask (cm.ContentModel once validated)."""
    filter: FilterSpec = FilterSpec()
    budgets: SkipJsonSchema[BudgetsSpec | None] = None
    """Token budgets per class and tenant (docs/token-budgets.md). Not in the chart's values yet
    (left out of the JSON schema the chart's is generated from): plain Envoy only in this slice."""
    tracing: TracingSettings = TracingSettings()
    """OpenTelemetry traces of the mesh's requests: Envoy, every sidecar and vLLM export to one
    OTLP endpoint (docs/tracing.md); off by default."""
    pools: Annotated[dict[Annotated[str, Field(pattern=NAME)], PoolSpec], Field(min_length=1)]

    @model_validator(mode="after")
    def _references(self) -> "Policy":
        if self.default_class not in self.classes:
            raise FieldError("default_class", f"{self.default_class!r} is not one of the classes {sorted(self.classes)}")
        for name, c in self.classes.items():
            if c.pool not in self.pools:
                raise FieldError(f"classes.{name}.pool", f"{c.pool!r} is not one of the pools {sorted(self.pools)}")
        for name, p in self.pools.items():
            wd = p.when_degraded
            if wd is None:
                continue
            if wd.spill_to is not None and (wd.spill_to not in self.pools or wd.spill_to == name):
                raise FieldError(f"pools.{name}.when_degraded.spill_to", f"{wd.spill_to!r} must be another of the pools {sorted(self.pools)}")
            for i, c in enumerate(wd.shed_classes):
                if c not in self.classes:
                    raise FieldError(f"pools.{name}.when_degraded.shed_classes.{i}", f"{c!r} is not one of the classes {sorted(self.classes)}")
        seen: set[str] = set()
        # The config's regexes share the filter's compiled-size budget (each was checked alone
        # against the per-regex limit already): the filter's `regex_size_limit`.
        limit = regex_size_limit(sum(len(r.match.regexes()) for r in self.rules))
        for i, r in enumerate(self.rules):
            # The filter's wording (config.rs), in its order: name, then class, then its regexes.
            if r.name in seen:
                raise FieldError(f"rules.{i}.name", f"duplicate rule name `{r.name}`")
            seen.add(r.name)
            if r.class_ not in self.classes:
                raise FieldError(f"rules.{i}.class", f"unknown class `{r.class_}`")
            if (content := r.match.content) is not None:
                if self.content_model is None:
                    raise FieldError(f"rules.{i}.match.content", "a `content` condition needs a `content_model`")
                if content.label not in self.content_model.labels:
                    raise FieldError(f"rules.{i}.match.content.label",
                                     f"unknown label `{content.label}` (the model's labels: {', '.join(self.content_model.labels)})")
            if limit < REGEX_SIZE_LIMIT:
                for sub, pattern in r.match.regexes():
                    if why := regex_error(pattern, limit):
                        raise FieldError(f"rules.{i}.match.{sub}.regex", f"invalid regex: {why}")
        if self.budgets is not None:
            self._check_budgets(self.budgets)
        return self

    def _check_budgets(self, b: BudgetsSpec) -> None:
        """The references config.rs checks: known classes, hash-named tenants with api_key_hash;
        and the pool's completion default the filter bounds."""
        for name, c in b.classes.items():
            at = f"budgets.classes.{name}"
            if name not in self.classes:
                raise FieldError(at, f"unknown class `{name}`")
            pool = self.classes[name].pool
            if self.pools[pool].serving.default_max_tokens > BUDGET_MAX_TOKENS_MAX:
                raise FieldError(f"pools.{pool}.serving.default_max_tokens",
                                 f"must be between 1 and {BUDGET_MAX_TOKENS_MAX} (the budgets of class `{name}` bound it)")
            if b.tenant.api_key_hash:
                for t in c.tenants:
                    if not re.fullmatch(r"[0-9a-f]{16}", t):
                        raise FieldError(f"{at}.tenants.{t}",
                                         "with `api_key_hash` a tenant is named by the first 16 hex digits (lower case) of its key's SHA-256")

    @field_validator("content_model", mode="before")
    @classmethod
    def _content_model(cls, v: Any, info: ValidationInfo) -> cm.ContentModel | None:
        """An inline model, or `{file: PATH}` read relative to the policy's directory (the
        context's `policy_dir`; parse_policy passes it)."""
        if v is None or isinstance(v, cm.ContentModel):
            return v
        if isinstance(v, dict) and "file" in v:
            if set(v) != {"file"}:
                raise FieldError("", "either `{file: PATH}` or the model itself, not both")
            name = v["file"]
            if not isinstance(name, str) or not name:
                raise FieldError("file", "must be the path of a model file")
            try:
                return cm.load_model(Path((info.context or {}).get("policy_dir") or ".") / name)
            except cm.ModelError as e:
                raise FieldError(e.field or "file", f"{e.message} (in {name})" if e.field else e.message) from e
        try:
            return cm.ContentModel.from_obj(v)
        except cm.ModelError as e:
            raise FieldError(e.field, e.message) from e

    # ---- what other modules ask ---------------------------------------------------------------

    @property
    def default_pool(self) -> str:
        return self.classes[self.default_class].pool

    @property
    def needs_body(self) -> bool:
        """Whether any rule reads the request body (then the filter must be able to pause)."""
        return any(r.match.needs_body for r in self.rules)

    def objective(self, cls: str) -> str:
        """The class's x-gateway-inference-objective value (the filter's default: the class name)."""
        return self.classes[cls].objective or cls

    def degraded_routing(self, probe_clusters: Mapping[str, str] | None = None) -> dict | None:
        """The filter's `degraded_routing`: each pool whose `when_degraded` sheds classes, with
        the Envoy cluster the filter probes for its state (`probe_clusters`; default the
        plain-Envoy names: envoy_resources.state_cluster_name for a pool that spills, whose own
        cluster fails over, else cluster_name). Spill is not the filter's: Envoy's health check
        and priority failover (`failover`, `spill_levels`). None when no pool sheds."""
        shedding = {n: p.when_degraded for n, p in self.pools.items() if p.when_degraded and p.when_degraded.shed_classes}
        if not shedding:
            return None
        pools: dict[str, dict] = {}
        for name, wd in shedding.items():
            entry: dict[str, Any] = {"at_level": wd.at_level, "shed_classes": list(wd.shed_classes)}
            default = f"pool_{name}_state" if wd.spill_to else f"pool_{name}"
            cluster = probe_clusters.get(name) if probe_clusters is not None else default
            if cluster:
                entry["probe_cluster"] = cluster
            pools[name] = entry
        return {"pools": pools, **self.filter.pool_state.model_dump()}

    def failover(self) -> dict[str, str]:
        """pool -> the pool whose endpoints back it at priority 1 (its `when_degraded.spill_to`)."""
        return {n: p.when_degraded.spill_to for n, p in self.pools.items() if p.when_degraded and p.when_degraded.spill_to}

    def spill_levels(self) -> dict[str, int]:
        """pool -> the level from which Envoy spills it to its failover pool (`at_level`)."""
        return {n: p.when_degraded.at_level for n, p in self.pools.items() if p.when_degraded and p.when_degraded.spill_to}

    # ---- generators ---------------------------------------------------------------------------

    def filter_config(self, probe_clusters: Mapping[str, str] | None = None) -> dict:
        """The Wasm filter's JSON config (Envoy `configuration`, Istio `pluginConfig`);
        `probe_clusters`: see `degraded_routing`."""
        classes = {}
        for name, c in self.classes.items():
            classes[name] = {"pool": c.pool} | ({"objective": c.objective} if c.objective else {}) \
                | ({"prefix_key": c.prefix_key.model_dump()} if c.prefix_key is not None else {})
        cfg: dict[str, Any] = {
            "version": 1,
            "default_class": self.default_class,
            "classes": classes,
            "rules": [r.wire() for r in self.rules],
            "body": {"max_bytes": self.filter.body_max_bytes},
            "emit_objective_header": self.filter.emit_objective_header,
        }
        if self.filter.trusted_cidrs or self.filter.trusted_principals:
            cfg["trusted_sources"] = {"cidrs": list(self.filter.trusted_cidrs), "principals": list(self.filter.trusted_principals)}
        if (degraded := self.degraded_routing(probe_clusters)) is not None:
            cfg["degraded_routing"] = degraded
        if self.content_model is not None:
            cfg["content_model"] = self.content_model.to_obj()
        if self.budgets is not None:
            cfg["budgets"] = self.budgets_config()
        return cfg

    def budgets_config(self) -> dict:
        """The filter's `budgets`: each class with its pool's `serving.default_max_tokens` (the
        completion bound of a request that states none, which the sidecar enforces)."""
        b = self.budgets
        assert b is not None
        tenant = {"header": b.tenant.header} if b.tenant.header is not None else {"api_key_hash": True}
        classes: dict[str, Any] = {}
        for name, c in b.classes.items():
            entry: dict[str, Any] = {"default_max_tokens": self.pools[self.classes[name].pool].serving.default_max_tokens}
            if c.default is not None:
                entry["default"] = c.default.wire()
            if c.tenants:
                entry["tenants"] = {t: tb.wire() for t, tb in c.tenants.items()}
            classes[name] = entry
        return {"tenant": tenant, "classes": classes}

    def sidecar_config(self, pool: str, models_dir: Path, *, host: str = "127.0.0.1", http_port: int = HTTP_PORT,
                       grpc_port: int = GRPC_PORT, admin_port: int = 0, admin_grpc_port: int = 0, instance: str = "0") -> dict:
        """One pool's sidecar config (infermesh.sidecar.config.SidecarConfig), every setting explicit."""
        p = self.pools[pool]
        models = [m.model_dump(exclude={"path"}) | {"path": m.path or str(models_dir / m.name)} for m in p.models]
        # The sidecar knows every class (a request's class decides shedding); the mesh's default
        # stands for requests that arrive without one.
        class_fields = set(ClassSettings.model_fields)
        classes = {n: c.model_dump(include=class_fields) for n, c in self.classes.items()}
        return {
            "pool": pool,
            "instance": instance,
            "models": models,
            "server": {"host": host, "http_port": http_port, "grpc_port": grpc_port} | p.serving.model_dump(),
            "admin": {"host": "127.0.0.1", "port": admin_port, "grpc_port": admin_grpc_port},
            "classes": classes,
            "default_class": self.default_class,
            # Metric labels name only these pools (anything else a header says is `other`).
            "mesh_pools": sorted(self.pools),
            "breakers": {n: b.model_dump() for n, b in p.breakers.items()},
            "standby": p.standby,
            "monitor": p.monitor.model_dump(),
            "tracing": self.tracing.model_dump(),
        }


# ---- loading: whatever the file holds, only PolicyError comes out -------------------------------

MAX_POLICY_BYTES = 256 * 1024
"""A policy is a few KiB; a larger file is refused before it is parsed (PyYAML's safe loader,
pure Python for its bounds, reads about 0.3 MiB/s of policy)."""
MAX_YAML_DEPTH = 64
"""Deeper nesting is refused with its line, before Python's recursion limit is near."""
MAX_YAML_NODES = 100_000
"""The document's size with every alias expanded (a long scalar counts per 64 characters): bounds
what one small file can make the constructor and the validator walk (a YAML bomb)."""

REJECTION_REASONS = ("io", "size", "encoding", "yaml", "depth", "validation", "changed", "internal")
"""`PolicyError.reason`: why a policy was refused, as the control plane counts it. `changed`: the
file changed while it was read (read it again); `internal`: a bug of ours, never the file's."""


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def _one_line(msg: str, limit: int = 400) -> str:
    """A message fit for one `file:line: field: reason` line: control characters and lone
    surrogates escaped, at most `limit` characters (a value quoted in it may be anything)."""
    msg = re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]", _escape, str(msg))
    return msg if len(msg) <= limit else msg[:limit] + "…"


class PolicyError(Exception):
    """A policy that cannot be used. `problems` are (line or None, field, message); `reason` is one
    of REJECTION_REASONS."""

    def __init__(self, path: str, problems: list[tuple[int | None, str, str]], reason: str = "validation"):
        self.path = path
        self.problems = problems
        self.reason = reason
        lines = [f"{_one_line(path)}:{line or '?'}: {_one_line(field, 200)}: {_one_line(msg)}" for line, field, msg in problems]
        super().__init__("\n".join(lines))


def _line_of(node: yaml.Node | None, loc: list) -> int | None:
    """The 1-based line of the YAML node at `loc` (the deepest that exists)."""
    best = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if str(k.value) == str(key):
                    nxt = v
                    best = k.start_mark.line + 1
                    break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            best = node.start_mark.line + 1
        else:
            break
        if node is None:
            break
    return best


def _problem(err: dict) -> tuple[list, str]:
    """(field path, message) of one pydantic error; a FieldError names a path below its object."""
    loc, msg = list(err["loc"]), err["msg"]
    if loc and loc[-1] == "[key]":  # a map key that does not fit: name the key itself
        loc.pop()
    e = (err.get("ctx") or {}).get("error")
    if isinstance(e, FieldError):
        loc += [int(x) if x.isdigit() else x for x in e.sub.split(".") if x]
        msg = e.message
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return loc, msg


_SURROGATE = re.compile("[\ud800-\udfff]")


class _YamlLimit(yaml.MarkedYAMLError):
    """A document past MAX_YAML_DEPTH or MAX_YAML_NODES, at the node where it went past."""

    def __init__(self, reason: str, problem: str, mark):
        super().__init__(problem=problem, problem_mark=mark)
        self.reason = reason


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with its depth and its expanded size bounded (checked as it composes,
    so a bomb stops at the limit instead of after it), and a constructor error on a bad scalar
    (`2020-13-45`, a 5000-digit int) reported at that scalar's line instead of as a bare ValueError."""

    # PyYAML's own table, pinned: a library in the same process may patch SafeLoader's
    # (lm-format-enforcer, loaded with vLLM's structured outputs, reads every timestamp as a
    # string), and a policy must read the same in every process.
    yaml_constructors = {**yaml.SafeLoader.yaml_constructors,
                         "tag:yaml.org,2002:timestamp": yaml.constructor.SafeConstructor.construct_yaml_timestamp}

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._expanded = 0
        self._anchored: dict[int, int] = {}
        """id(anchored node) -> its expanded size (the node stays alive in `self.anchors`)."""

    def _count(self, n: int, mark) -> None:
        self._expanded += n
        if self._expanded > MAX_YAML_NODES:
            raise _YamlLimit("size", f"the document expands to more than {MAX_YAML_NODES} nodes "
                                     "(aliases counted each time they are used); a policy has a few hundred", mark)

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.anchors:
                self._count(self._anchored.get(id(self.anchors[event.anchor]), 1), event.start_mark)
            return super().compose_node(parent, index)
        if self._depth >= MAX_YAML_DEPTH:
            raise _YamlLimit("depth", f"nested more than {MAX_YAML_DEPTH} levels deep", event.start_mark)
        start = self._expanded
        value = getattr(event, "value", None)
        self._count(1 + (len(value) // 64 if isinstance(value, str) else 0), event.start_mark)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if getattr(event, "anchor", None) is not None:
            self._anchored[id(node)] = self._expanded - start
        return node

    def construct_object(self, node, deep=False):
        try:
            value = super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 — PyYAML's own constructors raise ValueError, AttributeError, …
            why = f": {e}" if isinstance(e, (ValueError, OverflowError)) else ""  # else PyYAML's own slip, no news to the user
            raise yaml.constructor.ConstructorError(None, None, f"not a valid {node.tag.rsplit(':', 1)[-1]}{why}",
                                                    node.start_mark) from e
        if isinstance(value, str) and _SURROGATE.search(value):
            # "\ud800" in double quotes: no character, and nothing downstream can encode it.
            raise yaml.constructor.ConstructorError(None, None, "a lone UTF-16 surrogate (\\uD800-\\uDFFF escape) is not a character",
                                                    node.start_mark)
        return value


def _compose(text: str, path: str) -> tuple[yaml.Node | None, Any]:
    """The document's node tree (for lines) and its data, or PolicyError naming the line."""
    loader = None
    try:
        loader = _BoundedLoader(text)  # its reader refuses unprintable characters here already
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        context = e.context or ""
        if context and e.context_mark and e.problem_mark and e.context_mark.line != e.problem_mark.line:
            context += f" (line {e.context_mark.line + 1})"  # e.g. where the unclosed quote or the first anchor was
        msg = ", ".join(x for x in (context, e.problem) if x) or type(e).__name__
        raise PolicyError(path, [(mark.line + 1 if mark else None, "(yaml)", msg)], getattr(e, "reason", "yaml")) from e
    except yaml.reader.ReaderError as e:
        # A character YAML does not allow (NUL, most control characters), at its character offset.
        line = text.count("\n", 0, max(e.position, 0)) + 1
        raise PolicyError(path, [(line, "(encoding)", f"character #x{e.character:04x} is not allowed in YAML: {e.reason}")],
                          "encoding") from e
    except yaml.YAMLError as e:
        raise PolicyError(path, [(None, "(yaml)", str(e))], "yaml") from e
    except RecursionError as e:  # not expected below MAX_YAML_DEPTH; never a traceback though
        raise PolicyError(path, [(None, "(yaml)", "nested too deeply to read")], "depth") from e
    except Exception as e:  # noqa: BLE001 — a bug of PyYAML's or ours: the file is refused, never a traceback
        raise PolicyError(path, [(None, "(yaml)", f"could not be read: {type(e).__name__}: {e}")], "internal") from e
    finally:
        if loader is not None:
            loader.dispose()


def field_line(text: str, field: str) -> int | None:
    """The 1-based line of a dotted field path (`filter.runtime`, `rules.0.match`) in a policy's text."""
    try:
        node, _ = _compose(text, "<policy>")
    except PolicyError:
        return None
    return _line_of(node, [int(k) if k.isdigit() else k for k in field.split(".")])


def parse_policy(text: str, path: str = "<policy>") -> Policy:
    node, data = _compose(text, path)
    if not isinstance(data, dict):
        raise PolicyError(path, [(1, "(root)", "a policy is a mapping with version, classes, pools, …")])
    try:
        # A content model's `file` is relative to the policy's directory.
        policy_dir = str(Path(path).parent) if not path.startswith("<") else None
        return Policy.model_validate(data, context={"policy_dir": policy_dir})
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc, msg = _problem(err)
            field = ".".join(str(x) for x in loc) or "(root)"
            problems.append((_line_of(node, loc), field, msg))
        raise PolicyError(path, problems) from e
    except (RecursionError, MemoryError) as e:
        raise PolicyError(path, [(None, "(root)", f"too large to check ({type(e).__name__})")], "size") from e
    except Exception as e:  # noqa: BLE001 — a validator's bug: the file is refused, never a traceback
        raise PolicyError(path, [(None, "(root)", f"could not be checked: {type(e).__name__}: {e}")], "internal") from e


def file_signature(st: os.stat_result) -> tuple:
    """What changes when a file is written or replaced: device, inode, size, mtime and ctime."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_policy_bytes(path: str | Path) -> tuple[bytes, os.stat_result]:
    """The file's bytes and its stat, read from one open file. Refused (PolicyError): what cannot
    be opened or read, what is not a regular file (a directory; a FIFO, which would block the
    reader), a file over MAX_POLICY_BYTES, and (reason `changed`) a file whose stat or path
    changed while it was read: a writer was at work."""
    p = str(path)

    def refuse(msg: str, reason: str = "io") -> PolicyError:
        return PolicyError(p, [(None, "(file)", msg)], reason)

    try:
        # Non-blocking: opening a FIFO with no writer must not hang the control plane.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise refuse(e.strerror or str(e)) from e
    try:
        before = os.fstat(fd)
        if stat.S_ISDIR(before.st_mode):
            raise refuse("is a directory, not a policy file")
        if not stat.S_ISREG(before.st_mode):
            raise refuse("is not a regular file (a FIFO, socket or device)")
        if before.st_size > MAX_POLICY_BYTES:
            raise refuse(f"is {before.st_size} bytes; a policy may be at most {MAX_POLICY_BYTES}", "size")
        chunks: list[bytes] = []
        got = 0
        while got <= MAX_POLICY_BYTES and (chunk := os.read(fd, MAX_POLICY_BYTES + 1 - got)):
            chunks.append(chunk)
            got += len(chunk)
        if got > MAX_POLICY_BYTES:
            raise refuse(f"is over {MAX_POLICY_BYTES} bytes, the most a policy may be", "size")
        after = os.fstat(fd)
    except OSError as e:
        raise refuse(e.strerror or str(e)) from e
    finally:
        os.close(fd)
    try:
        now = os.stat(p)
    except OSError:
        now = None
    if (now is None or file_signature(now) != file_signature(before) or file_signature(after) != file_signature(before)
            or got != before.st_size):
        raise refuse("changed while it was read (a write in progress); read again once it is still", "changed")
    return b"".join(chunks), before


def decode_policy(data: bytes, path: str) -> str:
    """The text of a UTF-8 policy (a UTF-8 byte-order mark is allowed); anything else is refused
    with the line and byte of the first undecodable sequence."""
    if data.startswith((codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise PolicyError(path, [(1, "(encoding)", "the file starts with a UTF-16/UTF-32 byte-order mark; a policy is UTF-8")],
                          "encoding")
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = skip + e.start
        line = data.count(b"\n", 0, at) + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise PolicyError(path, [(line, "(encoding)", f"not valid UTF-8: byte 0x{data[at]:02x} at column {column} "
                                                      f"({e.reason}); a policy is UTF-8")], "encoding") from e


def load_policy(path: str | Path) -> Policy:
    """The policy in the file `path`; whatever is wrong with it, only PolicyError is raised."""
    p = str(path)
    data, _ = read_policy_bytes(p)
    return parse_policy(decode_policy(data, p), p)


LOCAL_POLICY = Path(__file__).resolve().parent.parent / "policies" / "local.yaml"
"""The embedded default: two pools on one machine with the small local models."""
