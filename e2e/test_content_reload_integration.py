"""Integration: a content model changes live (issue 32). The real control plane and the real Envoy
with the compiled filter, in front of echo upstreams (test_control_plane_integration.py's
harness): a policy whose content rule sends coding questions to the batch pool, then an edit of
the policy with another model (inline), then one naming another model file, each applied without
a restart, while the rest of the rules keep working."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import numpy as np

import e2e.test_control_plane_integration as cpi
from e2e.test_control_plane_integration import Harness
from infermesh.meshconfig import content_model as cm

E2E_MODEL = Path(__file__).resolve().parent / "content-model-e2e.json"
CODE = "Write a function in JavaScript that sorts an array of numbers."
OTHER = "Who was the 37th President of the United States?"

# The control-plane harness's policy with a content model and a content rule before `chat`.
POLICY = cpi.POLICY.replace("CHAT_CLASS", "interactive").replace("rules:\n", """content_model: MODEL
rules:
  - name: code-questions
    class: batch
    match: {methods: [POST], path: {prefix: /v1/chat/completions}, content: {label: code, min_score: 0.8}}
""")


def ask(base: str, text: str) -> tuple[str, str]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        got = json.loads(r.read())
    return got["upstream"], got["headers"]["x-infermesh-rule"]


def everything_is(label: str) -> cm.ContentModel:
    """A model that gives every text `label` with a probability near 1 (its bias)."""
    labels = ("chat", "code")
    bias = tuple(8.0 if lab == label else 0.0 for lab in labels)
    return cm.ContentModel(labels, 256, 1, (0, 0), 4096, 0.01, bias, np.zeros((256, 2), np.int8))


def until(base: str, text: str, want: tuple[str, str], timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while ask(base, text) != want:
        assert time.monotonic() - t0 < timeout, f"{want} not served within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_new_content_model_applies_without_a_restart(upstreams, tmp_path):
    (tmp_path / "e2e-model.json").write_text(E2E_MODEL.read_text())
    h = Harness(tmp_path, upstreams, POLICY.replace("MODEL", "{file: e2e-model.json}"))
    try:
        h.wait_serving()
        until(h.base, CODE, ("batch", "code-questions"), 30)
        assert ask(h.base, OTHER) == ("interactive", "chat")
        envoy_pid = h.envoy.pid
        # An edit with another model inline: everything is code now.
        h.policy.write_text(POLICY.replace("MODEL", everything_is("code").to_json()))
        inline = until(h.base, OTHER, ("batch", "code-questions"))
        assert ask(h.base, CODE) == ("batch", "code-questions")
        # An edit naming another model file: nothing is code.
        cm.save_model(everything_is("chat"), tmp_path / "chat-model.json")
        h.policy.write_text(POLICY.replace("MODEL", "{file: chat-model.json}"))
        named = until(h.base, CODE, ("interactive", "chat"))
        assert ask(h.base, OTHER) == ("interactive", "chat")
        assert h.envoy.pid == envoy_pid and h.envoy.poll() is None, "the same Envoy, never restarted"
    finally:
        h.stop()
    print(f"[content reload] new inline model served after {inline * 1000:.0f} ms, new model file after {named * 1000:.0f} ms")
