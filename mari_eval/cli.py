"""``mari-eval``: the project's command line. ``mari-eval --help`` lists every command with one
line each (``build_parser``); ``mari-eval COMMAND --help`` describes one.

Evaluation itself goes through lm-eval: ``lm_eval --model mari --model_args ...``.
"""

from __future__ import annotations

import argparse
import json
import sys

from mari_eval import cli_generate  # light: the seed's type; the generate command
from mari_eval.methods import options
from mari_eval.cli_generate import key_values


def _materialize(args: argparse.Namespace) -> int:
    from mari_eval.storage.models import (EMBEDDED,  # deferred: keeps this module light (start-up, `mari-eval --help`)
                                  materialize)

    for alias in args.alias or list(EMBEDDED):
        if alias not in EMBEDDED:
            print(f"error: unknown embedded model '{alias}'; known: {', '.join(EMBEDDED)}", file=sys.stderr)
            return 2
        print(f"{alias}: {materialize(alias, force=args.force)}")
    return 0


def _splits(args: argparse.Namespace) -> int:
    from mari_eval.benchmarks.data_splits import make_splits  # deferred: keeps this module light (start-up, `mari-eval --help`)

    splits = make_splits(args.dataset, args.seed)
    text = json.dumps({**splits.to_json(), "fingerprint": splits.fingerprint()}, indent=2)
    if args.out:
        from mari_eval.storage.files import atomic_write  # deferred: keeps this module light (start-up, `mari-eval --help`)

        atomic_write(args.out, text + "\n")  # whole or not at all; a failure names --out's path
        sizes = {k: len(getattr(splits, k)) for k in ("pca", "train", "ctrl", "ctrl_arc", "ctrl_mmlu", "test")}
        print(f"wrote {args.out}: {sizes}")
    else:
        print(text)
    return 0


def _train(args: argparse.Namespace) -> int:
    import logging  # deferred: keeps this module light (start-up, `mari-eval --help`)

    from mari_eval.methods.bundle_spec import check_bundle_out  # deferred: keeps `mari-eval --help` light
    from mari_eval.injection.devices import Placement  # deferred: keeps this module light (start-up, `mari-eval --help`)
    from mari_eval.training.train import train  # deferred: keeps this module light (start-up, `mari-eval --help`)

    check_bundle_out(args.out, args.force)  # a trained bundle there is replaced only with --force

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    hp = {"K": args.K, "rank": args.rank, "epochs": args.epochs, "lr": args.lr, "rho": args.rho, "recipe": args.recipe}
    for key, value in key_values(args.set).items():
        if hp.get(key) is not None:
            raise ValueError(f"{key} given twice (--{key} and --set {key}=): give it once")
        hp[key] = options.set_value(key, value)  # JSON, numbers read as typed (mari_eval/storage/numbers.py)
    if args.single:
        hp["single"] = True
    if args.recipe is None:  # a baseline's recipe: the tables' unless --recipe says otherwise
        from mari_eval.methods import method_class  # deferred: keeps this module light

        cls = method_class(args.method)
        if cls.command_line_recipe:
            hp["recipe"] = cls.command_line_recipe
            print(f"training {cls.label}'s {cls.command_line_recipe} recipe, the one the tables score (--recipe adapted: "
                  "this suite's validated grid; docs/baselines.md)", file=sys.stderr)
    hp = {k: v for k, v in hp.items() if v is not None}
    placement = Placement(dtype=args.dtype, device=args.device, device_map=args.device_map,
                          max_memory_per_gpu=args.max_memory_per_gpu, max_cpu_memory=args.max_cpu_memory)
    path = train(args.method, args.attribute, args.model, args.seed, args.out, layer=args.layer,
                 max_train=args.max_train, max_ctrl=args.max_ctrl, max_pca=args.max_pca, hyperparameters=hp,
                 placement=placement, max_memory=args.max_memory)
    print(f"bundle: {path}")
    return 0


