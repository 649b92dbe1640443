"""e2e: picking the replica that served a conversation's prefix (docs/prefix-routing.md), on the
real local mesh: two real vLLM replicas of the interactive pool (policy-replicas-e2e.yaml, with
`prefix_key: {}` on the chat class and no TTFT deadline: a hedge is a retry, which Envoy sends to
the other replica on purpose), the real Envoy with the compiled filter and its stateful session
filter, the control plane, and the openai SDK.

- each tenant's conversation (its own system prompt) keeps every later turn on the replica that
  served its first (the sidecar's own `x-infermesh-served-by`);
- a client's `x-infermesh-prefix-host`, naming either replica, changes nothing;
- neither `x-infermesh-prefix-host` nor `x-infermesh-load` reaches a client.
"""

from __future__ import annotations

import base64
import urllib.request
from pathlib import Path

import openai
import pytest

from e2e.conftest import running_mesh

pytestmark = pytest.mark.e2e

SOURCE = Path(__file__).resolve().parent / "policy-replicas-e2e.yaml"
TENANTS = 4
INTERNAL = ("x-infermesh-prefix-host", "x-infermesh-load")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    src = SOURCE.read_text()
    keyed = "  interactive: {pool: interactive, priority: 0, prefix_key: {}}"
    policy = src.replace("  interactive: {pool: interactive, priority: 0, ttft_deadline_ms: 600}", keyed)
    assert keyed in policy, "policy-replicas-e2e.yaml's interactive class changed"
    run = tmp_path_factory.mktemp("prefix")
    path = run / "source.yaml"
    path.write_text(policy)
    yield from running_mesh(path, run)


@pytest.fixture(scope="module")
def client(mesh):
    return openai.OpenAI(base_url=mesh.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)


def replica_addresses(mesh) -> list[str]:
    """The interactive replicas (`IP:PORT`, priority 0 of the cluster: the spill pool's endpoints
    are at priority 1), from Envoy's /clusters."""
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.plan.admin_port}/clusters", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sorted({p[1] for p in (line.split("::") for line in lines) if p[0] == "pool_interactive" and p[2:] == ["priority", "0"]})


def envoy_stat(mesh, name: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.plan.admin_port}/stats?filter={name}$", timeout=5) as r:
        values = [int(line.rsplit(": ", 1)[1]) for line in r.read().decode().splitlines() if line.split(": ")[0].endswith(name)]
    return sum(values)


def turn(client, messages: list[dict], headers: dict | None = None) -> tuple[str, str]:
    """One turn: (the replica that served it, its answer); no internal header reached us."""
    raw = client.chat.completions.with_raw_response.create(model="tiny-llama", messages=messages, max_tokens=8, temperature=0,
                                                           extra_headers=headers or {})
    leaked = [h for h in INTERNAL if h in raw.headers]
    assert not leaked, f"internal headers reached the client: {leaked}"
    return raw.headers["x-infermesh-served-by"], raw.parse().choices[0].message.content or "."


def system_prompt(tenant: int) -> str:
    return (f"You are the support assistant of tenant {tenant}, a company that sells item {tenant * 7} in colour {tenant}. "
            + f"Answer in one short sentence. Policy {tenant}: be kind, be brief, be exact. " * 6)


def test_a_conversations_later_turns_land_on_the_replica_that_served_its_first(mesh, client):
    addresses = replica_addresses(mesh)
    assert len(addresses) == 2, addresses
    named_before = envoy_stat(mesh, "infermesh.prefix_named_total")
    stuck, later, first = 0, 0, {}
    conversations = {}
    for tenant in range(TENANTS):
        messages = [{"role": "system", "content": system_prompt(tenant)}, {"role": "user", "content": f"Hello from customer {tenant}."}]
        served, answer = turn(client, messages)
        first[tenant] = served
        conversations[tenant] = messages + [{"role": "assistant", "content": answer}]
    for n in (2, 3):
        for tenant in range(TENANTS):
            messages = conversations[tenant] + [{"role": "user", "content": f"Question {n}: where is my order?"}]
            served, answer = turn(client, messages)
            later += 1
            stuck += served == first[tenant]
            conversations[tenant] = messages + [{"role": "assistant", "content": answer}]
    print(f"[prefix] first turns on {sorted(first.values())}; later turns on their first turn's replica: {stuck}/{later}")
    assert stuck == later, f"{stuck}/{later} later turns stayed on their first turn's replica ({first})"
    assert envoy_stat(mesh, "infermesh.prefix_named_total") - named_before >= later

    # A client naming a replica itself (either one) is ignored: the filter strips its header.
    tenant = 0
    for addr in addresses:
        spoof = {"x-infermesh-prefix-host": base64.b64encode(addr.encode()).decode()}
        messages = conversations[tenant] + [{"role": "user", "content": "One more thing."}]
        served, _ = turn(client, messages, spoof)
        assert served == first[tenant], f"a client's prefix host ({addr}) moved the conversation"
