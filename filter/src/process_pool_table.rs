//! The native module's pool state table: one process-wide structure, a mutex per pool (every
//! worker reads it per request and writes it per response, and sees a change at once). Pure
//! (no host calls, the clock is an argument), so it is compiled and tested on any target.

use crate::config::DegradedRouting;
use crate::pool_state::{parse_report, PoolRecord};
use crate::request_flow::{Metrics, PoolStates, StateError};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// The process-wide pool state table: one record per configured pool, each behind its own
/// mutex (every worker reads it per request and writes it per response; a lock held for the
/// few comparisons of `degraded` or `observe`).
#[derive(Default, Debug)]
pub struct PoolTable {
    pools: BTreeMap<String, Mutex<PoolRecord>>,
}

impl PoolTable {
    /// The newest reading of `pool` (0: none).
    pub fn newest_ms(&self, pool: &str) -> u64 {
        self.pools.get(pool).and_then(|r| r.lock().ok().map(|r| r.newest_ms())).unwrap_or(0)
    }
}

impl PoolStates for PoolTable {
    const ERRORS: &'static [StateError] =
        &[StateError::BadHeader, StateError::UnknownPool, StateError::ProbeFailed, StateError::ProbeStatus, StateError::NoCluster];

    fn for_config(d: Option<&DegradedRouting>, _metrics: &Metrics) -> PoolTable {
        let pools = d.map(|d| d.pools.keys().map(|p| (p.clone(), Mutex::new(PoolRecord::default()))).collect());
        PoolTable { pools: pools.unwrap_or_default() }
    }

    fn is_degraded(&self, d: &DegradedRouting, pool: &str, now: u64) -> bool {
        match (self.pools.get(pool), d.pools.get(pool)) {
            (Some(rec), Some(p)) => rec.lock().map_or(false, |r| r.degraded(&p.rule, now)),
            _ => false,
        }
    }

    fn report(&self, d: &DegradedRouting, value: &str, now: u64) -> Result<(), StateError> {
        let r = parse_report(value)?;
        match (self.pools.get(r.pool), d.pools.get(r.pool)) {
            (Some(rec), Some(p)) => {
                if let Ok(mut rec) = rec.lock() {
                    rec.observe(&p.rule, r.replica, r.level, now);
                }
                Ok(())
            }
            _ => Err(StateError::UnknownPool),
        }
    }
}

/// The pools whose state is probed now: those with a probe cluster and no fresh reading (traffic
/// keeps a busy pool's readings fresh, so only idle pools cost a callout).
pub fn pools_to_probe<'a>(d: &'a DegradedRouting, table: &PoolTable, now: u64) -> Vec<(&'a str, &'a str)> {
    d.pools
        .iter()
        .filter_map(|(pool, p)| p.probe_cluster.as_deref().map(|c| (pool.as_str(), c)))
        .filter(|(pool, _)| now.saturating_sub(table.newest_ms(pool)) >= d.probe_interval_ms)
        .collect()
}
