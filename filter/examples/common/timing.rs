//! Timing shared by the examples' benches (included with `#[path]`: a folder under examples/ is
//! not an example of its own).

use std::time::Instant;

/// Microseconds per call of `f`, over at least `ms` milliseconds (the count doubled until then).
pub fn per_call<F: FnMut()>(ms: u128, mut f: F) -> f64 {
    let mut iters = 1u64;
    loop {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        let el = t.elapsed();
        if el.as_millis() >= ms {
            return el.as_secs_f64() * 1e6 / iters as f64;
        }
        iters *= 2;
    }
}

/// The best of `rounds` rounds of `per_call(ms, f)`.
#[allow(dead_code)] // not every bench takes the best of rounds
pub fn best_of<F: FnMut()>(rounds: usize, ms: u128, mut f: F) -> f64 {
    (0..rounds).map(|_| per_call(ms, &mut f)).fold(f64::MAX, f64::min)
}
