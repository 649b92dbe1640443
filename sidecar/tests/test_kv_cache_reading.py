"""The kv_cache reading while a kv-cache breaker holds the ladder (monitors.KvCache): the KV the
pool's present load holds on every engine, in the primary's terms. Fake engine stats stand in for
vLLM's stat loggers (each engine's steps and its cache size in tokens)."""

from types import SimpleNamespace

import pytest

from infermesh.sidecar.breakers import Breaker, BreakerConfig, State
from infermesh.sidecar.monitors import EngineStats, KvCache
from infermesh.sidecar.tests.conftest import FakeClock

# The e2e mesh's interactive ladder (e2e/policy-e2e.yaml, 12 MiB each): tiny-llama-large holds
# 2,048 tokens, tiny-llama-small 24,576.
PRIMARY_TOKENS, FALLBACK_TOKENS = 2048, 24576

KV_BREAKER = {"signal": "kv_cache", "trip_above": 0.90, "recover_below": 0.50, "sustain_s": 2, "recover_sustain_s": 5,
              "actions": ["shed", "degrade"], "escalate_after_s": 0, "half_open_timeout_s": 5}


def fake_engine_stats(capacity_tokens: int | None) -> EngineStats:
    """An engine's stats as its vLLM stat logger would keep them, without vLLM."""
    return EngineStats(kv_capacity_tokens=capacity_tokens)


def fake_step(stats: EngineStats, clock: FakeClock, use: float, running: int) -> None:
    stats.record(use, running=running, waiting=0, now=clock())


def fake_replay(clock: FakeClock, src: KvCache, breaker: Breaker, primary: EngineStats, fallback: EngineStats, window=None):
    """run(seconds, p, f, chats_per_s, inject): the engines step every 0.1 s ((use, running) or
    None: silent), first tokens are recorded at `chats_per_s`, and the breaker observes the
    reading (or an injected one) every 0.2 s; returns the readings."""

    def run(seconds: float, p=None, f=None, chats_per_s: float = 0.0, inject: float | None = None) -> list:
        out, every = [], max(1, round(10 / chats_per_s)) if chats_per_s else 0
        for i in range(round(seconds * 10)):
            clock.t += 0.1
            if p is not None:
                fake_step(primary, clock, *p)
            if f is not None:
                fake_step(fallback, clock, *f)
            if every and i % every == 0:
                window.record_ttft(0.2)
            if i % 2 == 1:
                out.append(inject if inject is not None else src.read())
                breaker.observe(out[-1])
        return out

    return run


@pytest.fixture
def e2e_like_pool(make_pool, monkeypatch):
    """A pool with the e2e interactive ladder's kv-cache breaker, on fake engines whose stats the
    test pushes; returns (pool, clock, run) where run(seconds, primary, fallback, chats_per_s)
    steps the engines ((use, running) or None: silent), records first tokens and samples every 0.25 s."""
    clock = FakeClock()
    pool = make_pool({"pool": "interactive",
                      "models": [{"name": "tiny-llama-large", "path": "/x"}, {"name": "tiny-llama-small", "path": "/y"}],
                      "breakers": {"kv-cache": KV_BREAKER}}, clock)
    monkeypatch.setattr(pool.ladder, "start", lambda standby: None)  # loaded already; no GPU probe (torch import)
    pool.start()
    primary, fallback = pool.ladder[0].stats, pool.ladder[1].stats
    primary.kv_capacity_tokens, fallback.kv_capacity_tokens = PRIMARY_TOKENS, FALLBACK_TOKENS
    chat_due = [0.0]

    def run(seconds: float, primary_step=None, fallback_step=None, chats_per_s: float = 0.0) -> list[float | None]:
        readings = []
        for _ in range(round(seconds / 0.25)):
            clock.t += 0.25
            if primary_step is not None:
                fake_step(primary, clock, *primary_step)
            if fallback_step is not None:
                fake_step(fallback, clock, *fallback_step)
            if chats_per_s and clock.t >= chat_due[0]:
                chat_due[0] = clock.t + 1 / chats_per_s
                pool.window.record_ttft(0.2)
            readings.append(pool.sample()["kv_cache"])
        return readings

    return pool, clock, run


