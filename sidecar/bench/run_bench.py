"""Benchmark the sidecar's fronts against vLLM itself, one run, side by side.

Same model (tiny-llama-large), same engine settings, same load: C concurrent streams, each
asking for T tokens (ignore_eos, so every request yields exactly T), R requests in all; then S
lone 8-token requests one at a time (the front's own latency, without batching effects).

  in-process   AsyncLLM consumed directly in the benchmark's own process (the ceiling)
  sidecar-grpc infermesh sidecar, gRPC Generate (grpc.aio client)
  sidecar-http infermesh sidecar, OpenAI HTTP/SSE (httpx client)
  vllm-serve   vLLM's own OpenAI server (python -m vllm.entrypoints.openai.api_server), HTTP/SSE

All three engines are loaded once and stay up (an idle vLLM engine blocks on its input queue);
the variants then take turns, K rounds, each round in a rotated order, so every variant sees the
machine as it is at that moment. Each ratio (sidecar-grpc / in-process, sidecar-http /
vllm-serve) is taken within a round and the median over rounds is reported with its range.
Absolute numbers from these machines are not meaningful; the ratios are.

Lone requests are not paired request by request between variants: the first request an engine
gets after another engine ran waits up to ~0.9 s on these 2 shared cores (tried; see
docs/sidecar-benchmark.md), so each variant's lone requests run as a block within its turn.

    python sidecar/bench/run_bench.py [--rounds 3] [--concurrency 16] [--tokens 128] [--requests 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
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


# ---- the servers ------------------------------------------------------------------------------

def start_sidecar(work: Path, event_loop: str) -> tuple[subprocess.Popen, Path, int, int]:
    http_port, grpc_port = free_ports(2)
    cfg = {
        "pool": "bench",
        "models": [{"name": MODEL, "path": str(paths.models_dir() / MODEL), "max_model_len": MAX_LEN, "kv_cache_bytes": KV_BYTES}],
        "server": {"http_port": http_port, "grpc_port": grpc_port, "max_concurrent_requests": 1024},
    }
    (work / "sidecar.json").write_text(json.dumps(cfg))
    log = work / "sidecar.log"
    proc = subprocess.Popen([sys.executable, "-m", "infermesh.sidecar.server", "--config", str(work / "sidecar.json"),
                             "--event-loop", event_loop],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, http_port, grpc_port


def start_vllm_serve(work: Path) -> tuple[subprocess.Popen, Path, int]:
    (port,) = free_ports(1)
    log = work / "vllm.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(paths.models_dir() / MODEL),
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_LEN),
         "--kv-cache-memory-bytes", str(KV_BYTES), "--enforce-eager", "--disable-log-stats", "--disable-uvicorn-access-log"],
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

VARIANTS = ("in-process", "sidecar-grpc", "sidecar-http", "vllm-serve")


async def bench(args, work: Path) -> dict:
    import grpc
    import httpx

    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

    say("bench: loading three engines (the sidecar, vllm serve, in-process) …")
    sidecar, sidecar_log, http_port, grpc_port = start_sidecar(work, args.sidecar_event_loop)
    serve, serve_log, serve_port = start_vllm_serve(work)
    eng = None
    try:
        limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client, \
                grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            eng, in_proc = await in_process_engine()
            await wait_http(client, f"http://127.0.0.1:{http_port}/health", sidecar, sidecar_log)
            await wait_http(client, f"http://127.0.0.1:{serve_port}/health", serve, serve_log)
            ones = {
                "in-process": in_proc,
                "sidecar-grpc": grpc_variant(pb_grpc.InferenceStub(channel)),
                "sidecar-http": sse_variant(client, f"http://127.0.0.1:{http_port}"),
                "vllm-serve": sse_variant(client, f"http://127.0.0.1:{serve_port}"),
            }
            for name, one in ones.items():  # warm-up: first requests compile and fill caches
                await drive(lambda: one(args.tokens), args.concurrency, args.concurrency)
                await drive(lambda: one(8), 1, 5)
            rounds: list[dict[str, dict]] = []
            for r in range(args.rounds):
                order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
                res: dict[str, dict] = {}
                for name in order:
                    one = ones[name]
                    ttfts, tokens, wall = await drive(lambda: one(args.tokens), args.concurrency, args.requests)
                    lone, _, _ = await drive(lambda: one(8), 1, args.single)
                    res[name] = {"tokens_per_s": tokens / wall, "ttft_p50_ms": 1000 * statistics.median(ttfts),
                                 "ttft_p99_ms": 1000 * pct(ttfts, 0.99), "lone_ttft_p50_ms": 1000 * statistics.median(lone),
                                 "lone_ttft_p99_ms": 1000 * pct(lone, 0.99), "tokens": tokens}
                    say(f"  round {r + 1}/{args.rounds} {name:13s} {tokens / wall:7.1f} tok/s  TTFT p50 {res[name]['ttft_p50_ms']:7.1f} ms"
                        f"  lone TTFT p50 {res[name]['lone_ttft_p50_ms']:6.2f} ms")
                rounds.append(res)
    finally:
        if eng is not None:
            eng.shutdown()
        stop(sidecar)
        stop(serve)
    return {"rounds": rounds}


def report(rounds: list[dict[str, dict]]) -> dict:
    def med(f) -> tuple[float, float, float]:
        xs = [f(r) for r in rounds]
        return statistics.median(xs), min(xs), max(xs)

    summary = {v: {k: statistics.median(r[v][k] for r in rounds) for k in rounds[0][v]} for v in VARIANTS}
    def ratio(a: str, b: str) -> tuple[float, float, float]:
        return med(lambda r: r[a]["tokens_per_s"] / r[b]["tokens_per_s"])

    def added(a: str, b: str, key: str) -> tuple[float, float, float]:
        return med(lambda r: r[a][key] - r[b][key])

    ratios = {
        "grpc_vs_in_process_tokens": ratio("sidecar-grpc", "in-process"),
        "grpc_added_lone_ttft_p50_ms": added("sidecar-grpc", "in-process", "lone_ttft_p50_ms"),
        "grpc_added_ttft_p50_ms_under_load": added("sidecar-grpc", "in-process", "ttft_p50_ms"),
        "http_vs_vllm_serve_tokens": ratio("sidecar-http", "vllm-serve"),
        "http_vs_vllm_serve_lone_ttft_p50_ms": added("sidecar-http", "vllm-serve", "lone_ttft_p50_ms"),
        "http_vs_in_process_tokens": ratio("sidecar-http", "in-process"),
        "vllm_serve_vs_in_process_tokens": ratio("vllm-serve", "in-process"),
    }
    print(f"\nmedian of {len(rounds)} rounds")
    print(f"{'variant':14s} {'tok/s':>8s} {'TTFT p50':>10s} {'TTFT p99':>10s} {'lone TTFT p50':>14s} {'lone p99':>9s}")
    for v in VARIANTS:
        s = summary[v]
        print(f"{v:14s} {s['tokens_per_s']:8.1f} {s['ttft_p50_ms']:8.1f}ms {s['ttft_p99_ms']:8.1f}ms"
              f" {s['lone_ttft_p50_ms']:12.2f}ms {s['lone_ttft_p99_ms']:7.2f}ms")
    print("\nwithin-round ratios: median [min, max]")
    for k, (m, lo, hi) in ratios.items():
        print(f"  {k:38s} {m:8.3f}  [{lo:.3f}, {hi:.3f}]")
    return {"summary": summary, "ratios": {k: {"median": m, "min": lo, "max": hi} for k, (m, lo, hi) in ratios.items()}}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--single", type=int, default=30, help="lone requests per variant per round")
    ap.add_argument("--sidecar-event-loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--json")
    args = ap.parse_args()
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
