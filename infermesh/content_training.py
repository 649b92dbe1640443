"""The content classifier's training and evaluation (`infermesh classes`, content_classes.py;
docs/content-classes.md, issue 32): examples, the reference features as a scipy matrix of counts / n,
scikit-learn's LogisticRegression in full precision, its int8 form (spec section 7), the held-out
scores, and the filter's own classifier run natively (filter/examples/content_eval.rs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from infermesh.meshconfig import content_model as cm

from .paths import REPO_ROOT

NO_LABEL = "(none)"
"""The confusion matrix's column for texts without features (no label)."""


class ExamplesError(ValueError):
    pass


# ---- examples ----------------------------------------------------------------------------------

def read_examples(path: str | Path) -> list[tuple[str, str]]:
    """(text, label) of each line of a JSONL file; ExamplesError names the line of a bad one."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
            except ValueError as e:
                raise ExamplesError(f"{path}:{i}: not JSON: {e}") from e
            if not (isinstance(ex, dict) and isinstance(ex.get("text"), str) and isinstance(ex.get("label"), str)):
                raise ExamplesError(f'{path}:{i}: expected {{"text": "...", "label": "..."}}')
            out.append((ex["text"], ex["label"]))
    if not out:
        raise ExamplesError(f"{path}: no examples")
    return out


@dataclass(frozen=True)
class FeatureSpec:
    dim: int = 16384
    word_ngrams: int = 2
    char_ngrams: tuple[int, int] = (3, 3)
    max_text_bytes: int = 4096


def bucket_counts(texts: Sequence[str], spec: FeatureSpec):
    """(counts, n): a scipy CSR matrix of bucket counts per text (int) and the features per text."""
    from scipy.sparse import csr_matrix

    rows, cols, n = [], [], np.zeros(len(texts), dtype=np.int64)
    for i, t in enumerate(texts):
        hashes = cm.features(t.encode("utf-8")[:spec.max_text_bytes], spec.word_ngrams, spec.char_ngrams)
        n[i] = len(hashes)
        cols.extend(h & (spec.dim - 1) for h in hashes)
        rows.extend([i] * len(hashes))
    counts = csr_matrix((np.ones(len(cols), dtype=np.int64), (rows, cols)), shape=(len(texts), spec.dim))
    counts.sum_duplicates()
    return counts, n


def normalized(counts, n: np.ndarray):
    """counts / n per row (a text without features stays all zero)."""
    from scipy.sparse import diags

    return diags(1.0 / np.maximum(n, 1)) @ counts.astype(np.float64)


# ---- training ----------------------------------------------------------------------------------

@dataclass
class Scores:
    accuracy: float
    macro_f1: float

    def line(self) -> str:
        return f"accuracy {self.accuracy:.3f}, macro-F1 {self.macro_f1:.3f}"


def scores(y_true: Sequence[str], y_pred: Sequence[str], labels: Sequence[str]) -> Scores:
    from sklearn.metrics import accuracy_score, f1_score

    return Scores(float(accuracy_score(y_true, y_pred)),
                  float(f1_score(y_true, y_pred, labels=list(labels), average="macro", zero_division=0)))


def confusion(y_true: Sequence[str], y_pred: Sequence[str], labels: Sequence[str]) -> str:
    """The confusion matrix as text: a row per true label, a column per predicted one."""
    from sklearn.metrics import confusion_matrix

    rows = list(labels) + sorted(set(y_true) - set(labels))
    cols = rows + ([NO_LABEL] if NO_LABEL in y_pred else [])
    m = confusion_matrix(y_true, y_pred, labels=cols)
    w = max(len(NO_LABEL), *(len(str(v)) for v in m.flat))
    short = [c[:w] for c in cols]
    corner = "true \\ predicted"
    head = f"{corner:<18}" + " ".join(f"{c:>{w}}" for c in short)
    body = [f"{r[:18]:<18}" + " ".join(f"{v:>{w}}" for v in m[i]) for i, r in enumerate(rows)]
    return "\n".join([head, *body])


def split(examples: Sequence[tuple[str, str]], holdout: float, seed: int):
    """Train and held-out examples, stratified by label where every label has two examples."""
    from sklearn.model_selection import train_test_split

    if holdout <= 0:
        return list(examples), []
    labels = [lab for _, lab in examples]
    strat = labels if min(Counter(labels).values()) >= 2 else None
    try:
        return train_test_split(list(examples), test_size=holdout, random_state=seed, stratify=strat)
    except ValueError:  # too few examples for a stratified split of that size
        return train_test_split(list(examples), test_size=holdout, random_state=seed)


@dataclass
class Trained:
    model: cm.ContentModel
    full: Scores | None
    quantized: Scores | None
    held_out: list[tuple[str, str]]
    predicted: list[str]
    """The quantized model's labels of the held-out examples (the reference's arithmetic)."""
    train_size: int


def quantized_labels(model: cm.ContentModel, counts, n: np.ndarray) -> list[str]:
    """The reference's label of each row: logit = bias + (scale * S) / n, S exact integers (section 4)."""
    sums = np.asarray((counts @ model.weights.astype(np.int64)))
    logits = np.array(model.bias) + (model.scale * sums.astype(np.float64)) / np.maximum(n, 1)[:, None]
    win = np.argmax(logits, axis=1)  # the first maximum: ties to the lowest label
    return [model.labels[w] if k else NO_LABEL for w, k in zip(win, n)]


