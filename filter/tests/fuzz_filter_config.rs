//! Randomized tests of the filter's config parser (`FilterConfig::parse`, what Envoy hands the
//! filter on every configure) and of the pool-state parsing (`parse_report`, `PoolRecord::decode`),
//! bounded in time (INFERMESH_FUZZ_SECS, default 3 s each) from a fixed seed
//! (INFERMESH_FUZZ_SEED to replay another).
//!
//! The configs mutated are the ones the control plane renders: the chart's bundled default, the
//! local and production policies' filter JSON (tests/configs/, rendered by mesh-config), and one
//! that sets every field. Mutations: byte flips, cuts, splices of odd tokens (huge numbers, lone
//! surrogates, invalid UTF-8), type swaps, deep nesting, huge arrays and strings, missing,
//! duplicated and unknown keys. On each the parser must answer Ok or an Err naming where, within
//! a time limit and a memory bound proportional to the input (a counting allocator, per thread).
//! A failure prints the seed and the input.

use infermesh_filter::config::FilterConfig;
use infermesh_filter::pool_state::{parse_report, PoolRecord, PoolRule, MAX_REPLICAS};
use infermesh_filter::stats::{TrustedCounters, MAX_LABEL_PAIRS};
use serde_json::{json, Value};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
#[path = "common/fuzz_rng.rs"]
mod fuzz_rng;
use fuzz_rng::{budget, seed, Rng};
use std::time::{Duration, Instant};

// ---- a per-thread count of live heap bytes, for the memory bound -------------------------------

struct Counting;

thread_local! {
    static LIVE: Cell<usize> = Cell::new(0);
    static PEAK: Cell<usize> = Cell::new(0);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        shrank(l.size());
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        grew(new);
        shrank(l.size());
        System.realloc(p, l, new)
    }
}

fn grew(n: usize) {
    let _ = LIVE.try_with(|live| {
        live.set(live.get() + n);
        let _ = PEAK.try_with(|p| p.set(p.get().max(live.get())));
    });
}

fn shrank(n: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(n)));
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// `f()` and the most heap it held at once beyond what was live before.
fn with_peak<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(|l| l.get());
    PEAK.with(|p| p.set(base));
    let r = f();
    (r, PEAK.with(|p| p.get()).saturating_sub(base))
}

// ---- seeds and randomness ---------------------------------------------------------------------


/// Longest one parse may take: ordinary configs parse in microseconds, the largest inputs here
/// (a few MiB) in milliseconds; this is a hang, even on a loaded two-core machine.
const HANG: Duration = Duration::from_secs(3);

/// Heap one parse may hold: proportional to the input (serde's strings and vectors, the
/// validated copy), plus the compiled regexes' shared limit (16 MiB, about 1.5x that in use).
fn memory_bound(input: usize) -> usize {
    16 * input + 48 * 1024 * 1024
}

/// Every field the parser reads, each set.
fn full_config() -> Value {
    json!({
        "version": 1,
        "default_class": "batch",
        "classes": {
            "interactive": {"pool": "gpu-a", "objective": "chat"},
            "batch": {"pool": "gpu-b"},
            "eval": {"pool": "gpu-b", "objective": "bulk"}
        },
        "rules": [
            {"name": "vip", "class": "interactive", "match": {"headers": [
                {"name": "x-priority", "exact": "high"}, {"name": "x-tenant", "prefix": "t-"},
                {"name": "x-debug", "present": false}, {"name": "x-any", "present": true}, {"name": "x-re", "regex": "^(a|b)+$"}]}},
            {"name": "bulk", "class": "batch", "match": {"methods": ["POST", "put"], "path": {"regex": "^/v1/(chat/)?completions$"},
                "body": {"stream": false, "max_tokens": {"min": 1024}, "n": {"max": 4}, "model": {"prefix": "eval-"},
                         "message_count": {"min": 1, "max": 99}, "prompt_chars": {"min": 10}, "priority": {"exact": "low"},
                         "service_tier": {"regex": "^flex"}}}},
            {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
            {"name": "grpc", "class": "interactive", "match": {"path": {"exact": "/infermesh.v1.Inference/Generate"}}}
        ],
        "body": {"max_bytes": 65536},
        "trusted_sources": {"cidrs": ["10.0.0.0/8", "::1", "fd00::/8"], "principals": ["spiffe://cluster.local/ns/gw/sa/gw"]},
        "emit_objective_header": true,
        "degraded_routing": {
            "pools": {
                "gpu-a": {"at_level": 3, "shed_classes": ["batch", "eval"], "probe_cluster": "outbound|8000||gpu-a.svc"},
                "gpu-b": {"probe_cluster": "pool_gpu-b"}
            },
            "probe_interval_ms": 500, "probe_timeout_ms": 400, "stale_after_ms": 5000, "recover_hold_ms": 1000, "retry_after_s": 5
        }
    })
}

/// The valid configs the mutations start from: what the control plane renders, and `full_config`.
fn corpus() -> Vec<Value> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let chart = std::fs::read_to_string(root.join("../charts/infermesh/files/default-generated.json")).expect("the chart's generated config");
    let chart: Value = serde_json::from_str(&chart).expect("chart json");
    let value = chart["filter"]["wasm"]["config"]["configuration"]["value"].as_str().expect("the filter config in the chart");
    let mut out = vec![serde_json::from_str(value).expect("chart filter config"), full_config()];
    for name in ["local.json", "production.json"] {
        let text = std::fs::read_to_string(root.join("tests/configs").join(name)).expect(name);
        out.push(serde_json::from_str(&text).expect(name));
    }
    for (i, v) in out.iter().enumerate() {
        let bytes = serde_json::to_vec(v).expect("json");
        if let Err(e) = FilterConfig::parse(&bytes) {
            panic!("corpus config {i} must be valid: {e}");
        }
    }
    out
}

