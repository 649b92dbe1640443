"""LocalMesh's CPU pinning: a child pinned before exec, and everything it spawns, runs only on
its pool's CPUs (vLLM's engine-core and worker processes are such grandchildren)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from infermesh.launcher import LaunchError, _start_child, parse_cpus

GRANDCHILD = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)));"
              "print(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
              " capture_output=True, text=True).stdout.strip())")


def test_cpu_lists_parse_and_a_wrong_one_names_the_setting():
    first = min(os.sched_getaffinity(0))
    assert parse_cpus(str(first)) == {first}
    assert parse_cpus(f"{first}-{first}") == {first}
    for bad in ("x", "0-", "", "4096", "1-0"):
        with pytest.raises(LaunchError, match=r"cpu_cores\['batch'\]"):
            parse_cpus(bad, "cpu_cores['batch']")


def test_a_pinned_child_and_its_children_run_only_on_those_cpus():
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", GRANDCHILD], preexec_fn=_start_child({cpu}), capture_output=True,
                         text=True, timeout=60, check=True).stdout.split("\n")
    assert out[0] == out[1] == str([cpu])


def test_an_unpinned_child_keeps_the_launchers_cpus():
    out = subprocess.run([sys.executable, "-c", GRANDCHILD], preexec_fn=_start_child(None), capture_output=True,
                         text=True, timeout=60, check=True).stdout.split("\n")
    assert out[0] == str(sorted(os.sched_getaffinity(0)))


@pytest.mark.parametrize("flags, says", [
    (["--cpus", "interactive"], "expected POOL=CPUS"),
    (["--cpus", "nosuchpool=0"], "no pool or replica 'nosuchpool' in the policy (there are batch"),
    (["--cpus", "interactive=4096"], "cpu_cores['interactive']: '4096' names CPUs outside"),
    (["--cpus", "batch=0", "--proxy-cpus", "x"], "proxy_cores: 'x' is not a CPU list"),
])
def test_up_refuses_a_bad_cpu_setting_before_starting_anything(flags, says, capsys, monkeypatch):
    import infermesh.models
    from infermesh.cli import main

    monkeypatch.setattr(infermesh.models, "build_all", lambda: pytest.fail("built before the settings were checked"))
    assert main(["up", *flags]) == 2
    assert says in capsys.readouterr().err


def test_a_pool_and_a_replica_can_each_be_given_cpus(tmp_path):
    from infermesh.launcher import LocalMesh
    from infermesh.meshconfig.local_mesh import LocalMeshPlan
    from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy

    plan = LocalMeshPlan(policy_path=LOCAL_POLICY, policy=load_policy(LOCAL_POLICY), listen_port=1, admin_port=2, xds_port=3)
    cpu = str(min(os.sched_getaffinity(0)))
    keys = {p.key for p in plan.pools} | {p.name for p in plan.pools}
    mesh = LocalMesh(plan, tmp_path, cpu_cores={k: cpu for k in keys}, pin_tree=True, proxy_cores=cpu)
    assert mesh.cpu_cores.keys() == keys
