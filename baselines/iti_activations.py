"""The head outputs the published ITI and NL-ITI recipes read (``baselines.iti_published`` fits on them).

Each recipe (``Recipe``: ITI's honest_llama, NL-ITI's repository) formats an example's true and
false answers as "Q: {question} A: {answer}" prompts, reads every attention head's output averaged
over the answer's last tokens (the probes' and the directions' rows), and, for sigma, the same
prompt continued with another question (``recipe_activations``). ``window_outputs`` runs a set of
such prompts in one pass over the tokens they share.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from tqdm import tqdm

from mari_eval.benchmarks.data import load_truthfulqa_mc
from mari_eval.evaluation.prefix_cache import broadcast_cache, common_prefix, encode_prefix, with_cache
from mari_eval.injection import site
from mari_eval.training.objectives import COMPLIANCE_TARGET

if TYPE_CHECKING:
    from mari_eval.training.examples import Example
    from mari_eval.training.session import Session


@dataclass(frozen=True)
class Recipe:
    """What one author's recipe sets: the prompt's separators, the probe and the token windows."""

    answer_separator: str  # between the question and "A:"
    question_separator: str  # between the answer and the other question (sigma's prompt)
    probe: str  # "linear" (logistic regression) or "mlp"
    probe_tokens: int  # answer tokens averaged for the probes
    tokens: int  # answer (other question) tokens averaged for the direction (sigma)
    shift_from: str  # "answer": after p*; "last_prompt_token": p* on

    def qa(self, question: str, answer: str) -> tuple[str, str]:
        """(text before the answer, the answer) in the recipe's format."""
        return f"Q: {question}{self.answer_separator}A:", f" {answer}"

    def end_q(self, question: str, answer: str, other: str) -> tuple[str, str]:
        """(text before the other question, the other question): the prompt sigma is read from."""
        return f"Q: {question}{self.answer_separator}A: {answer}{self.question_separator}Q:", f" {other}"

    def formats(self) -> dict[str, str]:
        return {"prompt_format": "".join(self.qa("{question}", "{answer}")),
                "sigma_format": "".join(self.end_q("{question}", "{answer}", "{other question}"))}


ITI_RECIPE = Recipe(" ", " ", "linear", 1, 1, "answer")
NL_ITI_RECIPE = Recipe("\n", "\n\n", "mlp", 4, 6, "last_prompt_token")


# ----------------------------------------------------------------------------- activations


@torch.no_grad()
def window_outputs(session: Session, texts: Sequence[tuple[str, str]], windows: Sequence[int]) -> list[torch.Tensor]:
    """Per window w, [R, layers, heads * head_dim]: every head's output on ``before + target``
    (tokenised whole, as the authors do), averaged over the last min(w, len(target)) tokens of
    the target. The tokens the rows share (never a target's) run once, as a key/value cache."""
    ids, n_target, shared = _layout(session, texts)
    model, widest = session.model, max(windows)
    prefix = encode_prefix(model, ids[0][:shared]) if shared else None
    rows = [t[shared:] for t in ids]
    width = max(map(len, rows))
    batch = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], device=session.device)  # right padding: no mask
    owner, cols, depth = [], [], []  # depth: 0 for a row's last token, 1 for the one before...
    for r, (row, n) in enumerate(zip(rows, n_target)):
        span = min(widest, n)
        owner += [r] * span
        cols += range(len(row) - span, len(row))
        depth += range(span - 1, -1, -1)
    owner_t, depth_t = torch.tensor(owner), torch.tensor(depth)
    cache = broadcast_cache(prefix.cache, len(rows)) if prefix is not None else None
    layers = range(session.num_layers)
    with site.capture_attention_heads(model, layers, (owner_t.to(batch.device), torch.tensor(cols, device=batch.device))) as seen:
        model(input_ids=batch, **with_cache(model, cache), use_cache=cache is not None, logits_to_keep=1)
    states = torch.stack([seen[l].float().cpu() for l in layers], 1)  # [positions, layers, heads * head_dim]
    out = []
    for w in windows:
        keep = depth_t < w
        count = torch.bincount(owner_t[keep], minlength=len(rows)).float()
        total = torch.zeros(len(rows), *states.shape[1:]).index_add_(0, owner_t[keep], states[keep])
        out.append(total / count[:, None, None])
    return out


def _layout(session: Session, texts: Sequence[tuple[str, str]]) -> tuple[list[list[int]], list[int], int]:
    """(each text's ids, its target's token count, the leading tokens all rows share and run once)."""
    ids = [session.encode_prompt(before + target) for before, target in texts]
    # The target's tokens: the whole text's beyond the text before it (NL-ITI's get_activations.py).
    n_target = [max(1, len(full) - len(session.encode_prompt(before))) for full, (before, _) in zip(ids, texts)]
    return ids, n_target, min(len(common_prefix(ids)), *(len(t) - n for t, n in zip(ids, n_target)))


