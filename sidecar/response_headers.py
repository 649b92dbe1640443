"""The headers every generation response carries, for both fronts: who served it and how.

One place, so that each new response header (load reports for Envoy, the pool state the filter
reads) is added once and the HTTP and gRPC fronts cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from infermesh.settings import LEVEL_DOWN

from .load_report import ORCA_HEADER

if TYPE_CHECKING:
    from .pool import Pool

POOL_LEVEL_HEADER = "x-infermesh-pool-level"
"""`POOL;LEVEL;REPLICA`: the filter's pool state table reads it (filter/src/pool_state.rs) and
strips it before the client; it is internal to the mesh, like every `x-infermesh-*` header."""

LOAD_HEADER = "x-infermesh-load"
"""The replica's utilization, the ORCA report's application_utilization with 3 decimals (above 1
while requests wait): the filter's prefix table bounds picking by prefix with it
(docs/prefix-routing.md) and strips it. Internal like the pool level; the ORCA header itself is
removed by the route before any filter sees the response, hence a header of its own."""


def pool_level(pool: "Pool") -> int:
    """The replica's degradation level as the mesh counts it: its breakers' level (0-3), or
    LEVEL_DOWN while it is not ready or draining (as the control plane's watcher counts it)."""
    if not pool.ready or pool.admission.draining:
        return LEVEL_DOWN
    return pool.policy.level


def pool_level_value(pool: "Pool") -> str:
    cfg = pool.config
    return f"{cfg.pool};{pool_level(pool)};{cfg.instance}"


def identity_headers(pool: "Pool", model: str, degraded: bool = False, reason: str = "", load_report: bool = True) -> dict[str, str]:
    """`x-infermesh-model`, `x-infermesh-degraded` (and `-reason`), `x-infermesh-served-by`, and
    the ORCA load report `endpoint-load-metrics` (load_report.py) with the same utilization in
    the internal `x-infermesh-load` (HTTP only: a gRPC request has no prefix key). The pool level is not among
    them: on the HTTP front every response gets it (state_api.PoolLevelHeader); the gRPC front
    would send it in trailers, which the filter does not read and so could not strip (gRPC-only
    pools are learned by the probe)."""
    h = {"x-infermesh-model": model, "x-infermesh-degraded": "true" if degraded else "false",
         "x-infermesh-served-by": pool.config.served_by}
    if degraded and reason:
        h["x-infermesh-degraded-reason"] = reason
    # For Envoy's weighted round robin only; the mesh's edge removes it (envoy_resources.py).
    if load_report:
        report = pool.load.report()
        h[ORCA_HEADER] = report.header_value()
        h[LOAD_HEADER] = load_value(report.utilization)
    return h


def load_value(utilization: float) -> str:
    """`x-infermesh-load`'s value: the utilization with 3 decimals (the filter parses it)."""
    return f"{utilization:.3f}"


def load_report_header(pool: "Pool") -> dict[str, str]:
    """The ORCA load report alone: gRPC sends it with its initial metadata (the edge can remove
    headers, not trailers)."""
    return {ORCA_HEADER: pool.load.report().header_value()}
