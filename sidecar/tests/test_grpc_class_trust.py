"""The gRPC front takes a request's class only from the mesh: `x-infermesh-class` metadata from a
trusted peer (server.trusted_peers). A caller's `request_class` field, or its own metadata from
any other peer, changes nothing: not the class admission gives, not vLLM's priority, not the
metric labels. Served by a real grpc.aio server on loopback; the engine is the conftest's fake."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.grpc_api import InferenceServicer, add_inference_servicer
from infermesh.sidecar.metrics import SidecarMetrics
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

CLASSES = {"interactive": {"priority": 0, "vllm_priority": 0}, "batch": {"priority": 10, "sheddable": True, "vllm_priority": 7}}


def config(**server) -> SidecarConfig:
    return SidecarConfig.model_validate({"pool": "interactive", "models": [{"name": "m", "path": "/m", "max_model_len": 256}],
                                         "classes": CLASSES, "default_class": "batch", "mesh_pools": ["interactive", "batch"],
                                         "server": server})


async def serve_calls(pool, calls: list[tuple[pb.GenerateRequest, tuple]]) -> list:
    """Each (request, metadata) as a Generate call over loopback: its messages, or its RpcError."""
    server = grpc.aio.server()
    add_inference_servicer(InferenceServicer(pool), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.InferenceStub(ch)
            for request, metadata in calls:
                try:
                    out.append([m async for m in stub.Generate(request, metadata=metadata, timeout=10)])
                except grpc.aio.AioRpcError as e:
                    out.append(e)
    finally:
        await server.stop(None)
    return out


def series(pool, name: str) -> dict:
    """Every sample of `name` on the pool's registry, by its labels."""
    return {tuple(sorted(s.labels.items())): s.value for fam in pool.metrics.registry.collect() for s in fam.samples
            if s.name == name}


PLAIN = pb.GenerateRequest(text="hi", max_tokens=2)
SPOOFS = [
    (pb.GenerateRequest(text="hi", max_tokens=2, request_class="interactive"), ()),
    (pb.GenerateRequest(text="hi", max_tokens=2), (("x-infermesh-class", "interactive"),)),
    (pb.GenerateRequest(text="hi", max_tokens=2, request_class="vip-made-up"),
     (("x-infermesh-class", "also-made-up"), ("x-infermesh-pool", "pool-made-up"))),
]


def run_and_observe(make_pool, cfg: SidecarConfig, calls) -> tuple[list[int], dict, dict, list]:
    pool = make_pool(cfg)
    pool.metrics = SidecarMetrics.of(cfg)
    results = asyncio.run(serve_calls(pool, calls))
    return (pool.primary.engine.priorities, series(pool, "infermesh_sidecar_requests_total"),
            series(pool, "infermesh_sidecar_spilled_in_requests_total"), results)


def test_a_spoofed_class_from_an_untrusted_peer_changes_nothing(make_pool):
    cfg = config(trusted_peers=["10.0.0.0/8"])  # loopback, where this test's client is, is not the mesh here
    plain = run_and_observe(make_pool, cfg, [(PLAIN, ())] * len(SPOOFS))
    spoofed = run_and_observe(make_pool, cfg, SPOOFS)
    for got in (plain, spoofed):
        assert all(isinstance(r, list) and r[-1].final.finish_reason for r in got[3]), got[3]
    assert plain[0] == spoofed[0] == [7, 7, 7], "the default class's vLLM priority (batch), every time"
    assert plain[1] == spoofed[1], "the same request counters, labels included"
    assert list(spoofed[1]) == [(("api", "generate"), ("front", "grpc"), ("request_class", ""), ("status", "OK"))]
    assert spoofed[2] == plain[2] == {}, "an untrusted peer's x-infermesh-pool is not counted as a spill"


def test_from_the_meshs_proxy_the_metadata_sets_the_class_and_the_message_field_never_does(make_pool):
    cfg = config()  # loopback trusted (the default)
    calls = [
        (pb.GenerateRequest(text="hi", max_tokens=2, request_class="interactive"), ()),  # the field alone: ignored
        (pb.GenerateRequest(text="hi", max_tokens=2, request_class="batch"), (("x-infermesh-class", "interactive"),)),
        (pb.GenerateRequest(text="hi", max_tokens=2), (("x-infermesh-class", "made-up"), ("x-infermesh-pool", "batch"))),
    ]
    priorities, requests, spilled, results = run_and_observe(make_pool, cfg, calls)
    assert all(isinstance(r, list) for r in results), results
    assert priorities == [7, 0, 7], "field ignored; the mesh's interactive; an unknown name gets the default class"
    assert {dict(k)["request_class"]: v for k, v in requests.items()} == {"": 1, "interactive": 1, "other": 1}
    assert spilled == {(("bound_for", "batch"),): 1.0}


@pytest.mark.parametrize("peers", [["127.0.0.0/8"], ["::1/128"]])
def test_shedding_follows_the_meshs_class_not_the_callers(make_pool, peers):
    """Under `shed` the default class (batch, sheddable) is refused whatever the caller claims; the
    mesh's interactive is served (from loopback over IPv4 only when 127.0.0.0/8 is trusted)."""
    cfg = config(trusted_peers=peers)
    pool = make_pool(cfg)
    pool.admission.policy = type("Shedding", (), {"actions": {"shed"}, "reasons": lambda self: ["test"], "level": 1})()
    spoof = pb.GenerateRequest(text="hi", max_tokens=2, request_class="interactive")
    results = asyncio.run(serve_calls(pool, [(spoof, ()), (PLAIN, (("x-infermesh-class", "interactive"),))]))
    assert isinstance(results[0], grpc.aio.AioRpcError) and results[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    if peers == ["127.0.0.0/8"]:
        assert isinstance(results[1], list) and results[1][-1].final.served_by == "interactive/0"
    else:
        assert isinstance(results[1], grpc.aio.AioRpcError) and results[1].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
