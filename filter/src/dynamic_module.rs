//! Envoy dynamic-module glue (feature `dynamic-module`): the filter as a native shared object
//! that Envoy's `envoy.filters.http.dynamic_modules` filter loads — no VM, so no VM entries and
//! no copies of headers or body into one (docs/filter-native-module.md).
//!
//! The request flow is `request_flow`'s, as in the Wasm filter; what is this runtime's own:
//! - the pool state table is one process-wide structure (a mutex per pool), not proxy-wasm
//!   shared data with CAS: every response's level header is read, there is no sampling;
//! - request headers are read in place (Envoy's buffers) and written once, with one route-cache
//!   clear after the writes (proxy-wasm's host clears it on every header write);
//! - the idle-pool probe runs on Envoy's main thread: a ticker thread posts an event through the
//!   config scheduler, and the event hook sends the config-level HTTP callouts (the ABI has no
//!   timer for HTTP filters).
//!
//! `ffi.rs` holds the exported hooks and the `Host` over the ABI's callbacks; the pool state
//! table is `process_pool_table.rs`.

#[cfg(not(test))]
mod ffi;
