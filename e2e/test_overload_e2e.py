"""e2e: 100x the interactive pool's capacity through the real mesh (Envoy, the compiled filter,
real vLLM sidecars): every chat gets a status in time, none is lost, refusals are fast (p99 1 s
from the client's send to Envoy's last byte of the answer, read from the access log: the client's
own reading of it, on the cores the load saturates, is printed beside) and carry Retry-After and an
OpenAI error, and the chats admitted keep their TTFT target (time-bounded admission, docs/breakers.md).

The capacity is calibrated first as the bench does (infermesh.bench.calibrate_pool: one chat at a
time, only successful undegraded answers count). The load is the bench's overload chats (long,
distinct prompts, streamed), open loop, for LOAD_S seconds; the chats are long enough (120 words
in, 128 tokens out, within the e2e policy's 1024-token context) that 100x their one-at-a-time rate
is a rate this machine's Python client can send (with 48 tokens out it was 283/s, and the client
sent 161/s).
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections import Counter

import httpx
import pytest

from infermesh.bench import BenchDrill, BenchOptions, calibrate_pool
from infermesh.drill import DrillOptions
from infermesh.drill_report import percentile
from infermesh.launcher import wait_until

pytestmark = pytest.mark.e2e

MULTIPLE = 100.0
LOAD_S = 20.0
TARGET_S = 1.0
"""The interactive class's TTFT target (settings.DEFAULT_TTFT_TARGET_S: not sheddable)."""
REFUSAL_P99_S = 1.0
TIMEOUT_S = 20.0
"""The client's patience: a chat without a status by then is lost."""


def settle_on(mesh):
    async def settle(*_a) -> int:
        async with httpx.AsyncClient(timeout=2.0) as c:
            # Up to 5 min: the pools' cpu breakers (30 s over 0.95 to open, 15 s under 0.80 to close)
            # open while a loaded machine starts the mesh, and stay open while it stays loaded.
            for _ in range(600):
                states = [(await c.get(mesh.admin_url(p.name, p.replica) + "/admin/state")).json() for p in mesh.plan.pools]
                if all(st["level"] == 0 and st["in_flight"] == 0 for st in states):
                    return 0
                await asyncio.sleep(0.5)
        return max(st["level"] for st in states)
    return settle


def mesh_times(mesh, d, requests) -> dict[int, tuple[float, float]]:
    """When Envoy got the first byte of each request and sent the last byte of its answer (wall
    clock, by `id` of the Request), from the mesh's access log (flushed within a second or so)."""
    want = {r.trace_id: r for r in requests}
    done: dict[int, tuple[float, float]] = {}

    def read() -> bool:
        for line in mesh.access_log.read_text().splitlines():
            e = json.loads(line) if line.startswith("{") and line.endswith("}") else {}
            tp = e.get("traceparent") or ""
            r = want.get(tp.split("-")[1] if tp.count("-") == 3 else None)
            if r is not None:
                start = datetime.datetime.fromisoformat(e["start_time"].replace("Z", "+00:00")).timestamp()
                done[id(r)] = (start, start + e["duration_ms"] / 1000)
        return len(done) == len(want)

    wait_until(read, 15, every=0.5, what=f"the access log lines of {len(want)} refusals")
    return done


