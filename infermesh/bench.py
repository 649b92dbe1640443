"""`infermesh bench`: what infermesh buys a waiting person, side by side with what users run today.

    infermesh bench [--quick] [--scenario batch-flood|overload|all] [--json FILE] [--plot FILE.png]
    infermesh bench --scenario prefix [--quick] [--rounds N] [--json FILE]   (infermesh/bench_prefix.py)

Three set-ups on the same models, engine settings and machine, all started once and kept up
(an idle vLLM engine blocks on its input queue, so the set-ups not measured cost nothing):

- `vllm-serve`: vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) with the
  interactive pool's primary model, taking all traffic (what a user has without a mesh);
- `envoy-rr`: a plain Envoy (no filter, no classes) spreading all traffic round-robin over the
  pools' sidecars (a mesh without infermesh);
- `infermesh`: the local mesh (filter, classes, pools, priority, breakers, shedding).

`envoy-rr` and `infermesh` share the pools' sidecars, and each pool's sidecar runs on its own core,
its whole process tree (`LocalMesh(cpu_cores=…, pin_tree=True)`: interactive on CPU 0, batch on
CPU 1), as separate GPU pools would; `vllm-serve` gets both cores (the whole machine, as a user
would run it). The other processes are placed as `PLACEMENT` says, and the report prints it.

Scenarios (each a sweep of load levels, `bench_report.py` turns the windows into figures):

- `batch-flood`: a steady stream of streaming chats, driven and measured by vLLM's own serving
  benchmark client (`vllm.benchmarks.serve`, TTFT/ITL percentiles), while batch completions
  (the drills' client) rise from none to `flood_multiples` × what the batch pool serves without
  queueing (measured first: one completion at a time).
- `overload`: chats alone (the drills' client, with long and distinct prompts so prefix caching
  shares nothing) rise past what the interactive pool's KV cache holds, up to `EXTREME_MULTIPLE`
  (100x) what it serves one at a time, held for `extreme_window_s` (30 s); the pools' KV readings
  during each window are recorded, as proof of real pressure, and every refusal's time and
  whether it carried Retry-After.

Capacities come from a calibration that cannot be fooled by refusals: it waits until no breaker
of any pool acts, counts only successful, undegraded answers, and stops the bench, naming the
pool and the statuses it got, when it cannot get enough of them (`CalibrationError`).

Rounds alternate the set-ups (a rotated order every round) for every level, so each set-up sees
the machine as the others did. The KV cache of every model is set to `kv_cache_bytes` (the same
for all set-ups) so that pressure is reachable on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import yaml

from .drill import Drill, DrillOptions
from .drill_report import classify

SETUPS = ("vllm-serve", "envoy-rr", "infermesh")
SCENARIOS = ("batch-flood", "overload")
CPU_CORES = {"interactive": "0", "batch": "1"}
"""Each pool's sidecar on its own core, its whole process tree (front, vLLM's engine-core and
workers: `LocalMesh(pin_tree=True)`) and vLLM's OpenMP threads; vllm-serve gets both."""
ALL_CORES = "0-1"
PLACEMENT = {"envoy+control-plane": ALL_CORES, "envoy-rr": ALL_CORES, "vllm-serve": ALL_CORES,
             "flood-client": CPU_CORES["batch"], "bench-client": CPU_CORES["interactive"]}
"""Everything else, deliberately. Envoy carries both pools' traffic, so pinning it to either
pool's core would charge that pool for the other's requests: it floats, as a gateway on a GPU
node's host cores would. The flood's client is batch load: it runs on the batch core (on GPU
pools it is another machine). The bench's own process (vLLM's serving-benchmark client timing
the chats, 1-2 chats/s, and the watchers) runs on the interactive core, the side it measures."""
BATCH_TOKENS = 24
"""Tokens a batch completion of the drills' client asks for (`Drill.batch`)."""
EXTREME_MULTIPLE = 100.0
"""The overload sweep's extreme level, in multiples of the interactive pool's capacity."""


class CalibrationError(RuntimeError):
    """The calibration could not measure a pool: too few successful, undegraded answers."""


