"""e2e: the gRPC sampling surface through the real mesh (Envoy + compiled filter + vLLM sidecars),
with the real grpcio client: structured outputs (JSON schema, choice, regex) on vLLM's own
backends, log probabilities per chunk, penalties, min_tokens against stop tokens, and bad values
refused as INVALID_ARGUMENT naming the field (vLLM's own checks), never INTERNAL.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest

from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

PROMPT = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Describe the weather today.")])
SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stub(local_mesh):
    with grpc.insecure_channel(f"127.0.0.1:{local_mesh.plan.listen_port}") as ch:
        yield pb_grpc.InferenceStub(ch)


def generate(stub, **fields) -> tuple[list[pb.TokenChunk], pb.Final]:
    fields.setdefault("chat", PROMPT)
    fields.setdefault("temperature", 0)
    msgs = list(stub.Generate(pb.GenerateRequest(**fields), timeout=120))
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    (final,) = [m.final for m in msgs if m.HasField("final")]
    return chunks, final


def text_of(chunks) -> str:
    return "".join(c.text for c in chunks)


def ids_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_a_json_schema_constrained_generation_parses_and_matches_the_schema(stub):
    """JSON allows whitespace between its tokens, and the small model's random weights prefer a
    newline there at temperature 0: left alone it fills max_tokens with newlines inside the object
    (seen: finish `length` at 200 tokens; vLLM 0.32 takes `disable_any_whitespace` only as an
    engine setting, not per request). Frequency and presence penalties make each repeated
    whitespace token less likely, so the grammar's other tokens win and the object closes."""
    chunks, final = generate(stub, max_tokens=200, structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
                             frequency_penalty=2.0, presence_penalty=2.0)
    assert final.finish_reason == "stop", (final, text_of(chunks))
    value = json.loads(text_of(chunks))
    assert set(value) == {"color", "count"} and value["color"] in ("red", "green", "blue")
    assert isinstance(value["count"], int) and 0 <= value["count"] <= 9
    assert final.served_by == "interactive/0"


def test_a_choice_constraint_returns_one_of_the_choices(stub):
    choices = ["sunny", "cloudy", "raining"]
    for prompt in ("Hi", "What is the weather?"):
        chunks, final = generate(stub, chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=prompt)]), max_tokens=20,
                                 structured_output=pb.StructuredOutput(choice=pb.ChoiceList(choices=choices)))
        assert text_of(chunks) in choices and final.finish_reason == "stop"


def test_a_regex_constraint_is_matched(stub):
    chunks, final = generate(stub, max_tokens=20, structured_output=pb.StructuredOutput(regex="[0-9]{3}-[a-z]{2}"))
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text_of(chunks)), text_of(chunks)


def test_logprobs_come_with_every_chunk(stub):
    chunks, final = generate(stub, max_tokens=10, logprobs=True, top_logprobs=3)
    assert final.usage.completion_tokens == 10 == len(ids_of(chunks))
    for c in chunks:
        assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
        for lp in c.logprobs:
            assert len(lp.top_logprobs) == 3
            tops = [t.logprob for t in lp.top_logprobs]
            assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
            # Greedy (temperature 0): the sampled token is the most likely one.
            assert lp.rank == 1 and lp.top_logprobs[0].token_id == lp.token_id
            assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob)
    only, _ = generate(stub, max_tokens=4, logprobs=True)
    assert all(len(c.logprobs) == len(c.token_ids) and not any(lp.top_logprobs for lp in c.logprobs) for c in only)
    plain, _ = generate(stub, max_tokens=4)
    assert not any(c.logprobs for c in plain), "none asked, none sent"


def test_penalties_and_sampling_filters_are_accepted(stub):
    base, _ = generate(stub, max_tokens=24)
    chunks, final = generate(stub, max_tokens=24, presence_penalty=1.5, frequency_penalty=1.5, repetition_penalty=1.8,
                             top_k=5, min_p=0.05, seed=7)
    assert final.usage.completion_tokens == 24 and final.finish_reason == "length"
    # Greedy, the small model repeats a token or two (seen: 317 x13, 535 x11); penalised, it cannot.
    assert len(set(ids_of(chunks))) > len(set(ids_of(base))), (ids_of(base), ids_of(chunks))
    same, _ = generate(stub, max_tokens=24, presence_penalty=1.5, frequency_penalty=1.5, repetition_penalty=1.8,
                       top_k=5, min_p=0.05, seed=7)
    assert ids_of(same) == ids_of(chunks), "same settings, same seed: same tokens"


def test_min_tokens_holds_back_stop_tokens_as_ignore_eos_would(stub):
    """The model's first greedy token made a stop token ends the generation at once; with
    min_tokens it cannot be generated (nor end-of-sequence) before min_tokens tokens."""
    base, _ = generate(stub, text="Once upon a time", max_tokens=8)
    first = ids_of(base)[0]
    stopped, final = generate(stub, text="Once upon a time", max_tokens=8, stop_token_ids=[first])
    assert final.finish_reason == "stop" and final.usage.completion_tokens == 1
    held, final = generate(stub, text="Once upon a time", max_tokens=8, stop_token_ids=[first], min_tokens=5)
    ids = ids_of(held)
    assert final.usage.completion_tokens >= 5 and first not in ids[:5], (final, ids)


@pytest.mark.parametrize("fields, field", [
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),   # above vLLM's max_logprobs (20)
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop_token_ids": [10_000_000]}, "stop_token_ids"),        # out of the vocabulary
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"structured_output": pb.StructuredOutput(json_schema="{not json")}, "structured_output.json_schema"),
    ({"structured_output": pb.StructuredOutput(json_schema='{"type": "no-such-type"}')}, "structured_output"),
    ({"structured_output": pb.StructuredOutput(regex="([a-z")}, "structured_output"),
    ({"structured_output": pb.StructuredOutput(choice=pb.ChoiceList())}, "structured_output"),
    ({"structured_output": pb.StructuredOutput()}, "structured_output"),
])
def test_bad_fields_are_refused_naming_the_field(stub, fields, field):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, max_tokens=fields.pop("max_tokens", 8), **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert e.value.details().startswith(f"{field}: ") or e.value.details().startswith(f"{field} "), e.value.details()


def test_the_pool_still_serves_after_refusals(stub):
    chunks, final = generate(stub, max_tokens=4)
    assert final.usage.completion_tokens == 4 and final.finish_reason == "length"
