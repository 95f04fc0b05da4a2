"""Which heads ITI and NL-ITI shift, and the record of that choice (both recipes, ``iti`` and
``iti_published``).

Ranking. The heads are ranked by their probe's validation accuracy, best first. Both original
codes take ``np.argsort(accuracies)[::-1][:K]`` over the flattened (layer, head) accuracies
(likenneth/honest_llama ``utils.get_top_heads``; Samsung/NL-ITI ``utils.get_top_heads``).
Among equal accuracies that order is not specified: numpy's default sort is not stable (were it
stable, the reversal would put the highest index, the deepest layer, first; numpy 2's
vectorised sort returns ties in an order that depends on the machine's instruction set). Ties
are frequent here: a validation slice of a few questions allows a few distinct accuracies
among hundreds of heads. Ranking ties by head index, as this suite did before issue 36, filled
the ties at the top-K boundary with layers 0 and 1; the reversed stable order would fill them
with the last layers. ``rank_heads`` orders equal accuracies by a random permutation seeded by
the training seed instead: no layer is favoured, and the choice is the same on every machine
(Python's ``random`` with a string seed, not a platform sort).

Record. ``choice_record`` is what a bundle says about its heads (diagnostics of bundle.json,
and lm-eval's ``config.mari_diagnostics`` through ``ITI.summarize``): each chosen head with its
probe's validation accuracy, the accuracy of the K-th head (``boundary_accuracy``), how many
heads of the model share it (``heads_tied_at_boundary``) and how many of those the tie rule
let in (``tied_heads_chosen``): when the two differ, the seeded order, not the probes, chose
``tied_heads_chosen`` of the ``heads_tied_at_boundary``. ``probe_validation`` gives the size of
the slice the probes were scored on, the range of their accuracies over all heads, and the
plain accuracy of always answering the majority class (the bar for the published recipe's plain
accuracy; the adapted recipe's balanced accuracy puts that bar at 0.5).
"""

from __future__ import annotations

import random
from typing import Any, Callable

import torch

from mari_eval.methods.bundle_spec import Float, Int, List, Obj, Str

TIE_RULE = "seeded random order among equal accuracies (seed: the training seed)"
HEAD_SELECTIONS = ("validation", "cv")
CV_FOLDS = 5  # folds of questions for head_selection="cv"
HEAD_SCORES = ("accuracy", "balanced_accuracy", "auroc")  # what ranks the heads (the module's docstring)
HEAD_SCORE_SETTINGS = (*HEAD_SCORES, "auto")  # the published recipe's --set head_score=
# The setting as given, in a published bundle's hyperparameters (absent where not given: DEFAULT_HEAD_SCORE).
HEAD_SCORE_FIELD = Str(optional=True, choices=HEAD_SCORE_SETTINGS)
# Absent: plain accuracy, the authors' score, and that of every bundle trained before issue 81.5 (their cache keys
# name no head_score, so the same key must train the same bundle).
DEFAULT_HEAD_SCORE = "accuracy"
# head_score="auto": balanced accuracy above this majority share of the scored rows. TruthfulQA's MC2 answers, the
# rows both originals probe with plain accuracy, are 56.1% false over its 817 questions (3,297 of 5,882), and a
# random slice of 163 questions (honest_llama's 20%) never passed 0.6 in 20,000 draws, one of 100 in 0.05%; BBQ's
# correct option against the others is at least 2/3 (91.67% in the budget profile's rows). So "auto" keeps the
# authors' score on the authors' data and leaves it where always answering the majority already scores over 0.6.
AUTO_MAJORITY = 0.6

# What the record adds to a bundle's diagnostics; every key optional (bundles trained before issue 36 lack them).
RECORD_FIELDS = {
    "chosen_heads": List(Obj({"layer": Int(0), "head": Int(0), "validation_accuracy": Float(0, 1)}), optional=True),
    "boundary_accuracy": Float(0, 1, optional=True),
    "heads_tied_at_boundary": Int(1, optional=True),
    "tied_heads_chosen": Int(1, optional=True),
    "head_tie_rule": Str(optional=True),
    "probe_validation": Obj({"rows": Int(1), "true_rows": Int(0), "majority_accuracy": Float(0, 1),
                             "accuracy_min": Float(0, 1), "accuracy_max": Float(0, 1)}, optional=True),
    "head_selection": Str(optional=True, choices=HEAD_SELECTIONS),
    "selection_warnings": List(Str(), optional=True),
    # Absent before issue 81.5: plain accuracy (published) or balanced accuracy (adapted).
    "head_score": Str(optional=True, choices=HEAD_SCORES),
    "head_score_setting": Str(optional=True, choices=HEAD_SCORE_SETTINGS),
    "head_score_threshold": Float(0, 1, optional=True),
}