@dataclass
class BenchOptions:
    rounds: int = 3
    """Rounds; each runs every level of every scenario once per set-up."""
    window_s: float = 20.0
    """Length of one measured batch-flood window (arrivals stop then; requests in flight finish)."""
    overload_window_s: float = 24.0
    """Length of one overload window: long against the interactive pool's KV-cache breaker
    (fill ~2 s + sustain 2 s + escalation), so most of it shows the ladder acting, not the
    time before it (an 8 s window left ~3 s; docs/bench.md)."""
    interactive_rate: float = 2.0
    """Batch flood: streaming chats per second (steady, open loop): 2/s for 12 s puts 24 chats
    under each round's p99 (1/s for 8 s left 8, so one chat decided the ratio)."""
    flood_multiples: tuple[float, ...] = (0.0, 1.0, 3.0, 10.0)
    """Batch flood: batch load as multiples of the batch pool's capacity without queueing."""
    overload_multiples: tuple[float, ...] = (0.5, 2.0, 6.0, EXTREME_MULTIPLE)
    """Overload: chat load as multiples of the interactive pool's one-at-a-time capacity."""
    extreme_window_s: float = 30.0
    """Length of an overload window at `EXTREME_MULTIPLE` or more (the issue's 30 s at 100x)."""
    calibration_requests: int = 5
    """Successful, undegraded answers the calibration times per pool (after 2 warm-up answers)."""
    calibration_attempts: int = 20
    """Requests the calibration may send per pool to get them; fewer good answers stop the bench."""
    calibration_settle_s: float = 120.0
    """How long the calibration waits for every pool's breakers to stop acting."""
    overload_prompt_words: int = 120
    overload_max_tokens: int = 48
    ttft_target_s: float = 1.0
    """Goodput counts the chats whose first token came within this long."""
    kv_cache_bytes: int = 32 << 20
    """Every model's KV cache, in every set-up (small, so the overload sweep fills it on CPU)."""
    request_timeout_s: float = 20.0
    """A request with no response by then is lost (a waiting person has gone)."""

    @classmethod
    def quick(cls) -> "BenchOptions":
        return cls(rounds=2, window_s=12.0, overload_window_s=16.0, flood_multiples=(0.0, 10.0),
                   overload_multiples=(0.5, 6.0, EXTREME_MULTIPLE))


@dataclass
class Window:
    """One measured window: one set-up, one scenario, one load level, one round."""

    scenario: str
    setup: str
    level: float
    """The sweep's x value: batch completions/s (batch-flood) or chats/s (overload)."""
    round: int
    client: str
    """Who drove and measured the chats: `vllm-bench` (vllm.benchmarks.serve) or `drill`."""
    seconds: float
    ttfts: list[float] = field(default_factory=list)
    """Seconds to the first token, of every chat that was served (whatever its TTFT)."""
    itls: list[float] = field(default_factory=list)
    interactive: dict[str, int] = field(default_factory=dict)
    """Chat outcomes: ok, degraded, shed, failed, lost (see drill_report.py)."""
    batch: dict[str, int] = field(default_factory=dict)
    batch_tokens: int = 0
    kv_max: float | None = None
    """Highest KV-cache use of the engine serving chats during the window (0-1)."""
    level_max: int | None = None
    """Highest breaker level of the interactive pool during the window (sidecar set-ups)."""
    degraded_after_s: float | None = None
    """When the interactive pool first served new chats from its small model (level >= 2), in
    seconds from the window's start (sidecar set-ups; None: it did not)."""
    level_at_start: int | None = None
    """The highest pool level when the window began (0 unless a previous window's breakers,
    shedding included, had not recovered within `Bench.settle`'s timeout)."""
    cpu: dict = field(default_factory=dict)
    """Batch flood: each process's CPU during the window (`Bench._cpu_watch`): mean % of one core,
    and the share of samples it was running on CPU 0 (the interactive pool's engines' core)."""
    vllm_summary: dict = field(default_factory=dict)
    """vllm-bench windows: vLLM's own figures for the window (its goodput and p99s), for comparison."""
    multiple: float | None = None
    """Overload: the level as a multiple of the interactive pool's calibrated capacity."""
    refusal_s: list[float] = field(default_factory=list)
    """Overload: seconds from sending to the whole answer, of every 429/503."""
    refusals_without_retry_after: int = 0
    """Overload: 429/503 answers that carried no Retry-After."""


