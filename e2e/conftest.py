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
from infermesh.meshconfig.local_mesh import LocalMeshPlan, PoolPlan, default_breakers


FAST_CPU_BREAKER = {"signal": "cpu_load", "trip_above": 0.95, "recover_below": 0.80, "sustain_s": 3,
                    "recover_sustain_s": 3, "min_samples": 8, "actions": ["shed"], "half_open_timeout_s": 2}


@pytest.fixture(scope="session")
def local_mesh(tmp_path_factory) -> LocalMesh:
    ports = free_ports(10)
    plan = LocalMeshPlan(
        listen_port=ports[0],
        admin_port=ports[1],
        pools=[
            # A small KV cache (~2k tokens of the large model) so a handful of long requests make
            # real KV pressure; the CPU breaker of the batch pool reacts in seconds, not 30 s.
            PoolPlan("interactive", "tiny-llama-large", ports[2], ports[3], ports[6], ports[8], kv_cache_bytes=12 << 20, max_model_len=1024,
                     fallbacks=["tiny-llama-small"], breakers=default_breakers(interactive=True)),
            PoolPlan("batch", "tiny-llama-small", ports[4], ports[5], ports[7], ports[9],
                     breakers=default_breakers(interactive=False) | {"cpu": FAST_CPU_BREAKER}),
        ],
    )
    run_dir: Path = tmp_path_factory.mktemp("mesh")
    mesh = LocalMesh(plan, run_dir, paths.models_dir(), paths.filter_wasm())
    t0 = time.monotonic()
    mesh.start(timeout=420, progress=lambda m: print(f"[mesh] {m}", flush=True))
    print(f"[mesh] up in {time.monotonic() - t0:.1f}s: {mesh.ready_after}", flush=True)
    yield mesh
    mesh.stop()
