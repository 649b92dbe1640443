//! The filter's own verdict on filter configs, for the policy's contract test
//! (mesh-config/tests/test_rule_contract.py): one JSON document per line on stdin, one JSON line
//! out per document, `{"ok": true}` or `{"ok": false, "field": …, "message": …, "at": …}`.
//!
//! `field` is what `FilterConfig::parse` reports. For the errors serde reports (unknown or
//! missing fields, wrong types) that is `$` with a line and column; `at` then names the field:
//! the document is parsed with the filter's parser again, re-printed one value per line, so the
//! error's line gives the path (`rules[0].match.methds`). Otherwise `at` equals `field`.
//!
//!     cargo run --release --example check_config < configs.jsonl

use infermesh_filter::config::FilterConfig;
use serde_json::{json, Value};
use std::io::{self, BufRead, Write};

/// `v` printed one scalar, key or bracket per line: (line, the field that line is about).
fn lines(v: &Value, path: &str, prefix: String, suffix: &str, out: &mut Vec<(String, String)>) {
    let child = |k: &str| if path.is_empty() { k.to_string() } else { format!("{path}.{k}") };
    match v {
        Value::Object(m) => {
            out.push((format!("{prefix}{{"), path.to_string()));
            for (i, (k, c)) in m.iter().enumerate() {
                let key = format!("{}:", serde_json::to_string(k).unwrap_or_default());
                lines(c, &child(k), key, if i + 1 < m.len() { "," } else { "" }, out);
            }
            // A missing field is reported at the closing brace: the object's own line.
            out.push((format!("}}{suffix}"), path.to_string()));
        }
        Value::Array(a) => {
            out.push((format!("{prefix}["), path.to_string()));
            for (i, c) in a.iter().enumerate() {
                lines(c, &format!("{path}[{i}]"), String::new(), if i + 1 < a.len() { "," } else { "" }, out);
            }
            out.push((format!("]{suffix}"), path.to_string()));
        }
        scalar => out.push((format!("{prefix}{scalar}{suffix}"), path.to_string())),
    }
}

/// The field a serde error is about: the document printed one value per line and parsed again
/// (same values, so the same error), the error's line number names it.
fn serde_field(doc: &Value) -> Option<String> {
    let mut printed = Vec::new();
    lines(doc, "", String::new(), "", &mut printed);
    let text: Vec<&str> = printed.iter().map(|(l, _)| l.as_str()).collect();
    let e = FilterConfig::parse(text.join("\n").as_bytes()).err()?;
    let line: usize = e.message.rsplit_once(" at line ")?.1.split(' ').next()?.parse().ok()?;
    let mut at = printed.get(line.checked_sub(1)?)?.1.clone();
    if let Some(name) = e.message.strip_prefix("missing field `").and_then(|r| r.split('`').next()) {
        at = if at.is_empty() { name.to_string() } else { format!("{at}.{name}") };
    }
    Some(at)
}

fn verdict(line: &str) -> Value {
    match FilterConfig::parse(line.as_bytes()) {
        Ok(_) => json!({"ok": true}),
        Err(e) => {
            let at = if e.field == "$" {
                serde_json::from_str::<Value>(line).ok().and_then(|doc| serde_field(&doc)).unwrap_or_else(|| "$".into())
            } else {
                e.field.clone()
            };
            json!({"ok": false, "field": e.field, "message": e.message, "at": at})
        }
    }
}

fn main() {
    let stdout = io::stdout();
    let mut out = stdout.lock();
    for line in io::stdin().lock().lines() {
        let line = line.expect("stdin");
        if line.trim().is_empty() {
            continue;
        }
        writeln!(out, "{}", verdict(&line)).expect("stdout");
    }
}
