//! The content classifier (docs/content-classes.md, issue 32): a hashed n-gram linear model over
//! the user's text of a request, whose weights come in the filter config (`content_model`).
//!
//! - The text (`BodyText`): the user turns of chat / Anthropic `messages`, a completion's
//!   `prompt`, a Responses `input`, JSON-decoded and joined with `\n`; read by its own walk over
//!   the body (json_scan's grammar), run only when a rule with a `content` condition is reached,
//!   and stopped at the model's `max_text_bytes`.
//! - Features (`Features`): tokens are runs of ASCII letters/digits and bytes >= 0x80 (ASCII
//!   lower-cased); per token its word hash, the bigram with the token before, and its character
//!   n-grams (of `<token>`), each FNV-1a 32 hashed into `dim` buckets. Fixed-size state: the
//!   token's hash, the previous token's, the last 8 bytes of the token; nothing is allocated.
//! - Scoring: int8 weights summed per label (exact integers), then `bias + scale * S / n` in f64,
//!   the argmax (ties to the lowest label) and its softmax probability.
//!
//! The same code scores the contract test's examples natively (examples/content_eval.rs), so the
//! Python reference model (B's side) and Envoy give the same label.

use crate::json_scan::{Res, Scanner, Str, Tok};
use std::fmt;

/// Bounds of a model (`content_model`), checked by `ContentModel::from_raw` (config.rs).
pub const MIN_LABELS: usize = 2;
pub const MAX_LABELS: usize = 16;
pub const MIN_DIM: u64 = 256;
pub const MAX_DIM: u64 = 262_144;
pub const MAX_CHAR_NGRAM: u64 = 6;
pub const MIN_TEXT_BYTES: u64 = 64;
pub const MAX_TEXT_BYTES: u64 = 65_536;
/// The only model format version this build reads.
pub const MODEL_VERSION: u32 = 1;

use crate::base64::decode as base64_decode;

const FNV_BASIS: u32 = 0x811c_9dc5;
const FNV_PRIME: u32 = 0x0100_0193;

#[inline(always)]
fn fnv_step(h: u32, b: u8) -> u32 {
    (h ^ u32::from(b)).wrapping_mul(FNV_PRIME)
}

/// FNV-1a 32 of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(FNV_BASIS, |h, &b| fnv_step(h, b))
}

/// The hash of the word bigram (prev, this), from their unigram hashes.
#[inline(always)]
fn bigram(prev: u32, this: u32) -> u32 {
    // le32(prev) ++ le32(this), from a register.
    let both = u64::from(prev) | u64::from(this) << 32;
    let mut h = fnv_step(FNV_BASIS, b'b');
    for k in 0..8 {
        h = fnv_step(h, (both >> (8 * k)) as u8);
    }
    h
}

/// A validated model. Weights are kept in rows of `stride` (4, 8 or 16) bytes, the labels'
/// weights then zeros, so that a feature adds one fixed-size row.
#[derive(Clone)]
pub struct ContentModel {
    pub labels: Vec<String>,
    pub dim: u32,
    pub word_ngrams: u8,
    /// `(min, max)`; `(0, 0)`: no character n-grams.
    pub char_ngrams: (u8, u8),
    pub max_text_bytes: usize,
    pub scale: f64,
    pub bias: Vec<f64>,
    stride: usize,
    /// Each weight + 128 (0..=255), so that rows sum as unsigned lanes (`Sums::flush`).
    rows: Vec<u8>,
}

impl fmt::Debug for ContentModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContentModel")
            .field("labels", &self.labels)
            .field("dim", &self.dim)
            .field("word_ngrams", &self.word_ngrams)
            .field("char_ngrams", &self.char_ngrams)
            .field("max_text_bytes", &self.max_text_bytes)
            .finish_non_exhaustive()
    }
}

/// A model's raw fields as the config holds them (serde: config.rs reads it).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawContentModel {
    version: u32,
    labels: Vec<String>,
    dim: u64,
    word_ngrams: u64,
    char_ngrams: Vec<u64>,
    max_text_bytes: u64,
    scale: f64,
    bias: Vec<f64>,
    weights: String,
}

impl ContentModel {
    /// Validate a raw model; errors name the field (`at`: the model's own path, `content_model`
    /// in the filter config) in the words of the rest of config.rs.
    pub(crate) fn from_raw(at: &str, raw: RawContentModel) -> Result<ContentModel, (String, String)> {
        let bad = |field: &str, message: String| Err((format!("{at}.{field}"), message));
        if raw.version != MODEL_VERSION {
            return bad("version", format!("unsupported version {} (this filter understands {MODEL_VERSION})", raw.version));
        }
        let labels = raw.labels.len();
        if !(MIN_LABELS..=MAX_LABELS).contains(&labels) {
            return bad("labels", format!("must have between {MIN_LABELS} and {MAX_LABELS} labels"));
        }
        for (i, l) in raw.labels.iter().enumerate() {
            if let Err(message) = crate::config::token_error(l) {
                return bad(&format!("labels[{i}]"), message);
            }
            if raw.labels.get(..i).map_or(false, |before| before.contains(l)) {
                return bad(&format!("labels[{i}]"), format!("duplicate label `{l}`"));
            }
        }
        if !(MIN_DIM..=MAX_DIM).contains(&raw.dim) || !raw.dim.is_power_of_two() {
            return bad("dim", format!("must be a power of two between {MIN_DIM} and {MAX_DIM}"));
        }
        if !(1..=2).contains(&raw.word_ngrams) {
            return bad("word_ngrams", "must be between 1 and 2".to_string());
        }
        let chars = match raw.char_ngrams.as_slice() {
            [0, 0] => (0, 0),
            [lo, hi] if 2 <= *lo && lo <= hi && *hi <= MAX_CHAR_NGRAM => (*lo as u8, *hi as u8),
            _ => return bad("char_ngrams", format!("must be [min, max] with 2 <= min <= max <= {MAX_CHAR_NGRAM}, or [0, 0] (off)")),
        };
        if !(MIN_TEXT_BYTES..=MAX_TEXT_BYTES).contains(&raw.max_text_bytes) {
            return bad("max_text_bytes", format!("must be between {MIN_TEXT_BYTES} and {MAX_TEXT_BYTES}"));
        }
        if !(raw.scale.is_finite() && raw.scale > 0.0) {
            return bad("scale", "must be a finite number above 0".to_string());
        }
        if raw.bias.len() != labels {
            return bad("bias", format!("must have one number per label ({labels})"));
        }
        if let Some(i) = raw.bias.iter().position(|b| !b.is_finite()) {
            return bad(&format!("bias[{i}]"), "must be a finite number".to_string());
        }
        let dim = raw.dim as usize;
        let want = dim * labels;
        let weights = match base64_decode(&raw.weights) {
            Some(w) if w.len() == want => w,
            Some(w) => return bad("weights", format!("holds {} bytes, must hold dim × labels = {want}", w.len())),
            None => return bad("weights", "must be standard base64 (with padding)".to_string()),
        };
        let stride = labels.next_power_of_two().max(4);
        let mut rows = vec![0x80u8; dim * stride];
        for (row, w) in rows.chunks_exact_mut(stride).zip(weights.chunks_exact(labels)) {
            for (slot, &x) in row.iter_mut().zip(w) {
                *slot = x ^ 0x80;
            }
        }
        Ok(ContentModel {
            labels: raw.labels,
            dim: raw.dim as u32,
            word_ngrams: raw.word_ngrams as u8,
            char_ngrams: chars,
            max_text_bytes: raw.max_text_bytes as usize,
            scale: raw.scale,
            bias: raw.bias,
            stride,
            rows,
        })
    }

