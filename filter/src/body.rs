//! Facts about an OpenAI-style JSON request body, read in one pass without building a DOM.
//!
//! Only the top-level fields the rules can look at are kept; everything else is skipped by the
//! parser. Strings are measured, not stored (except the short `model`, `priority` and
//! `service_tier`). Wrong types never fail the parse: a field of an unexpected type is treated
//! as absent, so one odd field cannot turn a whole request into a fallback. Input that is not
//! JSON at all is an error, which the caller turns into the documented header-only decision.

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// Visitor methods for the JSON scalars a visitor does not care about: each yields `$v`.
macro_rules! other_scalars {
    ($t:ty, $v:expr; $($m:ident: $a:ty),*) => {
        $(fn $m<E>(self, _: $a) -> Result<$t, E> { Ok($v) })*
    };
    ($t:ty, $v:expr) => {
        other_scalars!($t, $v; visit_bool: bool, visit_u64: u64, visit_i64: i64, visit_f64: f64, visit_str: &str);
        fn visit_unit<E>(self) -> Result<$t, E> { Ok($v) }
    };
}

/// Visitor methods that skip a whole array or object and yield `$v`.
macro_rules! skip_composites {
    ($t:ty, $v:expr) => {
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<$t, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok($v)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<$t, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok($v)
        }
    };
}

/// Longest `model` / `priority` / `service_tier` value kept; longer values are cut (at a char
/// boundary) — no rule needs more, and it bounds what one request can make the filter hold.
pub const MAX_KEPT_STRING: usize = 256;

/// What the rules can match in a body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyFacts {
    pub stream: Option<bool>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub n: Option<u64>,
    pub model: Option<String>,
    /// Number of entries in `messages` (chat); 0 when absent.
    pub message_count: u64,
    /// Characters of prompt text: every message's text content plus `prompt` (completions).
    pub prompt_chars: u64,
    /// `priority`, as a string (an integer priority is rendered in decimal).
    pub priority: Option<String>,
    pub service_tier: Option<String>,
}

impl BodyFacts {
    /// The completion budget the client asked for: `max_completion_tokens` wins over the
    /// deprecated `max_tokens`, as in OpenAI's API.
    pub fn token_budget(&self) -> Option<u64> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// Parse a body. `Err` means it is not a JSON object (garbage, truncated, nested too deeply).
pub fn parse_body(bytes: &[u8]) -> Result<BodyFacts, String> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let facts = de.deserialize_map(TopVisitor).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    Ok(facts)
}

struct TopVisitor;

impl<'de> Visitor<'de> for TopVisitor {
    type Value = BodyFacts;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<BodyFacts, A::Error> {
        let mut facts = BodyFacts::default();
        // Duplicate keys: the last one wins, as in every JSON library the sidecar might use.
        let (mut message_chars, mut prompt_chars) = (0u64, 0u64);
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Stream => facts.stream = map.next_value::<Scalar>()?.as_bool(),
                Key::MaxTokens => facts.max_tokens = map.next_value::<Scalar>()?.as_u64(),
                Key::MaxCompletionTokens => facts.max_completion_tokens = map.next_value::<Scalar>()?.as_u64(),
                Key::N => facts.n = map.next_value::<Scalar>()?.as_u64(),
                Key::Model => facts.model = map.next_value::<Scalar>()?.into_string(),
                Key::Priority => facts.priority = map.next_value::<Scalar>()?.into_string_or_int(),
                Key::ServiceTier => facts.service_tier = map.next_value::<Scalar>()?.into_string(),
                Key::Messages => {
                    let (count, chars) = map.next_value_seed(MessagesSeed)?;
                    facts.message_count = count;
                    message_chars = chars;
                }
                Key::Prompt => prompt_chars = map.next_value_seed(TextSeed)?,
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        facts.prompt_chars = message_chars.saturating_add(prompt_chars);
        Ok(facts)
    }
}

