"""Time-bounded admission (admission.EngineSlots) with an injected fake clock: nothing here
sleeps. The estimated wait, refusal on arrival, refusal while waiting (before vLLM sees the
request), Retry-After derived from the estimate, and the rate following what is measured; then
the same through a pool's lifecycles on fake engines (conftest.py)."""

from __future__ import annotations

import asyncio
import math

import pytest

from infermesh.sidecar.admission import EngineSlots, TargetUnreachable
from infermesh.sidecar.lifecycle import Front, RequestLifecycle
from infermesh.sidecar.requests import GenerationRequest
from infermesh.settings import ClassSettings


def busy_slots(clock, slots=2, hold_s=1.0, first_token_s=0.1) -> EngineSlots:
    """Every slot held (`s.holders`), the pool measured: `slots / hold_s` requests start per second."""
    s = EngineSlots(slots, clock, limit=slots)
    s.holders = [s.enqueue(0, 1.0) for _ in range(slots)]
    s.measured_hold(hold_s)
    s.measured_first_token(first_token_s)
    return s


def test_the_estimated_wait_is_the_place_in_line_over_the_measured_rate(fake_clock):
    s = busy_slots(fake_clock, slots=2, hold_s=1.0)
    assert s.rate == 2.0
    assert s.start_wait(0) == 0.5 and s.start_wait(3) == 2.0
    for _ in range(3):
        s.enqueue(0, 10.0)
    assert s.estimate(0) == pytest.approx(2.0 + 0.1), "three ahead, the fourth in line: 4 / 2 per s, plus vLLM's first token"
    assert s.estimate(-1) == pytest.approx(0.5 + 0.1), "a more important class waits in front of them"


def test_an_idle_engine_admits_whatever_the_last_ttfts_were_a_busy_one_does_not(fake_clock):
    s = EngineSlots(4, fake_clock, limit=4)
    s.measured_first_token(5.0)
    s.check_arrival(1.0, 0, "x")  # no raise: vLLM starts it at once, and measures its TTFT again
    assert s.enqueue(0, 1.0).started_at == 0.0
    # A free slot is not a first token in time: vLLM's own queue (a full KV cache) is in first_token_s.
    with pytest.raises(TargetUnreachable) as e:
        s.check_arrival(1.0, 0, "x")
    assert e.value.retry_after_s == 4
    s.measured_first_token(0.1)
    for _ in range(20):
        s.measured_first_token(0.1)
    s.check_arrival(1.0, 0, "x")


def test_refused_on_arrival_past_the_target_with_retry_after_from_the_estimate(fake_clock):
    s = busy_slots(fake_clock, slots=2, hold_s=1.0, first_token_s=0.1)
    s.check_arrival(1.0, 0, "pool p")  # first in line: 0.5 s to a slot + 0.1 s
    s.enqueue(0, 1.0)
    with pytest.raises(TargetUnreachable) as e:  # second in line: 1.0 s + 0.1 s
        s.check_arrival(1.0, 0, "pool p")
    assert e.value.http_status == 429 and e.value.code == "ttft_target_unreachable" and e.value.retry_after_s == 1
    assert "1100 ms" in e.value.message and "1000 ms target" in e.value.message
    for _ in range(9):
        s.enqueue(0, 100.0)
    with pytest.raises(TargetUnreachable) as e:  # eleventh in line: 5.5 s + 0.1 s, 4.6 s over
        s.check_arrival(1.0, 0, "pool p")
    assert e.value.retry_after_s == 5
    s.check_arrival(10.0, 0, "pool p")  # a class with a 10 s target is still admitted


def test_unmeasured_the_line_is_no_longer_than_the_cap(fake_clock):
    s = EngineSlots(1, fake_clock)
    s.enqueue(0, 1.0)
    s.check_arrival(1.0, 0, "x")  # first in line: admitted to wait
    s.enqueue(0, 1.0)
    with pytest.raises(TargetUnreachable) as e:
        s.check_arrival(1.0, 0, "x")
    assert e.value.retry_after_s == 1


