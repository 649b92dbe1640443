"""Degraded-mode drills on the real local mesh: prove, before an incident, that the mesh degrades
instead of failing, and recovers by itself — with numbers.

    infermesh drill kv-cache [--json] [--plot FILE.png] [--policy FILE]
    infermesh drill all

A drill runs a steady, open-loop mixed load through Envoy (interactive streaming chats and batch
completions), keeps a baseline, injects its fault, ends it, waits until every pool is back to
normal, and reports what every request got (`drill_report.py` defines the outcomes and checks).

Scenarios (`SCENARIOS`):

- `kv-cache`, `gpu-memory`: the fault pool's KV-cache / GPU-memory reading is pushed over its
  breaker's threshold through the admin fault API (on a machine without a GPU there is no other
  way to get a GPU-memory reading); breakers, ladder, routing and clients are all real.
- `cpu`: real burner processes load every core.
- `sidecar-kill`: the fault pool's sidecar and its vLLM processes get SIGKILL, then restart.
- `slow-sidecar`: the fault pool's primary engine processes are stopped for most of every second
  (admin fault `stall`): real slowness that the latency (TTFT) breaker must catch.
- `slow-replica`: one replica of a pool of several is stalled (admin fault `stall`); its class's
  TTFT deadline must hedge every request to another replica, and the stalled replica's vLLM must
  hold nothing Envoy gave up on (needs a policy pool with `replicas` >= 2 and a hedging class).
- `control-plane-kill`: the control plane gets SIGKILL, then restarts; Envoy must keep serving.
- `invalid-policy`: a broken policy is written over the watched file, then the good one back.
- `bad-requests`: garbage, oversize, unknown-model, wrong-method, spoofed-header and vanishing
  requests mixed into the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import random
import re
import secrets
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from infermesh.meshconfig.policy import Policy

from .drill_report import Expectation, Marks, ReplicaSample, Request, Sample, build_report, slow_replica_checks

CHAT = {"role": "user", "content": "Hello! How are you today?"}


@dataclass
class DrillOptions:
    rate_interactive: float = 1.0
    """Interactive streaming chats started per second (open loop: arrivals do not wait). The
    default fits a 2-core machine serving with vLLM on CPU (where serving itself loads the CPUs
    the cpu_load breaker watches); raise it on real GPU pools."""
    rate_batch: float = 0.5
    """Batch completions started per second."""
    baseline_s: float = 6.0
    settle_s: float = 5.0
    """Load kept on after recovery, to show that service is normal again."""
    recover_timeout_s: float = 120.0
    """How long after the fault ends the pools may take to recover (sidecar-kill adds the model load)."""
    request_timeout_s: float = 30.0
    """A request with no response by then is lost."""
    fault_pool: str | None = None
    """Pool the fault hits (default: the pool of the most important class)."""
    model: str | None = None
    """Model name the load asks for (default: a name every pool accepts)."""
    trace_requests: bool = False
    """Each request carries a traceparent of its own (not sampled), so its line in Envoy's
    access log can be found (`Request.trace_id`): where the mesh's time and the client's part."""


class Drill:
    """One scenario's run on a started `LocalMesh`."""

    def __init__(self, mesh, options: DrillOptions | None = None, progress: Callable[[str], None] = lambda s: None):
        self.mesh = mesh
        self.policy: Policy = mesh.plan.policy
        self.opt = options or DrillOptions()
        self.progress = progress
        self.pools = list(self.policy.pools)
        self.fault_pool = self.opt.fault_pool or self.policy.classes[min(self.policy.classes, key=lambda c: self.policy.classes[c].priority)].pool
        if self.opt.fault_pool is not None and self.opt.fault_pool not in self.policy.pools:
            raise DrillError(f"--pool {self.opt.fault_pool!r} is not one of the pools {self.pools}")
        self.model = self.opt.model or _common_model(self.policy)
        self.requests: list[Request] = []
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
        """The wall clock at `t0`: a request's `sent` on the access log's clock."""
        self._tasks: set[asyncio.Task] = set()
        self.stop_load = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- load ---------------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _arrivals(self, rate: float, make) -> None:
        """Open loop: start a request every 1/rate s (jittered), whatever the others are doing."""
        rnd = random.Random(zlib.crc32(make.__name__.encode()))  # the same arrivals every run
        nxt = self.now()
        while not self.stop_load.is_set():
            self._spawn(make())
            nxt += rnd.uniform(0.5, 1.5) / rate
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop_load.wait(), timeout=max(0.0, nxt - self.now()))

    def _headers(self, r: Request) -> dict[str, str]:
        if not self.opt.trace_requests:
            return {}
        r.trace_id = secrets.token_hex(16)
        return {"traceparent": f"00-{r.trace_id}-{secrets.token_hex(8)}-00"}

    def _record(self, r: Request, resp: httpx.Response) -> None:
        r.status = resp.status_code
        r.stage = "headers"
        h = resp.headers
        r.served_by = h.get("x-infermesh-served-by")
        r.model = h.get("x-infermesh-model")
        r.degraded_header = h.get("x-infermesh-degraded") == "true"
        r.retry_after = "retry-after" in h
        r.shed_by = h.get("x-infermesh-shed-by")

    @staticmethod
    def _error_code(body: bytes) -> str | None:
        try:
            err = json.loads(body)["error"]
            return err.get("code") or err.get("type")
        except (ValueError, KeyError, TypeError):
            return None

    def chat_body(self) -> dict:
        """The body of one interactive request (a load with other prompts overrides it)."""
        return {"model": self.model, "stream": True, "max_tokens": 16, "temperature": 0, "messages": [CHAT]}

    async def interactive(self) -> None:
        r = Request("interactive", self.now())
        self.requests.append(r)
        try:
            async with self.client.stream("POST", "/v1/chat/completions", json=self.chat_body(), headers=self._headers(r)) as resp:
                self._record(r, resp)
                if resp.status_code != 200:
                    r.error_code = self._error_code(await resp.aread())
                    return
                r.stage = "body"
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        r.complete = True
                        break
                    chunk = json.loads(line[6:])
                    if r.ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                        r.ttft = self.now() - r.sent
        except (httpx.HTTPError, ValueError) as e:
            r.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            r.done = self.now()

    async def batch(self) -> None:
        r = Request("batch", self.now())
        self.requests.append(r)
        body = {"model": self.model, "prompt": "Summarise: the quick brown fox jumps over the lazy dog.", "max_tokens": 24, "temperature": 0}
        try:
            resp = await self.client.post("/v1/completions", json=body, headers=self._headers(r))
            self._record(r, resp)
            if resp.status_code == 200:
                r.stage = "body"
                r.complete = bool(resp.json().get("choices"))
            else:
                r.error_code = self._error_code(resp.content)
        except (httpx.HTTPError, ValueError) as e:
            r.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            r.done = self.now()

    async def _warm_up(self) -> None:
        """A few requests of each kind, one at a time and not counted: a fresh engine's first
        steps are slow, and a drill measures the mesh, not a cold start."""
        for _ in range(3):
            await self.interactive()
            await self.batch()
        self.requests.clear()

    # -- pool state ---------------------------------------------------------------------------

    async def _sample_loop(self, every: float = 0.1) -> None:
        async with httpx.AsyncClient(timeout=0.5) as admin:
            while True:
                for pool in self.pools:
                    t = self.now()
                    try:
                        st = (await admin.get(self.mesh.admin_url(pool) + "/admin/state")).json()
                    except httpx.TimeoutException:
                        # Slow to answer is not down (a sidecar that has just loaded its models
                        # is busy); down is a refused or broken connection, or a bad answer.
                        continue
                    except (httpx.HTTPError, ValueError):
                        self.samples.append(Sample(t, pool, up=False))
                        continue
                    self.samples.append(Sample(
                        t, pool, up=True, level=st["level"], ready=st["ready"] and not st["draining"],
                        serving_model=st["serving_model"], primary_model=st["primary_model"],
                        breakers={b["name"]: b for b in st["breakers"]},
                        unfinished=sum(e["unfinished"] for e in st["engines"]), faults=st["faults"]))
                await asyncio.sleep(every)

    def latest(self, pool: str) -> Sample | None:
        return next((s for s in reversed(self.samples) if s.pool == pool), None)

    def all_normal(self) -> bool:
        latest = [self.latest(p) for p in self.pools]
        return all(s is not None and s.normal and s.t > self.now() - 0.5 for s in latest)

    async def wait_normal(self, timeout: float) -> bool:
        deadline = self.now() + timeout
        while self.now() < deadline:
            if self.all_normal():
                return True
            await asyncio.sleep(0.1)
        return False

    # -- one run ------------------------------------------------------------------------------

    async def run(self, scenario: "Scenario") -> dict:
        self.progress(f"{scenario.name}: waiting for every pool to be normal")
        self.client = httpx.AsyncClient(base_url=self.mesh.base_url, timeout=httpx.Timeout(self.opt.request_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=512, max_keepalive_connections=64))
        sampler = asyncio.get_running_loop().create_task(self._sample_loop())
        try:
            await self._warm_up()
            if not await self.wait_normal(self.opt.recover_timeout_s):
                raise RuntimeError(f"the pools are not normal before the drill: {[self.latest(p) for p in self.pools]}")
            self.requests.clear()
            baseline = self.now()
            if self.opt.fault_pool is None:
                self.fault_pool = scenario.default_pool(self) or self.fault_pool
            await scenario.prepare(self)
            self.progress(f"{scenario.name}: baseline load for {self.opt.baseline_s:.0f}s "
                          f"({self.opt.rate_interactive:g} chats/s, {self.opt.rate_batch:g} completions/s)")
            loads = [asyncio.get_running_loop().create_task(self._arrivals(self.opt.rate_interactive, self.interactive)),
                     asyncio.get_running_loop().create_task(self._arrivals(self.opt.rate_batch, self.batch))]
            extra = scenario.extra_load(self)
            if extra is not None:
                loads.append(asyncio.get_running_loop().create_task(extra))
            await asyncio.sleep(self.opt.baseline_s)
            marks = Marks(inject=self.now(), clear=0.0, end=0.0, baseline=baseline)
            self.progress(f"{scenario.name}: injecting — {scenario.describe(self)}")
            await scenario.inject(self, marks)
            marks.clear = self.now()
            self.progress(f"{scenario.name}: fault over after {marks.clear - marks.inject:.1f}s; waiting for recovery")
            recovered = await self.wait_normal(scenario.recover_timeout(self))
            self.progress(f"{scenario.name}: " + (f"recovered {self.now() - marks.clear:.1f}s after the fault"
                                                  if recovered else "NOT recovered in time"))
            await asyncio.sleep(self.opt.settle_s)
            self.stop_load.set()
            await asyncio.gather(*loads)
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=self.opt.request_timeout_s + 5)
            marks.end = self.now()
            checks = await scenario.checks(self, marks)
        finally:
            sampler.cancel()
            await self.client.aclose()
            await scenario.cleanup(self)
        exp = scenario.expectation(self)
        rep = build_report(scenario.name, scenario.describe(self), exp, self.requests, self.samples, marks, self.pools, checks)
        rep.update(scenario.report_sections(self))
        rep.update(self._queries(marks))
        return rep

    def _queries(self, marks: Marks) -> dict:
        """The drill's window on the wall clock and the chart dashboards' queries over it, linked
        to the Prometheus that scrapes the mesh when there is one (docs/drills.md)."""
        from .observe import NAMESPACE, drill_queries

        start, end = self.t0_wall + marks.baseline, self.t0_wall + marks.end
        prometheus = getattr(self.mesh, "prometheus", None)
        url = prometheus if isinstance(prometheus, str) else getattr(prometheus, "url", None)
        remote = isinstance(self.mesh, RemoteMesh)  # a cluster's Prometheus: any namespace, scraped every 15-30 s
        utc = datetime.timezone.utc
        return {"window": {"start": datetime.datetime.fromtimestamp(start, utc).isoformat(timespec="seconds"),
                           "end": datetime.datetime.fromtimestamp(end, utc).isoformat(timespec="seconds")},
                "queries": drill_queries(start, end, self.fault_pool, url, namespace=".*" if remote else NAMESPACE,
                                         rate_interval="1m" if remote else "10s")}


