//! The pool state table: what each pool's replicas last reported about their degradation level,
//! and the rule that turns those readings into "this pool is degraded" for `when_degraded`.
//!
//! Pure (no host calls, the clock is an argument): the glue keeps one [`PoolRecord`] per pool in
//! proxy-wasm shared data (every Envoy worker reads and writes the same record, with CAS) and
//! feeds it readings from the `x-infermesh-pool-level` response header and from the probe of the
//! sidecars' state endpoint.
//!
//! The rule, per pool, over its *fresh* readings (one per replica, at most `stale_after_ms` old):
//! - a replica is *high* when its last reading is at or above the pool's `at_level`, or when it
//!   reported such a level less than `recover_hold_ms` ago (hysteresis: a replica that drops
//!   below must stay below for the hold before it counts as recovered, so readings that
//!   alternate around the level do not flap the routing);
//! - the pool is degraded when a strict majority of its fresh replicas are high (one of one, two
//!   of three, two of two);
//! - no fresh reading at all: not degraded (fail open to normal routing).

/// The response header a sidecar sets: `POOL;LEVEL;REPLICA`.
pub const HEADER_POOL_LEVEL: &str = "x-infermesh-pool-level";
/// The level a sidecar reports while it is not serving (loading, draining): past every level.
pub const LEVEL_DOWN: u8 = 4;
/// Replicas kept per pool; past this the stalest reading is dropped (bounds the shared record).
pub const MAX_REPLICAS: usize = 64;

/// Why a reading was not used; each is counted (`infermesh_pool_state_errors_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadingError {
    /// The header is not `POOL;LEVEL;REPLICA` with a known-good token in each part.
    BadHeader,
    /// It names a pool this config keeps no state for (a pool that went away, or never was).
    UnknownPool,
}

/// One parsed `x-infermesh-pool-level` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report<'a> {
    pub pool: &'a str,
    pub level: u8,
    pub replica: &'a str,
}

fn token(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Parse a header value; anything but exactly `POOL;LEVEL;REPLICA` (level 0-4) is refused.
pub fn parse_report(value: &str) -> Result<Report<'_>, ReadingError> {
    let mut parts = value.trim().split(';');
    let (pool, level, replica) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(p), Some(l), Some(r), None) => (p, l, r),
        _ => return Err(ReadingError::BadHeader),
    };
    let level = match level.as_bytes() {
        [d @ b'0'..=b'4'] => d - b'0',
        _ => return Err(ReadingError::BadHeader),
    };
    if !token(pool) || !token(replica) {
        return Err(ReadingError::BadHeader);
    }
    Ok(Report { pool, level, replica })
}

/// How one pool's readings are judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolRule {
    /// A replica at or above this level counts as degraded (`when_degraded.at_level`; 4 for a
    /// pool without `when_degraded`: only a replica that is not serving).
    pub at_level: u8,
    pub stale_after_ms: u64,
    pub recover_hold_ms: u64,
}

/// One replica's last reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    pub replica: String,
    pub level: u8,
    /// When it was read (ms since the epoch, Envoy's clock).
    pub at_ms: u64,
    /// The last time this replica reported a level at or above the pool's `at_level` (0: never).
    pub high_ms: u64,
}

/// A pool's readings, one per replica: the value kept in shared data.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolRecord {
    pub readings: Vec<Reading>,
}

impl PoolRecord {
    /// Record `level` from `replica` at `now`.
    pub fn observe(&mut self, rule: &PoolRule, replica: &str, level: u8, now: u64) {
        let high = level >= rule.at_level;
        if let Some(r) = self.readings.iter_mut().find(|r| r.replica == replica) {
            // An older reading arriving late (another worker's, a slow probe) never wins.
            if now < r.at_ms {
                return;
            }
            r.level = level;
            r.at_ms = now;
            if high {
                r.high_ms = now;
            }
            return;
        }
        if self.readings.len() >= MAX_REPLICAS {
            if let Some(i) = (0..self.readings.len()).min_by_key(|&i| self.readings[i].at_ms) {
                self.readings.swap_remove(i);
            }
        }
        self.readings.push(Reading { replica: replica.to_string(), level, at_ms: now, high_ms: if high { now } else { 0 } });
    }

