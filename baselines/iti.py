"""ITI: Inference-Time Intervention (Li et al., 2023), and NL-ITI (Hoscilowicz et al., 2024).

What ITI computes (as in the original):

1. For every training question, each continuation is appended to the prompt (the
   correct option(s) labelled 1, the wrong ones 0; for SORRY-Bench the refusal target 1
   and the compliance target 0) and every attention head's output (the input of the
   layer's attention output projection, one ``head_dim`` slice per head) is read at the
   last token.
2. One linear probe per head is fitted on 80% of D_train and scored on the other 20% (the
   validation slice, split by question; ``--set validation=ctrl``: fitted on all of D_train,
   scored on D_ctrl's attribute examples, ``common.VALIDATION_SOURCES``); heads ranked by that
   accuracy, ties in an order seeded by the training seed (``iti_heads.rank_heads``). The chosen
   heads, their accuracies and the ties at the K-th are in the bundle's diagnostics (``iti_heads``).
3. For each of the top K heads, the *mass-mean* direction theta = mean(label 1) -
   mean(label 0) of its outputs, normalised, and sigma = the standard deviation of the
   outputs projected on it.
4. At inference the head's output is shifted by alpha * sigma * theta at every position
   from the last prompt token on, generated tokens included (the original adds the
   shift at all positions it runs after the prompt). Shifting a head's output by s is
   adding W_o s to the attention output, which is what the hooks do (the original folds
   the same vector into the projection's bias). ``scale=`` in lm-eval's ``--model_args``
   multiplies alpha at evaluation (``common.ScaledVector``).

NL-ITI changes two things and nothing else (``NLITI``'s class attributes): the probes are MLPs
(one hidden ReLU layer), and the head outputs are averaged over the last ``tokens = 4`` tokens of
each continuation (its "multi-token" representation), for probing and the direction alike.

Hyperparameters: ITI used K = 48 of Llama-7B's 1024 heads (4.7%) and alpha = 15. Here K is chosen
among 2.5%, 5% and 10% of the heads and alpha among 2.5, 5, 10, 15 by the task loss on the
validation slice; the directions and sigmas are then recomputed on all of D_train.

Deviations: probes are logistic regressions (or MLPs) trained with Adam on standardised features,
all heads in one batched tensor, class-balanced (a question has one correct option and several
wrong ones) and ranked by balanced accuracy; ITI used scikit-learn's and plain accuracy.

Published recipe (``--recipe published``, ``iti_published``; sources and remaining differences
in its docstring). The authors' own pipeline: head outputs read on "Q: {question} A: {answer}"
(NL-ITI: "Q: {question}\nA: {answer}") with no few-shot preamble, for every true (1) and false
(0) answer of TruthfulQA's MC2 targets (BBQ, SORRY-Bench: as above), one L2 logistic regression
(scikit-learn's C = 1, lbfgs) per head on raw outputs ranked by plain validation accuracy
(NL-ITI: a width-16 MLP with BatchNorm, 10 epochs of Adam, its best epoch; probes on the
answer's last 4 tokens, directions and sigmas on its last 6), mass-mean directions, sigma the
population std of the projections of prompts ending with another question, and fixed K =
48/1024 of the heads (13 of SmolLM2-135M's 270) and alpha = 15. ITI's shift starts at the
answer's first token, not at p* (honest_llama's multiple-choice scoring): its bundle records
``shift_from: answer``, which ``applied`` honours; NL-ITI's starts at p*, as the adapted one.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mari_eval.injection import devices, site
from mari_eval.methods.bundle_spec import BundleError, Float, Int, List, Obj, Str, TensorSpec
from mari_eval.methods.intervention import Intervention
from mari_eval.injection.plan import BASE, Plan, Positions
from mari_eval.evaluation.prefix_cache import broadcast_cache, with_cache
from mari_eval.methods.registry import register_method

from .common import (RECIPE_FIELD, SELECTION_KEY, VALIDATION_FIELD, VALIDATION_FIELDS, ScaledVector, prepare_validation,
                     validation_losses, validation_record, validation_split)
from .iti_heads import HEAD_SCORE_FIELD, HEAD_SELECTIONS, RECORD_FIELDS, choice_record, heads_summary, rank_heads
from .iti_activations import ITI_RECIPE, NL_ITI_RECIPE, Recipe
from .iti_published import fit_published

if TYPE_CHECKING:
    from mari_eval.training.examples import AttributeData, Example
    from mari_eval.training.session import Session

log = logging.getLogger(__name__)

HEAD_FRACTIONS = (0.025, 0.05, 0.1)
ALPHAS = (2.5, 5.0, 10.0, 15.0)
PROBE_STEPS = 300
MLP_WIDTH = 32


# ----------------------------------------------------------------------------- activations


@torch.no_grad()
def head_outputs(session: Session, ex: Example, continuations: list[list[int]], tokens: int) -> torch.Tensor:
    """[M, layers, heads * head_dim]: every head's output after ``ex``'s prompt + each
    continuation, averaged over the continuation's last ``tokens`` tokens."""
    model = session.model
    rows = [[ex.context[-1]] + list(c) for c in continuations]
    width = max(map(len, rows))
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], device=session.device)
    owner, cols = [], []
    for r, row in enumerate(rows):  # row position 0 is p*, the continuation starts at 1
        span = range(max(1, len(row) - tokens), len(row))
        owner += [r] * len(span)
        cols += list(span)
    owner_t = torch.tensor(owner, device=ids.device)
    layers = range(session.num_layers)
    cache = broadcast_cache(session.prefix(ex).cache, len(rows))
    # Right padding: every read position comes before the pads, so no mask is needed.
    with site.capture_attention_heads(model, layers, (owner_t, torch.tensor(cols, device=ids.device))) as seen:
        # The heads' outputs are read on the way: the logits of one position are enough (no vocabulary-wide
        # projection of every token, a fifth of the pass).
        model(input_ids=ids, **with_cache(model, cache), use_cache=cache is not None, logits_to_keep=1)
    count = torch.bincount(owner_t, minlength=len(rows))[:, None].float()
    means = [torch.zeros(len(rows), seen[l].shape[-1]).index_add_(0, owner_t.cpu(), seen[l].float().cpu()) / count.cpu()
             for l in layers]
    return torch.stack(means, 1)


