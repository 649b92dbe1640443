//! Pure request classification: no host calls, no panics.
//!
//! Rules are tried in order. A rule whose header-side conditions (method, path, headers) hold
//! and that has body conditions needs the body: the caller buffers it and asks again. When the
//! body cannot be had (too large, not JSON, invalid, absent) rules with body conditions are
//! skipped — the documented header-only decision — and the reason is reported.

use crate::body::BodyFacts;
use crate::config::{BodyMatch, ContentMatch, FilterConfig, HeaderCond, Rule};
use crate::content_classifier::ContentLabel;

/// What the classifier may look at. The glue implements it over Envoy's header map; tests use
/// a plain struct.
pub trait RequestView {
    fn header(&self, name: &str) -> Option<&str>;
    /// The `:method` pseudo-header (a view that holds the pseudo-headers apart overrides these).
    fn method(&self) -> Option<&str> {
        self.header(":method")
    }
    /// The `:path` pseudo-header, query string included.
    fn path(&self) -> Option<&str> {
        self.header(":path")
    }
}

/// Why the body could not be used; each has a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// Over `body.max_bytes` (by Content-Length, or while buffering a chunked body).
    TooLarge,
    /// Content-Type is not JSON (e.g. gRPC, form data).
    NotJson,
    /// Not a JSON object.
    InvalidJson,
    /// The request has no body.
    Missing,
}

impl Fallback {
    pub const ALL: [Fallback; 4] = [Fallback::TooLarge, Fallback::NotJson, Fallback::InvalidJson, Fallback::Missing];

    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::TooLarge => "too_large",
            Fallback::NotJson => "not_json",
            Fallback::InvalidJson => "invalid_json",
            Fallback::Missing => "missing",
        }
    }
}

/// The body as far as the classifier knows it.
#[derive(Debug, Clone, Copy)]
pub enum Body<'a> {
    /// Not read yet: a rule that needs it stops the decision.
    NotYet,
    /// Its facts, and its content label as far as it is known.
    Parsed(&'a BodyFacts, Content),
    Unavailable(Fallback),
}

/// The request's content label (content_classifier.rs), computed only when a rule whose other
/// conditions hold has a `content` condition.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Content {
    /// Not computed yet: such a rule stops the decision (`Outcome::NeedContent`).
    NotYet,
    /// Computed; `None`: the request has no text (no label).
    Known(Option<ContentLabel>),
}

/// The outcome written back into the request headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision<'c> {
    pub class: &'c str,
    pub pool: &'c str,
    /// The rule that matched, or `default` when none did.
    pub rule: &'c str,
    pub objective: &'c str,
    /// Set when a body rule was skipped because the body could not be used.
    pub fallback: Option<Fallback>,
    /// Index of the rule in the config; `rules.len()` for the default.
    pub rule_index: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<'c> {
    Decided(Decision<'c>),
    /// The first applicable rule needs the body.
    NeedBody,
    /// The first rule whose other conditions hold needs the content label (the body is in):
    /// ask again with `Content::Known`.
    NeedContent,
}

/// The rule name reported when no rule matched.
pub const DEFAULT_RULE: &str = "default";
/// The rule name reported when a trusted source's own decision was kept.
pub const TRUSTED_RULE: &str = "trusted";