    /// Whether the pool counts as degraded at `now` (the rule in the module doc).
    pub fn degraded(&self, rule: &PoolRule, now: u64) -> bool {
        let (mut fresh, mut high) = (0usize, 0usize);
        for r in &self.readings {
            if now.saturating_sub(r.at_ms) > rule.stale_after_ms {
                continue;
            }
            fresh += 1;
            let recent_high = r.high_ms > 0 && now.saturating_sub(r.high_ms) < rule.recover_hold_ms;
            if r.level >= rule.at_level || recent_high {
                high += 1;
            }
        }
        fresh > 0 && 2 * high > fresh
    }

    /// The newest reading's time (0: none): the probe skips a pool that traffic keeps fresh.
    pub fn newest_ms(&self) -> u64 {
        self.readings.iter().map(|r| r.at_ms).max().unwrap_or(0)
    }

    /// The shared-data form: one `REPLICA LEVEL AT_MS HIGH_MS` line per replica.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = String::with_capacity(self.readings.len() * 40);
        for r in &self.readings {
            out.push_str(&format!("{} {} {} {}\n", r.replica, r.level, r.at_ms, r.high_ms));
        }
        out.into_bytes()
    }

    /// The inverse of [`encode`](Self::encode); `None` for bytes it did not write.
    pub fn decode(bytes: &[u8]) -> Option<PoolRecord> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut readings = Vec::new();
        for line in text.lines() {
            let mut f = line.split(' ');
            let replica = f.next().filter(|r| token(r))?;
            let level: u8 = f.next()?.parse().ok().filter(|l| *l <= LEVEL_DOWN)?;
            let at_ms: u64 = f.next()?.parse().ok()?;
            let high_ms: u64 = f.next()?.parse().ok()?;
            if f.next().is_some() || readings.len() >= MAX_REPLICAS {
                return None;
            }
            readings.push(Reading { replica: replica.to_string(), level, at_ms, high_ms });
        }
        Some(PoolRecord { readings })
    }
}

/// Values a worker remembers writing; past this it forgets them all (bounds the map).
const MAX_RECENT: usize = 1024;

/// A worker's memory of the readings it wrote to shared data lately, keyed by the raw header value
/// (`POOL;LEVEL;REPLICA`): a response that repeats a reading written less than `rewrite_ms` ago is
/// dropped with one map lookup, before it is parsed (nearly every response, under traffic). At
/// most one value per (pool, replica) is kept, so a level that changes and changes back is
/// written again.
#[derive(Debug, Default)]
pub struct RecentWrites {
    at: std::collections::HashMap<String, u64>,
}

impl RecentWrites {
    /// Whether `value` was written less than `rewrite_ms` before `now` (or by a clock ahead of it).
    pub fn fresh(&self, value: &str, now: u64, rewrite_ms: u64) -> bool {
        self.at.get(value).map_or(false, |at| now.saturating_sub(*at) < rewrite_ms)
    }

    /// `value` (which parsed as `report`) was written at `now`.
    pub fn wrote(&mut self, value: &str, report: &Report<'_>, now: u64) {
        if self.at.len() >= MAX_RECENT {
            self.at.clear();
        }
        self.at.retain(|v, _| parse_report(v).map_or(true, |r| r.pool != report.pool || r.replica != report.replica));
        self.at.insert(value.to_string(), now);
    }
}

/// Which responses a worker reads the level header of: at most one per pool every `every_ms`
/// (claimed when the request is routed). Reading a header copies it into the VM, which costs as
/// much as the rest of the state table; under traffic a pool's level is still read within
/// `every_ms` of a change and, at 100 reads a second per worker, a pool of 64 replicas keeps
/// every replica's reading well inside the staleness bound. Unread responses only lose the header.
#[derive(Debug, Default)]
pub struct ResponseSampler {
    last: std::collections::HashMap<String, u64>,
}

