"""LoRA: low-rank adaptation (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language
Models"), the finetuning baseline AxBench (Wu et al., 2025) found to beat most steering methods.

What it computes: every target Linear W of every decoder layer gains a low-rank update,
W x + (alpha / r) B A x, with A in R^{r x in}, B in R^{out x r} trained and the model frozen.
It edits every position from the first layer on: the prompt (``LoRA.prompt_sites``: every
position before p*, so the runner encodes each prompt under the adapter), p*, the scored options
and every generated token. Applied by forward hooks on the frozen model's modules
(``baselines.lora_hooks``), never by replacing or wrapping them; the same hooks train it.

Settings (``DEFAULTS``) and their sources:

* targets ``q_proj`` and ``v_proj`` of every layer: peft's default target modules for Llama
  (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``), the choice of the LoRA paper (Sec. 7.1:
  adapting W_q and W_v);
* rank r = 8, alpha = 8 (scaling alpha / r = 1), no dropout: peft's ``LoraConfig`` defaults
  (``r=8, lora_alpha=8, lora_dropout=0.0``);
* initialisation: A uniform in +-1/sqrt(in) (peft's ``kaiming_uniform_(a=sqrt(5))``), B = 0, so
  training starts from the untouched model;
* AdamW at 9e-4 without weight decay: AxBench's LoRA baseline (axbench/sweep/wuzhengx/2b/l20/lora.yaml:
  ``lr 0.0009, weight_decay 0.00``; it trains rank 4, alpha 32, on ``o_proj`` of 4 layers, 24 epochs of
  144 examples per concept);
* 10 epochs of batches of 8 (ReFT's adapted batch), the epoch kept the one with the lowest task loss on the
  20% validation slice of D_train (early stopping, as ReFT's adapted recipe): the validation loss of every
  epoch and of the untouched model are recorded in bundle.json's diagnostics. Why 10: with 5, on the
  standard profile's 24 TruthfulQA examples (SmolLM2-135M, seed 0), the validation loss was still
  falling at the last epoch (untouched 4.97; epochs 1-5: 4.70, 4.23, 3.59, 2.95, 2.54), 30 s an epoch
  on 2 CPU cores.

The loss is the other trained baselines' (ReFT's, MARI's single expert): the option cross-entropy
(eq:per_adapter_ce_mc) for TruthfulQA and BBQ, the teacher-forced NLL of the refusal target
(eq:per_adapter_ce_gen) for SORRY-Bench (``objectives.task_losses``), on 80% of D_train. One recipe
(this suite's); ``--recipe`` is refused.

peft is the reference, not the runtime: the bundle holds A and B per target ([layers, r, in] and
[layers, out, r], float32) in weights.safetensors, read back with safetensors and JSON only, and
tests/test_lora.py checks the hooks' log-likelihoods against peft's ``PeftModel`` with the same A
and B. ``baselines.lora_peft`` converts both ways: ``mari-eval export-lora`` writes a bundle as a peft
adapter directory and ``mari-eval import-lora`` makes a bundle of a peft LoRA adapter.
"""

from __future__ import annotations

import copy
import logging
import math
import random
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from mari_eval.evaluation import runner
from mari_eval.methods.bundle_spec import BundleError, Float, Int, List, Str, TensorSpec
from mari_eval.training.epochs import EpochLoop
from mari_eval.methods.intervention import Intervention
from mari_eval.training import memory
from mari_eval.training.objectives import task_losses
from mari_eval.injection import site
from mari_eval.injection.plan import Plan, Positions
from mari_eval.evaluation.prefix_cache import encode_prefix
from mari_eval.methods.registry import register_method

from .common import (RECIPE_FIELD, SELECTION_KEY, VALIDATION_FIELD, VALIDATION_FIELDS, Baseline, shuffled_batches, validation_loss,
                     validation_record, validation_split)
from .lora_hooks import Weights, lora_applied, target_modules
from .loreft import python_rng_state

if TYPE_CHECKING:
    from mari_eval.training.examples import AttributeData, Example
    from mari_eval.training.session import Session

log = logging.getLogger(__name__)

# Targets that read the same tensor (a decoder layer's normed input to attention, or to the MLP).
SAME_INPUT = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "gate_proj": "mlp", "up_proj": "mlp"}
DEFAULTS = {"rank": 8, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "lr": 9e-4, "epochs": 10, "batch": 8}


def every_position_before(length: int) -> list[int]:
    """A prompt of ``length`` tokens: every position before p* (LoRA edits all of them)."""
    return list(range(length - 1))


