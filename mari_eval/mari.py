"""MARI: K competitive low-rank experts at one site, entropy routing and an energy gate.

Equation labels refer to ../shared/paper/MARI.tex (Section 4 and Appendices A-B).

Variant ids (see mari_eval.runner): experts are 0..K-1; ``SINGLE`` (= K) is the
one-adapter ablation trained beside them ("w/o Multi-Adapter", Table 2); ``PROBE``
(= K + 1) is the gate's calibrator g_phi, run only for its hidden states.

Choices the paper leaves open (all exposed as ``mari-eval train`` options, recorded in
the bundle; see DEFAULTS):

* l* = num_layers // 2: the middle of the network, where steering works best for
  most methods the paper compares with (ITI, CAA); p* = the last prompt token.
* rank r = 4: LoReFT's default rank at the last prompt position; K = 4.
* gamma = 1 and s_k = 1 frozen (the paper's default, eq:act_phi); alpha_full = 1, so
  an applicable input gets the experts exactly as trained.
* Adam, lr 5e-3, 4 epochs, 8 examples per step: the adapters have ~5k parameters
  each and D_train has 100 (TruthfulQA) to ~900 (BBQ) examples.
* T_bal = 1 (losses are nats of option cross-entropy, O(1)); lambda_bal = 1,
  lambda_inter = lambda_out = 0.1: diversity terms are regularisers, balancing is what
  prevents collapse.
* Probe rank 2, PCA rank 16 (Appendix B). The off-subspace penalty is divided by the
  mean squared norm of the D_pca states, so lambda_off = 1 means "as costly as the task
  loss when the probe leaves the subspace by one typical state norm" for any model
  (the paper's eq:offsub_penalty is unnormalised; the scale of h differs per model).
* alpha_probe = 1: the probe is trained as an intervention h + delta_phi(h), so at
  strength 1 it is a task-sized update.
* T_ent = 8 greedy steps for generation routing (eq:entropy_gen).
* Median of an even number of layers: the mean of the two middle values.

Energy threshold (the paper contradicts itself): Section 4.3 says tau_E is the
(1 - rho)-quantile of non-applicable control energies so that a fraction rho of them
has E >= tau_E, and in the same sentence that this "rejects/intercepts a fraction
rho of non-applicable inputs"; Appendix B says tau_E is the rho-quantile. Inputs with
E >= tau_E are intervened on (eq:energy_gate_rule), so only the rho-quantile makes a
fraction rho of non-applicable inputs fall *below* tau_E and get the base model, which
is the stated intent. We use the rho-quantile (linear interpolation).

Applicability of a control example (Appendix B leaves the outcome open): an example is
*applicable* when the intervention as it would be applied at inference (the
entropy-routed expert, gate ignored) lowers its task loss below the base model's
(option cross-entropy for multiple choice, NLL of the target for generation).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

from mari_eval import runner
from mari_eval.methods import Float, Int, Intervention, List, Obj, Str, TensorSpec, check_hyperparameters, register_method

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "K": 4,
    "rank": 4,
    "gamma": 1.0,
    "lr": 5e-3,
    "epochs": 3,
    "batch_size": 8,
    "T_bal": 1.0,
    "lambda_bal": 1.0,
    "lambda_inter": 0.1,
    "lambda_out": 0.1,
    "probe_rank": 2,
    "pca_rank": 16,
    "lambda_off": 1.0,
    "alpha_probe": 1.0,
    "alpha_full": 1.0,
    "T_ent": 8,
    "rho": 0.9,
    "init_scale": 0.01,
}


# ----------------------------------------------------------------------------- equations


def lowrank_delta(h: torch.Tensor, U: torch.Tensor, V: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Delta(h) = U (V^T h + b) per row (eq:act_lowrank); h [R, d], U and V [R, d, r], b [R, r]."""
    return torch.einsum("rdk,rk->rd", U, torch.einsum("rdk,rd->rk", V, h) + b)


def task_losses(logprobs: torch.Tensor, gold: int | None) -> torch.Tensor:
    """Per-variant task loss from option scores [V, M].

    Multiple choice: CE over the option log-likelihoods (eq:per_adapter_ce_mc).
    Generation (gold None): the single "option" is the target, loss = its NLL (eq:per_adapter_ce_gen).
    """
    if gold is None:
        return -logprobs[:, 0]
    return F.cross_entropy(logprobs, torch.full((logprobs.shape[0],), gold, device=logprobs.device), reduction="none")


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


