"""The request lifecycle on fake engines (conftest.py): admission on entry, release on every way
out (normal end, an exception, cancellation, a stream that never began), and TTFT, inter-token
time, token counts and the outcome recorded once, read back from the real prometheus registry."""

from __future__ import annotations

import asyncio

import pytest

from infermesh.sidecar.errors import EngineFailed, Overloaded
from infermesh.sidecar.events import BreakerChanged, Draining
from infermesh.sidecar.grpc_api import AdminServicer
from infermesh.sidecar.lifecycle import Front, RequestLifecycle
from infermesh.sidecar.requests import Completion, GenerationRequest, TokenDelta

CFG = {
    "pool": "interactive",
    "models": [{"name": "big", "path": "/x"}, {"name": "small", "path": "/y"}],
    "classes": {"interactive": {"priority": 0, "vllm_priority": 0}, "batch": {"priority": 10, "sheddable": True, "vllm_priority": 5}},
    "server": {"max_concurrent_requests": 2, "stream_coalesce_min_inflight": 2, "stream_coalesce_ms": 10},
}


def sample(pool, name: str, **labels) -> float:
    return pool.metrics.registry.get_sample_value(name, labels) or 0.0


def requests_total(pool, front="grpc", api="generate", cls="interactive", status="OK") -> float:
    return sample(pool, "infermesh_sidecar_requests_total", front=front, api=api, request_class=cls, status=status)


def ttft_count(pool, front="grpc", cls="interactive") -> float:
    return sample(pool, "infermesh_sidecar_time_to_first_token_seconds_count", front=front, request_class=cls)


def itl_count(pool, front="grpc", cls="interactive") -> float:
    return sample(pool, "infermesh_sidecar_inter_token_latency_seconds_count", front=front, request_class=cls)


def req(**kw) -> GenerationRequest:
    return GenerationRequest(model=None, prompt="abcd", request_class="interactive", **kw)


async def held_stream(pool, front: Front, api: str) -> asyncio.Task:
    """A consumer inside a lifecycle, its request held by the fake engine after the first token."""
    pool.primary.engine.gate = asyncio.Event()
    first = asyncio.Event()

    async def consume():
        async with RequestLifecycle(pool, req(), front, api) as life:
            async for _ in life.events():
                first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    return task


def test_normal_end_admits_records_once_and_releases_without_abort(make_pool):
    pool = make_pool(CFG)
    llm = pool.primary.engine

    async def run():
        seen = []
        async with RequestLifecycle(pool, req(), Front.GRPC, "generate") as life:
            assert pool.inflight == 1 and pool.primary.inflight == 1
            async for ev in life.events():
                seen.append(ev)
        return seen, life

    seen, life = asyncio.run(run())
    assert [type(e) for e in seen] == [TokenDelta] * 3 + [Completion]
    assert seen[-1].prompt_tokens == 4 and seen[-1].completion_tokens == 3 and seen[-1].model == "big"
    assert pool.inflight == 0 and pool.primary.inflight == 0
    assert llm.aborted == [], "vLLM finished the request: nothing to abort"
    assert llm.priorities == [0], "the class's vLLM priority"
    assert requests_total(pool) == 1
    assert ttft_count(pool) == 1 and itl_count(pool) == 2
    assert sample(pool, "infermesh_sidecar_prompt_tokens_total", model="big") == 4
    assert sample(pool, "infermesh_sidecar_completion_tokens_total", model="big") == 3
    assert pool.window.outcomes and pool.window.outcomes[-1][1] is False and len(pool.window.ttfts) == 1


def test_an_exception_in_the_front_aborts_and_counts_the_client_as_gone(make_pool):
    pool = make_pool(CFG)
    llm = pool.primary.engine

    async def run():
        async with RequestLifecycle(pool, req(), Front.HTTP, "chat") as life:
            async for _ in life.events():
                raise RuntimeError("the front failed to format a chunk")

    with pytest.raises(RuntimeError):
        asyncio.run(run())
    assert pool.inflight == 0 and len(llm.aborted) == 1 and not llm.unfinished
    assert requests_total(pool, "http", "chat", status="499") == 1
    assert ttft_count(pool, "http") == 1 and itl_count(pool, "http") == 0
    assert sample(pool, "infermesh_sidecar_completion_tokens_total", model="big") == 1, "the tokens generated before it"


def test_cancellation_mid_stream_aborts_in_vllm_and_records_once(make_pool):
    pool = make_pool(CFG)
    llm = pool.primary.engine

    async def run():
        task = await held_stream(pool, Front.GRPC, "generate")
        assert llm.unfinished and pool.inflight == 1
        task.cancel()  # a passed deadline or a cancelled RPC
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert pool.inflight == 0 and len(llm.aborted) == 1 and not llm.unfinished
    assert requests_total(pool, status="CANCELLED") == 1 and requests_total(pool) == 0
    assert ttft_count(pool) == 1
    assert not pool.window.outcomes, "a cancelled request says nothing about the engine's health"


def test_the_abort_reaches_vllm_when_the_stream_is_cancelled_again_at_every_await(make_pool):
    # Starlette (anyio) cancels a vanished client's stream again at every await inside its scope.
    pool = make_pool(CFG)
    llm = pool.primary.engine
    llm.abort_delay = 0.01

    async def run():
        task = await held_stream(pool, Front.HTTP, "chat")
        while not task.done():
            task.cancel()
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)

    asyncio.run(run())
    assert pool.inflight == 0 and len(llm.aborted) == 1 and not llm.unfinished
    assert requests_total(pool, "http", "chat", status="499") == 1


