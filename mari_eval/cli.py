"""``mari-eval``: the project's command line.

    mari-eval materialize [ALIAS ...]          build the embedded models' safetensors directories
    mari-eval splits --dataset truthfulqa --seed 0 [--out FILE]
                                               print or write the paper's splits as example ids

Evaluation itself goes through lm-eval: ``lm_eval --model mari --model_args ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _materialize(args: argparse.Namespace) -> int:
    from mari_eval.models import EMBEDDED, materialize

    for alias in args.alias or list(EMBEDDED):
        if alias not in EMBEDDED:
            print(f"error: unknown embedded model '{alias}'; known: {', '.join(EMBEDDED)}", file=sys.stderr)
            return 2
        print(f"{alias}: {materialize(alias, force=args.force)}")
    return 0


def _splits(args: argparse.Namespace) -> int:
    from mari_eval.data import make_splits

    splits = make_splits(args.dataset, args.seed)
    text = json.dumps({**splits.to_json(), "fingerprint": splits.fingerprint()}, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        sizes = {k: len(getattr(splits, k)) for k in ("pca", "train", "ctrl", "ctrl_arc", "test")}
        print(f"wrote {args.out}: {sizes}")
    else:
        print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mari-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("materialize", help="build the embedded models' safetensors directories (once)")
    p.add_argument("alias", nargs="*", help="embedded model aliases (default: all)")
    p.add_argument("--force", action="store_true", help="rebuild even if present")
    p.set_defaults(run=_materialize)

    p = sub.add_parser("splits", help="the paper's data splits (Appendix B) as example ids")
    p.add_argument("--dataset", required=True, choices=["truthfulqa", "bbq", "sorry_bench"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write JSON here instead of printing it")
    p.set_defaults(run=_splits)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
