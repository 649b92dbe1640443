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


# The wire of infermesh.v1 as first released (name=number:protobuf type:singular|repeated), before
# the sampling fields were added. Fields are only ever added: each of these keeps its number, type
# and cardinality, and no new field takes a number below the message's highest here.
RELEASED = {
    "ChatMessage": "role=1:9:s content=2:9:s",
    "ChatPrompt": "messages=1:11:r",
    "GenerateRequest": "request_id=1:9:s model=2:9:s text=3:9:s chat=4:11:s max_tokens=5:13:s temperature=6:2:s top_p=7:2:s "
                       "seed=8:3:s stop=9:9:r request_class=10:9:s n=11:13:s ignore_eos=12:8:s",
    "TokenChunk": "text=1:9:s token_ids=2:13:r index=3:13:s",
    "Usage": "prompt_tokens=1:13:s completion_tokens=2:13:s total_tokens=3:13:s",
    "Final": "finish_reason=1:9:s usage=2:11:s model=3:9:s degraded=4:8:s degraded_reason=5:9:s served_by=6:9:s finish_reasons=7:9:r",
    "GenerateResponse": "request_id=1:9:s chunk=2:11:s final=3:11:s",
    "ModelInfo": "id=1:9:s aliases=2:9:r primary=3:8:s",
    "ListModelsResponse": "models=1:11:r",
    "BreakerState": "name=1:9:s signal=2:9:s state=3:9:s actions=4:9:r value=5:1:s trip_above=6:1:s recover_below=7:1:s",
    "PoolState": "pool=1:9:s served_by=2:9:s ready=3:8:s draining=4:8:s level=5:13:s actions=6:9:r serving_model=7:9:s "
                 "primary_model=8:9:s in_flight=9:13:s breakers=10:11:r",
    "BreakerTransition": "at_unix=1:1:s breaker=2:9:s from_state=3:9:s to_state=4:9:s actions=5:9:r pool_actions=6:9:r "
                         "serving_model=7:9:s reason=8:9:s",
    "PoolEvent": "state=1:11:s transition=2:11:s",
}


def test_released_fields_keep_their_wire_form_and_new_ones_come_after():
    from infermesh.sidecar.proto.infermesh.v1 import inference_pb2 as pb

    for message, fields in RELEASED.items():
        now = {f.name: f for f in pb.DESCRIPTOR.message_types_by_name[message].fields}
        released = dict(item.split("=") for item in fields.split())
        for name, wire in released.items():
            f = now.get(name)
            assert f is not None and f"{f.number}:{f.type}:{'r' if f.is_repeated else 's'}" == wire, f"{message}.{name}"
        top = max(int(w.split(":")[0]) for w in released.values())
        assert all(f.number > top for n, f in now.items() if n not in released), f"{message}: a new field reuses an old number"
