//! The filter's typed configuration: parsed once when Envoy configures the plugin.
//!
//! An invalid configuration is rejected as a whole with a message that names the field; the
//! glue then keeps the last good configuration (or Envoy refuses to start when there is none).

use crate::content_classifier::ContentModel;
use regex::Regex;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

/// The only configuration version this build understands. A config with another version is
/// refused rather than half-understood.
pub const CONFIG_VERSION: u32 = 1;

/// Headers the filter owns. Any client-sent copy is removed before the decision is written.
pub const HEADER_CLASS: &str = "x-infermesh-class";
pub const HEADER_POOL: &str = "x-infermesh-pool";
pub const HEADER_RULE: &str = "x-infermesh-rule";
/// Prefix of every header the filter reserves for itself.
pub const INTERNAL_HEADER_PREFIX: &str = "x-infermesh-";
/// Gateway API Inference Extension / llm-d: the InferenceObjective a request belongs to.
pub const HEADER_OBJECTIVE: &str = "x-gateway-inference-objective";

/// Default and ceiling of the body buffer. The ceiling stays one read (64 KiB) below Envoy's
/// default per-connection buffer limit (1 MiB): the filter must let go of a body before Envoy
/// would answer 413 on its behalf.
pub const DEFAULT_MAX_BODY_BYTES: usize = 256 * 1024;
pub const MAX_MAX_BODY_BYTES: usize = 1024 * 1024 - 64 * 1024;

/// An integer field of the config: its inclusive bounds and its value when absent. These consts
/// are the filter's one statement of its numeric limits: the parser checks against them, and
/// `limits()` hands them (with the parsed defaults) to the policy model's contract test
/// (mesh-config/tests/test_rule_contract.py), which holds the policy's bounds and defaults to them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// The field's path in the config (`*`: any pool).
    pub field: &'static str,
    pub min: u64,
    pub max: u64,
    pub default: u64,
}

pub const BODY_MAX_BYTES: Limit =
    Limit { field: "body.max_bytes", min: 1, max: MAX_MAX_BODY_BYTES as u64, default: DEFAULT_MAX_BODY_BYTES as u64 };
/// Degraded-mode routing (docs/filter.md): an idle pool is probed twice a second, so its state is
/// known within ~1 s; a reading counts for 5 s; a recovered replica is held 1 s.
pub const PROBE_INTERVAL_MS: Limit = Limit { field: "degraded_routing.probe_interval_ms", min: 50, max: 60_000, default: 500 };
pub const PROBE_TIMEOUT_MS: Limit = Limit { field: "degraded_routing.probe_timeout_ms", min: 10, max: 60_000, default: 400 };
pub const STALE_AFTER_MS: Limit = Limit { field: "degraded_routing.stale_after_ms", min: 100, max: 3_600_000, default: 5000 };
pub const RECOVER_HOLD_MS: Limit = Limit { field: "degraded_routing.recover_hold_ms", min: 0, max: 3_600_000, default: 1000 };
pub const RETRY_AFTER_S: Limit = Limit { field: "degraded_routing.retry_after_s", min: 1, max: 3600, default: 5 };
/// A threshold on the level a pool's replicas report: 1-3 the breakers' rungs (shed, fallback
/// model, critical only), LEVEL_DOWN while a replica does not serve. Absent: LEVEL_DOWN, a pool
/// kept for its state only (the policy always writes the level).
pub const AT_LEVEL: Limit = Limit {
    field: "degraded_routing.pools.*.at_level",
    min: 1,
    max: crate::pool_state::LEVEL_DOWN as u64,
    default: crate::pool_state::LEVEL_DOWN as u64,
};
/// A class's prefix key (prefix_key.rs, docs/prefix-routing.md): keys in the chain, and a
/// completion prompt's chunk (64 B to 64 KiB of its JSON string; 1 KiB is about 250 tokens).
pub const PREFIX_MAX_KEYS: Limit =
    Limit { field: "classes.*.prefix_key.max_keys", min: 1, max: crate::prefix_key::MAX_KEYS as u64, default: 4 };
pub const PREFIX_CHUNK_BYTES: Limit = Limit { field: "classes.*.prefix_key.chunk_bytes", min: 64, max: 65536, default: 1024 };
/// The load bound on naming a keyed class's replica (prefix_table::LoadBound): percent over the
/// pool's mean, the floor under which it never applies, the ceiling over which it always does.
pub const PREFIX_LOAD_OVER_MEAN_PCT: Limit = Limit { field: "classes.*.prefix_key.load_over_mean_pct", min: 0, max: 400, default: 25 };
pub const PREFIX_LOAD_FLOOR_PCT: Limit = Limit { field: "classes.*.prefix_key.load_floor_pct", min: 0, max: 100, default: 50 };
pub const PREFIX_LOAD_CEILING_PCT: Limit = Limit { field: "classes.*.prefix_key.load_ceiling_pct", min: 1, max: 100, default: 90 };
/// Every bounded integer field the parser checks.
pub const LIMITS: [Limit; 12] = [
    BODY_MAX_BYTES,
    PROBE_INTERVAL_MS,
    PROBE_TIMEOUT_MS,
    STALE_AFTER_MS,
    RECOVER_HOLD_MS,
    RETRY_AFTER_S,
    AT_LEVEL,
    PREFIX_MAX_KEYS,
    PREFIX_CHUNK_BYTES,
    PREFIX_LOAD_OVER_MEAN_PCT,
    PREFIX_LOAD_FLOOR_PCT,
    PREFIX_LOAD_CEILING_PCT,
];

/// Token budgets (token_budget.rs, docs/token-budgets.md). A window's limit and a budget's
/// concurrent streams have no default (absent: not limited; `default` 0 says so); the weights of
/// `count` default to 1 each; a class's `default_max_tokens` is its pool's (the policy writes it),
/// 256 (the sidecar's own default) when absent.
pub const BUDGET_PER_MINUTE: Limit = Limit { field: "budgets.classes.*.*.tokens.per_minute", min: 1, max: 1_000_000_000_000, default: 0 };
pub const BUDGET_PER_HOUR: Limit = Limit { field: "budgets.classes.*.*.tokens.per_hour", min: 1, max: 1_000_000_000_000, default: 0 };
pub const BUDGET_PER_DAY: Limit = Limit { field: "budgets.classes.*.*.tokens.per_day", min: 1, max: 1_000_000_000_000, default: 0 };
pub const BUDGET_COUNT_INPUT: Limit = Limit { field: "budgets.classes.*.*.count.input", min: 0, max: 1000, default: 1 };
pub const BUDGET_COUNT_OUTPUT: Limit = Limit { field: "budgets.classes.*.*.count.output", min: 0, max: 1000, default: 1 };
pub const BUDGET_CONCURRENT_STREAMS: Limit = Limit { field: "budgets.classes.*.*.concurrent_streams", min: 1, max: 1_000_000, default: 0 };
pub const BUDGET_DEFAULT_MAX_TOKENS: Limit =
    Limit { field: "budgets.classes.*.default_max_tokens", min: 1, max: u32::MAX as u64, default: 256 };
/// Every bounded field of `budgets` (`*.*`: a class's `default` or one of its `tenants`).
pub const BUDGET_LIMITS: [Limit; 7] =
    [BUDGET_PER_MINUTE, BUDGET_PER_HOUR, BUDGET_PER_DAY, BUDGET_COUNT_INPUT, BUDGET_COUNT_OUTPUT, BUDGET_CONCURRENT_STREAMS, BUDGET_DEFAULT_MAX_TOKENS];
/// Tenants one class's budget may list (each is a metric label).
pub const BUDGET_MAX_TENANTS: usize = 256;

pub const DEFAULT_PROBE_INTERVAL_MS: u64 = PROBE_INTERVAL_MS.default;
pub const DEFAULT_PROBE_TIMEOUT_MS: u64 = PROBE_TIMEOUT_MS.default;
pub const DEFAULT_STALE_AFTER_MS: u64 = STALE_AFTER_MS.default;
pub const DEFAULT_RECOVER_HOLD_MS: u64 = RECOVER_HOLD_MS.default;
pub const DEFAULT_RETRY_AFTER_S: u64 = RETRY_AFTER_S.default;

/// Class, pool, objective and rule names: 1 to this many of [A-Za-z0-9_-] (`check_token`).
pub const TOKEN_MAX_LEN: usize = 64;
/// A probe cluster's name: 1 to this many visible ASCII characters.
pub const PROBE_CLUSTER_MAX_LEN: usize = 256;

