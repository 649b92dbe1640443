"""Start and stop the processes of a local mesh: the sidecars (`replicas` per pool), then Envoy.

Children get PR_SET_PDEATHSIG so they die with the launcher even if it is SIGKILLed; a clean
stop sends SIGTERM (Envoy first so no new traffic arrives, then the sidecars, which drain) and
SIGKILLs whatever outlives the grace period.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from infermesh.meshconfig.envoy_bootstrap import write_bootstrap
from infermesh.meshconfig.envoy_resources import ACCESS_LOG_ENV, native_module_env
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.xds_server import xds_bootstrap

from . import paths
from .observe import Prometheus, PrometheusError, binary, mesh_targets, sidecar_pod


class LaunchError(RuntimeError):
    pass


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.setpgrp()  # Ctrl-C in the terminal reaches the launcher only; it stops children in order


def parse_cpus(spec: str, what: str = "cpus") -> set[int]:
    """CPU ids from `0`, `1`, `0-1`, `0,2-3` (the format of VLLM_CPU_OMP_THREADS_BIND and taskset
    -c); each must be one this process may run on, so a typo fails at start, not as a silent
    no-op of sched_setaffinity."""
    cpus: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if m is None:
            raise LaunchError(f"{what}: {spec!r} is not a CPU list such as 0, 0-1 or 0,2-3")
        cpus.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus:
        raise LaunchError(f"{what}: {spec!r} names no CPU")
    if not cpus <= allowed:
        raise LaunchError(f"{what}: {spec!r} names CPUs outside this process's set {sorted(allowed)}")
    return cpus


def _start_child(cpus: set[int] | None) -> Callable[[], None]:
    """The child's set-up before exec: die with the launcher and, with `cpus`, run only there.
    Affinity set before exec is inherited by everything the child spawns (vLLM's engine-core and
    worker processes), which VLLM_CPU_OMP_THREADS_BIND alone does not reach."""
    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    argv: list[str]
    env: dict[str, str] | None = None
    """Variables added to the launcher's environment (a restart keeps them)."""
    cpus: str | None = None
    """The CPUs its process tree is pinned to (a restart keeps them); None: not pinned."""

    def tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1, below the kernel's ephemeral range.

    A port picked by binding to 0 comes from the ephemeral range, and between picking it and the
    server binding it (a sidecar binds its ports only after loading its models, a minute or more)
    an outgoing connection or vLLM's own ZMQ sockets may take it. Ports below that range are
    only ever taken on purpose."""
    lo, hi = _ephemeral_range()
    candidates = list(range(10000, lo)) if lo > 11000 else list(range(hi + 1, 65536))
    random.SystemRandom().shuffle(candidates)
    socks, ports = [], []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
            if len(ports) == n:
                return ports
        raise LaunchError(f"not {n} free ports on 127.0.0.1")
    finally:
        for s in socks:
            s.close()


def plan_on_free_ports(policy_path: Path) -> LocalMeshPlan:
    """A local mesh plan from a policy file with every port picked free on 127.0.0.1 (so it runs
    beside another mesh, e.g. `infermesh up` on the default ports)."""
    from infermesh.meshconfig.local_mesh import PoolPorts, replica_list
    from infermesh.meshconfig.policy import load_policy

    policy = load_policy(policy_path)
    sidecars = replica_list(policy)
    ports = free_ports(4 + 4 * len(sidecars))
    pools = [PoolPorts(name, *ports[4 + 4 * i: 8 + 4 * i], replica=r) for i, (name, r) in enumerate(sidecars)]
    return LocalMeshPlan(policy_path=policy_path, policy=policy, listen_port=ports[0], admin_port=ports[1], xds_port=ports[2],
                         metrics_port=ports[3], pools=pools)


def wait_until(pred: Callable[[], object], timeout: float, every: float = 0.1, what: str = "condition"):
    """Poll `pred` until it returns something truthy (returned), or raise after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def _http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class LocalMesh:
    def __init__(self, plan: LocalMeshPlan, run_dir: Path, models_dir: Path | None = None, wasm: Path | None = None,
                 native_module: Path | None = None, cpu_cores: dict[str, str] | None = None, pin_tree: bool = False, proxy_cores: str | None = None,
                 observe: bool = False):
        self.plan = plan
        self.observe = observe
        """Also start a Prometheus of the mesh's own once it is up (`start_prometheus`)."""
        self.prometheus: Prometheus | None = None
        # Pool (or `pool.N`, one replica) -> the CPU ids its vLLM engines bind their OpenMP threads
        # to (VLLM_CPU_OMP_THREADS_BIND: `0`, `1`, `0-1`), so pools sharing one machine stop
        # competing for cores as separate GPU pools would; a pool left out keeps vLLM's own binding.
        self.cpu_cores = cpu_cores or {}
        self.pin_tree = pin_tree
        """Also pin each such sidecar's whole process tree (its Python front, vLLM's engine-core
        scheduler and workers) to those CPUs, not only the OpenMP compute threads."""
        self.proxy_cores = proxy_cores
        """CPUs for Envoy and the control plane (None: wherever Linux runs them)."""
        known = {p.name for p in plan.pools} | {p.key for p in plan.pools}
        for key, spec in self.cpu_cores.items():
            if key not in known:
                raise LaunchError(f"cpu_cores: no pool or replica {key!r} in the policy (there are {', '.join(sorted(known))})")
            parse_cpus(spec, f"cpu_cores[{key!r}]")
        if proxy_cores:
            parse_cpus(proxy_cores, "proxy_cores")
        self.run_dir = run_dir
        self.models_dir = models_dir or paths.models_dir()
        self.wasm = wasm or paths.filter_wasm()
        self.native_module = native_module or paths.filter_native_module()
        self.children: list[Child] = []
        self.ipc_dir: Path | None = None
        self.started_at: dict[str, float] = {}
        self.ready_after: dict[str, float] = {}

    # -- start ------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, cpus: str | None = None) -> Child:
        """Start a child (`cpus`: the CPU list it and everything it spawns may run on)."""
        log_path = self.run_dir / f"{name}.log"
        log = open(log_path, "ab")  # a restarted process goes on in the same log
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_start_child(parse_cpus(cpus, name) if cpus else None),
                                env=os.environ | env if env else None)
        log.close()
        child = Child(name, proc, log_path, argv, env, cpus)
        self.children = [c for c in self.children if c.name != name] + [child]
        self.started_at[name] = time.monotonic()
        return child

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a child's whole process group (a sidecar and its vLLM engine processes) and
        reap it: what a node losing a pod looks like."""
        c = self.child(name)
        try:
            os.killpg(c.proc.pid, sig)
        except ProcessLookupError:
            pass
        c.proc.wait(timeout=30)

    def restart(self, name: str) -> Child:
        """Start a child again with the same command line (after `kill`); see `wait_ready`."""
        c = self.child(name)
        if c.proc.poll() is None:
            raise LaunchError(f"{name} is still running")
        return self._spawn(name, c.argv, c.env, c.cpus)

    def sidecar_url(self, pool: str, replica: int = 0) -> str:
        return f"http://{self.plan.host}:{self.plan.replica(pool, replica).http_port}"

    def admin_url(self, pool: str, replica: int = 0) -> str:
        return f"http://127.0.0.1:{self.plan.replica(pool, replica).admin_port}"

    def admin_state(self, pool: str, replica: int = 0) -> dict:
        """A pool sidecar's GET /admin/state."""
        with urllib.request.urlopen(self.admin_url(pool, replica) + "/admin/state", timeout=5) as r:
            return json.loads(r.read())

    def held_breakers(self, pools: Sequence[str] | None = None) -> list[str]:
        """What keeps the sidecars of `pools` (all by default) from rest: each breaker that is not
        closed, as `pool/replica breaker: state (signal value)`, and any level above 0 without one.
        [] means at rest: every pool at level 0, every breaker closed."""
        held = []
        for p in self.plan.pools:
            if pools is not None and p.name not in pools:
                continue
            s = self.admin_state(p.name, p.replica)
            mine = [f"{p.name}/{p.replica} {b['name']}: {b['state']} ({b['signal']} {b['value']})"
                    for b in s["breakers"] if b["state"] != "closed"]
            held += mine or ([f"{p.name}/{p.replica}: level {s['level']}"] if s["level"] else [])
        return held

    def wait_at_rest(self, timeout: float, pools: Sequence[str] | None = None, why: str = "") -> None:
        """Wait until `held_breakers(pools)` is empty; the TimeoutError names what still held."""
        deadline = time.monotonic() + timeout
        while held := self.held_breakers(pools):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the mesh not at rest after {timeout:g}s{' ' + why if why else ''}: {'; '.join(held)}")
            time.sleep(0.2)

    @staticmethod
    def sidecar_name(pool: str, replica: int = 0) -> str:
        """The child's name: `sidecar-POOL` for the first replica, `sidecar-POOL.N` after it (and
        its `pod` label in the mesh's Prometheus)."""
        return sidecar_pod(pool, replica)

    @property
    def access_log(self) -> Path:
        """Envoy's JSON access log of the mesh listener."""
        return self.run_dir / "envoy-access.log"

    @property
    def base_url(self) -> str:
        return f"http://{self.plan.host}:{self.plan.listen_port}"

    def start(self, timeout: float = 300.0, progress: Callable[[str], None] = lambda s: None) -> None:
        if not self.wasm.exists():
            raise LaunchError(f"filter not built: {self.wasm} is missing (run scripts/setup.sh)")
        try:
            # Always, so that a policy edited to `filter.runtime: native` later finds the module.
            envoy_env = native_module_env(self.native_module)
        except ValueError as e:
            if self.plan.policy.filter.runtime == "native":
                raise LaunchError(str(e)) from e
            envoy_env = {}
        if self.observe:
            try:
                binary()  # before any process starts
            except PrometheusError as e:
                raise LaunchError(str(e)) from e
        if self.plan.policy.filter.runtime == "native" and not self.native_module.exists():
            raise LaunchError(f"filter.runtime: native, and the module is not built: {self.native_module} is missing "
                              "(run scripts/build-native-filter.sh)")
        for p in self.plan.pools:
            for model in self.plan.local_models(p.name):
                if not (self.models_dir / model / "config.json").exists():
                    raise LaunchError(f"model {model} not found in {self.models_dir} (run `infermesh models build`)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # vLLM's processes talk over ZeroMQ IPC sockets it never removes (VLLM_RPC_BASE_PATH,
        # default the system's temp dir): here in a directory of the mesh's own, gone at `stop`.
        # Short, as a socket's path must be (108 bytes), whatever the run directory is.
        self.ipc_dir = Path(tempfile.mkdtemp(prefix="infermesh-ipc-"))
        for p in self.plan.pools:
            name = self.sidecar_name(p.name, p.replica)
            cfg_path = self.run_dir / f"{name}.json"
            cfg_path.write_text(json.dumps(self.plan.sidecar_config(p, self.models_dir), indent=2))
            # A replica's own entry (`pool.N`) first, else the pool's.
            cores = self.cpu_cores.get(p.key) or self.cpu_cores.get(p.name)
            self._spawn(name, [sys.executable, "-m", "infermesh.sidecar.server", "--config", str(cfg_path)],
                        {"VLLM_RPC_BASE_PATH": str(self.ipc_dir)} | ({"VLLM_CPU_OMP_THREADS_BIND": cores} if cores else {}),
                        cores if self.pin_tree else None)
            ladder = " > ".join(self.plan.ladder(p.name))
            progress(f"sidecar {p.key}: starting ({ladder}; http :{p.http_port}, grpc :{p.grpc_port}, admin 127.0.0.1:{p.admin_port})")
        # The control plane serves Envoy its listener and clusters from the policy file (ADS)
        # and keeps watching the file; Envoy starts from a bootstrap that only names it.
        xds = [sys.executable, "-m", "infermesh.meshconfig.xds_server", "--policy", str(self.plan.policy_path),
               "--port", str(self.plan.xds_port), "--listen-host", self.plan.host, "--listen-port", str(self.plan.listen_port),
               "--wasm", str(self.wasm), "--native-module", str(self.native_module), "--metrics-port", str(self.plan.metrics_port)]
        for p in self.plan.pools:
            xds += ["--pool", f"{p.name}={self.plan.host}:{p.http_port}:{p.grpc_port}"]
            if p.admin_port:
                xds += ["--pool-admin", f"{p.name}=http://127.0.0.1:{p.admin_port}"]
        # Envoy's JSON access log (one line per request, docs/observability.md): the control plane
        # builds the listener in its own process and takes the path from its environment.
        self._spawn("control-plane", xds, {ACCESS_LOG_ENV: str(self.access_log)}, cpus=self.proxy_cores)
        progress(f"control plane: starting (ADS 127.0.0.1:{self.plan.xds_port}, metrics http://127.0.0.1:{self.plan.metrics_port}/metrics, "
                 f"watching {self.plan.policy_path})")
        bootstrap = self.run_dir / "envoy.json"
        bootstrap.write_text(json.dumps(xds_bootstrap(self.plan.admin_port, "127.0.0.1", self.plan.xds_port), indent=2))
        # For reading only: the resources the control plane serves, as a static config.
        served = self.plan.listener(self.wasm)
        served.access_log_path = str(self.access_log)
        write_bootstrap(served, self.run_dir / "envoy-resources.json")
        envoy = paths.envoy_binary()
        self._spawn(
            "envoy",
            # The access log reaches its file within half a second (Envoy's default: 10 s).
            [str(envoy), "-c", str(bootstrap), "--use-dynamic-base-id", "--concurrency", "2", "--log-level", "warn",
             "--drain-time-s", "1", "--parent-shutdown-time-s", "2", "--file-flush-interval-msec", "500"],
            envoy_env or None, cpus=self.proxy_cores,
        )
        progress(f"envoy: starting (listener :{self.plan.listen_port}, admin 127.0.0.1:{self.plan.admin_port})")
        try:
            self.wait_ready({c.name for c in self.children}, timeout, progress)
            # Ready means Envoy routes to every pool: its health checks must have seen them.
            wait_until(self.envoy_sees_every_pool, 30, every=0.1, what="Envoy's health checks to pass for every pool")
            if self.observe:
                self.start_prometheus()
                progress(f"prometheus: {self.prometheus.url} (scraping Envoy, the control plane and every sidecar every {self.prometheus.interval})")
        except (LaunchError, TimeoutError) as e:
            self.stop()
            raise LaunchError(str(e)) from e

    def start_prometheus(self, port: int = 0, timeout: float = 30.0) -> Prometheus:
        """A Prometheus on 127.0.0.1 (`port`, 0: a free one) scraping every process of the mesh
        (infermesh/observe.py), started as one of the mesh's children: it stops with the mesh, or
        with `stop_child("prometheus")`. Its config and storage are in RUN_DIR/prometheus."""
        self.prometheus = Prometheus(self.run_dir / "prometheus", port or free_ports(1)[0], mesh_targets(self.plan))
        self.prometheus.write_config()
        self._spawn("prometheus", self.prometheus.argv(), cpus=self.proxy_cores)
        self.wait_ready({"prometheus"}, timeout)
        # Ready is not scraping yet: Prometheus hands its targets to the scrapers ~5 s after start.
        wait_until(self.prometheus.all_up, timeout, every=0.25, what="Prometheus to scrape every process of the mesh")
        return self.prometheus

    def wait_ready(self, names: set[str], timeout: float, progress: Callable[[str], None] = lambda s: None) -> None:
        """Wait until every named child is ready; LaunchError if one exits or time runs out."""
        pending = set(names)
        deadline = time.monotonic() + timeout
        last_note = time.monotonic()
        while pending:
            for c in self.children:
                if c.name in pending and c.proc.poll() is not None:
                    raise LaunchError(f"{c.name} exited with code {c.proc.returncode} while starting:\n{c.tail()}")
            for name in sorted(pending):
                if self._ready(name):
                    pending.discard(name)
                    self.ready_after[name] = time.monotonic() - self.started_at[name]
                    progress(f"{name}: ready in {self.ready_after[name]:.1f}s")
            if time.monotonic() > deadline:
                raise LaunchError(f"not ready after {timeout:.0f}s: {', '.join(sorted(pending))}")
            if pending and time.monotonic() - last_note > 10:
                last_note = time.monotonic()
                waited = time.monotonic() - min(self.started_at[n] for n in pending)
                progress(f"waiting for {', '.join(sorted(pending))} ({waited:.0f}s; models load in ~30-60s on CPU)")
            time.sleep(0.25)

    def envoy_sees_every_pool(self) -> bool:
        """Every pool cluster's own (priority 0) endpoints are healthy in Envoy."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.plan.admin_port}/clusters?format=json", timeout=2) as r:
                clusters = json.loads(r.read()).get("cluster_statuses", [])
        except (urllib.error.URLError, OSError, ValueError):
            return False
        seen = 0
        for c in clusters:
            if not c["name"].startswith("pool_"):
                continue
            seen += 1
            own = [h for h in c.get("host_statuses", []) if h.get("priority", 0) == 0]
            if not own or any(set(h.get("health_status", {})) - {"eds_health_status"} or
                              h["health_status"].get("eds_health_status", "HEALTHY") != "HEALTHY" for h in own):
                return False
        return seen > 0

    def _ready(self, name: str) -> bool:
        if name == "control-plane":
            try:
                with socket.create_connection(("127.0.0.1", self.plan.xds_port), timeout=0.5):
                    return True
            except OSError:
                return False
        if name == "envoy":
            return _http_ok(f"http://127.0.0.1:{self.plan.admin_port}/ready")
        if name == "prometheus":
            return self.prometheus is not None and self.prometheus.ready()
        p = next(p for p in self.plan.pools if self.sidecar_name(p.name, p.replica) == name)
        return _http_ok(f"http://{self.plan.host}:{p.http_port}/health")

    # -- stop -------------------------------------------------------------------------------

    def stop_child(self, name: str, grace: float = 5.0) -> None:
        """Stop one child (SIGTERM, SIGKILL after `grace` s) and forget it."""
        c = self.child(name)
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
        try:
            c.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
        self.children.remove(c)
        if name == "prometheus":
            self.prometheus = None

    def stop(self, grace: float = 25.0) -> None:
        # Envoy first (no new traffic), then the control plane, then the sidecars drain in parallel.
        order = sorted(self.children, key=lambda c: {"envoy": 0, "control-plane": 1}.get(c.name, 2))
        for c in order:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
            if c.name in ("envoy", "control-plane"):
                try:
                    c.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
        deadline = time.monotonic() + grace
        for c in order:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
            # Whatever the child left behind in its process group goes too: a sidecar stopped
            # while it still loads its models dies at once and orphans vLLM's engine processes.
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.children.clear()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def __enter__(self) -> "LocalMesh":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
