"""ReFT: LoReFT, low-rank linear subspace representation finetuning (Wu et al., 2024).

What it computes (as in the original): at the hidden state h after layer l of the
edited positions,

    Phi(h) = h + R^T (W h + b - R h),        R in R^{r x d} with orthonormal rows,

i.e. the component of h in the r-dimensional subspace spanned by R's rows is replaced
by the learned projection W h + b. The original edits the first f and the last l prompt
tokens ("f5+l5" in its instruction-tuning runs, "f7+l7" for commonsense reasoning);
here f = l = 5, the last one being p*, at l* (``Intervention.prompt_sites``; the
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
"""

from __future__ import annotations

import copy
import logging
import random
from typing import TYPE_CHECKING, Any

import torch

from .common import RECIPE_FIELD, SELECTION_KEY, VALIDATION_FRACTION, recipe_of, validation_loss, validation_split
from mari_eval import runner
from mari_eval.plan import Plan
from mari_eval.prefix_cache import encode_prefix
from mari_eval.epochs import EpochLoop
from mari_eval.bundle_spec import Float, Int, Str, TensorSpec
from mari_eval.methods import Intervention, register_method

if TYPE_CHECKING:
    from mari_eval.train import AttributeData, Example, Session

log = logging.getLogger(__name__)

DEFAULTS = {"rank": 4, "first": 5, "last": 5, "lr": 5e-3, "epochs": 3, "batch": 8}


def loreft(h: torch.Tensor, R: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Phi(h) = h + R^T (W h + b - R h), row-wise on [N, d]."""
    return h + (h @ W.T + b - h @ R.T) @ R


def orthonormal_rows(free: torch.Tensor) -> torch.Tensor:
    """R with orthonormal rows spanning the row space of ``free`` ([r, d], r <= d)."""
    return torch.linalg.qr(free.T).Q.T


def first_and_last(length: int, first: int, last: int) -> list[int]:
    """The first ``first`` and last ``last`` positions of a prompt of ``length`` tokens, p* excluded."""
    p_star = length - 1
    return sorted(({*range(min(first, p_star))} | {*range(max(0, length - last), p_star)}))


@register_method("reft")
class ReFT(Intervention):
    """Tensors: ``R`` [r, d] (orthonormal rows), ``W`` [r, d], ``b`` [r]; config: hyperparameters.first/last."""

    hyperparameter_fields = {
        "first": Int(0), "last": Int(0),
        "rank": Int(1, optional=True), "lr": Float(0, lo_open=True, optional=True), "epochs": Int(1, optional=True),
        "batch": Int(1, optional=True), "epoch_kept": Int(1, optional=True), "init": Str(optional=True),
        "validation_fraction": Float(0, 1, lo_open=True, hi_open=True, optional=True), "recipe": RECIPE_FIELD,
    }

    label = "ReFT"
    training_fields = {k: v for k, v in hyperparameter_fields.items() if k in DEFAULTS or k == "recipe"}
    training_defaults = DEFAULTS

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        sizes = {"hidden_size": config["base_model"]["hidden_size"]}
        if "rank" in config["hyperparameters"]:
            sizes["rank"] = config["hyperparameters"]["rank"]
        return sizes, {"R": TensorSpec(("rank", "hidden_size")), "W": TensorSpec(("rank", "hidden_size")),
                       "b": TensorSpec(("rank",))}

    def edit(self, hidden: torch.Tensor) -> torch.Tensor:
        t = self.tensors_like(hidden)
        return loreft(hidden, t["R"], t["W"], t["b"])

    def prompt_sites(self, length: int) -> list[int]:
        hp = self.config["hyperparameters"]
        return first_and_last(length, int(hp["first"]), int(hp["last"]))

    @classmethod
    def fit(cls, session: Session, data: AttributeData, config: dict[str, Any], hyperparameters: dict[str, Any],
            seed: int) -> Intervention:
        hp = cls.training_hyperparameters(hyperparameters)
        if recipe_of(hp) == "published":
            return cls.fit_published(session, data, config, hp, seed)
        gen = torch.Generator().manual_seed(seed)
        d = session.hidden_size
        free = torch.randn(hp["rank"], d, generator=gen).to(session.site_device)  # float32, as trained parameters stay
        R0 = orthonormal_rows(free)
        params = {"free": free, "W": R0.clone(), "b": torch.zeros(hp["rank"], device=session.site_device)}
        for p in params.values():
            p.requires_grad_(True)
        fit_examples, val_examples = validation_split(data.train, seed)
        session.prepare(data.train, "D_train")
        loop = EpochLoop("reft", "ReFT", hp["epochs"], params, torch.optim.Adam(params.values(), lr=hp["lr"]),
                         session.checkpoints)
        base = validation_loss(session, val_examples)
        best = [float("inf"), -1, None]  # validation loss, epoch, parameters of the best epoch so far
        order = random.Random(f"reft:{seed}")

        def batches(epoch: int) -> list[list[Example]]:
            batch_order = list(fit_examples)
            order.shuffle(batch_order)
            return [batch_order[i : i + hp["batch"]] for i in range(0, len(batch_order), hp["batch"])]

        def loss(batch: list[Example]) -> tuple[torch.Tensor, dict[str, float]]:
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

        def restored(state: dict[str, Any], kept: dict[str, torch.Tensor]) -> None:  # a killed run resumes after its last finished epoch (mari_eval.checkpoint)
            order.setstate(_python_rng_state(state["order"]))
            best[:] = [state["best_validation"], state["best_epoch"], {k: kept[k] for k in params}]

        history = loop.run(batches, loss, end_epoch, restored=restored, extra=lambda: best[2],
                           state=lambda: {"order": order.getstate(), "best_validation": best[0], "best_epoch": best[1]})
        _, best_epoch, kept = best
        tensors = {"R": orthonormal_rows(kept["free"]).contiguous(), "W": kept["W"].contiguous(), "b": kept["b"].contiguous()}
        config = copy.deepcopy(config)
        config["site"]["position"] = f"first {hp['first']} and last {hp['last']} prompt tokens (the last is p*)"
        config["hyperparameters"] = {**hp, "recipe": "adapted", "epoch_kept": best_epoch, "validation_fraction": VALIDATION_FRACTION,
                                     "init": "R random orthonormal, W = R, b = 0"}
        config["diagnostics"] = {"history": history, SELECTION_KEY: best[0], "validation_loss_base": base,
                                 "validation_ids": [ex.id for ex in val_examples]}
        return cls(config, tensors)


def _python_rng_state(saved: list) -> tuple:
    """random.Random.getstate() after a JSON round trip (lists back to tuples)."""
    version, internal, gauss_next = saved
    return version, tuple(internal), gauss_next


def task_loss(session: Session, ex: Example, hp: dict[str, Any], params: dict[str, torch.Tensor]) -> torch.Tensor:
    """MARI's single-expert task loss of ``ex`` with LoReFT at the first/last prompt tokens of l*."""
    from mari_eval.objectives import task_losses

    R = orthonormal_rows(params["free"])
    plan = Plan.at_site(session.model, session.layer, lambda h, ids: loreft(h, R.to(h), params["W"].to(h), params["b"].to(h)), [0])
    sites = first_and_last(len(ex.context), hp["first"], hp["last"])
    prefix = encode_prefix(session.model, ex.context[:-1], apply=plan.apply, sites=sites)
    run = runner.score_variants(session.model, prefix, ex.context[-1], ex.options, plan,
                                max_tokens=session.max_tokens, lower=(session.layer, ex.lower))
    return task_losses(run.logprobs, ex.gold)[0]
