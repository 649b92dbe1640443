#!/usr/bin/env bash
# Real istiod for e2e/test_istiod_e2e.py, built from the Go module proxy only: e2e/istiod is a
# small program around Istio's own discovery server (module istio.io/istio at the commit its
# go.mod pins), serving ADS on loopback from a directory of rendered YAML. docs/kubernetes.md,
# "Proven with istiod".
#
# Idempotent: the binary lands in $INFERMESH_HOME (default ~/.cache/infermesh)/istiod under a
# name keyed by its sources (go.mod pins the Istio version), so a second run only checks that it
# is there. Module and build caches stay in Go's default places, so a rebuild after a source
# change takes seconds, and the first build several minutes on 2 cores.
#
#   scripts/setup-istiod.sh     build it if missing; prints ISTIOD= last
set -euo pipefail

SRC="$(cd "$(dirname "$0")/../e2e/istiod" && pwd)"
HOME_DIR="${INFERMESH_HOME:-$HOME/.cache/infermesh}"
ISTIO_VERSION="$(sed -n 's/^require istio.io\/istio \(.*\)$/\1/p; s/^[[:space:]]*istio.io\/istio \(v[^ ]*\)$/\1/p' "$SRC/go.mod" | head -n1)"
KEY="$(cat "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go" | sha256sum | cut -c1-12)"
ISTIOD="$HOME_DIR/istiod/istiod-harness-$ISTIO_VERSION-$KEY"
say() { echo "setup-istiod: $*" >&2; }

command -v go >/dev/null || { say "Go is required (it builds istiod)"; exit 1; }
[ -n "$ISTIO_VERSION" ] || { say "no istio.io/istio version in $SRC/go.mod"; exit 1; }

if [ ! -x "$ISTIOD" ]; then
  t0=$SECONDS
  say "building istiod ($ISTIO_VERSION) from the Go module proxy (about 6 min on 2 cores the first time)"
  mkdir -p "$HOME_DIR/istiod"
  # -mod=readonly: the committed go.sum decides every version; GOTOOLCHAIN=local: never fetch
  # another Go (the module needs Go >= its go.mod's `go` line); nice: the machine is shared.
  (cd "$SRC" && GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" \
    nice -n 10 go build -ldflags "-s -w" -o "$ISTIOD.tmp.$$" .)
  mv "$ISTIOD.tmp.$$" "$ISTIOD"  # per-process name: two setups at once must not take each other's file
  # Builds of older sources (140 MB each) are never used again.
  find "$HOME_DIR/istiod" -maxdepth 1 -name 'istiod-harness-*' ! -name "$(basename "$ISTIOD")" -delete
  say "istiod ready in $((SECONDS - t0))s"
fi

echo "ISTIOD=$ISTIOD"