    /// The weight of bucket `b`, label `l` (as the model file holds it).
    pub fn weight(&self, bucket: usize, label: usize) -> Option<i8> {
        self.rows.get(bucket * self.stride + label).map(|&w| (w ^ 0x80) as i8)
    }

    /// The index of a label.
    pub fn label_index(&self, name: &str) -> Option<usize> {
        self.labels.iter().position(|l| l == name)
    }

    /// Classify a text (cut at `max_text_bytes`).
    pub fn classify_text(&self, text: &[u8]) -> Scored {
        let mut f = Features::new(self);
        f.piece();
        f.feed(text);
        f.finish()
    }

    /// Classify a request body (one buffer or a native host's segments): its text as the rules
    /// see it. A body that is not a JSON object has no text.
    pub fn classify_body(&self, parts: &[&[u8]]) -> Scored {
        let mut f = Features::new(self);
        let read = match parts {
            [one] => Scanner::new(one).body_text(&mut f),
            _ => Scanner::segments(parts).body_text(&mut f),
        };
        match read {
            Ok(()) => f.finish(),
            Err(_) => Scored { label: None, features: 0 },
        }
    }
}

/// A text's label: `None` when it had no features (no text); `features`: how many were summed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    pub label: Option<ContentLabel>,
    pub features: u32,
}

/// The winning label (its index in the model's labels) and its softmax probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ContentLabel {
    pub index: usize,
    pub score: f64,
}

/// Features waiting to be summed: their rows' offsets, summed a batch at a time (the sums are
/// then locals, added a row a step in vector registers).
const BATCH: usize = 64;

/// Each byte of text: 0 for a byte that separates tokens, else the byte as a token holds it
/// (ASCII upper case lowered; a NUL separates, so 0 is free).
const TOKEN_BYTE: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = if c.is_ascii_alphanumeric() || c >= 0x80 { c.to_ascii_lowercase() } else { 0 };
        b += 1;
    }
    t
};

/// The token being read: whether there is one, its word hash so far (`w` ++ bytes), the last 8
/// bytes of `<` ++ token (newest lowest) and how many bytes that has; the previous token's word
/// hash (for the bigram).
#[derive(Clone, Copy)]
struct Token {
    in_token: bool,
    word: u32,
    window: u64,
    p_len: u32,
    prev: Option<u32>,
}

/// A model's feature settings, copied where the bytes are read (registers, not reloads).
#[derive(Clone, Copy)]
struct Params {
    lo: u8,
    hi: u8,
    mask: u32,
    bigrams: bool,
}

/// The sums so far, and the features waiting to be added to them: their rows' offsets, summed
/// a batch at a time (the batch's sums then stay in vector registers).
struct Sums {
    /// Per label, the sum of its weights over the features so far. At most 65536 bytes of text
    /// give fewer than 7 features a byte, each at most 128 in size: far inside an i32.
    sums: [i32; MAX_LABELS],
    n: u32,
    /// Twice a batch: a byte's features (at most 2 + 6 + 5) always fit after a batch's worth
    /// minus one, so `emit` writes unchecked (masked) and a byte flushes once, when full.
    pending: [u32; 2 * BATCH],
    len: usize,
}

impl Sums {
    #[inline(always)]
    fn emit<const S: usize>(&mut self, mask: u32, h: u32) {
        self.pending[self.len % (2 * BATCH)] = (h & mask) * S as u32;
        self.len += 1;
    }

    /// Flush when a batch is full (once a byte, after its features).
    #[inline(always)]
    fn room<const S: usize>(&mut self, rows: &[u8]) {
        if self.len >= BATCH {
            self.flush::<S>(rows);
        }
    }

    /// Sum the pending features' rows, four lanes to a word: each biased weight (0..=255) into
    /// a 16-bit lane of a u64 (even and odd bytes apart; a batch is at most 64 + 17 rows, and
    /// 81 × 255 < 65536), then the bias (128 a row) taken off in the i32 sums. Portable: 4
    /// labels an add on any target.
    #[inline(never)]
    fn flush<const S: usize>(&mut self, rows: &[u8]) {
        const EVEN: u64 = 0x00ff_00ff_00ff_00ff;
        let mut even = [0u64; 2];
        let mut odd = [0u64; 2];
        for &at in self.pending.iter().take(self.len) {
            let at = at as usize;
            if let Some(row) = rows.get(at..at + S) {
                for (w, chunk) in row.chunks(8).enumerate().take(2) {
                    let mut b = [0u8; 8];
                    for (d, &x) in b.iter_mut().zip(chunk) {
                        *d = x;
                    }
                    let x = u64::from_le_bytes(b);
                    even[w] += x & EVEN;
                    odd[w] += (x >> 8) & EVEN;
                }
            }
        }
        let bias = 128 * self.len as i32;
        for (l, s) in self.sums.iter_mut().enumerate().take(S) {
            let (w, lane) = (l / 8, (l % 8) / 2);
            let word = if l % 2 == 0 { even[w % 2] } else { odd[w % 2] };
            *s += ((word >> (16 * lane)) & 0xffff) as i32 - bias;
        }
        self.n += self.len as u32;
        self.len = 0;
    }
}