impl ResponseSampler {
    /// Whether the response to a request routed to `pool` at `now` is read; if so, it claims the slot.
    pub fn due(&mut self, pool: &str, now: u64, every_ms: u64) -> bool {
        match self.last.get_mut(pool) {
            // A clock that went back is due at once rather than stuck until it catches up.
            Some(at) if now >= *at && now - *at < every_ms => false,
            Some(at) => {
                *at = now;
                true
            }
            None => {
                self.last.insert(pool.to_string(), now);
                true
            }
        }
    }
}

/// What `when_degraded` does to one request, given which pools are degraded. Spilling a
/// degraded pool's traffic elsewhere is not the filter's: Envoy's health check of the sidecars'
/// state endpoint fails from `at_level` on and the pool's cluster fails over to its priority-1
/// endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Normal,
    /// Answer it at the edge with 429 + Retry-After.
    Shed,
}

impl crate::config::DegradedRouting {
    /// `when_degraded` for a request of `class`: shed when a degraded pool lists the class in its
    /// `shed_classes` (and the request generates), else route it normally. As the control
    /// plane's overlay did (`Policy.degraded_overlay`), now per request.
    pub fn verdict(&self, class: &str, generates: bool, degraded: &mut dyn FnMut(&str) -> bool) -> Verdict {
        if generates {
            for (name, p) in &self.pools {
                if p.shed_classes.iter().any(|c| c == class) && degraded(name) {
                    return Verdict::Shed;
                }
            }
        }
        Verdict::Normal
    }
}

