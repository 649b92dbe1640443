"""The mesh policy: one file from which the filter config, each pool's sidecar config and the
Envoy config are generated. `infermesh policy check FILE` validates it; errors name the file,
the line and the field.

    version: 1
    default_class: batch
    classes:
      interactive: {pool: interactive, priority: 0, objective: chat-latency}
      batch: {pool: batch, priority: 10, sheddable: true}
    rules:                       # ordered; the first match decides (see docs/filter.md)
      - name: chat
        class: interactive
        match: {methods: [POST], path: {prefix: /v1/chat/completions}}
    filter: {body_max_bytes: 262144, trusted_cidrs: [], emit_objective_header: false}
    pools:
      interactive:
        gpu: {type: H100, count: 1}
        models:                  # the ladder: primary first
          - {name: llama-3-70b, path: meta-llama/Meta-Llama-3-70B-Instruct, aliases: [chat]}
          - {name: phi-3-mini, path: microsoft/Phi-3-mini-4k-instruct}
        breakers: {...}          # sidecar/breakers.py BreakerConfig, by name
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from infermesh.sidecar.breakers import BreakerConfig

NAME = r"^[A-Za-z0-9_-]{1,64}$"

LEVEL_DOWN = 4
"""A pool's level while its sidecar is gone (unreachable, restarting, draining): above every
breaker level (1 shedding, 2 fallback model, 3 critical only), so `when_degraded` applies."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClassSpec(_Strict):
    pool: Annotated[str, Field(pattern=NAME)]
    """The pool that serves this class."""
    priority: Annotated[int, Field(ge=0, le=1000)] = 10
    """Lower is more important; the lowest is kept when a pool serves critical classes only."""
    sheddable: bool = False
    """Refused first when a pool sheds load."""
    objective: Annotated[str, Field(pattern=NAME)] | None = None
    """Gateway API Inference Extension objective name (x-gateway-inference-objective)."""


class ModelSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    path: str | None = None
    """Checkpoint directory or hub id; default: the local model of that name ($INFERMESH_HOME/models)."""
    aliases: list[str] = []
    max_model_len: Annotated[int, Field(gt=0)] = 2048
    kv_cache_bytes: Annotated[int, Field(gt=0)] = 128 << 20
    """KV-cache size (CPU: RAM). On GPUs leave the default to vLLM's own sizing (future)."""


class GpuSpec(_Strict):
    type: str = "cpu"
    """Accelerator class of the pool's nodes (H100, A100, L4, A10, cpu): used by the chart."""
    count: Annotated[int, Field(ge=0, le=16)] = 0


class DegradedRouting(_Strict):
    """What the mesh does while this pool is degraded (its sidecars report the level)."""

    at_level: Annotated[int, Field(ge=1, le=3)] = 3
    """From this pool level on: 1 shedding, 2 serving a fallback model, 3 critical classes only.
    A pool whose sidecar is gone (killed, restarting, draining) counts as past every level."""
    spill_to: Annotated[str, Field(pattern=NAME)] | None = None
    """Send this pool's traffic to that pool instead (unless that one is degraded too). Its
    endpoints also stand behind this pool's at priority 1: a request this pool's sidecar refuses
    at the connection level is retried there before anything else has noticed."""
    shed_classes: list[str] = []
    """Answer these classes at the edge with 429 + Retry-After, before they reach any pool."""


class PoolSpec(_Strict):
    models: Annotated[list[ModelSpec], Field(min_length=1)]
    """The model ladder: primary first, lighter fallbacks after it (the first is a hot standby)."""
    gpu: GpuSpec = GpuSpec()
    replicas: Annotated[int, Field(ge=1, le=1000)] = 1
    breakers: dict[Annotated[str, Field(pattern=NAME)], BreakerConfig] = {}
    when_degraded: DegradedRouting | None = None


class FilterSpec(_Strict):
    body_max_bytes: Annotated[int, Field(gt=0, le=983040)] = 262144
    trusted_cidrs: list[str] = []
    trusted_principals: list[str] = []
    emit_objective_header: bool = False