def _common_model(policy: Policy) -> str:
    """A model name every pool accepts (so a spilled request is served), else the first primary."""
    names = [set(n for m in p.models for n in (m.name, *m.aliases)) for p in policy.pools.values()]
    common = set.intersection(*names) if names else set()
    first = next(iter(policy.pools.values())).models[0]
    for n in (*first.aliases, first.name):
        if n in common:
            return n
    return sorted(common)[0] if common else first.name


# -- scenarios ----------------------------------------------------------------------------------

class Scenario:
    name = ""
    degrades = True
    signal: str | None = None
    """The breaker signal the fault drives (to know when degradation is due)."""

    def breaker(self, d: Drill):
        """The fault pool's breaker on `signal` (the quickest one, if several)."""
        bs = [b for b in d.policy.pools[d.fault_pool].breakers.values() if b.signal == self.signal]
        if not bs:
            raise DrillError(f"{self.name}: pool {d.fault_pool!r} has no breaker on {self.signal!r} in the policy; "
                             f"add one (see mesh-config/policies/local.yaml) or pick another --pool")
        return min(bs, key=lambda b: b.sustain_s)

    def default_pool(self, d: Drill) -> str | None:
        """The pool this scenario hits unless --pool says (None: the most important class's pool)."""
        return None

    def unfit(self, policy: Policy, fault_pool: str | None) -> str | None:
        """Why this policy cannot run the scenario (checked before the mesh starts), or None."""
        return None

    def report_sections(self, d: Drill) -> dict:
        """Scenario-specific parts of the report."""
        return {}

    def fault_s(self, d: Drill) -> float:
        return max(10.0, self.breaker(d).sustain_s + 8.0) if self.signal else 5.0

    def describe(self, d: Drill) -> str:
        return self.name

    def expectation(self, d: Drill) -> Expectation:
        if not self.degrades:
            return Expectation(degrade=False)
        b = self.breaker(d) if self.signal else None
        return Expectation(degrade=True, fault_pool=d.fault_pool, breaker_signal=self.signal, sustain_s=b.sustain_s if b else 0.0)

    def recover_timeout(self, d: Drill) -> float:
        return d.opt.recover_timeout_s

    async def prepare(self, d: Drill) -> None:
        if self.signal:
            self.breaker(d)  # fail before the load if the policy cannot run this drill

    def extra_load(self, d: Drill):
        return None

    async def inject(self, d: Drill, marks: Marks) -> None:
        raise NotImplementedError

    async def checks(self, d: Drill, marks: Marks) -> list[tuple[str, bool, str]]:
        return []

    async def cleanup(self, d: Drill) -> None:
        pass


