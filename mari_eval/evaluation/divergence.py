"""How far a method moves the model on text it was not trained on: KL divergence and cross-entropy.

ITI (Li et al., 2023, section 5.1) reads an intervention's invasiveness from two numbers on
general text: the intervened model's cross-entropy, and the KL divergence of its next-token
distribution from the untouched model's. Both can move for a model at chance on MMLU and ARC.

Here a document is a (context, continuation) pair of text, of one of two sets (``TASKS``):

* ``general_text``, in source: MMLU and ARC-Challenge question texts cut in two (``data.load_general_text``),
  exam questions like those of the gate's "not applicable" calibration (MMLU validation, ARC-Easy train);
* ``benign_text``, out of source (issue 81.1): Self-Instruct's 252 user-oriented requests, as the model is
  used: the context is the request as one user turn of the chat template, ready for the answer (the
  prompt generation reads, its last token p*), and the continuation the authors' answer to it (the
  request's first instance's output), its first ``BENIGN_ANSWER_TOKENS`` tokens. The KL is measured
  over the answer's tokens: the next-token distributions from which the model would answer a benign
  request, after the edit the method makes at p* on that very request (repro/engine/divergence_run.py).

The method edits as it does in generation:
at the context's last token p* (and its prompt sites, ReFT), and on every later token where its
edit reaches them (CAA, ITI: ``site.edit_from_site``); a teacher-forced pass over context and
continuation computes what decoding the continuation would, token by token. For each token x_t
of the continuation:

    KL_t = sum_v p_base(v | x_<t) [log p_base(v | x_<t) - log p_steer(v | x_<t)]   (nats)
    CE_t = -log p_steer(x_t | x_<t)                                                (nats)

and a document's scores are their means over its continuation's tokens (``TextScores``, with the
record of the method's choice: MARI's gate, whose open rate the tables report). The
untouched model reads the plain context; a method that rewrites prompts (Prompting's
instruction) reads its own, so its KL includes what the instruction does. A method with several
variants (MARI's experts and its gate's fallback to the base model) answers with the variant its
generation would choose for that context (``generation.generate_variants``: the gate, then
entropy routing over T_ent greedy steps), held for the whole continuation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mari_eval.evaluation import generation
from mari_eval.injection import devices
from mari_eval.injection.plan import BASE, Plan

# Bumped when what a document's scores mean changes: part of every cached evaluation's key (repro/engine/cache.py).
VERSION = 1
TASK = "general_text"  # the name the tables' columns give this measurement (repro/engine/profiles.py)
BENIGN_TASK = "benign_text"  # the same measure on Self-Instruct's requests, out of source
VERSIONS = {TASK: VERSION, BENIGN_TASK: 1}  # per measured set: its documents' version, in its evaluations' keys
TASKS = tuple(VERSIONS)
METRICS = ("kl", "ce")  # per document, in nats per continuation token
BENIGN_ANSWER_TOKENS = 64  # the benign continuation: the first tokens of the authors' answer (their mean is 77, median 45)

EncodePair = Callable[[str, str], tuple[list[int], list[int]]]  # (context, continuation) -> their token ids


@dataclass(frozen=True)
class TextScores:
    """One document's means over its continuation's tokens, and how many there were."""

    kl: float
    ce: float
    tokens: int
    variant: int  # the variant that answered (BASE: the untouched model)
    record: dict | None = dataclasses.field(default=None, compare=False)  # the plan's choice record (one variant: None)


@torch.no_grad()
def _log_probs(model: torch.nn.Module, context: Sequence[int], continuation: Sequence[int],
               edit: contextlib.AbstractContextManager | None = None) -> torch.Tensor:
    """log p(. | x_<t) at each continuation token ([len(continuation), vocabulary], float32)."""
    ids = torch.tensor([[*context, *continuation]], device=devices.input_device(model))
    with edit or contextlib.nullcontext():
        logits = model(input_ids=ids).logits[0, len(context) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


class UntouchedLogProbs:
    """The untouched model's ``_log_probs`` of each general-text document, computed once for every row
    that reads the documents after one another over one shared pass (``SharedPass.untouched_text``):
    each row's KL needs them and they do not depend on the row. Kept on the CPU up to ``max_bytes``
    (float32, continuation tokens x vocabulary: about 1.2 GB for 200 documents at a 49k vocabulary);
    past it, a document is computed again for each row as without this store."""

    def __init__(self, max_bytes: int = 4 * 2**30):
        self.max_bytes, self.bytes = max_bytes, 0
        self._kept: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        self.computed = self.served = 0

    def get(self, model: torch.nn.Module, context: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
        key = (tuple(context), tuple(continuation))
        kept = self._kept.get(key)
        if kept is not None:
            self.served += 1
            return kept  # on the CPU: score_text moves it beside the row's own log-probabilities
        log_probs = _log_probs(model, context, continuation)
        self.computed += 1
        size = log_probs.numel() * log_probs.element_size()
        if self.bytes + size <= self.max_bytes:
            self._kept[key] = log_probs.to("cpu", copy=True)
            self.bytes += size
        return log_probs


def chosen_variant(model: torch.nn.Module, plan: Plan, context: Sequence[int], pad_token_id: int | None) -> int:
    """The variant ``plan`` answers ``context`` with in generation (its only one, else its choice)."""
    return choice(model, plan, context, pad_token_id)[0]


def choice(model: torch.nn.Module, plan: Plan, context: Sequence[int], pad_token_id: int | None) -> tuple[int, dict | None]:
    """(``chosen_variant``, the plan's record of that choice: MARI's gate energy and whether it opened; None
    for a plan with one variant, which chooses nothing)."""
    if len(plan.variants) == 1:
        return plan.variants[0], None
    picks: list[tuple[int, dict]] = []

    def choose(run):
        chosen, record = plan.pick(run)
        picks.append((chosen, record))
        return chosen, record

    ids = torch.tensor([list(context)], device=devices.input_device(model))
    generation.generate_variants(model, ids, torch.ones_like(ids), dataclasses.replace(plan, choose=choose),
                                 len(context) + plan.window, pad_token_id=pad_token_id, do_sample=False)
    return picks[0]


def score_text(model: torch.nn.Module, plan: Plan, base: tuple[list[int], list[int]],
               steered_context: list[int], pad_token_id: int | None = None,
               untouched: UntouchedLogProbs | None = None) -> TextScores:
    """``TextScores`` of one document: ``base`` is (context, continuation) as the untouched model
    reads them, ``steered_context`` the context the method reads (the same but for Prompting);
    ``untouched``: where the untouched model's reading is kept across rows (else computed here)."""
    context, continuation = base
    if not context or not continuation:
        raise ValueError("a general-text document needs a context and a continuation of at least one token each")
    variant, record = choice(model, plan, steered_context, pad_token_id)
    sites = [*plan.prompt_sites(len(steered_context)), len(steered_context) - 1]
    positions = (torch.zeros(len(sites), dtype=torch.long), torch.tensor(sites))
    edit = None if variant == BASE else plan.apply(torch.full((len(sites),), variant), positions)  # one id per site
    base_lp = untouched.get(model, context, continuation) if untouched is not None else _log_probs(model, context, continuation)
    unedited = edit is None and list(steered_context) == list(context)  # the untouched model's own pass: KL is 0
    steered_lp = base_lp if unedited else _log_probs(model, steered_context, continuation, edit)
    base_lp = base_lp.to(steered_lp.device)  # a kept reading is on the CPU
    kl = (base_lp.exp() * (base_lp - steered_lp)).sum(-1)
    ce = -steered_lp.gather(-1, torch.tensor(continuation, device=steered_lp.device)[:, None])[:, 0]
    scores = TextScores(float(kl.mean()), float(ce.mean()), len(continuation), variant, record)
    if not (math.isfinite(scores.kl) and math.isfinite(scores.ce)):
        raise FloatingPointError(f"non-finite KL {scores.kl} or cross-entropy {scores.ce} under variant {variant} "
                                 f"for the continuation of {len(context)} context tokens: the edit overflows the model's "
                                 "dtype here; evaluate in float32 (--dtype float32) or check the bundle's scale")
    return scores


def score_texts(model: torch.nn.Module, plan: Plan, documents: Sequence[tuple[str, str]], encode_pair: EncodePair,
                instructed: Callable[[str], str] = lambda context: context, pad_token_id: int | None = None,
                progress: Callable | None = None, untouched: UntouchedLogProbs | None = None) -> list[TextScores]:
    """``score_text`` of every (context, continuation) text pair, tokenized as lm-eval scores a
    log-likelihood request (``encode_pair``); ``instructed`` is the method's own context; ``untouched``
    as for ``score_text``."""
    out = []
    for context, continuation in (progress or (lambda items: items))(documents):
        base = encode_pair(context, continuation)
        own_context = instructed(context)
        steered = base if own_context == context else encode_pair(own_context, continuation)
        if steered[1] != base[1]:  # the instruction changed how the continuation tokenizes: score it as the base reads it
            steered = (steered[0], base[1])
        out.append(score_text(model, plan, base, steered[0], pad_token_id, untouched))
    return out
