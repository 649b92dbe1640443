"""Mutation fuzz of the gRPC front (fixed seed, bounded time): mutated GenerateRequests (field values
at their types' edges, nasty JSON schemas and regexes) and corrupted wire bytes, each sent to a
real grpc.aio server. None may end in INTERNAL or UNKNOWN (a bug) or hang; every INVALID_ARGUMENT
names the field; a plain request is served afterwards and nothing is left in flight.

The engine is the conftest's FakeVllmAsyncLLM: vLLM's real SamplingParams, its engine-side checks
(SamplingParams.verify, the structured-output backend's schema and regex validation) and the
small local model's real tokenizer and chat template; only the generation is scripted."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from infermesh.sidecar.grpc_api import InferenceServicer, add_inference_servicer
from infermesh.sidecar.metrics import SidecarMetrics
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

SEED = 28
BUDGET_S = 10.0
"""Mutations stop after this long (the whole test stays within 20 s on this machine)."""

CONFIG = {"pool": "interactive", "models": [{"name": "tiny", "path": "/unused", "aliases": ["t"], "max_model_len": 512}],
          "classes": {"interactive": {"priority": 0}, "batch": {"priority": 10, "sheddable": True}},
          "server": {"max_n": 4}}

FIELDS = {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields} | {"prompt", "chat.messages", "request"}
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

SCHEMAS = [
    "", "{", "not json", "[]", "5", "null", '"s"', "true", "NaN", '{"a": Infinity}', '{"a": NaN}',
    "[" * 5000 + "]" * 5000, '{"a":' * 300 + "1" + "}" * 300, "{" * 3000,
    '"\\ud800"', '{"type": "string", "enum": ["\\udfff"]}', '{"\\ud83d": 1}', '{"type": "string", "const": "\\ud83d\\ude00"}',
    '{"type": 5}', '{"type": "nope"}', '{"type": ["string", 5]}', '{"properties": []}', '{"properties": {"a": 5}}',
    '{"required": "a"}', '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', '{"$ref": 5}',
    '{"type": "string", "pattern": "("}', '{"type": "string", "minLength": -1}', '{"type": "integer", "minimum": "x"}',
    '{"type": "array", "items": 5}', '{"enum": {}}', '{"anyOf": 5}', '{"anyOf": []}', '{"allOf": [{"type": 1}]}',
    '{"type": "string", "format": "\\u0000"}', '{"type": "integer", "minimum": 1e400}', '{"type": "number", "maximum": -1e400}',
    '{"type": "array", "minItems": 99999999999999999999}', '{"type": "object", "additionalProperties": "x"}',
    '{"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "integer"}}}}}}',
]
REGEXES = ["", "(", "[", "a{99999999}", "\\", "(?P<x>a)(?P<x>b)", "a**", "[z-a]", "\\p{Zzzz}", "(" * 400 + ")" * 400, "\x00"]
TEXTS = ["", "hi", "\x00", "\u202e", "😀" * 50, "<|endoftext|>", "{{ raise }}", "x" * 20_000]
ROLES = ["user", "system", "assistant", "", "tool", "\x00", "{{", "user" * 100]
STRINGS = ["", "t", "tiny", "nope", "\x00", "../../etc", "😀", "x" * 5000, " tiny", "TINY"]
FLOATS = [float("nan"), float("inf"), float("-inf"), -1e38, 1e38, -0.0, 0.0, 1e-45, -1.0, 0.5, 1.0, 2.0, 3.0, 100.0]
UINT32 = [0, 1, 2, 3, 5, 20, 21, 511, 512, 513, 2**31 - 1, 2**31, 2**32 - 1]
INT32 = [-(2**31), -2, -1, 0, 1, 50, 2**31 - 1]
INT64 = [-(2**63), -1, 0, 1, 2**32, 2**63 - 1]
META = [(), (("x-infermesh-ttft-give-up-ms", "9" * 5000),),
        (("x-infermesh-ttft-give-up-ms", "-5"),), (("x-infermesh-class", "interactive"),),
        (("x-infermesh-pool", "x" * 300),), (("x-infermesh-ttft-give-up-ms", "1"),)]


def base(rng: random.Random) -> pb.GenerateRequest:
    r = pb.GenerateRequest(max_tokens=rng.choice([0, 2, 4]))
    if rng.random() < 0.5:
        r.text = "hello"
    else:
        r.chat.messages.add(role="user", content="hello")
    return r


def mutate(rng: random.Random, r: pb.GenerateRequest) -> None:
    """One to four field mutations, each at a value its type allows but the API may not."""
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(17)
        if kind == 0:
            r.structured_output.json_schema = rng.choice(SCHEMAS)
        elif kind == 1:
            r.structured_output.regex = rng.choice(REGEXES)
        elif kind == 2:
            r.structured_output.choice.choices[:] = rng.choice([[], [""], ["a", "a"], ["x" * 3000], ["\x00", "😀"]])
        elif kind == 3:
            setattr(r, rng.choice(["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"]),
                    rng.choice(FLOATS))
        elif kind == 4:
            setattr(r, rng.choice(["max_tokens", "n", "min_tokens", "top_logprobs"]), rng.choice(UINT32))
        elif kind == 5:
            r.top_k = rng.choice(INT32)
        elif kind == 6:
            r.seed = rng.choice(INT64)
        elif kind == 7:
            r.model = rng.choice(STRINGS)
        elif kind == 8:
            r.request_id = rng.choice(STRINGS)
        elif kind == 9:
            r.stop[:] = rng.choice([[""], ["x" * 5000], ["\x00"], ["a"] * 200, ["😀"]])
        elif kind == 10:
            r.stop_token_ids[:] = [rng.choice(UINT32) for _ in range(rng.randint(1, 4))]
        elif kind == 11:
            r.text = rng.choice(TEXTS)
        elif kind == 12:
            r.chat.messages.add(role=rng.choice(ROLES), content=rng.choice(TEXTS))
        elif kind == 13:
            r.ClearField("prompt") if rng.random() < 0.5 else r.chat.ClearField("messages")
        elif kind == 14:
            r.logprobs = rng.random() < 0.5
            r.top_logprobs = rng.choice(UINT32)
        elif kind == 15:
            r.ignore_eos = True
        else:
            r.request_class = rng.choice(["interactive", "batch", "made-up", "\x00"])


def corrupt(rng: random.Random, data: bytes) -> bytes:
    """The serialized message with bytes flipped, dropped, inserted or cut."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:
            del b[rng.randrange(len(b))]
        elif op == 2:
            b.insert(rng.randrange(len(b) + 1), rng.choice([0xFF, 0x80, 0xC0, 0xED, 0x0A, 0x12, 0x1A]))
        elif b:
            del b[rng.randrange(len(b)):]
    return bytes(b)