class DrillError(RuntimeError):
    """A drill that cannot run (the policy lacks what it needs); the message says what to change."""


async def _admin(d: Drill, pool: str, method: str, path: str, body: dict | None = None, replica: int = 0) -> None:
    async with httpx.AsyncClient(timeout=5) as c:
        r = await c.request(method, d.mesh.admin_url(pool, replica) + path, json=body)
        if r.status_code != 200:
            raise DrillError(f"admin {method} {path} on {pool}: {r.status_code} {r.text[:200]}")


class InjectedReading(Scenario):
    """A breaker's reading pushed over its threshold through the admin fault API."""

    value = 0.99

    def __init__(self, name: str, signal: str):
        self.name, self.signal = name, signal

    def describe(self, d: Drill) -> str:
        return f"{self.signal} reading {self.value} on pool {d.fault_pool} (admin fault API) for {self.fault_s(d):.0f}s"

    async def inject(self, d: Drill, marks: Marks) -> None:
        dur = self.fault_s(d)
        await _admin(d, d.fault_pool, "PUT", f"/admin/faults/{self.signal}", {"value": self.value, "duration_s": dur + 60})
        await asyncio.sleep(dur)
        await _admin(d, d.fault_pool, "DELETE", f"/admin/faults/{self.signal}")

    async def cleanup(self, d: Drill) -> None:
        with contextlib.suppress(Exception):
            await _admin(d, d.fault_pool, "DELETE", "/admin/faults")