# score(x_fit [N, G, d], y_fit [N], x_val [M, G, d], y_val [M], seed) -> the score of each of G probes [G]
ProbeScore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def majority_share(y: torch.Tensor) -> float:
    """The share of the rows labelled ``y`` [M] in their larger class: always answering it scores this plain accuracy."""
    true_rows = int((y > 0.5).sum())
    return max(true_rows, len(y) - true_rows) / len(y)


def resolve_head_score(setting: str, y: torch.Tensor) -> str:
    """The score (``HEAD_SCORES``) that ranks heads whose probes are scored on rows labelled ``y``:
    ``setting`` itself, or for "auto" balanced accuracy above ``AUTO_MAJORITY`` majority share, else plain accuracy."""
    if setting not in HEAD_SCORE_SETTINGS:
        raise ValueError(f"head_score={setting!r}: use one of {', '.join(HEAD_SCORE_SETTINGS)} (--set head_score=...)")
    if setting != "auto":
        return setting
    return "balanced_accuracy" if majority_share(y) > AUTO_MAJORITY else "accuracy"


def head_scores(decisions: torch.Tensor, y: torch.Tensor, score: str) -> torch.Tensor:
    """``score`` of each of G probes [G] from their decisions [M, G] on rows labelled ``y`` [M]; a
    probe answers 1 where its decision is above 0. Plain accuracy is computed as ``accuracy_score``
    (the hits over M, in float64, then float32: the same value as scikit-learn's)."""
    gold = y > 0.5
    hits = (decisions > 0) == gold[:, None]
    if score == "accuracy":
        return (hits.double().sum(0) / len(y)).float()
    if gold.all() or not gold.any():
        raise ValueError(f"head_score={score}: the {len(y)} rows the probes are scored on (a validation slice or a "
                         "fold of questions) are one class only; use more training examples or head_score=accuracy")
    if score == "balanced_accuracy":  # the mean of the recalls of the two classes
        return (0.5 * (hits[gold].double().mean(0) + hits[~gold].double().mean(0))).float()
    if score == "auroc":
        # Mann-Whitney: (the true rows' rank sum - n1 (n1 + 1) / 2) / (n1 n0), ranks over all M rows, ties averaged.
        from scipy.stats import rankdata  # deferred: scipy is heavy; only this score needs it

        ranks = torch.from_numpy(rankdata(decisions.double().numpy(), axis=0))
        n1, n0 = int(gold.sum()), int((~gold).sum())
        return ((ranks[gold].sum(0) - n1 * (n1 + 1) / 2) / (n1 * n0)).float()
    raise ValueError(f"head score {score!r}: use one of {', '.join(HEAD_SCORES)}")


def cross_validated_accuracy(score: ProbeScore, x: torch.Tensor, y: torch.Tensor, owner: torch.Tensor, seed: int,
                             folds: int = CV_FOLDS) -> torch.Tensor:
    """Each head's probe score over all rows ``x`` [N, G, d], every row predicted by a probe (``score``)
    fitted on the rows of the other folds; the folds split the questions (``owner``: each row's question),
    seeded, so that no question is both fitted and scored. The folds' scores are averaged weighted by
    their rows: for plain accuracy, the share of all rows predicted right."""
    questions = sorted(set(owner.tolist()))
    if len(questions) < 2:
        raise ValueError("cross-validated head selection needs at least 2 training questions")
    order = list(questions)
    random.Random(f"iti-heads:cv:{seed}").shuffle(order)
    fold_of = {q: i % min(folds, len(order)) for i, q in enumerate(order)}
    assigned = torch.tensor([fold_of[int(q)] for q in owner])
    correct = torch.zeros(x.shape[1], dtype=torch.float64)
    for fold in range(min(folds, len(order))):
        held = assigned == fold
        if y[~held].min() == y[~held].max():
            raise ValueError(f"cross-validated head selection: the probes of fold {fold + 1} would be fitted on one "
                             "class only; use more training examples")
        correct += score(x[~held], y[~held], x[held], y[held], seed).double() * int(held.sum())
    return (correct / len(y)).float()


def score_label(score: str) -> str:
    """How prose names a head score: "accuracy", "balanced accuracy", "AUROC"."""
    return "AUROC" if score == "auroc" else score.replace("_", " ")


