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
    kv_cache_bytes: int = 128 << 20


@dataclass
class LocalMeshPlan:
    listen_port: int = 8080
    admin_port: int = 9901
    host: str = "127.0.0.1"
    pools: list[PoolPlan] = field(
        default_factory=lambda: [
            PoolPlan("interactive", "tiny-llama-large", 8101, 8201),
            PoolPlan("batch", "tiny-llama-small", 8102, 8202),
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
                    "max_model_len": 2048,
                    "kv_cache_bytes": pool.kv_cache_bytes,
                }
            ],
            "server": {"host": self.host, "http_port": pool.http_port, "grpc_port": pool.grpc_port},
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
