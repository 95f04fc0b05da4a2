"""Training a MARI bundle: PCA basis, competitive experts, the gate's probe, calibration on D_ctrl
(``MARI.fit`` calls ``fit_mari``). Equation labels refer to ../shared/paper/MARI.tex.

Applicability of a control example (Appendix B leaves the outcome open): an example is
*applicable* when the intervention as it would be applied at inference (the
entropy-routed expert, gate ignored) lowers its task loss below the base model's
(option cross-entropy for multiple choice, NLL of the target for generation).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from mari_eval.evaluation import generation, runner
from mari_eval.injection import devices
from mari_eval.training.epochs import EpochLoop, weighted_means
from mari_eval.mari import gate_labels
from mari_eval.mari.equations import (apply_variants, balance_loss, energy_threshold, inter_ortho_loss, lowrank_delta,
                                      offsubspace_penalty, option_entropy, out_ortho_loss, pca_basis, probe_delta,
                                      probe_variant, routed_loss, run_energy)
from mari_eval.training.objectives import task_losses
from mari_eval.injection.plan import Plan

if TYPE_CHECKING:
    from mari_eval.methods.intervention import Intervention
    from mari_eval.training.examples import AttributeData, Example
    from mari_eval.training.session import Session

log = logging.getLogger(__name__)

# Probe strengths alpha at which calibration also measures E(x; alpha) over D_ctrl with the one trained
# probe (absolute values in h + alpha delta_phi(h), eq:probe_update, eq:prop_energy_def): evaluation's
# probe_alpha= reads them to recompute tau_E without retraining (issue 36.7c; the paper's bound,
# eq:energy_nonapp_compact_main, is first-order in alpha). The trained alpha_probe is always added.
PROBE_ALPHAS = (0.1, 0.3, 1.0)


def probe_alpha_grid(trained: float) -> list[float]:
    """The inference strengths a bundle trained at alpha_probe=``trained`` stores, ascending."""
    return sorted({*PROBE_ALPHAS, float(trained)})


def lowrank_params(K: int, d: int, r: int, scale: float, gen: torch.Generator,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """U small (the edit starts near the identity), V a random projection, b zero.

    Drawn on the CPU (the same numbers on every device), then kept in float32 on ``device``
    (the site layer's): trained parameters stay float32 whatever the model's dtype."""
    return {
        "U": (torch.randn(K, d, r, generator=gen) * scale).to(device).requires_grad_(),
        "V": (torch.randn(K, d, r, generator=gen) / math.sqrt(d)).to(device).requires_grad_(),
        "b": torch.zeros(K, r, device=device).requires_grad_(),
    }


def like(params: dict[str, torch.Tensor], hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """float32 parameters cast to ``hidden``'s dtype and device (gradients flow back through the cast)."""
    return {name: value.to(hidden) for name, value in params.items()}


def epoch_batches(examples: list, size: int, gen: torch.Generator) -> list[list]:
    """One epoch's batches of ``examples``: a permutation drawn from ``gen``, cut into ``size``s."""
    order = torch.randperm(len(examples), generator=gen).tolist()
    return [[examples[i] for i in order[k : k + size]] for k in range(0, len(order), size)]


def fit_experts(session: Session, examples: list[Example], K: int, hp: dict[str, Any], gen: torch.Generator, label: str,
                stage: str = "experts") -> tuple[dict, list]:
    """Competitive training of K experts (eq:hard_route .. eq:out_ortho); returns tensors and the epoch log.

    Checkpointed after every epoch as ``stage`` (``session.checkpoints``); a killed run resumes there."""
    p = lowrank_params(K, session.hidden_size, hp["rank"], hp["init_scale"], gen, session.site_device)
    loop = EpochLoop(stage, label, hp["epochs"], p, torch.optim.Adam(p.values(), lr=hp["lr"]), session.checkpoints, gen)
    gamma = hp["gamma"]

    def edit(h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # eq:act_phi with s_k = 1, in the model's dtype
        q = like(p, h)
        return h + gamma * lowrank_delta(h, q["U"][ids], q["V"][ids], q["b"][ids])

    def loss(batch: list[Example]) -> tuple[torch.Tensor, dict[str, Any]]:
        session.step_estimate(batch, K)
        losses = torch.stack([task_losses(session.run(ex, list(range(K)), edit).logprobs, ex.gold)
                              for ex in batch]).to(session.site_device)
        hidden = torch.stack([ex.hidden for ex in batch]).float()  # [B, d]
        deltas = torch.stack([gamma * lowrank_delta(hidden, p["U"][[k] * len(batch)], p["V"][[k] * len(batch)],
                                                    p["b"][[k] * len(batch)]) for k in range(K)], dim=1)  # eq:delta_def
        route, winners = routed_loss(losses)
        bal, inter, out = balance_loss(losses, hp["T_bal"]), inter_ortho_loss(p["U"]), out_ortho_loss(deltas)
        total = route + hp["lambda_bal"] * bal + hp["lambda_inter"] * inter + hp["lambda_out"] * out
        parts = {k: v.detach() for k, v in zip(("routed", "bal", "inter", "out"), (route, bal, inter, out))}
        return total, {**parts, "usage": torch.bincount(winners, minlength=K).cpu()}

    def end_epoch(epoch: int, parts: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        usage = sum(logged["usage"] for _, logged in parts)
        record = {**weighted_means(parts, ("routed", "bal", "inter", "out")),
                  "usage": [round(u / len(examples), 3) for u in usage.tolist()]}
        log.info("%s epoch %d: routed loss %.4f, L_bal %.4f, L_inter %.4f, L_out %.4f, usage %s", label, epoch + 1,
                 record["routed"], record["bal"], record["inter"], record["out"], record["usage"])
        if K > 1 and min(record["usage"]) < 1 / (4 * K):
            log.warning("%s epoch %d: expert usage %s has an expert below 1/(4K): it is collapsing", label, epoch + 1, record["usage"])
        return record

    history = loop.run(lambda epoch: epoch_batches(examples, hp["batch_size"], gen), loss, end_epoch)
    return {k: v.detach() for k, v in p.items()}, history


def fit_probe(session: Session, examples: list[Example], pca_states: torch.Tensor, basis: torch.Tensor, hp: dict[str, Any],
              gen: torch.Generator) -> tuple[dict, list]:
    """Calibrator g_phi: task loss under h + alpha_probe delta_phi(h) plus lambda_off R_off (eq:cal_objective,
    eq:offsubspace_penalty). Trained at the strength the gate uses it at (eq:probe_update), so a
    smaller alpha_probe is not merely a rescaled probe: the delta learns to be larger."""
    p = lowrank_params(1, session.hidden_size, hp["probe_rank"], hp["init_scale"], gen, session.site_device)
    p = {"probe_U": p["U"][0].detach().requires_grad_(), "probe_V": p["V"][0].detach().requires_grad_(),
         "probe_b": p["b"][0].detach().requires_grad_()}
    loop = EpochLoop("probe", "probe", hp["epochs"], p, torch.optim.Adam(p.values(), lr=hp["lr"]), session.checkpoints, gen)
    state_scale = pca_states.pow(2).sum(-1).mean()  # normalises R_off (see the module docstring)
    alpha = hp["alpha_probe"]

    def loss(batch: list[Example]) -> tuple[torch.Tensor, dict[str, Any]]:
        session.step_estimate(batch, 1)
        task = torch.stack([task_losses(session.run(ex, [0], lambda h, ids: h + alpha * probe_delta(h, like(p, h))).logprobs,
                                        ex.gold)[0] for ex in batch]).mean().to(session.site_device)
        off = offsubspace_penalty(probe_delta(pca_states, p), basis).mean() / state_scale
        return task + hp["lambda_off"] * off, {"task": task.detach(), "off": off.detach()}

    def end_epoch(epoch: int, parts: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        record = weighted_means(parts, ("task", "off"))
        log.info("probe epoch %d: task loss %.4f, R_off %.4f", epoch + 1, record["task"], record["off"])
        return record

    history = loop.run(lambda epoch: epoch_batches(examples, hp["batch_size"], gen), loss, end_epoch)
    return {k: v.detach() for k, v in p.items()}, history


@torch.no_grad()
def routing_entropies(model: torch.nn.Module, prompt: list[int], plan: Plan, window: int) -> torch.Tensor:
    """u_k of eq:entropy_gen for ``prompt`` under each variant of ``plan`` ([V]), over ``window`` greedy
    steps, by inference's own generation path (``generation.generate_variants``): the prompt before
    p* is computed once for all the variants, where ``generation.routing_entropy`` ran it whole
    once per variant."""
    seen: list[torch.Tensor] = []

    def choose(run: runner.VariantRun) -> tuple[int, dict[str, Any]]:
        seen.append(run.entropy)
        return plan.variants[0], {}

    ids = torch.tensor([list(prompt)], device=devices.input_device(model))
    # One prompt: nothing is padded but what follows an end-of-sequence token, which is not read here.
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else model.generation_config.eos_token_id
    pad = (pad[0] if pad else None) if isinstance(pad, (list, tuple)) else pad
    generation.generate_variants(model, ids, torch.ones_like(ids), dataclasses.replace(plan, choose=choose, window=window),
                                 max_length=ids.shape[1] + window, do_sample=False, pad_token_id=pad if pad is not None else 0)
    return seen[0]


@torch.no_grad()
def calibrate(session: Session, examples: list[Example], tensors: dict[str, torch.Tensor], hp: dict[str, Any]) -> dict[str, Any]:
    """Energies of D_ctrl, its loss and flip applicability labels (routed expert and single adapter;
    mari_eval.mari.gate_labels), routing agreement; and E(x; alpha) of the same trained probe at every
    strength of ``probe_alpha_grid`` ("ctrl_energy_by_alpha" [n_alpha, N], the grid as "probe_alphas"):
    a site-only row at p* per extra strength, in the same run."""
    K = tensors["expert_U"].shape[0]
    has_single = "single_U" in tensors
    grid = probe_alpha_grid(hp["alpha_probe"])
    # The trained strength's energy is ctrl_energy itself (variant K + 1); the others get their own rows.
    extra = {j: probe_variant(K, j) for j, alpha in enumerate(grid) if alpha != hp["alpha_probe"]}
    probes = [probe_variant(K, None), *extra.values()]
    variants = [runner.BASE, *range(K), *([K] if has_single else []), *probes]
    layers = list(range(session.layer, session.num_layers))
    energies, by_alpha, applicable, applicable_single, flip, flip_single, agrees = [], [], [], [], [], [], []
    def edit(h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return apply_variants(like(tensors, h), hp, h, ids, grid)

    experts = Plan.at_site(session.model, session.layer, edit, list(range(K)))
    for ex in tqdm(examples, desc="calibrating the energy gate on D_ctrl", leave=False):
        run = session.run(ex, variants, edit, capture=layers, site_only=probes)
        energies.append(float(run_energy(run, probe_variant(K, None), layers)))
        by_alpha.append([float(run_energy(run, extra[j], layers)) if j in extra else energies[-1]
                         for j in range(len(grid))])
        expert_rows = [run.row(k) for k in range(K)]
        if ex.gold is None:  # generation: route as inference does, over the first T_ent greedy steps
            u = routing_entropies(session.model, ex.context, experts, hp["T_ent"])
        else:
            u = option_entropy(run.logprobs[expert_rows])
        losses = task_losses(run.logprobs, ex.gold)
        routed, base = int(u.argmin()), run.row(runner.BASE)
        applicable.append(gate_labels.loss_label(losses, expert_rows[routed], base))
        flip.append(gate_labels.flip_label(run.logprobs, ex.gold, expert_rows[routed], base))
        if has_single:
            applicable_single.append(gate_labels.loss_label(losses, run.row(K), base))
            flip_single.append(gate_labels.flip_label(run.logprobs, ex.gold, run.row(K), base))
        agrees.append(routed == int(losses[expert_rows].argmin()))  # Appendix C.2: entropy vs lowest-loss expert
    bad = [ex.id for ex, row in zip(examples, by_alpha) if not all(map(math.isfinite, row))]
    if bad:  # tau_E would be NaN (every gate comparison False) or infinite: refuse, naming the examples
        raise FloatingPointError(
            f"gate calibration: the propagation energy E(x) is not finite for {len(bad)} of {len(energies)} D_ctrl "
            f"examples ({', '.join(bad[:8])}{', ...' if len(bad) > 8 else ''}); the probe's or the model's states "
            "overflowed there. Retrain with a lower --lr (or in float32, --dtype float32), or inspect these examples")
    out = {
        "ctrl_energy": torch.tensor(energies),
        "ctrl_energy_by_alpha": torch.tensor(by_alpha).reshape(len(examples), len(grid)).T.contiguous(),  # [n_alpha, N]
        "ctrl_applicable": torch.tensor(applicable, dtype=torch.uint8),
        "ctrl_applicable_single": torch.tensor(applicable_single or applicable, dtype=torch.uint8),
        "ctrl_flip": torch.tensor(flip, dtype=torch.uint8),
        "ctrl_flip_single": torch.tensor(flip_single or flip, dtype=torch.uint8),
    }
    out["routing_agreement"] = sum(agrees) / max(1, len(agrees))
    out["probe_alphas"] = grid
    return out


def fit_mari(cls: type[Intervention], session: Session, data: AttributeData, config: dict[str, Any],
             hyperparameters: dict[str, Any], seed: int) -> Intervention:
    """PCA basis, experts, single adapter, probe, gate calibration: a complete MARI bundle of ``cls``
    (``mari_eval.mari.MARI``, which calls this from its ``fit``)."""
    hp = cls.training_hyperparameters(hyperparameters)
    if len(data.pca_prompts) < hp["pca_rank"]:  # the basis would have fewer directions than the bundle records
        raise ValueError(f"D_pca has {len(data.pca_prompts)} prompts, fewer than pca_rank={hp['pca_rank']}: "
                         f"raise --max-pca to at least {hp['pca_rank']} or lower it with --set pca_rank=N")
    gen = torch.Generator().manual_seed(seed)
    data.prepare(session)
    pca_states = session.hidden_of_prompts(data.pca_prompts)
    tensors: dict[str, torch.Tensor] = {"pca_basis": pca_basis(pca_states, hp["pca_rank"])}  # eq:proj_ops
    experts, expert_log = fit_experts(session, data.train, hp["K"], hp, gen, f"experts (K={hp['K']})")
    tensors.update(expert_U=experts["U"], expert_V=experts["V"], expert_b=experts["b"])
    logs = {"experts": expert_log}
    if hyperparameters.get("single", False):
        single, logs["single"] = fit_experts(session, data.train, 1, hp, gen, "single adapter (K=1 ablation)",
                                               stage="single")
        tensors.update(single_U=single["U"], single_V=single["V"], single_b=single["b"])
    probe, logs["probe"] = fit_probe(session, data.train, pca_states, tensors["pca_basis"], hp, gen)
    tensors.update(probe)
    cal = calibrate(session, data.ctrl, tensors, hp)
    agreement, probe_alphas = cal.pop("routing_agreement"), cal.pop("probe_alphas")
    tensors.update(cal)
    applicable = gate_labels.control_labels(cal, data.ctrl_source, hp["labels"])
    tau = energy_threshold(cal["ctrl_energy"], applicable, hp["rho"])
    config = {
        **config,
        "hyperparameters": hp,
        "gate": {"tau_E": tau, "rho": hp["rho"], "labels": hp["labels"],
                 "quantile": f"rho-quantile of the D_ctrl energies non-applicable by labels={hp['labels']}",
                 "n_ctrl": int(applicable.numel()), "n_applicable": int(applicable.sum()),
                 "ctrl_sources": data.ctrl_source, "probe_alphas": probe_alphas},
        "diagnostics": {"training": logs, "ctrl_routing_agreement": agreement},
    }
    log.info("gate: tau_E %.4f (rho %.2f, labels %s), %d/%d control examples applicable, routing agreement %.3f",
             tau, hp["rho"], hp["labels"], int(applicable.sum()), applicable.numel(), agreement)
    return cls(config, {k: v.detach().contiguous() for k, v in tensors.items()})
