//! The exported hooks Envoy calls, and `Envoy`, the `Host` over the ABI's callbacks.
//!
//! Nothing here may panic: with `panic = "abort"` a panic takes the whole Envoy process down
//! (worse than a Wasm VM), so every pointer Envoy hands over is checked and every failed host
//! call falls back to routing as if the filter were not there.

use crate::process_pool_table::{pools_to_probe, PoolTable};
use crate::config::FilterConfig;
use crate::envoy_abi::*;
use crate::pool_state::HEADER_POOL_LEVEL;
use crate::request_flow::{now_ms, probe_answer, Accepted, BudgetTable, CounterId, Host, Metrics, Next, StateError, Stream, STATE_PATH};
use crate::token_budget::ProcessBudgets;
use std::collections::HashMap;
use std::os::raw::c_char;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// One accepted configuration, shared by every worker's streams.
type ModuleConfig = Accepted<PoolTable>;

/// A non-null pointer for the do-nothing build's hooks, which must return one.
static NOOP: u8 = 0;
const NOOP_PTR: *const std::os::raw::c_void = &NOOP as *const u8 as *const std::os::raw::c_void;

fn log(level: u32, message: &str) {
    unsafe { envoy_dynamic_module_callback_log(level, ModuleBuffer::of(message.as_bytes())) }
}

/// Envoy's side of one stream.
struct Envoy {
    ptr: FilterEnvoyPtr,
}

/// # Safety
/// Envoy's bytes, valid for the current hook until the next write; the 'static is bounded by
/// the Host trait's borrow of `&self` (or, in a callout hook, by the hook).
unsafe fn bytes(ptr: *const c_char, len: usize) -> &'static [u8] {
    EnvoyBuffer { ptr, length: len }.as_bytes()
}

fn utf8(ptr: *const c_char, len: usize) -> Option<&'static str> {
    std::str::from_utf8(unsafe { bytes(ptr, len) }).ok()
}

impl Envoy {
    fn chunks(&self, body_type: BodyType, into: &mut Vec<&[u8]>) {
        let n = unsafe { envoy_dynamic_module_callback_http_get_body_chunks_size(self.ptr, body_type) };
        if n == 0 {
            return;
        }
        let mut bufs = vec![EnvoyBuffer::NULL; n];
        if unsafe { envoy_dynamic_module_callback_http_get_body_chunks(self.ptr, body_type, bufs.as_mut_ptr()) } {
            into.extend(bufs.iter().map(|b| unsafe { b.as_bytes() }).filter(|b| !b.is_empty()));
        }
    }

    /// Whether this body hook's chunk is Envoy's buffer itself (a filter before us buffered it),
    /// not a new chunk to add to it.
    fn received_is_buffered(&self) -> bool {
        unsafe { envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr) }
    }

    fn attribute(&self, id: u32) -> Option<String> {
        let mut b = EnvoyBuffer::NULL;
        if unsafe { envoy_dynamic_module_callback_http_filter_get_attribute_string(self.ptr, id, &mut b) } && !b.ptr.is_null() {
            return Some(String::from_utf8_lossy(unsafe { b.as_bytes() }).into_owned());
        }
        None
    }
}

impl Host for Envoy {
    fn request_headers(&self) -> Vec<(&[u8], &[u8])> {
        const NONE: EnvoyHeader = EnvoyHeader { key_ptr: std::ptr::null(), key_length: 0, value_ptr: std::ptr::null(), value_length: 0 };
        let n = unsafe { envoy_dynamic_module_callback_http_get_headers_size(self.ptr, REQUEST_HEADER) };
        // On the stack for any ordinary request; the heap only for one with many headers.
        let mut stack = [NONE; 32];
        let mut heap = Vec::new();
        let raw: &mut [EnvoyHeader] = if n <= stack.len() {
            &mut stack[..n]
        } else {
            heap.resize(n, NONE);
            &mut heap
        };
        if n == 0 || !unsafe { envoy_dynamic_module_callback_http_get_headers(self.ptr, REQUEST_HEADER, raw.as_mut_ptr()) } {
            return Vec::new();
        }
        raw.iter()
            .map(|h| unsafe { (bytes(h.key_ptr, h.key_length), bytes(h.value_ptr, h.value_length)) })
            .collect()
    }

