"""`infermesh classes train` (infermesh/content_classes.py, content_training.py): examples, the held-out scores of the
full-precision and int8 models, the confusion matrix, and where the model is written (a file, a
policy's model file, inline in a policy, which is checked before it is replaced)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from infermesh.content_classes import main
from infermesh.content_training import (NO_LABEL, ExamplesError, FeatureSpec, bucket_counts, confusion, quantized_labels, read_examples,
                                        train, write_into_policy)
from infermesh.meshconfig import content_model as cm
from infermesh.meshconfig.policy import PolicyError, load_policy

CODE = ["how do I reverse a list in python", "what does this segfault in my C code mean", "write a function that parses JSON",
        "why does my rust borrow checker complain", "fix this javascript promise bug", "how to sort a dict by value in python",
        "regex to match an email address", "git rebase versus merge", "my unit test fails with a null pointer exception",
        "compile error: undefined reference to main", "how do I read a file line by line in go", "sql query to join two tables"]
CHAT = ["what is the capital of france", "tell me a joke about cats", "how are you today", "recommend a good novel to read",
        "what should I cook for dinner tonight", "who won the football match yesterday", "write a poem about the sea",
        "what is the weather like in spring", "give me tips for a job interview", "how tall is mount everest",
        "suggest a name for my dog", "what is the meaning of life"]


def examples() -> list[tuple[str, str]]:
    return [(t, "code") for t in CODE] + [(t, "chat") for t in CHAT]


SPEC = FeatureSpec(1024, 2, (3, 4), 256)


def write_examples(path, rows) -> None:
    path.write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows))


def test_read_examples_names_the_bad_line(tmp_path):
    p = tmp_path / "ex.jsonl"
    p.write_text('{"text": "a", "label": "x"}\n\n{"text": 1, "label": "x"}\n')
    with pytest.raises(ExamplesError, match=r"ex.jsonl:3: "):
        read_examples(p)
    p.write_text('{"text": "a", "label": "x"}\nnot json\n')
    with pytest.raises(ExamplesError, match=r"ex.jsonl:2: not JSON"):
        read_examples(p)
    p.write_text("\n")
    with pytest.raises(ExamplesError, match="no examples"):
        read_examples(p)


def test_counts_are_the_reference_features():
    counts, n = bucket_counts(["Hello world", "", "hello"], SPEC)
    assert n.tolist() == [len(cm.features(b"Hello world", 2, (3, 4))), 0, len(cm.features(b"hello", 2, (3, 4)))]
    assert counts.sum(axis=1).A1.tolist() == n.tolist()
    hashes = cm.features(b"hello", 2, (3, 4))
    assert counts[2, hashes[0] & (SPEC.dim - 1)] >= 1


def test_train_binary_scores_and_labels():
    t = train(examples(), SPEC, holdout=0.25, seed=1)
    assert t.model.labels == ("chat", "code") and t.train_size == 18 and len(t.held_out) == 6
    assert 0 <= t.full.accuracy <= 1 and 0 <= t.quantized.macro_f1 <= 1
    # The binary form (one sklearn row) is written as two: the first label's weights and bias 0.
    assert not t.model.weights[:, 0].any() and t.model.bias[0] == 0.0
    assert int(np.abs(t.model.weights).max()) == 127
    # The held-out labels are the reference's own, example by example.
    assert t.predicted == [t.model.classify(x).label for x, _ in t.held_out]
    # On its own training text the model is right (the classes are far apart).
    assert t.model.classify("how do I reverse a list in python").label == "code"
    assert t.model.classify("tell me a joke about cats").label == "chat"


def test_quantized_labels_are_the_reference_arithmetic():
    t = train(examples(), SPEC, holdout=0, seed=0)
    texts = [x for x, _ in examples()] + ["", "!!!", "python " * 100]
    got = quantized_labels(t.model, *bucket_counts(texts, SPEC))
    assert got == [(t.model.classify(x).label or NO_LABEL) for x in texts]
    assert got[-3] == NO_LABEL


def test_train_refuses_bad_labels():
    with pytest.raises(ExamplesError, match="1 labels"):
        train([("a", "x"), ("b", "x")], SPEC, holdout=0)
    with pytest.raises(ExamplesError, match="label `chat bot`"):
        train([("a", "chat bot"), ("b", "code")], SPEC, holdout=0)


def test_confusion_matrix_text():
    table = confusion(["code", "chat", "code", "other"], ["code", "code", NO_LABEL, "chat"], ["chat", "code"])
    lines = table.splitlines()
    # Rows: the model's labels, then true labels it does not have; columns: those, then no label.
    assert lines[0].split()[-4:] == ["chat", "code", "other", NO_LABEL]
    assert lines[1].split() == ["chat", "0", "1", "0", "0"]
    assert lines[2].split() == ["code", "0", "1", "0", "1"]
    assert lines[3].split() == ["other", "1", "0", "0", "0"]


POLICY = """# a policy with comments, kept
version: 1
default_class: batch
classes:
  batch: {pool: batch}
  code: {pool: batch}