class CpuPressure(Scenario):
    """Real burner processes, two per core, for the fault's duration."""

    name = "cpu"
    signal = "cpu_load"

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def default_pool(self, d: Drill) -> str | None:
        # Every pool shares the machine's cores: the drill watches the pool that reacts first.
        quickest = [(b.sustain_s, name) for name, p in d.policy.pools.items() for b in p.breakers.values() if b.signal == self.signal]
        return min(quickest)[1] if quickest else None

    def describe(self, d: Drill) -> str:
        return f"{2 * (os.cpu_count() or 1)} CPU burner processes for {self.fault_s(d):.0f}s (breaker cpu_load on pool {d.fault_pool})"

    async def inject(self, d: Drill, marks: Marks) -> None:
        code = "while True: pass"
        self.procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for _ in range(2 * (os.cpu_count() or 1))]
        try:
            await asyncio.sleep(self.fault_s(d))
        finally:
            await self.cleanup(d)

    async def cleanup(self, d: Drill) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


class SlowSidecar(Scenario):
    """The fault pool's primary engine stalled (SIGSTOP) for `duty` of every `period_s`."""

    name = "slow-sidecar"
    signal = "ttft_p95"
    duty, period_s = 0.85, 2.0

    def describe(self, d: Drill) -> str:
        return (f"pool {d.fault_pool}'s primary engine stopped {self.duty:.0%} of every {self.period_s:g}s "
                f"for {self.fault_s(d):.0f}s (admin fault stall; breaker ttft_p95)")

    async def inject(self, d: Drill, marks: Marks) -> None:
        dur = self.fault_s(d)
        await _admin(d, d.fault_pool, "PUT", "/admin/faults/stall", {"value": self.duty, "duration_s": dur + 60, "period_s": self.period_s})
        await asyncio.sleep(dur)
        await _admin(d, d.fault_pool, "DELETE", "/admin/faults/stall")

    def recover_timeout(self, d: Drill) -> float:
        # The TTFT window still holds the slow samples after the stall ends.
        from infermesh.sidecar.config import MonitorConfig

        return d.opt.recover_timeout_s + MonitorConfig().window_s

    async def cleanup(self, d: Drill) -> None:
        with contextlib.suppress(Exception):
            await _admin(d, d.fault_pool, "DELETE", "/admin/faults")


class SidecarKill(Scenario):
    """SIGKILL to the fault pool's sidecar and its vLLM processes; restart after `down_s`."""

    name = "sidecar-kill"
    down_s = 3.0

    def describe(self, d: Drill) -> str:
        return f"SIGKILL to pool {d.fault_pool}'s sidecar (and its vLLM processes), restarted {self.down_s:g}s later"

    def expectation(self, d: Drill) -> Expectation:
        return Expectation(degrade=True, fault_pool=d.fault_pool, allow_interrupted=True)

    def recover_timeout(self, d: Drill) -> float:
        return d.opt.recover_timeout_s + 180.0  # the restarted sidecar loads its models again

    async def prepare(self, d: Drill) -> None:
        wd = d.policy.pools[d.fault_pool].when_degraded
        if wd is None or wd.spill_to is None:
            d.progress(f"note: pool {d.fault_pool} has no when_degraded.spill_to: its traffic is shed (503) while it is down")

    async def inject(self, d: Drill, marks: Marks) -> None:
        name = f"sidecar-{d.fault_pool}"
        marks.kill = d.now()
        await asyncio.to_thread(d.mesh.kill, name)
        await asyncio.sleep(self.down_s)
        d.mesh.restart(name)
        d.progress(f"{self.name}: {name} restarted; it loads its models again")


def _hedging_pools(policy: Policy) -> list[tuple[int, str, str]]:
    """(priority, class, pool) of the classes that hedge past a TTFT deadline to a pool of several
    replicas, most important first."""
    return sorted((c.priority, name, c.pool) for name, c in policy.classes.items()
                  if c.hedges and policy.pools[c.pool].replicas >= 2)


def _requests_finished(metrics_text: str) -> dict[str, int]:
    """A sidecar's own count of the requests it finished, by status (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for smp in fam.samples:
            if smp.name == "infermesh_sidecar_requests_total":
                out[smp.labels["status"]] = out.get(smp.labels["status"], 0) + int(smp.value)
    return out


def _held(state: dict) -> tuple[int, int]:
    """(requests its vLLM engines hold unfinished, requests in flight in the sidecar), from a
    replica's /admin/state."""
    return sum(e["unfinished"] for e in state["engines"]), state["in_flight"]