def test_a_degraded_pool_recovers_under_light_traffic_after_one_long_prompt_filled_the_primary(e2e_like_pool):
    """e2e/test_observability_e2e.py in suite order: an earlier test's long prompt, one every 2 s,
    filled the small primary past half; much later a drill's injected reading degrades the pool
    and is deleted while light chats flow. The fallback's chats hold ~500 tokens, a quarter of the
    primary's cache: the ladder steps back with its usual holds (two 5 s holds, then half-open).
    The ratio learnt from that long prompt (its KV per first token/s, 0.7 / 0.5) is another
    load's: kept, it read the light chats as a full primary and held the ladder for as long as
    they came."""
    pool, clock, run = e2e_like_pool
    kv = pool.breakers[0]
    run(4.0, primary_step=(0.7, 1), chats_per_s=0.5)  # the long prompt: 1,434 tokens
    run(0.25, primary_step=(0.0, 0))
    run(30.0)  # idle: vLLM reports nothing
    pool.faults.set("kv_cache", 0.99, 120)
    run(3.0, primary_step=(0.05, 1), chats_per_s=1.0)
    assert kv.state is State.OPEN and "degrade" in pool.policy.actions
    run(0.25, primary_step=(0.0, 0))  # the primary's last chat done
    pool.faults.clear("kv_cache")
    t_cleared = clock()
    back, held = None, []
    for _ in range(int(30 / 0.25)):
        reading = run(0.25, fallback_step=(0.02, 1), chats_per_s=1.0)[0]  # ~490 tokens on the fallback
        if back is None:
            held.append(reading)
            if "degrade" not in pool.policy.actions:
                back = clock() - t_cleared
    # The fallback's tokens in the primary's terms (and the primary's last steps for a second).
    assert max(held) < 0.5 and held[-1] == pytest.approx(0.02 * FALLBACK_TOKENS / PRIMARY_TOKENS)
    assert back is not None and back <= 5.5, back  # the first 5 s hold below 0.5 takes degrade off
    assert kv.state is State.CLOSED


def test_a_load_whose_tokens_on_the_fallback_would_fill_the_primary_holds_the_ladder():
    """The bench's overload: the primary fills and the breaker moves new chats to the small model;
    the primary drains, its own cache empties. While the load the small model serves holds as
    many tokens as the primary's cache, the reading stays full (no recovery onto a cache the same
    load refills at once); once the load has gone, the usual holds and half-open."""
    clock = FakeClock()
    primary, fallback = fake_engine_stats(5248), fake_engine_stats(131072)  # the bench's 32 MiB caches
    b = Breaker("kv-cache", BreakerConfig(**KV_BREAKER), clock)
    src = KvCache(lambda: primary, clock=clock, others=lambda: [fallback], holding=lambda: "degrade" in b.actions)
    run = fake_replay(clock, src, b, primary, fallback)

    run(4.0, p=(0.98, 10))
    assert b.state is State.OPEN and b.actions == ("shed", "degrade")
    # The primary finishes its queue while the small model takes the new chats: the two together.
    draining = run(3.0, p=(0.4, 4), f=(0.03, 12))
    assert src.held() == pytest.approx((0.4 * 5248 + 0.03 * 131072) / 5248) and draining[-1] == 1.0
    run(0.1, p=(0.0, 0))
    held = run(20.0, f=(0.045, 24))  # 5,898 tokens on the small model: more than the primary holds
    assert b.actions == ("shed", "degrade") and min(held[2:]) == 1.0
    # The load goes: the small model's steps empty, then stop; two 5 s holds and half-open.
    run(0.5, f=(0.0, 0))
    run(12.0)
    assert b.state is State.HALF_OPEN and b.level == 0


def test_a_load_the_fallback_turns_over_faster_still_holds_the_ladder_by_the_ratio_learnt_in_its_pressure():
    """The bench's overload as measured (2026-12-05, 10.2 chats/s): the small model turned the
    chats over faster, so while the load went on the ladder held a third of the primary's cache
    (0.358): on that alone the pool stepped back and the primary refilled 1.3 s later, three
    switches a window. The primary's KV per first token/s, learnt while it filled, reads the
    load the pool still serves as a full primary until the load goes."""
    from infermesh.sidecar.monitors import RequestWindow

    def overload(learnt_long_before: bool):
        clock = FakeClock()
        primary, fallback = fake_engine_stats(5248), fake_engine_stats(131072)
        window = RequestWindow(30.0, clock=clock)
        b = Breaker("kv-cache", BreakerConfig(**KV_BREAKER), clock)
        src = KvCache(lambda: primary, clock=clock, others=lambda: [fallback], rate=window.first_token_rate,
                      holding=lambda: "degrade" in b.actions)
        run = fake_replay(clock, src, b, primary, fallback, window)

        if learnt_long_before:
            run(4.0, p=(0.7, 1), chats_per_s=0.5)  # one long prompt at a low rate, long ago
            run(0.1, p=(0.0, 0))
            run(30.0)
            run(3.0, chats_per_s=3.0, inject=0.99)  # a drill's reading trips the breaker
        else:
            run(4.0, p=(0.98, 10), chats_per_s=3.0)  # full at what it gets through: 3 first tokens/s
        assert b.actions == ("shed", "degrade")
        run(0.1, p=(0.0, 0))
        held = run(20.0, f=(0.0143, 9), chats_per_s=10.0)  # 0.358 of the primary's cache
        return src, b, held, run

    src, b, held, run = overload(learnt_long_before=False)
    assert src.held() == pytest.approx(0.0143 * 131072 / 5248, rel=0.01) and src.held() < 0.5
    assert b.actions == ("shed", "degrade") and min(held[4:]) == 1.0
    # The load goes: the rate falls to 0 within its 2 s window, then two 5 s holds and half-open.
    run(2.5, f=(0.0, 0))
    assert src.projected() == 0.0
    run(11.0)
    assert b.state is State.HALF_OPEN and b.level == 0
    # A ratio learnt from another load long before the hold began does not count: the ladder's
    # tokens alone (a third of the primary) let it step back.
    src, b, held, run = overload(learnt_long_before=True)
    assert src.kv_per_rate is None and max(held[4:]) < 0.5 and "degrade" not in b.actions


