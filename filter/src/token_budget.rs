//! Token budgets per class and tenant (docs/token-budgets.md): what a request reserves on
//! arrival, the fixed windows and concurrent streams it is held to, and the table every worker
//! of one Envoy shares — proxy-wasm shared data written with CAS in the Wasm filter
//! (`SharedBudgets`, the pattern of shared_pool_table.rs), one process-wide map behind a mutex
//! per shard in the native module (`ProcessBudgets`, as process_pool_table.rs).
//!
//! The reservation is an upper bound on what the request can cost: every token of a byte-level
//! BPE covers at least one byte of the prompt, a chat template adds a few tokens per message,
//! and the sidecar never generates more than `max_completion_tokens` / `max_tokens` (or the
//! pool's `default_max_tokens`) per choice. So a budget is never overshot; it is over-charged by
//! the estimate's error until the sidecar reports real usage (step 2 of the design).
//!
//! Pure apart from `SharedData` (the host's key-value store), so it compiles and is tested on
//! any target.

use crate::body::BodyFacts;
use crate::request_flow::CounterId;
use crate::shared_pool_table::SharedData;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// The windows a budget can limit, in the order of `Budget::tokens`: name and length.
pub const WINDOWS: [(&str, u64); 3] = [("per_minute", 60_000), ("per_hour", 3_600_000), ("per_day", 86_400_000)];
/// Chat-template tokens charged per message on top of its text (role markers, separators).
pub const MESSAGE_OVERHEAD: u64 = 8;
/// Tenants a class's budget does not list are kept in this many records per class, by a hash of
/// the tenant: two that share a record share one default budget (a stricter limit, never a
/// looser one), and no client can make the table grow (a key hash is anyone's to invent).
pub const TENANT_SLOTS: u64 = 4096;
/// The tenant of a request that names none the filter may believe (no header, a header from an
/// untrusted source, no API key): one shared record under the class's default budget. Also the
/// metric label of every tenant the policy does not list.
pub const OTHER: &str = crate::stats::OTHER;
/// Retry-After of a refusal for concurrent streams (a stream's end frees a slot at any time).
pub const STREAMS_RETRY_AFTER_S: u64 = 1;
/// Response headers (OpenAI's names and formats).
pub const HEADER_LIMIT: &str = "x-ratelimit-limit-tokens";
pub const HEADER_REMAINING: &str = "x-ratelimit-remaining-tokens";
pub const HEADER_RESET: &str = "x-ratelimit-reset-tokens";
/// The OpenAI error code of a refusal.
pub const ERROR_CODE: &str = "token_budget_exceeded";

/// Where a request's tenant comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantSource {
    /// A header set by an authenticating hop: read only from a trusted source (the filter's
    /// `trusted_sources`), removed from any other.
    Header(String),
    /// The first 16 hex digits of the SHA-256 of the bearer token (`authorization: Bearer K`,
    /// else `x-api-key: K`): a client that can send a tenant's key is that tenant.
    ApiKeyHash,
}

/// One budget: the limits of the windows it sets, how tokens are weighted, concurrent streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    /// Tokens per minute, hour, day (WINDOWS' order); `None`: that window is not limited.
    pub tokens: [Option<u64>; 3],
    /// The charge is `input * prompt + output * completion`.
    pub input_weight: u64,
    pub output_weight: u64,
    pub concurrent_streams: Option<u64>,
}

/// One class's budgets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassBudgets {
    /// The completion bound of a request that states none (its pool's `default_max_tokens`, which
    /// the sidecar enforces).
    pub default_max_tokens: u64,
    /// Each tenant not listed (and `other`) gets this budget; `None`: they are not limited.
    pub default: Option<Budget>,
    pub tenants: BTreeMap<String, Budget>,
}

/// The config's `budgets`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budgets {
    pub tenant: TenantSource,
    pub classes: BTreeMap<String, ClassBudgets>,
}

impl Budgets {
    /// The tenant header a client must not send past the trust rules.
    pub fn tenant_header(&self) -> Option<&str> {
        match &self.tenant {
            TenantSource::Header(h) => Some(h),
            TenantSource::ApiKeyHash => None,
        }
    }
}

