"""Training memory of the paper's six models, by the formula of mari_eval.training.memory.

    python repro/memory_table.py [--seed 0] [--tokenizer-model smollm2-135m-instruct]

For every attribute, the sets MARI's training prepares (D_train, then D_ctrl's attribute
and ARC-Easy sources) are tokenised by the embedded model's tokenizer (the paper's models
cannot be downloaded here; their tokenizers give other counts, so the numbers are
estimates of the right size, not exact), and for each paper model, built on the meta
device from its public configuration's shape (no weights), the training state is
computed by ``memory.estimate``: the shared preamble once, each example's own prompt
cache and its states after l*. Beside it, what the earlier code held (a whole prompt
cache per example, preamble included), and the bf16 weights. Writes
results/memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

from mari_eval.methods import options
from mari_eval.training import memory
from mari_eval.injection import site
from mari_eval.storage.files import atomic_write, write_results_json
from mari_eval import mari
from mari_eval.training.session import MAX_TOKENS
from mari_eval.training.train import Session, attribute_data
from repro.analysis.tables import markdown_table

REPO = Path(__file__).resolve().parents[1]

# Shapes from the models' public config.json files (the checkpoints repro/engine/profiles.py's paper profile names).
PAPER_SHAPES = {
    "Llama-2-7B": transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    "Llama-2-13B": transformers.LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                                            num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40),
    "Llama-3-8B": transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "Qwen2-7B": transformers.Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                         tie_word_embeddings=False),
    "Qwen2.5-14B": transformers.Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                                            num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                                            tie_word_embeddings=False),
    "Qwen2.5-32B": transformers.Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                                            num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                                            tie_word_embeddings=False),
}
ATTRIBUTES = ("truthfulqa", "bbq", "sorry_bench")


def token_counts(model_name: str, seed: int) -> dict[str, list[dict]]:
    """Per attribute, per prepared set: shared preamble tokens, own tokens and row tokens of each example."""
    session = Session(model_name, placement=None)
    out = {}
    for attribute in ATTRIBUTES:
        data = attribute_data(session, attribute, seed)
        sets = [("D_train", data.train)] + [
            (f"D_ctrl ({source})", [ex for ex, s in zip(data.ctrl, data.ctrl_source) if s == source])
            for source in dict.fromkeys(data.ctrl_source)]
        out[attribute] = []
        for name, examples in sets:
            common, own_tokens, row_tokens = memory.token_counts(examples)  # as Session.prepare counts them
            out[attribute].append({"set": name, "examples": len(examples), "shared_tokens": len(common),
                                   "own_tokens": own_tokens, "row_tokens": row_tokens,
                                   "shapes": [(len(ex.context), [len(o) for o in ex.options]) for ex in examples]})
    return out, session


def largest_step(model, layer: int, shapes: list[tuple[int, list[int]]], batch: int, K: int) -> int:
    """Bytes of a MARI training step (``memory.step_estimate``) over the ``batch`` examples of D_train
    whose own steps are largest: an upper bound on any batch of that size."""
    def step(chosen: list[tuple[int, list[int]]]) -> memory.Step:
        return memory.step_estimate(model, layer, memory.step_passes(chosen, K, MAX_TOKENS))

    alone = sorted(shapes, key=lambda shape: step([shape]).saved_bytes, reverse=True)
    return step(alone[:batch]).total

def model_rows(counts: dict[str, list[dict]]) -> dict[str, dict]:
    rows = {}
    for name, config in PAPER_SHAPES.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        c = site.kv_bytes_per_token(model)
        row = {"parameters": sum(p.numel() for p in model.parameters()), "cache_bytes_per_token": c,
               "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "attributes": {}}
        for attribute, sets in counts.items():
            now = before = 0
            for s in sets:
                e = memory.estimate(model, s["shared_tokens"], s["own_tokens"], s["row_tokens"], lower=True)
                now += e.total
                before += e.total - e.shared_bytes + s["examples"] * e.shared_bytes  # the preamble copied per example
            step = largest_step(model, config.num_hidden_layers // 2, sets[0]["shapes"], mari.DEFAULTS["batch_size"],
                                mari.DEFAULTS["K"])  # sets[0]: D_train; MARI's default site is the middle layer
            row["attributes"][attribute] = {"now_bytes": now, "before_bytes": before, "step_bytes": step}
        rows[name] = row
    return rows


def checked_gpu_runs(session: Session, paths: list[Path]) -> list[dict]:
    """Each recorded GPU run's MARI training (repro/gpu_bench.py) against the estimate with its step
    term: the run's D_train (the embedded tokenizer, as the runs used), the batches its seeded order
    drew, a meta model of its shape and vocabulary. Runs recorded before the step term was added
    get it here; later runs carry it themselves (``step_estimate_bytes``)."""
    from mari_eval.mari import fit  # deferred: only this check needs training's own draws
    from repro.benchmark import random_model

    out = []
    for path in paths:
        raw = json.loads(path.read_text())
        step = next((s for s in raw["steps"] if s.get("step") == "train/mari" and s.get("status") == "done"), None)
        if step is None or step["memory"].get("peak_allocated_bytes") is None:
            continue
        settings, hp, recorded = raw["settings"], step["hyperparameters"], step["memory"]
        config = random_model.hf_config(random_model.load_shape(settings["shape"]), vocab_size=raw["model"]["vocab_size"])
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, settings["dtype"]))
        examples = attribute_data(session, "truthfulqa", settings["seed"], max_train=settings["max_train"],
                                  max_ctrl=settings["max_ctrl"], max_pca=settings["max_pca"]).train
        gen = torch.Generator().manual_seed(settings["seed"])
        fit.lowrank_params(hp["K"], config.hidden_size, hp["rank"], hp["init_scale"], gen)  # training's draws before its batches
        largest = max(memory.step_estimate(model, step["layer"], memory.step_passes(
            memory.example_shapes(batch), hp["K"], session.max_tokens)).total
            for _ in range(hp["epochs"]) for batch in fit.epoch_batches(examples, hp["batch_size"], gen))
        estimate = recorded["weights_bytes"] + recorded["held_estimate_bytes"] + largest
        out.append({"run": path.name, "shape": settings["shape"], "batch_size": hp["batch_size"], "K": hp["K"],
                    "weights_bytes": recorded["weights_bytes"], "held_estimate_bytes": recorded["held_estimate_bytes"],
                    "step_estimate_bytes": largest, "estimate_bytes": estimate,
                    "peak_allocated_bytes": recorded["peak_allocated_bytes"],
                    "peak_over_estimate": recorded["peak_allocated_bytes"] / estimate})
    return out


def markdown(rows: dict, counts: dict, command: str, tokenizer: str, seed: int, runs: list[dict]) -> str:
    gib = lambda n: f"{n / 2**30:.1f}"
    lines = ["# Training memory of the paper's models (MARI, bf16)\n",
             f"Generated by `{command}`: split seed {seed}, full D_train and D_ctrl of each attribute, token counts "
             f"from the `{tokenizer}` tokenizer (the paper's models tokenise differently: sizes, not exact figures). "
             "Per model, the formula of `mari_eval/training/memory.py`, c = 2 L H_kv d_h b bytes per cached token and "
             "M = P c + sum_i (q_i c + r_i d b), on a meta-device model of the public configuration's shape.\n",
             "Sets: " + "; ".join(f"{a}: " + ", ".join(f"{s['set']} {s['examples']} examples, preamble {s['shared_tokens']} tokens"
                                                   for s in sets) for a, sets in counts.items()) + ".\n"]
    headers = ["model", "parameters", "weights (GiB)", "c (KiB/token)"]
    for a in counts:
        headers += [f"{a}: held now (GiB)", f"{a}: before, preamble per example (GiB)"]
    headers += ["largest training step (GiB)", "peak now, largest attribute (GiB)"]
    table = []
    for name, row in rows.items():
        cells = [name, f"{row['parameters'] / 1e9:.2f} B", gib(row["weights_bytes"]), f"{row['cache_bytes_per_token'] / 1024:.0f}"]
        for a in counts:
            cells += [gib(row["attributes"][a]["now_bytes"]), gib(row["attributes"][a]["before_bytes"])]
        largest = max(v["now_bytes"] + v["step_bytes"] for v in row["attributes"].values())
        cells += [gib(max(v["step_bytes"] for v in row["attributes"].values())), gib(row["weights_bytes"] + largest)]
        table.append(cells)
    lines.append(markdown_table(headers, table))
    lines.append("\nPeak = weights + the largest attribute's training state and training step. A step is MARI's "
                 f"default (batch {mari.DEFAULTS['batch_size']}, K = {mari.DEFAULTS['K']}, l* the middle layer) "
                 "over the D_train examples whose own steps are largest, an upper bound on any batch: the "
                 "activations autograd keeps for the backward of its option rows through the layers above l*, "
                 "and one pass's logits (`memory.step_estimate`; the formula and its source are in "
                 "docs/benchmark.md). Past "
                 "`mari-eval train --max-memory` (default: half the free memory of the site layer's device), "
                 "the per-example caches are recomputed at each use instead of kept.")
    if runs:
        lines += ["\n## The estimate against the GPU runs\n",
                  "MARI's training in each run of results/gpu_bench_runs (an H200, random weights of the shape named; "
                  "repro/gpu_bench.py): the weights and M as the run recorded them, the step recomputed for the "
                  "batches that run's seeded order drew, against its peak allocated GPU memory. The goal is "
                  "within 10%.\n",
                  markdown_table(["run", "shape", "batch", "K", "weights", "M", "largest step", "estimate", "peak",
                                  "peak / estimate"],
                                 [[r["run"], r["shape"], str(r["batch_size"]), str(r["K"]), gib(r["weights_bytes"]),
                                   gib(r["held_estimate_bytes"]), gib(r["step_estimate_bytes"]), gib(r["estimate_bytes"]),
                                   gib(r["peak_allocated_bytes"]), f"{r['peak_over_estimate']:.3f}"] for r in runs])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=options.seed, default=0)
    parser.add_argument("--tokenizer-model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default=str(REPO / "results"))
    parser.add_argument("--gpu-runs", default=str(REPO / "results" / "gpu_bench_runs"),
                        help="a folder of repro/gpu_bench.py's raw runs to check the estimate against")
    args = parser.parse_args(argv)
    start = time.time()
    counts, session = token_counts(args.tokenizer_model, args.seed)
    rows = model_rows(counts)
    runs = checked_gpu_runs(session, sorted(Path(args.gpu_runs).glob("run*.json")))
    command = "python repro/memory_table.py" + (f" --seed {args.seed}" if args.seed else "")
    out = Path(args.out)
    summary = {a: [{k: v for k, v in s.items() if k not in ("own_tokens", "row_tokens", "shapes")} |
                   {"own_tokens_total": sum(s["own_tokens"]), "row_tokens_total": sum(s["row_tokens"])} for s in sets]
               for a, sets in counts.items()}
    write_results_json(out / "memory.json", {"command": command, "seed": args.seed, "tokenizer": args.tokenizer_model,
                                             "dtype": "bfloat16", "sets": summary, "models": rows, "gpu_runs": runs,
                                             "wall_time_s": round(time.time() - start, 1)})
    atomic_write(out / "memory.md", markdown(rows, counts, command, args.tokenizer_model, args.seed, runs).encode())
    print(markdown(rows, counts, command, args.tokenizer_model, args.seed, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