def test_an_engine_failure_is_an_error_without_abort(make_pool):
    pool = make_pool(CFG)
    llm = pool.primary.engine
    llm.fail_after = 1

    async def run():
        async with RequestLifecycle(pool, req(), Front.GRPC, "generate") as life:
            async for _ in life.events():
                pass

    with pytest.raises(EngineFailed):
        asyncio.run(run())
    assert pool.inflight == 0 and llm.aborted == [], "vLLM has dropped a failed request already"
    assert requests_total(pool, status="INTERNAL") == 1
    assert pool.window.outcomes[-1][1] is True


def test_refusal_is_counted_once_and_holds_no_slot(make_pool):
    pool = make_pool(CFG)
    pool.admission.inflight.update({"a": pool.primary, "b": pool.primary})

    async def run():
        async with RequestLifecycle(pool, req(), Front.HTTP, "completions"):
            raise AssertionError("not admitted")

    with pytest.raises(Overloaded):
        asyncio.run(run())
    assert requests_total(pool, "http", "completions", status="429") == 1
    assert sample(pool, "infermesh_sidecar_shed_requests_total", request_class="interactive", reason="concurrency_limit") == 1
    assert len(pool.admission.inflight) == 2 and ttft_count(pool, "http") == 0


def test_a_stream_that_never_began_is_released_by_close(make_pool):
    # The HTTP stream admits before its response starts; if the client leaves before the body
    # began, only the response's own close() is left to release the request.
    pool = make_pool(CFG)

    async def run():
        life = RequestLifecycle(pool, req(), Front.HTTP, "chat")
        life.admit()
        assert pool.inflight == 1
        await life.close()
        await life.close()  # idempotent

    asyncio.run(run())
    assert pool.inflight == 0 and pool.primary.engine.aborted == [], "vLLM never saw it"
    assert requests_total(pool, "http", "chat", status="499") == 1


def test_coalescing_waits_only_under_load(make_pool):
    pool = make_pool(CFG)

    async def run():
        a = RequestLifecycle(pool, req(), Front.GRPC, "generate")
        a.admit()
        alone = a._pause_s()
        b = RequestLifecycle(pool, req(), Front.GRPC, "generate")
        b.admit()
        loaded = a._pause_s()
        await a.close()
        await b.close()
        return alone, loaded

    assert asyncio.run(run()) == (0.0, 0.01)


def test_the_degraded_model_serves_under_its_name_and_says_why(make_pool, fake_clock):
    cfg = CFG | {"breakers": {"kv": {"signal": "kv_cache", "trip_above": 0.9, "recover_below": 0.5, "sustain_s": 0,
                                     "min_samples": 1, "actions": ["degrade"]}}}
    pool = make_pool(cfg, fake_clock)
    pool.faults.set("kv_cache", 0.99, 60)
    pool.sample()

    async def run():
        async with RequestLifecycle(pool, req(), Front.GRPC, "generate") as life:
            return [ev async for ev in life.events()][-1]

    final = asyncio.run(run())
    assert (final.model, final.degraded, final.degraded_reason) == ("small", True, "kv:kv_cache")
    assert sample(pool, "infermesh_sidecar_completion_tokens_total", model="small") == 3


def test_event_wire_format_is_what_the_control_plane_reads():
    t = BreakerChanged(1.5, "kv", "closed", "open", ["shed"], ["shed"], "big", "above 0.9", 0.97)
    assert list(t.wire().items()) == [("at", 1.5), ("breaker", "kv"), ("from", "closed"), ("to", "open"), ("actions", ["shed"]),
                                      ("pool_actions", ["shed"]), ("serving_model", "big"), ("reason", "above 0.9"), ("value", 0.97)]
    assert Draining(2.0, []).wire() == {"at": 2.0, "event": "draining", "ready": False, "draining": True, "pool_actions": []}


def test_watch_state_streams_the_state_then_transitions_and_drains(make_pool, fake_clock):
    cfg = CFG | {"breakers": {"kv": {"signal": "kv_cache", "trip_above": 0.9, "recover_below": 0.5, "sustain_s": 0,
                                     "min_samples": 1, "actions": ["shed"]}}}
    pool = make_pool(cfg, fake_clock)

    async def run():
        stream = AdminServicer(pool).WatchState(None, None)
        first = await anext(stream)
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # subscribed
        pool.faults.set("kv_cache", 0.99, 60)
        pool.sample()
        second = await pending
        pool.begin_drain()
        third = await anext(stream)
        await stream.aclose()
        return first, second, third

    first, second, third = asyncio.run(run())
    assert first.HasField("state") and first.state.ready
    assert second.transition.breaker == "kv" and second.transition.to_state == "open" and list(second.transition.pool_actions) == ["shed"]
    assert third.HasField("state") and third.state.draining and not third.state.ready
    assert sample(pool, "infermesh_breaker_transitions_total", breaker="kv", to="open") == 1
    assert pool.events._subscribers == [pool.metrics.count_transition], "the watcher unsubscribed when its stream ended"
