//! proxy-wasm glue: read the request, ask the pure classifier, write the decision back.
//!
//! The request path must never panic (a panic aborts the VM and fails every request on the
//! worker), so every host call result is handled and the fallback is always a decision from
//! the headers alone. Body rules need `allow_on_headers_stop_iteration: true` in the plugin
//! config (see docs/filter.md); the filter only pauses when a rule actually needs the body.
//!
//! Degraded-mode routing (`degraded_routing` in the config): the pool state table of
//! `pool_state.rs` lives in proxy-wasm shared data, one record per pool, written with CAS by
//! every worker; it is fed by the `x-infermesh-pool-level` header of upstream responses (stripped
//! in the response callback, and read on one response per pool every SAMPLE_MS) and by a probe of each pool's state endpoint on the
//! root context's timer. After the decision, `when_degraded` sheds the request (spilling a degraded
//! pool elsewhere is Envoy's: the health check of the sidecars' state endpoint and priority failover).

use crate::body::parse_body;
use crate::header_map;
use crate::classify::{classify, Body, Decision, Fallback, Outcome, RequestView, DEFAULT_RULE};
use crate::config::{
    reload, DegradedRouting, FilterConfig, HEADER_CLASS, HEADER_OBJECTIVE, HEADER_POOL, HEADER_RULE, INTERNAL_HEADER_PREFIX,
};
use crate::pool_state::{costs_generation, parse_report, PoolRecord, ReadingError, RecentWrites, ResponseSampler, Verdict, HEADER_POOL_LEVEL};
use crate::stats::TrustedCounters;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType, Status};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

/// Parts of the body path a profiling build can leave out (feature `bench-profile`, never
/// shipped): the VM configuration names one, so one module measures what each part costs
/// (filter/bench/instructions.py, docs/filter-benchmark.md).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    /// Pausing for the body at all: decide at once as if it were missing.
    Pause = 1,
    /// Copying the buffered body into the VM (decide on empty facts).
    Copy,
    /// Scanning the copied body (decide on empty facts).
    Scan,
    /// Writing the decision headers.
    Write,
}

#[cfg(feature = "bench-profile")]
static SKIPPED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

fn skipped(part: Part) -> bool {
    #[cfg(feature = "bench-profile")]
    return SKIPPED.load(std::sync::atomic::Ordering::Relaxed) == part as u8;
    #[cfg(not(feature = "bench-profile"))]
    return {
        let _ = part;
        false
    };
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root {
            config: None,
            metrics: Rc::new(Metrics::default()),
            rejections: None,
            states: Rc::new(PoolStates::default()),
            probes: HashMap::new(),
        })
    });
}}

/// Counters through the proxy-wasm metrics API. Envoy shows them under `wasmcustom.`; the
/// generated bootstrap extracts `class`, `pool`, `rule` and `reason` as tags. Every counter a
/// config can touch is defined once in `on_configure`, so a request only increments an id.
#[derive(Default)]
struct Metrics {
    /// One per rule, in rule order, then the default rule.
    decisions: Vec<Option<u32>>,
    fallbacks: [Option<u32>; 4],
    stripped: Option<u32>,
    /// Decisions kept from trusted sources, by the config's (class, pool) labels; a name the
    /// config does not define is counted as `other` (crate::stats), so traffic never defines a stat.
    trusted: TrustedCounters<Option<u32>>,
    /// Requests shed at the edge, by class.
    shed: HashMap<String, Option<u32>>,
    /// Readings not used and probes that failed, by reason (`STATE_ERRORS`).
    state_errors: [Option<u32>; 6],
}

/// Why the pool state table could not use something: the filter then routes normally.
#[derive(Clone, Copy)]
enum StateError {
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
    /// A shared-data record that does not decode, or a write that kept losing its CAS race.
    SharedData,
}

const STATE_ERRORS: [&str; 6] = ["bad_header", "unknown_pool", "probe_failed", "probe_status", "no_cluster", "shared_data"];

