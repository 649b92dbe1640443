//! The JSON grammar, for the body's field walk (body.rs): tokens, strings read or skipped, and
//! values skipped at any depth. Nothing here knows which fields a rule reads; the bytes inside a
//! string are found by string_run.rs.
//!
//! It accepts and refuses exactly what the serde_json 1.0.128 visitors it replaced did
//! (tests/common/serde_scanner.rs keeps them, and the fuzz test compares the two):
//! - a string that is *read* is validated as serde_json parses a `&str`: UTF-8, escapes,
//!   paired `\u` surrogates; a number that is read must fit an f64 (`1e400` is refused);
//! - a value that is *skipped* has only its grammar checked, as serde_json's `IgnoredAny` does:
//!   bytes inside skipped strings are not UTF-8-checked, a `\u` escape needs four hex digits
//!   but no surrogate pairing, numbers any size, nesting any depth (a heap stack, as serde_json
//!   skips).
//!
//! A body is one buffer (the Wasm host copies it into the VM whole) or the segments a native
//! host holds it in, read where they are: a token may cross a segment's end. Positions (and
//! errors) are offsets in the whole body, so a body gives the same result however it is cut. A
//! string cut by a segment end is scanned piece by piece (a UTF-8 character cut there is checked
//! whole); a number, literal or escape is read byte by byte there; a string whose bytes are
//! needed (a kept value, a key) is joined only if it is cut. Floats and over-long integers that
//! are read, and escaped strings that must be kept or matched, are rare: serde_json decodes those
//! few tokens itself, so their edge cases (range, rounding, decoding) stay its own.

use crate::string_run::{find_stop, utf8_chars, utf8_width};
use std::borrow::Cow;

/// Why and where a body was refused.
pub(crate) struct Bad(pub(crate) &'static str, pub(crate) usize);

pub(crate) type Res<T> = Result<T, Bad>;

/// A string that was read (validated): its contents are the body's bytes `start..end`, raw.
pub(crate) struct Str {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) chars: u64,
    /// UTF-8 bytes of the decoded string (a read string's; 0 for a skipped one).
    pub(crate) bytes: u64,
    pub(crate) escaped: bool,
}

/// A value as serde_json's `deserialize_any` meets it: scalars read whole (strings and numbers
/// validated), a composite only seen (the position stays on its bracket).
pub(crate) enum Tok {
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

/// A position in a body. The field walk (body.rs) drives it; everything here is the grammar.
/// After `peek` returns a byte, that byte is `b[i]` (so the walk steps past a bracket with
/// `i += 1`). A copy is a saved position (the content classifier's walk comes back to a value).
#[derive(Clone, Copy)]
pub(crate) struct Scanner<'a> {
    /// The segment being read, and the position in it.
    b: &'a [u8],
    pub(crate) i: usize,
    /// Where `b` starts in the whole body.
    base: usize,
    /// Every segment (none for a body in one buffer), and the index of the one after `b`.
    parts: &'a [&'a [u8]],
    next: usize,
}