def selection_warnings(record: dict[str, Any], k: int) -> list[str]:
    """What makes a choice of heads uninformative (``choice_record``'s record of it): the K-th head's
    score within one probe row of what no signal scores (plain accuracy: always answering the majority
    class; balanced accuracy or AUROC: 0.5, within one row of the minority class), or more heads tied
    at it than K."""
    out = []
    score = record.get("head_score", DEFAULT_HEAD_SCORE)
    probe = record.get("probe_validation", {})
    rows, majority = probe.get("rows"), probe.get("majority_accuracy")
    kth = record["boundary_accuracy"]
    if score == "accuracy":
        if rows and majority is not None and kth - majority <= 1 / rows + 2e-6:  # both rounded to 1e-6
            out.append(f"the K-th head's probe accuracy {kth:.4f} is within one of {rows} rows of "
                       f"always answering the majority class ({majority:.4f})")
    elif rows and "true_rows" in probe:
        minority = min(probe["true_rows"], rows - probe["true_rows"])
        if minority and kth - 0.5 <= 0.5 / minority + 1e-6:  # one minority row moves balanced accuracy by 0.5 / minority
            out.append(f"the K-th head's probe {score_label(score)} {kth:.4f} is within one of the {minority} rows of the "
                       "minority class of 0.5, what a probe without signal scores")
    if record["heads_tied_at_boundary"] > k:
        out.append(f"{record['heads_tied_at_boundary']} heads tie at the K-th {score_label(score)}, more than K = {k}: "
                   f"the seeded order chose {record['tied_heads_chosen']} of them")
    return out


def rank_heads(accuracy: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Flat head indices (layer * n_heads + head) by probe accuracy, best first; equal accuracies
    in a random order seeded by ``seed`` (never by index; the module's docstring says why)."""
    order = list(range(len(accuracy)))
    random.Random(f"iti-heads:{seed}").shuffle(order)
    shuffled = torch.tensor(order, dtype=torch.long)
    # A stable sort of the shuffled accuracies keeps equal ones in the shuffled order.
    return shuffled[torch.sort(accuracy[shuffled], descending=True, stable=True).indices]


def choice_record(accuracy: torch.Tensor, ranked: torch.Tensor, k: int, n_heads: int,
                  y_val: torch.Tensor | None = None, score: str = DEFAULT_HEAD_SCORE) -> dict[str, Any]:
    """The diagnostics of choosing ``ranked[:k]`` (heads of ``n_heads`` per layer) by ``accuracy``
    [layers * n_heads], the probes' ``score`` (``HEAD_SCORES``); ``y_val``: the probes' validation
    labels, for the size and majority class of the slice they were scored on."""
    if not 1 <= k <= len(ranked):
        raise ValueError(f"K = {k} heads asked of {len(ranked)}: choose K between 1 and the model's number of heads")
    top = ranked[:k]
    boundary = accuracy[top[-1]]
    tied = accuracy == boundary
    record: dict[str, Any] = {
        "chosen_heads": [{"layer": int(i) // n_heads, "head": int(i) % n_heads,
                          "validation_accuracy": round(float(accuracy[i]), 6)} for i in top],
        "boundary_accuracy": round(float(boundary), 6),
        "heads_tied_at_boundary": int(tied.sum()),
        "tied_heads_chosen": int(tied[top].sum()),
        "head_tie_rule": TIE_RULE,
        "head_score": score,
    }
    if y_val is not None:
        true_rows = int((y_val > 0.5).sum())
        record["probe_validation"] = {
            "rows": len(y_val), "true_rows": true_rows,
            "majority_accuracy": round(max(true_rows, len(y_val) - true_rows) / len(y_val), 6),
            "accuracy_min": round(float(accuracy.min()), 6), "accuracy_max": round(float(accuracy.max()), 6)}
    return record


def heads_summary(config: dict[str, Any], heads: torch.Tensor) -> dict[str, Any]:
    """What lm-eval's diagnostics show of a bundle's heads: its record (``choice_record``), or, for a
    bundle trained before it existed, its heads [K, 2] with the accuracies it kept (``probe_accuracy``)."""
    diagnostics = config.get("diagnostics") or {}
    if "chosen_heads" in diagnostics:
        return {key: diagnostics[key] for key in RECORD_FIELDS if key in diagnostics}
    accuracy = diagnostics.get("probe_accuracy")
    if not isinstance(accuracy, list) or len(accuracy) != len(heads):
        accuracy = [None] * len(heads)
    return {"chosen_heads": [{"layer": layer, "head": head, "validation_accuracy": a}
                             for (layer, head), a in zip(heads.tolist(), accuracy)],
            "head_tie_rule": "not recorded (bundle trained before issue 36)"}