class SlowReplica(Scenario):
    """One replica of a pool of several stalled (its engine stopped `duty` of every `period_s`):
    the class's TTFT deadline must hedge each request to another replica (docs/replicas.md)."""

    name = "slow-replica"
    degrades = False
    duty, period_s, fault = 0.95, 10.0, 15.0
    """The admin API's longest stop (95 % of 10 s), for 15 s: one short run window in the middle."""
    replica = 0
    """The replica stalled (the drill's pool sampler watches replica 0, so recovery waits for it)."""
    margin_s = 0.5
    """Allowed above the deadline: the hedge's own TTFT on the other replica (a shared 2-core CPU
    machine; e2e/test_replicas_e2e.py uses the same)."""
    min_share = 0.8
    """The stalled replica can win a request only in its run window (5 % of each period) or
    within a deadline before it: the others must serve most."""
    probes = 8
    """Chats sent one at a time after the load, to see the stalled replica serve again."""

    def unfit(self, policy: Policy, fault_pool: str | None) -> str | None:
        hedging = _hedging_pools(policy)
        if hedging and (fault_pool is None or fault_pool in {p for _, _, p in hedging}):
            return None
        pools = ", ".join(f"{n} ({p.replicas} replica{'s' if p.replicas > 1 else ''})" for n, p in policy.pools.items())
        deadlines = ", ".join(f"{n} -> {c.pool} ({c.ttft_deadline_ms} ms, {'hedges' if c.hedges else 'no hedge'})"
                              for n, c in policy.classes.items() if c.ttft_deadline_ms is not None) or "none"
        where = f"pool {fault_pool!r}" if fault_pool else "a pool"
        return (f"{self.name}: {where} needs replicas >= 2 and a class served by it with ttft_deadline_ms that hedges; "
                f"this policy's pools: {pools}; classes with a deadline: {deadlines} "
                f"(e2e/policy-replicas-e2e.yaml is one that fits; docs/replicas.md)")

    def default_pool(self, d: Drill) -> str | None:
        hedging = _hedging_pools(d.policy)
        return hedging[0][2] if hedging else None

    def _setup(self, d: Drill) -> None:
        self.pool = d.fault_pool
        self.n = d.policy.pools[self.pool].replicas
        self.stalled = f"{self.pool}/{self.replica}"
        self.deadline_s = min(c.ttft_deadline_ms for c in d.policy.classes.values() if c.pool == self.pool and c.hedges) / 1000

    def describe(self, d: Drill) -> str:
        self._setup(d)
        return (f"replica {self.stalled} of {self.n} stopped {self.duty:.0%} of every {self.period_s:g}s for {self.fault:g}s "
                f"(admin fault stall); a {self.deadline_s * 1000:.0f} ms TTFT deadline hedges to the others")

    async def _finished(self, d: Drill) -> dict[str, dict[str, int]]:
        async with httpx.AsyncClient(timeout=5) as c:
            return {f"{self.pool}/{i}": _requests_finished((await c.get(d.mesh.sidecar_url(self.pool, i) + "/metrics")).text)
                    for i in range(self.n)}

    async def prepare(self, d: Drill) -> None:
        if (why := self.unfit(d.policy, d.fault_pool)) is not None:
            raise DrillError(why)
        self._setup(d)
        self.replica_samples: list[ReplicaSample] = []
        self.probe_results: list[Request] = []
        self.finished_before = await self._finished(d)
        self.finished: dict[str, dict[str, int]] = {}

    async def _sample_replicas(self, d: Drill, every: float = 0.1) -> None:
        async with httpx.AsyncClient(timeout=0.5) as admin:
            while not d.stop_load.is_set():
                for i in range(self.n):
                    t = d.now()
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        held = _held((await admin.get(d.mesh.admin_url(self.pool, i) + "/admin/state")).json())
                        self.replica_samples.append(ReplicaSample(t, f"{self.pool}/{i}", *held))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(d.stop_load.wait(), timeout=every)

    def extra_load(self, d: Drill):
        return self._sample_replicas(d)

    async def inject(self, d: Drill, marks: Marks) -> None:
        body = {"value": self.duty, "duration_s": self.fault + 60, "period_s": self.period_s}
        await _admin(d, self.pool, "PUT", "/admin/faults/stall", body, replica=self.replica)
        await asyncio.sleep(self.fault)
        await _admin(d, self.pool, "DELETE", "/admin/faults/stall", replica=self.replica)

    async def checks(self, d: Drill, marks: Marks):
        async with httpx.AsyncClient(timeout=2) as admin:
            async def held() -> dict[str, tuple[int, int]]:
                return {f"{self.pool}/{i}": _held((await admin.get(d.mesh.admin_url(self.pool, i) + "/admin/state")).json())
                        for i in range(self.n)}
            deadline = d.now() + 10
            left = await held()
            while any(left.values()) and d.now() < deadline:
                await asyncio.sleep(0.2)
                left = await held()
        for _ in range(self.probes):
            await d.interactive()
            self.probe_results.append(d.requests.pop())  # not part of the drill's load
        after = await self._finished(d)
        self.finished = {who: {st: n - self.finished_before[who].get(st, 0) for st, n in sorted(c.items()) if n - self.finished_before[who].get(st, 0)}
                         for who, c in after.items()}
        probes_ok = sum(1 for r in self.probe_results if r.status == 200 and r.complete)
        return [("no request left in vLLM or the sidecar on any replica", not any(any(v) for v in left.values()),
                 f"(vLLM unfinished, sidecar in flight) by replica: {left}"),
                (f"probes after the load all served", probes_ok == len(self.probe_results),
                 f"{probes_ok}/{len(self.probe_results)}; served by {[r.served_by for r in self.probe_results]}")] + \
            slow_replica_checks(d.requests, self.replica_samples, marks, self.stalled, self.deadline_s, self.margin_s,
                                self.min_share, self.probe_results)

    def report_sections(self, d: Drill) -> dict:
        peak: dict[str, int] = {}
        for s in self.replica_samples:
            peak[s.replica] = max(peak.get(s.replica, 0), s.unfinished)
        return {"replica_load": {who: {"finished": self.finished.get(who, {}), "max_unfinished": peak.get(who, 0)}
                                 for who in (f"{self.pool}/{i}" for i in range(self.n))},
                "stalled_replica": self.stalled, "ttft_deadline_ms": round(self.deadline_s * 1000)}

    async def cleanup(self, d: Drill) -> None:
        with contextlib.suppress(Exception):
            await _admin(d, self.pool, "DELETE", "/admin/faults", replica=self.replica)