/// The top-level fields: an error's path starts with one of them (or is `$`, serde's own).
const TOP: [&str; 8] = ["version", "default_class", "classes", "rules", "body", "trusted_sources", "emit_objective_header", "degraded_routing"];

// ---- mutations --------------------------------------------------------------------------------

/// Tokens that are JSON but odd, or not JSON at all.
const TOKENS: &[&str] = &[
    "1e999", "-1e999", "18446744073709551616", "18446744073709551615", "-1", "-0", "0.5", "1E2", "4294967296", "256",
    "\"\\ud800\"", "\"\\udc00\\ud800\"", "\"\\ud83d\\ude00\"", "\"\\u0000\"", "\"\\uDFFF\"", "\"\\x\"", "\"\\u12\"",
    "null", "true", "[]", "{}", "\"\"", "NaN", "Infinity", "01", "1.", ".5", "+1", "\"a\"", "[null]", "{\"\":0}", ",", ":", "]", "}",
];
const RAW: &[&[u8]] = &[b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x00", b"\xef\xbb\xbf", b"\x7f"];

fn mutate_bytes(r: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + r.below(4) {
        if b.is_empty() {
            b.push(r.below(256) as u8);
            continue;
        }
        let i = r.below(b.len() as u64) as usize;
        match r.below(8) {
            0 => b[i] ^= 1 << r.below(8),
            1 => b[i] = r.below(256) as u8,
            2 => {
                b.remove(i);
            }
            3 => b.truncate(i),
            4 => {
                let t = r.pick(TOKENS).as_bytes().to_vec();
                b.splice(i..i, t);
            }
            5 => {
                let t = r.pick(RAW).to_vec();
                b.splice(i..i, t);
            }
            6 => b.insert(i, *r.pick(b"{}[]\",:0-e.\\ntfu ")),
            _ => {
                let j = r.below(b.len() as u64) as usize;
                let chunk = b[i.min(j)..i.max(j)].to_vec();
                b.splice(i..i, chunk);
            }
        }
    }
    b
}

/// A random node of `v` (the root included).
fn node<'a>(r: &mut Rng, v: &'a mut Value) -> &'a mut Value {
    let descend = r.below(4) != 0;
    let n = match v {
        Value::Array(a) if descend && !a.is_empty() => a.len(),
        Value::Object(m) if descend && !m.is_empty() => m.len(),
        _ => return v,
    };
    let i = r.below(n as u64) as usize;
    match v {
        Value::Array(a) => node(r, &mut a[i]),
        Value::Object(m) => match m.values_mut().nth(i) {
            Some(child) => node(r, child),
            None => unreachable!(),
        },
        _ => unreachable!(),
    }
}

fn other_type(r: &mut Rng, v: &Value) -> Value {
    let s = match v {
        Value::String(s) => s.clone(),
        _ => "x".into(),
    };
    match r.below(9) {
        0 => Value::Null,
        1 => json!(r.below(2) == 0),
        2 => json!(*r.pick(&[0u64, 1, 2, 4, 5, 255, 256, u32::MAX as u64, u64::MAX])),
        3 => json!(*r.pick(&[-1i64, i64::MIN])),
        4 => json!(*r.pick(&[0.5f64, -0.0, 1e300])),
        5 => json!(s),
        6 => json!([v.clone()]),
        7 => json!({ "x": v.clone() }),
        _ => json!({}),
    }
}

