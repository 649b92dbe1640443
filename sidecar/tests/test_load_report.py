"""The ORCA load report each generation response carries for Envoy's weighted round robin: the
fields Envoy needs (it drops a report without rps_fractional), utilization from the KV cache and
the requests in flight, and the text form Envoy's parser reads."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.http_api import build_app
from infermesh.sidecar.load_report import ORCA_HEADER, LoadReporter
from infermesh.sidecar.response_headers import LOAD_HEADER, load_value

# Envoy's TEXT form: `TEXT key=value,...`, known keys, each once, non-negative numbers.
TEXT = re.compile(r"^TEXT rps_fractional=(?P<num>[0-9.]+),eps=(?P<eps>[0-9.]+),application_utilization=(?P<u>[0-9.]+),"
                  r"named_metrics\.rps=(?P<rps>[0-9.]+)$")


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_rates_count_the_window_and_utilization_takes_the_larger_of_kv_and_slots():
    clock, inflight, kv = FakeClock(), [0], [None]
    r = LoadReporter(8, lambda: inflight[0], lambda: kv[0], window_s=5, clock=clock)
    for _ in range(10):
        r.on_admitted()
    r.on_failed()
    inflight[0] = 4
    rep = r.report()
    assert (rep.rps, rep.eps, rep.utilization) == (2.0, 0.2, 0.5)
    kv[0] = 0.9
    assert r.report().utilization == 0.9
    inflight[0] = 16  # a waiting queue: above 1
    assert r.report().utilization == 2.0
    clock.t += 6
    inflight[0], kv[0] = 0, 0.0
    rep = r.report()
    assert (rep.rps, rep.eps) == (0.0, 0.0) and rep.utilization > 0  # never 0: Envoy would use cpu_utilization


def test_the_header_is_envoys_text_form():
    clock = FakeClock()
    r = LoadReporter(32, lambda: 3, lambda: 0.25, clock=clock)
    r.on_admitted()
    m = TEXT.match(r.report().header_value())
    assert m and float(m["rps"]) == 0.2 and float(m["u"]) == 0.25
    # Envoy's weight is rps_fractional / utilization: a constant numerator makes it headroom.
    assert float(m["num"]) == 1.0


def test_every_generation_response_carries_a_report(make_vllm_pool):
    pool = make_vllm_pool(SidecarConfig.model_validate({"pool": "p", "models": [{"name": "m", "path": "/x", "max_num_seqs": 4}]}))
    c = TestClient(build_app(pool))
    for stream in (False, True):
        r = c.post("/v1/completions", json={"prompt": "x", "stream": stream})
        m = TEXT.match(r.headers[ORCA_HEADER])
        assert m, r.headers[ORCA_HEADER]
        assert float(m["rps"]) > 0  # this request was admitted
        # A stream reports with its first token (itself in flight, of 4 slots); a whole response
        # after its request was released.
        assert float(m["u"]) == (0.25 if stream else 0.05)


def test_every_generation_response_carries_its_utilization_for_the_filter(make_vllm_pool):
    """`x-infermesh-load` is the ORCA report's application_utilization with 3 decimals: the filter's
    prefix table reads it (the route removes the ORCA header before any filter sees it)."""
    pool = make_vllm_pool(SidecarConfig.model_validate({"pool": "p", "models": [{"name": "m", "path": "/x", "max_num_seqs": 4}]}))
    c = TestClient(build_app(pool))
    for stream in (False, True):
        r = c.post("/v1/completions", json={"prompt": "x", "stream": stream})
        m = TEXT.match(r.headers[ORCA_HEADER])
        assert r.headers[LOAD_HEADER] == f"{float(m['u']):.3f}", (r.headers[LOAD_HEADER], m["u"])
        assert re.fullmatch(r"[0-9]+\.[0-9]{3}", r.headers[LOAD_HEADER])
    assert load_value(2.0) == "2.000" and load_value(0.05) == "0.050"
