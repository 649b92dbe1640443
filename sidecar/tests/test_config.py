"""Sidecar config loading: good files load, bad ones name the file and the field."""

import json

import pytest

from infermesh.sidecar.config import ConfigError, load_config

GOOD = {
    "pool": "interactive",
    "models": [{"name": "m-large", "path": "/models/large", "aliases": ["m"]}],
    "server": {"http_port": 1234},
}


def write(tmp_path, data, name="sidecar.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data) if isinstance(data, dict) else data)
    return p


def test_good_config_loads_with_defaults(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.served_by == "interactive/0"
    assert cfg.server.http_port == 1234
    assert cfg.server.host == "127.0.0.1"
    assert cfg.models[0].kv_cache_bytes > 0


def test_yaml_is_accepted(tmp_path):
    p = write(tmp_path, "pool: batch\nmodels:\n  - {name: s, path: /m}\n", "sidecar.yaml")
    assert load_config(p).pool == "batch"


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["server"].update(http_port=70000), "server.http_port"),
        (lambda d: d["server"].update(htp_port=1), "server.htp_port"),
        (lambda d: d.update(pool="has space"), "pool"),
        (lambda d: d.update(models=[]), "models"),
        (lambda d: d["models"][0].pop("path"), "models.0.path"),
        (lambda d: d["models"].append({"name": "m", "path": "/x"}), "models"),
    ],
)
def test_bad_config_names_the_field(tmp_path, mutate, field):
    data = json.loads(json.dumps(GOOD))
    mutate(data)
    p = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value)
    assert f"  {field}:" in str(e.value)


def test_unparsable_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(write(tmp_path, "{nope"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.json")


def test_the_policy_and_the_sidecar_share_one_definition_of_each_setting():
    from infermesh.meshconfig.policy import ClassSpec, ModelSpec, PoolSpec
    from infermesh.settings import ClassSettings, ModelSettings, PoolSettings, ServingSettings
    from infermesh.sidecar.config import ClassPolicy, ModelConfig, ServerConfig, SidecarConfig

    assert issubclass(ModelConfig, ModelSettings) and issubclass(ModelSpec, ModelSettings)
    assert ClassPolicy is ClassSettings and issubclass(ClassSpec, ClassSettings)
    assert issubclass(ServerConfig, ServingSettings) and PoolSpec.model_fields["serving"].annotation is ServingSettings
    assert issubclass(SidecarConfig, PoolSettings) and issubclass(PoolSpec, PoolSettings)
    assert ModelConfig(name="m", path="/m").kv_cache_bytes == ModelSpec(name="m").kv_cache_bytes == 128 << 20
