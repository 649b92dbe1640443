"""LocalMesh with a policy's `filter.runtime: native`: the module must be built, under the name
Envoy loads it by, before anything starts."""

from __future__ import annotations

import pytest

from infermesh.launcher import LaunchError, LocalMesh
from infermesh.meshconfig.local_mesh import LocalMeshPlan
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy


def native_plan() -> LocalMeshPlan:
    p = load_policy(LOCAL_POLICY)
    p = p.model_copy(update={"filter": p.filter.model_copy(update={"runtime": "native"})})
    return LocalMeshPlan(policy_path=LOCAL_POLICY, policy=p, listen_port=1, admin_port=2, xds_port=3)


@pytest.mark.parametrize("module, says", [
    ("libinfermesh_filter.so", "filter.runtime: native, and the module is not built: "),
    ("old.so", "filter.runtime: native: Envoy loads the module as libinfermesh_filter.so, not old.so"),
])
def test_a_native_policy_without_its_module_is_refused_before_anything_starts(tmp_path, module, says):
    wasm = tmp_path / "infermesh_filter.wasm"
    wasm.write_bytes(b"\0asm")
    mesh = LocalMesh(native_plan(), tmp_path / "run", models_dir=tmp_path / "no-models", wasm=wasm, native_module=tmp_path / module)
    with pytest.raises(LaunchError, match=says.replace(".", r"\.")):
        mesh.start()
    assert not mesh.children and not (tmp_path / "run").exists()


def test_a_wasm_policy_does_not_need_the_module(tmp_path):
    wasm = tmp_path / "infermesh_filter.wasm"
    wasm.write_bytes(b"\0asm")
    plan = LocalMeshPlan(policy_path=LOCAL_POLICY, policy=load_policy(LOCAL_POLICY), listen_port=1, admin_port=2, xds_port=3)
    mesh = LocalMesh(plan, tmp_path / "run", models_dir=tmp_path / "no-models", wasm=wasm, native_module=tmp_path / "old.so")
    with pytest.raises(LaunchError, match="model tiny-llama"):  # got past the filter checks, to the models
        mesh.start()
