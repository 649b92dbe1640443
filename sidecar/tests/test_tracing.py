"""The sidecar's request spans (sidecar/tracing.py) on fake engines (conftest.py), read from the
SDK's in-memory exporter: the span joins the request's `traceparent` (HTTP headers, gRPC
metadata), carries the GenAI and infermesh attributes, its phases are children, the outcome of a
refusal or a degraded answer is on it, vLLM gets the span's context, and with tracing off the
lifecycle holds nothing. The real collector, Envoy and vLLM: e2e/test_tracing_e2e.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from infermesh.sidecar import tracing
from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.errors import Overloaded
from infermesh.sidecar.http_api import build_app
from infermesh.sidecar.lifecycle import Front, RequestLifecycle
from infermesh.sidecar.requests import GenerationRequest

CFG = {
    "pool": "interactive",
    "instance": "3",
    "models": [{"name": "big", "path": "/x", "aliases": ["m"]}, {"name": "small", "path": "/y"}],
    "classes": {"interactive": {"priority": 0}, "batch": {"priority": 10, "sheddable": True}},
    "server": {"max_concurrent_requests": 1},
}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.start(SidecarConfig.model_validate(CFG), exporter)
    yield exporter
    tracing.stop()


def by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_grpc_request_is_one_server_span_under_its_traceparent_with_its_phases(make_pool, spans):
    pool = make_pool(CFG)
    llm = pool.primary.engine
    md = {"traceparent": PARENT, "x-infermesh-rule": "chat", "x-infermesh-pool": "interactive", "x-envoy-attempt-count": "2"}

    async def run():
        async with RequestLifecycle(pool, GenerationRequest(model="m", prompt="abcd", request_class="interactive"), Front.GRPC,
                                    "generate", md) as life:
            async for _ in life.events():
                pass
        return life

    life = asyncio.run(run())
    got = by_name(spans)
    server = got["text_completion m"]
    assert f"{server.context.trace_id:032x}" == TRACE_ID and f"{server.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert server.kind.name == "SERVER"
    a = server.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "m" and a["gen_ai.response.model"] == "big"
    assert a["gen_ai.usage.input_tokens"] == 4 and a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.server.time_to_first_token"] >= 0
    assert a["infermesh.class"] == "interactive" and a["infermesh.rule"] == "chat" and a["infermesh.pool"] == "interactive"
    assert a["infermesh.served_by"] == "interactive/3" and a["infermesh.degraded"] is False and a["infermesh.ladder_model"] == "big"
    assert a["infermesh.attempt"] == 2 and "infermesh.spilled" not in a
    assert a["infermesh.outcome"] == "ok" and a["infermesh.status"] == "OK"
    assert a["infermesh.request_id"] == life.admission.request_id
    last = server.start_time
    for phase in ("infermesh.queue", "infermesh.prefill", "infermesh.decode"):  # one after the other, inside the request
        assert got[phase].parent.span_id == server.context.span_id
        assert last <= got[phase].start_time <= got[phase].end_time <= server.end_time
        last = got[phase].end_time
    assert [e.name for e in server.events] == ["admitted"]
    # vLLM's span is the sidecar span's child: the request's trace_headers carry its context.
    assert llm.trace_headers == [{"traceparent": f"00-{TRACE_ID}-{server.context.span_id:016x}-01"}]
    assert server.resource.attributes["service.name"] == "infermesh-sidecar"
    assert server.instrumentation_scope.schema_url == tracing.SEMCONV_SCHEMA


def test_a_refusal_at_admission_is_a_span_with_its_outcome(make_pool, spans):
    pool = make_pool(CFG)

    async def run():
        held = RequestLifecycle(pool, GenerationRequest(model=None, prompt="ab", request_class="interactive"), Front.GRPC, "generate")
        held.admit()  # the pool's one slot
        with pytest.raises(Overloaded):
            async with RequestLifecycle(pool, GenerationRequest(model=None, prompt="ab", request_class="batch"), Front.GRPC, "generate",
                                        {"traceparent": PARENT}):
                pass
        await held.close()

    asyncio.run(run())
    refused = [s for s in spans.get_finished_spans() if s.attributes.get("infermesh.outcome") == "refused"]
    assert len(refused) == 1
    assert refused[0].attributes["infermesh.status"] == "RESOURCE_EXHAUSTED" and refused[0].attributes["infermesh.class"] == "batch"
    assert [e.name for e in refused[0].events] == ["refused"]


def test_an_http_chat_joins_the_traceparent_and_a_degraded_answer_says_so(make_vllm_pool, spans, caplog):
    from types import SimpleNamespace

    pool = make_vllm_pool(CFG | {"models": [{"name": "big", "path": "/x", "aliases": ["m"]}, {"name": "small", "path": "/y"}]})
    pool.admission.policy = SimpleNamespace(actions={"degrade"}, reasons=lambda: ["kv:kv_cache"])  # an open breaker
    client = TestClient(build_app(pool))
    with caplog.at_level(logging.INFO, logger="infermesh.sidecar.requests"):
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                        headers={"traceparent": PARENT})
    assert r.status_code == 200, r.text
    server = by_name(spans)["chat m"]
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    a = server.attributes
    assert a["infermesh.outcome"] == "degraded" and a["infermesh.degraded"] is True and a["infermesh.degraded_reason"] == "kv:kv_cache"
    assert a["gen_ai.response.model"] == "small" and a["infermesh.ladder_step"] == 1 and a["infermesh.status"] == "200"
    assert pool.ladder[1].engine.trace_headers[0]["traceparent"].startswith(f"00-{TRACE_ID}-{server.context.span_id:016x}-")
    # The request's log line carries the trace id and the request id.
    line = next(r for r in caplog.records if r.getMessage() == "request")
    assert line.trace_id == TRACE_ID and line.request_id == a["infermesh.request_id"] and line.outcome == "degraded"


def test_an_unsampled_parent_is_followed_and_vllm_is_told(make_pool, spans):
    pool = make_pool(CFG)

    async def run():
        async with RequestLifecycle(pool, GenerationRequest(model=None, prompt="ab", request_class="interactive"), Front.GRPC, "generate",
                                    {"traceparent": PARENT[:-2] + "00"}) as life:
            async for _ in life.events():
                pass

    asyncio.run(run())
    assert spans.get_finished_spans() == ()
    assert pool.primary.engine.trace_headers[0]["traceparent"].endswith("-00"), "vLLM does not trace it either"


def test_tracing_off_holds_nothing(make_pool):
    tracing.stop()
    pool = make_pool(CFG)

    async def run():
        async with RequestLifecycle(pool, GenerationRequest(model=None, prompt="ab", request_class="interactive"), Front.GRPC, "generate",
                                    {"traceparent": PARENT}) as life:
            async for _ in life.events():
                pass
        return life

    assert asyncio.run(run()).trace is None
    assert pool.primary.engine.trace_headers == [None]
    assert tracing.vllm_endpoint() is None


def test_the_setting_is_off_by_default_and_checked():
    from pydantic import ValidationError

    from infermesh.settings import TracingSettings

    assert not SidecarConfig.model_validate(CFG).tracing.on
    t = TracingSettings(otlp_endpoint="collector.observability:4317", sample_ratio=0.1)
    assert t.on and t.otlp_host == "collector.observability" and t.otlp_port == 4317
    assert TracingSettings(otlp_endpoint="[::1]:4317").otlp_host == "::1"
    for bad in ({"otlp_endpoint": "http://x:4317"}, {"otlp_endpoint": "x"}, {"otlp_endpoint": "x:0"}, {"otlp_endpoint": "x:70000"},
                {"sample_ratio": 1.5}):
        with pytest.raises(ValidationError):
            TracingSettings.model_validate(bad)
    assert json.loads(TracingSettings().model_dump_json()) == {"otlp_endpoint": None, "sample_ratio": 1.0}
