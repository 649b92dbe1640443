//! Facts about an OpenAI-style JSON request body, read in one pass without building a DOM: the
//! field walk. It knows which top-level fields the rules can look at (and, in `messages`, the
//! `content` of each message and its text parts) and skips everything else; the bytes
//! themselves are scanned by json_scan.rs (the grammar) and string_run.rs (inside strings).
//! Strings are measured, not stored (except the short `model`, `priority` and
//! `service_tier`). Wrong types never fail the parse: a field of an
//! unexpected type is treated as absent, so one odd field cannot turn a whole request into a
//! fallback. Input that is not a JSON object is an error, which the caller turns into the
//! documented header-only decision. The values that are read are at most 6 levels deep, far
//! from serde_json's limit of 128 (whose behaviour the scanner keeps).

use crate::json_scan::{Bad, Res, Scanner, Str, Tok};
use crate::prefix_key::{PrefixKeys, PrefixSpec, PrefixWalk};

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
    /// The same text's UTF-8 bytes (decoded; a token id counts one), which the token budget's
    /// reservation counts: a byte-level BPE spends at most one token per byte.
    pub prompt_bytes: u64,
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

/// Parse a body. `Err` means it is not a JSON object (garbage, truncated, bad escapes, …).
pub fn parse_body(bytes: &[u8]) -> Result<BodyFacts, String> {
    Scanner::new(bytes).body(None).map_err(|Bad(why, at)| format!("{why} at byte {at}"))
}

/// `parse_body`, and the request's prefix keys in the same pass (prefix_key.rs): the same facts,
/// the keys `None` where the body has no usable prefix.
pub fn parse_body_keyed(bytes: &[u8], spec: PrefixSpec) -> Result<(BodyFacts, Option<PrefixKeys>), String> {
    keyed(Scanner::new(bytes), spec)
}

/// `parse_body_keyed` on a body in segments.
pub fn parse_body_segments_keyed(parts: &[&[u8]], spec: PrefixSpec) -> Result<(BodyFacts, Option<PrefixKeys>), String> {
    keyed(Scanner::segments(parts), spec)
}

fn keyed(mut scanner: Scanner<'_>, spec: PrefixSpec) -> Result<(BodyFacts, Option<PrefixKeys>), String> {
    let mut walk = PrefixWalk::new(spec);
    let facts = scanner.body(Some(&mut walk)).map_err(|Bad(why, at)| format!("{why} at byte {at}"))?;
    let keys = walk.keys();
    Ok((facts, (!keys.chain().is_empty() || keys.learn.is_some()).then_some(keys)))
}

/// Parse a body held in segments (a native host's buffers, in order), where they are: the same
/// result as `parse_body` on the segments joined.
pub fn parse_body_segments(parts: &[&[u8]]) -> Result<BodyFacts, String> {
    Scanner::segments(parts).body(None).map_err(|Bad(why, at)| format!("{why} at byte {at}"))
}