def padded_tokens(session: Session, texts: Sequence[tuple[str, str]]) -> int:
    """The tokens one ``window_outputs`` pass over ``texts`` runs: the shared part once, then every
    row right-padded to the longest."""
    ids, _, shared = _layout(session, texts)
    return shared + len(ids) * max(len(t) - shared for t in ids)


def contrast_texts(ex: Example) -> tuple[list[str], list[str]]:
    """(true, false) answers: the correct option and the others, or the refusal and the compliance."""
    if ex.gold is None:
        return ex.choices[:1], [COMPLIANCE_TARGET]
    return [ex.choices[ex.gold]], [c for i, c in enumerate(ex.choices) if i != ex.gold]


def truthfulqa_mc2() -> dict[str, tuple[list[str], list[str]]]:
    """TruthfulQA's MC2 answers by question id (``data.load_truthfulqa_mc``): (true, false) as
    ``mc2_targets.labels`` marks them (1 true, 0 false), in the file's order."""
    out = {}
    for record in load_truthfulqa_mc():
        targets = record["mc2_targets"]
        pairs = list(zip(targets["choices"], targets["labels"]))
        out[record["id"]] = ([c for c, label in pairs if label == 1], [c for c, label in pairs if label != 1])
    return out


def probe_answers(attribute: str, examples: list[Example]) -> tuple[str, list[tuple[list[str], list[str]]]]:
    """(what the rows are, each example's (true, false) answers): TruthfulQA's MC2 answers, as both
    originals probe ("mc2"); elsewhere ``contrast_texts`` ("options": BBQ; "refusal": SORRY-Bench)."""
    if attribute != "truthfulqa":
        return ("refusal" if examples and examples[0].gold is None else "options"), [contrast_texts(ex) for ex in examples]
    mc2 = truthfulqa_mc2()
    missing = [ex.id for ex in examples if ex.id not in mc2]
    if missing:
        raise ValueError(f"the published ITI recipe probes TruthfulQA's MC2 answers, but {len(missing)} training example(s) "
                         f"({', '.join(missing[:3])}) are not questions of the TruthfulQA data file "
                         "(truthfulqa/mc.jsonl.gz under MARI_DATA_DIR): point MARI_DATA_DIR at the data the splits were made from")
    return "mc2", [mc2[ex.id] for ex in examples]


def other_questions(examples: list[Example], pool: list[Example], seed: int) -> list[str]:
    """A seeded question of ``pool`` for each example, never its own (the end of sigma's prompt)."""
    rng = random.Random(f"iti-published:end_q:{seed}")
    texts = sorted({ex.question for ex in pool})
    out = []
    for ex in examples:
        candidates = [q for q in texts if q != ex.question] or texts
        out.append(rng.choice(candidates))
    return out


def recipe_activations(session: Session, recipe: Recipe, examples: list[Example], others: list[str],
                       answers: list[tuple[list[str], list[str]]]) -> dict[str, torch.Tensor]:
    """The recipe's activations of ``examples``' (true, false) ``answers`` ([rows, layers, heads,
    head_dim] each): ``probe`` and ``direction`` on the Q/A prompts (``labels``, ``owner``: the
    example's index), ``sigma`` on the prompts ending with another question (``sigma_owner``)."""
    n_heads, head_dim = site.attention_heads(session.model)
    shape = lambda x: x.reshape(len(x), session.num_layers, n_heads, head_dim)
    parts: dict[str, list] = {"probe": [], "direction": [], "sigma": [], "labels": [], "owner": [], "sigma_owner": []}
    for i, (ex, other, (true, false)) in enumerate(tqdm(list(zip(examples, others, answers)),
                                                          desc="published recipe: head outputs", leave=False)):
        qa = [recipe.qa(ex.question, a) for a in true + false]
        end_q = [recipe.end_q(ex.question, a, other) for a in true + false]
        # One pass for both prompts where that runs fewer tokens: they share "Q: {question} A:" (the
        # probe window of the end_q rows is not used), but a long other question (BBQ's contexts)
        # would pad every short answer row to its length, so then each kind runs in its own pass.
        m = len(qa)
        if padded_tokens(session, qa + end_q) <= padded_tokens(session, qa) + padded_tokens(session, end_q):
            probe, direction = window_outputs(session, qa + end_q, (recipe.probe_tokens, recipe.tokens))
            sigma, probe, direction = direction[m:], probe[:m], direction[:m]
        else:
            probe, direction = window_outputs(session, qa, (recipe.probe_tokens, recipe.tokens))
            (sigma,) = window_outputs(session, end_q, (recipe.tokens,))
        parts["probe"].append(shape(probe))
        parts["direction"].append(shape(direction))
        parts["sigma"].append(shape(sigma))
        parts["labels"] += [1.0] * len(true) + [0.0] * len(false)
        parts["owner"] += [i] * m
        parts["sigma_owner"] += [i] * m
    return {k: torch.cat(v) if k in ("probe", "direction", "sigma") else torch.tensor(v) for k, v in parts.items()}
