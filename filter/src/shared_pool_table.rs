//! The Wasm filter's pool state table: one record per pool in proxy-wasm shared data, written
//! with CAS by every worker (`SharedData`: the host's key-value store, hostcalls in `glue.rs`),
//! and this worker's view of it. It is fed by the `x-infermesh-pool-level` header of upstream
//! responses (one response per pool read every SAMPLE_MS) and by the probe of each pool's state
//! endpoint that one worker claims per interval. Pure apart from `SharedData`, so it compiles
//! and is tested on any target.

use crate::config::DegradedRouting;
use crate::pool_state::{parse_report, PoolRecord, RecentWrites, ResponseSampler};
use crate::request_flow::{CounterId, Metrics, PoolStates, StateError};
use std::cell::RefCell;
use std::collections::HashMap;

/// proxy-wasm shared data, as the table uses it.
pub trait SharedData: Default {
    /// A key's value and CAS token (`None`: the host call failed).
    fn get(&self, key: &str) -> Option<(Option<Vec<u8>>, Option<u32>)>;
    /// Write `value` if the key's CAS token is still `cas`.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool;
    fn count(&self, id: CounterId);
}

/// Shared-data keys: one record per pool, and the time of each pool's last probe.
fn state_key(pool: &str) -> String {
    format!("infermesh.pool_state.{pool}")
}
fn probe_key(pool: &str) -> String {
    format!("infermesh.probe.{pool}")
}

/// A worker reuses its view of a normal pool this long before reading shared data again (the
/// request path then costs no shared-data read; well inside the 1 s target).
const VIEW_MS: u64 = 100;
/// A worker rewrites an unchanged reading of a replica at most this often: fresh enough for the
/// staleness bound, without a shared-data write per response.
const REWRITE_MS: u64 = 250;
/// A worker reads the level header of one response per pool this often (`ResponseSampler`).
const SAMPLE_MS: u64 = 10;
/// Traffic keeps a pool's newest reading in shared data at most this old (an unchanged one is
/// rewritten every REWRITE_MS): an older one means its traffic stopped (spilled away, idle), and
/// the probe is due now, not a whole probe interval after the pool's last response.
const TRAFFIC_FRESH_MS: u64 = REWRITE_MS + SAMPLE_MS;
/// CAS attempts per write before it is given up (and counted): another worker keeps winning.
const CAS_TRIES: usize = 4;

/// This worker's side of the shared pool state table (one per accepted config: a new config may
/// change a pool's level rule, so it starts from the shared records again).
#[derive(Default)]
pub struct SharedTable<D> {
    data: D,
    /// `pool_state_errors_total{reason="shared_data"}`.
    shared_data_error: CounterId,
    /// pool -> (read at, degraded).
    view: RefCell<HashMap<String, (u64, bool)>>,
    /// The readings this worker wrote lately (skipped while unchanged).
    written: RefCell<RecentWrites>,
    /// Which responses' level header this worker reads.
    sampled: RefCell<ResponseSampler>,
}

impl<D: SharedData> SharedTable<D> {
    fn read(&self, pool: &str) -> (PoolRecord, Option<u32>) {
        match self.data.get(&state_key(pool)) {
            Some((Some(bytes), cas)) => match PoolRecord::decode(&bytes) {
                Some(rec) => (rec, cas),
                None => {
                    self.data.count(self.shared_data_error);
                    (PoolRecord::default(), cas)
                }
            },
            Some((None, cas)) => (PoolRecord::default(), cas),
            None => (PoolRecord::default(), None),
        }
    }

    /// Claim this interval's probe of `pool` for this worker (CAS on the pool's probe key), unless
    /// traffic already keeps its readings fresh.
    pub fn claim_probe(&self, pool: &str, interval: u64, now: u64) -> bool {
        if now.saturating_sub(self.read(pool).0.newest_ms()) < interval.min(TRAFFIC_FRESH_MS) {
            return false;
        }
        let key = probe_key(pool);
        let (last, cas) = match self.data.get(&key) {
            Some((bytes, cas)) => (bytes.and_then(|b| String::from_utf8(b).ok()).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0), cas),
            None => return false,
        };
        // 90 %: the workers' timers drift; a probe slightly early beats one skipped.
        if now.saturating_sub(last) < interval * 9 / 10 {
            return false;
        }
        self.data.set(&key, now.to_string().as_bytes(), cas)
    }
}

