"""The published training recipes of ITI and NL-ITI (``--recipe published``; ``iti.ITI.fit_published``).

Published recipe. What the authors do, from their code:

* ITI (Li et al., 2023; likenneth/honest_llama, ``utils.py`` and ``legacy/llama_validate_2fold.py``):
  every answer of TruthfulQA's MC2 targets, each true one labelled 1 and each false one 0
  (``tokenized_tqa`` reads ``mc2_targets``), is written "Q: {question} A: {answer}" with no
  instruction or few-shot preamble (``format_truthfulqa``) and each head's output is read at its
  last token. One scikit-learn ``LogisticRegression`` (default L2, C = 1, lbfgs) per head is
  fitted on the raw outputs of the answers of 80% of the training questions and scored by plain
  accuracy on those of the other 20%, split by question (``train_probes``); the heads are ranked
  by that accuracy, ``np.argsort(accs)[::-1]`` (``get_top_heads``). The direction of a head is
  the mass-mean difference true minus false over
  the training and validation questions (``get_com_directions``, ``--use_center_of_mass``), unit
  length; sigma is the population standard deviation (``np.std``) of the projections on it of
  the "tuning" activations, read at the last token of "Q: {question} A: {answer} Q: {another
  question}" (``tokenized_tqa_gen_end_q``, ``--activations_dataset tqa_gen_end_q``). K = 48 heads
  of Llama-7B's 32 x 32 and alpha = 15 are fixed (the script's defaults, the released models'
  settings). In multiple-choice scoring the shift is added from the answer's tokens on
  (``tqa_run_probs``: ``start_edit_location`` skips the question and its "\\nA: "), so the first
  answer token is scored by the unshifted model.
* NL-ITI (Hoscilowicz et al., 2024; Samsung/NL-ITI, ``reproduce_table1_commands``): the same
  pipeline on MC2's true and false answers (``prepare_dataset``: ``answers``, ``false_answers``;
  ``split_activations`` splits by question; ``utils.get_top_heads`` the same reversed argsort),
  with "Q: {question}\\nA: {answer}" (``prepare_dataset.format_qa``), the head outputs
  averaged over the last tokens of the answer (``get_activations.py``: the target after "A:"),
  4 of them for the probes and 6 for the direction and sigma; the probe is an MLP
  head_dim-16-1 with BatchNorm and ReLU (``probes.MLP_S``) trained 10 epochs with Adam (lr 5e-4,
  weight decay 1e-4, batches of 32, BCE), keeping each head's epoch of best validation accuracy
  (``probing.train_model``); sigma from "Q: {question}\\nA: {answer}\\n\\nQ: {another question}",
  averaged over the other question's last 6 tokens (``format_endq``, on the same MC2 answers,
  ``--activations_std_format endq``). The shift starts at the token before the answer line
  (``intervention.intervene``:
  ``start_edit_location = answer_starts_at_idx - 1``), i.e. at p* here. Its reported numbers
  come from a grid of K in 16..96 and alpha in 5..30 whose best MC1 on the evaluation fold is
  kept (``-ht``, ``common.HT_HEADS``/``HT_ALPHA``, ``utils.get_best_result``); no fixed pair is
  published, so this recipe takes ``intervention.py``'s defaults, K = 48 and alpha = 15
  (``--heads``, ``--alpha``), the same as ITI's, rather than choose on a test split.

What this recipe does: the above on D_train. A TruthfulQA question gives one probe row per MC2
answer (every true one 1, every false one 0; ``probe_answers``, read from the data file by the
example's id), as both originals probe; BBQ keeps the correct option (1) against the others
(0), SORRY-Bench the refusal target (1) against the compliance target (0): they have no MC2
(``hyperparameters.probe_answers`` says which). ITI's probes are scikit-learn's own estimator
(``logistic_accuracy``), NL-ITI's MLPs one batched network over all heads (``mlp_accuracy``).
Equal accuracies are ordered by a random permutation seeded by the training seed
(``iti_heads.rank_heads``: the originals' reversed argsort leaves ties to numpy's unstable
sort; ordering them by head index favoured layers 0 and 1). The chosen heads with their
validation accuracies, and how many heads share the K-th accuracy, are recorded in the
bundle's diagnostics (``iti_heads.choice_record``) and shown in lm-eval's
``config.mari_diagnostics``; ``head_selection="cv"`` scores the probes by cross-validation over
all of D_train instead (``iti_heads``). ``head_score`` names the score that ranks them: absent or
"accuracy", the authors' plain accuracy; "balanced_accuracy" or "auroc"; "auto", balanced accuracy
where more than 60% of the scored rows are one class (BBQ's), else plain accuracy
(``iti_heads.AUTO_MAJORITY``); a deviation from the authors, recorded as given in the
hyperparameters and as used in the diagnostics (NL-ITI then also keeps each probe's epoch by that
score). K scales with the model: 48 / 1024 of its heads (13 of SmolLM2-135M's 30 x 9), so that the share of the model moved is the authors'; alpha is in units
of sigma and stays 15. The probes are fitted on the answers of the 80% of the questions of
``common.validation_split`` and scored on those of its 20% (a split by question, as the
authors'; ``validation=ctrl``: fitted on all of D_train, scored on D_ctrl's attribute examples);
the kept bundle's directions and sigmas come from all of D_train (as the authors' train + val),
and ``validation_loss_selected`` is the task loss on the validation examples with directions and
sigmas from the fitted ones alone. ITI's bundle records ``shift_from: answer`` (``ITI.applied``).

Where it must still differ: the probes and directions are read from the authors' own prompt, but
every method is evaluated (and the selection loss computed) on lm-eval's prompts, the 6-shot
TruthfulQA preamble included (the selection loss on TruthfulQA MC1, the suite's training task);
BBQ and SORRY-Bench examples use the same Q/A format (with BBQ's context; the refusal and
compliance targets as answers); sigma's
prompts are MC2's answers (honest_llama reads the generation set's correct and incorrect
answers, from which MC2's were drawn) on D_train alone, their "other question" a seeded draw
from the fit slice (honest_llama reads them on all 817 questions, unlabelled); a fit slice smaller
than one batch of 32 trains the MLPs on one batch; in generation, honest_llama's answer path also
shifts the last prompt token (``start_edit_location='lt'``), which ``shift_from: answer`` does not.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F


from .iti_activations import Recipe, other_questions, probe_answers, recipe_activations
from .common import SELECTION_KEY, validation_loss, validation_record, validation_split
from .iti_heads import (AUTO_MAJORITY, CV_FOLDS, DEFAULT_HEAD_SCORE, choice_record, cross_validated_accuracy, head_scores,
                        rank_heads, resolve_head_score, score_label, selection_warnings)

if TYPE_CHECKING:
    from mari_eval.methods.intervention import Intervention
    from mari_eval.training.examples import AttributeData
    from mari_eval.training.session import Session

log = logging.getLogger(__name__)

HEAD_FRACTION = 48 / 1024  # ITI's K = 48 of Llama-7B's 1024 heads, also NL-ITI's --heads default
ALPHA = 15.0  # both repositories' default --alpha
LOGISTIC_C = 1.0  # scikit-learn's default inverse regularisation strength
LBFGS_ITERATIONS = 1000  # honest_llama's max_iter
MLP = {"width": 16, "epochs": 10, "lr": 5e-4, "weight_decay": 1e-4, "batch_size": 32}  # NL-ITI's probes.MLP_S, probing.py
BATCH_NORM_EPS, BATCH_NORM_MOMENTUM = 1e-5, 0.1  # torch.nn.BatchNorm1d's defaults


# ----------------------------------------------------------------------------- probes


def logistic_accuracy(x_fit: torch.Tensor, y_fit: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor,
                      seed: int, score: str = DEFAULT_HEAD_SCORE) -> torch.Tensor:
    """Validation ``score`` [G] (plain accuracy unless told: ``iti_heads.head_scores``; ``predict`` is
    ``decision_function > 0``) of one scikit-learn ``LogisticRegression`` per head on the raw
    outputs ``x`` [N, G, d]: ITI's own probe (``train_probes``: C = 1, lbfgs, max_iter 1000,
    ``random_state=seed``), in float64 as the authors' float16 activations reach it. The
    authors' estimator rather than a re-solve: the same optimum to lbfgs's tolerance, in about
    two seconds for 270 heads (one torch L-BFGS over all heads at once, whose curvatures differ
    by orders of magnitude, stopped short of it on some heads and took 30 times longer)."""
    # deferred: scikit-learn is heavy; only this path needs it
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    fit_x, val_x = x_fit.double().numpy(), x_val.double().numpy()
    fit_y, val_y = y_fit.numpy() > 0.5, y_val.numpy() > 0.5
    decisions, unconverged = [], 0
    for g in range(fit_x.shape[1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)  # counted below, reported once
            probe = LogisticRegression(C=LOGISTIC_C, solver="lbfgs", max_iter=LBFGS_ITERATIONS, random_state=seed)
            probe.fit(fit_x[:, g], fit_y)
        unconverged += int(probe.n_iter_[0] >= LBFGS_ITERATIONS)
        decisions.append(probe.decision_function(val_x[:, g]))
    if unconverged:
        log.warning("ITI probes: lbfgs stopped at max_iter=%d on %d of %d heads (as it would in honest_llama)",
                    LBFGS_ITERATIONS, unconverged, fit_x.shape[1])
    return head_scores(torch.from_numpy(np.stack(decisions, 1)), y_val, score)


def mlp_accuracy(x_fit: torch.Tensor, y_fit: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor, seed: int,
                 score: str = DEFAULT_HEAD_SCORE) -> torch.Tensor:
    """Validation accuracy [G] of each head's NL-ITI probe (Linear d-16, BatchNorm, ReLU, Linear
    16-1, sigmoid; BCE, Adam), at the epoch of its best validation accuracy (the first best),
    as ``probing.train_model`` keeps (another ``score``, ``iti_heads.head_scores``: that score, at
    its best epoch). All heads train as one batched network; every head starts from the same initial weights, as every probe of the authors' runs is built after
    ``set_seeds(seed)``, and sees the same batches: one ``randperm`` per epoch from a generator
    seeded ``seed`` (their DataLoader's is seeded 0)."""
    n, groups, dim = x_fit.shape
    width = MLP["width"]
    gen, orders = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    uniform = lambda shape, fan_in: (torch.rand(shape, generator=gen) * 2 - 1) / fan_in**0.5  # nn.Linear's initialisation
    first = [uniform((dim, width), dim), uniform((width,), dim)]
    second = [uniform((width,), width), uniform((), width)]
    params = {"w1": first[0].expand(groups, dim, width), "b1": first[1].expand(groups, width),
              "gamma": torch.ones(groups, width), "beta": torch.zeros(groups, width),
              "w2": second[0].expand(groups, width), "b2": second[1].expand(groups)}
    params = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    running = {"mean": torch.zeros(groups, width), "var": torch.ones(groups, width)}

    def logits(x: torch.Tensor, train: bool) -> torch.Tensor:
        h = torch.einsum("ngd,gdm->ngm", x, params["w1"]) + params["b1"]
        if train:
            mean, var = h.mean(0), h.var(0, unbiased=False)
            with torch.no_grad():
                running["mean"].lerp_(mean, BATCH_NORM_MOMENTUM)
                running["var"].lerp_(h.var(0, unbiased=True) if len(h) > 1 else var, BATCH_NORM_MOMENTUM)
        else:
            mean, var = running["mean"], running["var"]
        h = torch.relu((h - mean) / (var + BATCH_NORM_EPS).sqrt() * params["gamma"] + params["beta"])
        return torch.einsum("ngm,gm->ng", h, params["w2"]) + params["b2"]

    opt = torch.optim.Adam(params.values(), lr=MLP["lr"], weight_decay=MLP["weight_decay"])
    size = min(MLP["batch_size"], n)  # DataLoader(drop_last=True); a smaller fit slice is one batch
    best = torch.full((groups,), -1.0)
    gold = y_val[:, None] > 0.5
    for _ in range(MLP["epochs"]):
        order = torch.randperm(n, generator=orders)
        with torch.enable_grad():
            for start in range(0, n - size + 1, size):
                batch = order[start : start + size]
                opt.zero_grad()
                out = logits(x_fit[batch], train=True)
                # BCELoss averages over each head's batch; the heads' losses add, their gradients stay apart.
                F.binary_cross_entropy_with_logits(out, y_fit[batch, None].expand_as(out), reduction="none").mean(0).sum().backward()
                opt.step()
        with torch.no_grad():
            out = logits(x_val, train=False)
            # Plain accuracy in float32 as before issue 81.5, so that a bundle's key trains the same heads.
            accuracy = ((out > 0) == gold).float().mean(0) if score == "accuracy" else head_scores(out, y_val, score)
            best = torch.where(accuracy > best, accuracy, best)
    return best


def direction_and_sigma(x: torch.Tensor, y: torch.Tensor, tuning: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit mass-mean directions (true minus false) of ``x`` [N, K, d] and the population standard
    deviation (``np.std``) of ``tuning`` [M, K, d]'s projections on them, as get_interventions_dict."""
    theta = x[y > 0.5].mean(0) - x[y <= 0.5].mean(0)
    theta = theta / theta.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    return theta, torch.einsum("mkd,kd->mk", tuning, theta).std(0, correction=0)


def num_heads_for(total_heads: int) -> int:
    """K: ITI's share of the heads (48 / 1024), at least one."""
    return max(1, round(HEAD_FRACTION * total_heads))


# ----------------------------------------------------------------------------- the fit


def fit_published(cls: type[Intervention], session: Session, data: AttributeData, config: dict[str, Any],
                  hyperparameters: dict[str, Any], seed: int) -> Intervention:
    """``cls`` (ITI or NL-ITI) trained by its authors' recipe, ``cls.published``."""
    recipe: Recipe = cls.published
    fixed = sorted(set(hyperparameters) - {"recipe", "head_selection", "head_score", "validation"})
    selection = hyperparameters.get("head_selection", "validation")  # how the probes are scored (iti_heads)
    setting = hyperparameters.get("head_score", DEFAULT_HEAD_SCORE)  # what ranks them (iti_heads.HEAD_SCORES)
    if fixed:
        raise ValueError(f"{cls.method}: the published recipe fixes K and alpha (the authors' 48/1024 of the heads and 15); "
                         f"drop --set {', '.join(fixed)} or use --recipe adapted, which chooses them on the validation slice")
    source = hyperparameters.get("validation")  # None: the seeded 20% of D_train (common.VALIDATION_SOURCES)
    fit_examples, val_examples = validation_split(data, seed, source)
    examples = fit_examples + val_examples
    answer_kind, answers = probe_answers(data.attribute, examples)
    acts = recipe_activations(session, recipe, examples, other_questions(examples, fit_examples, seed), answers)
    n_layers, n_heads, head_dim = acts["probe"].shape[1:]
    flat = {k: acts[k].reshape(len(acts[k]), n_layers * n_heads, head_dim) for k in ("probe", "direction", "sigma")}
    y = acts["labels"]
    is_fit, sigma_fit = acts["owner"] < len(fit_examples), acts["sigma_owner"] < len(fit_examples)
    in_train, sigma_in_train = (is_fit, sigma_fit) if source == "ctrl" else (torch.ones_like(is_fit), torch.ones_like(sigma_fit))  # D_train
    if y[~is_fit].min() == y[~is_fit].max():
        raise ValueError(f"{cls.method}: the validation slice has one class only; use more training examples")
    scored = y[in_train] if selection == "cv" else y[~is_fit]  # the rows the probes are scored on
    head_score = resolve_head_score(setting, scored)
    score = functools.partial(logistic_accuracy if recipe.probe == "linear" else mlp_accuracy, score=head_score)
    if selection == "cv":  # every row scored by a probe fitted without its question
        accuracy = cross_validated_accuracy(score, flat["probe"][in_train], y[in_train], acts["owner"][in_train], seed)
    else:
        accuracy = score(flat["probe"][is_fit], y[is_fit], flat["probe"][~is_fit], y[~is_fit], seed)
    k = num_heads_for(n_layers * n_heads)
    ranked = rank_heads(accuracy, seed)
    top = ranked[:k]
    heads = torch.stack([top // n_heads, top % n_heads], 1)
    choice = choice_record(accuracy, ranked, k, n_heads, scored, head_score)
    choice.update(head_selection=selection, head_score_setting=setting, selection_warnings=selection_warnings(choice, k),
                  **({"head_score_threshold": AUTO_MAJORITY} if setting == "auto" else {}))
    for warning in choice["selection_warnings"]:
        log.warning("%s (published) head choice: %s", cls.method, warning)
    log.info("%s (published): heads ranked by %s (head_score=%s, majority share %.4f); %d of %d share the K-th score "
             "%.4f, %d of them chosen by the seeded tie order", cls.method, score_label(head_score), setting,
             choice["probe_validation"]["majority_accuracy"], choice["heads_tied_at_boundary"], len(accuracy),
             choice["boundary_accuracy"], choice["tied_heads_chosen"])

    hp = {"recipe": "published", "alpha": ALPHA, "num_heads": k, "head_fraction": HEAD_FRACTION, "probe": recipe.probe,
          "probe_answers": answer_kind, "probe_tokens": recipe.probe_tokens, "tokens": recipe.tokens, "shift_from": recipe.shift_from,
          **recipe.formats(), **validation_record(source, val_examples),
          **({"head_selection": "cv", "probe_folds": CV_FOLDS} if selection == "cv" else {}),
          **({"head_score": setting} if "head_score" in hyperparameters else {})}
    hp.update({"probe_C": LOGISTIC_C, "probe_max_iter": LBFGS_ITERATIONS} if recipe.probe == "linear"
              else {f"probe_{name}": value for name, value in MLP.items()})
    position = ("attention heads' outputs, every token after the last prompt token (the answer's)" if recipe.shift_from == "answer"
                else "attention heads' outputs, last prompt token and every later token")
    site_config = {**config["site"], "layer": int(heads[:, 0].min()), "position": position}

    def bundle(rows: torch.Tensor, sigma_rows: torch.Tensor, diagnostics: dict[str, Any]) -> Intervention:
        theta, sigma = direction_and_sigma(flat["direction"][rows][:, top], y[rows], flat["sigma"][sigma_rows][:, top])
        return cls({**config, "site": site_config, "hyperparameters": hp, "diagnostics": diagnostics},
                   {"heads": heads.contiguous(), "directions": theta.contiguous(), "sigma": sigma.contiguous()})

    # The selection loss: the kept heads with directions and sigmas of the fit slice alone, applied as evaluation applies them.
    session.prepare(val_examples, f"{cls.method} validation slice", lower=False)
    candidate = bundle(is_fit, sigma_fit, {})
    selected = validation_loss(session, val_examples, candidate.plan(session.model))
    base = validation_loss(session, val_examples)
    log.info("%s (published): %d heads, alpha %g: validation loss %.4f (base %.4f)", cls.method, k, ALPHA, selected, base)
    return bundle(in_train, sigma_in_train, {
        SELECTION_KEY: selected, "validation_loss_base": base, "probe_accuracy": accuracy[top].tolist(),
        "heads": heads.tolist(), **choice, "validation_ids": [ex.id for ex in val_examples]})
