"""`infermesh drill` refuses what it cannot run before it starts a mesh (minutes on CPU)."""

from __future__ import annotations

import subprocess
import sys

from infermesh.cli import main
from infermesh.meshconfig.policy import LOCAL_POLICY


def test_an_invalid_policy_is_reported_with_file_line_and_field(tmp_path, capsys):
    bad = tmp_path / "p.yaml"
    bad.write_text(LOCAL_POLICY.read_text().replace("default_class: batch", "default_class: nope"))
    assert main(["drill", "kv-cache", "--policy", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "default_class" in err


def test_an_unknown_pool_names_the_pools(capsys):
    assert main(["drill", "cpu", "--pool", "gpu-a"]) == 2
    assert "'gpu-a' is not one of the pools ['interactive', 'batch']" in capsys.readouterr().err


def test_an_unknown_scenario_lists_the_scenarios():
    r = subprocess.run([sys.executable, "-m", "infermesh.cli", "drill", "meteor"], capture_output=True, text=True)
    assert r.returncode == 2 and "kv-cache" in r.stderr and "bad-requests" in r.stderr


def test_a_remote_drill_refuses_what_it_cannot_do_to_a_cluster(capsys):
    """--gateway: a mesh this process did not start (docs/kubernetes.md); only faults through the
    admin API and bad input, and the fault pool's admin URL is required."""
    assert main(["drill", "kv-cache", "--gateway", "http://127.0.0.1:1"]) == 2
    assert "--gateway needs --policy" in capsys.readouterr().err
    args = ["--gateway", "http://127.0.0.1:1", "--policy", str(LOCAL_POLICY)]
    assert main(["drill", "sidecar-kill", *args, "--admin", "interactive=http://127.0.0.1:2"]) == 2
    assert "sidecar-kill: only kv-cache, gpu-memory, slow-sidecar, bad-requests run against a remote mesh" in capsys.readouterr().err
    assert main(["drill", "kv-cache", *args]) == 2
    assert "--admin interactive=URL is needed" in capsys.readouterr().err
    assert main(["drill", "kv-cache", *args, "--admin", "gpu=http://x"]) == 2
    assert "'gpu' is not one of the pools" in capsys.readouterr().err