class Policy(_Strict):
    version: Annotated[int, Field(ge=1, le=1)] = 1
    default_class: str
    classes: Annotated[dict[Annotated[str, Field(pattern=NAME)], ClassSpec], Field(min_length=1)]
    rules: list[dict[str, Any]] = []
    """Filter rules, exactly as docs/filter.md describes; validated by the filter's own rules below."""
    filter: FilterSpec = FilterSpec()
    pools: Annotated[dict[Annotated[str, Field(pattern=NAME)], PoolSpec], Field(min_length=1)]

    @model_validator(mode="after")
    def _references(self) -> "Policy":
        if self.default_class not in self.classes:
            raise ValueError(f"default_class: {self.default_class!r} is not one of the classes {sorted(self.classes)}")
        for name, c in self.classes.items():
            if c.pool not in self.pools:
                raise ValueError(f"classes.{name}.pool: {c.pool!r} is not one of the pools {sorted(self.pools)}")
        for name, p in self.pools.items():
            wd = p.when_degraded
            if wd is None:
                continue
            if wd.spill_to is not None and (wd.spill_to not in self.pools or wd.spill_to == name):
                raise ValueError(f"pools.{name}.when_degraded.spill_to: {wd.spill_to!r} must be another of the pools {sorted(self.pools)}")
            for c in wd.shed_classes:
                if c not in self.classes:
                    raise ValueError(f"pools.{name}.when_degraded.shed_classes: {c!r} is not one of the classes {sorted(self.classes)}")
        names: set[str] = set()
        for i, r in enumerate(self.rules):
            for key in r:
                if key not in ("name", "class", "match"):
                    raise ValueError(f"rules.{i}.{key}: unknown field (a rule has name, class, match)")
            if not isinstance(r.get("name"), str) or not re.match(NAME, r["name"]):
                raise ValueError(f"rules.{i}.name: a rule needs a name of [A-Za-z0-9_-]")
            if r["name"] in names:
                raise ValueError(f"rules.{i}.name: duplicate rule name {r['name']!r}")
            names.add(r["name"])
            if r.get("class") not in self.classes:
                raise ValueError(f"rules.{i}.class: {r.get('class')!r} is not one of the classes {sorted(self.classes)}")
        return self

    # ---- generators -------------------------------------------------------------------------

    def filter_config(self) -> dict:
        """The Wasm filter's JSON config (Envoy `configuration`, Istio `pluginConfig`)."""
        classes = {}
        for name, c in self.classes.items():
            classes[name] = {"pool": c.pool} | ({"objective": c.objective} if c.objective else {})
        cfg: dict[str, Any] = {
            "version": 1,
            "default_class": self.default_class,
            "classes": classes,
            "rules": [dict(r) for r in self.rules],
            "body": {"max_bytes": self.filter.body_max_bytes},
            "emit_objective_header": self.filter.emit_objective_header,
        }
        if self.filter.trusted_cidrs or self.filter.trusted_principals:
            cfg["trusted_sources"] = {"cidrs": list(self.filter.trusted_cidrs), "principals": list(self.filter.trusted_principals)}
        return cfg

    def degraded_overlay(self, levels: dict[str, int]) -> tuple[dict[str, str], list[str]]:
        """(spill, shed_classes) for the pools' current levels (from their sidecars)."""
        spill: dict[str, str] = {}
        shed: list[str] = []

        def degraded(name: str) -> bool:
            wd = self.pools[name].when_degraded
            level = levels.get(name, 0)
            return level >= LEVEL_DOWN or (wd is not None and level >= wd.at_level)

        for name, p in self.pools.items():
            wd = p.when_degraded
            if wd is None or not degraded(name):
                continue
            if wd.spill_to is not None and not degraded(wd.spill_to):
                spill[name] = wd.spill_to
            shed.extend(c for c in wd.shed_classes if c not in shed)
        return spill, shed

    def failover(self) -> dict[str, str]:
        """pool -> the pool whose endpoints back it at priority 1 (its `when_degraded.spill_to`)."""
        return {n: p.when_degraded.spill_to for n, p in self.pools.items() if p.when_degraded and p.when_degraded.spill_to}

    @property
    def default_pool(self) -> str:
        return self.classes[self.default_class].pool

    def sidecar_config(self, pool: str, models_dir: Path, *, host: str = "127.0.0.1", http_port: int = 8000,
                       grpc_port: int = 50051, admin_port: int = 0, admin_grpc_port: int = 0, instance: str = "0") -> dict:
        """One pool's sidecar config (sidecar/config.py)."""
        p = self.pools[pool]
        models = []
        for i, m in enumerate(p.models):
            models.append({
                "name": m.name,
                "path": m.path or str(models_dir / m.name),
                "aliases": list(m.aliases),
                "max_model_len": m.max_model_len,
                "kv_cache_bytes": m.kv_cache_bytes,
            })
        # A request's class decides shedding; the sidecar knows every class, the mesh's
        # default stands for requests that arrive without one.
        classes = {n: {"priority": c.priority, "sheddable": c.sheddable} for n, c in self.classes.items()}
        return {
            "pool": pool,
            "instance": instance,
            "models": models,
            "server": {"host": host, "http_port": http_port, "grpc_port": grpc_port},
            "admin": {"host": "127.0.0.1", "port": admin_port, "grpc_port": admin_grpc_port},
            "classes": classes,
            "default_class": self.default_class,
            "breakers": {n: b.model_dump() for n, b in p.breakers.items()},
        }


class PolicyError(Exception):
    """A policy that cannot be used. `problems` are (line or None, field, message)."""

    def __init__(self, path: str, problems: list[tuple[int | None, str, str]]):
        self.path = path
        self.problems = problems
        lines = [f"{path}:{line or '?'}: {field}: {msg}" for line, field, msg in problems]
        super().__init__("\n".join(lines))


def _line_of(node: yaml.Node | None, loc: list) -> int | None:
    """The 1-based line of the YAML node at `loc` (the deepest that exists)."""
    best = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if str(k.value) == str(key):
                    nxt = v
                    best = k.start_mark.line + 1
                    break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            best = node.start_mark.line + 1
        else:
            break
        if node is None:
            break
    return best


def parse_policy(text: str, path: str = "<policy>") -> Policy:
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise PolicyError(path, [(mark.line + 1 if mark else None, "(yaml)", str(getattr(e, "problem", e)))]) from e
    if not isinstance(data, dict):
        raise PolicyError(path, [(1, "(root)", "a policy is a mapping with version, classes, pools, …")])
    try:
        return Policy.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = list(err["loc"])
            msg = err["msg"]
            # Cross-field checks report their own field path at the start of the message.
            m = re.match(r"Value error, ([\w.\-]+): (.*)", msg)
            if m and not loc:
                loc = [int(x) if x.isdigit() else x for x in m.group(1).split(".")]
                msg = m.group(2)
            field = ".".join(str(x) for x in loc) or "(root)"
            problems.append((_line_of(node, loc), field, msg))
        raise PolicyError(path, problems) from e


def load_policy(path: str | Path) -> Policy:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise PolicyError(str(p), [(None, "(file)", e.strerror or str(e))]) from e
    return parse_policy(text, str(p))


LOCAL_POLICY = Path(__file__).resolve().parent.parent / "policies" / "local.yaml"
"""The embedded default: two pools on one machine with the small local models."""

