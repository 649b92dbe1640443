"""The Python reference classifier (content_model.py) and the filter's own (content_classifier.rs,
natively through filter/examples/content_eval.rs) give the same label on every example, the same
feature count, and scores within 1e-9: on a model trained from chatterbot-corpus and on every
statement of it, on random models of other shapes (words only, character n-grams 2..6, 16 labels,
a 64-byte cut), and on request bodies of every kind the filter reads (section 1 of the spec).

The binary is built here (cargo, incremental) when it is not; without cargo the test fails: the
contract is not checked by skipping it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from infermesh.content_bench import corpus
from infermesh.content_training import FeatureSpec, native_classify, train
from infermesh.meshconfig import content_model as cm


@pytest.fixture(scope="module")
def statements() -> list[tuple[str, str]]:
    return corpus()


@pytest.fixture(scope="module")
def trained(statements) -> cm.ContentModel:
    # A small dim and C: a few seconds of training; the contract is about the arithmetic.
    return train(statements, FeatureSpec(4096, 2, (3, 4), 4096), holdout=0.2, seed=0, c=100.0).model


def random_model(rng, labels: int, dim: int, word: int, chars: tuple[int, int], max_text: int) -> cm.ContentModel:
    return cm.ContentModel(tuple(f"l{i}" for i in range(labels)), dim, word, chars, max_text, float(rng.uniform(0.001, 0.2)),
                           tuple(float(x) for x in rng.normal(0, 1, labels)), rng.integers(-127, 128, (dim, labels), dtype=np.int8))


def random_models() -> list[tuple[str, cm.ContentModel]]:
    rng = np.random.default_rng(32)
    return [("words-only", random_model(rng, 3, 256, 1, (0, 0), 4096)),
            ("chars-2-6", random_model(rng, 5, 1024, 2, (2, 6), 65536)),
            ("16-labels-cut-64", random_model(rng, 16, 512, 2, (3, 4), 64)),
            ("2-labels-big-dim", random_model(rng, 2, 262144, 2, (4, 4), 1000))]


def agree(model: cm.ContentModel, items: list[dict], ours: list[cm.Verdict], tmp_path) -> None:
    path = tmp_path / "model.json"
    cm.save_model(model, path)
    theirs = native_classify(path, items)
    assert len(theirs) == len(ours)
    for item, a, b in zip(items, ours, theirs):
        assert "error" not in b, (item, b)
        assert (a.label, a.features) == (b["label"], b["features"]), (item, a, b)
        if a.label is not None:
            assert abs(a.score - b["score"]) <= 1e-9, (item, a, b)


def test_trained_model_every_statement(trained, statements, tmp_path):
    texts = [t for t, _ in statements]
    agree(trained, [{"text": t} for t in texts], [trained.classify(t) for t in texts], tmp_path)
    # The same statements as chat requests (the text the rules see).
    bodies = [{"model": "m", "messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": t}]} for t in texts]
    agree(trained, [{"body": b} for b in bodies], [trained.classify_body(json.dumps(b)) for b in bodies], tmp_path)


@pytest.mark.parametrize("name, model", random_models(), ids=[n for n, _ in random_models()])
def test_random_models(name, model, statements, tmp_path):
    rng = np.random.default_rng(7)
    texts = [t for t, _ in statements[:400]]
    # Long texts (cut at max_text_bytes), text with non-ASCII bytes, punctuation only.
    texts += [" ".join(rng.choice(texts, 300)), "naïve café — 東京 😀 " * 50, "!!! ,,, ...", "", "x"]
    agree(model, [{"text": t} for t in texts], [model.classify(t) for t in texts], tmp_path)


def test_the_largest_sums(tmp_path):
    """Every weight at its end (127, -128) and the most features the bounds allow (65536 bytes of
    one token, character n-grams 2..6): the sums are exact on both sides, not wrapped."""
    w = np.empty((256, 3), np.int8)
    w[:, 0], w[:, 1], w[:, 2] = 127, -128, 0
    m = cm.ContentModel(("high", "low", "zero"), 256, 2, (2, 6), 65536, 1e-3, (0.0, 0.0, 0.5), w)
    texts = ["a" * 70000, "ab " * 30000, "x1 " * 22000, "é" * 40000]
    ours = [m.classify(t) for t in texts]
    assert ours[0].features > 300_000  # S = 127 x n: far past 16 bits
    agree(m, [{"text": t} for t in texts], ours, tmp_path)
    w[:, 0] = -128
    low = cm.ContentModel(m.labels, 256, 2, (2, 6), 65536, 1e-3, (0.0, 0.0, 0.5), w)
    agree(low, [{"text": t} for t in texts], [low.classify(t) for t in texts], tmp_path)


BODIES = [
    {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "How do I reverse a list in Python?"},
                  {"role": "assistant", "content": "Use reversed()."}, {"role": "user", "content": "And a string?"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Explain this code"}, {"type": "image_url", "image_url": {"url": "x"}},
                                               {"type": "text", "text": "def f(x): return x * 2"}]}]},
    {"model": "claude", "max_tokens": 64, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is a monad?"}]}]},
    {"prompt": "def quicksort(arr):"},
    {"prompt": ["first prompt", [1, 2, 3], "second prompt"]},
    {"input": "Who won the world cup in 1998?"},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "tell me a joke"}, {"type": "input_image", "image_url": "u"}]},
               {"role": "assistant", "content": "no"}, {"role": "user", "content": "about robots"}]},
    {"input": [{"role": "user", "content": [{"type": "text", "text": "plain text part"}]}]},
    {"messages": [{"role": "user", "content": "escapes: tab\t quote\" backslash\\ newline\n é 東 😀 \u0000 \u001f"}]},
    {"messages": [{"role": "user", "content": "é" * 3000}]},  # the cut inside a two-byte character, wherever it falls
    {"messages": [{"role": "user", "content": "a" * 5000 + " python"}]},
    {"messages": [{"role": "user", "content": ""}, {"role": "user", "content": "second turn"}]},
    {"messages": [{"role": "assistant", "content": "only the assistant"}]},
    {"messages": [{"role": "user", "content": None}, {"role": "user"}, {"content": "no role"}, "not an object", {"role": "user", "content": 7}]},
    {"messages": "not a list", "prompt": 42, "input": {"role": "user"}},
    {"messages": [{"role": "user", "content": "chat"}], "prompt": "and prompt", "input": "and input"},
    {"model": "m"},
    {},
]


def test_request_bodies(trained, tmp_path):
    for max_text in (64, 4096):
        m = cm.ContentModel(trained.labels, trained.dim, trained.word_ngrams, trained.char_ngrams, max_text, trained.scale,
                            trained.bias, trained.weights)
        agree(m, [{"body": b} for b in BODIES], [m.classify_body(json.dumps(b)) for b in BODIES], tmp_path)
    assert trained.classify_body(json.dumps(BODIES[-1])).label is None
