"""The drill faults: injected readings expire, and the stall fault (slow-sidecar drill) on a real
process is stopped for its duty share of every period, and always running again at the end — on
expiry, on stop, and on cancellation."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import psutil

from infermesh.sidecar.faults import EngineStall, Faults


def _status_samples(pid: int, seconds: float) -> list[str]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(psutil.Process(pid).status())
        time.sleep(0.01)
    return out


def test_stall_stops_the_process_for_its_duty_and_always_resumes_it():
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.001)"])
    try:
        async def scenario():
            stall = EngineStall([child.pid], duty=0.7, duration_s=1.0, period_s=0.2, clock=time.monotonic)
            stall.start()
            statuses = await asyncio.to_thread(_status_samples, child.pid, 0.8)
            await asyncio.sleep(0.5)  # past its duration
            after_expiry = psutil.Process(child.pid).status()
            # stop() in the middle of a stopped phase resumes at once
            stall2 = EngineStall([child.pid], duty=0.9, duration_s=30, period_s=1.0, clock=time.monotonic)
            stall2.start()
            await asyncio.sleep(0.2)
            mid = psutil.Process(child.pid).status()
            stall2.stop()
            await asyncio.sleep(0.05)
            return statuses, after_expiry, mid, psutil.Process(child.pid).status(), stall.snapshot()

        statuses, after_expiry, mid, after_stop, snap = asyncio.run(scenario())
        stopped = statuses.count(psutil.STATUS_STOPPED) / len(statuses)
        assert 0.45 < stopped < 0.9, f"stopped {stopped:.0%} of the time, duty 70%"
        assert after_expiry != psutil.STATUS_STOPPED
        assert mid == psutil.STATUS_STOPPED and after_stop != psutil.STATUS_STOPPED
        assert snap is None, "an expired stall reports nothing"
    finally:
        child.kill()
        child.wait()


def test_stall_of_a_vanished_process_is_harmless():
    async def scenario():
        stall = EngineStall([2 ** 22 + 12345], duty=0.5, duration_s=0.3, period_s=0.1, clock=time.monotonic)
        stall.start()
        await asyncio.sleep(0.4)
        return stall.task.done() and stall.task.exception() is None

    assert asyncio.run(scenario())


def test_injected_readings_expire(fake_clock):
    f = Faults(fake_clock)
    f.set("cpu_load", 1.0, 5)
    assert f.get("cpu_load") == 1.0
    fake_clock.t = 5
    assert f.get("cpu_load") is None and f.snapshot() == {}


def test_clearing_by_name_or_all_also_ends_the_stall(fake_clock):
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    try:
        async def scenario():
            f = Faults(fake_clock)
            f.set("kv_cache", 0.99, 60)
            f.start_stall([child.pid], duty=0.5, duration_s=60, period_s=1.0)
            both = sorted(f.snapshot())
            f.clear("stall")
            after_stall = sorted(f.snapshot())
            f.start_stall([child.pid], duty=0.5, duration_s=60, period_s=1.0)
            f.clear()
            await asyncio.sleep(0.05)
            return both, after_stall, f.snapshot(), psutil.Process(child.pid).status()

        both, after_stall, after_all, status = asyncio.run(scenario())
        assert both == ["kv_cache", "stall"] and after_stall == ["kv_cache"] and after_all == {}
        assert status != psutil.STATUS_STOPPED
    finally:
        child.kill()
        child.wait()
