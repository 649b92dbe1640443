"""Integration: the prefix key (docs/prefix-routing.md) through the real Envoy with the compiled
filter, in both runtimes, in front of the echo upstreams (which return the headers they got): a
keyed class's request reaches its pool with the filter's `x-infermesh-prefix-key`, the same
chain the filter's own parser computes; a client's copy never reaches it; requests with no usable
prefix, or of a class without a key, carry none. (Picking a replica by the key: e2e/test_prefix_routing_e2e.py.)
"""

from __future__ import annotations

import json

import pytest

from e2e.test_filter_envoy_integration import RUNTIMES, call, filter_envoy

HEADER = "x-infermesh-prefix-key"
CONFIG = {
    "version": 1,
    "default_class": "batch",
    "classes": {"interactive": {"pool": "interactive", "prefix_key": {"max_keys": 4, "chunk_bytes": 64}}, "batch": {"pool": "batch"}},
    "rules": [
        {"name": "unkeyed", "class": "batch", "match": {"headers": [{"name": "x-plain", "present": True}]}},
        {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
    ],
}
SYSTEM = {"role": "system", "content": "You are tenant 7's assistant. Answer briefly."}


def chat(*turns: str) -> dict:
    roles = ["user", "assistant"]
    return {"model": "m", "stream": True, "messages": [SYSTEM] + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


@pytest.fixture(scope="module", params=RUNTIMES)
def envoy(request, upstreams, tmp_path_factory):
    e = filter_envoy(request, tmp_path_factory.mktemp(f"prefix-{request.param}"), CONFIG, upstreams, request.param)
    assert e.wait_ready(), "envoy did not start:\n" + e.log()[-3000:]
    yield e
    e.stop()


def test_a_conversations_turns_carry_a_chain_that_names_the_turn_before(envoy):
    t1 = call(envoy.base, "/v1/chat/completions", body=chat("hello"))
    t2 = call(envoy.base, "/v1/chat/completions", body=chat("hello", "hi!", "my order"))
    assert t1["upstream"] == t2["upstream"] == "interactive"
    k1, k2 = t1["headers"][HEADER].split(","), t2["headers"][HEADER].split(",")
    assert len(k1) == 1 and len(k2) == 3, (k1, k2)
    assert k2[-1] == k1[-1], "both end with the system prompt's key"
    assert all(len(k) == 16 and int(k, 16) >= 0 for k in k1 + k2)
    # Another tenant's system prompt: another key.
    other = chat("hello")
    other["messages"][0] = {"role": "system", "content": "Another tenant."}
    assert call(envoy.base, "/v1/chat/completions", body=other)["headers"][HEADER] != t1["headers"][HEADER]


def test_a_client_cannot_send_the_prefix_key(envoy):
    spoofed = {HEADER: "00000000000000aa"}
    got = call(envoy.base, "/v1/chat/completions", headers=spoofed, body=chat("hello", "hi!", "again"))
    assert got["headers"][HEADER] != "00000000000000aa" and len(got["headers"][HEADER].split(",")) == 3
    # No usable prefix (one turn, no system prompt), a class without a key, a non-JSON body: none at all.
    one_turn = {"stream": True, "messages": [{"role": "user", "content": "hi"}]}
    for headers, body in [({}, one_turn), ({"x-plain": "1"}, chat("hello")), ({"content-type": "text/plain"}, chat("hello"))]:
        got = call(envoy.base, "/v1/chat/completions", headers=spoofed | headers, body=json.dumps(body).encode())
        assert HEADER not in got["headers"], (headers, got["headers"])