impl From<ReadingError> for StateError {
    fn from(e: ReadingError) -> Self {
        match e {
            ReadingError::BadHeader => StateError::BadHeader,
            ReadingError::UnknownPool => StateError::UnknownPool,
        }
    }
}

fn counter(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Counter, name).ok()
}

fn decision_metric(class: &str, pool: &str, rule: &str) -> Option<u32> {
    counter(&format!("infermesh.requests_total.class.{class}.pool.{pool}.rule.{rule}"))
}

fn bump(id: Option<u32>) {
    if let Some(id) = id {
        let _ = hostcalls::increment_metric(id, 1);
    }
}

impl Metrics {
    fn for_config(config: &FilterConfig) -> Metrics {
        let mut decisions: Vec<Option<u32>> =
            config.rules.iter().map(|r| decision_metric(&r.class, &r.pool, &r.name)).collect();
        decisions.push(decision_metric(&config.default_class, &config.default_pool, DEFAULT_RULE));
        let mut fallbacks = [None; 4];
        for (slot, f) in fallbacks.iter_mut().zip(Fallback::ALL) {
            *slot = counter(&format!("infermesh.body_fallbacks_total.reason.{}", f.as_str()));
        }
        let mut shed = HashMap::new();
        let mut state_errors = [None; 6];
        if let Some(d) = &config.degraded {
            for p in d.pools.values() {
                for c in &p.shed_classes {
                    shed.entry(c.clone()).or_insert_with(|| counter(&format!("infermesh.shed_requests_total.class.{c}")));
                }
            }
            for (slot, reason) in state_errors.iter_mut().zip(STATE_ERRORS) {
                *slot = counter(&format!("infermesh.pool_state_errors_total.reason.{reason}"));
            }
        }
        Metrics {
            decisions,
            fallbacks,
            stripped: counter("infermesh.stripped_requests_total"),
            trusted: TrustedCounters::define(config, &mut |n| counter(n)),
            shed,
            state_errors,
        }
    }

    fn state_error(&self, e: StateError) {
        bump(self.state_errors[e as usize]);
    }

    fn decision(&self, d: &Decision) {
        bump(self.decisions.get(d.rule_index).copied().flatten());
        if let Some(f) = d.fallback {
            bump(self.fallbacks[f as usize]);
        }
    }

    fn trusted(&self, class: &str, pool: &str) {
        bump(self.trusted.get(class, pool).flatten());
    }
}

fn now_ms() -> u64 {
    hostcalls::get_current_time().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_millis() as u64)
}

/// Shared-data keys: one record per pool, and the time of each pool's last probe.
fn state_key(pool: &str) -> String {
    format!("infermesh.pool_state.{pool}")
}
fn probe_key(pool: &str) -> String {
    format!("infermesh.probe.{pool}")
}

/// A worker reuses its view of a normal pool this long before reading shared data again (the
/// request path then costs no shared-data read; well inside the 1 s target).
const VIEW_MS: u64 = 100;
/// A worker rewrites an unchanged reading of a replica at most this often: fresh enough for the
/// staleness bound, without a shared-data write per response.
const REWRITE_MS: u64 = 250;
/// A worker reads the level header of one response per pool this often (`ResponseSampler`).
const SAMPLE_MS: u64 = 10;
/// Traffic keeps a pool's newest reading in shared data at most this old (an unchanged one is
/// rewritten every REWRITE_MS): an older one means its traffic stopped (spilled away, idle), and
/// the probe is due now, not a whole probe interval after the pool's last response.
const TRAFFIC_FRESH_MS: u64 = REWRITE_MS + SAMPLE_MS;
/// CAS attempts per write before it is given up (and counted): another worker keeps winning.
const CAS_TRIES: usize = 4;

/// This worker's side of the shared pool state table.
#[derive(Default)]
struct PoolStates {
    /// pool -> (read at, degraded).
    view: RefCell<HashMap<String, (u64, bool)>>,
    /// The readings this worker wrote lately (skipped while unchanged).
    written: RefCell<RecentWrites>,
    /// Which responses' level header this worker reads.
    sampled: RefCell<ResponseSampler>,
}

