//! Facts about an OpenAI-style JSON request body, read in one pass without building a DOM.
//!
//! Only the top-level fields the rules can look at are kept; everything else is skipped by the
//! scanner. Strings are measured, not stored (except the short `model`, `priority` and
//! `service_tier`). Wrong types never fail the parse: a field of an unexpected type is treated
//! as absent, so one odd field cannot turn a whole request into a fallback. Input that is not
//! JSON at all is an error, which the caller turns into the documented header-only decision.
//!
//! The scanner is hand-written. It accepts and refuses exactly what the serde_json visitors it
//! replaced did (serde_json 1.0.128; tests/common/serde_scanner.rs keeps them, and the fuzz test
//! compares the two), which is not quite "valid JSON":
//! - where a value is *read* (top-level keys and the fields below, message keys and contents,
//!   text parts), strings are validated as serde_json parses a `&str`: UTF-8, escapes, paired
//!   `\u` surrogates; numbers must fit an f64 (`1e400` is refused);
//! - where a value is *skipped* (any other field, a message's `role`, tools, …) only the
//!   grammar is checked, as serde_json's `IgnoredAny` does: bytes inside skipped strings are not
//!   UTF-8-checked, a `\u` escape needs four hex digits but no surrogate pairing, numbers any
//!   size; nesting has no depth limit there (serde_json skips with a heap stack, and so does
//!   this), and the values that are read are at most 6 levels deep, far from its limit of 128.
//!
//! Strings, most of a chat body, are scanned 16 bytes a step (SWAR on two u64s): the next `"`,
//! `\` or control byte, and whether any byte ≥ 0x80 came before it. A run of ASCII is then
//! counted by its length alone; only a run with other bytes is UTF-8-validated and its
//! characters counted (bytes that are not 0b10xxxxxx continuation bytes, also a word at a time).
//! serde_json made three passes over each content string (find its end, validate it, count it).
//! Floats and over-long integers where a value is read, and strings with escapes that must be
//! kept (an escaped `model`) or matched (an escaped key), are rare: serde_json itself decodes
//! those few tokens, so their edge cases (range, rounding, decoding) stay its own.

use std::borrow::Cow;

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

/// Parse a body. `Err` means it is not a JSON object (garbage, truncated, bad escapes, …).
pub fn parse_body(bytes: &[u8]) -> Result<BodyFacts, String> {
    Scanner { b: bytes, i: 0 }.body().map_err(|Bad(why, at)| format!("{why} at byte {at}"))
}

/// Why and where a body was refused.
struct Bad(&'static str, usize);

type Res<T> = Result<T, Bad>;

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// Bit 7 of a byte of the result is set where `w` has a byte that ends a run of plain string
/// bytes: `"`, `\` or a control byte (< 0x20). The lowest set bit is exact; bits above it may be
/// false positives (a borrow runs up from the first match), so only the lowest is used.
/// Flipping bit 1 maps `"` (0x22) to 0x20 and keeps control bytes below 0x20, so one
/// "byte < 0x21" test finds both; a second finds `\`.
#[inline(always)]
fn stops(w: u64) -> u64 {
    let ctrl_or_quote = w ^ (ONES * 0x02);
    let backslash = w ^ (ONES * u64::from(b'\\'));
    // Bytes ≥ 0x80 have bit 7 set in all three words: `& !w` drops them.
    (ctrl_or_quote.wrapping_sub(ONES * 0x21) | backslash.wrapping_sub(ONES)) & !w & HIGH
}

/// The index of the first `"`, `\` or control byte at or after `from` (`b.len()` if none), and,
/// when `HIGH_BYTES`, whether a byte ≥ 0x80 came before it. Two words per step.
#[inline(always)]
fn find_stop<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    let rest = b.get(from..).unwrap_or(&[]);
    let mut high = 0u64;
    let mut at = from;
    let mut pairs = rest.chunks_exact(16);
    for pair in &mut pairs {
        let (lo, hi) = pair.split_at(8);
        let w0 = u64::from_le_bytes(lo.try_into().unwrap_or([0; 8]));
        let w1 = u64::from_le_bytes(hi.try_into().unwrap_or([0; 8]));
        let (m0, m1) = (stops(w0), stops(w1));
        if m0 | m1 != 0 {
            let (w, m, at) = if m0 != 0 { (w0, m0, at) } else { (w1, m1, at + 8) };
            if HIGH_BYTES && m0 == 0 {
                high |= w0;
            }
            return stop_in(w, m, at, high);
        }
        if HIGH_BYTES {
            high |= w0 | w1;
        }
        at += 16;
    }
    let tail = pairs.remainder();
    if tail.len() >= 8 {
        let w = u64::from_le_bytes(tail.get(..8).and_then(|x| x.try_into().ok()).unwrap_or([0; 8]));
        let m = stops(w);
        if m != 0 {
            return stop_in(w, m, at, high);
        }
        high |= w;
        at += 8;
    }
    for &c in tail.get(8..).unwrap_or(tail) {
        if c == b'"' || c == b'\\' || c < 0x20 {
            break;
        }
        high |= u64::from(c);
        at += 1;
    }
    (at, high & HIGH != 0)
}