def test_refused_while_waiting_never_gets_a_slot(fake_clock):
    s = busy_slots(fake_clock, slots=1, hold_s=0.5, first_token_s=0.1)

    async def run():
        w = s.enqueue(0, 1.0)  # due at 1.0; estimate 0.5 + 0.1
        task = asyncio.create_task(s.acquire(w))
        await asyncio.sleep(0)
        assert not task.done() and s.waiting == [w]
        fake_clock.t = 0.95  # the slot is still held: 0.95 + 0.5 + 0.1 is past 1.0
        s.expire()
        with pytest.raises(TargetUnreachable) as e:
            await task
        return w, e.value

    w, err = asyncio.run(run())
    assert w.started_at is None and s.waiting == [] and s.busy == 1, "never started: vLLM never sees it"
    assert err.retry_after_s == 1 and "waited 950 ms" in err.message
    assert s.refused_waiting == 1


def test_a_slower_measured_rate_refuses_those_in_line_at_the_next_release(fake_clock):
    s = busy_slots(fake_clock, slots=1, hold_s=0.2, first_token_s=0.0)
    waiters = [s.enqueue(0, 1.0) for _ in range(3)]  # 0.2, 0.4, 0.6 s: all within 1 s
    assert s.expire() == []
    fake_clock.t = 0.5
    for _ in range(10):
        s.measured_hold(2.0)  # the pool slows down: now ~1.8 s a request
    # The holder releases: the first in line starts; the others would start past their deadline.
    s.finish(s.holders[0], ran=False)
    assert waiters[0].started_at == 0.5
    assert waiters[1].refusal is not None and waiters[2].refusal is not None
    assert s.waiting == [] and s.busy == 1


def test_the_rate_follows_the_measured_holds(fake_clock):
    s = EngineSlots(4, fake_clock, limit=4)
    s.measured_hold(1.0)
    assert s.rate == 4.0
    for _ in range(20):
        s.measured_hold(4.0)
    assert s.rate == pytest.approx(1.0, rel=0.05)
    for _ in range(30):
        s.measured_hold(0.5)
    assert s.rate == pytest.approx(8.0, rel=0.05)


def test_finish_frees_the_slot_for_the_next_in_line_and_measures_only_what_ran(fake_clock):
    s = EngineSlots(1, fake_clock)
    a = s.enqueue(0, 10.0)
    b = s.enqueue(5, 10.0)
    c = s.enqueue(0, 10.0)
    assert s.waiting == [c, b], "by priority, then arrival"
    fake_clock.t = 2.0
    s.finish(a, ran=True)
    assert s.hold_s == 2.0 and c.started_at == 2.0 and s.waiting == [b]
    s.finish(c, ran=False)
    assert s.hold_s == 2.0, "a request vLLM did not finish measures nothing"
    s.finish(c, ran=False)  # idempotent
    assert s.busy == 1 and b.started_at == 2.0


def test_class_targets_default_by_sheddable():
    assert ClassSettings().ttft_target_s == 1.0
    assert ClassSettings(sheddable=True).ttft_target_s == 10.0
    assert ClassSettings(ttft_target_ms=250).ttft_target_s == 0.25
    with pytest.raises(ValueError):
        ClassSettings(ttft_target_ms=5)


# -- through the pool's lifecycles (fake engines) ---------------------------------------------

CFG = {
    "pool": "interactive",
    "models": [{"name": "big", "path": "/x", "max_num_seqs": 1}],
    "classes": {"interactive": {"priority": 0, "ttft_target_ms": 1000}, "batch": {"priority": 10, "sheddable": True}},
    "server": {"max_concurrent_requests": 16},
}


def req(cls="interactive") -> GenerationRequest:
    return GenerationRequest(model=None, prompt="abcd", request_class=cls)


