"""MARI's equations as plain tensor functions (labels: ../shared/paper/MARI.tex, Section 4 and
Appendices A-B). The method (``mari_eval.mari.method``) and its training (``mari_eval.mari.fit``) call them.

Energy threshold (the paper contradicts itself): Section 4.3 says tau_E is the
(1 - rho)-quantile of non-applicable control energies so that a fraction rho of them
has E >= tau_E, and in the same sentence that this "rejects/intercepts a fraction
rho of non-applicable inputs"; Appendix B says tau_E is the rho-quantile. Inputs with
E >= tau_E are intervened on (eq:energy_gate_rule), so only the rho-quantile makes a
fraction rho of non-applicable inputs fall *below* tau_E and get the base model, which
is the stated intent. We use the rho-quantile (linear interpolation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from mari_eval.injection.plan import BASE, VariantRun


def lowrank_delta(h: torch.Tensor, U: torch.Tensor, V: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Delta(h) = U (V^T h + b) per row (eq:act_lowrank); h [R, d], U and V [R, d, r], b [R, r]."""
    return torch.einsum("rdk,rk->rd", U, torch.einsum("rdk,rd->rk", V, h) + b)


def option_entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """u_k = H(softmax(z_k)) over the options (eq:entropy_def, eq:entropy_mc); [V, M] -> [V]."""
    p = torch.softmax(logprobs, dim=-1)
    return -(p * torch.log_softmax(logprobs, dim=-1)).sum(-1)