class BenchDrill(Drill):
    """The drills' load and records, aimed at one set-up; chats with long, distinct prompts for overload."""

    def __init__(self, mesh, options: DrillOptions, base_url: str, long_chats: BenchOptions | None = None, rate: float = 0.0):
        super().__init__(mesh, options)
        self.base_url = base_url
        self.long = long_chats
        self._n = 0
        # Enough connections for every request the rate can have open until the timeout: a
        # request waiting for one of the client's own connections would be lost by the client.
        conns = max(1024, int(rate * options.request_timeout_s * 1.5))
        self.client = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(options.request_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=conns, max_keepalive_connections=128))

    def chat_body(self) -> dict:
        if self.long is None:
            return super().chat_body()
        self._n += 1
        # The number first: no two prompts share a prefix block, so vLLM's prefix cache shares nothing.
        words = " ".join(f"w{(self._n * 7919 + i) % 997}" for i in range(self.long.overload_prompt_words))
        return {"model": self.model, "stream": True, "max_tokens": self.long.overload_max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"{self._n}: summarise {words}"}]}

    async def window(self, rate_interactive: float, rate_batch: float, seconds: float) -> None:
        loads = []
        if rate_interactive > 0:
            loads.append(asyncio.get_running_loop().create_task(self._arrivals(rate_interactive, self.interactive)))
        if rate_batch > 0:
            loads.append(asyncio.get_running_loop().create_task(self._arrivals(rate_batch, self.batch)))
        await asyncio.sleep(seconds)
        self.stop_load.set()
        await asyncio.gather(*loads)
        await self.drain()

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.opt.request_timeout_s + 5)

    def outcomes(self, kind: str, home: dict[str, str]) -> dict[str, int]:
        c = {o: 0 for o in ("ok", "degraded", "shed", "failed", "lost")}
        for r in self.requests:
            if r.kind == kind:
                r.outcome = classify(r, home, None)
                c[r.outcome if r.outcome in c else "failed"] += 1
        return c


def good(r) -> bool:
    """A successful, undegraded answer: the only kind a capacity may be measured on."""
    return r.status == 200 and r.complete and r.error is None and not r.degraded_header


def outcome_label(r) -> str:
    """One answer as the calibration reports it: its status (and error code), or what went wrong."""
    if r.status is None:
        return "no answer" + (f" ({r.error.split(':')[0]})" if r.error else "")
    if r.status == 200:
        return "200" if good(r) else ("200 degraded" if r.degraded_header else "200 incomplete")
    return f"{r.status} {r.error_code}" if r.error_code else str(r.status)


async def calibrate_pool(d, send, pool: str, kind: str, opt: BenchOptions, settle) -> dict:
    """Time `opt.calibration_requests` good answers of `send`, one at a time, after 2 good warm-up
    answers, within `opt.calibration_attempts` requests; a refusal waits for the pool to settle
    before the next try. Raises CalibrationError, naming the pool and the statuses, when it cannot."""
    from collections import Counter

    need = 2 + opt.calibration_requests
    good_ones = []
    for _ in range(opt.calibration_attempts):
        await send()
        r = d.requests[-1]
        if good(r):
            good_ones.append(r)
            if len(good_ones) >= need:
                break
        else:
            await settle()  # a refusal or a degraded answer: the pool was protecting itself
    outcomes = dict(Counter(outcome_label(r) for r in d.requests))
    timed = good_ones[2:]
    if len(timed) < opt.calibration_requests:
        raise CalibrationError(f"calibration: pool {pool} gave {len(good_ones)} successful, undegraded {kind} answers in "
                               f"{len(d.requests)} requests (needed {need}); answers: {outcomes}")
    lat = statistics.median(r.done - r.sent for r in timed)
    return {"pool": pool, "one_at_a_time_s": round(lat, 3), "capacity_rps": round(1 / lat, 2), "outcomes": outcomes,
            "timed_ms": [round((r.done - r.sent) * 1000, 1) for r in timed]}


