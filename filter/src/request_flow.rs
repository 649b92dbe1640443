//! The filter's request flow, written once for both runtimes: the header hook, the body hook
//! (and trailers), the response hook, the decision written back or the request shed.
//!
//! Everything a runtime differs in is behind two traits: [`Host`] (one stream's headers, body,
//! local reply and counters: proxy-wasm in `glue.rs`, Envoy's dynamic-module ABI in
//! `dynamic_module/ffi.rs`, fakes in the tests) and [`PoolStates`] (the pool state table:
//! proxy-wasm shared data in `shared_pool_table.rs`, one process-wide table in
//! `dynamic_module.rs`). The decisions themselves are the pure core's (`classify`, `body`,
//! `pool_state`), so this flow is tested natively.
//!
//! Token budgets (token_budget.rs) are applied in `write`, once the class is known and the
//! degraded-mode verdict let the request through: a budgeted generation request is reserved on
//! the table of `Accepted::budgets`, or refused with 429 before any upstream work; the response
//! gives the tokens back on an upstream error, and the stream's end its concurrent slot.

use crate::body::{parse_body, parse_body_segments, parse_body_keyed, parse_body_segments_keyed, BodyFacts};
use crate::classify::{classify, Body, Content, Decision, Fallback, Outcome, RequestView, DEFAULT_RULE};
use crate::config::{DegradedRouting, FilterConfig, HEADER_CLASS, HEADER_OBJECTIVE, HEADER_POOL, HEADER_RULE, INTERNAL_HEADER_PREFIX};
use crate::pool_state::{costs_generation, ReadingError, Verdict, HEADER_POOL_LEVEL};
use crate::prefix_key::{PrefixKeys, PrefixSpec, HEADER_PREFIX_KEY, MAX_KEYS};
use crate::prefix_table::{base64_decode, base64_encode, Pick, PrefixTable, ProcessSharedData, HEADER_LOAD, HEADER_PREFIX_HOST};
use crate::shared_pool_table::SharedData;
use crate::stats::{BudgetCounters, TrustedCounters};
use crate::token_budget::{self, Ask, BudgetStore, Held, Refusal, TenantSource};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{SystemTime, UNIX_EPOCH};

/// Why the pool state table could not use something: the filter then routes normally.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateError {
    /// A response's or probe's `x-infermesh-pool-level` is not `POOL;LEVEL;REPLICA`.
    BadHeader = 0,
    /// A probe's reading names a pool the config keeps no state for (a response's is dropped:
    /// every sidecar sends one, and only the pools that shed are kept).
    UnknownPool,
    /// The probe got no response (reset, no connection); a timeout comes back as Envoy's 504.
    ProbeFailed,
    /// The probe got a response other than 200.
    ProbeStatus,
    /// The probe's cluster does not exist in this Envoy (a pool that went away, a wrong name).
    NoCluster,
    /// A shared-data record that does not decode, or a write that kept losing its CAS race
    /// (only a table in proxy-wasm shared data has these).
    SharedData,
}

/// The `reason` label of each `StateError`, in order.
pub const STATE_ERRORS: [&str; 6] = ["bad_header", "unknown_pool", "probe_failed", "probe_status", "no_cluster", "shared_data"];

impl From<ReadingError> for StateError {
    fn from(e: ReadingError) -> Self {
        match e {
            ReadingError::BadHeader => StateError::BadHeader,
            ReadingError::UnknownPool => StateError::UnknownPool,
        }
    }
}

/// A counter, as the host defined it (`None`: its definition failed; counting it is a no-op).
pub type CounterId = Option<usize>;

