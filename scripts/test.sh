#!/usr/bin/env bash
# The whole test suite: native Rust tests of the filter, then pytest (unit tests, Envoy +
# compiled-filter integration tests, and the e2e tests of the real local mesh with vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
PY="$(scripts/setup.sh)"
echo "test: setup done in $((SECONDS - t0))s" >&2
scripts/setup-chart-tools.sh >/dev/null  # Helm and the Kubernetes/Istio schemas for charts/tests
scripts/setup-istiod.sh >/dev/null  # istiod for e2e/test_istiod_e2e.py (built once; docs/kubernetes.md)
scripts/setup-otelcol.sh >/dev/null  # the OpenTelemetry Collector for e2e/test_tracing_e2e.py (built once; docs/tracing.md)

echo "== filter: cargo test (native) ==" >&2
# The flow's unit tests need no feature; `dynamic-module` also compiles (and tests) the native bindings.
(cd filter && INFERMESH_FUZZ_SECS="${INFERMESH_FUZZ_SECS:-5}" cargo test --release --quiet --features dynamic-module 2>&1)

echo "== pytest ==" >&2
"$PY" -m pytest "$@"
echo "test: suite done in $((SECONDS - t0))s" >&2
