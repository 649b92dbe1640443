"""This sidecar's load, as an ORCA report for Envoy's client-side weighted round robin.

Envoy 1.40 reads `endpoint-load-metrics: TEXT rps_fractional=…,eps=…,application_utilization=…`
from a response's headers (or trailers) and weighs each endpoint by
`rps_fractional / (application_utilization + eps / rps_fractional × penalty)`, so the report needs
all three. vLLM's own ORCA header has no `rps_fractional` and is ignored by Envoy, hence this.

Why the per-response header and not Envoy's out-of-band ORCA stream: every response already
passes through Envoy, the header costs one line, needs no extra gRPC server per sidecar, and a
busy replica (the one whose weight matters) reports most often. An idle replica reports nothing
and falls back to the median weight once its last report expires, which is what lets a replica
that was starved get traffic again.

- application_utilization: the larger of the KV cache's use and the requests in flight (running
  plus waiting) per `max_num_seqs` sequence slot; a waiting queue pushes it above 1.
- rps_fractional: a constant 1, so Envoy's weight is 1 / (utilization + eps × penalty): a
  replica's share follows its headroom. The real request rate would make the weight
  rps / utilization, which rewards the busiest replica here: a request's cost is its length, not
  its count, and the share a replica wins raises its rate and so its weight again
  (docs/replicas.md). The measured rate is reported as `named_metrics.rps`.
- eps: requests that failed on the server side (5xx) over the last `window_s`, per second.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

ORCA_HEADER = "endpoint-load-metrics"

WEIGHT_NUMERATOR = 1.0
"""What the report sends as `rps_fractional` (see above)."""

MIN_UTILIZATION = 0.05
"""Envoy falls back to cpu_utilization (which we do not report) when application_utilization
is 0; the floor also bounds how far one replica's weight can rise above another's (the mesh's
host selection retries, envoy_resources.HOST_SELECTION_ATTEMPTS, must outlast that ratio)."""


@dataclass(frozen=True)
class LoadReport:
    rps: float
    """Requests admitted per second over the window (named_metrics.rps)."""
    eps: float
    utilization: float

    def header_value(self) -> str:
        return (f"TEXT rps_fractional={WEIGHT_NUMERATOR:g},eps={self.eps:.4f},application_utilization={self.utilization:.4f},"
                f"named_metrics.rps={self.rps:.4f}")


class LoadReporter:
    """Counts admitted and failed requests over a sliding window and reads the load when asked."""

    def __init__(self, max_num_seqs: int, inflight: Callable[[], int], kv_cache_usage: Callable[[], float | None],
                 window_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.max_num_seqs = max_num_seqs
        self.inflight = inflight
        self.kv_cache_usage = kv_cache_usage
        self.window_s = window_s
        self.clock = clock
        self._admitted: deque[float] = deque()
        self._failed: deque[float] = deque()

    def on_admitted(self) -> None:
        self._admitted.append(self.clock())

    def on_failed(self) -> None:
        self._failed.append(self.clock())

    def _rate(self, q: deque[float]) -> float:
        cutoff = self.clock() - self.window_s
        while q and q[0] < cutoff:
            q.popleft()
        return len(q) / self.window_s

    def report(self) -> LoadReport:
        kv = self.kv_cache_usage() or 0.0
        util = max(kv, self.inflight() / self.max_num_seqs, MIN_UTILIZATION)
        return LoadReport(self._rate(self._admitted), self._rate(self._failed), util)
