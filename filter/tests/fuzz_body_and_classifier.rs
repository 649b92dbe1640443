//! Randomized tests of the JSON body scanner and the classifier, bounded in time
//! (INFERMESH_FUZZ_SECS, default 3 s each), from a fixed seed (INFERMESH_FUZZ_SEED to replay another).
//!
//! - differential: for generated OpenAI-like bodies and for byte-level mutations of them, the
//!   streaming scanner must agree with a reference built on serde_json::Value, and must return an
//!   error exactly when the input is not a JSON object;
//! - exact: on every input here (mutants with bad escapes, surrogates, invalid UTF-8, odd
//!   numbers, deep nesting, token soup, random bytes) the hand-written scanner must give the
//!   same result, facts or error, as the serde_json visitors it replaced
//!   (tests/common/serde_scanner.rs);
//! - the classifier never panics, asks for the body only before it has it, and always yields a
//!   class/pool pair that the config defines;
//! - the content classifier's text walk reads what the spec reads on a serde_json::Value (user
//!   turns, prompt, input; escapes decoded) wherever the body is cut, and never panics.
//!
//! A failure prints the seed and the input. Natively the strings are scanned with SSE2, the twin
//! of the module's Wasm SIMD loop (src/string_run.rs), and AVX2 where the CPU has it.

use infermesh_filter::body::{parse_body, parse_body_keyed, parse_body_segments, parse_body_segments_keyed, BodyFacts, MAX_KEPT_STRING};
use infermesh_filter::prefix_key::{PrefixSpec, MAX_KEYS};
use infermesh_filter::classify::{classify, Body, Content, Fallback, Outcome, RequestView};
use infermesh_filter::config::{parse_content_model, FilterConfig};
use infermesh_filter::content_classifier::ContentModel;
use serde_json::{json, Map, Value};
#[path = "common/fuzz_rng.rs"]
mod fuzz_rng;
use fuzz_rng::{budget, seed, Rng};
use std::time::Instant;

#[path = "common/serde_scanner.rs"]
mod serde_scanner;
#[path = "common/base64.rs"]
mod base64;
use base64::base64;

/// The new scanner must decide exactly as the serde_json one did: the same facts, or an error.
fn same_as_serde_scanner(s: u64, input: &[u8]) -> Result<BodyFacts, String> {
    let got = parse_body(input);
    let want = serde_scanner::parse_body(input);
    assert_eq!(got.as_ref().ok(), want.as_ref().ok(), "seed {s}: scanners differ (new {got:?}, serde_json {want:?}) on {:?}", String::from_utf8_lossy(input));
    same_with_the_prefix_key(s, input, &got);
    got
}

/// The prefix key (prefix_key.rs) changes nothing the walk decides (the same facts, the same
/// refusal and where), stays within its bounds, and is the same however the body is cut.
fn same_with_the_prefix_key(s: u64, input: &[u8], plain: &Result<BodyFacts, String>) {
    let spec = PrefixSpec { max_keys: 1 + (s as usize ^ input.len()) % MAX_KEYS, chunk_bytes: 64 };
    let keyed = parse_body_keyed(input, spec);
    let show = String::from_utf8_lossy(input);
    assert_eq!(keyed.as_ref().map(|(f, _)| f), plain.as_ref(), "seed {s}: the key changed the walk on {show:?}");
    if let Ok((_, Some(k))) = &keyed {
        assert!(k.chain().len() <= spec.max_keys, "seed {s}: {k:?} on {show:?}");
    }
    let at = (s as usize ^ 0x5bd1) % (input.len() + 1);
    let cut = parse_body_segments_keyed(&[&input[..at], &input[at..]], spec);
    assert_eq!(cut, keyed, "seed {s}: cut at {at} on {show:?}");
}


fn text(r: &mut Rng) -> String {
    let alphabet = ["a", "b", "é", "\"", "\\", "\n", "😀", " ", "\u{0}", "{", "]", "x", "/", "中", "\u{7f}", "\u{1f}", "\u{10ffff}", "\u{ffff}"];
    let n = r.below(40);
    (0..n).map(|_| *r.pick(&alphabet)).collect()
}