// ---- raw (serde) shapes -----------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    version: u32,
    default_class: String,
    classes: BTreeMap<String, RawClass>,
    #[serde(default)]
    rules: Vec<RawRule>,
    #[serde(default)]
    body: RawBody,
    #[serde(default)]
    trusted_sources: RawTrusted,
    #[serde(default)]
    emit_objective_header: bool,
    #[serde(default)]
    degraded_routing: Option<RawDegraded>,
    /// The content classifier's model (content_classifier.rs), for rules' `content` conditions.
    #[serde(default)]
    content_model: Option<crate::content_classifier::RawContentModel>,
    /// Token budgets per class and tenant (token_budget.rs).
    #[serde(default)]
    budgets: Option<RawBudgets>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBudgets {
    tenant: RawTenant,
    classes: BTreeMap<String, RawClassBudgets>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    #[serde(default)]
    header: Option<String>,
    #[serde(default)]
    api_key_hash: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClassBudgets {
    #[serde(default = "default_budget_max_tokens")]
    default_max_tokens: u64,
    #[serde(default)]
    default: Option<RawBudget>,
    #[serde(default)]
    tenants: BTreeMap<String, RawBudget>,
}

fn default_budget_max_tokens() -> u64 {
    BUDGET_DEFAULT_MAX_TOKENS.default
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBudget {
    #[serde(default)]
    tokens: Option<RawTokens>,
    #[serde(default)]
    count: Option<RawCount>,
    #[serde(default)]
    concurrent_streams: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTokens {
    #[serde(default)]
    per_minute: Option<u64>,
    #[serde(default)]
    per_hour: Option<u64>,
    #[serde(default)]
    per_day: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCount {
    #[serde(default = "default_count_weight")]
    input: u64,
    #[serde(default = "default_count_weight")]
    output: u64,
}

fn default_count_weight() -> u64 {
    BUDGET_COUNT_INPUT.default
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDegraded {
    pools: BTreeMap<String, RawDegradedPool>,
    #[serde(default = "default_probe_interval")]
    probe_interval_ms: u64,
    #[serde(default = "default_probe_timeout")]
    probe_timeout_ms: u64,
    #[serde(default = "default_stale_after")]
    stale_after_ms: u64,
    #[serde(default = "default_recover_hold")]
    recover_hold_ms: u64,
    #[serde(default = "default_retry_after")]
    retry_after_s: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDegradedPool {
    #[serde(default = "default_at_level")]
    at_level: u8,
    /// No longer the filter's (Envoy's health check and priority failover spill a degraded
    /// pool): refused by name rather than as an unknown field, so an old config says why.
    #[serde(default, deserialize_with = "present")]
    spill_to: Option<()>,
    #[serde(default)]
    shed_classes: Vec<String>,
    #[serde(default)]
    probe_cluster: Option<String>,
}

fn default_probe_interval() -> u64 {
    DEFAULT_PROBE_INTERVAL_MS
}
fn default_probe_timeout() -> u64 {
    DEFAULT_PROBE_TIMEOUT_MS
}
fn default_stale_after() -> u64 {
    DEFAULT_STALE_AFTER_MS
}
fn default_recover_hold() -> u64 {
    DEFAULT_RECOVER_HOLD_MS
}
fn default_retry_after() -> u64 {
    DEFAULT_RETRY_AFTER_S
}
fn default_at_level() -> u8 {
    crate::pool_state::LEVEL_DOWN
}
/// `Some(())` for a field that is there at all, whatever its value (`null` included).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<()>, D::Error> {
    serde::de::IgnoredAny::deserialize(d).map(|_| Some(()))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClass {
    pool: String,
    #[serde(default)]
    objective: Option<String>,
    /// Present: the filter writes this class's prefix key (prefix_key.rs).
    #[serde(default)]
    prefix_key: Option<RawPrefixKey>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPrefixKey {
    #[serde(default = "default_prefix_max_keys")]
    max_keys: u64,
    #[serde(default = "default_prefix_chunk_bytes")]
    chunk_bytes: u64,
    #[serde(default = "default_prefix_load_over_mean_pct")]
    load_over_mean_pct: u64,
    #[serde(default = "default_prefix_load_floor_pct")]
    load_floor_pct: u64,
    #[serde(default = "default_prefix_load_ceiling_pct")]
    load_ceiling_pct: u64,
}

fn default_prefix_load_over_mean_pct() -> u64 {
    PREFIX_LOAD_OVER_MEAN_PCT.default
}

fn default_prefix_load_floor_pct() -> u64 {
    PREFIX_LOAD_FLOOR_PCT.default
}

fn default_prefix_load_ceiling_pct() -> u64 {
    PREFIX_LOAD_CEILING_PCT.default
}

fn default_prefix_max_keys() -> u64 {
    PREFIX_MAX_KEYS.default
}

fn default_prefix_chunk_bytes() -> u64 {
    PREFIX_CHUNK_BYTES.default
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    class: String,
    #[serde(rename = "match", default)]
    matcher: RawMatch,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    #[serde(default)]
    methods: Vec<String>,
    #[serde(default)]
    path: Option<RawStringMatch>,
    #[serde(default)]
    headers: Vec<RawHeaderMatch>,
    #[serde(default)]
    body: Option<RawBodyMatch>,
    #[serde(default)]
    content: Option<RawContentMatch>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawContentMatch {
    label: String,
    #[serde(default)]
    min_score: f64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStringMatch {
    exact: Option<String>,
    prefix: Option<String>,
    regex: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeaderMatch {
    name: String,
    exact: Option<String>,
    prefix: Option<String>,
    regex: Option<String>,
    /// `false`: the header must be absent.
    #[serde(default)]
    present: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBodyMatch {
    stream: Option<bool>,
    max_tokens: Option<Range>,
    n: Option<Range>,
    model: Option<RawStringMatch>,
    message_count: Option<Range>,
    prompt_chars: Option<Range>,
    priority: Option<RawStringMatch>,
    service_tier: Option<RawStringMatch>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBody {
    #[serde(default = "default_max_body")]
    max_bytes: usize,
}

impl Default for RawBody {
    fn default() -> Self {
        RawBody { max_bytes: DEFAULT_MAX_BODY_BYTES }
    }
}

fn default_max_body() -> usize {
    DEFAULT_MAX_BODY_BYTES
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrusted {
    #[serde(default)]
    cidrs: Vec<String>,
    #[serde(default)]
    principals: Vec<String>,
}

// ---- validated shapes -------------------------------------------------------------------------

/// An inclusive numeric range; either end may be open.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Range {
    #[serde(default)]
    pub min: Option<u64>,
    #[serde(default)]
    pub max: Option<u64>,
}

impl Range {
    pub fn contains(&self, v: u64) -> bool {
        self.min.map_or(true, |m| v >= m) && self.max.map_or(true, |m| v <= m)
    }
}

/// How a string (path, header value, body field) is matched.
#[derive(Debug, Clone)]
pub enum StringMatch {
    Exact(String),
    Prefix(String),
    Regex(Regex),
}

impl StringMatch {
    pub fn matches(&self, s: &str) -> bool {
        match self {
            StringMatch::Exact(x) => s == x,
            StringMatch::Prefix(x) => s.starts_with(x.as_str()),
            StringMatch::Regex(r) => r.is_match(s),
        }
    }
}

/// A header condition: `None` = the header must be present; `Absent` = it must not be.
#[derive(Debug, Clone)]
pub enum HeaderCond {
    Present,
    Absent,
    Value(StringMatch),
}

#[derive(Debug, Clone)]
pub struct HeaderMatch {
    pub name: String,
    pub cond: HeaderCond,
}

/// Conditions on the JSON body. A field that is absent or of the wrong type does not match a
/// condition on it, except `stream` (absent = false, OpenAI's default) and `n` (absent = 1).
#[derive(Debug, Clone, Default)]
pub struct BodyMatch {
    pub stream: Option<bool>,
    pub max_tokens: Option<Range>,
    pub n: Option<Range>,
    pub model: Option<StringMatch>,
    pub message_count: Option<Range>,
    pub prompt_chars: Option<Range>,
    pub priority: Option<StringMatch>,
    pub service_tier: Option<StringMatch>,
}

/// A condition on the request's content label (content_classifier.rs): the label the model gives
/// the request's text is `label` (an index into the model's labels), with a score of at least
/// `min_score`. A request with no text has no label: the condition does not hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ContentMatch {
    pub label: usize,
    pub min_score: f64,
}

/// One ordered rule: all its conditions must hold; the first matching rule decides.
#[derive(Debug, Clone)]
pub struct Rule {
    pub name: String,
    pub class: String,
    pub pool: String,
    pub objective: String,
    pub methods: Vec<String>,
    pub path: Option<StringMatch>,
    pub headers: Vec<HeaderMatch>,
    pub body: Option<BodyMatch>,
    pub content: Option<ContentMatch>,
}

impl Rule {
    /// Whether the rule looks at the body (a body field or its content).
    pub fn needs_body(&self) -> bool {
        self.body.is_some() || self.content.is_some()
    }
}

/// An IP network (`10.0.0.0/8`, `::1/128`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Option<Cidr> {
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a.parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max)?,
            None => max,
        };
        Some(Cidr { addr, prefix })
    }

    pub fn contains(&self, ip: &IpAddr) -> bool {
        fn masked(bits: u128, prefix: u8, width: u8) -> u128 {
            if prefix == 0 {
                0
            } else {
                bits >> (width - prefix)
            }
        }
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                masked(u32::from(n) as u128, self.prefix, 32) == masked(u32::from(*a) as u128, self.prefix, 32)
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => masked(u128::from(n), self.prefix, 128) == masked(u128::from(*a), self.prefix, 128),
            (IpAddr::V4(n), IpAddr::V6(a)) => match a.to_ipv4_mapped() {
                Some(a4) => masked(u32::from(n) as u128, self.prefix, 32) == masked(u32::from(a4) as u128, self.prefix, 32),
                None => false,
            },
            (IpAddr::V6(_), IpAddr::V4(_)) => false,
        }
    }
}

/// Sources whose `x-infermesh-*` headers are kept (an upstream infermesh hop already decided).
#[derive(Debug, Clone, Default)]
pub struct TrustedSources {
    pub cidrs: Vec<Cidr>,
    /// mTLS peer identities (URI SANs, e.g. `spiffe://cluster.local/ns/gw/sa/gateway`).
    pub principals: Vec<String>,
}

impl TrustedSources {
    pub fn is_empty(&self) -> bool {
        self.cidrs.is_empty() && self.principals.is_empty()
    }
}

/// The validated configuration the request path uses.
#[derive(Debug, Clone)]
pub struct FilterConfig {
    /// Every class the config defines, with its pool (metric labels are bounded to these names).
    pub classes: BTreeMap<String, String>,
    pub default_class: String,
    pub default_pool: String,
    pub default_objective: String,
    pub rules: Vec<Rule>,
    /// Bodies up to this size are buffered when a rule needs them.
    pub max_body_bytes: usize,
    pub trusted: TrustedSources,
    pub emit_objective_header: bool,
    /// `when_degraded`, applied by the filter itself; `None`: no pool has it.
    pub degraded: Option<DegradedRouting>,
    /// The classes whose requests get a prefix key, with its form (docs/prefix-routing.md).
    pub prefix: BTreeMap<String, crate::prefix_key::PrefixSpec>,
    /// The same classes' load bound on naming a replica (docs/prefix-routing.md).
    pub prefix_bound: BTreeMap<String, crate::prefix_table::LoadBound>,
    /// The content classifier's model, when a rule has a `content` condition.
    pub content_model: Option<crate::content_classifier::ContentModel>,
    /// Token budgets per class and tenant; `None`: no request is budgeted.
    pub budgets: Option<crate::token_budget::Budgets>,
}

/// One pool's `when_degraded` as the filter applies it (shedding; spill is Envoy's health-check
/// failover) and how its state is learned.
#[derive(Debug, Clone)]
pub struct DegradedPool {
    pub rule: crate::pool_state::PoolRule,
    pub shed_classes: Vec<String>,
    /// The Envoy cluster of the pool's HTTP front, for the state probe (`pool_NAME` in plain
    /// Envoy, `outbound|PORT||HOST` in Istio); `None`: learned from traffic only.
    pub probe_cluster: Option<String>,
}

/// Degraded-mode routing: the pools the filter keeps state for, and the timings.
#[derive(Debug, Clone)]
pub struct DegradedRouting {
    pub pools: BTreeMap<String, DegradedPool>,
    pub probe_interval_ms: u64,
    pub probe_timeout_ms: u64,
    pub retry_after_s: u64,
}

/// Why a configuration was refused; `field` is a JSON-path-like location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid infermesh filter config at `{}`: {}", self.field, self.message)
    }
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), message: message.into() }
}

/// Compiled size allowed to one regex, and to all of a config's together: a few bytes of pattern
/// (`a{1000}{10}`) compile to most of a MiB, so a config of many would otherwise take memory
/// without bound. The config's regexes share the total equally, each at most the per-regex limit.
pub const REGEX_SIZE_LIMIT: usize = 1 << 20;
pub const REGEX_TOTAL_SIZE_LIMIT: usize = 16 << 20;
/// Nesting of groups and classes a pattern may have (the `regex` crate's default, set here so
/// that the policy's model of the dialect, filter_regex.py, is checked against a number of ours).
pub const REGEX_NEST_LIMIT: u32 = 250;

fn regex_size_limit(count: usize) -> usize {
    (REGEX_TOTAL_SIZE_LIMIT / count.max(1)).min(REGEX_SIZE_LIMIT)
}

fn string_match(field: &str, raw: RawStringMatch, regex_limit: usize) -> Result<StringMatch, ConfigError> {
    match (raw.exact, raw.prefix, raw.regex) {
        (Some(x), None, None) => Ok(StringMatch::Exact(x)),
        (None, Some(x), None) => Ok(StringMatch::Prefix(x)),
        (None, None, Some(x)) => {
            // Bounded compiled size and match-time cache: a pathological pattern is a config
            // error, not a memory hog.
            regex::RegexBuilder::new(&x)
                .nest_limit(REGEX_NEST_LIMIT)
                .size_limit(regex_limit)
                .dfa_size_limit(regex_limit)
                .build()
                .map(StringMatch::Regex)
                .map_err(|e| {
                    let mut refused = err(format!("{field}.regex"), format!("invalid regex: {e}"));
                    if regex_limit < REGEX_SIZE_LIMIT {
                        refused.message.push_str(&format!(" (the config's regexes share {} MiB of compiled size)", REGEX_TOTAL_SIZE_LIMIT >> 20));
                    }
                    refused
                })
        }
        _ => Err(err(field, "exactly one of `exact`, `prefix`, `regex` is required")),
    }
}

/// How many regexes the rules compile (they share REGEX_TOTAL_SIZE_LIMIT).
fn regex_count(rules: &[RawRule]) -> usize {
    let is = |m: &Option<RawStringMatch>| m.as_ref().map_or(0, |m| usize::from(m.regex.is_some()));
    rules
        .iter()
        .map(|r| {
            let m = &r.matcher;
            let body = m.body.as_ref().map_or(0, |b| is(&b.model) + is(&b.priority) + is(&b.service_tier));
            is(&m.path) + m.headers.iter().filter(|h| h.regex.is_some()).count() + body
        })
        .sum()
}

fn check_range(field: &str, r: Range) -> Result<Range, ConfigError> {
    match (r.min, r.max) {
        (None, None) => Err(err(field, "a range needs `min`, `max` or both")),
        (Some(a), Some(b)) if a > b => Err(err(field, format!("min {a} is above max {b}"))),
        _ => Ok(r),
    }
}

impl FilterConfig {
    /// Parse and validate the plugin configuration bytes.
    pub fn parse(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        // serde_json names the unknown or missing field and the position; keep its message and
        // add the field's path where it can be found.
        let raw: RawConfig = serde_json::from_slice(bytes).map_err(|e| serde_error(bytes, &e))?;
        if raw.version != CONFIG_VERSION {
            return Err(err(
                "version",
                format!("unsupported version {} (this filter understands {})", raw.version, CONFIG_VERSION),
            ));
        }
        if raw.classes.is_empty() {
            return Err(err("classes", "at least one class is required"));
        }
        let mut classes = BTreeMap::new();
        let mut prefix = BTreeMap::new();
        let mut prefix_bound = BTreeMap::new();
        for (name, class) in &raw.classes {
            check_token(&format!("classes.{name}"), name)?;
            check_token(&format!("classes.{name}.pool"), &class.pool)?;
            let objective = class.objective.clone().unwrap_or_else(|| name.clone());
            if let Some(o) = &class.objective {
                check_token(&format!("classes.{name}.objective"), o)?;
            }
            classes.insert(name.clone(), (class.pool.clone(), objective));
            if let Some(p) = &class.prefix_key {
                let bounded = |l: Limit, v: u64| -> Result<usize, ConfigError> {
                    let field = format!("classes.{name}.prefix_key.{}", l.field.rsplit('.').next().unwrap_or(""));
                    if (l.min..=l.max).contains(&v) {
                        Ok(v as usize)
                    } else {
                        Err(err(field, format!("must be between {} and {}", l.min, l.max)))
                    }
                };
                let spec = crate::prefix_key::PrefixSpec {
                    max_keys: bounded(PREFIX_MAX_KEYS, p.max_keys)?,
                    chunk_bytes: bounded(PREFIX_CHUNK_BYTES, p.chunk_bytes)?,
                };
                let bound = crate::prefix_table::LoadBound {
                    over_mean_pct: bounded(PREFIX_LOAD_OVER_MEAN_PCT, p.load_over_mean_pct)? as u64,
                    floor_pct: bounded(PREFIX_LOAD_FLOOR_PCT, p.load_floor_pct)? as u64,
                    ceiling_pct: bounded(PREFIX_LOAD_CEILING_PCT, p.load_ceiling_pct)? as u64,
                };
                prefix.insert(name.clone(), spec);
                prefix_bound.insert(name.clone(), bound);
            }
        }
        let lookup = |field: &str, class: &str| -> Result<(String, String), ConfigError> {
            classes.get(class).cloned().ok_or_else(|| err(field, format!("unknown class `{class}`")))
        };
        let (default_pool, default_objective) = lookup("default_class", &raw.default_class)?;
        let content_model = match raw.content_model {
            Some(m) => Some(ContentModel::from_raw("content_model", m).map_err(|(f, m)| err(f, m))?),
            None => None,
        };
        let regex_limit = regex_size_limit(regex_count(&raw.rules));
        let mut rules = Vec::with_capacity(raw.rules.len());
        let mut seen = BTreeSet::new();
        for (i, r) in raw.rules.into_iter().enumerate() {
            let at = format!("rules[{i}]");
            check_token(&format!("{at}.name"), &r.name)?;
            if r.name == crate::classify::DEFAULT_RULE || r.name == crate::classify::TRUSTED_RULE {
                return Err(err(format!("{at}.name"), format!("`{}` is reserved", r.name)));
            }
            if !seen.insert(r.name.clone()) {
                return Err(err(format!("{at}.name"), format!("duplicate rule name `{}`", r.name)));
            }
            let (pool, objective) = lookup(&format!("{at}.class"), &r.class)?;
            let m = r.matcher;
            let path = match m.path {
                Some(p) => {
                    let f = format!("{at}.match.path");
                    let sm = string_match(&f, p, regex_limit)?;
                    if let StringMatch::Exact(p) | StringMatch::Prefix(p) = &sm {
                        if !p.starts_with('/') {
                            return Err(err(f, "a path must start with `/`"));
                        }
                    }
                    Some(sm)
                }
                None => None,
            };
            let mut headers = Vec::with_capacity(m.headers.len());
            for (j, h) in m.headers.into_iter().enumerate() {
                let f = format!("{at}.match.headers[{j}]");
                if h.name.is_empty() || h.name.bytes().any(|b| b.is_ascii_uppercase() || b <= b' ' || b >= 0x7f) {
                    return Err(err(format!("{f}.name"), "header names must be non-empty lower-case tokens"));
                }
                let has_value = h.exact.is_some() || h.prefix.is_some() || h.regex.is_some();
                let cond = match (h.present, has_value) {
                    (Some(false), false) => HeaderCond::Absent,
                    (Some(true) | None, false) => HeaderCond::Present,
                    (None | Some(true), true) => {
                        HeaderCond::Value(string_match(&f, RawStringMatch { exact: h.exact, prefix: h.prefix, regex: h.regex }, regex_limit)?)
                    }
                    (Some(false), true) => return Err(err(f, "`present: false` cannot be combined with a value match")),
                };
                headers.push(HeaderMatch { name: h.name, cond });
            }
            let body = match m.body {
                Some(b) => {
                    let f = format!("{at}.match.body");
                    let opt_range = |name: &str, r: Option<Range>| r.map(|r| check_range(&format!("{f}.{name}"), r)).transpose();
                    let opt_str = |name: &str, s: Option<RawStringMatch>| s.map(|s| string_match(&format!("{f}.{name}"), s, regex_limit)).transpose();
                    let bm = BodyMatch {
                        stream: b.stream,
                        max_tokens: opt_range("max_tokens", b.max_tokens)?,
                        n: opt_range("n", b.n)?,
                        model: opt_str("model", b.model)?,
                        message_count: opt_range("message_count", b.message_count)?,
                        prompt_chars: opt_range("prompt_chars", b.prompt_chars)?,
                        priority: opt_str("priority", b.priority)?,
                        service_tier: opt_str("service_tier", b.service_tier)?,
                    };
                    Some(bm)
                }
                None => None,
            };
            let content = match m.content {
                Some(c) => Some(content_match(&format!("{at}.match.content"), c, content_model.as_ref())?),
                None => None,
            };
            rules.push(Rule {
                name: r.name,
                class: r.class,
                pool,
                objective,
                methods: m.methods.iter().map(|m| m.to_ascii_uppercase()).collect(),
                path,
                headers,
                body,
                content,
            });
        }
        if !(BODY_MAX_BYTES.min..=BODY_MAX_BYTES.max).contains(&(raw.body.max_bytes as u64)) {
            let (lo, hi) = (BODY_MAX_BYTES.min, BODY_MAX_BYTES.max);
            return Err(err(BODY_MAX_BYTES.field, format!("must be between {lo} and {hi} (below Envoy's 1 MiB per-connection buffer)")));
        }
        let mut trusted = TrustedSources::default();
        for (i, c) in raw.trusted_sources.cidrs.iter().enumerate() {
            let cidr = Cidr::parse(c).ok_or_else(|| err(format!("trusted_sources.cidrs[{i}]"), format!("`{c}` is not an IP network")))?;
            trusted.cidrs.push(cidr);
        }
        for (i, p) in raw.trusted_sources.principals.iter().enumerate() {
            if p.is_empty() {
                return Err(err(format!("trusted_sources.principals[{i}]"), "must not be empty"));
            }
        }
        trusted.principals = raw.trusted_sources.principals;
        let degraded = match raw.degraded_routing {
            Some(d) => Some(degraded_routing(d, &classes)?),
            None => None,
        };
        let budgets = match raw.budgets {
            Some(b) => Some(budgets(b, &classes)?),
            None => None,
        };
        Ok(FilterConfig {
            classes: classes.into_iter().map(|(c, (pool, _))| (c, pool)).collect(),
            default_class: raw.default_class,
            default_pool,
            default_objective,
            rules,
            max_body_bytes: raw.body.max_bytes,
            trusted,
            emit_objective_header: raw.emit_objective_header,
            degraded,
            prefix,
            prefix_bound,
            content_model,
            budgets,
        })
    }

    /// Every pool the config names: the classes' pools and those degraded routing keeps state for.
    pub fn pool_names(&self) -> BTreeSet<&str> {
        let mut pools: BTreeSet<&str> = self.classes.values().map(String::as_str).collect();
        if let Some(d) = &self.degraded {
            pools.extend(d.pools.keys().map(String::as_str));
        }
        pools
    }

    /// Whether any rule looks at the body (otherwise the filter never buffers).
    pub fn needs_body(&self) -> bool {
        self.rules.iter().any(Rule::needs_body)
    }
}

/// A rule's `content` condition, against the config's model.
fn content_match(field: &str, raw: RawContentMatch, model: Option<&ContentModel>) -> Result<ContentMatch, ConfigError> {
    let model = model.ok_or_else(|| err(field, "a `content` condition needs a `content_model`"))?;
    let label = model.label_index(&raw.label).ok_or_else(|| {
        err(format!("{field}.label"), format!("unknown label `{}` (the model's labels: {})", raw.label, model.labels.join(", ")))
    })?;
    if !(0.0..=1.0).contains(&raw.min_score) {
        return Err(err(format!("{field}.min_score"), "must be between 0 and 1"));
    }
    Ok(ContentMatch { label, min_score: raw.min_score })
}

/// A content model on its own (a model file: `infermesh classes`' format, the same JSON as the
/// config's `content_model`), checked as the config checks it; errors name the field from the
/// model's top (`dim`, `labels[2]`) or, for serde's, where it broke.
pub fn parse_content_model(bytes: &[u8]) -> Result<ContentModel, ConfigError> {
    let raw: crate::content_classifier::RawContentModel = serde_json::from_slice(bytes).map_err(|e| serde_error(bytes, &e))?;
    ContentModel::from_raw("", raw).map_err(|(f, m)| err(f.trim_start_matches('.'), m))
}

/// serde's refusal (field `$`, its words and position), with ` (at `PATH`)`: a wrong type's
/// message names no field, and an unknown one only its own name.
fn serde_error(bytes: &[u8], e: &serde_json::Error) -> ConfigError {
    let mut refused = err("$", e.to_string());
    let missing = refused.message.strip_prefix("missing field `").and_then(|r| r.split('`').next()).map(str::to_string);
    if let Some(path) = path_at(bytes, offset_of(bytes, e.line(), e.column()), missing.as_deref()) {
        refused.message.push_str(&format!(" (at `{path}`)"));
    }
    refused
}

/// The byte offset of serde_json's (line, column): lines from 1, columns counted in bytes.
fn offset_of(bytes: &[u8], line: usize, column: usize) -> usize {
    let mut start = 0;
    if line > 1 {
        match bytes.iter().enumerate().filter(|(_, b)| **b == b'\n').nth(line - 2) {
            Some((i, _)) => start = i + 1,
            None => return bytes.len(),
        }
    }
    start.saturating_add(column).min(bytes.len())
}

/// The path of the value being read at byte `end` of `bytes`, found by one pass over the tokens
/// before it (no tree is built: the cost is the input's); `missing`: the field serde found absent
/// from the object that closed there. `None` past a depth no config has.
fn path_at(bytes: &[u8], end: usize, missing: Option<&str>) -> Option<String> {
    enum Frame {
        Object(Option<String>),
        Array(usize, bool),
    }
    fn started(stack: &mut [Frame]) {
        if let Some(Frame::Array(_, started)) = stack.last_mut() {
            *started = true;
        }
    }
    let mut stack: Vec<Frame> = Vec::new();
    let mut i = 0;
    while i < end {
        match bytes[i] {
            b'{' | b'[' => {
                started(&mut stack);
                if stack.len() >= 256 {
                    return None;
                }
                stack.push(if bytes[i] == b'{' { Frame::Object(None) } else { Frame::Array(0, false) });
            }
            b'}' | b']' => {
                stack.pop();
            }
            b',' => match stack.last_mut() {
                Some(Frame::Array(index, started)) => {
                    *index += 1;
                    *started = false;
                }
                Some(Frame::Object(key)) => *key = None,
                None => {}
            },
            b'"' => {
                let from = i + 1;
                i += 1;
                while i < end && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                match stack.last_mut() {
                    Some(Frame::Object(key)) if key.is_none() => {
                        let raw = &bytes[from..i.min(end)];
                        *key = Some(serde_json::from_slice::<String>(&[b"\"", raw, b"\""].concat()).unwrap_or_else(|_| String::from_utf8_lossy(raw).into_owned()));
                    }
                    _ => started(&mut stack),
                }
            }
            b' ' | b'\t' | b'\n' | b'\r' | b':' => {}
            _ => started(&mut stack),
        }
        i += 1;
    }
    let mut path = String::new();
    for f in &stack {
        match f {
            Frame::Object(Some(k)) => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
            }
            Frame::Array(index, true) => path.push_str(&format!("[{index}]")),
            _ => {}
        }
    }
    if let Some(name) = missing {
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(name);
    }
    (!path.is_empty()).then_some(path)
}

/// `v` within `limit`, or an error at `field` (the limit's own path, or a pool's for `*`).
fn bounded(field: &str, v: u64, limit: Limit) -> Result<u64, ConfigError> {
    if (limit.min..=limit.max).contains(&v) {
        Ok(v)
    } else {
        Err(err(field, format!("must be between {} and {}", limit.min, limit.max)))
    }
}

fn degraded_routing(d: RawDegraded, classes: &BTreeMap<String, (String, String)>) -> Result<DegradedRouting, ConfigError> {
    let at = "degraded_routing";
    let interval = bounded(PROBE_INTERVAL_MS.field, d.probe_interval_ms, PROBE_INTERVAL_MS)?;
    let timeout = bounded(PROBE_TIMEOUT_MS.field, d.probe_timeout_ms, PROBE_TIMEOUT_MS)?;
    let stale = bounded(STALE_AFTER_MS.field, d.stale_after_ms, STALE_AFTER_MS)?;
    let hold = bounded(RECOVER_HOLD_MS.field, d.recover_hold_ms, RECOVER_HOLD_MS)?;
    let retry_after_s = bounded(RETRY_AFTER_S.field, d.retry_after_s, RETRY_AFTER_S)?;
    let mut pools = BTreeMap::new();
    for (name, p) in &d.pools {
        let f = format!("{at}.pools.{name}");
        check_token(&f, name)?;
        if p.spill_to.is_some() {
            return Err(err(format!("{f}.spill_to"), "spill is Envoy's health-check failover now (remove the field)"));
        }
        bounded(&format!("{f}.at_level"), u64::from(p.at_level), AT_LEVEL)?;
        for (i, c) in p.shed_classes.iter().enumerate() {
            if !classes.contains_key(c) {
                return Err(err(format!("{f}.shed_classes[{i}]"), format!("unknown class `{c}`")));
            }
        }
        if let Some(c) = &p.probe_cluster {
            if c.is_empty() || c.len() > PROBE_CLUSTER_MAX_LEN || c.bytes().any(|b| b <= b' ' || b >= 0x7f) {
                return Err(err(format!("{f}.probe_cluster"), format!("must be a cluster name (1-{PROBE_CLUSTER_MAX_LEN} visible ASCII characters)")));
            }
        }
        let rule = crate::pool_state::PoolRule { at_level: p.at_level, stale_after_ms: stale, recover_hold_ms: hold };
        pools.insert(
            name.clone(),
            DegradedPool { rule, shed_classes: p.shed_classes.clone(), probe_cluster: p.probe_cluster.clone() },
        );
    }
    Ok(DegradedRouting { pools, probe_interval_ms: interval, probe_timeout_ms: timeout, retry_after_s })
}

fn budgets(b: RawBudgets, classes: &BTreeMap<String, (String, String)>) -> Result<crate::token_budget::Budgets, ConfigError> {
    use crate::token_budget::{Budgets, ClassBudgets, TenantSource};
    let tenant = match (b.tenant.header, b.tenant.api_key_hash) {
        (Some(h), None) => {
            check_header_name("budgets.tenant.header", &h)?;
            TenantSource::Header(h)
        }
        (None, Some(true)) => TenantSource::ApiKeyHash,
        (None, Some(false)) => return Err(err("budgets.tenant.api_key_hash", "must be true (or name a `header`)")),
        _ => return Err(err("budgets.tenant", "exactly one of `header`, `api_key_hash` is required")),
    };
    if b.classes.is_empty() {
        return Err(err("budgets.classes", "a budget needs at least one class"));
    }
    let mut out = BTreeMap::new();
    for (name, c) in b.classes {
        let at = format!("budgets.classes.{name}");
        if !classes.contains_key(&name) {
            return Err(err(at, format!("unknown class `{name}`")));
        }
        let default_max_tokens = bounded(&format!("{at}.default_max_tokens"), c.default_max_tokens, BUDGET_DEFAULT_MAX_TOKENS)?;
        if c.default.is_none() && c.tenants.is_empty() {
            return Err(err(at, "a class's budget needs a `default`, `tenants` or both"));
        }
        if c.tenants.len() > BUDGET_MAX_TENANTS {
            return Err(err(format!("{at}.tenants"), format!("at most {BUDGET_MAX_TENANTS} tenants per class")));
        }
        let default = match c.default {
            Some(d) => Some(budget(&format!("{at}.default"), d)?),
            None => None,
        };
        let mut tenants = BTreeMap::new();
        for (t, raw) in c.tenants {
            let f = format!("{at}.tenants.{t}");
            check_token(&f, &t)?;
            if t == crate::token_budget::OTHER {
                return Err(err(f, "`other` is reserved (tenants not listed are counted as `other`)"));
            }
            if tenant == TenantSource::ApiKeyHash && !(t.len() == 16 && t.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))) {
                return Err(err(f, "with `api_key_hash` a tenant is named by the first 16 hex digits (lower case) of its key's SHA-256"));
            }
            let parsed = budget(&f, raw)?;
            tenants.insert(t, parsed);
        }
        out.insert(name, ClassBudgets { default_max_tokens, default, tenants });
    }
    Ok(Budgets { tenant, classes: out })
}