/// What a generation request asks for, as the reservation reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ask {
    /// UTF-8 bytes of the prompt's text (token ids count one each).
    pub prompt_bytes: u64,
    pub messages: u64,
    /// Choices (`n`, at least 1).
    pub choices: u64,
    /// `max_completion_tokens`, else `max_tokens`; `None`: the class's default.
    pub max_tokens: Option<u64>,
}

impl Ask {
    pub fn from_facts(f: &BodyFacts) -> Ask {
        Ask { prompt_bytes: f.prompt_bytes, messages: f.message_count, choices: f.n.unwrap_or(1).max(1), max_tokens: f.token_budget() }
    }

    /// A body the filter did not read (too large to buffer, not JSON, none): its whole length
    /// stands for the prompt (JSON text is at least as long as the text in it); the completion
    /// is the class's default for one choice, which the sidecar caps a request that states none at.
    pub fn unread(body_bytes: u64) -> Ask {
        Ask { prompt_bytes: body_bytes, messages: 0, choices: 1, max_tokens: None }
    }

    /// The reservation: `input * (bytes + 8 per message) + output * choices * max_tokens`.
    pub fn cost(&self, b: &Budget, default_max_tokens: u64) -> u64 {
        let input = self.prompt_bytes.saturating_add(self.messages.saturating_mul(MESSAGE_OVERHEAD));
        let output = self.choices.max(1).saturating_mul(self.max_tokens.unwrap_or(default_max_tokens));
        b.input_weight.saturating_mul(input).saturating_add(b.output_weight.saturating_mul(output))
    }
}

// ---- the tenant --------------------------------------------------------------------------------

/// Which record and which metric label a request is charged to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charged<'c> {
    /// The budget that applies (`None`: none: the request is not limited).
    pub budget: Option<&'c Budget>,
    /// The record's key part: a listed tenant's name, `other`, or `~SLOT` for one not listed.
    pub record: String,
    /// A listed tenant's name, else `other` (bounded: the policy's names plus `other`).
    pub label: &'c str,
}

/// The budget and record of `tenant` (`None`: `other`) in `class`.
pub fn charged<'c>(class: &'c ClassBudgets, tenant: Option<&str>) -> Charged<'c> {
    let tenant = match tenant {
        Some(t) if !t.is_empty() => t,
        _ => return Charged { budget: class.default.as_ref(), record: OTHER.to_string(), label: OTHER },
    };
    match class.tenants.get_key_value(tenant) {
        Some((name, b)) => Charged { budget: Some(b), record: name.clone(), label: name },
        None => Charged { budget: class.default.as_ref(), record: format!("~{}", fnv1a(tenant.as_bytes()) % TENANT_SLOTS), label: OTHER },
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The tenant `api_key_hash` names: the first 16 hex digits of SHA-256 of the bearer token
/// (`authorization: Bearer K`, the scheme case-insensitive), else of `x-api-key`.
pub fn api_key_tenant(authorization: Option<&[u8]>, x_api_key: Option<&[u8]>) -> Option<String> {
    let bearer = authorization.and_then(|v| {
        let v = trim(v);
        match v.get(..7) {
            Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => Some(trim(v.get(7..).unwrap_or(&[]))),
            _ => None,
        }
    });
    let key = bearer.or_else(|| x_api_key.map(trim)).filter(|k| !k.is_empty())?;
    let digest = sha256(key);
    let mut out = String::with_capacity(16);
    for b in &digest[..8] {
        out.push(hex(b >> 4));
        out.push(hex(b & 15));
    }
    Some(out)
}

fn trim(v: &[u8]) -> &[u8] {
    let start = v.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(v.len());
    let end = v.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(start, |e| e + 1);
    v.get(start..end).unwrap_or(&[])
}

fn hex(n: u8) -> char {
    char::from(b"0123456789abcdef"[usize::from(n & 15)])
}

/// SHA-256 (FIPS 180-4), for `api_key_hash` (no crate: the Wasm build's toolchain is pinned).
pub fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be,
        0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa,
        0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85,
        0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3,
        0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f,
        0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
    ];
    let mut h: [u32; 8] = [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64).wrapping_mul(8)).to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16].wrapping_add(s0).wrapping_add(w[i - 7]).wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh.wrapping_add(s1).wrapping_add(ch).wrapping_add(K[i]).wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(h) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