/// Decide the class and pool of a request.
pub fn classify<'c>(config: &'c FilterConfig, req: &dyn RequestView, body: Body<'_>) -> Outcome<'c> {
    let path = req.path().map(strip_query);
    let mut fallback = None;
    for (rule_index, rule) in config.rules.iter().enumerate() {
        if !head_matches(rule, req, path) {
            continue;
        }
        if rule.needs_body() {
            match body {
                Body::NotYet => return Outcome::NeedBody,
                Body::Parsed(facts, content) => {
                    if !rule.body.as_ref().map_or(true, |bm| body_matches(bm, facts)) {
                        continue;
                    }
                    match (&rule.content, content) {
                        (None, _) => {}
                        (Some(_), Content::NotYet) => return Outcome::NeedContent,
                        (Some(cm), Content::Known(label)) => {
                            if !content_matches(cm, label) {
                                continue;
                            }
                        }
                    }
                }
                Body::Unavailable(why) => {
                    fallback = Some(why);
                    continue;
                }
            }
        }
        return Outcome::Decided(Decision {
            class: &rule.class,
            pool: &rule.pool,
            rule: &rule.name,
            objective: &rule.objective,
            fallback,
            rule_index,
        });
    }
    Outcome::Decided(Decision {
        class: &config.default_class,
        pool: &config.default_pool,
        rule: DEFAULT_RULE,
        objective: &config.default_objective,
        fallback,
        rule_index: config.rules.len(),
    })
}

fn strip_query(path: &str) -> &str {
    match path.find(['?', '#']) {
        Some(i) => &path[..i],
        None => path,
    }
}

fn head_matches(rule: &Rule, req: &dyn RequestView, path: Option<&str>) -> bool {
    if !rule.methods.is_empty() {
        match req.method() {
            Some(m) if rule.methods.iter().any(|x| x.eq_ignore_ascii_case(m)) => {}
            _ => return false,
        }
    }
    if let Some(pm) = &rule.path {
        match path {
            Some(p) if pm.matches(p) => {}
            _ => return false,
        }
    }
    rule.headers.iter().all(|h| match (&h.cond, req.header(&h.name)) {
        (HeaderCond::Present, v) => v.is_some(),
        (HeaderCond::Absent, v) => v.is_none(),
        (HeaderCond::Value(m), Some(v)) => m.matches(v),
        (HeaderCond::Value(_), None) => false,
    })
}

fn content_matches(m: &ContentMatch, label: Option<ContentLabel>) -> bool {
    label.map_or(false, |l| l.index == m.label && l.score >= m.min_score)
}

