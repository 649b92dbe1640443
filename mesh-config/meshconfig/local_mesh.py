"""A mesh on one machine, from a policy: one sidecar per pool on 127.0.0.1, Envoy in front.

The policy (mesh-config/policies/local.yaml by default) is the single source: the filter's
JSON, each sidecar's config and the Envoy bootstrap are generated from it; this module only
adds what a single machine needs — ports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .envoy_resources import MeshListener, PoolEndpoint, Routing
from .policy import LOCAL_POLICY, Policy, load_policy

@dataclass
class PoolPorts:
    """Where one pool's sidecar listens on this machine."""

    name: str
    http_port: int
    grpc_port: int
    admin_port: int = 0
    admin_grpc_port: int = 0


def default_ports(policy: Policy, base: int = 8101) -> list[PoolPorts]:
    """8101.. HTTP, 8201.. gRPC, 8301.. admin HTTP, 8401.. admin gRPC, in the policy's pool order."""
    return [PoolPorts(name, base + i, base + 100 + i, base + 200 + i, base + 300 + i) for i, name in enumerate(policy.pools)]


@dataclass
class LocalMeshPlan:
    policy_path: Path = LOCAL_POLICY
    """The policy file; the control plane watches it, so edits reach the running mesh."""
    policy: Policy | None = None
    """The loaded policy (default: loaded from `policy_path`)."""
    listen_port: int = 8080
    admin_port: int = 9901
    xds_port: int = 18000
    host: str = "127.0.0.1"
    pools: list[PoolPorts] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.policy is None:
            self.policy = load_policy(self.policy_path)
        if not self.pools:
            self.pools = default_ports(self.policy)
        missing = set(self.policy.pools) - {p.name for p in self.pools}
        if missing:
            raise ValueError(f"no ports for pools {sorted(missing)}")

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
            admin_port=pool.admin_port, admin_grpc_port=pool.admin_grpc_port,
        )

    def listener(self, wasm_path: Path) -> MeshListener:
        return MeshListener(
            listen_host=self.host,
            listen_port=self.listen_port,
            admin_port=self.admin_port,
            wasm_path=wasm_path,
            filter_config=self.filter_config(),
            pools=[PoolEndpoint(p.name, self.host, p.http_port, p.grpc_port) for p in self.pools],
            default_pool=self.policy.default_pool,
            failover=self.policy.failover(),
            routing=Routing.from_policy(self.policy),
        )