def train(examples: Sequence[tuple[str, str]], spec: FeatureSpec = FeatureSpec(), *, holdout: float = 0.2, seed: int = 0,
          c: float = 1000.0, max_iter: int = 3000) -> Trained:
    """Train on a split of `examples`; the model is the one the held-out scores are of."""
    from sklearn.linear_model import LogisticRegression

    labels = sorted({lab for _, lab in examples})
    if not cm.MIN_LABELS <= len(labels) <= cm.MAX_LABELS:
        raise ExamplesError(f"{len(labels)} labels; a model has {cm.MIN_LABELS} to {cm.MAX_LABELS}")
    for lab in labels:
        if not re.fullmatch(cm.LABEL, lab):
            raise ExamplesError(f"label `{lab}`: 1-64 characters of [A-Za-z0-9_-] (it is named in rules)")
    tr, te = split(examples, holdout, seed)
    if len({lab for _, lab in tr}) != len(labels):
        raise ExamplesError("every label needs examples in the training split")
    counts, n = bucket_counts([t for t, _ in tr], spec)
    from threadpoolctl import threadpool_limits

    lr = LogisticRegression(C=c, max_iter=max_iter, random_state=seed)
    # One BLAS thread: several times faster here than threads fighting over two cores, and the
    # same fit on every machine.
    with threadpool_limits(1):
        lr.fit(normalized(counts, n), [lab for _, lab in tr])
    assert list(lr.classes_) == labels
    coef, intercept = lr.coef_, lr.intercept_
    if len(labels) == 2:  # sklearn's binary form: one row for the second label; the first's logit is 0
        coef, intercept = np.vstack([np.zeros_like(coef), coef]), np.concatenate([[0.0], intercept])
    model = cm.quantize(coef.T, intercept, labels, word_ngrams=spec.word_ngrams, char_ngrams=spec.char_ngrams,
                        max_text_bytes=spec.max_text_bytes)
    if not te:
        return Trained(model, None, None, [], [], len(tr))
    tcounts, tn = bucket_counts([t for t, _ in te], spec)
    truth = [lab for _, lab in te]
    full = [str(p) for p in lr.predict(normalized(tcounts, tn))]
    pred = quantized_labels(model, tcounts, tn)
    return Trained(model, scores(truth, full, labels), scores(truth, pred, labels), list(te), pred, len(tr))


# ---- the filter's own classifier, natively ---------------------------------------------------------

CONTENT_EVAL = REPO_ROOT / "filter" / "target" / "release" / "examples" / "content_eval"