def _judge(args: argparse.Namespace) -> int:
    import logging  # deferred: keeps this module light (start-up, `mari-eval --help`)

    from mari_eval.judge.samples import (judge_file,  # deferred: keeps this module light (start-up, `mari-eval --help`)
                                         print_result)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # not every HTTP request
    logging.getLogger("mari_eval").setLevel(logging.INFO)
    if args.forget_cached:
        import os  # deferred: keeps `mari-eval --help` light

        from mari_eval.judge import ENV_MODEL, JudgeCache  # deferred: keeps `mari-eval --help` light

        model = args.model or os.environ.get(ENV_MODEL)
        if not model:
            raise SystemExit(f"mari-eval judge --forget-cached: name the judge whose verdicts to remove, --model NAME "
                             f"(or {ENV_MODEL})")
        cache = JudgeCache(args.cache)
        print(f"removed {cache.forget(model)} cached verdict(s) of judge {model!r} from {cache.path}")
        if args.samples is None:
            return 0
    elif args.samples is None:
        raise SystemExit("mari-eval judge: give SAMPLES (a samples_sorry_bench*.jsonl or generations file), "
                         "or --forget-cached to clear a judge's cached verdicts")
    result = judge_file(args.samples, base_url=args.base_url, model=args.model, cache=args.cache, prompt=args.prompt,
                        out=args.out, local=args.local)
    print_result(result)
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _push(args: argparse.Namespace) -> int:
    from mari_eval.methods.hub import push  # deferred: keeps this module light (start-up, `mari-eval --help`)

    pushed = push(args.bundle, args.repo, revision=args.revision, private=args.private,
                  commit_message=args.commit_message, to_dir=args.to_dir)
    if args.to_dir:
        print(f"wrote {', '.join(pushed.files)} to {pushed.where}; nothing was uploaded")
    else:
        print(f"pushed {', '.join(pushed.files)} as commit {pushed.commit}")
        print(f"evaluate this version with --model_args bundle={pushed.where}")
    return 0


def _import_vector(args: argparse.Namespace) -> int:
    from mari_eval.methods.bundle_spec import check_bundle_out  # deferred: keeps `mari-eval --help` light
    from mari_eval.vectors.control_vector import import_gguf  # deferred: keeps this module light (start-up, `mari-eval --help`)

    check_bundle_out(args.out, args.force)  # a bundle there is replaced only with --force
    from mari_eval.vectors.pyreft_save import is_pyreft_save, run_import  # deferred: keeps this module light
    if args.positions is not None or is_pyreft_save(args.file):  # a pyreft save folder (mari_eval/vectors/pyreft_save.py)
        return run_import(args)
    from mari_eval.vectors.vector_sign import SignCheck  # deferred: as above
    check = SignCheck(args.model, args.sign_check) if args.sign_check else None  # measured before anything is written
    if args.file.lower().endswith((".pt", ".pth", ".csv")):  # lm-eval's steered config or SAE CSV (FILE.PT too)
        from mari_eval.vectors.steer_config import import_steer_file  # deferred: keeps this module light

        if args.scale != 1.0 or args.allow_other_model:
            raise ValueError("--scale and --allow-other-model apply to GGUF vectors: an lm-eval steering config keeps its "
                             "own steering_coefficient (scale=S at evaluation multiplies it)")
        path = import_steer_file(args.file, args.model, args.out)
    else:
        path = import_gguf(args.file, args.model, args.out, scale=args.scale, allow_other_model=args.allow_other_model)
    print(f"bundle: {path}")
    if check is not None:
        print(check.apply(path))
    print(f"evaluate it with --model mari --model_args pretrained={args.model},bundle={path} (scale=S multiplies it)")
    return 0