def test_lifecycles_wait_for_the_slot_and_are_refused_before_vllm(make_pool, fake_clock):
    pool = make_pool(CFG, fake_clock)
    llm = pool.primary.engine
    slots = pool.admission.slots["big"]

    async def run():
        llm.gate = asyncio.Event()
        first = asyncio.Event()

        async def hold():
            async with RequestLifecycle(pool, req(), Front.GRPC, "generate") as life:
                async for _ in life.events():
                    first.set()

        holder = asyncio.create_task(hold())
        await first.wait()
        # Nothing measured and the one slot busy: one may wait, the next is refused at once.
        waiting = RequestLifecycle(pool, req(), Front.GRPC, "generate")
        waiting.admit()
        with pytest.raises(TargetUnreachable):
            RequestLifecycle(pool, req(), Front.GRPC, "generate").admit()
        slots.measured_hold(0.4)  # as if measured: 2.5 starts a second

        async def wait_then_generate():
            async with waiting as life:
                async for _ in life.events():
                    pass

        w = asyncio.create_task(wait_then_generate())
        await asyncio.sleep(0)
        assert len(slots.waiting) == 1
        fake_clock.t = 0.7  # 0.7 + 0.4 to a slot: past its 1 s target
        slots.expire()
        with pytest.raises(TargetUnreachable) as e:
            await w
        llm.gate.set()
        await holder
        return e.value

    err = asyncio.run(run())
    assert len(llm.priorities) == 1, "only the holder reached the engine"
    assert err.grpc_code.name == "RESOURCE_EXHAUSTED" and err.retry_after_s >= 1
    assert pool.inflight == 0 and slots.busy == 0 and slots.waiting == []
    assert pool.metrics.registry.get_sample_value("infermesh_sidecar_requests_total", {
        "front": "grpc", "api": "generate", "request_class": "interactive", "status": "RESOURCE_EXHAUSTED"}) == 2, "one refused on arrival, one while it waited"


def test_the_cap_grows_with_first_tokens_in_time_and_shrinks_once_a_round_when_late(fake_clock):
    s = EngineSlots(32, fake_clock)
    assert s.cap == 8, "a cold engine gets a quarter of max_num_seqs"
    held = [s.enqueue(0, 1.0) for _ in range(9)]
    assert held[7].started_at == 0.0 and held[8].started_at is None, "24 of max_num_seqs free, but the cap is 8"
    s.measured_first_token(0.2, 1.0)  # within half the target: one more, and the one in line starts
    assert s.cap == 9 and held[8].started_at == 0.0
    for _ in range(6):
        s.measured_first_token(0.2, 1.0)
    assert s.cap == 15
    s.measured_first_token(0.7, 1.0)  # between half and the target: holds
    assert s.cap == 15
    fake_clock.t = 5.0
    s.measured_first_token(1.5, 1.0, started_at=4.0)
    assert s.cap == 11
    s.measured_first_token(1.5, 1.0, started_at=4.5)  # started before the cut: the same round
    assert s.cap == 11
    fake_clock.t = 6.0
    s.measured_first_token(1.5, 1.0, started_at=5.5)
    assert s.cap == 8
    for _ in range(100):
        s.measured_first_token(0.1, 1.0)
    assert s.cap == 32, "never above max_num_seqs"


# -- through the HTTP front on vLLM's serving layer (fake engine, conftest.py) -------------------

def _one_slot_app(make_vllm_pool, classes: dict, **config):
    """The HTTP front of a pool whose one model (m-large) has one engine slot, on vLLM's serving
    layer over a fake engine whose first tokens wait on the returned event. Returns (pool, the
    fake engine, the event, the app, the model's slots)."""
    from infermesh.sidecar.config import SidecarConfig
    from infermesh.sidecar.http_api import build_app
    from sidecar.tests.test_headers_at_first_token import _hold_first_token

    pool = make_vllm_pool(SidecarConfig.model_validate({
        "pool": "interactive", "models": [{"name": "m-large", "path": "/nonexistent", "max_num_seqs": 1}], "classes": classes} | config))
    opened = _hold_first_token(pool.primary.engine)
    return pool, pool.primary.engine, opened, build_app(pool), pool.admission.slots["m-large"]