fn any_value(r: &mut Rng, depth: u32) -> Value {
    match r.below(if depth > 3 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => Value::Bool(r.below(2) == 0),
        2 if r.below(8) == 0 => json!(*r.pick(&[u64::MAX, 1 << 63, (1 << 63) - 1, 0])),
        2 => json!(r.below(5000)),
        3 if r.below(8) == 0 => json!(*r.pick(&[i64::MIN, i64::MIN + 1, -1])),
        3 => json!(-(r.below(100) as i64)),
        4 if r.below(8) == 0 => json!(*r.pick(&[-0.0, 1e300, -1e-300, 5e-324])),
        4 => json!(r.below(100) as f64 + 0.5),
        5 => Value::String(text(r)),
        6 => Value::Array((0..r.below(4)).map(|_| any_value(r, depth + 1)).collect()),
        _ => {
            let mut m = Map::new();
            for _ in 0..r.below(4) {
                let k = r.pick(&["text", "content", "type", "role", "x"]).to_string();
                m.insert(k, any_value(r, depth + 1));
            }
            Value::Object(m)
        }
    }
}

fn message(r: &mut Rng) -> Value {
    match r.below(5) {
        0 => json!({"role": "user", "content": text(r)}),
        1 => json!({"role": "user", "content": [{"type": "text", "text": text(r)}, {"type": "image_url", "image_url": {"url": text(r)}}]}),
        2 => json!({"role": "assistant", "content": null, "tool_calls": [any_value(r, 2)]}),
        3 => any_value(r, 2),
        _ => json!({"role": "system", "content": text(r), "name": text(r)}),
    }
}

fn body(r: &mut Rng) -> Value {
    let mut m = Map::new();
    let fields = ["model", "stream", "max_tokens", "max_completion_tokens", "n", "messages", "prompt", "priority", "service_tier", "temperature", "tools"];
    for _ in 0..r.below(9) {
        let f = *r.pick(&fields);
        let v = match (f, r.below(4)) {
            (_, 0) => any_value(r, 1),
            ("model", _) | ("service_tier", _) => Value::String(if r.below(10) == 0 { "m".repeat(300) } else { text(r) }),
            ("stream", _) => Value::Bool(r.below(2) == 0),
            ("max_tokens", _) | ("max_completion_tokens", _) | ("n", _) => json!(r.below(9000)),
            ("messages", _) => Value::Array((0..r.below(6)).map(|_| message(r)).collect()),
            ("prompt", _) => match r.below(3) {
                0 => Value::String(text(r)),
                1 => Value::Array((0..r.below(4)).map(|_| Value::String(text(r))).collect()),
                _ => Value::Array((0..r.below(6)).map(|i| json!(i)).collect()),
            },
            ("priority", _) => if r.below(2) == 0 { json!(r.below(10) as i64 - 5) } else { Value::String(text(r)) },
            _ => any_value(r, 1),
        };
        m.insert(f.to_string(), v);
    }
    Value::Object(m)
}

fn chars(s: &str) -> u64 {
    s.chars().count() as u64
}

fn text_chars(v: &Value, depth: u32) -> u64 {
    text_measure(v, depth, &chars)
}

/// The prompt's UTF-8 bytes (a token id counts one), as `prompt_chars` counts characters.
fn text_bytes(v: &Value, depth: u32) -> u64 {
    text_measure(v, depth, &|s: &str| s.len() as u64)
}

fn text_measure(v: &Value, depth: u32, m: &dyn Fn(&str) -> u64) -> u64 {
    match v {
        Value::String(s) => m(s),
        Value::Number(n) if depth > 0 && (n.is_u64() || n.is_i64()) => 1,
        Value::Array(xs) if depth == 0 => xs.iter().map(|x| text_measure(x, depth + 1, m)).sum(),
        Value::Object(o) => match o.get("text") {
            Some(Value::String(s)) => m(s),
            _ => 0,
        },
        _ => 0,
    }
}