def _cargo() -> str | None:
    # rustup's cargo (the native toolchain); /usr/bin/cargo is Debian's, for the wasm32 build.
    home = Path(os.environ.get("CARGO_HOME", Path.home() / ".cargo")) / "bin" / "cargo"
    return str(home) if home.exists() else shutil.which("cargo")


def content_eval_binary(build: bool = True) -> Path:
    """filter/target/release/examples/content_eval, built first (incremental) when cargo is here."""
    cargo = _cargo()
    if build and cargo is not None:
        r = subprocess.run([cargo, "build", "--release", "--quiet", "--example", "content_eval"], cwd=REPO_ROOT / "filter",
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"cargo build --example content_eval failed:\n{r.stderr[-3000:]}")
    if not CONTENT_EVAL.exists():
        raise FileNotFoundError(f"{CONTENT_EVAL} is not built: cd filter && cargo build --release --example content_eval")
    return CONTENT_EVAL


def native_classify(model_path: str | Path, items: Sequence[dict], build: bool = True) -> list[dict]:
    """The filter's verdict on each item (`{"text": ...}` or `{"body": {...}}`): `{"label", "score", "features"}`."""
    binary = content_eval_binary(build)
    data = "".join(json.dumps(it) + "\n" for it in items)
    r = subprocess.run([str(binary), str(model_path)], input=data, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"content_eval failed ({r.returncode}):\n{r.stderr[-3000:]}")
    out = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    if len(out) != len(items):
        raise RuntimeError(f"content_eval answered {len(out)} lines for {len(items)}:\n{r.stderr[-3000:]}")
    return out


# ---- writing the model -------------------------------------------------------------------------------

def _atomic_write(path: Path, text: str) -> None:
    """Replace `path` at once: the control plane watching a policy never reads half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_into_policy(policy_path: str | Path, model: cm.ContentModel) -> Path:
    """The model goes where the policy says: the file its `content_model: {file: …}` names, else
    inline (a top-level `content_model:` replaced or added, the rest of the text kept). The new
    policy is checked before it is written. Returns the file written."""
    from infermesh.meshconfig.policy import MAX_POLICY_BYTES, parse_policy

    p = Path(policy_path)
    text = p.read_text()
    import yaml

    data = yaml.safe_load(text) or {}
    current = data.get("content_model") if isinstance(data, dict) else None
    if isinstance(current, dict) and set(current) == {"file"} and isinstance(current["file"], str):
        # The policy as it will read with the new model, checked before the file is written.
        parse_policy(yaml.safe_dump(data | {"content_model": model.to_obj()}), str(p))
        target = p.parent / current["file"]
        _atomic_write(target, model.to_json() + "\n")
        return target
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if re.match(r"content_model\s*:", line)), None)
    entry = f"content_model: {model.to_json()}\n"
    if start is None:
        new = text + ("" if text.endswith("\n") or not text else "\n") + entry
    else:
        end = start + 1
        while end < len(lines) and (lines[end][:1] in (" ", "\t", "\n", "#") or not lines[end].strip()):
            end += 1
        new = "".join(lines[:start]) + entry + "".join(lines[end:])
    if len(new.encode()) > MAX_POLICY_BYTES:
        raise ExamplesError(f"the model inline makes the policy {len(new.encode())} bytes (at most {MAX_POLICY_BYTES}): "
                            "write it to a file (-o FILE) and name it in the policy: content_model: {file: FILE}")
    parse_policy(new, str(p))
    _atomic_write(p, new)
    return p


def evaluate(model_path: str | Path, examples: Sequence[tuple[str, str]], labels: Sequence[str], build: bool = True):
    """(Scores, confusion text, predicted labels) of the filter's own classifier on `examples`."""
    got = native_classify(model_path, [{"text": t} for t, _ in examples], build)
    pred = [g["label"] if g.get("label") is not None else NO_LABEL for g in got]
    truth = [lab for _, lab in examples]
    return scores(truth, pred, labels), confusion(truth, pred, labels), pred