# -- the set-ups --------------------------------------------------------------------------------

def plain_envoy_bootstrap(listen_port: int, admin_port: int, endpoints: list[tuple[str, int]]) -> dict:
    """A static Envoy without the filter: one round-robin cluster over every pool's sidecar, with
    the same connection limits, outlier detection and health checks as the mesh's pool clusters."""
    from infermesh.meshconfig.envoy_resources import (LOCAL_REPLY_CONFIG, POOL_LIMITS, admin, circuit_breakers,
                                                      health_checks, outlier_detection)

    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "plain", "codec_type": "AUTO", "stream_idle_timeout": "120s", "local_reply_config": LOCAL_REPLY_CONFIG,
        "route_config": {"name": "plain", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "pools_rr", "timeout": "0s"}}]}]},
        "http_filters": [{"name": "envoy.filters.http.router",
                          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    cluster = {
        "name": "pools_rr", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": POOL_LIMITS.connect_timeout,
        "circuit_breakers": circuit_breakers(), "outlier_detection": outlier_detection(), "health_checks": health_checks(False),
        "load_assignment": {"cluster_name": "pools_rr", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in endpoints]}]},
    }
    return {"admin": admin(admin_port), "static_resources": {
        "listeners": [{"name": "plain", "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                       "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}],
        "clusters": [cluster]}}


def bench_policy(source: Path, out: Path, kv_cache_bytes: int) -> Path:
    """A copy of the policy with every model's KV cache set to `kv_cache_bytes`."""
    doc = yaml.safe_load(source.read_text())
    for pool in doc["pools"].values():
        for m in pool["models"]:
            m["kv_cache_bytes"] = kv_cache_bytes
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


