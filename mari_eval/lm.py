"""``lm_eval --model mari``: lm-eval's HFLM with an intervention applied at the site.

The class knows only the method interface (``mari_eval.methods.Intervention``): with
no ``bundle`` it is the frozen base model and scores like ``--model hf`` (to 1e-4);
with a bundle it applies that bundle's edit at (l*, p*), p* being the last prompt token:

* log-likelihood requests are grouped by question and visited in token order, so a
  preamble shared by several questions (few-shot examples) is computed once
  (``runner.PrefixCache``); every option runs as a short suffix under every variant the
  method proposes (``mari_eval.runner``), edited rows from the untouched rows' states
  at l*; the method's ``choose`` picks the variant that answers (MARI: the gate, then
  the lowest option entropy; a closed gate skips the experts). lm-eval's
  ``batch_size`` does not apply to this path: each question is a few packed passes;
* generation requests are left-padded by HFLM, so p* is the last column of the prefill
  and the edit is applied once, before decoding (``mari_eval.site.edit_site``); a
  method with several variants runs them all for its routing window first (after its
  gate, for MARI).

Model args beyond HFLM's: ``bundle``, and for MARI bundles ``gate``, ``rho``,
``experts`` (ablations) and ``diagnostics`` (a JSON file of every routing decision).
Everything else (chat templates, ``--limit``, ``--log_samples``) is HFLM's.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from mari_eval import methods, runner
from mari_eval.files import atomic_write_json
from mari_eval.models import DEFAULT_MODEL, resolve_model

# A doc field (harness_tasks/utils.py, SORRY-Bench) holding the prompt as one chat user turn:
# a generation context equal to it is rendered through the model's chat template.
CHAT_TURN_FIELD = "chat_user_turn"


@register_model("mari")
class MariLM(HFLM):
    def __init__(
        self,
        pretrained: str = DEFAULT_MODEL,
        bundle: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        gate: bool | str | None = None,
        rho: float | str | None = None,
        experts: str | int | None = None,
        diagnostics: str | None = None,
        allow_other_model: bool | str | None = None,
        **kwargs: Any,
    ) -> None:
        ablation = _ablation_args(bundle, gate=gate, rho=rho, experts=experts, diagnostics=diagnostics,
                                  allow_other_model=allow_other_model)
        if diagnostics:
            _check_writable(Path(diagnostics))
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        _cpu_ranks_under_a_launcher()
        # A model object passed in is named by the checkpoint it was loaded from (bundle checks).
        self.model_name = pretrained if isinstance(pretrained, str) else getattr(pretrained, "name_or_path", "") or type(pretrained).__name__
        super().__init__(
            pretrained=resolve_model(pretrained) if isinstance(pretrained, str) else pretrained,
            device=device,
            dtype=dtype,
            **kwargs,
        )
        self.model.requires_grad_(False)
        self._enable_data_parallel_ranks()
        self.intervention: methods.Intervention | None = None
        if bundle is not None:
            self.intervention = methods.load_bundle(bundle)
            self.intervention.check_compatible(self.model, self.model_name,
                                               _as_bool(allow_other_model or False, "allow_other_model"))
            iv = self.intervention
            if iv.prompt_sites(64) and (len(iv.variants()) > 1 or iv.uses_base):
                raise ValueError(f"{iv.method}: edits before p* (prompt_sites) need a method with one variant")
            if hasattr(self.intervention, "configure"):
                self.intervention.configure(**ablation)
            elif ablation:
                raise ValueError(f"{', '.join(ablation)} apply to MARI bundles; this bundle is {self.intervention.method}: "
                                 "drop them from --model_args")
        self.diagnostics_path = diagnostics
        self.records: list[dict] = []  # one per prompt: the method's choice (expert, gate, energy...)
        self._record_keys: list[tuple] = []  # each record's prompt (its place in a canonical order)
        self._request_meta: list | None = None
        self._generation_task: str | None = None  # the task of the generation requests being answered
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

    # ------------------------------------------------------------------ the site

    def _variants(self) -> tuple[list[int], Any, list[int], list[int]]:
        """(variants, apply, captured layers, site-only variants) of the intervention, BASE alone without one."""
        iv = self.intervention
        if iv is None:
            return [runner.BASE], runner.no_edit, [], []
        variants = ([runner.BASE] if iv.uses_base else []) + iv.variants()

        def apply(variant_ids, positions):
            return iv.applied(self.model, positions, variant_ids)

        return variants, apply, iv.captured_layers(), iv.site_only_variants()

    def _choose(self, run: runner.VariantRun) -> tuple[int, dict]:
        if self.intervention is None:
            return runner.BASE, {}
        return self.intervention.choose(run)

    # ------------------------------------------------------------------ scoring

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        # Keep which question each request belongs to: a method that chooses among
        # variants (MARI's entropy routing) sees all options of a question together.
        self._check_heldout_splits(requests)
        _check_request_text(requests)

        def score(unique):
            self._request_meta = [(r.task_name, r.doc_id, r.doc) for r in unique]
            try:
                return super(MariLM, self).loglikelihood(unique, disable_tqdm=disable_tqdm)
            finally:
                self._request_meta = None

        return self._once_per_request(requests, score)

    def _check_heldout_splits(self, requests) -> None:
        """Refuse a held-out test set that may hold the bundle's training or control examples.

        Held-out docs name the split they were cut with (``split_dataset``, ``split_seed``,
        ``split_fingerprint``: harness_tasks/utils.py). A bundle trained on that dataset must
        have used the same seed, and the data must still give the split it recorded
        (``data.check_recorded_splits``: same fingerprint, same file hashes).
        """
        from mari_eval import data

        recorded = (self.intervention.config.get("splits") or {}) if self.intervention is not None else {}
        for request in requests:
            doc = request.doc if isinstance(request.doc, dict) else {}
            key = (doc.get("split_dataset"), doc.get("split_seed"), doc.get("split_fingerprint"))
            if key[0] is None or key[0] != recorded.get("dataset") or key in self._splits_checked:
                continue  # not a held-out doc, or of a dataset the bundle was not trained on
            if key[1] != recorded.get("seed"):
                raise data.DataError(
                    f"task {request.task_name} holds out the {key[0]} split of seed {key[1]}, but the bundle was "
                    f"trained on the split of seed {recorded.get('seed')}: its training and control examples are "
                    f"in this test set. Add --metadata '{{\"split_seed\": {recorded.get('seed')}}}', or use a bundle "
                    f"trained with --seed {key[1]}.")
            data.check_recorded_splits(key[0], recorded, self.intervention.config.get("data_files"))
            self._splits_checked.add(key)

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
        self._gather_records(start)
        return [answers[id(request)] for request in requests]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """Sum of continuation log-probs and whether it is the greedy continuation, per request.

        Requests are grouped by question (task, doc, context tokens). Each group's context
        before p* is run once (sharing the preamble common with its neighbour in token
        order, e.g. a few-shot prompt) and its options run as short suffixes under every
        variant of the intervention (``mari_eval.runner``); the method then picks the
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
        variants, apply, capture, site_only = self._variants()
        iv = self.intervention
        screen = None if iv is None else iv.screen
        # Edits start at the site's output for methods with several variants (MARI): their
        # rows reuse the untouched model's states below it (runner.score_variants).
        edit_layer = iv.layer if iv is not None and len(variants) > 1 else None
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        prefixes = runner.PrefixCache(self.model)
        # Sorted by context tokens, questions sharing a preamble are neighbours (PrefixCache).
        for (task, doc_id, context), idxs in sorted(groups.items(), key=lambda item: _prompt_order(*item[0])):
            conts = [requests[i][2] for i in idxs]
            # Left-truncate like HFLM so that the longest row fits in max_length.
            context = context[-(self.max_length + 1 - max(map(len, conts))):]
            sites = iv.prompt_sites(len(context)) if iv is not None else []
            if sites:  # the prompt itself is edited: nothing before p* can be shared
                prefix = runner.encode_prefix(self.model, context[:-1], apply=apply, sites=sites)
            else:
                prefix = prefixes.encode(context[:-1])
            with torch.no_grad():
                run = runner.score_variants(self.model, prefix, context[-1], conts, variants, apply, capture, site_only,
                                            edit_layer=edit_layer, screen=screen)
            chosen, record = self._choose(run)
            _refuse_nonfinite(run, record, iv, f"task {task}, document {doc_id}")
            row = run.row(chosen)
            for m, i in enumerate(idxs):
                answer = (float(run.logprobs[row, m]), bool(run.greedy[row, m]))
                results[i] = answer
                self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            if iv is not None:
                doc = meta[idxs[0]][2] if meta else None
                self._record(record, task, doc_id, run, variants, _gold_options(task, doc, len(conts)))
                self._record_keys.append(_prompt_order(task, doc_id, context))
            pbar.update(len(idxs))
        pbar.close()
        return results

    # ------------------------------------------------------------------ diagnostics

    def _record(self, record: dict, task, doc_id, run: runner.VariantRun, variants, gold: set[int] | None) -> None:
        record = {"task": task, "doc_id": doc_id, **record}
        site_only = self.intervention.site_only_variants()
        answering = [v for v in variants if v != runner.BASE and v not in site_only]
        if gold is not None and answering and "expert" in record:
            correct = [int(run.logprobs[run.row(v)].argmax()) in gold for v in answering]
            if any(correct):
                # Appendix C.2: does the entropy choice pick an expert whose answer is correct?
                record["routing_agrees"] = bool(correct[answering.index(record["expert"])])
        self.records.append(record)

    def _gather_records(self, start: int) -> None:
        """The records of the call that began at ``start``, from every rank, in one order.

        They are sorted by their prompts (``_prompt_order``), so one process and several give
        the same list; every rank then holds all of them, and rank 0 writes the file.
        """
        if self.intervention is None:
            return
        mine = list(zip(self._record_keys[start:], self.records[start:]))
        if self.world_size > 1:
            import torch.distributed as dist

            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, mine)
            mine = [pair for part in everyone for pair in part]
        mine.sort(key=lambda pair: pair[0])
        self._record_keys[start:] = [key for key, _ in mine]
        self.records[start:] = [record for _, record in mine]
        if self.rank == 0:
            self._write_diagnostics()

    def diagnostics_summary(self) -> dict:
        if self.intervention is None:
            return {}
        return self.intervention.summarize(self.records)

    def _write_diagnostics(self) -> None:
        if not self.diagnostics_path or self.intervention is None:
            return
        atomic_write_json(Path(self.diagnostics_path), {"summary": self.diagnostics_summary(), "records": self.records})

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        if self.intervention is not None:
            raise NotImplementedError(
                "loglikelihood_rolling (perplexity tasks) has no prompt, hence no last prompt token to edit; "
                "run these tasks without a bundle."
            )
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False):
        self._check_heldout_splits(requests)
        _check_request_text(requests)
        # Tasks whose docs carry CHAT_TURN_FIELD (SORRY-Bench) want their prompt as one user
        # turn of the chat template, as training renders it. A context lm-eval already
        # changed (--apply_chat_template, a system instruction, few-shot) no longer equals
        # the turn and is left alone, so the template is never applied twice.
        asked = {}  # the arguments lm-eval's --use_cache looks a request up by, where they are rendered here
        for request in requests:
            turn = request.doc.get(CHAT_TURN_FIELD) if isinstance(request.doc, dict) else None
            if isinstance(turn, str) and request.args[0] == turn:
                asked[id(request)] = request.args
                request.arguments = (self.chat_turn_prompt(turn), *request.args[1:])
        # lm-eval sends every task's generation requests in one call and reorders them, so a
        # generation record can name its task only when the call holds one task's requests.
        tasks = {request.task_name for request in requests}
        self._generation_task = tasks.pop() if len(tasks) == 1 else None
        try:
            answers = self._once_per_request(requests, lambda unique: super(MariLM, self).generate_until(unique, disable_tqdm))
        finally:
            self._generation_task = None
        for request, answer in zip(requests, answers):  # HFLM cached it under the rendered prompt
            if id(request) in asked:
                self.cache_hook.add_partial("generate_until", asked[id(request)], answer)
        return answers

    def chat_turn_prompt(self, user: str) -> str:
        """The prompt of a task whose doc carries CHAT_TURN_FIELD (SORRY-Bench), as generated
        and as trained: one user turn of the chat template, or ``user + "\\n"`` without one."""
        return self.chat_prompt(user, without_template=user + "\n")

    def generation_ids(self, prompt: str) -> list[int]:
        """The token ids HFLM's ``generate_until`` gives the model for ``prompt`` (its
        ``tok_batch_encode``, padding aside); p* is the last. Training and calibration on
        generation examples use these ids (``train.Session.encode_generation``), never
        ``_encode_pair``, which moves a template's trailing "\\n" into the continuation and so
        would put p* on another token than the one generation edits."""
        ids, mask = self.tok_batch_encode([prompt])
        return ids[0][mask[0].bool()].tolist()

    def chat_prompt(self, user: str, without_template: str) -> str:
        """``user`` as one user turn of the chat template, ready for the answer;
        ``without_template`` for a tokenizer that has none (e.g. a base model)."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
        return without_template

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        width = context.shape[1]
        context, generation_kwargs["attention_mask"] = self._without_empty_rows(context, generation_kwargs.get("attention_mask"))
        from transformers import LogitsProcessorList

        generation_kwargs["logits_processor"] = LogitsProcessorList(
            [*generation_kwargs.get("logits_processor", []), _FiniteLogits(self, context, generation_kwargs["attention_mask"])])
        added = context.shape[1] - width  # a column added for an all-empty batch, cut from the answer below
        return self._generate_nonempty(context, max_length + added, stop, **generation_kwargs)[:, added:]

    def _without_empty_rows(self, context, attention_mask):
        """An empty prompt gets lm-eval's prefix token (BOS or EOT) as its only token.

        lm-eval scores an empty context's continuation after that token; generation from an
        empty prompt starts from it too, and p* (where every method edits) is that token.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(context)
        if context.shape[1] == 0:
            context = context.new_full((context.shape[0], 1), self.tokenizer.pad_token_id or 0)
            attention_mask = torch.zeros_like(context)
        empty = attention_mask.sum(-1) == 0
        if bool(empty.any()):
            context, attention_mask = context.clone(), attention_mask.clone()
            context[empty, -1] = self.prefix_token_id
            attention_mask[empty, -1] = 1
        return context, attention_mask

    def _generate_nonempty(self, context, max_length: int, stop: list[str], **generation_kwargs):
        iv = self.intervention
        if iv is None or (len(iv.variants()) == 1 and not iv.uses_base):
            # One edit: HFLM's generation inside it; the edit reaches the prefill's last column
            # (HFLM left-pads), plus the method's prompt sites, and the decode steps are left
            # to the method (untouched for a p*-only edit).
            sites = None if iv is None else self._generation_sites(generation_kwargs.get("attention_mask"), context)
            with contextlib.nullcontext() if iv is None else iv.applied(self.model, sites):
                return super()._model_generate(context, max_length, stop, **generation_kwargs)
        return self._routed_generate(context, max_length, stop, **generation_kwargs)

    def _generation_sites(self, attention_mask, context):
        """p* of every left-padded row (the last column), plus the method's prompt sites."""
        if attention_mask is None:
            attention_mask = torch.ones_like(context)
        width = attention_mask.shape[1]
        rows, cols = [], []
        for row, length in enumerate(attention_mask.sum(-1).tolist()):
            for position in self.intervention.prompt_sites(length) + [length - 1]:
                rows.append(row)
                cols.append(width - length + position)
        if len(rows) == len(attention_mask):
            return None  # p* alone: the last column of every row
        return torch.tensor(rows, device=context.device), torch.tensor(cols, device=context.device)

    def _routed_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """Every variant for T_ent greedy steps as one batch, then the chosen one continues (eq:entropy_gen)."""
        from lm_eval.models.utils_hf import stop_sequences_criteria

        kwargs = dict(generation_kwargs)
        attention_mask = kwargs.pop("attention_mask", None)
        if attention_mask is None:
            attention_mask = torch.ones_like(context)
        if kwargs.get("temperature", 0.0) == 0.0 and not kwargs.get("do_sample"):
            kwargs.pop("temperature", None)
            kwargs["do_sample"] = False
        variants, apply, capture, site_only = self._variants()
        iv = self.intervention
        window = int(iv.config.get("hyperparameters", {}).get("T_ent", 8))
        def choose(run: runner.VariantRun) -> tuple[int, dict]:
            chosen, record = iv.choose(run)
            _refuse_nonfinite(run, record, iv, f"task {self._generation_task}, prompt "
                                               f"{self._prompt_text(context[run.prompt], attention_mask[run.prompt])!r}")
            return chosen, record

        sequences, records = runner.generate_variants(
            self.model, context, attention_mask, variants, apply, choose, window, max_length,
            capture=capture, site_only=site_only, screen=iv.screen if iv.uses_base else None, edit_layer=iv.layer,
            pad_token_id=self.tokenizer.pad_token_id,
            stopping_criteria=lambda rows, width: stop_sequences_criteria(self.tokenizer, stop, width, rows),
            **kwargs,
        )
        for row, record in enumerate(records):
            self.records.append({"task": self._generation_task, "doc_id": None, **record})
            prompt = context[row][attention_mask[row].bool()]
            self._record_keys.append(_prompt_order(self._generation_task, None, tuple(prompt.tolist())))
        return sequences

    def _prompt_text(self, ids: torch.Tensor, mask: torch.Tensor) -> str:
        """A prompt row's text, shortened, to name it in errors."""
        text = self.tok_decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
        return text if len(text) <= 120 else text[:40] + " ... " + text[-75:]

    # ------------------------------------------------------------------ bookkeeping

    def set_cache_hook(self, cache_hook) -> None:
        # CachingLM (--use_cache) keys requests on their text only: results computed
        # under one bundle would be served for another. Allow it only when the cache
        # file names this bundle's fingerprint.
        db = getattr(cache_hook, "dbdict", None)
        if self.intervention is not None and db is not None:
            fingerprint = self.intervention.fingerprint()
            if fingerprint not in str(getattr(db, "filename", "")):
                raise ValueError(
                    "--use_cache keys results on the request text only, so a cache shared between bundles "
                    f"would return wrong results. Put this bundle's fingerprint in the cache path, e.g. "
                    f"--use_cache cache/mari-{fingerprint}"
                )
        super().set_cache_hook(cache_hook)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["mari_model"] = self.model_name
        info["mari_intervention"] = None if self.intervention is None else self.intervention.describe()
        if self.intervention is not None:
            info["mari_diagnostics"] = self.diagnostics_summary()
        return info