def routed_loss(losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Winner-take-gradient (eq:hard_route, eq:routed_loss); losses [B, K] -> (mean winner loss, winners).

    Only the winner's loss enters the sum, so the losers receive no task gradient.
    """
    winners = losses.detach().argmin(-1)
    return losses.gather(-1, winners[:, None]).mean(), winners


def balance_loss(losses: torch.Tensor, T_bal: float) -> torch.Tensor:
    """L_bal = sum_k (p_k - 1/K)^2 with p_k the batch mean of softmax(-l/T_bal) (eq:usage_soft, eq:bal)."""
    K = losses.shape[-1]
    p = torch.softmax(-losses / T_bal, dim=-1).mean(0)
    return ((p - 1.0 / K) ** 2).sum()


def inter_ortho_loss(U: torch.Tensor) -> torch.Tensor:
    """Mean pairwise ||Q_i^T Q_j||_F^2, Q_k = reduced QR of U_k (eq:inter_ortho); U [K, d, r]."""
    K = U.shape[0]
    if K < 2:
        return U.new_zeros(())
    Q = torch.linalg.qr(U, mode="reduced").Q
    overlap = torch.einsum("idr,jds->ijrs", Q, Q).pow(2).sum((-1, -2))
    return overlap.triu(diagonal=1).sum() * 2 / (K * (K - 1))


def out_ortho_loss(deltas: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Mean pairwise squared cosine of the experts' updates per example (eq:out_ortho); deltas [B, K, d]."""
    K = deltas.shape[1]
    if K < 2:
        return deltas.new_zeros(())
    unit = deltas / deltas.norm(dim=-1, keepdim=True).clamp_min(eps)
    cos2 = torch.einsum("bid,bjd->bij", unit, unit).pow(2)
    return (cos2.triu(diagonal=1).sum((-1, -2)) * 2 / (K * (K - 1))).mean()


def pca_basis(states: torch.Tensor, rank: int) -> torch.Tensor:
    """Orthonormal [d, rank] basis of the top principal directions of ``states`` [N, d]."""
    states = states.float()  # a bf16 model's states: the basis is fitted in float32 (and float64 below)
    centred = states - states.mean(0, keepdim=True)
    _, _, Vh = torch.linalg.svd(centred.double(), full_matrices=False)
    return Vh[:rank].T.float().contiguous()


def offsubspace_penalty(delta: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """||(I - B B^T) delta||^2 per row (eq:offsub_penalty, eq:proj_ops); delta [N, d], B [d, k]."""
    return (delta - (delta @ B) @ B.T).pow(2).sum(-1)


def propagation_energy(probed: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """E = median over layers l*..L of ||h^(alpha,m)_{p*} - h^(m)_{p*}|| (eq:prop_curve_def, eq:prop_energy_def).

    probed, base: [..., n_layers, d] -> [...]. An even count takes the mean of the two middle values.
    """
    return torch.quantile((probed.float() - base.float()).norm(dim=-1), 0.5, dim=-1)


def energy_threshold(energies: torch.Tensor, applicable: torch.Tensor, rho: float) -> float:
    """tau_E = the rho-quantile of the non-applicable control energies (see the module docstring).

    With no non-applicable control example there is nothing to intercept: -inf (always intervene).
    """
    non = energies[~applicable.bool()]
    if non.numel() == 0:
        return -math.inf
    return float(torch.quantile(non.double(), rho))


def run_energy(run: VariantRun, probe_id: int, layers: list[int]) -> torch.Tensor:
    """E(x) from a run holding the base model's and the probe's states at p* after ``layers``."""
    # Layers may live on different devices (a device map): gather them in float32 on the first's.
    device = run.site[layers[0]].device
    probed = torch.stack([run.site[m][run.row(probe_id)].to(device, torch.float32) for m in layers])
    base = torch.stack([run.site[m][run.row(BASE)].to(device, torch.float32) for m in layers])
    return propagation_energy(probed, base)


def gate_open(energy: torch.Tensor, tau: float) -> torch.Tensor:
    """eq:energy_gate_rule: intervene (alpha_full) iff E >= tau_E, else the base model (alpha_safe = 0)."""
    return energy >= tau


def apply_variants(tensors: dict[str, torch.Tensor], hp: dict[str, Any], hidden: torch.Tensor,
                   variant_ids: torch.Tensor, probe_alphas: Sequence[float] = ()) -> torch.Tensor:
    """The edit of every variant on its rows (shared by the trained bundle and by training).

    Ids 0..K-1: the experts; K: the single adapter; K + 1: the probe at its trained strength,
    h + alpha_probe delta_phi(h) (eq:probe_update); K + 2 + j: the same probe at
    ``probe_alphas[j]`` (the fixed-probe strengths of ``probe_variant``)."""
    K = tensors["expert_U"].shape[0]
    out = hidden
    experts = (variant_ids >= 0) & (variant_ids < K)
    if experts.any():
        k = variant_ids.clamp(0, K - 1)
        delta = lowrank_delta(hidden, tensors["expert_U"][k], tensors["expert_V"][k], tensors["expert_b"][k])
        out = torch.where(experts[:, None], out + hp["alpha_full"] * hp["gamma"] * delta, out)  # eq:delta_def
    single = variant_ids == K
    if single.any() and "single_U" in tensors:
        zero = torch.zeros_like(variant_ids)
        delta = lowrank_delta(hidden, tensors["single_U"][zero], tensors["single_V"][zero], tensors["single_b"][zero])
        out = torch.where(single[:, None], out + hp["alpha_full"] * hp["gamma"] * delta, out)
    probe = variant_ids == K + 1
    if probe.any():
        delta = probe_delta(hidden, tensors)
        out = torch.where(probe[:, None], out + hp["alpha_probe"] * delta, out)
    if probe_alphas and bool((variant_ids >= K + 2).any()):
        delta = probe_delta(hidden, tensors)
        for j, alpha in enumerate(probe_alphas):  # one trained probe, injected at another strength
            out = torch.where((variant_ids == probe_variant(K, j))[:, None], out + alpha * delta, out)
    return out


def probe_variant(K: int, index: int | None) -> int:
    """The variant id of the gate's probe: K + 1 at the trained alpha_probe (``index`` None), K + 2 +
    ``index`` at the bundle's ``index``-th stored inference strength (gate.probe_alphas). A distinct id
    per strength keeps a variant's edit fixed by the bundle alone (``Intervention.edit_fingerprint``)."""
    return K + 1 if index is None else K + 2 + index


def probe_delta(hidden: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """delta_phi(h) = U_p (V_p^T h + b_p) (eq:probe_update), the calibrator g_phi."""
    return (hidden @ tensors["probe_V"] + tensors["probe_b"]) @ tensors["probe_U"].T
