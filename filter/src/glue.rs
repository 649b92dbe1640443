//! proxy-wasm glue: read the request, ask the pure classifier, write the decision back.
//!
//! The request path must never panic (a panic aborts the VM and fails every request on the
//! worker), so every host call result is handled and the fallback is always a decision from
//! the headers alone. Body rules need `allow_on_headers_stop_iteration: true` in the plugin
//! config (see docs/filter.md); the filter only pauses when a rule actually needs the body.

use crate::body::parse_body;
use crate::classify::{classify, Body, Decision, Fallback, Outcome, RequestView, DEFAULT_RULE, TRUSTED_RULE};
use crate::config::{
    FilterConfig, HEADER_CLASS, HEADER_OBJECTIVE, HEADER_POOL, HEADER_RULE, INTERNAL_HEADER_PREFIX,
};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;

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
        Box::new(Root { config: None, metrics: Rc::new(Metrics::default()), rejections: None })
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
    /// Decisions kept from trusted sources, by (class, pool): rare, defined on first use.
    trusted: RefCell<HashMap<(String, String), Option<u32>>>,
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
        Metrics {
            decisions,
            fallbacks,
            stripped: counter("infermesh.stripped_requests_total"),
            trusted: RefCell::new(HashMap::new()),
        }
    }

    fn decision(&self, d: &Decision) {
        bump(self.decisions.get(d.rule_index).copied().flatten());
        if let Some(f) = d.fallback {
            bump(self.fallbacks[f as usize]);
        }
    }

    fn trusted(&self, class: &str, pool: &str) {
        let mut t = self.trusted.borrow_mut();
        let id = *t
            .entry((class.to_string(), pool.to_string()))
            .or_insert_with(|| decision_metric(class, pool, TRUSTED_RULE));
        bump(id);
    }
}

struct Root {
    /// The last configuration that validated. A rejected update leaves it in place.
    config: Option<Rc<FilterConfig>>,
    metrics: Rc<Metrics>,
    rejections: Option<u32>,
}

impl Context for Root {}

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
        match FilterConfig::parse(&bytes) {
            Ok(cfg) => {
                log::info!(
                    "infermesh: config accepted: {} rules ({} need the body), default class {}, body limit {} bytes",
                    cfg.rules.len(),
                    cfg.rules.iter().filter(|r| r.body.is_some()).count(),
                    cfg.default_class,
                    cfg.max_body_bytes
                );
                self.metrics = Rc::new(Metrics::for_config(&cfg));
                self.config = Some(Rc::new(cfg));
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

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            config: self.config.clone(),
            metrics: Rc::clone(&self.metrics),
            headers: Headers { all: Vec::new() },
            waiting_for_body: false,
            internal_in_request: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// A snapshot of the request headers taken once, so the classifier sees a consistent view and
/// each header is fetched from the host a single time.
struct Headers {
    all: Vec<(String, String)>,
}

impl Headers {
    fn get(&self, name: &str) -> Option<&str> {
        self.all.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

impl RequestView for Headers {
    fn method(&self) -> Option<&str> {
        self.get(":method")
    }
    fn path(&self) -> Option<&str> {
        self.get(":path")
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.get(name)
    }
}

struct Request {
    config: Option<Rc<FilterConfig>>,
    metrics: Rc<Metrics>,
    headers: Headers,
    waiting_for_body: bool,
    /// Whether Envoy's header map may still hold an `x-infermesh-*` header (a trusted peer's
    /// partial decision); when not, the decision's headers are added without a lookup each.
    internal_in_request: bool,
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

    fn write(&self, config: &FilterConfig, d: &Decision) {
        if skipped(Part::Write) {
            self.metrics.decision(d);
            return;
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
    }

    /// Decide with the body known or known to be unavailable (never `Body::NotYet`, so the
    /// classifier always decides).
    fn decide_now(&mut self, config: &FilterConfig, body: Body) {
        self.waiting_for_body = false;
        if let Outcome::Decided(d) = classify(config, &self.headers, body) {
            self.write(config, &d)
        }
    }

    fn decide_on_body(&mut self, config: &FilterConfig, bytes: &[u8]) {
        if skipped(Part::Copy) || skipped(Part::Scan) {
            return self.decide_now(config, Body::Parsed(&Default::default()));
        }
        match parse_body(bytes) {
            Ok(facts) => self.decide_now(config, Body::Parsed(&facts)),
            Err(_) => {
                let why = if bytes.is_empty() { Fallback::Missing } else { Fallback::InvalidJson };
                self.decide_now(config, Body::Unavailable(why));
            }
        }
    }

    /// Remove every client-sent `x-infermesh-*` header, from Envoy and from the snapshot the
    /// classifier reads.
    fn strip_internal_headers(&mut self) {
        for (name, _) in self.headers.all.iter().filter(|(k, _)| k.starts_with(INTERNAL_HEADER_PREFIX)) {
            self.set_http_request_header(name, None);
        }
        self.headers.all.retain(|(k, _)| !k.starts_with(INTERNAL_HEADER_PREFIX));
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

/// Request callbacks only: the build drops the exports of the response-side ones
/// (and `on_log`, `on_done`) so Envoy skips those calls; one used here must come off the list in
/// scripts/strip-wasm-exports.py.
impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if cfg!(feature = "bench-noop") {
            return Action::Continue;
        }
        self.headers = Headers { all: self.get_http_request_headers() };
        let config = match &self.config {
            Some(c) => Rc::clone(c),
            None => {
                // No valid config ever arrived: still never let a client steer routing.
                self.strip_internal_headers();
                return Action::Continue;
            }
        };
        let spoofed = self.headers.all.iter().any(|(k, _)| k.starts_with(INTERNAL_HEADER_PREFIX));
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
            Outcome::Decided(d) => {
                self.write(&config, &d);
                Action::Continue
            }
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
                    Some(why) => {
                        self.decide_now(&config, Body::Unavailable(why));
                        Action::Continue
                    }
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
            self.decide_now(&config, Body::Unavailable(Fallback::TooLarge));
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause; // keep buffering
        }
        let bytes = if skipped(Part::Copy) { Vec::new() } else { self.get_http_request_body(0, body_size).unwrap_or_default() };
        self.decide_on_body(&config, &bytes);
        Action::Continue
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // A body followed by trailers never reports end_of_stream on the body: decide here.
        if self.waiting_for_body {
            if let Some(config) = self.config.clone() {
                let bytes = self.get_http_request_body(0, config.max_body_bytes).unwrap_or_default();
                self.decide_on_body(&config, &bytes);
            }
        }
        Action::Continue
    }
}
