"""Benchmark the sidecar's fronts against vLLM itself, one run, side by side.

Same model (tiny-llama-large), same engine settings, same load: C concurrent streams, each
asking for T tokens (ignore_eos, so every request yields exactly T), R requests in all.

  in-process   AsyncLLM consumed directly in one Python process (the ceiling)
  sidecar-grpc infermesh sidecar, gRPC Generate (grpc.aio client)
  sidecar-http infermesh sidecar, OpenAI HTTP/SSE (httpx client)
  vllm-serve   vLLM's own OpenAI server (python -m vllm.entrypoints.openai.api_server), HTTP/SSE

Only one engine runs at a time. Reported: output tokens/s and TTFT p50/p99, and ratios
(sidecar-grpc / in-process, sidecar-http / vllm-serve). Absolute numbers from these machines
are not meaningful; the ratios are.

    python sidecar/bench/run_bench.py [--concurrency 16] [--tokens 128] [--requests 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infermesh import paths
from infermesh.launcher import free_ports

MODEL = "tiny-llama-large"
KV_BYTES = 256 << 20
MAX_LEN = 1024
PROMPT = "Summarize the following: the service mesh routes interactive chat and batch work to pools."


def with_single(load: dict, single: tuple[list[float], int, float]) -> dict:
    """Add the TTFT of lone requests (one at a time, 8 tokens): the front's own latency."""
    t = sorted(single[0])
    load["single_ttft_p50_ms"] = 1000 * statistics.median(t)
    load["single_ttft_p99_ms"] = 1000 * t[min(len(t) - 1, int(0.99 * len(t)))]
    return load


def summarize(name: str, ttfts: list[float], tokens: int, wall: float) -> dict:
    ttfts = sorted(ttfts)
    return {
        "variant": name,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "wall_s": wall,
    }


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


# ---- in-process -------------------------------------------------------------------------------

def in_process(args) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    async def main():
        eng = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(paths.models_dir() / MODEL), kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_LEN,
            enforce_eager=True, disable_log_stats=True))
        tok = eng.get_tokenizer()
        ids = tok.encode(PROMPT)
        counter = {"i": 0}

        async def one(tokens=args.tokens):
            counter["i"] += 1
            sp = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            t0 = time.monotonic()
            ttft, n = None, 0
            async for out in eng.generate(TokensPrompt(prompt_token_ids=ids), sp, f"r{counter['i']}"):
                k = len(out.outputs[0].token_ids)
                if k and ttft is None:
                    ttft = time.monotonic() - t0
                n += k
            return ttft, n

        await drive(one, args.concurrency, args.concurrency)  # warm-up
        res = await drive(one, args.concurrency, args.requests)
        single = await drive(lambda: one(8), 1, args.single)
        eng.shutdown()
        return res, single

    res, single = asyncio.run(main())
    return with_single(summarize("in-process", *res), single)


# ---- servers ----------------------------------------------------------------------------------

def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start: " + log.read_text()[-3000:])


async def sse_one(client, url: str, body: dict):
    t0 = time.monotonic()
    ttft, n = None, 0
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
            if ev.get("choices") and ev["choices"][0].get("text") and ttft is None:
                ttft = time.monotonic() - t0
    return ttft, n


