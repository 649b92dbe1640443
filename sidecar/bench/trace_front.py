"""Per-stage timestamps of lone chats in the sidecar's HTTP front and in `vllm serve`, side by side.

    python sidecar/bench/trace_front.py [--requests 60] [--json out.json]

Each server runs under this file's `serve` mode, which patches, before the server starts, the
points every request passes in both (uvicorn's HTTP protocol, vLLM's OpenAIServingChat and
AsyncLLM) and, in the sidecar, its admission; each stamp is time.monotonic(), which is the same
clock in every process here, so the client's send and receive times line up with the server's.
One request at a time, so a stamp belongs to the request in flight. Stages (ms, median over N):

  client → server     the request's bytes sent by the client → uvicorn's data_received
  HTTP server         data_received → the ASGI app called (httptools, uvicorn's task)
  app → serving       the ASGI app → OpenAIServingChat.create_chat_completion (middleware,
                      routing, body, request model; in the sidecar also admission)
  render + submit     create_chat_completion (create_completion) → AsyncLLM.add_request returned (chat template,
                      tokenizing, SamplingParams, the input processor, the engine-core send)
  engine              add_request returned → AsyncLLM.generate's first output (prefill, one step)
  first output → sent the first output → the first content's bytes written by uvicorn (response building, SSE
                      framing, the front's wrappers, the response start)
  server → client     written → the client read the first content (stream) / the whole body

The engine runs in its own process in both; everything but "engine" is the front's.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

STAMPS_ENV = "INFERMESH_TRACE_STAMPS"


# ---- inside the server --------------------------------------------------------------------------

def _install_stamps(path: str) -> None:
    from uvicorn.protocols.http import httptools_impl
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.v1.engine.async_llm import AsyncLLM

    paths = (b"/v1/chat/completions", b"/v1/completions")
    out = open(path, "a", buffering=1)
    cur: dict = {}

    def stamp(name: str) -> None:
        cur.setdefault(name, time.monotonic())

    data_received = httptools_impl.HttpToolsProtocol.data_received

    def data_received_(self, data):
        if any(p in data[:64] for p in paths):
            cur.clear()
            stamp("recv")
        return data_received(self, data)

    run_asgi = httptools_impl.RequestResponseCycle.run_asgi

    async def run_asgi_(self, app):
        if self.scope.get("path", "").encode() in paths:
            stamp("asgi")
        await run_asgi(self, app)
        if self.scope.get("path", "").encode() in paths and cur:
            out.write(json.dumps(cur) + "\n")
            cur.clear()

    send = httptools_impl.RequestResponseCycle.send

    async def send_(self, message):
        r = await send(self, message)
        if self.scope.get("path", "").encode() in paths:
            if message["type"] == "http.response.start":
                stamp("response_start")
            elif message.get("body"):
                stamp("first_body")
                body = message["body"]
                if (b'"content":"' in body and b'"content":""' not in body) or (b'"text":"' in body and b'"text":""' not in body):
                    stamp("content_body")
                cur["last_body"] = time.monotonic()
        return r

    def stamped(create):
        async def create_(self, *a, **k):
            stamp("serving")
            return await create(self, *a, **k)
        return create_

    add_request = AsyncLLM.add_request

    async def add_request_(self, *a, **k):
        stamp("add_request")
        r = await add_request(self, *a, **k)
        stamp("added")
        return r

    generate = AsyncLLM.generate

    async def generate_(self, *a, **k):
        async for o in generate(self, *a, **k):
            stamp("first_output")
            cur["last_output"] = time.monotonic()
            yield o

    httptools_impl.HttpToolsProtocol.data_received = data_received_
    httptools_impl.RequestResponseCycle.run_asgi = run_asgi_
    httptools_impl.RequestResponseCycle.send = send_
    OpenAIServingChat.create_chat_completion = stamped(OpenAIServingChat.create_chat_completion)
    OpenAIServingCompletion.create_completion = stamped(OpenAIServingCompletion.create_completion)
    AsyncLLM.add_request = add_request_
    AsyncLLM.generate = generate_
    try:
        from infermesh.sidecar.lifecycle import RequestLifecycle
    except ImportError:
        return
    admit = RequestLifecycle.admit

    def admit_(self):
        stamp("admit")
        return admit(self)

    RequestLifecycle.admit = admit_


def serve(argv: list[str]) -> int:
    _install_stamps(os.environ[STAMPS_ENV])
    if argv[0] == "sidecar":
        from infermesh.sidecar.server import main as sidecar_main

        return sidecar_main(argv[1:])
    import runpy

    sys.argv = ["vllm-api-server", *argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
    return 0


# ---- the client -------------------------------------------------------------------------------

STAGES = [("client → server", "sent", "recv"), ("HTTP server", "recv", "asgi"), ("app → serving", "asgi", "serving"),
          ("  of which before admission", "asgi", "admit"), ("render + submit", "serving", "added"),
          ("engine (prefill + 1 step)", "added", "first_output"), ("first output → sent", "first_output", "content_body"),
          ("  of which to the response start", "first_output", "response_start"),
          ("server → client", "content_body", "seen")]
STAGES_FULL = [("client → server", "sent", "recv"), ("HTTP server", "recv", "asgi"), ("app → serving", "asgi", "serving"),
               ("  of which before admission", "asgi", "admit"), ("render + submit", "serving", "added"),
               ("engine (prefill + 8 steps)", "added", "last_output"), ("last output → sent", "last_output", "last_body"),
               ("server → client", "last_body", "seen")]


async def measure(args, work: Path) -> dict:
    import httpx

    spec = importlib.util.spec_from_file_location("sidecar_run_bench", Path(__file__).with_name("run_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from infermesh.launcher import free_ports

    http_port, grpc_port, serve_port = free_ports(3)
    cfg = {"pool": "bench", "models": [{"name": bench.MODEL, "path": str(bench.paths.models_dir() / bench.MODEL),
                                        "max_model_len": bench.MAX_LEN, "kv_cache_bytes": bench.KV_BYTES}],
           "server": {"http_port": http_port, "grpc_port": grpc_port, "max_concurrent_requests": 1024}}
    (work / "sidecar.json").write_text(json.dumps(cfg))
    import subprocess

    procs = {}
    for name, argv in (("sidecar-http", ["sidecar", "--config", str(work / "sidecar.json")]),
                       ("vllm-serve", ["vllm", "--model", str(bench.paths.models_dir() / bench.MODEL), "--served-model-name", bench.MODEL,
                                       "--host", "127.0.0.1", "--port", str(serve_port), "--max-model-len", str(bench.MAX_LEN),
                                       "--kv-cache-memory-bytes", str(bench.KV_BYTES), "--enforce-eager", "--disable-log-stats",
                                       "--disable-uvicorn-access-log"])):
        log = work / f"{name}.log"
        env = os.environ | {STAMPS_ENV: str(work / f"{name}.stamps")}
        procs[name] = (subprocess.Popen([sys.executable, __file__, "serve", *argv], env=env, stdout=open(log, "wb"),
                                        stderr=subprocess.STDOUT, start_new_session=True), log)
    bases = {"sidecar-http": f"http://127.0.0.1:{http_port}", "vllm-serve": f"http://127.0.0.1:{serve_port}"}
    results: dict = {}
    try:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)  # as run_bench.py's client
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            for name, (proc, log) in procs.items():
                await bench.wait_http(client, bases[name] + "/health", proc, log)
            for _ in range(args.rounds):
                for name in procs:
                    stamps_file = work / f"{name}.stamps"
                    kinds = (("completions", True),) if args.bench_like else (("chat", False), ("chat", True), ("completions", True))
                    for api, stream in kinds:
                        body = {"model": bench.MODEL, "max_tokens": 8, "ignore_eos": True} | ({"stream": True} if stream else {})
                        body |= {"prompt": bench.PROMPT} if api == "completions" else {"messages": [{"role": "user", "content": bench.PROMPT}]}
                        url = bases[name] + ("/v1/completions" if api == "completions" else "/v1/chat/completions")
                        for _ in range(5):
                            await one(client, url, body, stream)
                        if args.bench_like:  # run_bench.py's turn: its load first, /metrics read after each lone request
                            await bench.drive(lambda: bench.sse_variant(client, bases[name])(64), 16, 96)
                        await asyncio.sleep(0.2)
                        start = len(stamps_file.read_text().splitlines())
                        client_side = []
                        for _ in range(args.requests):
                            client_side.append(await one(client, url, body, stream))
                            if args.bench_like:
                                await client.get(bases[name] + "/metrics")
                            await asyncio.sleep(0.02)
                        await asyncio.sleep(0.2)
                        server = [json.loads(x) for x in stamps_file.read_text().splitlines()[start:]][-len(client_side):]
                        rows = [c | s for c, s in zip(client_side, server)]
                        kind = ("stream" if stream else "non-stream") if api == "chat" else "completions-stream"
                        results.setdefault(name, {}).setdefault(kind, []).extend(rows)
                        say(f"{name} {kind}: {len(rows)} requests")
    finally:
        for proc, _ in procs.values():
            bench.stop(proc)
    return results


async def one(client, url: str, body: dict, stream: bool) -> dict:
    t = {"sent": time.monotonic()}
    if not stream:
        r = await client.post(url, json=body)
        r.raise_for_status()
        t["seen"] = time.monotonic()
        return t
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if "seen" not in t and line.startswith("data: {") and (('"content":"' in line and '"content":""' not in line)
                                                                    or ('"text":"' in line and '"text":""' not in line)):
                t["seen"] = time.monotonic()
    return t


def show(results: dict) -> None:
    for kind, stages in (("stream", STAGES), ("completions-stream", STAGES), ("non-stream", STAGES_FULL)):
        names = list(results)
        if any(kind not in results[x] for x in names):
            continue
        n = min(len(results[x][kind]) for x in names)
        print(f"\n== lone {'completion' if kind.startswith('completions') else 'chat'}, {kind}, 8 tokens: ms, median of n={n} per server")
        print(f"  {'stage':32s}" + "".join(f"{x:>14s}" for x in names) + f"{'difference':>12s}")
        end = "seen"
        for label, a, b in stages + [("total (client)", "sent", end)]:
            vals = []
            for x in names:
                rows = [r for r in results[x][kind] if a in r and b in r]
                vals.append(1000 * statistics.median(r[b] - r[a] for r in rows) if rows else float("nan"))
            print(f"  {label:32s}" + "".join(f"{v:14.2f}" for v in vals) + (f"{vals[0] - vals[1]:+12.2f}" if len(vals) == 2 else ""))
        if kind != "non-stream":
            # What run_bench.py calls the front's overhead: the client's TTFT less the sidecar's own
            # admission → first token (its TTFT histogram); for both, less serving → first output.
            for label, start in (("client TTFT − (admit → 1st out)", "admit"), ("client TTFT − (serving → 1st out)", "serving")):
                vals = []
                for x in names:
                    rows = [r for r in results[x][kind] if start in r]
                    vals.append(1000 * statistics.median((r["seen"] - r["sent"]) - (r["first_output"] - r[start]) for r in rows)
                                if rows else float("nan"))
                print(f"  {label:32s}" + "".join(f"{v:14.2f}" for v in vals) + (f"{vals[0] - vals[1]:+12.2f}" if len(vals) == 2 else ""))


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return serve(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--bench-like", action="store_true",
                    help="streamed completions only, each block after run_bench.py's load (96 of 64 tokens, 16 at a time), /metrics read after each")
    ap.add_argument("--json")
    ap.add_argument("--report", metavar="JSON")
    args = ap.parse_args()
    if args.report:
        show(json.loads(Path(args.report).read_text()))
        return 0
    import uvloop

    with tempfile.TemporaryDirectory(prefix="infermesh-front-trace-") as tmp:
        results = uvloop.run(measure(args, Path(tmp)))
    show(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
