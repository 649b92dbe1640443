"""The static Envoy bootstrap of the mesh: the parts of envoy_resources.py assembled into one
file for a single `envoy -c` (routes and endpoints inline), what `infermesh policy render FILE
envoy`, the filter tests and the filter benchmark run. The control plane assembles the same
parts over xDS (xds_snapshot.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from .envoy_resources import (
    FILTER_STATS_TAGS,
    LAYERED_RUNTIME,
    MeshListener,
    PoolEndpoint,
    admin,
    cluster,
    http_connection_manager,
    inline_routes,
    listener,
    pool_clusters,
    state_clusters,
)

__all__ = ["MeshListener", "PoolEndpoint", "bootstrap", "write_bootstrap"]


def bootstrap(m: MeshListener) -> dict:
    return {
        "stats_config": {"stats_tags": copy.deepcopy(FILTER_STATS_TAGS)},
        "layered_runtime": copy.deepcopy(LAYERED_RUNTIME),
        "admin": admin(m.admin_port),
        "static_resources": {
            "listeners": [listener(m, http_connection_manager(m, inline_routes(m)))],
            "clusters": [*(cluster(m, p, grpc, eds=False) for p, grpc in pool_clusters(m)), *state_clusters(m, eds=False)],
        },
    }


def write_bootstrap(m: MeshListener, path: Path) -> Path:
    path.write_text(json.dumps(bootstrap(m), indent=2))
    return path