    fn add_request_header(&mut self, name: &str, value: &str) {
        unsafe {
            envoy_dynamic_module_callback_http_add_header(self.ptr, REQUEST_HEADER, ModuleBuffer::of(name.as_bytes()), ModuleBuffer::of(value.as_bytes()))
        };
    }

    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        let v = value.map_or(ModuleBuffer::NULL, |v| ModuleBuffer::of(v.as_bytes()));
        unsafe { envoy_dynamic_module_callback_http_set_header(self.ptr, REQUEST_HEADER, ModuleBuffer::of(name.as_bytes()), v) };
    }

    fn remove_request_header(&mut self, name: &[u8]) {
        unsafe { envoy_dynamic_module_callback_http_set_header(self.ptr, REQUEST_HEADER, ModuleBuffer::of(name), ModuleBuffer::NULL) };
    }

    fn clear_route_cache(&mut self) {
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.ptr) }
    }

    fn request_body(&mut self) -> Vec<&[u8]> {
        let mut parts: Vec<&[u8]> = Vec::new();
        self.chunks(BUFFERED_REQUEST_BODY, &mut parts);
        if !self.received_is_buffered() {
            self.chunks(RECEIVED_REQUEST_BODY, &mut parts);
        }
        parts
    }

    fn request_body_size(&self) -> usize {
        let buffered = unsafe { envoy_dynamic_module_callback_http_get_body_size(self.ptr, BUFFERED_REQUEST_BODY) };
        if self.received_is_buffered() {
            return buffered;
        }
        buffered + unsafe { envoy_dynamic_module_callback_http_get_body_size(self.ptr, RECEIVED_REQUEST_BODY) }
    }

    fn source_address(&self) -> Option<String> {
        self.attribute(ATTRIBUTE_SOURCE_ADDRESS)
    }

    fn peer_principals(&self) -> Vec<String> {
        [ATTRIBUTE_CONNECTION_URI_SAN_PEER, ATTRIBUTE_CONNECTION_DNS_SAN_PEER].iter().filter_map(|a| self.attribute(*a)).collect()
    }

    fn send_response(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let mut hs: Vec<ModuleHeader> = headers.iter().map(|(k, v)| ModuleHeader::of(k.as_bytes(), v.as_bytes())).collect();
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.ptr,
                status,
                hs.as_mut_ptr(),
                hs.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::of(b"infermesh_shed"),
            )
        }
    }

    fn response_header(&self, name: &str) -> Option<String> {
        let mut b = EnvoyBuffer::NULL;
        let ok = unsafe {
            envoy_dynamic_module_callback_http_get_header(self.ptr, RESPONSE_HEADER, ModuleBuffer::of(name.as_bytes()), &mut b, 0, std::ptr::null_mut())
        };
        if ok && !b.ptr.is_null() {
            return Some(String::from_utf8_lossy(unsafe { b.as_bytes() }).into_owned());
        }
        None
    }

    fn remove_response_header(&mut self, name: &str) {
        unsafe { envoy_dynamic_module_callback_http_set_header(self.ptr, RESPONSE_HEADER, ModuleBuffer::of(name.as_bytes()), ModuleBuffer::NULL) };
    }

    fn set_response_header(&mut self, name: &str, value: &str) {
        unsafe {
            envoy_dynamic_module_callback_http_set_header(self.ptr, RESPONSE_HEADER, ModuleBuffer::of(name.as_bytes()), ModuleBuffer::of(value.as_bytes()))
        };
    }

    fn count(&mut self, id: CounterId) {
        if let Some(id) = id {
            unsafe { envoy_dynamic_module_callback_http_filter_increment_counter(self.ptr, id, std::ptr::null_mut(), 0, 1) };
        }
    }
}

/// A pointer Envoy owns that the ticker thread hands back to it (the scheduler is made for
/// being committed from any thread).
struct SendPtr(ConfigSchedulerPtr);
unsafe impl Send for SendPtr {}

/// The probe ticker: a thread that posts one event per probe interval to Envoy's main thread.
struct Ticker {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    scheduler: ConfigSchedulerPtr,
}