def labelled_outputs(session: Session, examples: list[Example], tokens: int,
                     desc: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [N, layers, heads, head_dim], labels [N], example index [N]) over ``examples``."""
    heads, head_dim = site.attention_heads(session.model)
    feats, labels, owner = [], [], []
    for i, ex in enumerate(tqdm(examples, desc=desc, leave=False)):
        positive, negative = ex.contrast()
        acts = head_outputs(session, ex, positive + negative, tokens)
        feats.append(acts.reshape(len(acts), session.num_layers, heads, head_dim))
        labels += [1.0] * len(positive) + [0.0] * len(negative)
        owner += [i] * len(acts)
    return torch.cat(feats), torch.tensor(labels), torch.tensor(owner)


# ----------------------------------------------------------------------------- probes


def probe_accuracy(x_fit: torch.Tensor, y_fit: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor, kind: str,
                   seed: int) -> torch.Tensor:
    """Balanced validation accuracy of one probe per head; x: [N, G, head_dim] -> [G]."""
    gen = torch.Generator().manual_seed(seed)
    mean, std = x_fit.mean(0), x_fit.std(0) + 1e-6
    # Head-major [G, N, d], made contiguous once: every step's batched products then read the
    # features as they lie (an einsum over [N, G, d] copied them into this layout at each call).
    x_fit, x_val = (((x - mean) / std).transpose(0, 1).contiguous() for x in (x_fit, x_val))
    groups, _, dim = x_fit.shape
    if kind == "linear":
        params = [torch.zeros(groups, dim), torch.zeros(groups)]
        logits = lambda x, w, b: (torch.bmm(x, w[:, :, None])[..., 0] + b[:, None]).T
    elif kind == "mlp":
        params = [torch.randn(groups, dim, MLP_WIDTH, generator=gen) / dim**0.5, torch.zeros(groups, MLP_WIDTH),
                  torch.randn(groups, MLP_WIDTH, generator=gen) / MLP_WIDTH**0.5, torch.zeros(groups)]
        logits = lambda x, w1, b1, w2, b2: (torch.bmm(torch.relu(torch.bmm(x, w1) + b1[:, None]), w2[:, :, None])[..., 0]
                                            + b2[:, None]).T
    else:
        raise ValueError(f"probe kind {kind!r}: use 'linear' or 'mlp'")
    return fit_probes(logits, params, x_fit, y_fit, x_val, y_val)


Logits = Callable[..., torch.Tensor]  # (features, *params) -> [N, G] logits, one column per probe


def fit_probes(logits: Logits, params: list[torch.Tensor], x_fit: torch.Tensor, y_fit: torch.Tensor,
               x_val: torch.Tensor, y_val: torch.Tensor) -> torch.Tensor:
    """Train ``params`` (G probes at once) with class-balanced Adam; their balanced accuracy on the validation set: [G]."""
    for p in params:
        p.requires_grad_(True)
    # Class-balanced weights: one correct continuation per question against several wrong ones.
    pos = y_fit.mean().clamp(1e-3, 1 - 1e-3)
    weight = torch.where(y_fit > 0.5, 0.5 / pos, 0.5 / (1 - pos))[:, None]
    opt = torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)
    with torch.enable_grad():
        for _ in range(PROBE_STEPS):
            opt.zero_grad()
            out = logits(x_fit, *params)
            F.binary_cross_entropy_with_logits(out, y_fit[:, None].expand_as(out), weight=weight.expand_as(out)).backward()
            opt.step()
    with torch.no_grad():
        hit = (logits(x_val, *params) > 0) == (y_val[:, None] > 0.5)
        pos_val = y_val > 0.5
        return 0.5 * (hit[pos_val].float().mean(0) + hit[~pos_val].float().mean(0))


def mass_mean(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit mass-mean direction and the std of the projections on it; x: [N, K, head_dim]."""
    theta = x[y > 0.5].mean(0) - x[y <= 0.5].mean(0)
    theta = theta / theta.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    sigma = torch.einsum("nkd,kd->nk", x, theta).std(0)
    return theta, sigma


