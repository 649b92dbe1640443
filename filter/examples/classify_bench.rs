//! Native cost of the pure decision logic (no Envoy, no Wasm): classification on headers and
//! JSON body scanning for 2, 32 and 200 KB chat bodies, the hand-written scanner beside the
//! serde_json one it replaced (tests/common/serde_scanner.rs), and the walk with the prefix key. Run with
//! `cargo run --release --example classify_bench`. It explains how much of the filter's cost in
//! Envoy is its own logic and how much is proxy-wasm host calls (filter/bench/run_bench.py).
//! Then the content classifier (content_classifier.rs): a 16-label model of dim 16384, words 1-2,
//! with and without character 3-4-grams, on 2 and 32 KB of prompt text, read up to 4 KB (the
//! usual `max_text_bytes`) and up to 32 KB; `content` alone runs only that part.

#[path = "common/timing.rs"]
mod timing;

use infermesh_filter::body::{parse_body, parse_body_keyed};
use infermesh_filter::prefix_key::PrefixSpec;
use infermesh_filter::classify::{classify, Body, Content, RequestView};
use infermesh_filter::config::{parse_content_model, FilterConfig};
use infermesh_filter::content_classifier::ContentModel;
use std::hint::black_box;
use std::time::Instant;

#[path = "../tests/common/serde_scanner.rs"]
mod serde_scanner;
#[path = "../tests/common/base64.rs"]
mod base64;

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

fn time<F: FnMut()>(label: &str, f: F) -> f64 {
    let us = timing::per_call(300, f);
    println!("{label:60} {us:10.2} us/op");
    us
}

/// Prompt text of `size` bytes: English and code words (5 letters on average), punctuation.
fn prompt_text(size: usize) -> String {
    let words = ["the", "function", "returns", "a", "list", "of", "values", "when", "called", "with", "an", "empty", "input", "please",
                 "explain", "why", "my", "rust", "borrow", "checker", "error", "appears", "def", "main():", "return", "x[i]", "+", "1;",
                 "customer", "order", "refund", "shipping", "delayed", "two", "weeks", "thanks!", "summarize", "this", "document", "in",
                 "three", "bullet", "points,", "É", "naïve", "café", "→", "import", "numpy", "as", "np"];
    let (mut out, mut x) = (String::new(), 0x2545_f491_4f6c_dd1du64);
    while out.len() < size {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(words[(x % words.len() as u64) as usize]);
        out.push(if x % 13 == 0 { '\n' } else { ' ' });
    }
    out.truncate(out.char_indices().map(|(i, _)| i).take_while(|&i| i <= size).last().unwrap_or(0));
    out
}

/// A content model in the model format: `labels` labels, `dim`, pseudo-random int8 weights.
fn content_model(labels: usize, dim: usize, chars: [u8; 2], max_text: usize) -> String {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let raw: Vec<u8> = (0..dim * labels)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let b64 = base64::base64(&raw);
    let names: Vec<String> = (0..labels).map(|i| format!("label{i}")).collect();
    serde_json::json!({"version": 1, "labels": names, "dim": dim, "word_ngrams": 2, "char_ngrams": chars, "max_text_bytes": max_text,
                       "scale": 0.01, "bias": vec![0.0; labels], "weights": b64})
    .to_string()
}