fn kept(s: &str) -> String {
    let mut end = s.len().min(MAX_KEPT_STRING);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// The reference: what the scanner must find, computed from a full DOM.
fn reference(v: &Value) -> Option<BodyFacts> {
    let m = v.as_object()?;
    let s = |k: &str| m.get(k).and_then(|x| x.as_str()).map(kept);
    let content = |f: &dyn Fn(&Value, u32) -> u64| -> u64 {
        match m.get("messages") {
            Some(Value::Array(xs)) => xs.iter().map(|x| x.as_object().and_then(|o| o.get("content")).map(|c| f(c, 0)).unwrap_or(0)).sum(),
            _ => 0,
        }
    };
    let message_count = match m.get("messages") {
        Some(Value::Array(xs)) => xs.len() as u64,
        _ => 0,
    };
    let (message_chars, message_bytes) = (content(&text_chars), content(&text_bytes));
    Some(BodyFacts {
        stream: m.get("stream").and_then(|x| x.as_bool()),
        max_tokens: m.get("max_tokens").and_then(|x| x.as_u64()),
        max_completion_tokens: m.get("max_completion_tokens").and_then(|x| x.as_u64()),
        n: m.get("n").and_then(|x| x.as_u64()),
        model: s("model"),
        message_count,
        prompt_chars: message_chars + m.get("prompt").map(|p| text_chars(p, 0)).unwrap_or(0),
        prompt_bytes: message_bytes + m.get("prompt").map(|p| text_bytes(p, 0)).unwrap_or(0),
        priority: match m.get("priority") {
            Some(Value::String(x)) => Some(kept(x)),
            Some(Value::Number(n)) if n.is_u64() || n.is_i64() => Some(n.to_string()),
            _ => None,
        },
        service_tier: s("service_tier"),
    })
}

/// Pieces a mutation may insert: escapes (valid, invalid, surrogates paired and not), numbers
/// at the edges of u64/i64/f64, literals, nesting, whitespace.
const SPLICES: &[&str] = &[
    "\\u00e9", "\\u0000", "\\uD83D\\uDE00", "\\ud83d", "\\ude00", "\\uDBFF\\uDFFF", "\\uD800\\u0041", "\\ud800\\n",
    "\\uD800\\uD800\\uDC00", "\\u12G4", "\\u12", "\\x", "\\/", "\\", "\\\"", "\\b\\f\\r\\t",
    "-0", "0", "-", "1.", ".5", "01", "1e", "1e+", "1E-5", "1e400", "-1e400", "1e-400", "0e999999999999", "1e999999999999",
    "18446744073709551615", "18446744073709551616", "-9223372036854775808", "-9223372036854775809", "-18446744073709551615",
    "1.7976931348623157e308", "1.7976931348623159e308", "123456789012345678901234567890", "4.9e-324", "-0.0",
    "true", "fals", "nul", "null", " ", "\t\r\n", "[[[[[[[[", "]]]]]]]]", "{\"a\":", "}", "[]", "{}", ",", ":",
    "\"messages\":", "\"content\":", "\"text\":", "\"model\":", "\"prompt\":", "\"priority\":", "\"str\\u0065am\":", "\"mod\\u0065l\":",
];

/// Raw bytes a mutation may insert: invalid UTF-8 (stray continuation, truncated sequences,
/// overlong, surrogate code points, past U+10FFFF) and valid multi-byte characters.
const RAW: &[&[u8]] = &[
    b"\x80", b"\xbf", b"\xc3", b"\xc3\xa9", b"\xe4\xb8", b"\xe4\xb8\xad", b"\xf0\x9f\x98", b"\xf0\x9f\x98\x80", b"\xc0\xaf",
    b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xed\x9f\xbf", b"\xf4\x90\x80\x80", b"\xf4\x8f\xbf\xbf", b"\xff", b"\xfe", b"\x00", b"\x1f", b"\x7f",
];

fn mutate(r: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + r.below(4) {
        if b.is_empty() {
            b.push(r.below(256) as u8);
            continue;
        }
        let i = r.below(b.len() as u64) as usize;
        match r.below(7) {
            5 => {
                let piece = r.pick(SPLICES).as_bytes().to_vec();
                b.splice(i..i, piece);
            }
            6 => {
                let piece = r.pick(RAW).to_vec();
                b.splice(i..i, piece);
            }
            0 => b[i] = r.below(256) as u8,
            1 => {
                b.remove(i);
            }
            2 => b.insert(i, *r.pick(b"{}[]\",:0-e.\\ntfu")),
            3 => b.truncate(i),
            _ => {
                let j = r.below(b.len() as u64) as usize;
                let chunk: Vec<u8> = b[i.min(j)..i.max(j)].to_vec();
                b.splice(i..i, chunk);
            }
        }
    }
    b
}

#[test]
fn scanner_agrees_with_the_reference_on_generated_and_mutated_bodies() {
    let s = seed();
    let mut r = Rng(s);
    let end = Instant::now() + budget();
    let (mut n, mut valid_mutants) = (0u64, 0u64);
    while Instant::now() < end {
        let v = body(&mut r);
        let mut bytes = serde_json::to_vec(&v).unwrap();
        if r.below(2) == 0 {
            bytes = reescape(&mut r, &bytes);
        }
        let got = same_as_serde_scanner(s, &bytes);
        assert_eq!(got.as_ref().ok(), reference(&v).as_ref(), "seed {s}: {}", String::from_utf8_lossy(&bytes));
        for _ in 0..4 {
            let m = mutate(&mut r, bytes.clone());
            let got = same_as_serde_scanner(s, &m);
            if std::str::from_utf8(&m).is_err() {
                // Invalid UTF-8 inside a string the scanner skips is not detected (the sidecar
                // rejects such a body); all that matters here is no panic.
                n += 1;
                continue;
            }
            match serde_json::from_slice::<Value>(&m) {
                Ok(dom) if dom.is_object() => {
                    valid_mutants += 1;
                    assert_eq!(got.as_ref().ok(), reference(&dom).as_ref(), "seed {s}: {}", String::from_utf8_lossy(&m))
                }
                _ => {
                    // serde skips ignored values without checking them fully (a 1e999 the
                    // scanner never reads is fine by it); never more lenient than that.
                    if got.is_ok() {
                        let structural = serde_json::from_slice::<serde::de::IgnoredAny>(&m).is_ok();
                        assert!(structural, "seed {s}: accepted malformed input {:?}", String::from_utf8_lossy(&m));
                    }
                }
            }
            n += 1;
        }
        n += 1;
    }
    eprintln!("scanner fuzz: seed {s}, {n} inputs ({valid_mutants} valid mutants)");
    assert!(n > 1000, "too few iterations to mean anything: {n}");
}

#[test]
fn random_bytes_never_panic() {
    let s = seed();
    let mut r = Rng(s ^ 0x9e3779b97f4a7c15);
    let end = Instant::now() + budget() / 2;
    let mut n = 0u64;
    while Instant::now() < end {
        let len = r.below(300) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| r.below(256) as u8).collect();
        let _ = same_as_serde_scanner(s, &bytes);
        n += 1;
    }
    eprintln!("random bytes: seed {s}, {n} inputs");
}

