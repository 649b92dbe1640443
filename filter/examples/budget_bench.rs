//! Native cost of the token budget check (token_budget.rs, docs/token-budgets.md): the request
//! flow (request_flow.rs, the code both runtimes run) on a 2 KB chat, headers + body + response
//! headers + the stream's end, with and without a budget for its class, on a bench host (no
//! Envoy: the host calls cost nothing here). Two configs: the class decided by a body rule (the
//! body is scanned either way: the difference is the check itself), and by a header rule (a
//! budget makes the filter read the body: the difference includes that scan). Then the table
//! operations alone: the process table's (the native module's) and the CAS loop over a map
//! standing in for proxy-wasm shared data (whose host calls the Wasm build adds).
//!
//!     cargo run --release --example budget_bench

#[path = "common/timing.rs"]
mod timing;

use infermesh_filter::config::FilterConfig;
use infermesh_filter::prefix_table::ProcessSharedData;
use infermesh_filter::process_pool_table::PoolTable;
use infermesh_filter::request_flow::{Accepted, BudgetTable, CounterId, Host, Metrics, Next, Stream};
use infermesh_filter::token_budget::{record_key, release_stream, reserve, Budget, ProcessBudgets, SharedBudgets};
use std::hint::black_box;

/// A host with a request in memory; writes are dropped.
struct BenchHost {
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    body: Vec<u8>,
    now: u64,
}

impl Host for BenchHost {
    fn request_headers(&self) -> Vec<(&[u8], &[u8])> {
        self.headers.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect()
    }
    fn set_request_header(&mut self, _: &str, _: Option<&str>) {}
    fn remove_request_header(&mut self, _: &[u8]) {}
    fn add_request_header(&mut self, _: &str, _: &str) {}
    fn clear_route_cache(&mut self) {}
    fn request_body(&mut self) -> Vec<&[u8]> {
        vec![self.body.as_slice()]
    }
    fn request_body_size(&self) -> usize {
        self.body.len()
    }
    fn source_address(&self) -> Option<String> {
        Some("10.8.0.1:4000".into())
    }
    fn peer_principals(&self) -> Vec<String> {
        Vec::new()
    }
    fn send_response(&mut self, status: u32, _: &[(&str, &str)], body: &[u8]) {
        // The bench measures served requests: a refusal (over budget, shed) is a bug in it.
        panic!("the bench request was refused: {status} {}", String::from_utf8_lossy(body))
    }
    fn response_header(&self, name: &str) -> Option<String> {
        (name == ":status").then(|| "200".to_string())
    }
    fn remove_response_header(&mut self, _: &str) {}
    fn set_response_header(&mut self, _: &str, _: &str) {}
    fn count(&mut self, _: CounterId) {}
    fn now_ms(&self) -> u64 {
        self.now
    }
}

fn chat_body(size: usize) -> Vec<u8> {
    let filler = "The quick brown fox jumps over the lazy dog. ";
    let mut msgs = Vec::new();
    while serde_json::to_vec(&msgs).map(|v| v.len()).unwrap_or(0) < size.saturating_sub(120) {
        msgs.push(serde_json::json!({"role": "user", "content": filler.repeat(5)}));
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "stream": true, "max_tokens": 256, "messages": msgs})).unwrap_or_default()
}

fn config(body_rule: bool, budgets: bool) -> String {
    let rule = if body_rule {
        r#"{"name": "chat", "class": "interactive", "match": {"path": {"prefix": "/v1/chat/completions"}, "body": {"stream": true}}}"#
    } else {
        r#"{"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}}"#
    };
    let b = if budgets {
        r#", "budgets": {"tenant": {"header": "x-tenant-id"}, "classes": {"interactive": {
            "default": {"tokens": {"per_minute": 1000000000000}, "concurrent_streams": 1000},
            "tenants": {"team-a": {"tokens": {"per_minute": 1000000000000, "per_day": 1000000000000}, "concurrent_streams": 1000}}}}}"#
    } else {
        ""
    };
    format!(
        r#"{{"version": 1, "default_class": "batch", "classes": {{"interactive": {{"pool": "interactive"}}, "batch": {{"pool": "batch"}}}},
            "rules": [{rule}], "trusted_sources": {{"cidrs": ["10.8.0.0/16"]}}{b}}}"#
    )
}

fn table(_: &Metrics) -> BudgetTable {
    Box::new(ProcessBudgets::fresh())
}

/// Microseconds per call of `f`, the best of 5 rounds of at least 200 ms each.
fn per_call<F: FnMut()>(f: F) -> f64 {
    timing::best_of(5, 200, f)
}

fn flow(body_rule: bool, budgets: bool) -> f64 {
    let cfg: Accepted<PoolTable> =
        Accepted::new(FilterConfig::parse(config(body_rule, budgets).as_bytes()).expect("bench config"), &mut |_| None, &table);
    let body = chat_body(2048);
    let mut host = BenchHost {
        headers: vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":path".to_vec(), b"/v1/chat/completions".to_vec()),
            (b"content-type".to_vec(), b"application/json".to_vec()),
            (b"content-length".to_vec(), body.len().to_string().into_bytes()),
            (b"x-tenant-id".to_vec(), b"team-a".to_vec()),
        ],
        body,
        now: 1_800_000_000_000,
    };
    per_call(|| {
        let mut s = Stream::default();
        let mut next = s.on_request_headers(&cfg, &mut host, false);
        if next == Next::Wait {
            next = s.on_request_body(&cfg, &mut host, true);
        }
        assert_eq!(next, Next::Continue);
        s.on_response_headers(&cfg, &mut host);
        s.on_stream_end(&cfg);
        black_box(&s);
    })
}

fn main() {
    println!("request flow on a 2 KB chat (headers, body, response, stream end), best of 5, us per request:");
    for (body_rule, what) in [(true, "class decided by a body rule"), (false, "class decided by a header rule")] {
        let (off, on) = (flow(body_rule, false), flow(body_rule, true));
        println!("  {what:32} no budget {off:7.3}   budget {on:7.3}   the budget's cost {:7.3} ({:.2}x)", on - off, on / off);
    }
    let b = Budget { tokens: [Some(u64::MAX / 2), None, Some(u64::MAX / 2)], input_weight: 1, output_weight: 1, concurrent_streams: Some(1 << 40) };
    let key = record_key("interactive", "team-a");
    let process = ProcessBudgets::fresh();
    let t = per_call(|| {
        let held = reserve(&process, black_box(&key), &b, 900, 1_800_000_000_000).expect("admitted");
        release_stream(&process, &held);
    });
    println!("table: reserve + stream release, process table (native module)        {t:7.3} us");
    let shared = SharedBudgets { data: ProcessSharedData::default(), error: None };
    let t = per_call(|| {
        let held = reserve(&shared, black_box(&key), &b, 900, 1_800_000_000_000).expect("admitted");
        release_stream(&shared, &held);
    });
    println!("table: reserve + stream release, CAS over a map (Wasm; host calls not included) {t:7.3} us");
}