@register_method("lora")
class LoRA(Baseline):
    """Tensors ``<target>.A`` [layers, rank, in] and ``<target>.B`` [layers, out, rank] per target;
    config: hyperparameters.rank, alpha, targets, layers."""

    hyperparameter_fields = {
        "rank": Int(1), "alpha": Float(0, lo_open=True), "targets": List(Str()), "layers": List(Int(0)),
        "lr": Float(0, lo_open=True, optional=True), "epochs": Int(1, optional=True), "batch": Int(1, optional=True),
        "weight_decay": Float(0, optional=True), "dropout": Float(0, 1, hi_open=True, optional=True),
        "epoch_kept": Int(1, optional=True), "init": Str(optional=True), "recipe": RECIPE_FIELD,
        "validation_fraction": Float(0, 1, lo_open=True, hi_open=True, optional=True), **VALIDATION_FIELDS,
    }
    label = "LoRA"
    training_fields = {**{k: v for k, v in hyperparameter_fields.items() if k in DEFAULTS},
                       "layers": List(Int(0), optional=True), "validation": VALIDATION_FIELD}
    training_defaults = DEFAULTS

    @classmethod
    def tensor_spec(cls, config: dict[str, Any], names: set[str]) -> tuple[dict[str, int], dict[str, TensorSpec]]:
        hp = config["hyperparameters"]
        sizes = {"layers": len(hp["layers"]), "rank": hp["rank"]}
        specs = {}
        for target in hp["targets"]:
            specs[f"{target}.A"] = TensorSpec(("layers", "rank", f"{target}.in"))
            specs[f"{target}.B"] = TensorSpec(("layers", f"{target}.out", "rank"))
        return sizes, specs

    @property
    def scaling(self) -> float:
        hp = self.config["hyperparameters"]
        return float(hp["alpha"]) / int(hp["rank"])

    def applied(self, model: torch.nn.Module, positions: Positions,
                variant_ids: torch.Tensor | None = None) -> AbstractContextManager:
        hp = self.config["hyperparameters"]
        return lora_applied(model, hp["layers"], hp["targets"], self.tensors_like, self.scaling, variant_ids, positions)

    def plan(self, model: torch.nn.Module) -> Plan:
        """One variant, edited from the first layer at every position: the runner encodes each prompt
        under the adapter (``prompt_sites``: every position before p*); no ``edit_layer``."""
        return Plan((0,), lambda variant_ids, positions: self.applied(model, positions, variant_ids), self.choose,
                    prompt_sites=every_position_before)

    def prompt_sites(self, length: int) -> list[int]:
        return every_position_before(length)

    def check_compatible(self, model: torch.nn.Module, model_name: str, allow_other_model: bool = False) -> None:
        super().check_compatible(model, model_name, allow_other_model)
        hp = self.config["hyperparameters"]
        try:
            modules = target_modules(model, hp["layers"], hp["targets"])
        except ValueError as e:
            raise BundleError(f"This LoRA bundle's targets do not fit '{model_name}': {e}") from None
        for (target, j), module in modules.items():
            A, B = self.tensors[f"{target}.A"][j], self.tensors[f"{target}.B"][j]
            if A.shape[1] != module.in_features or B.shape[0] != module.out_features:
                raise BundleError(f"This LoRA bundle's {target} of layer {hp['layers'][j]} is {B.shape[0]} x "
                                  f"{A.shape[1]}; '{model_name}' has {module.out_features} x {module.in_features}: "
                                  "it was trained for another model, retrain it")

    @classmethod
    def fit_adapted(cls, session: Session, data: AttributeData, config: dict[str, Any], hyperparameters: dict[str, Any],
                    seed: int) -> Intervention:
        hp = dict(hyperparameters)
        hp["layers"] = list(hp.get("layers") or range(session.num_layers))
        model, scaling = session.model, float(hp["alpha"]) / int(hp["rank"])
        params = initial_weights(model, hp["layers"], hp["targets"], hp["rank"], seed, session.site_device)
        fit_examples, val_examples = validation_split(data, seed, hp.get("validation"))
        session.prepare(val_examples, "LoRA validation slice", lower=False)
        base = validation_loss(session, val_examples)
        loop = EpochLoop("lora", "LoRA", hp["epochs"], params,
                         torch.optim.AdamW(params.values(), lr=hp["lr"], weight_decay=0.0), session.checkpoints)
        best = [float("inf"), -1, None]  # validation loss, epoch, parameters of the best epoch so far
        order = random.Random(f"lora:{seed}")

        def batches(epoch: int) -> list[list[Example]]:
            return shuffled_batches(fit_examples, hp["batch"], order)

        def weights(x: torch.Tensor) -> dict[str, torch.Tensor]:
            return params

        def loss(batch: list[Example]) -> tuple[torch.Tensor, dict[str, float]]:
            session.record_step(step_estimate(session, batch, hp))
            value = torch.stack([task_loss(session, ex, hp, weights, scaling) for ex in batch]).mean()
            return value, {"loss": value.item()}

        def end_epoch(epoch: int, parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
            losses = [logged["loss"] for _, logged in parts]
            with torch.no_grad():
                val = sum(float(task_loss(session, ex, hp, weights, scaling)) for ex in val_examples) / len(val_examples)
            record = {"train_loss": sum(losses) / len(losses), "validation_loss": val}
            log.info("LoRA epoch %d: train loss %.4f, validation loss %.4f (base %.4f)", epoch + 1, record["train_loss"],
                     val, base)
            if val < best[0]:
                best[:] = [val, epoch + 1, {k: v.detach().clone() for k, v in params.items()}]
            return record

        def restored(state: dict[str, Any], kept: dict[str, torch.Tensor]) -> None:  # a killed run resumes (mari_eval.storage.checkpoint)
            order.setstate(python_rng_state(state["order"]))
            best[:] = [state["best_validation"], state["best_epoch"], {k: kept[k] for k in params}]

        history = loop.run(batches, loss, end_epoch, restored=restored, extra=lambda: best[2],
                           state=lambda: {"order": order.getstate(), "best_validation": best[0], "best_epoch": best[1]})
        _, best_epoch, kept = best
        config = copy.deepcopy(config)
        config["site"] = {"layer": min(hp["layers"]), "position": "every token (prompt, options, generated tokens) "
                          f"through {', '.join(hp['targets'])} of layers {hp['layers'][0]}..{hp['layers'][-1]}"}
        config["hyperparameters"] = {**hp, "alpha": float(hp["alpha"]), "recipe": "adapted", "epoch_kept": best_epoch,
                                     "weight_decay": 0.0, "dropout": 0.0,
                                     **validation_record(hp.get("validation"), val_examples),
                                     "init": "A uniform in +-1/sqrt(in) (peft's kaiming_uniform_, a=sqrt(5)), B = 0"}
        config["diagnostics"] = {"history": history, SELECTION_KEY: best[0], "validation_loss_base": base,
                                 "validation_ids": [ex.id for ex in val_examples]}
        return cls(config, {k: v.detach().float().cpu().contiguous() for k, v in kept.items()})


def step_estimate(session: Session, batch: list[Example], hp: dict[str, Any]) -> memory.Step:
    """The activations a training step keeps for its backward (``memory.step_estimate``): every
    example of ``batch`` at once (the batch's loss is one mean), each its prompt's pass under the
    adapter and its options' packed passes, through every layer from the first adapted one; plus
    the adapter's own inputs per adapted layer and token: each target's input in float32 (one
    tensor for the targets that read the same input, when the model is float32 already) and its
    A x (r float32)."""
    model, targets = session.model, hp["targets"]
    passes = memory.edited_prompt_passes(memory.example_shapes(batch), session.max_tokens)
    made = memory.step_estimate(model, min(hp["layers"]) - 1, passes)
    inputs = {target: module.in_features for (target, j), module in target_modules(model, hp["layers"][:1], targets).items()}
    b = site.element_bytes(model)
    shared = {SAME_INPUT.get(target, target): width for target, width in inputs.items()}  # float32 models: no copies
    per_token = 4 * (sum(inputs.values()) if b < 4 else sum(shared.values())) + 4 * int(hp["rank"]) * len(targets)
    tokens = sum(p.tokens for p in passes)
    return memory.Step(made.passes, made.saved_bytes + len(hp["layers"]) * tokens * per_token, made.transient_bytes)


def initial_weights(model: torch.nn.Module, layers: list[int], targets: list[str], rank: int, seed: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """A (uniform in +-1/sqrt(in), as peft's ``kaiming_uniform_(a=sqrt(5))``) and B (zeros) of every
    target, stacked over ``layers``, float32, seeded, requiring gradients."""
    gen = torch.Generator().manual_seed(seed)
    modules = target_modules(model, layers, targets)
    params = {}
    for target in targets:
        first = modules[target, 0]
        bound = 1 / math.sqrt(first.in_features)
        A = (torch.rand(len(layers), rank, first.in_features, generator=gen) * 2 - 1) * bound
        params[f"{target}.A"] = A.to(device).requires_grad_(True)
        params[f"{target}.B"] = torch.zeros(len(layers), first.out_features, rank, device=device, requires_grad=True)
    return params


def task_loss(session: Session, ex: Example, hp: dict[str, Any], weights: Weights, scaling: float) -> torch.Tensor:
    """The task loss of ``ex`` (option cross-entropy, or the target's NLL) with the adapter on every
    token: its prompt encoded under it, then its options scored under it (the evaluation path)."""
    plan = Plan((0,), lambda ids, positions: lora_applied(session.model, hp["layers"], hp["targets"], weights, scaling,
                                                          ids, positions), prompt_sites=every_position_before)
    prefix = encode_prefix(session.model, ex.context[:-1], apply=plan.apply, sites=every_position_before(len(ex.context)))
    run = runner.score_variants(session.model, prefix, ex.context[-1], ex.options, plan, max_tokens=session.max_tokens)
    return task_losses(run.logprobs, ex.gold)[0]
