"""The content classifier's reference model (content_model.py) on cases computed by hand, and the
policy's `content_model` and `match.content` (errors by file, line and field)."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import yaml

from infermesh.meshconfig import content_model as cm
from infermesh.meshconfig.policy import MAX_POLICY_BYTES, PolicyError, load_policy, parse_policy


def fnv(data: bytes) -> int:
    """FNV-1a 32 written out once more, from the spec's line."""
    h = 0x811C9DC5
    for b in data:
        h ^= b
        h = (h * 0x01000193) % 2**32
    return h


def model(labels=("code", "chat"), dim=256, word=2, chars=(3, 4), max_text=64, scale=1.0, bias=None, weights=None) -> cm.ContentModel:
    w = np.zeros((dim, len(labels)), np.int8) if weights is None else weights
    return cm.ContentModel(tuple(labels), dim, word, tuple(chars), max_text, scale, tuple(bias or [0.0] * len(labels)), w)


# ---- features --------------------------------------------------------------------------------

def test_fnv1a_published_vectors():
    # The FNV authors' test vectors for FNV-1a 32.
    assert cm.fnv1a(b"") == 0x811C9DC5
    assert cm.fnv1a(b"a") == 0xE40C292C
    assert cm.fnv1a(b"foobar") == 0xBF9CF968
    assert cm.fnv1a(b"w" + b"code") == fnv(b"wcode")


def test_tokens_are_ascii_alphanumerics_and_high_bytes_lowercased_ascii_only():
    assert cm.tokens(b"Hello, WORLD!  x_y-z\tA1b2") == [b"hello", b"world", b"x", b"y", b"z", b"a1b2"]
    # Bytes >= 0x80 join tokens and are kept as they are (no Unicode lowering: "É" stays).
    assert cm.tokens("Café ÉTÉ".encode()) == ["café".encode(), "ÉtÉ".encode()]
    assert cm.tokens(b"\x00\x7f ,.;") == []


def test_features_by_hand():
    u_hi, u_there = fnv(b"whi"), fnv(b"wthere")
    bigram = fnv(b"b" + u_hi.to_bytes(4, "little") + u_there.to_bytes(4, "little"))
    # Words only.
    assert cm.features(b"Hi there", 1, (0, 0)) == [u_hi, u_there]
    assert cm.features(b"Hi there", 2, (0, 0)) == [u_hi, u_there, bigram]
    # Char 3-grams of "<hi>": "<hi", "hi>"; 4-grams: "<hi>"; and of "<a>" only the 3-gram (len 3 < 4).
    got = cm.features(b"hi a", 1, (3, 4))
    assert sorted(got) == sorted([u_hi, fnv(b"c<hi"), fnv(b"chi>"), fnv(b"c<hi>"), fnv(b"wa"), fnv(b"c<a>")])
    # "hello world", word bigrams, char 3..4: hello 1 + 5 + 4, world 1 + 1 + 5 + 4.
    assert len(cm.features(b"hello world", 2, (3, 4))) == 21
    # n up to 6; a token shorter than n emits none of that n.
    assert len(cm.features(b"ab", 1, (2, 6))) == 1 + 3 + 2 + 1


def test_bucket_is_the_low_bits():
    m = model(dim=256, word=1, chars=(0, 0))
    assert list(m.buckets(b"hi")) == [fnv(b"whi") & 255]


# ---- scoring -------------------------------------------------------------------------------------

def test_tie_goes_to_the_lowest_label_index():
    v = model(labels=("a", "b", "c")).classify(b"anything at all")
    assert v.label == "a" and v.score == pytest.approx(1 / 3, abs=1e-15)
    # A tie between the last two, the first below them: the lower of the two.
    v = model(labels=("a", "b", "c"), bias=[-1.0, 2.0, 2.0]).classify(b"x")
    assert v.label == "b"


def test_no_feature_no_label():
    m = model()
    assert m.classify(b"") == (None, 0.0, 0)
    assert m.classify(b" ,.;!? \n") == (None, 0.0, 0)
    assert m.classify_body(b'{"messages": [{"role": "user", "content": ""}]}') == (None, 0.0, 0)