enum Key {
    Stream,
    MaxTokens,
    MaxCompletionTokens,
    N,
    Model,
    Priority,
    ServiceTier,
    Messages,
    Prompt,
    Other,
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Key, E> {
                Ok(match s {
                    "stream" => Key::Stream,
                    "max_tokens" => Key::MaxTokens,
                    "max_completion_tokens" => Key::MaxCompletionTokens,
                    "n" => Key::N,
                    "model" => Key::Model,
                    "priority" => Key::Priority,
                    "service_tier" => Key::ServiceTier,
                    "messages" => Key::Messages,
                    "prompt" => Key::Prompt,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// Any JSON value, reduced to what a scalar rule can use.
enum Scalar {
    Bool(bool),
    Int(u64),
    NegInt(i64),
    Str(String),
    Other,
}

impl Scalar {
    fn as_bool(&self) -> Option<bool> {
        match self {
            Scalar::Bool(b) => Some(*b),
            _ => None,
        }
    }
    fn as_u64(&self) -> Option<u64> {
        match self {
            Scalar::Int(i) => Some(*i),
            _ => None,
        }
    }
    fn into_string(self) -> Option<String> {
        match self {
            Scalar::Str(s) => Some(s),
            _ => None,
        }
    }
    fn into_string_or_int(self) -> Option<String> {
        match self {
            Scalar::Str(s) => Some(s),
            Scalar::Int(i) => Some(i.to_string()),
            Scalar::NegInt(i) => Some(i.to_string()),
            _ => None,
        }
    }
}

fn keep(s: &str) -> String {
    if s.len() <= MAX_KEPT_STRING {
        return s.to_string();
    }
    let mut end = MAX_KEPT_STRING;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl<'de> de::Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Scalar, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_bool<E>(self, b: bool) -> Result<Scalar, E> {
                Ok(Scalar::Bool(b))
            }
            fn visit_u64<E>(self, i: u64) -> Result<Scalar, E> {
                Ok(Scalar::Int(i))
            }
            fn visit_i64<E>(self, i: i64) -> Result<Scalar, E> {
                Ok(if i >= 0 { Scalar::Int(i as u64) } else { Scalar::NegInt(i) })
            }
            fn visit_f64<E>(self, _: f64) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_str<E>(self, s: &str) -> Result<Scalar, E> {
                Ok(Scalar::Str(keep(s)))
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            skip_composites!(Scalar, Scalar::Other);
        }
        d.deserialize_any(V)
    }
}

/// Characters of text in a value: a string, or an array of strings / text parts
/// (`{"type": "text", "text": "..."}`); token-id arrays count one per token. Other shapes: 0.
struct TextSeed;

impl<'de> DeserializeSeed<'de> for TextSeed {
    type Value = u64;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        d.deserialize_any(TextVisitor { depth: 0 })
    }
}

struct TextVisitor {
    depth: u8,
}

impl<'de> Visitor<'de> for TextVisitor {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("text")
    }
    fn visit_str<E>(self, s: &str) -> Result<u64, E> {
        Ok(s.chars().count() as u64)
    }
    other_scalars!(u64, 0; visit_bool: bool, visit_f64: f64);
    fn visit_u64<E>(self, _: u64) -> Result<u64, E> {
        Ok(u64::from(self.depth > 0))
    }
    fn visit_i64<E>(self, _: i64) -> Result<u64, E> {
        Ok(u64::from(self.depth > 0))
    }
    fn visit_unit<E>(self) -> Result<u64, E> {
        Ok(0)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u64, A::Error> {
        let mut total: u64 = 0;
        if self.depth >= 1 {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            return Ok(0);
        }
        while let Some(n) = seq.next_element_seed(TextElemSeed { depth: self.depth + 1 })? {
            total = total.saturating_add(n);
        }
        Ok(total)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u64, A::Error> {
        // A content part: only its "text" counts (the last one, if repeated).
        let mut total: u64 = 0;
        while let Some(k) = map.next_key::<Key2>()? {
            if k.0 {
                total = map.next_value_seed(StrLenSeed)?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(total)
    }
}

struct TextElemSeed {
    depth: u8,
}

impl<'de> DeserializeSeed<'de> for TextElemSeed {
    type Value = u64;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        d.deserialize_any(TextVisitor { depth: self.depth })
    }
}

/// `true` for the key "text".
struct Key2(bool);

impl<'de> de::Deserialize<'de> for Key2 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key2, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key2;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, s: &str) -> Result<Key2, E> {
                Ok(Key2(s == "text"))
            }
        }
        d.deserialize_str(V)
    }
}

/// Characters of a string value; 0 for anything else (skipped).
struct StrLenSeed;

impl<'de> DeserializeSeed<'de> for StrLenSeed {
    type Value = u64;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        match Scalar::deserialize_len(d)? {
            Some(n) => Ok(n),
            None => Ok(0),
        }
    }
}

impl Scalar {
    fn deserialize_len<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Option<u64>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E>(self, s: &str) -> Result<Option<u64>, E> {
                Ok(Some(s.chars().count() as u64))
            }
            other_scalars!(Option<u64>, None; visit_bool: bool, visit_u64: u64, visit_i64: i64, visit_f64: f64);
            fn visit_unit<E>(self) -> Result<Option<u64>, E> {
                Ok(None)
            }
            skip_composites!(Option<u64>, None);
        }
        d.deserialize_any(V)
    }
}