/// What the flow needs from Envoy for one stream. Header bytes borrowed from the host are valid
/// until the next write (the dynamic-module ABI's rule), which the borrow of `&self` enforces.
pub trait Host {
    /// All request headers, as Envoy holds them (a value is read as UTF-8 only when looked up).
    fn request_headers(&self) -> Vec<(&[u8], &[u8])>;
    /// Replace (or, with `None`, remove) a request header.
    fn set_request_header(&mut self, name: &str, value: Option<&str>);
    /// Remove every value of a request header, named as the host holds it (a client's name
    /// need not be UTF-8).
    fn remove_request_header(&mut self, name: &[u8]);
    /// Add a request header the map does not hold yet (cheaper than a replace).
    fn add_request_header(&mut self, name: &str, value: &str);
    /// After the decision's writes: the route is chosen again on the new headers.
    fn clear_route_cache(&mut self);
    /// The request body received so far, as the slices the host holds it in, in order.
    fn request_body(&mut self) -> Vec<&[u8]>;
    fn request_body_size(&self) -> usize;
    /// `source.address` (`IP:PORT`).
    fn source_address(&self) -> Option<String>;
    /// The mTLS peer's URI and DNS SANs.
    fn peer_principals(&self) -> Vec<String>;
    fn send_response(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// A response header (a value that is not UTF-8 comes back lossily decoded: no reading
    /// parses with a replacement character in it).
    fn response_header(&self, name: &str) -> Option<String>;
    fn remove_response_header(&mut self, name: &str);
    /// Set a response header (a served request's remaining budget). Both runtimes' hosts and the
    /// tests' implement it; the default (a host that cannot) drops the header.
    fn set_response_header(&mut self, _name: &str, _value: &str) {}
    fn count(&mut self, id: CounterId);
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64 {
        now_ms()
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The pool state table as a runtime keeps it, for one accepted config.
pub trait PoolStates: Sized {
    /// The errors this table can run into: only theirs are defined as counters.
    const ERRORS: &'static [StateError];
    fn for_config(d: Option<&DegradedRouting>, metrics: &Metrics) -> Self;
    fn is_degraded(&self, d: &DegradedRouting, pool: &str, now: u64) -> bool;
    /// Whether the level header of the response to a request routed to `pool` is read.
    fn reads_response(&self, _d: &DegradedRouting, _pool: &str, _now: u64) -> bool {
        true
    }
    /// One `x-infermesh-pool-level` value, from a response or a probe (`UnknownPool`: a pool the
    /// table keeps no state for).
    fn report(&self, d: &DegradedRouting, value: &str, now: u64) -> Result<(), StateError>;
}

/// Counter ids, defined once per config (Envoy freezes stat creation after the config is made;
/// traffic never defines a stat).
#[derive(Default, Debug)]
pub struct Metrics {
    /// One per rule, in rule order, then the default rule.
    pub decisions: Vec<CounterId>,
    pub fallbacks: [CounterId; 4],
    pub stripped: CounterId,
    /// Decisions kept from trusted sources, by the config's (class, pool) labels; a name the
    /// config does not define is counted as `other` (crate::stats).
    pub trusted: TrustedCounters<CounterId>,
    /// Requests shed at the edge, by class.
    pub shed: HashMap<String, CounterId>,
    /// By `StateError`; only the table's `ERRORS` are defined.
    pub state_errors: [CounterId; 6],
    /// Keyed requests whose replica was named, not named because it was over the load bound,
    /// and responses learnt from (only with a keyed class).
    pub prefix_named: CounterId,
    pub prefix_over_bound: CounterId,
    pub prefix_learned: CounterId,
    /// Budget refusals by (class, tenant label: the policy's names and `other`), and the budget
    /// table's errors (only with budgets).
    pub budget_refusals: BudgetCounters<CounterId>,
    pub budget_errors: CounterId,
}

impl Metrics {
    /// Every counter a config can touch, through `define`; `errors`: the state errors counted.
    pub fn for_config(config: &FilterConfig, errors: &[StateError], define: &mut dyn FnMut(&str) -> CounterId) -> Metrics {
        let decision = |define: &mut dyn FnMut(&str) -> CounterId, c: &str, p: &str, r: &str| {
            define(&format!("infermesh.requests_total.class.{c}.pool.{p}.rule.{r}"))
        };
        let mut decisions: Vec<CounterId> = config.rules.iter().map(|r| decision(define, &r.class, &r.pool, &r.name)).collect();
        decisions.push(decision(define, &config.default_class, &config.default_pool, DEFAULT_RULE));
        let mut fallbacks = [None; 4];
        for (slot, f) in fallbacks.iter_mut().zip(Fallback::ALL) {
            *slot = define(&format!("infermesh.body_fallbacks_total.reason.{}", f.as_str()));
        }
        let trusted = TrustedCounters::define(config, define);
        let (mut shed, mut state_errors) = (HashMap::new(), [None; 6]);
        if let Some(d) = &config.degraded {
            for p in d.pools.values() {
                for c in &p.shed_classes {
                    if !shed.contains_key(c) {
                        shed.insert(c.clone(), define(&format!("infermesh.shed_requests_total.class.{c}")));
                    }
                }
            }
            for e in errors {
                state_errors[*e as usize] = define(&format!("infermesh.pool_state_errors_total.reason.{}", STATE_ERRORS[*e as usize]));
            }
        }
        let (mut prefix_named, mut prefix_over_bound, mut prefix_learned) = (None, None, None);
        if !config.prefix.is_empty() {
            prefix_named = define("infermesh.prefix_named_total");
            prefix_over_bound = define("infermesh.prefix_over_bound_total");
            prefix_learned = define("infermesh.prefix_learned_total");
        }
        let stripped = define("infermesh.stripped_requests_total");
        let budget_refusals = BudgetCounters::define(config, define);
        let budget_errors = if config.budgets.is_some() { define("infermesh.budget_errors_total") } else { None };
        Metrics {
            decisions,
            fallbacks,
            stripped,
            trusted,
            shed,
            state_errors,
            prefix_named,
            prefix_over_bound,
            prefix_learned,
            budget_refusals,
            budget_errors,
        }
    }
}

/// The token budget table a runtime gives a config (made once its counters are defined).
pub type BudgetTable = Box<dyn BudgetStore + Send + Sync>;

/// One accepted configuration, with its counters, the pool state table and the prefix table kept
/// for it (`D`: proxy-wasm shared data, or one map for the native module's process), and the
/// runtime's token budget table; every stream of it reads the same.
pub struct Accepted<P, D = ProcessSharedData> {
    pub filter: FilterConfig,
    pub metrics: Metrics,
    pub pools: P,
    pub prefixes: PrefixTable<D>,
    pub budgets: BudgetTable,
}

impl<P: PoolStates, D: SharedData> Accepted<P, D> {
    pub fn new(filter: FilterConfig, define: &mut dyn FnMut(&str) -> CounterId, budgets: &dyn Fn(&Metrics) -> BudgetTable) -> Accepted<P, D> {
        let metrics = Metrics::for_config(&filter, P::ERRORS, define);
        let pools = P::for_config(filter.degraded.as_ref(), &metrics);
        let budgets = budgets(&metrics);
        // The records of the listed tenants and `other` exist before traffic reserves on them.
        if let Some(b) = &filter.budgets {
            for (class, c) in &b.classes {
                for t in c.tenants.keys().map(String::as_str).chain(std::iter::once(token_budget::OTHER)) {
                    budgets.ensure(&token_budget::record_key(class, t));
                }
            }
        }
        Accepted { filter, metrics, pools, prefixes: PrefixTable::default(), budgets }
    }
}

/// A header snapshot as `classify` reads it (a value that is not UTF-8 is absent: no rule can
/// match it).
struct View<'a>(&'a [(&'a [u8], &'a [u8])]);

impl View<'_> {
    fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| *k == name.as_bytes()).and_then(|(_, v)| std::str::from_utf8(v).ok())
    }
}