/// Structural mutations on the value; some come back as text (what a value cannot hold).
fn mutate_value(r: &mut Rng, mut v: Value) -> Vec<u8> {
    match r.below(10) {
        0 | 1 => {
            let n = node(r, &mut v);
            *n = other_type(r, n);
        }
        2 => {
            // Remove a key (a required one, often), or add an unknown one.
            if let Value::Object(m) = node(r, &mut v) {
                if r.below(2) == 0 && !m.is_empty() {
                    let k = m.keys().nth(r.below(m.len() as u64) as usize).cloned().unwrap_or_default();
                    m.remove(&k);
                } else {
                    m.insert(r.pick(&["spill_to", "x", "version", "pool", ""]).to_string(), json!(r.below(3)));
                }
            }
        }
        3 => {
            // A huge array: the same element many times (rules, cidrs, headers, classes' names...).
            let n = if r.below(10) == 0 { 100_000 } else { *r.pick(&[10usize, 1_000]) };
            let target = node(r, &mut v);
            let elem = match &*target {
                Value::Array(a) if !a.is_empty() => a[0].clone(),
                other => other.clone(),
            };
            // At most a few MiB of input: the parser's cost is per byte, and building more costs the budget.
            let n = n.min((4 << 20) / serde_json::to_vec(&elem).map_or(1, |b| b.len().max(1)));
            *target = Value::Array(vec![elem; n]);
        }
        4 => {
            // Many distinct keys in an object (classes, pools).
            if let Value::Object(m) = node(r, &mut v) {
                let proto = m.values().next().cloned().unwrap_or(json!({"pool": "p"}));
                let n = if r.below(10) == 0 { 50_000 } else { *r.pick(&[10usize, 1_000]) };
                let n = n.min((4 << 20) / serde_json::to_vec(&proto).map_or(1, |b| b.len().max(1)));
                for i in 0..n {
                    m.insert(format!("k{i}"), proto.clone());
                }
            }
        }
        5 => {
            // A huge string (names, regexes, cidrs, principals).
            let len = if r.below(10) == 0 { *r.pick(&[1usize << 20, 4 << 20]) } else { *r.pick(&[65usize, 300, 70_000]) };
            let n = node(r, &mut v);
            let unit = r.pick(&["a", "é", "😀", "\u{0}", "(a*)*", "\\", "-"]).to_string();
            *n = Value::String(unit.repeat(len / unit.len().max(1) + 1));
        }
        6 => {
            // Deep nesting, as text: a value serde never returns.
            let depth = if r.below(10) == 0 { *r.pick(&[100_000usize, 1_000_000]) } else { *r.pick(&[127usize, 129, 1_000]) };
            let n = node(r, &mut v);
            *n = Value::String("\u{1}NEST\u{1}".into());
            let text = serde_json::to_string(&v).unwrap_or_default();
            let (open, close) = if r.below(2) == 0 { ("[", "]") } else { ("{\"a\":", "}") };
            let nested = format!("{}0{}", open.repeat(depth), close.repeat(depth));
            return text.replacen("\"\\u0001NEST\\u0001\"", &nested, 1).into_bytes();
        }
        7 => {
            // A duplicated key, as text.
            let text = serde_json::to_string(&v).unwrap_or_default();
            let key = *r.pick(&["\"version\":", "\"classes\":", "\"pool\":", "\"name\":", "\"rules\":"]);
            if let Some(at) = text.find(key) {
                let rest = &text[at..];
                let end = rest.find(',').unwrap_or(rest.len());
                let mut t = text.clone();
                t.insert_str(at, &format!("{},", &rest[..end]));
                return t.into_bytes();
            }
            return text.into_bytes();
        }
        8 => {
            // A regex meant to be costly to compile.
            let n = node(r, &mut v);
            *n = json!({"regex": *r.pick(&["a{1000}{1000}", "(a*)*b", "\\w{1000}", "[\\s\\S]{100}{100}", "((((((((((a))))))))))*", "(?i)\\pL", "x{4294967295}", "(", "[z-a]"])});
        }
        _ => {}
    }
    let bytes = serde_json::to_vec(&v).unwrap_or_default();
    if r.below(3) == 0 {
        mutate_bytes(r, bytes)
    } else {
        bytes
    }
}

