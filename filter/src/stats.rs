//! Metric labels that come from request headers, bounded to the config's names.
//!
//! A trusted peer's decision (`x-infermesh-class` / `x-infermesh-pool`) is kept as it arrived and
//! counted under its class and pool. Those values are whatever the peer sent, so a label that is
//! not one of the config's classes (or pools) is counted as `other`: the counters are the config's
//! classes and pools (and `other`) crossed, all defined when the config is accepted, and traffic
//! can never define a new stat. Both glues (Wasm and the native module) use this.

use crate::classify::TRUSTED_RULE;
use crate::config::FilterConfig;

/// The label of a class or pool the config does not name.
pub const OTHER: &str = "other";

/// The counter of a kept trusted decision: `requests_total` with the rule `trusted`.
pub fn trusted_metric_name(class: &str, pool: &str) -> String {
    format!("infermesh.requests_total.class.{class}.pool.{pool}.rule.{TRUSTED_RULE}")
}

/// Past this many (class, pool) label pairs a config defines only each class with its own pool
/// (and `other`/`other`): the cross product of a config of thousands of names would be millions.
pub const MAX_LABEL_PAIRS: usize = 1024;

/// The trusted-decision counters of one config, by (class label, pool label).
#[derive(Debug, Default)]
pub struct TrustedCounters<T> {
    /// Sorted, `other` included once (a config may itself name a class or pool `other`; the
    /// unknown ones then share its counter).
    classes: Vec<String>,
    pools: Vec<String>,
    /// The pairs with a counter, sorted; `other`/`other` is always one.
    pairs: Vec<(String, String, T)>,
}

fn with_other<'a>(names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut v: Vec<String> = names.chain(std::iter::once(OTHER)).map(str::to_string).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// `name` if it is in the sorted `names`, else `other`.
fn label<'a>(names: &'a [String], name: &'a str) -> &'a str {
    match names.binary_search_by(|n| n.as_str().cmp(name)) {
        Ok(_) => name,
        Err(_) => OTHER,
    }
}

impl<T: Copy> TrustedCounters<T> {
    /// Every counter a trusted peer's decision can touch, through `define` (none when the config
    /// trusts no source: nothing is ever kept then).
    pub fn define(config: &FilterConfig, define: &mut dyn FnMut(&str) -> T) -> TrustedCounters<T> {
        if config.trusted.is_empty() {
            return TrustedCounters { classes: Vec::new(), pools: Vec::new(), pairs: Vec::new() };
        }
        let classes = with_other(config.classes.keys().map(String::as_str));
        let pools = with_other(config.pool_names().into_iter());
        let mut names: Vec<(String, String)> = if classes.len().saturating_mul(pools.len()) <= MAX_LABEL_PAIRS {
            classes.iter().flat_map(|c| pools.iter().map(move |p| (c.clone(), p.clone()))).collect()
        } else {
            config.classes.iter().map(|(c, p)| (c.clone(), p.clone())).chain(std::iter::once((OTHER.to_string(), OTHER.to_string()))).collect()
        };
        names.sort_unstable();
        names.dedup();
        let pairs = names.into_iter().map(|(c, p)| {
            let id = define(&trusted_metric_name(&c, &p));
            (c, p, id)
        });
        TrustedCounters { classes, pools, pairs: pairs.collect() }
    }

    fn find(&self, class: &str, pool: &str) -> Option<usize> {
        self.pairs.binary_search_by(|(c, p, _)| (c.as_str(), p.as_str()).cmp(&(class, pool))).ok()
    }

    /// The labels a kept decision naming `class` and `pool` is counted under.
    pub fn labels<'a>(&'a self, class: &'a str, pool: &'a str) -> (&'a str, &'a str) {
        let (c, p) = (label(&self.classes, class), label(&self.pools, pool));
        match self.find(c, p) {
            Some(_) => (c, p),
            None => (OTHER, OTHER),
        }
    }

    /// The counter of a kept decision naming `class` and `pool` (`None`: none defined).
    pub fn get(&self, class: &str, pool: &str) -> Option<T> {
        let (c, p) = self.labels(class, pool);
        self.find(c, p).and_then(|i| self.pairs.get(i)).map(|(_, _, id)| *id)
    }

    /// How many counters were defined.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

