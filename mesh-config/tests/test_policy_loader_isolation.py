"""The policy reads the same in every process: a library that patches PyYAML's SafeLoader in the
same process (lm-format-enforcer, which vLLM's structured outputs load, makes every timestamp a
string) does not change what load_policy accepts or refuses."""

import pytest
import yaml

from infermesh.meshconfig.policy import LOCAL_POLICY, PolicyError, load_policy

TIMESTAMP = "tag:yaml.org,2002:timestamp"


def test_a_patched_safe_loader_does_not_change_the_policy_loader(tmp_path, monkeypatch):
    path = tmp_path / "policy.yaml"
    path.write_text(LOCAL_POLICY.read_text().replace("version: 1", "version: 2020-13-45"))
    monkeypatch.setitem(yaml.SafeLoader.yaml_constructors, TIMESTAMP, yaml.SafeLoader.yaml_constructors["tag:yaml.org,2002:str"])
    assert yaml.safe_load("v: 2020-13-45") == {"v": "2020-13-45"}, "the patch as lm-format-enforcer applies it"
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    assert e.value.reason == "yaml" and "month must be" in str(e.value)