def _cpu_ranks_under_a_launcher() -> None:
    """Under torchrun / ``accelerate launch`` without a GPU, let accelerate start the CPU ranks (gloo).

    HFLM creates ``Accelerator()``, which on a machine without an accelerator counts one
    process unless told to use the CPU (``accelerate launch --cpu`` says so through
    ACCELERATE_USE_CPU). A user's own setting is kept.
    """
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")


def _check_request_text(requests) -> None:
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


def _prompt_order(task, doc_id, prompt: tuple[int, ...]) -> tuple:
    """The order prompts are scored in (by their tokens, so a shared preamble is read once) and
    their records kept in, whichever rank scored them."""
    return prompt, str(task), -1 if doc_id is None else doc_id


def _as_bool(value, name: str) -> bool:
    if isinstance(value, str):
        if value.strip().lower() in ("true", "on", "1", "yes"):
            return True
        if value.strip().lower() in ("false", "off", "0", "no"):
            return False
    elif isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise ValueError(f"{name}={value!r} in --model_args: use true or false")


def _ablation_args(bundle, **given) -> dict[str, Any]:
    """The MARI switches given in --model_args (gate, rho, experts), checked; the others need a bundle too.

    An empty ``bundle=`` (an unset shell variable) is refused, never read as "no bundle":
    it would evaluate the plain model and report it as ``--model mari``.
    """
    if isinstance(bundle, str) and not bundle.strip():
        raise ValueError("bundle= is empty in --model_args (an unset shell variable?): give the bundle's directory, "
                         "or leave bundle out to evaluate the plain model")
    given = {k: v for k, v in given.items() if v is not None and v != ""}
    if bundle is None and given:
        raise ValueError(f"{', '.join(given)} in --model_args need a bundle: add bundle=DIR, or drop them to "
                         "evaluate the plain model")
    ablation: dict[str, Any] = {}
    if "gate" in given:
        ablation["gate"] = _as_bool(given["gate"], "gate")
    if "rho" in given:
        try:
            ablation["rho"] = float(given["rho"])
        except (TypeError, ValueError):
            raise ValueError(f"rho={given['rho']!r} in --model_args is not a number: give the gate's quantile, "
                             "e.g. rho=0.9") from None
    if "experts" in given:
        ablation["experts"] = str(given["experts"])
    return ablation


