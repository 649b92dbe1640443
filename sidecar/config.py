"""Sidecar configuration: one pydantic model per concern, every field typed, bounded and documented.

The sidecar reads it from a JSON or YAML file (`--config`), or generates it from the mesh policy
(`--policy FILE --pool NAME`, Policy.sidecar_config). What the policy can set (models, classes,
serving limits, breakers, monitor) is defined once in infermesh/settings.py, so both forms have
the same defaults; this module adds what only a running sidecar has (addresses, ports, admin).
Unknown keys are errors, so a typo fails at start with the field's name instead of being ignored.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from infermesh.settings import (GRPC_PORT, HTTP_PORT, NAME, BreakerConfig, ClassSettings, ModelSettings, MonitorSettings, PoolSettings,
                                ServingSettings, Strict, TracingSettings, check_ladder)

# The settings the mesh policy can set are defined once, in infermesh/settings.py; the names
# below are the sidecar's (engine.py and the fronts use them).
ClassPolicy = ClassSettings
MonitorConfig = MonitorSettings
__all__ = ["AdminConfig", "BreakerConfig", "ClassPolicy", "ConfigError", "ModelConfig", "MonitorConfig", "ServerConfig",
           "SidecarConfig", "load_config"]


class ModelConfig(ModelSettings):
    """One model of the pool's ladder, as vLLM loads it."""

    path: str
    """Local checkpoint directory (or a hub id where the machine can reach a hub)."""


class ServerConfig(ServingSettings):
    """Where the fronts listen, what they accept (ServingSettings) and how they drain."""

    host: str = "127.0.0.1"
    """Bind address of the serving ports."""
    http_port: Annotated[int, Field(ge=0, le=65535)] = HTTP_PORT
    """OpenAI-compatible HTTP front."""
    grpc_port: Annotated[int, Field(ge=0, le=65535)] = GRPC_PORT
    """gRPC front (infermesh.v1.Inference, grpc.health.v1)."""
    drain_grace_s: Annotated[float, Field(ge=0, le=3600)] = 20.0
    """On SIGTERM, how long in-flight streams may take to finish."""
    trusted_peers: Annotated[list[str], Field(max_length=64)] = ["127.0.0.0/8", "::1/128"]
    """Networks (CIDR) of the peers whose `x-infermesh-*` headers the fronts take: the mesh's proxy.
    Envoy of the local mesh and Istio's sidecar proxy both connect over loopback; from any other
    peer a request's class header is ignored (mesh_class.py)."""

    @field_validator("trusted_peers")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for i, cidr in enumerate(v):
            try:
                ipaddress.ip_network(cidr)
            except ValueError as e:
                raise ValueError(f"trusted_peers[{i}] {cidr!r} is not a network (CIDR): {e}") from None
        return v


class AdminConfig(Strict):
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


class SidecarConfig(PoolSettings):
    """A sidecar serves one GPU pool (breakers, standby and monitor: PoolSettings)."""

    pool: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
    """The pool this sidecar serves (reported in every response)."""
    instance: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] = "0"
    """This replica's id within the pool."""
    models: Annotated[list[ModelConfig], Field(min_length=1)]
    """The model ladder: primary first, lighter fallbacks after it."""
    server: ServerConfig = ServerConfig()
    classes: dict[Annotated[str, Field(pattern=NAME)], ClassPolicy] = Field(default_factory=_default_classes)
    default_class: str = "batch"
    """The class of a request that carries none (direct clients, not through the mesh)."""
    mesh_pools: Annotated[list[Annotated[str, Field(pattern=NAME)]], Field(max_length=1024)] = []
    """Every pool of the mesh policy (generated from it): the names a spilled-in request's
    `x-infermesh-pool` is counted under in the metrics; any other name is counted as `other`."""
    admin: AdminConfig = AdminConfig()
    tracing: TracingSettings = TracingSettings()
    """OpenTelemetry traces of this sidecar's requests (the policy's `tracing`; docs/tracing.md)."""

    @model_validator(mode="after")
    def _default_class_known(self) -> "SidecarConfig":
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of classes: {sorted(self.classes)}")
        return self

    _unique_names = field_validator("models")(check_ladder)

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
