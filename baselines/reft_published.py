"""ReFT's published recipe: LoReFT trained as its authors train it for commonsense reasoning.

The settings, their sources and what still differs are in ``baselines.reft``'s docstring
("Published recipe"). In short: one intervention per layer at every layer, shared by the
first 7 and last 7 prompt tokens, rank 8, W and b at ``torch.nn.Linear``'s default
initialisation, AdamW at 9e-4 with a linear schedule after 10% warm-up, effective batch
32, gradients clipped to norm 1, the last epoch kept, and the language-modelling loss of
the answer: the teacher-forced NLL of the gold option's (or the target's) tokens, averaged
over the tokens of the batch. ``--set epoch_selection=best`` keeps instead the epoch of the
lowest validation loss, as pyreft's authors select on held-out data for GLUE (their
``train.py``: ``load_best_model_at_end``; for commonsense and math they keep the last epoch and
tune the length on a dev split), recorded as ``epoch_kept``.

How many optimizer steps (issue 36): pyreft's commonsense command trains 6 epochs of ~170k
examples at batch 32, some 32,000 steps. On 20-80 fit examples 6 epochs are 6 steps (the
first at learning rate 0 under Hugging Face's schedule), which leave W at its random start.
What carries over is the number of steps, so:

    steps per epoch = ceil(n_fit / batch)      (a batch holds at most the n_fit examples)
    epochs          = max(6, ceil(MIN_STEPS / steps per epoch)),   MIN_STEPS = 100

MIN_STEPS is pyreft's own recipe for very little data, the README's "a few demonstrations"
example (stanfordnlp/pyreft README.md, steps 3-4): 10 examples, batch 10, 100 epochs, i.e.
100 optimizer steps. On their commonsense data the rule changes nothing; here it gives 100
epochs of one step at 20 fit examples, 34 epochs of 3 steps at 80 (TruthfulQA's whole D_train).
``--set min_steps=N`` replaces MIN_STEPS: the standard profile's 20 and the quick profile's 10
(repro/engine/profiles.py ``STANDARD_REFT_STEPS``, ``QUICK_REFT_STEPS``, for their budgets on 2 CPU cores), recorded in the bundle. Learning rate, schedule shape, batch and clipping stay the commonsense ones;
the warm-up ramp starts a step earlier than Hugging Face's (``warmup_linear``) so that the
first step learns. The fit records the steps, every epoch's validation loss and how far the
edit moved from its start (``diagnostics.distance_from_init``). R is orthonormalised with its
signs kept continuous (``continuous_rows``).

The model is run through the same path as evaluation (``prefix_cache.encode_prefix`` with
the prompt's sites edited, then ``runner.score_variants`` over the answer), so what is
trained is what lm-eval scores. The selection number (``common.SELECTION_KEY``) is the
option task loss of the kept bundle on the validation slice, computed by the bundle itself.
"""

from __future__ import annotations

import copy
import logging
import math
import random
from typing import TYPE_CHECKING, Any

import torch

from mari_eval.evaluation import row_passes, runner
from mari_eval.methods.bundle_spec import check_hyperparameters
from mari_eval.training.epochs import EpochLoop
from mari_eval.training.objectives import task_losses
from mari_eval.injection.plan import Plan
from mari_eval.evaluation.prefix_cache import encode_prefix

from .common import (SELECTION_KEY, held_out_count, prepare_validation, selects_on_ctrl, shuffled_batches,
                     validation_loss, validation_record, validation_split)
from .loreft import (continuous_rows, distance_from_init, dropped, edits_at_layers, initial_parameters, loreft,
                     pyreft_positions, python_rng_state)
from .reft_step import batch_gradient, shared_length, step_estimate

if TYPE_CHECKING:
    from mari_eval.training.examples import AttributeData, Example
    from mari_eval.methods.intervention import Intervention
    from mari_eval.training.session import Session

log = logging.getLogger(__name__)

# stanfordnlp/pyreft examples/loreft/README.md, "Commonsense reasoning tasks": -l all -r 8 -p f7+l7
# -e 6 -lr 9e-4, batch 16 x 2 accumulation steps, --dropout 0.00, --share_weights, --warmup_ratio 0.1;
# train.py's defaults: linear schedule, weight decay 0, adamw_torch; Trainer's max_grad_norm 1.0.
# "layers" is absent: every layer of the model (their "-l all").
# "epochs" is the least number of epochs: ``step_plan`` adds epochs up to MIN_STEPS optimizer steps.
PUBLISHED = {"rank": 8, "first": 7, "last": 7, "lr": 9e-4, "epochs": 6, "batch": 32, "dropout": 0.0,
             "warmup_ratio": 0.1, "weight_decay": 0.0, "max_grad_norm": 1.0}
