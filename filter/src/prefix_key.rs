//! The prefix key: a short chain of 64-bit keys naming the reusable prefix of a chat or
//! completion request (docs/prefix-routing.md), computed on the body the filter scans anyway
//! (body.rs calls in here from its field walk), for the classes whose policy turns it on.
//!
//! - chat: after each message, the key of the messages so far (roles and text content, in
//!   order). The lookup chain is the key of everything before the last message, then shorter
//!   prefixes, longest first (`max_keys` − 1 of them), ending with the leading system/developer
//!   messages' key (a tenant's system prompt) when there are such messages. The learn key is the
//!   key of every message: the next turn's request repeats it, then adds the answer and a new
//!   user turn, so its chain holds it.
//! - completions: a string `prompt` cut into `chunk_bytes` chunks; after each whole chunk, the
//!   key of the chunks so far. The chain: the longest whole-chunk prefixes, ending with the first
//!   chunk's key. A token-id prompt gets no key.
//!
//! A prefix with no text (an empty system prompt) names nothing: a request whose chain is empty
//! (a one-message chat, a prompt shorter than a chunk) carries no key and is picked by load.
//! Strings are hashed as the body's raw JSON bytes (escapes not decoded: no copy, no decode; a
//! client that re-encodes a prompt between turns differently only loses the affinity).
//! Bounded: a fixed array of keys, a 32-byte buffer, no allocation.

/// The request header the filter writes the chain into (`x-infermesh-*`: stripped from clients).
pub const HEADER_PREFIX_KEY: &str = "x-infermesh-prefix-key";

/// Most keys in a chain (the policy's `prefix_key.max_keys` bound); a header of at most
/// 8 × 17 bytes.
pub const MAX_KEYS: usize = 8;

/// A class's key form, from its policy (`classes.NAME.prefix_key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixSpec {
    /// Keys in the lookup chain (1..=MAX_KEYS): with 1, only the system prompt / first chunk.
    pub max_keys: usize,
    /// A completion prompt's chunk, in bytes of its JSON string.
    pub chunk_bytes: usize,
}

/// A request's keys: `chain` longest prefix first; `learn`: the key of the whole conversation
/// (chat) or of the longest whole-chunk prefix (completions), which later requests look up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixKeys {
    keys: [u64; MAX_KEYS],
    len: usize,
    pub learn: Option<u64>,
}

impl PrefixKeys {
    pub fn chain(&self) -> &[u64] {
        self.keys.get(..self.len).unwrap_or(&[])
    }

    fn push(&mut self, k: u64) {
        if self.len < MAX_KEYS && !self.chain().contains(&k) {
            if let Some(slot) = self.keys.get_mut(self.len) {
                *slot = k;
                self.len += 1;
            }
        }
    }

    /// The header value: the chain in hex, comma-separated (None: no usable prefix).
    pub fn header_value(&self) -> Option<String> {
        if self.len == 0 {
            return None;
        }
        let mut out = String::with_capacity(self.len * 17);
        for (i, k) in self.chain().iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&format!("{k:016x}"));
        }
        Some(out)
    }
}

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;

/// A streaming 64-bit hash in four independent lanes (xxHash64's round): the same value however
/// the input is cut into writes. Not cryptographic: a collision only sends a request where
/// another prefix was served, still within the load bound.
#[derive(Clone)]
pub(crate) struct Hasher {
    lanes: [u64; 4],
    buf: [u8; 32],
    filled: usize,
    total: u64,
}

#[inline(always)]
fn round(acc: u64, w: u64) -> u64 {
    acc.wrapping_add(w.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1)
}

#[inline(always)]
fn word(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        w.copy_from_slice(s);
    }
    u64::from_le_bytes(w)
}

impl Hasher {
    pub(crate) fn new() -> Hasher {
        Hasher { lanes: [P1.wrapping_add(P2), P2, 0, 0u64.wrapping_sub(P1)], buf: [0; 32], filled: 0, total: 0 }
    }

    #[inline(always)]
    fn block(&mut self, b: &[u8]) {
        self.lanes[0] = round(self.lanes[0], word(b, 0));
        self.lanes[1] = round(self.lanes[1], word(b, 8));
        self.lanes[2] = round(self.lanes[2], word(b, 16));
        self.lanes[3] = round(self.lanes[3], word(b, 24));
    }

