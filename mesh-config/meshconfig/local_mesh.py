"""A mesh on one machine, from a policy: `replicas` sidecars per pool on 127.0.0.1, Envoy in front.

The policy (mesh-config/policies/local.yaml by default) is the single source: the filter's
JSON, each sidecar's config and the Envoy bootstrap are generated from it; this module only
adds what a single machine needs — ports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from infermesh.settings import XDS_PORT

from .envoy_resources import MeshListener, PoolEndpoint, Replica, Routing
from .policy import LOCAL_POLICY, Policy, load_policy

@dataclass
class PoolPorts:
    """Where one sidecar (one replica of a pool) listens on this machine."""

    name: str
    """The pool."""
    http_port: int
    grpc_port: int
    admin_port: int = 0
    admin_grpc_port: int = 0
    replica: int = 0
    """Which replica of the pool (its sidecar's `instance`, so `served_by` is `pool/replica`)."""

    @property
    def key(self) -> str:
        """`pool` for the first replica (so a one-replica mesh keeps its names), `pool.N` after it."""
        return self.name if self.replica == 0 else f"{self.name}.{self.replica}"


def replica_list(policy: Policy) -> list[tuple[str, int]]:
    """(pool, replica) of every sidecar, in the policy's pool order."""
    return [(name, i) for name, p in policy.pools.items() for i in range(p.replicas)]


def default_ports(policy: Policy, base: int = 8101) -> list[PoolPorts]:
    """8101.. HTTP, 8201.. gRPC, 8301.. admin HTTP, 8401.. admin gRPC, one per sidecar in the
    policy's pool order (replicas of a pool next to each other)."""
    return [PoolPorts(name, base + i, base + 100 + i, base + 200 + i, base + 300 + i, replica)
            for i, (name, replica) in enumerate(replica_list(policy))]


@dataclass
class LocalMeshPlan:
    policy_path: Path = LOCAL_POLICY
    """The policy file; the control plane watches it, so edits reach the running mesh."""
    policy: Policy | None = None
    """The loaded policy (default: loaded from `policy_path`)."""
    listen_port: int = 8080
    admin_port: int = 9901
    xds_port: int = XDS_PORT
    metrics_port: int = 18001
    """The control plane's counters (policy rejections, NACKs, rollbacks) on 127.0.0.1: /metrics."""
    host: str = "127.0.0.1"
    pools: list[PoolPorts] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.policy is None:
            self.policy = load_policy(self.policy_path)
        if not self.pools:
            self.pools = default_ports(self.policy)
        missing = set(replica_list(self.policy)) - {(p.name, p.replica) for p in self.pools}
        if missing:
            raise ValueError(f"no ports for (pool, replica) {sorted(missing)}")

    def replicas(self, pool: str) -> list[PoolPorts]:
        return [p for p in self.pools if p.name == pool]

    def replica(self, pool: str, replica: int = 0) -> PoolPorts:
        return next(p for p in self.pools if p.name == pool and p.replica == replica)

    def ladder(self, pool: str) -> list[str]:
        return [m.name for m in self.policy.pools[pool].models]

    def local_models(self, pool: str) -> list[str]:
        """Ladder models without an explicit path: built by `infermesh models build`."""
        return [m.name for m in self.policy.pools[pool].models if m.path is None]

    def filter_config(self) -> dict:
        return self.policy.filter_config()

    def sidecar_config(self, pool: PoolPorts, models_dir: Path) -> dict:
        return self.policy.sidecar_config(
            pool.name, models_dir, host=self.host, http_port=pool.http_port, grpc_port=pool.grpc_port,
            admin_port=pool.admin_port, admin_grpc_port=pool.admin_grpc_port, instance=str(pool.replica),
        )

    def listener(self, wasm_path: Path) -> MeshListener:
        return MeshListener(
            listen_host=self.host,
            listen_port=self.listen_port,
            admin_port=self.admin_port,
            wasm_path=wasm_path,
            filter_runtime=self.policy.filter.runtime,
            filter_config=self.filter_config(),
            pools=[PoolEndpoint.of(name, [Replica(self.host, r.http_port, r.grpc_port) for r in self.replicas(name)])
                   for name in self.policy.pools],
            default_pool=self.policy.default_pool,
            failover=self.policy.failover(),
            spill_levels=self.policy.spill_levels(),
            routing=Routing.from_policy(self.policy),
            tracing=self.policy.tracing,
        )
