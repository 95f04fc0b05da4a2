"""``mari-eval generate``'s command line (the work: mari_eval/evaluation/side_by_side.py), and ``--set KEY=VALUE``
as the commands read it. Light: `mari-eval --help` imports it."""

from __future__ import annotations

import argparse

from mari_eval.methods import options

DTYPES = ("auto", "float32", "bfloat16", "float16")  # the model's dtypes a command takes (auto: the checkpoint's)


def key_values(items: list[str] | None) -> dict[str, str]:
    """``--set KEY=VALUE`` items as {KEY: VALUE}; an item without "=" or a key given twice is refused
    (never the last one kept silently)."""
    found: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        if key in found:
            raise ValueError(f"--set {key}= given twice ({found[key]!r} and {value!r}): give each key once")
        found[key] = value
    return found


def run(args: argparse.Namespace) -> int:
    from mari_eval.evaluation import side_by_side  # deferred: keeps this module light (start-up, `mari-eval --help`)

    settings = side_by_side.GenerationSettings(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    given = key_values(args.set)
    if args.scale is not None:
        if "scale" in given:
            raise ValueError("scale given twice (--scale and --set scale=): give it once")
        given["scale"] = args.scale
    side_by_side.run(args.bundle, args.prompt, args.model, given, settings, args.compare, args.dtype, args.device)
    return 0


def add_parser(sub) -> None:
    """The ``generate`` subcommand, on ``mari-eval``'s subparsers ``sub``."""
    p = sub.add_parser("generate", help="stream a bundle's answer to a prompt (--compare)",
                       description="Decode PROMPT with BUNDLE's method as lm-eval's generation does (one user turn of the "
                                   "chat template where the model has one; MARI's gate and routing; the gate's verdict "
                                   "and the chosen expert printed after the answer). --compare first decodes the untouched "
                                   "model's answer from the same loaded model. Greedy unless --temperature > 0.")
    p.add_argument("bundle", help="a bundle directory or a Hub repository (hf://...)")
    p.add_argument("prompt", help="the user's message")
    p.add_argument("--model", help="the model to steer (default: the one the bundle was trained on)")
    p.add_argument("--compare", action="store_true", help="the untouched model's answer first, then the bundle's")
    p.add_argument("--scale", help="the method's scale= option (vector methods: the multiplier; 0 is the plain model)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="another evaluation option (T_ent=3, gate=false)")
    p.add_argument("--max-new-tokens", type=options.positive_int, default=64, help="answer length in tokens (64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's p, with --temperature")
    p.add_argument("--seed", type=options.seed, default=0, help="the sampling seed")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="the model's dtype (auto: the checkpoint's)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.set_defaults(run=run)
