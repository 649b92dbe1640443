"""`python -m infermesh.sidecar.server --policy FILE --pool NAME`: the pool's config comes from
the mesh policy (what the Helm chart runs), and mistakes are reported by name."""

from pathlib import Path

import pytest

from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy
from infermesh.sidecar.config import ConfigError
from infermesh.sidecar.server import build_parser, config_from_args, main


def config(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_a_pool_of_the_policy_becomes_its_sidecar_config(tmp_path):
    cfg = config("--policy", str(LOCAL_POLICY), "--pool", "interactive", "--host", "0.0.0.0", "--http-port", "8100",
                 "--grpc-port", "8200", "--instance", "interactive-7f9c", "--models-dir", str(tmp_path), "--drain-grace-s", "45")
    policy = load_policy(LOCAL_POLICY)
    assert cfg.pool == "interactive" and cfg.served_by == "interactive/interactive-7f9c"
    assert [m.name for m in cfg.models] == [m.name for m in policy.pools["interactive"].models]
    assert cfg.models[0].path == str(tmp_path / "tiny-llama-large")  # no path in the policy: the models dir
    assert (cfg.server.host, cfg.server.http_port, cfg.server.grpc_port, cfg.server.drain_grace_s) == ("0.0.0.0", 8100, 8200, 45.0)
    assert cfg.admin.host == "127.0.0.1", "the admin API never leaves loopback"
    assert set(cfg.breakers) == set(policy.pools["interactive"].breakers)
    assert cfg.classes["batch"].sheddable and cfg.default_class == policy.default_class


def test_fixed_admin_ports_and_faults_off_for_production():
    cfg = config("--policy", str(LOCAL_POLICY), "--pool", "batch", "--admin-port", "8301", "--admin-grpc-port", "8401", "--no-faults")
    assert (cfg.admin.host, cfg.admin.port, cfg.admin.grpc_port, cfg.admin.allow_faults) == ("127.0.0.1", 8301, 8401, False)
    assert config("--policy", str(LOCAL_POLICY), "--pool", "batch").admin.allow_faults, "on by default (local drills)"


def test_defaults_keep_the_sidecars_own_drain_grace():
    assert config("--policy", str(LOCAL_POLICY), "--pool", "batch").server.drain_grace_s == 20.0


def test_an_unknown_pool_names_the_pools():
    with pytest.raises(ConfigError, match=r"--pool 'gpu' is not one of the pools \['batch', 'interactive'\]"):
        config("--policy", str(LOCAL_POLICY), "--pool", "gpu")


def test_a_bad_policy_names_file_line_and_field(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text(Path(LOCAL_POLICY).read_text().replace("pool: interactive", "pool: nowhere", 1))
    with pytest.raises(ConfigError, match=r"p\.yaml:\d+: classes\.interactive\.pool: 'nowhere' is not one of the pools"):
        config("--policy", str(bad), "--pool", "batch")


def test_policy_without_pool_exits_2_with_the_reason(capsys):
    assert main(["--policy", str(LOCAL_POLICY)]) == 2
    assert "--policy needs --pool" in capsys.readouterr().err


def test_config_and_policy_are_exclusive():
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--config", "x.yaml", "--policy", "p.yaml"])
    assert e.value.code == 2


def test_every_setting_of_the_policy_reaches_the_sidecar(tmp_path):
    text = Path(LOCAL_POLICY).read_text()
    text = text.replace("  batch: {pool: batch, priority: 10, sheddable: true}",
                        "  batch: {pool: batch, priority: 10, sheddable: true, vllm_priority: 5}")
    text = text.replace("      - {name: tiny-llama-small, aliases: [tiny-llama]}",
                        "      - {name: tiny-llama-small, aliases: [tiny-llama], max_num_seqs: 8, dtype: bfloat16, kv_cache_bytes: 1048576}\n"
                        "    serving: {max_concurrent_requests: 12, max_n: 2, default_max_tokens: 64, stream_coalesce_ms: 0}\n"
                        "    monitor: {interval_s: 0.5}\n"
                        "    standby: false")
    p = tmp_path / "p.yaml"
    p.write_text(text)
    cfg = config("--policy", str(p), "--pool", "batch", "--models-dir", str(tmp_path))
    m = cfg.models[0]
    assert (m.max_num_seqs, m.dtype, m.kv_cache_bytes) == (8, "bfloat16", 1048576)
    s = cfg.server
    assert (s.max_concurrent_requests, s.max_n, s.default_max_tokens, s.stream_coalesce_ms) == (12, 2, 64, 0.0)
    assert cfg.monitor.interval_s == 0.5 and cfg.standby is False
    assert cfg.classes["batch"].vllm_priority == 5 and cfg.classes["interactive"].vllm_priority is None


def test_a_setting_the_policy_leaves_out_has_the_sidecars_default(tmp_path):
    """One default each: a pool config from the policy equals a config file that says nothing."""
    from infermesh.sidecar.config import SidecarConfig

    cfg = config("--policy", str(LOCAL_POLICY), "--pool", "batch", "--models-dir", str(tmp_path))
    bare = SidecarConfig.model_validate({"pool": "batch", "models": [{"name": "tiny-llama-small", "path": cfg.models[0].path,
                                                                      "aliases": ["tiny-llama"]}]})
    assert cfg.models == bare.models
    assert cfg.server == bare.server and cfg.monitor == bare.monitor and cfg.standby == bare.standby
    assert cfg.classes["batch"] == bare.classes["batch"]


def test_a_bad_setting_is_refused_by_the_policy_check(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text(Path(LOCAL_POLICY).read_text().replace("- {name: tiny-llama-small}", "- {name: tiny-llama-small, dtype: fp8}"))
    with pytest.raises(ConfigError, match=r"p\.yaml:\d+: pools\.interactive\.models\.1\.dtype: Input should be 'auto'"):
        config("--policy", str(bad), "--pool", "batch")
