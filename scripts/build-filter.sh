#!/usr/bin/env bash
# Build the proxy-wasm filter for wasm32-wasi with Debian's rustc 1.63 (the toolchain on these
# machines that has a wasm32-wasi std). Debian's cargo 1.65 cannot read the crates.io sparse
# index, so rustup's cargo vendors the locked crates into a cache first; the build is offline.
# Extra arguments go to cargo build (the benchmark builds its baseline with
# `--features bench-noop --target-dir target/bench-noop`).
set -euo pipefail
cd "$(dirname "$0")/../filter"
HOME_DIR="${INFERMESH_HOME:-$HOME/.cache/infermesh}"
VENDOR="$HOME_DIR/cargo-vendor-$(sha256sum Cargo.lock | cut -c1-12)"
if [ ! -f "$VENDOR/.complete" ]; then
  NEW_CARGO="$(command -v cargo || true)"
  if [ -z "$NEW_CARGO" ] || [ "$NEW_CARGO" = /usr/bin/cargo ]; then
    NEW_CARGO="$HOME/.cargo/bin/cargo"
  fi
  echo "build-filter: vendoring crates into $VENDOR" >&2
  rm -rf "$VENDOR"
  RUSTC=/usr/bin/rustc "$NEW_CARGO" vendor --locked --versioned-dirs "$VENDOR" >/dev/null
  touch "$VENDOR/.complete"
fi
RUSTC=/usr/bin/rustc /usr/bin/cargo build --offline --locked --release --target wasm32-wasi \
  --config "source.crates-io.replace-with=\"vendored\"" \
  --config "source.vendored.directory=\"$VENDOR\"" "$@"
# Envoy calls every proxy_on_* callback a module exports; drop those the filter does not use.
[ $# -gt 0 ] || python3 ../scripts/strip-wasm-exports.py target/wasm32-wasi/release/infermesh_filter.wasm
[ $# -gt 0 ] || ls -l target/wasm32-wasi/release/infermesh_filter.wasm >&2