# stanfordnlp/pyreft README.md, "Step 3: a few demonstrations" and "Step 4": 10 training examples,
# per_device_train_batch_size=10, num_train_epochs=100.0, i.e. 100 optimizer steps (module docstring).
MIN_STEPS = 100


def published_hyperparameters(cls: type[Intervention], given: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``given`` (``mari-eval train`` flags and ``--set``) over the published settings, checked."""
    hp = {**PUBLISHED, "layers": list(range(num_layers)),
          **{k: v for k, v in given.items() if v is not None}, "recipe": "published"}
    unknown = sorted(set(hp) - set(cls.training_fields))
    if unknown:
        raise ValueError(f"unknown ReFT hyperparameters {unknown}; known: {', '.join(sorted(cls.training_fields))} "
                         "(`mari-eval train --set KEY=VALUE`)")
    check_hyperparameters(cls, hp, "ReFT hyperparameters (published recipe)", cls.training_fields)
    bad = [layer for layer in hp["layers"] if layer >= num_layers]
    if not hp["layers"] or bad or len(set(hp["layers"])) != len(hp["layers"]):
        raise ValueError(f"--set layers={hp['layers']}: give distinct layers in 0..{num_layers - 1} (the model has "
                         f"{num_layers}), e.g. --set layers=[3,9,18,24]")
    return hp


def step_plan(n_fit: int, batch: int, min_epochs: int, min_steps: int | None = None) -> tuple[int, int, int]:
    """(optimizer steps per epoch, epochs, total steps) for ``n_fit`` examples in batches of ``batch``:
    at least ``min_epochs`` epochs and at least ``min_steps`` (default MIN_STEPS) steps (module docstring)."""
    min_steps = MIN_STEPS if min_steps is None else min_steps
    if n_fit < 1 or batch < 1 or min_epochs < 1 or min_steps < 1:
        raise ValueError(f"step_plan({n_fit}, {batch}, {min_epochs}, {min_steps}): every count must be at least 1 "
                         "(an empty fit split: give ReFT more D_train examples, --max-train)")
    per_epoch = math.ceil(n_fit / batch)
    epochs = max(min_epochs, math.ceil(min_steps / per_epoch))
    return per_epoch, epochs, per_epoch * epochs


def warmup_steps(total: int, warmup_ratio: float) -> int:
    return math.ceil(total * warmup_ratio)  # Hugging Face's TrainingArguments.get_warmup_steps


def warmup_linear(step: int, total: int, warmup_ratio: float) -> float:
    """The learning-rate factor of optimizer step ``step`` (0-based) of ``total``: Hugging Face's
    linear schedule (get_linear_schedule_with_warmup) with w = ``warmup_steps`` warm-up steps, the
    decay after step w as theirs, the ramp counted from one step before the first, (step + 1) / (w + 1),
    where theirs is step / w: it still reaches the peak at step w, but the first step runs at
    lr / (w + 1), not at 0 as under their Trainer (issue 36: with few steps that step was lost)."""
    warmup = warmup_steps(total, warmup_ratio)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return max(0.0, (total - step) / max(1, total - warmup))


def planned_epochs(n_train: int, given: dict[str, Any]) -> int:
    """The epochs ``fit_published`` will train on ``n_train`` D_train examples under the settings ``given``
    (``--set``): ``step_plan``'s, on the examples it fits (all of D_train under validation=ctrl, else
    all but the validation slice). For a plan's cost, before any data is read."""
    hp = {**PUBLISHED, **{k: v for k, v in given.items() if v is not None}}
    n_fit = n_train if selects_on_ctrl(hp.get("validation")) else n_train - held_out_count(n_train)
    return step_plan(max(1, n_fit), hp["batch"], hp["epochs"], hp.get("min_steps"))[1]