/// Bytes that can be part of a number token.
fn numberish(c: u8) -> bool {
    matches!(c, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
}

/// A number in `b` at `i`, as JSON's grammar has it (all serde_json checks where it skips one):
/// where it ends, and `true` for an integer (no fraction, no exponent); errors at offsets in `b`.
fn number_grammar(b: &[u8], mut i: usize) -> Res<(usize, bool)> {
    let digit = |c: Option<&u8>| matches!(c, Some(b'0'..=b'9'));
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
    Ok((i, integer))
}

impl<'a> Scanner<'a> {
    /// A body in one buffer.
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Scanner { b, i: 0, base: 0, parts: &[], next: 0 }
    }

    /// A body in segments, in order (empty ones are passed over).
    pub(crate) fn segments(parts: &'a [&'a [u8]]) -> Self {
        let mut s = Scanner { b: &[], i: 0, base: 0, parts, next: 0 };
        s.advance();
        s
    }

    /// The position in the whole body.
    pub(crate) fn pos(&self) -> usize {
        self.base + self.i
    }

    /// At the end of `b`: on to the next non-empty segment (false at the body's end).
    #[inline(never)]
    fn advance(&mut self) -> bool {
        while let Some(&p) = self.parts.get(self.next) {
            self.next += 1;
            if !p.is_empty() {
                self.base += self.b.len();
                self.b = p;
                self.i = 0;
                return true;
            }
        }
        false
    }

    /// Past `n` bytes (that are there).
    fn skip(&mut self, mut n: usize) {
        loop {
            let room = self.b.len().saturating_sub(self.i);
            if n <= room {
                self.i += n;
                return;
            }
            n -= room;
            self.i = self.b.len();
            if !self.advance() {
                return;
            }
        }
    }

    /// The body's bytes `start..end`: borrowed where one segment holds them (always, for a body
    /// in one buffer), else joined.
    pub(crate) fn span(&self, start: usize, end: usize) -> Cow<'a, [u8]> {
        if let Some(s) = start.checked_sub(self.base).and_then(|lo| self.b.get(lo..end - self.base)) {
            return Cow::Borrowed(s);
        }
        let (mut joined, mut off) = (Vec::new(), 0usize);
        for &p in self.parts {
            let (lo, hi) = (off, off + p.len());
            off = hi;
            if start >= lo && end <= hi {
                return Cow::Borrowed(p.get(start - lo..end - lo).unwrap_or(&[]));
            }
            if start < hi && end > lo {
                joined.extend_from_slice(p.get(start.max(lo) - lo..end.min(hi) - lo).unwrap_or(&[]));
            }
        }
        Cow::Owned(joined)
    }

    /// The body's bytes `start..end`, in the pieces the segments hold them in, to `f` until it
    /// returns false (nothing is joined or copied).
    pub(crate) fn each_slice(&self, start: usize, end: usize, f: &mut dyn FnMut(&[u8]) -> bool) {
        if self.parts.is_empty() {
            if let Some(s) = self.b.get(start..end) {
                f(s);
            }
            return;
        }
        let mut off = 0usize;
        for &p in self.parts {
            let (lo, hi) = (off, off + p.len());
            off = hi;
            if hi <= start || p.is_empty() {
                continue;
            }
            if lo >= end {
                return;
            }
            if !f(p.get(start.max(lo) - lo..end.min(hi) - lo).unwrap_or(&[])) {
                return;
            }
        }
    }

    /// The next byte that is not JSON whitespace (not consumed).
    #[inline(always)]
    pub(crate) fn peek(&mut self) -> Option<u8> {
        loop {
            while let Some(&c) = self.b.get(self.i) {
                if !matches!(c, b' ' | b'\n' | b'\t' | b'\r') {
                    return Some(c);
                }
                self.i += 1;
            }
            if !self.advance() {
                return None;
            }
        }
    }

    fn next_byte(&mut self) -> Option<u8> {
        if self.i >= self.b.len() && !self.advance() {
            return None;
        }
        let c = self.b.get(self.i).copied();
        self.i += usize::from(c.is_some());
        c
    }

    pub(crate) fn bad<T>(&self, why: &'static str) -> Res<T> {
        Err(Bad(why, self.pos()))
    }

    fn literal(&mut self, word: &[u8]) -> Res<()> {
        if self.b.get(self.i..self.i + word.len()) == Some(word) {
            self.i += word.len();
            return Ok(());
        }
        // Not whole in this segment: byte by byte (refused where it starts, as in one piece).
        let start = self.pos();
        for &w in word {
            if self.next_byte() != Some(w) {
                return Err(Bad("invalid literal", start));
            }
        }
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
    /// hex digits). Every escape of a read string is one character, of the UTF-8 bytes returned
    /// (a skipped string's: 1).
    fn escape(&mut self, read: bool) -> Res<u64> {
        match self.next_byte() {
            Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Ok(1),
            Some(b'u') => {
                let n = self.hex4()?;
                if !read {
                    return Ok(1);
                }
                match n {
                    0xDC00..=0xDFFF => self.bad("lone trailing surrogate"),
                    0xD800..=0xDBFF => {
                        if self.next_byte() != Some(b'\\') || self.next_byte() != Some(b'u') {
                            return self.bad("lone leading surrogate");
                        }
                        match self.hex4()? {
                            0xDC00..=0xDFFF => Ok(4),
                            _ => self.bad("lone leading surrogate"),
                        }
                    }
                    0..=0x7F => Ok(1),
                    0x80..=0x7FF => Ok(2),
                    _ => Ok(3),
                }
            }
            _ => self.bad("invalid escape"),
        }
    }

    /// A string that is read, after its opening quote: validated, its characters counted.
    fn string(&mut self) -> Res<Str> {
        let start = self.pos();
        let (mut chars, mut saved, mut escaped) = (0u64, 0u64, false);
        // Where the run of plain bytes began: invalid UTF-8 is refused there, as in one piece.
        let mut run_start = start;
        loop {
            let (stop, high) = find_stop::<true>(self.b, self.i);
            let run = self.b.get(self.i..stop).unwrap_or(&[]);
            let at_end = stop >= self.b.len();
            let n = if high {
                match utf8_chars(run) {
                    Some((n, 0)) => n,
                    Some((n, cut)) if at_end => {
                        self.i = stop;
                        self.cut_character(run.get(run.len() - cut..).unwrap_or(&[]), run_start)?;
                        chars = chars.saturating_add(n);
                        continue;
                    }
                    _ => return Err(Bad("invalid UTF-8 in a string", run_start)),
                }
            } else {
                run.len() as u64
            };
            chars = chars.saturating_add(n);
            self.i = stop;
            if at_end {
                if self.advance() {
                    continue;
                }
                return self.bad("unterminated string");
            }
            match self.next_byte() {
                Some(b'"') => {
                    let end = self.pos() - 1;
                    return Ok(Str { start, end, chars, bytes: ((end - start) as u64).saturating_sub(saved), escaped });
                }
                Some(b'\\') => {
                    // The escape as written (2 or 6 or 12 bytes) is that many fewer decoded.
                    let at = self.pos();
                    let width = self.escape(true)?;
                    saved = saved.saturating_add(((self.pos() - at + 1) as u64).saturating_sub(width));
                    chars = chars.saturating_add(1);
                    escaped = true;
                    run_start = self.pos();
                }
                _ => return self.bad("control character in a string"),
            }
        }
    }

    /// A UTF-8 character that a segment's end cuts after its first bytes `head` (at the end of
    /// `b`): the rest is taken from the segments after and the character checked whole.
    #[inline(never)]
    fn cut_character(&mut self, head: &[u8], run_start: usize) -> Res<()> {
        let mut c = [0u8; 4];
        let width = utf8_width(head.first().copied().unwrap_or(0));
        for (k, slot) in c.iter_mut().enumerate().take(width) {
            *slot = match head.get(k) {
                Some(&x) => x,
                None => match self.next_byte() {
                    Some(x) => x,
                    None => return Err(Bad("invalid UTF-8 in a string", run_start)),
                },
            };
        }
        match std::str::from_utf8(c.get(..width).unwrap_or(&[])) {
            Ok(_) => Ok(()),
            Err(_) => Err(Bad("invalid UTF-8 in a string", run_start)),
        }
    }

    /// A string that is skipped, after its opening quote.
    #[inline(always)]
    fn skip_string(&mut self) -> Res<()> {
        self.span_string().map(|_| ())
    }

    /// A string after its opening quote, its grammar checked as when skipped (not its UTF-8 or
    /// surrogates: the content classifier reads strings of a body the field walk has read, and
    /// takes their bytes as bytes): where its contents are, and whether it has escapes (its
    /// characters are not counted).
    #[inline(always)]
    pub(crate) fn span_string(&mut self) -> Res<Str> {
        let start = self.pos();
        let mut escaped = false;
        loop {
            let (stop, _) = find_stop::<false>(self.b, self.i);
            self.i = stop;
            if stop >= self.b.len() {
                if self.advance() {
                    continue;
                }
                return self.bad("unterminated string");
            }
            match self.next_byte() {
                Some(b'"') => return Ok(Str { start, end: self.pos() - 1, chars: 0, bytes: 0, escaped }),
                Some(b'\\') => {
                    self.escape(false)?;
                    escaped = true;
                }
                _ => return self.bad("control character in a string"),
            }
        }
    }

    /// The decoded bytes of a read string (borrowed unless it has escapes, or a segment's end
    /// cuts it: serde_json decodes escapes, on the string's own bytes).
    pub(crate) fn decoded(&self, s: &Str) -> Res<Cow<'a, [u8]>> {
        if !s.escaped {
            return Ok(self.span(s.start, s.end));
        }
        let quoted = self.span(s.start.saturating_sub(1), s.end + 1);
        match serde_json::from_slice::<String>(&quoted) {
            Ok(t) => Ok(Cow::Owned(t.into_bytes())),
            Err(_) => Err(Bad("invalid string", s.start)),
        }
    }

    /// Past a number (the position is on it): its bytes, and `true` for an integer.
    fn number_token(&mut self) -> Res<(Cow<'a, [u8]>, bool)> {
        let (b, start) = (self.b, self.i);
        if self.next < self.parts.len() && b.get(start..).map_or(true, |t| t.iter().all(|&c| numberish(c))) {
            return self.cut_number();
        }
        let (end, integer) = number_grammar(b, start).map_err(|Bad(why, at)| Bad(why, self.base + at))?;
        self.i = end;
        Ok((Cow::Borrowed(b.get(start..end).unwrap_or(&[])), integer))
    }

    /// A number that may go on past the end of this segment: its bytes joined, then read.
    #[inline(never)]
    fn cut_number(&mut self) -> Res<(Cow<'a, [u8]>, bool)> {
        let start = self.pos();
        let mut token = self.b.get(self.i..).unwrap_or(&[]).to_vec();
        for &p in self.parts.get(self.next..).unwrap_or(&[]) {
            let n = p.iter().position(|&c| !numberish(c));
            token.extend_from_slice(p.get(..n.unwrap_or(p.len())).unwrap_or(&[]));
            if n.is_some() {
                break;
            }
        }
        let (end, integer) = number_grammar(&token, 0).map_err(|Bad(why, at)| Bad(why, start + at))?;
        self.skip(end);
        token.truncate(end);
        Ok((Cow::Owned(token), integer))
    }

    /// A number that is read: an integer as serde_json types it (u64, negative i64, else f64),
    /// and refused where serde_json refuses it (an f64 that overflows).
    fn number(&mut self) -> Res<Tok> {
        let start = self.pos();
        let (token, integer) = self.number_token()?;
        if integer {
            let (negative, digits) = match token.split_first() {
                Some((b'-', rest)) => (true, rest),
                _ => (false, &token[..]),
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
        match serde_json::from_slice::<f64>(&token) {
            Ok(_) => Ok(Tok::Float),
            Err(_) => Err(Bad("number out of range", start)),
        }
    }

    /// The next value, as serde_json's `deserialize_any` starts it.
    pub(crate) fn any(&mut self) -> Res<Tok> {
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
    pub(crate) fn skip_composite(&mut self, t: &Tok) -> Res<()> {
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
    pub(crate) fn key(&mut self, first: &mut bool) -> Res<Option<Str>> {
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
    pub(crate) fn element(&mut self, first: &mut bool) -> Res<bool> {
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

    pub(crate) fn key_is(&self, k: &Str, name: &[u8]) -> Res<bool> {
        Ok(if k.escaped { *self.decoded(k)? == *name } else { k.end - k.start == name.len() && *self.span(k.start, k.end) == *name })
    }

    /// Skip one value (serde_json's `IgnoredAny`): the grammar only, any depth, no recursion.
    pub(crate) fn skip_value(&mut self) -> Res<()> {
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
}