class ControlPlaneKill(Scenario):
    """SIGKILL to the control plane, restart after `down_s`: Envoy serves its last config meanwhile."""

    name = "control-plane-kill"
    degrades = False
    down_s = 3.0

    def describe(self, d: Drill) -> str:
        return f"SIGKILL to the control plane, restarted {self.down_s:g}s later"

    async def _connected(self, d: Drill) -> bool:
        async with httpx.AsyncClient(timeout=2) as c:
            text = (await c.get(f"http://127.0.0.1:{d.mesh.plan.admin_port}/stats?filter=control_plane.connected_state")).text
        return text.strip().endswith(": 1")

    async def inject(self, d: Drill, marks: Marks) -> None:
        marks.kill = d.now()
        await asyncio.to_thread(d.mesh.kill, "control-plane")
        await asyncio.sleep(self.down_s)
        self.connected_while_down = await self._connected(d)
        d.mesh.restart("control-plane")
        t_restart = d.now()
        while not await self._connected(d):
            if d.now() - t_restart > 30:
                break
            await asyncio.sleep(0.05)
        marks.extra["resync_s"] = round(d.now() - t_restart, 3)

    async def checks(self, d: Drill, marks: Marks):
        resync = marks.extra.get("resync_s")
        return [("envoy noticed the control plane was gone", not self.connected_while_down, "connected_state 0 while down"),
                ("envoy reconnected to the restarted control plane", resync is not None and resync < 30, f"{resync} s after the restart")]


class InvalidPolicy(Scenario):
    """A broken policy over the watched file for `hold_s`, then the good one back."""

    name = "invalid-policy"
    degrades = False
    hold_s = 5.0

    def describe(self, d: Drill) -> str:
        return f"an invalid policy (default_class names no class) written over {d.mesh.plan.policy_path.name} for {self.hold_s:g}s, then restored"

    async def _versions(self, d: Drill) -> dict[str, str]:
        async with httpx.AsyncClient(timeout=2) as c:
            text = (await c.get(f"http://127.0.0.1:{d.mesh.plan.admin_port}/stats?filter=version_text")).text
        return dict(line.split(": ", 1) for line in text.strip().splitlines() if ": " in line)

    async def inject(self, d: Drill, marks: Marks) -> None:
        path: Path = d.mesh.plan.policy_path
        self.good = path.read_text()
        broken, n = re.subn(r"(?m)^default_class:.*$", "default_class: no-such-class", self.good)
        if not n:
            broken = self.good + "\nno_such_field: 1\n"
        self.before = await self._versions(d)
        self.log_mark = d.mesh.child("control-plane").log_path.stat().st_size
        path.write_text(broken)
        await asyncio.sleep(self.hold_s)
        self.during = await self._versions(d)
        path.write_text(self.good)
        await asyncio.sleep(0.5)

    async def checks(self, d: Drill, marks: Marks):
        log = d.mesh.child("control-plane").log_path.read_bytes()[self.log_mark:].decode(errors="replace")
        rejected = "policy rejected; keeping the last good config" in log and "default_class" in log
        return [("the control plane rejected the policy, naming the field", rejected, "logged 'policy rejected … default_class'"),
                ("envoy kept its config version while the file was bad", self.before == self.during and bool(self.before),
                 f"{len(self.before)} xDS versions unchanged")]

    async def cleanup(self, d: Drill) -> None:
        if getattr(self, "good", None) is not None and d.mesh.plan.policy_path.read_text() != self.good:
            d.mesh.plan.policy_path.write_text(self.good)


@dataclass
class BadCase:
    name: str
    expect: tuple[int, ...]
    send: Callable