/// Bytes of text into features (`S`: the model's row stride; `HI`: the longest character
/// n-gram, 0 for none, so the hash chains unroll). The character n-grams are hashed by where
/// they start: once `HI` bytes of `p` = `<` ++ token ++ `>` follow a start, one FNV chain over
/// them gives every length from `lo` to `HI` (`HI` steps a byte, not lo + ... + HI); the starts
/// nearer the token's end than `HI` are hashed when it ends.
#[inline(never)]
fn tokens<const S: usize, const HI: u8>(p: Params, token: &mut Token, out: &mut Sums, rows: &[u8], bytes: &[u8]) {
    let mut t = *token;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        i += 1;
        let mut c = TOKEN_BYTE[usize::from(b)];
        if c == 0 {
            if t.in_token {
                end_token::<S, HI>(p, &mut t, out);
                out.room::<S>(rows);
            }
            continue;
        }
        if !t.in_token {
            t.in_token = true;
            t.word = fnv_step(FNV_BASIS, b'w');
            t.window = u64::from(b'<');
            t.p_len = 1;
        }
        // The token's bytes, in a loop of their own.
        loop {
            t.word = fnv_step(t.word, c);
            if HI != 0 {
                push::<S, HI>(p, &mut t, out, c);
                out.room::<S>(rows);
            }
            match bytes.get(i) {
                Some(&b) if TOKEN_BYTE[usize::from(b)] != 0 => {
                    c = TOKEN_BYTE[usize::from(b)];
                    i += 1;
                }
                _ => break,
            }
        }
    }
    *token = t;
}

/// The next byte of `p`, and the n-grams that start `HI` bytes before its end.
#[inline(always)]
fn push<const S: usize, const HI: u8>(p: Params, t: &mut Token, out: &mut Sums, c: u8) {
    t.window = t.window << 8 | u64::from(c);
    t.p_len += 1;
    if HI != 0 && t.p_len >= u32::from(HI) {
        grams_from::<S>(p, t.window, HI, HI, out);
    }
}

/// The n-grams (lo <= n <= len) that start `back` bytes before the window's end.
#[inline(always)]
fn grams_from<const S: usize>(p: Params, window: u64, back: u8, len: u8, out: &mut Sums) {
    let mut h = fnv_step(FNV_BASIS, b'c');
    for k in 0..len {
        h = fnv_step(h, (window >> (8 * u32::from(back - 1 - k))) as u8);
        if k + 1 >= p.lo {
            out.emit::<S>(p.mask, h);
        }
    }
}

#[inline(always)]
fn end_token<const S: usize, const HI: u8>(p: Params, t: &mut Token, out: &mut Sums) {
    t.in_token = false;
    if HI != 0 {
        push::<S, HI>(p, t, out, b'>');
        // The starts fewer than `HI` bytes before the end: each with the lengths it has room for.
        let last = t.p_len.min(u32::from(HI) - 1) as u8;
        for back in (p.lo..=last).rev() {
            grams_from::<S>(p, t.window, back, back, out);
        }
    }
    let u = t.word;
    out.emit::<S>(p.mask, u);
    if p.bigrams {
        if let Some(prev) = t.prev {
            out.emit::<S>(p.mask, bigram(prev, u));
        }
    }
    t.prev = Some(u);
}

/// `tokens` for the model's stride and longest n-gram.
fn tokens_for<const S: usize>(p: Params, token: &mut Token, out: &mut Sums, rows: &[u8], bytes: &[u8]) {
    match p.hi {
        0 => tokens::<S, 0>(p, token, out, rows, bytes),
        2 => tokens::<S, 2>(p, token, out, rows, bytes),
        3 => tokens::<S, 3>(p, token, out, rows, bytes),
        4 => tokens::<S, 4>(p, token, out, rows, bytes),
        5 => tokens::<S, 5>(p, token, out, rows, bytes),
        _ => tokens::<S, 6>(p, token, out, rows, bytes),
    }
}

/// `end_token` for the model's longest n-gram.
fn end_token_for<const S: usize>(p: Params, t: &mut Token, out: &mut Sums) {
    match p.hi {
        0 => end_token::<S, 0>(p, t, out),
        2 => end_token::<S, 2>(p, t, out),
        3 => end_token::<S, 3>(p, t, out),
        4 => end_token::<S, 4>(p, t, out),
        5 => end_token::<S, 5>(p, t, out),
        _ => end_token::<S, 6>(p, t, out),
    }
}

/// The running sums of one text: fixed-size, no allocation. Feed it the text's pieces
/// (`piece`, then `feed` as often as the bytes come); `finish` scores.
pub struct Features<'m> {
    model: &'m ContentModel,
    params: Params,
    out: Sums,
    /// Bytes of text taken (the cut: `max_text_bytes`) and whether a piece came before.
    taken: usize,
    started: bool,
    token: Token,
}