impl PoolStates {
    fn read(metrics: &Metrics, pool: &str) -> (PoolRecord, Option<u32>) {
        match hostcalls::get_shared_data(&state_key(pool)) {
            Ok((Some(bytes), cas)) => match PoolRecord::decode(&bytes) {
                Some(rec) => (rec, cas),
                None => {
                    metrics.state_error(StateError::SharedData);
                    (PoolRecord::default(), cas)
                }
            },
            Ok((None, cas)) => (PoolRecord::default(), cas),
            Err(_) => (PoolRecord::default(), None),
        }
    }

    fn is_degraded(&self, cfg: &DegradedRouting, metrics: &Metrics, pool: &str, now: u64) -> bool {
        let p = match cfg.pools.get(pool) {
            Some(p) => p,
            None => return false,
        };
        if let Some((at, d)) = self.view.borrow().get(pool) {
            // Only a normal view is reused: a degraded one is read again on every request, so a
            // recovery reaches every worker at once, not up to VIEW_MS later on another worker.
            if !*d && now.saturating_sub(*at) < VIEW_MS {
                return false;
            }
        }
        let degraded = Self::read(metrics, pool).0.degraded(&p.rule, now);
        self.view.borrow_mut().insert(pool.to_string(), (now, degraded));
        degraded
    }

    /// One `x-infermesh-pool-level` value, from a response or a probe. Every sidecar sends it,
    /// but the table keeps only the pools that shed: a response's reading of another pool (one
    /// that sheds nothing, or the failover pool that served a spilled request) is dropped, a
    /// probe's is counted as `unknown_pool`.
    fn report(&self, cfg: &DegradedRouting, metrics: &Metrics, value: &str, now: u64, from_probe: bool) {
        if self.written.borrow().fresh(value, now, REWRITE_MS) {
            return;
        }
        let r = match parse_report(value) {
            Ok(r) => r,
            Err(e) => return metrics.state_error(e.into()),
        };
        let p = match cfg.pools.get(r.pool) {
            Some(p) => p,
            None if from_probe => return metrics.state_error(StateError::UnknownPool),
            None => return,
        };
        for _ in 0..CAS_TRIES {
            let (mut rec, cas) = Self::read(metrics, r.pool);
            rec.observe(&p.rule, r.replica, r.level, now);
            if hostcalls::set_shared_data(&state_key(r.pool), Some(&rec.encode()), cas).is_ok() {
                self.written.borrow_mut().wrote(value, &r, now);
                self.view.borrow_mut().insert(r.pool.to_string(), (now, rec.degraded(&p.rule, now)));
                return;
            }
        }
        metrics.state_error(StateError::SharedData);
    }

    /// Claim this interval's probe of `pool` for this worker (CAS on the pool's probe key), unless
    /// traffic already keeps its readings fresh.
    fn claim_probe(metrics: &Metrics, pool: &str, interval: u64, now: u64) -> bool {
        if now.saturating_sub(Self::read(metrics, pool).0.newest_ms()) < interval.min(TRAFFIC_FRESH_MS) {
            return false;
        }
        let key = probe_key(pool);
        let (last, cas) = match hostcalls::get_shared_data(&key) {
            Ok((bytes, cas)) => (bytes.and_then(|b| String::from_utf8(b).ok()).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0), cas),
            Err(_) => return false,
        };
        // 90 %: the workers' timers drift; a probe slightly early beats one skipped.
        if now.saturating_sub(last) < interval * 9 / 10 {
            return false;
        }
        hostcalls::set_shared_data(&key, Some(now.to_string().as_bytes()), cas).is_ok()
    }
}

struct Root {
    /// The last configuration that validated. A rejected update leaves it in place.
    config: Option<Rc<FilterConfig>>,
    metrics: Rc<Metrics>,
    rejections: Option<u32>,
    states: Rc<PoolStates>,
    /// Probe calls in flight: token -> the pool probed.
    probes: HashMap<u32, String>,
}

