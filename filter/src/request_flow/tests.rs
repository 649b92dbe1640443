//! The request flow against a fake host (no Envoy), with the native module's pool state table:
//! what it writes, strips, counts and answers. The real hosts are exercised by
//! e2e/test_filter_envoy_integration.py and e2e/test_filter_dynamic_module_integration.py.

use super::*;
use crate::config::{FilterConfig, HEADER_CLASS, HEADER_OBJECTIVE, HEADER_POOL, HEADER_RULE};
use crate::pool_state::HEADER_POOL_LEVEL;
use crate::process_pool_table::{pools_to_probe, PoolTable};
use crate::token_budget::{record_key, ProcessBudgets, Record};

type ModuleConfig = Accepted<PoolTable>;

/// Each config its own budget table (the native module's kind: the process's one is shared).
fn table(_: &Metrics) -> BudgetTable {
    Box::new(ProcessBudgets::fresh())
}

/// A fake `Host`: the request's headers as bytes, as Envoy holds them (names and values need not
/// be UTF-8), its body in slices, the response's headers, what was answered and counted.
#[derive(Default)]
struct FakeHost {
    request: Vec<(Vec<u8>, Vec<u8>)>,
    body: Vec<u8>,
    /// The lengths of the slices the body is held in, but the last (none: one slice).
    body_cuts: Vec<usize>,
    source: Option<String>,
    principals: Vec<String>,
    response: Vec<(String, String)>,
    route_cache_clears: usize,
    /// The answer: status, headers, body (a second one fails the test).
    sent: Option<(u32, Vec<(String, String)>, Vec<u8>)>,
    counted: Vec<usize>,
    /// The clock (None: the real one).
    now: Option<u64>,
}

impl FakeHost {
    fn request(method: &str, path: &str, extra: &[(&str, &str)]) -> FakeHost {
        let mut h = FakeHost::default();
        h.push(":method", method);
        h.push(":path", path);
        for (k, v) in extra {
            h.push(k, v);
        }
        h
    }

    /// A request header as a client sends it, next to any of the same name.
    fn push(&mut self, name: &str, value: &str) {
        self.request.push((name.as_bytes().to_vec(), value.as_bytes().to_vec()));
    }

    /// A request header's first value, as text (one that is not UTF-8 fails the test).
    fn header(&self, name: &str) -> Option<&str> {
        self.request.iter().find(|(k, _)| k == name.as_bytes()).map(|(_, v)| std::str::from_utf8(v).expect("a UTF-8 value"))
    }

    /// How many values of a request header are held.
    fn header_count(&self, name: &str) -> usize {
        self.request.iter().filter(|(k, _)| k == name.as_bytes()).count()
    }

    /// The request headers whose names start with `prefix`, in order, as text.
    fn headers_starting_with(&self, prefix: &str) -> Vec<(&str, &str)> {
        fn text(b: &[u8]) -> &str {
            std::str::from_utf8(b).expect("a UTF-8 header")
        }
        self.request.iter().filter(|(k, _)| k.starts_with(prefix.as_bytes())).map(|(k, v)| (text(k), text(v))).collect()
    }
}

impl Host for FakeHost {
    fn request_headers(&self) -> Vec<(&[u8], &[u8])> {
        self.request.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect()
    }
    fn add_request_header(&mut self, name: &str, value: &str) {
        assert_eq!(self.header_count(name), 0, "added over an existing {name}");
        self.push(name, value);
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        self.request.retain(|(k, _)| k != name.as_bytes());
        if let Some(v) = value {
            self.push(name, v);
        }
    }
    fn remove_request_header(&mut self, name: &[u8]) {
        self.request.retain(|(k, _)| k != name);
    }
    fn clear_route_cache(&mut self) {
        self.route_cache_clears += 1;
    }
    fn request_body(&mut self) -> Vec<&[u8]> {
        let mut parts = Vec::new();
        let mut rest = &self.body[..];
        for &n in &self.body_cuts {
            let (head, tail) = rest.split_at(n.min(rest.len()));
            parts.push(head);
            rest = tail;
        }
        parts.push(rest);
        parts
    }
    fn request_body_size(&self) -> usize {
        self.body.len()
    }
    fn source_address(&self) -> Option<String> {
        self.source.clone()
    }
    fn peer_principals(&self) -> Vec<String> {
        self.principals.clone()
    }
    fn send_response(&mut self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        assert!(self.sent.is_none(), "answered twice");
        self.sent = Some((status, headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), body.to_vec()));
    }
    fn response_header(&self, name: &str) -> Option<String> {
        self.response.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }
    fn remove_response_header(&mut self, name: &str) {
        self.response.retain(|(k, _)| k != name);
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        self.remove_response_header(name);
        self.response.push((name.to_string(), value.to_string()));
    }
    fn now_ms(&self) -> u64 {
        self.now.unwrap_or_else(now_ms)
    }
    fn count(&mut self, id: CounterId) {
        if let Some(id) = id {
            self.counted.push(id);
        }
    }
}

const CONFIG: &str = r#"{
  "version": 1,
  "default_class": "batch",
  "classes": {"interactive": {"pool": "interactive"}, "batch": {"pool": "batch"}},
  "rules": [
    {"name": "chat-bulk", "class": "batch",
     "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}, "body": {"stream": false, "max_tokens": {"min": 1024}}}},
    {"name": "hdr-priority", "class": "interactive", "match": {"headers": [{"name": "x-priority", "exact": "high"}]}},
    {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}}
  ],
  "body": {"max_bytes": 4096},
  "trusted_sources": {"cidrs": ["10.8.0.0/16"]},
  "degraded_routing": {
    "pools": {
      "interactive": {"at_level": 3, "shed_classes": ["batch"], "probe_cluster": "pool_interactive"},
      "batch": {"at_level": 4, "probe_cluster": "pool_batch"}
    },
    "probe_interval_ms": 500, "probe_timeout_ms": 400, "stale_after_ms": 5000, "recover_hold_ms": 1000, "retry_after_s": 7
  }
}"#;

/// The config with counter ids in definition order, and the names by id.
fn module() -> (ModuleConfig, Vec<String>) {
    module_of(CONFIG)
}

fn module_of(config: &str) -> (ModuleConfig, Vec<String>) {
    let mut names = Vec::new();
    let cfg = ModuleConfig::new(FilterConfig::parse(config.as_bytes()).expect("test config"), &mut |n| {
        names.push(n.to_string());
        Some(names.len() - 1)
    }, &table);
    (cfg, names)
}

fn counted(host: &FakeHost, names: &[String]) -> Vec<String> {
    host.counted.iter().map(|i| names[*i].clone()).collect()
}

fn chat(body: &[u8]) -> FakeHost {
    let mut h = FakeHost::request("POST", "/v1/chat/completions", &[("content-type", "application/json")]);
    h.body = body.to_vec();
    h
}

#[test]
fn a_header_rule_is_written_with_one_route_cache_clear() {
    let (cfg, names) = module();
    let mut h = FakeHost::request("GET", "/v1/models", &[("x-priority", "high")]);
    assert_eq!(Stream::default().on_request_headers(&cfg, &mut h, true), Next::Continue);
    assert_eq!(h.header(HEADER_CLASS), Some("interactive"));
    assert_eq!(h.header(HEADER_POOL), Some("interactive"));
    assert_eq!(h.header(HEADER_RULE), Some("hdr-priority"));
    assert_eq!(h.header(HEADER_OBJECTIVE), None);
    assert_eq!(h.route_cache_clears, 1);
    assert_eq!(counted(&h, &names), ["infermesh.requests_total.class.interactive.pool.interactive.rule.hdr-priority"]);
}

#[test]
fn client_sent_internal_headers_are_stripped_and_counted() {
    let (cfg, names) = module();
    let mut h = FakeHost::request("GET", "/v1/models", &[("x-infermesh-pool", "interactive"), ("x-infermesh-anything", "x")]);
    h.source = Some("192.168.1.5:4000".into());
    Stream::default().on_request_headers(&cfg, &mut h, true);
    assert_eq!(h.header("x-infermesh-anything"), None);
    assert_eq!(h.header(HEADER_POOL), Some("batch"), "the spoofed pool is replaced by the decision");
    assert_eq!(h.header(HEADER_RULE), Some("default"));
    assert!(counted(&h, &names).contains(&"infermesh.stripped_requests_total".to_string()));
}