// ---- one record: fixed windows and streams -----------------------------------------------------

/// One (class, tenant) record: each window's index (`now / length`) and the tokens charged in it,
/// and the streams in flight. Every window is counted whether or not the budget limits it, so a
/// limit a new config adds sees the window's earlier charges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Record {
    pub windows: [(u64, u64); 3],
    pub streams: u64,
}

/// A record in shared data: seven little-endian u64s.
pub const RECORD_BYTES: usize = 7 * 8;

impl Record {
    pub fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut out = [0u8; RECORD_BYTES];
        let words = [self.windows[0].0, self.windows[0].1, self.windows[1].0, self.windows[1].1, self.windows[2].0, self.windows[2].1, self.streams];
        for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<Record> {
        if bytes.len() != RECORD_BYTES {
            return None;
        }
        let mut w = [0u64; 7];
        for (slot, chunk) in w.iter_mut().zip(bytes.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            *slot = u64::from_le_bytes(b);
        }
        Some(Record { windows: [(w[0], w[1]), (w[2], w[3]), (w[4], w[5])], streams: w[6] })
    }

    /// Tokens charged in window `w` at `now` (0 once the window has moved on).
    fn used(&self, w: usize, now: u64) -> u64 {
        let (index, used) = self.windows[w];
        if index == now / WINDOWS[w].1 {
            used
        } else {
            0
        }
    }

    /// Charge `cost` and take a stream slot if `b` allows both now.
    pub fn reserve(&mut self, b: &Budget, cost: u64, now: u64) -> Result<Admission, Refusal> {
        let mut tightest: Option<Quota> = None;
        let mut refused: Option<Quota> = None;
        for (w, limit) in b.tokens.iter().enumerate() {
            let limit = match limit {
                Some(l) => *l,
                None => continue,
            };
            let length = WINDOWS[w].1;
            let remaining = limit.saturating_sub(self.used(w, now));
            let reset_ms = length - now % length;
            if cost > remaining {
                // The request fits once every window that refuses it has moved on: the latest.
                if refused.map_or(true, |q| reset_ms > q.reset_ms) {
                    refused = Some(Quota { limit, remaining, reset_ms });
                }
            } else if tightest.map_or(true, |q| remaining - cost < q.remaining) {
                tightest = Some(Quota { limit, remaining: remaining - cost, reset_ms });
            }
        }
        if let Some(quota) = refused {
            return Err(Refusal { quota: Some(quota), why: Why::Tokens { cost } });
        }
        if let Some(max) = b.concurrent_streams {
            if self.streams >= max {
                return Err(Refusal { quota: tightest, why: Why::Streams { max } });
            }
        }
        let mut windows = [0u64; 3];
        for (w, slot) in windows.iter_mut().enumerate() {
            let index = now / WINDOWS[w].1;
            let used = self.used(w, now).saturating_add(cost);
            self.windows[w] = (index, used);
            *slot = index;
        }
        self.streams = self.streams.saturating_add(1);
        Ok(Admission { cost, windows, quota: tightest })
    }

    /// Give back an admission's tokens, in the windows it was charged to that are still current.
    pub fn release_tokens(&mut self, a: &Admission) {
        for (w, index) in a.windows.iter().enumerate() {
            if self.windows[w].0 == *index {
                self.windows[w].1 = self.windows[w].1.saturating_sub(a.cost);
            }
        }
    }

    pub fn release_stream(&mut self) {
        self.streams = self.streams.saturating_sub(1);
    }
}

/// A window's state as the response headers tell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub limit: u64,
    pub remaining: u64,
    pub reset_ms: u64,
}