/// The stop in word `w` (at `at`, `m = stops(w) != 0`), with the bytes ≥ 0x80 seen before it.
#[inline(always)]
fn stop_in(w: u64, m: u64, at: usize, high: u64) -> (usize, bool) {
    let k = m.trailing_zeros() as usize / 8;
    // Only the k bytes before the stop count (little-endian: the low ones).
    let before = w & (1u64 << (8 * k)).wrapping_sub(1);
    (at + k, (high | before) & HIGH != 0)
}

/// Characters of a run of string bytes that has bytes ≥ 0x80: `None` if it is not UTF-8.
fn utf8_chars(run: &[u8]) -> Option<u64> {
    std::str::from_utf8(run).ok()?;
    let mut continuation = 0u64;
    let mut words = run.chunks_exact(8);
    for chunk in &mut words {
        let w = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
        // 0b10xxxxxx: bit 7 set and bit 6 (shifted up into bit 7's place) clear.
        continuation += u64::from((w & !(w << 1) & HIGH).count_ones());
    }
    continuation += words.remainder().iter().filter(|&&c| c & 0xC0 == 0x80).count() as u64;
    Some((run.len() as u64).saturating_sub(continuation))
}

/// A string that was read (validated): its contents are `b[start..end]`, raw.
struct Str {
    start: usize,
    end: usize,
    chars: u64,
    escaped: bool,
}

/// A value as serde_json's `deserialize_any` meets it: scalars read whole (strings and numbers
/// validated), a composite only seen (the position stays on its bracket).
enum Tok {
    Str(Str),
    Int(u64),
    /// Negative integers (i64 range, -0 excluded: serde_json reads that as the f64 -0.0).
    Neg(i64),
    Float,
    Bool(bool),
    Null,
    Array,
    Object,
}

/// The depth-first stack of the containers a skipped value is inside (`true`: an object); the
/// first 64 levels in a word, deeper ones on the heap, so any depth is skipped.
struct Frames {
    depth: usize,
    low: u64,
    deep: Vec<u64>,
}

impl Frames {
    fn push(&mut self, object: bool) {
        let d = self.depth;
        if d < 64 {
            self.low = (self.low & !(1 << d)) | (u64::from(object) << d);
        } else {
            let (word, bit) = ((d - 64) / 64, (d - 64) % 64);
            if word >= self.deep.len() {
                self.deep.push(0);
            }
            if let Some(x) = self.deep.get_mut(word) {
                *x = (*x & !(1 << bit)) | (u64::from(object) << bit);
            }
        }
        self.depth += 1;
    }
    /// The innermost container: `Some(true)` for an object, `None` outside any.
    fn top(&self) -> Option<bool> {
        let d = self.depth.checked_sub(1)?;
        Some(if d < 64 {
            self.low >> d & 1 == 1
        } else {
            self.deep.get((d - 64) / 64).map_or(false, |x| x >> ((d - 64) % 64) & 1 == 1)
        })
    }
    fn pop(&mut self) {
        self.depth = self.depth.saturating_sub(1);
    }
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    /// The next byte that is not JSON whitespace (not consumed).
    #[inline(always)]
    fn peek(&mut self) -> Option<u8> {
        while let Some(&c) = self.b.get(self.i) {
            if !matches!(c, b' ' | b'\n' | b'\t' | b'\r') {
                return Some(c);
            }
            self.i += 1;
        }
        None
    }