/// The same JSON with some string characters written as escapes serde_json never writes
/// (`\u00e9`, surrogate pairs, `\/`): the meaning, and so the reference, is unchanged.
fn reescape(r: &mut Rng, json: &[u8]) -> Vec<u8> {
    let text = std::str::from_utf8(json).unwrap();
    // `verbatim`: characters still to copy as they are (the rest of an escape sequence).
    let (mut out, mut in_string, mut verbatim) = (String::new(), false, 0);
    let mut prev = ' ';
    for c in text.chars() {
        if verbatim > 0 {
            verbatim -= 1;
            if prev == '\\' && c == 'u' {
                verbatim = 4;
            }
            prev = c;
            out.push(c);
            continue;
        }
        prev = c;
        if c == '"' {
            in_string = !in_string;
        }
        if c == '\\' {
            verbatim = 1;
        }
        if !in_string || c == '"' || c == '\\' || r.below(4) != 0 {
            out.push(c);
        } else if c == '/' {
            out.push_str("\\/");
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&if r.below(2) == 0 { format!("\\u{:04x}", u) } else { format!("\\u{:04X}", u) });
            }
        }
    }
    out.into_bytes()
}

/// Hand-picked edges (the unit tests' among them): the scanners must agree on each.
#[test]
fn edge_cases_agree_with_the_serde_scanner() {
    let mut cases: Vec<Vec<u8>> = [
        &b"{\"x\":\"\xff\\ud800\",\"t\":1e400,\"role\":[\"\\udc00\"],\"tools\":{\"\\udc00\":1}}"[..],
        b"{\"model\":{\"\\udc00\":1}}", b"{\"model\":[\"\\udc00\"]}", b"{\"messages\":{\"\\udc00\":1}}", b"{\"messages\":[[\"\\udc00\"]]}",
        b"{\"messages\":[{\"\\udc00\":1}]}", b"{\"messages\":[{\"role\":\"\\udc00\"}]}", b"{\"messages\":[\"\\udc00\"]}",
        b"{\"messages\":[{\"content\":[{\"\\udc00\":1}]}]}", b"{\"messages\":[{\"content\":[{\"type\":\"\\udc00\"}]}]}",
        b"{\"messages\":[{\"content\":[[\"\\udc00\"]]}]}", b"{\"messages\":[{\"content\":[{\"text\":{\"\\udc00\":1}}]}]}",
        b"{\"messages\":[{\"content\":[{\"text\":[\"\\udc00\"]}]}]}", b"{\"messages\":[{\"content\":{\"text\":\"ab\"}}]}",
        b"{\"messages\":[{\"content\":[1,-1,-0,1.5,true,null,\"ab\"]}]}", b"{\"messages\":[{\"content\":\"a\",\"content\":\"bcd\"}]}",
        b"{\"prompt\":[[1,2],[3]]}", b"{\"prompt\":[{\"text\":\"abc\",\"text\":7}]}", b"{\"prompt\":[1e400]}", b"{\"prompt\":[[1e400]]}",
        b"{\"model\":1e400}", b"{\"model\":[1e400]}", b"{\"model\":{\"a\":1e400}}", b"{\"stream\":\"\xff\"}", b"{\"stream\":[\"\xff\"]}",
        b"{\"stream\":{\"\xff\":1}}", b"{\"stream\":{\"a\":\"\xff\"}}", b"{\"\xff\":1}", b"{\"tools\":{\"\xff\":\"\xff\"}}",
        b"{\"max_tokens\": 18446744073709551615, \"n\": 18446744073709551616, \"priority\": -9223372036854775808}",
        b"{\"priority\": -9223372036854775809}", b"{\"priority\": -0}", b"{\"priority\": 0}", b"{\"priority\": 1.0}",
        b"{\"max_tokens\": 1.7976931348623157e308}", b"{\"max_tokens\": 1.7976931348623159e308}", b"{\"max_tokens\": 1e-400}",
        b"{\"max_tokens\": 0e999999999999}", b"{\"max_tokens\": 1e999999999999}", b"{\"max_tokens\": -1e999999999999}",
        b"{\"str\\u0065am\": true, \"m\\u006fdel\": \"m\\u00e9\"}", b"{\"prompt\":\"a\\nb\\u00e9\\ud83d\\ude00\\/\\\"\"}",
        b"{\"model\":\"\\ud800\\ud800\\udc00\"}", b"{\"model\":\"\\uD83D\\uDE00\"}", b"{\"model\":\"\\u0000\"}",
        b"{}", b" {} ", b"{} x", b"{},", b"{\"a\":1,}", b"{,}", b"{\"a\" 1}", b"{\"a\":1 \"b\":2}", b"{\"messages\":[1,]}",
        b"{\"messages\":[,1]}", b"{\"messages\":[1 2]}", b"{\"tools\":[1,]}", b"{\"tools\":{\"a\":1,}}", b"\t{\"n\":\r\n1}\n",
        b"{\"n\":01}", b"{\"n\":-}", b"{\"n\":1.}", b"{\"n\":.5}", b"{\"n\":1e}", b"{\"n\":1e+}", b"{\"n\":+1}", b"{\"n\":1x}",
        b"{\"n\":tru}", b"{\"n\":nul}", b"{\"n\":truex}", b"{\"n\":\"\\u12\"}", b"{\"n\":\"\\x\"}", b"{\"n\":\"\t\"}", b"{\"n\":\"\x7f\"}",
        b"\xef\xbb\xbf{}", b"{\"n\":1}\x00",
    ]
    .iter()
    .map(|c| c.to_vec())
    .collect();
    for depth in [1usize, 63, 64, 65, 126, 127, 128, 129, 1000] {
        for wrap in ["{\"tools\":#}", "{\"model\":#}", "{\"messages\":[#]}", "{\"messages\":[{\"content\":#}]}", "{\"prompt\":[#]}"] {
            let v = format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
            cases.push(wrap.replace('#', &v).into_bytes());
            let v = format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
            cases.push(wrap.replace('#', &v).into_bytes());
        }
    }
    let big = |n: usize| format!("{{\"max_tokens\":1{},\"tools\":1{}}}", "0".repeat(n), "0".repeat(n + 400));
    for n in [300usize, 307, 308, 309, 310, 400] {
        cases.push(big(n).into_bytes());
    }
    for c in &cases {
        let _ = same_as_serde_scanner(0, c);
    }
}

