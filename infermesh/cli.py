"""The `infermesh` command line."""

from __future__ import annotations

import argparse
import sys


def _cmd_models_build(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .models import build_all

    build_all(Path(args.dir) if args.dir else None, force=args.force)
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    import signal
    import tempfile
    import time
    from pathlib import Path

    from infermesh.meshconfig.local_mesh import LocalMeshPlan

    from .launcher import LaunchError, LocalMesh
    from .models import build_all

    def say(msg: str) -> None:
        print(f"infermesh: {msg}", file=sys.stderr, flush=True)

    from infermesh.meshconfig.policy import LOCAL_POLICY, PolicyError, load_policy

    try:
        policy = load_policy(args.policy or LOCAL_POLICY)
    except PolicyError as e:
        say(f"invalid policy:\n{e}")
        return 2
    plan = LocalMeshPlan(policy_path=Path(args.policy) if args.policy else LOCAL_POLICY, policy=policy,
                         listen_port=args.port, admin_port=args.admin_port, xds_port=args.xds_port)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="infermesh-run-"))
    try:
        cores = {}
        for item in args.cpus:
            pool, sep, spec = item.partition("=")
            if not (sep and pool and spec):
                raise LaunchError(f"--cpus {item!r}: expected POOL=CPUS, e.g. --cpus interactive=0 --cpus batch=1")
            cores[pool] = spec
        mesh = LocalMesh(plan, run_dir, cpu_cores=cores, pin_tree=bool(cores), proxy_cores=args.proxy_cpus, observe=args.observe)
    except LaunchError as e:
        say(str(e))
        if not args.run_dir:
            run_dir.rmdir()
        return 2
    build_all()
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    try:
        mesh.start(progress=say)
    except LaunchError as e:
        say(f"failed to start: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted while starting; stopping")
        mesh.stop()
        return 130
    say(f"mesh up in {time.monotonic() - t0:.1f}s; logs and generated configs in {run_dir}")
    print(
        f"""
OpenAI API: {mesh.base_url}/v1   (model: "tiny-llama")

  curl -sN {mesh.base_url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model":"tiny-llama","stream":true,"max_tokens":16,"messages":[{{"role":"user","content":"Hello!"}}]}}'

Chat goes to the interactive pool, everything else to the batch pool; the response headers
x-infermesh-served-by and x-infermesh-model say which sidecar and model served.
Edit {plan.policy_path} and the change reaches Envoy within a second. Ctrl-C stops.
""",
        flush=True,
    )
    if mesh.prometheus is not None:
        print(f"""Prometheus: {mesh.prometheus.url}   (Envoy, the control plane and every sidecar, every {mesh.prometheus.interval};
  the queries of the chart's dashboards: docs/observability.md; Envoy's access log: {mesh.access_log})
""", flush=True)
    try:
        while True:
            for c in mesh.children:
                if c.proc.poll() is not None:
                    say(f"{c.name} exited with code {c.proc.returncode}; stopping the mesh\n{c.tail()}")
                    mesh.stop()
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        say("stopping")
        mesh.stop()
        say("stopped")
        return 0


