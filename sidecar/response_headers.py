"""The headers every generation response carries, for both fronts: who served it and how.

One place, so that each new response header (load reports for Envoy, the pool state the filter
reads) is added once and the HTTP and gRPC fronts cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .load_report import ORCA_HEADER

if TYPE_CHECKING:
    from .pool import Pool


def identity_headers(pool: "Pool", model: str, degraded: bool = False, reason: str = "", load_report: bool = True) -> dict[str, str]:
    """`x-infermesh-model`, `x-infermesh-degraded` (and `-reason`), `x-infermesh-served-by`, and
    the ORCA load report `endpoint-load-metrics` (load_report.py)."""
    h = {"x-infermesh-model": model, "x-infermesh-degraded": "true" if degraded else "false",
         "x-infermesh-served-by": pool.config.served_by}
    if degraded and reason:
        h["x-infermesh-degraded-reason"] = reason
    # For Envoy's weighted round robin only; the mesh's edge removes it (envoy_resources.py).
    if load_report:
        h.update(load_report_header(pool))
    return h


def load_report_header(pool: "Pool") -> dict[str, str]:
    """The ORCA load report alone: gRPC sends it with its initial metadata (the edge can remove
    headers, not trailers)."""
    return {ORCA_HEADER: pool.load.report().header_value()}