def test_the_reading_counts_only_engines_that_report_and_whose_size_is_known():
    clock = FakeClock()
    primary, fallback = fake_engine_stats(PRIMARY_TOKENS), fake_engine_stats(FALLBACK_TOKENS)
    holding = [True]
    src = KvCache(lambda: primary, clock=clock, others=lambda: [fallback], holding=lambda: holding[0])
    # Never reported: nothing held anywhere (the primary's own: no reading).
    assert src.held() == 0.0 and src.read() == 0.0
    holding[0] = False
    assert src.read() is None
    holding[0] = True
    clock.t = 10.0
    fake_step(primary, clock, 0.2, 1)
    fake_step(fallback, clock, 0.05, 3)
    assert src.read() == pytest.approx((0.2 * 2048 + 0.05 * 24576) / 2048)
    # Not holding: the primary's own peak, whatever the fallback holds.
    holding[0] = False
    assert src.read() == 0.2
    holding[0] = True
    # The peak of the last second's steps, on every engine.
    clock.t = 10.5
    fake_step(primary, clock, 0.0, 0)
    fake_step(fallback, clock, 0.01, 0)
    assert src.held() == pytest.approx((0.2 * 2048 + 0.05 * 24576) / 2048)
    # Silent past stale_after_s with nothing running: an empty cache (vLLM reports only with work).
    clock.t = 13.0
    assert src.held() == 0.0 and src.read() == 0.0
    # Silent but still running (a long prefill): its last step counts.
    fallback.running = 2
    assert src.read() == pytest.approx(0.01 * 24576 / 2048)
    # A fallback holding KV whose size is unknown: the primary's own reading.
    fallback.kv_capacity_tokens = None
    assert src.held() is None and src.read() == 0.0
    # ... as long as it holds something: an empty one counts nothing.
    fake_step(fallback, clock, 0.0, 0)
    fake_step(primary, clock, 0.3, 1)
    assert src.read() == 0.3 and src.held() == pytest.approx(0.3)
    # The primary's size unknown: its own reading.
    primary.kv_capacity_tokens = None
    fallback.kv_capacity_tokens = FALLBACK_TOKENS
    fake_step(fallback, clock, 0.5, 6)
    assert src.held() is None and src.read() == 0.3


def test_the_pool_reads_the_ladders_kv_only_while_its_kv_breaker_holds_the_ladder(make_pool, monkeypatch):
    """The wiring in pool.py: the kv-cache source reads the fallbacks' stats and is told when a
    kv_cache breaker's `degrade` is on (another breaker's does not count)."""
    clock = FakeClock()
    pool = make_pool({"pool": "interactive",
                      "models": [{"name": "big", "path": "/x"}, {"name": "small", "path": "/y"}],
                      "breakers": {
                          "kv": {"signal": "kv_cache", "trip_above": 0.9, "recover_below": 0.5, "sustain_s": 1,
                                 "actions": ["shed", "degrade"], "escalate_after_s": 0},
                          "ttft": {"signal": "ttft_p95", "trip_above": 2.0, "recover_below": 1.0, "sustain_s": 1,
                                   "actions": ["degrade"]}}}, clock)
    monkeypatch.setattr(pool.ladder, "start", lambda standby: None)  # loaded already; no GPU probe (torch import)
    pool.start()
    src = pool.readings.sources["kv_cache"]
    assert [s is pool.ladder[1].stats for s in src.others()] == [True] and src.holding() is False
    assert src.rate == pool.window.first_token_rate

    def tick(seconds: float) -> None:
        for _ in range(int(seconds / 0.25)):
            clock.t += 0.25
            pool.sample()

    pool.faults.set("ttft_p95", 3.0, 1000)
    tick(1.5)
    assert "degrade" in pool.policy.actions and src.holding() is False  # the TTFT breaker's degrade
    pool.faults.set("kv_cache", 0.97, 1000)
    tick(1.5)
    assert src.holding() is True
    assert "kv_capacity_tokens" in pool.state()["engines"][0]


def test_the_stat_logger_learns_the_kv_cache_size_in_tokens_once_vllm_has_sized_it():
    """vLLM's client fills num_gpu_blocks in from the engine core's handshake; a logger made
    before that learns it at the next step."""
    from infermesh.sidecar.engines import _StatsLogger

    fake_vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=None, block_size=128))
    stats = EngineStats()
    logger = _StatsLogger(stats, fake_vllm_config)
    assert stats.kv_capacity_tokens is None
    fake_vllm_config.cache_config.num_gpu_blocks = 16
    logger.record(SimpleNamespace(kv_cache_usage=0.5, num_running_reqs=1, num_waiting_reqs=0), None)
    assert stats.kv_capacity_tokens == 2048 and stats.kv_cache_usage == 0.5
    assert _StatsLogger(EngineStats(), None).sink.kv_capacity_tokens is None