impl RequestView for View<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.get(name)
    }
}

fn is_internal(name: &[u8]) -> bool {
    name.starts_with(INTERNAL_HEADER_PREFIX.as_bytes())
}

/// Remove every `x-infermesh-*` request header (by the bytes Envoy holds: a lossy UTF-8 copy of
/// an odd name would remove nothing).
pub fn strip_internal_headers<H: Host>(host: &mut H) {
    let names: Vec<Vec<u8>> = host.request_headers().iter().filter(|(k, _)| is_internal(k)).map(|(k, _)| k.to_vec()).collect();
    for n in &names {
        host.remove_request_header(n);
    }
}

fn is_json(content_type: Option<&str>) -> bool {
    match content_type {
        // No content type: OpenAI clients always send one, but curl -d does not say JSON;
        // trying the parser is cheap and an invalid body falls back anyway.
        None => true,
        Some(ct) => {
            let media = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
            media == "application/json" || media.ends_with("+json")
        }
    }
}

pub fn source_is_trusted<H: Host>(config: &FilterConfig, host: &H) -> bool {
    if config.trusted.is_empty() {
        return false;
    }
    if !config.trusted.cidrs.is_empty() {
        let ip = host.source_address().and_then(|s| s.parse::<SocketAddr>().map(|a| a.ip()).ok().or_else(|| s.parse::<IpAddr>().ok()));
        if let Some(ip) = ip {
            if config.trusted.cidrs.iter().any(|c| c.contains(&ip)) {
                return true;
            }
        }
    }
    !config.trusted.principals.is_empty() && host.peer_principals().iter().any(|p| config.trusted.principals.iter().any(|t| t == p))
}

/// The header-only part of a decision: the outcome, whether the request generates, and why
/// the body cannot be used if a body rule asks for it.
type HeadDecision<'c> = (Outcome<'c>, bool, Option<Fallback>);

fn decide_on_headers<'c>(config: &'c FilterConfig, headers: &[(&[u8], &[u8])], end_of_stream: bool) -> HeadDecision<'c> {
    let view = View(headers);
    let outcome = classify(config, &view, Body::NotYet);
    let generates = costs_generation(view.get(":method").unwrap_or(""), view.get(":path").unwrap_or(""));
    // (Without the body no rule gets as far as its content: NeedContent needs the body first.)
    let why = match outcome {
        Outcome::Decided(_) => None,
        Outcome::NeedBody | Outcome::NeedContent if end_of_stream => Some(Fallback::Missing),
        Outcome::NeedBody | Outcome::NeedContent if !is_json(view.get("content-type")) => Some(Fallback::NotJson),
        Outcome::NeedBody | Outcome::NeedContent => match view.get("content-length").map(|v| v.trim().parse::<usize>()) {
            Some(Ok(0)) => Some(Fallback::Missing),
            Some(Ok(n)) if n > config.max_body_bytes => Some(Fallback::TooLarge),
            _ => None,
        },
    };
    (outcome, generates, why)
}