/// A content-rule case: the model (16 labels, dim 16384, words 1-2, `chars`, read up to
/// `max_text` bytes) and a chat body with `kb` KB of prompt text in its user turn.
fn content_case(chars: [u8; 2], max_text: usize, kb: usize) -> (ContentModel, Vec<u8>) {
    let model = parse_content_model(content_model(16, 16384, chars, max_text).as_bytes()).unwrap();
    let text = prompt_text(kb * 1024);
    let body = serde_json::to_vec(&serde_json::json!({"model": "m", "stream": true,
        "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]}))
    .unwrap();
    assert_eq!(model.classify_body(&[&body]), model.classify_text(text.as_bytes()));
    (model, body)
}

const CONTENT_CASES: [([u8; 2], &str); 3] = [([3, 4], "words 1-2 + chars 3-4"), ([3, 3], "words 1-2 + chars 3"), ([0, 0], "words 1-2, no chars")];

/// The content classifier's added cost: the text walk and the features of a chat body (what a
/// request pays once a content rule is reached).
fn content_bench() {
    for (chars, what) in CONTENT_CASES {
        for max_text in [4096usize, 32768] {
            for kb in [2usize, 32] {
                let (model, body) = content_case(chars, max_text, kb);
                let features = model.classify_body(&[&body]).features;
                // The best of 7 rounds: on a shared machine the other rounds measure the neighbours.
                let best = (0..7)
                    .map(|_| timing::per_call(50, || {
                        black_box(model.classify_body(&[black_box(&body)]));
                    }))
                    .fold(f64::INFINITY, f64::min);
                println!("{:60} {best:10.2} us/op", format!("content {kb} KB, read {} KB, {what} ({features} features)", max_text / 1024));
            }
        }
    }
}

/// `content-count LO HI MAX_TEXT KB ITERS`: one case, ITERS calls of `classify_body`, the loop
/// alone timed: callgrind's instructions for ITERS calls and the time of the same calls natively
/// (filter/bench/content_instructions.sh divides one by the other).
fn content_count(args: &[String]) {
    let n = |i: usize| args.get(i).and_then(|a| a.parse::<usize>().ok()).expect("content-count LO HI MAX_TEXT KB ITERS");
    let (model, body) = content_case([n(0) as u8, n(1) as u8], n(2), n(3));
    let t = Instant::now();
    for _ in 0..n(4) {
        black_box(model.classify_body(&[black_box(&body)]));
    }
    let el = t.elapsed().as_secs_f64();
    println!("{} calls in {el:.4} s: {:.3} us/call", n(4), el * 1e6 / n(4).max(1) as f64);
}

/// `clock`: the core's clock in GHz from a chain of dependent register adds (one cycle each;
/// /proc/cpuinfo's "cpu MHz" in a VM is the nominal 2.6 GHz, not what the core runs at).
#[cfg(target_arch = "x86_64")]
fn clock() {
    let best = (0..5)
        .map(|_| {
            let (mut x, n) = (0u64, 200_000_000u64);
            let t = Instant::now();
            for i in 0..n / 8 {
                // Register operands: an add of an immediate can be folded at rename on newer cores.
                unsafe {
                    std::arch::asm!("add {x}, {i}", "add {x}, {i}", "add {x}, {i}", "add {x}, {i}",
                                    "add {x}, {i}", "add {x}, {i}", "add {x}, {i}", "add {x}, {i}",
                                    x = inout(reg) x, i = in(reg) i, options(nomem, nostack));
                }
            }
            black_box(x);
            n as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max);
    println!("clock {best:.2} GHz (best of 5)");
}

#[cfg(not(target_arch = "x86_64"))]
fn clock() {
    println!("clock: x86_64 only");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("content") => return content_bench(),
        Some("content-count") => return content_count(&args[1..]),
        Some("clock") => return clock(),
        _ => {}
    }
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
        println!("{:60} {:10.2}x faster", "", old / new);
        // The prefix key (docs/prefix-routing.md) in the same pass: its cost is the difference.
        let spec = PrefixSpec { max_keys: 4, chunk_bytes: 1024 };
        let keyed = time(&format!("parse_body_keyed {kb} KB"), || {
            black_box(parse_body_keyed(black_box(&b), spec).ok());
        });
        println!("{:60} {:10.2} us/op for the prefix key", "", keyed - new);
        let facts = parse_body(&b).unwrap();
        time(&format!("classify with {kb} KB body facts"), || {
            black_box(classify(&cfg, &req, Body::Parsed(black_box(&facts), Content::NotYet)));
        });
    }
    content_bench();
}