/// The counter of a budget refusal.
pub fn budget_metric_name(class: &str, tenant: &str) -> String {
    format!("infermesh.budget_refusals_total.class.{class}.tenant.{tenant}")
}

/// Budget refusals by (class, tenant): each budgeted class with each tenant its budget lists and
/// `other` (every tenant it does not list, and a request with no tenant it may believe), defined
/// when the config is accepted; a tenant label is never taken from a request.
#[derive(Debug, Default)]
pub struct BudgetCounters<T> {
    /// Sorted by (class, tenant).
    pairs: Vec<(String, String, T)>,
}

impl<T: Copy> BudgetCounters<T> {
    pub fn define(config: &FilterConfig, define: &mut dyn FnMut(&str) -> T) -> BudgetCounters<T> {
        let mut names: Vec<(String, String)> = Vec::new();
        if let Some(b) = &config.budgets {
            for (class, c) in &b.classes {
                for t in c.tenants.keys().map(String::as_str).chain(std::iter::once(OTHER)) {
                    names.push((class.clone(), t.to_string()));
                }
            }
        }
        names.sort_unstable();
        names.dedup();
        let pairs = names.into_iter().map(|(c, t)| {
            let id = define(&budget_metric_name(&c, &t));
            (c, t, id)
        });
        BudgetCounters { pairs: pairs.collect() }
    }