/// The state endpoint of a sidecar's serving port (sidecar/state_api.py).
const STATE_PATH: &str = "/infermesh/state";

impl Root {
    fn probe(&mut self) {
        let config = match &self.config {
            Some(c) => Rc::clone(c),
            None => return,
        };
        let d = match &config.degraded {
            Some(d) => d,
            None => return,
        };
        let now = now_ms();
        for (pool, p) in &d.pools {
            let cluster = match &p.probe_cluster {
                Some(c) => c,
                None => continue,
            };
            if !PoolStates::claim_probe(&self.metrics, pool, d.probe_interval_ms, now) {
                continue;
            }
            let headers = vec![(":method", "GET"), (":path", STATE_PATH), (":authority", pool.as_str()), ("accept", "application/json")];
            match self.dispatch_http_call(cluster, headers, None, vec![], Duration::from_millis(d.probe_timeout_ms)) {
                Ok(token) => {
                    self.probes.insert(token, pool.clone());
                }
                Err(_) => self.metrics.state_error(StateError::NoCluster),
            }
        }
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, _body_size: usize, _num_trailers: usize) {
        if self.probes.remove(&token_id).is_none() {
            return;
        }
        let d = match self.config.as_ref().and_then(|c| c.degraded.as_ref()) {
            Some(d) => d,
            None => return,
        };
        if num_headers == 0 {
            return self.metrics.state_error(StateError::ProbeFailed);
        }
        if self.get_http_call_response_header_bytes(":status").as_deref() != Some(&b"200"[..]) {
            return self.metrics.state_error(StateError::ProbeStatus);
        }
        // The reading is the pool the header names: a probe cluster with failover endpoints at
        // priority 1 answers from the failover pool once the pool's own sidecars are all gone.
        match self.get_http_call_response_header_bytes(HEADER_POOL_LEVEL).and_then(|v| String::from_utf8(v).ok()) {
            Some(v) => self.states.report(d, &self.metrics, &v, now_ms(), true),
            None => self.metrics.state_error(StateError::BadHeader),
        }
    }
}

