"""The content classifier's reference model (issue 32, docs/content-classes.md): the text of a
request, its hashed n-gram features, the int8 linear model that scores them, and the model's
JSON (the same object in the policy's `content_model`, the filter config and a model file).

The filter (filter/src/content_classifier.rs, natively its `content_eval` example) implements the
same spec (docs/content-classes.md); the contract test (mesh-config/tests/test_content_contract.py)
holds the two to the same label on every example.

    m = ContentModel.from_obj(json.load(f))      # or load_model(path); ModelError on a bad model
    m.classify(b"how do I reverse a list in python")   -> Verdict(label="code", score=0.91, features=57)
    m.classify_body(request_body_bytes)                 -> the same, from a chat/completions/Responses body
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import numpy as np

VERSION = 1
MIN_LABELS, MAX_LABELS = 2, 16
DIM_MIN, DIM_MAX = 256, 262144
MAX_TEXT_MIN, MAX_TEXT_MAX = 64, 65536
CHAR_NGRAM_MAX = 6
MAX_WEIGHT_BYTES = 512 * 1024
"""dim x labels: what keeps a model's JSON within MAX_MODEL_BYTES (dim 32768 x 16 labels)."""
MAX_MODEL_BYTES = 1024 * 1024
"""The bound on a model's JSON (a model file; a policy holds at most policy.MAX_POLICY_BYTES)."""
LABEL = r"^[A-Za-z0-9_-]{1,64}$"
"""A label is a name like a class's (infermesh.settings.NAME)."""

FNV_OFFSET, FNV_PRIME = 0x811C9DC5, 0x01000193
CHAR_NGRAMS_MESSAGE = f"must be [min, max] with 2 <= min <= max <= {CHAR_NGRAM_MAX}, or [0, 0] (off)"
MODEL_FIELDS = ("version", "labels", "dim", "word_ngrams", "char_ngrams", "max_text_bytes", "scale", "bias", "weights")


