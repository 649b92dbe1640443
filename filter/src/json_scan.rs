//! JSON at the byte level, for the body's field walk (body.rs): the grammar, strings 16 bytes
//! a step, and values skipped at any depth. Nothing here knows which fields a rule reads.
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
//! Strings are scanned 16 bytes a step (SWAR on two u64s): the next `"`, `\` or control byte,
//! and whether a byte ≥ 0x80 came before it. A run of ASCII is counted by its length alone; only
//! a run with other bytes is UTF-8-validated and its characters counted (bytes that are not
//! 0b10xxxxxx continuation bytes, a word at a time). Floats and over-long integers that are
//! read, and escaped strings that must be kept or matched, are rare: serde_json decodes those
//! few tokens itself, so their edge cases (range, rounding, decoding) stay its own.

use std::borrow::Cow;

/// Why and where a body was refused.
pub(crate) struct Bad(pub(crate) &'static str, pub(crate) usize);

pub(crate) type Res<T> = Result<T, Bad>;

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
/// when `HIGH_BYTES`, whether a byte ≥ 0x80 came before it: 16-byte vectors where the target has
/// them (Wasm SIMD in the filter, SSE2 natively, so the tests run the same loop), else words.
#[inline(always)]
fn find_stop<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    #[cfg(any(target_arch = "wasm32", target_arch = "x86_64"))]
    return find_stop_vectors::<HIGH_BYTES>(b, from);
    #[cfg(not(any(target_arch = "wasm32", target_arch = "x86_64")))]
    return find_stop_words::<HIGH_BYTES>(b, from);
}

/// `find_stop` with vectors: 64 bytes a step while no stop is in them ([`quad_flags`]: one
/// branch per four vectors), then 16 bytes a step, per block a bit per byte that is a stop and a
/// bit per byte ≥ 0x80 ([`masks16`]); fewer than 16 bytes left go to the word scan.
#[cfg(any(target_arch = "wasm32", target_arch = "x86_64"))]
#[cfg_attr(target_arch = "wasm32", target_feature(enable = "simd128"))]
fn find_stop_vectors<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
    let mut at = from;
    let mut quad_high = false;
    for quad in b.get(from..).unwrap_or(&[]).chunks_exact(64) {
        let (stop, high) = quad_flags(quad);
        if stop {
            break;
        }
        quad_high |= HIGH_BYTES && high;
        at += 64;
    }
    let rest = b.get(at..).unwrap_or(&[]);
    let mut high = u32::from(quad_high);
    let mut blocks = rest.chunks_exact(16);
    for block in &mut blocks {
        let (stop, block_high) = masks16(block);
        if stop != 0 {
            let k = stop.trailing_zeros();
            // Only the bytes before the stop count.
            return (at + k as usize, HIGH_BYTES && (high | (block_high & ((1u32 << k) - 1))) != 0);
        }
        if HIGH_BYTES {
            high |= block_high;
        }
        at += 16;
    }
    let (end, tail_high) = find_stop_words::<HIGH_BYTES>(b, at);
    (end, HIGH_BYTES && (high != 0 || tail_high))
}

/// For 16 bytes: (a bit per `"`, `\` or control byte, a bit per byte ≥ 0x80), byte 0 in bit 0.
#[cfg(target_arch = "wasm32")]
#[target_feature(enable = "simd128")]
#[inline]
fn masks16(block: &[u8]) -> (u32, u32) {
    use core::arch::wasm32::*;
    if block.len() < 16 {
        return (0, 0);
    }
    // SAFETY: 16 readable bytes (checked above); v128_load reads unaligned.
    let v = unsafe { v128_load(block.as_ptr() as *const v128) };
    let quote_or_backslash = v128_or(u8x16_eq(v, u8x16_splat(b'"')), u8x16_eq(v, u8x16_splat(b'\\')));
    let stop = v128_or(quote_or_backslash, u8x16_lt(v, u8x16_splat(0x20)));
    (u8x16_bitmask(stop) as u32, u8x16_bitmask(v) as u32)
}

/// For 64 bytes: (whether any is a `"`, `\\` or control byte, whether any is ≥ 0x80).
#[cfg(target_arch = "wasm32")]
#[target_feature(enable = "simd128")]
#[inline]
fn quad_flags(quad: &[u8]) -> (bool, bool) {
    use core::arch::wasm32::*;
    if quad.len() < 64 {
        return (true, false);
    }
    let (quote, backslash, space) = (u8x16_splat(b'"'), u8x16_splat(b'\\'), u8x16_splat(0x20));
    let (mut stop, mut high) = (u8x16_splat(0), u8x16_splat(0));
    for block in quad.chunks_exact(16) {
        // SAFETY: 16 readable bytes (a chunk of 64 checked above); v128_load reads unaligned.
        let v = unsafe { v128_load(block.as_ptr() as *const v128) };
        stop = v128_or(stop, v128_or(v128_or(u8x16_eq(v, quote), u8x16_eq(v, backslash)), u8x16_lt(v, space)));
        high = v128_or(high, v);
    }
    (v128_any_true(stop), u8x16_bitmask(high) != 0)
}

