"""The embedded default mesh: two pools on 127.0.0.1, each served by one sidecar with a small
local model, and the filter rules that split chat (interactive) from everything else (batch).

This is the single source the run command and the e2e tests generate every config from: the
filter's JSON, each sidecar's config and the Envoy bootstrap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .envoy_bootstrap import MeshListener, PoolEndpoint

PUBLIC_MODEL = "tiny-llama"
"""The model name clients use; every pool accepts it and serves it with its own ladder."""


@dataclass
class PoolPlan:
    name: str
    model: str
    """Local checkpoint name (infermesh.models.LOCAL_MODELS)."""
    http_port: int
    grpc_port: int
    admin_port: int = 0
    admin_grpc_port: int = 0
    kv_cache_bytes: int = 128 << 20
    max_model_len: int = 2048
    fallbacks: list[str] = field(default_factory=list)
    """Lighter models after the primary: the degradation ladder (the first is a hot standby)."""
    breakers: dict = field(default_factory=dict)


def default_breakers(interactive: bool) -> dict:
    """The brief's defaults, scaled to the local mesh (see docs/breakers.md)."""
    b = {
        # GPU memory above 92 % → degrade to the light model. No readings on a CPU machine.
        "gpu-memory": {"signal": "gpu_memory", "trip_above": 0.92, "recover_below": 0.85, "sustain_s": 5,
                       "recover_sustain_s": 10, "actions": ["degrade"]},
        # CPU above 0.95 for 30 s → isolate: shed the sheddable classes.
        "cpu": {"signal": "cpu_load", "trip_above": 0.95, "recover_below": 0.80, "sustain_s": 30,
                "recover_sustain_s": 15, "min_samples": 20, "actions": ["shed"]},
    }
    if interactive:
        b["kv-cache"] = {"signal": "kv_cache", "trip_above": 0.90, "recover_below": 0.50, "sustain_s": 2,
                         "recover_sustain_s": 5, "actions": ["shed", "degrade"], "escalate_after_s": 0,
                         "half_open_timeout_s": 5}
    return b


@dataclass
class LocalMeshPlan:
    listen_port: int = 8080
    admin_port: int = 9901
    host: str = "127.0.0.1"
    pools: list[PoolPlan] = field(
        default_factory=lambda: [
            PoolPlan("interactive", "tiny-llama-large", 8101, 8201, 8301, 8401, fallbacks=["tiny-llama-small"],
                     breakers=default_breakers(interactive=True)),
            PoolPlan("batch", "tiny-llama-small", 8102, 8202, 8302, 8402, breakers=default_breakers(interactive=False)),
        ]
    )
    default_class: str = "batch"

    def filter_config(self) -> dict:
        return {
            "version": 1,
            "default_class": self.default_class,
            "classes": {"interactive": {"pool": "interactive"}, "batch": {"pool": "batch"}},
            "rules": [
                {
                    # A chat request that does not stream and wants a long answer is bulk work.
                    "name": "chat-bulk",
                    "class": "batch",
                    "match": {
                        "methods": ["POST"],
                        "path": {"prefix": "/v1/chat/completions"},
                        "body": {"stream": False, "max_tokens": {"min": 1024}},
                    },
                },
                {
                    "name": "chat",
                    "class": "interactive",
                    "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}},
                },
            ],
        }

    def sidecar_config(self, pool: PoolPlan, models_dir: Path) -> dict:
        return {
            "pool": pool.name,
            "instance": "0",
            "models": [
                {
                    "name": pool.model,
                    "path": str(models_dir / pool.model),
                    "aliases": [PUBLIC_MODEL],
                    "max_model_len": pool.max_model_len,
                    "kv_cache_bytes": pool.kv_cache_bytes,
                },
                *[
                    {"name": fb, "path": str(models_dir / fb), "max_model_len": pool.max_model_len, "kv_cache_bytes": pool.kv_cache_bytes}
                    for fb in pool.fallbacks
                ],
            ],
            "server": {"host": self.host, "http_port": pool.http_port, "grpc_port": pool.grpc_port},
            "admin": {"host": "127.0.0.1", "port": pool.admin_port, "grpc_port": pool.admin_grpc_port},
            "breakers": pool.breakers,
        }

    def listener(self, wasm_path: Path) -> MeshListener:
        cfg = self.filter_config()
        return MeshListener(
            listen_host=self.host,
            listen_port=self.listen_port,
            admin_port=self.admin_port,
            wasm_path=wasm_path,
            filter_config=cfg,
            pools=[PoolEndpoint(p.name, self.host, p.http_port) for p in self.pools],
            default_pool=cfg["classes"][cfg["default_class"]]["pool"],
        )