/// What a hook tells Envoy to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    Continue,
    /// Headers: stop until the body is in. Body: keep buffering.
    Wait,
    /// A local reply was sent: stop without buffering.
    Answered,
}

/// One stream's state between hooks.
#[derive(Debug)]
pub struct Stream {
    waiting_for_body: bool,
    /// A trusted peer's partial decision is in the header map: the decision's headers replace
    /// it (otherwise they are added: the map holds no x-infermesh-* header then).
    replace_headers: bool,
    /// Whether the request generates (`costs_generation`), kept from the header hook for the
    /// decision made on the body.
    generates: bool,
    /// Whether the response's level header is read (`PoolStates::reads_response`; a request
    /// not routed by `write`, e.g. a trusted peer's, is always read).
    read_level: bool,
    /// The class decided on the headers has a prefix key: the body is read for it alone.
    key_spec: Option<PrefixSpec>,
    /// The request's prefix keys, written by `write` (docs/prefix-routing.md).
    keys: Option<PrefixKeys>,
    /// A keyed request's pool and the replica the filter named for it (None: none), for the
    /// response to learn from.
    prefix: Option<(String, Option<String>)>,
    /// The budget's tenant header came from a trusted source (it is read; from anyone else it
    /// was removed, and the request is the tenant `other`).
    tenant_trusted: bool,
    /// What the request asks for, from its body (when the body was read).
    ask: Option<Ask>,
    /// The budget reservation, until the response and the stream's end settle it.
    held: Option<Held>,
}

impl Default for Stream {
    fn default() -> Stream {
        Stream {
            waiting_for_body: false,
            replace_headers: false,
            generates: false,
            read_level: true,
            key_spec: None,
            keys: None,
            prefix: None,
            tenant_trusted: false,
            ask: None,
            held: None,
        }
    }
}

/// Whether a decided request's body can be read for its class's prefix key or token budget: a
/// generation request with a JSON body that the filter may buffer (the same conditions as a
/// body rule's).
fn body_readable(config: &FilterConfig, headers: &[(&[u8], &[u8])], generates: bool, end_of_stream: bool) -> bool {
    let view = View(headers);
    let fits = match view.get("content-length").map(|v| v.trim().parse::<usize>()) {
        Some(Ok(n)) => n > 0 && n <= config.max_body_bytes,
        _ => true,
    };
    generates && !end_of_stream && is_json(view.get("content-type")) && fits
}

/// The prefix form of a decided class, when its request can have a key.
fn key_spec_on_headers(config: &FilterConfig, class: &str, headers: &[(&[u8], &[u8])], generates: bool, end_of_stream: bool) -> Option<PrefixSpec> {
    let spec = *config.prefix.get(class)?;
    body_readable(config, headers, generates, end_of_stream).then_some(spec)
}

/// Whether a decided request's class is budgeted and its body can be read for the reservation.
fn budget_reads_body(config: &FilterConfig, class: &str, headers: &[(&[u8], &[u8])], generates: bool, end_of_stream: bool) -> bool {
    config.budgets.as_ref().map_or(false, |b| b.classes.contains_key(class)) && body_readable(config, headers, generates, end_of_stream)
}