    pub(crate) fn write(&mut self, mut bytes: &[u8]) {
        self.total = self.total.wrapping_add(bytes.len() as u64);
        if self.filled > 0 {
            let take = (32 - self.filled).min(bytes.len());
            if let (Some(dst), Some(src)) = (self.buf.get_mut(self.filled..self.filled + take), bytes.get(..take)) {
                dst.copy_from_slice(src);
            }
            self.filled += take;
            bytes = bytes.get(take..).unwrap_or(&[]);
            if self.filled < 32 {
                return;
            }
            let buf = self.buf;
            self.block(&buf);
            self.filled = 0;
        }
        let mut chunks = bytes.chunks_exact(32);
        for c in &mut chunks {
            self.block(c);
        }
        let rest = chunks.remainder();
        if let Some(dst) = self.buf.get_mut(..rest.len()) {
            dst.copy_from_slice(rest);
        }
        self.filled = rest.len();
    }

    /// A field's end: its length and a tag, so that ("ab", "c") and ("a", "bc") differ.
    pub(crate) fn end_field(&mut self, len: usize, tag: u8) {
        let mut t = [0u8; 9];
        t[..8].copy_from_slice(&(len as u64).to_le_bytes());
        t[8] = tag;
        self.write(&t);
    }

    /// The hash of everything written so far (the hasher goes on).
    pub(crate) fn finish(&self) -> u64 {
        let [a, b, c, d] = self.lanes;
        let mut h = a.rotate_left(1).wrapping_add(b.rotate_left(7)).wrapping_add(c.rotate_left(12)).wrapping_add(d.rotate_left(18));
        h = h.wrapping_add(self.total);
        let tail = self.buf.get(..self.filled).unwrap_or(&[]);
        let mut words = tail.chunks(8);
        for w in &mut words {
            let mut x = [0u8; 8];
            if let Some(dst) = x.get_mut(..w.len()) {
                dst.copy_from_slice(w);
            }
            h = (h ^ round(0, u64::from_le_bytes(x))).rotate_left(27).wrapping_mul(P1).wrapping_add(P3);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(P2);
        h ^= h >> 29;
        h = h.wrapping_mul(P3);
        h ^ (h >> 32)
    }
}

const TAG_ROLE: u8 = 1;
const TAG_TEXT: u8 = 2;
const TAG_MESSAGE: u8 = 3;

/// One boundary seen while walking: its key, and whether any text came before it.
#[derive(Clone, Copy, Default)]
struct Boundary {
    key: u64,
    has_text: bool,
}

/// The walk's state while body.rs reads `messages` or `prompt`.
pub(crate) struct PrefixWalk {
    spec: PrefixSpec,
    hasher: Hasher,
    /// The last MAX_KEYS + 1 message boundaries (ring, by message index).
    ring: [Boundary; MAX_KEYS + 1],
    count: usize,
    text_bytes: u64,
    /// The boundary after the leading system/developer messages (chat), or after the first
    /// chunk (completions), with its index.
    anchor: Option<(usize, Boundary)>,
    leading_system: bool,
    /// This message's role is system/developer.
    system_message: bool,
    completion: bool,
}

impl PrefixWalk {
    pub(crate) fn new(spec: PrefixSpec) -> PrefixWalk {
        PrefixWalk {
            spec: PrefixSpec { max_keys: spec.max_keys.clamp(1, MAX_KEYS), chunk_bytes: spec.chunk_bytes.max(1) },
            hasher: Hasher::new(),
            ring: [Boundary::default(); MAX_KEYS + 1],
            count: 0,
            text_bytes: 0,
            anchor: None,
            leading_system: true,
            system_message: false,
            completion: false,
        }
    }

    /// A new `messages` or `prompt` field: a repeated key starts over (the last one wins, as
    /// for every other field).
    pub(crate) fn restart(&mut self, completion: bool) {
        *self = PrefixWalk { completion, ..PrefixWalk::new(self.spec) };
    }

    fn boundary(&mut self) {
        let b = Boundary { key: self.hasher.finish(), has_text: self.text_bytes > 0 };
        if let Some(slot) = self.ring.get_mut(self.count % (MAX_KEYS + 1)) {
            *slot = b;
        }
        self.count += 1;
    }

    /// A message's role (raw JSON bytes of its string).
    pub(crate) fn role(&mut self, raw: &[u8]) {
        self.system_message = raw == b"system" || raw == b"developer";
        self.hasher.write(raw);
        self.hasher.end_field(raw.len(), TAG_ROLE);
    }

    /// Text of a message's content (a string or a text part).
    pub(crate) fn text(&mut self, raw: &[u8]) {
        self.text_bytes += raw.len() as u64;
        self.hasher.write(raw);
        self.hasher.end_field(raw.len(), TAG_TEXT);
    }