/// `messages`: (count, characters of text content). Non-array values count as no messages.
struct MessagesSeed;

impl<'de> DeserializeSeed<'de> for MessagesSeed {
    type Value = (u64, u64);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(u64, u64), D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = (u64, u64);
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(u64, u64), A::Error> {
                let (mut count, mut chars) = (0u64, 0u64);
                while let Some(c) = seq.next_element_seed(MessageSeed)? {
                    count += 1;
                    chars = chars.saturating_add(c);
                }
                Ok((count, chars))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(u64, u64), A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok((0, 0))
            }
            other_scalars!((u64, u64), (0, 0));
        }
        d.deserialize_any(V)
    }
}

/// One message: the characters of its `content` (a string or text parts).
struct MessageSeed;

impl<'de> DeserializeSeed<'de> for MessageSeed {
    type Value = u64;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = u64;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a message")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u64, A::Error> {
                let mut chars = 0u64;
                while let Some(k) = map.next_key::<ContentKey>()? {
                    if k.0 {
                        chars = map.next_value_seed(TextSeed)?;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(chars)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u64, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(0)
            }
            other_scalars!(u64, 0);
        }
        d.deserialize_any(V)
    }
}

/// `true` for the key "content".
struct ContentKey(bool);

impl<'de> de::Deserialize<'de> for ContentKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ContentKey, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ContentKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, s: &str) -> Result<ContentKey, E> {
                Ok(ContentKey(s == "content"))
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_chat_body() {
        let f = parse_body(
            br#"{"model":"llama-3-70b","stream":true,"max_tokens":64,"n":2,"priority":"high","service_tier":"default",
                 "messages":[{"role":"system","content":"be brief"},
                             {"role":"user","content":[{"type":"text","text":"h\u00e9llo"},{"type":"image_url","image_url":{"url":"x"}}]}],
                 "tools":[{"type":"function"}]}"#,
        )
        .unwrap();
        assert_eq!(f.model.as_deref(), Some("llama-3-70b"));
        assert_eq!(f.stream, Some(true));
        assert_eq!(f.token_budget(), Some(64));
        assert_eq!(f.n, Some(2));
        assert_eq!(f.priority.as_deref(), Some("high"));
        assert_eq!(f.service_tier.as_deref(), Some("default"));
        assert_eq!(f.message_count, 2);
        assert_eq!(f.prompt_chars, 8 + 5);
    }

    #[test]
    fn max_completion_tokens_wins() {
        let f = parse_body(br#"{"max_tokens": 10, "max_completion_tokens": 20}"#).unwrap();
        assert_eq!(f.token_budget(), Some(20));
    }

    #[test]
    fn completion_prompts_count() {
        assert_eq!(parse_body(br#"{"prompt":"abc"}"#).unwrap().prompt_chars, 3);
        assert_eq!(parse_body(br#"{"prompt":["ab","cd"]}"#).unwrap().prompt_chars, 4);
        assert_eq!(parse_body(br#"{"prompt":[1,2,3]}"#).unwrap().prompt_chars, 3);
        assert_eq!(parse_body(br#"{"prompt":[[1,2],[3]]}"#).unwrap().prompt_chars, 0);
    }

    #[test]
    fn wrong_types_are_absent_not_errors() {
        let f = parse_body(br#"{"stream":"yes","max_tokens":-1,"n":1.5,"model":7,"messages":"hi","priority":3}"#).unwrap();
        assert_eq!(f.stream, None);
        assert_eq!(f.max_tokens, None);
        assert_eq!(f.n, None);
        assert_eq!(f.model, None);
        assert_eq!(f.message_count, 0);
        assert_eq!(f.priority.as_deref(), Some("3"));
    }

    #[test]
    fn not_json_objects_are_errors() {
        for bad in [&b""[..], b"[]", b"42", b"{", b"{\"a\":}", b"\xff\xfe", b"{} trailing", b"null"] {
            assert!(parse_body(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let mut s = String::from("{\"x\":");
        s.push_str(&"[".repeat(100_000));
        assert!(parse_body(s.as_bytes()).is_err());
    }

    #[test]
    fn kept_strings_are_bounded() {
        let long = format!("{{\"model\":\"{}\u{e9}\"}}", "a".repeat(MAX_KEPT_STRING - 1));
        let f = parse_body(long.as_bytes()).unwrap();
        assert_eq!(f.model.unwrap().len(), MAX_KEPT_STRING - 1);
    }
}
