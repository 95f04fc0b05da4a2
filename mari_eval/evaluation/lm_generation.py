"""Generation for ``--model mari`` (``MariLM``'s ``generate_until``), as a mixin over lm-eval's HFLM.

HFLM left-pads each batch of prompts, so p* is the last column of the prefill: a plan with one
variant is applied around HFLM's own generation (``Plan.apply`` at the rows' p* and the method's
prompt sites); a plan with several (MARI's experts) runs them all for its routing window as one
batch, then the chosen variant of each prompt decodes (``mari_eval.evaluation.generation``, eq:entropy_gen).
Prompts of a task whose docs carry ``CHAT_TURN_FIELD`` (SORRY-Bench) are rendered as one user turn
of the chat template, as training renders them. Every choice is recorded with its task and doc_id
(the batch's rows are matched to their requests as HFLM encodes them, ``generation_order``), and
non-finite scores stop generation naming the prompt (``lm_checks.FiniteLogits``).

The mixin reads what ``MariLM`` sets up: ``plan``, ``intervention``, ``choices``, the method's
instruction (``instruction``, ``instructed``, ``with_instruction``, ``_templated``), and the generation
bookkeeping (``_generation_task``, ``_generation_docs``, ``_batch_docs``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

import torch
from lm_eval.models.utils import Collator, normalize_gen_kwargs
from lm_eval.models.utils_hf import stop_sequences_criteria
from transformers import LogitsProcessorList

from mari_eval.evaluation import batching, generation, lm_checks as checks, runner
from mari_eval.evaluation.choice_log import prompt_order

# A doc field (harness_tasks/utils.py, SORRY-Bench) holding the prompt as one chat user turn:
# a generation context equal to it is rendered through the model's chat template.
CHAT_TURN_FIELD = "chat_user_turn"

log = logging.getLogger("mari_eval.evaluation.lm")


class GenerationMixin:
    """``generate_until`` and what it needs, for a subclass of HFLM (``MariLM``)."""

    def generate_until(self, requests, disable_tqdm: bool = False):
        self._check_heldout_splits(requests)
        checks.check_request_text(requests)
        # Tasks whose docs carry CHAT_TURN_FIELD (SORRY-Bench) want their prompt as one user
        # turn of the chat template, as training renders it. A context lm-eval already
        # changed (--apply_chat_template, a system instruction, few-shot) no longer equals
        # the turn and is left alone, so the template is never applied twice.
        # A method's instruction (Prompting) joins the chat turn's system turn, or precedes another
        # prompt (``MariLM.instructed``; the identity for every other method).
        asked = {}  # the arguments lm-eval's --use_cache looks a request up by, where they are rendered here
        for request in requests:
            if id(request) in asked:  # the same request again (lm-eval's padding of a rank): rendered once
                continue
            turn = request.doc.get(CHAT_TURN_FIELD) if isinstance(request.doc, dict) else None
            chat_turn = isinstance(turn, str) and request.args[0] == turn
            prompt = self.chat_turn_prompt(turn) if chat_turn else self.instructed(request.args[0])
            if chat_turn or prompt != request.args[0]:
                asked[id(request)] = request.args
                request.arguments = (prompt, *request.args[1:])
        # lm-eval sends every task's generation requests in one call and HFLM reorders them:
        # each batch's rows are matched to their requests when HFLM encodes the batch
        # (tok_batch_encode), so that every record names its task and doc_id. The call's task,
        # when it holds one task's requests, also names the prompt in errors (FiniteLogits).
        tasks = {request.task_name for request in requests}
        self._generation_task = tasks.pop() if len(tasks) == 1 else None

        def generate(unique):
            self._generation_docs = generation_order(unique)
            self._generation_batch = self._auto_generation_batch(unique) if str(self.batch_size).startswith("auto") else None
            try:
                return super(GenerationMixin, self).generate_until(unique, disable_tqdm)
            finally:
                self._generation_docs, self._batch_docs, self._generation_batch = None, [], None

        try:
            answers = self._once_per_request(requests, generate)
        finally:
            self._generation_task = None
        for request, answer in zip(requests, answers):  # HFLM cached it under the rendered prompt
            if id(request) in asked:
                self.cache_hook.add_partial("generate_until", asked[id(request)], answer)
        return answers

    def tok_batch_encode(self, strings, *args, **kwargs):
        # HFLM's generate_until encodes each batch here, just before generating it: the rows'
        # requests are named now (generation_order), so that their records carry their doc_id.
        if self._generation_docs is not None:
            self._batch_docs = [self._next_generation_doc(text) for text in strings]
        return super().tok_batch_encode(strings, *args, **kwargs)

    def _next_generation_doc(self, prompt: str) -> tuple:
        queue = self._generation_docs.get(prompt)
        if queue:
            return queue.popleft()
        # Not a prompt of this call (were lm-eval to encode its batches otherwise): the record
        # says so (doc_id None) rather than naming another document.
        log.warning("a generation batch holds a prompt not among this call's requests; its diagnostics record "
                    "has doc_id None (prompt %r)", prompt[:80])
        return self._generation_task, None

    _generation_batch: int | None = None  # prompts per batch for batch_size=auto, while generating

    def _auto_generation_batch(self, requests) -> int:
        """Prompts per generation batch under ``batch_size=auto`` (``batching.generation_batch``):
        the budget in tokens over the longest prompt (as HFLM cuts it) plus its ``max_gen_toks``."""
        longest = 0
        for request in requests:
            kwargs = request.args[1] if len(request.args) > 1 and isinstance(request.args[1], dict) else {}
            new = int(normalize_gen_kwargs(dict(kwargs), self.max_gen_toks)["max_gen_toks"])  # as HFLM reads it
            longest = max(longest, min(len(self.tok_encode(request.args[0])), max(1, self.max_length - new)) + new)
        budget = self.batch_tokens or batching.generation_token_budget(self.model)
        size = batching.generation_batch(longest, len(self.plan.variants), budget, self.request_cap)
        log.info("generation: %d prompts per batch (batch_size=auto: %d tokens, rows of up to %d tokens, %d per prompt)",
                 size, budget, longest, len(self.plan.variants))
        return size

    def _detect_batch_size(self, requests=None, pos: int = 0) -> int:
        # HFLM's generate_until asks here under batch_size=auto; its own answer is a search for
        # the largest batch that does not run out of memory, capped at 64 requests.
        if self._generation_batch is None:
            return super()._detect_batch_size(requests, pos)
        return self._generation_batch

    def chat_turn_prompt(self, user: str) -> str:
        """The prompt of a task whose doc carries CHAT_TURN_FIELD (SORRY-Bench), as generated
        and as trained: one user turn of the chat template, or ``user + "\\n"`` without one."""
        return self.chat_prompt(user, without_template=user + "\n")

    def generation_ids(self, prompt: str) -> list[int]:
        """The token ids HFLM's ``generate_until`` gives the model for ``prompt`` (its
        ``tok_batch_encode``, padding aside); p* is the last. Training and calibration on
        generation examples use these ids (``session.Session.encode_generation``), never
        ``_encode_pair``, which moves a template's trailing "\\n" into the continuation and so
        would put p* on another token than the one generation edits."""
        ids, mask = self.tok_batch_encode([prompt])
        return ids[0][mask[0].bool()].tolist()

    def chat_prompt(self, user: str, without_template: str) -> str:
        """``user`` as one user turn of the chat template, ready for the answer;
        ``without_template`` for a tokenizer that has none (e.g. a base model)."""
        if getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template(
                self.with_instruction([{"role": "user", "content": user}]), tokenize=False, add_generation_prompt=True
            )
            if self.instruction:
                self._templated.add(rendered)
            return rendered
        return self.instructed(without_template)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        width = context.shape[1]
        context, generation_kwargs["attention_mask"] = self._without_empty_rows(context, generation_kwargs.get("attention_mask"))
        mask = generation_kwargs["attention_mask"]
        finite = checks.FiniteLogits(lambda i: self._prompt_text(context[i], mask[i]), len(context), self._generation_task)
        generation_kwargs["logits_processor"] = LogitsProcessorList([*generation_kwargs.get("logits_processor", []), finite])
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
        if len(self.plan.variants) == 1:
            # One edit: HFLM's generation inside it; the edit reaches the prefill's last column
            # (HFLM left-pads), plus the method's prompt sites, and the decode steps are left
            # to the method (untouched for a p*-only edit).
            sites = self._generation_sites(generation_kwargs.get("attention_mask"), context)
            with self.plan.apply(None, sites):
                return super()._model_generate(context, max_length, stop, **generation_kwargs)
        return self._routed_generate(context, max_length, stop, **generation_kwargs)

    def _generation_sites(self, attention_mask, context):
        """p* of every left-padded row (the last column), plus the method's prompt sites."""
        if attention_mask is None:
            attention_mask = torch.ones_like(context)
        width = attention_mask.shape[1]
        rows, cols = [], []
        for row, length in enumerate(attention_mask.sum(-1).tolist()):
            for position in self.plan.prompt_sites(length) + [length - 1]:
                rows.append(row)
                cols.append(width - length + position)
        if len(rows) == len(attention_mask):
            return None  # p* alone: the last column of every row
        return torch.tensor(rows, device=context.device), torch.tensor(cols, device=context.device)

    def _routed_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """Every variant for the plan's routing window as one batch, then the chosen one continues (eq:entropy_gen)."""
        kwargs = dict(generation_kwargs)
        attention_mask = kwargs.pop("attention_mask", None)
        if attention_mask is None:
            attention_mask = torch.ones_like(context)
        if kwargs.get("temperature", 0.0) == 0.0 and not kwargs.get("do_sample"):
            kwargs.pop("temperature", None)
            kwargs["do_sample"] = False
        docs = self._batch_docs if len(self._batch_docs) == len(context) else [(self._generation_task, None)] * len(context)

        def choose(run: runner.VariantRun) -> tuple[int, dict]:
            chosen, record = self.plan.pick(run)
            task, doc_id = docs[run.prompt]
            checks.refuse_nonfinite(run, record, self.intervention, f"task {task}, document {doc_id}, prompt "
                                    f"{self._prompt_text(context[run.prompt], attention_mask[run.prompt])!r}")
            return chosen, record

        sequences, records = generation.generate_variants(
            self.model, context, attention_mask, dataclasses.replace(self.plan, choose=choose), max_length,
            pad_token_id=self.tokenizer.pad_token_id,
            stopping_criteria=lambda rows, width: stop_sequences_criteria(self.tokenizer, stop, width, rows),
            **kwargs,
        )
        for row, ((task, doc_id), record) in enumerate(zip(docs, records)):
            prompt = context[row][attention_mask[row].bool()]
            self.choices.add(prompt_order(task, doc_id, tuple(prompt.tolist())), {"task": task, "doc_id": doc_id, **record})
        return sequences

    def _prompt_text(self, ids: torch.Tensor, mask: torch.Tensor) -> str:
        """A prompt row's text, shortened, to name it in errors."""
        text = self.tok_decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
        return text if len(text) <= 120 else text[:40] + " ... " + text[-75:]


def generation_order(requests) -> dict[str, deque]:
    """Per prompt, the (task, doc_id) of the requests holding it, in the order HFLM's
    ``generate_until`` generates them: its Collator groups the requests by generation
    arguments (the groups in order of first appearance) and sorts each group stably by prompt,
    so the requests that share a prompt come in this order (and ``tok_batch_encode`` pops them)."""

    groups = Collator.group(list(enumerate(requests)), fn=lambda item: item[1].args[1], group_by="gen_kwargs")
    order: dict[str, deque] = {}
    for members in groups.values():
        for _, request in members:
            order.setdefault(request.args[0], deque()).append((request.task_name, request.doc_id))
    return order
