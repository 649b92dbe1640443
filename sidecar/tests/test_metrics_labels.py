"""Class and pool labels of the sidecar's metrics are the policy's names or `other`: a caller's
made-up name never becomes a series (each distinct label value is one)."""

from __future__ import annotations

from prometheus_client import generate_latest

from infermesh.sidecar.config import SidecarConfig
from infermesh.sidecar.errors import BadRequest, Overloaded
from infermesh.sidecar.lifecycle import Front, RequestLifecycle, refuse
from infermesh.sidecar.metrics import OTHER, UNCONFIGURED_CAP, LabelBound, SidecarMetrics
from infermesh.sidecar.requests import GenerationRequest

CONFIG = SidecarConfig.model_validate(
    {"pool": "interactive", "models": [{"name": "m", "path": "/m"}], "mesh_pools": ["interactive", "batch", "gpu-large"],
     "classes": {"interactive": {"priority": 0}, "batch": {"priority": 10, "sheddable": True}}})


def label_values(m: SidecarMetrics, label: str) -> set[str]:
    return {s.labels[label] for fam in m.registry.collect() for s in fam.samples if label in s.labels}


def test_the_bound_keeps_the_names_and_counts_the_rest_as_other():
    bound = LabelBound(["interactive", "batch"])
    assert [bound(v) for v in ("interactive", "batch", "", None, "vip", "x" * 10_000, "batch ", "Batch")] == \
        ["interactive", "batch", "", "", OTHER, OTHER, OTHER, OTHER]


def test_without_the_policys_names_a_label_still_takes_at_most_a_few_values():
    bound = LabelBound()
    firsts = [bound(f"c{i}") for i in range(UNCONFIGURED_CAP)]
    assert firsts == [f"c{i}" for i in range(UNCONFIGURED_CAP)]
    assert bound("one-more") == OTHER and bound("c0") == "c0" and bound("y" * 65) == OTHER


def test_every_class_and_pool_label_of_a_config_built_registry_is_a_policy_name_or_other():
    m = SidecarMetrics.of(CONFIG)
    for i in range(500):  # what callers could send if a label took any value
        made_up = f"made-up-{i}"
        m.requests.labels("grpc", "generate", made_up, "OK").inc()
        m.ttft.labels("grpc", made_up).observe(0.1)
        m.itl.labels(front="http", request_class=made_up).observe(0.01)
        m.count_rejection("http", "chat", made_up, "429", Overloaded("busy", code="pool_shedding"))
        m.spilled_in.labels(bound_for=made_up).inc()
    m.requests.labels("http", "chat", "interactive", "200").inc()
    m.spilled_in.labels(bound_for="gpu-large").inc()
    assert label_values(m, "request_class") == {"interactive", OTHER}
    assert label_values(m, "bound_for") == {"gpu-large", OTHER}
    assert m.registry.get_sample_value("infermesh_sidecar_requests_total",
                                       {"front": "grpc", "api": "generate", "request_class": OTHER, "status": "OK"}) == 500
    assert m.registry.get_sample_value("infermesh_sidecar_spilled_in_requests_total", {"bound_for": OTHER}) == 500
    assert "made-up" not in generate_latest(m.registry).decode()


def test_a_pools_own_metrics_bound_what_the_lifecycle_and_the_pool_label(make_pool):
    """Through the real call sites (lifecycle, refusals, Pool.note_bound_for), on the registry a
    config-built SidecarMetrics gives."""
    import asyncio

    pool = make_pool(CONFIG)
    pool.metrics = SidecarMetrics.of(CONFIG)

    async def serve(cls: str) -> None:
        async with RequestLifecycle(pool, GenerationRequest(model=None, prompt="ab", request_class=cls), Front.GRPC, "generate") as life:
            async for _ in life.events():
                pass

    asyncio.run(serve("made-up"))
    asyncio.run(serve("interactive"))
    refuse(pool, Front.HTTP, "chat", "another-made-up", BadRequest("bad", param="x"))
    pool.note_bound_for("made-up-pool")
    pool.note_bound_for("batch")
    assert label_values(pool.metrics, "request_class") == {"interactive", OTHER}
    assert label_values(pool.metrics, "bound_for") == {"batch", OTHER}
    assert pool.metrics.registry.get_sample_value("infermesh_sidecar_time_to_first_token_seconds_count",
                                                  {"front": "grpc", "request_class": OTHER}) == 1


def test_a_config_without_the_meshs_pools_counts_every_other_pool_as_other():
    cfg = SidecarConfig.model_validate({"pool": "p", "models": [{"name": "m", "path": "/m"}]})
    assert cfg.mesh_pools == []
    m = SidecarMetrics.of(cfg)
    m.spilled_in.labels(bound_for="q").inc()
    assert label_values(m, "bound_for") == {OTHER}
