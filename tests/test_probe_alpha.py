"""alpha_probe varied at inference over one fixed probe (issue 36.7c): calibration stores the D_ctrl
energies E(x; alpha) of the trained probe at a grid of strengths (eq:probe_update,
eq:prop_energy_def), and ``probe_alpha=A`` injects that probe at A and recomputes tau_E from the
energies at A, beside the retrained alpha_probe sweep."""

import dataclasses
import json
import math
import statistics

import pytest
import torch
from safetensors.torch import load_file, save_file

from mari_eval import mari, methods
from mari_eval.injection import site
from mari_eval.mari import gate_labels
from mari_eval.mari import equations as mari_equations
from mari_eval.mari import fit as mari_fit
from mari_eval.injection.plan import BASE

from .tiny import score_under, tiny_mari
from .helpers import DISTINCT_GROUPS, close, evaluate, lm_for
from .helpers import model, tokenizer, truthfulqa_requests  # noqa: F401 (fixtures)
from .tiny import tiny_model

GRID = [0.1, 0.3, 1.0]  # mari_fit.probe_alpha_grid(1.0): the strengths a default bundle stores


def _training():
    """A Session around tests/tiny.py's float32 Llama and an attribute's data: 10 training and 12
    control examples (6 held-out attribute ones, 6 general-capability ones)."""
    from mari_eval.training.train import AttributeData, Example

    from .tiny import tiny_session

    session = tiny_session(tiny_model("llama"))
    session.memory_budget = 2**30
    g = torch.Generator().manual_seed(4)
    make = lambda i: Example(f"ex{i}", torch.randint(1, 97, (9,), generator=g).tolist(),  # noqa: E731
                             [torch.randint(1, 97, (2,), generator=g).tolist() for _ in range(3)], i % 3,
                             question=f"q{i}", choices=["a", "b", "c"])
    data = AttributeData("tiny", None, [torch.randint(1, 97, (6,), generator=g).tolist() for _ in range(20)],
                         [make(i) for i in range(10)], [make(10 + i) for i in range(12)], ["attribute"] * 6 + ["arc_easy"] * 6)
    config = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1}}
    return session, data, config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(bundle directory, the control examples, the model): a MARI trained on the tiny model, saved."""
    session, data, config = _training()
    bundle = mari.MARI.fit(session, data, config, {"K": 2, "epochs": 1, "pca_rank": 4, "lr": 2e-2}, seed=0)
    return bundle.save(tmp_path_factory.mktemp("probe_alpha") / "mari"), data.ctrl, session.model


def _energy_by_hand(tiny, bundle, context, alpha):
    """E(x; alpha) of eq:prop_energy_def: the median over layers l*..L of ||h^(alpha,m) - h^(m)|| at p*,
    the probe injected as h + alpha delta_phi(h) at (l*, p*), each run on its own."""
    ids, pos = torch.tensor([context]), torch.tensor([len(context) - 1])
    layers = list(range(bundle.layer, 4))
    probe = lambda h: h + alpha * mari_equations.probe_delta(h, bundle.tensors)  # noqa: E731
    with torch.no_grad():
        with site.capture_site(tiny, layers, pos) as base:
            tiny(input_ids=ids)
        with site.edit_site(tiny, bundle.layer, probe, pos), site.capture_site(tiny, layers, pos) as probed:
            tiny(input_ids=ids)
    return statistics.median(float((probed[m] - base[m]).norm()) for m in layers)


def test_training_stores_the_energies_of_its_one_probe_at_every_strength_of_the_grid(trained):
    path, ctrl, tiny = trained
    config = json.loads((path / methods.BUNDLE_JSON).read_text())
    assert config["gate"]["probe_alphas"] == GRID == mari_fit.probe_alpha_grid(1.0)
    assert mari_fit.probe_alpha_grid(0.5) == [0.1, 0.3, 0.5, 1.0]  # the trained strength is always stored
    bundle = methods.load_bundle(path)
    by_alpha = bundle.tensors["ctrl_energy_by_alpha"]
    assert by_alpha.shape == (3, 12) and by_alpha.dtype == torch.float32
    assert torch.equal(by_alpha[GRID.index(1.0)], bundle.tensors["ctrl_energy"])  # the trained strength: ctrl_energy
    for i in (0, 7):  # an attribute and a general-capability control example
        for j, alpha in enumerate(GRID):
            assert float(by_alpha[j, i]) == pytest.approx(_energy_by_hand(tiny, bundle, ctrl[i].context, alpha), rel=1e-4)
    assert not torch.allclose(by_alpha[0], by_alpha[2])  # the strengths measure different energies


def test_probe_alpha_at_the_trained_strength_is_the_default_evaluation_exactly(trained):
    path, ctrl, tiny = trained
    default, same = methods.load_bundle(path), methods.load_bundle(path)
    same.configure_from({"probe_alpha": "1"})
    assert same.options == {"probe_alpha": 1.0} and same.probe_id == default.probe_id == 3  # K + 1
    assert same.tau == default.tau and same.tau == methods.load_bundle(path).config["gate"]["tau_E"]
    records = []
    for bundle in (default, same):
        runs = [score_under(tiny, bundle, ex.context, ex.options) for ex in ctrl[:4]]
        records.append([bundle.choose(run) for run in runs])
        records[-1].append(bundle.summarize([r for _, r in records[-1]]))
        records[-1].append([run.logprobs for run in runs])
    for a, b in zip(records[0][-1], records[1][-1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert records[0][:-1] == records[1][:-1]
    assert records[0][-2]["probe_alpha"] == records[0][-2]["alpha_probe_trained"] == 1.0


@pytest.mark.parametrize("labels", ["loss", "source"])
def test_another_probe_alpha_injects_the_same_probe_and_takes_tau_from_the_energies_at_it(trained, labels):
    path, ctrl, tiny = trained
    default = methods.load_bundle(path)
    default.configure_from({"labels": labels, "rho": "0.5"})
    bundle = methods.load_bundle(path)
    bundle.configure_from({"probe_alpha": "0.1", "labels": labels, "rho": "0.5"})
    energies = bundle.tensors["ctrl_energy_by_alpha"][0]
    applicable = gate_labels.control_labels(bundle.tensors, bundle.ctrl_sources, labels)
    assert bundle.tau == mari_equations.energy_threshold(energies, applicable, 0.5)
    assert bundle.tau != default.tau and bundle.probe_id == 4 and bundle.variants()[-1] == 4  # K + 2 + index 0
    summary = bundle.summarize([])
    assert (summary["probe_alpha"], summary["alpha_probe_trained"], summary["tau_E"]) == (0.1, 1.0, bundle.tau)
    assert summary["control_separation"][labels] == gate_labels.separation(energies, applicable, bundle.ctrl_sources)
    assert summary["control_energies"]["non_applicable"]["median"] == pytest.approx(float(energies[~applicable].median()))
    # how far from first order in alpha the energy is (eq:first_order_expand_app): 1 = linear
    ratios = [float(e) / (0.1 * float(base)) for e, base in zip(energies, bundle.tensors["ctrl_energy"])]
    assert summary["energy_linearity"] == pytest.approx(float(torch.tensor(ratios, dtype=torch.float64).median()), rel=1e-6)
    assert "energy_linearity" not in default.summarize([])
    # The gate's probe row at inference: h + 0.1 delta_phi(h), the energy calibration stored for the example.
    for i in (1, 8):
        run = score_under(tiny, bundle, ctrl[i].context, ctrl[i].options)
        assert float(bundle.energy(run)) == pytest.approx(float(energies[i]), rel=1e-4)
        assert float(bundle.energy(run)) == pytest.approx(_energy_by_hand(tiny, bundle, ctrl[i].context, 0.1), rel=1e-4)
    h = torch.randn(2, 32)
    torch.testing.assert_close(bundle.edit_variants(h, torch.tensor([4, BASE])),
                               torch.stack([h[0] + 0.1 * mari_equations.probe_delta(h[:1], bundle.tensors)[0], h[1]]))


def test_unstored_or_malformed_probe_alphas_are_refused_naming_the_stored_ones(trained):
    bundle = methods.load_bundle(trained[0])
    bundle.configure_from({"rho": "0.5"})
    with pytest.raises(ValueError, match=r"probe_alpha=0.2: this bundle holds the control energies \(for tau_E\) at "
                                         r"probe_alpha=0.1, 0.3, 1 only \(gate.probe_alphas; its probe was trained at "
                                         r"alpha_probe=1\): use one of them"):
        bundle.configure_from({"probe_alpha": "0.2", "rho": "0.7"})
    assert bundle.rho == 0.5 and bundle.probe_alpha == 1.0  # a refused option changes nothing
    with pytest.raises(ValueError, match=r"probe_alpha='abc' in --model_args is not a number: e.g. probe_alpha=0.1"):
        bundle.configure_from({"probe_alpha": "abc"})
    with pytest.raises(ValueError, match=r"probe_alpha='inf' in --model_args is not a finite number"):
        bundle.configure_from({"probe_alpha": "inf"})
    with pytest.raises(ValueError, match=r"alpha_probe in --model_args: not an option of mari bundles \(its options "
                                         r"are T_ent, experts, gate, labels, probe_alpha, rho\)"):
        bundle.configure_from({"alpha_probe": "0.1"})  # the training hyperparameter: retrains, never an evaluation option


def _without_grid(path):
    meta = json.loads((path / methods.BUNDLE_JSON).read_text())
    del meta["gate"]["probe_alphas"]
    (path / methods.BUNDLE_JSON).write_text(json.dumps(meta))
    stored = load_file(path / methods.BUNDLE_WEIGHTS)
    del stored["ctrl_energy_by_alpha"]
    save_file(stored, path / methods.BUNDLE_WEIGHTS)


def test_an_older_bundle_loads_and_refuses_probe_alpha_saying_to_retrain(trained, tmp_path):
    old = methods.load_bundle(trained[0]).save(tmp_path / "old")
    _without_grid(old)
    bundle, new = methods.load_bundle(old), methods.load_bundle(trained[0])
    assert bundle.tau == new.tau  # its default evaluation is unchanged
    bundle.configure_from({"probe_alpha": "1.0"})  # its trained strength needs nothing more
    assert bundle.tau == new.tau and bundle.probe_id == new.probe_id
    with pytest.raises(ValueError, match=r"probe_alpha=0.1: this bundle holds the control energies at its trained "
                                         r"alpha_probe=1 only \(it was trained before .*\); retrain it with "
                                         r"`mari-eval train`, or drop probe_alpha"):
        bundle.configure_from({"probe_alpha": "0.1"})


def test_energies_by_alpha_must_agree_with_the_stored_strengths(trained, tmp_path):
    path = methods.load_bundle(trained[0]).save(tmp_path / "b")
    meta = json.loads((path / methods.BUNDLE_JSON).read_text())
    meta["gate"]["probe_alphas"] = [0.1, 1.0]  # three rows of energies, two strengths
    (path / methods.BUNDLE_JSON).write_text(json.dumps(meta))
    with pytest.raises(methods.BundleError, match=r"tensor ctrl_energy_by_alpha has shape \(3, 12\), expected \(2, 12\)"):
        methods.load_bundle(path)
    meta["gate"]["probe_alphas"] = [0.1, 0.0, 1.0]
    (path / methods.BUNDLE_JSON).write_text(json.dumps(meta))
    with pytest.raises(methods.BundleError, match=r"gate.probe_alphas\[1\] is 0.0 .*expected a finite number > 0"):
        methods.load_bundle(path)
    del meta["gate"]["probe_alphas"]  # energies whose strengths are not recorded
    (path / methods.BUNDLE_JSON).write_text(json.dumps(meta))
    with pytest.raises(methods.BundleError, match=r"tensor ctrl_energy_by_alpha has shape \(3, 12\), expected \(0, 12\)"):
        methods.load_bundle(path)


# ----------------------------------------------------------------------------- the shared pass


def _grid_bundle(d, layers, by_alpha, path):
    """test_mari's synthetic MARI (K = 3) with energies stored at GRID: ``by_alpha`` [3, 20]."""
    made = tiny_mari(K=3, d=d, layers=layers, layer=1, energies=by_alpha[GRID.index(1.0)].clone())
    config = {**made.config, "gate": {"probe_alphas": GRID}}
    return str(mari.MARI(config, {**made.tensors, "ctrl_energy_by_alpha": by_alpha}).save(path))


