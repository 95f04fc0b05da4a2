"""One optimizer step of published ReFT (``baselines.reft_published``): the token-mean NLL of a
batch's answers and its gradient (``batch_gradient``), under LoReFT edits at the first and last
prompt positions of every edited layer. The prompts' edited caches are built once per step where
examples share a prefix under the same edits (``shared_length``), and the answers of several
examples run packed in one sequence (``packed_nll``): the same loss and gradient as one example at
a time (tests/test_training_shortcuts_equal_slow_paths_reft.py).
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Callable

import torch

from mari_eval.evaluation import runner
from mari_eval.injection import devices, site
from mari_eval.training import memory
from mari_eval.injection.plan import Plan
from mari_eval.evaluation.prefix_cache import (Prefix, broadcast_cache, cache_of, common_prefix, encode_prefix, packed_inputs,
                                               with_cache)

if TYPE_CHECKING:
    from mari_eval.training.examples import Example
    from mari_eval.training.session import Session


def answer_of(ex: Example) -> list[int]:
    """The tokens trained on: the gold option's continuation, or the target (generation)."""
    return ex.options[ex.gold if ex.gold is not None else 0]


def shared_length(examples: list[Example], first: int, last: int) -> int:
    """How many leading prompt tokens all ``examples`` share with the same edits, so that one
    pass over them under the edit serves every example of a step: their common prefix, cut
    before any example's last-token window and, where the first-token windows differ (prompts
    capped at half their length), to the shortest of them. 0: nothing worth sharing."""
    if len(examples) < 2:
        return 0
    n = len(common_prefix([ex.context[:-1] for ex in examples]))
    windows = [(min(len(ex.context) // 2, first), min(len(ex.context) // 2, last), len(ex.context)) for ex in examples]
    n = min([n] + [length - l for _, l, length in windows])
    if len({min(f, n) for f, _, _ in windows}) > 1:
        n = min(f for f, _, _ in windows)
    return n if n > 1 else 0


def batch_gradient(session: Session, batch: list[Example], plan: Plan, sites: Callable[[int], list[int]],
                   params: dict[str, torch.Tensor], shared: int, packed: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """(token-mean NLL of the batch's answers, its gradient for ``params``) with ``plan``'s edits at
    ``sites(prompt length)`` of each prompt and at p*.

    Each example's graph is freed once its gradient is taken, so memory holds one example,
    not the batch. The first ``shared`` prompt tokens (``shared_length``: the same tokens and
    the same edits for every example, e.g. a few-shot preamble) run once per step: each example
    reads their cache as leaf tensors, its gradients for them are summed, and one backward
    pass takes the sum through the shared part. Same numbers as running each prompt whole.

    ``packed`` (models whose layers all see the whole prompt, no dropout): the examples' prompts and
    answers run packed in one sequence per ``session.max_tokens`` tokens (``packed_nll``), so memory
    holds one such group instead of one example; the same numbers to float rounding.
    """
    from transformers.cache_utils import \
        DynamicLayer  # deferred: transformers is heavy; only this path needs it

    model, names = session.model, list(params)
    tokens = sum(len(answer_of(ex)) for ex in batch)
    grads = {k: torch.zeros_like(v) for k, v in params.items()}
    head = leaves = None
    if shared:
        head = encode_prefix(model, batch[0].context[:shared], apply=plan.apply,
                             sites=[p for p in sites(len(batch[0].context)) if p < shared])
        if not all(type(layer) is DynamicLayer for layer in head.cache.layers):
            head = None  # sliding-window layers: each prompt runs whole
    if head is not None:
        kv = [t for layer in head.cache.layers for t in (layer.keys, layer.values)]
        # Keys and values below the lowest edited layer do not depend on the edit: they stay as they are.
        carried = [t.detach().requires_grad_(True) if t.requires_grad else t for t in kv]
        outputs = [t for t in kv if t.requires_grad]
        leaves = [c for t, c in zip(kv, carried) if t.requires_grad]
        leaf_head = Prefix(head.tokens, _with_tensors(head.cache, carried))
        leaf_grads = [torch.zeros_like(t) for t in leaves]

    def one_nll(ex: Example) -> torch.Tensor:  # one prompt at a time; its cache and scores go with this call
        positions = sites(len(ex.context))
        if head is None:
            prefix = encode_prefix(model, ex.context[:-1], apply=plan.apply, sites=positions)
        else:
            prefix = _extended(model, leaf_head, ex.context[:-1], [p - shared for p in positions if p >= shared], plan)
        run = runner.score_variants(model, prefix, ex.context[-1], [answer_of(ex)], plan, max_tokens=session.max_tokens)
        return -run.logprobs[0, 0]

    total = 0.0
    start = len(head.tokens) if head is not None else 0
    packed = packed and (head is not None or not shared)  # a sliding-window head: one prompt at a time
    for group in _token_groups(batch, start, session.max_tokens) if packed else [[ex] for ex in batch]:
        if packed:
            part = packed_nll(model, leaf_head if head is not None else None, group, plan, sites) / tokens
        else:
            part = one_nll(*group) / tokens
        inputs = list(params.values()) + (leaves or [])
        # retain_graph: R's orthonormalisation (and the shared part) is shared by the batch's
        # examples; the group's own graph is freed when ``part`` goes, below.
        got = torch.autograd.grad(part, inputs, allow_unused=True, retain_graph=True)
        for k, g in zip(names, got):
            if g is not None:
                grads[k] += g
        for acc, g in zip(leaf_grads if leaves else [], got[len(names):]):
            if g is not None:
                acc += g
        total += float(part.detach())
        del part, got  # the group's graph, before the next group's forward builds its own
    if head is not None and outputs:  # the shared part's share of the gradient, in one backward pass
        got = torch.autograd.grad(outputs, list(params.values()), grad_outputs=leaf_grads, allow_unused=True)
        for k, g in zip(names, got):
            if g is not None:
                grads[k] += g
    return total, grads


def step_estimate(session: Session, batch: list[Example], sites: Callable[[int], list[int]], shared: int, packed: bool,
                  layers: list[int], rank: int) -> memory.Step:
    """The activations ``batch_gradient`` holds at its peak (``memory.step_estimate``'s passes,
    through the layers above the lowest edited one): the shared preamble's pass under the edit,
    with the gradients of its keys and values, kept through the step; and the largest group's
    (packed) or example's (one at a time: its prompt after the preamble, then its answer) passes,
    each freed by its backward. Plus the edit's own: each edited position's hidden state in every
    edited layer, and R and W in the model's dtype. Sliding-window layers hold fewer keys than
    counted (their prompts run whole): an upper bound there."""
    model, low = session.model, min(layers)
    b, d = site.element_bytes(model), session.hidden_size
    above = session.num_layers - low - 1  # layers whose input depends on the edit

    def edit_bytes(positions: int) -> int:
        return len(layers) * (positions * d + 2 * rank * d) * b

    def step(passes: list[memory.Pass], positions: int) -> memory.Step:
        made = memory.step_estimate(model, low, passes)
        return memory.Step(made.passes, made.saved_bytes + edit_bytes(positions), made.transient_bytes)

    kept = 0
    if shared:
        head = step([memory.Pass(shared, shared, scored=0, masked=False)], sum(p < shared for p in sites(len(batch[0].context))))
        # the gradients of the keys and values of the layers above the edit: their share of the cache
        kept = head.saved_bytes + shared * site.kv_bytes_per_token(model) * above // session.num_layers
    parts = []
    if packed:
        for group in _token_groups(batch, shared, session.max_tokens):
            tokens = sum(len(ex.context) - shared + len(answer_of(ex)) - 1 for ex in group)
            parts.append(step([memory.Pass(tokens, shared + tokens, scored=sum(len(answer_of(ex)) for ex in group))],
                              sum(1 + sum(p >= shared for p in sites(len(ex.context))) for ex in group)))
    else:
        for ex in batch:
            prompt, answer = len(ex.context) - 1, len(answer_of(ex))
            passes = [memory.Pass(prompt - shared, prompt, scored=0, masked=bool(shared)), memory.Pass(answer, prompt + answer)]
            parts.append(step(passes, 1 + sum(p >= shared for p in sites(len(ex.context)))))
    largest = max(parts, key=lambda part: part.total)
    return memory.Step(largest.passes + bool(shared), kept + largest.saved_bytes, largest.transient_bytes)


def _token_groups(batch: list[Example], start: int, max_tokens: int) -> list[list[Example]]:
    """``batch`` in order, cut into groups whose prompts after ``start`` and answers add up to at
    most ``max_tokens`` tokens (one example alone may exceed it)."""
    groups: list[list[Example]] = []
    size = 0
    for ex in batch:
        n = len(ex.context) - start + len(answer_of(ex)) - 1
        if groups and size + n <= max_tokens:
            groups[-1].append(ex)
            size += n
        else:
            groups.append([ex])
            size = n
    return groups


def packed_nll(model: torch.nn.Module, head: Prefix | None, group: list[Example], plan: Plan,
               sites: Callable[[int], list[int]]) -> torch.Tensor:
    """The summed NLL of ``group``'s answers, each after its prompt, in one forward pass: every
    example's prompt after ``head`` (the cache of the tokens all share, or None), its p* and its
    answer, packed in one sequence where each token sees ``head`` and its own example's earlier
    tokens only, at its own positions, under ``plan``'s edits at ``sites(prompt length)`` and at p*
    (what ``_extended`` and ``runner.score_variants`` run for one example)."""
    start = len(head.tokens) if head is not None else 0
    rows = [list(ex.context[start:]) + answer_of(ex)[:-1] for ex in group]
    inputs = packed_inputs(model, start, rows, [], [start] * len(rows))
    offsets = [0]
    for row in rows[:-1]:
        offsets.append(offsets[-1] + len(row))
    edited, scored, targets = [], [], []
    for ex, offset in zip(group, offsets):
        p_star = len(ex.context) - 1
        edited += [offset + p - start for p in sites(len(ex.context)) if p >= start] + [offset + p_star - start]
        scored += range(offset + p_star - start, offset + p_star - start + len(answer_of(ex)))
        targets += answer_of(ex)
    device = inputs["input_ids"].device
    cols = torch.tensor(edited, device=device)
    cache = broadcast_cache(head.cache, 1) if head is not None else None
    with plan.apply(None, (torch.zeros_like(cols), cols)):
        # Logits of the answers' positions only: the prompts' would be thrown away.
        logits = model(**with_cache(model, cache), use_cache=cache is not None, **inputs,
                       logits_to_keep=torch.tensor(scored, device=device)).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -logprobs.gather(-1, torch.tensor(targets, device=logprobs.device)[:, None]).sum()


def _with_tensors(cache, tensors: list[torch.Tensor]):
    """A copy of ``cache`` whose layers' keys and values are ``tensors`` (in layer order, keys first)."""
    new = copy.copy(cache)
    new.layers = []
    for i, layer in enumerate(cache.layers):
        layer = copy.copy(layer)
        layer.keys, layer.values = tensors[2 * i], tensors[2 * i + 1]
        new.layers.append(layer)
    return new


def _extended(model: torch.nn.Module, head: Prefix, tokens: list[int], cols: list[int], plan: Plan) -> Prefix:
    """The cache of ``tokens`` from ``head``'s (a prefix of them), the rest run under ``plan``'s edits at
    ``cols`` (positions counted from the end of ``head``); ``head`` itself is never written."""
    rest = tokens[len(head.tokens):]
    cache = broadcast_cache(head.cache, 1)
    if not rest:
        return Prefix(tuple(tokens), cache)
    device = devices.input_device(model)
    index = torch.tensor(cols, dtype=torch.long, device=device)
    edit = plan.apply(None, (torch.zeros_like(index), index)) if cols else contextlib.nullcontext()
    with edit:
        out = model(input_ids=torch.tensor([rest], device=device), **with_cache(model, cache), use_cache=True,
                    logits_to_keep=1)
    return Prefix(tuple(tokens), cache_of(out))
