//! What every fuzz test shares: a small seeded generator, the time budget and the seed.

use std::time::Duration;

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

/// Each fuzz loop's time budget: INFERMESH_FUZZ_SECS (default 3 s).
pub fn budget() -> Duration {
    let secs = std::env::var("INFERMESH_FUZZ_SECS").ok().and_then(|s| s.parse::<f64>().ok()).unwrap_or(3.0);
    Duration::from_secs_f64(secs)
}

/// Fixed, so a failure in the suite replays; INFERMESH_FUZZ_SEED explores others.
pub fn seed() -> u64 {
    std::env::var("INFERMESH_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x1f5e_ed28_c0f1_9001)
}