fn budget(at: &str, b: RawBudget) -> Result<crate::token_budget::Budget, ConfigError> {
    if b.tokens.is_none() && b.concurrent_streams.is_none() {
        return Err(err(at, "a budget needs `tokens`, `concurrent_streams` or both"));
    }
    let mut tokens = [None; 3];
    if let Some(t) = b.tokens {
        if t.per_minute.is_none() && t.per_hour.is_none() && t.per_day.is_none() {
            return Err(err(format!("{at}.tokens"), "`tokens` needs `per_minute`, `per_hour`, `per_day` or several"));
        }
        for (slot, (v, l)) in tokens.iter_mut().zip([(t.per_minute, BUDGET_PER_MINUTE), (t.per_hour, BUDGET_PER_HOUR), (t.per_day, BUDGET_PER_DAY)]) {
            if let Some(v) = v {
                *slot = Some(bounded(&format!("{at}.tokens.{}", l.field.rsplit('.').next().unwrap_or("")), v, l)?);
            }
        }
    }
    let count = b.count.unwrap_or(RawCount { input: BUDGET_COUNT_INPUT.default, output: BUDGET_COUNT_OUTPUT.default });
    let input_weight = bounded(&format!("{at}.count.input"), count.input, BUDGET_COUNT_INPUT)?;
    let output_weight = bounded(&format!("{at}.count.output"), count.output, BUDGET_COUNT_OUTPUT)?;
    if input_weight == 0 && output_weight == 0 {
        return Err(err(format!("{at}.count"), "`input` and `output` cannot both be 0 (nothing would be charged)"));
    }
    let concurrent_streams = match b.concurrent_streams {
        Some(n) => Some(bounded(&format!("{at}.concurrent_streams"), n, BUDGET_CONCURRENT_STREAMS)?),
        None => None,
    };
    Ok(crate::token_budget::Budget { tokens, input_weight, output_weight, concurrent_streams })
}

