"""mesh_class: a request's class is the mesh's `x-infermesh-class`, taken only from a trusted peer
(server.trusted_peers), as both fronts call it; from anyone else it is ignored."""

from __future__ import annotations

import ipaddress
from types import SimpleNamespace

import pytest

from infermesh.sidecar.config import ConfigError, SidecarConfig, load_config
from infermesh.sidecar.lifecycle import Front, RequestLifecycle
from infermesh.sidecar.mesh_class import mesh_class, mesh_pool, peer_address, trusted
from infermesh.sidecar.requests import GenerationRequest

BASE = {"pool": "interactive", "models": [{"name": "m", "path": "/m"}],
        "classes": {"interactive": {"priority": 0, "vllm_priority": 0}, "batch": {"priority": 10, "sheddable": True, "vllm_priority": 7}},
        "default_class": "batch"}
CONFIG = SidecarConfig.model_validate(BASE)


def config(**server) -> SidecarConfig:
    return SidecarConfig.model_validate(BASE | {"server": server})


@pytest.mark.parametrize("peer, address", [
    ("ipv4:127.0.0.1:51234", "127.0.0.1"),
    ("ipv6:[::1]:51234", "::1"),
    ("ipv6:%5B::1%5D:51234", "::1"),  # gRPC core percent-encodes the brackets
    ("ipv6:%5B::ffff:127.0.0.1%5D:80", "127.0.0.1"),  # a dual-stack socket's IPv4 peer
    ("ipv6:%5Bfe80::1%25eth0%5D:80", "fe80::1%eth0"),
    (("10.1.2.3", 5000), "10.1.2.3"),
    (SimpleNamespace(host="::1", port=1), "::1"),  # Starlette's request.client
    ("192.168.0.9", "192.168.0.9"),
])
def test_peer_addresses_of_both_fronts(peer, address):
    assert peer_address(peer) == ipaddress.ip_address(address)


@pytest.mark.parametrize("peer", [None, "unix:/tmp/s.sock", "unix-abstract:x", ("testclient", 50000), SimpleNamespace(host=None),
                                  "ipv4:not-an-ip:1", "", "ipv4:", "ipv6:%5B::1", 12, ("",)])
def test_a_peer_without_an_ip_address_has_none(peer):
    assert peer_address(peer) is None
    assert not trusted(CONFIG, peer)


@pytest.mark.parametrize("peer, is_trusted", [
    ("ipv4:127.0.0.1:1", True), ("ipv4:127.0.0.6:1", True),  # Istio's inbound proxy connects from 127.0.0.6
    ("ipv6:%5B::1%5D:1", True), ("ipv6:%5B::ffff:127.0.0.1%5D:1", True),
    ("ipv4:10.0.0.7:1", False), ("ipv6:%5B::2%5D:1", False), ("ipv6:%5B2001:db8::1%5D:1", False),
    ("ipv4:128.0.0.1:1", False),
])
def test_loopback_is_trusted_by_default_and_nothing_else(peer, is_trusted):
    assert trusted(CONFIG, peer) is is_trusted


def test_the_header_counts_only_from_a_trusted_peer():
    headers = {"x-infermesh-class": "interactive", "x-infermesh-pool": "batch"}
    assert mesh_class(CONFIG, headers, "ipv4:127.0.0.1:9") == "interactive"
    assert mesh_pool(CONFIG, headers, "ipv4:127.0.0.1:9") == "batch"
    for untrusted in ("ipv4:10.0.0.7:9", ("testclient", 50000), None):
        assert mesh_class(CONFIG, headers, untrusted) == "", untrusted
        assert mesh_pool(CONFIG, headers, untrusted) is None, untrusted


def test_trusted_networks_come_from_the_config_ipv4_and_ipv6():
    cfg = config(trusted_peers=["10.0.0.0/8", "fd00::/8"])
    headers = [("x-infermesh-class", "interactive")]  # gRPC metadata: (key, value) pairs
    assert mesh_class(cfg, headers, "ipv4:10.3.2.1:5") == "interactive"
    assert mesh_class(cfg, headers, "ipv6:%5Bfd12::3%5D:5") == "interactive"
    assert mesh_class(cfg, headers, "ipv4:127.0.0.1:5") == "", "loopback is trusted only while the config says so"
    assert mesh_class(cfg, headers, "ipv6:%5B::1%5D:5") == ""
    assert mesh_class(config(trusted_peers=[]), headers, "ipv4:127.0.0.1:5") == "", "no trusted peer: nobody sets a class"


def test_a_missing_header_is_no_class():
    assert mesh_class(CONFIG, {}, "ipv4:127.0.0.1:1") == ""
    assert mesh_class(CONFIG, [], "ipv4:127.0.0.1:1") == ""
    assert mesh_class(CONFIG, None, "ipv4:127.0.0.1:1") == ""
    assert mesh_pool(CONFIG, {"x-infermesh-pool": ""}, "ipv4:127.0.0.1:1") is None


def test_a_request_without_the_meshs_class_gets_the_default_class_and_an_unknown_one_too(make_pool):
    """What mesh_class gives is what admission maps: "" (untrusted, missing) and a name that is not
    one of the classes (a trusted peer's mistake) both get the default class."""
    pool = make_pool(CONFIG)
    for headers, peer in [({"x-infermesh-class": "interactive"}, "ipv4:10.9.9.9:1"),  # untrusted: ignored
                          ({}, "ipv4:127.0.0.1:1"),  # missing
                          ({"x-infermesh-class": "vip-made-up"}, "ipv4:127.0.0.1:1")]:  # unknown
        req = GenerationRequest(model=None, prompt="x", request_class=mesh_class(CONFIG, headers, peer))
        life = RequestLifecycle(pool, req, Front.GRPC, "generate")
        assert life.admit().request_class == "batch", (headers, peer)
        pool.admission.forget(life.admission.request_id)
    req = GenerationRequest(model=None, prompt="x", request_class=mesh_class(CONFIG, {"x-infermesh-class": "interactive"}, "ipv4:127.0.0.1:1"))
    assert RequestLifecycle(pool, req, Front.GRPC, "generate").admit().request_class == "interactive"


def test_a_trusted_peers_entry_that_is_no_network_fails_at_start_naming_it(tmp_path):
    p = tmp_path / "sidecar.json"
    import json

    p.write_text(json.dumps(BASE | {"server": {"trusted_peers": ["127.0.0.1/8"]}}))  # host bits set: a typo or a host?
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "server.trusted_peers" in str(e.value) and "127.0.0.1/8" in str(e.value)
    p.write_text(json.dumps(BASE | {"server": {"trusted_peers": ["everyone"]}}))
    with pytest.raises(ConfigError, match="trusted_peers"):
        load_config(p)
    assert config().server.trusted_peers == ["127.0.0.0/8", "::1/128"]
