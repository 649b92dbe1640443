//! The filter's content classifier, natively, on lines of JSON: what `infermesh classes eval` and
//! the contract test (the Python reference against the filter) call. The model is parsed by
//! config.rs's own checks and scored by content_classifier.rs, the code Envoy runs.
//!
//!     cargo build --release --example content_eval
//!     target/release/examples/content_eval MODEL.json < in.jsonl > out.jsonl
//!
//! Each input line is `{"text": "..."}` (that text, cut at the model's `max_text_bytes`) or
//! `{"body": {...}}` (a request body: its text as the rules read it). Each output line, in order:
//! `{"label": "code", "score": 0.83, "features": 123}`, `label` and `score` null when the text
//! has no features; a line that is not one of those gets `{"error": "..."}` and the next goes on.
//! A model that does not parse: its error on stderr, exit status 2.

use infermesh_filter::config::parse_content_model;
use infermesh_filter::content_classifier::{ContentModel, Scored};
use serde_json::{json, Value};
use std::io::{BufRead, BufWriter, Write};

fn line(model: &ContentModel, bytes: &[u8]) -> Value {
    let v: Value = match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(e) => return json!({"error": format!("not JSON: {e}")}),
    };
    let scored = match (v.get("text"), v.get("body")) {
        (Some(Value::String(t)), None) => model.classify_text(t.as_bytes()),
        (None, Some(body)) => match serde_json::to_vec(body) {
            Ok(b) => model.classify_body(&[&b]),
            Err(e) => return json!({"error": format!("body: {e}")}),
        },
        _ => return json!({"error": "a line must be {\"text\": STRING} or {\"body\": OBJECT}"}),
    };
    let Scored { label, features } = scored;
    match label {
        Some(l) => json!({"label": model.labels[l.index], "score": l.score, "features": features}),
        None => json!({"label": null, "score": null, "features": features}),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 2 {
        eprintln!("usage: content_eval MODEL.json < in.jsonl > out.jsonl");
        std::process::exit(2);
    }
    let model = match std::fs::read(&args[1]).map_err(|e| e.to_string()).and_then(|b| parse_content_model(&b).map_err(|e| e.to_string())) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("content_eval: {}: {e}", args[1]);
            std::process::exit(2);
        }
    };
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    for input in stdin.lock().split(b'\n') {
        let input = match input {
            Ok(i) => i,
            Err(e) => {
                eprintln!("content_eval: reading stdin: {e}");
                std::process::exit(1);
            }
        };
        let result = line(&model, &input);
        if writeln!(out, "{result}").is_err() {
            std::process::exit(1);
        }
    }
    if out.flush().is_err() {
        std::process::exit(1);
    }
}
