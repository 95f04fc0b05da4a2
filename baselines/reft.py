"""ReFT: LoReFT, low-rank linear subspace representation finetuning (Wu et al., 2024).

What it computes (as in the original): at the hidden state h after layer l of the
edited positions,

    Phi(h) = h + R^T (W h + b - R h),        R in R^{r x d} with orthonormal rows,

i.e. the component of h in the r-dimensional subspace spanned by R's rows is replaced
by the learned projection W h + b. The original edits the first f and the last l prompt
tokens ("f5+l5" in its instruction-tuning runs, "f7+l7" for commonsense reasoning);
here f = l = 5, the last one being p*, at l* (``ReFT.prompt_sites``; the
runner then computes every prompt under the edit). Generated tokens are not edited
(the original intervenes on the prompt only).

Training: R, W and b by Adam on the same task losses as MARI's single expert (option
cross-entropy, eq:per_adapter_ce_mc; teacher-forced NLL of the refusal target,
eq:per_adapter_ce_gen) on 80% of D_train; the epoch kept is the one with the lowest loss
on the 20% validation slice (early stopping, as the original selects its checkpoints
on a development set). R stays orthonormal by construction: R = Q^T of the QR
decomposition of a free matrix (the original uses PyTorch's orthogonal
parametrisation).

Deviations: one layer (l*, the site MARI edits) instead of several, rank 4 and
learning rate 5e-3 (MARI's expert rank and rate) instead of the original's per-task
grid, no dropout, and W = R, b = 0 at initialisation (the edit starts as the identity;
the original initialises W at random).

Published recipe (``--recipe published``, ``baselines.reft_published``): what the authors
run for their multiple-choice-like benchmark, commonsense reasoning (stanfordnlp/pyreft,
examples/loreft/README.md, whose commands reproduce the paper's runs, and
scripts/commonsense_strict.sbatch): one LoReFT per layer at every layer ("-l all"), the same intervention at the
first 7 and the last 7 prompt tokens ("f7+l7", ``--share_weights``; each count capped at
half the prompt, as pyreft's ``get_intervention_locations``), rank 8, AdamW at 9e-4 with
no weight decay, a linear schedule with 10% warm-up, effective batch 32 (16 x 2
accumulation steps), gradients clipped to norm 1 (Hugging Face Trainer's default), 6
epochs, the last one kept, dropout 0.00 on the intervention output (the option exists and
is recorded; their GLUE runs use 0.05). W and b start as ``torch.nn.Linear``'s default
(uniform in +-1/sqrt(d), pyreft's ``learned_source``), R random orthonormal. The loss is
theirs: teacher-forced NLL of the answer tokens, averaged over the batch's tokens; here
the answer is the gold option's continuation (multiple choice) or the target
(generation). Still different: the prompts are lm-eval's (the evaluation prompts of
every method), not their "the correct answer is" template, and the answer carries no
end-of-sequence token (options are scored, not generated); the data are D_train's 80%,
a few steps where they train for thousands; the model is far smaller than their LLaMA-7B;
R is orthonormalised by QR rather than PyTorch's orthogonal parametrisation. A published
bundle records its ``layers`` and holds one R, W, b per layer (tensors [layers, r, d]),
applied at each of them through ``mari_eval.injection.site.edit_site``; bundles without ``layers``
are applied at l* alone, as before.
"""

from __future__ import annotations

import copy
import logging
import random
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from mari_eval.evaluation import runner
from mari_eval.methods.bundle_spec import Float, Int, List, Str, TensorSpec
from mari_eval.training.epochs import EpochLoop
from mari_eval.methods.intervention import Intervention
from mari_eval.training import memory
from mari_eval.training.objectives import task_losses
from mari_eval.injection.plan import Plan, Positions
from mari_eval.evaluation.prefix_cache import encode_prefix
from mari_eval.methods.registry import register_method

from .common import (IMPORTED, RECIPE_FIELD, SELECTION_KEY, VALIDATION_FIELDS, Baseline, recipe_of, shuffled_batches,
                     validation_loss, validation_split,
                     prepare_validation, validation_record)
from .loreft import edits_at_layers, first_and_last, loreft, orthonormal_rows, pyreft_positions, python_rng_state
from .reft_published import fit_published, planned_epochs as published_epochs

if TYPE_CHECKING:
    from mari_eval.training.examples import AttributeData, Example
    from mari_eval.training.session import Session

log = logging.getLogger(__name__)

DEFAULTS = {"rank": 4, "first": 5, "last": 5, "lr": 5e-3, "epochs": 3, "batch": 8}
# Settings only the published recipe reads (``baselines.reft_published``); the adapted fit refuses them.
PUBLISHED_ONLY = ("layers", "dropout", "warmup_ratio", "weight_decay", "max_grad_norm", "min_steps", "epoch_selection")