    fn next_byte(&mut self) -> Option<u8> {
        let c = self.b.get(self.i).copied();
        self.i += usize::from(c.is_some());
        c
    }

    fn bad<T>(&self, why: &'static str) -> Res<T> {
        Err(Bad(why, self.i))
    }

    fn literal(&mut self, word: &[u8]) -> Res<()> {
        if self.b.get(self.i..self.i + word.len()) != Some(word) {
            return self.bad("invalid literal");
        }
        self.i += word.len();
        Ok(())
    }

    /// Four hex digits of a `\u` escape.
    fn hex4(&mut self) -> Res<u16> {
        let mut n = 0u16;
        for _ in 0..4 {
            let d = match self.next_byte() {
                Some(c @ b'0'..=b'9') => c - b'0',
                Some(c @ b'a'..=b'f') => c - b'a' + 10,
                Some(c @ b'A'..=b'F') => c - b'A' + 10,
                _ => return self.bad("invalid \\u escape"),
            };
            n = n << 4 | u16::from(d);
        }
        Ok(n)
    }

    /// After a backslash. `read`: as serde_json parsing a `&str` (a `\u` surrogate must be a
    /// leading one followed by `\u` and a trailing one); else as it skips a string (any four
    /// hex digits). Every escape of a read string is one character.
    fn escape(&mut self, read: bool) -> Res<()> {
        match self.next_byte() {
            Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Ok(()),
            Some(b'u') => {
                let n = self.hex4()?;
                if !read {
                    return Ok(());
                }
                match n {
                    0xDC00..=0xDFFF => self.bad("lone trailing surrogate"),
                    0xD800..=0xDBFF => {
                        if self.next_byte() != Some(b'\\') || self.next_byte() != Some(b'u') {
                            return self.bad("lone leading surrogate");
                        }
                        match self.hex4()? {
                            0xDC00..=0xDFFF => Ok(()),
                            _ => self.bad("lone leading surrogate"),
                        }
                    }
                    _ => Ok(()),
                }
            }
            _ => self.bad("invalid escape"),
        }
    }

    /// A string that is read, after its opening quote: validated, its characters counted.
    fn string(&mut self) -> Res<Str> {
        let start = self.i;
        let (mut chars, mut escaped) = (0u64, false);
        loop {
            let (stop, high) = find_stop::<true>(self.b, self.i);
            let run = self.b.get(self.i..stop).unwrap_or(&[]);
            let n = if high {
                match utf8_chars(run) {
                    Some(n) => n,
                    None => return self.bad("invalid UTF-8 in a string"),
                }
            } else {
                run.len() as u64
            };
            chars = chars.saturating_add(n);
            self.i = stop;
            match self.next_byte() {
                Some(b'"') => return Ok(Str { start, end: stop, chars, escaped }),
                Some(b'\\') => {
                    self.escape(true)?;
                    chars = chars.saturating_add(1);
                    escaped = true;
                }
                Some(_) => return self.bad("control character in a string"),
                None => return self.bad("unterminated string"),
            }
        }
    }

    /// A string that is skipped, after its opening quote.
    fn skip_string(&mut self) -> Res<()> {
        loop {
            let (stop, _) = find_stop::<false>(self.b, self.i);
            self.i = stop;
            match self.next_byte() {
                Some(b'"') => return Ok(()),
                Some(b'\\') => self.escape(false)?,
                Some(_) => return self.bad("control character in a string"),
                None => return self.bad("unterminated string"),
            }
        }
    }

