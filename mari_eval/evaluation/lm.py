"""``lm_eval --model mari``: lm-eval's HFLM with an intervention applied at the site.

The class knows only the method interface: a bundle loads as a
``mari_eval.methods.Intervention``, which builds the ``Plan`` the runner follows
(``mari_eval.injection.plan``). With no ``bundle`` it is the frozen base model and scores like
``--model hf`` (to 1e-4); with one, the bundle's edit is applied at (l*, p*), p* being
the last prompt token:

* log-likelihood requests are grouped by question and visited in token order, so a
  preamble shared by several questions (few-shot examples) is computed once
  (``prefix_cache.PrefixCache``); every option runs as a short suffix under every
  variant of the plan (``mari_eval.evaluation.runner``), edited rows from the untouched rows'
  states at l*; the plan's ``choose`` picks the variant that answers. lm-eval's
  ``batch_size`` (``auto`` included) says how many questions share each pass
  (``mari_eval.evaluation.batching``); the default, 1, scores one question at a time;
* generation requests (``mari_eval.evaluation.lm_generation``, a mixin) are left-padded by HFLM, so
  p* is the last column of the prefill and a one-variant edit is applied once, before
  decoding (``mari_eval.injection.site.edit_site``); a plan with several variants runs them all for
  its routing window first (``mari_eval.evaluation.generation``);
* a method that edits no state but the prompt (Prompting: ``Intervention.instruction``) has its
  instruction put into every prompt: the chat template's system turn, or the context's first
  paragraph (``MariLM.instructed``); for every other method this is the identity.

Several methods' lm-eval runs can share the frozen model's log-likelihood work: from Python,
``shared_pass=`` (``mari_eval.evaluation.shared_pass.SharedPass``). Model args beyond HFLM's: ``bundle``
(a directory or a Hub repository, at ``bundle_revision``: ``mari_eval.methods.hub``), ``diagnostics``
(a JSON file of every choice the method made, each record naming its task and ``doc_id`` as
``--log_samples`` does), ``allow_other_model``, and the evaluation options of the bundle's method
(``Intervention.option_fields``; docs/mari.md, evaluation switches; ``scale`` for CAA, ITI
and NL-ITI). Everything else (chat templates, ``--limit``, ``--log_samples``) is HFLM's.
Under ``--use_cache``, results read from the cache never reach this class: the diagnostics
say so (``ChoiceLog.use_cache``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from mari_eval import methods
from mari_eval.evaluation import batching, lm_args, lm_checks as checks, runner
from mari_eval.methods import hub, options
from mari_eval.evaluation.choice_log import ChoiceLog, prompt_order
from mari_eval.evaluation.lm_generation import (CHAT_TURN_FIELD,  # noqa: F401 (CHAT_TURN_FIELD: the tasks' doc field)
                                     GenerationMixin)
from mari_eval.storage.models import DEFAULT_MODEL, resolve_model
from mari_eval.storage.numbers import read_number
from mari_eval.evaluation.shared_pass import OwnRuns, SharedPass, join_shared

log = logging.getLogger(__name__)

INSTRUCTION_DELIMITER = "\n\n"  # between a method's instruction and what follows it (``MariLM.instructed``)


@register_model("mari")
class MariLM(GenerationMixin, HFLM):
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm-eval's, refusing a key given twice (``rho=0.0,rho=1.0``: lm-eval keeps the last silently) and
        reading numbers from the text (``lm_args``)."""
        return super().create_from_arg_obj(lm_args.from_arg_string(arg_string, _own_args), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """lm-eval's; under the ``lm_eval`` command (which hands over a dict), ``--model_args`` read again from
        the command line: a key given twice refused, numbers read from the text (``lm_args``)."""
        if checks.is_lm_eval_command(sys.argv):
            arg_dict = lm_args.from_command_line(arg_dict, sys.argv[1:], _own_args)
        return super().create_from_arg_obj(arg_dict, additional_config)

    def __init__(
        self,
        pretrained: str = DEFAULT_MODEL,
        bundle: str | None = None,
        bundle_revision: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        diagnostics: str | None = None,
        allow_other_model: bool | str | None = None,
        shared_pass: SharedPass | None = None,
        batch_tokens: int | None = None,
        max_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        # The method's evaluation options (Intervention.option_fields) travel with HFLM's model args.
        # (Reading the option names imports every built-in method's module: only when there are model args to sort.)
        names = methods.option_names() if kwargs else set()
        method_options = options.given({k: kwargs.pop(k) for k in list(kwargs) if k in names})
        checks.bundle_args(bundle, bundle_revision, **method_options, diagnostics=diagnostics, allow_other_model=allow_other_model)
        batch_tokens = batching.check_batch_tokens(batch_tokens)
        if max_batch_size is not None:
            max_batch_size = read_number(max_batch_size, "max_batch_size=", integer=True, lo=1, where="in --model_args")
        # Batches are sized by tokens; lm-eval's max_batch_size caps their requests only when given (batching.py).
        self.batch_tokens, self.request_cap = batch_tokens, max_batch_size
        if diagnostics:
            checks.check_writable(Path(diagnostics))
        if checks.is_lm_eval_command(sys.argv):  # results written after the run: checked before it
            checks.check_lm_eval_output(sys.argv[1:])
        # The bundle is read and its options applied before the model is loaded, so a bad one fails fast.
        self.intervention: methods.Intervention | None = None
        self._templated: set[str] = set()  # prompts rendered by the chat template with the method's instruction
        if bundle is not None:
            self.intervention = hub.load_bundle(bundle, bundle_revision)  # a directory or a Hub repository
            self.intervention.configure_from(method_options)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        _cpu_ranks_under_a_launcher()
        # A model object passed in is named by the checkpoint it was loaded from (bundle checks).
        self.model_name = pretrained if isinstance(pretrained, str) else getattr(pretrained, "name_or_path", "") or type(pretrained).__name__
        super().__init__(
            pretrained=resolve_model(pretrained) if isinstance(pretrained, str) else pretrained,
            device=device,
            dtype=dtype,
            max_batch_size=64 if max_batch_size is None else max_batch_size,  # HFLM's own default, for its generation
            **kwargs,
        )
        self.model.requires_grad_(False)
        self._enable_data_parallel_ranks()
        self.plan = runner.VANILLA
        if self.intervention is not None:
            self.intervention.check_compatible(self.model, self.model_name,
                                               options.as_bool(allow_other_model or False, "allow_other_model"))
            self.plan = self.intervention.plan(self.model)
        self.shared = join_shared(shared_pass, self.model, self.plan, self.intervention)  # None: runs computed here
        self.choices = ChoiceLog(self.intervention, diagnostics)
        self._request_meta: list | None = None
        self._generation_task: str | None = None  # the task of the generation requests being answered
        self._generation_docs: dict[str, deque] | None = None  # per prompt, its requests' (task, doc_id), in HFLM's order
        self._batch_docs: list[tuple] = []  # (task, doc_id) of each row of the batch being generated
        self._splits_checked: set[tuple] = set()  # held-out splits found consistent with the bundle's

    def _enable_data_parallel_ranks(self) -> None:
        """Data parallelism under ``accelerate launch`` / torchrun whatever the device.

        lm-eval 0.4.13's HFLM turns ranks on only when it counts more than one GPU, so two
        CPU processes (gloo) or one GPU per process on separate hosts would each evaluate
        everything. Here every process launched together takes its share of the requests.
        """
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1 and self.world_size == 1:
            self._rank, self._world_size = accelerator.process_index, accelerator.num_processes

    # ------------------------------------------------------------------ scoring

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        # Keep which question each request belongs to: a method that chooses among
        # variants (e.g. by the options' entropies) sees all options of a question together.
        self._check_heldout_splits(requests)
        checks.check_request_text(requests)

        def score(unique):
            self._request_meta = [(r.task_name, r.doc_id, r.doc) for r in unique]
            try:
                return super(MariLM, self).loglikelihood(unique, disable_tqdm=disable_tqdm)
            finally:
                self._request_meta = None

        return self._once_per_request(requests, score)

    def _check_heldout_splits(self, requests) -> None:
        if self.intervention is not None:
            checks.check_heldout_splits(requests, self.intervention.config, self._splits_checked)

    def _once_per_request(self, requests, answer):
        """``answer`` the distinct request objects once, then gather the diagnostics of all ranks.

        Under data parallelism lm-eval pads a rank's list with copies of its last request
        (the same object again); scored as requests they would join that question's
        option group and move its routing entropies, and generated they would count twice
        in the diagnostics. Each copy gets its original's answer instead.
        """
        first = {}
        for request in requests:
            first.setdefault(id(request), request)
        unique = list(first.values())
        start = len(self.records)
        answers = dict(zip(first, answer(unique)))
        self.choices.gather(start, self.world_size, self.rank)
        return [answers[id(request)] for request in requests]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """Sum of continuation log-probs and whether it is the greedy continuation, per request.

        Requests are grouped by question (task, doc, context tokens). Each group's context
        before p* is run once (sharing the preamble common with its neighbour in token
        order, e.g. a few-shot prompt) and its options run as short suffixes under every
        variant of the intervention (``mari_eval.evaluation.runner``); the method then picks the
        variant that answers. Without a bundle this equals HFLM's scoring (tested to 1e-4).
        """
        meta = self._request_meta if self._request_meta and len(self._request_meta) == len(requests) else None
        groups: dict[tuple, list[int]] = {}
        for i, (key, context_enc, cont_enc) in enumerate(requests):
            text = key[0] if key else None  # (context, continuation); None for rolling windows
            where = f"task {meta[i][0]}, document {meta[i][1]}" if meta else "a request"
            if not context_enc or not cont_enc:
                raise ValueError(
                    f"{where}: the {'context' if not context_enc else 'continuation'} has no tokens (context "
                    f"{text!r}; lm-eval moves a context's trailing whitespace into the continuation, so a "
                    "whitespace-only prompt leaves none): give the document a prompt and a non-empty answer")
            if len(cont_enc) > self.max_length:
                raise ValueError(f"{where}: a continuation of {len(cont_enc)} tokens exceeds max_length={self.max_length}")
            question = (meta[i][0], meta[i][1]) if meta else (None, None)
            groups.setdefault((*question, tuple(context_enc)), []).append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        # Sorted by context tokens, questions sharing a preamble are neighbours (PrefixCache).
        ordered = []
        for (task, doc_id, context), idxs in sorted(groups.items(), key=lambda item: prompt_order(*item[0])):
            conts = [requests[i][2] for i in idxs]
            # Left-truncate like HFLM so that the longest row fits in max_length.
            ordered.append((task, doc_id, context[-(self.max_length + 1 - max(map(len, conts))):], idxs, conts))
        runs, batches = self._question_batches(ordered)
        for batch in batches:
            with torch.no_grad():
                batch_runs = runs.run_many([(ordered[q][2], ordered[q][4]) for q in batch])
            for q, run in zip(batch, batch_runs):
                self._answer(requests, results, *ordered[q], run)
                pbar.update(len(ordered[q][3]))
        pbar.close()
        return results

    def _question_batches(self, ordered: list[tuple]) -> tuple[Any, list[list[int]]]:
        """Who computes the runs, and the questions of ``ordered`` (task, doc_id, context, request
        indices, continuations) cut into the batches lm-eval's ``batch_size`` asks for."""
        if self.shared is not None:  # the shared pass goes question by question (SharedPass.run_many)
            return self.shared, [[q] for q in range(len(ordered))]
        how = batching.Batching.of(self.batch_size_per_gpu, self.request_cap, self.model, self.batch_tokens)
        runs = OwnRuns(self.model, self.plan, max_tokens=how.max_tokens)
        rows = [sum(map(len, conts)) for *_, conts in ordered]
        batches = batching.question_batches([q[2][:-1] for q in ordered], rows, [len(q[3]) for q in ordered], how)
        return runs, batches

    def _answer(self, requests, results, task, doc_id, context, idxs, conts, run: runner.VariantRun) -> None:
        """The answers of one question's requests, from the variant its plan picks in ``run``."""
        plan, iv = self.plan, self.intervention
        meta = self._request_meta if self._request_meta and len(self._request_meta) == len(requests) else None
        chosen, record = plan.pick(run)
        checks.refuse_nonfinite(run, record, iv, f"task {task}, document {doc_id}")
        row = run.row(chosen)
        for m, i in enumerate(idxs):
            answer = (float(run.logprobs[row, m]), bool(run.greedy[row, m]))
            results[i] = answer
            self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        if iv is not None:
            doc = meta[idxs[0]][2] if meta else None
            self._record(record, task, doc_id, run, checks.gold_options(task, doc, len(conts)), context)

    # ------------------------------------------------------------------ a method's instruction
    #
    # A method may put an instruction into every prompt (``Intervention.instruction``: Prompting's).
    # With a chat template it joins the system turn (``apply_chat_template``: lm-eval's
    # --apply_chat_template; ``chat_prompt``: SORRY-Bench's chat turn); otherwise it is the context's
    # first paragraph, before any few-shot preamble (``instructed``), as lm-eval's ``_encode_pair``
    # encodes a log-likelihood request and as ``generate_until`` hands a prompt on. For every other
    # method (instruction None) and without a bundle each of these is the identity.

    @property
    def instruction(self) -> str | None:
        return None if self.intervention is None else self.intervention.instruction

    def instructed(self, context: str) -> str:
        """``context`` after the method's instruction, unless the chat template put it in its system turn."""
        if not self.instruction or context in self._templated:
            return context
        return self.instruction + INSTRUCTION_DELIMITER + context

    def with_instruction(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """Chat ``messages`` with the method's instruction in their system turn (after a system
        instruction lm-eval put there, or as a new system turn)."""
        if not self.instruction:
            return messages
        if messages and messages[0].get("role") == "system":
            first = messages[0]
            return [{**first, "content": first["content"] + INSTRUCTION_DELIMITER + self.instruction}, *messages[1:]]
        return [{"role": "system", "content": self.instruction}, *messages]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        rendered = super().apply_chat_template(self.with_instruction(chat_history), add_generation_prompt)
        if self.instruction:
            if self.instruction not in rendered:  # a template without a system turn (HFLM drops it): the first user turn carries it
                turns = [dict(m) for m in chat_history if m.get("role") != "system"]
                user = next((m for m in turns if m.get("role") == "user"), None)
                if user is not None:
                    user["content"] = self.instruction + INSTRUCTION_DELIMITER + user["content"]
                rendered = super().apply_chat_template(turns, add_generation_prompt)
            self._templated.add(rendered)
        return rendered

    def _encode_pair(self, context: str, continuation: str):
        # The request keeps its text (lm-eval's cache keys on it); only its tokens carry the instruction.
        return super()._encode_pair(self.instructed(context), continuation)

    # ------------------------------------------------------------------ diagnostics

    @property
    def records(self) -> list[dict]:
        """The method's choose record of every prompt so far (``ChoiceLog``)."""
        return self.choices.records

    def diagnostics_summary(self) -> dict:
        return self.choices.summary()

    def _record(self, record: dict, task, doc_id, run: runner.VariantRun, gold: set[int] | None, prompt) -> None:
        record = {"task": task, "doc_id": doc_id, **record}
        if gold is not None:
            self.intervention.record_outcome(record, run, gold)
        self.choices.add(prompt_order(task, doc_id, tuple(prompt)), record)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        if self.intervention is not None:
            raise NotImplementedError(
                "loglikelihood_rolling (perplexity tasks) has no prompt, hence no last prompt token to edit; "
                "run these tasks without a bundle."
            )
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    # ------------------------------------------------------------------ bookkeeping

    def set_cache_hook(self, cache_hook) -> None:
        # CachingLM (--use_cache) keys requests on their text only: results computed
        # under one bundle (or under other options: scale=, rho=...) would be served for
        # another. Allow it only when the cache file names this bundle and its options.
        db = getattr(cache_hook, "dbdict", None)
        if self.intervention is not None and db is not None:
            fingerprint = self.intervention.cache_fingerprint()
            path = str(getattr(db, "filename", ""))
            if fingerprint not in path:
                given = ", ".join(f"{k}={v}" for k, v in sorted(self.intervention.options.items()))
                what = f"this bundle with {given}" if given else "this bundle"
                raise ValueError(
                    "--use_cache keys results on the request text only, so a cache shared between bundles "
                    "(or between evaluation options of one bundle) would return wrong results. Put the "
                    f"fingerprint of {what} in the cache path, e.g. --use_cache cache/mari-{fingerprint}"
                )
            # Requests answered from the cache never reach this class: the diagnostics say so.
            self.choices.use_cache(path, len(db), self.rank)
        super().set_cache_hook(cache_hook)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["mari_model"] = self.model_name
        info["mari_intervention"] = None if self.intervention is None else self.intervention.describe()
        if self.intervention is not None:
            info["mari_diagnostics"] = self.diagnostics_summary()
            _shown.info("%s diagnostics (in full: the results JSON's config.mari_diagnostics): %s",
                        self.intervention.label, diagnostics_line(info["mari_diagnostics"]))
        return info


_shown = logging.getLogger("lm_eval.mari_eval")  # a child of lm-eval's logger: shown at its level (INFO)


def diagnostics_line(summary: dict, width: int = 400) -> str:
    """The summary's numbers, strings and short lists on one line (MARI: gate_rate, expert usage...),
    shortened to ``width`` characters; the nested records stay in the JSON."""
    def shown(value) -> bool:
        return isinstance(value, (int, float, str, bool)) or (isinstance(value, (list, dict)) and len(str(value)) <= 80)

    text = ", ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}" for k, v in summary.items() if shown(v))
    return text if len(text) <= width else text[:width - 3] + "..."


def _cpu_ranks_under_a_launcher() -> None:
    """Under torchrun / ``accelerate launch`` without a GPU, let accelerate start the CPU ranks (gloo).

    HFLM creates ``Accelerator()``, which on a machine without an accelerator counts one
    process unless told to use the CPU (``accelerate launch --cpu`` says so through
    ACCELERATE_USE_CPU). A user's own setting is kept.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")


def _own_args() -> set[str]:
    """The model args ``MariLM`` reads itself (``lm_args.typed`` hands them the text as typed)."""
    return set(lm_args.OWN_ARGS) | methods.option_names()
