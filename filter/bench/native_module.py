"""The filter as a native Envoy dynamic module against the Wasm filter and no filter, side by side.

Each native variant is a run_bench variant with `filter.runtime: native`: Envoy's
`envoy.filters.http.dynamic_modules` filter (envoy_resources.filter_http_filter) loading the shared object built by
scripts/build-native-filter.sh (docs/filter-native-module.md); everything else (routes, sink,
request bodies, pinning) is run_bench's, so the two forms differ only in the filter runtime.

  native-noop             the do-nothing module (features dynamic-module + bench-noop): every
                          hook returns at once — the floor of the mechanism, as wasm-noop is of proxy-wasm
  native-headers          headers-wasm's config, the module deciding every request
  native-body             body's config (a body rule first: every chat body buffered and scanned)
  native-degraded         headers-degraded's config (when_degraded live, level headers, probes)

    python filter/bench/native_module.py instructions --variants no-filter,wasm-noop,native-noop --sizes 2,32
    python filter/bench/native_module.py time --variants headers-wasm,native-headers --sizes 2,32 --rounds 4
    python filter/bench/native_module.py time --variants native-body --native-before OLD.so   # a change, in one run

`instructions` counts Envoy's instructions per request under callgrind (instructions.py's
machinery); `time` is run_bench's saturation run (throughput and Envoy CPU per request),
interleaved rounds, ratios against no-filter from the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import instructions  # noqa: E402
import run_bench as rb  # noqa: E402
from infermesh.meshconfig.envoy_resources import NATIVE_MODULE_NAME, native_module_env  # noqa: E402

FILTER_DIR = rb.paths.REPO_ROOT / "filter"
NATIVE_SO = FILTER_DIR / "target" / "native" / "release" / "libinfermesh_filter.so"
NATIVE_NOOP_SO = FILTER_DIR / "target" / "native-noop" / "release" / "libinfermesh_filter.so"

# native variant -> (the run_bench variant whose config it takes, the module it loads)
NATIVE = {
    "native-noop": ("wasm-noop", NATIVE_NOOP_SO),
    "native-headers": ("headers-wasm", NATIVE_SO),
    "native-body": ("body", NATIVE_SO),
    "native-degraded": ("headers-degraded", NATIVE_SO),
}
BASE_VARIANTS = ("no-filter", "wasm-noop", "headers-only", "headers-wasm", "body", "headers-degraded")
VARIANTS = BASE_VARIANTS + tuple(NATIVE)


# run_bench's own config writer, before native_module points run_bench at the one below.
_WASM_CONFIG = rb.write_variant_config


def write_variant_config(path: Path, name: str, port: int, admin: int, sink_port: int, runtime: str = "envoy.wasm.runtime.v8",
                         modules: dict[str, Path] | None = None) -> None:
    """run_bench's config of a variant; a native variant's with the policy's native runtime.
    Envoy finds the module through its environment, and each variant's Envoy starts right after
    its config is written: the search path is set here for that child."""
    base, module = NATIVE.get(name, (name, None))
    _WASM_CONFIG(path, base, port, admin, sink_port, runtime, modules, native_module=module)
    if module:
        os.environ.update(native_module_env(_as_loadable(module)))


_STAGED: dict[Path, Path] = {}


def _as_loadable(module: Path) -> Path:
    """`module`, or a copy of it under the name Envoy loads (an earlier build given by path)."""
    if module.name == f"lib{NATIVE_MODULE_NAME}.so":
        return module
    if module not in _STAGED:
        staged = Path(tempfile.mkdtemp(prefix="infermesh-native-")) / f"lib{NATIVE_MODULE_NAME}.so"
        shutil.copy2(module, staged)
        _STAGED[module] = staged
    return _STAGED[module]


# run_bench.start_variant and instructions.count write each variant's config through these.
rb.write_variant_config = write_variant_config
instructions.write_config = lambda path, name, port, admin, sink_port, modules=None: write_variant_config(path, name, port, admin, sink_port)


def build(chosen: set[str]) -> None:
    script = str(rb.paths.REPO_ROOT / "scripts" / "build-native-filter.sh")
    if "native-noop" in chosen:
        print("native: building the do-nothing module (features dynamic-module, bench-noop)", file=sys.stderr, flush=True)
        subprocess.run([script, "--features", "bench-noop", "--target-dir", "target/native-noop"], check=True, stdout=subprocess.DEVNULL)
    if chosen & {"native-headers", "native-body", "native-degraded"}:
        subprocess.run([script], check=True, stdout=subprocess.DEVNULL)
    if "wasm-noop" in chosen:
        rb.build_noop()


def run_instructions(args, chosen: list[str]) -> dict:
    if not shutil.which("valgrind"):
        raise SystemExit("native: valgrind is needed (apt-get install valgrind)")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="infermesh-native-") as tmp:
        work = Path(tmp)
        sink, sink_port = rb.start_sink(work)
        try:
            for kb in args.sizes:
                body = rb.chat_body(kb * 1024)
                for name in chosen:
                    per = instructions.count(work, name, sink_port, body, args.requests, args.warmup) / args.requests
                    results[f"{name}/{kb}KB"] = {"instructions_per_request": round(per)}
                    print(f"{name}/{kb}KB {per:12,.0f} instructions/request", flush=True)
        finally:
            sink.stop()
    print(f"\n{'variant':22s} {'instr/req':>12s} {'added':>10s} {'ratio':>7s} {'~throughput':>12s}")
    for key, r in results.items():
        base = results.get(f"no-filter/{key.split('/')[1]}")
        if not base:
            continue
        ratio = r["instructions_per_request"] / base["instructions_per_request"]
        r.update(added=r["instructions_per_request"] - base["instructions_per_request"], ratio=round(ratio, 3), throughput_estimate=round(1 / ratio, 3))
        print(f"{key:22s} {r['instructions_per_request']:12,d} {r['added']:+10,d} {ratio:7.3f} {1 / ratio:11.3f}x")
    return results


def run_time(args, chosen: list[str]) -> dict:
    veg = rb.vegeta()
    samples: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="infermesh-native-") as tmp:
        work = Path(tmp)
        sink, sink_port = rb.start_sink(work)
        try:
            for rnd in range(args.rounds):
                for kb in args.sizes:
                    body = rb.chat_body(kb * 1024)
                    for name in chosen:
                        proc, port = _start(work, name, sink_port)
                        try:
                            rb.attack(veg, work, port, body, 1, None)  # warm-up
                            sat = rb.attack(veg, work, port, body, args.seconds, None, proc.p.pid)
                        finally:
                            proc.stop()
                        samples.setdefault(f"{name}/{kb}KB", []).append(sat)
                        bad = "" if sat["success"] >= 1 else f"  NON-200: {sat['codes']}"
                        print(f"round {rnd + 1}/{args.rounds} {name}/{kb}KB {sat['rps']:8.0f} rps {sat['envoy_cpu_us_per_request']:6.1f} cpu-us/req{bad}", flush=True)
        finally:
            sink.stop()
    summary = {}
    print(f"\n{'variant':22s} {'n':>2s} {'rps':>7s} {'ratio':>6s} {'round ratios [range]':>22s} {'CPU us/req':>10s} {'CPU ratio':>9s} {'round CPU ratios [range]':>26s}")
    for key, s in samples.items():
        base = samples[f"no-filter/{key.split('/')[1]}"]
        rps = statistics.median(x["rps"] for x in s)
        cpu = statistics.median(x["envoy_cpu_us_per_request"] for x in s)
        brps = statistics.median(x["rps"] for x in base)
        bcpu = statistics.median(x["envoy_cpu_us_per_request"] for x in base)
        rr = [a["rps"] / b["rps"] for a, b in zip(s, base)]
        cr = [b["envoy_cpu_us_per_request"] / a["envoy_cpu_us_per_request"] for a, b in zip(s, base)]
        summary[key] = {"n": len(s), "rps": round(rps), "throughput_ratio": round(rps / brps, 3), "cpu_us_per_request": round(cpu, 1),
                        "cpu_ratio": round(bcpu / cpu, 3), "round_ratios": [round(x, 3) for x in rr], "round_cpu_ratios": [round(x, 3) for x in cr]}
        print(f"{key:22s} {len(s):2d} {rps:7.0f} {rps / brps:6.3f} {statistics.median(rr):8.3f} [{min(rr):.2f}, {max(rr):.2f}]"
              f" {cpu:10.1f} {bcpu / cpu:9.3f} {statistics.median(cr):12.3f} [{min(cr):.2f}, {max(cr):.2f}]")
    return {"summary": summary, "samples": samples}


def _start(work: Path, name: str, sink_port: int):
    # The do-nothing forms pass the sink's level header on (they strip nothing): no level check.
    if name.endswith("-noop") or name == "no-filter":
        port, admin = rb.free_ports(2)
        path = work / f"{name}.json"
        rb.write_variant_config(path, name, port, admin, sink_port, "envoy.wasm.runtime.v8")
        proc = rb.Proc(rb.PIN_TESTED + [str(rb.paths.envoy_binary()), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1",
                                        "--log-level", "error"], work / f"{name}.log")
        rb.wait_ready(admin, proc)
        return proc, port
    return rb.start_variant(work, name, sink_port, "envoy.wasm.runtime.v8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("instructions", "time"))
    ap.add_argument("--variants", default="no-filter,wasm-noop,native-noop", help=f"from {', '.join(VARIANTS)} (no-filter always runs)")
    ap.add_argument("--sizes", default="2,32", help="chat body sizes in KB")
    ap.add_argument("--requests", type=int, default=300, help="instructions: requests counted per variant")
    ap.add_argument("--warmup", type=int, default=600, help="instructions: requests before counting")
    ap.add_argument("--rounds", type=int, default=4, help="time: interleaved rounds")
    ap.add_argument("--seconds", type=float, default=3.0, help="time: seconds of saturation per variant and round")
    ap.add_argument("--no-build", action="store_true", help="use the modules already built")
    ap.add_argument("--native-before", metavar="PATH",
                    help="also run native-body with this module (an earlier build of the .so): variant native-body@before")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    wanted = set(args.variants.split(",")) | {"no-filter"}
    if unknown := wanted - set(VARIANTS):
        ap.error(f"--variants: unknown {', '.join(sorted(unknown))}")
    chosen = [v for v in VARIANTS if v in wanted]
    if args.native_before:
        # The same config as native-body, another module: a change against the one before it, in one run.
        NATIVE["native-body@before"] = ("body", Path(args.native_before).resolve())
        chosen.append("native-body@before")
    if not args.no_build:
        build(wanted)
    out = run_instructions(args, chosen) if args.mode == "instructions" else run_time(args, chosen)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": out, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
