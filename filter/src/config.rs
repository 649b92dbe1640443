//! The filter's typed configuration: parsed once when Envoy configures the plugin.
//!
//! An invalid configuration is rejected as a whole with a message that names the field; the
//! glue then keeps the last good configuration (or refuses to start when there is none).

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;

/// The only configuration version this build understands. A config with another version is
/// refused rather than half-understood.
pub const CONFIG_VERSION: u32 = 1;

/// Headers the filter owns. Any client-sent copy is removed before the decision is written.
pub const HEADER_CLASS: &str = "x-infermesh-class";
pub const HEADER_POOL: &str = "x-infermesh-pool";
pub const HEADER_RULE: &str = "x-infermesh-rule";
/// Prefix of every header the filter reserves for itself.
pub const INTERNAL_HEADER_PREFIX: &str = "x-infermesh-";

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    version: u32,
    default_class: String,
    classes: BTreeMap<String, RawClass>,
    #[serde(default)]
    rules: Vec<RawRule>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct RawClass {
    pool: String,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    class: String,
    #[serde(rename = "match", default)]
    matcher: RawMatch,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    #[serde(default)]
    methods: Vec<String>,
    #[serde(default)]
    path: Option<PathMatch>,
    #[serde(default)]
    headers: Vec<HeaderMatch>,
}

/// How a rule matches the request path (the query string is ignored).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum PathMatch {
    /// The path equals this string.
    Exact(String),
    /// The path starts with this string.
    Prefix(String),
}

/// A header condition: the header is present and, when `value` is set, equals it exactly.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatch {
    pub name: String,
    #[serde(default)]
    pub value: Option<String>,
}

/// One ordered rule: all its conditions must hold; the first matching rule decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    pub class: String,
    pub pool: String,
    pub methods: Vec<String>,
    pub path: Option<PathMatch>,
    pub headers: Vec<HeaderMatch>,
}

/// The validated configuration the request path uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterConfig {
    pub default_class: String,
    pub default_pool: String,
    pub rules: Vec<Rule>,
}

/// Why a configuration was refused; `field` is a JSON-path-like location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid infermesh filter config at `{}`: {}", self.field, self.message)
    }
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), message: message.into() }
}

impl FilterConfig {
    /// Parse and validate the plugin configuration bytes.
    pub fn parse(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        let raw: RawConfig = serde_json::from_slice(bytes).map_err(|e| {
            // serde_json names the unknown/missing field in its message; keep it whole.
            err("$", e.to_string())
        })?;
        if raw.version != CONFIG_VERSION {
            return Err(err(
                "version",
                format!("unsupported version {} (this filter understands {})", raw.version, CONFIG_VERSION),
            ));
        }
        if raw.classes.is_empty() {
            return Err(err("classes", "at least one class is required"));
        }
        for (name, class) in &raw.classes {
            check_token(&format!("classes.{name}"), name)?;
            check_token(&format!("classes.{name}.pool"), &class.pool)?;
        }
        let pool_of = |field: &str, class: &str| -> Result<String, ConfigError> {
            raw.classes
                .get(class)
                .map(|c| c.pool.clone())
                .ok_or_else(|| err(field, format!("unknown class `{class}`")))
        };
        let default_pool = pool_of("default_class", &raw.default_class)?;
        let mut rules = Vec::with_capacity(raw.rules.len());
        let mut seen = std::collections::BTreeSet::new();
        for (i, r) in raw.rules.into_iter().enumerate() {
            let at = format!("rules[{i}]");
            check_token(&format!("{at}.name"), &r.name)?;
            if !seen.insert(r.name.clone()) {
                return Err(err(format!("{at}.name"), format!("duplicate rule name `{}`", r.name)));
            }
            let pool = pool_of(&format!("{at}.class"), &r.class)?;
            if let Some(PathMatch::Exact(p) | PathMatch::Prefix(p)) = &r.matcher.path {
                if !p.starts_with('/') {
                    return Err(err(format!("{at}.match.path"), "a path must start with `/`"));
                }
            }
            for (j, h) in r.matcher.headers.iter().enumerate() {
                if h.name.is_empty() || h.name.bytes().any(|b| b.is_ascii_uppercase() || b <= b' ') {
                    return Err(err(
                        format!("{at}.match.headers[{j}].name"),
                        "header names must be non-empty lower-case tokens",
                    ));
                }
            }
            rules.push(Rule {
                name: r.name,
                class: r.class,
                pool,
                methods: r.matcher.methods.iter().map(|m| m.to_ascii_uppercase()).collect(),
                path: r.matcher.path,
                headers: r.matcher.headers,
            });
        }
        Ok(FilterConfig { default_class: raw.default_class, default_pool, rules })
    }
}

/// Class, pool and rule names end up in header values and metric names: keep them plain.
fn check_token(field: &str, value: &str) -> Result<(), ConfigError> {
    let ok = !value.is_empty()
        && value.len() <= 64
        && value.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(err(field, format!("`{value}` must be 1-64 characters of [A-Za-z0-9._-]")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{
        "version": 1,
        "default_class": "batch",
        "classes": {"interactive": {"pool": "gpu-a"}, "batch": {"pool": "gpu-b"}},
        "rules": [
            {"name": "chat", "class": "interactive",
             "match": {"methods": ["post"], "path": {"prefix": "/v1/chat/completions"}}}
        ]
    }"#;

    #[test]
    fn parses_a_good_config() {
        let c = FilterConfig::parse(GOOD.as_bytes()).unwrap();
        assert_eq!(c.default_pool, "gpu-b");
        assert_eq!(c.rules[0].pool, "gpu-a");
        assert_eq!(c.rules[0].methods, vec!["POST".to_string()]);
    }

    #[test]
    fn rejects_wrong_version_naming_the_field() {
        let e = FilterConfig::parse(GOOD.replace("\"version\": 1", "\"version\": 2").as_bytes()).unwrap_err();
        assert_eq!(e.field, "version");
    }

    #[test]
    fn rejects_unknown_class_in_rule() {
        let e = FilterConfig::parse(GOOD.replace("\"class\": \"interactive\"", "\"class\": \"nope\"").as_bytes())
            .unwrap_err();
        assert_eq!(e.field, "rules[0].class");
        assert!(e.message.contains("nope"));
    }

    #[test]
    fn rejects_unknown_default_class() {
        let e = FilterConfig::parse(GOOD.replace("\"default_class\": \"batch\"", "\"default_class\": \"x\"").as_bytes())
            .unwrap_err();
        assert_eq!(e.field, "default_class");
    }

    #[test]
    fn rejects_unknown_fields_and_garbage() {
        let e = FilterConfig::parse(GOOD.replace("\"rules\"", "\"rulez\"").as_bytes()).unwrap_err();
        assert!(e.message.contains("rulez"), "{e}");
        assert!(FilterConfig::parse(b"\xff\x00garbage").is_err());
        assert!(FilterConfig::parse(b"").is_err());
    }

    #[test]
    fn rejects_relative_paths_and_bad_names() {
        let e = FilterConfig::parse(GOOD.replace("\"/v1/chat", "\"v1/chat").as_bytes()).unwrap_err();
        assert_eq!(e.field, "rules[0].match.path");
        let e = FilterConfig::parse(GOOD.replace("\"gpu-a\"", "\"gpu a\"").as_bytes()).unwrap_err();
        assert_eq!(e.field, "classes.interactive.pool");
    }
}