#[test]
fn a_trusted_peers_decision_is_kept() {
    let (cfg, names) = module();
    let mut h = FakeHost::request("GET", "/v1/models", &[("x-infermesh-class", "interactive"), ("x-infermesh-pool", "interactive")]);
    h.source = Some("10.8.3.4:5000".into());
    assert_eq!(Stream::default().on_request_headers(&cfg, &mut h, true), Next::Continue);
    assert_eq!(h.header(HEADER_RULE), None, "nothing written");
    assert_eq!(h.route_cache_clears, 0);
    assert_eq!(counted(&h, &names), ["infermesh.requests_total.class.interactive.pool.interactive.rule.trusted"]);
}

/// Every header the mesh reserves (the filter's, the sidecar's, the routes'): whatever a client
/// sends under these names never reaches a pool.
const INTERNAL_HEADERS: [&str; 14] = [
    "x-infermesh-class", "x-infermesh-pool", "x-infermesh-rule", "x-infermesh-pool-level", "x-infermesh-ttft-give-up-ms",
    "x-infermesh-served-by", "x-infermesh-model", "x-infermesh-degraded", "x-infermesh-degraded-reason", "x-infermesh-shed-by",
    "x-infermesh-debug", "x-infermesh-class-hint", "x-infermesh-spilled-from", "x-infermesh-",
];

#[test]
fn every_internal_header_from_outside_is_stripped_before_anything_reads_it() {
    let (cfg, names) = module();
    for name in INTERNAL_HEADERS {
        for source in [None, Some("192.168.1.5:4000"), Some("not an address"), Some("10.9.0.1"), Some("[::ffff:10.7.0.1]:80")] {
            let mut h = FakeHost::request("GET", "/v1/models", &[(name, "interactive"), ("x-priority", "low")]);
            h.source = source.map(str::to_string);
            Stream::default().on_request_headers(&cfg, &mut h, true);
            let internal = h.headers_starting_with("x-infermesh-");
            assert_eq!(internal, [(HEADER_CLASS, "batch"), (HEADER_POOL, "batch"), (HEADER_RULE, "default")], "{name} from {source:?}: only the filter's own decision remains");
            assert_eq!(counted(&h, &names).iter().filter(|n| *n == "infermesh.stripped_requests_total").count(), 1, "{name}");
        }
    }
    // The ORCA load report is a response header: one a client sends is not the mesh's, and no
    // part of the filter reads it (Envoy's weighted round robin reads upstream responses only).
    let mut h = FakeHost::request("GET", "/v1/models", &[("endpoint-load-metrics", "TEXT application_utilization=0.0")]);
    Stream::default().on_request_headers(&cfg, &mut h, true);
    assert_eq!(h.header(HEADER_POOL), Some("batch"));
    assert!(!counted(&h, &names).contains(&"infermesh.stripped_requests_total".to_string()));
}

#[test]
fn a_client_cannot_pass_a_routing_header_through_a_header_rule() {
    // A rule that reads an x-infermesh-* header is only ever satisfied by a trusted peer: from
    // outside, the header is gone before the rules run.
    let cfg = r#"{"version": 1, "default_class": "batch", "classes": {"interactive": {"pool": "interactive"}, "batch": {"pool": "batch"}},
        "rules": [{"name": "hint", "class": "interactive", "match": {"headers": [{"name": "x-infermesh-class-hint", "exact": "i"}]}}],
        "trusted_sources": {"cidrs": ["10.8.0.0/16"]}}"#;
    let cfg = ModuleConfig::new(FilterConfig::parse(cfg.as_bytes()).expect("config"), &mut |_| None, &table);
    let mut outside = FakeHost::request("GET", "/v1/models", &[("x-infermesh-class-hint", "i")]);
    outside.source = Some("192.168.0.9:1".into());
    Stream::default().on_request_headers(&cfg, &mut outside, true);
    assert_eq!(outside.header(HEADER_RULE), Some("default"));
    assert_eq!(outside.header("x-infermesh-class-hint"), None);
    let mut peer = FakeHost::request("GET", "/v1/models", &[("x-infermesh-class-hint", "i")]);
    peer.source = Some("10.8.0.9:1".into());
    Stream::default().on_request_headers(&cfg, &mut peer, true);
    assert_eq!(peer.header(HEADER_RULE), Some("hint"), "a trusted peer's partial decision is decided here, on its headers");
    assert_eq!(peer.header("x-infermesh-class-hint"), Some("i"), "and kept");
}

#[test]
fn a_trusted_peers_made_up_names_are_counted_as_other_and_define_nothing() {
    let (cfg, names) = module();
    let defined = names.len();
    let cases = [
        (("interactive", "batch"), "infermesh.requests_total.class.interactive.pool.batch.rule.trusted"),
        (("made-up", "interactive"), "infermesh.requests_total.class.other.pool.interactive.rule.trusted"),
        (("batch", "made-up"), "infermesh.requests_total.class.batch.pool.other.rule.trusted"),
        (("c1", "p1"), "infermesh.requests_total.class.other.pool.other.rule.trusted"),
        (("", ""), "infermesh.requests_total.class.other.pool.other.rule.trusted"),
    ];
    for ((class, pool), want) in cases {
        let mut h = FakeHost::request("GET", "/v1/models", &[("x-infermesh-class", class), ("x-infermesh-pool", pool), ("x-infermesh-ttft-give-up-ms", "50")]);
        h.source = Some("10.8.3.4:5000".into());
        assert_eq!(Stream::default().on_request_headers(&cfg, &mut h, true), Next::Continue);
        assert_eq!(counted(&h, &names), [want], "{class}/{pool}");
        assert_eq!((h.header(HEADER_CLASS), h.header(HEADER_POOL)), (Some(class), Some(pool)), "kept as the peer sent it");
        assert_eq!(h.header("x-infermesh-ttft-give-up-ms"), Some("50"), "a trusted hop's other internal headers are kept too");
    }
    assert_eq!(names.len(), defined, "nothing defined after configure");
    let trusted: Vec<_> = names.iter().filter(|n| n.ends_with(".rule.trusted")).collect();
    // {batch, interactive, other} x {batch, interactive, other}
    assert_eq!(trusted.len(), 9, "{trusted:?}");
}

#[test]
fn a_trusted_peers_partial_decision_is_decided_here() {
    let (cfg, _) = module();
    let mut h = FakeHost::request("GET", "/v1/models", &[("x-infermesh-class", "interactive")]);
    h.source = Some("10.8.3.4:5000".into());
    Stream::default().on_request_headers(&cfg, &mut h, true);
    assert_eq!(h.header(HEADER_CLASS), Some("batch"));
    assert_eq!(h.header(HEADER_POOL), Some("batch"));
}

#[test]
fn a_body_rule_waits_for_the_whole_body_then_decides_on_it() {
    let (cfg, names) = module();
    let mut h = chat(br#"{"stream":false,"max_tokens":2048,"messages":[]}"#);
    let mut s = Stream::default();
    assert_eq!(s.on_request_headers(&cfg, &mut h, false), Next::Wait);
    assert_eq!(h.header(HEADER_POOL), None);
    assert_eq!(s.on_request_body(&cfg, &mut h, false), Next::Wait, "keeps buffering until the end");
    assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue);
    assert_eq!(h.header(HEADER_RULE), Some("chat-bulk"));
    assert_eq!(h.header(HEADER_POOL), Some("batch"));
    assert_eq!(counted(&h, &names), ["infermesh.requests_total.class.batch.pool.batch.rule.chat-bulk"]);
    assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue, "decided once");
    assert_eq!(h.counted.len(), 1);
}

