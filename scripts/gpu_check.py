#!/usr/bin/env python3
"""GPU check for the GPU-memory breaker: real NVML readings, a real allocation past the threshold.

Runs on any machine with an NVIDIA GPU, torch (CUDA) and nvidia-ml-py; vLLM is not needed:

    pip install torch nvidia-ml-py pydantic && python scripts/gpu_check.py [--json out.json]

1. reads device memory through the sidecar's NVML monitor (GpuMemory) and prints it;
2. sets a breaker a little above the current use (or --trip-above, e.g. 0.92, the default policy);
3. allocates GPU memory with torch until the reading is past the threshold, holds it, and
   checks the breaker opens once the sustain window has passed (actions: degrade);
4. frees the memory and checks the breaker steps back to closed.

Exit 0: all checks held; 1: a check failed; 2: no usable GPU (nothing was checked).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _import_sidecar():
    # Works from a checkout without installing the package (the GPU machine may not have it).
    try:
        from infermesh.sidecar.breakers import Breaker, BreakerConfig
        from infermesh.sidecar.monitors import GpuMemory
    except ImportError:
        import importlib.util
        import types

        root = Path(__file__).resolve().parent.parent / "sidecar"
        pkg = types.ModuleType("_im_sidecar")
        pkg.__path__ = [str(root)]
        sys.modules["_im_sidecar"] = pkg
        for name in ("breakers", "monitors"):
            spec = importlib.util.spec_from_file_location(f"_im_sidecar.{name}", root / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        Breaker, BreakerConfig = sys.modules["_im_sidecar.breakers"].Breaker, sys.modules["_im_sidecar.breakers"].BreakerConfig
        GpuMemory = sys.modules["_im_sidecar.monitors"].GpuMemory
    return Breaker, BreakerConfig, GpuMemory


def run_check(read, allocate_until, free, trip_above, recover_below, sustain_s=2.0, recover_sustain_s=2.0,
              interval=0.25, clock=time.monotonic, sleep=time.sleep, say=print) -> dict:
    """The check itself, with its I/O injected (tests drive it with fakes)."""
    Breaker, BreakerConfig, _ = _import_sidecar()
    events = []
    b = Breaker("gpu-memory", BreakerConfig(signal="gpu_memory", trip_above=trip_above, recover_below=recover_below,
                                            sustain_s=sustain_s, recover_sustain_s=recover_sustain_s, min_samples=3,
                                            actions=["degrade"], half_open_timeout_s=1.0), clock, events.append)
    timeline = []

    def step(phase):
        v = read()
        b.observe(v)
        timeline.append({"t": round(clock(), 3), "phase": phase, "used": v, "state": b.state.value, "actions": list(b.actions)})
        return v

    baseline = step("baseline")
    say(f"gpu_check: baseline {baseline:.3f} used; breaker trips above {trip_above:.3f}, recovers below {recover_below:.3f}")
    allocate_until(trip_above + 0.02)
    t_over = None
    deadline = clock() + sustain_s + 10
    while clock() < deadline:
        v = step("allocated")
        if t_over is None and v > trip_above:
            t_over = clock()
        if b.state.value == "open":
            break
        sleep(interval)
    tripped = b.state.value == "open" and "degrade" in b.actions
    trip_delay = (clock() - t_over - sustain_s) if (tripped and t_over is not None) else None
    say(f"gpu_check: reading {timeline[-1]['used']:.3f}; breaker {b.state.value} {list(b.actions)}"
        + (f"; opened {trip_delay * 1000:.0f} ms after the sustain window" if trip_delay is not None else ""))
    free()
    deadline = clock() + recover_sustain_s + 15
    while clock() < deadline and b.state.value != "closed":
        step("freed")
        sleep(interval)
    recovered = b.state.value == "closed"
    say(f"gpu_check: after free {timeline[-1]['used']:.3f}; breaker {b.state.value}")
    return {
        "ok": bool(tripped and recovered and trip_delay is not None and trip_delay < 1.0),
        "baseline_used": baseline,
        "trip_above": trip_above,
        "recover_below": recover_below,
        "tripped": tripped,
        "trip_delay_after_sustain_s": trip_delay,
        "recovered": recovered,
        "transitions": [{"to": e.to_state.value, "actions": list(e.actions), "reason": e.reason} for e in events],
        "timeline": timeline,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trip-above", type=float, help="threshold (default: current use + 0.10, capped at 0.92)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; nothing checked", file=sys.stderr)
        return 2
    _, _, GpuMemory = _import_sidecar()
    mon = GpuMemory([args.device])
    if not mon.available or not torch.cuda.is_available():
        print("gpu_check: no NVIDIA GPU usable here (NVML or CUDA unavailable); nothing checked", file=sys.stderr)
        return 2
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(args.device)
    total = pynvml.nvmlDeviceGetMemoryInfo(h).total
    base = mon.read()
    trip = args.trip_above if args.trip_above is not None else min(0.92, base + 0.10)
    held: list = []

    def allocate_until(fraction: float) -> None:
        chunk = 256 << 20
        while mon.read() < fraction:
            held.append(torch.empty(chunk, dtype=torch.uint8, device=f"cuda:{args.device}"))
        torch.cuda.synchronize(args.device)

    def free() -> None:
        held.clear()
        torch.cuda.empty_cache()

    print(f"gpu_check: {torch.cuda.get_device_name(args.device)}, {total / 2**30:.1f} GiB", flush=True)
    result = run_check(mon.read, allocate_until, free, trip_above=trip, recover_below=max(0.0, trip - 0.05))
    result["device"] = torch.cuda.get_device_name(args.device)
    result["total_bytes"] = total
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print("gpu_check: " + ("PASS" if result["ok"] else "FAIL"), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