impl<D: SharedData> PoolStates for SharedTable<D> {
    const ERRORS: &'static [StateError] = &[
        StateError::BadHeader,
        StateError::UnknownPool,
        StateError::ProbeFailed,
        StateError::ProbeStatus,
        StateError::NoCluster,
        StateError::SharedData,
    ];

    fn for_config(_d: Option<&DegradedRouting>, metrics: &Metrics) -> Self {
        SharedTable { shared_data_error: metrics.state_errors[StateError::SharedData as usize], ..SharedTable::default() }
    }

    fn is_degraded(&self, cfg: &DegradedRouting, pool: &str, now: u64) -> bool {
        let p = match cfg.pools.get(pool) {
            Some(p) => p,
            None => return false,
        };
        if let Some((at, d)) = self.view.borrow().get(pool) {
            // Only a normal view is reused: a degraded one is read again on every request, so a
            // recovery reaches every worker at once, not up to VIEW_MS later on another worker.
            if !*d && now.saturating_sub(*at) < VIEW_MS {
                return false;
            }
        }
        let degraded = self.read(pool).0.degraded(&p.rule, now);
        self.view.borrow_mut().insert(pool.to_string(), (now, degraded));
        degraded
    }

    /// Reading a header copies it into the VM: one response per kept pool every SAMPLE_MS.
    fn reads_response(&self, cfg: &DegradedRouting, pool: &str, now: u64) -> bool {
        cfg.pools.contains_key(pool) && self.sampled.borrow_mut().due(pool, now, SAMPLE_MS)
    }

    fn report(&self, cfg: &DegradedRouting, value: &str, now: u64) -> Result<(), StateError> {
        if self.written.borrow().fresh(value, now, REWRITE_MS) {
            return Ok(());
        }
        let r = parse_report(value)?;
        let p = cfg.pools.get(r.pool).ok_or(StateError::UnknownPool)?;
        for _ in 0..CAS_TRIES {
            let (mut rec, cas) = self.read(r.pool);
            rec.observe(&p.rule, r.replica, r.level, now);
            if self.data.set(&state_key(r.pool), &rec.encode(), cas) {
                self.written.borrow_mut().wrote(value, &r, now);
                self.view.borrow_mut().insert(r.pool.to_string(), (now, rec.degraded(&p.rule, now)));
                return Ok(());
            }
        }
        Err(StateError::SharedData)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FilterConfig;
    use std::cell::Cell;

    /// A fake of proxy-wasm shared data: a map with a CAS token per key, and what was counted.
    #[derive(Default)]
    struct FakeSharedData {
        map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        /// Every write loses its CAS race (another worker keeps winning).
        contended: Cell<bool>,
        counted: RefCell<Vec<usize>>,
    }

    impl SharedData for FakeSharedData {
        fn get(&self, key: &str) -> Option<(Option<Vec<u8>>, Option<u32>)> {
            Some(match self.map.borrow().get(key) {
                Some((v, cas)) => (Some(v.clone()), Some(*cas)),
                None => (None, None),
            })
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            let mut map = self.map.borrow_mut();
            let now = map.get(key).map(|(_, c)| *c);
            if self.contended.get() || (cas.is_some() && cas != now) {
                return false;
            }
            map.insert(key.to_string(), (value.to_vec(), now.unwrap_or(0) + 1));
            true
        }
        fn count(&self, id: CounterId) {
            if let Some(id) = id {
                self.counted.borrow_mut().push(id);
            }
        }
    }

    const CONFIG: &str = r#"{"version": 1, "default_class": "batch",
      "classes": {"interactive": {"pool": "interactive"}, "batch": {"pool": "batch"}},
      "degraded_routing": {"pools": {"interactive": {"at_level": 3, "shed_classes": ["batch"], "probe_cluster": "pool_interactive"}},
        "probe_interval_ms": 500, "probe_timeout_ms": 400, "stale_after_ms": 5000, "recover_hold_ms": 1000, "retry_after_s": 7}}"#;

    fn table() -> (SharedTable<FakeSharedData>, DegradedRouting, usize) {
        let filter = FilterConfig::parse(CONFIG.as_bytes()).expect("test config");
        let mut n = 0;
        let metrics = Metrics::for_config(&filter, SharedTable::<FakeSharedData>::ERRORS, &mut |_| {
            n += 1;
            Some(n - 1)
        });
        let id = metrics.state_errors[StateError::SharedData as usize].expect("defined");
        let t = SharedTable::for_config(filter.degraded.as_ref(), &metrics);
        (t, filter.degraded.expect("degraded routing"), id)
    }

    #[test]
    fn a_reading_is_written_to_shared_data_and_read_back() {
        let (t, d, _) = table();
        assert!(!t.is_degraded(&d, "interactive", 1000));
        assert_eq!(t.report(&d, "interactive;3;r1", 1000), Ok(()));
        assert!(t.is_degraded(&d, "interactive", 1001));
        // Another worker's table reads the same record.
        let other = SharedTable { data: FakeSharedData { map: RefCell::new(t.data.map.borrow().clone()), ..Default::default() }, ..Default::default() };
        assert!(other.is_degraded(&d, "interactive", 1001));
        assert!(!t.is_degraded(&d, "batch", 1001), "a pool that sheds nothing is never degraded");
    }

    #[test]
    fn readings_it_cannot_use_are_errors_and_a_lost_cas_race_is_counted() {
        let (t, d, shared_data) = table();
        assert_eq!(t.report(&d, "garbage", 1000), Err(StateError::BadHeader));
        assert_eq!(t.report(&d, "batch;3;r1", 1000), Err(StateError::UnknownPool));
        t.data.contended.set(true);
        assert_eq!(t.report(&d, "interactive;3;r1", 1000), Err(StateError::SharedData));
        t.data.contended.set(false);
        t.data.map.borrow_mut().insert(state_key("interactive"), (b"not a record".to_vec(), 7));
        assert!(!t.is_degraded(&d, "interactive", 1000));
        assert_eq!(*t.data.counted.borrow(), [shared_data], "an undecodable record is counted where it is read");
    }

    #[test]
    fn an_unchanged_reading_is_rewritten_only_after_rewrite_ms() {
        let (t, d, _) = table();
        t.report(&d, "interactive;1;r1", 1000).expect("written");
        let cas = |t: &SharedTable<FakeSharedData>| t.data.map.borrow().get(&state_key("interactive")).map(|(_, c)| *c);
        let first = cas(&t);
        t.report(&d, "interactive;1;r1", 1000 + REWRITE_MS - 1).expect("skipped");
        assert_eq!(cas(&t), first);
        t.report(&d, "interactive;1;r1", 1000 + REWRITE_MS).expect("rewritten");
        assert_ne!(cas(&t), first);
    }

    #[test]
    fn one_response_per_kept_pool_is_read_every_sample_ms() {
        let (t, d, _) = table();
        assert!(t.reads_response(&d, "interactive", 1000));
        assert!(!t.reads_response(&d, "interactive", 1000 + SAMPLE_MS - 1));
        assert!(t.reads_response(&d, "interactive", 1000 + SAMPLE_MS));
        assert!(!t.reads_response(&d, "batch", 1000), "the table keeps no state for it");
    }

    #[test]
    fn one_worker_claims_each_probe_and_traffic_makes_it_unneeded() {
        let (t, d, _) = table();
        assert!(t.claim_probe("interactive", d.probe_interval_ms, 10_000));
        let other = SharedTable { data: FakeSharedData { map: RefCell::new(t.data.map.borrow().clone()), ..Default::default() }, ..Default::default() };
        assert!(!other.claim_probe("interactive", d.probe_interval_ms, 10_100), "claimed this interval");
        assert!(other.claim_probe("interactive", d.probe_interval_ms, 10_000 + d.probe_interval_ms * 9 / 10));
        t.report(&d, "interactive;0;r1", 20_000).expect("written");
        assert!(!t.claim_probe("interactive", d.probe_interval_ms, 20_000 + TRAFFIC_FRESH_MS - 1), "fresh from traffic");
    }
}