#[test]
fn a_body_in_several_slices_is_decided_as_in_one() {
    let (cfg, _) = module();
    let body = r#"{"stream":false,"max_tokens":2048,"messages":[{"role":"user","content":"h\u00e9llo wörld"}]}"#.as_bytes();
    let decide = |cuts: Vec<usize>| {
        let mut h = chat(body);
        h.body_cuts = cuts;
        let mut s = Stream::default();
        assert_eq!(s.on_request_headers(&cfg, &mut h, false), Next::Wait);
        assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue);
        (h.header(HEADER_RULE).map(str::to_string), h.counted.clone())
    };
    let whole = decide(vec![]);
    assert_eq!(whole.0.as_deref(), Some("chat-bulk"));
    for at in 0..=body.len() {
        assert_eq!(decide(vec![at]), whole, "cut at {at}");
    }
    assert_eq!(decide(vec![1; body.len()]), whole, "a byte a slice");
    // A cut body that is not JSON falls back as the whole one does.
    let mut h = chat(br#"{"stream":false,"max_tokens":20"#);
    h.body_cuts = vec![5, 0, 7];
    let mut s = Stream::default();
    s.on_request_headers(&cfg, &mut h, false);
    s.on_request_body(&cfg, &mut h, true);
    assert_eq!(h.header(HEADER_RULE), Some("chat"));
}

#[test]
fn body_fallbacks_decide_on_the_headers() {
    let (cfg, names) = module();
    let cases: [(&[(&str, &str)], &[u8], bool, &str); 4] = [
        (&[("content-type", "application/json"), ("content-length", "99999")], b"{}", false, "too_large"),
        (&[("content-type", "application/grpc")], b"{}", false, "not_json"),
        (&[("content-type", "application/json")], b"", true, "missing"),
        (&[("content-type", "application/json")], b"{\"stream\":", false, "invalid_json"),
    ];
    for (headers, body, eos, reason) in cases {
        let mut h = FakeHost::request("POST", "/v1/chat/completions", headers);
        h.body = body.to_vec();
        let mut s = Stream::default();
        if s.on_request_headers(&cfg, &mut h, eos) == Next::Wait {
            assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue);
        }
        assert_eq!(h.header(HEADER_RULE), Some("chat"), "{reason}");
        assert!(counted(&h, &names).contains(&format!("infermesh.body_fallbacks_total.reason.{reason}")), "{reason}: {:?}", counted(&h, &names));
    }
}

#[test]
fn a_chunked_body_past_the_limit_lets_go_at_once() {
    let (cfg, _) = module();
    let mut h = chat(&vec![b' '; 5000]);
    let mut s = Stream::default();
    assert_eq!(s.on_request_headers(&cfg, &mut h, false), Next::Wait);
    assert_eq!(s.on_request_body(&cfg, &mut h, false), Next::Continue, "over body.max_bytes before the end");
    assert_eq!(h.header(HEADER_RULE), Some("chat"));
}

#[test]
fn trailers_end_a_body_that_never_said_end_of_stream() {
    let (cfg, _) = module();
    let mut h = chat(br#"{"stream":false,"max_tokens":4000}"#);
    let mut s = Stream::default();
    s.on_request_headers(&cfg, &mut h, false);
    s.on_request_body(&cfg, &mut h, false);
    assert_eq!(s.on_request_trailers(&cfg, &mut h), Next::Continue);
    assert_eq!(h.header(HEADER_RULE), Some("chat-bulk"));
}

fn report(cfg: &ModuleConfig, value: &str) -> FakeHost {
    let mut h = FakeHost { response: vec![(HEADER_POOL_LEVEL.to_string(), value.to_string()), ("server".into(), "x".into())], ..Default::default() };
    Stream::default().on_response_headers(cfg, &mut h);
    h
}

#[test]
fn the_level_header_is_read_into_the_table_and_never_passed_on() {
    let (cfg, names) = module();
    let h = report(&cfg, "interactive;3;r1");
    assert_eq!(h.response, [("server".to_string(), "x".to_string())]);
    let d = cfg.filter.degraded.as_ref().expect("degraded routing");
    assert!(cfg.pools.is_degraded(d, "interactive", now_ms()));
    assert!(!cfg.pools.is_degraded(d, "batch", now_ms()));
    let bad = report(&cfg, "garbage");
    assert_eq!(counted(&bad, &names), ["infermesh.pool_state_errors_total.reason.bad_header"]);
    // Every sidecar sends its level, but only the pools that shed are kept: a response's reading
    // of another pool (one that sheds nothing, the failover pool of a spilled request) is only
    // removed; a probe's answer naming one is an error.
    let unknown = report(&cfg, "nosuch;1;r1");
    assert_eq!(unknown.response, [("server".to_string(), "x".to_string())]);
    assert_eq!(counted(&unknown, &names), Vec::<String>::new());
    assert_eq!(probe_answer(d, &cfg.pools, Some("200"), Some("nosuch;1;r1"), now_ms()), Err(StateError::UnknownPool));
}

#[test]
fn a_degraded_pools_own_class_is_routed_as_decided_and_the_shed_class_gets_429() {
    let (cfg, names) = module();
    report(&cfg, "interactive;3;r1");
    let mut chat_req = chat(b"{}");
    chat_req.body.clear();
    assert_eq!(Stream::default().on_request_headers(&cfg, &mut chat_req, true), Next::Continue);
    assert_eq!(chat_req.header(HEADER_CLASS), Some("interactive"));
    // Spilling it elsewhere is Envoy's (health check + priority failover): the filter leaves
    // the decision as it is and adds nothing.
    assert_eq!(chat_req.header(HEADER_POOL), Some("interactive"), "not rerouted by the filter");
    assert_eq!(chat_req.header("x-infermesh-spilled-from"), None);
    let chat_counts = counted(&chat_req, &names);
    assert!(chat_counts.contains(&"infermesh.requests_total.class.interactive.pool.interactive.rule.chat".to_string()), "{chat_counts:?}");
    assert!(!chat_counts.iter().any(|n| n.contains("shed") || n.contains("spill")), "{chat_counts:?}");
    assert!(!names.iter().any(|n| n.contains("spill")), "no spill counter is defined: {names:?}");

    let mut batch = FakeHost::request("POST", "/v1/completions", &[]);
    assert_eq!(Stream::default().on_request_headers(&cfg, &mut batch, true), Next::Answered);
    let (status, headers, body) = batch.sent.clone().expect("answered at the edge");
    assert_eq!(status, 429);
    assert!(headers.contains(&("retry-after".to_string(), "7".to_string())));
    assert_eq!(body, shed_body("batch").as_bytes());
    assert!(String::from_utf8_lossy(&body).contains("\"type\":\"rate_limit_error\""));
    assert!(counted(&batch, &names).contains(&"infermesh.shed_requests_total.class.batch".to_string()));

    let mut models = FakeHost::request("GET", "/v1/models", &[]);
    assert_eq!(Stream::default().on_request_headers(&cfg, &mut models, true), Next::Continue, "costs no generation: never shed");
    assert_eq!(models.header(HEADER_POOL), Some("batch"));
}

#[test]
fn a_shed_decided_on_the_body_is_answered_from_the_body_hook() {
    let (cfg, _) = module();
    report(&cfg, "interactive;4;r1");
    let mut h = chat(br#"{"stream":false,"max_tokens":2048}"#);
    let mut s = Stream::default();
    assert_eq!(s.on_request_headers(&cfg, &mut h, false), Next::Wait);
    assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Answered);
    assert_eq!(h.sent.as_ref().map(|s| s.0), Some(429));
}

#[test]
fn probes_skip_pools_that_traffic_keeps_fresh_and_read_the_answer() {
    let (cfg, names) = module();
    let d = cfg.filter.degraded.as_ref().expect("degraded routing");
    let now = now_ms();
    assert_eq!(pools_to_probe(d, &cfg.pools, now), [("batch", "pool_batch"), ("interactive", "pool_interactive")]);
    report(&cfg, "interactive;0;r1");
    assert_eq!(pools_to_probe(d, &cfg.pools, now_ms()), [("batch", "pool_batch")]);
    assert_eq!(probe_answer(d, &cfg.pools, None, None, now), Err(StateError::ProbeFailed));
    assert_eq!(probe_answer(d, &cfg.pools, Some("503"), Some("batch;0;r"), now), Err(StateError::ProbeStatus));
    assert_eq!(probe_answer(d, &cfg.pools, Some("200"), None, now), Err(StateError::BadHeader));
    assert_eq!(probe_answer(d, &cfg.pools, Some("200"), Some("batch;4;r"), now), Ok(()));
    assert!(cfg.pools.is_degraded(d, "batch", now));
    // A probe error is counted under the same names as the Wasm filter's.
    assert_eq!(names[cfg.metrics.state_errors[StateError::NoCluster as usize].expect("defined")], "infermesh.pool_state_errors_total.reason.no_cluster");
}

#[test]
fn without_degraded_routing_the_level_header_is_only_removed() {
    let v: serde_json::Value = serde_json::from_str(CONFIG).expect("json");
    let mut o = v.as_object().cloned().expect("object");
    o.remove("degraded_routing");
    let cfg = ModuleConfig::new(FilterConfig::parse(serde_json::to_string(&o).expect("json").as_bytes()).expect("config"), &mut |_| None, &table);
    let h = report(&cfg, "interactive;3;r1");
    assert_eq!(h.response.len(), 1);
    assert!(cfg.pools.newest_ms("interactive") == 0);
}

// ---- the request path on any input, natively (both runtimes run this flow) ----------------------

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
    fn bytes(&mut self, alphabet: &[&[u8]], max: u64) -> Vec<u8> {
        (0..self.below(max + 1)).flat_map(|_| self.pick(alphabet).to_vec()).collect()
    }
}