def test_score_by_hand():
    # Every bucket +3 for label 1, -1 for label 0: S = (-n, 3n), logit = bias + scale * S / n.
    w = np.zeros((256, 2), np.int8)
    w[:, 0], w[:, 1] = -1, 3
    m = model(scale=0.25, bias=[0.5, -0.2], weights=w)
    v = m.classify(b"hello world")
    assert v.features == 21
    l0, l1 = 0.5 + (0.25 * -21) / 21, -0.2 + (0.25 * 63) / 21
    assert v.label == "chat" and v.score == 1 / (math.exp(l0 - l1) + 1.0)
    # One bucket only: the features that fall in it count, the others are 0.
    w = np.zeros((256, 2), np.int8)
    b = fnv(b"whi") & 255
    w[b, 0] = 100
    v = model(weights=w, word=1, chars=(0, 0)).classify(b"hi hi there")
    assert v == ("code", 1 / (1 + math.exp(-(200 / 3))), 3)


def test_only_the_first_max_text_bytes_are_read():
    w = np.zeros((256, 2), np.int8)
    w[fnv(b"wpython") & 255, 0] = 127
    m = model(weights=w, word=1, chars=(0, 0), max_text=64, bias=[0.0, 0.1])
    assert len({fnv(t) & 255 for t in (b"wpython", b"wpyth", b"wx")}) == 3
    filler = b"x " * 30  # 60 bytes
    assert m.classify(filler + b"python").label == "chat"   # cut at 64: "pyth"
    assert m.classify(filler[:-2] + b"python").label == "code"  # "python" ends at byte 64
    # A cut inside a UTF-8 sequence: the first byte of "é" is a token of its own.
    text = b"a" * 63 + "é".encode()
    assert m.features(text) == cm.features(b"a" * 63 + b"\xc3", 1, (0, 0))
    assert len(m.features(text)) == 1


# ---- the text of a request --------------------------------------------------------------------------

@pytest.mark.parametrize("body, text", [
    ({"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "one"},
                   {"role": "assistant", "content": "two"}, {"role": "user", "content": "thr\u00e9e"}]}, "one\nthr\u00e9e"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}},
                                                {"type": "text", "text": "b"}]}]}, "a\nb"),
    ({"model": "claude", "max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "hi"),
    ({"prompt": "def f():"}, "def f():"),
    ({"prompt": ["p1", [1, 2], "p2"]}, "p1\np2"),
    ({"input": "question"}, "question"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": "u"}]},
                {"role": "assistant", "content": "no"}, {"role": "user", "content": "y"}]}, "x\ny"),
    ({"messages": [{"role": "user", "content": "tab\t\"quote\" \\u00e9"}]}, "tab\t\"quote\" \\u00e9"),
])
def test_text_of_a_body(body, text):
    assert cm.body_text(json.dumps(body).encode()) == text.encode()


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'{"model": "m"}', b'{"messages": [{"role": "assistant", "content": "a"}]}',
                                 b'{"messages": "hi"}', b'{"prompt": 7}', b'{"messages": [{"role": "user", "content": ""}]}'])
def test_no_text(raw):
    assert cm.body_text(raw) is None


def test_escapes_are_decoded_before_features():
    assert cm.body_text(b'{"prompt": "caf\\u00e9\\nbar"}') == "café\nbar".encode()
    assert cm.body_text(b'{"prompt": "\\ud83d\\ude00 \\ud800"}') == "\U0001f600 \ufffd".encode()


# ---- the model's JSON ------------------------------------------------------------------------------

def good_obj(**over) -> dict:
    return model().to_obj() | over


def test_round_trip():
    w = np.arange(-128, 128, dtype=np.int8).repeat(2).reshape(256, 2)
    m = model(weights=w, scale=0.0123, bias=[0.1, -0.3])
    back = cm.ContentModel.from_obj(json.loads(m.to_json()))
    assert back.to_obj() == m.to_obj() and (back.weights == w).all()
    # Row-major: bucket b, label l at b*L + l.
    raw = base64.b64decode(m.to_obj()["weights"])
    assert raw[5 * 2 + 1] == w[5, 1].astype(np.uint8)


