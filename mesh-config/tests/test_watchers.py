"""The control plane's watchers and how it turns their reports into snapshots: the policy file
with its last good config, a pool's admin event stream (fed here from a fake list of SSE lines),
and what the control plane does with them (levels are logged, routes do not follow them: the
filter applies `when_degraded`)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2

from infermesh.meshconfig.policy import LEVEL_DOWN, LOCAL_POLICY
from infermesh.meshconfig.watchers import PolicyFileWatcher, PoolWatcher, pool_level
from infermesh.meshconfig.xds_server import ControlPlane
from infermesh.meshconfig.xds_snapshot import FILTER_EXTENSION, FILTER_TYPE, LISTENER_TYPE, ROUTE_TYPE, MeshTarget

TARGET = MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {"interactive": ("127.0.0.1", 8101, 8201), "batch": ("127.0.0.1", 8102, 8202)})
GOOD = LOCAL_POLICY.read_text()


def test_the_policy_file_watch_hands_on_valid_edits_and_keeps_the_last_good_policy(tmp_path, caplog):
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    seen = []
    w = PolicyFileWatcher(path, seen.append, settle=0)  # settling: test_watchers_hardened.py
    assert w.load() and len(seen) == 1
    assert not w.poll(), "nothing changed"
    path.write_text(GOOD.replace("default_class: batch", "default_class: no-such-class"))
    assert not w.poll() and w.rejections == 1 and len(seen) == 1
    assert w.policy is seen[0], "the last good policy stays"
    assert any("policy rejected; keeping the last good config" in r.getMessage() and "default_class" in r.__dict__.get("problems", "")
               for r in caplog.records)
    path.write_text(GOOD.replace("class: interactive\n    match: {methods: [POST], path: {prefix: /v1/chat/completions}}",
                                 "class: batch\n    match: {methods: [POST], path: {prefix: /v1/chat/completions}}"))
    assert w.poll() and len(seen) == 2 and w.policy is seen[1]
    assert [r.class_ for r in w.policy.rules if r.name == "chat"] == ["batch"]
    path.unlink()
    assert not w.poll(), "a file that is gone (being replaced) is not an edit"


def test_pool_level_from_admin_events():
    assert pool_level({"ready": False}) == LEVEL_DOWN
    assert pool_level({"draining": True, "level": 0}) == LEVEL_DOWN
    assert pool_level({"level": 2}) == 2
    assert pool_level({"pool_actions": ["shed", "degrade"]}) == 2
    assert pool_level({"pool_actions": []}) == 0


def _lines(*events: str):
    async def gen():
        yield ": keep-alive"
        for e in events:
            yield f"data: {e}"
    return gen()


def test_a_pool_seen_and_lost_is_down_until_it_serves_again():
    reported = []
    w = PoolWatcher("interactive", "http://fake", "http://fake/health", lambda pool, level: reported.append(level))

    async def never_asked() -> bool:
        raise AssertionError("a pool that was not down needs no serving check")

    async def not_serving() -> bool:
        return False

    async def serving() -> bool:
        return True

    async def main():
        w.lost()
        assert reported == [], "never seen: the plain routes stay"
        await w.follow(_lines('{"level": 0}', '{"pool_actions": ["shed"]}', '{"level": 1}'), never_asked)
        assert reported == [0, 1], "repeated levels are reported once"
        w.lost()
        assert reported == [0, 1, LEVEL_DOWN]
        await w.follow(_lines('{"level": 0}', '{"level": 3}'), not_serving)
        assert reported[-1] == LEVEL_DOWN, "its admin API is back but it does not serve yet"
        await w.follow(_lines('{"level": 0}'), serving)
        assert reported[-1] == 0
    asyncio.run(main())


def _pool_route(cp: ControlPlane) -> str:
    vh = cp.ads.snapshot.resources[ROUTE_TYPE][0].virtual_hosts[0]
    return next(r.route.cluster for r in vh.routes if r.name == "class-pool-interactive")


def test_a_level_change_rebuilds_nothing_and_a_bad_policy_keeps_the_last_good_snapshot(tmp_path):
    cp = ControlPlane(TARGET)
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    assert PolicyFileWatcher(path, cp.set_policy).load()
    v1 = cp.version
    assert v1 and _pool_route(cp) == "pool_interactive"
    for level in (2, LEVEL_DOWN, 0):
        cp.set_level("interactive", level)
        assert cp.version == v1 and _pool_route(cp) == "pool_interactive", "the filter spills, not the routes"
    assert cp.levels == {"interactive": 0}
    # A policy naming a pool the control plane has no endpoint for: refused, the last good served.
    path.write_text(GOOD.replace("  batch:\n    models:", "  batch2:\n    models:").replace("pool: batch", "pool: batch2")
                    .replace("spill_to: batch", "spill_to: batch2"))
    assert PolicyFileWatcher(path, cp.set_policy).load()
    assert cp.rejections == 1 and cp.version == v1


def test_a_switch_to_the_native_runtime_is_served_only_once_the_module_exists(tmp_path):
    module = tmp_path / "libinfermesh_filter.so"
    cp = ControlPlane(dataclasses.replace(TARGET, native_module_path=module))
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    assert PolicyFileWatcher(path, cp.set_policy).load()
    v1 = cp.version
    path.write_text(GOOD + "filter:\n  runtime: native\n")
    assert PolicyFileWatcher(path, cp.set_policy).load()
    assert cp.rejections == 1 and cp.version == v1, "no module built: the Wasm listener stays"
    module.write_bytes(b"\x7fELF")
    assert cp.publish() and cp.version != v1
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    cp.ads.snapshot.resources[LISTENER_TYPE][0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    # The listener names the filter either way; its config (ECDS) names the runtime.
    assert [f.name for f in hcm.http_filters] == [FILTER_EXTENSION, "envoy.filters.http.router"]
    assert cp.ads.snapshot.resources[FILTER_TYPE][0].typed_config.type_url.endswith(".DynamicModuleFilter")