    /// The end of one message.
    pub(crate) fn end_message(&mut self) {
        self.hasher.end_field(self.count, TAG_MESSAGE);
        let system = std::mem::take(&mut self.system_message);
        self.boundary();
        if self.leading_system && system {
            self.anchor = self.at(self.count - 1).map(|b| (self.count - 1, b));
        } else {
            self.leading_system = false;
        }
    }

    /// A completion prompt (raw JSON bytes of its string), whole chunks only.
    pub(crate) fn prompt(&mut self, raw: &[u8]) {
        for c in raw.chunks_exact(self.spec.chunk_bytes) {
            self.text_bytes += c.len() as u64;
            self.hasher.write(c);
            self.boundary();
            if self.anchor.is_none() {
                self.anchor = self.at(0).map(|b| (0, b));
            }
        }
    }

    fn at(&self, index: usize) -> Option<Boundary> {
        // Only the last MAX_KEYS + 1 boundaries are kept.
        if index >= self.count || self.count - index > MAX_KEYS + 1 {
            return None;
        }
        self.ring.get(index % (MAX_KEYS + 1)).copied()
    }

    pub(crate) fn keys(&self) -> PrefixKeys {
        let mut out = PrefixKeys::default();
        if self.count == 0 {
            return out;
        }
        // Chat: prefixes end before the last message; completions: every whole chunk is one.
        let last = if self.completion { self.count } else { self.count - 1 };
        out.learn = self.at(self.count - 1).filter(|b| b.has_text).map(|b| b.key);
        // The anchor is a prefix only if it ends before the last message (chat).
        let anchor = self.anchor.filter(|(i, b)| *i < last && b.has_text).map(|(_, b)| b.key);
        let room = self.spec.max_keys - usize::from(anchor.is_some());
        for i in (0..last).rev().take(room) {
            if let Some(b) = self.at(i).filter(|b| b.has_text) {
                out.push(b.key);
            }
        }
        if let Some(a) = anchor {
            out.push(a);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_does_not_depend_on_how_the_input_is_cut() {
        let data: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut whole = Hasher::new();
        whole.write(&data);
        for cut in [0, 1, 7, 31, 32, 33, 64, 100, 299, 300] {
            let mut h = Hasher::new();
            h.write(&data[..cut]);
            h.write(&data[cut..]);
            assert_eq!(h.finish(), whole.finish(), "cut at {cut}");
        }
        let mut bytewise = Hasher::new();
        for b in &data {
            bytewise.write(std::slice::from_ref(b));
        }
        assert_eq!(bytewise.finish(), whole.finish());
    }

    use crate::body::{parse_body, parse_body_keyed, parse_body_segments_keyed};
    use serde_json::json;

    const SPEC: PrefixSpec = PrefixSpec { max_keys: 4, chunk_bytes: 64 };

    fn keys(body: &serde_json::Value) -> Option<PrefixKeys> {
        let bytes = serde_json::to_vec(body).unwrap();
        let (facts, keys) = parse_body_keyed(&bytes, SPEC).unwrap();
        assert_eq!(Ok(facts), parse_body(&bytes), "the key changes no fact");
        keys
    }

    fn chat(messages: &[(&str, &str)]) -> serde_json::Value {
        let m: Vec<_> = messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
        json!({"model": "m", "stream": true, "messages": m})
    }

    const SYSTEM: &str = "You are the support assistant of tenant 7. Answer briefly and politely.";

    #[test]
    fn a_conversations_next_turn_looks_up_what_its_last_turn_learnt() {
        let t1 = keys(&chat(&[("system", SYSTEM), ("user", "hello")])).unwrap();
        let t2 = keys(&chat(&[("system", SYSTEM), ("user", "hello"), ("assistant", "hi, how can I help?"), ("user", "my order")])).unwrap();
        let t3 = keys(&chat(&[("system", SYSTEM), ("user", "hello"), ("assistant", "hi, how can I help?"), ("user", "my order"),
                              ("assistant", "which one?"), ("user", "the last one")])).unwrap();
        assert!(t2.chain().contains(&t1.learn.unwrap()), "turn 2 names turn 1's whole conversation");
        assert!(t3.chain().contains(&t2.learn.unwrap()));
        // Every turn ends its chain with the system prompt's key: the tenant's other chats share it.
        let other = keys(&chat(&[("system", SYSTEM), ("user", "a different question")])).unwrap();
        assert_eq!(t1.chain(), other.chain());
        assert_eq!(t1.chain().len(), 1);
        assert_eq!(t3.chain().last(), t1.chain().last());
        assert!(t3.chain().len() <= SPEC.max_keys);
        // Longest prefix first: everything before the last message.
        let before_last = keys(&chat(&[("system", SYSTEM), ("user", "hello"), ("assistant", "hi, how can I help?"), ("user", "my order"),
                                       ("assistant", "which one?")])).unwrap();
        assert_eq!(t3.chain().first(), before_last.learn.as_ref());
    }

    #[test]
    fn requests_with_no_usable_prefix_name_nothing() {
        let one_turn = keys(&chat(&[("user", "hello")])).unwrap();
        assert_eq!(one_turn.header_value(), None, "a one-turn chat without a system prompt is picked by load");
        assert!(one_turn.learn.is_some(), "but its next turn can find where it went");
        let empty_system = keys(&chat(&[("system", ""), ("user", "hello")])).unwrap();
        assert_eq!(empty_system.header_value(), None);
        assert_eq!(keys(&json!({"messages": []})), None);
        assert_eq!(keys(&json!({"model": "m"})), None);
        // Completions: a prompt shorter than a chunk, or token ids.
        assert_eq!(keys(&json!({"prompt": "short"})), None);
        assert_eq!(keys(&json!({"prompt": [1, 2, 3]})), None);
    }

    #[test]
    fn different_system_prompts_or_histories_get_different_keys() {
        let a = keys(&chat(&[("system", SYSTEM), ("user", "x")])).unwrap();
        let b = keys(&chat(&[("system", "You are someone else entirely."), ("user", "x")])).unwrap();
        assert_ne!(a.chain(), b.chain());
        // The role counts: the same text as a user turn is another prefix.
        let c = keys(&chat(&[("user", SYSTEM), ("user", "x")])).unwrap();
        assert_ne!(a.chain(), c.chain());
        // Text parts are keyed by their text, images are not.
        let parts = keys(&json!({"messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}, {"type": "image_url", "image_url": {"url": "u"}}]},
                                              {"role": "user", "content": "x"}]})).unwrap();
        assert_eq!(parts.chain(), a.chain());
    }

    #[test]
    fn completion_prompts_are_keyed_by_leading_whole_chunks() {
        let base = "0123456789abcdef".repeat(4 * 5); // 5 chunks of 64 bytes
        let long = keys(&json!({"prompt": format!("{base}tail")})).unwrap();
        assert_eq!(long.chain().len(), SPEC.max_keys);
        let shared = keys(&json!({"prompt": base[..64 * 2 + 10].to_string()})).unwrap();
        // Two whole chunks in common: the shorter prompt's longest key is in the longer's chain
        // only if it is among its max_keys; its first chunk's key always is (the chain's end).
        assert_eq!(long.chain().last(), shared.chain().last());
        assert_eq!(shared.chain().len(), 2);
        assert_eq!(shared.learn, shared.chain().first().copied());
    }

    #[test]
    fn the_chain_is_bounded_and_the_same_however_the_body_is_cut() {
        let mut m = vec![("system", SYSTEM)];
        for _ in 0..40 {
            m.push(("user", "question"));
            m.push(("assistant", "answer"));
        }
        m.push(("user", "last"));
        let body = serde_json::to_vec(&chat(&m)).unwrap();
        for max_keys in 1..=MAX_KEYS {
            let spec = PrefixSpec { max_keys, chunk_bytes: 64 };
            let (_, k) = parse_body_keyed(&body, spec).unwrap();
            let k = k.unwrap();
            assert!(k.chain().len() <= max_keys);
            assert_eq!(k.chain().last(), keys(&chat(&[("system", SYSTEM), ("user", "x")])).unwrap().chain().last(),
                       "the system prompt's key ends every chain (max_keys {max_keys})");
            assert!(k.header_value().unwrap().len() <= MAX_KEYS * 17);
            for at in (0..=body.len()).step_by(7) {
                assert_eq!(parse_body_segments_keyed(&[&body[..at], &body[at..]], spec).unwrap().1, Some(k), "cut at {at}");
            }
        }
    }

    #[test]
    fn field_ends_tell_apart_what_concatenation_would_not() {
        let key = |parts: &[&[u8]]| {
            let mut h = Hasher::new();
            for p in parts {
                h.write(p);
                h.end_field(p.len(), TAG_TEXT);
            }
            h.finish()
        };
        assert_ne!(key(&[b"ab", b"c"]), key(&[b"a", b"bc"]));
        assert_ne!(key(&[b""]), key(&[]));
    }
}
