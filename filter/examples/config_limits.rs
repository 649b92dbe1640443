//! The filter's limits as one JSON line (`config::limits()`: each bounded field with its range
//! and default, the defaults `FilterConfig::parse` fills in, the name and regex limits), for the
//! policy model's contract test (mesh-config/tests/test_rule_contract.py).
//!
//!     cargo run --release --example config_limits

fn main() {
    println!("{}", infermesh_filter::config::limits());
}