def _combine(args: argparse.Namespace) -> int:
    from mari_eval.methods.bundle_spec import check_bundle_out  # deferred: keeps `mari-eval --help` light
    from mari_eval.vectors.combine import combine  # deferred: as above

    check_bundle_out(args.out, args.force)
    path = combine(args.terms, args.out, args.model)
    print(f"bundle: {path} (a control vector: every position; positions=from_last at evaluation for CAA's place)")
    return 0


def _export_vector(args: argparse.Namespace) -> int:
    from mari_eval.vectors.control_vector import (  # deferred: keeps this module light (start-up, `mari-eval --help`)
        EVERY_POSITION, export_gguf)

    exported = export_gguf(args.bundle, args.file, model_hint=args.model_hint, force=args.force)
    names = ", ".join(f"direction.{layer}" for layer in exported.layers)
    print(f"control vector: {exported.path} ({names}; model hint {exported.model_hint!r})")
    if exported.positions != EVERY_POSITION:
        print(f"note: the {exported.method} bundle adds it at {exported.positions}; llama.cpp adds a control vector at "
              "every position of every token (the whole prompt too), so its outputs differ from this bundle's scores")
    print(f"load it with llama.cpp: --control-vector {exported.path} (or --control-vector-scaled {exported.path}:S, "
          "S the strength; older builds took FILE S)")
    return 0


def _lora_peft():
    import importlib  # deferred: keeps this module light (start-up, `mari-eval --help`)

    from mari_eval.methods.registry import _baselines_package  # deferred: mari_eval never imports baselines/ at the top

    return importlib.import_module(f"{_baselines_package()}.lora_peft")


def _import_lora(args: argparse.Namespace) -> int:
    from mari_eval.methods.bundle_spec import check_bundle_out  # deferred: keeps `mari-eval --help` light

    check_bundle_out(args.out, args.force)  # a bundle there is replaced only with --force
    path = _lora_peft().import_peft(args.adapter, args.model, args.out, allow_other_model=args.allow_other_model)
    print(f"bundle: {path}")
    print(f"evaluate it with --model mari --model_args pretrained={args.model},bundle={path}")
    return 0


def _export_lora(args: argparse.Namespace) -> int:
    path = _lora_peft().export_peft(args.bundle, args.out)
    print(f"peft adapter: {path}")
    print(f"load it with PeftModel.from_pretrained(model, {str(path)!r})")
    return 0


def _methods(args: argparse.Namespace) -> int:
    from mari_eval.methods import registry  # deferred: keeps this module light (start-up, `mari-eval --help`)

    for name, source in registry.method_sources().items():
        print(f"{name:16} {source}")
    return 0


