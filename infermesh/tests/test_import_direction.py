"""The packages depend one way: what the control plane and the sidecar share lives in
infermesh.settings (typed settings, the level order) and infermesh.logs (JSON logging).

    infermesh.meshconfig  ──►  infermesh.settings, infermesh.logs  ◄──  infermesh.sidecar
           ▲                                                               │
           └──────── infermesh.meshconfig.policy only (`--policy FILE`) ───┘

- meshconfig never imports the sidecar (not at module level, not inside a function);
- the sidecar imports only the policy model from meshconfig (it reads the policy file itself
  when started with `--policy`), and the policy model imports nothing else of meshconfig's
  Envoy or Istio code, so a sidecar never loads the control plane;
- settings and logs import neither.
The folders are named differently from the packages (mesh-config/meshconfig is
infermesh.meshconfig), which is how the old cycle hid; these checks read the imports as written.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_architecture", REPO / "scripts" / "gen_architecture.py")
_gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gen)
PACKAGES = {"infermesh.meshconfig": REPO / "mesh-config" / "meshconfig", "infermesh.sidecar": REPO / "sidecar",
            "infermesh": REPO / "infermesh"}
SIDECAR_MAY_IMPORT = {"infermesh.meshconfig.policy"}
# The policy model's own leaves: the regex dialect and the content model (issue 32), which import
# nothing of meshconfig themselves.
POLICY_MAY_IMPORT = {"infermesh.meshconfig.filter_regex", "infermesh.meshconfig.content_model"}


def module_files(package: str) -> dict[str, Path]:
    root = PACKAGES[package]
    out = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).with_suffix("")
        if "tests" in rel.parts or "bench" in rel.parts or "proto" in rel.parts:
            continue
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join([package, *parts])] = f
    return out


def imports(module: str, path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it, as absolute names (the architecture page's reader)."""
    return _gen.imported_names(module, path)


def within(names: set[str], package: str) -> set[str]:
    return {n for n in names if n == package or n.startswith(package + ".")}


def test_meshconfig_never_imports_the_sidecar():
    found = {m: sorted(within(imports(m, f), "infermesh.sidecar")) for m, f in module_files("infermesh.meshconfig").items()}
    assert not {m: v for m, v in found.items() if v}


def test_the_sidecar_imports_only_the_policy_model_of_meshconfig():
    found = {}
    for m, f in module_files("infermesh.sidecar").items():
        names = within(imports(m, f), "infermesh.meshconfig")
        # `from infermesh.meshconfig.policy import X` also names infermesh.meshconfig.policy.X.
        bad = {n for n in names if not any(n == ok or n.startswith(ok + ".") for ok in SIDECAR_MAY_IMPORT)}
        if bad - {"infermesh.meshconfig"}:
            found[m] = sorted(bad)
    assert not found
    mesh = module_files("infermesh.meshconfig")
    policy_needs = within(imports("infermesh.meshconfig.policy", mesh["infermesh.meshconfig.policy"]), "infermesh.meshconfig")
    assert {n.rsplit(".", 1)[0] if n not in mesh else n for n in policy_needs} <= POLICY_MAY_IMPORT | {"infermesh.meshconfig"}


def test_the_shared_modules_import_neither():
    mods = module_files("infermesh")
    for name in ("infermesh.settings", "infermesh.logs"):
        names = imports(name, mods[name])
        assert not within(names, "infermesh.sidecar") | within(names, "infermesh.meshconfig"), name


def test_loading_the_policy_loads_no_sidecar_no_envoy_and_no_vllm_code():
    # The e2e policy names vLLM tool-call parsers: checking them must not import vLLM (and torch),
    # ~20 s of CPU that a restarting control plane would spend beside the engines.
    code = ("import sys, infermesh.settings, infermesh.logs, infermesh.meshconfig.policy as p; "
            f"p.load_policy(p.LOCAL_POLICY); p.load_policy({str(REPO / 'e2e' / 'policy-e2e.yaml')!r}); "
            "print(sorted(m for m in sys.modules if m.startswith(('infermesh.sidecar', 'envoy', 'grpc', 'vllm', 'torch'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
