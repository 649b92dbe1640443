"""Where a lone chat's time goes in the sidecar's HTTP front, against `vllm serve` on the same model.

Starts the sidecar and vLLM's own server as run_bench.py does (same model, engine settings),
then sends each, one at a time and 20 ms apart, N lone chats of 8 tokens: non-streamed, then
streamed. For every block it records

- the client's latency (non-streamed: the whole answer; streamed: the first content chunk);
- the server process's CPU time (utime + stime of its main process, /proc) per request, minus
  what the process burns idle over the same time (the sidecar's monitor loop);
- with --py-spy, the server's stacks (py-spy record, 1000 Hz, active threads only), summed by
  stage (`stages` below: the innermost frame that names one wins), as ms of CPU per request.

    python sidecar/bench/profile_front.py [--requests 100] [--py-spy] [--out DIR] [--json out.json]

The engine core runs in its own process in both servers, so what the server's own process
burns per lone request is its front: HTTP, the request model, rendering and tokenizing, the
engine client's input and output processing, response building.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

_spec = importlib.util.spec_from_file_location("sidecar_run_bench", Path(__file__).with_name("run_bench.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

PAUSE_S = 0.02
LOAD_TOKENS = 64
LOAD_CONCURRENCY = 16

# (stage, substrings of a py-spy frame "function (file:line)"); the innermost frame that matches
# any of them names the sample's stage, so the order below only breaks ties within one frame.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("metrics (prometheus)", ("prometheus_client/",)),
    ("monitor loop (breakers, psutil)", ("sidecar/monitors.py", "sidecar/breakers.py", "psutil/", "sidecar/cpu_amx.py")),
    ("engine output handling (AsyncLLM output processor, detokenizer)",
     ("v1/engine/output_processor.py", "v1/engine/detokenizer.py", "v1/engine/logprobs.py", "v1/metrics/", "process_outputs")),
    ("engine input (input processor, add_request, ZMQ)", ("v1/engine/input_processor.py", "v1/engine/core_client.py", "zmq/", "msgspec", "add_request")),
    ("tokenizer (HF)", ("tokenizers/", "transformers/tokenization", "tokenizers.", "tokenizer.py")),
    ("chat template (jinja)", ("jinja2/", "chat_utils.py", "template")),
    ("renderer (vLLM)", ("renderers/",)),
    ("sampling params", ("sampling_params.py",)),
    ("vLLM serving layer (chat/completion serving, response objects)",
     ("entrypoints/openai/", "entrypoints/serve/", "entrypoints/utils.py", "entrypoints/anthropic/")),
    ("pydantic (request model, response dumps)", ("pydantic/", "pydantic_core")),
    ("JSON", ("json/", "orjson", "json.")),
    ("infermesh lifecycle, admission, engine client", ("sidecar/lifecycle.py", "sidecar/admission.py", "sidecar/vllm_engine_client.py",
                                                      "sidecar/pool.py", "sidecar/load_report.py", "sidecar/events.py")),
    ("infermesh HTTP front, headers", ("sidecar/http_api.py", "sidecar/response_headers.py", "sidecar/state_api.py", "sidecar/requests.py")),
    ("FastAPI / Starlette (routing, middleware, responses)", ("fastapi/", "starlette/", "anyio/")),
    ("uvicorn / HTTP parsing", ("uvicorn/", "h11/", "httptools")),
    ("event loop, asyncio", ("asyncio/", "uvloop/", "contextvars", "selectors.py")),
    ("gc", ("<gc>", "gc_collect")),
]


def stage_of(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        for name, needles in STAGES:
            if any(n in frame for n in needles):
                return name
    return "other"


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's --format raw: `frame;frame;…;leaf count` per line (root first)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def split(samples: list[tuple[list[str], int]], rate: int, n: int) -> dict[str, float]:
    """ms of CPU per request, by stage."""
    by: collections.Counter = collections.Counter()
    for stack, count in samples:
        by[stage_of(stack)] += count
    return {k: 1000.0 * v / rate / n for k, v in by.most_common()}


def top_frames(samples: list[tuple[list[str], int]], rate: int, n: int, k: int = 25) -> list[tuple[str, float]]:
    """The leaf frames costing most, ms per request (self time)."""
    by: collections.Counter = collections.Counter()
    for stack, count in samples:
        by[stack[-1]] += count
    return [(f, 1000.0 * c / rate / n) for f, c in by.most_common(k)]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_GC = re.compile(r'^python_gc_collections_total\{generation="(\d)"\} (\S+)$', re.M)


async def gc_collections(client, base: str) -> dict[str, float]:
    """The server's garbage collections so far by generation (prometheus_client's GC series on /metrics)."""
    try:
        return {g: float(v) for g, v in _GC.findall((await client.get(base + "/metrics")).text)}
    except Exception:
        return {}


def chat_body(stream: bool) -> dict:
    body = {"model": bench.MODEL, "messages": [{"role": "user", "content": bench.PROMPT}], "max_tokens": 8, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def one_chat(client, base: str, stream: bool) -> float:
    """The client's latency: the whole answer, or a stream's first content chunk (read to its end)."""
    t0 = time.monotonic()
    if not stream:
        r = await client.post(base + "/v1/chat/completions", json=chat_body(False))
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == 8
        return time.monotonic() - t0
    ttft = None
    async with client.stream("POST", base + "/v1/chat/completions", json=chat_body(True)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                ttft = time.monotonic() - t0
    return ttft


async def block(client, base: str, pid: int, kind: str, n: int, spy: Path | None, rate: int) -> dict:
    rec = None
    if spy is not None:
        rec = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--rate", str(rate),
                                "--format", "raw", "--output", str(spy), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await asyncio.sleep(1.0)  # py-spy attaches
    gc0 = await gc_collections(client, base)
    c0, t0 = cpu_s(pid), time.monotonic()
    if kind == "load":  # run_bench.py's load: streamed completions of LOAD_TOKENS, LOAD_CONCURRENCY at a time
        lat, tokens, _ = await bench.drive(lambda: bench.sse_variant(client, base)(LOAD_TOKENS), LOAD_CONCURRENCY, n)
        assert tokens == n * LOAD_TOKENS, tokens
    else:
        lat = []
        for _ in range(n):
            lat.append(await one_chat(client, base, kind == "stream"))
            await asyncio.sleep(PAUSE_S)
    c1, t1 = cpu_s(pid), time.monotonic()
    gc1 = await gc_collections(client, base)
    # The same time idle: what the process burns without requests (the sidecar's monitor loop).
    await asyncio.sleep(min(t1 - t0, 10.0))
    idle = (cpu_s(pid) - c1) / min(t1 - t0, 10.0)
    if rec is not None:
        rec.send_signal(signal.SIGINT)
        rec.wait(timeout=60)
    return {"latency_ms": [1000 * x for x in lat], "latency_p50_ms": 1000 * statistics.median(lat), "wall_s": t1 - t0,
            "cpu_ms_per_request": 1000 * ((c1 - c0) - idle * (t1 - t0)) / n, "idle_cpu_share": idle,
            "gc_collections": {g: gc1[g] - gc0[g] for g in gc1 if g in gc0}}


async def run(args, work: Path) -> dict:
    import httpx

    sidecar, sidecar_log, http_port, _ = bench.start_sidecar(work, "uvloop")
    serve, serve_log, serve_port = bench.start_vllm_serve(work)
    servers = {"sidecar-http": (sidecar, f"http://127.0.0.1:{http_port}"), "vllm-serve": (serve, f"http://127.0.0.1:{serve_port}")}
    waits = [(sidecar, sidecar_log, http_port), (serve, serve_log, serve_port)]
    if args.serve_stats:
        stats, stats_log, stats_port = bench.start_vllm_serve(work, log_stats=True)
        servers["vllm-serve-stats"] = (stats, f"http://127.0.0.1:{stats_port}")
        waits.append((stats, stats_log, stats_port))
    out: dict = {}
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            for proc, log, port in waits:
                await bench.wait_http(client, f"http://127.0.0.1:{port}/health", proc, log)
            for _ in range(args.rounds):
                for name, (proc, base) in servers.items():
                    for _ in range(5):  # warm-up
                        await one_chat(client, base, False)
                        await one_chat(client, base, True)
                    if "load" in args.kinds:
                        await bench.drive(lambda: bench.sse_variant(client, base)(LOAD_TOKENS), LOAD_CONCURRENCY, LOAD_CONCURRENCY)
                    for kind in args.kinds:
                        spy = Path(args.out) / f"{name}-{kind}.raw" if args.py_spy else None
                        n = args.load_requests if kind == "load" else args.requests
                        res = await block(client, base, proc.pid, kind, n, spy, args.rate)
                        if kind == "load":
                            res["tokens_per_s"] = n * LOAD_TOKENS / res["wall_s"]
                        if spy is not None:
                            samples = read_raw(spy)
                            res["stages_ms"] = split(samples, args.rate, n)
                            res["top_frames_ms"] = top_frames(samples, args.rate, n)
                        out.setdefault(name, {}).setdefault(kind, []).append(res)
                        say(f"{name:13s} {kind:10s} {res.get('tokens_per_s', 0):6.1f} tok/s latency p50 {res['latency_p50_ms']:7.2f} ms  "
                            f"server CPU {res['cpu_ms_per_request']:6.2f} ms/request (idle share {res['idle_cpu_share']:.3f})"
                            f"  GC collections by generation {res['gc_collections']}")
    finally:
        for proc, _ in servers.values():
            bench.stop(proc)
    return out


def show(out: dict) -> None:
    for kind in next(iter(out.values())):
        print(f"\n== {kind}: lone chats of 8 tokens, or load: {LOAD_CONCURRENCY} concurrent completions of {LOAD_TOKENS} tokens; median over rounds, ms per request")
        for name in out:
            rs = out[name][kind]
            print(f"  {name:13s} latency p50 {statistics.median(r['latency_p50_ms'] for r in rs):7.2f} ms"
                  f"  server CPU {statistics.median(r['cpu_ms_per_request'] for r in rs):6.2f} ms/request")
        if "stages_ms" in next(iter(out.values()))[kind][0]:
            names = list(out)
            stages = sorted({s for n in names for r in out[n][kind] for s in r["stages_ms"]})
            print(f"  {'stage, ms CPU per request (py-spy)':62s}" + "".join(f"{n:>14s}" for n in names))
            for s in sorted(stages, key=lambda s: -out[names[0]][kind][-1]["stages_ms"].get(s, 0)):
                print(f"  {s[:62]:62s}" + "".join(f"{out[n][kind][-1]['stages_ms'].get(s, 0):14.3f}" for n in names))
            for n in names:
                print(f"  -- {n}: top leaf frames, ms per request")
                for f, ms in out[n][kind][-1]["top_frames_ms"][:15]:
                    print(f"     {ms:7.3f}  {f[:140]}")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100, help="lone chats per block")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kinds", nargs="+", default=["non-stream", "stream", "load"], choices=["non-stream", "stream", "load"])
    ap.add_argument("--serve-stats", action="store_true", help="also a `vllm serve` with its stats on (its default)")
    ap.add_argument("--load-requests", type=int, default=32, help="streamed completions in the load block")
    ap.add_argument("--py-spy", action="store_true", help="record each block's stacks with py-spy (in this venv's bin/)")
    ap.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    ap.add_argument("--out", help="where py-spy's raw stacks go (default: a temporary folder)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--report", metavar="JSON", help="print an earlier --json run; runs nothing")
    args = ap.parse_args()
    if args.report:
        show(json.loads(Path(args.report).read_text()))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="infermesh-front-profile-") as tmp:
        args.out = args.out or tmp
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = uvloop.run(run(args, Path(tmp)))
    show(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