def fit_published(cls: type[Intervention], session: Session, data: AttributeData, config: dict[str, Any],
                  given: dict[str, Any], seed: int, min_steps: int | None = None) -> Intervention:
    hp = published_hyperparameters(cls, given, session.num_layers)
    # The least number of steps: --set min_steps=N (a profile's budget: the quick and standard ones'), else MIN_STEPS.
    min_steps = hp.pop("min_steps", None) or (MIN_STEPS if min_steps is None else min_steps)
    layers, rank, d = hp["layers"], hp["rank"], session.hidden_size
    gen = torch.Generator().manual_seed(seed)
    initial = initial_parameters(gen, len(layers), rank, d)
    params = {k: v.clone().to(session.site_device).requires_grad_(True) for k, v in initial.items()}
    fit_examples, val_examples = validation_split(data, seed, hp.get("validation"))
    steps_per_epoch, epochs, total_steps = step_plan(len(fit_examples), hp["batch"], hp["epochs"], min_steps)
    hp = {**hp, "epochs": epochs, "min_epochs": hp["epochs"], "min_steps": min_steps,
          "steps_per_epoch": steps_per_epoch, "steps": total_steps,
          "warmup_steps": warmup_steps(total_steps, hp["warmup_ratio"])}
    session.prepare(data.train, "D_train", lower=False)  # the edited layers start below l*: no lower states
    prepare_validation(session, data, val_examples, lower=False)
    base = validation_loss(session, val_examples)
    optimizer = torch.optim.AdamW(params.values(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    loop = EpochLoop("reft_published", "ReFT (published)", epochs, params, optimizer, session.checkpoints,
                     generator=gen)
    order = random.Random(f"reft-published:{seed}")
    step = [0]
    keep_best = hp.get("epoch_selection") == "best"
    best: list = [math.inf, 0, None]  # validation loss, epoch (from 1), its parameters (epoch_selection=best)
    config = copy.deepcopy(config)
    config["site"]["position"] = (f"first {hp['first']} and last {hp['last']} prompt tokens (the last is p*), "
                                  f"at layers {_layer_span(layers)}")
    config["hyperparameters"] = {**hp, "epoch_kept": epochs, **validation_record(hp.get("validation"), val_examples),
                                 "init": "R random orthonormal, W and b torch.nn.Linear's default",
                                 "loss": "teacher-forced NLL of the answer tokens (token mean over the batch)",
                                 "schedule": "linear, warm-up from lr/(w+1) then decay to 0",
                                 "positions": f"f{hp['first']}+l{hp['last']}",
                                 "step_rule": f"epochs = max({hp['min_epochs']}, ceil({min_steps} / steps per epoch))"}

    def batches(epoch: int) -> list[list[Example]]:
        step[0] = epoch * steps_per_epoch  # also right after a resume
        return shuffled_batches(fit_examples, hp["batch"], order)

    shared = shared_length(fit_examples, hp["first"], hp["last"]) if hp["dropout"] == 0 else 0
    # Several prompts per pass where every layer sees the whole prompt; with dropout, one at a time, so
    # that the masks are drawn in the same order as ever.
    packed = hp["dropout"] == 0 and row_passes.packable(session.model, 10**9, 1)

    def loss(batch: list[Example]) -> tuple[torch.Tensor, dict[str, float]]:
        # The batch's token-mean NLL, as Hugging Face's causal-LM loss (``batch_gradient``);
        # the returned value carries the batch's gradient, clipped to max_grad_norm, for
        # EpochLoop's backward and step.
        R = continuous_rows(params["free"])

        def edit_at(i: int, h: torch.Tensor) -> torch.Tensor:
            return dropped(loreft(h, R[i].to(h), params["W"][i].to(h), params["b"][i].to(h)), hp["dropout"], gen)

        plan = Plan((0,), lambda variant_ids, positions: edits_at_layers(session.model, layers, edit_at, positions))
        sites = lambda length: pyreft_positions(length, hp["first"], hp["last"])
        session.record_step(step_estimate(session, batch, sites, shared, packed, layers, rank))
        total, grads = batch_gradient(session, batch, plan, sites, params, shared, packed)
        norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads.values()))
        scale = min(1.0, hp["max_grad_norm"] / (float(norm) + 1e-6))
        lr = hp["lr"] * warmup_linear(step[0], total_steps, hp["warmup_ratio"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        step[0] += 1
        surrogate = sum((p * (g * scale)).sum() for p, g in zip(params.values(), grads.values()))
        value = surrogate - surrogate.detach() + total  # value: the loss; gradient: the clipped batch gradient
        return value, {"loss": total, "grad_norm": float(norm), "lr": lr}

    def bundle() -> Intervention:
        with torch.no_grad():
            tensors = {"R": continuous_rows(params["free"]).detach().cpu().contiguous(),
                       "W": params["W"].detach().cpu().contiguous(), "b": params["b"].detach().cpu().contiguous()}
        return cls(config, tensors)

    def end_epoch(epoch: int, parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
        n = sum(size for size, _ in parts)
        record = {"train_loss": sum(logged["loss"] * size for size, logged in parts) / n,
                  "grad_norm": max(logged["grad_norm"] for _, logged in parts), "lr_last": parts[-1][1]["lr"],
                  "validation_loss": evaluation_loss(session, bundle(), val_examples)}
        if keep_best and record["validation_loss"] < best[0]:
            best[:] = [record["validation_loss"], epoch + 1, {k: v.detach().cpu().clone() for k, v in params.items()}]
        log.info("ReFT (published) epoch %d/%d: train loss (token-mean answer NLL, before each step) %.4f, validation "
                 "loss %.4f (vanilla %.4f)", epoch + 1, epochs, record["train_loss"], record["validation_loss"], base)
        return record

    def restored(state: dict[str, Any], kept: dict[str, torch.Tensor]) -> None:
        order.setstate(python_rng_state(state["order"]))
        if keep_best:
            best[:] = [state["best_validation"], state["best_epoch"], {k: kept[k] for k in params}]

    def state() -> dict[str, Any]:
        return {"order": order.getstate(), **({"best_validation": best[0], "best_epoch": best[1]} if keep_best else {})}

    initial_loss = evaluation_loss(session, bundle(), val_examples)  # before loop.run restores a checkpoint
    history = loop.run(batches, loss, end_epoch, restored=restored, state=state, extra=lambda: best[2])
    if keep_best:  # the epoch of the lowest validation loss, as pyreft's GLUE runs keep it
        with torch.no_grad():
            for k, v in best[2].items():
                params[k].copy_(v)
        config["hyperparameters"]["epoch_kept"] = best[1]
    fitted = bundle()
    with torch.no_grad():
        start = {"R": continuous_rows(initial["free"]), "W": initial["W"], "b": initial["b"]}
    kept_loss = history[config["hyperparameters"]["epoch_kept"] - 1]["validation_loss"]
    fitted.config["diagnostics"] = {"history": history, SELECTION_KEY: kept_loss,
                                    "validation_loss_base": base, "validation_loss_init": initial_loss,
                                    "validation_ids": [ex.id for ex in val_examples],
                                    "distance_from_init": distance_from_init(start, fitted.tensors)}
    return fitted


@torch.no_grad()
def evaluation_loss(session: Session, bundle: Intervention, examples: list[Example]) -> float:
    """Mean task loss (option cross-entropy, or target NLL) of ``examples`` under ``bundle`` as lm-eval
    applies it (``MariLM``: the prompt computed under its edits, then the options scored). The
    prompts' common head (``shared_length``) is computed once under the edit and extended for each
    prompt (``encode_prefix``'s ``base``, as lm-eval's prefix cache does): the same numbers."""
    from transformers.cache_utils import DynamicLayer  # deferred: transformers is heavy; only this path needs it

    plan, hp = bundle.plan(session.model), bundle.config["hyperparameters"]
    shared, head = shared_length(examples, int(hp["first"]), int(hp["last"])), None
    if shared:
        sites = [p for p in plan.prompt_sites(len(examples[0].context)) if p < shared]
        head = encode_prefix(session.model, examples[0].context[:shared], apply=plan.apply, sites=sites)
        if not all(type(layer) is DynamicLayer for layer in head.cache.layers):
            head = None  # sliding-window layers: each prompt runs whole
    losses = []
    for ex in examples:
        prefix = encode_prefix(session.model, ex.context[:-1], base=head, apply=plan.apply,
                               sites=plan.prompt_sites(len(ex.context)))
        run = runner.score_variants(session.model, prefix, ex.context[-1], ex.options, plan,
                                    max_tokens=session.max_tokens)
        losses.append(float(task_losses(run.logprobs, ex.gold)[0]))
    return sum(losses) / len(losses)


def _layer_span(layers: list[int]) -> str:
    return f"{layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2 \
        else ", ".join(map(str, layers))

