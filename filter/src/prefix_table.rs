//! The prefix → replica table (docs/prefix-routing.md): which replica of a pool served a prefix
//! key lately, and each replica's last load reading, so the filter can name that replica
//! (`x-infermesh-prefix-host`, read by Envoy's stateful session filter) while it is under the
//! load bound. Pure apart from `SharedData`: in the Wasm filter it is proxy-wasm shared data
//! (every worker of the VM), in the native module one process-wide map (`ProcessSharedData`).
//!
//! Bounded: `SLOTS` records per pool (a key's slot is `key % SLOTS`; a colliding key overwrites:
//! its next request is picked by load, and learnt again), each `IP:PORT` of at most `MAX_ADDR`
//! bytes; one load record per pool of at most `MAX_REPLICAS` readings.

use crate::shared_pool_table::SharedData;
use crate::request_flow::CounterId;
use std::collections::HashMap;
use std::sync::Mutex;

/// The replica to serve a request, `base64(IP:PORT)`: the filter writes it for Envoy's stateful
/// session filter (header-based session state); on the response that filter writes the replica
/// that served when it is not the one named. Internal both ways: a client's copy is stripped
/// with every `x-infermesh-*` request header, the response's is removed.
pub const HEADER_PREFIX_HOST: &str = "x-infermesh-prefix-host";
/// The serving replica's utilization (sidecar/response_headers.py), removed from every response.
pub const HEADER_LOAD: &str = "x-infermesh-load";

/// Records per pool: a key's slot is `key % SLOTS`.
pub const SLOTS: u64 = 1024;
/// An entry older than this is ignored: vLLM's prefix cache evicts a prefix not used for a while
/// (LRU under load), so an old entry promises nothing; 5 minutes outlasts a chat's think time.
pub const TTL_MS: u64 = 300_000;
/// A load reading older than this is not counted (an idle replica sends none).
pub const LOAD_FRESH_MS: u64 = 10_000;
/// When a keyed class's replica is too loaded to be named (the policy's
/// `classes.NAME.prefix_key.load_*_pct`, bounds and defaults in config.rs): over the pool's mean
/// fresh reading by more than `over_mean_pct`, once it is past `floor_pct` (with a request or two
/// in flight the relative bound would move a conversation off its cache for nothing); always past
/// `ceiling_pct`, whatever the mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadBound {
    pub over_mean_pct: u64,
    pub floor_pct: u64,
    pub ceiling_pct: u64,
}

impl Default for LoadBound {
    fn default() -> LoadBound {
        use crate::config::{PREFIX_LOAD_CEILING_PCT, PREFIX_LOAD_FLOOR_PCT, PREFIX_LOAD_OVER_MEAN_PCT};
        LoadBound {
            over_mean_pct: PREFIX_LOAD_OVER_MEAN_PCT.default,
            floor_pct: PREFIX_LOAD_FLOOR_PCT.default,
            ceiling_pct: PREFIX_LOAD_CEILING_PCT.default,
        }
    }
}
/// Readings kept per pool; a new replica past it replaces the oldest reading.
pub const MAX_REPLICAS: usize = 64;
/// The longest `IP:PORT` (an IPv6 address with brackets and port is at most 47 bytes).
pub const MAX_ADDR: usize = 64;
/// CAS attempts per load write before it is given up: another worker keeps winning.
const CAS_TRIES: usize = 4;

fn slot_key(pool: &str, key: u64) -> String {
    format!("infermesh.prefix.{pool}.{}", key % SLOTS)
}
fn load_key(pool: &str) -> String {
    format!("infermesh.prefix_load.{pool}")
}

/// One slot: the full key (the slot index is only its low bits), when it was learnt, where.
fn encode_slot(key: u64, at: u64, addr: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + addr.len());
    v.extend_from_slice(&key.to_le_bytes());
    v.extend_from_slice(&at.to_le_bytes());
    v.extend_from_slice(addr.as_bytes());
    v
}
fn decode_slot(b: &[u8]) -> Option<(u64, u64, &str)> {
    if b.len() < 16 || b.len() > 16 + MAX_ADDR {
        return None;
    }
    let key = u64::from_le_bytes(b[..8].try_into().ok()?);
    let at = u64::from_le_bytes(b[8..16].try_into().ok()?);
    Some((key, at, std::str::from_utf8(&b[16..]).ok()?))
}

/// A pool's load readings: (replica, utilization in thousandths, when).
#[derive(Default, Debug, PartialEq)]
struct LoadRecord(Vec<(String, u32, u64)>);