HOLD_S = 5.0
"""The holder's first token comes once the chat behind it has its answer, or after this (a chat
wrongly left waiting for the slot is then served: a 200 the tests refuse, not a hang)."""


def _waits_behind_a_holder(make_vllm_pool, target_ms: int, measure, stream: bool):
    """One engine slot (max_num_seqs 1), held by a batch chat (10 s target) until the chat behind
    it is answered (at most HOLD_S): no timing of the holder's own can free the slot first, however
    slow the machine; once it holds the slot, `measure(slots)` sets what the pool measured and an
    interactive chat (`target_ms`) comes in behind it. Returns (pool, the fake engine, the slots,
    the interactive chat's ASGI messages with their times)."""
    import json

    from sidecar.tests.test_headers_at_first_token import _asgi

    pool, llm, opened, app, slots = _one_slot_app(
        make_vllm_pool, {"interactive": {"priority": 0, "ttft_target_ms": target_ms}, "batch": {"priority": 10, "sheddable": True}})
    chat = {"messages": [{"role": "user", "content": "hi"}]}

    async def run():
        holder = asyncio.create_task(_asgi(app, json.dumps(chat | {"stream": True}).encode(), None, opened, open_after=HOLD_S))
        while slots.busy == 0:
            await asyncio.sleep(0.01)
        measure(slots)
        sent = await _asgi(app, json.dumps(chat | {"stream": stream}).encode(), None, headers=[(b"x-infermesh-class", b"interactive")])
        opened.set()
        await holder
        return sent

    return pool, llm, slots, asyncio.run(run())


