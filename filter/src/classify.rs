//! Pure request classification: no host calls, no allocation beyond the decision, no panics.

use crate::config::{FilterConfig, PathMatch, Rule};

/// What the classifier may look at. The glue implements it over Envoy's header map; tests use
/// a plain struct.
pub trait RequestView {
    fn method(&self) -> Option<&str>;
    /// The `:path` pseudo-header, query string included.
    fn path(&self) -> Option<&str>;
    fn header(&self, name: &str) -> Option<&str>;
}

/// The outcome written back into the request headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision<'c> {
    pub class: &'c str,
    pub pool: &'c str,
    /// The rule that matched, or `default` when none did.
    pub rule: &'c str,
}

/// The rule name reported when no rule matched.
pub const DEFAULT_RULE: &str = "default";

/// Decide the class and pool of a request: the first rule whose conditions all hold wins.
pub fn classify<'c>(config: &'c FilterConfig, req: &dyn RequestView) -> Decision<'c> {
    let path = req.path().map(strip_query);
    for rule in &config.rules {
        if rule_matches(rule, req, path) {
            return Decision { class: &rule.class, pool: &rule.pool, rule: &rule.name };
        }
    }
    Decision { class: &config.default_class, pool: &config.default_pool, rule: DEFAULT_RULE }
}

fn strip_query(path: &str) -> &str {
    match path.find(|c| c == '?' || c == '#') {
        Some(i) => &path[..i],
        None => path,
    }
}

fn rule_matches(rule: &Rule, req: &dyn RequestView, path: Option<&str>) -> bool {
    if !rule.methods.is_empty() {
        match req.method() {
            Some(m) if rule.methods.iter().any(|x| x.eq_ignore_ascii_case(m)) => {}
            _ => return false,
        }
    }
    if let Some(pm) = &rule.path {
        let ok = match (pm, path) {
            (PathMatch::Exact(want), Some(p)) => p == want,
            (PathMatch::Prefix(want), Some(p)) => p.starts_with(want.as_str()),
            (_, None) => false,
        };
        if !ok {
            return false;
        }
    }
    rule.headers.iter().all(|h| match (req.header(&h.name), &h.value) {
        (Some(_), None) => true,
        (Some(got), Some(want)) => got == want,
        (None, _) => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct FakeRequest {
        method: &'static str,
        path: &'static str,
        headers: HashMap<&'static str, &'static str>,
    }

    impl RequestView for FakeRequest {
        fn method(&self) -> Option<&str> {
            Some(self.method)
        }
        fn path(&self) -> Option<&str> {
            Some(self.path)
        }
        fn header(&self, name: &str) -> Option<&str> {
            self.headers.get(name).copied()
        }
    }

    fn req(method: &'static str, path: &'static str) -> FakeRequest {
        FakeRequest { method, path, headers: HashMap::new() }
    }

    fn local_default() -> FilterConfig {
        FilterConfig::parse(
            br#"{"version": 1, "default_class": "batch",
                "classes": {"interactive": {"pool": "interactive"}, "batch": {"pool": "batch"}},
                "rules": [
                  {"name": "priority-header", "class": "interactive",
                   "match": {"headers": [{"name": "x-priority", "value": "high"}]}},
                  {"name": "chat", "class": "interactive",
                   "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
                  {"name": "grpc-generate", "class": "interactive",
                   "match": {"path": {"exact": "/infermesh.v1.Inference/Generate"}}}
                ]}"#,
        )
        .unwrap()
    }

    #[test]
    fn chat_is_interactive() {
        let c = local_default();
        let d = classify(&c, &req("POST", "/v1/chat/completions"));
        assert_eq!(d, Decision { class: "interactive", pool: "interactive", rule: "chat" });
    }

    #[test]
    fn query_string_is_ignored() {
        let c = local_default();
        assert_eq!(classify(&c, &req("POST", "/v1/chat/completions?x=1")).rule, "chat");
    }

    #[test]
    fn completions_fall_to_default_batch() {
        let c = local_default();
        let d = classify(&c, &req("POST", "/v1/completions"));
        assert_eq!(d, Decision { class: "batch", pool: "batch", rule: DEFAULT_RULE });
    }

    #[test]
    fn method_must_match() {
        let c = local_default();
        assert_eq!(classify(&c, &req("GET", "/v1/chat/completions")).class, "batch");
    }

    #[test]
    fn header_rule_wins_when_first() {
        let c = local_default();
        let mut r = req("POST", "/v1/completions");
        r.headers.insert("x-priority", "high");
        assert_eq!(classify(&c, &r).rule, "priority-header");
        r.headers.insert("x-priority", "low");
        assert_eq!(classify(&c, &r).rule, DEFAULT_RULE);
    }

    #[test]
    fn exact_path_does_not_match_longer_path() {
        let c = local_default();
        assert_eq!(classify(&c, &req("POST", "/infermesh.v1.Inference/Generate")).rule, "grpc-generate");
        assert_eq!(classify(&c, &req("POST", "/infermesh.v1.Inference/GenerateX")).rule, DEFAULT_RULE);
    }

    #[test]
    fn odd_paths_never_panic() {
        let c = local_default();
        for p in ["", "?", "#", "/v1/chat/completions#frag", "\u{0}\u{ffff}", "//////"] {
            let r = FakeRequest { method: "POST", path: Box::leak(p.to_string().into_boxed_str()), headers: HashMap::new() };
            let _ = classify(&c, &r);
        }
    }
}