fn fuzz_budget() -> std::time::Duration {
    let secs = std::env::var("INFERMESH_FUZZ_SECS").ok().and_then(|s| s.parse::<f64>().ok()).unwrap_or(3.0);
    std::time::Duration::from_secs_f64(secs)
}

fn fuzz_seed() -> u64 {
    std::env::var("INFERMESH_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x1f5e_ed28_c0f1_9001)
}

#[test]
fn the_request_path_never_panics_and_never_lets_an_outside_header_through() {
    let (cfg, names) = module();
    let s = fuzz_seed();
    let mut r = Rng(s ^ 0xbeef);
    let names_pool: &[&[u8]] = &[
        b"x-infermesh-class", b"x-infermesh-pool", b"x-infermesh-rule", b"x-infermesh-pool-level", b"x-infermesh-ttft-give-up-ms",
        b"x-infermesh-", b"x-infermesh-x\xff", b"x-priority", b"content-type", b"content-length", b"x-gateway-inference-objective",
        b"endpoint-load-metrics", b"", b"\xff\xfe", b":authority", b"x-infermesh-class-hint",
    ];
    let values: &[&[u8]] = &[
        b"interactive", b"batch", b"high", b"application/json", b"application/grpc", b"0", b"99999999999999999999", b"-1", b" 12 ",
        b"\xff", b"\xed\xa0\x80", b"other", b"", b";", b"text/plain; charset=utf-8", b"application/vnd+json", b"\x00",
    ];
    let sources: &[Option<&str>] = &[None, Some("10.8.0.1:80"), Some("10.9.0.1:80"), Some("[::1]:9"), Some("garbage"), Some(""), Some("10.8.1.1")];
    let bodies: &[&[u8]] = &[
        b"", br#"{"stream":false,"max_tokens":2048}"#, br#"{"max_tokens":1e999}"#, b"{\"model\":\"\xff\"}", br#"{"messages":[[[[[[[[[[[]]]]]]]]]]]}"#,
        br#"{"a":"\ud800"}"#, b"[", b"not json", br#"{"stream":false,"max_tokens":2048,"n":1,"messages":[{"role":"user","content":"hi"}]}"#,
    ];
    let end = std::time::Instant::now() + fuzz_budget();
    let mut n = 0u64;
    while std::time::Instant::now() < end {
        let mut h = FakeHost {
            source: r.pick(sources).map(str::to_string),
            principals: if r.below(4) == 0 { vec![String::from_utf8_lossy(&r.bytes(values, 2)).into_owned()] } else { vec![] },
            ..Default::default()
        };
        h.request.push((b":method".to_vec(), r.pick(&[&b"POST"[..], b"GET", b"post", b"", b"\xff"]).to_vec()));
        h.request.push((b":path".to_vec(), r.pick(&[&b"/v1/chat/completions"[..], b"/v1/completions", b"/", b"", b"/v1/chat/completions?\xff"]).to_vec()));
        for _ in 0..r.below(6) {
            h.request.push((r.pick(names_pool).to_vec(), r.bytes(values, 3)));
        }
        h.body = r.pick(bodies).to_vec();
        if r.below(4) == 0 {
            h.body.extend(std::iter::repeat(b' ').take(r.below(6000) as usize));
        }
        h.body_cuts = vec![r.below(h.body.len() as u64 + 1) as usize];
        let trusted = source_is_trusted(&cfg.filter, &h);
        let mut st = Stream::default();
        let eos = h.body.is_empty() || r.below(8) == 0;
        let mut next = st.on_request_headers(&cfg, &mut h, eos);
        if next == Next::Wait {
            next = st.on_request_body(&cfg, &mut h, r.below(3) != 0);
            if next == Next::Wait {
                next = if r.below(2) == 0 { st.on_request_trailers(&cfg, &mut h) } else { st.on_request_body(&cfg, &mut h, true) };
            }
        }
        assert_ne!(next, Next::Wait, "seed {s}: still waiting after the whole body");
        assert_eq!(next == Next::Answered, h.sent.is_some(), "seed {s}");
        if let Some((status, _, _)) = &h.sent {
            assert_eq!(*status, 429, "seed {s}");
        }
        if !trusted {
            for (k, v) in &h.request {
                if k.starts_with(b"x-infermesh-") {
                    let k = std::str::from_utf8(k).expect("the filter writes UTF-8 names");
                    let v = std::str::from_utf8(v).expect("the filter writes UTF-8 values");
                    assert!([HEADER_CLASS, HEADER_POOL, HEADER_RULE].contains(&k), "seed {s}: {k} from outside passed through");
                    assert!(v == "batch" || v == "interactive" || ["chat-bulk", "hdr-priority", "chat", "default"].contains(&v), "seed {s}: {k}: {v}");
                }
            }
            if next == Next::Continue {
                let one = |name: &str| h.header_count(name);
                assert_eq!((one(HEADER_CLASS), one(HEADER_POOL), one(HEADER_RULE)), (1, 1, 1), "seed {s}: one decision");
            }
        }
        assert!(h.counted.iter().all(|id| *id < names.len()), "seed {s}: a counter nobody defined");
        // The response side: the level header never reaches the client, whatever it says.
        let mut resp = FakeHost::default();
        let level = String::from_utf8_lossy(&r.bytes(&[b"interactive", b"batch", b";", b"3", b"4", b"r1", b"\xff", b" ", b"x"], 6)).into_owned();
        resp.response.push((HEADER_POOL_LEVEL.to_string(), level));
        st.on_response_headers(&cfg, &mut resp);
        assert!(resp.response.is_empty(), "seed {s}");
        n += 1;
    }
    eprintln!("request path fuzz: seed {s}, {n} requests");
    assert!(n > 1000, "too few iterations to mean anything: {n}");
}

// ---- the prefix key (docs/prefix-routing.md) ---------------------------------------------------

const PREFIX_CONFIG: &str = r#"{
  "version": 1,
  "default_class": "plain",
  "classes": {
    "interactive": {"pool": "interactive", "prefix_key": {"max_keys": 4, "chunk_bytes": 64}},
    "batch": {"pool": "batch", "prefix_key": {}},
    "plain": {"pool": "batch"}
  },
  "rules": [
    {"name": "chat-bulk", "class": "batch",
     "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}, "body": {"stream": false}}},
    {"name": "unkeyed", "class": "plain", "match": {"headers": [{"name": "x-plain", "present": true}]}},
    {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
    {"name": "completions", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/completions"}}}
  ],
  "trusted_sources": {"cidrs": ["10.8.0.0/16"]}
}"#;

fn prefix_module() -> (ModuleConfig, Vec<String>) {
    module_of(PREFIX_CONFIG)
}

const TWO_TURNS: &[u8] = br#"{"stream":true,"messages":[{"role":"system","content":"You are tenant 7's assistant."},{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"my order"}]}"#;

/// Headers, then the whole body at once: the request's headers afterwards.
fn decide(cfg: &ModuleConfig, h: &mut FakeHost) -> Next {
    let mut s = Stream::default();
    match s.on_request_headers(cfg, h, h.body.is_empty()) {
        Next::Wait => s.on_request_body(cfg, h, true),
        next => next,
    }
}

fn expected_key(body: &[u8]) -> Option<String> {
    let spec = PrefixSpec { max_keys: 4, chunk_bytes: 64 };
    crate::body::parse_body_keyed(body, spec).unwrap().1.and_then(|k| k.header_value())
}

#[test]
fn a_keyed_class_decided_on_the_headers_waits_for_the_body_and_writes_the_key() {
    let (cfg, names) = prefix_module();
    let mut h = chat(TWO_TURNS);
    let mut s = Stream::default();
    assert_eq!(s.on_request_headers(&cfg, &mut h, false), Next::Wait, "the key needs the body");
    assert_eq!(h.header(HEADER_POOL), None, "nothing written before the body");
    assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue);
    assert_eq!((h.header(HEADER_CLASS), h.header(HEADER_RULE)), (Some("interactive"), Some("chat")));
    let key = h.header(HEADER_PREFIX_KEY).expect("a two-turn chat has a prefix");
    assert_eq!(Some(key.to_string()), expected_key(TWO_TURNS));
    assert_eq!(key.split(',').count(), 3, "before the last turn, before the answer... and the system prompt: {key}");
    assert_eq!(h.route_cache_clears, 1);
    assert_eq!(counted(&h, &names), ["infermesh.requests_total.class.interactive.pool.interactive.rule.chat"]);
}

#[test]
fn a_keyed_class_decided_by_a_body_rule_gets_its_key() {
    let (cfg, _) = prefix_module();
    let body = br#"{"stream":false,"messages":[{"role":"system","content":"Summarise."},{"role":"user","content":"text"}]}"#;
    let mut h = chat(body);
    assert_eq!(decide(&cfg, &mut h), Next::Continue);
    assert_eq!(h.header(HEADER_RULE), Some("chat-bulk"));
    assert_eq!(h.header(HEADER_PREFIX_KEY).map(str::to_string), expected_key(body));
    assert!(h.header(HEADER_PREFIX_KEY).is_some());
}

#[test]
fn completions_are_keyed_by_whole_chunks() {
    let (cfg, _) = prefix_module();
    let body = format!(r#"{{"prompt":"{}"}}"#, "few-shot example. ".repeat(10));
    let mut h = FakeHost::request("POST", "/v1/completions", &[("content-type", "application/json")]);
    h.body = body.clone().into_bytes();
    decide(&cfg, &mut h);
    assert_eq!(h.header(HEADER_RULE), Some("completions"));
    assert_eq!(h.header(HEADER_PREFIX_KEY).map(str::to_string), expected_key(body.as_bytes()));
    assert_eq!(h.header(HEADER_PREFIX_KEY).unwrap().split(',').count(), 2, "180 bytes: two whole chunks of 64");
}

#[test]
fn requests_without_a_usable_prefix_or_a_keyed_class_get_no_key_and_no_wait() {
    let (cfg, _) = prefix_module();
    // A one-turn chat, an empty system prompt: decided on the body, no key.
    for body in [&br#"{"stream":true,"messages":[{"role":"user","content":"hi"}]}"#[..], br#"{"stream":true,"messages":[{"role":"system","content":""},{"role":"user","content":"hi"}]}"#] {
        let mut h = chat(body);
        decide(&cfg, &mut h);
        assert_eq!(h.header(HEADER_RULE), Some("chat"));
        assert_eq!(h.header(HEADER_PREFIX_KEY), None);
    }
    // gRPC, a class without a key, a request without a body, one too large: decided on the
    // headers at once, as without prefix keys (on a path no body rule looks at).
    let cases: [(&str, &[(&str, &str)], bool); 4] = [
        ("/v1/completions", &[("content-type", "application/grpc")], false),
        ("/v1/completions", &[("content-type", "application/json"), ("x-plain", "1")], false),
        ("/v1/completions", &[("content-type", "application/json")], true),
        ("/v1/completions", &[("content-type", "application/json"), ("content-length", "999999")], false),
    ];
    for (path, headers, eos) in cases {
        let mut h = FakeHost::request("POST", path, headers);
        let next = Stream::default().on_request_headers(&cfg, &mut h, eos);
        assert_eq!(next, Next::Continue, "{headers:?}");
        assert!(h.header(HEADER_CLASS).is_some());
        assert_eq!(h.header(HEADER_PREFIX_KEY), None);
    }
    // A GET of a keyed class generates nothing: no key.
    let mut h = FakeHost::request("GET", "/v1/completions", &[("content-type", "application/json")]);
    assert_eq!(Stream::default().on_request_headers(&cfg, &mut h, false), Next::Continue);
}

#[test]
fn a_client_cannot_choose_a_replica_by_sending_the_prefix_key() {
    let (cfg, names) = prefix_module();
    // Spoofed on a request that has a key of its own: the filter's replaces it.
    let mut h = chat(TWO_TURNS);
    h.push(HEADER_PREFIX_KEY, "00000000000000aa");
    decide(&cfg, &mut h);
    assert_eq!(h.header_count(HEADER_PREFIX_KEY), 1);
    assert_eq!(h.header(HEADER_PREFIX_KEY).map(str::to_string), expected_key(TWO_TURNS));
    assert!(counted(&h, &names).contains(&"infermesh.stripped_requests_total".to_string()));
    // On one without a usable prefix, or of a class without keys: none is left.
    for (body, extra) in [(&br#"{"stream":true,"messages":[{"role":"user","content":"hi"}]}"#[..], None), (TWO_TURNS, Some(("x-plain", "1")))] {
        let mut h = chat(body);
        h.push(HEADER_PREFIX_KEY, "00000000000000aa");
        if let Some((k, v)) = extra {
            h.push(k, v);
        }
        decide(&cfg, &mut h);
        assert_eq!(h.header(HEADER_PREFIX_KEY), None);
    }
    // A trusted peer's partial decision (no class and pool): decided here, its key replaced.
    let mut h = chat(TWO_TURNS);
    h.source = Some("10.8.0.9:5000".into());
    h.push(HEADER_PREFIX_KEY, "00000000000000aa");
    decide(&cfg, &mut h);
    assert_eq!(h.header(HEADER_PREFIX_KEY).map(str::to_string), expected_key(TWO_TURNS));
}

// ---- picking by prefix (docs/prefix-routing.md) -------------------------------------------------

const THREE_TURNS: &[u8] = br#"{"stream":true,"messages":[{"role":"system","content":"You are tenant 7's assistant."},{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"my order"},{"role":"assistant","content":"which one?"},{"role":"user","content":"the last"}]}"#;
const REPLICA_A: &str = "127.0.0.1:8001";
const REPLICA_B: &str = "127.0.0.1:8002";

/// One request through the flow and its response (`response`: the upstream's headers, as the
/// stateful session filter leaves them): the request's prefix host and what reached the client.
fn serve(cfg: &ModuleConfig, mut h: FakeHost, response: &[(&str, &str)]) -> (Option<String>, FakeHost) {
    let mut s = Stream::default();
    let eos = h.body.is_empty();
    if s.on_request_headers(cfg, &mut h, eos) == Next::Wait {
        s.on_request_body(cfg, &mut h, true);
    }
    let named = h.header(HEADER_PREFIX_HOST).map(str::to_string);
    h.response = response.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    s.on_response_headers(cfg, &mut h);
    (named, h)
}

fn b64(addr: &str) -> String {
    base64_encode(addr.as_bytes())
}

#[test]
fn a_conversations_next_turn_names_the_replica_that_served_its_last() {
    let (cfg, names) = prefix_module();
    let served_by_a = b64(REPLICA_A);
    // Turn 1: nothing known; the session filter names the LB's pick in the response.
    let (named, h) = serve(&cfg, chat(TWO_TURNS), &[(":status", "200"), (HEADER_PREFIX_HOST, &served_by_a), (HEADER_LOAD, "0.250")]);
    assert_eq!(named, None);
    assert_eq!(h.response, [(":status".to_string(), "200".to_string())], "both internal headers removed");
    assert!(counted(&h, &names).contains(&"infermesh.prefix_learned_total".to_string()));
    // Turn 2 repeats turn 1's messages: named A; A served it (the response says nothing).
    let (named, h) = serve(&cfg, chat(THREE_TURNS), &[(":status", "200"), (HEADER_LOAD, "0.300")]);
    assert_eq!(named.as_deref(), Some(served_by_a.as_str()));
    assert!(counted(&h, &names).contains(&"infermesh.prefix_named_total".to_string()));
    // Another conversation of the same tenant shares only the system prompt: named A too.
    let other = br#"{"stream":true,"messages":[{"role":"system","content":"You are tenant 7's assistant."},{"role":"user","content":"a new question"}]}"#;
    let (named, _) = serve(&cfg, chat(other), &[(":status", "200")]);
    assert_eq!(named.as_deref(), Some(served_by_a.as_str()), "its system prompt's key");
    // A replica past the bound is not named; the response names B, which the keys now map to.
    cfg.prefixes.report_load("interactive", REPLICA_A, 0.95, now_ms());
    let (named, h) = serve(&cfg, chat(THREE_TURNS), &[(":status", "200"), (HEADER_PREFIX_HOST, &b64(REPLICA_B)), (HEADER_LOAD, "0.100")]);
    assert_eq!(named, None);
    assert!(counted(&h, &names).contains(&"infermesh.prefix_over_bound_total".to_string()));
    let (named, _) = serve(&cfg, chat(THREE_TURNS), &[(":status", "200")]);
    assert_eq!(named.as_deref(), Some(b64(REPLICA_B).as_str()));
}

#[test]
fn a_refusal_or_an_unreadable_host_teaches_nothing() {
    let (cfg, _) = prefix_module();
    serve(&cfg, chat(TWO_TURNS), &[(":status", "429"), (HEADER_PREFIX_HOST, &b64(REPLICA_A))]);
    serve(&cfg, chat(TWO_TURNS), &[(":status", "200"), (HEADER_PREFIX_HOST, "not base64!")]);
    // Nothing named and no session filter's word: where it went is unknown.
    serve(&cfg, chat(TWO_TURNS), &[(":status", "200")]);
    let (named, _) = serve(&cfg, chat(THREE_TURNS), &[(":status", "200")]);
    assert_eq!(named, None);
}

#[test]
fn a_client_cannot_choose_a_replica_by_sending_the_prefix_host() {
    let (cfg, _) = prefix_module();
    serve(&cfg, chat(TWO_TURNS), &[(":status", "200"), (HEADER_PREFIX_HOST, &b64(REPLICA_A))]);
    // Spoofed on a keyed request: stripped, the filter's own named.
    let mut h = chat(THREE_TURNS);
    h.push(HEADER_PREFIX_HOST, &b64(REPLICA_B));
    let (named, h) = serve(&cfg, h, &[(":status", "200")]);
    assert_eq!(named, Some(b64(REPLICA_A)));
    assert_eq!(h.header_count(HEADER_PREFIX_HOST), 1);
    // On a request without a key, of a class without keys, from a trusted peer's partial
    // decision without a key: none is left.
    for (body, extra) in [(&br#"{"stream":true,"messages":[{"role":"user","content":"hi"}]}"#[..], None), (TWO_TURNS, Some(("x-plain", "1")))] {
        let mut h = chat(body);
        h.push(HEADER_PREFIX_HOST, &b64(REPLICA_B));
        if let Some((k, v)) = extra {
            h.push(k, v);
        }
        assert_eq!(serve(&cfg, h, &[]).0, None);
    }
    let mut h = chat(br#"{"stream":true,"messages":[{"role":"user","content":"hi"}]}"#);
    h.source = Some("10.8.0.9:5000".into());
    h.push(HEADER_PREFIX_HOST, &b64(REPLICA_B));
    assert_eq!(serve(&cfg, h, &[]).0, None);
}

#[test]
fn every_response_loses_the_internal_prefix_headers_keyed_or_not() {
    let (cfg, names) = module();
    let mut h = FakeHost::request("GET", "/v1/models", &[]);
    h.response = vec![(HEADER_PREFIX_HOST.into(), b64(REPLICA_A)), (HEADER_LOAD.into(), "0.5".into()), ("x-ok".into(), "1".into())];
    Stream::default().on_response_headers(&cfg, &mut h);
    assert_eq!(h.response, [("x-ok".to_string(), "1".to_string())]);
    assert!(!names.iter().any(|n| n.contains("prefix")), "no prefix counters without a keyed class: {names:?}");
}

/// A content rule through the flow: the body buffered, the label computed from the host's
/// segments (however cut), and the decision written; no text, or another label, falls through.
#[test]
fn a_content_rule_decides_on_the_bodys_text() {
    let rust = (crate::content_classifier::fnv1a(b"wrust") & 255) as usize;
    let model = crate::content_classifier::tests::model_json(&["chat", "code"], 256, 2, [3, 4], 4096, |b, l| if b == rust && l == 1 { 100 } else { 0 });
    let config = format!(
        r#"{{"version": 1, "default_class": "batch", "content_model": {model},
            "classes": {{"interactive": {{"pool": "interactive"}}, "batch": {{"pool": "batch"}}, "code": {{"pool": "code"}}}},
            "rules": [
              {{"name": "code", "class": "code", "match": {{"path": {{"prefix": "/v1/"}}, "content": {{"label": "code", "min_score": 0.6}}}}}},
              {{"name": "chat", "class": "interactive", "match": {{"path": {{"prefix": "/v1/chat/completions"}}}}}}
            ]}}"#
    );
    let (cfg, _) = module_of(&config);
    let body = br#"{"model": "m", "messages": [{"role": "user", "content": "my Rust code does not build, rust says E0502"}]}"#;
    for cut in [0, 1, 40, 70, body.len() - 1] {
        let mut h = chat(body);
        h.body_cuts = vec![cut];
        let mut s = Stream::default();
        assert_eq!(s.on_request_headers(&cfg, &mut h, false), Next::Wait);
        assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue);
        assert_eq!((h.header(HEADER_CLASS), h.header(HEADER_RULE)), (Some("code"), Some("code")), "cut at {cut}");
    }
    for other in [&br#"{"messages": [{"role": "user", "content": "hello there"}]}"#[..], br#"{"messages": []}"#, b"{not json"] {
        let mut h = chat(other);
        let mut s = Stream::default();
        assert_eq!(s.on_request_headers(&cfg, &mut h, false), Next::Wait);
        assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue);
        assert_eq!(h.header(HEADER_RULE), Some("chat"), "{}", String::from_utf8_lossy(other));
    }
    // gRPC: no JSON body to read, decided on the headers.
    let mut h = FakeHost::request("POST", "/v1/x.Inference/Generate", &[("content-type", "application/grpc")]);
    assert_eq!(Stream::default().on_request_headers(&cfg, &mut h, false), Next::Continue);
    assert_eq!(h.header(HEADER_RULE), Some("default"));
}

// ---- token budgets (token_budget.rs, docs/token-budgets.md) -------------------------------------

const BUDGET_CONFIG: &str = r#"{
  "version": 1,
  "default_class": "batch",
  "classes": {"interactive": {"pool": "interactive"}, "batch": {"pool": "batch"}},
  "rules": [
    {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
    {"name": "bulk", "class": "batch", "match": {"body": {"stream": false}}}
  ],
  "trusted_sources": {"cidrs": ["10.8.0.0/16"]},
  "budgets": {"tenant": {"header": "x-tenant-id"}, "classes": {
    "interactive": {"default_max_tokens": 100,
      "default": {"tokens": {"per_minute": 1000}, "concurrent_streams": 2},
      "tenants": {"team-a": {"tokens": {"per_minute": 200, "per_day": 100000}}}},
    "batch": {"tenants": {"team-a": {"tokens": {"per_hour": 50}, "count": {"input": 0, "output": 1}}}}}}
}"#;

/// 10:00:15 into a minute: the minute window resets in 45 s.
const T0: u64 = 1_800_000_000_000 - 1_800_000_000_000 % 60_000 + 15_000;

/// A chat of one 5-byte message asking for `max_tokens`: it reserves 5 + 8 + max_tokens.
fn budgeted_chat(tenant: Option<&str>, source: &str, max_tokens: u64) -> FakeHost {
    let mut h = chat(format!(r#"{{"max_tokens":{max_tokens},"stream":true,"messages":[{{"role":"user","content":"hello"}}]}}"#).as_bytes());
    if let Some(t) = tenant {
        h.push("x-tenant-id", t);
    }
    h.source = Some(source.to_string());
    h.now = Some(T0);
    h
}

fn sent_header<'a>(h: &'a FakeHost, name: &str) -> Option<&'a str> {
    h.sent.as_ref().and_then(|(_, hs, _)| hs.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str()))
}

fn response(status: &str) -> FakeHost {
    FakeHost { response: vec![(":status".to_string(), status.to_string())], now: Some(T0), ..Default::default() }
}

fn record(cfg: &ModuleConfig, class: &str, tenant: &str) -> Record {
    let mut rec = Record::default();
    cfg.budgets.update(&record_key(class, tenant), &mut |r| {
        rec = *r;
        false
    });
    rec
}

#[test]
fn a_tenant_over_its_budget_is_refused_before_any_upstream_work_and_another_is_served() {
    let (cfg, names) = module_of(BUDGET_CONFIG);
    let trusted = "10.8.0.7:5000";
    let mut streams = Vec::new();
    for i in 0..3 {
        let mut h = budgeted_chat(Some("team-a"), trusted, 50);
        let mut s = Stream::default();
        assert_eq!(s.on_request_headers(&cfg, &mut h, false), Next::Wait, "a budgeted class waits for the body");
        assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue, "request {i}: 63 tokens fit");
        assert_eq!(h.header(HEADER_CLASS), Some("interactive"));
        let mut r = response("200");
        s.on_response_headers(&cfg, &mut r);
        let remaining = 200 - 63 * (i + 1);
        assert_eq!(r.response_header("x-ratelimit-remaining-tokens"), Some(remaining.to_string()), "the served response says what is left");
        assert_eq!(r.response_header("x-ratelimit-limit-tokens").as_deref(), Some("200"));
        assert_eq!(r.response_header("x-ratelimit-reset-tokens").as_deref(), Some("45s"));
        streams.push(s);
    }
    let mut h = budgeted_chat(Some("team-a"), trusted, 50);
    assert_eq!(decide(&cfg, &mut h), Next::Answered);
    let (status, _, body) = h.sent.clone().expect("answered");
    assert_eq!(status, 429);
    assert_eq!(sent_header(&h, "retry-after"), Some("45"));
    assert_eq!(sent_header(&h, "x-ratelimit-limit-tokens"), Some("200"));
    assert_eq!(sent_header(&h, "x-ratelimit-remaining-tokens"), Some("11"));
    assert_eq!(sent_header(&h, "x-ratelimit-reset-tokens"), Some("45s"));
    let body: serde_json::Value = serde_json::from_slice(&body).expect("OpenAI error JSON");
    assert_eq!(body["error"]["code"], "token_budget_exceeded");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert_eq!(h.header(HEADER_CLASS), None, "nothing written: the request never goes upstream");
    assert!(counted(&h, &names).contains(&"infermesh.budget_refusals_total.class.interactive.tenant.team-a".to_string()));
    // Another tenant (not listed: the default budget, its own record) is served.
    let mut other = budgeted_chat(Some("team-b"), trusted, 50);
    assert_eq!(decide(&cfg, &mut other), Next::Continue);
    assert_eq!(record(&cfg, "interactive", "team-a").windows[0].1, 189);
    for mut s in streams {
        s.on_stream_end(&cfg);
    }
    assert_eq!(record(&cfg, "interactive", "team-a").streams, 0);
}