/// One input: Ok or a clear Err, in time, in bounded memory.
fn check(s: u64, input: &[u8], stats: &mut Stats) {
    let t = Instant::now();
    let (result, peak) = with_peak(|| {
        FilterConfig::parse(input).map(|c| {
            // The stats an accepted config defines are bounded by its names, not their product.
            let mut defined = 0usize;
            let trusted = TrustedCounters::define(&c, &mut |_| defined += 1);
            assert!(defined == trusted.len() && defined <= MAX_LABEL_PAIRS.max(c.classes.len() + 1), "seed {s}: {defined} stats");
            (c.rules.len(), c.classes.len())
        })
    });
    let took = t.elapsed();
    let show = || String::from_utf8_lossy(&input[..input.len().min(400)]).into_owned();
    assert!(took < HANG, "seed {s}: {took:?} on {} bytes: {}", input.len(), show());
    assert!(peak <= memory_bound(input.len()), "seed {s}: {peak} bytes held on {} bytes of input: {}", input.len(), show());
    stats.slowest = stats.slowest.max(took);
    stats.peak_ratio = stats.peak_ratio.max(peak as f64 / (input.len().max(1) as f64));
    stats.peak = stats.peak.max(peak);
    match result {
        Ok((_, classes)) => {
            assert!(classes > 0, "seed {s}: accepted without a class: {}", show());
            stats.ok += 1;
        }
        Err(e) => {
            let text = e.to_string();
            assert!(!e.message.is_empty() && !e.field.is_empty(), "seed {s}: {text}");
            assert!(text.contains(&format!("`{}`", e.field)), "seed {s}: {text}");
            if e.field == "$" {
                // serde's own refusal: its words and where (line, column).
                assert!(e.message.contains(" at line ") && e.message.contains(" column "), "seed {s}: no position in {text}");
            } else {
                let head = e.field.split(|c| c == '.' || c == '[').next().unwrap_or("");
                assert!(TOP.contains(&head), "seed {s}: `{}` is not a config path ({text})", e.field);
            }
            stats.err += 1;
        }
    }
}

#[derive(Default)]
struct Stats {
    ok: u64,
    err: u64,
    slowest: Duration,
    peak: usize,
    peak_ratio: f64,
}

#[test]
fn config_parser_answers_every_mutation_in_time_and_bounded_memory() {
    let s = seed();
    let mut r = Rng(s);
    let corpus = corpus();
    let mut stats = Stats::default();
    let end = Instant::now() + budget();
    while Instant::now() < end {
        let v = r.pick(&corpus).clone();
        let input = if r.below(3) == 0 { mutate_bytes(&mut r, serde_json::to_vec(&v).unwrap_or_default()) } else { mutate_value(&mut r, v) };
        check(s, &input, &mut stats);
    }
    let n = stats.ok + stats.err;
    eprintln!(
        "config fuzz: seed {s}, {n} configs ({} accepted), slowest {:?}, peak heap {} KiB ({:.0}x the input at most)",
        stats.ok, stats.slowest, stats.peak / 1024, stats.peak_ratio
    );
    assert!(n > 200, "too few iterations to mean anything: {n}");
    assert!(stats.ok > 0 && stats.err > 0, "the mutations must both keep and break configs: {} ok, {} refused", stats.ok, stats.err);
}

