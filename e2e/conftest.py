"""Shared fixtures for tests that run real processes.

`local_mesh` starts the real thing once per session: two sidecars running vLLM with the small
local models, Envoy with the compiled filter, all on free loopback ports.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infermesh import paths
from infermesh.launcher import LocalMesh, free_ports
from infermesh.meshconfig.local_mesh import LocalMeshPlan, PoolPorts
from infermesh.meshconfig.policy import load_policy


E2E_POLICY = Path(__file__).resolve().parent / "policy-e2e.yaml"


@pytest.fixture(scope="session")
def local_mesh(tmp_path_factory) -> LocalMesh:
    ports = free_ports(10)
    plan = LocalMeshPlan(
        policy=load_policy(E2E_POLICY),
        listen_port=ports[0],
        admin_port=ports[1],
        pools=[
            PoolPorts("interactive", ports[2], ports[3], ports[6], ports[8]),
            PoolPorts("batch", ports[4], ports[5], ports[7], ports[9]),
        ],
    )
    run_dir: Path = tmp_path_factory.mktemp("mesh")
    mesh = LocalMesh(plan, run_dir, paths.models_dir(), paths.filter_wasm())
    t0 = time.monotonic()
    mesh.start(timeout=420, progress=lambda m: print(f"[mesh] {m}", flush=True))
    print(f"[mesh] up in {time.monotonic() - t0:.1f}s: {mesh.ready_after}", flush=True)
    yield mesh
    mesh.stop()