/// The field walk, on json_scan's tokens.
impl Scanner<'_> {
    /// A kept string (`model`, …), cut to MAX_KEPT_STRING bytes at a character boundary.
    fn kept(&self, s: &Str) -> Res<String> {
        let bytes = self.decoded(s)?;
        let mut end = bytes.len().min(MAX_KEPT_STRING);
        while end > 0 && bytes.get(end).map_or(false, |&c| c & 0xC0 == 0x80) {
            end -= 1;
        }
        match std::str::from_utf8(bytes.get(..end).unwrap_or(&[])) {
            Ok(t) => Ok(t.to_string()),
            Err(_) => Err(Bad("invalid UTF-8 in a string", s.start)),
        }
    }

    /// The whole body: one object, then only whitespace.
    /// `key`: the prefix walk, fed the roles and texts of `messages` and the `prompt` string.
    fn body(&mut self, mut key: Option<&mut PrefixWalk>) -> Res<BodyFacts> {
        if self.peek() != Some(b'{') {
            return self.bad("not a JSON object");
        }
        self.i += 1;
        let mut facts = BodyFacts::default();
        // Duplicate keys: the last one wins, as in every JSON library the sidecar might use.
        let (mut message_text, mut prompt_text) = (Text::default(), Text::default());
        let mut first = true;
        while let Some(k) = self.key(&mut first)? {
            // The decoded key borrows the body, not the scanner, so the arms can go on scanning.
            match &*self.decoded(&k)? {
                b"stream" => facts.stream = self.scalar(|t| if let Tok::Bool(b) = t { Some(*b) } else { None })?,
                b"max_tokens" => facts.max_tokens = self.scalar(int)?,
                b"max_completion_tokens" => facts.max_completion_tokens = self.scalar(int)?,
                b"n" => facts.n = self.scalar(int)?,
                b"model" => facts.model = self.kept_scalar(false)?,
                b"priority" => facts.priority = self.kept_scalar(true)?,
                b"service_tier" => facts.service_tier = self.kept_scalar(false)?,
                b"messages" => {
                    if let Some(k) = key.as_deref_mut() {
                        k.restart(false);
                    }
                    (facts.message_count, message_text) = self.messages(key.as_deref_mut())?
                }
                b"prompt" => {
                    if let Some(k) = key.as_deref_mut() {
                        k.restart(true);
                    }
                    prompt_text = self.text(0, key.as_deref_mut(), true)?
                }
                _ => self.skip_value()?,
            }
        }
        let text = message_text.add(prompt_text);
        (facts.prompt_chars, facts.prompt_bytes) = (text.chars, text.bytes);
        if self.peek().is_some() {
            return self.bad("trailing characters");
        }
        Ok(facts)
    }

    /// A value reduced to what a scalar rule can use (`f` of its token; composites skipped).
    fn scalar<T>(&mut self, f: impl Fn(&Tok) -> Option<T>) -> Res<Option<T>> {
        let t = self.any()?;
        self.skip_composite(&t)?;
        Ok(f(&t))
    }

    /// A kept string; with `int`, an integer too, in decimal (`priority`).
    fn kept_scalar(&mut self, int: bool) -> Res<Option<String>> {
        let t = self.any()?;
        self.skip_composite(&t)?;
        Ok(match t {
            Tok::Str(s) => Some(self.kept(&s)?),
            Tok::Int(n) if int => Some(n.to_string()),
            Tok::Neg(n) if int => Some(n.to_string()),
            _ => None,
        })
    }

    /// `messages`: (count, their text content). Non-array values count as no messages.
    fn messages(&mut self, mut key: Option<&mut PrefixWalk>) -> Res<(u64, Text)> {
        let t = self.any()?;
        if !matches!(t, Tok::Array) {
            self.skip_composite(&t)?;
            return Ok((0, Text::default()));
        }
        self.i += 1;
        let (mut count, mut chars, mut first) = (0u64, Text::default(), true);
        while self.element(&mut first)? {
            chars = chars.add(self.message(key.as_deref_mut())?);
            count += 1;
            if let Some(k) = key.as_deref_mut() {
                k.end_message();
            }
        }
        Ok((count, chars))
    }

    /// One message: the text of its `content` (the last one, if repeated).
    fn message(&mut self, mut key: Option<&mut PrefixWalk>) -> Res<Text> {
        let t = self.any()?;
        if !matches!(t, Tok::Object) {
            self.skip_composite(&t)?;
            return Ok(Text::default());
        }
        self.i += 1;
        let (mut chars, mut first) = (Text::default(), true);
        while let Some(k) = self.key(&mut first)? {
            if self.key_is(&k, b"content")? {
                chars = self.text(0, key.as_deref_mut(), false)?;
            } else if key.is_some() && self.key_is(&k, b"role")? {
                // Skipped as without a key (its grammar checked, not its UTF-8): the key must
                // not change which bodies are refused. Its raw bytes are hashed.
                let string = self.peek() == Some(b'"');
                let start = self.pos();
                self.skip_value()?;
                if let (true, Some(w)) = (string, key.as_deref_mut()) {
                    w.role(&self.span(start + 1, self.pos().saturating_sub(1).max(start + 1)));
                }
            } else {
                self.skip_value()?;
            }
        }
        Ok(chars)
    }

    /// Characters of text in a value: a string, or (at depth 0) an array of strings / text
    /// parts (`{"type": "text", "text": "..."}`); token-id arrays count one per token. Other
    /// shapes: 0. Recursion: depth 0 → 1 only. `key` gets the text (`prompt`: a completion's
    /// prompt, keyed only as one string).
    fn text(&mut self, depth: u8, mut key: Option<&mut PrefixWalk>, prompt: bool) -> Res<Text> {
        Ok(match self.any()? {
            Tok::Str(s) => {
                match key {
                    Some(k) if prompt && depth == 0 => k.prompt(&self.span(s.start, s.end)),
                    Some(k) if !prompt => k.text(&self.span(s.start, s.end)),
                    _ => {}
                }
                Text { chars: s.chars, bytes: s.bytes }
            }
            Tok::Int(_) | Tok::Neg(_) => Text { chars: u64::from(depth > 0), bytes: u64::from(depth > 0) },
            Tok::Float | Tok::Bool(_) | Tok::Null => Text::default(),
            Tok::Array if depth == 0 => {
                self.i += 1;
                let (mut total, mut first) = (Text::default(), true);
                while self.element(&mut first)? {
                    total = total.add(self.text(1, key.as_deref_mut(), prompt)?);
                }
                total
            }
            Tok::Array => {
                self.skip_value()?;
                Text::default()
            }
            Tok::Object => {
                // A content part: only its "text" counts (the last one, if repeated).
                self.i += 1;
                let (mut total, mut first) = (Text::default(), true);
                while let Some(k) = self.key(&mut first)? {
                    if self.key_is(&k, b"text")? {
                        let t = self.any()?;
                        self.skip_composite(&t)?;
                        total = if let Tok::Str(s) = t {
                            if let Some(k) = key.as_deref_mut().filter(|_| !prompt) {
                                k.text(&self.span(s.start, s.end));
                            }
                            Text { chars: s.chars, bytes: s.bytes }
                        } else {
                            Text::default()
                        };
                    } else {
                        self.skip_value()?;
                    }
                }
                total
            }
        })
    }
}