    /// The counter of a refusal of `class` charged to the tenant label `tenant` (a listed name or
    /// `other`; anything else is counted as `other`).
    pub fn get(&self, class: &str, tenant: &str) -> Option<T> {
        let find = |t: &str| self.pairs.binary_search_by(|(c, n, _)| (c.as_str(), n.as_str()).cmp(&(class, t))).ok();
        find(tenant).or_else(|| find(OTHER)).and_then(|i| self.pairs.get(i)).map(|(_, _, id)| *id)
    }

    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> FilterConfig {
        FilterConfig::parse(
            format!(
                r#"{{"version": 1, "default_class": "batch",
                "classes": {{"interactive": {{"pool": "gpu"}}, "batch": {{"pool": "cheap"}}, "eval": {{"pool": "cheap"}}}}
                {extra}}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn defined(cfg: &FilterConfig) -> (TrustedCounters<usize>, Vec<String>) {
        let mut names = Vec::new();
        let t = TrustedCounters::define(cfg, &mut |n| {
            names.push(n.to_string());
            names.len() - 1
        });
        (t, names)
    }

    #[test]
    fn every_label_pair_is_defined_once_at_configure_time_and_nothing_else() {
        let cfg = config(r#", "trusted_sources": {"cidrs": ["10.0.0.0/8"]},
            "degraded_routing": {"pools": {"spare": {}}}"#);
        let (t, names) = defined(&cfg);
        // classes {batch, eval, interactive, other} x pools {cheap, gpu, other, spare}
        assert_eq!(names.len(), 16);
        assert_eq!(t.len(), 16);
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), 16, "no name defined twice: {names:?}");
        assert!(names.contains(&"infermesh.requests_total.class.interactive.pool.gpu.rule.trusted".to_string()));
        assert!(names.contains(&"infermesh.requests_total.class.other.pool.other.rule.trusted".to_string()));
        assert!(names.contains(&"infermesh.requests_total.class.eval.pool.spare.rule.trusted".to_string()));
    }

    #[test]
    fn unknown_labels_are_counted_as_other_each_on_its_own() {
        let cfg = config(r#", "trusted_sources": {"principals": ["spiffe://gw"]}"#);
        let (t, names) = defined(&cfg);
        let name = |c: &str, p: &str| names[t.get(c, p).unwrap()].clone();
        assert_eq!(name("interactive", "gpu"), trusted_metric_name("interactive", "gpu"));
        assert_eq!(name("interactive", "cheap"), trusted_metric_name("interactive", "cheap"), "a known pair the peer chose");
        assert_eq!(name("made-up", "gpu"), trusted_metric_name("other", "gpu"));
        assert_eq!(name("batch", "made-up"), trusted_metric_name("batch", "other"));
        assert_eq!(name("", ""), trusted_metric_name("other", "other"));
        assert_eq!(name("x".repeat(10_000).as_str(), "\u{0}.rule.x"), trusted_metric_name("other", "other"));
        assert_eq!(t.labels("zzz", "gpu"), ("other", "gpu"));
        // However many made-up names arrive, no counter is added (the host's define is never
        // called after configure: `defined` holds every name there is).
        let before = names.len();
        for i in 0..10_000 {
            assert!(t.get(&format!("c{i}"), &format!("p{i}")).is_some());
        }
        assert_eq!(names.len(), before);
    }

    #[test]
    fn a_class_or_pool_named_other_shares_the_bucket() {
        let cfg = FilterConfig::parse(
            br#"{"version": 1, "default_class": "other", "classes": {"other": {"pool": "other"}},
                 "trusted_sources": {"cidrs": ["::1"]}}"#,
        )
        .unwrap();
        let (t, names) = defined(&cfg);
        assert_eq!(names, [trusted_metric_name("other", "other")]);
        assert_eq!(t.get("nope", "nope"), Some(0));
    }

    #[test]
    fn a_config_of_many_names_defines_each_class_with_its_pool_only() {
        let classes: Vec<String> = (0..5000).map(|i| format!(r#""c{i}": {{"pool": "p{i}"}}"#)).collect();
        let cfg = FilterConfig::parse(
            format!(r#"{{"version": 1, "default_class": "c0", "classes": {{{}}}, "trusted_sources": {{"cidrs": ["::1"]}}}}"#, classes.join(",")).as_bytes(),
        )
        .unwrap();
        let (t, names) = defined(&cfg);
        assert_eq!(names.len(), 5001, "linear in the config, not 5001 x 5001");
        let name = |c: &str, p: &str| names[t.get(c, p).unwrap()].clone();
        assert_eq!(name("c7", "p7"), trusted_metric_name("c7", "p7"));
        assert_eq!(name("c7", "p8"), trusted_metric_name("other", "other"), "a pair the config does not define");
        assert_eq!(name("nope", "p8"), trusted_metric_name("other", "other"));
        assert_eq!(t.labels("c7", "p8"), ("other", "other"));
    }

    #[test]
    fn budget_refusals_are_the_budgeted_classes_with_their_tenants_and_other() {
        let cfg = config(r#", "budgets": {"tenant": {"header": "x-tenant"}, "classes": {
            "batch": {"default": {"concurrent_streams": 2}, "tenants": {"team-a": {"concurrent_streams": 1}, "team-b": {"concurrent_streams": 1}}},
            "interactive": {"tenants": {"team-a": {"concurrent_streams": 9}}}}}"#);
        let mut names = Vec::new();
        let t = BudgetCounters::define(&cfg, &mut |n| {
            names.push(n.to_string());
            names.len() - 1
        });
        assert_eq!(names.len(), 5, "{names:?}");
        assert_eq!(t.len(), 5);
        let name = |c: &str, tenant: &str| t.get(c, tenant).map(|i| names[i].clone());
        assert_eq!(name("batch", "team-a").as_deref(), Some("infermesh.budget_refusals_total.class.batch.tenant.team-a"));
        assert_eq!(name("batch", "made-up"), Some(budget_metric_name("batch", "other")));
        assert_eq!(name("interactive", "other"), Some(budget_metric_name("interactive", "other")));
        assert_eq!(name("eval", "team-a"), None, "eval is not budgeted");
        assert!(BudgetCounters::<usize>::define(&config(""), &mut |_| 0).is_empty());
    }

    #[test]
    fn nothing_is_defined_when_no_source_is_trusted() {
        let (t, names) = defined(&config(""));
        assert!(names.is_empty() && t.is_empty());
        assert_eq!(t.get("interactive", "gpu"), None);
    }
}
