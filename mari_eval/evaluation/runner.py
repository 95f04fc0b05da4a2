"""Score a prompt's options under every variant of a method's ``Plan``, computing the prompt once.

The frozen model's cache of the prompt before p* is computed once
(``mari_eval.evaluation.prefix_cache``) and only short suffixes run over it:

    prefix  = context[:-1]                      (key/value cache, computed once, no grad)
    row     = [context[-1]] + continuation[:-1] (p* is row position 0)

A *variant* is one alternative edit proposed by a method (MARI: one per expert, plus
its gate probe); variant ``BASE`` (-1) is the untouched model (``mari_eval.injection.plan``). ``score_variants`` lays
out every (variant, option) row in packed batches, installs the method's edit with a
variant id per row, and returns each option's log-likelihood under each variant, the
greedy flags, and the hidden states at p* after the requested layers (for the energy
gate). An edit at l* changes nothing below it, so edited rows start from the untouched
rows' states after l*; and a method may stop after the untouched and probe rows (MARI's
closed gate). Gradients flow when enabled, so training uses the same path as evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from mari_eval.evaluation.row_passes import forward_rows, packable, packed_lower_states
from mari_eval.injection import devices, layer_spans
from mari_eval.injection.plan import BASE, VANILLA, Plan, VariantRun
from mari_eval.evaluation.prefix_cache import PackedPrompts, Prefix

__all__ = ["BASE", "VANILLA", "Plan", "Question", "Untouched", "VariantRun", "score_questions", "score_untouched",
           "score_variants"]


def score_variants(
    model: torch.nn.Module,
    prefix: Prefix,
    last_token: int,
    continuations: Sequence[Sequence[int]],
    plan: Plan,
    max_tokens: int = 1024,
    lower: tuple[int, list[torch.Tensor]] | None = None,
    untouched: Untouched | None = None,
    known: Sequence[VariantRun] = (),
) -> VariantRun:
    """Log-likelihood of every continuation after ``prefix + [last_token]`` under every variant of ``plan``.

    Variants in ``plan.site_only`` get one row holding p* alone: only their hidden states at
    p* (``plan.capture``) are wanted, as for the gate's probe run. ``lower = (layer, states)``
    gives the frozen model's states after ``layer`` for each option's row
    (``lower_states``): the layers up to ``layer`` are then not recomputed (valid when the
    edits are at ``layer`` or above; training reuses them across experts and epochs).
    ``untouched`` (``score_untouched`` of the same rows) answers the BASE rows instead of
    running them again (``mari_eval.evaluation.shared_pass``: one untouched run for several methods).
    ``known``: other runs of the same rows under the same edits (``shared_pass``: MARI's rows
    over one bundle that differ only in their gate); a variant one of them computed, with the
    states at p* this plan captures, is copied from it rather than run again.

    The rows run in three stages:

    1. the untouched model's (BASE) rows, in chunks laid out exactly as a run with BASE
       alone would be, so a closed gate returns bit-identical scores to the vanilla
       model. With ``plan.edit_layer`` (every edit is at that layer's output or above) they
       also keep their states after it, which become ``lower`` for the edited rows
       (without BASE rows, a pass up to that layer computes them for several variants);
    2. the site-only variants;
    3. the other variants, unless ``plan.screen`` (given the run so far) says they are not
       needed: MARI's closed gate answers with BASE, so its experts are never run and
       their log-likelihoods stay NaN.
    """
    question = Question(last_token, continuations, lower, untouched, known)
    return score_questions(model, PackedPrompts.of(prefix), [question], plan, max_tokens)[0]


@dataclass
class Question:
    """One prompt's options to score (``score_questions``): p*'s token, the continuations, and
    what ``score_variants`` may be given for them (``lower``, ``untouched``, ``known``)."""

    last_token: int
    continuations: Sequence[Sequence[int]]
    lower: tuple[int, list[torch.Tensor]] | None = None
    untouched: Untouched | None = None
    known: Sequence[VariantRun] = ()


def score_questions(model: torch.nn.Module, prompts: PackedPrompts, questions: Sequence[Question], plan: Plan,
                    max_tokens: int = 1024) -> list[VariantRun]:
    """``score_variants`` of several questions at once, question i after prompt i of ``prompts``:
    each stage runs the rows of every question in the same packed passes (at most ``max_tokens``
    row tokens each), so a GPU computes many questions' rows per pass. The same numbers as one
    question at a time (to rounding: the passes are larger), and the same stages per question."""
    if len(questions) > 1 and not packable(model, max(map(prompts.length, range(len(questions)))), 1):
        raise ValueError("several questions are scored together only where their rows can be packed (row_passes.packable)")
    rows = [_Rows(model, prompts, q.last_token, q.continuations, plan, max_tokens) for q in questions]
    variants = plan.variants
    base = [i for i, v in enumerate(variants) if v == BASE]
    probes = [i for i, v in enumerate(variants) if v != BASE and v in plan.site_only]
    answering = [i for i, v in enumerate(variants) if v != BASE and v not in plan.site_only]
    keep_after = plan.edit_layer if (probes or answering) and layer_spans.can_start_after(model) else None
    lower = [q.lower for q in questions]
    wants = [keep_after if q.lower is None else None for q in questions]  # the layer whose states to keep, per question
    kept: list[list[torch.Tensor] | None] = [None] * len(questions)
    computed = []
    for i, q in enumerate(questions):
        if q.untouched is not None:
            rows[i].take_untouched(base, q.untouched)
            kept[i] = q.untouched.below.get(wants[i])  # the frozen rows' states, whichever plan asked for them
        else:
            computed.append(i)
    keep = {i: (wants[i],) for i in computed if wants[i] is not None}
    for i, below in _run(rows, {i: (base, questions[i].lower) for i in computed}, keep).items():
        kept[i] = below.get(wants[i])
    missing = [i for i in range(len(questions)) if kept[i] is None and wants[i] is not None]
    if missing and len(probes) + len(answering) > 1:  # no BASE rows to keep them from
        for i, states in _lower_states(model, prompts, rows, missing, keep_after).items():
            kept[i] = states
    for i in range(len(questions)):
        if kept[i] is not None:
            lower[i] = (keep_after, kept[i])
    _run(rows, {i: (r.take_known(probes, questions[i].known), lower[i]) for i, r in enumerate(rows)})
    if answering:
        screened = [i for i, r in enumerate(rows) if plan.screen is None or plan.screen(r.result())]
        _run(rows, {i: (rows[i].take_known(answering, questions[i].known), lower[i]) for i in screened})
    return [r.result() for r in rows]


@dataclass
class Untouched:
    """The frozen model's rows of one prompt's options, computed once for several plans
    (``score_untouched``): its run (the one BASE row, with states at p* after ``run.site``'s
    layers) and, per layer of ``below``, every option row's states after that layer (packed
    path only: empty where the model's rows cannot be packed)."""

    run: VariantRun
    below: dict[int, list[torch.Tensor]]


def score_untouched(
    model: torch.nn.Module,
    prefix: Prefix,
    last_token: int,
    continuations: Sequence[Sequence[int]],
    capture: Sequence[int] = (),
    keep: Sequence[int] = (),
    max_tokens: int = 1024,
) -> Untouched:
    """The VANILLA run of the options, laid out as ``score_variants`` lays out BASE rows (so its
    numbers are the same), with the states at p* after ``capture`` and every row's states after
    ``keep``: what other plans' ``score_variants(untouched=...)`` read instead of recomputing."""
    rows = [_Rows(model, PackedPrompts.of(prefix), last_token, continuations, Plan(capture=tuple(capture)), max_tokens)]
    below = _run(rows, {0: ([0], None)}, {0: tuple(keep)} if keep else {}).get(0, {})
    return Untouched(rows[0].result(), below)


class _Rows:
    """One prompt's (variant, option) rows under ``plan`` (its place in ``prompts`` is its index in ``_run``'s list); what
    every row gave (its score, greedy flag, state at p*) is kept until ``result``."""

    def __init__(self, model: torch.nn.Module, prompts: PackedPrompts, last_token: int,
                 continuations: Sequence[Sequence[int]], plan: Plan, max_tokens: int):
        self.model, self.prompts, self.last_token, self.plan = model, prompts, last_token, plan
        self.continuations, self.max_tokens = continuations, max_tokens
        self.device = devices.input_device(model)
        self.scores: dict[tuple[int, int], torch.Tensor] = {}
        self.flags: dict[tuple[int, int], bool] = {}
        self.states: dict[int, dict[int, torch.Tensor]] = {layer: {} for layer in plan.capture}

    def layout(self, of: list[int]) -> list[tuple[int, int | None]]:
        """(variant index, option or None for a row of p* alone) of each row of the variant indices ``of``."""
        layout: list[tuple[int, int | None]] = []
        for v_idx in of:
            site_only = self.plan.variants[v_idx] in self.plan.site_only
            layout.extend([(v_idx, None)] if site_only else [(v_idx, m) for m in range(len(self.continuations))])
        return layout

    def tokens(self, m: int | None) -> list[int]:
        """The row of option ``m``: p*'s token, then the option's tokens but its last."""
        return [self.last_token] + (list(self.continuations[m][:-1]) if m is not None else [])

    def take(self, v: int, m: int | None, logits: torch.Tensor, seen: dict[int, torch.Tensor]) -> None:
        """What row (variant index ``v``, option ``m``) gave: its logits, its states at p* after the captured layers."""
        for layer, h in seen.items():  # the state at p* is the same in all rows of a variant
            self.states[layer].setdefault(v, h)
        if m is None:
            return
        target = torch.tensor(self.continuations[m], device=logits.device)
        lp = F.log_softmax(logits.float(), dim=-1)
        self.scores[v, m] = lp.gather(-1, target[:, None]).sum()
        self.flags[v, m] = bool((lp.argmax(-1) == target).all())

    def take_untouched(self, of: list[int], untouched: Untouched) -> None:
        """The BASE variant indices ``of`` answered from ``untouched`` rather than run."""
        for v_idx in of:
            for m in range(len(self.continuations)):
                self.scores[v_idx, m] = untouched.run.logprobs[0, m]
                self.flags[v_idx, m] = bool(untouched.run.greedy[0, m])
            for layer in self.states:
                if layer not in untouched.run.site:
                    raise ValueError(f"the untouched run holds no state at p* after layer {layer}, which this plan "
                                     f"reads (plan.capture): compute it with score_untouched(capture=...) naming {layer}")
                self.states[layer][v_idx] = untouched.run.site[layer][0]

    def take_known(self, of: list[int], known: Sequence[VariantRun]) -> list[int]:
        """The variant indices of ``of`` that no run of ``known`` holds; those it holds (scored, with a
        state at p* after every captured layer) are copied from it: scores, greedy flags, states."""
        missing = []
        for v_idx in of:
            variant = self.plan.variants[v_idx]
            source = next((run for run in known if self._holds(run, variant)), None)
            if source is None:
                missing.append(v_idx)
                continue
            row = source.row(variant)
            if variant not in self.plan.site_only:
                for m in range(len(self.continuations)):
                    self.scores[v_idx, m] = source.logprobs[row, m]
                    self.flags[v_idx, m] = bool(source.greedy[row, m])
            for layer in self.states:
                self.states[layer][v_idx] = source.site[layer][row]
        return missing

    def _holds(self, run: VariantRun, variant: int) -> bool:
        if variant not in run.variants:
            return False
        row = run.row(variant)
        if variant not in self.plan.site_only and (run.logprobs is None or not run.was_scored(variant)):
            return False  # its options were not scored there (a site-only row, or behind a closed gate)
        return all(layer in run.site and not bool(run.site[layer][row].isnan().all()) for layer in self.states)

    def result(self) -> VariantRun:
        variants, n_var, n_opt = self.plan.variants, len(self.plan.variants), len(self.continuations)
        # Scores live where the output head computes (the last device of a device map).
        nan = torch.tensor(float("nan"), device=next(iter(self.scores.values())).device if self.scores else self.device)
        logprobs = torch.stack([torch.stack([self.scores.get((v, m), nan) for m in range(n_opt)]) for v in range(n_var)])
        greedy = torch.tensor([[self.flags.get((v, m), False) for m in range(n_opt)] for v in range(n_var)],
                              device=self.device)
        site_states = {layer: _rows_of(by_v, n_var) for layer, by_v in self.states.items() if by_v}
        scored = frozenset(variants[v] for v, _ in self.scores)
        return VariantRun(list(variants), logprobs, greedy, site_states, scored=scored)


def _rows_of(by_variant: dict[int, torch.Tensor], n_var: int) -> torch.Tensor:
    """[V, d] states of the variants run so far; NaN rows for those not run."""
    some = next(iter(by_variant.values()))
    return torch.stack([by_variant.get(v, torch.full_like(some, float("nan"))) for v in range(n_var)])



def _run(rows: list[_Rows], asks: dict[int, tuple[list[int], tuple[int, list[torch.Tensor]] | None]],
         keep: dict[int, tuple[int, ...]] | None = None) -> dict[int, dict[int, list[torch.Tensor]]]:
    """Score, for each question i of ``asks``, the rows of its variant indices ``asks[i][0]`` (from
    its states ``asks[i][1]`` after a layer, when given), in packed passes of at most ``max_tokens``
    row tokens; per question of ``keep``, {layer: each option's states after that layer}."""
    keep = keep or {}
    items = [(i, v, m) for i, (of, _) in asks.items() for v, m in rows[i].layout(of)]
    if not items:
        return {}
    first = rows[0]
    model, prompts, plan = first.model, first.prompts, first.plan
    layers = tuple(sorted({layer for wanted in keep.values() for layer in wanted}))
    kept: dict[int, dict[int, dict[int, torch.Tensor]]] = {i: {layer: {} for layer in keep[i]} for i in keep}
    size = lambda item: len(rows[item[0]].tokens(item[2]))
    # Rows that start from kept states and rows that do not run in separate passes.
    for starts in (True, False):
        part = [item for item in items if (asks[item[0]][1] is not None) == starts]
        for chunk in chunks(part, list(map(size, part)), first.max_tokens):
            tokens = [rows[i].tokens(m) for i, _, m in chunk]
            variant_ids = torch.tensor([plan.variants[v] for _, v, _ in chunk], device=first.device)
            start = None
            if starts:
                lower = [asks[i][1] for i, _, _ in chunk]
                start = (lower[0][0], torch.cat([low[1][m] if m is not None else low[1][0][:1]
                                                 for low, (_, _, m) in zip(lower, chunk)]))
            logits, seen, below = forward_rows(model, prompts, [i for i, _, _ in chunk], tokens, variant_ids,
                                               plan.apply, plan.capture, start, layers)
            for j, (i, v, m) in enumerate(chunk):
                rows[i].take(v, m, logits[j], {layer: h[j] for layer, h in seen.items()})
                if m is not None and i in kept:
                    for layer in kept[i]:
                        kept[i][layer][m] = below[layer][j]
    n = {i: len(rows[i].continuations) for i in kept}
    return {i: {layer: [by_m[m] for m in range(n[i])] for layer, by_m in by_layer.items() if len(by_m) == n[i]}
            for i, by_layer in kept.items()}


def chunks(items: list, sizes: list[int], max_tokens: int) -> list[list]:
    """``items`` in order, cut into packed passes of at most ``max_tokens`` row tokens (one item alone may exceed it)."""
    out, current, total = [], [], 0
    for item, size in zip(items, sizes):
        if current and total + size > max_tokens:
            out.append(current)
            current, total = [], 0
        current.append(item)
        total += size
    return out + ([current] if current else [])


def _lower_states(model: torch.nn.Module, prompts: PackedPrompts, rows: list[_Rows], which: list[int],
                  layer: int) -> dict[int, list[torch.Tensor]]:
    """The frozen model's states after ``layer`` of every option row of the questions ``which``
    (those whose rows can be packed), in passes of at most ``max_tokens`` row tokens."""
    items = [(i, m) for i in which for m in range(len(rows[i].continuations))
             if packable(model, prompts.length(i), max(map(len, rows[i].continuations)))]
    got: dict[int, dict[int, torch.Tensor]] = {}
    for chunk in chunks(items, [len(rows[i].tokens(m)) for i, m in items], rows[0].max_tokens):
        states = packed_lower_states(model, prompts, [i for i, _ in chunk], [rows[i].tokens(m) for i, m in chunk], layer)
        for (i, m), h in zip(chunk, states):
            got.setdefault(i, {})[m] = h
    return {i: [by_m[m] for m in range(len(by_m))] for i, by_m in got.items()}
