"""``Session``: the frozen model at a site, and the work on it that training shares.

A method's ``fit`` gets a ``Session``: the model (loaded once, frozen, in its ``Placement``), the
site's layer, and the frozen work that no edit can change, done once per example
(``Session.prepare``): the key/value cache of the prompt before p* (sharing the longest common
prefix of a set, e.g. TruthfulQA's 6-shot preamble, and packing several examples in one pass)
and the states after l* of every option row, kept within a memory budget (``mari_eval.training.memory``).
``Session.run`` scores an example's options under a plan through the same runner as evaluation.
``mari_eval.training.train`` builds the examples and calls the method.
"""

from __future__ import annotations

import copy
import logging
from typing import Sequence

import torch
from tqdm import tqdm

from mari_eval.evaluation import row_passes, runner
from mari_eval.injection import devices, layer_spans, site
from mari_eval.training import memory
from mari_eval.storage.checkpoint import NO_CHECKPOINTS
from mari_eval.injection.devices import Placement
from mari_eval.training.examples import Example
from mari_eval.evaluation.lm import MariLM
from mari_eval.injection.plan import Plan, VariantEdit, VariantRun
from mari_eval.evaluation.prefix_cache import (Prefix, broadcast_cache, common_prefix, encode_prefix, encode_prompts, joined,
                                               own_part, with_cache)

log = logging.getLogger(__name__)


MAX_TOKENS = 1024  # row tokens per packed pass, by default


