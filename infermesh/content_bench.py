"""`infermesh classes bench`: the content classifier measured on text nobody in this project wrote,
the English conversations of the `chatterbot-corpus` package (PyPI), each statement labelled with
its file's category (docs/content-classes.md has the numbers and what they can and cannot show).

On one stratified held-out split (seed given): a majority-class baseline, a keyword-rule baseline
(per label the words a person would pick from the training split: the most frequent words found
in that label's statements 60 % of the time or more), the full-precision model (scikit-learn) and
the int8 model, the latter scored by the filter's own classifier (content_eval, natively) and by
the Python reference, which must agree on every label. Also the model's JSON size.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Sequence

from infermesh.meshconfig import content_model as cm

from .content_training import FeatureSpec, bucket_counts, evaluate, quantized_labels, scores, split, train

# The 16 largest categories (a model holds at most 16 labels); left out: botprofile (the bot's
# persona), food (34 statements), politics (30), history (16), health (9).
CATEGORIES = ("tech_support", "trivia", "coding", "emotion", "ai", "conversations", "psychology", "literature", "humor",
              "money", "science", "greetings", "sports", "movies", "computers", "gossip")


def corpus() -> list[tuple[str, str]]:
    """(statement, category) of every statement of the English files above; a statement that
    appears under two categories is left out (it has no one label), repeats within one are kept once."""
    import chatterbot_corpus
    import yaml

    root = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    seen: dict[str, set[str]] = defaultdict(set)
    order: list[str] = []
    for cat in CATEGORIES:
        doc = yaml.safe_load((root / f"{cat}.yml").read_text(encoding="utf-8"))
        for conv in doc.get("conversations") or []:
            for s in conv:
                s = str(s).strip()
                if s and s not in seen:
                    order.append(s)
                seen[s].add(cat) if s else None
    return [(s, next(iter(seen[s]))) for s in order if len(seen[s]) == 1]


def write_examples(path: str | Path, code_vs_chat: bool = False) -> int:
    """The corpus as EXAMPLES.jsonl for `classes train`; `code_vs_chat`: two labels, `code` (the
    coding category) and `chat` (the rest), the model of e2e/policy-content-e2e.yaml."""
    rows = [(t, ("code" if lab == "coding" else "chat") if code_vs_chat else lab) for t, lab in corpus()]
    Path(path).write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows))
    return len(rows)


def words(text: str) -> set[str]:
    return {t.decode("utf-8", "replace") for t in cm.tokens(text.encode("utf-8"))}


def keyword_rules(train_set: Sequence[tuple[str, str]], per_label: int = 8, min_count: int = 3, precision: float = 0.6) -> dict[str, list[str]]:
    """Per label, its most frequent words (in at least `min_count` of its statements) that are
    found in that label's statements at least `precision` of the times they are found at all."""
    in_label: dict[str, Counter] = defaultdict(Counter)
    overall: Counter = Counter()
    for text, lab in train_set:
        ws = words(text)
        in_label[lab].update(ws)
        overall.update(ws)
    rules = {}
    for lab, c in in_label.items():
        good = [w for w, k in c.most_common() if k >= min_count and k / overall[w] >= precision]
        rules[lab] = good[:per_label]
    return rules


def keyword_predict(rules: dict[str, list[str]], text: str, fallback: str) -> str:
    """The label with the most of its keywords in the text (the first of equals in `rules`'
    order); none: `fallback` (the majority label)."""
    ws = words(text)
    best, hits = fallback, 0
    for lab, kws in rules.items():
        k = sum(w in ws for w in kws)
        if k > hits:
            best, hits = lab, k
    return best