def run_energy(run: runner.VariantRun, probe_id: int, layers: list[int]) -> torch.Tensor:
    """E(x) from a run holding the base model's and the probe's states at p* after ``layers``."""
    # Layers may live on different devices (a device map): gather them in float32 on the first's.
    device = run.site[layers[0]].device
    probed = torch.stack([run.site[m][run.row(probe_id)].to(device, torch.float32) for m in layers])
    base = torch.stack([run.site[m][run.row(runner.BASE)].to(device, torch.float32) for m in layers])
    return propagation_energy(probed, base)


def gate_open(energy: torch.Tensor, tau: float) -> torch.Tensor:
    """eq:energy_gate_rule: intervene (alpha_full) iff E >= tau_E, else the base model (alpha_safe = 0)."""
    return energy >= tau


# ----------------------------------------------------------------------------- method


@register_method("mari")
class MARI(Intervention):
    """A trained MARI bundle. Tensors: expert_U/V [K, d, r], expert_b [K, r], single_U/V/b,
    probe_U/V [d, r_p], probe_b [r_p], pca_basis [d, k], ctrl_energy [N], ctrl_applicable [N],
    ctrl_applicable_single [N]."""

    # bundle.json (methods.check_bundle): what inference reads is required; training's record when present.
    hyperparameter_fields = {
        "K": Int(1), "rank": Int(1), "probe_rank": Int(1), "pca_rank": Int(1),
        "rho": Float(0, 1, lo_open=True), "gamma": Float(), "alpha_full": Float(), "alpha_probe": Float(), "T_ent": Int(1),
        "lr": Float(0, lo_open=True, optional=True), "epochs": Int(0, optional=True), "batch_size": Int(1, optional=True),
        "T_bal": Float(0, lo_open=True, optional=True), "init_scale": Float(0, optional=True),
        **{name: Float(0, optional=True) for name in ("lambda_bal", "lambda_inter", "lambda_out", "lambda_off")},
    }
    config_fields = {
        "gate": Obj({"tau_E": Float(finite=False, optional=True),  # -inf: no non-applicable example, always intervene
                     "rho": Float(0, 1, lo_open=True, optional=True), "n_ctrl": Int(0, optional=True),
                     "n_applicable": Int(0, optional=True), "quantile": Str(optional=True),
                     "ctrl_sources": List(Str(), optional=True)}, optional=True),
    }

    @classmethod
    def tensor_spec(cls, config, names):
        hp = config["hyperparameters"]
        sizes = {"K": hp["K"], "rank": hp["rank"], "probe_rank": hp["probe_rank"], "pca_rank": hp["pca_rank"],
                 "hidden_size": config["base_model"]["hidden_size"]}
        lowrank = lambda n: {"U": (n, "hidden_size", "rank"), "V": (n, "hidden_size", "rank"), "b": (n, "rank")}
        specs = {f"expert_{k}": TensorSpec(shape) for k, shape in lowrank("K").items()}
        # The one-adapter ablation (`mari-eval train --single`): all three tensors or none.
        specs.update({f"single_{k}": TensorSpec(shape, optional=not any(n.startswith("single_") for n in names))
                      for k, shape in lowrank(1).items()})
        specs.update(probe_U=TensorSpec(("hidden_size", "probe_rank")), probe_V=TensorSpec(("hidden_size", "probe_rank")),
                     probe_b=TensorSpec(("probe_rank",)), pca_basis=TensorSpec(("hidden_size", "pca_rank")),
                     ctrl_energy=TensorSpec(("n_ctrl",)), ctrl_applicable=TensorSpec(("n_ctrl",), "int"),
                     ctrl_applicable_single=TensorSpec(("n_ctrl",), "int"))
        return sizes, specs

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]):
        super().__init__(config, tensors)  # checks config and tensors (methods.check_bundle)
        hp = config["hyperparameters"]
        self.K = int(hp["K"])
        self.configure()

    # ------------------------------------------------------------------ runtime options

    def configure(self, gate: bool = True, rho: float | None = None, experts: str = "routed") -> None:
        """Ablation switches (lm_eval model_args): gate on/off, rho, and which experts answer.

        experts: "routed" (entropy routing over the K experts), "single" (the one-adapter
        ablation), or an expert index to force.
        """
        if experts not in ("routed", "single"):
            try:
                forced = int(experts)
            except ValueError:
                raise ValueError(f"experts={experts!r}: use 'routed', 'single' or an expert index 0..{self.K - 1}") from None
            if not 0 <= forced < self.K:
                raise ValueError(f"experts={forced} is out of range: this bundle has K={self.K} experts (0..{self.K - 1})")
        if experts == "single" and "single_U" not in self.tensors:
            raise ValueError("experts=single: this bundle has no single adapter (train it with `mari-eval train --single`)")
        self.gate = bool(gate)
        self.experts = experts
        self.rho = float(self.config["hyperparameters"]["rho"] if rho is None else rho)
        if not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"rho={self.rho} must lie in [0, 1]")
        self.tau = self.threshold(self.rho, single=experts == "single") if self.gate else -math.inf

    def threshold(self, rho: float, single: bool = False) -> float:
        labels = self.tensors["ctrl_applicable_single" if single else "ctrl_applicable"]
        return energy_threshold(self.tensors["ctrl_energy"], labels, rho)

    @property
    def uses_base(self) -> bool:  # the gate compares the probe run with the base run, and falls back to it
        return self.gate

    @property
    def single_id(self) -> int:
        return self.K

    @property
    def probe_id(self) -> int:
        return self.K + 1

    def answering_variants(self) -> list[int]:
        if self.experts == "routed":
            return list(range(self.K))
        return [self.single_id] if self.experts == "single" else [int(self.experts)]

    def variants(self) -> list[int]:
        return self.answering_variants() + ([self.probe_id] if self.gate else [])

    def site_only_variants(self) -> list[int]:
        return [self.probe_id]

    def captured_layers(self) -> list[int]:
        return list(range(self.layer, int(self.config["base_model"]["num_layers"]))) if self.gate else []

    # ------------------------------------------------------------------ the edit

    def edit_variants(self, hidden: torch.Tensor, variant_ids: torch.Tensor) -> torch.Tensor:
        """h + alpha gamma s_k U_k (V_k^T h + b_k) per row (eq:act_phi, eq:act_lowrank); probe rows get
        h + alpha_probe delta_phi(h) (eq:probe_update); BASE rows pass through."""
        return apply_variants(self.tensors_like(hidden), self.config["hyperparameters"], hidden, variant_ids)

    # ------------------------------------------------------------------ routing and gate

    def screen(self, run: runner.VariantRun) -> bool:
        """A closed gate (eq:energy_gate_rule) answers with the base model: the experts need not run."""
        return not self.gate or bool(gate_open(self.energy(run), self.tau))

    def choose(self, run: runner.VariantRun) -> tuple[int, dict[str, Any]]:
        record: dict[str, Any] = {}
        is_open = True
        if self.gate:
            energy = float(self.energy(run))
            is_open = bool(gate_open(torch.tensor(energy), self.tau))
            record.update(energy=energy, gate_open=is_open)
        answering = self.answering_variants()
        rows = [run.row(v) for v in answering]
        if run.entropy is not None:  # generation: eq:entropy_gen
            u = run.entropy[rows]
        else:  # multiple choice: eq:entropy_mc
            u = option_entropy(run.logprobs[rows])
        chosen = runner.BASE
        if all(run.was_scored(v) for v in answering):  # not run: ``screen`` (closed gate) turned them away
            chosen = answering[int(u.argmin())]  # eq:entropy_route
            record.update(expert=chosen, entropy=[round(float(x), 5) for x in u])
        if not is_open:
            chosen = runner.BASE
        record["variant"] = chosen
        return chosen, record

    def variant_name(self, variant: int) -> str:
        """How errors and diagnostics name a variant."""
        if variant == self.single_id:
            return "the single adapter"
        return "the gate's probe" if variant == self.probe_id else f"expert {variant}"

    def energy(self, run: runner.VariantRun) -> torch.Tensor:
        return run_energy(run, self.probe_id, self.captured_layers())

    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        n = len(records)
        usage = {str(k): 0 for k in self.answering_variants()}
        for r in records:
            if r["variant"] != runner.BASE:
                usage[str(r["expert"])] += 1
        out: dict[str, Any] = {
            "prompts": n,
            "experts": self.experts,
            "gate": self.gate,
            "expert_usage": {k: v / max(1, sum(usage.values())) for k, v in usage.items()},
            "expert_counts": usage,
        }
        if self.gate:  # no prompt seen: no rate (not 0)
            out.update(rho=self.rho, tau_E=self.tau, gate_rate=sum(r["gate_open"] for r in records) / n if n else None)
        agree = [r["routing_agrees"] for r in records if r.get("routing_agrees") is not None]
        if agree:
            out["routing_agreement"] = sum(agree) / len(agree)
            out["routing_agreement_n"] = len(agree)
        out["control_energies"] = self.control_energy_summary()
        return out

    def control_energy_summary(self) -> dict[str, Any]:
        e, a = self.tensors["ctrl_energy"], self.tensors["ctrl_applicable"].bool()
        def stats(x):
            return {"n": int(x.numel()), "mean": float(x.mean()) if x.numel() else None,
                    "median": float(x.median()) if x.numel() else None}
        return {"applicable": stats(e[a]), "non_applicable": stats(e[~a])}

    @classmethod
    def training_hyperparameters(cls, given, max_pca=None):
        return training_hyperparameters(cls, given, max_pca)

    @classmethod
    def fit(cls, session, data, config, hyperparameters, seed):
        return fit_mari(cls, session, data, config, hyperparameters, seed)