@pytest.mark.parametrize("over, field", [
    ({"version": 2}, "version"), ({"labels": ["a"]}, "labels"), ({"labels": ["a"] * 17}, "labels"),
    ({"labels": ["a", "a"]}, "labels.1"), ({"labels": ["a", "b c"]}, "labels.1"), ({"dim": 128}, "dim"), ({"dim": 384}, "dim"),
    ({"dim": 524288}, "dim"), ({"dim": 256.0}, "dim"), ({"word_ngrams": 3}, "word_ngrams"), ({"char_ngrams": [1, 3]}, "char_ngrams"),
    ({"char_ngrams": [0, 3]}, "char_ngrams"), ({"char_ngrams": [3, 7]}, "char_ngrams"), ({"char_ngrams": [4, 3]}, "char_ngrams"),
    ({"char_ngrams": [3]}, "char_ngrams"), ({"max_text_bytes": 63}, "max_text_bytes"), ({"max_text_bytes": 65537}, "max_text_bytes"),
    ({"scale": 0}, "scale"), ({"scale": -1.0}, "scale"), ({"scale": float("inf")}, "scale"), ({"bias": [0.0]}, "bias"),
    ({"bias": [0.0, float("nan")]}, "bias.1"), ({"weights": "!!"}, "weights"), ({"weights": base64.b64encode(b"\0" * 511).decode()}, "weights"),
    ({"extra": 1}, "extra"),
])
def test_a_bad_model_names_its_field(over, field):
    with pytest.raises(cm.ModelError) as e:
        cm.ContentModel.from_obj(good_obj(**over))
    assert e.value.field == field


def test_size_bound():
    # dim 32768 x 16 labels: the largest model of 16 labels, within 1 MiB of JSON.
    labels = [f"l{i}" for i in range(16)]
    big = model(labels=labels, dim=32768, weights=np.full((32768, 16), -127, np.int8))
    assert len(big.to_json()) <= cm.MAX_MODEL_BYTES
    cm.ContentModel.from_obj(json.loads(big.to_json()))
    with pytest.raises(cm.ModelError) as e:
        cm.ContentModel.from_obj(good_obj(labels=labels, bias=[0.0] * 16, dim=65536))
    assert e.value.field == "weights"


def test_quantize():
    coef = np.array([[0.5, -1.0], [0.25, 0.0]] + [[0.0, 0.0]] * 254)
    m = cm.quantize(coef, [0.1, 0.2], ["a", "b"], word_ngrams=1, char_ngrams=(0, 0), max_text_bytes=64)
    assert m.scale == 1.0 / 127
    assert m.weights[0].tolist() == [64, -127] and m.weights[1].tolist() == [32, 0] and m.bias == (0.1, 0.2)


# ---- the policy ---------------------------------------------------------------------------------------

def policy(tmp_path=None, model_entry=None, rules=None) -> str:
    doc = {"version": 1, "default_class": "batch", "classes": {"batch": {"pool": "batch"}, "code": {"pool": "code"}},
           "rules": rules if rules is not None else [{"name": "code-questions", "class": "code",
                                                      "match": {"content": {"label": "code", "min_score": 0.6}}}],
           "pools": {"batch": {"models": [{"name": "m"}]}, "code": {"models": [{"name": "m"}]}}}
    if model_entry is not None:
        doc["content_model"] = model_entry
    return yaml.safe_dump(doc, sort_keys=False)


def refusal(text: str, path: str = "p.yaml") -> tuple[int, str, str]:
    with pytest.raises(PolicyError) as e:
        parse_policy(text, path)
    return e.value.problems[0]


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_inline_model_and_content_rule():
    p = parse_policy(policy(model_entry=model().to_obj()), "p.yaml")
    assert p.needs_body and p.rules[0].match.needs_body
    assert p.rules[0].match.content.label == "code" and p.rules[0].match.content.min_score == 0.6
    cfg = p.filter_config()
    assert cfg["content_model"] == model().to_obj()
    assert cfg["rules"][0]["match"] == {"content": {"label": "code", "min_score": 0.6}}
    # min_score defaults to 0 (the filter's default: not written).
    p = parse_policy(policy(model_entry=model().to_obj(), rules=[{"name": "c", "class": "code", "match": {"content": {"label": "chat"}}}]))
    assert p.rules[0].match.content.min_score == 0 and p.filter_config()["rules"][0]["match"] == {"content": {"label": "chat"}}