#[test]
fn a_client_cannot_pick_its_tenant_by_sending_the_header() {
    let (cfg, names) = module_of(BUDGET_CONFIG);
    // From outside the trust rules the header is removed and the request is `other`'s.
    let mut h = budgeted_chat(Some("team-b"), "192.168.1.5:4000", 50);
    assert_eq!(decide(&cfg, &mut h), Next::Continue);
    assert_eq!(h.header("x-tenant-id"), None, "stripped before it reaches a pool");
    assert_eq!(record(&cfg, "interactive", "other").windows[0].1, 63);
    // `other` shares the default budget (1000/min): a client naming itself team-a from outside
    // still lands there, and cannot spend team-a's.
    for _ in 0..14 {
        let mut h = budgeted_chat(Some("team-a"), "192.168.1.5:4000", 50);
        let mut s = Stream::default();
        assert_eq!(s.on_request_headers(&cfg, &mut h, false), Next::Wait);
        s.on_request_body(&cfg, &mut h, true);
        s.on_stream_end(&cfg);
    }
    assert_eq!(record(&cfg, "interactive", "other").windows[0].1, 63 * 15);
    assert_eq!(record(&cfg, "interactive", "team-a").windows[0].1, 0);
    let mut h = budgeted_chat(None, "192.168.1.5:4000", 50);
    assert_eq!(decide(&cfg, &mut h), Next::Answered);
    assert!(counted(&h, &names).contains(&"infermesh.budget_refusals_total.class.interactive.tenant.other".to_string()));
    // A trusted source's header is believed, and kept for the sidecar.
    let mut h = budgeted_chat(Some("team-a"), "10.8.1.1:80", 50);
    assert_eq!(decide(&cfg, &mut h), Next::Continue);
    assert_eq!(h.header("x-tenant-id"), Some("team-a"));
    assert_eq!(record(&cfg, "interactive", "team-a").windows[0].1, 63);
}