impl Ticker {
    fn start(config_envoy: FilterConfigEnvoyPtr, every: Duration) -> Option<Ticker> {
        let scheduler = unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_new(config_envoy) };
        if scheduler.is_null() {
            return None;
        }
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let (s, p) = (Arc::clone(&stop), SendPtr(scheduler));
        let thread = std::thread::Builder::new()
            .name("infermesh-probe".into())
            .spawn(move || {
                let p = p;
                let (lock, cv) = &*s;
                let mut stopped = match lock.lock() {
                    Ok(g) => g,
                    Err(_) => return,
                };
                loop {
                    stopped = match cv.wait_timeout(stopped, every) {
                        Ok((g, _)) => g,
                        Err(_) => return,
                    };
                    if *stopped {
                        return;
                    }
                    unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_commit(p.0, 0) };
                }
            })
            .ok();
        match thread {
            Some(t) => Some(Ticker { stop, thread: Some(t), scheduler }),
            None => {
                unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler) };
                None
            }
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        if let Ok(mut s) = self.stop.0.lock() {
            *s = true;
        }
        self.stop.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.scheduler) };
    }
}

/// The module's side of one filter config.
struct Module {
    cfg: ModuleConfig,
    envoy: FilterConfigEnvoyPtr,
    /// Probe callouts in flight: callout id -> the pool probed (main thread only).
    probes: Mutex<HashMap<u64, String>>,
    /// Held for its Drop: stops the probe thread when Envoy destroys the config.
    _ticker: Option<Ticker>,
}

impl Module {
    fn count(&self, id: CounterId) {
        if let Some(id) = id {
            unsafe { envoy_dynamic_module_callback_http_filter_config_increment_counter(self.envoy, id, std::ptr::null_mut(), 0, 1) };
        }
    }

    fn state_error(&self, e: StateError) {
        self.count(self.cfg.metrics.state_errors[e as usize]);
    }

    fn probe(&self) {
        let d = match &self.cfg.filter.degraded {
            Some(d) => d,
            None => return,
        };
        for (pool, cluster) in pools_to_probe(d, &self.cfg.pools, now_ms()) {
            let mut headers = [
                ModuleHeader::of(b":method", b"GET"),
                ModuleHeader::of(b":path", STATE_PATH.as_bytes()),
                ModuleHeader::of(b":authority", pool.as_bytes()),
                ModuleHeader::of(b"accept", b"application/json"),
            ];
            let mut id = 0u64;
            let r = unsafe {
                envoy_dynamic_module_callback_http_filter_config_http_callout(
                    self.envoy,
                    &mut id,
                    ModuleBuffer::of(cluster.as_bytes()),
                    headers.as_mut_ptr(),
                    headers.len(),
                    ModuleBuffer::NULL,
                    d.probe_timeout_ms,
                )
            };
            if r == CALLOUT_INIT_SUCCESS {
                if let Ok(mut p) = self.probes.lock() {
                    p.insert(id, pool.to_string());
                }
            } else {
                self.state_error(StateError::NoCluster);
            }
        }
    }
}

/// The per-stream object Envoy holds for us.
struct Filter {
    cfg: *const Module,
    stream: Stream,
}

