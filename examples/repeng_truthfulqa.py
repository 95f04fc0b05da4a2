"""A control vector trained by repeng (Vogel, 2024) on this suite's TruthfulQA training split, exported
by repeng as GGUF, imported and scored beside Vanilla on the held-out questions (issue 39: a vector
made outside this repository reaches the main table with no line of ours changed).

    python examples/repeng_truthfulqa.py --out runs/imported/repeng-tqa-s0.gguf
    mari-eval import-vector runs/imported/repeng-tqa-s0.gguf --model smollm2-135m-instruct \
        --out runs/imported/repeng-tqa-s0
    mari-eval import-vector runs/imported/repeng-tqa-s0.gguf --model smollm2-135m-instruct --scale 8 \
        --out runs/imported/repeng-tqa-s0-x8
    python repro/main_table.py --profile standard --methods vanilla --extra-bundle repeng=runs/imported/repeng-tqa-s0 \
        --extra-bundle repeng_x8=runs/imported/repeng-tqa-s0-x8 --columns tqa_mc1,tqa_mc2 --seeds 0 \
        --out results/repeng_vector

What repeng is given, fixed before anything was scored: the main table's training questions for
the seed (D_train of ``make_splits("truthfulqa", seed)``, the same seeded subset of the standard
profile's ``max_train`` that the committed table's rows train on), each as a contrast pair written as
TruthfulQA's prompts write a question ("Q: ...\\nA: ..."): positive with the question's first
correct answer, negative with its first incorrect one (mc1_targets). Everything else is repeng's
default: ``ControlVector.train`` (PCA of the paired differences, ``pca_diff``) on the last
token's hidden state of every layer but the first, and the strength it is applied with is 1
(``mari-eval import-vector``'s default ``--scale``). No held-out question is read. The second
row, the same vector at strength 8, was added after the first showed no change (repeng's
directions are unit vectors, small beside this model's hidden states): read it as exploration,
not as a setting fixed in advance.

repeng 0.4.0 declares numpy<2 and names ``np.float_`` (removed in NumPy 2) in type annotations of
``ControlVector``; nothing else it runs needs NumPy 1, so the name is given back before it is
imported (``_import_repeng``). Install it beside this suite with ``pip install --no-deps
repeng==0.4.0`` (``make install`` does).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from mari_eval.benchmarks import data, data_splits
from mari_eval.storage.models import resolve_model
from repro.engine.profiles import PROFILES


def _import_repeng():
    import numpy as np

    if not hasattr(np, "float_"):  # NumPy 2 removed the alias that repeng 0.4.0's annotations name
        np.float_ = np.float64
    import repeng

    return repeng


def contrast_pairs(seed: int, max_train: int | None) -> list[tuple[str, str]]:
    """(positive, negative) texts of the seed's TruthfulQA D_train questions (the profile's subset)."""
    splits = data_splits.make_splits("truthfulqa", seed)
    train = list(splits.train)
    if max_train is not None and len(train) > max_train:  # as mari_eval.training.examples.attribute_data draws it
        train = random.Random(f"max_train:{seed}").sample(train, max_train)
    records = {r["id"]: r for r in data.load_truthfulqa_mc()}
    pairs = []
    for question_id in train:
        record = records[question_id]
        targets = record["mc1_targets"]
        correct = targets["choices"][targets["labels"].index(1)]
        wrong = targets["choices"][targets["labels"].index(0)]
        prompt = f"Q: {record['question']}\nA: "
        pairs.append((prompt + correct, prompt + wrong))
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="embedded alias, Hub id or directory")
    parser.add_argument("--seed", type=int, default=0, help="whose D_train (make_splits) the pairs come from")
    parser.add_argument("--profile", default="standard", choices=sorted(PROFILES), help="whose max_train subset")
    parser.add_argument("--out", required=True, type=Path, help="the .gguf file repeng writes")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repeng = _import_repeng()
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:  # repeng pads its batches
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pairs = contrast_pairs(args.seed, PROFILES[args.profile].max_train.get("truthfulqa"))
    dataset = [repeng.DatasetEntry(positive=p, negative=n) for p, n in pairs]
    vector = repeng.ControlVector.train(model, tokenizer, dataset)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    vector.export_gguf(str(args.out))
    print(f"{args.out}: repeng vector of {len(vector.directions)} layers from {len(pairs)} TruthfulQA D_train pairs "
          f"(seed {args.seed}); import it with `mari-eval import-vector {args.out} --model {args.model} --out DIR`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