    /// The decoded bytes of a read string (borrowed unless it has escapes: serde_json decodes
    /// those, on the string's own bytes).
    fn decoded(&self, s: &Str) -> Res<Cow<'a, [u8]>> {
        let raw = self.b.get(s.start..s.end).unwrap_or(&[]);
        if !s.escaped {
            return Ok(Cow::Borrowed(raw));
        }
        let quoted = self.b.get(s.start.saturating_sub(1)..s.end + 1).unwrap_or(&[]);
        match serde_json::from_slice::<String>(quoted) {
            Ok(t) => Ok(Cow::Owned(t.into_bytes())),
            Err(_) => Err(Bad("invalid string", s.start)),
        }
    }

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

    /// Past a number (the position is on it), as JSON's grammar has it: all serde_json checks
    /// where it skips one. `true` for an integer (no fraction, no exponent).
    fn number_token(&mut self) -> Res<bool> {
        let digit = |c: Option<&u8>| matches!(c, Some(b'0'..=b'9'));
        let b = self.b;
        let mut i = self.i;
        if b.get(i) == Some(&b'-') {
            i += 1;
        }
        match b.get(i) {
            Some(b'0') => {
                i += 1;
                if digit(b.get(i)) {
                    return Err(Bad("leading zero", i));
                }
            }
            Some(b'1'..=b'9') => {
                i += 1;
                while digit(b.get(i)) {
                    i += 1;
                }
            }
            _ => return Err(Bad("invalid number", i)),
        }
        let mut integer = true;
        if b.get(i) == Some(&b'.') {
            integer = false;
            i += 1;
            if !digit(b.get(i)) {
                return Err(Bad("invalid number", i));
            }
            while digit(b.get(i)) {
                i += 1;
            }
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            integer = false;
            i += 1;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            if !digit(b.get(i)) {
                return Err(Bad("invalid number", i));
            }
            while digit(b.get(i)) {
                i += 1;
            }
        }
        self.i = i;
        Ok(integer)
    }

    /// A number that is read: an integer as serde_json types it (u64, negative i64, else f64),
    /// and refused where serde_json refuses it (an f64 that overflows).
    fn number(&mut self) -> Res<Tok> {
        let start = self.i;
        let integer = self.number_token()?;
        let token = self.b.get(start..self.i).unwrap_or(&[]);
        if integer {
            let (negative, digits) = match token.split_first() {
                Some((b'-', rest)) => (true, rest),
                _ => (false, token),
            };
            let value = digits.iter().try_fold(0u64, |n, &c| n.checked_mul(10)?.checked_add(u64::from(c.wrapping_sub(b'0'))));
            if let Some(n) = value {
                if !negative {
                    return Ok(Tok::Int(n));
                }
                // serde_json: -0 and values below i64::MIN are f64s.
                let neg = (n as i64).wrapping_neg();
                return Ok(if neg >= 0 { Tok::Float } else { Tok::Neg(neg) });
            }
        }
        // A fraction, an exponent or an integer past u64: an f64, which serde_json refuses if
        // it overflows (`1e400`); it decides, on this token alone, by the same code path.
        match serde_json::from_slice::<f64>(token) {
            Ok(_) => Ok(Tok::Float),
            Err(_) => Err(Bad("number out of range", start)),
        }
    }

    /// The next value, as serde_json's `deserialize_any` starts it.
    fn any(&mut self) -> Res<Tok> {
        Ok(match self.peek() {
            Some(b'"') => {
                self.i += 1;
                Tok::Str(self.string()?)
            }
            Some(b'[') => Tok::Array,
            Some(b'{') => Tok::Object,
            Some(b't') => {
                self.literal(b"true")?;
                Tok::Bool(true)
            }
            Some(b'f') => {
                self.literal(b"false")?;
                Tok::Bool(false)
            }
            Some(b'n') => {
                self.literal(b"null")?;
                Tok::Null
            }
            Some(b'-' | b'0'..=b'9') => self.number()?,
            _ => return self.bad("expected a value"),
        })
    }

    /// After `any`, for a visitor that does not look inside a composite: an array is skipped
    /// whole (`IgnoredAny` elements), an object entry by entry (its keys are read, as serde_json
    /// reads map keys even into `IgnoredAny`; its values are skipped).
    fn skip_composite(&mut self, t: &Tok) -> Res<()> {
        match t {
            Tok::Array => self.skip_value(),
            Tok::Object => {
                self.i += 1;
                let mut first = true;
                while self.key(&mut first)?.is_some() {
                    self.skip_value()?;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The next key of an object that is read (after its `{` or a value), positioned after its
    /// `:`; `None`, past the `}`, at the end.
    fn key(&mut self, first: &mut bool) -> Res<Option<Str>> {
        match self.peek() {
            Some(b'}') => {
                self.i += 1;
                return Ok(None);
            }
            Some(b',') if !*first => {
                self.i += 1;
                if self.peek() != Some(b'"') {
                    return self.bad("expected a key");
                }
            }
            Some(b'"') if *first => {}
            _ => return self.bad("expected a key"),
        }
        *first = false;
        self.i += 1;
        let k = self.string()?;
        self.colon()?;
        Ok(Some(k))
    }

    fn colon(&mut self) -> Res<()> {
        if self.peek() != Some(b':') {
            return self.bad("expected ':'");
        }
        self.i += 1;
        Ok(())
    }

    /// Whether an array that is read (after its `[` or an element) has another element;
    /// past the `]` when not.
    fn element(&mut self, first: &mut bool) -> Res<bool> {
        match self.peek() {
            Some(b']') => {
                self.i += 1;
                return Ok(false);
            }
            Some(b',') if !*first => {
                self.i += 1;
                if matches!(self.peek(), Some(b']') | None) {
                    return self.bad("expected a value");
                }
            }
            Some(_) if *first => {}
            _ => return self.bad("expected ',' or ']'"),
        }
        *first = false;
        Ok(true)
    }

    fn key_is(&self, k: &Str, name: &[u8]) -> Res<bool> {
        Ok(if k.escaped { *self.decoded(k)? == *name } else { self.b.get(k.start..k.end) == Some(name) })
    }

    /// Skip one value (serde_json's `IgnoredAny`): the grammar only, any depth, no recursion.
    fn skip_value(&mut self) -> Res<()> {
        let mut frames = Frames { depth: 0, low: 0, deep: Vec::new() };
        loop {
            match self.peek() {
                Some(b'"') => {
                    self.i += 1;
                    self.skip_string()?;
                }
                Some(b'[') => {
                    self.i += 1;
                    if self.peek() == Some(b']') {
                        self.i += 1;
                    } else {
                        frames.push(false);
                        continue;
                    }
                }
                Some(b'{') => {
                    self.i += 1;
                    match self.peek() {
                        Some(b'}') => self.i += 1,
                        Some(b'"') => {
                            frames.push(true);
                            self.skip_key()?;
                            continue;
                        }
                        _ => return self.bad("expected a key"),
                    }
                }
                Some(b't') => self.literal(b"true")?,
                Some(b'f') => self.literal(b"false")?,
                Some(b'n') => self.literal(b"null")?,
                Some(b'-' | b'0'..=b'9') => {
                    self.number_token()?;
                }
                _ => return self.bad("expected a value"),
            }
            // A value ended: close the containers that end with it, up to the next one.
            loop {
                let object = match frames.top() {
                    Some(o) => o,
                    None => return Ok(()),
                };
                match self.peek() {
                    Some(b',') => {
                        self.i += 1;
                        if object {
                            if self.peek() != Some(b'"') {
                                return self.bad("expected a key");
                            }
                            self.skip_key()?;
                        }
                        break;
                    }
                    Some(b']') if !object => {}
                    Some(b'}') if object => {}
                    _ => return self.bad("expected ',' or the end of a container"),
                }
                self.i += 1;
                frames.pop();
            }
        }
    }

    /// A key of a skipped object (position on its quote) and its `:`.
    fn skip_key(&mut self) -> Res<()> {
        self.i += 1;
        self.skip_string()?;
        self.colon()
    }

    /// The whole body: one object, then only whitespace.
    fn body(&mut self) -> Res<BodyFacts> {
        if self.peek() != Some(b'{') {
            return self.bad("not a JSON object");
        }
        self.i += 1;
        let mut facts = BodyFacts::default();
        // Duplicate keys: the last one wins, as in every JSON library the sidecar might use.
        let (mut message_chars, mut prompt_chars) = (0u64, 0u64);
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
                b"messages" => (facts.message_count, message_chars) = self.messages()?,
                b"prompt" => prompt_chars = self.text(0)?,
                _ => self.skip_value()?,
            }
        }
        facts.prompt_chars = message_chars.saturating_add(prompt_chars);
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

    /// `messages`: (count, characters of text content). Non-array values count as no messages.
    fn messages(&mut self) -> Res<(u64, u64)> {
        let t = self.any()?;
        if !matches!(t, Tok::Array) {
            self.skip_composite(&t)?;
            return Ok((0, 0));
        }
        self.i += 1;
        let (mut count, mut chars, mut first) = (0u64, 0u64, true);
        while self.element(&mut first)? {
            chars = chars.saturating_add(self.message()?);
            count += 1;
        }
        Ok((count, chars))
    }

    /// One message: the characters of its `content` (the last one, if repeated).
    fn message(&mut self) -> Res<u64> {
        let t = self.any()?;
        if !matches!(t, Tok::Object) {
            self.skip_composite(&t)?;
            return Ok(0);
        }
        self.i += 1;
        let (mut chars, mut first) = (0u64, true);
        while let Some(k) = self.key(&mut first)? {
            if self.key_is(&k, b"content")? {
                chars = self.text(0)?;
            } else {
                self.skip_value()?;
            }
        }
        Ok(chars)
    }

    /// Characters of text in a value: a string, or (at depth 0) an array of strings / text
    /// parts (`{"type": "text", "text": "..."}`); token-id arrays count one per token. Other
    /// shapes: 0. Recursion: depth 0 → 1 only.
    fn text(&mut self, depth: u8) -> Res<u64> {
        Ok(match self.any()? {
            Tok::Str(s) => s.chars,
            Tok::Int(_) | Tok::Neg(_) => u64::from(depth > 0),
            Tok::Float | Tok::Bool(_) | Tok::Null => 0,
            Tok::Array if depth == 0 => {
                self.i += 1;
                let (mut total, mut first) = (0u64, true);
                while self.element(&mut first)? {
                    total = total.saturating_add(self.text(1)?);
                }
                total
            }
            Tok::Array => {
                self.skip_value()?;
                0
            }
            Tok::Object => {
                // A content part: only its "text" counts (the last one, if repeated).
                self.i += 1;
                let (mut total, mut first) = (0u64, true);
                while let Some(k) = self.key(&mut first)? {
                    if self.key_is(&k, b"text")? {
                        let t = self.any()?;
                        self.skip_composite(&t)?;
                        total = if let Tok::Str(s) = t { s.chars } else { 0 };
                    } else {
                        self.skip_value()?;
                    }
                }
                total
            }
        })
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

    #[test]
    fn word_scan_finds_the_first_stop_byte_as_a_byte_loop_does() {
        let mut x = 0x9e3779b97f4a7c15u64;
        let alphabet = [b'a', b' ', b'"', b'\\', 0x00, 0x1f, 0x20, 0x21, 0x23, 0x5b, 0x5d, 0x7f, 0x80, 0xa2, 0xdc, 0xc3, 0xff];
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 40) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|j| {
                    let r = x.rotate_left(j as u32 * 5);
                    if r % 3 == 0 { alphabet[(r >> 8) as usize % alphabet.len()] } else { b'a' }
                })
                .collect();
            let from = (x >> 32) as usize % (len + 1);
            let stop = (from..len).find(|&j| matches!(bytes[j], b'"' | b'\\' | 0..=0x1f)).unwrap_or(len);
            let high = bytes[from..stop].iter().any(|&c| c >= 0x80);
            assert_eq!(find_stop::<true>(&bytes, from), (stop, high), "{:?} from {}", bytes, from);
            assert_eq!(find_stop::<false>(&bytes, from).0, stop);
        }
        for c in 0..=255u8 {
            for k in 0..8 {
                let mut w = *b"aaaaaaaa";
                w[k] = c;
                let m = stops(u64::from_le_bytes(w));
                let want = matches!(c, b'"' | b'\\' | 0..=0x1f);
                assert_eq!(m != 0 && m.trailing_zeros() as usize / 8 == k, want, "byte {c:#x} at {k}");
            }
        }
    }

    #[test]
    fn kept_strings_are_bounded() {
        let long = format!("{{\"model\":\"{}\u{e9}\"}}", "a".repeat(MAX_KEPT_STRING - 1));
        let f = parse_body(long.as_bytes()).unwrap();
        assert_eq!(f.model.unwrap().len(), MAX_KEPT_STRING - 1);
    }
}
