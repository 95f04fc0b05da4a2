"""How many tokens a repro step reads: per task, per document, as lm-eval renders it (the step
graph's costs, ``repro.engine.steps``).

    python -m repro.engine.token_counts            # writes repro/engine/token_counts.json (MARI_DATA_DIR's data)

For each task a table evaluates, lm-eval builds its requests for a sample of documents (the
first ``SAMPLE`` of each task; MMLU: the first ``MMLU_SAMPLE`` of each subject) and they are
tokenised with the embedded SmolLM2-135M-Instruct tokenizer: the mean prompt tokens per
document (a few-shot preamble included), option tokens per request, requests per document, and
the task's whole test set size. For the attributes, the sizes of the paper's splits (seed 0):
D_train, D_ctrl (the attribute's controls, ARC-Easy's and MMLU's) and D_pca. The paper's models
tokenise the same text into other counts (Llama-2 and Qwen2 tokenizers split English text
within about 20% of SmolLM2's); the estimates built on these counts carry that error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mari_eval.evaluation.lm_generation import CHAT_TURN_FIELD
from repro.engine.profiles import (BBQ_AMBIGUOUS, BENCHMARKS, BENIGN_REFUSAL, BENIGN_TEXT, GENERAL_TEXT, REPO,
                                   TQA_GENERATION, XSTEST)

OUT = Path(__file__).resolve().parent / "token_counts.json"
SAMPLE = 40
MMLU_SAMPLE = 2
FEWSHOT_SEED = 1234  # simple_evaluate's fewshot_random_seed default: the same shots as an evaluation
TASKS = sorted({task for _, task, _, _ in BENCHMARKS + TQA_GENERATION + XSTEST + BBQ_AMBIGUOUS + GENERAL_TEXT
                 + BENIGN_TEXT + BENIGN_REFUSAL}
               | {"gsm8k", "arc_easy_first25", "arc_challenge_first25"})
ATTRIBUTE_TASKS = {"truthfulqa": "truthfulqa_mc1_heldout", "bbq": "bbq_disambig_heldout",
                   "sorry_bench": "sorry_bench_heldout"}


def measure_task(name: str, tokenizer, task_manager) -> dict:
    from lm_eval.tasks import get_task_dict  # deferred: lm-eval is heavy; only measuring needs it

    found = get_task_dict([name], task_manager)
    leaves = {}

    def collect(node):
        for key, value in node.items():
            if isinstance(value, dict):
                collect(value)
            else:
                leaves[getattr(key, "group_name", key) if not isinstance(key, str) else key] = value

    collect(found)
    prompt, option, requests, docs, documents, generation = 0, 0, 0, 0, 0, False
    for task in leaves.values():
        documents += len(task.eval_docs)
        limit = MMLU_SAMPLE if len(leaves) > 1 else SAMPLE
        task.set_fewshot_seed(seed=FEWSHOT_SEED)  # the shots lm-eval's simple_evaluate draws
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        by_doc: dict[int, list] = {}
        for instance in task.instances:
            by_doc.setdefault(instance.doc_id, []).append(instance)
        for doc_requests in by_doc.values():
            docs += 1
            context, turn = doc_requests[0].args[0], (doc_requests[0].doc or {}).get(CHAT_TURN_FIELD)
            if turn is not None:  # --model mari renders it as one user turn of the chat template (XSTest)
                context = tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                                        tokenize=False)
            prompt += len(tokenizer(context, add_special_tokens=turn is None).input_ids)
            if doc_requests[0].request_type == "generate_until":
                generation = True
                continue
            requests += len(doc_requests)
            option += sum(len(tokenizer(r.args[1], add_special_tokens=False).input_ids) for r in doc_requests)
    return {"documents": documents, "sampled": docs, "prompt_tokens": round(prompt / docs, 1),
            "requests_per_document": 0.0 if generation else round(requests / docs, 2),
            "option_tokens": 0.0 if generation else round(option / max(requests, 1), 2), "generation": generation}


def measure_sorry(tokenizer) -> dict:
    """SORRY-Bench's held-out prompts (seed 0) as ``--model mari`` generates from them: one user
    turn of the chat template. Read from the data, not through the task, whose loader asks for a
    judge before it builds anything."""
    from mari_eval.benchmarks.data import load_sorry_bench  # deferred: reads the data files
    from mari_eval.benchmarks.data_splits import make_splits  # deferred: as above

    test = set(make_splits("sorry_bench", 0).test)
    turns = [r["turns"][0] for r in load_sorry_bench() if r["id"] in test]
    sampled = turns[:SAMPLE]
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
                for t in sampled]
    tokens = [len(tokenizer(text, add_special_tokens=False).input_ids) for text in rendered]
    return {"documents": len(turns), "sampled": len(sampled), "prompt_tokens": round(sum(tokens) / len(tokens), 1),
            "requests_per_document": 0.0, "option_tokens": 0.0, "generation": True}


def measure_general_text(tokenizer) -> dict:
    """The KL and cross-entropy columns' documents (mari_eval/evaluation/divergence.py): one teacher-forced pass
    over context and continuation per document, priced as one log-likelihood request."""
    from mari_eval.benchmarks.data import load_general_text  # deferred: reads the data files

    documents = load_general_text()
    sampled = documents[:SAMPLE]
    prompt = [len(tokenizer(d["context"]).input_ids) for d in sampled]
    option = [len(tokenizer(d["continuation"], add_special_tokens=False).input_ids) for d in sampled]
    return {"documents": len(documents), "sampled": len(sampled), "prompt_tokens": round(sum(prompt) / len(prompt), 1),
            "requests_per_document": 1.0, "option_tokens": round(sum(option) / len(option), 2), "generation": False}


def measure_benign_text(tokenizer) -> dict:
    """The out-of-source KL and cross-entropy documents (repro/engine/divergence_run.py): each request as one chat
    user turn, then the first tokens of its authors' answer, one teacher-forced pass priced as one request."""
    from mari_eval.benchmarks.data import load_benign_instructions  # deferred: reads the data files
    from mari_eval.evaluation.divergence import BENIGN_ANSWER_TOKENS  # deferred: imports torch
    from repro.engine.divergence_run import BENIGN_SET, untouched_turn  # deferred: as above

    records = load_benign_instructions(BENIGN_SET, use="evaluation")
    sampled = records[:SAMPLE]
    prompt = [len(tokenizer(untouched_turn(tokenizer, r["prompt"]), add_special_tokens=False).input_ids) for r in sampled]
    option = [min(BENIGN_ANSWER_TOKENS, len(tokenizer(r["instances"][0]["output"], add_special_tokens=False).input_ids))
              for r in sampled]
    return {"documents": len(records), "sampled": len(sampled), "prompt_tokens": round(sum(prompt) / len(prompt), 1),
            "requests_per_document": 1.0, "option_tokens": round(sum(option) / len(option), 2), "generation": False}


