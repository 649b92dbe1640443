"""The breaker state machine, driven by a fake clock: no sleeps anywhere."""

import pytest
from pydantic import ValidationError

from infermesh.sidecar.breakers import Breaker, BreakerConfig, PoolPolicy, State


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


CFG = BreakerConfig(
    signal="gpu_memory", trip_above=0.92, recover_below=0.80, sustain_s=5, recover_sustain_s=10,
    min_samples=3, actions=["shed", "degrade", "critical_only"], escalate_after_s=10, half_open_trials=2, half_open_timeout_s=30,
)


def make(cfg=CFG):
    clock = FakeClock()
    log = []
    return Breaker("gpu", cfg, clock, log.append), clock, log


def feed(b, clock, value, seconds, every=0.25):
    """Readings of `value` every `every` s for `seconds` s (the sidecar samples at 4 Hz)."""
    n = int(round(seconds / every))
    for _ in range(n):
        clock.advance(every)
        b.observe(value)


def test_stays_closed_below_the_threshold():
    b, clock, log = make()
    feed(b, clock, 0.90, 60)
    assert b.state is State.CLOSED and not log


def test_trips_only_after_the_sustain_window():
    b, clock, log = make()
    feed(b, clock, 0.95, 4.75)
    assert b.state is State.CLOSED
    feed(b, clock, 0.95, 0.5)
    assert b.state is State.OPEN and b.actions == ("shed",)
    assert log[-1].to_state is State.OPEN and "above 0.92" in log[-1].reason


def test_min_samples_guards_sparse_readings():
    b, clock, _ = make()
    b.observe(0.99)
    clock.advance(6)
    b.observe(0.99)  # 6 s above, but only two readings
    assert b.state is State.CLOSED
    clock.advance(1)
    b.observe(0.99)
    assert b.state is State.OPEN


def test_a_dip_restarts_the_sustain_window():
    b, clock, _ = make()
    for _ in range(10):
        feed(b, clock, 0.99, 4)
        feed(b, clock, 0.50, 0.25)
    assert b.state is State.CLOSED


def test_escalates_while_pressure_lasts_and_recovers_one_step_at_a_time():
    b, clock, log = make()
    feed(b, clock, 0.99, 5.25)
    assert b.actions == ("shed",)
    feed(b, clock, 0.99, 10)
    assert b.actions == ("shed", "degrade")
    feed(b, clock, 0.99, 10)
    assert b.actions == ("shed", "degrade", "critical_only")
    feed(b, clock, 0.99, 60)
    assert b.actions == ("shed", "degrade", "critical_only"), "no level past the last action"
    # Hysteresis: between the thresholds nothing recovers.
    feed(b, clock, 0.85, 120)
    assert b.state is State.OPEN and len(b.actions) == 3
    feed(b, clock, 0.5, 10.25)  # the first reading below starts the hold
    assert b.actions == ("shed", "degrade")
    feed(b, clock, 0.5, 10)
    assert b.actions == ("shed",)
    feed(b, clock, 0.5, 10)
    assert b.state is State.HALF_OPEN and b.actions == ()
    states = [(t.to_state.value, t.actions) for t in log]
    assert states == [
        ("open", ("shed",)), ("open", ("shed", "degrade")), ("open", ("shed", "degrade", "critical_only")),
        ("open", ("shed", "degrade")), ("open", ("shed",)), ("half_open", ()),
    ]


def test_half_open_closes_after_trials():
    b, clock, _ = make()
    feed(b, clock, 0.99, 5.25)
    feed(b, clock, 0.5, 10.25)
    assert b.state is State.HALF_OPEN
    b.trial_admitted()
    assert b.state is State.HALF_OPEN
    b.trial_admitted()
    assert b.state is State.CLOSED


def test_half_open_closes_after_its_timeout_without_traffic():
    b, clock, _ = make()
    feed(b, clock, 0.99, 5.25)
    feed(b, clock, 0.5, 10.25)
    feed(b, clock, 0.85, 29.5)  # between the thresholds: not pressure
    assert b.state is State.HALF_OPEN
    feed(b, clock, 0.85, 0.5)
    assert b.state is State.CLOSED