/// A header name the filter reads: lower case, visible ASCII (what Envoy's map holds).
fn check_header_name(field: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.bytes().any(|b| b.is_ascii_uppercase() || b <= b' ' || b >= 0x7f) {
        return Err(err(field, "header names must be non-empty lower-case tokens"));
    }
    Ok(())
}

/// Class, pool and rule names end up in header values and metric names: keep them plain.
fn check_token(field: &str, value: &str) -> Result<(), ConfigError> {
    token_error(value).map_err(|message| err(field, message))
}

/// `check_token`'s verdict, without the field (a content model's labels are checked with it).
pub(crate) fn token_error(value: &str) -> Result<(), String> {
    let ok = !value.is_empty()
        && value.len() <= TOKEN_MAX_LEN
        && value.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(format!("`{value}` must be 1-{TOKEN_MAX_LEN} characters of [A-Za-z0-9_-]"))
    }
}

/// The limits the policy model shares with this parser, for its contract test (printed by
/// `cargo run --example config_limits`): each bounded field, and the defaults as `parse` fills
/// them into a config that leaves everything optional out.
pub fn limits() -> serde_json::Value {
    use serde_json::json;
    let minimal = r#"{"version": 1, "default_class": "c", "classes": {"c": {"pool": "p", "prefix_key": {}}}, "degraded_routing": {"pools": {"p": {}}}}"#;
    let c = FilterConfig::parse(minimal.as_bytes()).expect("the minimal config parses");
    let d = c.degraded.as_ref().expect("it has degraded routing");
    let pool = &d.pools["p"];
    let prefix = &c.prefix["c"];
    let bound = &c.prefix_bound["c"];
    let bounded: serde_json::Map<String, serde_json::Value> =
        LIMITS.iter().map(|l| (l.field.to_string(), json!({"min": l.min, "max": l.max, "default": l.default}))).collect();
    json!({
        "version": CONFIG_VERSION,
        "bounded": bounded,
        "defaults": {
            "body.max_bytes": c.max_body_bytes,
            "emit_objective_header": c.emit_objective_header,
            "trusted_sources.cidrs": c.trusted.cidrs.len(),
            "trusted_sources.principals": c.trusted.principals.len(),
            "degraded_routing.probe_interval_ms": d.probe_interval_ms,
            "degraded_routing.probe_timeout_ms": d.probe_timeout_ms,
            "degraded_routing.stale_after_ms": pool.rule.stale_after_ms,
            "degraded_routing.recover_hold_ms": pool.rule.recover_hold_ms,
            "degraded_routing.retry_after_s": d.retry_after_s,
            "degraded_routing.pools.*.at_level": pool.rule.at_level,
            "degraded_routing.pools.*.shed_classes": pool.shed_classes.len(),
            "classes.*.prefix_key.max_keys": prefix.max_keys,
            "classes.*.prefix_key.chunk_bytes": prefix.chunk_bytes,
            "classes.*.prefix_key.load_over_mean_pct": bound.over_mean_pct,
            "classes.*.prefix_key.load_floor_pct": bound.floor_pct,
            "classes.*.prefix_key.load_ceiling_pct": bound.ceiling_pct,
        },
        "level_down": crate::pool_state::LEVEL_DOWN,
        "token_max_len": TOKEN_MAX_LEN,
        "reserved_rule_names": [crate::classify::DEFAULT_RULE, crate::classify::TRUSTED_RULE],
        "regex": {"size_limit": REGEX_SIZE_LIMIT, "total_size_limit": REGEX_TOTAL_SIZE_LIMIT, "nest_limit": REGEX_NEST_LIMIT},
        "probe_cluster_max_len": PROBE_CLUSTER_MAX_LEN,
        "budgets": budget_limits(),
    })
}

