"""Benchmark the sidecar's fronts against vLLM itself, one run, side by side.

Same model (tiny-llama-large), same engine settings, same load: C concurrent streams, each
asking for T tokens (ignore_eos, so every request yields exactly T), R requests in all; then S
lone 8-token requests one at a time (the front's own latency, without batching effects).

  in-process   AsyncLLM consumed directly in the benchmark's own process (the ceiling)
  sidecar-grpc infermesh sidecar, gRPC Generate (grpc.aio client)
  sidecar-http infermesh sidecar, OpenAI HTTP/SSE (httpx client)
  vllm-serve   vLLM's own OpenAI server (python -m vllm.entrypoints.openai.api_server), HTTP/SSE,
               with --disable-log-stats (the strongest reference: no stats work per step)
  vllm-serve-stats  the same server as users start it, stats on (vLLM's default; the sidecar
               always has them: its breakers read the KV cache from them)

All engines are loaded once and stay up (an idle vLLM engine blocks on its input queue);
the variants then take turns, K rounds, each round in a rotated order, so every variant sees the
machine as it is at that moment. Each ratio (sidecar-grpc / in-process, sidecar-http /
vllm-serve) is taken within a round and the median over rounds is reported with its range.
Absolute numbers from these machines are not meaningful; the ratios are.

The HTTP variants' client runs in a process of its own (`HttpClientProcess`: this script with
`--client-worker`, nothing but httpx on uvloop, one connection pool per server), as vLLM's own
`vllm bench serve` client would: in the benchmark's process, beside the in-process engine and the
gRPC channel, the same client served both HTTP servers at a third of their speed and added
30-60 ms to lone requests (docs/sidecar-benchmark.md, runs G and I).

Lone requests are not paired request by request between variants: the first request an engine
gets after another engine ran waits up to ~0.9 s on these 2 shared cores (tried; see
docs/sidecar-benchmark.md), so each variant's lone requests run as a block within its turn.

What a front adds is also measured exactly, request by request, on the sidecar's own engine:
after each lone request the sidecar's TTFT histogram is read (/metrics), and its sum grows by
the sidecar's own time from admission to that request's first token; the client's TTFT minus
that is the front's overhead for that request (both transports, the servicer, the client's own
work), free of the engine's round-to-round noise. The gRPC turn alternates (ABBA) Python's
grpc.aio client with a grpc-go client (sidecar/bench/grpcttft, built with `go` when present),
which tells the server's share from what the Python client adds on its side.

    python sidecar/bench/run_bench.py [--rounds 3] [--concurrency 16] [--tokens 128] [--requests 64] [--no-go-client] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from infermesh import paths
from infermesh.launcher import free_ports

MODEL = "tiny-llama-large"
KV_BYTES = 256 << 20
MAX_LEN = 1024
PROMPT = "Summarize the following: the service mesh routes interactive chat and batch work to pools."


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def drive(one, concurrency: int, requests: int) -> tuple[list[float], int, float]:
    """Run `requests` calls of `one()` (-> (ttft, tokens)) with `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    total = 0

    async def task():
        nonlocal total
        async with sem:
            ttft, n = await one()
            ttfts.append(ttft)
            total += n

    t0 = time.monotonic()
    await asyncio.gather(*(task() for _ in range(requests)))
    return ttfts, total, time.monotonic() - t0


# ---- the variants: each is `one(tokens) -> (ttft, completion tokens)` ---------------------------

async def in_process_engine():
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(paths.models_dir() / MODEL), kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_LEN,
        enforce_eager=True, disable_log_stats=True))
    counter = itertools.count()

    async def one(tokens: int):
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        t0 = time.monotonic()
        ttft, n = None, 0
        async for out in eng.generate(PROMPT, sp, f"r{next(counter)}"):  # vLLM tokenizes, as for any text prompt
            k = len(out.outputs[0].token_ids)
            if k and ttft is None:
                ttft = time.monotonic() - t0
            n += k
        return ttft, n

    return eng, one


def sse_variant(client, base: str):
    async def one(tokens: int):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        ttft, n = None, 0
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    n = ev["usage"]["completion_tokens"]
                if ev.get("choices") and ev["choices"][0].get("text") and ttft is None:
                    ttft = time.monotonic() - t0
        return ttft, n

    return one


def grpc_variant(stub):
    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb

    async def one(tokens: int):
        t0 = time.monotonic()
        ttft, n = None, 0
        async for msg in stub.Generate(pb.GenerateRequest(text=PROMPT, max_tokens=tokens, ignore_eos=True), timeout=300):
            if msg.HasField("chunk") and ttft is None:
                ttft = time.monotonic() - t0
            if msg.HasField("final"):
                n = msg.final.usage.completion_tokens
        return ttft, n

    return one


async def lone_requests(clients, n: int, read_sum=None) -> dict[str, list[float]]:
    """`n` lone 8-token requests per client (`clients`: (label, call) pairs, ABBA so each is as
    often first as second on the same engine); with `read_sum` (the sidecar's TTFT-histogram sum
    for one front), each request's front overhead too."""
    out: dict[str, list[float]] = {}
    # Nothing else runs meanwhile: one reading after each request is the next one's "before".
    last = await read_sum() if read_sum else 0.0
    for i in range(n):
        for label, call in (clients if i % 4 in (0, 3) else clients[::-1]):
            ttft, _ = await call()
            out.setdefault(label, []).append(ttft)
            if read_sum:
                before, last = last, await read_sum()
                out.setdefault(label + "_overhead", []).append(ttft - (last - before))
            await asyncio.sleep(0.02)  # the same pause after every lone request, every variant
    return out


async def client_worker() -> None:
    """`--client-worker`: one JSON command a line on stdin, one JSON answer a line on stdout."""
    import gc

    import httpx

    clients: dict[str, httpx.AsyncClient] = {}
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    gc.freeze()
    while line := await reader.readline():
        cmd = json.loads(line)
        base = cmd["base"]
        if base not in clients:  # a pool per server: no server's idle connections crowd another's
            c = int(cmd["concurrency"])
            clients[base] = httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=2 * c, max_keepalive_connections=2 * c))
        client = clients[base]
        one = sse_variant(client, base)
        if cmd["op"] == "load":
            ttfts, tokens, wall = await drive(lambda: one(cmd["tokens"]), cmd["concurrency"], cmd["requests"])
            answer = {"ttfts": ttfts, "tokens": tokens, "wall": wall}
        else:
            url = cmd.get("metrics_url")
            answer = await lone_requests([("py", lambda: one(8))], cmd["n"],
                                         (lambda: sidecar_ttft_sum(client, url, "http")) if url else None)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    for c in clients.values():
        await c.aclose()


class HttpClientProcess:
    """The HTTP variants' client, in its own process (see the module's docstring)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, __file__, "--client-worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    async def call(self, **cmd) -> dict:
        def roundtrip() -> dict:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the HTTP client process exited ({self.proc.poll()})")
            return json.loads(line)
        return await asyncio.get_running_loop().run_in_executor(None, roundtrip)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def go_client_binary() -> Path | None:
    """Build sidecar/bench/grpcttft once (keyed by its sources); None without a Go toolchain."""
    src = Path(__file__).parent / "grpcttft"
    if shutil.which("go") is None:
        say("bench: no `go` here: the grpc-go client is left out")
        return None
    key = hashlib.sha256(b"".join((src / f).read_bytes() for f in ("go.mod", "go.sum", "main.go"))).hexdigest()[:12]
    out = paths.home() / "bin" / f"grpcttft-{key}"
    if not out.exists():
        say("bench: building the grpc-go client (sidecar/bench/grpcttft) …")
        out.parent.mkdir(parents=True, exist_ok=True)
        env = os.environ | {"GOFLAGS": "-mod=readonly -buildvcs=false"}
        subprocess.run(["go", "build", "-o", str(out) + ".tmp", "."], cwd=src, env=env, check=True)
        os.replace(str(out) + ".tmp", out)
    return out


class GoClient:
    """One grpcttft process on one connection: a call per line written, its TTFT read back."""

    def __init__(self, binary: Path, port: int, request: bytes):
        self.proc = subprocess.Popen(
            [str(binary), "-addr", f"127.0.0.1:{port}", "-request", request.hex()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    async def one(self) -> float:
        def call() -> float:
            self.proc.stdin.write("\n")
            line = self.proc.stdout.readline()
            if not line or line.startswith("error"):
                raise RuntimeError(f"grpcttft: {line.strip() or 'exited'}")
            return float(line)
        return await asyncio.get_running_loop().run_in_executor(None, call)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


_TTFT_SUM = re.compile(r'^infermesh_sidecar_time_to_first_token_seconds_sum\{([^}]*)\} (\S+)$', re.M)


async def sidecar_ttft_sum(client, metrics_url: str, front: str) -> float:
    """The sidecar's own TTFT histogram sum (seconds) for one front, over every class."""
    text = (await client.get(metrics_url)).text
    return sum(float(v) for labels, v in _TTFT_SUM.findall(text) if f'front="{front}"' in labels)


def _proc_stats() -> dict[int, list[str]]:
    """Every process's /proc/PID/stat fields after its name (field 3 on: state, ppid, …)."""
    stats = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                stats[int(pid)] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return stats


def _descendants(stats: dict[int, list[str]], root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, f in stats.items():
        children.setdefault(int(f[1]), []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of `root` ("front") and of all its descendants
    ("engine": vLLM's engine-core and worker processes), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = _proc_stats()

    def cpu(pid: int) -> float:
        f = stats.get(pid)
        return (int(f[11]) + int(f[12])) / tick if f else 0.0
    return {"front": cpu(root), "engine": sum(cpu(p) for p in _descendants(stats, root))}


def pin_server(root: int, front: set[int], engine: set[int]) -> None:
    """Every thread of `root` (the server's front) on `front`, every thread of its descendants
    (vLLM's engine-core and worker processes) on `engine`."""
    for pid in [root, *_descendants(_proc_stats(), root)]:
        with contextlib.suppress(OSError):  # a process gone meanwhile
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), front if pid == root else engine)


# ---- the servers ------------------------------------------------------------------------------

def start_sidecar(work: Path, event_loop: str, coalesce_ms: float | None = None) -> tuple[subprocess.Popen, Path, int, int]:
    http_port, grpc_port = free_ports(2)
    cfg = {
        "pool": "bench",
        "models": [{"name": MODEL, "path": str(paths.models_dir() / MODEL), "max_model_len": MAX_LEN, "kv_cache_bytes": KV_BYTES}],
        "server": {"http_port": http_port, "grpc_port": grpc_port, "max_concurrent_requests": 1024,
                   **({} if coalesce_ms is None else {"stream_coalesce_ms": coalesce_ms})},
    }
    (work / "sidecar.json").write_text(json.dumps(cfg))
    log = work / "sidecar.log"
    proc = subprocess.Popen([sys.executable, "-m", "infermesh.sidecar.server", "--config", str(work / "sidecar.json"),
                             "--event-loop", event_loop],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, http_port, grpc_port


def start_vllm_serve(work: Path, log_stats: bool = False) -> tuple[subprocess.Popen, Path, int]:
    """vLLM's own server; `log_stats` keeps vLLM's stats on (its default, what feeds its `vllm:*`
    metrics; the sidecar always has them, its breakers read the KV cache from them)."""
    (port,) = free_ports(1)
    log = work / ("vllm-stats.log" if log_stats else "vllm.log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(paths.models_dir() / MODEL),
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_LEN),
         "--kv-cache-memory-bytes", str(KV_BYTES), "--enforce-eager", "--disable-uvicorn-access-log"]
        + ([] if log_stats else ["--disable-log-stats"]),
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, port


async def wait_http(client, url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            if (await client.get(url, timeout=2)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("server did not start: " + log.read_text()[-3000:])


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- the run ----------------------------------------------------------------------------------

VARIANTS = ("in-process", "sidecar-grpc", "sidecar-http", "vllm-serve", "vllm-serve-stats")


async def bench(args, work: Path) -> dict:
    import grpc
    import httpx

    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

    go_bin = go_client_binary() if args.go_client else None
    http_client = HttpClientProcess()
    chosen = [v for v in VARIANTS if v in args.variants]
    say(f"bench: loading the engines of {', '.join(chosen)} …")
    sidecar, sidecar_log, http_port, grpc_port = start_sidecar(work, args.sidecar_event_loop, args.sidecar_coalesce_ms)
    serve = serve_stats = None
    if "vllm-serve" in chosen:
        serve, serve_log, serve_port = start_vllm_serve(work)
    if "vllm-serve-stats" in chosen:
        serve_stats, serve_stats_log, serve_stats_port = start_vllm_serve(work, log_stats=True)
    eng = go = None
    in_proc = None
    try:
        limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client, \
                grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            if "in-process" in chosen:
                eng, in_proc = await in_process_engine()
            await wait_http(client, f"http://127.0.0.1:{http_port}/health", sidecar, sidecar_log)
            http_bases = {"sidecar-http": f"http://127.0.0.1:{http_port}"}
            server_pids = {"sidecar-http": sidecar.pid, "sidecar-grpc": sidecar.pid}
            if serve is not None:
                await wait_http(client, f"http://127.0.0.1:{serve_port}/health", serve, serve_log)
                http_bases["vllm-serve"] = f"http://127.0.0.1:{serve_port}"
                server_pids["vllm-serve"] = serve.pid
            if serve_stats is not None:
                await wait_http(client, f"http://127.0.0.1:{serve_stats_port}/health", serve_stats, serve_stats_log)
                http_bases["vllm-serve-stats"] = f"http://127.0.0.1:{serve_stats_port}"
                server_pids["vllm-serve-stats"] = serve_stats.pid
            if args.pin:
                # vLLM's CPU engine-core and worker busy-wait on each other (shm_broadcast's
                # SpinCondition: sched_yield for 1 s after each read); sharing both cores with
                # the front and the client, that spin took 3-7x the CPU per token in some load
                # phases and not others. Engines on CPU 0, fronts and clients on CPU 1, as a GPU
                # would take the engine's work off the front's cores.
                engine_cpus, front_cpus = {0}, {1}
                # this process first: the servers are its children too, pinned next
                for pid in [os.getpid(), *set(server_pids.values())]:
                    pin_server(pid, front_cpus, engine_cpus)
                pin_server(http_client.proc.pid, front_cpus, front_cpus)
            go = GoClient(go_bin, grpc_port, pb.GenerateRequest(text=PROMPT, max_tokens=8, ignore_eos=True).SerializeToString()) if go_bin else None
            metrics_url = f"http://127.0.0.1:{http_port}/metrics"
            ones = {
                "in-process": in_proc,
                "sidecar-grpc": grpc_variant(pb_grpc.InferenceStub(channel)),
            }

            async def load_phase(name: str, tokens: int, concurrency: int, requests: int) -> tuple[list[float], int, float]:
                if name in http_bases:
                    a = await http_client.call(op="load", base=http_bases[name], tokens=tokens, concurrency=concurrency, requests=requests)
                    return a["ttfts"], a["tokens"], a["wall"]
                one = ones[name]
                return await drive(lambda: one(tokens), concurrency, requests)

            for name in chosen:  # warm-up: first requests compile and fill caches
                await load_phase(name, args.tokens, args.concurrency, args.concurrency)
                await load_phase(name, 8, 1, 5)
            if go:
                for _ in range(5):
                    await go.one()
            # The client shares this process with the in-process engine's heap (vLLM, torch):
            # frozen, as vLLM's server and the sidecar freeze theirs, so the client's own
            # collections do not walk it between messages.
            from vllm.utils.gc_utils import freeze_gc_heap

            freeze_gc_heap()

            async def lone_block(name: str) -> dict[str, list[float]]:
                """`args.single` lone 8-token requests; on the sidecar, each one's front overhead too."""
                if name in http_bases:
                    return await http_client.call(op="lone", base=http_bases[name], concurrency=args.concurrency, n=args.single,
                                                  metrics_url=metrics_url if name == "sidecar-http" else None)
                clients = [("py", lambda: ones[name](8))]
                if name == "sidecar-grpc" and go:
                    async def go_one():
                        return await go.one(), 8
                    clients.append(("go", go_one))
                read_sum = (lambda: sidecar_ttft_sum(client, metrics_url, "grpc")) if name == "sidecar-grpc" else None
                return await lone_requests(clients, args.single, read_sum)
            rounds: list[dict[str, dict]] = []
            for r in range(args.rounds):
                order = chosen[r % len(chosen):] + chosen[: r % len(chosen)]
                res: dict[str, dict] = {}
                for name in order:
                    await asyncio.sleep(args.gap_s)
                    server = server_pids.get(name)
                    cpu0 = tree_cpu_seconds(server) if server else None
                    ttfts, tokens, wall = await load_phase(name, args.tokens, args.concurrency, args.requests)
                    cpu1 = tree_cpu_seconds(server) if server else None
                    lone = await lone_block(name)
                    res[name] = {"tokens_per_s": tokens / wall, "ttft_p50_ms": 1000 * statistics.median(ttfts),
                                 "ttft_p99_ms": 1000 * pct(ttfts, 0.99), "lone_ttft_p50_ms": 1000 * statistics.median(lone["py"]),
                                 "lone_ttft_p99_ms": 1000 * pct(lone["py"], 0.99), "tokens": tokens}
                    for label, key in (("py_overhead", "front_overhead_p50_ms"), ("go", "go_lone_ttft_p50_ms"),
                                       ("go_overhead", "go_front_overhead_p50_ms")):
                        if label in lone:
                            res[name][key] = 1000 * statistics.median(lone[label])
                    if cpu0:  # the server's own CPU per 1000 tokens: the load phase's cost, free of wall-time noise
                        for part in ("front", "engine"):
                            res[name][f"{part}_cpu_ms_per_1k_tokens"] = 1e6 * (cpu1[part] - cpu0[part]) / tokens
                    say(f"  round {r + 1}/{args.rounds} {name:16s} {tokens / wall:7.1f} tok/s  TTFT p50 {res[name]['ttft_p50_ms']:7.1f} ms"
                        f"  lone TTFT p50 {res[name]['lone_ttft_p50_ms']:6.2f} ms"
                        + "".join(f"  {k} {v:.2f}" for k, v in res[name].items() if "overhead" in k or "cpu" in k or k.startswith("go_")))
                rounds.append(res)
    finally:
        http_client.close()
        if go is not None:
            go.close()
        if eng is not None:
            eng.shutdown()
        for proc in (sidecar, serve, serve_stats):
            if proc is not None:
                stop(proc)
    return {"rounds": rounds}


def report(rounds: list[dict[str, dict]]) -> dict:
    def med(f) -> tuple[float, float, float] | None:
        try:
            xs = [f(r) for r in rounds]
        except KeyError:  # a variant this run left out (--variants)
            return None
        return statistics.median(xs), min(xs), max(xs)

    present = [v for v in VARIANTS if v in rounds[0]]  # an earlier run's --json may lack a variant
    summary = {v: {k: statistics.median(r[v][k] for r in rounds) for k in rounds[0][v]} for v in present}

    def ratio(a: str, b: str, key: str = "tokens_per_s") -> tuple[float, float, float]:
        return med(lambda r: r[a][key] / r[b][key])

    def added(a: str, b: str, key: str, b_key: str | None = None) -> tuple[float, float, float]:
        return med(lambda r: r[a][key] - r[b][b_key or key])

    def own(v: str, key: str) -> tuple[float, float, float]:
        return med(lambda r: r[v][key])

    ratios = {
        "grpc_vs_in_process_tokens": ratio("sidecar-grpc", "in-process"),
        "grpc_added_lone_ttft_p50_ms": added("sidecar-grpc", "in-process", "lone_ttft_p50_ms"),
        "grpc_front_overhead_p50_ms": own("sidecar-grpc", "front_overhead_p50_ms"),
        "grpc_added_ttft_p50_ms_under_load": added("sidecar-grpc", "in-process", "ttft_p50_ms"),
        # vLLM's own server is a separate process too: the engine-placement share of the above
        "grpc_vs_vllm_serve_lone_ttft_p50_ms": added("sidecar-grpc", "vllm-serve", "lone_ttft_p50_ms"),
        "vllm_serve_vs_in_process_lone_ttft_p50_ms": added("vllm-serve", "in-process", "lone_ttft_p50_ms"),
        "http_front_overhead_p50_ms": own("sidecar-http", "front_overhead_p50_ms"),
        "http_vs_vllm_serve_tokens": ratio("sidecar-http", "vllm-serve"),
        "http_vs_vllm_serve_lone_ttft_p50_ms": added("sidecar-http", "vllm-serve", "lone_ttft_p50_ms"),
        "http_vs_vllm_serve_ttft_p50": ratio("sidecar-http", "vllm-serve", "ttft_p50_ms"),
        "http_vs_vllm_serve_ttft_p99": ratio("sidecar-http", "vllm-serve", "ttft_p99_ms"),
        "http_vs_vllm_serve_lone_ttft_p50": ratio("sidecar-http", "vllm-serve", "lone_ttft_p50_ms"),
        "http_vs_in_process_tokens": ratio("sidecar-http", "in-process"),
        "vllm_serve_vs_in_process_tokens": ratio("vllm-serve", "in-process"),
    }
    ratios["http_vs_vllm_serve_stats_tokens"] = ratio("sidecar-http", "vllm-serve-stats")
    ratios["http_vs_vllm_serve_stats_ttft_p99"] = ratio("sidecar-http", "vllm-serve-stats", "ttft_p99_ms")
    ratios["vllm_serve_stats_vs_vllm_serve_tokens"] = ratio("vllm-serve-stats", "vllm-serve")
    for ref in ("vllm-serve", "vllm-serve-stats"):  # > 1: the sidecar spends more CPU per token
        tag = ref.replace("-", "_")
        ratios[f"http_vs_{tag}_front_cpu_per_token"] = ratio("sidecar-http", ref, "front_cpu_ms_per_1k_tokens")
        ratios[f"http_vs_{tag}_engine_cpu_per_token"] = ratio("sidecar-http", ref, "engine_cpu_ms_per_1k_tokens")
    if "go_lone_ttft_p50_ms" in rounds[0].get("sidecar-grpc", {}):
        ratios["grpc_go_client_added_lone_ttft_p50_ms"] = added("sidecar-grpc", "in-process", "go_lone_ttft_p50_ms", "lone_ttft_p50_ms")
        ratios["grpc_go_client_front_overhead_p50_ms"] = own("sidecar-grpc", "go_front_overhead_p50_ms")
    print(f"\nmedian of {len(rounds)} rounds")
    print(f"{'variant':16s} {'tok/s':>8s} {'TTFT p50':>10s} {'TTFT p99':>10s} {'lone TTFT p50':>14s} {'lone p99':>9s}")
    for v in present:
        s = summary[v]
        print(f"{v:16s} {s['tokens_per_s']:8.1f} {s['ttft_p50_ms']:8.1f}ms {s['ttft_p99_ms']:8.1f}ms"
              f" {s['lone_ttft_p50_ms']:12.2f}ms {s['lone_ttft_p99_ms']:7.2f}ms")
    ratios = {k: v for k, v in ratios.items() if v is not None}
    print("\nwithin-round ratios: median [min, max]")
    for k, (m, lo, hi) in ratios.items():
        print(f"  {k:42s} {m:8.3f}  [{lo:.3f}, {hi:.3f}]")
    # How many rounds the sidecar's HTTP front served more tokens/s than each vllm serve: with
    # rounds this noisy, the count says more than the range.
    wins = {ref: sum(r["sidecar-http"]["tokens_per_s"] >= r[ref]["tokens_per_s"] for r in rounds)
            for ref in ("vllm-serve", "vllm-serve-stats") if ref in present and "sidecar-http" in present}
    for ref, n in wins.items():
        print(f"  sidecar-http >= {ref} tokens/s in {n} of {len(rounds)} rounds")
    return {"summary": summary, "ratios": {k: {"median": m, "min": lo, "max": hi} for k, (m, lo, hi) in ratios.items()},
            "http_rounds_ahead": wins}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--single", type=int, default=30, help="lone requests per variant per round")
    ap.add_argument("--sidecar-coalesce-ms", type=float, help="the sidecar's stream_coalesce_ms (default: the sidecar's own)")
    ap.add_argument("--gap-s", type=float, default=2.0,
                    help="idle seconds before each variant's turn (default 2: vLLM's engine busy-waits for 1 s after its last work, and on one core that spin met the next turn's start)")
    ap.add_argument("--no-go-client", dest="go_client", action="store_false",
                    help="leave out the grpc-go client's lone requests (built with `go` when present)")
    ap.add_argument("--sidecar-event-loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--json", help="write the rounds and the summary here")
    ap.add_argument("--report", metavar="JSON", help="print the summary of an earlier run's --json file; runs nothing")
    ap.add_argument("--variants", type=lambda v: v.split(","), default=list(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)} (default all)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave every process on every CPU (default: engines on CPU 0, fronts and clients on CPU 1)")
    ap.add_argument("--client-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client_worker:
        uvloop.run(client_worker())
        return 0
    if args.report:
        report(json.loads(Path(args.report).read_text())["rounds"])
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    with tempfile.TemporaryDirectory(prefix="infermesh-sidecar-bench-") as tmp:
        # uvloop for the clients and the in-process engine alike, as vLLM's own server runs
        out = uvloop.run(bench(args, Path(tmp)))
    out |= report(out["rounds"])
    if args.json:
        Path(args.json).write_text(json.dumps(out | {"args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
