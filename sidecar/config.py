"""Sidecar configuration: one pydantic model per concern, every field typed, bounded and documented.

The sidecar reads it from a JSON or YAML file (`--config`); mesh-config generates that file.
Unknown keys are errors, so a typo fails at start with the field's name instead of being ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .breakers import BreakerConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """One model of the pool's ladder, as vLLM loads it."""

    name: Annotated[str, Field(min_length=1, max_length=128)]
    """The id clients see in responses and `/v1/models`."""
    path: str
    """Local checkpoint directory (or a hub id where the machine can reach a hub)."""
    aliases: list[str] = []
    """Extra names accepted in a request's `model` field."""
    max_model_len: Annotated[int, Field(gt=0, le=1_048_576)] = 2048
    """Longest prompt plus completion, in tokens."""
    kv_cache_bytes: Annotated[int, Field(gt=0)] = 256 << 20
    """KV-cache size. On CPU it is RAM; an explicit size also skips vLLM's warm-up profiling."""
    max_num_seqs: Annotated[int, Field(gt=0, le=4096)] = 32
    """Sequences vLLM batches at once."""
    dtype: str = "auto"
    """vLLM dtype (`auto`, `bfloat16`, `float16`, `float32`)."""


class ServerConfig(_Strict):
    """Where the fronts listen and what they accept."""

    host: str = "127.0.0.1"
    """Bind address of the serving ports."""
    http_port: Annotated[int, Field(ge=0, le=65535)] = 8000
    """OpenAI-compatible HTTP front."""
    grpc_port: Annotated[int, Field(ge=0, le=65535)] = 50051
    """gRPC front (infermesh.v1.Inference, grpc.health.v1)."""
    max_body_bytes: Annotated[int, Field(gt=0)] = 4 << 20
    """Largest HTTP request body / gRPC message accepted."""
    max_concurrent_requests: Annotated[int, Field(gt=0)] = 256
    """Requests in flight across both fronts; more get 429 / RESOURCE_EXHAUSTED."""
    default_max_tokens: Annotated[int, Field(gt=0)] = 256
    """Completion length when a request does not say."""
    drain_grace_s: Annotated[float, Field(ge=0, le=3600)] = 20.0
    """On SIGTERM, how long in-flight streams may take to finish."""
    max_n: Annotated[int, Field(ge=1, le=128)] = 8
    """Largest `n` (choices per request) accepted."""
    stream_coalesce_ms: Annotated[float, Field(ge=0, le=1000)] = 10.0
    """Under load, at most one streamed message per choice per this window (0: off)."""
    stream_coalesce_min_inflight: Annotated[int, Field(ge=1)] = 8
    """Coalescing starts at this many requests in flight; below it every step is sent at once."""


class ClassPolicy(_Strict):
    """How the pool treats one semantic class (the mesh sets it in `x-infermesh-class`)."""

    priority: Annotated[int, Field(ge=0, le=1000)] = 10
    """Lower is more important; the lowest value is the class kept under `critical_only`."""
    sheddable: bool = False
    """Refused first (429 / RESOURCE_EXHAUSTED) when a breaker sheds."""
    vllm_priority: Annotated[int, Field(ge=-1000, le=1000)] | None = None
    """Passed to vLLM as the request priority (used with the priority scheduler)."""


class MonitorConfig(_Strict):
    interval_s: Annotated[float, Field(gt=0, le=5)] = 0.25
    """How often every signal is read and fed to the breakers."""
    window_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Sliding window of the sidecar's own TTFT and error measurements."""


class AdminConfig(_Strict):
    """The admin and fault-injection API: its own port, loopback by default, never routed."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    """HTTP admin port; 0 picks a free port (logged at start)."""
    grpc_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """gRPC Admin service port (infermesh.v1.Admin); 0 picks a free port."""
    allow_faults: bool = True
    """Whether PUT /admin/faults may inject readings (drills); turn off in production."""


def _default_classes() -> dict[str, ClassPolicy]:
    return {"interactive": ClassPolicy(priority=0), "batch": ClassPolicy(priority=10, sheddable=True)}


class SidecarConfig(_Strict):
    """A sidecar serves one GPU pool."""

    pool: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
    """The pool this sidecar serves (reported in every response)."""
    instance: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] = "0"
    """This replica's id within the pool."""
    models: Annotated[list[ModelConfig], Field(min_length=1)]
    """The model ladder: primary first, lighter fallbacks after it."""
    server: ServerConfig = ServerConfig()
    breakers: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")], BreakerConfig] = {}
    """Resource breakers of this pool, by name."""
    classes: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")], ClassPolicy] = Field(default_factory=_default_classes)
    default_class: str = "batch"
    """The class of a request that carries none (direct clients, not through the mesh)."""
    standby: bool = True
    """Load the next model of the ladder at start, so degrading is a switch, not a cold start."""
    monitor: MonitorConfig = MonitorConfig()
    admin: AdminConfig = AdminConfig()

    @model_validator(mode="after")
    def _default_class_known(self) -> "SidecarConfig":
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of classes: {sorted(self.classes)}")
        return self

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelConfig]) -> list[ModelConfig]:
        seen: set[str] = set()
        for m in models:
            for n in [m.name, *m.aliases]:
                if n in seen:
                    raise ValueError(f"model name or alias {n!r} is used twice")
                seen.add(n)
        return models

    @property
    def served_by(self) -> str:
        return f"{self.pool}/{self.instance}"


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and the field."""


def load_config(path: str | Path) -> SidecarConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from e
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from e
    try:
        return SidecarConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"{p}: invalid sidecar config:"]
        for err in e.errors():
            field = ".".join(str(x) for x in err["loc"]) or "(root)"
            lines.append(f"  {field}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from e