/// `limits()`' budgets part: each bounded field, the defaults `parse` fills in, the tenant bounds.
fn budget_limits() -> serde_json::Value {
    use serde_json::json;
    let minimal = r#"{"version": 1, "default_class": "c", "classes": {"c": {"pool": "p"}},
        "budgets": {"tenant": {"header": "x-tenant"}, "classes": {"c": {"default": {"concurrent_streams": 1}}}}}"#;
    let c = FilterConfig::parse(minimal.as_bytes()).expect("the minimal budgets config parses");
    let b = c.budgets.as_ref().expect("it has budgets");
    let class = &b.classes["c"];
    let d = class.default.as_ref().expect("a default budget");
    let bounded: serde_json::Map<String, serde_json::Value> =
        BUDGET_LIMITS.iter().map(|l| (l.field.to_string(), json!({"min": l.min, "max": l.max, "default": l.default}))).collect();
    let none = |v: Option<u64>| v.unwrap_or(0);
    json!({
        "bounded": bounded,
        "defaults": {
            "budgets.classes.*.*.tokens.per_minute": none(d.tokens[0]),
            "budgets.classes.*.*.tokens.per_hour": none(d.tokens[1]),
            "budgets.classes.*.*.tokens.per_day": none(d.tokens[2]),
            "budgets.classes.*.*.count.input": d.input_weight,
            "budgets.classes.*.*.count.output": d.output_weight,
            "budgets.classes.*.*.concurrent_streams": BUDGET_CONCURRENT_STREAMS.default,
            "budgets.classes.*.default_max_tokens": class.default_max_tokens,
            "budgets.classes.*.tenants": class.tenants.len(),
        },
        "max_tenants": BUDGET_MAX_TENANTS,
        "windows": crate::token_budget::WINDOWS.iter().map(|(n, ms)| json!([n, ms])).collect::<Vec<_>>(),
        "message_overhead": crate::token_budget::MESSAGE_OVERHEAD,
        "tenant_slots": crate::token_budget::TENANT_SLOTS,
        "reserved_tenant": crate::token_budget::OTHER,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{
        "version": 1,
        "default_class": "batch",
        "classes": {"interactive": {"pool": "gpu-a"}, "batch": {"pool": "gpu-b", "objective": "bulk"}},
        "rules": [
            {"name": "chat", "class": "interactive",
             "match": {"methods": ["post"], "path": {"prefix": "/v1/chat/completions"}}},
            {"name": "big", "class": "batch",
             "match": {"path": {"regex": "^/v1/(chat/)?completions$"},
                       "headers": [{"name": "x-tenant", "prefix": "eval-"}, {"name": "x-debug", "present": false}],
                       "body": {"max_tokens": {"min": 1024}, "model": {"exact": "m"}, "stream": false}}}
        ],
        "body": {"max_bytes": 65536},
        "trusted_sources": {"cidrs": ["10.0.0.0/8", "::1"], "principals": ["spiffe://cluster.local/ns/gw/sa/gw"]},
        "emit_objective_header": true
    }"#;

    fn parse_err(s: &str) -> ConfigError {
        FilterConfig::parse(s.as_bytes()).unwrap_err()
    }

    #[test]
    fn parses_a_good_config() {
        let c = FilterConfig::parse(GOOD.as_bytes()).unwrap();
        assert_eq!(c.default_pool, "gpu-b");
        assert_eq!(c.default_objective, "bulk");
        assert_eq!(c.rules[0].pool, "gpu-a");
        assert_eq!(c.rules[0].objective, "interactive");
        assert_eq!(c.rules[0].methods, vec!["POST".to_string()]);
        assert!(c.needs_body());
        assert_eq!(c.max_body_bytes, 65536);
        assert_eq!(c.trusted.cidrs.len(), 2);
        assert!(matches!(c.rules[1].headers[1].cond, HeaderCond::Absent));
    }

    #[test]
    fn rejects_wrong_version_naming_the_field() {
        assert_eq!(parse_err(&GOOD.replace("\"version\": 1", "\"version\": 2")).field, "version");
    }

    #[test]
    fn rejects_unknown_class_in_rule() {
        let e = parse_err(&GOOD.replace("\"class\": \"interactive\"", "\"class\": \"nope\""));
        assert_eq!(e.field, "rules[0].class");
        assert!(e.message.contains("nope"));
    }

    #[test]
    fn rejects_unknown_default_class() {
        assert_eq!(parse_err(&GOOD.replace("\"default_class\": \"batch\"", "\"default_class\": \"x\"")).field, "default_class");
    }

    #[test]
    fn rejects_unknown_fields_and_garbage() {
        let e = parse_err(&GOOD.replace("\"rules\"", "\"rulez\""));
        assert!(e.message.contains("rulez"), "{e}");
        let e = parse_err(&GOOD.replace("\"max_tokens\"", "\"max_tokenz\""));
        assert!(e.message.contains("max_tokenz"), "{e}");
        assert!(FilterConfig::parse(b"\xff\x00garbage").is_err());
        assert!(FilterConfig::parse(b"").is_err());
    }

    #[test]
    fn serde_refusals_name_the_field_path_too() {
        let e = parse_err(&GOOD.replace("\"version\": 1", "\"version\": \"1\""));
        assert_eq!(e.field, "$");
        assert!(e.message.starts_with("invalid type: string \"1\", expected u32 at line "), "{e}");
        assert!(e.message.ends_with(" (at `version`)"), "{e}");
        let e = parse_err(&GOOD.replace("\"max_tokens\"", "\"max_tokenz\""));
        assert!(e.message.ends_with("(at `rules[1].match.body.max_tokenz`)"), "{e}");
        let e = parse_err(&GOOD.replace("[\"post\"]", "[\"post\", 7]"));
        assert!(e.message.ends_with("(at `rules[0].match.methods[1]`)"), "{e}");
        let e = parse_err(&GOOD.replace("\"pool\": \"gpu-a\"", "\"objective\": \"x\""));
        assert!(e.message.starts_with("missing field `pool`") && e.message.ends_with("(at `classes.interactive.pool`)"), "{e}");
        let e = parse_err(&GOOD.replace("\"version\": 1,", "\"version\": 1, \"version\": 1,"));
        assert!(e.message.starts_with("duplicate field `version`") && e.message.ends_with("(at `version`)"), "{e}");
        let e = parse_err(&GOOD.replace("{\"min\": 1024}", "{\"min\": -5}"));
        assert!(e.message.ends_with("(at `rules[1].match.body.max_tokens.min`)"), "{e}");
        let e = parse_err(&GOOD.replace("\"x-tenant\", \"prefix\": \"eval-\"}", "\"x-tenant\", \"prefix\": [\"a,b\\\"]\", 1]}"));
        assert!(e.message.ends_with("(at `rules[1].match.headers[0].prefix`)"), "{e}");
        // Not JSON: where it broke.
        let e = parse_err("{\"version\": 1, \"classes\": {\"b\": {\"pool\" \"p\"}}}");
        assert!(e.message.starts_with("expected `:`") && e.message.ends_with("(at `classes.b.pool`)"), "{e}");
        assert!(!parse_err("").message.contains("(at"));
    }

    #[test]
    fn rejects_bad_matchers_naming_the_field() {
        assert_eq!(parse_err(&GOOD.replace("\"/v1/chat", "\"v1/chat")).field, "rules[0].match.path");
        assert_eq!(parse_err(&GOOD.replace("\"gpu-a\"", "\"gpu a\"")).field, "classes.interactive.pool");
        assert_eq!(parse_err(&GOOD.replace("^/v1/(chat/)?", "^/v1/(chat/?")).field, "rules[1].match.path.regex");
        assert_eq!(parse_err(&GOOD.replace("{\"min\": 1024}", "{}")).field, "rules[1].match.body.max_tokens");
        assert_eq!(parse_err(&GOOD.replace("{\"min\": 1024}", "{\"min\": 9, \"max\": 3}")).field, "rules[1].match.body.max_tokens");
        assert_eq!(parse_err(&GOOD.replace("{\"exact\": \"m\"}", "{\"exact\": \"m\", \"prefix\": \"n\"}")).field, "rules[1].match.body.model");
        assert_eq!(parse_err(&GOOD.replace("\"x-tenant\"", "\"X-Tenant\"")).field, "rules[1].match.headers[0].name");
        assert_eq!(parse_err(&GOOD.replace("\"10.0.0.0/8\"", "\"10.0.0.0/33\"")).field, "trusted_sources.cidrs[0]");
        assert_eq!(parse_err(&GOOD.replace("65536", "2000000")).field, "body.max_bytes");
        assert_eq!(parse_err(&GOOD.replace("\"name\": \"big\"", "\"name\": \"chat\"")).field, "rules[1].name");
        assert_eq!(parse_err(&GOOD.replace("\"name\": \"big\"", "\"name\": \"default\"")).field, "rules[1].name");
    }

    #[test]
    fn degraded_routing_is_checked_naming_the_field() {
        let with = |d: &str| GOOD.replace("\"emit_objective_header\": true", &format!("\"emit_objective_header\": true, \"degraded_routing\": {d}"));
        let ok = FilterConfig::parse(with(r#"{"pools": {"gpu-a": {"at_level": 3, "shed_classes": ["batch"],
            "probe_cluster": "outbound|8000||gpu-a.infermesh.svc.cluster.local"}, "gpu-b": {}}, "probe_interval_ms": 250}"#).as_bytes()).unwrap();
        let d = ok.degraded.unwrap();
        assert_eq!((d.probe_interval_ms, d.probe_timeout_ms, d.retry_after_s), (250, DEFAULT_PROBE_TIMEOUT_MS, DEFAULT_RETRY_AFTER_S));
        assert_eq!(d.pools["gpu-a"].rule.stale_after_ms, DEFAULT_STALE_AFTER_MS);
        assert_eq!(d.pools["gpu-b"].probe_cluster, None);
        assert!(FilterConfig::parse(GOOD.as_bytes()).unwrap().degraded.is_none());
        let bad = |d: &str| parse_err(&with(d)).field;
        // Spill is Envoy's (health check + priority failover): a config that still asks the
        // filter for it is refused by name, whatever the value.
        for v in [r#""gpu-b""#, r#""gpu-a""#, r#""nope""#, "null", "3"] {
            let e = parse_err(&with(&format!(r#"{{"pools": {{"gpu-a": {{"at_level": 3, "spill_to": {v}, "shed_classes": ["batch"]}}, "gpu-b": {{}}}}}}"#)));
            assert_eq!(e.field, "degraded_routing.pools.gpu-a.spill_to", "{v}: {e}");
            assert_eq!(e.message, "spill is Envoy's health-check failover now (remove the field)");
        }
        assert_eq!(bad(r#"{"pools": {"gpu-a": {"shed_classes": ["batch", "x"]}}}"#), "degraded_routing.pools.gpu-a.shed_classes[1]");
        assert_eq!(bad(r#"{"pools": {"gpu-a": {"at_level": 0}}}"#), "degraded_routing.pools.gpu-a.at_level");
        assert_eq!(bad(r#"{"pools": {"gpu-a": {"at_level": 5}}}"#), "degraded_routing.pools.gpu-a.at_level");
        assert_eq!(bad(r#"{"pools": {"gpu a": {}}}"#), "degraded_routing.pools.gpu a");
        assert_eq!(bad(r#"{"pools": {"gpu-a": {"probe_cluster": ""}}}"#), "degraded_routing.pools.gpu-a.probe_cluster");
        assert_eq!(bad(r#"{"pools": {}, "probe_interval_ms": 10}"#), "degraded_routing.probe_interval_ms");
        assert_eq!(bad(r#"{"pools": {}, "retry_after_s": 0}"#), "degraded_routing.retry_after_s");
        assert!(parse_err(&with(r#"{"pools": {"gpu-a": {"spil_to": "gpu-b"}}}"#)).message.contains("spil_to"));
    }

    #[test]
    fn every_limit_is_what_parse_enforces() {
        // Each LIMITS entry, set in a config at its bounds and one past them: the bounds pass,
        // one past is refused naming the field (a pool's for `*`) in `bounded`'s words.
        let config = |field: &str, v: u64| -> String {
            let mut doc: serde_json::Value = serde_json::from_str(GOOD).unwrap();
            doc["degraded_routing"] = serde_json::json!({"pools": {"gpu-a": {"shed_classes": ["batch"]}}});
            let (at, key) = field.rsplit_once('.').unwrap();
            let parent = match at {
                "body" => &mut doc["body"],
                "degraded_routing" => &mut doc["degraded_routing"],
                "classes.*.prefix_key" => &mut doc["classes"]["interactive"]["prefix_key"],
                _ => &mut doc["degraded_routing"]["pools"]["gpu-a"],
            };
            parent[key] = serde_json::json!(v);
            doc.to_string()
        };
        for l in LIMITS {
            for v in [l.min, l.max, l.default] {
                assert!(FilterConfig::parse(config(l.field, v).as_bytes()).is_ok(), "{} = {v}", l.field);
            }
            let mut past = vec![l.max + 1];
            if l.min > 0 {
                past.push(l.min - 1);
            }
            for v in past {
                let e = parse_err(&config(l.field, v));
                let named = if l.field.starts_with("classes.") { "interactive" } else { "gpu-a" };
                assert_eq!(e.field, l.field.replace('*', named), "{} = {v}", l.field);
                assert!(e.message.starts_with(&format!("must be between {} and {}", l.min, l.max)), "{e}");
            }
        }
        let limits = limits();
        assert_eq!(limits["bounded"].as_object().unwrap().len(), LIMITS.len());
        for l in LIMITS {
            assert_eq!(limits["defaults"][l.field], l.default, "{}: the parser fills in its declared default", l.field);
        }
    }

    #[test]
    fn deep_nesting_is_refused_without_recursion() {
        // The typed shape is a few levels deep: anything nested deeper is a wrong type at its
        // first bracket. The one free-form value (the retired `spill_to`, IgnoredAny) is skipped
        // by serde_json without recursion, however deep.
        for depth in [127usize, 129, 10_000, 1_000_000] {
            let (open, close) = ("[".repeat(depth), "]".repeat(depth));
            let spill = format!(
                r#"{{"version": 1, "default_class": "b", "classes": {{"b": {{"pool": "p"}}}},
                    "degraded_routing": {{"pools": {{"p": {{"spill_to": {open}{close}}}}}}}}}"#
            );
            assert_eq!(parse_err(&spill).field, "degraded_routing.pools.p.spill_to", "depth {depth}");
            let rules = format!(r#"{{"version": 1, "default_class": "b", "classes": {{"b": {{"pool": "p"}}}}, "rules": {open}{close}}}"#);
            assert!(parse_err(&rules).message.contains("invalid type"), "depth {depth}");
            let classes = format!(r#"{{"version": 1, "default_class": "b", "classes": {{"b": {open}{close}}}}}"#);
            assert!(parse_err(&classes).message.contains("invalid type"), "depth {depth}");
        }
        let e = parse_err(&format!(r#"{{"version": 1, "x": {}}}"#, "{\"a\":".repeat(100_000)));
        assert!(e.message.contains("unknown field `x`"), "{e}");
        // Where a whole document is read as a JSON value, serde_json's recursion limit (128)
        // refuses it before the stack is at risk.
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        let e = serde_json::from_str::<serde_json::Value>(&deep).unwrap_err();
        assert!(e.to_string().contains("recursion limit exceeded"), "{e}");
    }

    #[test]
    fn many_regexes_share_a_bounded_compiled_size() {
        let with = |pattern: &str, n: usize| {
            let rules: Vec<String> = (0..n)
                .map(|i| format!(r#"{{"name": "r{i}", "class": "b", "match": {{"path": {{"regex": "{}"}}}}}}"#, pattern.replace("{i}", &i.to_string())))
                .collect();
            format!(r#"{{"version": 1, "default_class": "b", "classes": {{"b": {{"pool": "p"}}}}, "rules": [{}]}}"#, rules.join(","))
        };
        // One pattern of a few bytes compiles to most of a MiB: alone it is fine, a hundred are not.
        assert!(FilterConfig::parse(with("a{1000}{10}", 1).as_bytes()).is_ok());
        let e = parse_err(&with("a{1000}{10}", 100));
        assert_eq!(e.field, "rules[0].match.path.regex");
        assert!(e.message.contains("share 16 MiB"), "{e}");
        // Ordinary patterns stay small however many there are, and still match.
        let c = FilterConfig::parse(with("^/v1/m{i}/(chat/)?completions$", 2000).as_bytes()).unwrap();
        assert!(c.rules[1999].path.as_ref().unwrap().matches("/v1/m1999/chat/completions"));
        assert!(!c.rules[1999].path.as_ref().unwrap().matches("/v1/m199/chat/completions"));
    }

    #[test]
    fn content_conditions_are_checked_against_the_model() {
        let model = crate::content_classifier::tests::model_json(&["code", "chat"], 256, 2, [3, 4], 4096, |_, _| 1);
        let with = |model: Option<&str>, content: &str| {
            let mut doc: serde_json::Value = serde_json::from_str(GOOD).unwrap();
            if let Some(m) = model {
                doc["content_model"] = serde_json::from_str(m).unwrap();
            }
            doc["rules"][1]["match"]["content"] = serde_json::from_str(content).unwrap();
            doc.to_string()
        };
        let c = FilterConfig::parse(with(Some(&model), r#"{"label": "chat", "min_score": 0.6}"#).as_bytes()).unwrap();
        assert_eq!(c.rules[1].content, Some(ContentMatch { label: 1, min_score: 0.6 }));
        assert_eq!(c.content_model.as_ref().unwrap().labels, ["code", "chat"]);
        let c = FilterConfig::parse(with(Some(&model), r#"{"label": "code"}"#).as_bytes()).unwrap();
        assert_eq!(c.rules[1].content, Some(ContentMatch { label: 0, min_score: 0.0 }));
        // A content rule needs the body, like a body rule.
        let mut doc: serde_json::Value = serde_json::from_str(&with(Some(&model), r#"{"label": "code"}"#)).unwrap();
        doc["rules"][1]["match"].as_object_mut().unwrap().remove("body");
        doc["rules"].as_array_mut().unwrap().remove(0);
        let c = FilterConfig::parse(doc.to_string().as_bytes()).unwrap();
        assert!(c.rules[0].body.is_none() && c.needs_body());
        // A model without content rules is fine (and unused).
        assert!(FilterConfig::parse(with(Some(&model), r#"{"label": "code"}"#).replace(r#","content":{"label":"code"}"#, "").as_bytes()).is_ok());
        let e = parse_err(&with(None, r#"{"label": "code"}"#));
        assert_eq!((e.field.as_str(), e.message.as_str()), ("rules[1].match.content", "a `content` condition needs a `content_model`"));
        let e = parse_err(&with(Some(&model), r#"{"label": "math"}"#));
        assert_eq!(e.field, "rules[1].match.content.label");
        assert!(e.message.contains("math") && e.message.contains("code, chat"), "{e}");
        for bad in ["1.5", "-0.1"] {
            assert_eq!(parse_err(&with(Some(&model), &format!(r#"{{"label": "code", "min_score": {bad}}}"#))).field, "rules[1].match.content.min_score");
        }
        assert!(parse_err(&with(Some(&model), r#"{"label": "code", "score": 1}"#)).message.contains("unknown field `score`"));
        assert!(parse_err(&with(Some(&model), r#"{"min_score": 0.5}"#)).message.contains("missing field `label`"));
        // The model's own checks name its fields under `content_model`.
        let e = parse_err(&with(Some(&model.replace("\"dim\":256", "\"dim\":255")), r#"{"label": "code"}"#));
        assert_eq!(e.field, "content_model.dim");
        let e = parse_err(&with(Some(&model.replace("\"code\",\"chat\"", "\"code\",\"code\"")), r#"{"label": "code"}"#));
        assert_eq!(e.field, "content_model.labels[1]");
    }

    fn with_budgets(b: &str) -> String {
        GOOD.replace("\"emit_objective_header\": true", &format!("\"emit_objective_header\": true, \"budgets\": {b}"))
    }

    #[test]
    fn budgets_are_parsed_with_their_defaults() {
        use crate::token_budget::TenantSource;
        let c = FilterConfig::parse(
            with_budgets(
                r#"{"tenant": {"header": "x-tenant-id"}, "classes": {"batch": {"default_max_tokens": 512,
                "default": {"tokens": {"per_minute": 200000, "per_day": 20000000}, "count": {"input": 0, "output": 1}, "concurrent_streams": 16},
                "tenants": {"team-a": {"tokens": {"per_minute": 50000}, "concurrent_streams": 4}}}}}"#,
            )
            .as_bytes(),
        )
        .unwrap();
        let b = c.budgets.unwrap();
        assert_eq!(b.tenant, TenantSource::Header("x-tenant-id".into()));
        let batch = &b.classes["batch"];
        assert_eq!(batch.default_max_tokens, 512);
        let d = batch.default.as_ref().unwrap();
        assert_eq!((d.tokens, d.input_weight, d.output_weight, d.concurrent_streams), ([Some(200000), None, Some(20000000)], 0, 1, Some(16)));
        let a = &batch.tenants["team-a"];
        assert_eq!((a.tokens, a.input_weight, a.output_weight, a.concurrent_streams), ([Some(50000), None, None], 1, 1, Some(4)), "no inheritance: count defaults to 1/1");
        let c = FilterConfig::parse(
            with_budgets(r#"{"tenant": {"api_key_hash": true}, "classes": {"interactive": {"tenants": {"8879f6a4ae35c420": {"concurrent_streams": 1}}}}}"#).as_bytes(),
        )
        .unwrap();
        let b = c.budgets.unwrap();
        assert_eq!(b.tenant, TenantSource::ApiKeyHash);
        assert_eq!(b.classes["interactive"].default_max_tokens, BUDGET_DEFAULT_MAX_TOKENS.default);
        assert!(b.classes["interactive"].default.is_none());
        assert!(FilterConfig::parse(GOOD.as_bytes()).unwrap().budgets.is_none());
    }

    #[test]
    fn budgets_are_checked_naming_the_field() {
        let bad = |b: &str| {
            let e = parse_err(&with_budgets(b));
            (e.field, e.message)
        };
        let class = |c: &str| format!(r#"{{"tenant": {{"header": "x-t"}}, "classes": {{"batch": {c}}}}}"#);
        let cases: Vec<(String, &str, &str)> = vec![
            (r#"{"tenant": {}, "classes": {"batch": {"default": {"concurrent_streams": 1}}}}"#.into(), "budgets.tenant", "exactly one of `header`, `api_key_hash` is required"),
            (r#"{"tenant": {"header": "x-t", "api_key_hash": true}, "classes": {}}"#.into(), "budgets.tenant", "exactly one of"),
            (r#"{"tenant": {"api_key_hash": false}, "classes": {}}"#.into(), "budgets.tenant.api_key_hash", "must be true"),
            (r#"{"tenant": {"header": "X-Tenant"}, "classes": {}}"#.into(), "budgets.tenant.header", "header names must be"),
            (r#"{"tenant": {"header": "x-t"}, "classes": {}}"#.into(), "budgets.classes", "a budget needs at least one class"),
            (r#"{"tenant": {"header": "x-t"}, "classes": {"nope": {"default": {"concurrent_streams": 1}}}}"#.into(), "budgets.classes.nope", "unknown class `nope`"),
            (class("{}"), "budgets.classes.batch", "a class's budget needs a `default`, `tenants` or both"),
            (class(r#"{"default": {}}"#), "budgets.classes.batch.default", "a budget needs `tokens`, `concurrent_streams` or both"),
            (class(r#"{"default": {"tokens": {}}}"#), "budgets.classes.batch.default.tokens", "`tokens` needs"),
            (class(r#"{"default": {"tokens": {"per_hour": 0}}}"#), "budgets.classes.batch.default.tokens.per_hour", "must be between 1 and 1000000000000"),
            (class(r#"{"default": {"concurrent_streams": 1, "count": {"input": 0, "output": 0}}}"#), "budgets.classes.batch.default.count", "`input` and `output` cannot both be 0"),
            (class(r#"{"default": {"concurrent_streams": 1, "count": {"output": 1001}}}"#), "budgets.classes.batch.default.count.output", "must be between 0 and 1000"),
            (class(r#"{"default": {"concurrent_streams": 0}}"#), "budgets.classes.batch.default.concurrent_streams", "must be between 1 and 1000000"),
            (class(r#"{"default_max_tokens": 0, "default": {"concurrent_streams": 1}}"#), "budgets.classes.batch.default_max_tokens", "must be between 1 and 4294967295"),
            (class(r#"{"tenants": {"team a": {"concurrent_streams": 1}}}"#), "budgets.classes.batch.tenants.team a", "`team a` must be 1-64 characters"),
            (class(r#"{"tenants": {"other": {"concurrent_streams": 1}}}"#), "budgets.classes.batch.tenants.other", "`other` is reserved"),
            (class(r#"{"tenants": {"t": {"tokens": {"per_day": 0}}}}"#), "budgets.classes.batch.tenants.t.tokens.per_day", "must be between"),
            (
                r#"{"tenant": {"api_key_hash": true}, "classes": {"batch": {"tenants": {"team-a": {"concurrent_streams": 1}}}}}"#.into(),
                "budgets.classes.batch.tenants.team-a",
                "with `api_key_hash` a tenant is named by",
            ),
        ];
        for (b, field, message) in cases {
            let (f, m) = bad(&b);
            assert_eq!(f, field, "{b}: {m}");
            assert!(m.starts_with(message), "{b}: {m}");
        }
        let many: Vec<String> = (0..=BUDGET_MAX_TENANTS).map(|i| format!(r#""t{i}": {{"concurrent_streams": 1}}"#)).collect();
        let (f, m) = bad(&class(&format!(r#"{{"tenants": {{{}}}}}"#, many.join(","))));
        assert_eq!((f.as_str(), m.as_str()), ("budgets.classes.batch.tenants", "at most 256 tenants per class"));
        // serde's refusals name the field too.
        let e = parse_err(&with_budgets(&class(r#"{"default": {"tokens": {"per_second": 5}}}"#)));
        assert!(e.message.contains("per_second") && e.message.ends_with("(at `budgets.classes.batch.default.tokens.per_second`)"), "{e}");
        let e = parse_err(&with_budgets(r#"{"tenant": {"header": "x-t"}, "on_unavailable": "open", "classes": {}}"#));
        assert!(e.message.contains("unknown field `on_unavailable`"), "global mode is not built: {e}");
    }

    #[test]
    fn every_budget_limit_is_what_parse_enforces() {
        let config = |field: &str, v: u64| -> (String, String) {
            let mut doc: serde_json::Value = serde_json::from_str(GOOD).unwrap();
            doc["budgets"] = serde_json::json!({"tenant": {"header": "x-t"}, "classes": {"batch": {"tenants": {"t": {"concurrent_streams": 1}}}}});
            let named = match field.strip_prefix("budgets.classes.*.*.") {
                Some(sub) => {
                    let t = &mut doc["budgets"]["classes"]["batch"]["tenants"]["t"];
                    match sub.split_once('.') {
                        Some((parent, k)) => t[parent][k] = serde_json::json!(v),
                        None => t[sub] = serde_json::json!(v),
                    }
                    format!("budgets.classes.batch.tenants.t.{sub}")
                }
                None => {
                    let key = field.rsplit('.').next().unwrap();
                    doc["budgets"]["classes"]["batch"][key] = serde_json::json!(v);
                    format!("budgets.classes.batch.{key}")
                }
            };
            (doc.to_string(), named)
        };
        for l in BUDGET_LIMITS {
            for v in [l.min.max(1), l.max] {
                let (c, _) = config(l.field, v);
                assert!(FilterConfig::parse(c.as_bytes()).is_ok(), "{} = {v}", l.field);
            }
            let mut past = vec![l.max + 1];
            if l.min > 0 {
                past.push(l.min - 1);
            }
            for v in past {
                let (c, named) = config(l.field, v);
                let e = parse_err(&c);
                assert_eq!(e.field, named, "{} = {v}", l.field);
                assert!(e.message.starts_with(&format!("must be between {} and {}", l.min, l.max)), "{e}");
            }
        }
        let limits = limits();
        assert_eq!(limits["budgets"]["bounded"].as_object().unwrap().len(), BUDGET_LIMITS.len());
        for l in BUDGET_LIMITS {
            assert_eq!(limits["budgets"]["defaults"][l.field], l.default, "{}: the parser fills in its declared default", l.field);
        }
    }

    #[test]
    fn classes_and_pools_are_kept_for_the_metric_labels() {
        let c = FilterConfig::parse(GOOD.as_bytes()).unwrap();
        assert_eq!(c.classes.get("batch").map(String::as_str), Some("gpu-b"));
        assert_eq!(c.pool_names().into_iter().collect::<Vec<_>>(), ["gpu-a", "gpu-b"]);
    }

    #[test]
    fn cidrs() {
        let net = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(net.contains(&"10.1.200.3".parse().unwrap()));
        assert!(!net.contains(&"10.2.0.1".parse().unwrap()));
        assert!(net.contains(&"::ffff:10.1.0.9".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0").unwrap().contains(&"1.2.3.4".parse().unwrap()));
        assert!(Cidr::parse("::1").unwrap().contains(&"::1".parse().unwrap()));
        assert!(!Cidr::parse("::1").unwrap().contains(&"127.0.0.1".parse().unwrap()));
        assert!(Cidr::parse("nope/1").is_none());
    }
}
