"""Integration: native header rules. The same filter config served two ways by the real Envoy
with the compiled filter — the filter deciding every request, and Envoy's route table deciding
the rules it can match itself with the filter only on the routes where a body (or a regex) may
decide — must route every request of a mixed matrix to the same pool with the same headers.
Natively decided requests never enter the Wasm VM."""

from __future__ import annotations

import json
import urllib.request

import pytest

from e2e.test_filter_envoy_integration import EnvoyUnderTest, metric, not_found, prom
from infermesh.meshconfig.envoy_resources import EDGE_PATHS

CONFIG = {
    "version": 1,
    "default_class": "batch",
    "classes": {"interactive": {"pool": "interactive", "objective": "chat-latency"}, "batch": {"pool": "batch"}},
    "rules": [
        {"name": "vip", "class": "interactive", "match": {"headers": [{"name": "x-priority", "exact": "high"}]}},
        {"name": "no-bulk-hint", "class": "interactive",
         "match": {"path": {"exact": "/v1/hint"}, "headers": [{"name": "x-bulk", "present": False}]}},
        {"name": "chat-bulk", "class": "batch",
         "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}, "body": {"stream": False, "max_tokens": {"min": 1024}}}},
        {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
        {"name": "tenant", "class": "interactive", "match": {"headers": [{"name": "x-tenant", "prefix": "team-"}, {"name": "x-debug"}]}},
        {"name": "models", "class": "interactive", "match": {"methods": ["GET", "head"], "path": {"exact": "/v1/models"}}},
        {"name": "v2", "class": "interactive", "match": {"path": {"regex": "^/v2/"}}},
        {"name": "after-regex", "class": "interactive", "match": {"path": {"prefix": "/v3/"}}},
    ],
    "emit_objective_header": True,
}

# Paths outside the serving API that the rules below match on (an exact path, a regex, a prefix
# after a regex): the listener serves them too here, so both forms decide them.
MADE_UP_PATHS = ("/v1/hint", "/v2/anything", "/v3/after")

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
REQUESTS = [
    ("POST", "/v1/completions", {"x-priority": "high"}, {}),
    ("POST", "/v1/completions", {"x-priority": "low"}, {}),
    ("POST", "/v1/chat/completions", {}, CHAT | {"stream": True}),
    ("POST", "/v1/chat/completions", {}, CHAT | {"stream": False, "max_tokens": 2000}),
    ("POST", "/v1/chat/completions?api-version=2", {}, CHAT | {"stream": False, "max_tokens": 2000}),
    ("POST", "/v1/chat/completions", {"x-priority": "high"}, CHAT | {"stream": False, "max_tokens": 2000}),
    ("POST", "/v1/chat/completions", {"content-type": "text/plain"}, CHAT),
    ("GET", "/v1/chat/completions", {}, None),
    ("POST", "/v1/hint", {}, {}),
    ("POST", "/v1/hint?q=1", {}, {}),
    ("POST", "/v1/hint", {"x-bulk": "1"}, {}),
    ("POST", "/v1/completions", {"x-tenant": "team-a", "x-debug": ""}, {}),
    ("POST", "/v1/completions", {"x-tenant": "team-a"}, {}),
    ("POST", "/v1/completions", {"x-tenant": "other", "x-debug": "1"}, {}),
    ("GET", "/v1/models", {}, None),
    ("PUT", "/v1/models", {}, {}),
    ("POST", "/v1/models", {}, {}),
    ("POST", "/v2/anything", {}, {}),
    ("POST", "/v3/after", {}, {}),
    # Spoofed routing headers: stripped before any route is chosen, in both forms.
    ("POST", "/v1/completions", {"x-infermesh-pool": "interactive", "x-infermesh-class": "interactive", "x-infermesh-rule": "vip"}, {}),
    ("POST", "/v1/chat/completions", {"x-infermesh-pool": "batch"}, CHAT | {"stream": True}),
]


def send(base: str, method: str, path: str, headers: dict, body: dict | None) -> tuple:
    data = None if body is None else json.dumps(body).encode()
    h = {"content-type": "application/json"} | headers
    req = urllib.request.Request(base + path, data=data, method=method, headers=h)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        got = json.loads(r.read())
    h = got["headers"]
    return got["upstream"], h.get("x-infermesh-pool"), h.get("x-infermesh-class"), h.get("x-infermesh-rule"), h.get("x-gateway-inference-objective")


@pytest.fixture(scope="module")
def pair(upstreams, tmp_path_factory):
    envoys = {}
    for native in (False, True):
        e = EnvoyUnderTest(tmp_path_factory.mktemp(f"native-{native}"), CONFIG, upstreams, native_rules=native,
                           edge_paths=EDGE_PATHS + MADE_UP_PATHS)
        assert e.wait_ready(), e.log()[-3000:]
        envoys[native] = e
    yield envoys
    for e in envoys.values():
        e.stop()


def test_native_rules_route_every_request_as_the_filter_does(pair):
    filter_side = [send(pair[False].base, *r) for r in REQUESTS]
    native_side = [send(pair[True].base, *r) for r in REQUESTS]
    for req, a, b in zip(REQUESTS, filter_side, native_side):
        assert a == b, f"{req}: filter {a} != native {b}"
    # The matrix exercises every kind of decision.
    rules = {d[3] for d in filter_side}
    assert rules == {"vip", "no-bulk-hint", "chat-bulk", "chat", "tenant", "models", "v2", "after-regex", "default"}, rules
    assert ("batch", "batch", "batch", "default", "batch") in filter_side, "the spoofed headers were ignored"
    # A path neither the serving API nor the rules' made-up paths: the same 404 in both forms,
    # whatever header rule it would match.
    for e in pair.values():
        for path in ("/v1/embeddings", "/v2", "/v3"):
            for headers in ({}, {"x-priority": "high"}, {"x-tenant": "team-a", "x-debug": ""}):
                assert not_found(e.base, path, headers=headers)["code"] == "not_found", (path, headers)


def test_natively_decided_requests_never_enter_the_vm(pair):
    native = pair[True]
    before = prom(native)
    for _ in range(5):
        send(native.base, "POST", "/v1/completions", {"x-priority": "high"}, {})  # rule vip: native
        send(native.base, "GET", "/v1/models", {}, None)                         # rule models: native
    send(native.base, "POST", "/v1/chat/completions", {}, CHAT | {"stream": True})  # the filter decides (body rule on the path)
    after = prom(native)
    vm = lambda text, rule: metric(text, "infermesh_requests_total", rule=rule)  # noqa: E731
    assert vm(after, "vip") == vm(before, "vip") and vm(after, "models") == vm(before, "models"), "the filter ran"
    assert vm(after, "chat") == vm(before, "chat") + 1
    # Natively decided requests are counted per route, tagged like the filter's counter.
    route = lambda text, rule: metric(text, "envoy_vhost_route_upstream_rq_total", rule=rule)  # noqa: E731
    assert route(after, "vip") - route(before, "vip") == 5 and route(after, "models") - route(before, "models") == 5
