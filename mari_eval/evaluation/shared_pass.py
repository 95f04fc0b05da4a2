"""Several methods' log-likelihood runs for little more than one: the frozen model's work shared.

A results table scores the same lm-eval tasks under several interventions (vanilla, CAA,
ITI, NL-ITI, ReFT, MARI), each as its own lm-eval run with its own ``MariLM``, so that
every method's metrics come from lm-eval's own task code. Each run used to encode every
prompt before p* and run every option under the untouched model again. A ``SharedPass``
is handed to each of those ``MariLM``s (``MariLM(..., shared_pass=shared)``, Python callers
only); on the first request of a question group (context and options) it computes, once:

* the frozen model's prefix (``PrefixCache``: the prompt before p*, shared with the
  previous question's preamble);
* the untouched model's option rows (``runner.score_untouched``), when some method reads
  them (vanilla, MARI's BASE variant), keeping each row's states after every method's
  lowest untouched layer;
* every joined method's ``VariantRun`` over that prefix (``runner.score_variants``), its
  BASE rows read from the untouched run and its edited rows starting from the untouched
  states below its edit (``lower``), and a variant another joined run of the same edit
  (``Intervention.edit_fingerprint``: MARI's rows over one bundle that differ in their gate,
  rho or labels) has computed copied from it (``known``). A method that edits the prompt before p*
  (``plan.prompt_sites``: ReFT) cannot share the prefix: its run is computed on its own. A method
  that rewrites the prompts (``Intervention.instruction``: Prompting) does not join at all.

It hands back the asking method's run and keeps the others, each dropped once its method
has taken it: the later methods' lm-eval runs find theirs computed. Everything after the
run (``plan.pick``, the non-finite checks, diagnostics, lm-eval's cache hook) stays in each
``MariLM``, so each method's lm-eval run is unchanged except where the compute happens.

Methods are meant to be evaluated one after the other: runs are computed ahead only for the
methods that have asked nothing yet, so a finished method's runs never pile up. The runs kept
ahead wait on the CPU until their method's evaluation: a few numbers per option for most
methods, but MARI's hold its states at p* after every layer from l* up, so evaluate MARI first
on long task lists (MMLU) to keep the others' runs only. A request
whose run is not stored (one the earlier methods never saw, or one asked again later) is
computed on demand, for the asker (and the methods still to come), never taken from another
request; one asked again at once (the same context and options) gets the same run again.
Generation (``generate_until``) is not shared: each method generates in its own run. The KL
measure on general text (mari_eval/evaluation/divergence.py) reads the untouched model's
distributions from ``untouched_text``, computed for the first row that asks.

Usage (all ``MariLM``s built on the same loaded model, all before the first evaluation)::

    shared = SharedPass(model)
    lms = [MariLM(pretrained=model, tokenizer=tok, bundle=b, shared_pass=shared) for b in (None, caa, mari)]
    for lm in lms:
        simple_evaluate(model=lm, tasks=...)
"""

from __future__ import annotations

import dataclasses
import logging
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mari_eval.evaluation import divergence, row_passes, runner
from mari_eval.injection import layer_spans
from mari_eval.injection.plan import BASE, Plan, VariantRun
from mari_eval.evaluation.prefix_cache import (MIN_SHARED, PackedPrompts, Prefix, PrefixCache, common_prefix, encode_prefix,
                                               encode_prompts, truncated)

if TYPE_CHECKING:
    from mari_eval.methods.intervention import Intervention

log = logging.getLogger(__name__)