/// An admitted reservation, kept by the stream until it is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    pub cost: u64,
    /// The window indices it was charged in.
    pub windows: [u64; 3],
    /// The limited window with the least left after it (`None`: no window is limited).
    pub quota: Option<Quota>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    Tokens { cost: u64 },
    Streams { max: u64 },
    /// The table could not record the reservation (a shared-data failure, or every CAS try
    /// lost): refused rather than admitted unrecorded, so the budget is never overshot.
    Unrecorded,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The window that refused (tokens), or the tightest one (streams); `None`: no window.
    pub quota: Option<Quota>,
    pub why: Why,
}

impl Refusal {
    pub fn retry_after_s(&self) -> u64 {
        match (self.why, self.quota) {
            (Why::Tokens { .. }, Some(q)) => ((q.reset_ms + 999) / 1000).max(1),
            _ => STREAMS_RETRY_AFTER_S,
        }
    }

    /// The OpenAI error body of the 429.
    pub fn body(&self, class: &str, tenant: &str) -> String {
        let why = match (self.why, self.quota) {
            (Why::Tokens { cost }, Some(q)) if cost > q.limit => {
                format!("this request reserves {cost} tokens, more than the {} tokens its window allows", q.limit)
            }
            (Why::Tokens { cost }, Some(q)) => format!("this request reserves {cost} tokens and {} remain in the window", q.remaining),
            (Why::Streams { max }, _) => format!("{max} streams are already in flight"),
            _ => "the reservation could not be recorded".to_string(),
        };
        format!(
            r#"{{"error":{{"message":"token budget of class {class}, tenant {tenant} exceeded: {why}","type":"rate_limit_error","param":null,"code":"{ERROR_CODE}"}}}}"#
        )
    }
}

/// `x-ratelimit-reset-tokens`' format (OpenAI's: `20ms`, `59s`, `6m0s`, `1h0m0s`).
pub fn reset_text(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = (ms + 999) / 1000;
    match (s / 3600, s % 3600 / 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec}s"),
        (h, m, sec) => format!("{h}h{m}m{sec}s"),
    }
}