def run(quick: bool = False, seed: int = 0, json_out: str | None = None, say=print) -> int:
    data = corpus()
    labels = sorted({lab for _, lab in data})
    spec = FeatureSpec()
    say(f"chatterbot-corpus (english): {len(data)} statements, {len(labels)} labels; held out 20 %, seed {seed}")
    tr, te = split(data, 0.2, seed)
    truth = [lab for _, lab in te]
    counts = Counter(lab for _, lab in tr)
    majority = counts.most_common(1)[0][0]
    out: dict = {"statements": len(data), "labels": labels, "train": len(tr), "held_out": len(te), "seed": seed,
                 "label_counts": dict(Counter(lab for _, lab in data).most_common())}
    out["majority"] = vars(scores(truth, [majority] * len(te), labels))
    rules = keyword_rules(tr)
    out["keywords"] = vars(scores(truth, [keyword_predict(rules, t, majority) for t, _ in te], labels))
    configs = [spec] if quick else [spec, FeatureSpec(32768, 2, (3, 5), 4096), FeatureSpec(16384, 1, (0, 0), 4096)]
    out["models"] = []
    best_native = None
    for s in configs:
        t0 = time.monotonic()
        t = train(data, s, holdout=0.2, seed=seed)
        secs = time.monotonic() - t0
        assert [x for x in t.held_out] == list(te), "the same split"
        import tempfile

        with tempfile.TemporaryDirectory(prefix="infermesh-classes-bench-") as d:
            path = Path(d) / "model.json"
            cm.save_model(t.model, path)
            native, table, pred = evaluate(path, te, t.model.labels)
        ref = quantized_labels(t.model, *bucket_counts([x for x, _ in te], s))
        agree = sum(a == b for a, b in zip(pred, ref))
        row = {"dim": s.dim, "word_ngrams": s.word_ngrams, "char_ngrams": list(s.char_ngrams), "max_text_bytes": s.max_text_bytes,
               "full_precision": vars(t.full), "int8_reference": vars(t.quantized), "int8_filter": vars(native),
               "filter_agrees_with_reference": f"{agree}/{len(pred)}", "model_json_bytes": len(t.model.to_json()),
               "train_seconds": round(secs, 1)}
        out["models"].append(row)
        if best_native is None:
            best_native = table
    say(f"majority class ({majority}):       accuracy {out['majority']['accuracy']:.3f}, macro-F1 {out['majority']['macro_f1']:.3f}")
    say(f"keyword rules (8 words a label):   accuracy {out['keywords']['accuracy']:.3f}, macro-F1 {out['keywords']['macro_f1']:.3f}")
    for r in out["models"]:
        say(f"model dim {r['dim']}, words {r['word_ngrams']}, chars {r['char_ngrams']}: "
            f"full precision acc {r['full_precision']['accuracy']:.3f} F1 {r['full_precision']['macro_f1']:.3f}; "
            f"int8 by the filter acc {r['int8_filter']['accuracy']:.3f} F1 {r['int8_filter']['macro_f1']:.3f} "
            f"(reference agrees {r['filter_agrees_with_reference']}); {r['model_json_bytes']} bytes of JSON")
    say("confusion matrix of the first model (int8, by the filter):")
    say(best_native)
    # Other splits of the first model (the held-out set is small: a few statements of the small categories).
    if not quick:
        out["other_seeds"] = []
        for other in (seed + 1, seed + 2):
            t = train(data, spec, holdout=0.2, seed=other)
            out["other_seeds"].append({"seed": other, "full_precision": vars(t.full), "int8_reference": vars(t.quantized)})
            say(f"seed {other}: full precision acc {t.full.accuracy:.3f} F1 {t.full.macro_f1:.3f}; "
                f"int8 acc {t.quantized.accuracy:.3f} F1 {t.quantized.macro_f1:.3f}")
    # The routing question of e2e/policy-content-e2e.yaml: code (the coding category) or not.
    binary = [(t, "code" if lab == "coding" else "chat") for t, lab in data]
    btr, bte = split(binary, 0.2, seed)
    btruth = [lab for _, lab in bte]
    brules = keyword_rules(btr)
    t = train(binary, FeatureSpec(4096, 2, (3, 4), 4096), holdout=0.2, seed=seed)
    out["code_vs_chat"] = {"majority": vars(scores(btruth, ["chat"] * len(bte), ["chat", "code"])),
                           "keywords": vars(scores(btruth, [keyword_predict(brules, x, "chat") for x, _ in bte], ["chat", "code"])),
                           "full_precision": vars(t.full), "int8_reference": vars(t.quantized), "model_json_bytes": len(t.model.to_json())}
    b = out["code_vs_chat"]
    say(f"code vs chat (dim 4096): majority acc {b['majority']['accuracy']:.3f} F1 {b['majority']['macro_f1']:.3f}; "
        f"keywords acc {b['keywords']['accuracy']:.3f} F1 {b['keywords']['macro_f1']:.3f}; "
        f"full precision acc {t.full.accuracy:.3f} F1 {t.full.macro_f1:.3f}; int8 acc {t.quantized.accuracy:.3f} F1 {t.quantized.macro_f1:.3f}")
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=2) + "\n")
    bad = [r for r in out["models"] if r["filter_agrees_with_reference"] != f"{len(te)}/{len(te)}"]
    return 1 if bad else 0
