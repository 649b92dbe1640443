//! proxy-wasm bindings: the request flow of `request_flow` on the proxy-wasm host.
//!
//! The request path must never panic (a panic aborts the VM and fails every request on the
//! worker), so every host call result is handled and the fallback is always a decision from
//! the headers alone. Body rules need `allow_on_headers_stop_iteration: true` in the plugin
//! config (see docs/filter.md); the filter only pauses when a rule actually needs the body.
//!
//! Degraded-mode routing (`degraded_routing` in the config): the pool state table lives in
//! proxy-wasm shared data (`shared_pool_table.rs`); the root context's timer probes each idle
//! pool's state endpoint. After the decision, `when_degraded` sheds the request (spilling a
//! degraded pool elsewhere is Envoy's: the health check of the sidecars' state endpoint and
//! priority failover).

use crate::config::FilterConfig;
use crate::header_map;
use crate::request_flow::{probe_answer, strip_internal_headers, Accepted, CounterId, Host, Next, StateError, Stream, STATE_PATH};
use crate::shared_pool_table::{SharedData, SharedTable};
use crate::token_budget::SharedBudgets;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { accepted: None, rejections: None, probes: HashMap::new() })
    });
}}

/// Counters through the proxy-wasm metrics API. Envoy shows them under `wasmcustom.`; the
/// generated bootstrap extracts `class`, `pool`, `rule` and `reason` as tags.
fn counter(name: &str) -> CounterId {
    hostcalls::define_metric(MetricType::Counter, name).ok().map(|id| id as usize)
}

fn count(id: CounterId) {
    if let Some(id) = id {
        let _ = hostcalls::increment_metric(id as u32, 1);
    }
}

fn now_ms() -> u64 {
    hostcalls::get_current_time().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_millis() as u64)
}

/// proxy-wasm shared data (one key-value store for every worker of the VM).
#[derive(Default)]
struct ProxyWasmSharedData;

impl SharedData for ProxyWasmSharedData {
    fn get(&self, key: &str) -> Option<(Option<Vec<u8>>, Option<u32>)> {
        hostcalls::get_shared_data(key).ok()
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        hostcalls::set_shared_data(key, Some(value), cas).is_ok()
    }
    fn count(&self, id: CounterId) {
        count(id)
    }
}

type Config = Accepted<SharedTable<ProxyWasmSharedData>, ProxyWasmSharedData>;

struct Root {
    /// The last configuration that validated. A rejected update leaves it in place.
    accepted: Option<Rc<Config>>,
    rejections: CounterId,
    /// Probe calls in flight: token -> the pool probed.
    probes: HashMap<u32, String>,
}

impl Root {
    fn probe(&mut self) {
        let cfg = match &self.accepted {
            Some(c) => Rc::clone(c),
            None => return,
        };
        let d = match &cfg.filter.degraded {
            Some(d) => d,
            None => return,
        };
        let now = now_ms();
        for (pool, p) in &d.pools {
            let cluster = match &p.probe_cluster {
                Some(c) => c,
                None => continue,
            };
            if !cfg.pools.claim_probe(pool, d.probe_interval_ms, now) {
                continue;
            }
            let headers = vec![(":method", "GET"), (":path", STATE_PATH), (":authority", pool.as_str()), ("accept", "application/json")];
            match self.dispatch_http_call(cluster, headers, None, vec![], Duration::from_millis(d.probe_timeout_ms)) {
                Ok(token) => {
                    self.probes.insert(token, pool.clone());
                }
                Err(_) => count(cfg.metrics.state_errors[StateError::NoCluster as usize]),
            }
        }
    }
}

fn call_response_header(name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, name).ok().flatten()
}

