"""e2e: mutation fuzz of the serving API through the real mesh (Envoy, the compiled filter, both
vLLM sidecars), issue 28.

Every OpenAI / Anthropic / tokenize body of `infermesh.fuzz_inputs` (wrong types, nested ones too,
lone surrogates, deep nesting, truncation, bytes that are not UTF-8) and mutated gRPC `Generate`
calls (odd field values, and raw bytes that are no protobuf at all) go through the mesh listener.
Fixed seeds, a time budget per protocol. For every answer: no 5xx (gRPC: no INTERNAL, UNKNOWN,
UNAVAILABLE, DATA_LOSS), an error is JSON with a message, nothing hangs past its deadline; neither
sidecar counted an internal error; and a plain chat and a plain gRPC call are still served after.
"""

from __future__ import annotations

import random
import re
import time
import urllib.request

import grpc
import httpx
import pytest

from infermesh import fuzz_inputs
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

SEED = 2028
HTTP_BUDGET_S = 45.0
GRPC_BUDGET_S = 20.0
MIN_CASES = 40
REQUEST_TIMEOUT_S = 30.0
"""A case that gets no answer within this is a hang (a plain 4-token chat takes well under 1 s)."""

BAD_GRPC = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
            grpc.StatusCode.DEADLINE_EXCEEDED}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def internal_errors(mesh) -> float:
    """`infermesh_internal_errors_total` summed over every sidecar, read from each sidecar itself."""
    total = 0.0
    for pool in ("interactive", "batch"):
        with urllib.request.urlopen(mesh.sidecar_url(pool) + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                m = re.match(r"^infermesh_internal_errors_total(?:\{.*\})? (\S+)$", line)
                if m:
                    total += float(m.group(1))
    return total


def test_mutated_openai_requests_through_the_mesh_get_no_5xx(local_mesh):
    before = internal_errors(local_mesh)
    statuses: dict[int, int] = {}
    done = 0
    deadline = time.monotonic() + HTTP_BUDGET_S
    with httpx.Client(base_url=local_mesh.base_url, timeout=REQUEST_TIMEOUT_S) as client:
        for case in fuzz_inputs.api_cases(SEED, 10_000, model="tiny-llama"):
            if done >= MIN_CASES and time.monotonic() > deadline:
                break
            r = client.request(case.method, case.path, content=case.body, headers=case.headers)
            fuzz_inputs.check_answer(r, case)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            done += 1
        print(f"[fuzz] {done} mutated requests through the mesh: {dict(sorted(statuses.items()))}")
        assert any(s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses), "the mutations hit both paths"
        ok = client.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    assert internal_errors(local_mesh) == before


def grpc_cases(seed: int, n: int):
    """(kind, raw request bytes) for Generate: proto messages with odd values, and bytes that are no
    protobuf (a client sending garbage on a valid gRPC frame)."""
    rng = random.Random(seed)
    odd_text = ["", "\x00", "😀", "x" * 5000, "{", "[" * 2000, '{"type": "object"}', '{"type": 5}', '"\\ud800"',
                '{"a":' * 300 + "1" + "}" * 300, "NaN", "(((((", "[a-"]
    for _ in range(n):
        kind = rng.choice(["fields", "fields", "schema", "regex", "choice", "garbage"])
        req = pb.GenerateRequest(max_tokens=rng.choice([0, 1, 4, 2**32 - 1]))
        if rng.random() < 0.5:
            req.chat.messages.append(pb.ChatMessage(role=rng.choice(["user", "system", "assistant", "", "x" * 300]), content=rng.choice(odd_text)))
        else:
            req.text = rng.choice(odd_text + ["hi"])
        if kind == "fields":
            req.model = rng.choice(["", "tiny-llama", "nope", "x" * 1000, "\x00"])
            req.n = rng.choice([0, 1, 2, 1000, 2**32 - 1])
            req.request_class = rng.choice(["", "interactive", "critical", "made-up", "\x00" * 3])
            if rng.random() < 0.5:
                req.temperature = rng.choice([-1.0, 0.0, 1e30, float("nan"), float("inf")])
            if rng.random() < 0.5:
                req.top_p = rng.choice([-1.0, 0.0, 2.0, float("nan")])
            if rng.random() < 0.5:
                req.top_k = rng.choice([-5, 0, 2**31 - 1])
            if rng.random() < 0.3:
                req.seed = rng.choice([-(2**63), 2**63 - 1])
            req.top_logprobs = rng.choice([0, 5, 100])
            req.logprobs = rng.random() < 0.5
            req.stop_token_ids.extend(rng.choice([[], [0], [2**32 - 1]]))
        elif kind == "schema":
            req.structured_output.json_schema = rng.choice(odd_text)
        elif kind == "regex":
            req.structured_output.regex = rng.choice(odd_text)
        elif kind == "choice":
            req.structured_output.choice.choices.extend(rng.choice([[], [""], ["a", "\x00"], ["x" * 5000]]))
        data = req.SerializeToString()
        if kind == "garbage":
            data = rng.choice([b"\xff" * 8, b"\x0a\xff\xff\xff\xff\x0f", data[: max(0, len(data) - 3)] + b"\xff", bytes(rng.randrange(256) for _ in range(40))])
        yield kind, data


def test_mutated_grpc_calls_through_the_mesh_get_no_internal_errors(local_mesh):
    before = internal_errors(local_mesh)
    codes: dict[str, int] = {}
    done = 0
    deadline = time.monotonic() + GRPC_BUDGET_S
    with grpc.insecure_channel(f"127.0.0.1:{local_mesh.plan.listen_port}") as ch:
        raw = ch.unary_stream("/infermesh.v1.Inference/Generate", request_serializer=lambda b: b,
                              response_deserializer=pb.GenerateResponse.FromString)
        for kind, data in grpc_cases(SEED, 10_000):
            if done >= MIN_CASES and time.monotonic() > deadline:
                break
            try:
                list(raw(data, timeout=REQUEST_TIMEOUT_S))
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
                assert code not in BAD_GRPC, f"{code} {e.details()!r} <- {kind}: {data[:120]!r}"
            codes[code.name] = codes.get(code.name, 0) + 1
            done += 1
        print(f"[fuzz] {done} mutated gRPC calls through the mesh: {dict(sorted(codes.items()))}")
        assert codes.get("OK") and codes.get("INVALID_ARGUMENT"), "the mutations hit both paths"
        chunks = list(pb_grpc.InferenceStub(ch).Generate(
            pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hi")]), max_tokens=4), timeout=30))
        assert chunks and chunks[-1].HasField("final")
    assert internal_errors(local_mesh) == before
