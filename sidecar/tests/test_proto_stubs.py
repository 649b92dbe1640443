"""The committed gRPC stubs are exactly what scripts/gen-proto.sh generates from the .proto."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "sidecar" / "proto" / "infermesh" / "v1"


def test_committed_stubs_match_the_proto(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "scripts" / "gen-proto.sh"), str(tmp_path)], check=True, env=env, cwd=ROOT)
    for name in ("inference_pb2.py", "inference_pb2_grpc.py", "inference_pb2.pyi"):
        fresh = (tmp_path / "infermesh" / "v1" / name).read_text()
        assert fresh == (STUBS / name).read_text(), f"{name} is stale: run scripts/gen-proto.sh"
