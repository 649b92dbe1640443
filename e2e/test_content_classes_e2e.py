"""e2e: routing by what the prompt is about (issue 32), through the real local mesh (Envoy, the
compiled filter, the control plane, the vLLM sidecars) with the openai SDK as the client.

The example policy e2e/policy-content-e2e.yaml (its classes, rules and content model, on the
running mesh's pools) is written over the running mesh's policy: a live edit, no restart. A coding
question then lands in the code class's pool (`batch` here) by the rule `code-questions`; a
question about something else, and a text the model calls `code` below the rule's min_score,
fall through to `chat` (the interactive pool). The rule and the pool are read from Envoy's own
access log (the `x-infermesh-rule` header Envoy sent upstream and the sidecar it reached, found by
the request's traceparent). The running mesh's policy is put back afterwards.

The running sidecars know the mesh's own classes only: the batch sidecar takes `code` for its
default class (batch, sheddable), so on a loaded machine its CPU breaker may answer 429 (the
pool sheds batch work): that answer came from the code pool too, and counts as routed there.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path

import openai
import pytest
import yaml

from infermesh.meshconfig.policy import load_policy

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parent / "policy-content-e2e.yaml"
CODE = "Write a function in JavaScript that sorts an array of numbers."
OTHER = "Who was the 37th President of the United States?"
BELOW = "Write a short poem about the sea."
"""The model calls it `code`, with a probability under the rule's min_score (0.8)."""
APPLY_S = 20.0


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def content_policy(mesh):
    """The running mesh's policy with the example's classes, rules and model (its own pools kept)."""
    path = Path(mesh.plan.policy_path)
    original = path.read_text()
    example = yaml.safe_load(EXAMPLE.read_text())
    doc = yaml.safe_load(original)
    doc["classes"] = {**doc["classes"], **example["classes"]}
    doc["rules"] = example["rules"]
    doc["content_model"] = {"file": str(EXAMPLE.parent / example["content_model"]["file"])}
    write_atomically(path, yaml.safe_dump(doc, sort_keys=False))
    load_policy(path)  # what the control plane reads: a valid policy
    try:
        yield
    finally:
        write_atomically(path, original)


def pool_of(mesh, host: str) -> str:
    """The pool whose sidecar listens on `host` (an access log's upstream_host)."""
    pools = [p for p in ("interactive", "batch") if mesh.sidecar_url(p) == f"http://{host}"]
    assert len(pools) == 1, (host, [mesh.sidecar_url(p) for p in ("interactive", "batch")])
    return pools[0]


def ask(client, mesh, text: str, max_tokens: int = 4) -> tuple[str, dict]:
    """(the pool whose sidecar answered, Envoy's access-log line of the request)."""
    trace = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", messages=[{"role": "system", "content": "You are brief."}, {"role": "user", "content": text}],
            max_tokens=max_tokens, temperature=0, extra_headers={"traceparent": trace})
        served = raw.headers["x-infermesh-served-by"].split("/")[0]
        assert raw.parse().choices[0].message.content is not None
    except openai.RateLimitError as e:  # the batch pool shedding its sheddable default class (above)
        assert "pool batch is shedding" in e.response.text, e.response.text
        served = "batch"
    deadline = time.monotonic() + 10
    while True:  # Envoy flushes its access log about once a second
        lines = [json.loads(x) for x in mesh.access_log.read_text().splitlines() if trace in x] if mesh.access_log.exists() else []
        if lines:
            assert pool_of(mesh, lines[-1]["upstream_host"]) == served, lines[-1]
            return served, lines[-1]
        assert time.monotonic() < deadline, f"no access-log line for traceparent {trace}"
        time.sleep(0.2)


def wait_for_rule(client, mesh, text: str, rule: str) -> float:
    t0 = time.monotonic()
    while ask(client, mesh, text, max_tokens=1)[1]["rule"] != rule:
        assert time.monotonic() - t0 < APPLY_S, f"the policy edit was not applied in {APPLY_S} s"
    return time.monotonic() - t0


def test_a_coding_question_goes_to_the_code_pool_by_the_content_rule(local_mesh):
    model = load_policy(EXAMPLE).content_model
    # What the example's model says of the three texts (the reference; the filter agrees:
    # mesh-config/tests/test_content_contract.py).
    assert model.classify(CODE).label == "code" and model.classify(CODE).score >= 0.8
    assert model.classify(OTHER).label == "chat"
    assert model.classify(BELOW).label == "code" and model.classify(BELOW).score < 0.8
    client = openai.OpenAI(base_url=local_mesh.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)
    with content_policy(local_mesh):
        applied = wait_for_rule(client, local_mesh, CODE, "code-questions")
        served, log = ask(client, local_mesh, CODE)
        assert (served, log["rule"], log["class"]) == ("batch", "code-questions", "code"), log
        served, log = ask(client, local_mesh, OTHER)
        assert (served, log["rule"], log["class"], int(log["status"])) == ("interactive", "chat", "interactive", 200), log
        served, log = ask(client, local_mesh, BELOW)
        assert (served, log["rule"], log["class"], int(log["status"])) == ("interactive", "chat", "interactive", 200), log
    # The mesh's own policy again (the rest of the session runs on it).
    restored = wait_for_rule(client, local_mesh, CODE, "chat")
    print(f"[content] the edit applied in {applied:.1f} s, the original policy again in {restored:.1f} s")
