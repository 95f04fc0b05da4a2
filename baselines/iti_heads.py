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
}

# score(x_fit [N, G, d], y_fit [N], x_val [M, G, d], y_val [M], seed) -> accuracy of each of G probes [G]
ProbeScore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def cross_validated_accuracy(score: ProbeScore, x: torch.Tensor, y: torch.Tensor, owner: torch.Tensor, seed: int,
                             folds: int = CV_FOLDS) -> torch.Tensor:
    """Each head's probe accuracy over all rows ``x`` [N, G, d], every row predicted by a probe (``score``)
    fitted on the rows of the other folds; the folds split the questions (``owner``: each row's question),
    seeded, so that no question is both fitted and scored."""
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


def selection_warnings(record: dict[str, Any], k: int) -> list[str]:
    """What makes a choice of heads uninformative (``choice_record``'s record of it): the K-th
    accuracy within one probe row of the majority class, or more heads tied at it than K."""
    out = []
    rows = record.get("probe_validation", {}).get("rows")
    majority = record.get("probe_validation", {}).get("majority_accuracy")
    if rows and majority is not None and record["boundary_accuracy"] - majority <= 1 / rows + 2e-6:  # both rounded to 1e-6
        out.append(f"the K-th head's probe accuracy {record['boundary_accuracy']:.4f} is within one of {rows} rows of "
                   f"always answering the majority class ({majority:.4f})")
    if record["heads_tied_at_boundary"] > k:
        out.append(f"{record['heads_tied_at_boundary']} heads tie at the K-th accuracy, more than K = {k}: the seeded "
                   f"order chose {record['tied_heads_chosen']} of them")
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
                  y_val: torch.Tensor | None = None) -> dict[str, Any]:
    """The diagnostics of choosing ``ranked[:k]`` (heads of ``n_heads`` per layer) by ``accuracy``
    [layers * n_heads]; ``y_val``: the probes' validation labels, for the size and majority class of
    the slice they were scored on."""
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