class ModelError(ValueError):
    """A model that cannot be used: `field` is its path below the model ("" for the model)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field, self.message = field, message


# ---- the text of a request (spec section 1) -----------------------------------------------------

def _user_parts(content: Any, part_types: tuple[str, ...]) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content
                if isinstance(p, dict) and p.get("type") in part_types and isinstance(p.get("text"), str)]
    return []


def _user_turns(messages: Any, part_types: tuple[str, ...]) -> list[str]:
    if not isinstance(messages, list):
        return []
    return [t for m in messages if isinstance(m, dict) and m.get("role") == "user"
            for t in _user_parts(m.get("content"), part_types)]


def text_pieces(body: Any) -> list[str]:
    """The pieces of user text in a decoded request body: the user turns of `messages` (chat,
    Anthropic), `prompt` (completions), `input` (Responses), in that order."""
    if not isinstance(body, dict):
        return []
    pieces = _user_turns(body.get("messages"), ("text",))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        pieces.append(prompt)
    elif isinstance(prompt, list):
        pieces += [p for p in prompt if isinstance(p, str)]
    inp = body.get("input")
    if isinstance(inp, str):
        pieces.append(inp)
    else:
        pieces += _user_turns(inp, ("input_text", "text"))
    return pieces


_SURROGATE = re.compile("[\ud800-\udfff]")


def body_text(body: bytes | str | Any) -> bytes | None:
    """The classified text of a request body (raw JSON, or already decoded): its pieces as UTF-8,
    joined by one `\\n`; None when there is none (not JSON, no such field, only empty strings)."""
    if isinstance(body, (bytes, bytearray, str)):
        try:
            body = json.loads(body)
        except (ValueError, RecursionError):
            return None
    # A lone surrogate escape (`"\\ud800"`) is no character: U+FFFD, as the filter decodes it.
    text = _SURROGATE.sub("\ufffd", "\n".join(text_pieces(body))).encode("utf-8")
    return text or None


# ---- features (spec section 2) ---------------------------------------------------------------------

def fnv1a(data: bytes, h: int = FNV_OFFSET) -> int:
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & 0xFFFFFFFF
    return h


_TOKEN = re.compile(rb"[A-Za-z0-9\x80-\xff]+")


def tokens(text: bytes) -> list[bytes]:
    """Maximal runs of ASCII letters, digits and bytes >= 0x80; A-Z lowered, other bytes kept."""
    return [t.lower() if t.isascii() else bytes(c + 32 if 65 <= c <= 90 else c for c in t) for t in _TOKEN.findall(text)]


_W, _B, _C = fnv1a(b"w"), fnv1a(b"b"), fnv1a(b"c")  # the prefix byte hashed once


def features(text: bytes, word_ngrams: int, char_ngrams: tuple[int, int]) -> list[int]:
    """The 32-bit hash of every emitted feature (the text already cut at max_text_bytes)."""
    out: list[int] = []
    lo, hi = char_ngrams
    prev = None
    for t in tokens(text):
        u = fnv1a(t, _W)
        out.append(u)
        if word_ngrams == 2 and prev is not None:
            out.append(fnv1a(prev.to_bytes(4, "little") + u.to_bytes(4, "little"), _B))
        prev = u
        if hi:
            p = b"<" + t + b">"
            for n in range(lo, hi + 1):
                out.extend(fnv1a(p[i:i + n], _C) for i in range(len(p) - n + 1))
    return out


# ---- the model (spec sections 3 and 4) ---------------------------------------------------------------

class Verdict(NamedTuple):
    label: str | None
    """None: no feature (no text)."""
    score: float
    features: int


def _bounded(field: str, v: Any, lo: int, hi: int) -> int:
    if type(v) is not int:
        raise ModelError(field, "must be an integer")
    if not lo <= v <= hi:
        raise ModelError(field, f"must be between {lo} and {hi}")
    return v


def _finite(field: str, v: Any) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ModelError(field, "must be a finite number")
    return float(v)


@dataclass(frozen=True, eq=False)
class ContentModel:
    labels: tuple[str, ...]
    dim: int
    word_ngrams: int
    char_ngrams: tuple[int, int]
    max_text_bytes: int
    scale: float
    bias: tuple[float, ...]
    weights: np.ndarray
    """int8, shape (dim, labels): bucket b, label l at [b, l] (the wire's b*L + l)."""

    @classmethod
    def from_obj(cls, obj: Any) -> "ContentModel":
        """The model of a decoded JSON object, checked field by field (ModelError names the field)."""
        if not isinstance(obj, dict):
            raise ModelError("", "a content model is an object with version, labels, dim, …, weights")
        for k in obj:
            if k not in MODEL_FIELDS:
                raise ModelError(str(k), "unknown field (expected one of " + ", ".join(MODEL_FIELDS) + ")")
        for k in MODEL_FIELDS:
            if k not in obj:
                raise ModelError(k, "missing field")
        if obj["version"] != VERSION or type(obj["version"]) is not int:
            raise ModelError("version", f"unsupported version {obj['version']!r} (this filter understands {VERSION})")
        labels = obj["labels"]
        if not isinstance(labels, list) or not MIN_LABELS <= len(labels) <= MAX_LABELS:
            raise ModelError("labels", f"must have between {MIN_LABELS} and {MAX_LABELS} labels")
        for i, name in enumerate(labels):
            if not isinstance(name, str) or not re.fullmatch(LABEL, name):
                raise ModelError(f"labels.{i}", f"`{name}` must be 1-64 characters of [A-Za-z0-9_-]")
            if name in labels[:i]:
                raise ModelError(f"labels.{i}", f"duplicate label `{name}`")
        dim = obj["dim"]
        if type(dim) is not int or not DIM_MIN <= dim <= DIM_MAX or dim & (dim - 1):
            raise ModelError("dim", f"must be a power of two between {DIM_MIN} and {DIM_MAX}")
        word = _bounded("word_ngrams", obj["word_ngrams"], 1, 2)
        cn = obj["char_ngrams"]
        if not (isinstance(cn, list) and len(cn) == 2 and all(type(x) is int for x in cn)):
            raise ModelError("char_ngrams", CHAR_NGRAMS_MESSAGE)
        lo, hi = cn
        if not (0 <= lo <= hi <= CHAR_NGRAM_MAX and (lo >= 2 or (lo, hi) == (0, 0))):
            raise ModelError("char_ngrams", CHAR_NGRAMS_MESSAGE)
        max_text = _bounded("max_text_bytes", obj["max_text_bytes"], MAX_TEXT_MIN, MAX_TEXT_MAX)
        scale = _finite("scale", obj["scale"])
        if not scale > 0:
            raise ModelError("scale", "must be a finite number above 0")
        bias = obj["bias"]
        if not isinstance(bias, list) or len(bias) != len(labels):
            raise ModelError("bias", f"must have one number per label ({len(labels)})")
        bias = tuple(_finite(f"bias.{i}", b) for i, b in enumerate(bias))
        if dim * len(labels) > MAX_WEIGHT_BYTES:
            raise ModelError("weights", f"dim × labels is {dim * len(labels)}; at most {MAX_WEIGHT_BYTES} "
                                        f"(a model's JSON stays within {MAX_MODEL_BYTES} bytes)")
        w = obj["weights"]
        if not isinstance(w, str):
            raise ModelError("weights", "must be a base64 string")
        try:
            raw = base64.b64decode(w.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise ModelError("weights", "must be standard base64 (with padding)") from None
        if len(raw) != dim * len(labels):
            raise ModelError("weights", f"holds {len(raw)} bytes, must hold dim × labels = {dim * len(labels)}")
        weights = np.frombuffer(raw, dtype=np.int8).reshape(dim, len(labels))
        return cls(tuple(labels), dim, word, (lo, hi), max_text, scale, bias, weights)

    def to_obj(self) -> dict:
        return {"version": VERSION, "labels": list(self.labels), "dim": self.dim, "word_ngrams": self.word_ngrams,
                "char_ngrams": list(self.char_ngrams), "max_text_bytes": self.max_text_bytes, "scale": self.scale,
                "bias": list(self.bias), "weights": base64.b64encode(self.weights.astype(np.int8).tobytes()).decode("ascii")}

    def to_json(self) -> str:
        return json.dumps(self.to_obj(), separators=(",", ":"))

    def features(self, text: bytes) -> list[int]:
        """The emitted features' hashes of `text` cut at max_text_bytes."""
        return features(text[:self.max_text_bytes], self.word_ngrams, self.char_ngrams)

    def buckets(self, text: bytes) -> np.ndarray:
        return np.array(self.features(text), dtype=np.int64) & (self.dim - 1)

    def classify(self, text: bytes | str) -> Verdict:
        """The label and score of `text` (spec section 4)."""
        if isinstance(text, str):
            text = text.encode("utf-8")
        b = self.buckets(text)
        n = len(b)
        if n == 0:
            return Verdict(None, 0.0, 0)
        sums = self.weights[b].sum(axis=0, dtype=np.int64)
        logits = [self.bias[l] + (self.scale * int(s)) / n for l, s in enumerate(sums)]
        win = max(range(len(logits)), key=lambda l: (logits[l], -l))  # ties: the lowest index
        return Verdict(self.labels[win], 1.0 / sum(math.exp(x - logits[win]) for x in logits), n)

    def classify_body(self, body: bytes | str | Any) -> Verdict:
        text = body_text(body)
        return self.classify(text) if text is not None else Verdict(None, 0.0, 0)


def load_model(path: str | Path) -> ContentModel:
    """A model file (JSON, at most MAX_MODEL_BYTES); ModelError with field "" when unreadable."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_MODEL_BYTES + 1)
    except OSError as e:
        raise ModelError("", f"cannot read {p}: {e.strerror or e}") from e
    if len(data) > MAX_MODEL_BYTES:
        raise ModelError("", f"{p} is over {MAX_MODEL_BYTES} bytes, the most a content model may be")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ModelError("", f"{p} is not JSON: {e}") from e
    return ContentModel.from_obj(obj)


def save_model(model: ContentModel, path: str | Path) -> None:
    Path(path).write_text(model.to_json() + "\n")


def quantize(coef: np.ndarray, intercept: Iterable[float], labels: Iterable[str], *, word_ngrams: int,
             char_ngrams: tuple[int, int], max_text_bytes: int) -> ContentModel:
    """The int8 model of full-precision weights `coef` (dim x labels): scale = max|w| / 127,
    w_q = round(w / scale) (spec section 7); the bias stays f64."""
    coef = np.asarray(coef, dtype=np.float64)
    top = float(np.abs(coef).max())
    scale = top / 127 if top > 0 else 1.0
    q = np.clip(np.rint(coef / scale), -127, 127).astype(np.int8)
    return ContentModel(tuple(labels), coef.shape[0], word_ngrams, tuple(char_ngrams), max_text_bytes, scale,
                        tuple(float(b) for b in intercept), q)