impl Context for Root {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, _body_size: usize, _num_trailers: usize) {
        if self.probes.remove(&token_id).is_none() {
            return;
        }
        let cfg = match &self.accepted {
            Some(c) => c,
            None => return,
        };
        let d = match &cfg.filter.degraded {
            Some(d) => d,
            None => return,
        };
        let status = match num_headers {
            0 => None,
            _ => Some(call_response_header(":status").and_then(|s| String::from_utf8(s).ok()).unwrap_or_default()),
        };
        let level = if status.as_deref() == Some("200") {
            call_response_header(crate::pool_state::HEADER_POOL_LEVEL).and_then(|v| String::from_utf8(v).ok())
        } else {
            None
        };
        if let Err(e) = probe_answer(d, &cfg.pools, status.as_deref(), level.as_deref(), now_ms()) {
            count(cfg.metrics.state_errors[e as usize]);
        }
    }
}

impl RootContext for Root {
    #[cfg(feature = "bench-profile")]
    fn on_vm_start(&mut self, _size: usize) -> bool {
        let name = hostcalls::get_buffer(BufferType::VmConfiguration, 0, usize::MAX).ok().flatten();
        crate::bench_profile::configure(name.as_deref());
        true
    }

    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten().unwrap_or_default();
        // Only a config that validates replaces the one in force.
        match FilterConfig::parse(&bytes) {
            Ok(filter) => {
                log::info!(
                    "infermesh: config accepted: {} rules ({} need the body), default class {}, body limit {} bytes",
                    filter.rules.len(),
                    filter.rules.iter().filter(|r| r.body.is_some()).count(),
                    filter.default_class,
                    filter.max_body_bytes
                );
                let tick = filter.degraded.as_ref().filter(|d| d.pools.values().any(|p| p.probe_cluster.is_some()));
                let _ = hostcalls::set_tick_period(tick.map_or(Duration::ZERO, |d| Duration::from_millis(d.probe_interval_ms)));
                // Its own counters and pool state table (a new config may change a pool's level
                // rule: start from the shared records again).
                // Budgets: one shared-data record per (class, tenant), written with CAS by every worker.
                let budgets = |m: &crate::request_flow::Metrics| -> crate::request_flow::BudgetTable {
                    #[cfg(feature = "bench-profile")]
                    if crate::bench_profile::skipped(crate::bench_profile::Part::BudgetStore) {
                        return Box::new(crate::token_budget::ProcessBudgets::fresh());
                    }
                    Box::new(SharedBudgets { data: ProxyWasmSharedData, error: m.budget_errors })
                };
                self.accepted = Some(Rc::new(Config::new(filter, &mut |n| counter(n), &budgets)));
                true
            }
            Err(e) => {
                if self.rejections.is_none() {
                    self.rejections = counter("infermesh.config_rejections_total");
                }
                count(self.rejections);
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
        Some(Box::new(Request { accepted: self.accepted.clone(), stream: Stream::default(), host: WasmHost::default() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
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

/// One stream's side of the proxy-wasm host. Headers and body are copied into the VM: the
/// request headers once, at the header hook (a snapshot the flow decides on; the removals are
/// applied to it, the decision's writes come last and are not), the body when it is decided on.
#[derive(Default)]
struct WasmHost {
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    body: Vec<u8>,
    /// What the body hook was told is buffered (the trailers hook: up to the body limit, which
    /// the body hooks before it checked).
    body_size: usize,
}

impl Host for WasmHost {
    fn request_headers(&self) -> Vec<(&[u8], &[u8])> {
        self.headers.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect()
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value);
    }
    fn remove_request_header(&mut self, name: &[u8]) {
        // SAFETY: the host only reads `name` for the call.
        let _ = unsafe { proxy_remove_header_map_value(REQUEST_HEADERS, name.as_ptr(), name.len()) };
        self.headers.retain(|(k, _)| k != name);
    }
    fn add_request_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::add_map_value(MapType::HttpRequestHeaders, name, value);
    }
    /// proxy-wasm's host clears the route cache on every header write.
    fn clear_route_cache(&mut self) {}
    fn request_body(&mut self) -> Vec<&[u8]> {
        self.body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, self.body_size).ok().flatten().unwrap_or_default();
        vec![self.body.as_slice()]
    }
    fn request_body_size(&self) -> usize {
        self.body_size
    }
    fn source_address(&self) -> Option<String> {
        property(vec!["source", "address"])
    }
    fn peer_principals(&self) -> Vec<String> {
        [["connection", "uri_san_peer_certificate"], ["connection", "dns_san_peer_certificate"]]
            .iter()
            .filter_map(|path| property(path.to_vec()))
            .collect()
    }
    fn send_response(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let _ = hostcalls::send_http_response(status, headers.to_vec(), Some(body));
    }
    fn response_header(&self, name: &str) -> Option<String> {
        let value = hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name).ok().flatten()?;
        Some(String::from_utf8_lossy(&value).into_owned())
    }
    fn remove_response_header(&mut self, name: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, None);
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value));
    }
    fn count(&mut self, id: CounterId) {
        count(id)
    }
    fn now_ms(&self) -> u64 {
        now_ms()
    }
}

