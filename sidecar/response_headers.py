"""The headers every generation response carries, for both fronts: who served it and how.

One place, so that each new response header (load reports for Envoy, the pool state the filter
reads) is added once and the HTTP and gRPC fronts cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .pool import Pool


def identity_headers(pool: "Pool", model: str, degraded: bool = False, reason: str = "") -> dict[str, str]:
    """`x-infermesh-model`, `x-infermesh-degraded` (and `-reason`), `x-infermesh-served-by`."""
    h = {"x-infermesh-model": model, "x-infermesh-degraded": "true" if degraded else "false",
         "x-infermesh-served-by": pool.config.served_by}
    if degraded and reason:
        h["x-infermesh-degraded-reason"] = reason
    return h
