//! The profiling build's host (feature `bench-profile`, never shipped): the Wasm host with one
//! part of the body path left out, named by the VM configuration, so one module measures what
//! each part costs (filter/bench/instructions.py, docs/filter-benchmark.md). The request flow
//! itself is the shipped one.

use crate::request_flow::{CounterId, Host};
use std::sync::atomic::{AtomicU8, Ordering};

/// A part of the body path the profiling build can leave out.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Pausing for the body at all: every request's headers are its end (decided as if the
    /// body were missing).
    Pause = 1,
    /// Copying the buffered body into the VM (the flow sees no body).
    Copy,
    /// Scanning the copied body (the flow sees no body).
    Scan,
    /// Writing the decision headers.
    Write,
    /// Writing a budgeted response's `x-ratelimit-*` headers.
    BudgetHeaders,
    /// Giving a budgeted stream's slot back at its end (one shared-data get and set).
    BudgetRelease,
    /// The token budget table in shared data: an in-VM table stands in (no host calls).
    BudgetStore,
}

static SKIPPED: AtomicU8 = AtomicU8::new(0);

/// The VM configuration: `no-pause`, `no-copy`, `no-scan`, `no-write`, `no-budget-headers`,
/// `no-budget-release` or `no-budget-store` (anything else: none).
pub fn configure(vm_configuration: Option<&[u8]>) {
    let part = match vm_configuration {
        Some(b"no-pause") => Part::Pause as u8,
        Some(b"no-copy") => Part::Copy as u8,
        Some(b"no-scan") => Part::Scan as u8,
        Some(b"no-write") => Part::Write as u8,
        Some(b"no-budget-headers") => Part::BudgetHeaders as u8,
        Some(b"no-budget-release") => Part::BudgetRelease as u8,
        Some(b"no-budget-store") => Part::BudgetStore as u8,
        _ => 0,
    };
    SKIPPED.store(part, Ordering::Relaxed);
}

pub fn skipped(part: Part) -> bool {
    SKIPPED.load(Ordering::Relaxed) == part as u8
}

/// `H` with the configured part left out.
pub struct Profiled<'a, H>(pub &'a mut H);

impl<H: Host> Host for Profiled<'_, H> {
    fn request_headers(&self) -> Vec<(&[u8], &[u8])> {
        self.0.request_headers()
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        if !skipped(Part::Write) {
            self.0.set_request_header(name, value)
        }
    }
    fn remove_request_header(&mut self, name: &[u8]) {
        self.0.remove_request_header(name)
    }
    fn add_request_header(&mut self, name: &str, value: &str) {
        if !skipped(Part::Write) {
            self.0.add_request_header(name, value)
        }
    }
    fn clear_route_cache(&mut self) {
        self.0.clear_route_cache()
    }
    fn request_body(&mut self) -> Vec<&[u8]> {
        if skipped(Part::Copy) {
            return Vec::new();
        }
        let parts = self.0.request_body();
        if skipped(Part::Scan) {
            return Vec::new();
        }
        parts
    }
    fn request_body_size(&self) -> usize {
        self.0.request_body_size()
    }
    fn source_address(&self) -> Option<String> {
        self.0.source_address()
    }
    fn peer_principals(&self) -> Vec<String> {
        self.0.peer_principals()
    }
    fn send_response(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.0.send_response(status, headers, body)
    }
    fn response_header(&self, name: &str) -> Option<String> {
        self.0.response_header(name)
    }
    fn remove_response_header(&mut self, name: &str) {
        self.0.remove_response_header(name)
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        if !skipped(Part::BudgetHeaders) {
            self.0.set_response_header(name, value)
        }
    }
    fn count(&mut self, id: CounterId) {
        self.0.count(id)
    }
    fn now_ms(&self) -> u64 {
        self.0.now_ms()
    }
}