impl LoadRecord {
    fn encode(&self) -> Vec<u8> {
        let mut s = String::new();
        for (addr, load, at) in &self.0 {
            s.push_str(&format!("{addr} {load} {at}\n"));
        }
        s.into_bytes()
    }
    fn decode(b: &[u8]) -> Option<LoadRecord> {
        let s = std::str::from_utf8(b).ok()?;
        let mut out = Vec::new();
        for line in s.lines() {
            let mut f = line.split(' ');
            let (addr, load, at) = (f.next()?, f.next()?.parse().ok()?, f.next()?.parse().ok()?);
            if out.len() == MAX_REPLICAS || addr.len() > MAX_ADDR {
                return None;
            }
            out.push((addr.to_string(), load, at));
        }
        Some(LoadRecord(out))
    }
    fn observe(&mut self, addr: &str, load: u32, now: u64) {
        if let Some(e) = self.0.iter_mut().find(|(a, _, _)| a == addr) {
            e.1 = load;
            e.2 = now;
            return;
        }
        if self.0.len() == MAX_REPLICAS {
            if let Some(oldest) = self.0.iter_mut().min_by_key(|(_, _, at)| *at) {
                *oldest = (addr.to_string(), load, now);
            }
            return;
        }
        self.0.push((addr.to_string(), load, now));
    }
    /// Whether `addr`'s fresh reading is over the bound (no fresh reading: not over it).
    fn over_bound(&self, addr: &str, now: u64, bound: LoadBound) -> bool {
        let fresh = |at: u64| now.saturating_sub(at) < LOAD_FRESH_MS;
        let mine = match self.0.iter().find(|(a, _, at)| a == addr && fresh(*at)) {
            Some((_, load, _)) => f64::from(*load) / 1000.0,
            None => return false,
        };
        let readings: Vec<f64> = self.0.iter().filter(|(_, _, at)| fresh(*at)).map(|(_, l, _)| f64::from(*l) / 1000.0).collect();
        let mean = readings.iter().sum::<f64>() / readings.len() as f64;
        let pct = |p: u64| p as f64 / 100.0;
        mine > pct(bound.ceiling_pct) || (mine > pct(bound.floor_pct) && mine > mean * (1.0 + pct(bound.over_mean_pct)))
    }
}

/// What a lookup found.
#[derive(Debug, PartialEq, Eq)]
pub enum Pick {
    /// The replica to name.
    Named(String),
    /// Some key's replica was over the load bound, and no shorter key named another.
    OverBound,
    /// No fresh entry for any key.
    Unknown,
}

/// The table as one worker (or the process) sees it.
#[derive(Default)]
pub struct PrefixTable<D> {
    data: D,
}

impl<D: SharedData> PrefixTable<D> {
    /// `lookup_bounded` with the default load bound.
    pub fn lookup(&self, pool: &str, chain: &[u64], now: u64) -> Pick {
        self.lookup_bounded(pool, chain, now, LoadBound::default())
    }

    /// The replica of the first key of `chain` (longest prefix first) with a fresh entry whose
    /// replica is not over the load `bound`.
    pub fn lookup_bounded(&self, pool: &str, chain: &[u64], now: u64, bound: LoadBound) -> Pick {
        let mut loads: Option<LoadRecord> = None;
        let mut over = false;
        for &key in chain {
            let bytes = match self.data.get(&slot_key(pool, key)) {
                Some((Some(b), _)) => b,
                _ => continue,
            };
            let addr = match decode_slot(&bytes) {
                Some((k, at, addr)) if k == key && now.saturating_sub(at) < TTL_MS => addr,
                _ => continue,
            };
            let loads = loads.get_or_insert_with(|| self.loads(pool).0);
            if loads.over_bound(addr, now, bound) {
                over = true;
                continue;
            }
            return Pick::Named(addr.to_string());
        }
        if over {
            Pick::OverBound
        } else {
            Pick::Unknown
        }
    }

    /// The request's keys now map to `addr` (last writer wins: no CAS needed).
    pub fn learn(&self, pool: &str, keys: &[u64], addr: &str, now: u64) {
        if addr.is_empty() || addr.len() > MAX_ADDR {
            return;
        }
        for &key in keys {
            self.data.set(&slot_key(pool, key), &encode_slot(key, now, addr), None);
        }
    }

    fn loads(&self, pool: &str) -> (LoadRecord, Option<u32>) {
        match self.data.get(&load_key(pool)) {
            Some((Some(b), cas)) => (LoadRecord::decode(&b).unwrap_or_default(), cas),
            Some((None, cas)) => (LoadRecord::default(), cas),
            None => (LoadRecord::default(), None),
        }
    }

