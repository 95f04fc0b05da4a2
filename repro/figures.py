"""The paper's diagnostic Figures 1, 5a, 5b and 6 from our TruthfulQA MARI bundles, with the numbers
behind each picture (issue 42).

    python repro/figures.py [--profile quick|standard|large|paper|smoke] [--model ID] [--seeds 0]
    python repro/figures.py --plan --profile budget  # its bundles and their cost; runs nothing

``--plan`` prices the bundles it needs (the main table's); the figures' own pass over D_train and
D_ctrl under each bundle is not a cached step and is not priced (minutes on 2 CPU cores).

For each model and seed: the main table's TruthfulQA MARI bundle (the same cache under runs/)
and the examples it was trained and calibrated on, rebuilt from its recorded splits (refused
if they differ from the ids the bundle recorded). Statistics and the choices the paper leaves
open: repro/plots/figure_stats.py.

* Figure 1 (Section 3.1, eq:mot_delta): for D_train's TruthfulQA questions (and D_ctrl's
  attribute ones) that the frozen model answers wrongly (its highest-likelihood option y_hat
  is not y*), the correction Delta(x) = a(x, y*) - a(x, y_hat), a(x, y) the mean state after
  l* over option y's tokens; sorted along t(x) = PC1 of a(x, y_hat), window-wise medians and
  bands of the strength ||Delta|| and of the directional dispersion.
* Figure 5a: every expert's update gamma U_k (V_k^T h + b_k) (eq:act_lowrank) at the frozen
  states h at (l*, p*) of D_ctrl, projected on v_global; the distribution per expert and a
  test of whether they differ.
* Figure 5b: D_ctrl's applicable and non-applicable examples under each labelling the bundle
  holds (mari_eval/mari/gate_labels.py): the energy E(x) (eq:prop_energy_def, as the gate
  computes it) against PC1 of the frozen states at (l*, p*); the AUROC of each with an interval
  (PC1's sign is arbitrary: its AUROC is reported as the larger of a and 1 - a).
* Figure 6: the state at p* after the last layer before and after MARI's intervention as
  evaluation applies it (the gate, then the routed expert; a closed gate leaves it unchanged)
  on D_ctrl, the normalized mean shift of applicable and non-applicable examples per labelling
  with intervals, beside the paper's 119.76 and 10.22.

Writes results/figures.{json,md} and results/figure1.png, figure5a.png, figure5b.png, figure6.png.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mari_eval.injection import site
from mari_eval.training.examples import attribute_data
from mari_eval.storage.files import atomic_write, write_results_json
from mari_eval.methods import load_bundle
from mari_eval.injection.plan import BASE
from mari_eval.evaluation.prefix_cache import Prefix, PrefixCache, broadcast_cache, with_cache
from mari_eval.training.session import Session
from repro.engine import cache, command_line, planning, profiles, steps
from repro.plots import figure_plots, figure_stats
from repro.analysis.tables import markdown_table

PAPER_SHIFT = {"applicable": 119.76, "non_applicable": 10.22}  # Figure 6's normalized mean shifts (Section 5)
STATES = "_states"  # a seed's states before and after the intervention: drawn in figure6.png, not written


@torch.no_grad()
def option_states(model: torch.nn.Module, layer: int, context: list[int], options: list[list[int]],
                  prefixes: PrefixCache | None = None) -> tuple[int, torch.Tensor]:
    """(the option with the highest summed log-likelihood, [M, d] each option's mean state after
    ``layer`` over its own tokens), the options as one right-padded batch after ``context``. With
    ``prefixes``, the frozen keys and values of the context before its last token come from that
    cache (the few-shot preamble computed once for every question), the rest runs over them."""
    prefix = prefixes.encode(context[:-1]) if prefixes is not None else Prefix((), None)
    past = len(prefix.tokens)
    rows = [context[past:] + o for o in options]
    width = max(map(len, rows))
    device = next(model.parameters()).device
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
    mask = torch.tensor([[1] * (past + len(r)) + [0] * (width - len(r)) for r in rows], device=device)
    start = len(context) - past  # the first option token's position among the rows' tokens
    where = [(i, start + j) for i, o in enumerate(options) for j in range(len(o))]
    positions = (torch.tensor([i for i, _ in where]), torch.tensor([c for _, c in where]))
    past_cache = broadcast_cache(prefix.cache, len(rows)) if prefix.cache is not None else None
    with site.capture_site(model, [layer], positions) as seen:
        logits = model(input_ids=ids, attention_mask=mask, **with_cache(model, past_cache)).logits.float()
    logp = torch.log_softmax(logits, -1)
    scores = [sum(float(logp[i, start + j - 1, t]) for j, t in enumerate(o)) for i, o in enumerate(options)]
    states = seen[layer].float().cpu().split([len(o) for o in options])
    return max(range(len(options)), key=scores.__getitem__), torch.stack([s.mean(0) for s in states])


def figure1(session: Session, examples) -> dict:
    wrong_delta, wrong_state = [], []
    prefixes = PrefixCache(session.model)  # the shared few-shot preamble, encoded once
    for ex in tqdm(examples, desc="figure 1: option states", leave=False):
        chosen, states = option_states(session.model, session.layer, ex.context, ex.options, prefixes)
        if chosen != ex.gold:
            wrong_delta.append(states[ex.gold] - states[chosen])
            wrong_state.append(states[chosen])
    out = {"questions": len(examples), "wrong": len(wrong_delta), "layer": session.layer, "windows": []}
    if len(wrong_delta) >= 2:
        deltas = torch.stack(wrong_delta)
        t = figure_stats.first_component(torch.stack(wrong_state))
        strength = deltas.double().norm(dim=-1)
        out.update(t=t.tolist(), strength=strength.tolist(), windows=figure_stats.windows(t, deltas),
                   strength_cv=float(strength.std() / strength.mean()),
                   dispersion_overall=float(figure_stats.directional_dispersion(deltas).median()))
    return out


def gate_states(session: Session, bundle, ctrl) -> dict[str, torch.Tensor]:
    """Each D_ctrl example under the bundle's evaluation plan: the frozen state at (l*, p*), the
    last layer's state at p* before and after the intervention, the gate's energy and verdict."""
    plan, last = bundle.plan(session.model), session.num_layers - 1
    out: dict[str, list] = {"hidden": [], "before": [], "after": [], "energy": [], "open": []}
    for ex in tqdm(ctrl, desc="figures 5 and 6: D_ctrl under the bundle", leave=False):
        run = session.score(ex, plan)
        variant, record = bundle.choose(run)
        out["hidden"].append(ex.hidden.float().cpu())
        out["before"].append(run.site[last][run.row(BASE)].float().cpu())
        out["after"].append(run.site[last][run.row(variant)].float().cpu())
        out["energy"].append(record["energy"])
        out["open"].append(record["gate_open"])
    return {k: torch.stack(v) if k in ("hidden", "before", "after") else torch.tensor(v) for k, v in out.items()}


def figure5a(bundle, hidden: torch.Tensor) -> dict:
    n, k = len(hidden), bundle.K
    h = hidden.repeat_interleave(k, 0).to(bundle.tensors["expert_U"].dtype)
    updates = (bundle.edit_variants(h, torch.arange(k).repeat(n)) - h).reshape(n, k, -1)
    projected, _ = figure_stats.projections(updates)
    experts = [{"expert": j, "mean": float(projected[:, j].mean()), "std": float(projected[:, j].std()),
                **{f"q{int(q * 100)}": float(projected[:, j].quantile(q)) for q in (0.1, 0.5, 0.9)}} for j in range(k)]
    return {"inputs": n, "experts": experts, "test": figure_stats.experts_differ(projected),
            "projections": projected.tolist()}


def figure5b_and_6(bundle, states: dict[str, torch.Tensor], pc1: torch.Tensor) -> tuple[dict, dict]:
    five_b, six = {}, {}
    for labels in bundle.control_separation():  # the labellings this bundle holds
        applicable = bundle.applicable(labels).bool()
        energy = figure_stats.auroc_interval(states["energy"], applicable)
        pc = figure_stats.auroc_interval(pc1, applicable)
        if pc["value"] is not None and pc["value"] < 0.5:  # PC1's sign is arbitrary: the orientation that separates
            pc = figure_stats.auroc_interval(-pc1, applicable)
        five_b[labels] = {"auroc_energy": energy, "auroc_pc1": pc, "applicable": applicable.tolist()}
        six[labels] = {}
        for name, members in (("applicable", applicable), ("non_applicable", ~applicable)):
            before, after = states["before"][members], states["after"][members]
            shift = figure_stats.normalized_shift(before, after)
            low, high = figure_stats.bootstrap(lambda i: figure_stats.normalized_shift(before[i], after[i]), len(before)) \
                if len(before) > 1 else (float("nan"), float("nan"))
            six[labels][name] = {"shift": shift, "low": low, "high": high, "n": int(members.sum()),
                                 "gate_rate": float(states["open"][members].float().mean()) if members.any() else None,
                                 "paper": PAPER_SHIFT[name]}
    return five_b, six


def plan(profile: profiles.Profile, store: cache.Store) -> steps.Graph:
    """``run``'s cached work as a graph of steps (repro/engine/planning.py): the TruthfulQA MARI bundles."""
    graph = steps.Graph()
    for model in profile.models:
        for seed in profile.seeds:
            planning.train_step(graph, store, profile, "mari", "truthfulqa", model, seed)
    return graph