fn body_matches(m: &BodyMatch, f: &BodyFacts) -> bool {
    if let Some(want) = m.stream {
        if f.stream.unwrap_or(false) != want {
            return false;
        }
    }
    let range = |r: &Option<crate::config::Range>, v: Option<u64>| match (r, v) {
        (None, _) => true,
        (Some(r), Some(v)) => r.contains(v),
        (Some(_), None) => false,
    };
    let text = |s: &Option<crate::config::StringMatch>, v: &Option<String>| match (s, v) {
        (None, _) => true,
        (Some(s), Some(v)) => s.matches(v),
        (Some(_), None) => false,
    };
    range(&m.max_tokens, f.token_budget())
        && range(&m.n, Some(f.n.unwrap_or(1)))
        && range(&m.message_count, Some(f.message_count))
        && range(&m.prompt_chars, Some(f.prompt_chars))
        && text(&m.model, &f.model)
        && text(&m.priority, &f.priority)
        && text(&m.service_tier, &f.service_tier)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::parse_body;
    use std::collections::HashMap;

    pub(crate) struct FakeRequest {
        pub method: String,
        pub path: String,
        pub headers: HashMap<String, String>,
    }

    impl RequestView for FakeRequest {
        fn method(&self) -> Option<&str> {
            Some(&self.method)
        }
        fn path(&self) -> Option<&str> {
            Some(&self.path)
        }
        fn header(&self, name: &str) -> Option<&str> {
            self.headers.get(name).map(|s| s.as_str())
        }
    }

    fn req(method: &str, path: &str) -> FakeRequest {
        FakeRequest { method: method.into(), path: path.into(), headers: HashMap::new() }
    }

    fn config() -> FilterConfig {
        FilterConfig::parse(
            br#"{"version": 1, "default_class": "batch",
                "classes": {"interactive": {"pool": "h100"}, "batch": {"pool": "l4"}, "premium": {"pool": "h100", "objective": "gold"}},
                "rules": [
                  {"name": "priority-header", "class": "interactive",
                   "match": {"headers": [{"name": "x-priority", "exact": "high"}]}},
                  {"name": "premium-tier", "class": "premium",
                   "match": {"path": {"prefix": "/v1/"}, "body": {"service_tier": {"exact": "priority"}}}},
                  {"name": "long-chat", "class": "batch",
                   "match": {"path": {"exact": "/v1/chat/completions"}, "body": {"max_tokens": {"min": 2048}}}},
                  {"name": "bulk-n", "class": "batch",
                   "match": {"path": {"exact": "/v1/chat/completions"}, "body": {"n": {"min": 4}}}},
                  {"name": "chat", "class": "interactive",
                   "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
                  {"name": "streamed", "class": "interactive",
                   "match": {"path": {"regex": "^/v1/completions$"}, "body": {"stream": true, "prompt_chars": {"max": 2000}}}},
                  {"name": "grpc-generate", "class": "interactive",
                   "match": {"path": {"exact": "/infermesh.v1.Inference/Generate"},
                             "headers": [{"name": "x-infermesh-class-hint", "present": false}]}}
                ]}"#,
        )
        .unwrap()
    }

    /// As the request flow decides: on the headers, then on the body's facts, then (when a
    /// content rule is reached) with its content label.
    pub(crate) fn decide<'c>(c: &'c FilterConfig, r: &FakeRequest, body: &[u8]) -> Decision<'c> {
        match classify(c, r, Body::NotYet) {
            Outcome::Decided(d) => d,
            Outcome::NeedContent => panic!("asked for the content before the body"),
            Outcome::NeedBody => {
                let facts = parse_body(body);
                let b = match &facts {
                    Ok(f) => Body::Parsed(f, Content::NotYet),
                    Err(_) => Body::Unavailable(Fallback::InvalidJson),
                };
                match classify(c, r, b) {
                    Outcome::Decided(d) => d,
                    Outcome::NeedBody => panic!("asked for the body twice"),
                    Outcome::NeedContent => {
                        let label = c.content_model.as_ref().unwrap().classify_body(&[body]).label;
                        match classify(c, r, Body::Parsed(facts.as_ref().unwrap(), Content::Known(label))) {
                            Outcome::Decided(d) => d,
                            other => panic!("asked again with the label: {other:?}"),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn header_rule_decides_without_the_body() {
        let c = config();
        let mut r = req("POST", "/v1/chat/completions");
        r.headers.insert("x-priority".into(), "high".into());
        assert!(matches!(classify(&c, &r, Body::NotYet), Outcome::Decided(Decision { rule: "priority-header", .. })));
    }

    #[test]
    fn body_rules_before_a_header_rule_need_the_body() {
        let c = config();
        assert_eq!(classify(&c, &req("POST", "/v1/chat/completions"), Body::NotYet), Outcome::NeedBody);
    }

    #[test]
    fn no_body_rule_applies_no_buffering() {
        let c = config();
        // /v2/ matches no body rule's head: decided on headers alone.
        assert!(matches!(classify(&c, &req("POST", "/v2/x"), Body::NotYet), Outcome::Decided(Decision { rule: DEFAULT_RULE, .. })));
    }

    #[test]
    fn chat_by_body() {
        let c = config();
        let r = req("POST", "/v1/chat/completions");
        let d = decide(&c, &r, br#"{"messages":[{"role":"user","content":"hi"}],"stream":true}"#);
        assert_eq!((d.class, d.pool, d.rule, d.fallback), ("interactive", "h100", "chat", None));
        assert_eq!(decide(&c, &r, br#"{"max_tokens": 4096}"#).rule, "long-chat");
        assert_eq!(decide(&c, &r, br#"{"max_completion_tokens": 4096, "max_tokens": 5}"#).rule, "long-chat");
        assert_eq!(decide(&c, &r, br#"{"n": 8}"#).rule, "bulk-n");
        let d = decide(&c, &r, br#"{"service_tier": "priority"}"#);
        assert_eq!((d.class, d.pool, d.objective), ("premium", "h100", "gold"));
    }

    #[test]
    fn completions_stream_and_size() {
        let c = config();
        let r = req("POST", "/v1/completions");
        assert_eq!(decide(&c, &r, br#"{"prompt":"hi","stream":true}"#).rule, "streamed");
        assert_eq!(decide(&c, &r, br#"{"prompt":"hi"}"#).rule, DEFAULT_RULE);
        let long = format!("{{\"prompt\":\"{}\",\"stream\":true}}", "x".repeat(2001));
        assert_eq!(decide(&c, &r, long.as_bytes()).rule, DEFAULT_RULE);
    }

    #[test]
    fn invalid_body_falls_back_to_header_rules_and_says_so() {
        let c = config();
        let d = decide(&c, &req("POST", "/v1/chat/completions"), b"\x00garbage{");
        assert_eq!((d.rule, d.fallback), ("chat", Some(Fallback::InvalidJson)));
        let d = decide(&c, &req("POST", "/v1/completions"), b"not json");
        assert_eq!((d.rule, d.fallback), (DEFAULT_RULE, Some(Fallback::InvalidJson)));
    }

    #[test]
    fn unavailable_body_skips_body_rules() {
        let c = config();
        for why in Fallback::ALL {
            match classify(&c, &req("POST", "/v1/chat/completions"), Body::Unavailable(why)) {
                Outcome::Decided(d) => assert_eq!((d.rule, d.fallback), ("chat", Some(why))),
                Outcome::NeedBody | Outcome::NeedContent => panic!(),
            }
        }
    }

    #[test]
    fn grpc_by_method_and_metadata() {
        let c = config();
        let mut r = req("POST", "/infermesh.v1.Inference/Generate");
        r.headers.insert("content-type".into(), "application/grpc".into());
        assert!(matches!(classify(&c, &r, Body::NotYet), Outcome::Decided(Decision { rule: "grpc-generate", .. })));
        r.headers.insert("x-infermesh-class-hint".into(), "x".into());
        assert!(matches!(classify(&c, &r, Body::NotYet), Outcome::Decided(Decision { rule: DEFAULT_RULE, .. })));
    }

    /// Rules with content conditions, before and after others: a model whose label is `code`
    /// for "rust" (and `chat` otherwise), surer the more often it is said.
    fn content_config() -> FilterConfig {
        let rust = (crate::content_classifier::fnv1a(b"wrust") & 255) as usize;
        let model = crate::content_classifier::tests::model_json(&["chat", "code"], 256, 1, [0, 0], 4096, |b, l| if b == rust && l == 1 { 4 } else { 0 });
        FilterConfig::parse(
            format!(
                r#"{{"version": 1, "default_class": "batch", "content_model": {model},
                "classes": {{"interactive": {{"pool": "h100"}}, "batch": {{"pool": "l4"}}, "code": {{"pool": "coder"}}}},
                "rules": [
                  {{"name": "header", "class": "interactive", "match": {{"headers": [{{"name": "x-priority", "exact": "high"}}]}}}},
                  {{"name": "tenant-code", "class": "batch",
                   "match": {{"headers": [{{"name": "x-tenant", "exact": "eval"}}], "content": {{"label": "code", "min_score": 0.5}}}}}},
                  {{"name": "streamed-code", "class": "code", "match": {{"body": {{"stream": true}}, "content": {{"label": "code", "min_score": 0.9}}}}}},
                  {{"name": "code", "class": "code", "match": {{"path": {{"prefix": "/v1/"}}, "content": {{"label": "code", "min_score": 0.6}}}}}},
                  {{"name": "chat", "class": "interactive", "match": {{"path": {{"prefix": "/v1/chat/"}}}}}}
                ]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn content_rules_match_the_label_and_its_score() {
        let c = content_config();
        let r = req("POST", "/v1/chat/completions");
        let chat = |text: &str| format!(r#"{{"messages": [{{"role": "user", "content": "{text}"}}]}}"#);
        // "rust" once in 2 words: logit 2 vs 0, p = 0.88: the `code` rule (0.6), not the streamed one (0.9).
        assert_eq!(decide(&c, &r, chat("rust please").as_bytes()).rule, "code");
        assert_eq!(decide(&c, &r, format!(r#"{{"stream": true, {}"#, &chat("rust please")[1..]).as_bytes()).rule, "code");
        // Every word "rust": p = 0.98, the streamed rule first when streamed.
        assert_eq!(decide(&c, &r, format!(r#"{{"stream": true, {}"#, &chat("rust rust")[1..]).as_bytes()).rule, "streamed-code");
        // Below the score (1 word in 12: p = 0.58 < 0.6): falls through to the next rule.
        assert_eq!(decide(&c, &r, chat("rust a b c d e f g h i j k").as_bytes()).rule, "chat");
        // Another label, or no text: falls through, with no fallback.
        let d = decide(&c, &r, chat("hello there").as_bytes());
        assert_eq!((d.rule, d.fallback), ("chat", None));
        for none in [r#"{"messages": []}"#, r#"{"messages": [{"role": "assistant", "content": "rust"}]}"#, r#"{"prompt": [1, 2]}"#, "{}"] {
            let d = decide(&c, &r, none.as_bytes());
            assert_eq!((d.rule, d.fallback), ("chat", None), "{none}");
        }
        // Not JSON: the body rules are skipped, as any body condition.
        let d = decide(&c, &r, b"not json rust");
        assert_eq!((d.rule, d.fallback), ("chat", Some(Fallback::InvalidJson)));
        // It composes with headers: the tenant's rule needs both.
        let mut t = req("POST", "/v1/chat/completions");
        t.headers.insert("x-tenant".into(), "eval".into());
        assert_eq!(decide(&c, &t, chat("rust please").as_bytes()).rule, "tenant-code");
        assert_eq!(decide(&c, &t, chat("hello").as_bytes()).rule, "chat");
        // Completions and Responses text, on other paths.
        assert_eq!(decide(&c, &req("POST", "/v1/completions"), br#"{"prompt": "rust"}"#).rule, "code");
        assert_eq!(decide(&c, &req("POST", "/v1/responses"), br#"{"input": "Rust!"}"#).rule, "code");
        assert_eq!(decide(&c, &req("POST", "/v2/completions"), br#"{"prompt": "rust"}"#).rule, DEFAULT_RULE);
    }

    #[test]
    fn the_label_is_asked_for_only_when_a_content_rule_is_reached() {
        let c = content_config();
        let r = req("POST", "/v1/chat/completions");
        let facts = parse_body(br#"{"stream": false}"#).unwrap();
        // A header rule before the content rules decides without the body or the label.
        let mut high = req("POST", "/v1/chat/completions");
        high.headers.insert("x-priority".into(), "high".into());
        assert!(matches!(classify(&c, &high, Body::NotYet), Outcome::Decided(Decision { rule: "header", .. })));
        // The body first, then the label.
        assert_eq!(classify(&c, &r, Body::NotYet), Outcome::NeedBody);
        assert_eq!(classify(&c, &r, Body::Parsed(&facts, Content::NotYet)), Outcome::NeedContent);
        // No content rule reached (not /v1/, no tenant): decided without the label.
        assert!(matches!(classify(&c, &req("POST", "/v2/x"), Body::Parsed(&facts, Content::NotYet)), Outcome::Decided(Decision { rule: DEFAULT_RULE, .. })));
        // Unavailable body: content rules are skipped like body rules, with the reason.
        match classify(&c, &r, Body::Unavailable(Fallback::NotJson)) {
            Outcome::Decided(d) => assert_eq!((d.rule, d.fallback), ("chat", Some(Fallback::NotJson))),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn query_string_and_method() {
        let c = config();
        assert_eq!(decide(&c, &req("POST", "/v1/chat/completions?x=1"), b"{}").rule, "chat");
        assert_eq!(decide(&c, &req("GET", "/v1/chat/completions"), b"{}").rule, DEFAULT_RULE);
    }
}