impl<'m> Features<'m> {
    pub fn new(model: &'m ContentModel) -> Features<'m> {
        let (lo, hi) = model.char_ngrams;
        Features {
            model,
            params: Params { lo, hi, mask: model.dim - 1, bigrams: model.word_ngrams == 2 },
            out: Sums { sums: [0; MAX_LABELS], n: 0, pending: [0; 2 * BATCH], len: 0 },
            taken: 0,
            started: false,
            token: Token { in_token: false, word: 0, window: 0, p_len: 0, prev: None },
        }
    }

    /// A new piece of text starts: one `\n` after the pieces before it.
    pub fn piece(&mut self) {
        if self.started {
            self.feed(b"\n");
        }
        self.started = true;
    }

    /// Whether the text is at its cut (nothing more is read).
    pub fn full(&self) -> bool {
        self.taken >= self.model.max_text_bytes
    }

    /// The next bytes of the text (after the cut: ignored).
    pub fn feed(&mut self, bytes: &[u8]) {
        let room = self.model.max_text_bytes.saturating_sub(self.taken);
        let bytes = bytes.get(..room.min(bytes.len())).unwrap_or(&[]);
        self.taken += bytes.len();
        let (p, rows) = (self.params, &self.model.rows[..]);
        match self.model.stride {
            16 => tokens_for::<16>(p, &mut self.token, &mut self.out, rows, bytes),
            8 => tokens_for::<8>(p, &mut self.token, &mut self.out, rows, bytes),
            _ => tokens_for::<4>(p, &mut self.token, &mut self.out, rows, bytes),
        }
    }

    /// The text ended: the features of its last token, all summed.
    pub fn close(&mut self) {
        match self.model.stride {
            16 => self.close_with::<16>(),
            8 => self.close_with::<8>(),
            _ => self.close_with::<4>(),
        }
    }

    fn close_with<const S: usize>(&mut self) {
        let rows = &self.model.rows[..];
        if self.token.in_token {
            end_token_for::<S>(self.params, &mut self.token, &mut self.out);
        }
        self.out.flush::<S>(rows);
    }

    /// The text ended: its label and score.
    pub fn finish(mut self) -> Scored {
        self.close();
        Scored { label: self.model.score(&self.out.sums, self.out.n), features: self.out.n }
    }

    /// Per label, the integer sum so far (after `close`: the text's).
    pub fn sums(&self) -> &[i32] {
        self.out.sums.get(..self.model.labels.len()).unwrap_or(&[])
    }
}

impl ContentModel {
    /// `logit_l = bias[l] + (scale * S_l) / n` in f64 in that order (the Python reference's own);
    /// the argmax, ties to the lowest label; its softmax probability.
    fn score(&self, sums: &[i32], n: u32) -> Option<ContentLabel> {
        if n == 0 {
            return None;
        }
        let logit = |l: usize| self.bias.get(l).copied().unwrap_or(0.0) + (self.scale * f64::from(sums.get(l).copied().unwrap_or(0))) / f64::from(n);
        let mut win = 0;
        let mut best = logit(0);
        for l in 1..self.labels.len() {
            let x = logit(l);
            if x > best {
                win = l;
                best = x;
            }
        }
        let total: f64 = (0..self.labels.len()).map(|l| (logit(l) - best).exp()).sum();
        Some(ContentLabel { index: win, score: 1.0 / total })
    }
}

/// JSON string escapes decoded as the raw bytes of a string come (in pieces, across a native
/// host's segments); the string was validated by the scanner already. Fixed-size state.
#[derive(Default)]
struct Unescape {
    /// 0: plain; 1: after `\`; 2..=5: reading the hex digits of `\u` (2 + digits read);
    /// 6: after a leading surrogate, expecting `\`; 7: expecting `u`.
    state: u8,
    hex: u32,
    high: u32,
}

impl Unescape {
    /// Decode `raw` into `out` (plain runs in one call each).
    fn feed(&mut self, raw: &[u8], out: &mut Features<'_>) {
        let mut i = 0;
        while i < raw.len() && !out.full() {
            if self.state == 0 {
                let run = raw.get(i..).unwrap_or(&[]);
                // The next `\` (a string's raw bytes hold no `"` or control byte unescaped).
                let plain = crate::string_run::find_stop::<false>(run, 0).0;
                out.feed(run.get(..plain).unwrap_or(&[]));
                i += plain;
                if i < raw.len() {
                    self.state = 1;
                    i += 1;
                }
                continue;
            }
            let c = raw.get(i).copied().unwrap_or(0);
            i += 1;
            match self.state {
                1 => {
                    let decoded = match c {
                        b'b' => 0x08,
                        b'f' => 0x0c,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'u' => {
                            self.state = 2;
                            self.hex = 0;
                            continue;
                        }
                        other => other,
                    };
                    out.feed(&[decoded]);
                    self.state = 0;
                }
                2..=5 => {
                    let d = match c {
                        b'0'..=b'9' => c - b'0',
                        b'a'..=b'f' => c - b'a' + 10,
                        b'A'..=b'F' => c - b'A' + 10,
                        _ => 0,
                    };
                    self.hex = self.hex << 4 | u32::from(d);
                    self.state += 1;
                    if self.state == 6 {
                        self.code_unit(out);
                    }
                }
                6 => self.state = 7,
                _ => {
                    self.state = 2;
                    self.hex = 0;
                }
            }
        }
    }

    /// Four hex digits were read: a character, or a leading surrogate that waits for its pair.
    fn code_unit(&mut self, out: &mut Features<'_>) {
        let unit = self.hex;
        let code = match unit {
            0xD800..=0xDBFF if self.high == 0 => {
                self.high = unit;
                self.state = 6;
                return;
            }
            0xDC00..=0xDFFF if self.high != 0 => 0x10000 + ((self.high - 0xD800) << 10) + (unit - 0xDC00),
            _ => unit,
        };
        self.high = 0;
        self.state = 0;
        let mut buf = [0u8; 4];
        let ch = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
        out.feed(ch.encode_utf8(&mut buf).as_bytes());
    }
}

/// The text walk: what section 1 of the spec reads, on json_scan's tokens.
impl Scanner<'_> {
    /// The next value, a string's bytes found but not validated again (`span_string`).
    fn value(&mut self) -> Res<Tok> {
        if self.peek() == Some(b'"') {
            self.i += 1;
            return Ok(Tok::Str(self.span_string()?));
        }
        self.any()
    }

    /// The body's text into `f`: `messages` (user turns), then `prompt`, then `input` (user
    /// items); the last of a repeated key, as everywhere in the body.
    pub(crate) fn body_text(&mut self, f: &mut Features<'_>) -> Res<()> {
        if self.peek() != Some(b'{') {
            return self.bad("not a JSON object");
        }
        self.i += 1;
        let (mut messages, mut prompt, mut input) = (None, None, None);
        let mut first = true;
        while let Some(k) = self.key(&mut first)? {
            let slot = if self.key_is(&k, b"messages")? {
                &mut messages
            } else if self.key_is(&k, b"prompt")? {
                &mut prompt
            } else if self.key_is(&k, b"input")? {
                &mut input
            } else {
                self.skip_value()?;
                continue;
            };
            *slot = Some(*self);
            self.skip_value()?;
        }
        if let Some(mut s) = messages {
            s.turns(f, false)?;
        }
        if let Some(mut s) = prompt {
            s.prompt_text(f)?;
        }
        if let Some(mut s) = input {
            if s.peek() == Some(b'[') {
                s.turns(f, true)?;
            } else {
                match s.value()? {
                    Tok::Str(t) => s.piece(&t, f),
                    other => s.skip_composite(&other)?,
                }
            }
        }
        Ok(())
    }

