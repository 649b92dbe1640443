"""e2e: a gRPC caller cannot choose its class. Through the real mesh (Envoy + compiled filter + vLLM
sidecars), a Generate call whose `request_class` field and `x-infermesh-class` / `x-infermesh-pool`
metadata are spoofed is classified exactly as the same call without them: the filter decides
(rule grpc-generate: interactive) and strips the client's x-infermesh-* metadata, the sidecar
ignores the message's field, and no made-up name becomes a metric label.

What is compared is what the sidecar itself reports: `served_by`, `model`, `degraded` in the
Final message and its own counters on /metrics, read straight from the sidecar (not through Envoy).
"""

from __future__ import annotations

import re
import urllib.request

import grpc
import pytest

from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

MADE_UP = "vip-madeup-e2e"
PROMPT = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hello there")])


def grpc_series(mesh, pool: str) -> dict[tuple, float]:
    """Every sample of the sidecar's request counter for the gRPC front, by (request_class, status);
    and the raw exposition."""
    with urllib.request.urlopen(mesh.sidecar_url(pool) + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[tuple, float] = {}
    for line in text.splitlines():
        m = re.match(r"^infermesh_sidecar_requests_total\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if labels.get("front") == "grpc":
                out[(labels["request_class"], labels["status"])] = float(m.group(2))
    return out, text


def delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after) if after.get(k, 0) != before.get(k, 0)}


def final_of(stub, request: pb.GenerateRequest, metadata=()) -> pb.Final:
    msgs = list(stub.Generate(request, metadata=metadata, timeout=120))
    (final,) = [m.final for m in msgs if m.HasField("final")]
    return final


SPOOFS = [
    ("the field names the other class", {"request_class": "batch"}, ()),
    ("the metadata names the other class", {}, (("x-infermesh-class", "batch"), ("x-infermesh-pool", "batch"))),
    ("made-up names everywhere", {"request_class": MADE_UP},
     (("x-infermesh-class", MADE_UP), ("x-infermesh-pool", MADE_UP + "-pool"))),
]


@pytest.mark.parametrize("what, fields, metadata", SPOOFS, ids=[s[0] for s in SPOOFS])
def test_a_spoofed_grpc_class_is_classified_as_without_it(local_mesh, what, fields, metadata):
    with grpc.insecure_channel(f"127.0.0.1:{local_mesh.plan.listen_port}") as ch:
        stub = pb_grpc.InferenceStub(ch)
        before, _ = grpc_series(local_mesh, "interactive")
        plain = final_of(stub, pb.GenerateRequest(chat=PROMPT, max_tokens=4, temperature=0))
        middle, _ = grpc_series(local_mesh, "interactive")
        spoofed = final_of(stub, pb.GenerateRequest(chat=PROMPT, max_tokens=4, temperature=0, **fields), metadata)
        after, text = grpc_series(local_mesh, "interactive")
    assert (spoofed.served_by, spoofed.model, spoofed.degraded) == (plain.served_by, plain.model, plain.degraded)
    assert plain.served_by == "interactive/0", "rule grpc-generate: the interactive pool"
    assert delta(before, middle) == {("interactive", "OK"): 1}, "the mesh's class, as the sidecar counts it"
    assert delta(middle, after) == delta(before, middle), f"{what}: counted exactly as the plain call"
    assert MADE_UP not in text, "no made-up name in the sidecar's metrics"
    assert {cls for cls, _ in after} <= {"interactive", "batch", "other", ""}


def test_straight_to_the_sidecar_the_message_field_is_ignored_too(local_mesh):
    """A client on the sidecar's own port (no mesh header): its `request_class` is not a class
    and not a label; the request is counted without a class (it gets the default class)."""
    pool = next(p for p in local_mesh.plan.pools if p.name == "interactive")
    with grpc.insecure_channel(f"127.0.0.1:{pool.grpc_port}") as ch:
        stub = pb_grpc.InferenceStub(ch)
        before, _ = grpc_series(local_mesh, "interactive")
        final = final_of(stub, pb.GenerateRequest(chat=PROMPT, max_tokens=4, temperature=0, request_class=MADE_UP))
        after, text = grpc_series(local_mesh, "interactive")
    assert final.served_by == "interactive/0"
    assert delta(before, after) == {("", "OK"): 1}
    assert MADE_UP not in text


DEEP_OBJECT = '{"type": "object", "properties": {"a": ' * 60 + '{"type": "integer"}' + "}}" * 60
SCHEMAS = [
    "[" * 5000 + "]" * 5000, '{"a":' * 300 + "1" + "}" * 300, '"\\ud800"', '{"type": "string", "enum": ["\\udfff"]}',
    '{"\\ud83d": {"type": "string"}}', '{"type": 5}', '{"type": "nope"}', '{"properties": []}', '{"properties": {"a": 5}}',
    '{"type": "string", "pattern": "("}', '{"type": "integer", "minimum": "x"}', '{"$ref": "#/nowhere"}', '{"anyOf": 5}',
    '{"type": "array", "items": 5}', '{"type": "integer", "minimum": 1e400}', "NaN", "5", "[]", DEEP_OBJECT,
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_a_json_schema_of_any_shape_is_served_or_refused_naming_the_field_never_internal(local_mesh, schema):
    """On real vLLM and its structured-output backend (xgrammar), through the mesh."""
    with grpc.insecure_channel(f"127.0.0.1:{local_mesh.plan.listen_port}") as ch:
        stub = pb_grpc.InferenceStub(ch)
        try:
            final = final_of(stub, pb.GenerateRequest(chat=PROMPT, max_tokens=6, temperature=0,
                                                      structured_output=pb.StructuredOutput(json_schema=schema)))
            assert final.served_by == "interactive/0"
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            assert e.details().startswith("structured_output"), e.details()
        assert final_of(stub, pb.GenerateRequest(chat=PROMPT, max_tokens=2)).served_by == "interactive/0"