#[test]
fn an_upstream_error_gives_the_tokens_back_and_the_streams_end_its_slot() {
    let (cfg, _) = module_of(BUDGET_CONFIG);
    let trusted = "10.8.0.7:5000";
    for status in ["503", "429", "400", "504"] {
        let mut h = budgeted_chat(Some("team-a"), trusted, 150);
        let mut s = Stream::default();
        s.on_request_headers(&cfg, &mut h, false);
        assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue);
        assert_eq!(record(&cfg, "interactive", "team-a").windows[0].1, 163);
        let mut r = response(status);
        s.on_response_headers(&cfg, &mut r);
        assert_eq!(record(&cfg, "interactive", "team-a").windows[0].1, 0, "{status}: nothing was generated");
        assert_eq!(r.response_header("x-ratelimit-remaining-tokens"), None);
        s.on_stream_end(&cfg);
        s.on_stream_end(&cfg);
        assert_eq!(record(&cfg, "interactive", "team-a"), Record { windows: record(&cfg, "interactive", "team-a").windows, streams: 0 });
    }
    // Served: the reservation stays charged (it bounds what was generated).
    let mut h = budgeted_chat(Some("team-a"), trusted, 150);
    let mut s = Stream::default();
    s.on_request_headers(&cfg, &mut h, false);
    s.on_request_body(&cfg, &mut h, true);
    s.on_response_headers(&cfg, &mut response("200"));
    s.on_stream_end(&cfg);
    assert_eq!(record(&cfg, "interactive", "team-a").windows[0].1, 163);
    // Concurrent streams of the default budget (2): a third is refused until one ends.
    let mut open: Vec<Stream> = (0..2)
        .map(|_| {
            let mut h = budgeted_chat(Some("team-c"), trusted, 10);
            let mut s = Stream::default();
            s.on_request_headers(&cfg, &mut h, false);
            assert_eq!(s.on_request_body(&cfg, &mut h, true), Next::Continue);
            s
        })
        .collect();
    let mut third = budgeted_chat(Some("team-c"), trusted, 10);
    assert_eq!(decide(&cfg, &mut third), Next::Answered);
    assert_eq!(sent_header(&third, "retry-after"), Some("1"));
    assert!(String::from_utf8_lossy(&third.sent.as_ref().expect("answered").2).contains("2 streams are already in flight"));
    // A client that vanished: Envoy destroys the stream with no response at all.
    open[0].on_stream_end(&cfg);
    let mut fourth = budgeted_chat(Some("team-c"), trusted, 10);
    assert_eq!(decide(&cfg, &mut fourth), Next::Continue);
    open.truncate(0);
}