def test_rows_differing_in_probe_alpha_share_a_pass_with_their_own_answers(model, tokenizer, tmp_path, monkeypatch):
    d, layers = model.config.hidden_size, site.num_layers(model)
    # Every control energy at each strength midway between the questions' energies at that strength:
    # the gate opens on some questions and not on others, whichever probe_alpha.
    first = {"mari": _grid_bundle(d, layers, torch.ones(3, 20), tmp_path / "first")}
    midway = []
    for alpha in GRID:
        _, records, _ = evaluate(lm_for(model, tokenizer, first, "mari", {"probe_alpha": str(alpha)}), truthfulqa_requests(), model)
        energies = [r["energy"] for r in records]
        midway.append(torch.full((20,), (min(energies) + max(energies)) / 2))
    bundles = {"mari": _grid_bundle(d, layers, torch.stack(midway), tmp_path / "mari")}

    edited = {}  # variant id -> rows MARI's edit was applied to
    original = mari.MARI.edit_variants

    def counting(self, hidden, variant_ids):
        for v in variant_ids.tolist():
            edited[v] = edited.get(v, 0) + 1
        return original(self, hidden, variant_ids)

    rows = [{}, {"probe_alpha": "0.1"}, {"probe_alpha": "0.3"}, {"probe_alpha": "1"}]
    alone = [evaluate(lm_for(model, tokenizer, bundles, "mari", options), truthfulqa_requests(), model) for options in rows]
    monkeypatch.setattr(mari.MARI, "edit_variants", counting)
    from mari_eval.evaluation.shared_pass import SharedPass

    shared = SharedPass(model)
    lms = [lm_for(model, tokenizer, bundles, "mari", options, shared) for options in rows]
    together = [evaluate(lm, truthfulqa_requests(), model) for lm in lms]
    for options, (answers, records, _), (got, got_records, _) in zip(rows, alone, together):
        assert [x for x, _ in got] == pytest.approx([x for x, _ in answers], abs=1e-5), options
        assert close(got_records, records), (options, got_records, records)
        assert {r["gate_open"] for r in records} == {True, False}, options
    # Each strength's own probe row: the energies differ between strengths, and at the trained one
    # probe_alpha=1 is the default row itself.
    energies = [[r["energy"] for r in records] for _, records, _ in alone]
    assert all(abs(a - b) > 1e-4 for a, b in zip(energies[0], energies[1]))
    assert close(alone[3][1], alone[0][1], tol=0)
    summaries = [lm.get_model_info()["mari_diagnostics"] for lm in lms]
    assert [s["probe_alpha"] for s in summaries] == [1.0, 0.1, 0.3, 1.0]
    assert [s["tau_E"] for s in summaries] == pytest.approx([float(midway[i][0]) for i in (2, 0, 1, 2)])
    # Together, each distinct question group's probe row once per strength: K + 1 (alpha_probe = 1,
    # the default and probe_alpha=1 rows), K + 2 (0.1), K + 3 (0.3); never the grid's copy of 1 (K + 4).
    assert {v: edited.get(v, 0) for v in (4, 5, 6, 7)} == {4: DISTINCT_GROUPS, 5: DISTINCT_GROUPS, 6: DISTINCT_GROUPS, 7: 0}


