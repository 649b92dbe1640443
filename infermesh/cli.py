"""The `infermesh` command line."""

from __future__ import annotations

import argparse
import sys


def _cmd_models_build(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .models import build_all

    build_all(Path(args.dir) if args.dir else None, force=args.force)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infermesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="local model checkpoints")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    build = models_sub.add_parser("build", help="build the small local checkpoints (idempotent)")
    build.add_argument("--dir", help="output directory (default: $INFERMESH_HOME/models)")
    build.add_argument("--force", action="store_true", help="rebuild even if up to date")
    build.set_defaults(func=_cmd_models_build)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