def test_half_open_reopens_on_pressure_without_waiting_for_the_sustain_window():
    b, clock, _ = make()
    feed(b, clock, 0.99, 5.25)
    feed(b, clock, 0.5, 10.25)
    assert b.state is State.HALF_OPEN
    for _ in range(CFG.min_samples - 1):
        clock.advance(0.25)
        b.observe(0.97)
        assert b.state is State.HALF_OPEN
    clock.advance(0.25)
    b.observe(0.97)  # min_samples (3) in a row: 0.75 s, not the 5 s sustain window
    assert b.state is State.OPEN and b.actions == ("shed",)


def test_one_spike_in_half_open_does_not_reopen():
    """A noisy signal (CPU load on a machine the serving itself keeps busy) spikes over the
    threshold for a reading or two; re-opening on each spike made the pool flap."""
    b, clock, log = make()
    feed(b, clock, 0.99, 5.25)
    feed(b, clock, 0.5, 10.25)
    assert b.state is State.HALF_OPEN
    for _ in range(31):  # past the 30 s half-open timeout
        feed(b, clock, 0.97, 0.5)  # two readings above
        feed(b, clock, 0.6, 0.5)
    assert b.state is State.CLOSED, "spikes shorter than min_samples readings are not pressure"
    assert [t.to_state for t in log][-2:] == [State.HALF_OPEN, State.CLOSED]


def test_oscillating_signal_does_not_flap():
    b, clock, log = make()
    # Around the trip threshold with a period shorter than the sustain window: never trips.
    for _ in range(50):
        feed(b, clock, 0.95, 2)
        feed(b, clock, 0.91, 2)
    assert not log
    # Open, then oscillating around the recovery threshold: never recovers, never re-trips.
    feed(b, clock, 0.95, 5.25)
    n = len(log)
    for _ in range(50):
        feed(b, clock, 0.78, 4)
        feed(b, clock, 0.82, 4)
    assert b.state is State.OPEN and len(log) == n, "neither recovery nor escalation"


def test_silence_never_trips_but_lets_an_open_breaker_recover():
    b, clock, _ = make()
    feed(b, clock, 0.99, 4)
    for _ in range(40):
        clock.advance(0.25)
        b.observe(None)
    assert b.state is State.CLOSED, "no readings are no evidence of pressure"
    feed(b, clock, 0.99, 5.25)
    assert b.state is State.OPEN
    for _ in range(int(45 / 0.25)):  # 10 s hold below, then the 30 s half-open timeout
        clock.advance(0.25)
        b.observe(None)
    assert b.state is State.CLOSED, "a source gone quiet must not hold the pool degraded forever"


def test_pool_policy_is_the_union_of_open_breakers():
    gpu, clock, _ = make()
    cpu = Breaker("cpu", BreakerConfig(signal="cpu_load", trip_above=0.95, recover_below=0.8, sustain_s=1, min_samples=1, actions=["shed"]), clock)
    pool = PoolPolicy([gpu, cpu])
    assert pool.level == 0
    feed(cpu, clock, 1.0, 1.25)
    assert pool.actions == {"shed"} and pool.level == 1
    feed(gpu, clock, 0.99, 15.25)
    assert pool.actions == {"shed", "degrade"} and pool.level == 2
    assert pool.reasons() == ["gpu:gpu_memory", "cpu:cpu_load"]


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"recover_below": 0.95}, "must not be above trip_above"),
        ({"actions": ["degrade", "shed"]}, "must escalate"),
        ({"actions": ["shed", "shed"]}, "must not repeat"),
        ({"actions": []}, "at least 1"),
        ({"signal": "temperature"}, "signal"),
        ({"sustain_s": -1}, "greater than or equal"),
    ],
)
def test_bad_configs_are_refused(kw, msg):
    base = dict(signal="gpu_memory", trip_above=0.92, recover_below=0.8)
    with pytest.raises(ValidationError, match=msg):
        BreakerConfig(**(base | kw))


