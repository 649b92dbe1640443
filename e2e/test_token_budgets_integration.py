"""Integration: token budgets (docs/token-budgets.md) through the real Envoy with the compiled
filter, in both runtimes (the Wasm module's table in proxy-wasm shared data, the native module's
process-wide one), in front of echo upstreams (conftest's `echo_server`: the status a request
asks for in `x-test-status`, after the delay in `x-test-delay-ms`, and the headers they got).

The filter config is the one a policy writes (`Policy.filter_config()`). The trusted hop before
the mesh is a client bound to 127.0.0.2 (the policy trusts that address only); any other client
connects from 127.0.0.1. Envoy runs two workers, so the burst test races both on one table.
Reservations: a chat of one 5-byte message with `max_tokens: 100` reserves 5 + 8 + 100 = 113 tokens. Windows are per day, so no test straddles a window's reset
(short of midnight UTC).
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from e2e.conftest import echo_server
from e2e.test_filter_envoy_integration import RUNTIMES, filter_envoy, filter_stats
from infermesh.launcher import free_ports
from infermesh.meshconfig.policy import parse_policy

POLICY = """
version: 1
default_class: batch
classes:
  interactive: {pool: interactive}
  batch: {pool: batch}
rules:
  - {name: chat, class: interactive, match: {methods: [POST], path: {prefix: /v1/chat/completions}}}
filter: {trusted_cidrs: [127.0.0.2/32]}
pools:
  interactive: {models: [{name: m}]}
  batch: {models: [{name: m}]}
budgets:
  tenant: {header: x-tenant-id}
  classes:
    interactive:
      default: {tokens: {per_day: 1000}}
      tenants:
        team-a: {tokens: {per_day: 300}}
        team-s: {concurrent_streams: 1}
        team-burst: {tokens: {per_day: 1130}}