class Session:
    """The frozen model at one site, and the runner calls every method's training uses."""

    memory_held = 0  # bytes kept by earlier ``prepare`` calls
    largest_step = 0  # bytes of the largest training step's activations so far (``step_estimate``)
    _memory_budget: int | None = None  # None: the default, read when first needed

    def __init__(self, model_name: str, layer: int | None = None, placement: "Placement | None" = None,
                 max_tokens: int = MAX_TOKENS, max_memory: str | int | None = None, lm=None):
        """``lm``: an already loaded ``MariLM`` to train through (``model_name`` then only names it)."""
        self.model_name = model_name
        self.placement = placement or Placement()
        self.lm = lm if lm is not None else MariLM(pretrained=model_name, **self.placement.model_args())
        self.model = self.lm.model
        self.num_layers = site.num_layers(self.model)
        self.layer = site.check_layer(self.model, self.num_layers // 2 if layer is None else layer)
        self.memory_budget = memory.parse_size(max_memory) if max_memory is not None else None
        self.hidden_size = int(self.model.config.get_text_config().hidden_size)
        self.max_tokens = max_tokens
        self.checkpoints = NO_CHECKPOINTS  # per-epoch training state; ``train`` gives it a directory

    @property
    def device(self) -> torch.device:
        """Where token ids go (the embedding's device)."""
        return devices.input_device(self.model)

    @property
    def site_device(self) -> torch.device:
        """Where trained parameters live: the site layer's device."""
        return devices.layer_device(self.model, self.layer)

    @property
    def memory_budget(self) -> int:
        """Bytes ``prepare`` may keep (``--max-memory``; default half the site device's free memory)."""
        if self._memory_budget is None:
            self._memory_budget = memory.default_budget(self.site_device)
        return self._memory_budget

    @memory_budget.setter
    def memory_budget(self, value: int | None) -> None:
        self._memory_budget = value

    # ------------------------------------------------------------------ tokens

    def encode(self, context: str, continuations: Sequence[str]) -> tuple[list[int], list[list[int]]]:
        """lm-eval's encoding of (context, continuation) pairs (HFLM._encode_pair)."""
        pairs = [self.lm._encode_pair(context, c) for c in continuations]
        contexts = {tuple(c) for c, _ in pairs}
        if len(contexts) != 1:  # trailing whitespace moved into the continuation differs per option
            raise ValueError(f"options of one prompt tokenise to different contexts: {context[-60:]!r}")
        return list(pairs[0][0]), [cont for _, cont in pairs]

    def encode_generation(self, prompt: str, targets: Sequence[str]) -> tuple[list[int], list[list[int]]]:
        """A generation prompt tokenised exactly as ``lm_eval`` generation feeds it
        (``MariLM.generation_ids``: p* is the token generation edits), and each target
        tokenised on its own, as the tokens that would be generated after it."""
        return self.lm.generation_ids(prompt), [self.lm.tok_encode(t, add_special_tokens=False) for t in targets]

    def encode_prompt(self, text: str) -> list[int]:
        return self.lm.tok_encode(text)

    def chat_prompt(self, user: str, without_template: str) -> str:
        """``user`` as one user turn of the model's chat template (``MariLM.chat_prompt``)."""
        return self.lm.chat_prompt(user, without_template)

    # ------------------------------------------------------------------ frozen work, once

    @torch.no_grad()
    def prepare(self, examples: list[Example], desc: str, lower: bool = True) -> memory.Plan:
        """The frozen model's work on ``examples`` that no edit changes, done once (``mari_eval.training.memory``).

        The cache of the preamble all of them share is computed and held once; each example
        keeps its own remainder of the prompt cache and, with ``lower`` (methods editing at
        l*), the states after l* of its option rows and its site state ``hidden``. What
        does not fit the memory budget is recomputed at each use instead; the plan is logged
        before any work starts.
        """
        common, own_tokens, row_tokens = memory.token_counts(examples)
        need = memory.estimate(self.model, len(common), own_tokens, row_tokens, lower)
        plan = memory.plan(need, max(0, self.memory_budget - self.memory_held))
        (log.info if plan.keep_caches else log.warning)(plan.describe(f"encoding {desc}"))
        shared = encode_prefix(self.model, common)
        # Models whose layers all see the whole prompt encode several examples per pass (``_encode_packed``).
        packed = row_passes.packable(self.model, 10**9, 1) and _full_attention_only(shared)
        for batch in tqdm(example_batches(examples, len(common), self.max_tokens) if packed else [[ex] for ex in examples],
                          desc=f"encoding {desc}", leave=False):
            if not (packed and self._encode_packed(batch, shared, plan, lower)):
                for ex in batch:
                    self._encode_one(ex, shared, plan, lower)
        self.memory_held += need.shared_bytes + (need.cache_bytes if plan.keep_caches else 0) + \
            (need.lower_bytes if plan.keep_lower else 0)
        return plan

    def _encode_one(self, ex: Example, shared: Prefix, plan: memory.Plan, lower: bool) -> None:
        """``prepare``'s work on one example: its prompt over the shared preamble, its rows up to l*."""
        prefix = encode_prefix(self.model, ex.context[:-1], base=shared)
        ex.shared, ex.own = shared, own_part(prefix, shared) if plan.keep_caches else None
        ex.lower = ex.hidden = None
        rows = [[ex.context[-1]] + option[:-1] for option in ex.options]
        if lower and row_passes.packable(self.model, len(prefix.tokens), max(map(len, rows))):
            states = row_passes.lower_states(self.model, prefix, rows, self.layer)
            ex.lower = states if plan.keep_lower else None
            ex.hidden = states[0][0] if plan.keep_lower else states[0][0].clone()
        elif lower:  # rows crossing a sliding window run whole (runner): only the site state is kept
            ids = torch.tensor([ex.context], device=self.device)
            ex.hidden = layer_spans.hidden_at_site(self.model, ids, torch.ones_like(ids), self.layer)[0]

    def _encode_packed(self, batch: list[Example], shared: Prefix, plan: memory.Plan, lower: bool) -> bool:
        """``_encode_one`` for several examples in two packed passes: their own prompt tokens after the
        preamble in one pass through the model (``prefix_cache.encode_prompts``), then all their option
        rows in one pass up to l* (``row_passes.packed_lower_states``): the same caches and states as one
        example at a time, in a few large matrix products instead of many small ones. False (nothing
        done) when the pass left a layer that does not hold every token (a sliding window)."""
        packed = encode_prompts(self.model, shared, [ex.context[:-1] for ex in batch])
        if packed is None:
            return False
        P = packed.shared
        for ex, (a, b) in zip(batch, packed.spans):
            ex.shared, ex.own, ex.lower, ex.hidden = shared, None, None, None
            if b > a and plan.keep_caches:
                ex.own = Prefix(tuple(ex.context[:-1]), _cache_slice(packed.cache, P + a, P + b))
        if not lower:
            return True
        rows = [[ex.context[-1]] + option[:-1] for ex in batch for option in ex.options]
        states = iter(row_passes.packed_lower_states(self.model, packed, [i for i, ex in enumerate(batch) for _ in ex.options],
                                                 rows, self.layer))
        for ex in batch:
            ex_states = [next(states) for _ in ex.options]
            ex.lower = ex_states if plan.keep_lower else None
            ex.hidden = ex_states[0][0] if plan.keep_lower else ex_states[0][0].clone()
        return True

    def prefix(self, ex: Example) -> Prefix:
        """The frozen model's cache of ``ex``'s prompt before p*: the shared preamble's joined
        with the example's own part, or the own part recomputed when it was not kept."""
        if ex.shared is None:
            raise ValueError(f"example {ex.id} was not prepared: call Session.prepare on its set first")
        if ex.own is not None or len(ex.shared.tokens) == len(ex.context) - 1:
            return joined(ex.shared, ex.own)
        return encode_prefix(self.model, ex.context[:-1], base=ex.shared)

    @torch.no_grad()
    def hidden_of_prompts(self, prompts: list[list[int]]) -> torch.Tensor:
        """h^{(l*)} at the last token of each prompt ([N, d]), e.g. for the PCA basis of D_pca.

        The tokens all prompts share (TruthfulQA's few-shot preamble: most of each prompt) are
        encoded once; the rest of each prompt runs over that cache, right-padded in batches of
        at most ``max_tokens`` tokens (causal attention: no real token sees a pad), up to l* only.
        """
        shared: tuple[int, ...] = ()
        if len(prompts) > 1:  # at least one token of every prompt stays its own: its last one is read
            shared = common_prefix(prompts)[: min(map(len, prompts)) - 1]
        prefix = encode_prefix(self.model, shared)
        states = []
        for chunk in _token_batches([list(p[len(shared):]) for p in prompts], self.max_tokens):
            width = max(map(len, chunk))
            ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in chunk], device=self.device)
            last = torch.tensor([len(r) - 1 for r in chunk], device=self.device)
            cache = broadcast_cache(prefix.cache, len(chunk))
            states.append(layer_spans.states_after(self.model, self.layer, last, input_ids=ids, use_cache=cache is not None,
                                            **with_cache(self.model, cache)).float())
        return torch.cat(states)

    # ------------------------------------------------------------------ runner

    def run(
        self,
        ex: Example,
        variants: Sequence[int],
        edit: VariantEdit,
        capture: Sequence[int] = (),
        site_only: Sequence[int] = (),
    ) -> VariantRun:
        """``ex``'s options under each variant; ``edit(hidden [R, d], variant_ids [R])`` edits (l*, p*)."""
        plan = Plan.at_site(self.model, self.layer, edit, variants, capture, site_only)
        return self.score(ex, plan)

    def step_estimate(self, batch: Sequence[Example], variants: int) -> memory.Step:
        """The activations a training step keeps for its backward when it scores ``batch`` under
        ``variants`` edits at l* (``memory.step_estimate``: ``run``'s packed passes of rows)."""
        passes = memory.step_passes(memory.example_shapes(batch), variants, self.max_tokens)
        return self.record_step(memory.step_estimate(self.model, self.layer, passes))

    def record_step(self, step: memory.Step) -> memory.Step:
        """Note a training step's activations (a method's ``memory.step_estimate``); ``largest_step``
        keeps the largest, logged when the bundle is trained."""
        self.largest_step = max(self.largest_step, step.total)
        return step

    def score(self, ex: Example, plan: Plan) -> VariantRun:
        """``ex``'s options under each variant of ``plan``, from the frozen states it keeps below l*."""
        return runner.score_variants(self.model, self.prefix(ex), ex.context[-1], ex.options, plan,
                                     max_tokens=self.max_tokens,
                                     lower=(self.layer, ex.lower) if ex.lower is not None else None)