impl Stream {
    pub fn on_request_headers<H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &Accepted<P, D>, host: &mut H, end_of_stream: bool) -> Next {
        let config = &cfg.filter;
        if let Some(name) = config.budgets.as_ref().and_then(|b| b.tenant_header()) {
            self.guard_tenant_header(config, host, name);
        }
        // One snapshot for the common case: no client-sent x-infermesh-* header.
        let clean = {
            let headers = host.request_headers();
            if headers.iter().any(|(k, _)| is_internal(k)) {
                None
            } else {
                Some(decide_on_headers(config, &headers, end_of_stream))
            }
        };
        let head = match clean {
            Some(head) => head,
            None => match self.strip_or_keep(cfg, host, end_of_stream) {
                Some(head) => head,
                None => return Next::Continue,
            },
        };
        match head {
            (Outcome::Decided(d), generates, _) => {
                let (spec, budget) = {
                    let headers = host.request_headers();
                    let spec = key_spec_on_headers(config, d.class, &headers, generates, end_of_stream);
                    (spec, spec.is_none() && budget_reads_body(config, d.class, &headers, generates, end_of_stream))
                };
                if spec.is_some() || budget {
                    // Decided, but its class keys the prefix or is budgeted: decide again on the
                    // body (the same decision: the rule that matched looks at no body), with the
                    // key and what the request asks for.
                    self.key_spec = spec;
                    self.waiting_for_body = true;
                    self.generates = generates;
                    return Next::Wait;
                }
                self.write(cfg, host, &d, generates)
            }
            (Outcome::NeedBody | Outcome::NeedContent, generates, Some(why)) => self.decide_now(cfg, host, Body::Unavailable(why), generates),
            (Outcome::NeedBody | Outcome::NeedContent, generates, None) => {
                self.waiting_for_body = true;
                self.generates = generates;
                Next::Wait
            }
        }
    }

    /// The budget's tenant header is believed only from a trusted source: from anyone else it is
    /// removed (the request is then the tenant `other`), whatever class it turns out to be.
    fn guard_tenant_header<H: Host>(&mut self, config: &FilterConfig, host: &mut H, name: &str) {
        let present = host.request_headers().iter().any(|(k, _)| *k == name.as_bytes());
        if !present {
            return;
        }
        self.tenant_trusted = source_is_trusted(config, host);
        if !self.tenant_trusted {
            host.remove_request_header(name.as_bytes());
        }
    }

    /// A request with `x-infermesh-*` headers: a trusted peer's complete decision is kept (None:
    /// nothing to decide); anything else is stripped (or, from a trusted peer, replaced by the
    /// decision) and decided on the headers that remain.
    fn strip_or_keep<'c, H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &'c Accepted<P, D>, host: &mut H, end_of_stream: bool) -> Option<HeadDecision<'c>> {
        if source_is_trusted(&cfg.filter, host) {
            let kept = {
                let headers = host.request_headers();
                let view = View(&headers);
                match (view.get(HEADER_CLASS), view.get(HEADER_POOL)) {
                    (Some(c), Some(p)) => Some(cfg.metrics.trusted.get(c, p).flatten()),
                    _ => None,
                }
            };
            if let Some(id) = kept {
                // An upstream infermesh hop already decided: keep its headers as they are.
                host.count(id);
                return None;
            }
            // A partial decision: the decision's headers replace what the peer sent.
            self.replace_headers = true;
        } else {
            strip_internal_headers(host);
            host.count(cfg.metrics.stripped);
        }
        let headers = host.request_headers();
        Some(decide_on_headers(&cfg.filter, &headers, end_of_stream))
    }

    pub fn on_request_body<H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &Accepted<P, D>, host: &mut H, end_of_stream: bool) -> Next {
        if !self.waiting_for_body {
            return Next::Continue;
        }
        let generates = self.generates;
        if host.request_body_size() > cfg.filter.max_body_bytes {
            // A chunked body outgrew the limit: let it flow and decide on headers.
            return self.decide_now(cfg, host, Body::Unavailable(Fallback::TooLarge), generates);
        }
        if !end_of_stream {
            return Next::Wait;
        }
        self.decide_on_body(cfg, host, generates)
    }

    /// A body followed by trailers never reports end_of_stream on the body: decide here.
    pub fn on_request_trailers<H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &Accepted<P, D>, host: &mut H) -> Next {
        if !self.waiting_for_body {
            return Next::Continue;
        }
        let generates = self.generates;
        self.decide_on_body(cfg, host, generates)
    }

    /// The replica's level is for the mesh only: read into the state table, never passed on.
    /// Every sidecar sends it, but the table keeps only the pools that shed: a response's
    /// reading of another pool (one that sheds nothing, or the failover pool that served a
    /// spilled request) is dropped, not counted as `unknown_pool` (a probe's still is).
    pub fn on_response_headers<H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &Accepted<P, D>, host: &mut H) {
        self.settle_on_response(cfg, host);
        self.learn_prefix(cfg, host);
        let value = match &cfg.filter.degraded {
            Some(_) if self.read_level => host.response_header(HEADER_POOL_LEVEL),
            _ => None,
        };
        host.remove_response_header(HEADER_POOL_LEVEL);
        if let (Some(d), Some(v)) = (&cfg.filter.degraded, value) {
            match cfg.pools.report(d, &v, host.now_ms()) {
                Ok(()) | Err(StateError::UnknownPool) => {}
                Err(e) => host.count(cfg.metrics.state_errors[e as usize]),
            }
        }
    }

    /// The stream is over (completed, reset, its client gone: Envoy destroys the filter in every
    /// case): the reservation's concurrent-stream slot goes back. Its tokens stay charged unless
    /// the response was an error (`settle_on_response`): the reservation bounds what was used.
    pub fn on_stream_end<P, D>(&mut self, cfg: &Accepted<P, D>) {
        if let Some(held) = self.held.take() {
            token_budget::release_stream(&*cfg.budgets, &held);
        }
    }

    /// A budgeted request's response: an error (4xx/5xx, before any token: the upstream's or
    /// Envoy's own, e.g. no healthy upstream) gives the tokens back; a served one tells the
    /// client what remains of its tightest window.
    fn settle_on_response<H: Host, P, D>(&mut self, cfg: &Accepted<P, D>, host: &mut H) {
        let held = match &mut self.held {
            Some(h) => h,
            None => return,
        };
        let status = host.response_header(":status").and_then(|s| s.trim().parse::<u32>().ok()).unwrap_or(0);
        // An unreadable status keeps the tokens charged (an over-charge, never an overshoot).
        if status >= 400 {
            token_budget::release_tokens(&*cfg.budgets, held);
            return;
        }
        if let Some(q) = held.admission.quota {
            for (name, value) in token_budget::quota_headers(&q).iter() {
                host.set_response_header(name, value);
            }
        }
    }

    /// Reserve a budgeted request's tokens and stream slot; `Err`: refused, with the tenant's
    /// label. A request its class's budgets do not limit (no budget for the class, an unlisted
    /// tenant without a default) passes.
    fn reserve<'c, H: Host, P, D>(&mut self, cfg: &'c Accepted<P, D>, host: &mut H, class: &str) -> Result<(), (&'c str, Refusal)> {
        let budgets = match &cfg.filter.budgets {
            Some(b) => b,
            None => return Ok(()),
        };
        let cb = match budgets.classes.get(class) {
            Some(c) => c,
            None => return Ok(()),
        };
        let tenant = {
            let headers = host.request_headers();
            let view = View(&headers);
            match &budgets.tenant {
                TenantSource::Header(h) if self.tenant_trusted => view.get(h).map(str::to_string),
                TenantSource::Header(_) => None,
                TenantSource::ApiKeyHash => {
                    let raw = |n: &str| headers.iter().find(|(k, _)| *k == n.as_bytes()).map(|(_, v)| *v);
                    token_budget::api_key_tenant(raw("authorization"), raw("x-api-key"))
                }
            }
        };
        let charged = token_budget::charged(cb, tenant.as_deref());
        let budget = match charged.budget {
            Some(b) => b,
            None => return Ok(()),
        };
        let ask = match self.ask {
            Some(a) => a,
            None => {
                // The body was not read: its length (declared, or what arrived) stands for the prompt.
                let declared = View(&host.request_headers()).get("content-length").and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(0);
                Ask::unread(declared.max(host.request_body_size() as u64))
            }
        };
        let cost = ask.cost(budget, cb.default_max_tokens);
        let key = token_budget::record_key(class, &charged.record);
        match token_budget::reserve(&*cfg.budgets, &key, budget, cost, host.now_ms()) {
            Ok(held) => {
                self.held = Some(held);
                Ok(())
            }
            Err(r) => Err((charged.label, r)),
        }
    }

    /// The replica that served a keyed request: the one Envoy's stateful session filter names in
    /// `x-infermesh-prefix-host` (it does when the named one did not serve, or none was named),
    /// else the one the filter named. Its keys now map to it, and its `x-infermesh-load` is its
    /// reading. Both headers are internal: removed from every response.
    fn learn_prefix<H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &Accepted<P, D>, host: &mut H) {
        let prefix = self.prefix.take();
        let read = |host: &H, name: &str| if prefix.is_some() { host.response_header(name) } else { None };
        let (served, load, status) = (read(host, HEADER_PREFIX_HOST), read(host, HEADER_LOAD), read(host, ":status"));
        host.remove_response_header(HEADER_PREFIX_HOST);
        host.remove_response_header(HEADER_LOAD);
        let (keys, (pool, named)) = match (&self.keys, prefix) {
            (Some(k), Some(p)) => (k, p),
            _ => return,
        };
        let addr = match served {
            Some(v) => base64_decode(&v).and_then(|b| String::from_utf8(b).ok()),
            None => named,
        };
        let addr = match addr {
            Some(a) => a,
            None => return,
        };
        let now = host.now_ms();
        if let Some(l) = load.and_then(|v| v.trim().parse::<f64>().ok()) {
            // A lost CAS race loses one reading; the next response brings another.
            cfg.prefixes.report_load(&pool, &addr, l, now);
        }
        // A refusal (429, 503) or error says nothing about where the prefix is cached.
        if !status.map_or(false, |s| s.starts_with('2')) {
            return;
        }
        let mut all = [0u64; MAX_KEYS + 1];
        let mut n = 0;
        for (slot, k) in all.iter_mut().zip(keys.learn.iter().chain(keys.chain())) {
            *slot = *k;
            n += 1;
        }
        cfg.prefixes.learn(&pool, &all[..n], &addr, now);
        host.count(cfg.metrics.prefix_learned);
    }

    /// Name the replica that served the request's prefix, while it is under the load bound.
    fn name_replica<H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &Accepted<P, D>, host: &mut H, class: &str, pool: &str) {
        let keys = match &self.keys {
            Some(k) => k,
            None => {
                if self.replace_headers {
                    host.set_request_header(HEADER_PREFIX_HOST, None);
                }
                return;
            }
        };
        let bound = cfg.filter.prefix_bound.get(class).copied().unwrap_or_default();
        let named = match cfg.prefixes.lookup_bounded(pool, keys.chain(), host.now_ms(), bound) {
            Pick::Named(addr) => Some(addr),
            Pick::OverBound => {
                host.count(cfg.metrics.prefix_over_bound);
                None
            }
            Pick::Unknown => None,
        };
        match &named {
            Some(addr) => {
                let value = base64_encode(addr.as_bytes());
                if self.replace_headers {
                    host.set_request_header(HEADER_PREFIX_HOST, Some(&value));
                } else {
                    host.add_request_header(HEADER_PREFIX_HOST, &value);
                }
                host.count(cfg.metrics.prefix_named);
            }
            None if self.replace_headers => host.set_request_header(HEADER_PREFIX_HOST, None),
            None => {}
        }
        self.prefix = Some((pool.to_string(), named));
    }

    fn decide_on_body<H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &Accepted<P, D>, host: &mut H, generates: bool) -> Next {
        let spec = self.key_spec.take();
        let (facts, keys) = match parse_request_body(host, spec) {
            Ok(parsed) => parsed,
            Err(why) => return self.decide_now(cfg, host, Body::Unavailable(why), generates),
        };
        self.ask = Some(Ask::from_facts(&facts));
        let d = match self.classify_now(cfg, host, Body::Parsed(&facts, Content::NotYet)) {
            Some(d) => d,
            None => return Next::Continue,
        };
        self.keys = match cfg.filter.prefix.get(d.class) {
            Some(_) if spec.is_some() => keys,
            // A body rule decided a keyed class: the key takes a second pass over the body.
            Some(&s) if generates => parse_request_body(host, Some(s)).ok().and_then(|(_, k)| k),
            _ => None,
        };
        self.write(cfg, host, &d, generates)
    }

    /// Decide with the body known or known to be unavailable (the classifier always decides).
    fn decide_now<H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &Accepted<P, D>, host: &mut H, body: Body, generates: bool) -> Next {
        match self.classify_now(cfg, host, body) {
            Some(d) => self.write(cfg, host, &d, generates),
            None => Next::Continue,
        }
    }

    /// The classifier's decision now that the body is settled (None: it still asks for the body).
    /// A content rule reached asks for the content label: the body's text is classified then,
    /// once, and the rules tried again with it.
    fn classify_now<'c, H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &'c Accepted<P, D>, host: &mut H, body: Body) -> Option<Decision<'c>> {
        self.waiting_for_body = false;
        let outcome = classify(&cfg.filter, &View(&host.request_headers()), body);
        let body = match (outcome, body, &cfg.filter.content_model) {
            (Outcome::Decided(d), _, _) => return Some(d),
            (Outcome::NeedContent, Body::Parsed(facts, Content::NotYet), Some(model)) => {
                Body::Parsed(facts, Content::Known(model.classify_body(&host.request_body()).label))
            }
            _ => return None,
        };
        match classify(&cfg.filter, &View(&host.request_headers()), body) {
            Outcome::Decided(d) => Some(d),
            _ => None,
        }
    }

    /// Write the decision, after `when_degraded` had its say.
    fn write<H: Host, P: PoolStates, D: SharedData>(&mut self, cfg: &Accepted<P, D>, host: &mut H, d: &Decision, generates: bool) -> Next {
        let config = &cfg.filter;
        let m = &cfg.metrics;
        if let Some(dr) = &config.degraded {
            let now = host.now_ms();
            match dr.verdict(d.class, generates, &mut |p| cfg.pools.is_degraded(dr, p, now)) {
                Verdict::Normal => self.read_level = cfg.pools.reads_response(dr, d.pool, now),
                Verdict::Shed => {
                    count_decision(m, host, d);
                    host.count(m.shed.get(d.class).copied().flatten());
                    shed(dr, host, d.class);
                    return Next::Answered;
                }
            }
        }
        if generates {
            if let Err((tenant, refusal)) = self.reserve(cfg, host, d.class) {
                count_decision(m, host, d);
                host.count(m.budget_refusals.get(d.class, tenant).flatten());
                refuse_over_budget(host, d.class, tenant, &refusal);
                return Next::Answered;
            }
        }
        let headers = [(HEADER_CLASS, d.class), (HEADER_POOL, d.pool), (HEADER_RULE, d.rule), (HEADER_OBJECTIVE, d.objective)];
        let n = if config.emit_objective_header { 4 } else { 3 };
        for (name, value) in headers.iter().take(n) {
            if self.replace_headers {
                host.set_request_header(name, Some(value));
            } else {
                host.add_request_header(name, value);
            }
        }
        if let Some(value) = self.keys.as_ref().and_then(PrefixKeys::header_value) {
            if self.replace_headers {
                host.set_request_header(HEADER_PREFIX_KEY, Some(&value));
            } else {
                host.add_request_header(HEADER_PREFIX_KEY, &value);
            }
        } else if self.replace_headers {
            // A trusted peer's partial decision may carry a key; a request without one has none.
            host.set_request_header(HEADER_PREFIX_KEY, None);
        }
        self.name_replica(cfg, host, d.class, d.pool);
        // One clear for all the writes.
        host.clear_route_cache();
        count_decision(m, host, d);
        Next::Continue
    }
}