class OwnRuns:
    """A method's runs computed by itself (no shared pass): one ``PrefixCache`` per lm-eval call."""

    def __init__(self, model: torch.nn.Module, plan: Plan, max_tokens: int = 1024):
        self.model, self.plan, self.max_tokens = model, plan, max_tokens
        self.prefixes = PrefixCache(model)
        self.edited = EditedPrefix(model, plan)

    def run(self, context: Sequence[int], continuations: Sequence[Sequence[int]]) -> VariantRun:
        """The plan's run of ``continuations`` after ``context`` (p* is its last token)."""
        if self.plan.prompt_sites(len(context)):  # the prompt itself is edited: nothing before p* is the frozen model's
            prefix = self.edited.encode(context)
        else:
            prefix = self.prefixes.encode(context[:-1])
        return runner.score_variants(self.model, prefix, context[-1], continuations, self.plan, self.max_tokens)

    def run_many(self, questions: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> list[VariantRun]:
        """``run`` of several (context, continuations) in the same passes (``runner.score_questions``):
        their prompts' own tokens packed after the preamble they share, then each stage's rows of
        all of them together. One alone, or a model whose rows cannot be packed, runs as ``run``."""
        contexts = [context for context, _ in questions]
        packed = None
        if len(questions) > 1 and row_passes.packable(self.model, max(map(len, contexts)), 1):
            if any(self.plan.prompt_sites(len(context)) for context in contexts):  # edited prompts (ReFT)
                packed = self.edited.encode_many(contexts)
            else:
                prompts = [tuple(context[:-1]) for context in contexts]
                packed = encode_prompts(self.model, self.prefixes.encode(common_prefix(prompts)), prompts)
        if packed is None:
            return [self.run(context, continuations) for context, continuations in questions]
        return runner.score_questions(self.model, packed, [runner.Question(context[-1], continuations)
                                                           for context, continuations in questions],
                                      self.plan, self.max_tokens)


class EditedPrefix:
    """The prompt before p* under a plan that edits it (``plan.prompt_sites``: ReFT).

    The previous prompt's cache is reused up to the first position where the two differ,
    in their tokens or in whether the plan edits that position: ReFT edits each site's own
    state, so the tokens before that point have the same keys and values in both prompts
    (a few-shot preamble, edited at its first tokens, is computed once). The same prompt
    again at once (TruthfulQA's mc1 and mc2 of a doc) is not recomputed.
    """

    def __init__(self, model: torch.nn.Module, plan: Plan, min_shared: int = MIN_SHARED):
        self.model, self.plan, self.min_shared = model, plan, min_shared
        self.last: Prefix | None = None
        self.preamble: Prefix | None = None  # the last shared edited preamble of ``encode_many``

    def encode(self, context: Sequence[int]) -> Prefix:
        tokens = tuple(context[:-1])
        if self.last is not None and self.last.tokens == tokens:  # the sites depend on the prompt's length only
            return self.last
        sites = self.plan.prompt_sites(len(context))
        base = None
        if self.last is not None:
            same = len(common_prefix([self.last.tokens, tokens]))
            shared = min([same, len(tokens) - 1, *set(self.last.sites).symmetric_difference(sites)])
            if shared >= self.min_shared:
                base = truncated(self.last, shared)
        self.last = encode_prefix(self.model, tokens, base=base, apply=self.plan.apply, sites=sites)
        return self.last

    def encode_many(self, contexts: Sequence[Sequence[int]]) -> PackedPrompts | None:
        """The prompts before p* of ``contexts`` under the plan's edit, in two passes where they share
        a preamble whose edited positions are the same in every prompt (ReFT's first ones in a
        few-shot preamble): that preamble once (kept for the next batch), then every prompt's own tokens packed
        after it under the edit at its own positions (``encode_prompts``). Prompts that share fewer
        than ``min_shared`` such tokens (zero-shot BBQ) are packed whole in one pass, each under the
        edit at its own positions. None: the model cannot pack (sliding windows)."""
        prompts = [tuple(context[:-1]) for context in contexts]
        sites = [self.plan.prompt_sites(len(context)) for context in contexts]
        common = min(len(common_prefix(prompts)), *(len(p) - 1 for p in prompts))
        inside = [{s for s in own if s < common} for own in sites]
        shared = min([common, *(s for own in inside[1:] for s in own.symmetric_difference(inside[0]))])
        if shared < self.min_shared:
            return encode_prompts(self.model, Prefix((), None), prompts, apply=self.plan.apply, sites=sites)
        tokens, below = prompts[0][:shared], tuple(sorted(s for s in inside[0] if s < shared))  # every prompt's alike
        if self.preamble is None or (self.preamble.tokens, self.preamble.sites) != (tokens, below):
            self.preamble = encode_prefix(self.model, tokens, apply=self.plan.apply, sites=below)
        return encode_prompts(self.model, self.preamble, prompts, apply=self.plan.apply, sites=sites)


@dataclass(eq=False)
class Member:
    """One joined method, as its ``MariLM`` asks for its runs."""

    shared: SharedPass
    index: int
    plan: Plan
    below: int | None  # the highest layer whose output the method never edits (None: every layer may be)
    edited: EditedPrefix  # a method that edits the prompt (ReFT): its own prefixes
    edit: str | None  # what its variants' edits are (Intervention.edit_fingerprint); None: vanilla
    started: bool = False  # whether it has asked for a run (its evaluation has begun)
    # Its last question group and run: a group asked again at once (TruthfulQA's mc1 and mc2 of a
    # doc whose two option lists are the same: MariLM visits them one after the other) is not recomputed.
    last: tuple[bytes, VariantRun] | None = None

    def run(self, context: Sequence[int], continuations: Sequence[Sequence[int]]) -> VariantRun:
        return self.shared.run(self, context, continuations)

    def run_many(self, questions: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> list[VariantRun]:
        """One question at a time: the shared pass shares the frozen model's work across methods
        instead of across questions (``batch_size`` still batches generation)."""
        return [self.run(context, continuations) for context, continuations in questions]


class SharedPass:
    """The runs of every joined method, computed together per question group (module docstring)."""

    def __init__(self, model: torch.nn.Module, max_tokens: int = 1024):
        self.model, self.max_tokens = model, max_tokens
        self.members: list[Member] = []
        self.prefixes = PrefixCache(model)
        self._stored: dict[bytes, dict[int, _Kept]] = {}  # question group -> member index -> its run, on the CPU
        # groups: question groups computed for several methods together; untouched: untouched runs;
        # runs: method runs computed; served: runs handed out from the store; on_demand: runs computed
        # when asked, not found in the store; repeated: a method's group asked again at once
        self.stats: Counter = Counter()
        # The general-text KL's untouched readings (mari_eval/evaluation/divergence.py), for every joined row.
        self.untouched_text = divergence.UntouchedLogProbs()

    def join(self, model: torch.nn.Module, plan: Plan, intervention: Intervention | None) -> Member:
        """Add the method ``MariLM`` scores with ``plan`` (``intervention``; None: vanilla); its handle."""
        if model is not self.model:
            raise ValueError("a MariLM given shared_pass= must score with the shared pass's model: build it with "
                             "MariLM(pretrained=shared.model, tokenizer=..., shared_pass=shared)")
        if any(m.started for m in self.members):
            log.warning("a method joined the shared pass after another began its evaluation: its runs of the "
                        "questions already computed are computed on demand; build every MariLM before evaluating")
        edit = None if intervention is None else intervention.edit_fingerprint()
        member = Member(self, len(self.members), plan, _untouched_below(plan, intervention), EditedPrefix(model, plan), edit)
        self.members.append(member)
        return member

    def pending(self) -> int:
        """Runs computed ahead and not yet taken by their method."""
        return sum(map(len, self._stored.values()))

    def run(self, member: Member, context: Sequence[int], continuations: Sequence[Sequence[int]]) -> VariantRun:
        """``member``'s run of ``continuations`` after ``context``: stored, else computed now."""
        member.started = True
        key = _key(context, continuations)
        if member.last is not None and member.last[0] == key:
            self.stats["repeated"] += 1
            return member.last[1]
        waiting = self._stored.get(key, {})
        if member.index in waiting:
            mine = waiting.pop(member.index).restored()
            if not waiting:
                del self._stored[key]  # every method has taken its run of this group
            self.stats["served"] += 1
        else:
            ahead = [m for m in self.members if not m.started and m.index not in waiting]
            self.stats["groups" if ahead else "on_demand"] += 1
            runs = self._compute(context, continuations, [member, *ahead])
            mine = runs.pop(member.index)
            if runs:  # kept on the CPU: a later method takes them only after this one's whole evaluation
                self._stored.setdefault(key, {}).update({i: _Kept.of(run) for i, run in runs.items()})
        member.last = (key, mine)
        return mine

    def _compute(self, context: Sequence[int], continuations: Sequence[Sequence[int]],
                 members: list[Member]) -> dict[int, VariantRun]:
        context, last = list(context), context[-1]
        own = [m for m in members if m.plan.prompt_sites(len(context))]
        sharing = [m for m in members if m not in own]
        runs: dict[int, VariantRun] = {}
        self.stats["runs"] += len(members)
        with torch.no_grad():
            for m in own:  # the prompt itself is edited: its prefix is the method's own
                prefix = m.edited.encode(context)
                runs[m.index] = runner.score_variants(self.model, prefix, last, continuations, m.plan, self.max_tokens)
            if not sharing:
                return runs
            prefix = self.prefixes.encode(context[:-1])
            untouched = None
            # The untouched rows are worth running once when some method reads them (vanilla, MARI's
            # BASE): every other method's rows then start from their states below its edit.
            if any(BASE in m.plan.variants for m in sharing):
                edited = [m for m in sharing if any(v != BASE for v in m.plan.variants)]
                keep = sorted({m.below for m in edited if m.below is not None}) if layer_spans.can_start_after(self.model) else []
                capture = sorted({layer for m in sharing for layer in m.plan.capture})
                untouched = runner.score_untouched(self.model, prefix, last, continuations, capture, keep, self.max_tokens)
                self.stats["untouched"] += 1
            # Runs of one edit capture the union of their layers, so each can lend its variants to the next.
            computed: dict[str, list[VariantRun]] = {}
            for m in sharing:
                lower = None
                if untouched is not None and m.below in untouched.below:
                    lower = (m.below, untouched.below[m.below])
                same = [o for o in sharing if o.edit is not None and o.edit == m.edit]
                plan = dataclasses.replace(m.plan, capture=tuple(sorted({layer for o in same for layer in o.plan.capture})))
                known = computed.setdefault(m.edit, []) if m.edit is not None else []
                run = runner.score_variants(self.model, prefix, last, continuations, plan, self.max_tokens,
                                            lower=lower, untouched=untouched, known=known)
                known.append(run)
                runs[m.index] = dataclasses.replace(run, site={layer: run.site[layer] for layer in m.plan.capture
                                                               if layer in run.site})
        return runs


def join_shared(shared: SharedPass | None, model: torch.nn.Module, plan: Plan,
                intervention: Intervention | None) -> Member | None:
    """``MariLM``'s ``shared_pass=``: the method's handle in ``shared``, or None without one."""
    if shared is None:
        return None
    if not isinstance(shared, SharedPass):
        raise TypeError(f"shared_pass= takes a mari_eval.evaluation.shared_pass.SharedPass built in Python, not {type(shared).__name__} "
                        "(it cannot be given in --model_args); leave it out to score each method on its own")
    if intervention is not None and intervention.instruction is not None:
        # Its prompts are not the others' (Prompting's instruction is in them): sharing would
        # compute every joined method's runs over both kinds of prompt, half of them never asked.
        log.info("%s rewrites the prompts: scored on its own, outside the shared pass", intervention.method)
        return None
    return shared.join(model, plan, intervention)


def _untouched_below(plan: Plan, intervention: Intervention | None) -> int | None:
    """The highest layer whose output ``plan`` never edits, or None.

    ``plan.edit_layer`` says it when set (every edit at that layer's output or above). A
    one-variant plan does not set it; every method edits at its site layer l* or above, but
    some inside l* (ITI shifts head outputs within l*'s attention), so only l* - 1 is sure.
    """
    if intervention is None:
        return None
    if plan.edit_layer is not None:
        return plan.edit_layer
    return intervention.layer - 1 if intervention.layer >= 1 else None


def _key(context: Sequence[int], continuations: Sequence[Sequence[int]]) -> bytes:
    """A question group's exact tokens, compactly (a long evaluation keeps one per group ahead)."""
    flat = array("q", [len(context), *context])
    for c in continuations:
        flat.append(len(c))
        flat.extend(c)
    return flat.tobytes()


@dataclass
class _Kept:
    """A run kept for a later method: its tensors on the CPU (exact copies), and where each was."""

    run: VariantRun
    devices: dict[str, torch.device]

    @classmethod
    def of(cls, run: VariantRun) -> _Kept:
        devices = {name: t.device for name, t in _tensors(run).items()}
        return cls(_moved(run, lambda name, t: t.to("cpu")), devices)

    def restored(self) -> VariantRun:
        """The run as computed: each tensor back on its device."""
        return _moved(self.run, lambda name, t: t.to(self.devices[name]))


def _tensors(run: VariantRun) -> dict[str, torch.Tensor]:
    named = {"logprobs": run.logprobs, "greedy": run.greedy, "entropy": run.entropy,
             **{f"site {layer}": states for layer, states in run.site.items()}}
    return {name: t for name, t in named.items() if t is not None}


def _moved(run: VariantRun, move: Callable[[str, torch.Tensor], torch.Tensor]) -> VariantRun:
    """``run`` with each tensor replaced by ``move(its name, it)``."""
    new = {name: move(name, t) for name, t in _tensors(run).items()}
    return dataclasses.replace(run, logprobs=new.get("logprobs"), greedy=new.get("greedy"), entropy=new.get("entropy"),
                               site={layer: new[f"site {layer}"] for layer in run.site})
