"""MARI: K competitive low-rank experts at one site, entropy routing and an energy gate.

Equation labels refer to ../shared/paper/MARI.tex (Section 4 and Appendices A-B). The
equations are in ``mari_eval.mari.equations`` (with the reading of tau_E the paper leaves
ambiguous), training in ``mari_eval.mari.fit`` (with the applicability labels).

Variant ids (see mari_eval.evaluation.runner): experts are 0..K-1; ``SINGLE`` (= K) is the
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
* alpha_probe = 1: the probe is trained and used as h + alpha_probe delta_phi(h)
  (eq:probe_update at training as at calibration and inference), so at strength 1 it is a
  task-sized update. The paper calls the update "small" and its analysis is first-order in
  alpha (eq:energy_nonapp_compact_main); repro/sensitivity.py measures alpha_probe = 0.1, 0.3
  and 1 twice: retrained at each (--alphas), and over the one probe trained at 1, injected at
  each strength at inference (probe_alpha=..., --probe-alphas). Calibration stores E(x; alpha)
  of D_ctrl at fit.PROBE_ALPHAS and the trained alpha (gate.probe_alphas), so that
  ``probe_alpha=A`` recomputes tau_E from the energies at A.
* T_ent = 8 greedy steps for generation routing (eq:entropy_gen).
* labels = "loss": a control example is applicable when the routed expert lowers its task
  loss (the paper's text); "flip" and "source" are the other readings (mari_eval.mari.gate_labels),
  stored in every bundle and selectable at evaluation (labels=...), like rho.
* Median of an even number of layers: the mean of the two middle values.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mari_eval.evaluation import runner
from mari_eval.methods.bundle_spec import Bool, Float, Int, List, Obj, Str, TensorSpec
from mari_eval.methods.intervention import Intervention
from mari_eval.mari import fit as mari_fit, gate_labels
from mari_eval.mari.equations import (apply_variants, energy_threshold, gate_open, option_entropy, probe_variant,
                                      run_energy)
from mari_eval.methods.options import Option, as_int
from mari_eval.injection.plan import Plan
from mari_eval.methods.registry import register_method

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
    "labels": "loss",
    "init_scale": 0.01,
    # Self-Instruct seed tasks added to D_ctrl's general controls (training.examples.REQUEST_SOURCE; issue 81.2):
    # 0 is the paper's calibration (held-out attribute examples, ARC-Easy and MMLU), the default.
    "gate_requests": 0,
}


# ----------------------------------------------------------------------------- method


@register_method("mari")
class MARI(Intervention):
    """A trained MARI bundle. Tensors: expert_U/V [K, d, r], expert_b [K, r], single_U/V/b,
    probe_U/V [d, r_p], probe_b [r_p], pca_basis [d, k], ctrl_energy [N], ctrl_applicable [N],
    ctrl_applicable_single [N], ctrl_flip [N], ctrl_flip_single [N] (gate_labels), ctrl_energy_by_alpha
    [n_alpha, N] (E(x; alpha) of the trained probe at each gate.probe_alphas; absent from older bundles)."""

    # bundle.json (bundle_spec.check_bundle): what inference reads is required; training's record when present.
    hyperparameter_fields = {
        "K": Int(1), "rank": Int(1), "probe_rank": Int(1), "pca_rank": Int(1),
        "rho": Float(0, 1, lo_open=True), "labels": Str(optional=True, choices=gate_labels.LABELINGS),
        "gamma": Float(), "alpha_full": Float(), "alpha_probe": Float(), "T_ent": Int(1),
        "lr": Float(0, lo_open=True, optional=True), "epochs": Int(0, optional=True), "batch_size": Int(1, optional=True),
        "T_bal": Float(0, lo_open=True, optional=True), "init_scale": Float(0, optional=True),
        "gate_requests": Int(0, 175, optional=True),
        **{name: Float(0, optional=True) for name in ("lambda_bal", "lambda_inter", "lambda_out", "lambda_off")},
    }
    label = "MARI"
    # `mari-eval train`: every hyperparameter above (DEFAULTS completes them), and single (also
    # train the one-adapter ablation; mari-eval train --single).
    training_fields = {**{k: v for k, v in hyperparameter_fields.items() if k in DEFAULTS}, "single": Bool(optional=True)}
    training_defaults = DEFAULTS
    config_fields = {
        "gate": Obj({"tau_E": Float(finite=False, optional=True),  # -inf: no non-applicable example, always intervene
                     "rho": Float(0, 1, lo_open=True, optional=True), "n_ctrl": Int(0, optional=True),
                     "labels": Str(optional=True, choices=gate_labels.LABELINGS),
                     "n_applicable": Int(0, optional=True), "quantile": Str(optional=True),
                     "ctrl_sources": List(Str(), optional=True),
                     # the probe strengths of ctrl_energy_by_alpha's rows (fit.probe_alpha_grid)
                     "probe_alphas": List(Float(0, lo_open=True), optional=True)}, optional=True),
    }

    @classmethod
    def tensor_spec(cls, config, names):
        hp = config["hyperparameters"]
        alphas = (config.get("gate") or {}).get("probe_alphas")
        sizes = {"K": hp["K"], "rank": hp["rank"], "probe_rank": hp["probe_rank"], "pca_rank": hp["pca_rank"],
                 "hidden_size": config["base_model"]["hidden_size"]}
        if alphas is not None or "ctrl_energy_by_alpha" in names:  # energies without their strengths: refused
            sizes["n_probe_alphas"] = len(alphas or ())
        lowrank = lambda n: {"U": (n, "hidden_size", "rank"), "V": (n, "hidden_size", "rank"), "b": (n, "rank")}
        specs = {f"expert_{k}": TensorSpec(shape) for k, shape in lowrank("K").items()}
        # The one-adapter ablation (`mari-eval train --single`): all three tensors or none.
        specs.update({f"single_{k}": TensorSpec(shape, optional=not any(n.startswith("single_") for n in names))
                      for k, shape in lowrank(1).items()})
        specs.update(probe_U=TensorSpec(("hidden_size", "probe_rank")), probe_V=TensorSpec(("hidden_size", "probe_rank")),
                     probe_b=TensorSpec(("probe_rank",)), pca_basis=TensorSpec(("hidden_size", "pca_rank")),
                     ctrl_energy=TensorSpec(("n_ctrl",)), ctrl_applicable=TensorSpec(("n_ctrl",), "int"),
                     ctrl_applicable_single=TensorSpec(("n_ctrl",), "int"),
                     # Bundles trained before the flip labels were recorded have none (labels=flip refused).
                     ctrl_flip=TensorSpec(("n_ctrl",), "int", optional=True),
                     ctrl_flip_single=TensorSpec(("n_ctrl",), "int", optional=True),
                     # Bundles trained before the fixed-probe grid was recorded have neither (probe_alpha= refused).
                     ctrl_energy_by_alpha=TensorSpec(("n_probe_alphas", "n_ctrl"), optional=alphas is None))
        return sizes, specs

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], *, checked: bool = False):
        super().__init__(config, tensors, checked=checked)  # checks config and tensors unless checked
        hp = config["hyperparameters"]
        self.K = int(hp["K"])
        self.configure()

    # ------------------------------------------------------------------ runtime options

    option_fields = {"gate": Option(bool, "gate=false"), "rho": Option(float, "rho=0.9"),
                     "labels": Option(str, "labels=loss, labels=flip or labels=source"),
                     "experts": Option(str, "experts=routed, experts=single or experts=0"),
                     "probe_alpha": Option(float, "probe_alpha=0.1", finite=True), "T_ent": Option(int, "T_ent=1")}

    def configure(self, gate: bool = True, rho: float | None = None, experts: str = "routed",
                  labels: str | None = None, probe_alpha: float | None = None, T_ent: int | None = None) -> None:
        """Ablation switches (lm_eval model_args): gate on/off, rho, the applicability labels tau_E
        is calibrated on (default: the bundle's), which experts answer, and the strength the
        gate's trained probe is injected at (default: alpha_probe, the one it was trained at).

        experts: "routed" (entropy routing over the K experts), "single" (the one-adapter
        ablation), or an expert index to force. T_ent: the greedy steps generation routes over
        (eq:entropy_gen; default the bundle's): the first token of a routed answer waits for them.
        """
        if experts not in ("routed", "single"):
            forced = as_int(experts, "experts", f"experts=routed, single or an expert index 0..{self.K - 1}")
            if not 0 <= forced < self.K:
                raise ValueError(f"experts={forced} is out of range: this bundle has K={self.K} experts (0..{self.K - 1})")
        if experts == "single" and "single_U" not in self.tensors:
            raise ValueError("experts=single: this bundle has no single adapter (train it with `mari-eval train --single`)")
        strength = self._probe_strength(probe_alpha)  # refused before any switch is changed
        if T_ent is not None and T_ent < 1:
            raise ValueError(f"T_ent={T_ent}: generation routes over at least one greedy step (T_ent >= 1)")
        self.T_ent = int(self.config["hyperparameters"]["T_ent"] if T_ent is None else T_ent)
        self.gate = bool(gate)
        self.experts = experts
        self.rho = float(self.config["hyperparameters"]["rho"] if rho is None else rho)
        if not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"rho={self.rho} must lie in [0, 1]")
        self.labels = labels if labels is not None else self.config["hyperparameters"].get("labels", "loss")
        applicable = self.applicable(self.labels, single=experts == "single")  # refuses unknown or missing labels
        self.probe_alpha, self.probe_index = strength
        self.tau = energy_threshold(self.calibration_energies, applicable, self.rho) if self.gate else -math.inf

    def _probe_strength(self, probe_alpha: float | None) -> tuple[float, int | None]:
        """(alpha the probe is injected at, its index in gate.probe_alphas; None: the trained alpha_probe)."""
        trained = float(self.config["hyperparameters"]["alpha_probe"])
        if probe_alpha is None or math.isclose(probe_alpha, trained, rel_tol=1e-9):
            return trained, None  # variant K + 1 and ctrl_energy: exactly the default evaluation
        stored = self.stored_probe_alphas
        if "ctrl_energy_by_alpha" not in self.tensors or stored is None:
            raise ValueError(f"probe_alpha={probe_alpha:g}: this bundle holds the control energies at its trained "
                             f"alpha_probe={trained:g} only (it was trained before the energies at other probe "
                             "strengths were recorded); retrain it with `mari-eval train`, or drop probe_alpha")
        index = next((j for j, a in enumerate(stored) if math.isclose(probe_alpha, a, rel_tol=1e-9)), None)
        if index is None:
            raise ValueError(f"probe_alpha={probe_alpha:g}: this bundle holds the control energies (for tau_E) at "
                             f"probe_alpha={', '.join(f'{a:g}' for a in stored)} only (gate.probe_alphas; its probe "
                             f"was trained at alpha_probe={trained:g}): use one of them")
        return float(stored[index]), index

    @property
    def stored_probe_alphas(self) -> list[float] | None:
        return (self.config.get("gate") or {}).get("probe_alphas")

    @property
    def calibration_energies(self) -> torch.Tensor:
        """E(x; alpha) of D_ctrl at the strength the probe is injected at (eq:prop_energy_def): tau_E's sample."""
        if self.probe_index is None:
            return self.tensors["ctrl_energy"]
        return self.tensors["ctrl_energy_by_alpha"][self.probe_index]

    def edit_fingerprint(self) -> str:
        """The bundle's alone: the options (gate, rho, labels, experts) choose which variants run and
        answer, and the gate's threshold, but never change a variant's edit; probe_alpha chooses
        another probe variant (a distinct id per stored strength, equations.probe_variant)."""
        return self.fingerprint()

    def applicable(self, labels: str, single: bool = False) -> torch.Tensor:
        """Which D_ctrl examples are applicable under ``labels`` (mari_eval.mari.gate_labels)."""
        return gate_labels.control_labels(self.tensors, self.ctrl_sources, labels, single)

    @property
    def ctrl_sources(self) -> list[str] | None:
        return (self.config.get("gate") or {}).get("ctrl_sources")

    @property
    def uses_base(self) -> bool:  # the gate compares the probe run with the base run, and falls back to it
        return self.gate

    @property
    def single_id(self) -> int:
        return self.K

    @property
    def probe_id(self) -> int:
        return probe_variant(self.K, self.probe_index)

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

    def plan(self, model: torch.nn.Module) -> Plan:
        """Every prompt's variants: BASE (when the gate reads it), the answering experts, and the
        gate's probe, run for its states alone after every layer from l* (eq:energy); a closed gate
        turns the experts away (``screen``); ``choose`` routes (eq:entropy_route); generation routes
        after ``routing_window`` greedy steps (eq:entropy_gen)."""
        variants = ([runner.BASE] if self.uses_base else []) + self.variants()
        return Plan(tuple(variants), lambda variant_ids, positions: self.applied(model, positions, variant_ids),
                    self.choose, capture=tuple(self.captured_layers()), site_only=tuple(self.site_only_variants()),
                    screen=self.screen if self.uses_base else None,
                    # several variants start from the untouched states at the site (runner.score_variants)
                    edit_layer=self.layer if len(variants) > 1 else None, window=self.routing_window)

    # ------------------------------------------------------------------ the edit

    def edit_variants(self, hidden: torch.Tensor, variant_ids: torch.Tensor) -> torch.Tensor:
        """h + alpha gamma s_k U_k (V_k^T h + b_k) per row (eq:act_phi, eq:act_lowrank); probe rows get
        h + alpha delta_phi(h) (eq:probe_update), alpha_probe or a stored probe_alpha by id; BASE rows pass through."""
        return apply_variants(self.tensors_like(hidden), self.config["hyperparameters"], hidden, variant_ids,
                              self.stored_probe_alphas or ())

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
        if variant == self.probe_id:
            return "the gate's probe" + ("" if self.probe_index is None else f" (probe_alpha={self.probe_alpha:g})")
        return super().variant_name(variant) if variant == runner.BASE else f"expert {variant}"

    @property
    def routing_window(self) -> int:  # eq:entropy_gen's T_ent (the bundle's, or the T_ent= option)
        return self.T_ent

    def record_outcome(self, record: dict[str, Any], run: runner.VariantRun, gold: set[int]) -> None:
        """Appendix C.2: does the entropy choice pick an expert whose answer is correct? (Asked
        only when the experts ran and some expert answers correctly.)"""
        answering = self.answering_variants()
        if "expert" not in record:
            return
        correct = [int(run.logprobs[run.row(v)].argmax()) in gold for v in answering]
        if any(correct):
            record["routing_agrees"] = bool(correct[answering.index(record["expert"])])

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
            "T_ent": self.T_ent,
            "expert_usage": {k: v / max(1, sum(usage.values())) for k, v in usage.items()},
            "expert_counts": usage,
        }
        if self.gate:  # no prompt seen: no rate (not 0)
            out.update(rho=self.rho, labels=self.labels, tau_E=self.tau, probe_alpha=self.probe_alpha,
                       alpha_probe_trained=float(self.config["hyperparameters"]["alpha_probe"]),
                       gate_rate=sum(r["gate_open"] for r in records) / n if n else None)
            if self.probe_index is not None:
                out["energy_linearity"] = self.energy_linearity()
        agree = [r["routing_agrees"] for r in records if r.get("routing_agrees") is not None]
        if agree:
            out["routing_agreement"] = sum(agree) / len(agree)
            out["routing_agreement_n"] = len(agree)
        out["control_energies"] = self.control_energy_summary()
        out["control_separation"] = self.control_separation()
        return out

    def energy_linearity(self) -> float | None:
        """Median over D_ctrl of E(x; probe_alpha) / ((probe_alpha / alpha_probe) E(x; alpha_probe)): 1 where the
        energy is first-order in the probe's strength (eq:first_order_expand_app); None without a positive energy."""
        trained = float(self.config["hyperparameters"]["alpha_probe"])
        at, base = self.calibration_energies.double(), self.tensors["ctrl_energy"].double()
        ratio = at[base > 0] / (self.probe_alpha / trained * base[base > 0])
        return float(ratio.median()) if ratio.numel() else None

    def control_separation(self) -> dict[str, Any]:
        """Per labelling the bundle holds: how well energy (at the probe strength in use) separates
        applicable from non-applicable D_ctrl examples (AUROC over all, and within each source; gate_labels)."""
        out = {}
        for labels in gate_labels.LABELINGS:
            try:
                applicable = self.applicable(labels)
            except ValueError:  # not recorded in this (older) bundle
                continue
            out[labels] = gate_labels.separation(self.calibration_energies, applicable, self.ctrl_sources)
        return out

    def control_energy_summary(self) -> dict[str, Any]:
        e, a = self.calibration_energies, self.applicable(self.labels)
        def stats(x):
            return {"n": int(x.numel()), "mean": float(x.mean()) if x.numel() else None,
                    "median": float(x.median()) if x.numel() else None}
        return {"applicable": stats(e[a]), "non_applicable": stats(e[~a])}

    @classmethod
    def training_hyperparameters(cls, given, max_pca=None):
        """The shared check (``Intervention.training_hyperparameters``), less ``single`` (which
        ``fit`` reads from what was given); a D_pca subset below the PCA rank is refused too."""
        hp = super().training_hyperparameters(given)
        hp.pop("single", None)
        if max_pca is not None and max_pca < hp["pca_rank"]:
            raise ValueError(f"--max-pca {max_pca} is below the PCA rank pca_rank={hp['pca_rank']}: the gate's "
                             f"subspace needs at least that many D_pca prompts; raise --max-pca or lower it with "
                             f"--set pca_rank=N")
        return hp

    @classmethod
    def fit(cls, session, data, config, hyperparameters, seed):
        return mari_fit.fit_mari(cls, session, data, config, hyperparameters, seed)