def test_cpu_load_is_averaged_over_its_window_with_a_fake_proc_stat():
    """Fake /proc/stat: one core busy 100 % for 0.25 s, then idle; readings every 0.25 s average
    the last second instead of jumping between 0 and 1."""
    from collections import namedtuple

    from infermesh.sidecar.monitors import CpuLoad

    T = namedtuple("T", "user nice system idle iowait irq softirq steal guest guest_nice")
    clock = [0.0]
    counters = {"busy": 0.0, "idle": 0.0}

    def times():
        return [T(counters["busy"], 0, 0, counters["idle"], 0, 0, 0, 0, 0, 0)]

    cpu = CpuLoad(window_s=1.0, times=times, clock=lambda: clock[0])
    cpu.cpus = [0]

    def step(busy_share: float) -> float:
        clock[0] += 0.25
        counters["busy"] += 0.25 * busy_share
        counters["idle"] += 0.25 * (1 - busy_share)
        return cpu.read()

    readings = [step(1.0)] + [step(0.0) for _ in range(5)]
    assert readings[0] == 1.0
    assert readings[1:4] == [0.5, 1 / 3, 0.25]  # the busy quarter stays in the one-second window
    assert readings[4] == 0.0 and readings[5] == 0.0  # and leaves it
    # Half busy all along reads 0.5 every time.
    assert [round(step(0.5), 6) for _ in range(8)][-4:] == [0.5] * 4


# The interactive pool's primary KV-cache use during the bench's overload (12 chats/s of 120-word
# prompts, 32 MiB cache = 41 blocks, 8-10 running and 15-70 waiting), sampled at 10 Hz, 2.0-7.8 s.
CHURNING_FULL_CACHE = [
    0.98, 0.98, 0.98, 0.93, 0.93, 0.93, 0.93, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.85, 0.73, 0.73, 0.46, 0.46, 0.46,
    0.46, 0.46, 0.76, 0.76, 0.93, 0.93, 0.95, 0.95, 0.95, 0.95, 0.95, 0.98, 0.98, 0.85, 0.83, 0.83, 0.93, 0.93, 0.93,
    0.8, 0.8, 0.51, 0.51, 0.51, 0.51, 0.51, 0.51, 0.8, 0.8, 0.98, 0.98, 0.98, 1.0, 0.9, 0.9, 0.9,
]


def _replay_kv(trace, repeats, read_every=0.25):
    """Engine steps every 0.1 s from `trace` (repeated); a breaker with the local policy's
    kv-cache settings observes the KvCache source every `read_every`; returns (breaker, readings)."""
    from infermesh.sidecar.monitors import EngineStats, KvCache

    clock = FakeClock()
    stats = EngineStats()
    src = KvCache(lambda: stats, clock=clock)
    cfg = BreakerConfig(signal="kv_cache", trip_above=0.90, recover_below=0.50, sustain_s=2, recover_sustain_s=5,
                        actions=["shed", "degrade"], escalate_after_s=0, half_open_timeout_s=5)
    b = Breaker("kv-cache", cfg, clock)
    readings, next_read = [], clock() + read_every
    for u in trace * repeats:
        clock.advance(0.1)
        stats.record(u, running=8, waiting=40, now=clock())
        if clock() >= next_read - 1e-9:
            next_read += read_every
            readings.append(src.read())
            b.observe(readings[-1])
    return b, readings, stats, src, clock


def test_kv_cache_reads_the_peak_of_recent_steps_so_a_churning_full_cache_opens_the_breaker():
    # The premise: the last step alone (the old reading) never stays above 0.90 for 2 s.
    run = longest = 0
    for u in CHURNING_FULL_CACHE * 2:
        run = run + 1 if u > 0.90 else 0
        longest = max(longest, run)
    assert longest * 0.1 < 2.0
    b, readings, stats, src, clock = _replay_kv(CHURNING_FULL_CACHE, 2)
    assert b.state is State.OPEN and b.actions == ("shed", "degrade")
    assert max(readings) == 1.0 and min(readings) >= 0.51
    # Load gone: the engine's last steps are empty, and the reading follows within the window.
    for _ in range(12):
        clock.advance(0.1)
        stats.record(0.0, running=0, waiting=0, now=clock())
    assert src.read() == 0.0
    assert len(stats.kv_steps) <= 51  # the engine keeps 5 s of steps, not all of them
    # An idle engine stops reporting: its stale last reading counts as an empty cache.
    clock.advance(3.0)
    stats.kv_cache_usage = 0.7
    assert src.read() == 0.0