/// Valid bodies with one value nested deep (below, at and far past serde_json's recursion limit
/// of 128) in a field that is read or skipped: the scanners must agree (the old one skips such
/// values with a heap stack, so it accepts any depth).
#[test]
fn deep_nesting_agrees_with_the_serde_scanner() {
    let s = seed();
    let mut r = Rng(s ^ 0x5555);
    let end = Instant::now() + budget() / 4;
    let mut n = 0u64;
    while Instant::now() < end {
        let depth = *r.pick(&[1usize, 2, 5, 63, 64, 65, 127, 128, 129, 200, 3000]);
        let (mut open, mut close) = (String::new(), Vec::new());
        for _ in 0..depth {
            if r.below(2) == 0 {
                open.push('[');
                close.push(']');
            } else {
                open.push_str(r.pick::<&str>(&["{\"a\":", "{\"text\":", "{\"content\":", "{\"x\":1,\"b\":"]));
                close.push('}');
            }
        }
        let close: String = close.into_iter().rev().collect();
        let inner = r.pick(&["1", "\"x\"", "[]", "{}", "\"\\ud800\"", "1e400", "\"\\u00e9\""]);
        let mut wrap = |v: String| -> String {
            match r.below(5) {
                0 => format!("{{\"messages\":[{{\"content\":{v}}}]}}"),
                1 => format!("{{\"messages\":[{v}]}}"),
                2 => format!("{{\"prompt\":[{v}]}}"),
                3 => format!("{{\"model\":{v},\"n\":2}}"),
                _ => format!("{{\"tools\":{v},\"stream\":true}}"),
            }
        };
        let mut body = wrap(format!("{open}{inner}{close}"));
        if r.below(4) == 0 {
            body = String::from_utf8_lossy(&mutate(&mut r, body.into_bytes())).into_owned();
        }
        let _ = same_as_serde_scanner(s, body.as_bytes());
        n += 1;
    }
    eprintln!("deep nesting: seed {s}, {n} inputs");
}