    /// `addr`'s utilization (`x-infermesh-load`); false: every CAS try lost its race.
    pub fn report_load(&self, pool: &str, addr: &str, load: f64, now: u64) -> bool {
        if addr.is_empty() || addr.len() > MAX_ADDR || addr.contains(' ') || !load.is_finite() || load < 0.0 {
            return true;
        }
        // Thousandths, capped: a long queue reads as 1000 × load, far past any bound.
        let milli = (load * 1000.0).round().min(1e6) as u32;
        for _ in 0..CAS_TRIES {
            let (mut rec, cas) = self.loads(pool);
            rec.observe(addr, milli, now);
            if self.data.set(&load_key(pool), &rec.encode(), cas) {
                return true;
            }
        }
        false
    }
}

/// The native module's `SharedData`: one map for the whole process (every worker), a CAS token
/// per key as proxy-wasm's.
#[derive(Default)]
pub struct ProcessSharedData {
    map: Mutex<HashMap<String, (Vec<u8>, u32)>>,
}

impl SharedData for ProcessSharedData {
    fn get(&self, key: &str) -> Option<(Option<Vec<u8>>, Option<u32>)> {
        let map = self.map.lock().ok()?;
        Some(match map.get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        })
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        let mut map = match self.map.lock() {
            Ok(m) => m,
            Err(_) => return false,
        };
        let now = map.get(key).map(|(_, c)| *c);
        if cas.is_some() && cas != now {
            return false;
        }
        map.insert(key.to_string(), (value.to_vec(), now.unwrap_or(0).wrapping_add(1)));
        true
    }
    fn count(&self, _id: CounterId) {}
}

pub use crate::base64::encode as base64_encode;

