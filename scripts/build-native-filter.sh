#!/usr/bin/env bash
# Build the filter as a native Envoy dynamic module (feature dynamic-module): a Linux shared
# object, libinfermesh_filter.so, that Envoy's envoy.filters.http.dynamic_modules filter loads
# (docs/filter-native-module.md). rustup's cargo builds it natively, offline, from the same
# vendored crates as scripts/build-filter.sh (vendored first if this Cargo.lock has none yet).
# Extra arguments go to cargo build (the benchmark's do-nothing module:
# `--features bench-noop --target-dir target/native-noop`).
set -euo pipefail
cd "$(dirname "$0")/../filter"
HOME_DIR="${INFERMESH_HOME:-$HOME/.cache/infermesh}"
VENDOR="$HOME_DIR/cargo-vendor-$(sha256sum Cargo.lock | cut -c1-12)"
CARGO="$HOME/.cargo/bin/cargo"
[ -x "$CARGO" ] || CARGO="$(command -v cargo)"
if [ ! -f "$VENDOR/.complete" ]; then
  echo "build-native-filter: vendoring crates into $VENDOR" >&2
  rm -rf "$VENDOR"
  RUSTC=/usr/bin/rustc "$CARGO" vendor --locked --versioned-dirs "$VENDOR" >/dev/null
  touch "$VENDOR/.complete"
fi
# Default target dir: target/native (apart from the Wasm build's, so neither rebuilds the other).
TARGET_DIR=target/native
prev=""
DEFAULT=(--target-dir "$TARGET_DIR")
for a in "$@"; do [ "$prev" = --target-dir ] && TARGET_DIR="$a" && DEFAULT=(); prev="$a"; done
"$CARGO" build --offline --locked --release --lib --features dynamic-module \
  --config "source.crates-io.replace-with=\"vendored\"" \
  --config "source.vendored.directory=\"$VENDOR\"" "${DEFAULT[@]}" "$@"
ls -l "$TARGET_DIR/release/libinfermesh_filter.so" >&2
# The content classifier on lines of JSON (filter/examples/content_eval.rs), where `infermesh
# classes eval` and the contract test call it (target/release/examples/content_eval): the default
# build only, by the very command they run (its artifacts are theirs: neither rebuilds the other).
if [ $# -eq 0 ]; then
  "$CARGO" build --release --quiet --example content_eval
  ls -l target/release/examples/content_eval >&2
fi
