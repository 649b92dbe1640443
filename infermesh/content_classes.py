"""`infermesh classes`: the content classifier's model from the user's own examples
(docs/content-classes.md, issue 32).

    infermesh classes train EXAMPLES.jsonl -o content-model.json   # or --policy POLICY.yaml
    infermesh classes eval MODEL EXAMPLES.jsonl                     # by the filter's own code
    infermesh classes bench [--quick]                               # chatterbot-corpus, against baselines

EXAMPLES.jsonl: one `{"text": ..., "label": ...}` a line. Training (content_training.py): the
reference features (meshconfig/content_model.py) as counts / n in a scipy sparse matrix,
scikit-learn's LogisticRegression (multinomial) in full precision, then int8 (scale = max|w| / 127);
held-out accuracy and macro-F1 of both and the quantized model's confusion matrix are printed.
`eval` classifies every example with the filter's code, natively (filter/examples/content_eval.rs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from infermesh.meshconfig import content_model as cm

from .content_training import ExamplesError, FeatureSpec, confusion, evaluate, read_examples, train, write_into_policy


def _model_file(path: str) -> tuple[Path, cm.ContentModel, tempfile.TemporaryDirectory | None]:
    """A model file, or a policy's content_model written to one."""
    if path.endswith((".yaml", ".yml")):
        from infermesh.meshconfig.policy import load_policy

        policy = load_policy(path)
        if policy.content_model is None:
            raise ExamplesError(f"{path}: the policy has no content_model")
        tmp = tempfile.TemporaryDirectory(prefix="infermesh-classes-")
        out = Path(tmp.name) / "content-model.json"
        cm.save_model(policy.content_model, out)
        return out, policy.content_model, tmp
    return Path(path), cm.load_model(path), None



# ---- commands ------------------------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(msg, flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    from infermesh.meshconfig.policy import PolicyError

    if not (args.output or args.policy):
        print("classes train: give -o MODEL.json or --policy POLICY.yaml", file=sys.stderr)
        return 2
    spec = FeatureSpec(args.dim, args.word_ngrams, tuple(args.char_ngrams), args.max_text_bytes)
    try:
        cm.ContentModel.from_obj(cm.quantize(np.zeros((spec.dim, 2)), [0, 0], ["a", "b"], word_ngrams=spec.word_ngrams,
                                             char_ngrams=spec.char_ngrams, max_text_bytes=spec.max_text_bytes).to_obj())
        examples = read_examples(args.examples)
        t = train(examples, spec, holdout=args.holdout, seed=args.seed, c=args.C)
    except (ExamplesError, cm.ModelError) as e:
        print(f"classes train: {e}", file=sys.stderr)
        return 2
    _say(f"{len(examples)} examples, {len(t.model.labels)} labels; trained on {t.train_size}, held out {len(t.held_out)}")
    if t.full is not None:
        _say(f"held out, full precision (scikit-learn): {t.full.line()}")
        _say(f"held out, int8 (the filter's model):     {t.quantized.line()}")
        _say(confusion([lab for _, lab in t.held_out], t.predicted, t.model.labels))
    size = len(t.model.to_json())
    try:
        if args.output:
            cm.save_model(t.model, args.output)
            _say(f"wrote {args.output} ({size} bytes of JSON)")
        if args.policy:
            where = write_into_policy(args.policy, t.model)
            _say(f"wrote the model into {where} ({size} bytes of JSON)")
    except (ExamplesError, PolicyError) as e:
        print(f"classes train: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from infermesh.meshconfig.policy import PolicyError

    tmp = None
    try:
        path, model, tmp = _model_file(args.model)
        examples = read_examples(args.examples)
        s, table, _ = evaluate(path, examples, model.labels)
    except (ExamplesError, cm.ModelError, PolicyError, OSError, RuntimeError) as e:
        print(f"classes eval: {e}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            tmp.cleanup()
    _say(f"{len(examples)} examples, by the filter's classifier (content_eval): {s.line()}")
    _say(table)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .content_bench import run, write_examples

    if args.write_examples:
        _say(f"wrote {write_examples(args.write_examples, args.code_vs_chat)} examples to {args.write_examples}")
        return 0
    return run(quick=args.quick, seed=args.seed, json_out=args.json)


def register(subparsers) -> None:
    """`infermesh classes …` (the CLI's subcommands)."""
    classes = subparsers.add_parser("classes", help="semantic classes from prompt content: the content classifier (docs/content-classes.md)")
    sub = classes.add_subparsers(dest="classes_command", required=True)
    d = FeatureSpec()
    train_p = sub.add_parser("train", help="train a content model from EXAMPLES.jsonl ({\"text\", \"label\"} a line)",
                             description="Held-out accuracy and macro-F1 of the full-precision model (scikit-learn) and of "
                                         "its int8 form (what the filter runs), and the confusion matrix.")
    train_p.add_argument("examples")
    train_p.add_argument("-o", "--output", metavar="MODEL.json", help="write the model to this file")
    train_p.add_argument("--policy", metavar="POLICY.yaml",
                         help="write the model into this policy: to the file its content_model names, else inline")
    train_p.add_argument("--dim", type=int, default=d.dim, help=f"hash buckets, a power of two (default {d.dim})")
    train_p.add_argument("--word-ngrams", type=int, choices=[1, 2], default=d.word_ngrams, help="1: words; 2: and word bigrams (default)")
    train_p.add_argument("--char-ngrams", type=int, nargs=2, metavar=("MIN", "MAX"), default=list(d.char_ngrams),
                         help="character n-grams of each word, MIN..MAX (default 3 3: trigrams; 0 0: off)")
    train_p.add_argument("--max-text-bytes", type=int, default=d.max_text_bytes, help=f"bytes of text read (default {d.max_text_bytes})")
    train_p.add_argument("--holdout", type=float, default=0.2, help="held-out fraction (default 0.2; 0: train on all)")
    train_p.add_argument("--seed", type=int, default=0)
    train_p.add_argument("--C", type=float, default=1000.0,
                         help="inverse L2 regularization of the logistic regression (default 1000: features are counts / n, small)")
    train_p.set_defaults(func=cmd_train)
    eval_p = sub.add_parser("eval", help="accuracy, macro-F1 and confusion matrix by the filter's own classifier (natively)")
    eval_p.add_argument("model", help="a model file, or a policy with a content_model")
    eval_p.add_argument("examples")
    eval_p.set_defaults(func=cmd_eval)
    bench_p = sub.add_parser("bench", help="measure on chatterbot-corpus (real text nobody here wrote) against baselines")
    bench_p.add_argument("--quick", action="store_true", help="one split, the default features only")
    bench_p.add_argument("--seed", type=int, default=0)
    bench_p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    bench_p.add_argument("--write-examples", metavar="FILE.jsonl", help="only write the corpus as examples for `classes train`")
    bench_p.add_argument("--code-vs-chat", action="store_true", help="with --write-examples: two labels, code (coding) and chat (the rest)")
    bench_p.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infermesh")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
