"""The gRPC front's sampling surface: each GenerateRequest field reaches vLLM's SamplingParams
under vLLM's name, a value vLLM's own validation refuses is INVALID_ARGUMENT naming the proto
field, and log probabilities come back per chunk. vLLM's SamplingParams and Logprob are the real
ones; the engine is the conftest's fake (FakeModelEngine), whose engine-level checks (verify) the
e2e test covers on real vLLM."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.logprobs import Logprob

from infermesh.sidecar.engines import ModelEngine, token_logprobs, vllm_bad_request
from infermesh.sidecar.errors import BadRequest, UnknownModel
from infermesh.sidecar.grpc_api import generation_request, grpc_message, token_chunk
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.requests import GenerationRequest, TokenDelta, TokenLogprob

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


def parse(**fields) -> GenerationRequest:
    return generation_request(pb.GenerateRequest(text="hi", **fields), "interactive", max_n=4)


@pytest.fixture
def engine(make_pool) -> ModelEngine:
    return make_pool({"pool": "p", "models": [{"name": "m", "path": "/m", "max_model_len": 512}]}).primary


def kwargs_of(engine, **fields) -> dict:
    return engine.sampling_kwargs(parse(**fields), prompt_len=2, default_max_tokens=16)


def test_every_sampling_field_reaches_vllms_sampling_params(engine):
    kw = kwargs_of(engine, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, top_k=5, min_p=0.1,
                   min_tokens=3, stop_token_ids=[7, 9], logprobs=True, top_logprobs=2, seed=11,
                   structured_output=pb.StructuredOutput(json_schema=SCHEMA))
    assert kw["presence_penalty"] == 0.5 and kw["frequency_penalty"] == -0.5
    assert kw["repetition_penalty"] == pytest.approx(1.2) and kw["min_p"] == pytest.approx(0.1)
    assert (kw["top_k"], kw["min_tokens"], kw["stop_token_ids"], kw["logprobs"], kw["seed"]) == (5, 3, [7, 9], 2, 11)
    assert kw["structured_outputs"] == {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
    constraint = kw.pop("structured_outputs")
    params = SamplingParams(**kw)  # vLLM takes every keyword under these names
    assert (params.top_k, params.min_tokens, params.logprobs, params.stop_token_ids) == (5, 3, 2, [7, 9])
    assert constraint["json"]["required"] == ["a"]


def test_unset_fields_leave_vllms_defaults(engine):
    kw = kwargs_of(engine)
    assert set(kw) == {"max_tokens", "n", "ignore_eos"}
    assert parse().logprobs is None and parse().structured_output is None
    assert parse(logprobs=True).logprobs == 0, "logprobs alone: the sampled token's only"
    assert parse(top_k=0).top_k == 0, "an explicit 0 (all tokens) is kept"


@pytest.mark.parametrize("constraint, expected", [
    (pb.StructuredOutput(regex="[0-9]{3}"), {"regex": "[0-9]{3}"}),
    (pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes", "no"])), {"choice": ["yes", "no"]}),
    (pb.StructuredOutput(json_schema=SCHEMA), {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}),
])
def test_one_structured_output_constraint_each(constraint, expected):
    assert parse(structured_output=constraint).structured_output == expected


@pytest.mark.parametrize("fields, field, message", [
    ({"top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs"),
    ({"structured_output": pb.StructuredOutput(json_schema="{not json")}, "structured_output.json_schema", "is not JSON"),
    ({"structured_output": pb.StructuredOutput(json_schema="[1]")}, "structured_output.json_schema", "must be a JSON object"),
    ({"structured_output": pb.StructuredOutput()}, "structured_output", "needs one of json_schema, regex, choice"),
    ({"n": 5}, "n", "n must be at most 4"),
])
def test_malformed_fields_are_refused_by_the_front(fields, field, message):
    with pytest.raises(BadRequest) as e:
        parse(**fields)
    assert e.value.param == field and message in e.value.message
    assert grpc_message(e.value).startswith(field)


@pytest.mark.parametrize("fields, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
])
def test_values_vllm_refuses_are_refused_naming_the_field(engine, fields, field):
    """vLLM's own SamplingParams checks decide; their error names the field, with or without
    vLLM's `parameter`."""
    kw = kwargs_of(engine, **fields)
    with pytest.raises(Exception) as raised:
        SamplingParams(**kw)
    e = vllm_bad_request(raised.value, set(kw))
    assert isinstance(e, BadRequest) and e.param == field and e.grpc_code.name == "INVALID_ARGUMENT"
    assert grpc_message(e).startswith(field)


def test_vllms_names_become_the_protos_in_messages():
    assert grpc_message(BadRequest("Requested sample logprobs of 30, which is greater than max allowed: 20", param="logprobs")) \
        == "top_logprobs: Requested sample logprobs of 30, which is greater than max allowed: 20"
    assert grpc_message(BadRequest("Choice '[]' cannot be an empty list", param="structured_outputs")).startswith("structured_output: ")
    assert grpc_message(BadRequest("no field")) == "no field"
    assert grpc_message(UnknownModel("x", ["m"])).startswith("The model `x` does not exist")


def test_logprobs_per_token_with_the_top_alternatives_most_likely_first():
    positions = [
        {5: Logprob(-0.1, rank=1, decoded_token="a"), 6: Logprob(-2.5, rank=2, decoded_token="b"), 7: Logprob(-3.0, rank=3, decoded_token="c")},
        {9: Logprob(-4.0, rank=7, decoded_token="z"), 6: Logprob(-0.5, rank=1, decoded_token="b"), 5: Logprob(-1.0, rank=2, decoded_token="a")},
    ]
    got = token_logprobs([5, 9], positions, top_n=2)
    assert got == [TokenLogprob(5, "a", -0.1, 1, [(5, "a", -0.1), (6, "b", -2.5)]),
                   TokenLogprob(9, "z", -4.0, 7, [(6, "b", -0.5), (5, "a", -1.0)])]
    assert [lp.top for lp in token_logprobs([5], positions[:1], top_n=0)] == [[]]
    chunk = token_chunk(TokenDelta("az", [5, 9], 0, got))
    assert [(lp.token_id, lp.token, lp.rank, [t.token_id for t in lp.top_logprobs]) for lp in chunk.logprobs] == \
        [(5, "a", 1, [5, 6]), (9, "z", 7, [6, 5])]
    assert chunk.logprobs[1].logprob == pytest.approx(-4.0)
    assert not token_chunk(TokenDelta("x", [1])).logprobs, "none asked, none sent"