def test_generation_reads_the_gate_energy_at_probe_alpha(trained):
    from mari_eval.evaluation import generation

    path, ctrl, tiny = trained
    bundle = methods.load_bundle(path)
    bundle.configure_from({"probe_alpha": "0.3"})
    prompts = torch.tensor([ctrl[2].context, ctrl[9].context])  # p*: each prompt's last token, as scored
    _, records = generation.generate_variants(tiny, prompts, torch.ones_like(prompts), bundle.plan(tiny),
                                              max_length=prompts.shape[1] + 4, pad_token_id=0, do_sample=False)
    stored = bundle.tensors["ctrl_energy_by_alpha"][GRID.index(0.3)]
    assert [r["energy"] for r in records] == pytest.approx([float(stored[2]), float(stored[9])], rel=1e-4)


def test_T_ent_sets_the_greedy_steps_generation_routes_over_and_the_entropies_it_routes_on(trained, monkeypatch):
    """``T_ent=`` (--model_args) replaces the bundle's routing window (eq:entropy_gen) at evaluation:
    the routing window runs that many greedy steps, and u_k is the mean entropy over them."""
    from mari_eval.evaluation import generation

    path, ctrl, tiny = trained
    default, short = methods.load_bundle(path), methods.load_bundle(path)
    short.configure_from({"T_ent": "2"})
    assert default.T_ent == default.config["hyperparameters"]["T_ent"] == 8 and short.T_ent == 2
    assert short.summarize([])["T_ent"] == 2 and default.summarize([])["T_ent"] == 8
    windows, real = [], generation._routing_window

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        windows.append((args[6], out[1]))  # (greedy steps, each row's mean entropy)
        return out

    monkeypatch.setattr(generation, "_routing_window", spy)
    prompt = torch.tensor([ctrl[0].context])
    for bundle in (default, short):
        bundle.tau = -math.inf  # the gate opens: the experts are routed
        _, records = generation.generate_variants(tiny, prompt, torch.ones_like(prompt), bundle.plan(tiny),
                                                  max_length=prompt.shape[1] + 12, pad_token_id=0, do_sample=False)
        assert records[0]["gate_open"]
    (steps_default, u_default), (steps_short, u_short) = windows
    assert (steps_default, steps_short) == (8, 2)
    expected = generation.routing_entropy(tiny, ctrl[0].context, dataclasses.replace(short.plan(tiny),
                                          variants=tuple(short.answering_variants())), window=2)
    torch.testing.assert_close(u_short, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(u_default, u_short)
    with pytest.raises(ValueError, match=r"T_ent=0: generation routes over at least one greedy step"):
        short.configure_from({"T_ent": "0"})
    with pytest.raises(ValueError, match=r"T_ent='x' in --model_args is not an integer: e.g. T_ent=1"):
        short.configure_from({"T_ent": "x"})