impl RootContext for Root {
    #[cfg(feature = "bench-profile")]
    fn on_vm_start(&mut self, _size: usize) -> bool {
        let name = hostcalls::get_buffer(proxy_wasm::types::BufferType::VmConfiguration, 0, usize::MAX).ok().flatten();
        let part = match name.as_deref() {
            Some(b"no-pause") => Part::Pause as u8,
            Some(b"no-copy") => Part::Copy as u8,
            Some(b"no-scan") => Part::Scan as u8,
            Some(b"no-write") => Part::Write as u8,
            _ => 0,
        };
        SKIPPED.store(part, std::sync::atomic::Ordering::Relaxed);
        true
    }

    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        // Only a config that validates replaces the one in force (config::reload).
        match reload(&mut self.config, &bytes) {
            Ok(cfg) => {
                log::info!(
                    "infermesh: config accepted: {} rules ({} need the body), default class {}, body limit {} bytes",
                    cfg.rules.len(),
                    cfg.rules.iter().filter(|r| r.body.is_some()).count(),
                    cfg.default_class,
                    cfg.max_body_bytes
                );
                self.metrics = Rc::new(Metrics::for_config(&cfg));
                let tick = cfg.degraded.as_ref().filter(|d| d.pools.values().any(|p| p.probe_cluster.is_some()));
                let _ = hostcalls::set_tick_period(tick.map_or(Duration::ZERO, |d| Duration::from_millis(d.probe_interval_ms)));
                // A new config may change a pool's level rule: start from the shared records again.
                self.states = Rc::new(PoolStates::default());
                true
            }
            Err(e) => {
                if self.rejections.is_none() {
                    self.rejections = counter("infermesh.config_rejections_total");
                }
                bump(self.rejections);
                // Returning false makes Envoy refuse this configuration; a previously
                // accepted one keeps serving.
                log::error!("infermesh: {e}; keeping the last good config");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        self.probe();
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            config: self.config.clone(),
            metrics: Rc::clone(&self.metrics),
            states: Rc::clone(&self.states),
            headers: Headers { all: Vec::new() },
            waiting_for_body: false,
            internal_in_request: false,
            read_level: Cell::new(true),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// A snapshot of the request headers taken once, so the classifier sees a consistent view and
/// each header is fetched from the host a single time. As bytes: a value that is not UTF-8 is
/// absent to the rules (no rule can match it), as in the native module.
struct Headers {
    all: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Headers {
    fn get(&self, name: &str) -> Option<&str> {
        self.all.iter().find(|(k, _)| k == name.as_bytes()).and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    fn internal(&self) -> impl Iterator<Item = &[u8]> {
        self.all.iter().map(|(k, _)| k.as_slice()).filter(|k| k.starts_with(INTERNAL_HEADER_PREFIX.as_bytes()))
    }
}

// The SDK's header getters unwrap `String::from_utf8` (a panic on one odd byte from a client, and
// a panic aborts the VM): the request map is read and its odd names removed through these.
// The ABI's map type and status are u32s (the SDK's enums, non-exhaustive, are not FFI-safe).
#[allow(clashing_extern_declarations)]
extern "C" {
    fn proxy_get_header_map_pairs(map_type: u32, return_map_data: *mut *mut u8, return_map_size: *mut usize) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
}

const REQUEST_HEADERS: u32 = MapType::HttpRequestHeaders as u32;
const STATUS_OK: u32 = Status::Ok as u32;

fn request_headers() -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: on Ok the host hands over a buffer it allocated through this module's
    // proxy_on_memory_allocate (as the SDK's own get_map takes it).
    unsafe {
        match proxy_get_header_map_pairs(REQUEST_HEADERS, &mut data, &mut size) {
            STATUS_OK if !data.is_null() => header_map::deserialize(&Vec::from_raw_parts(data, size, size)),
            _ => Vec::new(),
        }
    }
}

fn remove_request_header(name: &[u8]) {
    // SAFETY: the host only reads `name` for the call.
    let _ = unsafe { proxy_remove_header_map_value(REQUEST_HEADERS, name.as_ptr(), name.len()) };
}

impl RequestView for Headers {
    fn header(&self, name: &str) -> Option<&str> {
        self.get(name)
    }
}

struct Request {
    config: Option<Rc<FilterConfig>>,
    metrics: Rc<Metrics>,
    states: Rc<PoolStates>,
    headers: Headers,
    waiting_for_body: bool,
    /// Whether Envoy's header map may still hold an `x-infermesh-*` header (a trusted peer's
    /// partial decision); when not, the decision's headers are added without a lookup each.
    internal_in_request: bool,
    /// Whether the response's level header is read (degraded routing samples responses per
    /// pool, and only of the pools it keeps state for: the others' sidecars send the header too;
    /// a request not routed by `write`, e.g. a trusted peer's, is always read).
    read_level: Cell<bool>,
}

impl Request {
    fn source_is_trusted(&self, config: &FilterConfig) -> bool {
        if config.trusted.is_empty() {
            return false;
        }
        if !config.trusted.cidrs.is_empty() {
            if let Some(ip) = self.source_ip() {
                if config.trusted.cidrs.iter().any(|c| c.contains(&ip)) {
                    return true;
                }
            }
        }
        if !config.trusted.principals.is_empty() {
            for path in [["connection", "uri_san_peer_certificate"], ["connection", "dns_san_peer_certificate"]] {
                if let Some(p) = self.get_property(path.to_vec()).and_then(|b| String::from_utf8(b).ok()) {
                    if config.trusted.principals.iter().any(|t| *t == p) {
                        return true;
                    }
                }
            }
        }
        false
    }

    fn source_ip(&self) -> Option<IpAddr> {
        let raw = self.get_property(vec!["source", "address"])?;
        let s = String::from_utf8(raw).ok()?;
        s.parse::<SocketAddr>().map(|a| a.ip()).ok().or_else(|| s.parse::<IpAddr>().ok())
    }

    /// Write the decision, after `when_degraded` had its say: Pause once a shed request has
    /// been answered, Continue otherwise.
    fn write(&self, config: &FilterConfig, d: &Decision) -> Action {
        if skipped(Part::Write) {
            self.metrics.decision(d);
            return Action::Continue;
        }
        if let Some(dr) = &config.degraded {
            let generates = costs_generation(self.headers.get(":method").unwrap_or(""), self.headers.get(":path").unwrap_or(""));
            let now = now_ms();
            let verdict = dr.verdict(d.class, generates, &mut |p| self.states.is_degraded(dr, &self.metrics, p, now));
            match verdict {
                Verdict::Normal => {
                    let kept = dr.pools.contains_key(d.pool);
                    self.read_level.set(kept && self.states.sampled.borrow_mut().due(d.pool, now, SAMPLE_MS));
                }
                Verdict::Shed => {
                    self.metrics.decision(d);
                    bump(self.metrics.shed.get(d.class).copied().flatten());
                    self.shed(dr, d.class);
                    return Action::Pause;
                }
            }
        }
        let headers = [(HEADER_CLASS, d.class), (HEADER_POOL, d.pool), (HEADER_RULE, d.rule), (HEADER_OBJECTIVE, d.objective)];
        let n = if config.emit_objective_header { 4 } else { 3 };
        for (name, value) in headers.iter().take(n) {
            if self.internal_in_request {
                self.set_http_request_header(name, Some(value));
            } else {
                self.add_http_request_header(name, value);
            }
        }
        self.metrics.decision(d);
        Action::Continue
    }

    /// Answer a shed class at the edge: 429, Retry-After and an OpenAI error body, as the
    /// sidecars' own refusals look.
    fn shed(&self, dr: &DegradedRouting, class: &str) {
        let body = format!(
            r#"{{"error":{{"message":"the mesh is shedding {class} requests while a pool is degraded","type":"rate_limit_error","param":null,"code":"mesh_shedding"}}}}"#
        );
        let retry = dr.retry_after_s.to_string();
        let headers = vec![("retry-after", retry.as_str()), ("content-type", "application/json"), ("x-infermesh-shed-by", "mesh")];
        let _ = hostcalls::send_http_response(429, headers, Some(body.as_bytes()));
    }

    /// Decide with the body known or known to be unavailable (never `Body::NotYet`, so the
    /// classifier always decides).
    fn decide_now(&mut self, config: &FilterConfig, body: Body) -> Action {
        self.waiting_for_body = false;
        match classify(config, &self.headers, body) {
            Outcome::Decided(d) => self.write(config, &d),
            Outcome::NeedBody => Action::Continue,
        }
    }

    fn decide_on_body(&mut self, config: &FilterConfig, bytes: &[u8]) -> Action {
        if skipped(Part::Copy) || skipped(Part::Scan) {
            return self.decide_now(config, Body::Parsed(&Default::default()));
        }
        match parse_body(bytes) {
            Ok(facts) => self.decide_now(config, Body::Parsed(&facts)),
            Err(_) => {
                let why = if bytes.is_empty() { Fallback::Missing } else { Fallback::InvalidJson };
                self.decide_now(config, Body::Unavailable(why))
            }
        }
    }

    /// Remove every client-sent `x-infermesh-*` header, from Envoy and from the snapshot the
    /// classifier reads.
    fn strip_internal_headers(&mut self) {
        for name in self.headers.internal() {
            remove_request_header(name);
        }
        self.headers.all.retain(|(k, _)| !k.starts_with(INTERNAL_HEADER_PREFIX.as_bytes()));
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

impl Context for Request {}

/// The request callbacks and the response headers (the pool level); the build drops the exports
/// of the other response-side ones (and `on_log`, `on_done`) so Envoy skips those calls; one used
/// here must come off the list in scripts/strip-wasm-exports.py.
impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if cfg!(feature = "bench-noop") {
            return Action::Continue;
        }
        self.headers = Headers { all: request_headers() };
        let config = match &self.config {
            Some(c) => Rc::clone(c),
            None => {
                // No valid config ever arrived: still never let a client steer routing.
                self.strip_internal_headers();
                return Action::Continue;
            }
        };
        let spoofed = self.headers.internal().next().is_some();
        if spoofed {
            if self.source_is_trusted(&config) {
                // An upstream infermesh hop already decided: keep its headers as they are.
                if self.headers.get(HEADER_CLASS).is_some() && self.headers.get(HEADER_POOL).is_some() {
                    self.metrics.trusted(self.headers.get(HEADER_CLASS).unwrap_or(""), self.headers.get(HEADER_POOL).unwrap_or(""));
                    return Action::Continue;
                }
                self.internal_in_request = true;
            } else {
                self.strip_internal_headers();
                bump(self.metrics.stripped);
            }
        }
        match classify(&config, &self.headers, Body::NotYet) {
            Outcome::Decided(d) => self.write(&config, &d),
            Outcome::NeedBody => {
                let why = if end_of_stream {
                    Some(Fallback::Missing)
                } else if !is_json(self.headers.get("content-type")) {
                    Some(Fallback::NotJson)
                } else {
                    match self.headers.get("content-length").map(|v| v.trim().parse::<usize>()) {
                        Some(Ok(0)) => Some(Fallback::Missing),
                        Some(Ok(n)) if n > config.max_body_bytes => Some(Fallback::TooLarge),
                        _ => None,
                    }
                };
                let why = if skipped(Part::Pause) { why.or(Some(Fallback::Missing)) } else { why };
                match why {
                    Some(why) => self.decide_now(&config, Body::Unavailable(why)),
                    None => {
                        self.waiting_for_body = true;
                        Action::Pause
                    }
                }
            }
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.waiting_for_body {
            return Action::Continue;
        }
        let config = match &self.config {
            Some(c) => Rc::clone(c),
            None => return Action::Continue,
        };
        if body_size > config.max_body_bytes {
            // A chunked body outgrew the limit: let it flow and decide on headers.
            return self.decide_now(&config, Body::Unavailable(Fallback::TooLarge));
        }
        if !end_of_stream {
            return Action::Pause; // keep buffering
        }
        let bytes = if skipped(Part::Copy) { Vec::new() } else { self.get_http_request_body(0, body_size).unwrap_or_default() };
        self.decide_on_body(&config, &bytes)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A body followed by trailers never reports end_of_stream on the body: decide here.
        if self.waiting_for_body {
            if let Some(config) = self.config.clone() {
                let bytes = self.get_http_request_body(0, config.max_body_bytes).unwrap_or_default();
                return self.decide_on_body(&config, &bytes);
            }
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if cfg!(feature = "bench-noop") {
            return Action::Continue;
        }
        // The replica's level is for the mesh only: never passed on to the client. Without
        // degraded routing it is only removed (reading it would cost a copy into the VM).
        match self.config.as_ref().and_then(|c| c.degraded.as_ref()) {
            Some(d) => {
                if !self.read_level.get() {
                    self.set_http_response_header(HEADER_POOL_LEVEL, None);
                } else if let Some(value) = self.get_http_response_header_bytes(HEADER_POOL_LEVEL) {
                    self.set_http_response_header(HEADER_POOL_LEVEL, None);
                    match String::from_utf8(value) {
                        Ok(v) => self.states.report(d, &self.metrics, &v, now_ms(), false),
                        Err(_) => self.metrics.state_error(StateError::BadHeader),
                    }
                }
            }
            None => self.set_http_response_header(HEADER_POOL_LEVEL, None),
        }
        Action::Continue
    }
}