#[test]
fn the_reservation_counts_the_body_weighted_and_a_header_decision_without_a_body_too() {
    let (cfg, _) = module_of(BUDGET_CONFIG);
    // batch/team-a counts output only (50 per hour): a body rule's decision reads the body anyway.
    let mut h = budgeted_chat(Some("team-a"), "10.8.0.1:1", 0);
    h.request.retain(|(k, _)| k != b":path");
    h.push(":path", "/v1/completions");
    h.body = br#"{"stream":false,"prompt":"\u00e9\u4e2d long prompt text","max_tokens":20,"n":2}"#.to_vec();
    assert_eq!(decide(&cfg, &mut h), Next::Continue);
    assert_eq!(h.header(HEADER_CLASS), Some("batch"));
    assert_eq!(record(&cfg, "batch", "team-a").windows[1].1, 40, "output only: n x max_tokens");
    let mut again = budgeted_chat(Some("team-a"), "10.8.0.1:1", 0);
    again.request.retain(|(k, _)| k != b":path");
    again.push(":path", "/v1/completions");
    again.body = br#"{"stream":false,"prompt":"x","max_tokens":11}"#.to_vec();
    assert_eq!(decide(&cfg, &mut again), Next::Answered, "40 + 11 > 50 per hour");
    // Not a generation request: never budgeted, never waits.
    let mut models = FakeHost::request("GET", "/v1/models", &[("x-tenant-id", "team-a")]);
    models.source = Some("10.8.0.1:1".into());
    assert_eq!(Stream::default().on_request_headers(&cfg, &mut models, true), Next::Continue);
    // A chat whose body is not read (no JSON content type): its length stands for the prompt,
    // the class default for the completion.
    let mut raw = budgeted_chat(Some("team-z"), "10.8.0.1:1", 50);
    raw.request.retain(|(k, _)| k != b"content-type");
    raw.push("content-type", "text/plain");
    raw.push("content-length", &raw.body.len().to_string());
    let len = raw.body.len() as u64;
    assert_eq!(Stream::default().on_request_headers(&cfg, &mut raw, false), Next::Continue);
    let mut rec = Record::default();
    let key = record_key("interactive", &crate::token_budget::charged(&cfg.filter.budgets.as_ref().unwrap().classes["interactive"], Some("team-z")).record);
    cfg.budgets.update(&key, &mut |r| {
        rec = *r;
        false
    });
    assert_eq!(rec.windows[0].1, len + 100);
}