/// # Safety
/// `m` is a pointer `on_http_filter_new` returned and Envoy has not destroyed yet.
unsafe fn filter<'a>(m: FilterModulePtr) -> Option<(&'a Module, &'a mut Stream)> {
    let f = (m as *mut Filter).as_mut()?;
    Some((f.cfg.as_ref()?, &mut f.stream))
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    ABI_VERSION.as_ptr() as *const c_char
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: FilterConfigEnvoyPtr,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> FilterConfigModulePtr {
    if cfg!(feature = "bench-noop") {
        return NOOP_PTR;
    }
    let filter = match FilterConfig::parse(unsafe { config.as_bytes() }) {
        Ok(f) => f,
        Err(e) => {
            // A null config makes Envoy refuse this filter config (the last good one keeps serving).
            log(LOG_ERROR, &format!("infermesh: {e}"));
            return std::ptr::null();
        }
    };
    let mut define = |name: &str| {
        let mut id = 0usize;
        let r = unsafe {
            envoy_dynamic_module_callback_http_filter_config_define_counter(config_envoy, ModuleBuffer::of(name.as_bytes()), std::ptr::null_mut(), 0, &mut id)
        };
        if r == METRICS_SUCCESS {
            Some(id)
        } else {
            None
        }
    };
    // Budgets: the process's one table (every worker, every config: a reload keeps the counts).
    let budgets = |_: &Metrics| -> BudgetTable { Box::new(ProcessBudgets::process()) };
    let cfg = ModuleConfig::new(filter, &mut define, &budgets);
    let probing = cfg.filter.degraded.as_ref().filter(|d| d.pools.values().any(|p| p.probe_cluster.is_some()));
    let ticker = match probing {
        Some(d) if !unsafe { envoy_dynamic_module_callback_is_validation_mode() } => {
            let t = Ticker::start(config_envoy, Duration::from_millis(d.probe_interval_ms));
            if t.is_none() {
                log(LOG_WARN, "infermesh: no probe ticker: idle pools are learned from traffic only");
            }
            t
        }
        _ => None,
    };
    let module = Box::new(Module { cfg, envoy: config_envoy, probes: Mutex::new(HashMap::new()), _ticker: ticker });
    Box::into_raw(module) as FilterConfigModulePtr
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: FilterConfigModulePtr) {
    if cfg!(feature = "bench-noop") || config.is_null() {
        return;
    }
    // Dropping it stops and joins the ticker before its scheduler is deleted.
    drop(unsafe { Box::from_raw(config as *mut Module) });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(_c: FilterConfigEnvoyPtr, config: FilterConfigModulePtr, _event: u64) {
    if cfg!(feature = "bench-noop") {
        return;
    }
    if let Some(m) = unsafe { (config as *const Module).as_ref() } {
        m.probe();
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _c: FilterConfigEnvoyPtr,
    config: FilterConfigModulePtr,
    id: u64,
    result: u32,
    headers: *mut EnvoyHeader,
    headers_size: usize,
    _body: *mut EnvoyBuffer,
    _body_size: usize,
) {
    if cfg!(feature = "bench-noop") {
        return;
    }
    let m = match unsafe { (config as *const Module).as_ref() } {
        Some(m) => m,
        None => return,
    };
    let pool = m.probes.lock().ok().and_then(|mut p| p.remove(&id));
    let d = match (&m.cfg.filter.degraded, pool) {
        (Some(d), Some(_)) => d,
        _ => return,
    };
    let hs: &[EnvoyHeader] = if headers.is_null() || result != CALLOUT_SUCCESS { &[] } else { unsafe { std::slice::from_raw_parts(headers, headers_size) } };
    let find = |name: &str| {
        hs.iter().find(|h| utf8(h.key_ptr, h.key_length) == Some(name)).and_then(|h| utf8(h.value_ptr, h.value_length))
    };
    if let Err(e) = probe_answer(d, &m.cfg.pools, find(":status"), find(HEADER_POOL_LEVEL), now_ms()) {
        m.state_error(e);
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(config: FilterConfigModulePtr, _filter_envoy: FilterEnvoyPtr) -> FilterModulePtr {
    if cfg!(feature = "bench-noop") {
        return NOOP_PTR;
    }
    Box::into_raw(Box::new(Filter { cfg: config as *const Module, stream: Stream::default() })) as FilterModulePtr
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(m: FilterModulePtr) {
    if cfg!(feature = "bench-noop") || m.is_null() {
        return;
    }
    let mut f = unsafe { Box::from_raw(m as *mut Filter) };
    // Every stream ends here (completed, reset, its client gone): the budget's stream slot goes back.
    if let Some(module) = unsafe { f.cfg.as_ref() } {
        f.stream.on_stream_end(&module.cfg);
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(f: FilterEnvoyPtr, m: FilterModulePtr, eos: bool) -> u32 {
    if cfg!(feature = "bench-noop") {
        return HEADERS_CONTINUE;
    }
    match unsafe { filter(m) } {
        Some((module, stream)) => match stream.on_request_headers(&module.cfg, &mut Envoy { ptr: f }, eos) {
            Next::Continue => HEADERS_CONTINUE,
            Next::Wait | Next::Answered => HEADERS_STOP_ITERATION,
        },
        None => HEADERS_CONTINUE,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(f: FilterEnvoyPtr, m: FilterModulePtr, eos: bool) -> u32 {
    if cfg!(feature = "bench-noop") {
        return BODY_CONTINUE;
    }
    match unsafe { filter(m) } {
        Some((module, stream)) => match stream.on_request_body(&module.cfg, &mut Envoy { ptr: f }, eos) {
            Next::Continue => BODY_CONTINUE,
            Next::Wait => BODY_STOP_ITERATION_AND_BUFFER,
            Next::Answered => BODY_STOP_ITERATION_NO_BUFFER,
        },
        None => BODY_CONTINUE,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(f: FilterEnvoyPtr, m: FilterModulePtr) -> u32 {
    if cfg!(feature = "bench-noop") {
        return TRAILERS_CONTINUE;
    }
    match unsafe { filter(m) } {
        Some((module, stream)) => match stream.on_request_trailers(&module.cfg, &mut Envoy { ptr: f }) {
            Next::Answered => TRAILERS_STOP_ITERATION,
            _ => TRAILERS_CONTINUE,
        },
        None => TRAILERS_CONTINUE,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(f: FilterEnvoyPtr, m: FilterModulePtr, _eos: bool) -> u32 {
    if cfg!(feature = "bench-noop") {
        return HEADERS_CONTINUE;
    }
    if let Some((module, stream)) = unsafe { filter(m) } {
        stream.on_response_headers(&module.cfg, &mut Envoy { ptr: f });
    }
    HEADERS_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(_f: FilterEnvoyPtr, _m: FilterModulePtr) {}

// Hooks the filter does not use; Envoy requires them all to be exported.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(_f: FilterEnvoyPtr, _m: FilterModulePtr, _eos: bool) -> u32 {
    BODY_CONTINUE
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(_f: FilterEnvoyPtr, _m: FilterModulePtr) -> u32 {
    TRAILERS_CONTINUE
}
/// Per-route configs are not used (routes disable the filter with Envoy's own FilterConfig).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(_name: EnvoyBuffer, _config: EnvoyBuffer) -> FilterConfigModulePtr {
    NOOP_PTR
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(_config: FilterConfigModulePtr) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _f: FilterEnvoyPtr,
    _m: FilterModulePtr,
    _id: u64,
    _result: u32,
    _headers: *mut EnvoyHeader,
    _headers_size: usize,
    _body: *mut EnvoyBuffer,
    _body_size: usize,
) {
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _f: FilterEnvoyPtr,
    _m: FilterModulePtr,
    _id: u64,
    _headers: *mut EnvoyHeader,
    _size: usize,
    _end: bool,
) {
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _f: FilterEnvoyPtr,
    _m: FilterModulePtr,
    _id: u64,
    _data: *const EnvoyBuffer,
    _count: usize,
    _end: bool,
) {
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _f: FilterEnvoyPtr,
    _m: FilterModulePtr,
    _id: u64,
    _trailers: *mut EnvoyHeader,
    _size: usize,
) {
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(_f: FilterEnvoyPtr, _m: FilterModulePtr, _id: u64) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(_f: FilterEnvoyPtr, _m: FilterModulePtr, _id: u64, _reason: u32) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(_f: FilterEnvoyPtr, _m: FilterModulePtr, _event: u64) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_headers(
    _c: FilterConfigEnvoyPtr,
    _m: FilterConfigModulePtr,
    _id: u64,
    _headers: *mut EnvoyHeader,
    _size: usize,
    _end: bool,
) {
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_data(
    _c: FilterConfigEnvoyPtr,
    _m: FilterConfigModulePtr,
    _id: u64,
    _data: *const EnvoyBuffer,
    _count: usize,
    _end: bool,
) {
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_trailers(
    _c: FilterConfigEnvoyPtr,
    _m: FilterConfigModulePtr,
    _id: u64,
    _trailers: *mut EnvoyHeader,
    _size: usize,
) {
}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_complete(_c: FilterConfigEnvoyPtr, _m: FilterConfigModulePtr, _id: u64) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_stream_reset(_c: FilterConfigEnvoyPtr, _m: FilterConfigModulePtr, _id: u64, _reason: u32) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(_f: FilterEnvoyPtr, _m: FilterModulePtr) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(_f: FilterEnvoyPtr, _m: FilterModulePtr) {}
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(_f: FilterEnvoyPtr, _m: FilterModulePtr, _code: u32, _details: EnvoyBuffer, _reset: bool) -> u32 {
    LOCAL_REPLY_CONTINUE
}