rules:
  - name: code-questions
    class: code
    match: {content: {label: code, min_score: 0.6}}
pools:
  batch: {models: [{name: m}]}
"""


def test_train_command_writes_a_model_file_and_a_policy(tmp_path, capsys):
    ex = tmp_path / "ex.jsonl"
    write_examples(ex, examples())
    assert main(["classes", "train", str(ex), "-o", str(tmp_path / "m.json"), "--dim", "1024", "--max-text-bytes", "256",
                 "--holdout", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "held out, full precision (scikit-learn): accuracy" in out and "held out, int8 (the filter's model):" in out
    assert "true \\ predicted" in out
    m = cm.load_model(tmp_path / "m.json")
    assert (m.dim, m.max_text_bytes, m.char_ngrams) == (1024, 256, (3, 3)), "the default: character trigrams"
    # Into a policy without a model: inline, at the end, the rest of the text as it was.
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY)
    assert main(["classes", "train", str(ex), "--policy", str(p), "--dim", "1024", "--holdout", "0"]) == 0
    text = p.read_text()
    assert text.startswith(POLICY) and load_policy(p).content_model.labels == ("chat", "code")
    # Again: the inline model is replaced, not repeated.
    assert main(["classes", "train", str(ex), "--policy", str(p), "--dim", "512", "--holdout", "0"]) == 0
    assert p.read_text().count("content_model:") == 1 and load_policy(p).content_model.dim == 512
    assert p.read_text().startswith(POLICY)


def test_a_policy_naming_a_model_file_gets_the_file(tmp_path):
    t = train(examples(), SPEC, holdout=0)
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY + "content_model: {file: models/code.json}\n")
    (tmp_path / "models").mkdir()
    assert write_into_policy(p, t.model) == tmp_path / "models" / "code.json"
    assert p.read_text().endswith("content_model: {file: models/code.json}\n")
    assert load_policy(p).content_model.to_obj() == t.model.to_obj()


def test_a_model_that_breaks_the_policy_is_not_written(tmp_path):
    # The rule asks for `code`; a model without that label would break the policy: nothing changes.
    t = train([(x, "a" if lab == "code" else "b") for x, lab in examples()], SPEC, holdout=0)
    p = tmp_path / "policy.yaml"
    p.write_text(POLICY)
    with pytest.raises(PolicyError, match="unknown label `code`"):
        write_into_policy(p, t.model)
    assert p.read_text() == POLICY
    # Nor the model file a policy names.
    named = POLICY + "content_model: {file: code.json}\n"
    p.write_text(named)
    cm.save_model(train(examples(), SPEC, holdout=0).model, tmp_path / "code.json")
    before = (tmp_path / "code.json").read_text()
    with pytest.raises(PolicyError, match="unknown label `code`"):
        write_into_policy(p, t.model)
    assert (tmp_path / "code.json").read_text() == before and p.read_text() == named
    p.write_text(POLICY)
    # An inline model past the policy's size bound: refused, with where to put it instead.
    big = cm.ContentModel(("chat", "code"), 131072, 2, (3, 4), 4096, 1.0, (0.0, 0.0), np.zeros((131072, 2), np.int8))
    with pytest.raises(ExamplesError, match="write it to a file"):
        write_into_policy(p, big)
    assert p.read_text() == POLICY
    assert yaml.safe_load(p.read_text())["rules"][0]["name"] == "code-questions"


def test_train_command_errors(tmp_path, capsys):
    ex = tmp_path / "ex.jsonl"
    write_examples(ex, examples())
    assert main(["classes", "train", str(ex)]) == 2
    assert main(["classes", "train", str(ex), "-o", str(tmp_path / "m.json"), "--dim", "1000"]) == 2
    assert "power of two" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