def names_a_field(details: str) -> bool:
    head = details.split(":", 1)[0].split(" ", 1)[0].strip("`")
    return head.split(".")[0] in FIELDS or head in FIELDS


@pytest.fixture
def pool(make_vllm_pool):
    p = make_vllm_pool(CONFIG)
    p.metrics = SidecarMetrics.of(p.config)
    return p


def gave_up_as_asked(wire: bool, meta, details: str) -> bool:
    """A DEADLINE_EXCEEDED that is the sidecar's answer to the mesh's 1 ms TTFT give-up (whether a
    first token comes within 1 ms depends on the machine's load), not the client's 10 s timeout (a hang)."""
    return not wire and ("x-infermesh-ttft-give-up-ms", "1") in meta and details.startswith("no first token within 1 ms")


def test_mutated_generate_requests_never_end_in_internal_or_unknown(pool):
    rng = random.Random(SEED)

    async def run() -> tuple[dict, list]:
        server = grpc.aio.server()
        add_inference_servicer(InferenceServicer(pool), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes: dict = {}
        bad: list = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.InferenceStub(ch)
                raw = ch.unary_stream("/infermesh.v1.Inference/Generate")  # bytes in, bytes out
                raw_models = ch.unary_unary("/infermesh.v1.Inference/ListModels")
                deadline = time.monotonic() + BUDGET_S
                n = 0
                while time.monotonic() < deadline and n < 1500:
                    n += 1
                    r = base(rng)
                    mutate(rng, r)
                    wire = rng.random() < 0.25
                    meta = ()
                    try:
                        if wire:
                            if rng.random() < 0.2:
                                await raw_models(corrupt(rng, b"\x0a\x01x"), timeout=10)
                            else:
                                [m async for m in raw(corrupt(rng, r.SerializeToString()), timeout=10)]
                        else:
                            meta = rng.choice(META)
                            [m async for m in stub.Generate(r, metadata=meta, timeout=10)]
                        code = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as e:
                        code = e.code()
                        if code in BAD or code == grpc.StatusCode.DEADLINE_EXCEEDED and not gave_up_as_asked(wire, meta, e.details()):
                            bad.append((code, e.details(), "wire" if wire else r))
                        elif code == grpc.StatusCode.INVALID_ARGUMENT and not names_a_field(e.details()):
                            bad.append(("unnamed", e.details(), r))
                    codes[code] = codes.get(code, 0) + 1
                plain = [m async for m in stub.Generate(pb.GenerateRequest(text="hello", max_tokens=3), timeout=10)]
                assert plain[-1].final.finish_reason and plain[-1].final.served_by == "interactive/0"
                models = await stub.ListModels(pb.ListModelsRequest(), timeout=10)
                assert [m.id for m in models.models] == ["tiny"]
        finally:
            await server.stop(None)
        return codes, bad

    codes, bad = asyncio.run(run())
    assert not bad, bad[:5]
    assert sum(codes.values()) >= 200, codes
    assert codes.get(grpc.StatusCode.OK, 0) > 0 and codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 0, codes
    assert pool.inflight == 0 and not pool.primary.engine.unfinished
    assert pool.metrics.registry.get_sample_value("infermesh_internal_errors_total", {"front": "grpc", "api": "generate"}) is None