/// The request body's facts, and its prefix keys when `spec` asks for them (the reason the body
/// cannot be used otherwise).
fn parse_request_body<H: Host>(host: &mut H, spec: Option<PrefixSpec>) -> Result<(BodyFacts, Option<PrefixKeys>), Fallback> {
    let parts = host.request_body();
    let parsed = match (parts.as_slice(), spec) {
        _ if parts.iter().all(|p| p.is_empty()) => return Err(Fallback::Missing),
        ([one], None) => parse_body(one).map(|f| (f, None)),
        (_, None) => parse_body_segments(&parts).map(|f| (f, None)),
        ([one], Some(s)) => parse_body_keyed(one, s),
        (_, Some(s)) => parse_body_segments_keyed(&parts, s),
    };
    parsed.map_err(|_| Fallback::InvalidJson)
}

fn count_decision<H: Host>(m: &Metrics, host: &mut H, d: &Decision) {
    host.count(m.decisions.get(d.rule_index).copied().flatten());
    if let Some(f) = d.fallback {
        host.count(m.fallbacks[f as usize]);
    }
}

/// The body of a shed request, as the sidecars' own refusals look (OpenAI error JSON).
pub fn shed_body(class: &str) -> String {
    format!(
        r#"{{"error":{{"message":"the mesh is shedding {class} requests while a pool is degraded","type":"rate_limit_error","param":null,"code":"mesh_shedding"}}}}"#
    )
}

