"""The sidecar benchmark's own instruments: the grpc-go client and the TTFT-histogram reading.

They decide what docs/sidecar-benchmark.md reports as a front's overhead, so they are tested
here against a fake gRPC servicer (no engine) and the sidecar's real metrics registry.
"""

import asyncio
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import generate_latest

from infermesh.sidecar.metrics import SidecarMetrics
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb
from infermesh.sidecar.proto.infermesh.v1 import inference_pb2_grpc as pb_grpc

_spec = importlib.util.spec_from_file_location("sidecar_run_bench", Path(__file__).resolve().parents[1] / "bench" / "run_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


class FakeInference(pb_grpc.InferenceServicer):
    """Answers after `delay_s` with one chunk and a final; `max_tokens == 13` fails the call."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.max_tokens == 13:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake refusal")
        await asyncio.sleep(self.delay_s)
        yield pb.GenerateResponse(request_id="r", chunk=pb.TokenChunk(text="a", token_ids=[1]))
        await asyncio.sleep(self.delay_s)  # the time to the first message must not include this
        yield pb.GenerateResponse(request_id="r", final=pb.Final(finish_reason="length"))


def test_ttft_sum_reads_one_front_over_every_class():
    m = SidecarMetrics("p", "i")
    m.ttft.labels("grpc", "interactive").observe(0.25)
    m.ttft.labels("grpc", "batch").observe(0.5)
    m.ttft.labels("http", "interactive").observe(2.0)
    text = generate_latest(m.registry).decode()

    class FakeClient:
        async def get(self, url):
            return SimpleNamespace(text=text)

    assert asyncio.run(bench.sidecar_ttft_sum(FakeClient(), "u", "grpc")) == pytest.approx(0.75)
    assert asyncio.run(bench.sidecar_ttft_sum(FakeClient(), "u", "http")) == pytest.approx(2.0)


def _go_client() -> Path:
    # The suite needs Go anyway (scripts/setup-chart-tools.sh builds Helm with it).
    assert shutil.which("go"), "the Go toolchain is required"
    return bench.go_client_binary()


def test_go_client_times_the_first_message_of_each_call():
    binary = _go_client()
    delay = 0.05

    async def run():
        fake = FakeInference(delay)
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            sent = pb.GenerateRequest(text="hi", max_tokens=8, ignore_eos=True)
            go = bench.GoClient(binary, port, sent.SerializeToString())
            t0 = time.monotonic()
            ttfts = [await go.one() for _ in range(3)]
            wall = time.monotonic() - t0
            go.close()
            # A failed call is reported, not timed.
            bad = bench.GoClient(binary, port, pb.GenerateRequest(text="hi", max_tokens=13).SerializeToString())
            with pytest.raises(RuntimeError, match="ResourceExhausted|fake refusal"):
                await bad.one()
            bad.close()
            return fake.requests, sent, ttfts, wall
        finally:
            await server.stop(0)

    requests, sent, ttfts, wall = asyncio.run(run())
    assert requests[:3] == [sent] * 3  # the bytes given arrive as that very message
    assert all(delay <= t < 2 * delay for t in ttfts), ttfts  # the first message, not the stream's end
    assert wall >= 3 * 2 * delay  # and each call was read to its end before the next


def test_go_client_refuses_a_request_that_is_not_hex():
    binary = _go_client()
    r = subprocess.run([str(binary), "-request", "zz"], capture_output=True, text=True, input="")
    assert r.returncode == 2 and "not hex" in r.stderr


def test_a_servers_cpu_is_split_into_its_front_and_its_descendants_and_pinned_so():
    """run_bench's CPU-per-token and pinning read a server's tree: the root is the front, every
    descendant (vLLM's engine core and worker) the engine."""
    import os

    # a front that spawns a busy child, then waits
    front = subprocess.Popen([sys.executable, "-c",
                              "import subprocess,sys,time;"
                              "c=subprocess.Popen([sys.executable,'-c','import time\\nt=time.time()\\nwhile time.time()-t<1.5: pass']);"
                              "c.wait()"])
    try:
        time.sleep(0.3)
        cpus = sorted(os.sched_getaffinity(0))
        bench.pin_server(front.pid, {cpus[-1]}, {cpus[0]})
        children = [int(p) for p in Path(f"/proc/{front.pid}/task/{front.pid}/children").read_text().split()]
        assert children and all(os.sched_getaffinity(c) == {cpus[0]} for c in children)
        assert os.sched_getaffinity(front.pid) == {cpus[-1]}
        time.sleep(0.8)
        parts = bench.tree_cpu_seconds(front.pid)
        assert parts["engine"] > 0.2, parts  # the busy child's, counted as the engine's
        assert parts["front"] < parts["engine"]
        front.wait(timeout=10)
    finally:
        front.kill()
