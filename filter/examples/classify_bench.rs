//! Native cost of the pure decision logic (no Envoy, no Wasm): classification on headers and
//! JSON body scanning for 2, 32 and 200 KB chat bodies, the hand-written scanner beside the
//! serde_json one it replaced (tests/common/serde_scanner.rs), and the walk with the prefix key. Run with
//! `cargo run --release --example classify_bench`. It explains how much of the filter's cost in
//! Envoy is its own logic and how much is proxy-wasm host calls (filter/bench/run_bench.py).

use infermesh_filter::body::{parse_body, parse_body_keyed};
use infermesh_filter::prefix_key::PrefixSpec;
use infermesh_filter::classify::{classify, Body, RequestView};
use infermesh_filter::config::FilterConfig;
use std::hint::black_box;
use std::time::Instant;

#[path = "../tests/common/serde_scanner.rs"]
mod serde_scanner;

struct Req(Vec<(String, String)>);

impl RequestView for Req {
    fn header(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

fn chat_body(size: usize) -> Vec<u8> {
    let filler = "The quick brown fox jumps over the lazy dog. ";
    let per = (size / 8).max(1);
    let content: String = filler.repeat(per / filler.len() + 1)[..per].to_string();
    let mut msgs = Vec::new();
    while serde_json::to_vec(&msgs).map(|v| v.len()).unwrap_or(0) < size.saturating_sub(120) {
        msgs.push(serde_json::json!({"role": "user", "content": content}));
    }
    serde_json::to_vec(&serde_json::json!({"model": "llama-3-70b", "stream": true, "max_tokens": 256, "messages": msgs})).unwrap()
}

fn time<F: FnMut()>(label: &str, mut f: F) -> f64 {
    let mut iters = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        let el = t.elapsed();
        if el.as_millis() >= 300 {
            let us = el.as_secs_f64() * 1e6 / iters as f64;
            println!("{label:32} {us:10.2} us/op");
            return us;
        }
        iters *= 2;
    }
}

fn main() {
    let cfg = FilterConfig::parse(
        br#"{"version":1,"default_class":"batch","classes":{"interactive":{"pool":"interactive"},"batch":{"pool":"batch"}},
            "rules":[{"name":"chat-bulk","class":"batch","match":{"methods":["POST"],"path":{"prefix":"/v1/chat/completions"},"body":{"stream":false,"max_tokens":{"min":1024}}}},
                     {"name":"hdr","class":"interactive","match":{"headers":[{"name":"x-priority","exact":"high"}]}},
                     {"name":"chat","class":"interactive","match":{"methods":["POST"],"path":{"prefix":"/v1/chat/completions"}}}]}"#,
    )
    .unwrap();
    let req = Req(vec![
        (":method".into(), "POST".into()),
        (":path".into(), "/v1/chat/completions".into()),
        (":authority".into(), "127.0.0.1:8080".into()),
        ("content-type".into(), "application/json".into()),
        ("user-agent".into(), "OpenAI/Python 1.0".into()),
        ("content-length".into(), "2048".into()),
    ]);
    time("classify (headers only)", || {
        black_box(classify(&cfg, black_box(&req), Body::Unavailable(infermesh_filter::classify::Fallback::NotJson)));
    });
    for kb in [2usize, 32, 200] {
        let b = chat_body(kb * 1024);
        assert_eq!(parse_body(&b), serde_scanner::parse_body(&b));
        let new = time(&format!("parse_body {kb} KB"), || {
            black_box(parse_body(black_box(&b)).ok());
        });
        let old = time(&format!("parse_body {kb} KB (serde_json)"), || {
            black_box(serde_scanner::parse_body(black_box(&b)).ok());
        });
        println!("{:32} {:10.2}x faster", "", old / new);
        // The prefix key (docs/prefix-routing.md) in the same pass: its cost is the difference.
        let spec = PrefixSpec { max_keys: 4, chunk_bytes: 1024 };
        let keyed = time(&format!("parse_body_keyed {kb} KB"), || {
            black_box(parse_body_keyed(black_box(&b), spec).ok());
        });
        println!("{:32} {:10.2} us/op for the prefix key", "", keyed - new);
        let facts = parse_body(&b).unwrap();
        time(&format!("classify with {kb} KB body facts"), || {
            black_box(classify(&cfg, &req, Body::Parsed(black_box(&facts))));
        });
    }
}