/// Random sequences of JSON tokens (mostly malformed, often nearly right): the structural
/// checks (commas, colons, brackets, trailing characters) must match the serde scanner's.
#[test]
fn token_soup_agrees_with_the_serde_scanner() {
    let tokens = [
        "{", "}", "[", "]", ",", ":", " ", "\"k\"", "\"messages\"", "\"content\"", "\"text\"", "\"prompt\"", "\"model\"",
        "\"priority\"", "\"n\"", "1", "-0", "-7", "1.5", "1e400", "true", "null", "\"a\\u00e9\"", "\"\\ud800\"", "\"\\udc00\"",
        "\"\\ud83d\\ude00\"", "\"\u{e9}\"",
    ];
    let s = seed();
    let mut r = Rng(s ^ 0x7777);
    let end = Instant::now() + budget() / 2;
    let (mut n, mut ok) = (0u64, 0u64);
    while Instant::now() < end {
        let mut body = String::from(if r.below(8) == 0 { "" } else { "{" });
        for _ in 0..r.below(24) {
            body.push_str(r.pick::<&str>(&tokens));
        }
        if r.below(2) == 0 {
            body.push('}');
        }
        ok += u64::from(same_as_serde_scanner(s, body.as_bytes()).is_ok());
        n += 1;
    }
    eprintln!("token soup: seed {s}, {n} inputs ({ok} accepted)");
}

struct Req {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
}