"""
COST = 5 + 8 + 100
TRUSTED, OUTSIDE = "127.0.0.2", "127.0.0.1"


@pytest.fixture(scope="module")
def status_upstreams():
    ports = dict(zip(("interactive", "batch"), free_ports(2)))
    servers = {pool: echo_server(pool, port) for pool, port in ports.items()}
    yield servers
    for s in servers.values():
        s.shutdown()
        s.server_close()


@pytest.fixture(scope="module", params=RUNTIMES)
def envoy(request, status_upstreams, tmp_path_factory):
    config = parse_policy(POLICY, "budgets.yaml").filter_config()
    assert config["budgets"]["classes"]["interactive"]["default_max_tokens"] == 256
    pools = {pool: s.server_address[1] for pool, s in status_upstreams.items()}
    e = filter_envoy(request, tmp_path_factory.mktemp(f"budgets-{request.param}"), config, pools, request.param, concurrency=2)
    assert e.wait_ready(), "envoy did not start:\n" + e.log()[-3000:]
    yield e
    e.stop()


def chat(envoy, tenant: str | None, source: str = TRUSTED, headers: dict | None = None, timeout: float = 10):
    """POST a one-message chat from `source`: (status, response headers, JSON body)."""
    port = int(envoy.base.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    body = json.dumps({"model": "m", "max_tokens": 100, "stream": False, "messages": [{"role": "user", "content": "hello"}]})
    h = {"content-type": "application/json"} | ({"x-tenant-id": tenant} if tenant else {}) | (headers or {})
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"null")
    finally:
        conn.close()


def test_a_tenant_over_its_budget_gets_429_with_the_headers_and_another_is_served(envoy, status_upstreams):
    upstream = status_upstreams["interactive"]
    for i in (1, 2):
        status, headers, got = chat(envoy, "team-a")
        assert status == 200 and got["upstream"] == "interactive", (status, got)
        assert got["headers"]["x-tenant-id"] == "team-a", "a trusted hop's tenant reaches the pool"
        assert headers["x-ratelimit-limit-tokens"] == "300"
        assert headers["x-ratelimit-remaining-tokens"] == str(300 - i * COST)
        assert headers["x-ratelimit-reset-tokens"].endswith("s")
    before = len(upstream.seen)
    status, headers, got = chat(envoy, "team-a")
    assert status == 429, (status, got)
    assert got["error"]["code"] == "token_budget_exceeded" and got["error"]["type"] == "rate_limit_error", got
    assert 1 <= int(headers["retry-after"]) <= 86_400
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == ("300", str(300 - 2 * COST))
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    assert len(upstream.seen) == before, "refused before any upstream work"
    # Another tenant (not listed: the default budget, a count of its own) is served.
    status, headers, _ = chat(envoy, "team-b")
    assert status == 200 and headers["x-ratelimit-remaining-tokens"] == str(1000 - COST)
    stats = filter_stats(envoy.admin, envoy.runtime)
    assert stats["infermesh.budget_refusals_total.class.interactive.tenant.team-a"] == 1, stats
    assert "infermesh.budget_refusals_total.class.interactive.tenant.team-b" not in stats, "labels: the policy's tenants and other"


def test_a_client_cannot_forge_the_tenant_header(envoy, status_upstreams):
    refused = filter_stats(envoy.admin, envoy.runtime)["infermesh.budget_refusals_total.class.interactive.tenant.other"]
    # From outside the trust rules the header is removed: every such request is `other`'s
    # (the default budget, 1000 a day: 8 chats), whatever tenant it names.
    for i in range(8):
        status, headers, got = chat(envoy, f"team-forged-{i}", source=OUTSIDE)
        assert status == 200, (status, got)
        assert "x-tenant-id" not in got["headers"], "stripped before it reaches a pool"
        assert headers["x-ratelimit-remaining-tokens"] == str(1000 - (i + 1) * COST)
    status, _, got = chat(envoy, "team-forged-9", source=OUTSIDE)
    assert status == 429 and "tenant other" in got["error"]["message"], got
    # The tenant it named still has its whole budget when a trusted hop names it.
    status, headers, _ = chat(envoy, "team-forged-9")
    assert status == 200 and headers["x-ratelimit-remaining-tokens"] == str(1000 - COST)
    assert filter_stats(envoy.admin, envoy.runtime)["infermesh.budget_refusals_total.class.interactive.tenant.other"] == refused + 1


def test_an_upstream_error_gives_the_reservation_back(envoy):
    # 12 x 113 would be past the 1000 of the default budget: the errors are never charged.
    for _ in range(12):
        status, headers, _ = chat(envoy, "team-e", headers={"x-test-status": "503"})
        assert status == 503, status
        assert "x-ratelimit-remaining-tokens" not in headers
    status, headers, _ = chat(envoy, "team-e")
    assert status == 200 and headers["x-ratelimit-remaining-tokens"] == str(1000 - COST)


def test_a_vanished_clients_stream_gives_its_slot_back(envoy, status_upstreams):
    # team-s may have one stream in flight: a slow one holds it, a second is refused...
    outcome: list = []

    def slow_call():
        try:
            outcome.append(chat(envoy, "team-s", headers={"x-test-delay-ms": "3000"}, timeout=0.5))
        except OSError as e:  # the client gives up and closes its connection
            outcome.append(e)

    def reached() -> int:  # the upstreams outlive one runtime's Envoy: count, don't look for any
        return sum(h.get("x-tenant-id") == "team-s" for h in status_upstreams["interactive"].seen)

    before = reached()
    slow = threading.Thread(target=slow_call)
    slow.start()
    deadline = time.monotonic() + 5
    while reached() == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reached() == before + 1, "the slow chat reached the pool"
    status, headers, got = chat(envoy, "team-s")
    assert status == 429 and "1 streams are already in flight" in got["error"]["message"], (status, got)
    assert headers["retry-after"] == "1"
    slow.join()
    assert isinstance(outcome[0], TimeoutError), outcome
    # ...and once its client has gone (Envoy resets the stream; the upstream is still asleep),
    # the slot is back.
    deadline = time.monotonic() + 2
    while (status := chat(envoy, "team-s")[0]) == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 200


def test_a_burst_of_64_concurrent_chats_never_overshoots_a_budget(envoy, status_upstreams):
    """Issue 31's target: with `max_tokens` stated, no overshoot at all. 64 chats at once (each held
    300 ms upstream, so all are in flight together, across Envoy's two workers) against a budget of
    exactly ten reservations: ten are served, 54 refused, and only ten reach the pool."""
    upstream = status_upstreams["interactive"]
    before = sum(h.get("x-tenant-id") == "team-burst" for h in upstream.seen)
    start = threading.Barrier(64)
    results: list[int] = []
    lock = threading.Lock()

    def one():
        start.wait()
        status, _, _ = chat(envoy, "team-burst", headers={"x-test-delay-ms": "300"})
        with lock:
            results.append(status)

    threads = [threading.Thread(target=one) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set(results)) == [200, 429] and results.count(200) == 10, sorted(results)
    assert sum(h.get("x-tenant-id") == "team-burst" for h in upstream.seen) - before == 10
    # The table agrees: nothing is left for the tenant (10 x 113 = 1130).
    status, headers, _ = chat(envoy, "team-burst")
    assert status == 429 and headers["x-ratelimit-remaining-tokens"] == "0", (status, headers)