    /// A string's decoded bytes, as one piece of the text.
    fn piece(&self, s: &Str, f: &mut Features<'_>) {
        f.piece();
        if s.escaped {
            let mut u = Unescape::default();
            self.each_slice(s.start, s.end, &mut |raw| {
                u.feed(raw, f);
                !f.full()
            });
        } else {
            self.each_slice(s.start, s.end, &mut |raw| {
                f.feed(raw);
                !f.full()
            });
        }
    }

    /// `messages` (or a Responses `input` array, `responses`): the content of each item whose
    /// `role` is `user`, in order.
    fn turns(&mut self, f: &mut Features<'_>, responses: bool) -> Res<()> {
        let t = self.value()?;
        if !matches!(t, Tok::Array) {
            return self.skip_composite(&t);
        }
        self.each_object(|s| {
            let (mut user, mut content, mut first_key) = (false, None, true);
            while let Some(k) = s.key(&mut first_key)? {
                if s.key_is(&k, b"role")? {
                    user = s.string_is(&[b"user"])?;
                } else if s.key_is(&k, b"content")? {
                    content = Some(*s);
                    s.skip_value()?;
                } else {
                    s.skip_value()?;
                }
            }
            match (user, content) {
                (true, Some(mut c)) => c.content(f, responses),
                _ => Ok(()),
            }
        })
    }

    /// Each object in an array (the position on its `[`), to `each` after its `{`; the other
    /// elements are skipped.
    fn each_object(&mut self, mut each: impl FnMut(&mut Self) -> Res<()>) -> Res<()> {
        self.i += 1;
        let mut first = true;
        while self.element(&mut first)? {
            let t = self.value()?;
            if matches!(t, Tok::Object) {
                self.i += 1;
                each(self)?;
            } else {
                self.skip_composite(&t)?;
            }
        }
        Ok(())
    }

