"""LocalMesh.held_breakers / wait_at_rest over fake /admin/state answers (no sidecar runs):
rest is every replica at level 0 with every breaker closed, and giving up names what held."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from infermesh.launcher import LocalMesh
from infermesh.meshconfig.local_mesh import PoolPorts


def breaker(name: str, state: str = "closed", signal: str = "cpu_load", value: float | None = 0.1) -> dict:
    return {"name": name, "signal": signal, "state": state, "value": value}


class FakeStateMesh(LocalMesh):
    """A LocalMesh whose admin_state answers from `states[(pool, replica)]`, a list consumed one
    answer per call (the last one repeats)."""

    def __init__(self, states: dict[tuple[str, int], list[dict]]):  # no super().__init__: nothing is started
        self.plan = SimpleNamespace(pools=[PoolPorts(pool, 1, 2, 3, 4, replica=r) for pool, r in states])
        self.states = states

    def admin_state(self, pool: str, replica: int = 0) -> dict:
        answers = self.states[(pool, replica)]
        return answers.pop(0) if len(answers) > 1 else answers[0]


def test_at_rest_is_level_0_and_every_breaker_closed_on_every_replica():
    rest = {"level": 0, "breakers": [breaker("cpu"), breaker("ttft", signal="ttft_p95", value=None)]}
    mesh = FakeStateMesh({("interactive", 0): [rest], ("interactive", 1): [rest], ("batch", 0): [rest]})
    assert mesh.held_breakers() == []
    mesh.wait_at_rest(0.1)


def test_held_names_the_pool_replica_breaker_and_reading_and_a_bare_level():
    shed = {"level": 1, "breakers": [breaker("cpu", "open", value=0.99), breaker("kv")]}
    half = {"level": 0, "breakers": [breaker("ttft", "half_open", "ttft_p95", 0.7)]}
    bare = {"level": 2, "breakers": []}  # a level without an open breaker is not rest either
    mesh = FakeStateMesh({("interactive", 0): [half], ("interactive", 1): [bare], ("batch", 0): [shed]})
    assert mesh.held_breakers() == ["interactive/0 ttft: half_open (ttft_p95 0.7)", "interactive/1: level 2",
                                    "batch/0 cpu: open (cpu_load 0.99)"]
    assert mesh.held_breakers(["batch"]) == ["batch/0 cpu: open (cpu_load 0.99)"]


def test_wait_at_rest_returns_once_the_breakers_close_and_names_what_held_when_it_gives_up():
    shed = {"level": 1, "breakers": [breaker("cpu", "open", value=0.99)]}
    rest = {"level": 0, "breakers": [breaker("cpu")]}
    mesh = FakeStateMesh({("batch", 0): [shed, shed, rest], ("interactive", 0): [rest]})
    mesh.wait_at_rest(5)
    assert mesh.states[("batch", 0)] == [rest]

    stuck = FakeStateMesh({("batch", 0): [shed], ("interactive", 0): [rest]})
    with pytest.raises(TimeoutError, match=r"not at rest after 0.3s before the test: batch/0 cpu: open \(cpu_load 0.99\)$"):
        stuck.wait_at_rest(0.3, why="before the test")
    stuck.wait_at_rest(0.3, ["interactive"])