/// The three rate-limit headers of a window.
pub fn quota_headers(q: &Quota) -> [(&'static str, String); 3] {
    [(HEADER_LIMIT, q.limit.to_string()), (HEADER_REMAINING, q.remaining.to_string()), (HEADER_RESET, reset_text(q.reset_ms))]
}

// ---- the table ---------------------------------------------------------------------------------

/// The record of (class, tenant record) in the table.
pub fn record_key(class: &str, record: &str) -> String {
    format!("infermesh.budget.{class}.{record}")
}

/// Where a runtime keeps the records, shared by every worker.
pub trait BudgetStore {
    /// Apply `f` to the record of `key` as one atomic step (`f` says whether it changed it; it
    /// may run more than once, on fresh copies, when a write loses a race). `false`: the store
    /// could not (a host failure, or every CAS try lost).
    fn update(&self, key: &str, f: &mut dyn FnMut(&mut Record) -> bool) -> bool;
    /// Create the record of `key` if there is none (at configure time, before traffic, so that
    /// no reservation is made on a record two workers create at once).
    fn ensure(&self, key: &str);
}

/// CAS tries of one update: a lost try means another worker's write won, so a burst of W
/// workers on one record needs at most W tries per update in the worst order.
pub const CAS_TRIES: usize = 64;

/// The Wasm runtime's table: one shared-data key per record, written with CAS.
pub struct SharedBudgets<D> {
    pub data: D,
    /// `budget_errors_total`: an undecodable record (read as empty), or an update given up.
    pub error: CounterId,
}

impl<D: SharedData> BudgetStore for SharedBudgets<D> {
    fn update(&self, key: &str, f: &mut dyn FnMut(&mut Record) -> bool) -> bool {
        for _ in 0..CAS_TRIES {
            let (bytes, cas) = match self.data.get(key) {
                Some(got) => got,
                None => break,
            };
            let mut rec = match bytes.as_deref().map(Record::decode) {
                Some(Some(r)) => r,
                Some(None) => {
                    self.data.count(self.error);
                    Record::default()
                }
                None => Record::default(),
            };
            if !f(&mut rec) {
                return true;
            }
            // A record that does not exist yet is created unconditionally (shared data has no
            // conditional create): the records of the listed tenants and `other` are ensured at
            // configure time, only an unlisted tenant's slot is first written by traffic.
            if self.data.set(key, &rec.encode(), cas) {
                return true;
            }
        }
        self.data.count(self.error);
        false
    }

    fn ensure(&self, key: &str) {
        if let Some((None, _)) = self.data.get(key) {
            self.data.set(key, &Record::default().encode(), None);
        }
    }
}

/// Shards of the native runtime's table: a record's key picks its shard, whose mutex is held for
/// the few comparisons of one update.
pub const SHARDS: usize = 64;
type Shard = Mutex<Option<HashMap<String, Record>>>;
#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SHARD: Shard = Mutex::new(None);
/// The process's table: every config the native module accepts uses it, so budgets outlive a
/// config reload (as proxy-wasm shared data does in the Wasm filter).
static PROCESS: [Shard; SHARDS] = [EMPTY_SHARD; SHARDS];

/// The native runtime's table.
pub struct ProcessBudgets {
    shards: &'static [Shard; SHARDS],
}

impl ProcessBudgets {
    /// The process-wide table.
    pub fn process() -> ProcessBudgets {
        ProcessBudgets { shards: &PROCESS }
    }

    /// A table of its own (tests: each its own records; never freed).
    pub fn fresh() -> ProcessBudgets {
        ProcessBudgets { shards: Box::leak(Box::new([EMPTY_SHARD; SHARDS])) }
    }

    fn shard(&self, key: &str) -> &Shard {
        &self.shards[(fnv1a(key.as_bytes()) % SHARDS as u64) as usize]
    }
}

impl BudgetStore for ProcessBudgets {
    fn update(&self, key: &str, f: &mut dyn FnMut(&mut Record) -> bool) -> bool {
        let mut shard = match self.shard(key).lock() {
            Ok(s) => s,
            Err(_) => return false,
        };
        let map = shard.get_or_insert_with(HashMap::new);
        match map.get_mut(key) {
            Some(rec) => {
                f(rec);
            }
            None => {
                let mut rec = Record::default();
                if f(&mut rec) {
                    map.insert(key.to_string(), rec);
                }
            }
        }
        true
    }

    fn ensure(&self, _key: &str) {}
}

// ---- reserve and settle ------------------------------------------------------------------------

/// A stream's reservation, until it is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub key: String,
    pub admission: Admission,
    /// The tokens are still charged (an upstream error gives them back once).
    pub tokens: bool,
}

/// Reserve `cost` on `key` under `b`.
pub fn reserve(store: &dyn BudgetStore, key: &str, b: &Budget, cost: u64, now: u64) -> Result<Held, Refusal> {
    let mut outcome = Err(Refusal { quota: None, why: Why::Unrecorded });
    let recorded = store.update(key, &mut |rec| {
        outcome = rec.reserve(b, cost, now);
        outcome.is_ok()
    });
    match outcome {
        Ok(admission) if recorded => Ok(Held { key: key.to_string(), admission, tokens: true }),
        Ok(_) => Err(Refusal { quota: None, why: Why::Unrecorded }),
        Err(r) => Err(r),
    }
}

/// Updates a release tries (each of `CAS_TRIES`): a release lost for good would hold a stream
/// slot for ever, so it tries harder than a reservation, which is refused instead.
const RELEASE_UPDATES: usize = 16;

/// The upstream answered an error (nothing was generated): the tokens go back.
pub fn release_tokens(store: &dyn BudgetStore, held: &mut Held) {
    if !held.tokens {
        return;
    }
    held.tokens = false;
    let a = held.admission;
    // Given up, the tokens stay charged: an over-charge, never an overshoot.
    for _ in 0..RELEASE_UPDATES {
        if store.update(&held.key, &mut |rec| {
            rec.release_tokens(&a);
            true
        }) {
            return;
        }
    }
}