def test_model_file_beside_the_policy(tmp_path):
    (tmp_path / "models").mkdir()
    cm.save_model(model(), tmp_path / "models" / "content.json")
    (tmp_path / "p.yaml").write_text(policy(model_entry={"file": "models/content.json"}))
    p = load_policy(tmp_path / "p.yaml")
    assert p.content_model.labels == ("code", "chat") and p.filter_config()["content_model"] == model().to_obj()


def test_model_file_errors_name_the_policy_line(tmp_path):
    text = policy(model_entry={"file": "missing.json"})
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(tmp_path / "p.yaml")
    line, field, msg = e.value.problems[0]
    assert (line, field) == (line_of(text, "file: missing.json"), "content_model.file") and "missing.json" in msg
    (tmp_path / "bad.json").write_text(json.dumps(good_obj(dim=100)))
    text = policy(model_entry={"file": "bad.json"})
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(tmp_path / "p.yaml")
    assert e.value.problems[0] == (line_of(text, "content_model"), "content_model.dim", "must be a power of two between 256 and 262144 (in bad.json)")
    (tmp_path / "big.json").write_text(" " * (cm.MAX_MODEL_BYTES + 1))
    (tmp_path / "p.yaml").write_text(policy(model_entry={"file": "big.json"}))
    with pytest.raises(PolicyError, match="over 1048576 bytes"):
        load_policy(tmp_path / "p.yaml")
    assert refusal(policy(model_entry={"file": "a.json", "dim": 256}))[1] == "content_model"
    assert refusal(policy(model_entry={"file": ""}))[1] == "content_model.file"


def test_content_errors_name_file_line_and_field():
    text = policy()
    assert refusal(text) == (line_of(text, "content:"), "rules.0.match.content", "a `content` condition needs a `content_model`")
    text = policy(model_entry=model(labels=("support", "chat")).to_obj())
    assert refusal(text) == (line_of(text, "label: code"), "rules.0.match.content.label",
                             "unknown label `code` (the model's labels: support, chat)")
    text = policy(model_entry=good_obj(word_ngrams=3))
    line, field, msg = refusal(text)
    assert (line, field, msg) == (line_of(text, "word_ngrams"), "content_model.word_ngrams", "must be between 1 and 2")
    for score in (-0.1, 1.01):
        text = policy(model_entry=model().to_obj(), rules=[{"name": "c", "class": "code", "match": {"content": {"label": "code", "min_score": score}}}])
        assert refusal(text) == (line_of(text, "min_score"), "rules.0.match.content.min_score", "must be between 0 and 1")
    text = policy(model_entry=model().to_obj(), rules=[{"name": "c", "class": "code", "match": {"content": {"label": "code", "minscore": 1}}}])
    assert refusal(text)[1] == "rules.0.match.content.minscore"
    text = policy(model_entry=model().to_obj(), rules=[{"name": "c", "class": "code", "match": {"content": {"min_score": 0.5}}}])
    assert refusal(text)[1] == "rules.0.match.content.label"
    text = policy(model_entry=model().to_obj(), rules=[{"name": "c", "class": "code", "match": {"content": {"label": "code", "min_score": "high"}}}])
    assert refusal(text)[1] == "rules.0.match.content.min_score"


def test_a_large_model_goes_in_a_file():
    # Inline, a model shares the policy's 256 KiB: dim 32768 x 16 labels needs a model file.
    labels = [f"l{i}" for i in range(16)]
    assert len(model(labels=labels, dim=32768, weights=np.zeros((32768, 16), np.int8)).to_json()) > MAX_POLICY_BYTES