def apply_variants(tensors: dict[str, torch.Tensor], hp: dict[str, Any], hidden: torch.Tensor,
                   variant_ids: torch.Tensor) -> torch.Tensor:
    """The edit of every variant on its rows (shared by the trained bundle and by training)."""
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
    return out


def probe_delta(hidden: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """delta_phi(h) = U_p (V_p^T h + b_p) (eq:probe_update), the calibrator g_phi."""
    return (hidden @ tensors["probe_V"] + tensors["probe_b"]) @ tensors["probe_U"].T


# ----------------------------------------------------------------------------- training


def _lowrank_params(K: int, d: int, r: int, scale: float, gen: torch.Generator,
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


def _batches(n: int, size: int, gen: torch.Generator) -> list[list[int]]:
    order = torch.randperm(n, generator=gen).tolist()
    return [order[i : i + size] for i in range(0, n, size)]


def _check_finite(loss: torch.Tensor, what: str, epoch: int, step: int, ids: list[str]) -> None:
    if not torch.isfinite(loss):
        raise FloatingPointError(
            f"{what}: loss is {float(loss.detach())} at epoch {epoch + 1}, step {step + 1} (examples {', '.join(ids[:4])}...); "
            "lower --lr or check the data"
        )


def fit_experts(session, examples, K: int, hp: dict[str, Any], gen: torch.Generator, label: str,
                stage: str = "experts") -> tuple[dict, list]:
    """Competitive training of K experts (eq:hard_route .. eq:out_ortho); returns tensors and the epoch log.

    Checkpointed after every epoch as ``stage`` (``session.checkpoints``); a killed run resumes there."""
    from tqdm import tqdm

    p = _lowrank_params(K, session.hidden_size, hp["rank"], hp["init_scale"], gen, session.site_device)
    opt = torch.optim.Adam(p.values(), lr=hp["lr"])
    gamma = hp["gamma"]
    checkpoints = session.checkpoints
    done, state, _ = checkpoints.restore(stage, p, opt, gen)
    history = state.get("history", [])

    def edit(h, ids):  # eq:act_phi with s_k = 1, in the model's dtype
        q = like(p, h)
        return h + gamma * lowrank_delta(h, q["U"][ids], q["V"][ids], q["b"][ids])

    for epoch in range(done, hp["epochs"]):
        sums = {"routed": 0.0, "bal": 0.0, "inter": 0.0, "out": 0.0}
        usage = torch.zeros(K, dtype=torch.long)
        batches = _batches(len(examples), hp["batch_size"], gen)
        for step, idx in enumerate(tqdm(batches, desc=f"{label} epoch {epoch + 1}/{hp['epochs']}", leave=False)):
            batch = [examples[i] for i in idx]
            losses = torch.stack([task_losses(session.run(ex, list(range(K)), edit).logprobs, ex.gold)
                                  for ex in batch]).to(session.site_device)
            hidden = torch.stack([ex.hidden for ex in batch]).float()  # [B, d]
            deltas = torch.stack([gamma * lowrank_delta(hidden, p["U"][[k] * len(batch)], p["V"][[k] * len(batch)],
                                                        p["b"][[k] * len(batch)]) for k in range(K)], dim=1)  # eq:delta_def
            route, winners = routed_loss(losses)
            bal, inter, out = balance_loss(losses, hp["T_bal"]), inter_ortho_loss(p["U"]), out_ortho_loss(deltas)
            total = route + hp["lambda_bal"] * bal + hp["lambda_inter"] * inter + hp["lambda_out"] * out
            _check_finite(total, label, epoch, step, [ex.id for ex in batch])
            opt.zero_grad()
            total.backward()
            opt.step()
            usage += torch.bincount(winners, minlength=K).cpu()
            for key, value in zip(sums, (route, bal, inter, out)):
                sums[key] += float(value.detach()) * len(batch)
        record = {"epoch": epoch + 1, **{k: round(v / len(examples), 5) for k, v in sums.items()},
                  "usage": [round(u / len(examples), 3) for u in usage.tolist()]}
        history.append(record)
        log.info("%s epoch %d: routed loss %.4f, L_bal %.4f, L_inter %.4f, L_out %.4f, usage %s", label, epoch + 1,
                 record["routed"], record["bal"], record["inter"], record["out"], record["usage"])
        if K > 1 and min(record["usage"]) < 1 / (4 * K):
            log.warning("%s epoch %d: expert usage %s has an expert below 1/(4K): it is collapsing", label, epoch + 1, record["usage"])
        checkpoints.save(stage, epoch + 1, p, opt, gen, {"history": history})
    return {k: v.detach() for k, v in p.items()}, history


def fit_probe(session, examples, pca_states: torch.Tensor, basis: torch.Tensor, hp: dict[str, Any],
              gen: torch.Generator) -> tuple[dict, list]:
    """Calibrator g_phi: task loss under h + delta_phi(h) plus lambda_off R_off (eq:cal_objective, eq:offsub_penalty)."""
    from tqdm import tqdm

    p = _lowrank_params(1, session.hidden_size, hp["probe_rank"], hp["init_scale"], gen, session.site_device)
    p = {"probe_U": p["U"][0].detach().requires_grad_(), "probe_V": p["V"][0].detach().requires_grad_(),
         "probe_b": p["b"][0].detach().requires_grad_()}
    opt = torch.optim.Adam(p.values(), lr=hp["lr"])
    state_scale = pca_states.pow(2).sum(-1).mean()  # normalises R_off (see the module docstring)
    checkpoints = session.checkpoints
    done, state, _ = checkpoints.restore("probe", p, opt, gen)
    history = state.get("history", [])
    for epoch in range(done, hp["epochs"]):
        sums = {"task": 0.0, "off": 0.0}
        for step, idx in enumerate(tqdm(_batches(len(examples), hp["batch_size"], gen), desc=f"probe epoch {epoch + 1}", leave=False)):
            batch = [examples[i] for i in idx]
            task = torch.stack([task_losses(session.run(ex, [0], lambda h, ids: h + probe_delta(h, like(p, h))).logprobs,
                                            ex.gold)[0] for ex in batch]).mean().to(session.site_device)
            off = offsubspace_penalty(probe_delta(pca_states, p), basis).mean() / state_scale
            total = task + hp["lambda_off"] * off
            _check_finite(total, "probe", epoch, step, [ex.id for ex in batch])
            opt.zero_grad()
            total.backward()
            opt.step()
            sums["task"] += float(task.detach()) * len(batch)
            sums["off"] += float(off.detach()) * len(batch)
        record = {"epoch": epoch + 1, **{k: round(v / len(examples), 5) for k, v in sums.items()}}
        history.append(record)
        log.info("probe epoch %d: task loss %.4f, R_off %.4f", epoch + 1, record["task"], record["off"])
        checkpoints.save("probe", epoch + 1, p, opt, gen, {"history": history})
    return {k: v.detach() for k, v in p.items()}, history


@torch.no_grad()
def calibrate(session, examples, tensors: dict[str, torch.Tensor], hp: dict[str, Any]) -> dict[str, Any]:
    """Energies of D_ctrl, applicability labels (routed expert and single adapter), routing agreement."""
    from tqdm import tqdm

    K = tensors["expert_U"].shape[0]
    has_single = "single_U" in tensors
    variants = [runner.BASE, *range(K), *([K] if has_single else []), K + 1]
    layers = list(range(session.layer, session.num_layers))
    energies, applicable, applicable_single, agrees = [], [], [], []
    def edit(h, ids):
        return apply_variants(like(tensors, h), hp, h, ids)

    for ex in tqdm(examples, desc="calibrating the energy gate on D_ctrl", leave=False):
        run = session.run(ex, variants, edit, capture=layers, site_only=[K + 1])
        energies.append(float(run_energy(run, K + 1, layers)))
        expert_rows = [run.row(k) for k in range(K)]
        if ex.gold is None:  # generation: route as inference does, over the first T_ent greedy steps
            u = runner.routing_entropy(session.model, ex.context, list(range(K)), session.edits(edit), hp["T_ent"])
        else:
            u = option_entropy(run.logprobs[expert_rows])
        losses = task_losses(run.logprobs, ex.gold)
        routed = int(u.argmin())
        applicable.append(bool(losses[expert_rows[routed]] < losses[run.row(runner.BASE)]))
        if has_single:
            applicable_single.append(bool(losses[run.row(K)] < losses[run.row(runner.BASE)]))
        agrees.append(routed == int(losses[expert_rows].argmin()))  # Appendix C.2: entropy vs lowest-loss expert
    bad = [ex.id for ex, e in zip(examples, energies) if not math.isfinite(e)]
    if bad:  # tau_E would be NaN (every gate comparison False) or infinite: refuse, naming the examples
        raise FloatingPointError(
            f"gate calibration: the propagation energy E(x) is not finite for {len(bad)} of {len(energies)} D_ctrl "
            f"examples ({', '.join(bad[:8])}{', ...' if len(bad) > 8 else ''}); the probe's or the model's states "
            "overflowed there. Retrain with a lower --lr (or in float32, --dtype float32), or inspect these examples")
    out = {
        "ctrl_energy": torch.tensor(energies),
        "ctrl_applicable": torch.tensor(applicable, dtype=torch.uint8),
        "ctrl_applicable_single": torch.tensor(applicable_single or applicable, dtype=torch.uint8),
    }
    out["routing_agreement"] = sum(agrees) / max(1, len(agrees))
    return out


def training_hyperparameters(cls, given: dict[str, Any], max_pca: int | None = None) -> dict[str, Any]:
    """DEFAULTS completed by ``given`` (``single``: also train the one-adapter ablation), checked
    as the bundle will be; a D_pca subset smaller than the PCA rank is refused too."""
    unknown = set(given) - set(DEFAULTS) - {"single"}
    if unknown:
        raise ValueError(f"unknown MARI hyperparameters {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    if type(given.get("single", False)) is not bool:
        raise ValueError(f"MARI hyperparameter single={given['single']!r}: use true or false (--single)")
    hp = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None and k != "single"}}
    check_hyperparameters(cls, hp, "MARI hyperparameters")  # the bundle would be refused
    if max_pca is not None and max_pca < hp["pca_rank"]:
        raise ValueError(f"--max-pca {max_pca} is below the PCA rank pca_rank={hp['pca_rank']}: the gate's subspace "
                         f"needs at least that many D_pca prompts; raise --max-pca or lower it with --set pca_rank=N")
    return hp


def fit_mari(cls, session, data, config, hyperparameters, seed):
    """PCA basis, experts, single adapter, probe, gate calibration: a complete MARI bundle."""
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
    agreement = cal.pop("routing_agreement")
    tensors.update(cal)
    tau = energy_threshold(cal["ctrl_energy"], cal["ctrl_applicable"], hp["rho"])
    applicable = cal["ctrl_applicable"].bool()
    config = {
        **config,
        "hyperparameters": hp,
        "gate": {"tau_E": tau, "rho": hp["rho"], "quantile": "rho-quantile of non-applicable D_ctrl energies",
                 "n_ctrl": int(applicable.numel()), "n_applicable": int(applicable.sum()),
                 "ctrl_sources": data.ctrl_source},
        "diagnostics": {"training": logs, "ctrl_routing_agreement": agreement},
    }
    log.info("gate: tau_E %.4f (rho %.2f), %d/%d control examples applicable, routing agreement %.3f",
             tau, hp["rho"], int(applicable.sum()), applicable.numel(), agreement)
    return cls(config, {k: v.detach().contiguous() for k, v in tensors.items()})