/// The stream ended (completed, reset, the client gone): its slot goes back.
pub fn release_stream(store: &dyn BudgetStore, held: &Held) {
    for _ in 0..RELEASE_UPDATES {
        if store.update(&held.key, &mut |rec| {
            rec.release_stream();
            true
        }) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix_table::ProcessSharedData;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    fn budget(per_minute: Option<u64>, per_day: Option<u64>, streams: Option<u64>) -> Budget {
        Budget { tokens: [per_minute, None, per_day], input_weight: 1, output_weight: 1, concurrent_streams: streams }
    }

    #[test]
    fn sha256_matches_the_standard_vectors() {
        let hex = |d: [u8; 32]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(hex(sha256(b"")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert_eq!(hex(sha256(b"abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(
            hex(sha256(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        assert_eq!(hex(sha256(&[b'a'; 1000])), "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3");
    }

    #[test]
    fn the_api_key_tenant_is_the_hash_of_the_bearer_token() {
        let t = api_key_tenant(Some(b"Bearer sk-team-a"), None).unwrap();
        // python3 -c "import hashlib; print(hashlib.sha256(b'sk-team-a').hexdigest()[:16])"
        assert_eq!(t, "8879f6a4ae35c420");
        assert_eq!(api_key_tenant(Some(b"bearer   sk-team-a  "), None).as_deref(), Some(t.as_str()));
        assert_eq!(api_key_tenant(None, Some(b"sk-team-a")).as_deref(), Some(t.as_str()), "x-api-key (Anthropic's)");
        assert_eq!(api_key_tenant(Some(b"Basic dXNlcg=="), None), None);
        assert_eq!(api_key_tenant(Some(b"Bearer "), None), None);
        assert_eq!(api_key_tenant(None, None), None);
        assert_eq!(api_key_tenant(Some(b"Bear"), Some(b"k")), api_key_tenant(None, Some(b"k")));
    }

    #[test]
    fn the_reservation_is_bytes_plus_messages_plus_the_completion_bound_weighted() {
        let b = budget(Some(1000), None, None);
        let ask = Ask { prompt_bytes: 100, messages: 2, choices: 1, max_tokens: Some(50) };
        assert_eq!(ask.cost(&b, 256), 100 + 16 + 50);
        assert_eq!(Ask { max_tokens: None, ..ask }.cost(&b, 256), 116 + 256, "the class default");
        assert_eq!(Ask { choices: 3, ..ask }.cost(&b, 256), 116 + 150, "n choices");
        let output_only = Budget { input_weight: 0, output_weight: 2, ..b.clone() };
        assert_eq!(ask.cost(&output_only, 256), 100);
        let huge = Ask { prompt_bytes: u64::MAX, messages: u64::MAX, choices: u64::MAX, max_tokens: Some(u64::MAX) };
        assert_eq!(huge.cost(&b, 256), u64::MAX, "saturates, never wraps");
        assert_eq!(Ask::unread(5000).cost(&b, 256), 5000 + 256);
    }

    #[test]
    fn listed_tenants_have_their_own_record_and_the_rest_share_bounded_slots() {
        let mut tenants = BTreeMap::new();
        tenants.insert("team-a".to_string(), budget(Some(10), None, None));
        let class = ClassBudgets { default_max_tokens: 16, default: Some(budget(Some(99), None, None)), tenants };
        let a = charged(&class, Some("team-a"));
        assert_eq!((a.record.as_str(), a.label, a.budget.unwrap().tokens[0]), ("team-a", "team-a", Some(10)));
        let o = charged(&class, None);
        assert_eq!((o.record.as_str(), o.label, o.budget.unwrap().tokens[0]), ("other", "other", Some(99)));
        assert_eq!(charged(&class, Some("")).record, "other");
        let x = charged(&class, Some("team-x"));
        assert_eq!((x.label, x.budget.unwrap().tokens[0]), ("other", Some(99)));
        assert!(x.record.starts_with('~'));
        assert_eq!(charged(&class, Some("team-x")).record, x.record, "the same tenant, the same slot");
        let slots: std::collections::BTreeSet<String> = (0..100_000).map(|i| charged(&class, Some(&format!("t{i}"))).record).collect();
        assert_eq!(slots.len() as u64, TENANT_SLOTS, "however many tenants, the records are bounded");
        let unlimited = ClassBudgets { default: None, ..class };
        assert_eq!(charged(&unlimited, Some("team-y")).budget, None);
    }

    #[test]
    fn fixed_windows_refuse_what_does_not_fit_and_reset() {
        let b = budget(Some(100), Some(150), None);
        let mut rec = Record::default();
        let t0 = 10 * 60_000 + 15_000;
        let a = rec.reserve(&b, 60, t0).unwrap();
        assert_eq!(a.quota, Some(Quota { limit: 100, remaining: 40, reset_ms: 45_000 }));
        let r = rec.reserve(&b, 41, t0 + 1).unwrap_err();
        assert_eq!(r.quota, Some(Quota { limit: 100, remaining: 40, reset_ms: 44_999 }));
        assert_eq!(r.retry_after_s(), 45);
        assert!(rec.reserve(&b, 40, t0 + 2).is_ok(), "exactly what remains fits");
        // The next minute: the minute window is new, the day has 50 left.
        let next = 11 * 60_000;
        let r = rec.reserve(&b, 60, next).unwrap_err();
        assert_eq!(r.quota.unwrap().limit, 150, "the day refuses");
        assert_eq!(r.retry_after_s(), (86_400_000 - next + 999) / 1000);
        let a = rec.reserve(&b, 50, next).unwrap();
        assert_eq!(a.quota.unwrap().remaining, 0);
        // Released in the same windows: back; a window that moved on is left alone.
        rec.release_tokens(&a);
        assert_eq!(rec.used(2, next), 100);
        assert_eq!(rec.used(0, next), 0);
        // A request larger than a window can never fit: refused, and the body says so.
        let r = Record::default().reserve(&b, 101, t0).unwrap_err();
        assert!(r.body("batch", "other").contains("more than the 100 tokens its window allows"), "{}", r.body("batch", "other"));
        assert!(r.body("batch", "other").contains(r#""code":"token_budget_exceeded""#));
        assert!(serde_json::from_str::<serde_json::Value>(&r.body("b", "t")).is_ok());
    }

    #[test]
    fn concurrent_streams_are_taken_and_given_back() {
        let b = budget(None, None, Some(2));
        let mut rec = Record::default();
        assert!(rec.reserve(&b, 5, 0).is_ok());
        assert!(rec.reserve(&b, 5, 0).is_ok());
        let r = rec.reserve(&b, 5, 0).unwrap_err();
        assert_eq!((r.why, r.retry_after_s()), (Why::Streams { max: 2 }, 1));
        rec.release_stream();
        assert!(rec.reserve(&b, 5, 0).is_ok());
        for _ in 0..10 {
            rec.release_stream();
        }
        assert_eq!(rec.streams, 0, "never below zero");
    }

    #[test]
    fn records_round_trip_and_garbage_does_not_decode() {
        let rec = Record { windows: [(1, 2), (3, 4), (u64::MAX, 6)], streams: 7 };
        assert_eq!(Record::decode(&rec.encode()), Some(rec));
        assert_eq!(Record::decode(b"short"), None);
        assert_eq!(Record::decode(&[0u8; 57]), None);
    }

    #[test]
    fn reset_is_written_as_openai_does() {
        assert_eq!(reset_text(20), "20ms");
        assert_eq!(reset_text(1000), "1s");
        assert_eq!(reset_text(59_001), "1m0s");
        assert_eq!(reset_text(360_000), "6m0s");
        assert_eq!(reset_text(3_600_000), "1h0m0s");
        assert_eq!(reset_text(86_400_000), "24h0m0s");
    }

    /// proxy-wasm shared data as 64 workers see it: get and set are separate host calls (each
    /// under the host's lock), with a yield between them so that races really happen.
    #[derive(Default)]
    struct RacyShared {
        inner: ProcessSharedData,
        lost: AtomicU64,
    }

    impl SharedData for Arc<RacyShared> {
        fn get(&self, key: &str) -> Option<(Option<Vec<u8>>, Option<u32>)> {
            let got = self.inner.get(key);
            std::thread::yield_now();
            got
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            let ok = self.inner.set(key, value, cas);
            if !ok {
                self.lost.fetch_add(1, Ordering::Relaxed);
            }
            ok
        }
        fn count(&self, _id: CounterId) {}
    }

    /// 64 threads, each a worker with its own view of the table, burst reservations at one
    /// budget: the sum of what was admitted never exceeds it (and the budget is filled).
    fn burst(store: Arc<dyn BudgetStore + Send + Sync>, limit: u64, costs: &[u64]) -> (u64, u64) {
        let b = budget(Some(limit), None, None);
        let key = record_key("batch", "team-a");
        store.ensure(&key);
        let admitted = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let start = Arc::new(std::sync::Barrier::new(64));
        let threads: Vec<_> = (0..64)
            .map(|t| {
                let (store, admitted, refused, start, key, b) = (Arc::clone(&store), Arc::clone(&admitted), Arc::clone(&refused), Arc::clone(&start), key.clone(), b.clone());
                let costs = costs.to_vec();
                std::thread::spawn(move || {
                    start.wait();
                    for i in 0..8 {
                        let cost = costs[(t * 8 + i) % costs.len()];
                        match reserve(&*store, &key, &b, cost, 1_000) {
                            Ok(h) => {
                                admitted.fetch_add(h.admission.cost, Ordering::SeqCst);
                                release_stream(&*store, &h);
                            }
                            Err(_) => {
                                refused.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        (admitted.load(Ordering::SeqCst), refused.load(Ordering::SeqCst))
    }

    #[test]
    fn a_burst_of_64_workers_never_overshoots_a_shared_data_budget() {
        let data = Arc::new(RacyShared::default());
        let store = Arc::new(SharedBudgets { data: Arc::clone(&data), error: None });
        let costs = [97, 300, 1, 1024, 55, 4096, 7, 640];
        let limit = 100_000;
        let (admitted, refused) = burst(store, limit, &costs);
        assert!(admitted <= limit, "admitted {admitted} > budget {limit}");
        // 512 requests of ~777 tokens on average ask ~4x the budget: it is filled but for less
        // than the largest request (and the refusals are real ones, not lost races).
        assert!(admitted > limit - 4096, "admitted only {admitted}");
        assert!(refused > 0);
        assert!(data.lost.load(Ordering::Relaxed) > 0, "the burst raced (CAS writes were lost and retried)");
        let rec = Record::decode(&data.inner.get(&record_key("batch", "team-a")).unwrap().0.unwrap()).unwrap();
        assert_eq!(rec.windows[0].1, admitted, "the table holds exactly what was admitted");
        assert_eq!(rec.streams, 0, "every slot was given back");
    }

    #[test]
    fn a_burst_of_64_workers_never_overshoots_the_process_table() {
        let store = Arc::new(ProcessBudgets::fresh());
        let (admitted, _) = burst(store.clone(), 50_000, &[333, 1, 2048, 90]);
        assert!(admitted <= 50_000 && admitted > 50_000 - 2048, "{admitted}");
        let mut rec = Record::default();
        store.update(&record_key("batch", "team-a"), &mut |r| {
            rec = *r;
            false
        });
        assert_eq!((rec.windows[0].1, rec.streams), (admitted, 0));
    }

    #[test]
    fn a_store_that_cannot_record_refuses_and_a_release_after_the_window_changes_nothing() {
        struct Broken;
        impl BudgetStore for Broken {
            fn update(&self, _: &str, f: &mut dyn FnMut(&mut Record) -> bool) -> bool {
                f(&mut Record::default());
                false
            }
            fn ensure(&self, _: &str) {}
        }
        let b = budget(Some(100), None, None);
        assert_eq!(reserve(&Broken, "k", &b, 1, 0).unwrap_err().why, Why::Unrecorded);
        let store = ProcessBudgets::fresh();
        let mut held = reserve(&store, "k", &b, 60, 0).unwrap();
        release_tokens(&store, &mut held);
        release_tokens(&store, &mut held);
        let again = reserve(&store, "k", &b, 100, 1).unwrap();
        assert_eq!(again.admission.quota.unwrap().remaining, 0, "released once, not twice");
    }
}
