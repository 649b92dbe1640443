"""scripts/gpu_check.py's logic with a fake GPU (no NVML, no CUDA): the real check runs only on a
GPU machine; this pins that its pass/fail verdict means what it says."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


class FakeGpu:
    """Memory use as a fraction, moved by fake allocations; time advances on sleep."""

    def __init__(self, used=0.30, stuck=False):
        self.used, self.t, self.stuck = used, 0.0, stuck

    def read(self):
        return self.used

    def allocate_until(self, fraction):
        self.used = fraction + 0.01

    def free(self):
        if not self.stuck:
            self.used = 0.30

    def clock(self):
        return self.t

    def sleep(self, dt):
        self.t += dt


def run(gpu):
    return gpu_check.run_check(gpu.read, gpu.allocate_until, gpu.free, trip_above=0.40, recover_below=0.35,
                               clock=gpu.clock, sleep=gpu.sleep, say=lambda *_: None)


def test_passes_when_the_breaker_trips_and_recovers():
    r = run(FakeGpu())
    assert r["ok"] and r["tripped"] and r["recovered"]
    assert 0 <= r["trip_delay_after_sustain_s"] < 1.0
    assert [t["to"] for t in r["transitions"]] == ["open", "half_open", "closed"]


def test_fails_when_memory_is_never_freed():
    r = run(FakeGpu(stuck=True))
    assert r["tripped"] and not r["recovered"] and not r["ok"]


def test_without_a_gpu_it_says_so_and_checks_nothing():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "nothing checked" in out.stderr