def measure() -> dict:
    from lm_eval.tasks import TaskManager  # deferred: lm-eval is heavy; only measuring needs it
    from transformers import AutoTokenizer  # deferred: as above

    from mari_eval.benchmarks.data_splits import make_splits  # deferred: reads the data files
    from mari_eval.storage.models import resolve_model  # deferred: as above

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    task_manager = TaskManager(include_path=str(REPO / "harness_tasks"), metadata={"split_seed": 0})
    special = {"sorry_bench_heldout": measure_sorry, "general_text": measure_general_text, "benign_text": measure_benign_text}
    tasks = {name: special[name](tokenizer) if name in special else measure_task(name, tokenizer, task_manager)
             for name in TASKS}
    splits = {}
    for attribute in ATTRIBUTE_TASKS:
        s = make_splits(attribute, 0)
        splits[attribute] = {"train": len(s.train), "ctrl": len(s.ctrl) + len(s.ctrl_arc) + len(s.ctrl_mmlu),
                             "pca": len(s.pca), "test": len(s.test), "task": ATTRIBUTE_TASKS[attribute]}
    return {"command": "python -m repro.engine.token_counts", "tokenizer": "smollm2-135m-instruct", "split_seed": 0,
            "sample": {"per_task": SAMPLE, "per_mmlu_subject": MMLU_SAMPLE}, "tasks": tasks, "splits": splits}


def load(path: Path = OUT) -> dict:
    """The committed counts (``python -m repro.engine.token_counts`` regenerates them)."""
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the counts (default: %(default)s)")
    args = parser.parse_args(argv)
    args.out.write_text(json.dumps(measure(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