def run(profile: profiles.Profile, store: cache.Store) -> dict:
    out: dict = {}
    for model in profile.models:
        for seed in profile.seeds:
            bundle_dir = store.bundle("mari", "truthfulqa", model, seed, profile)
            bundle = load_bundle(bundle_dir)
            config = json.loads((bundle_dir / "repro_config.json").read_text())
            session = Session(model, layer=bundle.layer, placement=store.placement, max_memory=store.max_memory)
            data = attribute_data(session, "truthfulqa", seed, max_train=config["max_train"],
                                  max_ctrl=config.get("max_ctrl"), max_pca=profile.max_pca)
            recorded = bundle.config["splits"]
            if [ex.id for ex in data.ctrl] != recorded["ctrl_used"] or [ex.id for ex in data.train] != recorded["train_used"]:
                raise SystemExit(f"figures.py: the examples rebuilt for {bundle_dir} are not the ones it recorded "
                                 "(splits.train_used, splits.ctrl_used): its data or the code that splits it changed "
                                 "since it was trained; delete that directory (the next run retrains it)")
            data.prepare_ctrl(session)
            states = gate_states(session, bundle, data.ctrl)
            stored = bundle.tensors["ctrl_energy"].double()
            drift = float(((states["energy"].double() - stored).abs() / stored.abs().clamp_min(1e-6)).max())
            if drift > 1e-2:
                raise SystemExit(f"figures.py: {bundle_dir}'s stored control energies differ from the ones its gate "
                                 f"computes here by up to {drift:.1%}: the bundle does not match this model or "
                                 "placement; retrain it (delete the directory) or run with the placement it was trained in")
            attribute = [ex for ex, s in zip(data.ctrl, data.ctrl_source) if s == "attribute"]
            pc1 = figure_stats.first_component(states["hidden"])
            five_b, six = figure5b_and_6(bundle, states, pc1)
            out.setdefault(model, {})[str(seed)] = {
                "bundle": bundle_dir.name, "layer": bundle.layer, "K": bundle.K, "ctrl_examples": len(data.ctrl),
                "ctrl_sources": data.ctrl_source, "energy_drift": drift, "energy": states["energy"].tolist(),
                "pc1": pc1.tolist(), "figure1": figure1(session, data.train + attribute),
                "figure5a": figure5a(bundle, states["hidden"]), "figure5b": five_b, "figure6": six,
                STATES: {k: states[k] for k in ("before", "after")}}  # for the plots; not written
    return out