def http_load(base: str, model: str, args):
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            body = {"model": model, "prompt": PROMPT, "max_tokens": args.tokens, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            one = lambda: sse_one(client, base + "/v1/completions", body)  # noqa: E731
            await drive(one, args.concurrency, args.concurrency)
            res = await drive(one, args.concurrency, args.requests)
            small = body | {"max_tokens": 8}
            single = await drive(lambda: sse_one(client, base + "/v1/completions", small), 1, args.single)
            return res, single

    return asyncio.run(main())


def grpc_load(port: int, args):
    import grpc

    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.InferenceStub(ch)

            async def one(tokens=args.tokens):
                t0 = time.monotonic()
                ttft, n = None, 0
                async for msg in stub.Generate(pb.GenerateRequest(text=PROMPT, max_tokens=tokens, ignore_eos=True), timeout=300):
                    if msg.HasField("chunk") and ttft is None:
                        ttft = time.monotonic() - t0
                    if msg.HasField("final"):
                        n = msg.final.usage.completion_tokens
                return ttft, n

            await drive(one, args.concurrency, args.concurrency)
            res = await drive(one, args.concurrency, args.requests)
            single = await drive(lambda: one(8), 1, args.single)
            return res, single

    return asyncio.run(main())


def sidecar(args, work: Path) -> list[dict]:
    http_port, grpc_port = free_ports(2)
    cfg = {
        "pool": "bench",
        "models": [{"name": MODEL, "path": str(paths.models_dir() / MODEL), "max_model_len": MAX_LEN, "kv_cache_bytes": KV_BYTES}],
        "server": {"http_port": http_port, "grpc_port": grpc_port, "max_concurrent_requests": 1024},
    }
    (work / "sidecar.json").write_text(json.dumps(cfg))
    log = work / "sidecar.log"
    proc = subprocess.Popen([sys.executable, "-m", "infermesh.sidecar.server", "--config", str(work / "sidecar.json")],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{http_port}/health", proc, log)
        res, single = grpc_load(grpc_port, args)
        out = [with_single(summarize("sidecar-grpc", *res), single)]
        res, single = http_load(f"http://127.0.0.1:{http_port}", MODEL, args)
        out.append(with_single(summarize("sidecar-http", *res), single))
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def vllm_serve(args, work: Path) -> dict:
    (port,) = free_ports(1)
    log = work / "vllm.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(paths.models_dir() / MODEL),
         "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_LEN),
         "--kv-cache-memory-bytes", str(KV_BYTES), "--enforce-eager", "--disable-log-stats", "--disable-uvicorn-access-log"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        res, single = http_load(f"http://127.0.0.1:{port}", MODEL, args)
        return with_single(summarize("vllm-serve", *res), single)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--single", type=int, default=30, help="lone requests for the front's own TTFT")
    ap.add_argument("--json")
    args = ap.parse_args()
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="infermesh-sidecar-bench-") as tmp:
        work = Path(tmp)
        for name, fn in (("in-process", lambda: [in_process(args)]), ("sidecar", lambda: sidecar(args, work)),
                         ("vllm-serve", lambda: [vllm_serve(args, work)])):
            print(f"bench: {name} …", file=sys.stderr, flush=True)
            for r in fn():
                results.append(r)
                print(f"  {r['variant']:14s} {r['tokens_per_s']:9.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms"
                      f"  lone TTFT p50 {r['single_ttft_p50_ms']:6.1f} ms",
                      file=sys.stderr, flush=True)
    by = {r["variant"]: r for r in results}
    print(f"\n{'variant':14s} {'tok/s':>9s} {'TTFT p50':>10s} {'TTFT p99':>10s} {'lone TTFT p50':>14s}")
    for r in results:
        print(f"{r['variant']:14s} {r['tokens_per_s']:9.1f} {r['ttft_p50_ms']:8.1f}ms {r['ttft_p99_ms']:8.1f}ms {r['single_ttft_p50_ms']:12.1f}ms")
    g, h, ip, vs = by["sidecar-grpc"], by["sidecar-http"], by["in-process"], by["vllm-serve"]
    ratios = {
        "grpc_vs_in_process_tokens": g["tokens_per_s"] / ip["tokens_per_s"],
        "grpc_added_ttft_p50_ms": g["ttft_p50_ms"] - ip["ttft_p50_ms"],
        "grpc_added_lone_ttft_p50_ms": g["single_ttft_p50_ms"] - ip["single_ttft_p50_ms"],
        "http_vs_vllm_serve_tokens": h["tokens_per_s"] / vs["tokens_per_s"],
        "http_vs_vllm_serve_ttft_p50": h["ttft_p50_ms"] / vs["ttft_p50_ms"],
    }
    print(f"\nsidecar-grpc / in-process tokens/s: {ratios['grpc_vs_in_process_tokens']:.3f}  (added TTFT p50 {ratios['grpc_added_ttft_p50_ms']:+.1f} ms under load, {ratios['grpc_added_lone_ttft_p50_ms']:+.1f} ms alone)")
    print(f"sidecar-http / vllm-serve tokens/s: {ratios['http_vs_vllm_serve_tokens']:.3f}  (TTFT p50 ratio {ratios['http_vs_vllm_serve_ttft_p50']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "ratios": ratios, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    if os.environ.get("OPENBLAS_CORETYPE"):
        pass  # leave the machine's BLAS settings alone (see the env notes)
    sys.exit(main())
