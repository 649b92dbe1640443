#!/usr/bin/env bash
# Real OpenTelemetry Collector for e2e/test_tracing_e2e.py, built from the Go module proxy only:
# e2e/otelcol is a small program around the collector's own packages (otelcol, the OTLP receiver
# over gRPC and HTTP, the contrib file exporter), as the collector builder would generate it.
# Every collector module is pinned at ONE release set in its go.mod: core v0.161.0 / v1.67.0
# (pdata, component, confmap, ...) and contrib v0.161.0 (fileexporter: its newest release that
# builds here; mixing releases breaks the collector's internal APIs). docs/tracing.md.
#
# Idempotent: the binary lands in $INFERMESH_HOME (default ~/.cache/infermesh)/otelcol under a
# name keyed by its sources, so a second run only checks that it is there. Module and build
# caches stay in Go's default places.
#
#   scripts/setup-otelcol.sh     build it if missing; prints OTELCOL= last
set -euo pipefail

SRC="$(cd "$(dirname "$0")/../e2e/otelcol" && pwd)"
HOME_DIR="${INFERMESH_HOME:-$HOME/.cache/infermesh}"
OTELCOL_VERSION="$(sed -n 's/^[[:space:]]*go.opentelemetry.io\/collector\/otelcol \(v[^ ]*\).*$/\1/p' "$SRC/go.mod" | head -n1)"
KEY="$(cat "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go" | sha256sum | cut -c1-12)"
OTELCOL="$HOME_DIR/otelcol/otelcol-infermesh-$OTELCOL_VERSION-$KEY"
say() { echo "setup-otelcol: $*" >&2; }

command -v go >/dev/null || { say "Go is required (it builds the collector)"; exit 1; }
[ -n "$OTELCOL_VERSION" ] || { say "no go.opentelemetry.io/collector/otelcol version in $SRC/go.mod"; exit 1; }

if [ ! -x "$OTELCOL" ]; then
  t0=$SECONDS
  say "building the OpenTelemetry Collector ($OTELCOL_VERSION) from the Go module proxy (a few minutes on 2 cores the first time)"
  mkdir -p "$HOME_DIR/otelcol"
  # -mod=readonly: the committed go.sum decides every version; GOTOOLCHAIN=local: never fetch
  # another Go; nice: the machine is shared.
  (cd "$SRC" && GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" \
    nice -n 10 go build -ldflags "-s -w" -o "$OTELCOL.tmp.$$" .)
  mv "$OTELCOL.tmp.$$" "$OTELCOL"  # per-process name: two setups at once must not take each other's file
  # Builds of older sources are never used again.
  find "$HOME_DIR/otelcol" -maxdepth 1 -name 'otelcol-infermesh-*' ! -name "$(basename "$OTELCOL")" -delete
  say "collector ready in $((SECONDS - t0))s"
fi

echo "OTELCOL=$OTELCOL"