class BadRequests(Scenario):
    """Bad input mixed into the load: each must get its documented answer and harm nothing else."""

    name = "bad-requests"
    degrades = False
    fault = 10.0
    rate = 6.0

    def describe(self, d: Drill) -> str:
        return (f"{self.rate:g}/s of bad input for {self.fault:g}s: malformed and non-JSON bodies, a 5 MiB body, an unknown model, "
                "a wrong method, spoofed routing headers, clients that vanish mid-stream")

    def cases(self, d: Drill) -> list[BadCase]:
        c = d.client

        async def malformed():
            return await c.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})

        async def not_json():
            return await c.post("/v1/chat/completions", content=os.urandom(512), headers={"content-type": "application/octet-stream"})

        async def oversize():
            return await c.post("/v1/completions", content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}', headers={"content-type": "application/json"})

        async def unknown_model():
            return await c.post("/v1/chat/completions", json={"model": "no-such-model", "messages": [CHAT], "max_tokens": 2})

        async def wrong_method():
            return await c.get("/v1/chat/completions")

        async def missing_field():
            return await c.post("/v1/chat/completions", json={"model": d.model, "max_tokens": 2})

        async def spoofed():
            # Asks for the fault pool by header; the filter must strip it and route by the rules.
            return await c.post("/v1/completions", json={"model": d.model, "prompt": "x", "max_tokens": 2},
                                headers={"x-infermesh-pool": d.fault_pool, "x-infermesh-class": "interactive", "x-infermesh-rule": "chat"})

        return [BadCase("malformed-json", (400,), malformed), BadCase("not-json", (400, 415), not_json),
                BadCase("oversize-5MiB", (413,), oversize), BadCase("unknown-model", (404,), unknown_model),
                BadCase("wrong-method", (405,), wrong_method), BadCase("missing-messages", (400,), missing_field),
                BadCase("spoofed-headers", (200,), spoofed), BadCase("vanishing-client", (), None)]

    async def _vanish(self, d: Drill, r: Request) -> None:
        body = {"model": d.model, "stream": True, "max_tokens": 200, "messages": [CHAT]}
        async with d.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            d._record(r, resp)
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break  # hang up after the first event: vLLM must drop the request
        r.abandoned = True

    async def _one(self, d: Drill, case: BadCase) -> None:
        r = Request(f"bad:{case.name}", d.now(), expect=case.expect)
        d.requests.append(r)
        try:
            if case.send is None:
                await self._vanish(d, r)
            else:
                resp = await case.send()
                d._record(r, resp)
                r.complete = True
                if case.name == "spoofed-headers":
                    self.spoofed_pools.append(r.pool)
        except httpx.HTTPError as e:
            r.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            r.done = d.now()

    async def inject(self, d: Drill, marks: Marks) -> None:
        self.spoofed_pools: list[str | None] = []
        cases = self.cases(d)
        i = 0
        end = d.now() + self.fault
        while d.now() < end:
            d._spawn(self._one(d, cases[i % len(cases)]))
            i += 1
            await asyncio.sleep(1 / self.rate)

    async def checks(self, d: Drill, marks: Marks):
        home = {r.kind: r.pool for r in d.requests if r.kind == "batch" and r.status == 200}.get("batch")
        spoof_ok = bool(self.spoofed_pools) and all(p == home for p in self.spoofed_pools)
        # Vanished clients: vLLM must hold no request once the load is over.
        deadline = d.now() + 10
        while d.now() < deadline:
            latest = [d.latest(p) for p in d.pools]
            if all(s is not None and s.up and s.unfinished == 0 for s in latest):
                break
            await asyncio.sleep(0.2)
        left = {p: (d.latest(p).unfinished if d.latest(p) else None) for p in d.pools}
        return [("spoofed routing headers were ignored", spoof_ok, f"served by {sorted(set(map(str, self.spoofed_pools)))}, expected {home}"),
                ("vanished clients left no request in vLLM", all(v == 0 for v in left.values()), f"unfinished: {left}")]


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    InjectedReading("kv-cache", "kv_cache"),
    InjectedReading("gpu-memory", "gpu_memory"),
    CpuPressure(),
    SidecarKill(),
    SlowSidecar(),
    SlowReplica(),
    ControlPlaneKill(),
    InvalidPolicy(),
    BadRequests(),
]}


REMOTE_SCENARIOS = ("kv-cache", "gpu-memory", "slow-sidecar", "bad-requests")
"""What a drill can do to a mesh it did not start: faults through the sidecars' admin API and bad
input. Killing processes, burning this machine's CPU and editing the control plane's policy file
are only for the local mesh."""


@dataclass
class RemoteMesh:
    """A mesh this process did not start (a cluster): its gateway URL and, per pool, the admin
    API of one of its pods (`kubectl port-forward POD LOCAL:8301`; the chart's
    `admin.allowFaults: true` lets it take faults)."""

    plan: Any
    """Only `.policy` is read: the policy the cluster runs (the chart's values)."""
    base_url: str
    admins: dict[str, str]
    prometheus: str | None = None
    """The URL of a Prometheus that scrapes the cluster's mesh (`--prometheus`): the report links its graphs."""

    def admin_url(self, pool: str, replica: int = 0) -> str:
        if replica:
            raise DrillError("a remote mesh is given one admin API per pool (--admin POOL=URL): no replica to choose")
        return self.admins[pool]