class Bench:
    def __init__(self, opt: BenchOptions, policy_path: Path, progress: Callable[[str], None]):
        self.opt = opt
        self.say = progress
        self.run_dir = Path(tempfile.mkdtemp(prefix="infermesh-bench-"))
        self.policy_path = bench_policy(policy_path, self.run_dir / "policy.yaml", opt.kv_cache_bytes)
        self.windows: list[Window] = []
        self.calibration: dict = {}

    # -- start / stop ---------------------------------------------------------------------------

    def start(self) -> None:
        from infermesh import paths
        from infermesh.launcher import LocalMesh, _http_ok, free_ports, parse_cpus, plan_on_free_ports, wait_until

        self.mesh = LocalMesh(plan_on_free_ports(self.policy_path), self.run_dir, cpu_cores=CPU_CORES, pin_tree=True,
                              proxy_cores=PLACEMENT["envoy+control-plane"])
        t0 = time.monotonic()
        self.mesh.start(timeout=600, progress=self.say)
        policy = self.mesh.plan.policy
        self.interactive_pool = policy.classes["interactive"].pool
        plain_port, plain_admin, vllm_port = free_ports(3)
        bootstrap = self.run_dir / "envoy-rr.json"
        bootstrap.write_text(json.dumps(plain_envoy_bootstrap(
            plain_port, plain_admin, [(self.mesh.plan.host, p.http_port) for p in self.mesh.plan.pools]), indent=2))
        self.mesh._spawn("envoy-rr", [str(paths.envoy_binary()), "-c", str(bootstrap), "--use-dynamic-base-id",
                                         "--concurrency", "2", "--log-level", "warn"], cpus=PLACEMENT["envoy-rr"])
        primary = policy.pools[self.interactive_pool].models[0]
        model_path = primary.path or str(self.mesh.models_dir / primary.name)
        names = [primary.name, *primary.aliases]
        self.mesh._spawn("vllm-serve", [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--served-model-name", *names,
            "--host", "127.0.0.1", "--port", str(vllm_port), "--max-model-len", str(primary.max_model_len),
            "--kv-cache-memory-bytes", str(primary.kv_cache_bytes), "--max-num-seqs", str(primary.max_num_seqs),
            "--dtype", primary.dtype, "--enforce-eager", "--disable-uvicorn-access-log"], {"VLLM_CPU_OMP_THREADS_BIND": ALL_CORES},
            cpus=PLACEMENT["vllm-serve"])
        self.say(f"vllm-serve: starting ({primary.name} on cores {ALL_CORES}); envoy-rr: starting (round-robin over the pools' sidecars)")
        self.urls = {"vllm-serve": f"http://127.0.0.1:{vllm_port}", "envoy-rr": f"http://127.0.0.1:{plain_port}",
                     "infermesh": self.mesh.base_url}
        self.model_path = model_path
        for name, probe in (("vllm-serve", self.urls["vllm-serve"] + "/health"), ("envoy-rr", f"http://127.0.0.1:{plain_admin}/ready")):
            def ready(probe=probe, name=name):
                c = self.mesh.child(name)
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{c.tail()}")
                return _http_ok(probe)
            wait_until(ready, 300, every=0.5, what=name)
        # Only now: every child above was given its own CPUs, and the flood's client gets its own
        # (parsed first: a CPU list is checked against this process's set, which this narrows).
        self.flood_cpus = parse_cpus(PLACEMENT["flood-client"])
        os.sched_setaffinity(0, parse_cpus(PLACEMENT["bench-client"]))
        self.say(f"all three set-ups up in {time.monotonic() - t0:.0f}s (logs in {self.run_dir})")

    def stop(self) -> None:
        if getattr(self, "mesh", None) is not None:
            self.mesh.stop()

    # -- load -------------------------------------------------------------------------------------

    def drill(self, setup: str, long_chats: bool = False, rate: float = 0.0) -> BenchDrill:
        opts = DrillOptions(request_timeout_s=self.opt.request_timeout_s)
        return BenchDrill(self.mesh, opts, self.urls[setup], self.opt if long_chats else None, rate)

    def home(self, setup: str) -> dict[str, str]:
        """Where each kind belongs: only the mesh has homes (a spill is a degradation); the
        others have none by design."""
        return {"interactive": self.interactive_pool, "batch": "batch"} if setup == "infermesh" else {}

    async def calibrate(self) -> None:
        """What each pool serves without queueing: one request at a time, straight to its sidecar,
        once no breaker of any pool acts. Only successful, undegraded answers are timed; every
        answer is kept in `calibration[kind]["outcomes"]`, and too few good ones stop the bench."""
        level = await self.settle(self.opt.calibration_settle_s)
        if level != 0:
            raise CalibrationError(f"calibration: the pools' breakers still acted (highest level {level}) after "
                                   f"{self.opt.calibration_settle_s:.0f} s; not measuring a pool that is protecting itself")
        for pool, long_chats, kind in (("batch", False, "batch"), (self.interactive_pool, True, "interactive")):
            d = BenchDrill(self.mesh, DrillOptions(request_timeout_s=self.opt.request_timeout_s), self.mesh.sidecar_url(pool),
                           self.opt if long_chats else None)
            try:
                self.calibration[kind] = await calibrate_pool(d, getattr(d, kind), pool, kind, self.opt, self.settle)
            finally:
                await d.client.aclose()
            c = self.calibration[kind]
            self.say(f"calibration: pool {pool} serves one {kind} request in {c['one_at_a_time_s'] * 1000:.0f} ms -> "
                     f"{c['capacity_rps']:.2f}/s without queueing (answers: {c['outcomes']})")

    async def _kv_watch(self, setup: str, stop: asyncio.Event, w: Window) -> None:
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=1.0) as c:
            while not stop.is_set():
                try:
                    if setup == "vllm-serve":
                        text = (await c.get(self.urls["vllm-serve"] + "/metrics")).text
                        m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.eE+-]+)", text, re.M)
                        kv = float(m.group(1)) if m else None
                    else:
                        st = (await c.get(self.mesh.admin_url(self.interactive_pool) + "/admin/state")).json()
                        kv = max(e["kv_cache_usage"] or 0.0 for e in st["engines"])
                        w.level_max = max(w.level_max or 0, st["level"])
                        if st["level"] >= 2 and w.degraded_after_s is None:
                            w.degraded_after_s = round(time.monotonic() - t0, 2)
                    if kv is not None:
                        w.kv_max = max(w.kv_max or 0.0, kv)
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    pass
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.25)

    async def _cpu_watch(self, stop: asyncio.Event, w: Window, extra: dict[str, int]) -> None:
        """Where the CPU goes during a flood window: the set-ups' processes (a sidecar's children
        are its vLLM engine cores), Envoy, the flood client and this process (vLLM's client)."""
        import psutil

        procs: dict[str, psutil.Process] = {}
        for c in self.mesh.children:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(c.proc.pid)
                procs[c.name] = p
                for i, k in enumerate(p.children(recursive=True)):
                    procs[f"{c.name}/engine{i}"] = k
        for name, pid in {**extra, "bench-client": os.getpid()}.items():
            with contextlib.suppress(psutil.Error):
                procs[name] = psutil.Process(pid)
        acc = {n: [0.0, 0, 0] for n in procs}  # cpu % summed, samples, samples on CPU 0
        for p in procs.values():
            with contextlib.suppress(psutil.Error):
                p.cpu_percent(None)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            for n, p in procs.items():
                with contextlib.suppress(psutil.Error):
                    acc[n][0] += p.cpu_percent(None)
                    acc[n][1] += 1
                    acc[n][2] += p.cpu_num() == 0
        w.cpu = {n: {"cpu_pct": round(a[0] / a[1], 1), "on_cpu0": round(a[2] / a[1], 2)} for n, a in acc.items() if a[1]}

    async def _vllm_bench(self, setup: str, rate: float, seconds: float) -> dict:
        """Chats driven and measured by vLLM's serving benchmark client, against one set-up."""
        from vllm.benchmarks import serve
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser()
        serve.add_cli_args(parser)
        n = max(2, round(rate * seconds))
        # No ready check: the set-up is up, and under a flood its one test request could miss a deadline.
        args = parser.parse_args([
            "--backend", "openai-chat", "--base-url", self.urls[setup], "--endpoint", "/v1/chat/completions",
            "--model", self.model_path, "--tokenizer", self.model_path, "--served-model-name", "tiny-llama",
            "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "16", "--ignore-eos",
            "--num-prompts", str(n), "--request-rate", str(rate), "--seed", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,95,99",
            "--goodput", f"ttft:{self.opt.ttft_target_s * 1000:g}", "--ready-check-timeout-sec", "0", "--save-detailed"])
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its own tables; ours come later
            return await serve.main_async(args)

    async def flood_window(self, setup: str, level: float, rnd: int, agree: bool) -> list[Window]:
        out = []
        level_at_start = await self.settle()
        flood = await self._start_flood(setup, level) if level > 0 else None
        try:
            if flood is not None:
                await asyncio.sleep(1.0)  # the flood is on before the first measured chat
            w = Window("batch-flood", setup, level, rnd, "vllm-bench", 0.0)
            stop = asyncio.Event()
            watch = asyncio.get_running_loop().create_task(self._cpu_watch(stop, w, {"flood-client": flood.pid} if flood else {}))
            t0 = time.monotonic()
            try:
                res = await self._vllm_bench(setup, self.opt.interactive_rate, self.opt.window_s)
            finally:
                stop.set()
                await watch
            seconds = time.monotonic() - t0
            batch = await self._stop_flood(flood) if flood is not None else {}
        finally:
            if flood is not None and flood.returncode is None:
                flood.kill()
                await flood.wait()
        # Goodput over the benchmark's own duration (its ready check before it is not load).
        w.seconds = res.get("duration") or seconds
        errs = res["errors"]
        w.vllm_summary = {k: res.get(k) for k in ("completed", "failed", "request_goodput", "p50_ttft_ms", "p99_ttft_ms",
                                                  "p50_itl_ms", "p99_itl_ms", "duration")}
        w.ttfts = [t for t, e in zip(res["ttfts"], errs) if not e]
        w.itls = [x for itl, e in zip(res["itls"], errs) if not e for x in itl]
        w.interactive = {"ok": len(w.ttfts), "degraded": 0, "shed": 0,
                         "failed": sum(1 for e in errs if e and "Timeout" not in e), "lost": sum(1 for e in errs if e and "Timeout" in e)}
        w.batch = batch
        w.level_at_start = level_at_start
        w.batch_tokens = BATCH_TOKENS * (batch.get("ok", 0) + batch.get("degraded", 0))
        out.append(w)
        if agree:
            # Our own client, same rate, no flood: it must agree with vLLM's client.
            d2 = self.drill(setup)
            try:
                await d2.window(self.opt.interactive_rate, 0, self.opt.window_s)
                w2 = Window("batch-flood", setup, level, rnd, "drill", self.opt.window_s)
                w2.interactive = d2.outcomes("interactive", self.home(setup))
                w2.ttfts = [r.ttft for r in d2.requests if r.ttft is not None and r.outcome in ("ok", "degraded")]
                out.append(w2)
            finally:
                await d2.client.aclose()
        return out

    async def _start_flood(self, setup: str, rate: float) -> asyncio.subprocess.Process:
        """The batch flood in a process of its own: at 10x capacity its client would otherwise slow
        the event loop that times the chats, and the chats' TTFT would be the client's."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "infermesh.bench", "--flood", self.urls[setup], "--policy", str(self.policy_path),
            "--rate", str(rate), "--timeout", str(self.opt.request_timeout_s), "--home", json.dumps(self.home(setup)),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            preexec_fn=functools.partial(os.sched_setaffinity, 0, self.flood_cpus))
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if line.strip() != b"started":
            raise RuntimeError(f"the batch flood process did not start: {line!r}")
        return proc

    async def _stop_flood(self, proc: asyncio.subprocess.Process) -> dict[str, int]:
        proc.stdin.write(b"stop\n")
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), self.opt.request_timeout_s + 30)
        await proc.wait()
        return json.loads(line)

    async def settle(self, timeout_s: float = 45.0) -> int:
        """Wait until no pool has a breaker action on and none has requests in flight (a previous
        window's breakers must not serve this one: envoy-rr and infermesh share the sidecars, and
        a vllm-serve flood window, ~35 s at 100 % of both cores, opens the pools' cpu breakers,
        whose shedding would then meet the next window's batch); returns the highest pool level then."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as c:
            while True:
                try:
                    states = [(await c.get(self.mesh.admin_url(p.name, p.replica) + "/admin/state")).json() for p in self.mesh.plan.pools]
                    if all(st["level"] == 0 and st["in_flight"] == 0 for st in states) or time.monotonic() > deadline:
                        return max(st["level"] for st in states)
                except (httpx.HTTPError, ValueError, KeyError):
                    if time.monotonic() > deadline:
                        return -1
                await asyncio.sleep(0.5)

    async def overload_window(self, setup: str, level: float, rnd: int) -> Window:
        d = self.drill(setup, long_chats=True, rate=level)
        multiple = level / self.calibration["interactive"]["capacity_rps"]
        seconds = self.opt.extreme_window_s if multiple >= EXTREME_MULTIPLE - 1e-6 else self.opt.overload_window_s
        w = Window("overload", setup, level, rnd, "drill", seconds, multiple=round(multiple, 1))
        w.level_at_start = await self.settle()
        stop = asyncio.Event()
        watch = asyncio.get_running_loop().create_task(self._kv_watch(setup, stop, w))
        try:
            await d.window(level, 0, seconds)
        finally:
            stop.set()
            await watch
            await d.client.aclose()
        w.interactive = d.outcomes("interactive", self.home(setup))
        w.ttfts = [r.ttft for r in d.requests if r.ttft is not None and r.outcome in ("ok", "degraded")]
        refused = [r for r in d.requests if r.status in (429, 503)]
        w.refusal_s = [round(r.done - r.sent, 4) for r in refused if r.done is not None]
        w.refusals_without_retry_after = sum(1 for r in refused if not r.retry_after)
        return w

    async def run(self, scenarios: list[str]) -> None:
        if "batch-flood" in scenarios:
            from vllm.benchmarks import serve  # noqa: F401  (its import takes ~20 s: not inside a window)
        await self.calibrate()
        c_batch = self.calibration["batch"]["capacity_rps"]
        c_chat = self.calibration["interactive"]["capacity_rps"]
        plan: list[tuple[str, float]] = []
        if "batch-flood" in scenarios:
            plan += [("batch-flood", round(m * c_batch, 2)) for m in self.opt.flood_multiples]
        if "overload" in scenarios:
            plan += [("overload", round(m * c_chat, 2)) for m in self.opt.overload_multiples]
        total = self.opt.rounds * len(plan) * len(SETUPS)
        i = 0
        for rnd in range(self.opt.rounds):
            for scenario, level in plan:
                order = SETUPS[rnd % 3:] + SETUPS[:rnd % 3]
                for setup in order:
                    i += 1
                    self.say(f"[{i}/{total}] round {rnd + 1} {scenario} level {level:g}/s {setup}")
                    if scenario == "batch-flood":
                        ws = await self.flood_window(setup, level, rnd, agree=(rnd == 0 and level == 0))
                    else:
                        ws = [await self.overload_window(setup, level, rnd)]
                    self.windows += ws
                    for w in ws:
                        self.say(f"    {w.client}: {w.interactive} ttft p99 "
                                 f"{(max(w.ttfts) if w.ttfts else float('nan')) * 1000:.0f} ms max; batch {w.batch or '-'}"
                                 + (f"; kv max {w.kv_max:.2f}" if w.kv_max is not None else ""))
                    await asyncio.sleep(1.0)  # the engines finish what was aborted before the next set-up

    def result(self, scenarios: list[str]) -> dict:
        from .bench_report import build_report

        return build_report([asdict(w) for w in self.windows], self.opt.ttft_target_s, self.calibration,
                            {"options": asdict(self.opt), "scenarios": scenarios,
                             "cpu_cores": {**{f"sidecar-{p}": c for p, c in CPU_CORES.items()}, **PLACEMENT},
                             "pinned": "each sidecar's whole process tree (front, vLLM engine-core and workers) "
                                       "and its OpenMP threads; every other process as listed",
                             # Each window's own chats (TTFTs in the order they were sent), so a
                             # slow round can be placed in time afterwards (docs/bench.md).
                             "windows": [asdict(w) for w in self.windows]})


def run_cli(args: argparse.Namespace) -> int:
    from infermesh.launcher import LaunchError
    from infermesh.meshconfig.policy import LOCAL_POLICY

    from .bench_report import format_report, plot_report
    from .models import build_all

    def say(msg: str) -> None:
        print(f"bench: {msg}", file=sys.stderr, flush=True)

    opt = BenchOptions.quick() if args.quick else BenchOptions()
    if args.rounds:
        opt.rounds = args.rounds
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    build_all()
    bench = Bench(opt, Path(args.policy) if args.policy else LOCAL_POLICY, say)
    try:
        bench.start()
        asyncio.run(bench.run(scenarios))
    except LaunchError as e:
        say(f"a set-up failed to start: {e}")
        return 1
    except CalibrationError as e:
        say(f"stopped: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        bench.stop()
    rep = bench.result(scenarios)
    print(format_report(rep), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2))
        say(f"JSON in {args.json}")
    if args.plot:
        plot_report(rep, args.plot)
        say(f"picture in {args.plot}")
    say(f"logs and generated configs in {bench.run_dir}")
    return 0


def _flood_main(argv: list[str]) -> int:
    """`python -m infermesh.bench --flood URL ...`: batch completions at a rate (the drills' open-loop
    client) until a line arrives on stdin, then their outcomes as one JSON line."""
    from types import SimpleNamespace

    from infermesh.meshconfig.policy import load_policy

    p = argparse.ArgumentParser()
    p.add_argument("--flood", required=True, help="base URL")
    p.add_argument("--policy", required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--home", default="{}")
    a = p.parse_args(argv)

    async def main() -> dict:
        mesh = SimpleNamespace(plan=SimpleNamespace(policy=load_policy(a.policy)))
        d = BenchDrill(mesh, DrillOptions(request_timeout_s=a.timeout), a.flood)
        load = asyncio.get_running_loop().create_task(d._arrivals(a.rate, d.batch))
        print("started", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        d.stop_load.set()
        await load
        await d.drain()
        await d.client.aclose()
        return d.outcomes("batch", json.loads(a.home))

    print(json.dumps(asyncio.run(main())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_flood_main(sys.argv[1:]))