def example_batches(examples: list[Example], shared: int, max_tokens: int) -> list[list[Example]]:
    """``examples`` in order, cut into batches whose own prompt tokens (after the ``shared`` preamble)
    and whose option rows each add up to at most ``max_tokens`` (one example alone may exceed it)."""
    batches: list[list[Example]] = []
    own = rows = 0
    for ex in examples:
        n, m = len(ex.context) - 1 - shared, sum(map(len, ex.options))
        if batches and own + n <= max_tokens and rows + m <= max_tokens:
            batches[-1].append(ex)
            own, rows = own + n, rows + m
        else:
            batches.append([ex])
            own, rows = n, m
    return batches


def _full_attention_only(prefix: Prefix) -> bool:
    """Whether every layer of ``prefix``'s cache holds every token (none is a sliding window)."""
    from transformers.cache_utils import \
        DynamicLayer  # deferred: transformers is heavy; only this path needs it

    return prefix.cache is None or all(type(layer) is DynamicLayer for layer in prefix.cache.layers)


def _cache_slice(cache, start: int, stop: int):
    """A copy of ``cache`` holding the tokens ``start:stop`` only (full-attention layers), as
    ``prefix_cache.own_part`` holds an example's part beyond the shared preamble."""
    new = copy.copy(cache)
    new.layers = []
    for layer in cache.layers:
        layer = copy.copy(layer)
        layer.keys, layer.values = layer.keys[..., start:stop, :].clone(), layer.values[..., start:stop, :].clone()
        new.layers.append(layer)
    return new


def _token_batches(rows: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """``rows`` in order, cut into batches whose padded size (rows x the longest) stays within ``max_tokens``."""
    batches: list[list[list[int]]] = []
    for row in rows:
        if batches and (len(batches[-1]) + 1) * max(len(row), *map(len, batches[-1])) <= max_tokens:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


# ----------------------------------------------------------------------------- provenance
