"""Pools of replicas, side by side in one run: the infermesh mesh (TTFT deadline hedging, ORCA
weighted round robin) vs a plain Envoy round-robin over the same two interactive replicas.

    python -m infermesh.bench_replicas [--quick] [--json FILE]

One local mesh from e2e/policy-replicas-e2e.yaml (two interactive replicas, each bound to its own
core as separate GPUs would be; interactive has a 600 ms deadline and hedges) and one plain Envoy
(`bench.plain_envoy_bootstrap`: ROUND_ROBIN, no retries, no deadline) over the same two sidecars.
Both set-ups get the same open-loop stream of short streaming chats; rounds alternate which goes
first. TTFT is the time to the first content delta, measured by the client.

- `stalled`: replica 0's engine stopped for 95 % of every 10 s (admin fault `stall`).
  Target: infermesh p99 TTFT <= deadline + 100 ms.
- `unequal`: replica 0 carries long streams sent to it directly (load Envoy only learns from the
  replicas' own reports). Target: infermesh p99 TTFT <= 0.7 x round robin's.

Prints one JSON report with p50/p99 per set-up and the ratios (docs/replicas.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

POLICY = Path(__file__).resolve().parent.parent / "e2e" / "policy-replicas-e2e.yaml"
CPU_CORES = {"interactive": "0", "interactive.1": "1", "batch": "1"}
"""Replica 0 on CPU 0, replica 1 on CPU 1; the batch pool (the fallback, idle here) beside replica 1."""
SETUPS = ("infermesh", "envoy-rr")


@dataclass
class Options:
    rounds: int = 3
    window_s: float = 15.0
    rate: float = 3.0
    """Chats per second, open loop."""
    max_tokens: int = 8
    loaders: int = 12
    """Unequal: long streams kept on replica 0."""


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one_chat(client: httpx.AsyncClient, base: str, max_tokens: int) -> tuple[float | None, str | None, int]:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    t0 = time.monotonic()
    ttft = None
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if ttft is None and '"content":"' in line and '"content":""' not in line:
                    ttft = time.monotonic() - t0
            return ttft, r.headers.get("x-infermesh-served-by"), r.status_code
    except httpx.HTTPError:
        return None, None, 0


async def window(base: str, opt: Options) -> dict:
    """Open loop at `opt.rate` for `opt.window_s`; every request is waited for."""
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        tasks = []
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < opt.window_s:
            tasks.append(asyncio.create_task(one_chat(client, base, opt.max_tokens)))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / opt.rate - time.monotonic()))
        results = await asyncio.gather(*tasks)
    ttfts = [t for t, _, s in results if t is not None and s == 200]
    served: dict[str, int] = {}
    for _, by, _ in results:
        served[str(by)] = served.get(str(by), 0) + 1
    return {"requests": len(results), "ok": len(ttfts), "ttfts": ttfts, "served_by": served}


async def loaded(replica_url: str, n: int, stop: asyncio.Event) -> None:
    """Keep `n` long streams on one replica until `stop` (restarting any that end). They start one
    at a time, each once the one before has its headers (its first token): the sidecar hands vLLM
    a measured number of requests at once, grown by first tokens in time, and refuses a burst it
    has nothing measured to wait by (sidecar/admission.py)."""
    async def stream(started: asyncio.Event):
        # 200 prompt tokens + 700: inside max_model_len (1024), far beyond the KV cache's share.
        body = {"model": "tiny-llama", "prompt": "x " * 100, "max_tokens": 700, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            while not stop.is_set():
                try:
                    async with client.stream("POST", replica_url + "/v1/completions", json=body) as r:
                        if r.status_code != 200:  # no load at all: the scenario would be void
                            raise RuntimeError(f"a long stream was refused: {r.status_code} {(await r.aread())[:200]!r}")
                        started.set()
                        async for _ in r.aiter_lines():
                            if stop.is_set():
                                return
                except httpx.HTTPError:
                    await asyncio.sleep(0.2)
    tasks = []
    for _ in range(n):
        started = asyncio.Event()
        tasks.append(asyncio.create_task(stream(started)))
        ready = asyncio.create_task(started.wait())
        await asyncio.wait({ready, tasks[-1]}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if tasks[-1].done():
            break  # it raised: gather says why
    await asyncio.gather(*tasks)


def summarize(windows: dict[str, list[dict]]) -> dict:
    out = {}
    for setup, ws in windows.items():
        ttfts = [t for w in ws for t in w["ttfts"]]
        served: dict[str, int] = {}
        for w in ws:
            for k, v in w["served_by"].items():
                served[k] = served.get(k, 0) + v
        out[setup] = {"requests": sum(w["requests"] for w in ws), "ok": len(ttfts),
                      "ttft_p50_ms": round(1000 * pct(ttfts, 0.5), 1) if ttfts else None,
                      "ttft_p99_ms": round(1000 * pct(ttfts, 0.99), 1) if ttfts else None, "served_by": served}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


async def run(mesh, urls: dict[str, str], opt: Options, say) -> dict:
    report: dict = {"options": opt.__dict__, "deadline_ms": mesh.plan.policy.classes["interactive"].ttft_deadline_ms}
    admin0 = mesh.admin_url("interactive", 0)
    async def interleaved(label: str, windows: dict[str, list[dict]]) -> None:
        """Each round measures every set-up once, in alternating order."""
        for rnd in range(opt.rounds):
            for setup in SETUPS[rnd % 2:] + SETUPS[:rnd % 2]:
                w = await window(urls[setup], opt)
                say(f"{label} round {rnd + 1} {setup}: p99 {1000 * (pct(w['ttfts'], 0.99) or 0):.0f} ms, {w['served_by']}")
                windows[setup].append(w)

    async with httpx.AsyncClient(timeout=10, trust_env=False) as c:
        # Stalled replica 0.
        windows: dict[str, list[dict]] = {s: [] for s in SETUPS}
        r = await c.put(admin0 + "/admin/faults/stall",
                        json={"value": 0.95, "duration_s": opt.rounds * 2 * opt.window_s + 120, "period_s": 10})
        r.raise_for_status()
        try:
            await interleaved("stalled", windows)
        finally:
            await c.delete(admin0 + "/admin/faults/stall")
        report["stalled"] = summarize(windows)
        await asyncio.sleep(3)  # let the stall's leftovers drain
        # Replica 0 loaded with long streams sent to it directly.
        windows = {s: [] for s in SETUPS}
        stop = asyncio.Event()
        load = asyncio.create_task(loaded(mesh.sidecar_url("interactive", 0), opt.loaders, stop))
        await asyncio.sleep(3)
        try:
            await interleaved("unequal", windows)
        finally:
            stop.set()
            await asyncio.wait_for(load, 60)
        report["unequal"] = summarize(windows)
    st, un = report["stalled"], report["unequal"]
    report["ratios"] = {
        "stalled_p99_infermesh_vs_rr": ratio(st["infermesh"]["ttft_p99_ms"], st["envoy-rr"]["ttft_p99_ms"]),
        "stalled_p50_infermesh_vs_rr": ratio(st["infermesh"]["ttft_p50_ms"], st["envoy-rr"]["ttft_p50_ms"]),
        "unequal_p99_infermesh_vs_rr": ratio(un["infermesh"]["ttft_p99_ms"], un["envoy-rr"]["ttft_p99_ms"]),
        "unequal_p50_infermesh_vs_rr": ratio(un["infermesh"]["ttft_p50_ms"], un["envoy-rr"]["ttft_p50_ms"]),
    }
    d = report["deadline_ms"]
    report["targets"] = {
        "stalled_p99_le_deadline_plus_100ms": (st["infermesh"]["ttft_p99_ms"] or 1e9) <= d + 100,
        "unequal_p99_le_0.7x_rr": (report["ratios"]["unequal_p99_infermesh_vs_rr"] or 9) <= 0.7,
    }
    return report


def main(argv: list[str] | None = None) -> int:
    from infermesh import paths
    from infermesh.bench import plain_envoy_bootstrap
    from infermesh.launcher import LocalMesh, free_ports, plan_on_free_ports, wait_until, _http_ok

    ap = argparse.ArgumentParser(prog="bench_replicas", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 8 s windows")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    opt = Options(rounds=2, window_s=8.0) if args.quick else Options()
    if args.rounds:
        opt.rounds = args.rounds

    def say(s: str) -> None:
        print(f"[bench-replicas] {s}", file=sys.stderr, flush=True)

    run_dir = Path(tempfile.mkdtemp(prefix="infermesh-bench-replicas-"))
    policy = run_dir / "policy.yaml"
    shutil.copyfile(POLICY, policy)
    mesh = LocalMesh(plan_on_free_ports(policy), run_dir, cpu_cores=CPU_CORES)
    try:
        mesh.start(timeout=600, progress=say)
        port, admin = free_ports(2)
        boot = run_dir / "envoy-rr.json"
        boot.write_text(json.dumps(plain_envoy_bootstrap(port, admin, [(mesh.plan.host, p.http_port) for p in mesh.plan.replicas("interactive")])))
        mesh._spawn("envoy-rr", [str(paths.envoy_binary()), "-c", str(boot), "--use-dynamic-base-id", "--concurrency", "2", "--log-level", "warn"])
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{admin}/ready"), 30, what="envoy-rr")
        time.sleep(3)  # its health checks
        urls = {"infermesh": mesh.base_url, "envoy-rr": f"http://127.0.0.1:{port}"}
        report = asyncio.run(run(mesh, urls, opt, say))
    finally:
        mesh.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