def test_100x_capacity_every_chat_answered_refusals_fast_served_in_time(local_mesh):
    opt = BenchOptions(overload_prompt_words=120, overload_max_tokens=128)
    settle = settle_on(local_mesh)

    async def run():
        assert await settle() == 0, "the pools' breakers must be quiet before calibrating"
        cal = BenchDrill(local_mesh, DrillOptions(request_timeout_s=TIMEOUT_S), local_mesh.base_url, opt)
        try:
            c = await calibrate_pool(cal, cal.interactive, "interactive", "interactive", opt, settle)
        finally:
            await cal.client.aclose()
        rate = MULTIPLE * c["capacity_rps"]
        print(f"capacity {c['capacity_rps']}/s (calibration {c['outcomes']}), load {rate:.1f}/s for {LOAD_S:.0f} s")
        await settle()
        d = BenchDrill(local_mesh, DrillOptions(request_timeout_s=TIMEOUT_S, trace_requests=True), local_mesh.base_url, opt, rate)
        try:
            await d.window(rate, 0, LOAD_S)
        finally:
            await d.client.aclose()
        return d, rate

    d, rate = asyncio.run(run())
    # Envoy refused nothing of its own: its pending queue, connection and request limits never overflowed.
    stats = httpx.get(f"http://127.0.0.1:{local_mesh.plan.admin_port}/stats?filter=overflow", timeout=5).text
    overflows = {k: int(v) for k, v in (line.split(": ") for line in stats.splitlines() if ": " in line) if v.isdigit() and int(v)}
    state = httpx.get(local_mesh.admin_url("interactive") + "/admin/state", timeout=5).json()
    print("interactive engines' slots after:", [(e["model"], e["slots"]) for e in state["engines"]])
    reqs = [r for r in d.requests if r.kind == "interactive"]
    counts = d.outcomes("interactive", {"interactive": "interactive"})
    refused = [r for r in reqs if r.status in (429, 503)]
    served = [r for r in reqs if r.status == 200]
    ttfts = [r.ttft for r in served if r.ttft is not None]
    refusal_s = [r.done - r.sent for r in refused]
    print(f"{len(reqs)} chats at {rate:.1f}/s: {counts}; refusals p50 {percentile(refusal_s, 50)} p99 {percentile(refusal_s, 99)} s; "
          f"served TTFT p50 {percentile(ttfts, 50)} p95 {percentile(ttfts, 95)} p99 {percentile(ttfts, 99)} s; "
          f"codes {Counter(str(r.error_code) for r in refused)}")
    # The mesh's time to a refusal: from the client's send to Envoy's last byte of the answer (its
    # access log line, found by the request's traceparent). The client's own time adds its reading
    # of the answer, on the two cores the mesh's load saturates (a CI run: mesh p99 0.75 s, client 1.31 s).
    at_mesh = mesh_times(local_mesh, d, refused)
    mesh_s = [at_mesh[id(r)][1] - (d.t0_wall + r.sent) for r in refused]
    to_envoy = [at_mesh[id(r)][0] - (d.t0_wall + r.sent) for r in refused]
    read_lag = [(d.t0_wall + r.done) - at_mesh[id(r)][1] for r in refused]
    print(f"refusals at the mesh p50 {percentile(mesh_s, 50):.3f} p99 {percentile(mesh_s, 99):.3f} s; of it, from the client's send "
          f"to Envoy's first byte p50 {percentile(to_envoy, 50):.3f} p99 {percentile(to_envoy, 99):.3f} s; the client's reading "
          f"after the mesh's last byte p50 {percentile(read_lag, 50):.3f} p99 {percentile(read_lag, 99):.3f} s")
    by_code: dict[str, list[float]] = {}
    for r in refused:
        by_code.setdefault(f"{r.status} {r.error_code}", []).append(r.done - r.sent)
    print("refusal time by code (n, p50, p99, max s):",
          {k: (len(v), round(percentile(v, 50), 3), round(percentile(v, 99), 3), round(max(v), 3)) for k, v in by_code.items()})
    print("slowest refusals (sent s, took s, code):",
          [(round(r.sent, 2), round(r.done - r.sent, 3), r.error_code) for r in sorted(refused, key=lambda r: r.sent - r.done)[:20]])
    print("failed:", Counter((r.status, str(r.error_code), r.stage, (r.error or "")[:60]) for r in reqs if r.outcome == "failed"))
    assert len(reqs) >= 0.8 * rate * LOAD_S, "the client kept the rate"
    assert counts["lost"] == 0, [r.error for r in reqs if r.status is None][:5]
    assert counts["failed"] == 0, [(r.status, r.error_code, r.error) for r in reqs if r.outcome == "failed"][:5]
    assert overflows == {}, overflows
    assert refused, "100x capacity is refused in part"
    assert all(r.retry_after and r.error_code for r in refused), "every refusal carries Retry-After and an OpenAI error"
    assert percentile(mesh_s, 99) <= REFUSAL_P99_S, "refusals are fast"
    assert served and all(r.complete for r in served)
    assert percentile(ttfts, 95) <= TARGET_S, "the chats admitted keep their TTFT target"
