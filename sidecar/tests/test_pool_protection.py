"""Admission under breaker actions, with fake engines (conftest.py) and a fake clock: which
classes are shed, which model serves, what the response says, and the admin API. No vLLM here
(see e2e)."""

import pytest
from fastapi.testclient import TestClient

from infermesh.sidecar.admin_api import build_admin_app
from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.errors import Overloaded, Unavailable
from infermesh.sidecar.events import BreakerChanged
from infermesh.sidecar.requests import GenerationRequest


CFG = SidecarConfig.model_validate(
    {
        "pool": "interactive",
        "models": [{"name": "big", "path": "/x", "aliases": ["m"]}, {"name": "small", "path": "/y"}],
        "breakers": {
            "kv": {"signal": "kv_cache", "trip_above": 0.9, "recover_below": 0.5, "sustain_s": 1, "recover_sustain_s": 2,
                   "min_samples": 2, "actions": ["shed", "degrade", "critical_only"], "escalate_after_s": 2, "half_open_trials": 1},
        },
    }
)


@pytest.fixture
def pool(make_pool, fake_clock):
    p = make_pool(CFG, fake_clock)  # both models loaded: the small one is the hot standby
    p.clock_ = fake_clock
    return p


def tick(pool, seconds, every=0.25):
    for _ in range(int(round(seconds / every))):
        pool.clock_.t += every
        pool.sample()


def ask(pool, cls, model="m"):
    return pool.admission.admit(GenerationRequest(model=model, prompt="x", request_class=cls))


def test_normal_service_is_the_primary_model(pool):
    adm = ask(pool, "interactive")
    assert adm.engine.config.name == "big" and not adm.degraded


def test_escalation_sheds_then_degrades_then_keeps_only_the_top_class(pool):
    pool.faults.set("kv_cache", 0.97, 1000)
    tick(pool, 1.25)
    assert pool.policy.actions == {"shed"}
    with pytest.raises(Overloaded) as e:
        ask(pool, "batch")
    assert e.value.http_status == 429 and e.value.retry_after_s and e.value.code == "pool_shedding"
    assert ask(pool, "interactive").engine.config.name == "big"

    tick(pool, 2)
    assert pool.policy.actions == {"shed", "degrade"}
    adm = ask(pool, "interactive")
    assert (adm.engine.config.name, adm.degraded, adm.degraded_reason) == ("small", True, "kv:kv_cache")
    assert ask(pool, "interactive", model="small").degraded is False, "asking for the small model is not a degradation"

    tick(pool, 2)
    with pytest.raises(Unavailable) as e:
        ask(pool, "batch")
    assert e.value.code == "pool_critical_only"
    assert ask(pool, "interactive").engine.config.name == "small"


def test_unknown_or_missing_class_is_the_default_class(pool):
    pool.faults.set("kv_cache", 0.97, 1000)
    tick(pool, 1.25)
    for cls in ("", "no-such-class"):
        with pytest.raises(Overloaded):
            ask(pool, cls)


def test_recovery_undoes_one_step_at_a_time_then_half_open_trial_closes(pool):
    pool.faults.set("kv_cache", 0.97, 1000)
    tick(pool, 5.25)
    assert pool.policy.level == 3
    pool.faults.set("kv_cache", 0.1, 1000)
    tick(pool, 2.25)
    assert pool.policy.actions == {"shed", "degrade"}
    tick(pool, 2)
    assert pool.policy.actions == {"shed"}
    tick(pool, 2)
    assert pool.policy.actions == set() and pool.breakers[0].state.value == "half_open"
    adm = ask(pool, "batch")  # one trial
    assert adm.engine.config.name == "big"
    assert pool.breakers[0].state.value == "closed"
    kinds = [(ev.to_state, tuple(ev.pool_actions)) for ev in pool.events.recent if isinstance(ev, BreakerChanged)]
    assert kinds == [
        ("open", ("shed",)), ("open", ("degrade", "shed")), ("open", ("critical_only", "degrade", "shed")),
        ("open", ("degrade", "shed")), ("open", ("shed",)), ("half_open", ()), ("closed", ()),
    ]


def test_admin_api_state_and_faults(pool):
    c = TestClient(build_admin_app(pool))
    assert c.get("/admin/state").json()["serving_model"] == "big"
    assert c.put("/admin/faults/kv_cache", json={"value": 0.99, "duration_s": 30}).status_code == 200
    assert c.put("/admin/faults/temperature", json={"value": 1}).status_code == 404
    assert c.put("/admin/faults/kv_cache", content=b"{oops").status_code == 400
    assert c.put("/admin/faults/kv_cache", json={"value": 1, "duration_s": 0}).status_code == 400
    tick(pool, 1.25)
    st = c.get("/admin/state").json()
    assert st["actions"] == ["shed"] and st["faults"]["kv_cache"]["value"] == 0.99
    assert st["breakers"][0]["state"] == "open"
    assert c.delete("/admin/faults").status_code == 200
    assert c.get("/admin/state").json()["faults"] == {}


def test_faults_can_be_disabled(make_pool):
    cfg = CFG.model_copy(update={"admin": CFG.admin.model_copy(update={"allow_faults": False})})
    c = TestClient(build_admin_app(make_pool(cfg)))
    assert c.put("/admin/faults/kv_cache", json={"value": 0.99}).status_code == 403


def test_admin_state_as_protobuf(pool):
    from infermesh.sidecar.grpc_api import pool_state_pb

    st = pool_state_pb(pool.state())
    assert st.serving_model == "big" and st.breakers[0].state == "closed"
    assert not st.breakers[0].HasField("value"), "no reading yet is unset, not 0"
    pool.faults.set("kv_cache", 0.97, 1000)
    tick(pool, 1.25)
    st = pool_state_pb(pool.state())
    assert st.level == 1 and list(st.actions) == ["shed"] and st.breakers[0].value == pytest.approx(0.97)
