"""Integration: the real Envoy with the compiled filter (the Wasm module and the native dynamic
module), in front of the echo upstreams: what a client or a trusted peer sends can neither
define a stat nor break the filter.

- A trusted peer's decision is kept and counted by its class and pool, but only under the config's
  names: made-up ones are counted as `other`, and Envoy's /stats holds the same stat names
  before and after (every one was defined when the config was accepted).
- A request header that is not UTF-8 (HTTP allows obs-text; Envoy passes it on) is served as any
  other, and the filter keeps deciding afterwards. The proxy-wasm SDK reads headers with
  `String::from_utf8(..).unwrap()`: before the glue read them as bytes, one such header
  panicked the Wasm VM.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request

import pytest

from e2e.test_filter_envoy_integration import FILTER_CONFIG, EnvoyUnderTest

PREFIX = {"wasm": "wasmcustom.", "native": "dynamicmodulescustom."}
TRUSTED = re.compile(r"infermesh\.requests_total\.class\.(.+)\.pool\.(.+)\.rule\.trusted$")
CLASSES = set(FILTER_CONFIG["classes"]) | {"other"}
POOLS = {c["pool"] for c in FILTER_CONFIG["classes"].values()} | {"other"}


@pytest.fixture(params=["wasm", "native"])
def trusting_envoy(request, upstreams, tmp_path):
    """An Envoy whose filter trusts loopback (the test is the trusted peer)."""
    cfg = dict(FILTER_CONFIG, trusted_sources={"cidrs": ["127.0.0.0/8"]})
    module = request.getfixturevalue("native_module") if request.param == "native" else None
    e = EnvoyUnderTest(tmp_path, cfg, upstreams, native_rules=False, native_module=module)
    assert e.wait_ready(), e.log()[-3000:]
    e.runtime = request.param
    yield e
    e.stop()


@pytest.fixture(params=["wasm", "native"])
def outside_envoy(request, upstreams, tmp_path):
    """An Envoy whose filter trusts no loopback client (the test is an outside client)."""
    module = request.getfixturevalue("native_module") if request.param == "native" else None
    e = EnvoyUnderTest(tmp_path, FILTER_CONFIG, upstreams, native_rules=False, native_module=module)
    assert e.wait_ready(), e.log()[-3000:]
    e.runtime = request.param
    yield e
    e.stop()


def filter_stats(e: EnvoyUnderTest) -> dict[str, int]:
    """Every infermesh counter Envoy holds for the filter (defined ones included, at 0)."""
    prefix = PREFIX[e.runtime]
    text = urllib.request.urlopen(e.admin + "/stats?filter=infermesh", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith(prefix) and value.strip().isdigit():
            out[name[len(prefix):]] = int(value)
    return out


def trusted_stats(e: EnvoyUnderTest) -> dict[tuple[str, str], int]:
    out = {}
    for name, v in filter_stats(e).items():
        m = TRUSTED.match(name)
        if m:
            out[(m.group(1), m.group(2))] = v
    return out


def post(base: str, headers: dict) -> int:
    req = urllib.request.Request(base + "/v1/completions", data=b"{}", method="POST",
                                 headers={"content-type": "application/json"} | headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as err:  # a made-up pool has no route: Envoy's 404 is fine here
        err.read()
        return err.code


def test_a_trusted_peers_made_up_names_are_counted_as_other_and_define_no_stat(trusting_envoy):
    e = trusting_envoy
    defined = trusted_stats(e)
    assert set(defined) == {(c, p) for c in CLASSES for p in POOLS}, "every label pair, defined when the config was accepted"
    assert not any(defined.values())
    names_before = set(filter_stats(e))
    sent = [("interactive", "interactive"), ("interactive", "batch"), ("made-up", "interactive"), ("batch", "made-up")]
    sent += [(f"class-{i}", f"pool-{i}") for i in range(40)]
    for class_, pool in sent:
        post(e.base, {"x-infermesh-class": class_, "x-infermesh-pool": pool})
    after = trusted_stats(e)
    assert set(filter_stats(e)) == names_before, "no stat defined by traffic"
    assert after[("interactive", "interactive")] == 1 and after[("interactive", "batch")] == 1
    assert after[("other", "interactive")] == 1 and after[("batch", "other")] == 1
    assert after[("other", "other")] == 40
    assert sum(after.values()) == len(sent)
    text = urllib.request.urlopen(e.admin + "/stats", timeout=5).read().decode()
    assert "class-7" not in text and "pool-7" not in text and "made-up" not in text


def raw_request(base: str, head: bytes, body: bytes = b"{}") -> tuple[int, dict]:
    """One HTTP/1.1 request with the header bytes as given (urllib would refuse odd bytes)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + head
                  + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    status = int(status_line.split()[1])
    body = rest.partition(b"\r\n\r\n")[2]
    return status, (json.loads(body) if status == 200 else {"raw": body[:200]})


def test_a_header_that_is_not_utf8_is_served_and_the_filter_keeps_deciding(outside_envoy):
    e = outside_envoy
    for head in [b"x-note: caf\xe9\r\n", b"x-infermesh-pool: \xff\xfe\r\n", b"x-priority: \xed\xa0\x80\r\n"]:
        status, got = raw_request(e.base, head)
        assert status == 200, (head, got, e.log()[-2000:])
        h = got["headers"]
        assert (got["upstream"], h["x-infermesh-pool"], h["x-infermesh-rule"]) == ("interactive", "interactive", "chat"), head
    # The filter is still there and deciding (a panicked VM answers nothing, or fails open).
    status, got = raw_request(e.base, b"x-infermesh-pool: batch\r\n")
    assert status == 200 and got["headers"]["x-infermesh-rule"] == "chat" and got["upstream"] == "interactive"
    assert filter_stats(e)["infermesh.stripped_requests_total"] == 2