def run_remote(names: list[str], policy_path: Path, gateway: str, admins: list[str], options: DrillOptions, as_json: bool,
               prometheus: str | None = None) -> int:
    """`infermesh drill SCENARIO --gateway URL --admin POOL=URL ...`: the scenarios against a running
    mesh (docs/kubernetes.md, "Drills against a cluster")."""
    from types import SimpleNamespace

    from infermesh.meshconfig.policy import PolicyError, load_policy

    from .drill_report import format_report

    def say(msg: str) -> None:
        print(f"drill: {msg}", file=sys.stderr, flush=True)

    try:
        policy = load_policy(policy_path)
    except PolicyError as e:
        say(f"invalid policy:\n{e}")
        return 2
    urls = dict(a.partition("=")[::2] for a in admins)
    fault_pool = options.fault_pool or policy.classes[min(policy.classes, key=lambda c: policy.classes[c].priority)].pool
    problems = [f"{n}: only {', '.join(REMOTE_SCENARIOS)} run against a remote mesh" for n in names if n not in REMOTE_SCENARIOS]
    problems += [f"--admin {p}=URL: {p!r} is not one of the pools {list(policy.pools)}" for p in urls if p not in policy.pools]
    if fault_pool not in urls:
        problems.append(f"--admin {fault_pool}=URL is needed: the fault goes to pool {fault_pool}'s admin API")
    if problems:
        say("; ".join(problems))
        return 2
    mesh = RemoteMesh(SimpleNamespace(policy=policy), gateway.rstrip("/"), urls, prometheus)
    reports = _run_scenarios(mesh, names, options, say, lambda name, rep: as_json or print(format_report(rep), flush=True))
    if reports is None:
        return 2
    if as_json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    return 0 if all(r["passed"] for r in reports) else 1


def fitting_scenarios(names: list[str], policy: Policy, fault_pool: str | None, say: Callable[[str], None]) -> list[str] | None:
    """The named scenarios this policy can run. One named scenario that cannot: None (said why);
    several (`all`): the others, with a note for each one left out."""
    unfit = {n: why for n in names if (why := SCENARIOS[n].unfit(policy, fault_pool)) is not None}
    if len(names) == 1 and unfit:
        say(unfit[names[0]])
        return None
    for n, why in unfit.items():
        say(f"skipping {why}")
    return [n for n in names if n not in unfit]


def _run_scenarios(mesh, names: list[str], options: DrillOptions, say: Callable[[str], None],
                   show: Callable[[str, dict], object]) -> list[dict] | None:
    """Each named drill in turn against `mesh`, `show`n as it ends; None when one could not run."""
    reports = []
    for name in names:
        try:
            rep = asyncio.run(Drill(mesh, options, progress=say).run(SCENARIOS[name]))
        except DrillError as e:
            say(str(e))
            return None
        reports.append(rep)
        show(name, rep)
    return reports


def run_cli(names: list[str], policy_path: Path | None, options: DrillOptions, as_json: bool, plot: str | None,
            observe: bool = False) -> int:
    """`infermesh drill`: start a local mesh on free ports from a copy of the policy, run the
    scenarios one after another on it, print the reports; exit 1 if any check failed. `observe`:
    the mesh's own Prometheus too, which the reports link (observe.drill_queries)."""
    import shutil
    import tempfile

    from infermesh.launcher import LaunchError, LocalMesh, plan_on_free_ports
    from infermesh.meshconfig.policy import LOCAL_POLICY, PolicyError, load_policy

    from .drill_report import format_report, plot_report
    from .models import build_all

    def say(msg: str) -> None:
        print(f"drill: {msg}", file=sys.stderr, flush=True)

    source = policy_path or LOCAL_POLICY
    try:
        policy = load_policy(source)
    except PolicyError as e:
        say(f"invalid policy:\n{e}")
        return 2
    if options.fault_pool is not None and options.fault_pool not in policy.pools:
        say(f"--pool {options.fault_pool!r} is not one of the pools {list(policy.pools)}")
        return 2
    names = fitting_scenarios(names, policy, options.fault_pool, say)
    if not names:
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix="infermesh-drill-"))
    policy_copy = run_dir / "policy.yaml"  # the invalid-policy drill writes over it, never over yours
    shutil.copyfile(source, policy_copy)
    build_all()
    mesh = LocalMesh(plan_on_free_ports(policy_copy), run_dir, observe=observe)
    reports = []
    try:
        t0 = time.monotonic()
        mesh.start(timeout=600, progress=say)
        say(f"mesh up in {time.monotonic() - t0:.0f}s (logs in {run_dir})")
        def show(name: str, rep: dict) -> None:
            if plot:
                out = plot if len(names) == 1 else str(Path(plot).with_name(f"{Path(plot).stem}-{name}{Path(plot).suffix or '.png'}"))
                plot_report(rep, out)
                say(f"timeline of {name} drawn in {out}")
            if not as_json:
                print(format_report(rep), flush=True)
                print(flush=True)

        reports = _run_scenarios(mesh, names, options, say, show)
        if reports is None:
            return 2
    except LaunchError as e:
        say(f"the mesh failed to start: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        mesh.stop()
    if as_json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    return 0 if all(r["passed"] for r in reports) else 1