@register_method("reft")
class ReFT(Baseline):
    """Tensors: ``R`` [r, d] (orthonormal rows), ``W`` [r, d], ``b`` [r]; config: hyperparameters.first/last.
    With hyperparameters.layers (the published recipe), one of each per layer: [len(layers), r, d] and [len(layers), r]."""

    hyperparameter_fields = {
        "first": Int(0), "last": Int(0),
        "rank": Int(1, optional=True), "lr": Float(0, lo_open=True, optional=True), "epochs": Int(1, optional=True),
        "batch": Int(1, optional=True), "epoch_kept": Int(1, optional=True), "init": Str(optional=True),
        "validation_fraction": Float(0, 1, lo_open=True, hi_open=True, optional=True), "recipe": RECIPE_FIELD,
        "layers": List(Int(0), optional=True), "dropout": Float(0, 1, hi_open=True, optional=True),
        "warmup_ratio": Float(0, 1, optional=True), "weight_decay": Float(0, optional=True),
        "max_grad_norm": Float(0, lo_open=True, optional=True), "loss": Str(optional=True),
        "schedule": Str(optional=True), "positions": Str(optional=True), "min_steps": Int(1, optional=True),
        # published recipe: the epoch kept, the last (pyreft's commonsense and math runs) or the best on the
        # validation slice (pyreft's GLUE runs, load_best_model_at_end); absent: the last
        "epoch_selection": Str(optional=True, choices=("last", "best")), **VALIDATION_FIELDS,
    }

    label = "ReFT"
    command_line_recipe = "published"  # what the tables score (repro/engine/recipes.py MAIN_TABLE_RECIPE)
    training_fields = {k: v for k, v in hyperparameter_fields.items()
                       if k in DEFAULTS or k in PUBLISHED_ONLY or k in ("recipe", "validation")}
    training_defaults = DEFAULTS

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        hp = config["hyperparameters"]
        sizes = {"hidden_size": config["base_model"]["hidden_size"]}
        if "rank" in hp:
            sizes["rank"] = hp["rank"]
        if "layers" not in hp:
            return sizes, {"R": TensorSpec(("rank", "hidden_size")), "W": TensorSpec(("rank", "hidden_size")),
                           "b": TensorSpec(("rank",))}
        sizes["layers"] = len(hp["layers"])
        return sizes, {"R": TensorSpec(("layers", "rank", "hidden_size")), "W": TensorSpec(("layers", "rank", "hidden_size")),
                       "b": TensorSpec(("layers", "rank"))}

    def edit(self, hidden: torch.Tensor) -> torch.Tensor:
        if "layers" in self.config["hyperparameters"]:
            raise ValueError("this ReFT bundle edits several layers (hyperparameters.layers): use edit_at(i, hidden) "
                             "for the i-th of them, or applied() for all")
        t = self.tensors_like(hidden)
        return loreft(hidden, t["R"], t["W"], t["b"])

    def edit_at(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """The edit of the i-th layer of hyperparameters.layers (published bundles)."""
        t = self.tensors_like(hidden)
        return loreft(hidden, t["R"][i], t["W"][i], t["b"][i])

    def applied(self, model: torch.nn.Module, positions: Positions,
                variant_ids: torch.Tensor | None = None) -> AbstractContextManager:
        layers = self.config["hyperparameters"].get("layers")
        if layers is None:  # one layer, l* (every bundle of the adapted recipe)
            return super().applied(model, positions, variant_ids)

        def edit_at(i: int, h: torch.Tensor) -> torch.Tensor:
            edited = self.edit_at(i, h)
            return edited if variant_ids is None else torch.where((variant_ids.to(h.device) >= 0)[:, None], edited, h)

        return edits_at_layers(model, layers, edit_at, positions)

    def plan(self, model: torch.nn.Module) -> Plan:
        """One edit, at p* and at the prompt positions before it (``prompt_sites``): the runner
        computes each prompt under the edit instead of sharing the frozen prefix."""
        return Plan((0,), lambda variant_ids, positions: self.applied(model, positions, variant_ids), self.choose,
                    prompt_sites=self.prompt_sites)

    def prompt_sites(self, length: int) -> list[int]:
        """The first ``first`` and last ``last`` positions of a prompt of ``length`` tokens, p* excluded."""
        hp = self.config["hyperparameters"]
        # pyreft's rule for its authors' recipe and for a pyreft save brought in (IMPORTED)
        positions = pyreft_positions if recipe_of(hp) in ("published", IMPORTED) else first_and_last
        return positions(length, int(hp["first"]), int(hp["last"]))

    @classmethod
    def fit_adapted(cls, session: Session, data: AttributeData, config: dict[str, Any], hyperparameters: dict[str, Any],
                    seed: int) -> Intervention:
        hp = hyperparameters
        published_only = sorted(k for k in PUBLISHED_ONLY if k in hp)
        if published_only:
            raise ValueError(f"ReFT's adapted recipe does not read {published_only} (settings of the published recipe): "
                             "drop them or add --recipe published")
        gen = torch.Generator().manual_seed(seed)
        d = session.hidden_size
        free = torch.randn(hp["rank"], d, generator=gen).to(session.site_device)  # float32, as trained parameters stay
        R0 = orthonormal_rows(free)
        params = {"free": free, "W": R0.clone(), "b": torch.zeros(hp["rank"], device=session.site_device)}
        for p in params.values():
            p.requires_grad_(True)
        fit_examples, val_examples = validation_split(data, seed, hp.get("validation"))
        session.prepare(data.train, "D_train")
        prepare_validation(session, data, val_examples)
        loop = EpochLoop("reft", "ReFT", hp["epochs"], params, torch.optim.Adam(params.values(), lr=hp["lr"]),
                         session.checkpoints)
        base = validation_loss(session, val_examples)
        best = [float("inf"), -1, None]  # validation loss, epoch, parameters of the best epoch so far
        order = random.Random(f"reft:{seed}")

        def batches(epoch: int) -> list[list[Example]]:
            return shuffled_batches(fit_examples, hp["batch"], order)

        def loss(batch: list[Example]) -> tuple[torch.Tensor, dict[str, float]]:
            passes = memory.edited_prompt_passes(memory.example_shapes(batch), session.max_tokens)
            session.record_step(memory.step_estimate(session.model, session.layer, passes))
            value = torch.stack([task_loss(session, ex, hp, params) for ex in batch]).mean()
            return value, {"loss": value.item()}

        def end_epoch(epoch: int, parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
            losses = [logged["loss"] for _, logged in parts]
            with torch.no_grad():
                val = sum(float(task_loss(session, ex, hp, params)) for ex in val_examples) / len(val_examples)
            record = {"train_loss": sum(losses) / len(losses), "validation_loss": val}
            log.info("ReFT epoch %d: train loss %.4f, validation loss %.4f (base %.4f)", epoch + 1, record["train_loss"], val, base)
            if val < best[0]:
                best[:] = [val, epoch + 1, {k: v.detach().clone() for k, v in params.items()}]
            return record

        def restored(state: dict[str, Any], kept: dict[str, torch.Tensor]) -> None:  # a killed run resumes after its last finished epoch (mari_eval.storage.checkpoint)
            order.setstate(python_rng_state(state["order"]))
            best[:] = [state["best_validation"], state["best_epoch"], {k: kept[k] for k in params}]

        history = loop.run(batches, loss, end_epoch, restored=restored, extra=lambda: best[2],
                           state=lambda: {"order": order.getstate(), "best_validation": best[0], "best_epoch": best[1]})
        _, best_epoch, kept = best
        tensors = {"R": orthonormal_rows(kept["free"]).contiguous(), "W": kept["W"].contiguous(), "b": kept["b"].contiguous()}
        config = copy.deepcopy(config)
        config["site"]["position"] = f"first {hp['first']} and last {hp['last']} prompt tokens (the last is p*)"
        config["hyperparameters"] = {**hp, "recipe": "adapted", "epoch_kept": best_epoch,
                                     **validation_record(hp.get("validation"), val_examples),
                                     "init": "R random orthonormal, W = R, b = 0"}
        config["diagnostics"] = {"history": history, SELECTION_KEY: best[0], "validation_loss_base": base,
                                 "validation_ids": [ex.id for ex in val_examples]}
        return cls(config, tensors)

    @classmethod
    def planned_epochs(cls, hyperparameters: dict[str, Any], n_train: int) -> int | None:
        if recipe_of(hyperparameters) == "published":  # its epochs follow from its least step count
            return published_epochs(n_train, hyperparameters)
        return super().planned_epochs(hyperparameters, n_train)

    @classmethod
    def published_given(cls, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        return hyperparameters  # the published recipe's own defaults complete what was given

    @classmethod
    def fit_published(cls, session: Session, data: AttributeData, config: dict[str, Any], hyperparameters: dict[str, Any],
                      seed: int) -> Intervention:
        """The authors' recipe (module docstring, ``baselines.reft_published``)."""
        return fit_published(cls, session, data, config, hyperparameters, seed)


def task_loss(session: Session, ex: Example, hp: dict[str, Any], params: dict[str, torch.Tensor]) -> torch.Tensor:
    """MARI's single-expert task loss of ``ex`` with LoReFT at the first/last prompt tokens of l*."""
    R = orthonormal_rows(params["free"])
    plan = Plan.at_site(session.model, session.layer, lambda h, ids: loreft(h, R.to(h), params["W"].to(h), params["b"].to(h)), [0])
    sites = first_and_last(len(ex.context), hp["first"], hp["last"])
    prefix = encode_prefix(session.model, ex.context[:-1], apply=plan.apply, sites=sites)
    run = runner.score_variants(session.model, prefix, ex.context[-1], ex.options, plan,
                                max_tokens=session.max_tokens, lower=(session.layer, ex.lower))
    return task_losses(run.logprobs, ex.gold)[0]