def _interval(cell: dict, key: str = "value") -> str:
    value = cell.get(key)
    if value is None or value != value:  # no example in the class
        return "-"
    low, high = cell.get("low"), cell.get("high")
    return f"{value:.3f} [{low:.3f}, {high:.3f}]" if low is not None and high == high else f"{value:.3f}"


def markdown(record: dict) -> str:
    lines = ["# Figures 1, 5a, 5b and 6 from our bundles", "", f"Generated by `{record['command']}` (profile "
             f"{record['profile']}, {record['compute_time_s']:.0f} s). Definitions and choices: repro/figures.py, "
             "repro/plots/figure_stats.py; intervals: 95% percentile bootstrap over examples.", ""]
    for model, seeds in record["models"].items():
        for seed, r in seeds.items():
            f1, f5a = r["figure1"], r["figure5a"]
            lines += [f"## {model}, seed {seed} (bundle {r['bundle']}, l* = {r['layer']}, K = {r['K']}, "
                      f"D_ctrl {r['ctrl_examples']} examples)", "",
                      f"**Figure 1** (figure1.png): {f1['wrong']} of {f1['questions']} TruthfulQA questions answered "
                      f"wrongly by the frozen model; strength ||Delta||: coefficient of variation "
                      f"{f1.get('strength_cv', float('nan')):.2f}; directional dispersion (1 - cos to the mean "
                      f"correction), median {f1.get('dispersion_overall', float('nan')):.3f}.", "",
                      markdown_table(["window (median t)", "n", "strength median [25%, 75%]", "dispersion median [25%, 75%]"],
                                     [[f"{w['t']:.2f}", str(w["n"]),
                                       f"{w['strength']['median']:.2f} [{w['strength']['low']:.2f}, {w['strength']['high']:.2f}]",
                                       f"{w['dispersion']['median']:.3f} [{w['dispersion']['low']:.3f}, {w['dispersion']['high']:.3f}]"]
                                      for w in f1["windows"]]), "",
                      f"**Figure 5a** (figure5a.png): each expert's update projected on v_global over {f5a['inputs']} "
                      f"D_ctrl inputs; {f5a['test']['test']} test that the experts' distributions are one: "
                      f"p = {'-' if f5a['test']['p'] is None else format(f5a['test']['p'], '.2g')}.", "",
                      markdown_table(["expert", "mean", "std", "10%", "50%", "90%"],
                                     [[str(e["expert"]), f"{e['mean']:.3f}", f"{e['std']:.3f}", f"{e['q10']:.3f}",
                                       f"{e['q50']:.3f}", f"{e['q90']:.3f}"] for e in f5a["experts"]]), "",
                      "**Figures 5b and 6** (figure5b.png, figure6.png), per applicability labelling of D_ctrl:", "",
                      markdown_table(["labels", "applicable / not", "AUROC E(x)", "AUROC PC1(h)", "shift applicable",
                                      "shift non-applicable", "gate rate applicable / not", "paper shift"],
                                     [[labels, f"{b['auroc_energy']['n_applicable']} / {b['auroc_energy']['n_non_applicable']}",
                                       _interval(b["auroc_energy"]), _interval(b["auroc_pc1"]),
                                       _interval(r["figure6"][labels]["applicable"], "shift"),
                                       _interval(r["figure6"][labels]["non_applicable"], "shift"),
                                       " / ".join("-" if r["figure6"][labels][c]["gate_rate"] is None
                                                  else f"{r['figure6'][labels][c]['gate_rate']:.2f}"
                                                  for c in ("applicable", "non_applicable")),
                                       f"{PAPER_SHIFT['applicable']} / {PAPER_SHIFT['non_applicable']}"]
                                      for labels, b in r["figure5b"].items()]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, profile, store, command = command_line.start(__doc__, "figures.py", argv, planning.add_arguments)
    started = time.time()
    title = f"figures, profile {profile.name}, {len(profile.models)} model(s), seeds {profile.seeds}"
    if planning.before_the_table(args, lambda: plan(profile, store), title, store, profile):
        return 0
    models = run(profile, store)
    states = {(model, seed): r.pop(STATES) for model, seeds in models.items() for seed, r in seeds.items()}
    record = {"profile": profile.name, "command": command, "compute_time_s": time.time() - started, "models": models}
    out = Path(args.out)
    write_results_json(out / "figures.json", record)
    atomic_write(out / "figures.md", markdown(record) + "\n")
    figure_plots.draw(models, states, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