#[test]
fn an_api_key_tenant_is_the_hash_of_the_key() {
    let cfg = BUDGET_CONFIG
        .replace(r#""tenant": {"header": "x-tenant-id"}"#, r#""tenant": {"api_key_hash": true}"#)
        .replace(r#""team-a": {"tokens": {"per_minute": 200, "per_day": 100000}}"#, r#""8879f6a4ae35c420": {"tokens": {"per_minute": 70}}"#)
        .replace(r#""team-a": {"tokens": {"per_hour": 50}"#, r#""8879f6a4ae35c420": {"tokens": {"per_hour": 50}"#);
    let (cfg, names) = module_of(&cfg);
    let mut h = budgeted_chat(None, "192.168.0.1:1", 50);
    h.push("authorization", "Bearer sk-team-a");
    assert_eq!(decide(&cfg, &mut h), Next::Continue, "any source: the key is the tenant");
    assert_eq!(record(&cfg, "interactive", "8879f6a4ae35c420").windows[0].1, 63);
    let mut h = budgeted_chat(None, "192.168.0.1:1", 50);
    h.push("authorization", "Bearer sk-team-a");
    assert_eq!(decide(&cfg, &mut h), Next::Answered);
    assert!(counted(&h, &names).contains(&"infermesh.budget_refusals_total.class.interactive.tenant.8879f6a4ae35c420".to_string()));
    let mut h = budgeted_chat(None, "192.168.0.1:1", 50);
    h.push("authorization", "Bearer sk-someone-else");
    assert_eq!(decide(&cfg, &mut h), Next::Continue);
}

#[test]
fn the_request_path_never_panics_with_budgets_and_every_slot_comes_back() {
    let (cfg, names) = module_of(BUDGET_CONFIG);
    let s = fuzz_seed();
    let mut r = Rng(s ^ 0xb0d6e7);
    let names_pool: &[&[u8]] = &[
        b"x-tenant-id", b"x-tenant-id", b"authorization", b"x-api-key", b"content-type", b"content-length", b"x-infermesh-class", b"\xff",
    ];
    let values: &[&[u8]] = &[
        b"team-a", b"team-b", b"other", b"Bearer k", b"application/json", b"0", b"18446744073709551616", b"\xff", b"", b" 5 ", b"~1",
    ];
    let sources: &[Option<&str>] = &[None, Some("10.8.0.1:80"), Some("10.9.0.1:80"), Some("garbage")];
    let bodies: &[&[u8]] = &[
        b"", br#"{"max_tokens":18446744073709551615,"n":18446744073709551615,"messages":[{"content":"x"}]}"#, br#"{"max_tokens":-1}"#,
        br#"{"messages":[{"role":"user","content":"\ud83d\ude00\u00e9"}],"max_completion_tokens":3}"#, b"[", b"{\"prompt\":\"\xff\"}",
        br#"{"stream":false,"prompt":[1,2,3],"max_tokens":1}"#, br#"{"messages":[{},{},{}],"n":0}"#,
    ];
    let statuses = ["200", "429", "503", "", "abc", "99999999999", "302"];
    let end = std::time::Instant::now() + fuzz_budget();
    let (mut n, mut refused) = (0u64, 0u64);
    while std::time::Instant::now() < end {
        let mut h = FakeHost { source: r.pick(sources).map(str::to_string), now: Some(T0 + r.below(200_000)), ..Default::default() };
        h.request.push((b":method".to_vec(), r.pick(&[&b"POST"[..], b"GET"]).to_vec()));
        h.request.push((b":path".to_vec(), r.pick(&[&b"/v1/chat/completions"[..], b"/v1/completions", b"/v1/messages"]).to_vec()));
        for _ in 0..r.below(5) {
            h.request.push((r.pick(names_pool).to_vec(), r.bytes(values, 2)));
        }
        h.body = r.pick(bodies).to_vec();
        h.body_cuts = vec![r.below(h.body.len() as u64 + 1) as usize];
        let trusted = source_is_trusted(&cfg.filter, &h);
        let mut st = Stream::default();
        let eos = h.body.is_empty();
        let mut next = st.on_request_headers(&cfg, &mut h, eos);
        if next == Next::Wait {
            next = st.on_request_body(&cfg, &mut h, true);
        }
        assert_ne!(next, Next::Wait, "seed {s}");
        if let Some((status, _, _)) = &h.sent {
            assert_eq!(*status, 429, "seed {s}");
            assert!(sent_header(&h, "retry-after").is_some(), "seed {s}: every refusal says when to retry");
            refused += 1;
        }
        if !trusted {
            assert_eq!(h.header_count("x-tenant-id"), 0, "seed {s}: an outside tenant header passed through");
        }
        assert!(h.counted.iter().all(|id| *id < names.len()), "seed {s}: a counter nobody defined");
        if r.below(3) != 0 {
            let mut resp = response(*r.pick(&statuses));
            st.on_response_headers(&cfg, &mut resp);
        }
        st.on_stream_end(&cfg);
        n += 1;
    }
    for (class, tenant) in [("interactive", "team-a"), ("interactive", "other"), ("batch", "team-a")] {
        assert_eq!(record(&cfg, class, tenant).streams, 0, "seed {s}: {class}/{tenant}: every stream's slot came back");
    }
    eprintln!("request path fuzz with budgets: seed {s}, {n} requests, {refused} refused");
    assert!(n > 1000 && refused > 0, "{n} requests, {refused} refused");
}