/// Answer a shed class at the edge: 429, Retry-After and an OpenAI error body.
fn shed<H: Host>(dr: &DegradedRouting, host: &mut H, class: &str) {
    let retry = dr.retry_after_s.to_string();
    let headers = [("retry-after", retry.as_str()), ("content-type", "application/json"), ("x-infermesh-shed-by", "mesh")];
    host.send_response(429, &headers, shed_body(class).as_bytes());
}

/// Refuse a request over its budget at the edge: 429, Retry-After (seconds to the refusing
/// window's reset), OpenAI's rate-limit headers and an OpenAI error body.
fn refuse_over_budget<H: Host>(host: &mut H, class: &str, tenant: &str, r: &Refusal) {
    let retry = r.retry_after_s().to_string();
    let quota = r.quota.map(|q| token_budget::quota_headers(&q));
    let mut headers: Vec<(&str, &str)> = vec![("retry-after", retry.as_str()), ("content-type", "application/json"), ("x-infermesh-shed-by", "budget")];
    if let Some(q) = &quota {
        headers.extend(q.iter().map(|(n, v)| (*n, v.as_str())));
    }
    host.send_response(429, &headers, r.body(class, tenant).as_bytes());
}

/// The state endpoint of a sidecar's serving port (sidecar/state_api.py), which the probe asks.
pub const STATE_PATH: &str = "/infermesh/state";

/// A probe's answer: its status (None: no response) and level header, into the table (or the
/// error it counts as).
pub fn probe_answer<P: PoolStates>(d: &DegradedRouting, pools: &P, status: Option<&str>, level: Option<&str>, now: u64) -> Result<(), StateError> {
    match status {
        None => Err(StateError::ProbeFailed),
        Some("200") => match level {
            // The reading is the pool the header names: a probe cluster with failover endpoints
            // at priority 1 answers from the failover pool once the pool's own are all gone.
            Some(v) => pools.report(d, v, now),
            None => Err(StateError::BadHeader),
        },
        Some(_) => Err(StateError::ProbeStatus),
    }
}

#[cfg(test)]
mod tests;