/// Whether a request makes a pool generate: only those are ever shed. Reads (`GET /v1/models`,
/// health) and tokenizing cost no generation and keep working while a class is shed.
pub fn costs_generation(method: &str, path: &str) -> bool {
    let path = path.split('?').next().unwrap_or("");
    let writes = !(method.eq_ignore_ascii_case("GET") || method.eq_ignore_ascii_case("HEAD") || method.eq_ignore_ascii_case("OPTIONS"));
    writes && !(path.ends_with("/tokenize") || path.ends_with("/detokenize") || path == "/health")
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: PoolRule = PoolRule { at_level: 3, stale_after_ms: 5000, recover_hold_ms: 1000 };

    #[test]
    fn parses_the_sidecars_header_and_refuses_garbage() {
        assert_eq!(parse_report("interactive;3;pod-a.1"), Ok(Report { pool: "interactive", level: 3, replica: "pod-a.1" }));
        assert_eq!(parse_report(" batch;0;0 ").map(|r| r.level), Ok(0));
        for bad in ["", "batch", "batch;3", "batch;3;0;x", "batch;5;0", "batch;-1;0", "batch;03;0", "batch;x;0", "ba tch;1;0",
                    "batch;1;", ";1;0", "batch;1;r/1", "batch;١;0", &"p".repeat(65).replace('p', "p;1;0p")] {
            assert_eq!(parse_report(bad), Err(ReadingError::BadHeader), "{bad:?}");
        }
    }

    #[test]
    fn one_replica_degrades_and_recovers_after_the_hold() {
        let mut rec = PoolRecord::default();
        assert!(!rec.degraded(&RULE, 1000), "no reading: normal");
        rec.observe(&RULE, "0", 2, 1000);
        assert!(!rec.degraded(&RULE, 1000), "below at_level");
        rec.observe(&RULE, "0", 3, 1100);
        assert!(rec.degraded(&RULE, 1100), "at at_level: degraded at once");
        rec.observe(&RULE, "0", 0, 1500);
        assert!(rec.degraded(&RULE, 1500), "recovered 400 ms after the last high reading: still held");
        assert!(rec.degraded(&RULE, 2099));
        assert!(!rec.degraded(&RULE, 2100), "the hold has passed");
    }

    #[test]
    fn alternating_readings_do_not_flap() {
        let mut rec = PoolRecord::default();
        let mut states = Vec::new();
        for i in 0..40u64 {
            let now = 10_000 + i * 100;
            rec.observe(&RULE, "0", if i % 3 == 0 { 3 } else { 1 }, now);
            states.push(rec.degraded(&RULE, now));
        }
        assert!(states.iter().all(|d| *d), "a replica that keeps touching the level stays degraded: {states:?}");
    }

    #[test]
    fn stale_readings_are_ignored_and_the_pool_fails_open() {
        let mut rec = PoolRecord::default();
        rec.observe(&RULE, "0", 3, 1000);
        assert!(rec.degraded(&RULE, 6000), "5 s old: still fresh");
        assert!(!rec.degraded(&RULE, 6001), "past the staleness bound: normal routing");
        // A clock that went backwards (another worker's reading, a later one) is not stale.
        assert!(rec.degraded(&RULE, 900));
    }

    #[test]
    fn several_replicas_need_a_strict_majority() {
        let mut rec = PoolRecord::default();
        rec.observe(&RULE, "a", 3, 1000);
        rec.observe(&RULE, "b", 0, 1000);
        assert!(!rec.degraded(&RULE, 1000), "one of two");
        rec.observe(&RULE, "c", 3, 1000);
        assert!(rec.degraded(&RULE, 1000), "two of three");
        rec.observe(&RULE, "c", 1, 2500);
        assert!(!rec.degraded(&RULE, 2500), "one of three once c's hold has passed");
        // A replica that stops reporting drops out of the count once stale.
        rec.observe(&RULE, "a", 4, 7000);
        assert!(!rec.degraded(&RULE, 7000), "b is stale; a is high, c is not: one of two");
    }

    #[test]
    fn the_majority_counts_fresh_replicas_only() {
        let mut rec = PoolRecord::default();
        rec.observe(&RULE, "a", 0, 1000);
        rec.observe(&RULE, "b", 0, 1000);
        rec.observe(&RULE, "c", 3, 7000);
        assert!(rec.degraded(&RULE, 7000), "a and b went quiet 6 s ago: c is the pool's one fresh voice");
    }

    #[test]
    fn late_readings_do_not_overwrite_newer_ones() {
        let mut rec = PoolRecord::default();
        rec.observe(&RULE, "0", 3, 2000);
        rec.observe(&RULE, "0", 0, 1500);
        assert_eq!(rec.readings[0].level, 3);
    }

    #[test]
    fn the_record_is_bounded_and_round_trips() {
        let mut rec = PoolRecord::default();
        for i in 0..(MAX_REPLICAS as u64 + 10) {
            rec.observe(&RULE, &format!("r{i}"), (i % 5) as u8, 1000 + i);
        }
        assert_eq!(rec.readings.len(), MAX_REPLICAS);
        assert!(rec.readings.iter().all(|r| r.replica != "r0"), "the stalest went first");
        assert_eq!(PoolRecord::decode(&rec.encode()), Some(rec.clone()));
        assert_eq!(PoolRecord::decode(b""), Some(PoolRecord::default()));
        for bad in [&b"r 9 1 0\n"[..], b"r 1 x 0\n", b"r 1 1\n", b"r 1 1 1 1\n", b"\xff 1 1 1\n", b"r/ 1 1 1\n"] {
            assert_eq!(PoolRecord::decode(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_repeated_reading_is_skipped_until_it_is_due_and_a_changed_one_never() {
        let mut w = RecentWrites::default();
        let (a3, a0, b3) = ("gpu;3;a", "gpu;0;a", "gpu;3;b");
        assert!(!w.fresh(a3, 1000, 250), "never written");
        w.wrote(a3, &parse_report(a3).unwrap(), 1000);
        assert!(w.fresh(a3, 1249, 250));
        assert!(!w.fresh(a3, 1250, 250), "due for a rewrite (the staleness bound)");
        assert!(w.fresh(a3, 900, 250), "a clock behind the write: still fresh");
        assert!(!w.fresh(a0, 1100, 250), "another level of the same replica is written at once");
        w.wrote(b3, &parse_report(b3).unwrap(), 1100);
        w.wrote(a0, &parse_report(a0).unwrap(), 1100);
        assert!(!w.fresh(a3, 1150, 250), "3 -> 0 -> 3 inside the window: the 3 is written again");
        assert!(w.fresh(b3, 1150, 250), "another replica's reading is kept");
        for i in 0..(MAX_RECENT + 5) {
            let v = format!("gpu;1;r{i}");
            w.wrote(&v, &parse_report(&v).unwrap(), 2000);
        }
        assert!(w.at.len() <= MAX_RECENT, "bounded: {}", w.at.len());
    }

    #[test]
    fn one_response_per_pool_and_interval_is_read() {
        let mut s = ResponseSampler::default();
        assert!(s.due("gpu", 1000, 10), "the first response of a pool");
        assert!(!s.due("gpu", 1000, 10));
        assert!(!s.due("gpu", 1009, 10));
        assert!(s.due("cheap", 1009, 10), "each pool has its own slot");
        assert!(s.due("gpu", 1010, 10), "the next interval");
        assert!(!s.due("gpu", 1015, 10));
        assert!(s.due("gpu", 500, 10), "a clock that went back");
        let reads = (0..1000u64).filter(|i| s.due("gpu", 2000 + i / 10, 10)).count();
        assert_eq!(reads, 10, "1000 responses over 100 ms: one read per 10 ms");
    }

    #[test]
    fn the_verdict_follows_when_degraded() {
        let cfg = crate::config::FilterConfig::parse(br#"{"version": 1, "default_class": "batch",
            "classes": {"interactive": {"pool": "gpu"}, "batch": {"pool": "cheap"}, "eval": {"pool": "cheap"}},
            "degraded_routing": {"pools": {
                "gpu": {"at_level": 3, "shed_classes": ["batch"], "probe_cluster": "pool_gpu_state"},
                "cheap": {"shed_classes": ["eval"]}}}}"#).unwrap();
        let d = cfg.degraded.as_ref().unwrap();
        assert_eq!(d.pools["cheap"].rule.at_level, LEVEL_DOWN, "no at_level: only a pool that is not serving");
        let none = |_: &str| false;
        assert_eq!(d.verdict("batch", true, &mut { none }), Verdict::Normal);
        let gpu = |p: &str| p == "gpu";
        assert_eq!(d.verdict("interactive", true, &mut { gpu }), Verdict::Normal, "the degraded pool's own class: Envoy's failover, not the filter's");
        assert_eq!(d.verdict("batch", true, &mut { gpu }), Verdict::Shed, "gpu sheds batch, wherever batch is bound");
        assert_eq!(d.verdict("batch", false, &mut { gpu }), Verdict::Normal, "GET /v1/models is never shed");
        assert_eq!(d.verdict("eval", true, &mut { gpu }), Verdict::Normal, "cheap sheds eval, and cheap is fine");
        let cheap = |p: &str| p == "cheap";
        assert_eq!(d.verdict("eval", true, &mut { cheap }), Verdict::Shed);
        assert_eq!(d.verdict("batch", true, &mut { cheap }), Verdict::Normal);
        let both = |_: &str| true;
        for c in ["batch", "eval"] {
            assert_eq!(d.verdict(c, true, &mut { both }), Verdict::Shed, "{c}");
        }
        assert_eq!(d.verdict("interactive", true, &mut { both }), Verdict::Normal, "no pool sheds interactive");
    }

    #[test]
    fn only_requests_that_generate_can_be_shed() {
        assert!(costs_generation("POST", "/v1/chat/completions"));
        assert!(costs_generation("post", "/v1/completions?x=1"));
        assert!(costs_generation("POST", "/infermesh.v1.Inference/Generate"));
        assert!(!costs_generation("GET", "/v1/models"));
        assert!(!costs_generation("HEAD", "/v1/models"));
        assert!(!costs_generation("POST", "/tokenize"));
        assert!(!costs_generation("POST", "/detokenize?a"));
        assert!(!costs_generation("GET", "/health"));
    }
}