def _check_writable(path: Path) -> None:
    """Refuse, before anything is scored, a ``diagnostics=`` file that could not be written at the end."""
    if path.is_dir():
        raise ValueError(f"diagnostics={path} is a directory: give a file name, e.g. diagnostics={path / 'diagnostics.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".check"):
            pass
    except OSError as e:
        raise ValueError(f"diagnostics={path} cannot be written ({e.strerror or e}): choose a writable path") from None


class NonFiniteError(ArithmeticError):
    """A NaN or infinite number while scoring or generating: an answer is never picked from one."""


def _variant_name(iv: methods.Intervention | None, variant: int) -> str:
    if variant == runner.BASE:
        return "the untouched model"
    return iv.variant_name(variant) if iv is not None and hasattr(iv, "variant_name") else f"variant {variant}"


def _refuse_nonfinite(run: runner.VariantRun, record: dict, iv: methods.Intervention | None, where: str) -> None:
    """Stop on a non-finite log-likelihood, entropy, state or energy (eq:energy), naming the document and the variant."""
    bad = [f"{what} of {_variant_name(iv, v)}" for v, what in run.nonfinite()]
    bad += [f"{key} {value}" for key, value in record.items() if key in ("energy", "entropy")
            and not all(math.isfinite(x) for x in (value if isinstance(value, list) else [value]))]
    if bad:
        raise NonFiniteError(f"non-finite numbers at {where}: {'; '.join(bad)}. The scores would be meaningless; "
                             "check the bundle (retrain it) and the model's dtype (float32 avoids overflow)")


class _FiniteLogits:
    """A logits processor for ``generate``: stops on NaN or +inf next-token scores (or a row of -inf
    only), naming the prompt. (-inf for some tokens is a processor's masking, e.g. min_new_tokens.)"""

    def __init__(self, lm: "MariLM", context: torch.Tensor, attention_mask: torch.Tensor):
        self.lm, self.context, self.mask = lm, context, attention_mask

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bad = scores.isnan().any(-1) | torch.isposinf(scores).any(-1) | torch.isneginf(scores).all(-1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            # Routed generation runs several rows per prompt; then the batch is named by its first prompt.
            which = row if len(scores) == len(self.context) else 0
            prompt = self.lm._prompt_text(self.context[which], self.mask[which])
            if len(scores) != len(self.context):
                prompt = f"one of {len(self.context)} prompts, the first {prompt!r}"
            raise NonFiniteError(
                f"non-finite next-token scores while generating (task {self.lm._generation_task}, prompt {prompt!r}); "
                "check the bundle (retrain it) and the model's dtype (float32 avoids overflow)")
        return scores


def _gold_options(task: str | None, doc: dict | None, n_options: int) -> set[int] | None:
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