def _cmd_drill(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .drill import SCENARIOS, DrillOptions, run_cli

    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    opts = DrillOptions(rate_interactive=args.rate_interactive, rate_batch=args.rate_batch, fault_pool=args.pool)
    if args.gateway:
        from .drill import run_remote

        if not args.policy:
            print("drill: --gateway needs --policy (the policy the cluster runs)", file=sys.stderr)
            return 2
        return run_remote(names, Path(args.policy), args.gateway, args.admin, opts, args.json, args.prometheus)
    if args.prometheus:
        print("drill: --prometheus is for --gateway (a local mesh's own Prometheus: --observe)", file=sys.stderr)
        return 2
    return run_cli(names, Path(args.policy) if args.policy else None, opts, args.json, args.plot, args.observe)


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.scenario == "prefix":  # its own set-ups (one pool of two replicas): infermesh/bench_prefix.py
        from .bench_prefix import run_cli as run_prefix

        return run_prefix(args)
    from .bench import run_cli

    return run_cli(args)


def _load_policy_or_report(path: str):
    """The policy, or None after printing its problems (file:line: field: message)."""
    from infermesh.meshconfig.policy import PolicyError, load_policy

    try:
        return load_policy(path)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return None


def _cmd_policy_check(args: argparse.Namespace) -> int:
    p = _load_policy_or_report(args.file)
    if p is None:
        return 1
    # The rules were checked as the filter checks them; say which make it buffer the body.
    body = [r.name for r in p.rules if r.match.needs_body]
    reads = f", {len(body)} {'reads' if len(body) == 1 else 'read'} the body: {', '.join(body)}" if body else ", none reads the body"
    runtime = "; filter: native dynamic module (plain Envoy only)" if p.filter.runtime == "native" else ""
    print(f"{args.file}: OK ({len(p.classes)} classes, {len(p.rules)} rules{reads}; pools: {', '.join(p.pools)}{runtime})")
    return 0


def _istio_refused(file: str, e: Exception) -> int:
    """A policy Istio cannot run: FILE:LINE: the message (the line of the field it names)."""
    from pathlib import Path

    from infermesh.meshconfig.policy import field_line

    field = getattr(e, "field", None)
    line = field_line(Path(file).read_text(), field) if field else None
    print(f"{file}:{line}: {e}" if line else f"{file}: {e}", file=sys.stderr)
    return 2


def _cmd_policy_render(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from infermesh import paths
    from infermesh.meshconfig.envoy_bootstrap import bootstrap
    from infermesh.meshconfig.local_mesh import LocalMeshPlan

    p = _load_policy_or_report(args.file)
    if p is None:
        return 1
    if args.what == "filter":
        out = p.filter_config()
    elif args.what == "sidecar":
        if args.pool not in p.pools:
            print(f"unknown pool {args.pool!r}; pools: {', '.join(p.pools)}", file=sys.stderr)
            return 2
        out = p.sidecar_config(args.pool, paths.models_dir())
    elif args.what == "istio":
        from infermesh.meshconfig.istio import IstioConfigError, IstioOptions, module_sha256, render_yaml

        url, sha = args.wasm_url, args.wasm_sha256
        if url is None:
            # The module built here, as a file the proxies would need mounted; say so.
            url, sha = f"file://{paths.filter_wasm()}", sha or module_sha256(paths.filter_wasm())
            print(f"infermesh: no --wasm-url: pointing at the local build {url}", file=sys.stderr)
        try:
            opts = IstioOptions(wasm_url=url, wasm_sha256=sha or "", namespace=args.namespace, tracing_provider=args.tracing_provider)
            print(render_yaml(p, opts), end="")
        except IstioConfigError as e:
            return _istio_refused(args.file, e)
        return 0
    elif args.what == "helm-values":
        import yaml

        from infermesh.meshconfig.istio import IstioConfigError, helm_values

        # JSON, which Helm reads as YAML without YAML 1.1's surprises (there a bare `n` key is false).
        try:
            out = helm_values(p, yaml.safe_load(Path(args.file).read_text()))
        except IstioConfigError as e:
            return _istio_refused(args.file, e)
    else:
        out = bootstrap(LocalMeshPlan(policy=p).listener(Path(paths.filter_wasm())))
    print(json.dumps(out, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    from infermesh.settings import XDS_PORT

    parser = argparse.ArgumentParser(prog="infermesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="local model checkpoints")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    build = models_sub.add_parser("build", help="build the small local checkpoints (idempotent)")
    build.add_argument("--dir", help="output directory (default: $INFERMESH_HOME/models)")
    build.add_argument("--force", action="store_true", help="rebuild even if up to date")
    build.set_defaults(func=_cmd_models_build)

    up = sub.add_parser("up", help="run the local mesh: Envoy + filter + one sidecar per pool, on 127.0.0.1")
    up.add_argument("--port", type=int, default=8080, help="mesh listener port (default 8080)")
    up.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port, 127.0.0.1 only (default 9901)")
    up.add_argument("--run-dir", help="where logs and generated configs go (default: a new temp dir)")
    up.add_argument("--policy", help="mesh policy file (default: mesh-config/policies/local.yaml); edits apply live")
    up.add_argument("--xds-port", type=int, default=XDS_PORT, help=f"control plane (ADS) port, 127.0.0.1 (default {XDS_PORT})")
    up.add_argument("--cpus", metavar="POOL=CPUS", action="append", default=[],
                    help="run POOL's sidecar, its whole process tree (front, vLLM's engine core and workers), only on "
                         "CPUS (0, 1, 0-1, 0,2-3), as a GPU pool of its own; POOL.N for one replica; once per pool")
    up.add_argument("--proxy-cpus", metavar="CPUS", help="CPUs for Envoy and the control plane (default: any)")
    up.add_argument("--observe", action="store_true",
                    help="also run a Prometheus on 127.0.0.1 scraping the whole mesh (Debian's prometheus; docs/observability.md) and print its URL")
    up.set_defaults(func=_cmd_up)

    from .drill import SCENARIOS

    drill = sub.add_parser("drill", help="run a degraded-mode drill on a local mesh of its own and report (docs/drills.md)",
                           description="Start a local mesh on free ports from a copy of the policy, run a steady mixed load, "
                                       "inject the fault, and report outcomes, times and checks. Exit 1 if a check fails.")
    drill.add_argument("scenario", choices=[*SCENARIOS, "all"], help="; ".join(SCENARIOS) + "; or all, one after another")
    drill.add_argument("--policy", help="mesh policy (default: mesh-config/policies/local.yaml); the drill works on a copy")
    drill.add_argument("--pool", help="pool the fault hits (default: the most important class's pool)")
    drill.add_argument("--json", action="store_true", help="print the report(s) as JSON instead of text")
    drill.add_argument("--plot", metavar="FILE.png", help="draw the timeline (with `all`: FILE-SCENARIO.png each)")
    drill.add_argument("--rate-interactive", type=float, default=1.0, help="streaming chats per second (default 1: a 2-core CPU machine)")
    drill.add_argument("--rate-batch", type=float, default=0.5, help="batch completions per second (default 0.5)")
    drill.add_argument("--gateway", metavar="URL", help="run against a running mesh at this URL (a cluster's gateway) instead of a local one")
    drill.add_argument("--admin", metavar="POOL=URL", action="append", default=[],
                       help="with --gateway: a pod's admin API of that pool, e.g. through `kubectl port-forward` (repeat)")
    drill.add_argument("--observe", action="store_true",
                       help="also run the local mesh's own Prometheus (as `up --observe`); the report links the dashboards' queries over the drill in it")
    drill.add_argument("--prometheus", metavar="URL", help="with --gateway: a Prometheus scraping the cluster's mesh, which the report links")
    drill.set_defaults(func=_cmd_drill)

    bench = sub.add_parser("bench", help="vllm serve vs plain Envoy vs infermesh, side by side on this machine (docs/bench.md)",
                           description="Start the three set-ups on the same models and cores, sweep the load "
                                       "(batch flood, overload) in interleaved rounds, and report ratios, goodput and outcomes.")
    bench.add_argument("--quick", action="store_true", help="2 rounds, 2 levels per scenario, short windows (a few minutes)")
    bench.add_argument("--scenario", choices=["batch-flood", "overload", "all", "prefix"], default="all",
                       help="all: batch-flood and overload; prefix: prefix-aware picking vs ORCA vs round robin (infermesh/bench_prefix.py)")
    bench.add_argument("--rounds", type=int, help="rounds (default 3, --quick 2)")
    bench.add_argument("--policy", help="mesh policy (default: mesh-config/policies/local.yaml); the bench works on a copy")
    bench.add_argument("--json", metavar="FILE", help="write the report as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw TTFT p99 vs batch load and goodput vs chat load")
    bench.set_defaults(func=_cmd_bench)

    policy = sub.add_parser("policy", help="the mesh policy file")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_sub.add_parser("check", help="validate a policy (its rules as the filter checks them); errors name the file, line and field")
    check.add_argument("file")
    check.set_defaults(func=_cmd_policy_check)
    render = policy_sub.add_parser("render", help="print a config generated from a policy")
    render.add_argument("file")
    render.add_argument("what", choices=["filter", "sidecar", "envoy", "istio", "helm-values"])
    render.add_argument("pool", nargs="?", help="with `sidecar`: the pool")
    render.add_argument("--wasm-url", help="with `istio`: where proxies fetch the filter (oci://…, https://…)")
    render.add_argument("--wasm-sha256", help="with `istio`: the module's SHA-256 (the image digest for oci://)")
    render.add_argument("--namespace", default="infermesh", help="with `istio`: the pools' namespace (default infermesh)")
    render.add_argument("--tracing-provider", default="", help="with `istio` and the policy's tracing on: the opentelemetry "
                        "extensionProvider of Istio's MeshConfig for Envoy's spans (docs/tracing.md)")
    render.set_defaults(func=_cmd_policy_render)

    from .content_classes import register as register_classes
    register_classes(sub)  # `infermesh classes train|eval|bench` (docs/content-classes.md)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