/// A host address from Envoy's session header: standard padded base64 (`crate::base64::decode`)
/// no longer than an `IP:PORT` of `MAX_ADDR` bytes needs.
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if s.len() > (MAX_ADDR + 2) / 3 * 4 {
        return None;
    }
    crate::base64::decode(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A fake of proxy-wasm shared data over the process map, whose writes can be made to lose
    /// every race (another worker keeps winning).
    #[derive(Default)]
    struct FakeSharedData {
        inner: ProcessSharedData,
        contended: Cell<bool>,
    }

    impl SharedData for FakeSharedData {
        fn get(&self, key: &str) -> Option<(Option<Vec<u8>>, Option<u32>)> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            if self.contended.get() {
                return false;
            }
            self.inner.set(key, value, cas)
        }
        fn count(&self, _id: CounterId) {}
    }

    const A: &str = "127.0.0.1:8001";
    const B: &str = "127.0.0.1:8002";

    #[test]
    fn a_learnt_key_names_its_replica_longest_prefix_first_until_it_expires() {
        let t = PrefixTable::<FakeSharedData>::default();
        assert_eq!(t.lookup("p", &[1, 2], 1000), Pick::Unknown);
        t.learn("p", &[2], A, 1000);
        t.learn("p", &[1], B, 1000);
        assert_eq!(t.lookup("p", &[1, 2], 2000), Pick::Named(B.into()));
        assert_eq!(t.lookup("p", &[3, 2], 2000), Pick::Named(A.into()));
        assert_eq!(t.lookup("other", &[1, 2], 2000), Pick::Unknown, "per pool");
        assert_eq!(t.lookup("p", &[1, 2], 1000 + TTL_MS), Pick::Unknown, "expired");
        // A colliding key (same slot) overwrites, and is told apart by its full key.
        t.learn("p", &[1 + SLOTS], A, 3000);
        assert_eq!(t.lookup("p", &[1], 3000), Pick::Unknown);
        assert_eq!(t.lookup("p", &[1 + SLOTS], 3000), Pick::Named(A.into()));
    }

    #[test]
    fn a_hot_keys_replica_over_the_bound_is_not_named() {
        let t = PrefixTable::<FakeSharedData>::default();
        t.learn("p", &[7, 8], A, 1000);
        t.learn("p", &[9], B, 1000);
        assert!(t.report_load("p", A, 0.8, 1000) && t.report_load("p", B, 0.2, 1000));
        // Mean 0.5, bound 0.625: A at 0.8 is over it; the shorter key's replica is not.
        assert_eq!(t.lookup("p", &[7], 1001), Pick::OverBound);
        t.learn("p", &[8], B, 1001);
        assert_eq!(t.lookup("p", &[7, 8], 1001), Pick::Named(B.into()));
        // Under the floor a replica is never over the relative bound.
        t.report_load("p", A, 0.45, 1002);
        assert_eq!(t.lookup("p", &[7], 1002), Pick::Named(A.into()));
        // Over the ceiling it always is, even when every replica is as loaded.
        t.report_load("p", A, 0.95, 1003);
        t.report_load("p", B, 0.95, 1003);
        assert_eq!(t.lookup("p", &[7], 1003), Pick::OverBound);
        // A stale reading is not counted: an idle replica sends none.
        assert_eq!(t.lookup("p", &[7], 1003 + LOAD_FRESH_MS), Pick::Named(A.into()));
    }

    #[test]
    fn a_classs_own_bound_is_the_one_applied() {
        let t = PrefixTable::<FakeSharedData>::default();
        t.learn("p", &[7], A, 1000);
        assert!(t.report_load("p", A, 0.8, 1000) && t.report_load("p", B, 0.2, 1000));
        // Mean 0.5: over 25 % above it by default; a class that allows 100 % keeps A (0.8 < 1.0).
        assert_eq!(t.lookup("p", &[7], 1001), Pick::OverBound);
        let loose = LoadBound { over_mean_pct: 100, ..LoadBound::default() };
        assert_eq!(t.lookup_bounded("p", &[7], 1001, loose), Pick::Named(A.into()));
        // A floor of 85 %: 0.8 is never over the relative bound; a ceiling of 75 %: always over.
        assert_eq!(t.lookup_bounded("p", &[7], 1001, LoadBound { floor_pct: 85, ceiling_pct: 90, ..loose }), Pick::Named(A.into()));
        assert_eq!(t.lookup_bounded("p", &[7], 1001, LoadBound { floor_pct: 50, ceiling_pct: 75, ..loose }), Pick::OverBound);
        // The defaults are the bound the table was measured with (docs/prefix-routing.md).
        assert_eq!(LoadBound::default(), LoadBound { over_mean_pct: 25, floor_pct: 50, ceiling_pct: 90 });
    }

    #[test]
    fn a_replica_that_leaves_holds_only_its_own_keys() {
        let t = PrefixTable::<FakeSharedData>::default();
        t.learn("p", &[1, 2], A, 1000);
        t.learn("p", &[3, 4], B, 1000);
        // B left (Envoy passes over a named host it does not know): its keys are learnt anew.
        t.learn("p", &[3], A, 2000);
        assert_eq!(t.lookup("p", &[3], 2000), Pick::Named(A.into()));
        assert_eq!(t.lookup("p", &[4], 2000), Pick::Named(B.into()), "only that key moved");
        assert_eq!(t.lookup("p", &[1], 2000), Pick::Named(A.into()));
    }

    #[test]
    fn a_load_write_that_keeps_losing_its_cas_race_gives_up() {
        let t = PrefixTable::<FakeSharedData>::default();
        t.data.contended.set(true);
        assert!(!t.report_load("p", A, 0.5, 1000));
        t.data.contended.set(false);
        assert!(t.report_load("p", A, 0.5, 1000));
        assert_eq!(t.loads("p").0, LoadRecord(vec![(A.into(), 500, 1000)]));
        assert!(t.report_load("p", "", 0.5, 1000) && t.report_load("p", A, f64::NAN, 1000), "nothing to write");
    }

    #[test]
    fn the_load_record_is_bounded() {
        let t = PrefixTable::<FakeSharedData>::default();
        for i in 0..(MAX_REPLICAS as u64 + 10) {
            t.report_load("p", &format!("10.0.0.{i}:80"), 0.1, 1000 + i);
        }
        let rec = t.loads("p").0;
        assert_eq!(rec.0.len(), MAX_REPLICAS);
        assert!(rec.0.iter().any(|(a, _, _)| a == "10.0.0.73:80") && !rec.0.iter().any(|(a, _, _)| a == "10.0.0.0:80"));
        // An address too long, a record that does not decode: nothing named, nothing kept.
        t.learn("p", &[1], &"x".repeat(MAX_ADDR + 1), 1000);
        assert_eq!(t.lookup("p", &[1], 1000), Pick::Unknown);
        t.data.inner.set(&load_key("q"), b"garbage", None);
        assert_eq!(t.loads("q").0, LoadRecord::default());
    }

    #[test]
    fn base64_is_envoys_standard_padded_form() {
        for (plain, enc) in [("127.0.0.1:8001", "MTI3LjAuMC4xOjgwMDE="), ("10.0.0.1:80", "MTAuMC4wLjE6ODA="), ("[::1]:9", "Wzo6MV06OQ=="), ("", "")] {
            assert_eq!(base64_encode(plain.as_bytes()), enc);
            assert_eq!(base64_decode(enc).as_deref(), Some(plain.as_bytes()));
        }
        for bad in ["abc", "a===", "ab=c", "MTI=MTI=", "!!!!"] {
            assert_eq!(base64_decode(bad), None, "{bad}");
        }
        assert_eq!(base64_decode(&"QUFB".repeat(40)), None, "too long for an address");
    }
}