impl RequestView for Req {
    fn method(&self) -> Option<&str> {
        Some(&self.method)
    }
    fn path(&self) -> Option<&str> {
        Some(&self.path)
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

#[test]
fn classifier_never_panics_and_only_yields_configured_pairs() {
    let cfg = FilterConfig::parse(
        br#"{"version": 1, "default_class": "batch",
            "classes": {"interactive": {"pool": "a"}, "batch": {"pool": "b"}, "bulk": {"pool": "b"}},
            "rules": [
              {"name": "h", "class": "interactive", "match": {"headers": [{"name": "x-p", "regex": "^(hi|high)$"}]}},
              {"name": "long", "class": "bulk", "match": {"path": {"prefix": "/v1/"}, "body": {"max_tokens": {"min": 1000}, "stream": false}}},
              {"name": "tier", "class": "interactive", "match": {"body": {"service_tier": {"prefix": "pri"}, "n": {"max": 2}}}},
              {"name": "size", "class": "bulk", "match": {"body": {"prompt_chars": {"min": 20}, "message_count": {"min": 2}}}},
              {"name": "model", "class": "bulk", "match": {"body": {"model": {"regex": "^eval"}}}},
              {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"regex": "^/v1/chat/.*"}}}
            ]}"#,
    )
    .unwrap();
    let s = seed();
    let mut r = Rng(s ^ 0x1234);
    let end = Instant::now() + budget();
    let mut n = 0u64;
    while Instant::now() < end {
        let req = Req {
            method: r.pick(&["POST", "GET", "post", "", "PUT"]).to_string(),
            path: format!("{}{}", r.pick(&["/v1/chat/completions", "/v1/completions", "/", "", "/v1/"]), text(&mut r)),
            headers: (0..r.below(3)).map(|_| (r.pick(&["x-p", "content-type", "x-q"]).to_string(), text(&mut r))).collect(),
        };
        let v = body(&mut r);
        let facts = parse_body(&serde_json::to_vec(&v).unwrap()).unwrap();
        let first = classify(&cfg, &req, Body::NotYet);
        for b in [Body::Parsed(&facts, Content::Known(None)), Body::Unavailable(*r.pick(&Fallback::ALL))] {
            match classify(&cfg, &req, b) {
                Outcome::NeedBody | Outcome::NeedContent => panic!("seed {s}: asked for the body after it was given"),
                Outcome::Decided(d) => {
                    let want_pool = if d.class == "interactive" { "a" } else { "b" };
                    assert_eq!(d.pool, want_pool, "seed {s}");
                    if let Outcome::Decided(early) = &first {
                        assert_eq!(early, &d, "seed {s}: a header-only decision must not change once the body is known");
                    }
                }
            }
        }
        n += 1;
    }
    eprintln!("classifier fuzz: seed {s}, {n} requests");
}

/// A native host hands the body over in the slices it holds: cut anywhere, into any number of
/// segments, a body gives the same result, facts or error (and where), as in one buffer.
#[test]
fn segments_give_what_one_buffer_gives_wherever_the_body_is_cut() {
    let s = seed();
    let mut r = Rng(s ^ 0xc0ffee);
    let end = Instant::now() + budget() / 2;
    let mut n = 0u64;
    while Instant::now() < end {
        let v = body(&mut r);
        let mut bytes = serde_json::to_vec(&v).unwrap();
        if r.below(2) == 0 {
            bytes = reescape(&mut r, &bytes);
        }
        let input = match r.below(3) {
            0 => bytes,
            1 => mutate(&mut r, bytes),
            _ => (0..r.below(300)).map(|_| *r.pick(b"{}[]\",:0123456789-+eE.\\ntrufalsu \xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80\xff")).collect(),
        };
        let whole = parse_body(&input);
        for _ in 0..4 {
            let mut cuts: Vec<usize> = (0..1 + r.below(6)).map(|_| r.below(input.len() as u64 + 1) as usize).collect();
            cuts.sort_unstable();
            let (mut parts, mut from) = (Vec::new(), 0);
            for c in cuts {
                parts.push(&input[from..c]);
                from = c;
            }
            parts.push(&input[from..]);
            assert_eq!(parse_body_segments(&parts), whole, "seed {s}: cut into {:?} of {:?}", parts.iter().map(|p| p.len()).collect::<Vec<_>>(), String::from_utf8_lossy(&input));
            n += 1;
        }
    }
    eprintln!("segments: seed {s}, {n} cut bodies");
    assert!(n > 1000, "too few iterations to mean anything: {n}");
}