fn property(path: Vec<&str>) -> Option<String> {
    hostcalls::get_property(path).ok().flatten().and_then(|b| String::from_utf8(b).ok())
}

struct Request {
    accepted: Option<Rc<Config>>,
    stream: Stream,
    host: WasmHost,
}

/// The host the flow runs on: the Wasm host, or in the profiling build that host with one part
/// of the body path left out (bench_profile.rs).
#[cfg(not(feature = "bench-profile"))]
macro_rules! host {
    ($h:expr) => {
        $h
    };
}
#[cfg(feature = "bench-profile")]
macro_rules! host {
    ($h:expr) => {
        &mut crate::bench_profile::Profiled($h)
    };
}

fn action(next: Next) -> Action {
    match next {
        Next::Continue => Action::Continue,
        Next::Wait | Next::Answered => Action::Pause,
    }
}

impl Context for Request {}

/// The stream's end: proxy-wasm deletes the context (`proxy_on_delete`, which Envoy calls for
/// every stream, a reset one or a vanished client's included; `on_done` and `on_log` are not
/// exported, scripts/strip-wasm-exports.py), and the SDK drops it: the budget's stream slot goes back.
impl Drop for Request {
    fn drop(&mut self) {
        #[cfg(feature = "bench-profile")]
        if crate::bench_profile::skipped(crate::bench_profile::Part::BudgetRelease) {
            return;
        }
        if let Some(cfg) = &self.accepted {
            self.stream.on_stream_end(&**cfg);
        }
    }
}

/// The request callbacks and the response headers (the pool level); the build drops the exports
/// of the other response-side ones (and `on_log`, `on_done`) so Envoy skips those calls; one used
/// here must come off the list in scripts/strip-wasm-exports.py.
impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if cfg!(feature = "bench-noop") {
            return Action::Continue;
        }
        self.host.headers = request_headers();
        let cfg = match &self.accepted {
            Some(c) => Rc::clone(c),
            None => {
                // No valid config ever arrived: still never let a client steer routing.
                strip_internal_headers(&mut self.host);
                return Action::Continue;
            }
        };
        #[cfg(feature = "bench-profile")]
        let end_of_stream = end_of_stream || crate::bench_profile::skipped(crate::bench_profile::Part::Pause);
        action(self.stream.on_request_headers(&*cfg, host!(&mut self.host), end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let cfg = match &self.accepted {
            Some(c) => Rc::clone(c),
            None => return Action::Continue,
        };
        self.host.body_size = body_size;
        action(self.stream.on_request_body(&*cfg, host!(&mut self.host), end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let cfg = match &self.accepted {
            Some(c) => Rc::clone(c),
            None => return Action::Continue,
        };
        self.host.body_size = cfg.filter.max_body_bytes;
        action(self.stream.on_request_trailers(&*cfg, host!(&mut self.host)))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if cfg!(feature = "bench-noop") {
            return Action::Continue;
        }
        // Without a config the internal headers are still never passed on to the client.
        match &self.accepted {
            Some(cfg) => self.stream.on_response_headers(&**cfg, &mut self.host),
            None => {
                for h in [crate::pool_state::HEADER_POOL_LEVEL, crate::prefix_table::HEADER_PREFIX_HOST, crate::prefix_table::HEADER_LOAD] {
                    self.host.remove_response_header(h);
                }
            }
        }
        Action::Continue
    }
}
