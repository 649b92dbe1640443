//! infermesh proxy-wasm filter.
//!
//! The decision logic lives in [`config`], [`classify`] and [`body`] (whose JSON `json_scan`
//! reads, the bytes of its strings `string_run`) and makes no host calls, so it is tested natively
//! with `cargo test`; so is the request flow, [`request_flow`], written once against a `Host`
//! trait, and both runtimes' pool state tables ([`shared_pool_table`], [`process_pool_table`]) and
//! token budget tables ([`token_budget`]).
//! The runtimes' bindings: `glue.rs` (proxy-wasm, compiled for wasm32 only) and
//! `dynamic_module.rs` (feature `dynamic-module`: the same filter as a native Envoy dynamic module).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod base64;
pub mod body;
pub mod classify;
pub mod config;
pub mod content_classifier;
pub mod header_map;
pub mod pool_state;
pub mod prefix_key;
pub mod prefix_table;
pub mod process_pool_table;
pub mod request_flow;
pub mod shared_pool_table;
pub mod stats;
pub mod token_budget;
mod json_scan;
mod string_run;

#[cfg(target_arch = "wasm32")]
mod glue;
#[cfg(all(feature = "bench-profile", target_arch = "wasm32"))]
mod bench_profile;

#[cfg(all(feature = "dynamic-module", not(target_arch = "wasm32")))]
mod dynamic_module;
#[cfg(all(feature = "dynamic-module", not(target_arch = "wasm32")))]
mod envoy_abi;