#[test]
fn config_parser_extremes() {
    let s = seed();
    let base = serde_json::to_string(&full_config()).expect("json");
    let mut stats = Stats::default();
    let mut inputs: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"\xff\xfe\x00{".to_vec(),
        b"\xef\xbb\xbf{}".to_vec(),
        "[".repeat(10_000_000).into_bytes(),
        "{\"version\":".repeat(1_000_000).into_bytes(),
        format!("{}{}", "[".repeat(200_000), "]".repeat(200_000)).into_bytes(),
        base.replace("\"version\":1", "\"version\":1e999").into_bytes(),
        base.replace("\"version\":1", "\"version\":18446744073709551616").into_bytes(),
        base.replace("\"max_bytes\":65536", "\"max_bytes\":18446744073709551615").into_bytes(),
        base.replace("\"at_level\":3", "\"at_level\":256").into_bytes(),
        base.replace("\"probe_interval_ms\":500", "\"probe_interval_ms\":-1").into_bytes(),
        base.replace("\"batch\"", "\"\\ud800\"").into_bytes(),
        base.replace("\"gpu-a\"", "\"\\udfff\\ud800\"").into_bytes(),
        base.replacen("gpu-b", "gpu\u{ff}-b", 1).replace('\u{ff}', "\u{0}").into_bytes(),
        base.replace("\"batch\"", &format!("\"{}\"", "b".repeat(16 << 20))).into_bytes(),
    ];
    let mut raw = base.clone().into_bytes();
    let at = raw.len() / 2;
    raw.splice(at..at, b"\xed\xa0\x80".iter().copied());
    inputs.push(raw);
    let rule = serde_json::to_string(&full_config()["rules"][1]).expect("json");
    let many = |n: usize, f: &dyn Fn(usize) -> String| (0..n).map(f).collect::<Vec<_>>().join(",");
    inputs.push(base.replacen("\"rules\":[", &format!("\"rules\":[{},", many(30_000, &|i| rule.replace("\"bulk\"", &format!("\"b{i}\"")))), 1).into_bytes());
    inputs.push(base.replacen("\"cidrs\":[", &format!("\"cidrs\":[{},", many(200_000, &|i| format!("\"10.{}.0.0/16\"", i % 256))), 1).into_bytes());
    inputs.push(base.replacen("\"classes\":{", &format!("\"classes\":{{{},", many(100_000, &|i| format!("\"c{i}\":{{\"pool\":\"p{i}\"}}"))), 1).into_bytes());
    inputs.push(base.replacen("\"rules\":[", &format!("\"rules\":[{},", many(1_000, &|i| format!(r#"{{"name":"re{i}","class":"batch","match":{{"path":{{"regex":"a{{1000}}{{10}}"}}}}}}"#))), 1).into_bytes());
    for input in &inputs {
        check(s, input, &mut stats);
    }
    eprintln!("config extremes: {} inputs ({} accepted), slowest {:?}, peak heap {} KiB", inputs.len(), stats.ok, stats.slowest, stats.peak / 1024);
    // The many distinct regexes of a few bytes each are refused, not compiled into a GiB.
    assert!(FilterConfig::parse(inputs.last().expect("input")).is_err());
}

// ---- pool state: the level header and the shared-data record ----------------------------------

fn level_value(r: &mut Rng) -> Vec<u8> {
    let parts = ["gpu", "batch", "", " ", "interactive", "r1", "pod-a.1", "0", "3", "4", "5", "-1", "03", "١", "x", ";", "p/1", "é"];
    let mut v = Vec::new();
    for i in 0..r.below(6) {
        if i > 0 {
            v.push(b';');
        }
        v.extend_from_slice(r.pick(&parts).as_bytes());
        if r.below(10) == 0 {
            v.extend_from_slice(*r.pick(RAW));
        }
        if r.below(30) == 0 {
            v.extend(std::iter::repeat(b'a').take(r.below(200) as usize));
        }
    }
    v
}

#[test]
fn pool_state_parsing_never_panics_and_stays_bounded() {
    let s = seed();
    let mut r = Rng(s ^ 0x5eed);
    let rule = PoolRule { at_level: 3, stale_after_ms: 5000, recover_hold_ms: 1000 };
    let mut rec = PoolRecord::default();
    let end = Instant::now() + budget() / 2;
    let (mut n, mut used) = (0u64, 0u64);
    while Instant::now() < end {
        let raw = level_value(&mut r);
        // Envoy hands the filter header values as bytes; only UTF-8 ones reach the parser.
        if let Ok(text) = std::str::from_utf8(&raw) {
            if let Ok(rep) = parse_report(text) {
                assert!(rep.level <= 4 && !rep.pool.is_empty() && !rep.replica.is_empty(), "seed {s}: {text:?}");
                assert!(!rep.pool.contains(';') && !rep.replica.contains(';'), "seed {s}: {text:?}");
                rec.observe(&rule, rep.replica, rep.level, 1000 + n);
                used += 1;
            }
        }
        assert!(rec.readings.len() <= MAX_REPLICAS, "seed {s}");
        let _ = rec.degraded(&rule, r.below(1 << 40));
        // The shared-data record: what this code wrote round-trips; anything else decodes to
        // None or to a bounded record, never a panic.
        assert_eq!(PoolRecord::decode(&rec.encode()).as_ref(), Some(&rec), "seed {s}");
        let mut bytes = rec.encode();
        if !bytes.is_empty() {
            bytes = mutate_bytes(&mut r, bytes);
        }
        if let Some(d) = PoolRecord::decode(&bytes) {
            assert!(d.readings.len() <= MAX_REPLICAS && d.readings.iter().all(|x| x.level <= 4), "seed {s}: {:?}", String::from_utf8_lossy(&bytes));
        }
        n += 1;
    }
    let lines: String = (0..10_000).map(|i| format!("r{i} 1 1 1\n")).collect();
    assert_eq!(PoolRecord::decode(lines.as_bytes()), None, "more replicas than a record holds");
    eprintln!("pool state fuzz: seed {s}, {n} level values ({used} used)");
    assert!(n > 1000, "too few iterations to mean anything: {n}");
}