/// The SSE2 twin of the Wasm `quad_flags`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn quad_flags(quad: &[u8]) -> (bool, bool) {
    use core::arch::x86_64::*;
    if quad.len() < 64 {
        return (true, false);
    }
    // SAFETY: 16 readable bytes per chunk (of 64, checked above), unaligned loads; SSE2 is
    // baseline on x86_64.
    unsafe {
        let (quote, backslash, below_space) = (_mm_set1_epi8(b'"' as i8), _mm_set1_epi8(b'\\' as i8), _mm_set1_epi8(0x1f));
        let (mut stop, mut high) = (_mm_setzero_si128(), _mm_setzero_si128());
        for block in quad.chunks_exact(16) {
            let v = _mm_loadu_si128(block.as_ptr() as *const __m128i);
            let control = _mm_cmpeq_epi8(_mm_min_epu8(v, below_space), v);
            stop = _mm_or_si128(stop, _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)), control));
            high = _mm_or_si128(high, v);
        }
        (_mm_movemask_epi8(stop) != 0, _mm_movemask_epi8(high) != 0)
    }
}

/// The SSE2 twin of the Wasm `masks16` (SSE2 is part of x86_64): what `cargo test` runs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn masks16(block: &[u8]) -> (u32, u32) {
    use core::arch::x86_64::*;
    if block.len() < 16 {
        return (0, 0);
    }
    // SAFETY: 16 readable bytes (checked above), an unaligned load; SSE2 is baseline on x86_64.
    unsafe {
        let v = _mm_loadu_si128(block.as_ptr() as *const __m128i);
        let quote_or_backslash = _mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8)), _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8)));
        // Unsigned v < 0x20 as min(v, 0x1f) == v.
        let control = _mm_cmpeq_epi8(_mm_min_epu8(v, _mm_set1_epi8(0x1f)), v);
        let stop = _mm_or_si128(quote_or_backslash, control);
        (_mm_movemask_epi8(stop) as u32, _mm_movemask_epi8(v) as u32)
    }
}

/// `find_stop` two words per step (SWAR); also the tail of the vector scan.
#[inline(always)]
fn find_stop_words<const HIGH_BYTES: bool>(b: &[u8], from: usize) -> (usize, bool) {
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
pub(crate) struct Str {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) chars: u64,
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
pub(crate) struct Scanner<'a> {
    pub(crate) b: &'a [u8],
    pub(crate) i: usize,
}

impl<'a> Scanner<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Scanner { b, i: 0 }
    }

    /// The next byte that is not JSON whitespace (not consumed).
    #[inline(always)]
    pub(crate) fn peek(&mut self) -> Option<u8> {
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

    pub(crate) fn bad<T>(&self, why: &'static str) -> Res<T> {
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
    pub(crate) fn decoded(&self, s: &Str) -> Res<Cow<'a, [u8]>> {
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
        Ok(if k.escaped { *self.decoded(k)? == *name } else { self.b.get(k.start..k.end) == Some(name) })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_scan_finds_the_first_stop_byte_as_a_byte_loop_does() {
        let mut x = 0x9e3779b97f4a7c15u64;
        let alphabet = [b'a', b' ', b'"', b'\\', 0x00, 0x1f, 0x20, 0x21, 0x23, 0x5b, 0x5d, 0x7f, 0x80, 0xa2, 0xdc, 0xc3, 0xff];
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 200) as usize;
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
            assert_eq!(find_stop_words::<true>(&bytes, from), (stop, high), "{:?} from {}", bytes, from);
            assert_eq!(find_stop_words::<false>(&bytes, from).0, stop);
        }
        // Long plain runs (the 64-byte steps): one stop and one byte ≥ 0x80 anywhere.
        for len in [63usize, 64, 65, 80, 127, 128, 129, 200] {
            for stop_at in (0..=len).step_by(3) {
                for high_at in [None, Some(0), Some(stop_at.saturating_sub(1)), Some(stop_at + 1), Some(len / 2)] {
                    let mut bytes = vec![b'a'; len];
                    if let Some(h) = high_at.filter(|&h| h < len) {
                        bytes[h] = 0xc3;
                    }
                    if stop_at < len {
                        bytes[stop_at] = if stop_at % 2 == 0 { b'"' } else { 0x1f };
                    }
                    for from in [0, 1, 17].into_iter().filter(|&f| f <= len) {
                        let stop = (from..len).find(|&j| matches!(bytes[j], b'"' | b'\\' | 0..=0x1f)).unwrap_or(len);
                        let high = bytes[from..stop].iter().any(|&c| c >= 0x80);
                        assert_eq!(find_stop::<true>(&bytes, from), (stop, high), "len {len} stop {stop_at} high {high_at:?} from {from}");
                        assert_eq!(find_stop::<false>(&bytes, from).0, stop);
                    }
                }
            }
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
}