/// The content classifier's text walk (src/content_classifier.rs) against the spec read on a
/// serde_json::Value: the user turns of `messages`, then `prompt`, then `input`, joined by `\n`.
fn spec_text(v: &Value) -> Vec<u8> {
    let parts = |content: Option<&Value>, kinds: &[&str]| -> Vec<String> {
        match content {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(xs)) => xs
                .iter()
                .filter(|p| p.get("type").and_then(Value::as_str).map_or(false, |t| kinds.contains(&t)))
                .filter_map(|p| p.get("text").and_then(Value::as_str).map(str::to_string))
                .collect(),
            _ => vec![],
        }
    };
    let turns = |items: Option<&Value>, kinds: &[&str]| -> Vec<String> {
        match items {
            Some(Value::Array(xs)) => xs
                .iter()
                .filter(|m| m.is_object() && m.get("role").and_then(Value::as_str) == Some("user"))
                .flat_map(|m| parts(m.get("content"), kinds))
                .collect(),
            _ => vec![],
        }
    };
    let mut pieces = turns(v.get("messages"), &["text"]);
    match v.get("prompt") {
        Some(Value::String(s)) => pieces.push(s.clone()),
        Some(Value::Array(xs)) => pieces.extend(xs.iter().filter_map(|x| x.as_str().map(str::to_string))),
        _ => {}
    }
    match v.get("input") {
        Some(Value::String(s)) => pieces.push(s.clone()),
        other => pieces.extend(turns(other, &["input_text", "text"])),
    }
    pieces.join("\n").into_bytes()
}

#[test]
fn content_text_is_the_specs_wherever_the_body_is_cut() {
    let s = seed();
    let mut r = Rng(s ^ 0xc1a5);
    let models: Vec<ContentModel> = [(64usize, [2u8, 4u8], 2u8), (4096, [3, 3], 1), (100, [0, 0], 2)]
        .iter()
        .map(|&(max, chars, word)| {
            let weights: Vec<u8> = (0..256 * 3).map(|_| r.below(256) as u8).collect();
            let m = json!({"version": 1, "labels": ["a", "b", "c"], "dim": 256, "word_ngrams": word, "char_ngrams": chars,
                           "max_text_bytes": max, "scale": 0.05, "bias": [0.1, 0.0, -0.1], "weights": base64(&weights)});
            parse_content_model(m.to_string().as_bytes()).unwrap()
        })
        .collect();
    let end = Instant::now() + budget() / 2;
    let (mut n, mut compared) = (0u64, 0u64);
    while Instant::now() < end {
        let mut v = body(&mut r);
        if r.below(3) == 0 {
            let input = match r.below(3) {
                0 => Value::String(text(&mut r)),
                1 => json!([{"role": "user", "content": [{"type": "input_text", "text": text(&mut r)}, {"type": "text", "text": text(&mut r)}]},
                            {"role": "assistant", "content": text(&mut r)}, {"content": text(&mut r), "role": "user"}]),
                _ => any_value(&mut r, 1),
            };
            v["input"] = input;
        }
        let mut bytes = serde_json::to_vec(&v).unwrap();
        if r.below(2) == 0 {
            bytes = reescape(&mut r, &bytes);
        }
        if r.below(4) == 0 {
            bytes = mutate(&mut r, bytes);
        }
        let m = &models[r.below(3) as usize];
        let whole = m.classify_body(&[&bytes]);
        // Where serde_json reads the body (the field walk refuses the rest before any rule
        // sees it), the text is the spec's.
        if let Ok(Value::Object(o)) = serde_json::from_slice::<Value>(&bytes) {
            assert_eq!(whole, m.classify_text(&spec_text(&Value::Object(o))), "seed {s}: {:?}", String::from_utf8_lossy(&bytes));
            compared += 1;
        }
        let at = r.below(bytes.len() as u64 + 1) as usize;
        let at2 = at + r.below((bytes.len() - at) as u64 + 1) as usize;
        assert_eq!(m.classify_body(&[&bytes[..at], &bytes[at..at2], &bytes[at2..]]), whole, "seed {s}: cut at {at}, {at2}");
        if let Some(l) = whole.label {
            assert!(l.index < 3 && l.score > 0.0 && l.score <= 1.0, "seed {s}: {l:?}");
        }
        n += 1;
    }
    assert!(compared > n / 2, "seed {s}: only {compared} of {n} bodies were valid JSON");
    eprintln!("content text fuzz: seed {s}, {n} bodies, {compared} compared with the spec's reading");
}
