"""What tracing costs the sidecar: tokens/s with tracing off and on at 100 % sampling, side by side
in one run (docs/tracing.md, "What it costs").

Two sidecars on the same model and engine settings (run_bench.py's), one with no `tracing`, one
exporting every request's spans (and vLLM's own) over OTLP/gRPC to a real OpenTelemetry Collector
(scripts/setup-otelcol.sh) that writes them to a file. Both stay loaded; each round drives C
concurrent streamed completions of T tokens (ignore_eos), R in all, against each sidecar in turn,
the order rotated every round, so both see the machine as it is at that moment. The ratio on/off
is taken within each round; the median over rounds is reported with its range, and the pooled
ratio (all tokens over all time, per variant). Each turn also reads the CPU time of each sidecar's
own process (where its spans, and vLLM's, are made and exported) and of its engine processes
(/proc), per request: the cost itself, where tokens/s on a shared machine is too noisy to show 3 %.

    python sidecar/bench/tracing_cost.py [--rounds 6] [--concurrency 8] [--tokens 64] [--requests 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
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

from infermesh import paths  # noqa: E402
from infermesh.chart_render import setup_outputs  # noqa: E402
from infermesh.launcher import free_ports, wait_until  # noqa: E402


def start_collector(work: Path) -> tuple[subprocess.Popen, str, Path]:
    grpc_port, http_port = free_ports(2)
    endpoint, out = f"127.0.0.1:{grpc_port}", work / "traces.jsonl"
    config = work / "otelcol.yaml"
    config.write_text(json.dumps({
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": endpoint}, "http": {"endpoint": f"127.0.0.1:{http_port}"}}}},
        "exporters": {"file": {"path": str(out)}},
        "service": {"telemetry": {"metrics": {"level": "none"}}, "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}}},
    }))
    log = work / "otelcol.log"
    proc = subprocess.Popen([setup_outputs("setup-otelcol.sh")["OTELCOL"], "--config", str(config)], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    wait_until(lambda: "Everything is ready" in log.read_text() or proc.poll() is not None, 30, what="the collector")
    return proc, endpoint, out


def start_sidecar(work: Path, tracing: dict | None) -> tuple[subprocess.Popen, Path, int]:
    work.mkdir(parents=True, exist_ok=True)
    http_port, grpc_port = free_ports(2)
    cfg = {
        "pool": "bench",
        "models": [{"name": bench.MODEL, "path": str(paths.models_dir() / bench.MODEL), "max_model_len": bench.MAX_LEN,
                    "kv_cache_bytes": bench.KV_BYTES}],
        "server": {"http_port": http_port, "grpc_port": grpc_port, "max_concurrent_requests": 1024},
        **({"tracing": tracing} if tracing else {}),
    }
    (work / "sidecar.json").write_text(json.dumps(cfg))
    log = work / "sidecar.log"
    proc = subprocess.Popen([sys.executable, "-m", "infermesh.sidecar.server", "--config", str(work / "sidecar.json")],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, http_port


async def run(args, work: Path) -> dict:
    import httpx

    collector, endpoint, spans_file = start_collector(work)
    servers = {"off": start_sidecar(work / "off", None),
               "on": start_sidecar(work / "on", {"otlp_endpoint": endpoint, "sample_ratio": 1.0})}
    rounds: list[dict[str, float]] = []
    try:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=256)) as client:
            for name, (proc, log, port) in servers.items():
                await bench.wait_http(client, f"http://127.0.0.1:{port}/health", proc, log)
                say(f"{name}: ready")
            calls = {name: bench.sse_variant(client, f"http://127.0.0.1:{port}") for name, (_, _, port) in servers.items()}
            for name, one in calls.items():  # warm-up: each engine's first requests are slow
                await bench.drive(lambda one=one: one(args.tokens), args.concurrency, args.concurrency)
            order = list(calls)
            for r in range(args.rounds):
                result = {}
                for name in order:
                    pid = servers[name][0].pid
                    cpu0 = bench.tree_cpu_seconds(pid)
                    _, total, elapsed = await bench.drive(lambda one=calls[name]: one(args.tokens), args.concurrency, args.requests)
                    cpu1 = bench.tree_cpu_seconds(pid)
                    result[name] = total / elapsed
                    result[f"{name}_tokens"], result[f"{name}_s"] = total, elapsed
                    # The sidecar's own process (spans are made and exported there, vLLM's too) and its engine's.
                    result[f"{name}_front_cpu_ms_per_request"] = (cpu1["front"] - cpu0["front"]) * 1000 / args.requests
                    result[f"{name}_engine_cpu_ms_per_request"] = (cpu1["engine"] - cpu0["engine"]) * 1000 / args.requests
                rounds.append(result)
                say(f"round {r + 1}: off {result['off']:.1f} tok/s, on {result['on']:.1f} tok/s, on/off {result['on'] / result['off']:.3f}")
                order.reverse()
    finally:
        for proc, _, _ in servers.values():
            bench.stop(proc)
        bench.stop(collector)
    ratios = [r["on"] / r["off"] for r in rounds]
    traced = sum(line.count('"name":"text_completion') for line in spans_file.read_text().splitlines()) if spans_file.exists() else 0
    return {
        "rounds": rounds,
        "tokens_per_s": {k: statistics.median(r[k] for r in rounds) for k in ("off", "on")},
        "on_over_off": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                        "geomean": statistics.geometric_mean(ratios),
                        # every round's tokens over every round's time, per variant
                        "pooled": (sum(r["on_tokens"] for r in rounds) / sum(r["on_s"] for r in rounds))
                        / (sum(r["off_tokens"] for r in rounds) / sum(r["off_s"] for r in rounds))},
        "front_cpu_ms_per_request": {k: statistics.median(r[f"{k}_front_cpu_ms_per_request"] for r in rounds) for k in ("off", "on")},
        "engine_cpu_ms_per_request": {k: statistics.median(r[f"{k}_engine_cpu_ms_per_request"] for r in rounds) for k in ("off", "on")},
        "sidecar_spans_received": traced,
        "requests_on": args.rounds * args.requests + args.concurrency,
        "settings": vars(args),
    }


def say(msg: str) -> None:
    print(f"[tracing-cost {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tracing-cost-") as d:
        out = uvloop.run(run(args, Path(d)))
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    m = out["on_over_off"]
    say(f"tokens/s off {out['tokens_per_s']['off']:.1f}, on {out['tokens_per_s']['on']:.1f}: on/off median {m['median']:.3f} "
        f"(rounds {m['min']:.3f}-{m['max']:.3f}), geomean {m['geomean']:.3f}, pooled {m['pooled']:.3f}; sidecar process CPU per "
        f"request off {out['front_cpu_ms_per_request']['off']:.1f} ms, on {out['front_cpu_ms_per_request']['on']:.1f} ms; "
        f"sidecar spans received {out['sidecar_spans_received']} of {out['requests_on']} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