def _import_arguments(parser: argparse.ArgumentParser, what: str, other: str) -> None:
    """--model, --out, --force and --allow-other-model of the import commands."""
    parser.add_argument("--model", required=True, help=f"the model {what}: embedded alias, Hub id or local directory")
    parser.add_argument("--out", required=True, help="bundle directory to write")
    parser.add_argument("--force", action="store_true", help="replace the bundle already at --out")
    parser.add_argument("--allow-other-model", action="store_true", help=f"import {other} (a warning, not an error)")


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype, --device, --device-map and the memory caps (``devices.Placement``), shared with repro/."""
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the frozen model's dtype (default auto: the checkpoint's, as lm-eval's --model hf); "
                             "trained parameters stay float32")
    parser.add_argument("--device", help="cuda, cuda:1, cpu... (default: cuda when available, else cpu)")
    parser.add_argument("--device-map", choices=["auto"],
                        help="auto: spread the model over the GPUs, then CPU and disk (accelerate; lm-eval's parallelize=True)")
    parser.add_argument("--max-memory-per-gpu", help="with --device-map auto: cap per GPU, e.g. 70GiB")
    parser.add_argument("--max-cpu-memory", help="with --device-map auto: cap on the CPU before offloading to disk, e.g. 100GiB")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mari-eval", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MARI's evaluation suite: train steering bundles, share them, judge generations.",
        epilog="Evaluation goes through lm-eval: lm_eval --model mari --model_args pretrained=...,bundle=...\n"
               "`mari-eval COMMAND --help` describes a command.")
    # One line per command in --help: keep each help= short (argparse wraps at the terminal's width).
    sub = parser.add_subparsers(dest="command", required=True, title="commands")

    p = sub.add_parser("materialize", help="build the embedded models' directories (once)")
    p.add_argument("alias", nargs="*", help="embedded model aliases (default: all)")
    p.add_argument("--force", action="store_true", help="rebuild even if present")
    p.set_defaults(run=_materialize)

    p = sub.add_parser("splits", help="print or write the paper's splits as example ids")
    p.add_argument("--dataset", required=True, choices=["truthfulqa", "bbq", "sorry_bench"])
    p.add_argument("--seed", type=options.seed, default=0)
    p.add_argument("--out", help="write JSON here instead of printing it")
    p.set_defaults(run=_splits)

    p = sub.add_parser("train", help="train a method on an attribute, save a bundle")
    p.add_argument("--method", default="mari",
                   help="mari (default), a baseline (caa, iti, nl_iti, reft, lora, prompting) or any method an installed "
                        "package declares (`mari-eval methods` lists them; docs/plugins.md)")
    p.add_argument("--attribute", required=True, choices=["truthfulqa", "bbq", "sorry_bench"])
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded alias, Hub id or local directory")
    p.add_argument("--seed", type=options.seed, default=0, help="split and initialisation seed")
    p.add_argument("--out", required=True, help="bundle directory to write")
    p.add_argument("--force", action="store_true", help="replace the bundle already at --out")
    p.add_argument("--layer", type=options.INTEGER_FLAG, help="injection layer l* (default: num_layers // 2)")
    p.add_argument("--K", type=options.INTEGER_FLAG, help="number of experts (MARI; default 4)")
    p.add_argument("--rank", type=options.INTEGER_FLAG, help="adapter rank (default 4)")
    p.add_argument("--epochs", type=options.INTEGER_FLAG)
    p.add_argument("--lr", type=options.NUMBER_FLAG)
    p.add_argument("--rho", type=options.NUMBER_FLAG, help="gate quantile (default 0.9; can be changed at evaluation)")
    p.add_argument("--max-train", type=options.INTEGER_FLAG, help="train on at most this many D_train examples (seeded subset)")
    p.add_argument("--max-ctrl", type=options.INTEGER_FLAG, help="calibrate on at most this many examples per control source (smoke runs)")
    p.add_argument("--max-pca", type=options.INTEGER_FLAG, help="fit the PCA subspace on at most this many D_pca prompts (smoke runs)")
    p.add_argument("--single", action="store_true",
                   help="MARI: also train a single adapter (evaluate it with experts=single)")
    p.add_argument("--recipe", choices=["adapted", "published"],
                   help="CAA, ITI, NL-ITI, ReFT: published (default: their authors' recipe, the one the tables score) "
                        "or adapted (this suite's validated grid); docs/baselines.md")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other hyperparameter, e.g. --set lambda_bal=0.5")
    add_placement_arguments(p)
    p.add_argument("--max-memory", help="what training may keep of the frozen model's work, e.g. 40GiB (default: half "
                                        "the site device's free memory); beyond it caches are recomputed, not kept")
    p.set_defaults(run=_train)

    p = sub.add_parser("judge", help="judge saved SORRY-Bench responses, print metrics",
                       description="Judge the responses of a SORRY-Bench run saved in SAMPLES (lm_eval --log_samples "
                                   "output, e.g. of a --predict_only run, or the generations file a judge error names) "
                                   "with the judge MARI_JUDGE_* configures, through the same cache, and print the "
                                   "metrics the task reports; verdicts scored where possible (docs/judge.md). The API "
                                   "key comes from MARI_JUDGE_API_KEY (else OPENAI_API_KEY), never from the command line.")
    p.add_argument("samples", nargs="?", help="samples_sorry_bench*.jsonl, or a generations file")
    p.add_argument("--forget-cached", action="store_true",
                   help="first remove every cached verdict of the judge --model (or $MARI_JUDGE_MODEL) names, e.g. "
                        "after finding that its server answered with another model; then judge SAMPLES, if given, "
                        "afresh")
    p.add_argument("--base-url", help="the judge's OpenAI-compatible /v1 URL (default: $MARI_JUDGE_BASE_URL)")
    p.add_argument("--model", help="the judge's served model name (default: $MARI_JUDGE_MODEL)")
    p.add_argument("--local", metavar="MODEL", help="judge in this process, verdicts scored (default with no server "
                   "configured: smollm2-135m-instruct)")
    p.add_argument("--cache", help="the verdict cache file (default: $MARI_JUDGE_CACHE, else the user cache)")
    p.add_argument("--prompt", help="judge prompt name (default: $MARI_JUDGE_PROMPT, else base-#thescore when available)")
    p.add_argument("--out", help="also write the metrics and the per-category summary here as JSON")
    p.set_defaults(run=_judge)

    p = sub.add_parser("push", help="upload a bundle to a Hugging Face Hub repository",
                       description="Upload the bundle directory BUNDLE to the Hub repository REPO with huggingface_hub "
                                   "(HfApi.upload_folder; the token from `hf auth login` or HF_TOKEN). The bundle is "
                                   "loaded and checked first, from the copy that is sent; a training checkpoint, a "
                                   "bundle being written or one holding other files is refused. Evaluate it with "
                                   "--model_args bundle=hf://REPO (bundle_revision=COMMIT to pin it).")
    p.add_argument("bundle", help="the bundle directory (`mari-eval train --out`)")
    p.add_argument("repo", help="org/name, hf://org/name, or hf://org/name/FOLDER for a folder of the repository")
    p.add_argument("--revision", help="the branch to commit to (created when missing; default main)")
    p.add_argument("--private", action="store_true", help="create the repository private (refused if it exists public)")
    p.add_argument("--commit-message", help="default: the method and base model")
    p.add_argument("--to-dir", metavar="DIR",
                   help="upload nothing: write into DIR (new or empty) exactly the files that would be sent")
    p.set_defaults(run=_push)

    p = sub.add_parser("import-vector", help="a GGUF, lm-eval .pt/.csv or pyreft save as a bundle",
                       description="Write the control vector FILE.gguf (repeng's ControlVector.export_gguf or llama.cpp's "
                                   "llama-cvector-generator) as a control_vector bundle for --model: direction.N is "
                                   "added to the output of decoder layer N (model.model.layers[N]) at every position, "
                                   "as llama.cpp applies it. Evaluate it with --model_args bundle=OUT (scale=S "
                                   "multiplies it); docs/methods.md. A FILE.pt (or .pth) is read as lm-eval's "
                                   "--model steered config ({hookpoint: steering_vector, steering_coefficient, action "
                                   "add or clamp, bias}), with torch.load(weights_only=True), as a steered_config bundle "
                                   "that edits what lm-eval's steered model edits (mari_eval/vectors/steer_config.py); a "
                                   "FILE.csv as its SAE-feature CSV, from local safetensors (mari_eval/vectors/sae_features.py).")
    p.add_argument("file", help="the control vector .gguf, lm-eval's steering config .pt, or the folder of pyreft's "
                                "ReftModel.save (LoReFT/NoReFT, as a reft bundle: mari_eval/vectors/pyreft_save.py)")
    p.add_argument("--positions", help="pyreft folder: the prompt tokens edited, fN+lM (default f7+l7)")
    _import_arguments(p, "it steers", "a vector whose model hint names another architecture")
    p.add_argument("--scale", type=options.NUMBER_FLAG, default=1.0,
                   help="the vector's strength in the bundle (llama.cpp's --control-vector-scaled; default 1)")
    p.add_argument("--sign-check", nargs=2, action="append", metavar=("POSITIVE", "NEGATIVE"), help="flip each added "
                   "direction the prompts' states say points away from POSITIVE (repeatable; mari_eval/vectors/vector_sign.py)")
    p.set_defaults(run=_import_vector)

    p = sub.add_parser("combine", help="sum steering vectors, with weights, into one bundle",
                       description="Write the weighted sum of TERMs (PATH[:WEIGHT]: a .gguf control vector or a bundle "
                                   "that adds fixed directions, CAA or a control vector; weight 1 by default) as one "
                                   "control_vector bundle: after each layer any term names, the sum of weight x its "
                                   "direction, at every position (mari_eval/vectors/combine.py).")
    p.add_argument("terms", nargs="+", metavar="TERM", help="PATH[:WEIGHT], e.g. happy.gguf:1 bundles/caa-tqa-s0:-0.5")
    p.add_argument("--out", required=True, help="bundle directory to write")
    p.add_argument("--model", help="the model (default: the first bundle term's base model; GGUF terms alone need it)")
    p.add_argument("--force", action="store_true", help="replace the bundle already at --out")
    p.set_defaults(run=_combine)

    p = sub.add_parser("export-vector", help="a CAA bundle as a GGUF control vector (llama.cpp)",
                       description="Write BUNDLE as the GGUF control vector FILE.gguf that llama.cpp loads "
                                   "(--control-vector) and repeng reads: direction.N is what the bundle adds, at "
                                   "scale=1, to the output of decoder layer N (model.model.layers[N]); a direction at "
                                   "layer 0 is refused (llama.cpp cannot load it). Methods that add fixed directions "
                                   "can be exported: caa, control_vector; others (mari, iti, reft, lora, prompting) "
                                   "are refused. Positions differ: llama.cpp adds the vector at every position of "
                                   "every token, the prompt's included, while a CAA bundle adds it from the last "
                                   "prompt token on, so llama.cpp's outputs are not this bundle's scores; "
                                   "docs/methods.md.")
    p.add_argument("bundle", help="the bundle directory")
    p.add_argument("file", help="the .gguf file to write")
    p.add_argument("--model-hint", help="controlvector.model_hint to write (default: the Hugging Face model_type of "
                                        "the bundle's base model, or an imported vector's own hint)")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.set_defaults(run=_export_vector)

    cli_generate.add_parser(sub)

    p = sub.add_parser("import-lora", help="import a peft LoRA adapter directory as a lora bundle",
                       description="Write the peft LoRA adapter in ADAPTER_DIR (adapter_config.json and "
                                   "adapter_model.safetensors, as PeftModel.save_pretrained writes them; never a pickle) "
                                   "as a lora bundle for --model. What a lora bundle cannot hold exactly (DoRA, biases, "
                                   "modules_to_save, per-module ranks, non-Linear targets) is refused. Evaluate it with "
                                   "--model_args bundle=OUT; docs/baselines.md.")
    p.add_argument("adapter", help="the peft adapter directory")
    _import_arguments(p, "it adapts", "an adapter whose base_model_name_or_path names another model")
    p.set_defaults(run=_import_lora)

    p = sub.add_parser("export-lora", help="write a lora bundle as a peft LoRA adapter directory",
                       description="Write the lora bundle BUNDLE as a peft adapter directory (adapter_config.json, "
                                   "adapter_model.safetensors under peft's own tensor names): "
                                   "PeftModel.from_pretrained(model, DIR) then computes what the bundle computes.")
    p.add_argument("bundle", help="the lora bundle directory")
    p.add_argument("--out", required=True, help="adapter directory to write (new, or holding only an adapter)")
    p.set_defaults(run=_export_lora)

    p = sub.add_parser("methods", help="list the methods: built-in and installed packages'")
    p.set_defaults(run=_methods)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError, ImportError, OSError, ArithmeticError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
