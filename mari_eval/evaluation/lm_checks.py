"""What the lm-eval model refuses, each naming the document, the argument or the prompt and the fix:
text no tokenizer reads, model args that need a bundle (or an empty one), an unwritable diagnostics file, and
non-finite numbers while scoring or generating. Also the gold options of the known
multiple-choice tasks, for the method's diagnostics (``Intervention.record_outcome``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mari_eval.benchmarks import data, data_splits
from mari_eval.evaluation import lm_outputs
from mari_eval.methods import options
from mari_eval.storage.files import check_writable_dir, check_writable_file
from mari_eval.injection.plan import VariantRun

if TYPE_CHECKING:
    from mari_eval.methods.intervention import Intervention


def check_request_text(requests) -> None:
    """Refuse, naming the task and document, text no tokenizer can read (a lone UTF-16 surrogate,
    e.g. from a "\\ud800" escape), before lm-eval tokenises a whole task and fails on it unnamed."""
    for request in requests:
        for arg in request.args:
            if not isinstance(arg, str):
                continue
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"task {request.task_name}, document {request.doc_id}: the text holds a lone surrogate "
                    f"{arg[e.start:e.end]!r} at character {e.start} ({arg[max(0, e.start - 30):e.start]!r} before it), "
                    "which is not text; fix that document (a broken \\u escape in the data)") from None


def bundle_args(bundle, bundle_revision=None, **given) -> None:
    """Refuse an empty ``bundle=`` (an unset shell variable), never read as "no bundle": it would
    evaluate the plain model and report it as ``--model mari``; likewise an empty ``bundle_revision=``,
    which would read the repository's main branch; and refuse the arguments that need a bundle
    (``bundle_revision``, the method's options, ``diagnostics``, ``allow_other_model``) without one.
    (``bundle_revision`` with a local directory is refused where the bundle is read: ``hub.resolve``.)"""
    if isinstance(bundle, str) and not bundle.strip():
        raise ValueError("bundle= is empty in --model_args (an unset shell variable?): give the bundle's directory "
                         "(or Hub repository), or leave bundle out to evaluate the plain model")
    if isinstance(bundle_revision, str) and not bundle_revision.strip():
        raise ValueError("bundle_revision= is empty in --model_args (an unset shell variable?): give a branch, tag or "
                         "commit of the bundle's repository, or leave it out for its main branch")
    given = options.given({"bundle_revision": bundle_revision, **given})
    if bundle is None and given:
        raise ValueError(f"{', '.join(given)} in --model_args need a bundle: add bundle=DIR, or drop them to "
                         "evaluate the plain model (bundle= also takes a Hub repository: bundle=hf://org/name)")


def is_lm_eval_command(argv: list[str]) -> bool:
    """Whether this process is the ``lm_eval`` command line (``lm_eval ...`` or ``python -m lm_eval ...``)."""
    program = Path(argv[0]) if argv else Path()
    return program.name in ("lm_eval", "lm-eval") or (program.name == "__main__.py" and program.parent.name == "lm_eval")


def lm_eval_output_path(argv: list[str]) -> str | None:
    """The output path of an ``lm_eval`` command line (``argv`` without the program), as lm-eval's own
    parser reads it, or None (``lm_outputs.output_path_given``: repeats that disagree are refused)."""
    return lm_outputs.output_path_given(argv)


def check_lm_eval_output(argv: list[str]) -> None:
    """Refuse, before the model is loaded, an ``lm_eval --output_path`` that cannot be written:
    lm-eval writes results and samples after the whole evaluation and, when that fails, logs a
    warning and exits 0 (its writer catches the error). A path ending in .json is a file, any
    other a directory, as lm-eval reads it. Then have lm-eval's writers checked once they have
    written (``lm_outputs.guard_result_writes``): a full disk at the end is an error too."""
    given = lm_eval_output_path(argv)
    if given is None:
        return
    path = Path(given).expanduser()
    if path.suffix == ".json":
        check_writable_file(path, "lm_eval --output_path ", "results.json")
    else:
        check_writable_dir(path, "lm_eval --output_path ")
    lm_outputs.guard_result_writes()


def check_writable(path: Path) -> None:
    """Refuse, before anything is scored, a ``diagnostics=`` file that could not be written at the end."""
    check_writable_file(path, "diagnostics=", "diagnostics.json")


class NonFiniteError(ArithmeticError):
    """A NaN or infinite number while scoring or generating: an answer is never picked from one."""


def refuse_nonfinite(run: VariantRun, record: dict, iv: "Intervention | None", where: str) -> None:
    """Stop on a non-finite log-likelihood, entropy or state of the run, or a non-finite number in the
    method's record (MARI: its energy, eq:energy), naming the document and the variant."""
    name = (lambda v: "the untouched model") if iv is None else iv.variant_name
    bad = [f"{what} of {name(v)}" for v, what in run.nonfinite()]
    bad += [f"{key} {value}" for key, value in record.items()
            if any(isinstance(x, float) and not math.isfinite(x) for x in (value if isinstance(value, list) else [value]))]
    if bad:
        raise NonFiniteError(f"non-finite numbers at {where}: {'; '.join(bad)}. The scores would be meaningless; "
                             "check the bundle (retrain it) and the model's dtype (float32 avoids overflow)")


class FiniteLogits:
    """A logits processor for ``generate``: stops on NaN or +inf next-token scores (or a row of -inf
    only), naming the task and the prompt (``prompt_text(i)``: prompt i's text, shortened) of the
    ``n_prompts`` prompts. (-inf for some tokens is a processor's masking, e.g. min_new_tokens.)"""

    def __init__(self, prompt_text: Callable[[int], str], n_prompts: int, task: str | None):
        self.prompt_text, self.n_prompts, self.task = prompt_text, n_prompts, task

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bad = scores.isnan().any(-1) | torch.isposinf(scores).any(-1) | torch.isneginf(scores).all(-1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            # Routed generation runs several rows per prompt; then the batch is named by its first prompt.
            which = row if len(scores) == self.n_prompts else 0
            prompt = self.prompt_text(which)
            if len(scores) != self.n_prompts:
                prompt = f"one of {self.n_prompts} prompts, the first {prompt!r}"
            raise NonFiniteError(
                f"non-finite next-token scores while generating (task {self.task}, prompt {prompt!r}); "
                "check the bundle (retrain it) and the model's dtype (float32 avoids overflow)")
        return scores


def gold_options(task: str | None, doc: dict | None, n_options: int) -> set[int] | None:
    """Indices of the correct options of a known multiple-choice doc (for routing agreement), else None."""
    if not task or not isinstance(doc, dict):
        return None
    try:
        if task.startswith("truthfulqa"):
            targets = doc["mc2_targets" if "mc2" in task else "mc1_targets"]
            gold = {i for i, label in enumerate(targets["labels"]) if label == 1}
        elif task.startswith("bbq"):
            gold = {int(doc["label"])}
        elif task.startswith("arc"):
            gold = {list(doc["choices"]["label"]).index(doc["answerKey"])}
        elif task.startswith("mmlu"):
            gold = {int(doc["answer"])}
        else:
            return None
    except (KeyError, ValueError, TypeError):
        return None
    return gold if all(0 <= g < n_options for g in gold) else None


def check_heldout_splits(requests, bundle_config: dict, checked: set[tuple]) -> None:
    """Refuse a held-out test set that may hold the bundle's training or control examples.

    Held-out docs name the split they were cut with (``split_dataset``, ``split_seed``,
    ``split_fingerprint``: harness_tasks/utils.py). A bundle trained on that dataset must
    have used the same seed, and the data must still give the split it recorded
    (``data_splits.check_recorded_splits``: same fingerprint, same file hashes). ``checked`` holds
    the splits already found consistent (each is checked once).
    """
    recorded = bundle_config.get("splits") or {}
    for request in requests:
        doc = request.doc if isinstance(request.doc, dict) else {}
        key = (doc.get("split_dataset"), doc.get("split_seed"), doc.get("split_fingerprint"))
        if key[0] is None or key[0] != recorded.get("dataset") or key in checked:
            continue  # not a held-out doc, or of a dataset the bundle was not trained on
        if key[1] != recorded.get("seed"):
            raise data.DataError(
                f"task {request.task_name} holds out the {key[0]} split of seed {key[1]}, but the bundle was "
                f"trained on the split of seed {recorded.get('seed')}: its training and control examples are "
                f"in this test set. Add --metadata '{{\"split_seed\": {recorded.get('seed')}}}', or use a bundle "
                f"trained with --seed {key[1]}.")
        data_splits.check_recorded_splits(key[0], recorded, bundle_config.get("data_files"))
        checked.add(key)