    /// Whether the next value is a string equal to one of `names` (any other value: false).
    fn string_is(&mut self, names: &[&[u8]]) -> Res<bool> {
        let t = self.value()?;
        self.skip_composite(&t)?;
        if let Tok::Str(s) = t {
            for n in names {
                if self.key_is(&s, n)? {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// A user turn's content: a string, or the `text` of its text parts (`type` `text`, and for
    /// Responses `input_text` too).
    fn content(&mut self, f: &mut Features<'_>, responses: bool) -> Res<()> {
        let kinds: &[&[u8]] = if responses { &[b"input_text", b"text"] } else { &[b"text"] };
        match self.value()? {
            Tok::Str(s) => self.piece(&s, f),
            Tok::Array => self.each_object(|s| {
                let (mut kind, mut text, mut first_key) = (false, None, true);
                while let Some(k) = s.key(&mut first_key)? {
                    if s.key_is(&k, b"type")? {
                        kind = s.string_is(kinds)?;
                    } else if s.key_is(&k, b"text")? {
                        let t = s.value()?;
                        s.skip_composite(&t)?;
                        text = if let Tok::Str(t) = t { Some(t) } else { None };
                    } else {
                        s.skip_value()?;
                    }
                }
                if let (true, Some(t)) = (kind, text) {
                    s.piece(&t, f);
                }
                Ok(())
            })?,
            other => self.skip_composite(&other)?,
        }
        Ok(())
    }

    /// A completion's `prompt`: a string, or the strings of an array.
    fn prompt_text(&mut self, f: &mut Features<'_>) -> Res<()> {
        match self.value()? {
            Tok::Str(s) => self.piece(&s, f),
            Tok::Array => {
                self.i += 1;
                let mut first = true;
                while self.element(&mut first)? {
                    match self.value()? {
                        Tok::Str(s) => self.piece(&s, f),
                        other => self.skip_composite(&other)?,
                    }
                }
            }
            other => self.skip_composite(&other)?,
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::parse_content_model;

    mod encode {
        include!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/common/base64.rs"));
    }
    pub(crate) use encode::base64;

    /// A model's JSON, its weights from `w(bucket, label)`.
    pub(crate) fn model_json(labels: &[&str], dim: usize, word: u8, chars: [u8; 2], max_text: usize, w: impl Fn(usize, usize) -> i8) -> String {
        let raw: Vec<u8> = (0..dim * labels.len()).map(|i| w(i / labels.len(), i % labels.len()) as u8).collect();
        let bias: Vec<f64> = labels.iter().map(|_| 0.0).collect();
        serde_json::json!({"version": 1, "labels": labels, "dim": dim, "word_ngrams": word, "char_ngrams": chars,
            "max_text_bytes": max_text, "scale": 1.0, "bias": bias, "weights": base64(&raw)})
        .to_string()
    }

    fn model(labels: &[&str], dim: usize, word: u8, chars: [u8; 2], max_text: usize, w: impl Fn(usize, usize) -> i8) -> ContentModel {
        parse_content_model(model_json(labels, dim, word, chars, max_text, w).as_bytes()).unwrap()
    }

    /// Label 0 counts the features, label 1 sums `bucket % 127` over them: a text's sums name
    /// its buckets.
    fn counting(word: u8, chars: [u8; 2]) -> ContentModel {
        model(&["count", "buckets"], 256, word, chars, 4096, |b, l| if l == 0 { 1 } else { (b % 127) as i8 })
    }

    fn sums(m: &ContentModel, text: &[u8]) -> (Vec<i32>, u32) {
        let mut f = Features::new(m);
        f.piece();
        f.feed(text);
        f.close();
        (f.sums().to_vec(), f.finish().features)
    }

    /// The spec's features, written out plainly (allocating): the hashes of a text's features.
    pub(crate) fn reference_features(m: &ContentModel, text: &[u8]) -> Vec<u32> {
        let text = &text[..text.len().min(m.max_text_bytes)];
        let mut out = Vec::new();
        let mut prev: Option<u32> = None;
        for t in text.split(|&b| !(b.is_ascii_alphanumeric() || b >= 0x80)).filter(|t| !t.is_empty()) {
            let t: Vec<u8> = t.iter().map(|b| b.to_ascii_lowercase()).collect();
            let u = fnv1a(&[b"w", &t[..]].concat());
            out.push(u);
            if m.word_ngrams == 2 {
                if let Some(p) = prev {
                    out.push(fnv1a(&[&b"b"[..], &p.to_le_bytes(), &u.to_le_bytes()].concat()));
                }
            }
            prev = Some(u);
            let (lo, hi) = m.char_ngrams;
            if hi > 0 {
                let p = [b"<", &t[..], b">"].concat();
                for n in lo as usize..=hi as usize {
                    if p.len() >= n {
                        for i in 0..=p.len() - n {
                            out.push(fnv1a(&[b"c", &p[i..i + n]].concat()));
                        }
                    }
                }
            }
        }
        out
    }

    /// A deterministic stream of pseudo-random numbers.
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    #[test]
    fn fnv1a_is_the_standard_one() {
        assert_eq!(fnv1a(b""), 0x811c_9dc5);
        assert_eq!(fnv1a(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a(b"foobar"), 0xbf9c_f968);
        // The spec's features of "code rust", by hand (Python: the same loop): unigrams and the bigram.
        assert_eq!(fnv1a(b"wcode"), 0x30c3_000b);
        assert_eq!(fnv1a(b"wrust"), 0x3f2f_cd84);
        assert_eq!(bigram(0x30c3_000b, 0x3f2f_cd84), 0x6139_d2e0);
        assert_eq!(fnv1a(b"c<hi"), 0xb0b0_df1d);
        assert_eq!(fnv1a(b"chi>"), 0xdc38_cd41);
    }

    #[test]
    fn features_by_hand() {
        // "code rust", words 1-2, no char n-grams: buckets 0x0b, 0x84, 0xe0 (dim 256).
        let m = counting(2, [0, 0]);
        assert_eq!(sums(&m, b"Code, RUST!"), (vec![3, 0x0b + (0x84 % 127) + (0xe0 % 127)], 3));
        let m1 = counting(1, [0, 0]);
        assert_eq!(sums(&m1, b"code rust"), (vec![2, 0x0b + (0x84 % 127)], 2));
        // "Hi", word + char trigrams: whi (0x69), c<hi (0x1d), chi> (0x41); one token, no bigram.
        let m3 = counting(2, [3, 3]);
        assert_eq!(sums(&m3, b"Hi"), (vec![3, 0x69 + 0x1d + 0x41], 3));
    }

    #[test]
    fn tokens_are_alphanumerics_and_high_bytes() {
        let m = counting(2, [2, 4]);
        for (a, b) in [(&b"HeLLo"[..], &b"hello"[..]), (b"a-b_c", b"a b c"), ("café ok".as_bytes(), "café\tok".as_bytes())] {
            assert_eq!(sums(&m, a), sums(&m, b), "{:?}", String::from_utf8_lossy(a));
        }
        // A byte >= 0x80 is part of a token (é is not a separator); Ä (0xC3 0x84) is not lower-cased.
        assert_ne!(sums(&m, "caf é".as_bytes()), sums(&m, "café".as_bytes()));
        assert_ne!(sums(&m, "Ä".as_bytes()), sums(&m, "ä".as_bytes()));
    }

    #[test]
    fn streamed_features_are_the_spec_features() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15u64);
        for (word, chars) in [(1u8, [0u8, 0u8]), (2, [0, 0]), (2, [3, 4]), (1, [2, 6]), (2, [5, 5]), (2, [2, 2])] {
            // Weights that tell buckets apart: per label a different hash of the bucket.
            let m = model(&["a", "b", "c"], 1024, word, chars, 300, |b, l| (fnv1a(&[(b & 255) as u8, (b >> 8) as u8, l as u8]) % 255) as u8 as i8);
            for _ in 0..300 {
                let len = (next() % 400) as usize;
                let text: Vec<u8> = (0..len).map(|_| *[b'a', b'B', b' ', b'7', b'.', 0xc3, 0xa9, b'\n', b'z', b'-'].get((next() % 10) as usize).unwrap()).collect();
                let feats = reference_features(&m, &text);
                let mut want = vec![0i32; 3];
                for h in &feats {
                    for (l, s) in want.iter_mut().enumerate() {
                        *s += i32::from(m.weight((*h & (m.dim - 1)) as usize, l).unwrap());
                    }
                }
                let (got, n) = sums(&m, &text);
                assert_eq!((got, n as usize), (want, feats.len()), "{word} {chars:?} {:?}", String::from_utf8_lossy(&text));
                // Fed in any pieces, the same.
                let mut f = Features::new(&m);
                f.piece();
                let cut = (next() as usize) % (text.len() + 1);
                f.feed(&text[..cut]);
                f.feed(&text[cut..]);
                assert_eq!(f.finish(), m.classify_text(&text));
            }
        }
    }

    #[test]
    fn scoring_ties_and_no_text() {
        // All zero: every logit equal, the first label wins with 1/L.
        let m = model(&["x", "y", "z", "w"], 256, 2, [3, 4], 4096, |_, _| 0);
        let s = m.classify_text(b"anything at all");
        assert_eq!(s.label, Some(ContentLabel { index: 0, score: 0.25 }));
        assert!(s.features > 0);
        for empty in [&b""[..], b"   ", b"!?-- ..\n\t", b"\x00\x1f"] {
            assert_eq!(m.classify_text(empty), Scored { label: None, features: 0 });
        }
        // Label 2 wins with weight 1 everywhere, by bias + scale * S / n = 1 vs 0.
        let m = model(&["x", "y", "z"], 256, 1, [0, 0], 4096, |_, l| i8::from(l == 2));
        let l = m.classify_text(b"one two").label.unwrap();
        assert_eq!(l.index, 2);
        let e = 1f64.exp();
        assert!((l.score - e / (e + 2.0)).abs() < 1e-12, "{}", l.score);
        // A tie between labels 1 and 2 goes to 1.
        let m = model(&["x", "y", "z"], 256, 1, [0, 0], 4096, |_, l| i8::from(l >= 1));
        assert_eq!(m.classify_text(b"tie").label.unwrap().index, 1);
    }

    #[test]
    fn logits_in_the_specs_order() {
        // bias + (scale * S) / n, with a bias and a scale that are not round.
        let json = model_json(&["p", "q"], 256, 1, [0, 0], 4096, |_, l| if l == 0 { 3 } else { -2 })
            .replace("\"scale\":1.0", "\"scale\":0.0123")
            .replace("\"bias\":[0.0,0.0]", "\"bias\":[-0.1,0.05]");
        let m = parse_content_model(json.as_bytes()).unwrap();
        let s = m.classify_text(b"a b c");
        let logit = |b: f64, w: f64| b + (0.0123 * (w * 3.0)) / 3.0;
        let (p, q) = (logit(-0.1, 3.0), logit(0.05, -2.0));
        assert_eq!(s.label.unwrap().index, 1);
        assert_eq!(s.label.unwrap().score, 1.0 / ((p - q).exp() + 1.0));
    }

    #[test]
    fn the_text_is_cut_at_max_text_bytes() {
        let m = counting(2, [3, 4]);
        let long: Vec<u8> = b"word ".iter().cycle().take(10_000).copied().collect();
        let mut cut = m.clone();
        cut.max_text_bytes = 64;
        // "word word ... wo": the last token is cut, and nothing after it is read.
        assert_eq!(cut.classify_text(&long), m.classify_text(&long[..64]));
        assert_ne!(cut.classify_text(&long), m.classify_text(&long[..63]));
        let body = format!(r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#, String::from_utf8_lossy(&long));
        assert_eq!(cut.classify_body(&[body.as_bytes()]), m.classify_text(&long[..64]));
        // The joins count: two pieces of 40 bytes, cut at 64 = 40 + "\n" + 23.
        let (a, b) = ("x".repeat(39) + " ", "y".repeat(40));
        let body = format!(r#"{{"prompt": ["{a}", "{b}"]}}"#);
        assert_eq!(cut.classify_body(&[body.as_bytes()]), m.classify_text(format!("{a}\n{}", &b[..23]).as_bytes()));
    }

    /// The text a body gives (as the spec reads it), and the classification of that text.
    fn same(m: &ContentModel, body: &str, text: &str) {
        let whole = m.classify_body(&[body.as_bytes()]);
        assert_eq!(whole, m.classify_text(text.as_bytes()), "{body}");
        // Wherever a native host's segments cut it, the same.
        let b = body.as_bytes();
        for at in 0..=b.len() {
            assert_eq!(m.classify_body(&[&b[..at], &b[at..]]), whole, "cut at {at}: {body}");
        }
        let bytes: Vec<&[u8]> = b.chunks(1).collect();
        assert_eq!(m.classify_body(&bytes), whole, "a byte a segment: {body}");
    }

    #[test]
    fn the_text_of_a_body() {
        let m = model(&["a", "b"], 4096, 2, [2, 4], 4096, |b, l| (fnv1a(&[(b & 255) as u8, (b >> 8) as u8, l as u8]) % 200) as u8 as i8);
        // Chat: user turns only, string or text parts, in order, joined by "\n" (bigrams span it).
        same(&m, r#"{"model": "m", "messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "fix my Rust"},
                    {"role": "assistant", "content": "sure"}, {"content": [{"text": "borrow checker", "type": "text"},
                    {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": 7}, {"type": "input_text", "text": "no"}, "loose"], "role": "user"}]}"#,
             "fix my Rust\nborrow checker");
        // The role may come after the content; a repeated key: the last one.
        same(&m, r#"{"messages": [{"content": "a b", "role": "user", "role": "assistant"}, {"role": "assistant", "content": "x", "role": "user", "content": "c d"}]}"#, "c d");
        // Escapes are decoded (UTF-8), surrogate pairs included.
        same(&m, r#"{"messages": [{"role": "user", "content": "caf\u00e9 \"q\"\n\ud83d\ude00x\/y\\z\tA\u0042"}]}"#, "café \"q\"\n😀x/y\\z\tAB");
        // Completions: a string, or the strings of an array.
        same(&m, r#"{"prompt": "def f(x): return x"}"#, "def f(x): return x");
        same(&m, r#"{"prompt": ["one", 2, ["three"], "four"]}"#, "one\nfour");
        // Responses: a string, or the user items' string content or input_text / text parts.
        same(&m, r#"{"input": "summarize this"}"#, "summarize this");
        same(&m, r#"{"input": [{"role": "developer", "content": "no"}, {"role": "user", "content": [{"type": "input_text", "text": "alpha"},
                    {"type": "text", "text": "beta"}, {"type": "input_image", "image_url": "x"}]}, {"type": "message", "role": "user", "content": "gamma"}]}"#,
             "alpha\nbeta\ngamma");
        // More than one: messages, then prompt, then input. Empty strings are pieces too.
        same(&m, r#"{"input": "i", "prompt": "p", "messages": [{"role": "user", "content": ""}, {"role": "user", "content": "m"}]}"#, "\nm\np\ni");
        // No text: no label.
        for none in [r#"{}"#, r#"{"messages": []}"#, r#"{"messages": [{"role": "assistant", "content": "x"}]}"#, r#"{"prompt": [1, 2]}"#,
                     r#"{"messages": "text"}"#, r#"{"messages": [{"role": "user", "content": "  !! "}]}"#, r#"{"input": 3}"#] {
            assert_eq!(m.classify_body(&[none.as_bytes()]), Scored { label: None, features: 0 }, "{none}");
        }
        for bad in [&b""[..], b"[]", b"{", b"not json", b"{\"messages\": [{\"role\": \"user\", \"content\": \"abc"] {
            assert_eq!(m.classify_body(&[bad]), Scored { label: None, features: 0 });
        }
    }

    #[test]
    fn escapes_cut_anywhere_decode_the_same() {
        let m = model(&["a", "b"], 1024, 2, [3, 5], 65536, |b, l| (fnv1a(&[(b & 255) as u8, (b >> 8) as u8, l as u8]) % 200) as u8 as i8);
        let text = "x\u{e9}\"\\/\u{8}\u{c}\n\r\t\u{1F600}y \u{4e2d}";
        let escaped = r#"x\u00E9\"\\\/\b\f\n\r\t\uD83D\uDE00y \u4e2d"#;
        same(&m, &format!(r#"{{"prompt": "{escaped}"}}"#), text);
        same(&m, &format!(r#"{{"messages": [{{"role": "\u0075ser", "content": [{{"type": "te\u0078t", "text": "{escaped}"}}]}}]}}"#), text);
    }

    #[test]
    fn model_bounds_name_the_field() {
        let good = model_json(&["code", "chat"], 256, 2, [3, 4], 4096, |_, _| 1);
        assert!(parse_content_model(good.as_bytes()).is_ok());
        let field = |from: &str, to: &str| {
            assert!(good.contains(from), "{from}");
            parse_content_model(good.replacen(from, to, 1).as_bytes()).unwrap_err().field
        };
        assert_eq!(field("\"version\":1", "\"version\":2"), "version");
        assert_eq!(field("[\"code\",\"chat\"]", "[\"code\"]"), "labels");
        assert_eq!(field("[\"code\",\"chat\"]", "[\"code\",\"code\"]"), "labels[1]");
        assert_eq!(field("[\"code\",\"chat\"]", "[\"code\",\"c hat\"]"), "labels[1]");
        assert_eq!(field("\"dim\":256", "\"dim\":300"), "dim");
        assert_eq!(field("\"dim\":256", "\"dim\":128"), "dim");
        assert_eq!(field("\"dim\":256", "\"dim\":524288"), "dim");
        assert_eq!(field("\"dim\":256", "\"dim\":512"), "weights");
        assert_eq!(field("\"word_ngrams\":2", "\"word_ngrams\":3"), "word_ngrams");
        assert_eq!(field("\"word_ngrams\":2", "\"word_ngrams\":0"), "word_ngrams");
        for bad in ["[1,3]", "[0,3]", "[4,3]", "[3,7]", "[3]", "[2,3,4]"] {
            assert_eq!(field("\"char_ngrams\":[3,4]", &format!("\"char_ngrams\":{bad}")), "char_ngrams", "{bad}");
        }
        assert_eq!(field("\"max_text_bytes\":4096", "\"max_text_bytes\":63"), "max_text_bytes");
        assert_eq!(field("\"max_text_bytes\":4096", "\"max_text_bytes\":65537"), "max_text_bytes");
        assert_eq!(field("\"scale\":1.0", "\"scale\":0.0"), "scale");
        assert_eq!(field("\"scale\":1.0", "\"scale\":-1.0"), "scale");
        assert_eq!(field("\"bias\":[0.0,0.0]", "\"bias\":[0.0]"), "bias");
        assert_eq!(field("\"weights\":\"", "\"weights\":\"!"), "weights");
        assert_eq!(field("\"weights\":\"", "\"weights\":\"AAAA"), "weights");
        // At the bounds: fine.
        for (dim, chars, max) in [(256usize, [2u8, 6u8], 64usize), (262_144, [0, 0], 65_536), (1024, [6, 6], 100)] {
            let labels: Vec<String> = (0..16).map(|i| format!("l{i}")).collect();
            let names: Vec<&str> = labels.iter().map(String::as_str).collect();
            let m = parse_content_model(model_json(&names, dim, 1, chars, max, |_, _| -128).as_bytes()).unwrap();
            assert_eq!((m.labels.len(), m.dim as usize, m.char_ngrams, m.max_text_bytes), (16, dim, (chars[0], chars[1]), max));
            // The largest sums stay exact (i32): every feature -128, on the longest text.
            let text = "ab ".repeat(max);
            let s = m.classify_text(text.as_bytes());
            assert_eq!(s.label.unwrap().index, 0);
        }
        // Unknown fields and wrong types are serde's refusals.
        assert!(parse_content_model(good.replace("\"dim\"", "\"dims\"").as_bytes()).unwrap_err().message.contains("dims"));
        assert!(parse_content_model(b"[]").is_err());
    }

    #[test]
    fn base64_is_strict() {
        assert_eq!(base64_decode(""), Some(vec![]));
        assert_eq!(base64_decode("TWFu"), Some(b"Man".to_vec()));
        assert_eq!(base64_decode("TWE="), Some(b"Ma".to_vec()));
        assert_eq!(base64_decode("TQ=="), Some(b"M".to_vec()));
        assert_eq!(base64_decode("/+8="), Some(vec![0xff, 0xef]));
        for bad in ["TQ=", "T===", "TQ==TWFu", "TW-u", "TWFu\n", "===="] {
            assert_eq!(base64_decode(bad), None, "{bad}");
        }
        for n in 0..40 {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            assert_eq!(base64_decode(&base64(&bytes)), Some(bytes));
        }
    }

    #[test]
    fn never_panics_on_any_body() {
        let m = model(&["a", "b", "c"], 256, 2, [2, 6], 64, |b, l| (b as i8).wrapping_mul(l as i8 + 1));
        let mut next = xorshift(0x2545_f491_4f6c_dd1du64);
        let atoms: [&[u8]; 20] = [b"{", b"}", b"[", b"]", b"\"", b":", b",", b"\\u", b"d83d", b"\\", b"messages", b"role", b"user",
            b"content", b"text", b"type", b"prompt", b"input", b"\xc3\xa9", b"\xff"];
        for _ in 0..20_000 {
            let body: Vec<u8> = (0..next() % 40).flat_map(|_| atoms[(next() % 20) as usize].iter().copied()).collect();
            let at = (next() as usize) % (body.len() + 1);
            let whole = m.classify_body(&[&body]);
            assert_eq!(m.classify_body(&[&body[..at], &body[at..]]), whole, "{:?}", String::from_utf8_lossy(&body));
            if let Some(l) = whole.label {
                assert!(l.index < 3 && l.score > 0.0 && l.score <= 1.0);
            }
            let _ = m.classify_text(&body);
            let _ = parse_content_model(&body);
        }
    }
}
