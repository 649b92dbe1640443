#!/usr/bin/env bash
# Regenerate the committed Python gRPC stubs from sidecar/proto/*.proto.
# The suite checks that the committed stubs match (sidecar/tests/test_proto_stubs.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
out="${1:-sidecar/proto}"
"$PY" -m grpc_tools.protoc -I sidecar/proto --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  sidecar/proto/infermesh/v1/inference.proto
# protoc emits absolute imports (`from infermesh.v1 import ...`); make them package-relative.
sed -i 's/^from infermesh\.v1 import inference_pb2/from . import inference_pb2/' "$out/infermesh/v1/inference_pb2_grpc.py"
touch "$out/infermesh/__init__.py" "$out/infermesh/v1/__init__.py"