/// Prompt text measured: characters and UTF-8 bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Text {
    chars: u64,
    bytes: u64,
}

impl Text {
    fn add(self, o: Text) -> Text {
        Text { chars: self.chars.saturating_add(o.chars), bytes: self.bytes.saturating_add(o.bytes) }
    }
}

fn int(t: &Tok) -> Option<u64> {
    if let Tok::Int(n) = t {
        Some(*n)
    } else {
        None
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
        assert_eq!(f.prompt_bytes, 8 + 6, "é (an escape) is two UTF-8 bytes");
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
    fn skipped_values_are_checked_as_serde_json_skips_them() {
        // Skipped: any depth, any bytes in strings, any \u hex, any number size.
        let deep = format!("{{\"tools\":{}{}, \"n\": 3}}", "[".repeat(5000), "]".repeat(5000));
        assert_eq!(parse_body(deep.as_bytes()).unwrap().n, Some(3));
        let deep = format!("{{\"messages\":[{}1{}]}}", "[{\"a\":".repeat(300), "}]".repeat(300));
        assert_eq!(parse_body(deep.as_bytes()).unwrap().message_count, 1);
        assert!(parse_body(b"{\"x\":\"\xff\\ud800\",\"t\":1e400,\"role\":[\"\\udc00\"],\"tools\":{\"\\udc00\":1}}").is_ok());
        // ...but the grammar still holds there.
        for bad in [&b"{\"x\":[1,]}"[..], b"{\"x\":{\"a\"}}", b"{\"x\":01}", b"{\"x\":\"\\x\"}", b"{\"x\":\"\\u12\"}", b"{\"x\":\"\t\"}", b"{\"x\":tru}"] {
            assert!(parse_body(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn read_values_are_validated_as_serde_json_parses_them() {
        for bad in [
            &b"{\"messages\":[{\"content\":\"\xff\"}]}"[..],
            b"{\"prompt\":\"\\ud800\"}",
            b"{\"prompt\":\"\\udc00\\ud800\"}",
            b"{\"prompt\":\"\\ud800\\u0041\"}",
            b"{\"model\":\"\xed\xa0\x80\"}",
            b"{\"max_tokens\":1e400}",
            b"{\"prompt\":[1, 2e999]}",
            b"{\"\xc3\":1}",
            // The keys of an object where a scalar is read are read too (serde_json's MapAccess).
            b"{\"model\":{\"\\udc00\":1}}",
        ] {
            assert!(parse_body(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn escapes_are_one_character_each() {
        let f = parse_body(br#"{"prompt":"a\nb\u00e9\ud83d\ude00\/\"", "model": "x\u00e9y"}"#).unwrap();
        assert_eq!(f.prompt_chars, 7);
        assert_eq!(f.model.as_deref(), Some("x\u{e9}y"));
        let f = parse_body("{\"prompt\":\"h\u{e9}llo \u{1F600} \u{4e2d}\"}".as_bytes()).unwrap();
        assert_eq!(f.prompt_chars, 9);
        let f = parse_body(br#"{"str\u0065am": true, "m\u006fdel": "m"}"#).unwrap();
        assert_eq!((f.stream, f.model.as_deref()), (Some(true), Some("m")));
    }

    #[test]
    fn integers_are_typed_as_serde_json_types_them() {
        let f = parse_body(br#"{"max_tokens": 18446744073709551615, "n": 18446744073709551616, "priority": -9223372036854775808}"#).unwrap();
        assert_eq!((f.max_tokens, f.n, f.priority.as_deref()), (Some(u64::MAX), None, Some("-9223372036854775808")));
        let f = parse_body(br#"{"max_tokens": -0, "priority": -0, "n": 2.0, "prompt": [1, -2, -0, 3.5]}"#).unwrap();
        assert_eq!((f.max_tokens, f.priority, f.n, f.prompt_chars), (None, None, None, 2));
    }

    /// `bytes` cut into segments at `cuts` (offsets, ascending).
    fn cut<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut parts = Vec::new();
        let mut from = 0;
        for &c in cuts {
            parts.push(&bytes[from..c]);
            from = c;
        }
        parts.push(&bytes[from..]);
        parts
    }

    #[test]
    fn a_body_in_segments_gives_what_it_gives_in_one_buffer_wherever_it_is_cut() {
        let long = "The quick brown fox jumps over the lazy dog. ".repeat(5);
        let wide = "h\u{e9}llo \u{1F600} \u{4e2d}\u{6587} ".repeat(6);
        let mut bodies: Vec<Vec<u8>> = [
            &br#"{"model":"llama-3-70b","stream":true,"max_tokens":64,"n":2,"priority":"high","service_tier":"default","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"h\u00e9llo"},{"type":"image_url","image_url":{"url":"x"}}]}],"tools":[{"type":"function"}]}"#[..],
            br#"{"max_tokens": 18446744073709551615, "n": 18446744073709551616, "priority": -9223372036854775808, "x": [1.5e3, -0, 0.25, true, false, null]}"#,
            br#"{"prompt":"a\nb\u00e9\ud83d\ude00\/\"", "m\u006fdel": "x\u00e9y", "str\u0065am": false}"#,
            b"{\"prompt\":[1,2,3], \"tools\": {\"\xff\": \"\xfe\\ud800\"}, \"n\" : 7 }  ",
            // Refused, each somewhere else: the error (and where) must not depend on the cuts.
            b"{\"messages\":[{\"content\":\"ab\xc3\"}]}", b"{\"prompt\":\"\xe4\xb8\"}", b"{\"prompt\":\"a\xf0\x9f\x98",
            b"{\"prompt\":\"\\ud800\\u0041\"}", b"{\"model\":\"\xed\xa0\x80\"}", b"{\"max_tokens\":1e400}", b"{\"n\":01}",
            b"{\"n\":1.}", b"{\"n\":1e+}", b"{\"n\":tru}", b"{\"n\":nul", b"{\"n\":\"\\u12\"}", b"{\"n\":\"\t\"}", b"{\"a\":1,}",
            b"{\"prompt\":\"unterminated", b"{} x", b"[]",
        ]
        .iter()
        .map(|b| b.to_vec())
        .collect();
        bodies.push(format!(r#"{{"messages":[{{"role":"user","content":"{long}"}},{{"content":"{wide}"}}],"tools":["{long}\"{wide}"],"prompt":"{wide}"}}"#).into_bytes());
        bodies.push(format!(r#"{{"messages":[{{"content":"{long}\u00e9{long}"}}], "tools":"{long}\n{long}"}}"#).into_bytes());
        for body in &bodies {
            let whole = parse_body(body);
            let show = String::from_utf8_lossy(body);
            for at in 0..=body.len() {
                assert_eq!(parse_body_segments(&cut(body, &[at])), whole, "cut at {at}: {show}");
            }
            let bytes: Vec<usize> = (1..body.len()).collect();
            assert_eq!(parse_body_segments(&cut(body, &bytes)), whole, "a byte a segment: {show}");
            if body.len() <= 80 {
                for a in 0..=body.len() {
                    for b in a..=body.len() {
                        assert_eq!(parse_body_segments(&cut(body, &[a, b])), whole, "cuts at {a}, {b}: {show}");
                    }
                }
            }
        }
        assert!(parse_body_segments(&[]).is_err());
        assert_eq!(parse_body_segments(&[b"", b"{}", b""]), Ok(BodyFacts::default()));
    }

    #[test]
    fn kept_strings_are_bounded() {
        let long = format!("{{\"model\":\"{}\u{e9}\"}}", "a".repeat(MAX_KEPT_STRING - 1));
        let f = parse_body(long.as_bytes()).unwrap();
        assert_eq!(f.model.unwrap().len(), MAX_KEPT_STRING - 1);
    }
}
