//! The body scanner as it was before the hand-written one (serde_json visitors, IgnoredAny for
//! skipped values): kept as the specification the new scanner is compared against
//! (tests/fuzz_body_and_classifier.rs) and as the "old" column of examples/classify_bench.rs.
//! Its accept/reject decisions and facts are the contract: src/body.rs must match them exactly.
#![allow(dead_code)]

use infermesh_filter::body::{BodyFacts, MAX_KEPT_STRING};
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
        let (mut message_chars, mut prompt_chars) = ((0u64, 0u64), (0u64, 0u64));
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
        (facts.prompt_chars, facts.prompt_bytes) = add(message_chars, prompt_chars);
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

/// Text measured: (characters, UTF-8 bytes).
type T = (u64, u64);

fn measured(s: &str) -> T {
    (s.chars().count() as u64, s.len() as u64)
}

fn add(a: T, b: T) -> T {
    (a.0.saturating_add(b.0), a.1.saturating_add(b.1))
}

/// Characters of text in a value: a string, or an array of strings / text parts
/// (`{"type": "text", "text": "..."}`); token-id arrays count one per token. Other shapes: 0.
struct TextSeed;

impl<'de> DeserializeSeed<'de> for TextSeed {
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        d.deserialize_any(TextVisitor { depth: 0 })
    }
}

struct TextVisitor {
    depth: u8,
}

impl<'de> Visitor<'de> for TextVisitor {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("text")
    }
    fn visit_str<E>(self, s: &str) -> Result<T, E> {
        Ok(measured(s))
    }
    other_scalars!(T, (0, 0); visit_bool: bool, visit_f64: f64);
    fn visit_u64<E>(self, _: u64) -> Result<T, E> {
        let n = u64::from(self.depth > 0);
        Ok((n, n))
    }
    fn visit_i64<E>(self, _: i64) -> Result<T, E> {
        let n = u64::from(self.depth > 0);
        Ok((n, n))
    }
    fn visit_unit<E>(self) -> Result<T, E> {
        Ok((0, 0))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<T, A::Error> {
        let mut total: T = (0, 0);
        if self.depth >= 1 {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            return Ok((0, 0));
        }
        while let Some(n) = seq.next_element_seed(TextElemSeed { depth: self.depth + 1 })? {
            total = add(total, n);
        }
        Ok(total)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
        // A content part: only its "text" counts (the last one, if repeated).
        let mut total: T = (0, 0);
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
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
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
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        match Scalar::deserialize_len(d)? {
            Some(n) => Ok(n),
            None => Ok((0, 0)),
        }
    }
}

impl Scalar {
    fn deserialize_len<'de, D: Deserializer<'de>>(d: D) -> Result<Option<T>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Option<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E>(self, s: &str) -> Result<Option<T>, E> {
                Ok(Some(measured(s)))
            }
            other_scalars!(Option<T>, None; visit_bool: bool, visit_u64: u64, visit_i64: i64, visit_f64: f64);
            fn visit_unit<E>(self) -> Result<Option<T>, E> {
                Ok(None)
            }
            skip_composites!(Option<T>, None);
        }
        d.deserialize_any(V)
    }
}

/// `messages`: (count, characters of text content). Non-array values count as no messages.
struct MessagesSeed;

impl<'de> DeserializeSeed<'de> for MessagesSeed {
    type Value = (u64, T);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(u64, T), D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = (u64, T);
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(u64, T), A::Error> {
                let (mut count, mut chars) = (0u64, (0, 0));
                while let Some(c) = seq.next_element_seed(MessageSeed)? {
                    count += 1;
                    chars = add(chars, c);
                }
                Ok((count, chars))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(u64, T), A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok((0, (0, 0)))
            }
            other_scalars!((u64, T), (0, (0, 0)));
        }
        d.deserialize_any(V)
    }
}

/// One message: the characters of its `content` (a string or text parts).
struct MessageSeed;

impl<'de> DeserializeSeed<'de> for MessageSeed {
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a message")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
                let mut chars: T = (0, 0);
                while let Some(k) = map.next_key::<ContentKey>()? {
                    if k.0 {
                        chars = map.next_value_seed(TextSeed)?;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(chars)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<T, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok((0, 0))
            }
            other_scalars!(T, (0, 0));
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