def layer_shifts(model: torch.nn.Module, heads: torch.Tensor, vectors: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per layer, W_o of the heads' shifts: ``heads`` [K, 2] (layer, head), ``vectors`` [K, head_dim]."""
    n_heads, head_dim = site.attention_heads(model)
    shifts = {}
    for layer in sorted(set(heads[:, 0].tolist())):
        s = torch.zeros(n_heads * head_dim)
        for (l, h), v in zip(heads.tolist(), vectors):
            if l == layer:
                s[h * head_dim : (h + 1) * head_dim] = v
        weight = devices.weight_of(model, site.attention_output(model, layer))  # also when offloaded
        shifts[layer] = F.linear(s.to(weight.device, torch.float32), weight.float())  # in float32; no bias: only the shift moves
    return shifts


def _site_owner(shape: torch.Size, variant_ids: torch.Tensor | None, positions: Positions) -> torch.Tensor:
    """[B, T]: the variant of the row each token belongs to, -1 before its row's site.

    ``positions`` as the runner gives them: (rows, cols), one site per variant row (a packed
    sequence: every row starts at its site), or a [B] column per batch row (padded rows);
    ``variant_ids`` None: variant 0 at every site (``plan.ApplyEdits``)."""
    batch, length = shape[:2]
    if isinstance(positions, tuple):
        rows, cols = (t.tolist() for t in positions)
    else:
        rows, cols = list(range(batch)), positions.tolist()
    ids = [0] * len(rows) if variant_ids is None else variant_ids.tolist()
    owner = torch.full((batch, length), -1, dtype=torch.long)
    # A token belongs to the last site at or before it in its row (sites in column order).
    for j in sorted(range(len(rows)), key=lambda j: (rows[j], cols[j])):
        owner[rows[j], cols[j]:] = ids[j]
    return owner


@contextlib.contextmanager
def shift_variants(model: torch.nn.Module, tables: dict[int, torch.Tensor], variant_ids: torch.Tensor,
                   positions: Positions):
    """Variant v's rows get ``tables[layer][v]`` added to ``layer``'s attention output from their
    site on (``site.shift_attention_from_site`` for several shifts at once: one validation
    pass scores every grid cell); BASE rows are left alone. tables: layer -> [V, d] (float32)."""
    owners: dict[tuple, torch.Tensor] = {}  # per input shape: computed once, shared by the layers

    def hook_for(table: torch.Tensor):
        padded = torch.cat([torch.zeros_like(table[:1]), table])  # row 0: no shift (BASE rows, tokens before p*)

        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            key = tuple(hidden.shape[:2])
            if key not in owners:
                owners[key] = _site_owner(hidden.shape, variant_ids, positions).to(hidden.device)
            shifted = hidden + padded.to(hidden)[owners[key] + 1]
            return (shifted, *output[1:]) if isinstance(output, tuple) else shifted
        return hook

    with contextlib.ExitStack() as stack:
        for layer, table in tables.items():
            stack.enter_context(site.forward_hook(site.attention_output(model, layer), hook_for(table)))
        yield


def grid_plan(model: torch.nn.Module, cells: list[dict[int, torch.Tensor]]) -> Plan:
    """BASE and one variant per grid cell (its ``layer_shifts``), for ``common.validation_losses``."""
    layers = sorted({layer for shifts in cells for layer in shifts})
    width = next(v for shifts in cells for v in shifts.values()).shape[-1]
    tables = {layer: torch.stack([shifts[layer].float().cpu() if layer in shifts else torch.zeros(width) for shifts in cells])
              for layer in layers}
    return Plan((BASE, *range(len(cells))), lambda ids, pos: shift_variants(model, tables, ids, pos))


# ----------------------------------------------------------------------------- the method


@register_method("iti")
class ITI(ScaledVector):
    """Tensors: ``heads`` [K, 2] (layer, head), ``directions`` [K, head_dim] (unit), ``sigma`` [K];
    config: hyperparameters.alpha (times ``scale=`` at evaluation)."""

    strength_name = "alpha"

    probe = "linear"  # NL-ITI: "mlp"
    tokens = 1  # continuation tokens averaged; NL-ITI: 4
    published: Recipe = ITI_RECIPE  # the authors' recipe (``--recipe published``); NL-ITI: NL_ITI_RECIPE

    hyperparameter_fields = {
        "alpha": Float(),
        "num_heads": Int(1, optional=True), "probe": Str(optional=True, choices=("linear", "mlp")),
        "tokens": Int(1, optional=True), "head_fractions_tried": List(Float(0, 1, lo_open=True), optional=True),
        "alphas_tried": List(Float(), optional=True), "probe_steps": Int(1, optional=True),
        "validation_fraction": Float(0, 1, lo_open=True, hi_open=True, optional=True), "recipe": RECIPE_FIELD,
        # The published recipe's settings (iti_published); shift_from absent: p* on, as before recipes.
        "shift_from": Str(optional=True, choices=("last_prompt_token", "answer")),
        "head_fraction": Float(0, 1, lo_open=True, optional=True), "probe_tokens": Int(1, optional=True),
        "prompt_format": Str(optional=True), "sigma_format": Str(optional=True),
        "probe_C": Float(0, lo_open=True, optional=True), "probe_max_iter": Int(1, optional=True),
        "probe_width": Int(1, optional=True), "probe_epochs": Int(1, optional=True), "probe_lr": Float(0, lo_open=True, optional=True),
        "probe_weight_decay": Float(0, optional=True), "probe_batch_size": Int(1, optional=True),
        # What the published recipe's probe rows are (iti_activations.probe_answers); absent before issue 36 (MC1's options).
        "probe_answers": Str(optional=True, choices=("mc2", "options", "refusal")), **VALIDATION_FIELDS,
        "head_selection": Str(optional=True, choices=HEAD_SELECTIONS), "probe_folds": Int(2, optional=True), "head_score": HEAD_SCORE_FIELD,
    }
    # The record of the chosen heads (iti_heads.choice_record); other diagnostics are not checked.
    config_fields = {"diagnostics": Obj(RECORD_FIELDS, optional=True)}
    label, command_line_recipe = "ITI", "published"  # `mari-eval train`'s default recipe: the one the tables score
    training_fields = {"head_fractions": List(Float(0, 1, lo_open=True), optional=True), "alphas": List(Float(), optional=True),
                       "recipe": RECIPE_FIELD, "head_selection": Str(optional=True, choices=HEAD_SELECTIONS),
                       "head_score": HEAD_SCORE_FIELD, "validation": VALIDATION_FIELD}

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        sizes = {"hidden_size": config["base_model"]["hidden_size"]}
        if "num_heads" in config["hyperparameters"]:
            sizes["num_heads"] = config["hyperparameters"]["num_heads"]
        return sizes, {"heads": TensorSpec(("num_heads", 2), "int"), "directions": TensorSpec(("num_heads", "head_dim")),
                       "sigma": TensorSpec(("num_heads",))}

    def shifts(self, model: torch.nn.Module) -> dict[int, torch.Tensor]:
        vectors = self.strength() * self.tensors["sigma"][:, None] * self.tensors["directions"]
        return layer_shifts(model, self.tensors["heads"], vectors)

    def applied(self, model: torch.nn.Module, positions: Positions,
                variant_ids: torch.Tensor | None = None) -> contextlib.AbstractContextManager:
        # ITI's published recipe shifts the answer's tokens only (after p*); other bundles from p* on.
        at_site = self.config["hyperparameters"].get("shift_from", "last_prompt_token") == "last_prompt_token"
        return site.shift_attention_from_site(model, self.shifts(model), positions, at_site=at_site)

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """lm-eval's ``config.mari_diagnostics``: also the heads the bundle shifts, with their probes'
        validation accuracies and the ties at the K-th accuracy (``iti_heads.heads_summary``)."""
        return {**super().summarize(records), **heads_summary(self.config, self.tensors["heads"])}

    def check_compatible(self, model: torch.nn.Module, model_name: str, allow_other_model: bool = False) -> None:
        super().check_compatible(model, model_name, allow_other_model)
        n_heads, head_dim = site.attention_heads(model)
        heads = self.tensors["heads"]
        layers = int(self.config["base_model"]["num_layers"])
        if len(heads) and (int(heads.min()) < 0 or int(heads[:, 0].max()) >= layers):
            raise BundleError(f"This {self.method} bundle moves heads {heads.tolist()} (layer, head): a layer outside "
                              f"0..{layers - 1} or a negative index. The bundle is damaged; retrain it.")
        if self.tensors["directions"].shape[-1] != head_dim or int(heads[:, 1].max()) >= n_heads:
            raise BundleError(
                f"This {self.method} bundle moves heads of dimension {self.tensors['directions'].shape[-1]} "
                f"(up to head {int(heads[:, 1].max())}); '{model_name}' has {n_heads} heads of dimension {head_dim}. Retrain it."
            )

    @classmethod
    def training_source(cls) -> str:
        return f"{cls.method}'s grid"

    @classmethod
    def fit_adapted(cls, session: Session, data: AttributeData, config: dict[str, Any], hyperparameters: dict[str, Any],
                    seed: int) -> Intervention:
        if published_only := sorted({"head_selection", "head_score"} & set(hyperparameters)):  # it ranks by balanced accuracy
            raise ValueError(f"{cls.label}: the adapted recipe does not read {published_only} (the published recipe's)")
        fractions = hyperparameters.get("head_fractions") or list(HEAD_FRACTIONS)
        alphas = hyperparameters.get("alphas") or list(ALPHAS)
        source = hyperparameters.get("validation")  # None: the seeded 20% of D_train (common.VALIDATION_SOURCES)
        fit_examples, val_examples = validation_split(data, seed, source)
        session.prepare(data.train, "D_train", lower=False)
        prepare_validation(session, data, val_examples, lower=False)
        x, y, owner = labelled_outputs(session, fit_examples + val_examples, cls.tokens, f"{cls.method}: head outputs")
        n_layers, n_heads, head_dim = x.shape[1:]
        x = x.reshape(len(x), n_layers * n_heads, head_dim)
        is_fit = owner < len(fit_examples)
        in_train = is_fit if source == "ctrl" else torch.ones_like(is_fit)  # the rows of D_train
        if y[~is_fit].min() == y[~is_fit].max():
            raise ValueError(f"{cls.method}: the validation slice has one class only; use more training examples")
        accuracy = probe_accuracy(x[is_fit], y[is_fit], x[~is_fit], y[~is_fit], cls.probe, seed)
        ranked = rank_heads(accuracy, seed)
        cells: dict[tuple[int, float], dict[int, torch.Tensor]] = {}  # (K, alpha) -> the shifts, in grid order
        for fraction in fractions:
            k = max(1, round(fraction * n_layers * n_heads))
            top = ranked[:k]
            theta, sigma = mass_mean(x[is_fit][:, top], y[is_fit])
            heads = torch.stack([top // n_heads, top % n_heads], 1)
            for alpha in alphas:
                cells.setdefault((k, alpha), layer_shifts(session.model, heads, alpha * sigma[:, None] * theta))
        # Every cell, and the base model, scored in one run per validation question (their rows packed together).
        base, *losses = validation_losses(session, val_examples, grid_plan(session.model, list(cells.values())))
        scores = dict(zip(cells, losses))
        for (k, alpha), loss in scores.items():
            log.info("%s: %d heads, alpha %g: validation loss %.4f (base %.4f)", cls.method, k, alpha, loss, base)
        k, alpha = min(scores, key=scores.get)
        top = ranked[:k]
        theta, sigma = mass_mean(x[in_train][:, top], y[in_train])  # the chosen heads' directions from all of D_train
        heads = torch.stack([top // n_heads, top % n_heads], 1)
        log.info("%s: chose %d heads, alpha %g (validation loss %.4f; base model %.4f)", cls.method, k, alpha, scores[k, alpha], base)
        config = {
            **config,
            "site": {**config["site"], "layer": int(heads[:, 0].min()),
                     "position": "attention heads' outputs, last prompt token and every later token"},
            "hyperparameters": {"recipe": "adapted", "alpha": alpha, "num_heads": k, "probe": cls.probe, "tokens": cls.tokens,
                                "head_fractions_tried": fractions, "alphas_tried": alphas,
                                **validation_record(source, val_examples), "probe_steps": PROBE_STEPS},
            "diagnostics": {"validation_loss": {f"{k_}:{a}": v for (k_, a), v in scores.items()},
                            SELECTION_KEY: scores[k, alpha],
                            "validation_loss_base": base, "probe_accuracy": accuracy[top].tolist(), "heads": heads.tolist(),
                            **choice_record(accuracy, ranked, k, n_heads, y[~is_fit], "balanced_accuracy"),
                            "validation_ids": [ex.id for ex in val_examples]},
        }
        return cls(config, {"heads": heads.contiguous(), "directions": theta.contiguous(), "sigma": sigma.contiguous()})

    @classmethod
    def fit_published(cls, session: Session, data: AttributeData, config: dict[str, Any], hyperparameters: dict[str, Any],
                      seed: int) -> Intervention:
        """The authors' recipe, ``cls.published`` (``iti_published``)."""
        return fit_published(cls, session, data, config, hyperparameters, seed)


@register_method("nl_iti")
class NLITI(ITI):
    """NL-ITI: ITI with MLP probes and the multi-token (last 4 tokens) head representation."""

    label = "NL-ITI"
    probe = "mlp"
    tokens = 4
    published = NL_ITI_RECIPE