def _refusal(sent) -> tuple[float, int, dict, dict]:
    """The answer's time, status, headers and OpenAI error object."""
    import json

    t, start = next((t, m) for t, m in sent if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    err = json.loads(b"".join(m.get("body", b"") for _, m in sent if m["type"] == "http.response.body"))["error"]
    return t, start["status"], headers, err


def test_http_stream_refused_while_waiting_gets_429_retry_after_and_never_reaches_vllm(make_vllm_pool):
    # As if measured: the next one would start in 0.2 s, within 75 % of 300 ms.
    pool, llm, slots, sent = _waits_behind_a_holder(make_vllm_pool, 300, lambda s: s.measured_hold(0.2), stream=True)
    t, status, headers, err = _refusal(sent)
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert err["code"] == "ttft_target_unreachable" and err["type"] == "rate_limit_error"
    assert len(llm.requests) == 1, "only the holder reached vLLM"
    assert slots.waiting == [] and slots.busy == 0 and pool.inflight == 0
    assert 0.225 <= t < 1.0, "answered at 75 % of its 300 ms target (ADMIT_SHARE), not when the slot freed"
    assert headers["endpoint-load-metrics"].startswith("TEXT rps_fractional="), "Envoy's weights learn the load from it"


def test_http_refused_on_arrival_carries_the_load_report(make_vllm_pool):
    # Measured: the slot frees in 5 s, far past 75 % of 300 ms: refused before it waits at all.
    pool, llm, slots, sent = _waits_behind_a_holder(make_vllm_pool, 300, lambda s: s.measured_hold(5.0), stream=True)
    t, status, headers, err = _refusal(sent)
    assert status == 429 and err["code"] == "ttft_target_unreachable" and slots.refused_waiting == 0
    # A refusal for load is the answer that most needs to reach Envoy's weighted round robin.
    assert headers["endpoint-load-metrics"].startswith("TEXT rps_fractional="), headers
    assert "application_utilization=1.0000" in headers["endpoint-load-metrics"], "its one slot is held"


def _measured_then_late(slots) -> None:
    slots.measured_hold(0.1)  # admitted: 0.1 s to the slot + 0.3 s to a first token, within 75 % of 600 ms
    slots.measured_first_token(0.3)  # at 0.15 s (450 - 300 ms) it can no longer start in time: refused then


def test_http_non_streamed_refused_while_waiting_is_answered_at_the_decision(make_vllm_pool):
    pool, llm, slots, sent = _waits_behind_a_holder(make_vllm_pool, 600, _measured_then_late, stream=False)
    t, status, headers, err = _refusal(sent)
    assert status == 429 and int(headers["retry-after"]) >= 1 and err["code"] == "ttft_target_unreachable"
    assert 0.15 <= t < 0.45, "answered when refused (0.15 s), before its 600 ms target"
    assert len(llm.requests) == 1 and slots.refused_waiting == 1 and pool.inflight == 0


def test_an_http_stream_without_a_first_token_by_its_target_is_503_and_its_wait_is_a_ttft(make_pool, fake_clock):
    pool = make_pool(CFG, fake_clock)
    slots = pool.admission.slots["big"]

    async def run():
        holder = RequestLifecycle(pool, req(), Front.HTTP, "chat")
        holder.admit()
        assert holder.req.ttft_give_up_s is None, "a slot at once: no limit, served however late vLLM is"
        life = RequestLifecycle(pool, req(), Front.HTTP, "chat")
        life.admit()
        assert life.req.ttft_give_up_s == 1.0, "in line: the class's target is its limit on HTTP"
        slots.finish(holder.admission.waiter, ran=False)  # the holder goes: the one in line starts
        await life._slot()
        life._delta = True  # a stream
        fake_clock.t = 1.0
        assert not life.first_token_seen
        err = life.gave_up()
        await life.close(err)
        await holder.close()
        return err

    err = asyncio.run(run())
    assert (err.http_status, err.code, err.retry_after_s) == (503, "ttft_target_missed", 1)
    assert [t for _, t in pool.window.ttfts] == [1.0], "the latency breaker's window sees it"
    assert pool.inflight == 0 and slots.busy == 0


def test_vllms_own_queue_pauses_the_starts_and_drops_the_cap_to_what_runs(fake_clock):
    s = EngineSlots(8, fake_clock, limit=6)
    held = [s.enqueue(0, 1.0) for _ in range(4)]
    assert all(w.started_at is not None for w in held) and s.cap == 6
    s.engine_stats(running=3, waiting=1)  # vLLM runs 3 of them; one waits in its scheduler (KV cache full)
    assert s.cap == 3, "the cap drops at once to what vLLM runs"
    s.engine_stats(running=3, waiting=1)
    assert s.cap == 3
    w = s.enqueue(0, 1.0)
    assert w.started_at is None and s.start_wait(0) != 0.0, "nothing starts while vLLM has a queue"
    s.finish(held[0], ran=True)
    assert w.started_at is None, "a free slot under the cap is no start while vLLM still reports a queue"
    s.finish(held[1], ran=True)
    assert s.busy == 2 and w.started_at is None
    s.engine_stats(running=2, waiting=0)
    assert w.started_at is not None, "the first step with nothing waiting moves the line"
    s.measured_first_token(0.9, 1.0, w.started_at)
    assert s.cap == 3, "a late first token of a request started before the drop is no second cut"


def test_a_reading_from_before_the_last_request_left_pauses_nothing(fake_clock):
    s = EngineSlots(4, fake_clock, limit=2)
    w = s.enqueue(0, 1.0)
    s.engine_stats(running=0, waiting=1)  # vLLM takes no further step once its queue is aborted
    s.finish(w, ran=False)
    assert s.enqueue(0, 1.0).started_at is not None, "no request of ours is in vLLM: its old queue is gone"


def test_engine_stats_reach_the_slots_of_their_model(make_pool, fake_clock):
    pool = make_pool(CFG, fake_clock)
    for m in pool.ladder:
        slots = pool.admission.slots[m.config.name]
        m.stats.record(0.99, running=1, waiting=2, now=fake_clock())
        assert slots.engine_waiting == 2


def test_http_stream_refused_while_waiting_is_answered_at_the_decision_not_its_target(make_vllm_pool):
    pool, llm, slots, sent = _waits_behind_a_holder(make_vllm_pool, 600, _measured_then_late, stream=True)
    t, status, headers, err = _refusal(sent)
    assert status == 429 and int(headers["retry-after"]) >= 1 and err["code"] == "ttft_target_unreachable"
    assert 0.15 <= t < 0.45, "answered when refused (0.15 s), not at its 600 ms target"
    assert len(llm.requests) == 1 and slots.refused_waiting == 1 and pool.inflight == 0


def test_an_estimate_within_the_target_but_past_its_admitted_share_is_refused(fake_clock):
    from infermesh.sidecar.admission import ADMIT_SHARE

    s = busy_slots(fake_clock, slots=2, hold_s=1.0, first_token_s=0.1)
    s.check_arrival(1.0, 0, "pool p")  # 0.5 s to a slot + 0.1 s: within 75 % of 1 s
    s.enqueue(0, 1.0)
    assert ADMIT_SHARE < (1.0 + 0.1) / 1.4 <= 1.0  # the next one: 1.0 s + 0.1 s, within 1.4 s but past its share
    with pytest.raises(TargetUnreachable):
        s.check_arrival(1.4, 0, "pool p")


# -- a stream in vLLM without a first token at its target: cut only while the pool is pressed -----

def _late_stream(make_vllm_pool, pressed: bool):
    """An interactive stream (300 ms target) gets the only engine slot at once and vLLM holds its
    first token until 1.0 s (pressed: HOLD_S). `pressed`: at 0.1 s a second interactive chat arrives and is refused
    for time (the slot is measured busy for 2 s). Returns (vLLM's fake engine, the slots, the
    stream's ASGI messages, the second chat's)."""
    import json

    from sidecar.tests.test_headers_at_first_token import _asgi

    pool, llm, opened, app, slots = _one_slot_app(make_vllm_pool, {"interactive": {"priority": 0, "ttft_target_ms": 300}},
                                                  default_class="interactive")
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    interactive = [(b"x-infermesh-class", b"interactive")]

    async def run():
        # Pressed, its first token comes only after HOLD_S (a stream not cut is then a 200 the test refuses).
        late = asyncio.create_task(_asgi(app, chat, None, opened, open_after=HOLD_S if pressed else 1.0, headers=interactive))
        while slots.busy == 0:
            await asyncio.sleep(0.01)
        other = None
        if pressed:
            await asyncio.sleep(0.1)
            slots.measured_hold(2.0)
            other = await _asgi(app, chat, None, headers=interactive)
        return await late, other

    late, other = asyncio.run(run())
    return pool, llm, slots, late, other


def test_a_stream_late_in_vllm_is_cut_at_its_admitted_share_while_the_pool_refuses_for_time(make_vllm_pool):
    pool, llm, slots, sent, other = _late_stream(make_vllm_pool, pressed=True)
    assert _refusal(other)[1] == 429, "the second chat was refused for time: the pool is pressed"
    t, status, headers, err = _refusal(sent)
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert err["code"] == "ttft_target_missed"
    assert 0.225 <= t < 1.0, "answered at 75 % of its 300 ms target (ADMIT_SHARE), not at its first token"
    assert "75% of the interactive class's 300 ms target" in err["message"]
    assert len(llm.aborted) == 1, "aborted in vLLM"
    assert slots.busy == 0 and pool.inflight == 0
    assert slots.first_token_s is not None, "nothing was measured before: vLLM's time with it is now a bound on the estimate"
    assert [round(t, 2) for _, t in pool.window.ttfts][0] >= 0.22, "the latency breaker's window sees it"


def test_a_stream_late_in_vllm_is_served_however_late_while_nothing_is_refused(make_vllm_pool):
    pool, llm, slots, sent, _ = _late_stream(make_vllm_pool, pressed=False)
    t, start = next((t, m) for t, m in sent if m["type"] == "http.response.start")
    assert start["status"] == 200 and t >= 1.0, "nothing else wanted its compute: served at its first token"
    assert llm.aborted == [] and pool.inflight == 0


def test_a_first_token_given_up_only_raises_the_estimate_and_cuts_the_cap_once_a_round(fake_clock):
    s = EngineSlots(8, fake_clock, limit=8)
    s.measured_first_token(0.4)
    s.missed_first_token(0.2, 1.0)
    assert s.first_token_s == 0.4 and s.limit == 8, "0.2 s in vLLM says nothing past a 0.4 s estimate, nor about the cap"
    s.missed_first_token(0.9, 1.0, started_at=0.0)
    assert s.first_token_s == pytest.approx(0.4 + 0.2 * 0.5) and s.limit == 6
    s.missed_first_token(0.9, 1.0, started_at=0.0)
    assert s.limit == 6, "one cut a round: it started before the last cut"


def test_pressure_is_a_refusal_for_time_since_admission_or_a_line(fake_clock, make_pool):
    pool = make_pool(CFG, fake_clock)
    adm, slots = pool.admission, pool.admission.slots["big"]
    assert not adm.pressed_since(0.0)
    fake_clock.t = 5.0
    slots.refused_at = 4.0
    assert adm.pressed_since(3.0) and not adm.pressed_since(4.5), "a refusal before it was admitted is not its pressure"
    slots.waiting.append(object())
    assert adm.pressed_since(4.5), "a request in line wants the compute now"


def test_a_burst_is_admitted_as_far_as_the_prefills_before_it_fit_its_target(fake_clock):
    # Measured one at a time (a calibration): 150 ms to a first token, nothing ahead.
    s = EngineSlots(32, fake_clock, limit=16)
    w = s.enqueue(0, 1.0)
    s.first_token(w, 0.15, 1.0)
    s.finish(w, ran=True)
    assert s.prefill_s == 0.15 and s.prefilling == 0
    admitted = 0
    with pytest.raises(TargetUnreachable):
        for _ in range(16):
            s.check_arrival(1.0, 0, "pool p")
            s.enqueue(0, 1.0)
            admitted += 1
    assert admitted == 5, "the 6th would be prefilled after 5: 6 x 150 ms is past 75 % of 1 s, with 11 slots free"
    assert s.busy == 5 and s.prefilling == 5


def test_a_first_token_measures_the_prefill_per_request_it_waited_for(fake_clock):
    s = EngineSlots(8, fake_clock, limit=8)
    a, b = s.enqueue(0, 1.0), s.enqueue(0, 1.0)
    assert (a.ahead, b.ahead, s.prefilling) == (0, 1, 2)
    s.first_token(a, 0.1, 1.0)
    s.first_token(b, 0.3, 1.0)
    assert s.prefill_s == pytest.approx(0.1 + 0.2 * (0.15 - 0.1)), "b's 300 ms covered two prefills"
    assert s.prefilling == 0
    c = s.enqueue(0, 1.0)
    s.finish(c, ran=True)
    assert s.prefilling == 0, "one that ends without a first token is no longer prefilling"


# -- a primary too slow for the target: the loaded fallback serves, degraded -----------------------

LADDER = CFG | {"models": [{"name": "big", "path": "/x", "max_num_seqs": 4}, {"name": "small", "path": "/y", "max_num_seqs": 4}]}


def stalled(slots: EngineSlots, prefill_s: float) -> None:
    """One request in flight on `slots`, the engine measured at `prefill_s` per prefill (and a
    request held twice that)."""
    slots.holders = [slots.enqueue(0, 1.0)]
    slots.measured_hold(2 * prefill_s)
    slots.prefill_s = slots.first_token_s = prefill_s


def test_a_primary_too_slow_alone_hands_the_request_to_the_loaded_fallback_degraded(make_pool, fake_clock):
    """The slow-sidecar drill's case (its primary SIGSTOPped most of every 2 s): one prefill takes
    1.7 s, past 75 % of the 1 s target even alone. Before a breaker has judged the pool, a chat
    arriving then is served by the fallback, degraded and saying why, not refused; and since
    nothing was refused, the primary's stalled streams are not cut (the pool is not pressed)."""
    pool = make_pool(LADDER, fake_clock)
    big, small = pool.admission.slots["big"], pool.admission.slots["small"]
    stalled(big, 1.7)
    adm = pool.admission.admit(req())
    assert adm.engine.config.name == "small" and adm.degraded and adm.degraded_reason == "primary_too_slow"
    assert small.busy == 1 and big.busy == 1
    assert big.refused_at == -math.inf and not pool.admission.pressed_since(0.0)
    # The fallback's own time bounds it too: once it cannot either, the request is refused.
    stalled(small, 1.7)
    with pytest.raises(TargetUnreachable):
        pool.admission.admit(req())
    assert pool.admission.pressed_since(0.0)


def test_a_line_or_a_burst_at_the_primary_is_refused_not_handed_to_the_fallback(make_pool, fake_clock):
    """Overload is not slowness: with a prefill in 150 ms, a request past its share because of
    the line (or of the prefills started before it) is refused as before; the fallback would take
    the same cores."""
    pool = make_pool(LADDER, fake_clock)
    big = pool.admission.slots["big"]
    stalled(big, 0.15)
    for _ in range(4):
        big.enqueue(0, 10.0)  # four in line behind the one running: seconds to a slot
    with pytest.raises(TargetUnreachable):
        pool.admission.admit(req())
    assert pool.admission.slots["small"].busy == 0 and big.refused_at == fake_clock.t


def test_without_a_loaded_fallback_a_slow_primary_refuses(make_pool, fake_clock):
    pool = make_pool(LADDER, fake_clock, loaded=False)
    pool.ladder.primary.start()  # the fallback is not a standby here
    stalled(pool.admission.slots["big"], 1.7)
    with pytest.raises(TargetUnreachable):
        pool.admission.admit(req())


def test_a_request_naming_the_fallback_or_a_degraded_pool_is_not_moved_again(make_pool, fake_clock):
    pool = make_pool(LADDER, fake_clock)
    stalled(pool.admission.slots["small"], 1.7)
    with pytest.raises(TargetUnreachable):
        pool.admission.admit(GenerationRequest(model="small", prompt="abcd", request_class="interactive"))


def test_a_prefill_stuck_past_the_share_now_is_slowness_before_the_average_learns_it(make_pool, fake_clock):
    """The drill's timeline (clean-clone run on 482d744): the average still says 0.49 s a prefill
    (one stalled first token of 1.84 s in it), a chat has been prefilling for 1.16 s without a
    first token, and the next one would be refused (2 x 0.49 s is past 75 % of 1 s): the engine is
    stalled now, so the fallback serves it. A prefill still within the share is not slowness."""
    pool = make_pool(LADDER, fake_clock)
    big = pool.admission.slots["big"]
    stalled(big, 0.49)
    fake_clock.t = 0.5
    with pytest.raises(TargetUnreachable):
        pool.admission.admit(req())
    fake_clock.t = 1.16
    adm = pool.admission.admit(req())
    assert adm.engine.config.name == "small" and adm.degraded_reason == "primary_too_slow"
    (w,) = big.in_prefill
    big.first_token(w, 1.2, 1.0)
    assert big.in_prefill == [] and big.prefilling == 0
