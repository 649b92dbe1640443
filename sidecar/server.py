"""Sidecar process: the pool's vLLM engines, its gRPC and OpenAI HTTP fronts, in one asyncio loop.

    python -m infermesh.sidecar.server --config sidecar.yaml
    python -m infermesh.sidecar.server --policy policy.yaml --pool NAME [--host 0.0.0.0]

The second form generates the pool's config from the mesh policy itself (what the Helm chart
runs: the policy is mounted from a ConfigMap, so pods and routes come from the same file).

SIGTERM or SIGINT drains: health turns NOT_SERVING, new requests get 503/UNAVAILABLE, in-flight
streams get `drain_grace_s` to finish, then the engine and its worker processes stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from pathlib import Path

import uvicorn
import uvloop
from grpc_health.v1 import health_pb2
from pydantic import ValidationError

from infermesh.logs import setup_logging
from infermesh.settings import GRPC_PORT, HTTP_PORT

from . import tracing
from .config import ConfigError, SidecarConfig, load_config
from .grpc_api import BELOW_LEVEL_SERVICES, FULL_SERVICE, INFERENCE_SERVICE, below_level_service, start_admin_grpc, start_grpc
from .admin_api import build_admin_app
from .http_api import build_app
from .metrics import SidecarMetrics
from .pool import Pool

log = logging.getLogger("infermesh.sidecar")

class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: this process drains on its own terms."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def run(config: SidecarConfig) -> int:
    setup_logging({"pool": config.pool, "instance_id": config.instance})
    # Before the engines: vLLM's own tracing joins with the same endpoint (sidecar/tracing.py).
    if tracing.start(config) is not None:
        log.info("tracing", extra={"otlp_endpoint": config.tracing.otlp_endpoint, "sample_ratio": config.tracing.sample_ratio})
    metrics = SidecarMetrics.of(config)
    pool = Pool(config, metrics=metrics)
    log.info("loading models", extra={"ladder": [m.name for m in config.models], "standby": config.standby})
    pool.start()
    for m in pool.ladder:
        if m.load_seconds is not None:
            metrics.model_load.labels(m.config.name).set(m.load_seconds)

    grpc_server, health_servicer, grpc_port = await start_grpc(pool)
    # vLLM's serving objects of every loaded model are built before anything says ready: built on
    # a first request they would block the event loop (tokenizer, templates, renderer warm-up)
    # just after the pool had reported ready, so the admin API and the first requests stalled.
    app = build_app(pool)
    for m in pool.ladder:
        if m.engine is not None:
            app.state.serving.of(m)
    # The admin API first: once /health says ready, everything this process serves is up.
    admin = _Uvicorn(
        uvicorn.Config(build_admin_app(pool), host=config.admin.host, port=config.admin.port, log_level="warning",
                       access_log=False, lifespan="off")
    )
    admin_task = asyncio.create_task(admin.serve())
    while not admin.started and not admin_task.done():
        await asyncio.sleep(0.05)
    admin_port = admin.servers[0].sockets[0].getsockname()[1] if admin.started else None
    admin_grpc, admin_grpc_port = await start_admin_grpc(pool)

    http = _Uvicorn(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.http_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(config.server.drain_grace_s) + 1,
        )
    )
    http_task = asyncio.create_task(http.serve())
    while not http.started and not http_task.done():
        await asyncio.sleep(0.05)
    if http_task.done():
        log.error("HTTP front failed to start")
        admin.should_exit = True
        await asyncio.gather(grpc_server.stop(0), admin_grpc.stop(0))
        pool.shutdown()
        return 1

    # grpc.health: "infermesh.pool.full_service" is SERVING only while no breaker action is on,
    # so a checker sees a degraded pool without the endpoint being taken out of rotation;
    # "infermesh.pool.below_level.N" while the level is below N (a failover pool's health check).
    def serving(yes: bool) -> int:
        return health_pb2.HealthCheckResponse.SERVING if yes else health_pb2.HealthCheckResponse.NOT_SERVING

    async def on_sample_health(level: int) -> None:
        await health_servicer.set(FULL_SERVICE, serving(level == 0))
        for n in range(1, len(BELOW_LEVEL_SERVICES) + 1):
            await health_servicer.set(below_level_service(n), serving(level < n))

    last_level = -1

    def on_sample(values: dict) -> None:
        nonlocal last_level
        if pool.policy.level != last_level:
            last_level = pool.policy.level
            asyncio.get_running_loop().create_task(on_sample_health(last_level))

    monitor_task = asyncio.create_task(pool.monitor_loop(on_sample))
    # As vLLM's own server does once it is up: the start-up heap (vLLM, torch, tokenizers) leaves
    # the collector's view, so old-generation collections while serving stay short.
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    log.info(
        "serving",
        extra={"http_port": config.server.http_port, "grpc_port": grpc_port, "admin_port": admin_port, "admin_grpc_port": admin_grpc_port,
               "models": [m.config.name for m in pool.ladder if m.engine is not None]},
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    # Drain: stop advertising, refuse new work, let in-flight streams finish.
    log.info("draining", extra={"in_flight": pool.inflight, "grace_s": config.server.drain_grace_s})
    pool.begin_drain()
    for name in ("", INFERENCE_SERVICE, FULL_SERVICE, *BELOW_LEVEL_SERVICES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = time.monotonic() + config.server.drain_grace_s
    while pool.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    http.should_exit = True
    admin.should_exit = True
    monitor_task.cancel()
    await grpc_server.stop(1.0)
    await admin_grpc.stop(0)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(http_task, admin_task), timeout=5)
    pool.shutdown()
    tracing.stop()  # the spans still batched are exported
    log.info("stopped", extra={"left_in_flight": pool.inflight})
    return 0


def config_from_policy(policy_path: str, pool: str, *, models_dir: Path, host: str, http_port: int, grpc_port: int,
                       instance: str, drain_grace_s: float | None, admin_port: int = 0, admin_grpc_port: int = 0,
                       allow_faults: bool = True) -> SidecarConfig:
    """One pool's config generated from the mesh policy (Policy.sidecar_config), validated."""
    from infermesh.meshconfig.policy import PolicyError, load_policy

    try:
        policy = load_policy(policy_path)
    except PolicyError as e:
        raise ConfigError(f"invalid policy:\n{e}") from e
    if pool not in policy.pools:
        raise ConfigError(f"{policy_path}: --pool {pool!r} is not one of the pools {sorted(policy.pools)}")
    data = policy.sidecar_config(pool, models_dir, host=host, http_port=http_port, grpc_port=grpc_port, instance=instance,
                                 admin_port=admin_port, admin_grpc_port=admin_grpc_port)
    data["admin"]["allow_faults"] = allow_faults
    if drain_grace_s is not None:
        data["server"]["drain_grace_s"] = drain_grace_s
    try:
        return SidecarConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"{policy_path}: the config generated for pool {pool!r} is invalid: {problems}") from e


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infermesh-sidecar")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="sidecar config file (YAML or JSON)")
    source.add_argument("--policy", help="mesh policy file: generate this pool's config from it (needs --pool)")
    parser.add_argument("--event-loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the asyncio loop both fronts and the engine run on (default uvloop, as vLLM's own server)")
    gen = parser.add_argument_group("with --policy")
    gen.add_argument("--pool", help="the pool this sidecar serves")
    gen.add_argument("--host", default="127.0.0.1", help="bind address of the serving ports (default 127.0.0.1; the admin API stays on loopback)")
    gen.add_argument("--http-port", type=int, default=HTTP_PORT, help=f"OpenAI HTTP front (default {HTTP_PORT})")
    gen.add_argument("--grpc-port", type=int, default=GRPC_PORT, help=f"gRPC front (default {GRPC_PORT})")
    gen.add_argument("--instance", default="0", help="this replica's id in the pool (the chart passes the pod name)")
    gen.add_argument("--models-dir", help="where models without a path live (default: $INFERMESH_HOME/models)")
    gen.add_argument("--drain-grace-s", type=float, help="on SIGTERM, how long in-flight streams may take (default: the sidecar's, 20 s)")
    gen.add_argument("--admin-port", type=int, default=0, help="admin HTTP API on 127.0.0.1 (default 0: a free port, logged)")
    gen.add_argument("--admin-grpc-port", type=int, default=0, help="admin gRPC API on 127.0.0.1 (default 0: a free port, logged)")
    gen.add_argument("--no-faults", dest="allow_faults", action="store_false",
                     help="refuse fault injection on the admin API (PUT /admin/faults/...); production")
    return parser


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    """The config the command line names: a config file, or a pool of a policy. Raises ConfigError."""
    if args.config:
        return load_config(args.config)
    if not args.pool:
        raise ConfigError("--policy needs --pool")
    from infermesh import paths

    return config_from_policy(
        args.policy, args.pool, models_dir=Path(args.models_dir) if args.models_dir else paths.models_dir(),
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port, instance=args.instance,
        drain_grace_s=args.drain_grace_s, admin_port=args.admin_port, admin_grpc_port=args.admin_grpc_port,
        allow_faults=args.allow_faults,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"infermesh-sidecar: {e}", file=sys.stderr)
        return 2
    # uvloop, as vLLM's own server runs: every streamed message and gRPC call costs less loop
    # time (measured in docs/sidecar.md).
    if args.event_loop == "asyncio":
        return asyncio.run(run(config))
    return uvloop.run(run(config))


if __name__ == "__main__":
    sys.exit(main())
