"""The ADS server against a fake Envoy stream: subscriptions, ACK, NACK, stale nonces, pushes,
named resources and unknown types, as Envoy's state-of-the-world protocol expects them.
(e2e/test_control_plane_integration.py runs the same server against the real Envoy.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import discovery_pb2

from infermesh.meshconfig.ads_server import AdsServer
from infermesh.meshconfig.policy import LOCAL_POLICY, load_policy
from infermesh.meshconfig.watchers import PolicyFileWatcher
from infermesh.meshconfig.xds_server import ControlPlane
from infermesh.meshconfig.xds_snapshot import (CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, MeshTarget,
                                               build_snapshot, resource_name)

POLICY = load_policy(LOCAL_POLICY)
TARGET = MeshTarget("127.0.0.1", 8080, Path("/x.wasm"), {"interactive": ("127.0.0.1", 8101, 8201), "batch": ("127.0.0.1", 8102, 8202)})
V1 = build_snapshot(POLICY, TARGET)
# Other versions: the same policy with the listener on other ports.
V2 = build_snapshot(POLICY, MeshTarget("127.0.0.1", 8081, TARGET.wasm_path, TARGET.endpoints))
V3 = build_snapshot(POLICY, MeshTarget("127.0.0.1", 8082, TARGET.wasm_path, TARGET.endpoints))
assert len({V1.version, V2.version, V3.version}) == 3
SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"


class FakeEnvoyStream:
    """A fake of Envoy's side of one ADS stream: the test sends DiscoveryRequests, the server's
    responses are collected in order."""

    def __init__(self, server: AdsServer):
        self.server = server
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses: asyncio.Queue = asyncio.Queue()

    async def _iter_requests(self):
        while (req := await self._requests.get()) is not None:
            yield req

    async def _collect(self):
        async for r in self.server.stream(self._iter_requests(), "fake-envoy"):
            self._responses.put_nowait(r)

    async def __aenter__(self):
        self._task = asyncio.create_task(self._collect())
        return self

    async def __aexit__(self, *exc):
        self._requests.put_nowait(None)
        await asyncio.wait_for(self._task, 1)

    def send(self, type_url: str, version: str = "", nonce: str = "", names=(), nack: str | None = None) -> None:
        req = discovery_pb2.DiscoveryRequest(type_url=type_url, version_info=version, response_nonce=nonce, resource_names=list(names))
        if nack is not None:
            req.error_detail.code, req.error_detail.message = 13, nack
        self._requests.put_nowait(req)

    async def response(self) -> discovery_pb2.DiscoveryResponse:
        return await asyncio.wait_for(self._responses.get(), 1)

    async def nothing(self) -> None:
        """No response comes (the server handles a request within a few loop turns)."""
        for _ in range(20):
            await asyncio.sleep(0)
        assert self._responses.empty(), self._responses.get_nowait()

    def ack(self, r: discovery_pb2.DiscoveryResponse, names=()) -> None:
        self.send(r.type_url, r.version_info, r.nonce, names)


def names(r: discovery_pb2.DiscoveryResponse) -> list[str]:
    msgs = {t: m for t, ms in V1.resources.items() for m in ms[:1]}
    out = []
    for a in r.resources:
        m = type(msgs[r.type_url])()
        a.Unpack(m)
        out.append(resource_name(m))
    return sorted(out)


def run(server: AdsServer, scenario) -> None:
    async def main():
        async with FakeEnvoyStream(server) as envoy:
            await scenario(envoy)
    asyncio.run(main())


def serving(snap=V1) -> AdsServer:
    s = AdsServer()
    s.set_snapshot(snap)
    return s


def test_initial_wildcard_requests_get_every_resource_of_their_type():
    async def scenario(envoy):
        envoy.send(CLUSTER_TYPE)
        r = await envoy.response()
        assert (r.type_url, r.version_info) == (CLUSTER_TYPE, V1.version) and r.nonce
        assert names(r) == ["pool_batch", "pool_batch_grpc", "pool_interactive", "pool_interactive_grpc", "pool_interactive_state"]
        envoy.send(LISTENER_TYPE)
        r2 = await envoy.response()
        assert names(r2) == ["infermesh"] and r2.nonce != r.nonce
    run(serving(), scenario)


def test_an_ack_is_not_answered():
    async def scenario(envoy):
        envoy.send(CLUSTER_TYPE)
        envoy.ack(await envoy.response())
        await envoy.nothing()
    run(serving(), scenario)


def test_a_new_snapshot_is_pushed_to_every_subscribed_type_in_dependency_order():
    server = serving()

    async def scenario(envoy):
        for t, asked in ((LISTENER_TYPE, ()), (ROUTE_TYPE, ["infermesh"]), (CLUSTER_TYPE, ()), (ENDPOINT_TYPE, ["pool_batch"])):
            envoy.send(t, names=asked)
            envoy.ack(await envoy.response(), asked)
        await envoy.nothing()
        assert server.set_snapshot(V2) and not server.set_snapshot(V2), "the same version is not news"
        pushed = [await envoy.response() for _ in range(4)]
        assert [r.type_url for r in pushed] == [CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE]
        assert {r.version_info for r in pushed} == {V2.version}
        assert names(pushed[1]) == ["pool_batch"], "still only the endpoints asked for"
        await envoy.nothing()
    run(server, scenario)


def test_a_nack_is_logged_and_counted_the_last_acked_version_is_served_again_and_the_refused_one_never(caplog):
    server = serving()

    async def scenario(envoy):
        envoy.send(CLUSTER_TYPE)
        envoy.ack(await envoy.response())
        server.set_snapshot(V2)
        r2 = await envoy.response()
        envoy.send(CLUSTER_TYPE, version=V1.version, nonce=r2.nonce, nack="cluster pool_x: bad thing")
        # Envoy may have taken part of V2 (it applies clusters one by one): V1 is sent again, whole.
        r3 = await envoy.response()
        assert r3.version_info == V1.version and names(r3) == names(r2)
        assert server.nacks == 1 and server.version == V1.version
        assert server.metrics.value("infermesh_xds_nacks_total", type="Cluster") == 1
        assert server.metrics.value("infermesh_xds_rollbacks_total") == 1
        envoy.ack(r3)
        await envoy.nothing()
        assert not server.set_snapshot(V2), "a version Envoy refused is never served again"
        await envoy.nothing()
        assert server.set_snapshot(V3)  # the next new version (a later edit) is sent
        assert (await envoy.response()).version_info == V3.version
    run(server, scenario)
    nack = [rec for rec in caplog.records if "NACK" in rec.getMessage()]
    assert nack and nack[0].__dict__["reason"] == "cluster pool_x: bad thing", "Envoy's error_detail is logged"


def test_after_a_nack_every_type_and_every_stream_goes_back_to_the_last_version_acked_whole():
    server = serving()
    types = ((CLUSTER_TYPE, ()), (ENDPOINT_TYPE, ["pool_batch"]), (LISTENER_TYPE, ()), (ROUTE_TYPE, ["infermesh"]))

    async def main():
        async with FakeEnvoyStream(server) as a, FakeEnvoyStream(server) as b:
            for envoy in (a, b):
                for t, asked in types:
                    envoy.send(t, names=asked)
                    envoy.ack(await envoy.response(), asked)
            assert server.accepted is server.snapshot is V1
            server.set_snapshot(V2)
            pushed = {envoy: [await envoy.response() for _ in types] for envoy in (a, b)}
            # Envoy `a` takes V2's clusters and endpoints, then refuses its listener.
            for r, (_, asked) in zip(pushed[a][:2], types[:2]):
                a.ack(r, asked)
            a.send(LISTENER_TYPE, version=V1.version, nonce=pushed[a][2].nonce, nack="listener infermesh: bad filter")
            for envoy in (a, b):
                again = [await envoy.response() for _ in types]
                assert [r.type_url for r in again] == [t for t, _ in types], "in dependency order"
                assert {r.version_info for r in again} == {V1.version}
                await envoy.nothing()
            assert server.version == V1.version and server.accepted is V1
    asyncio.run(main())


def test_a_request_with_a_stale_nonce_is_ignored():
    server = serving()

    async def scenario(envoy):
        envoy.send(ENDPOINT_TYPE, names=["pool_batch"])
        r1 = await envoy.response()
        server.set_snapshot(V2)
        r2 = await envoy.response()
        # Envoy's ACK of the first response arrives after the second was sent (with other names).
        envoy.send(ENDPOINT_TYPE, version=r1.version_info, nonce=r1.nonce, names=["pool_batch", "pool_interactive"])
        await envoy.nothing()
        # Envoy then answers the latest response, with its current names: those are served.
        envoy.send(ENDPOINT_TYPE, version=r2.version_info, nonce=r2.nonce, names=["pool_batch", "pool_interactive"])
        r3 = await envoy.response()
        assert r3.version_info == V2.version and names(r3) == ["pool_batch", "pool_interactive"]
    run(server, scenario)


def test_named_resources_are_answered_for_those_names_and_again_when_the_names_change():
    async def scenario(envoy):
        envoy.send(ENDPOINT_TYPE, names=["pool_interactive"])
        r1 = await envoy.response()
        assert names(r1) == ["pool_interactive"]
        envoy.ack(r1, ["pool_interactive"])
        await envoy.nothing()
        envoy.ack(r1, ["pool_interactive", "pool_batch_grpc"])  # a new cluster being warmed
        r2 = await envoy.response()
        assert r2.version_info == V1.version and names(r2) == ["pool_batch_grpc", "pool_interactive"]
        envoy.ack(r2, ["pool_interactive", "pool_batch_grpc"])
        await envoy.nothing()
    run(serving(), scenario)


def test_a_reconnecting_envoy_that_holds_the_version_gets_only_its_named_resources_again():
    async def scenario(envoy):
        envoy.send(CLUSTER_TYPE, version=V1.version)
        await envoy.nothing()
        envoy.send(ROUTE_TYPE, version=V1.version, names=["infermesh"])
        assert names(await envoy.response()) == ["infermesh"]
    run(serving(), scenario)


def test_an_unknown_type_is_left_unanswered_and_the_stream_keeps_working(caplog):
    async def scenario(envoy):
        envoy.send(SECRET_TYPE, names=["cert"])
        envoy.send(SECRET_TYPE, names=["cert"])
        await envoy.nothing()
        envoy.send(LISTENER_TYPE)
        assert (await envoy.response()).type_url == LISTENER_TYPE
    run(serving(), scenario)
    assert sum("does not serve" in rec.getMessage() for rec in caplog.records) == 1


def test_requests_before_the_first_snapshot_are_answered_when_it_comes():
    server = AdsServer()

    async def scenario(envoy):
        envoy.send(CLUSTER_TYPE)
        await envoy.nothing()
        server.set_snapshot(V1)
        assert (await envoy.response()).version_info == V1.version
    run(server, scenario)


def test_two_streams_each_get_the_push():
    server = serving()

    async def main():
        async with FakeEnvoyStream(server) as a, FakeEnvoyStream(server) as b:
            for envoy in (a, b):
                envoy.send(CLUSTER_TYPE)
                envoy.ack(await envoy.response())
            server.set_snapshot(V2)
            assert (await a.response()).version_info == (await b.response()).version_info == V2.version
        assert not server._streams, "a closed stream is forgotten"
    asyncio.run(main())


def test_a_policy_edit_envoy_refuses_leaves_the_last_acked_served_and_a_later_edit_is_published(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(LOCAL_POLICY.read_text())
    cp = ControlPlane(TARGET)
    watch = PolicyFileWatcher(path, cp.set_policy, cp.metrics, settle=0)
    assert watch.load() and cp.version == V1.version

    async def scenario(envoy):
        envoy.send(LISTENER_TYPE)
        envoy.ack(await envoy.response())
        path.write_text(LOCAL_POLICY.read_text().replace("default_class: batch", "default_class: interactive"))
        assert watch.poll()
        refused = await envoy.response()
        assert refused.version_info == cp.version != V1.version
        envoy.send(LISTENER_TYPE, version=V1.version, nonce=refused.nonce, nack="listener infermesh: refused")
        envoy.ack(back := await envoy.response())
        assert back.version_info == V1.version == cp.version
        path.write_text(LOCAL_POLICY.read_text().replace("default_class: batch", "default_class: interactive") + "# edited\n")
        assert watch.poll() and cp.version == V1.version, "the same config again is the version Envoy refused: not served"
        await envoy.nothing()
        path.write_text(LOCAL_POLICY.read_text().replace("class: interactive\n    match: {methods: [POST], path: {prefix: /v1/chat",
                                                         "class: batch\n    match: {methods: [POST], path: {prefix: /v1/chat"))
        assert watch.poll()
        r = await envoy.response()
        assert r.version_info == cp.version not in (V1.version, refused.version_info)
    run(cp.ads, scenario)
    assert cp.metrics.value("infermesh_policy_reloads_total") == 4
    assert cp.metrics.value("infermesh_xds_nacks_total", type="Listener") == 1


def test_a_policy_edit_reaches_the_stream_as_a_new_version(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(LOCAL_POLICY.read_text())
    cp = ControlPlane(TARGET)
    watch = PolicyFileWatcher(path, cp.set_policy, settle=0)
    assert watch.load() and cp.version == V1.version

    def default_class_of(r) -> str:
        """The pool of the table's last route to a pool (no rule matched: the default class's; a
        direct response may follow it, for paths the edge does not serve)."""
        rc = route_pb2.RouteConfiguration()
        r.resources[0].Unpack(rc)
        to_pools = [x for x in rc.virtual_hosts[0].routes if x.WhichOneof("action") == "route"]
        return to_pools[-1].route.cluster.removeprefix("pool_")

    async def scenario(envoy):
        envoy.send(ROUTE_TYPE, names=["infermesh"])
        r1 = await envoy.response()
        envoy.ack(r1, ["infermesh"])
        assert default_class_of(r1) == "batch"
        path.write_text(LOCAL_POLICY.read_text().replace("default_class: batch", "default_class: interactive"))
        assert watch.poll()
        r2 = await envoy.response()
        assert r2.version_info == cp.version != V1.version and default_class_of(r2) == "interactive"
    run(cp.ads, scenario)
