"""MARI's equations against brute-force references, its routing and gate rules, its bundle."""

import dataclasses
import itertools
import math
import statistics

import numpy as np
import pytest
import torch

from mari_eval import mari, methods
from mari_eval.evaluation import generation, runner
from mari_eval.injection import site
from mari_eval.training import objectives
from mari_eval.mari import equations as mari_equations
from mari_eval.mari import fit as mari_fit
from mari_eval.injection.plan import VANILLA, Plan
from mari_eval.evaluation.prefix_cache import PrefixCache, encode_prefix

from .tiny import reloaded, tiny_model
from .tiny import tiny_mari
from .tiny import score_under


# ----------------------------------------------------------------------------- equations


def test_lowrank_delta_is_U_times_Vh_plus_b():
    g = torch.Generator().manual_seed(0)
    h, U, V, b = (torch.randn(3, 6, generator=g), torch.randn(3, 6, 2, generator=g),
                  torch.randn(3, 6, 2, generator=g), torch.randn(3, 2, generator=g))
    expected = torch.stack([U[i] @ (V[i].T @ h[i] + b[i]) for i in range(3)])
    torch.testing.assert_close(mari_equations.lowrank_delta(h, U, V, b), expected)


def test_task_losses_mc_is_cross_entropy_and_gen_is_nll():
    z = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -2.0]])
    expected = [-(zk[1] - torch.logsumexp(zk, 0)) for zk in z]
    torch.testing.assert_close(objectives.task_losses(z, 1), torch.stack(expected))
    torch.testing.assert_close(objectives.task_losses(z[:, :1], None), torch.tensor([1.0, 3.0]))


def test_inter_ortho_matches_pairwise_qr_overlap():
    g = torch.Generator().manual_seed(1)
    U = torch.randn(4, 10, 3, generator=g)
    Q = [np.linalg.qr(U[k].numpy())[0] for k in range(4)]
    pairs = [np.linalg.norm(Q[i].T @ Q[j]) ** 2 for i, j in itertools.combinations(range(4), 2)]
    assert mari_equations.inter_ortho_loss(U).item() == pytest.approx(2 / (4 * 3) * sum(pairs), rel=1e-5)
    # Orthogonal subspaces have no overlap; one expert has nothing to compare.
    eye = torch.eye(6)
    assert mari_equations.inter_ortho_loss(torch.stack([eye[:, :3], eye[:, 3:]])).item() == pytest.approx(0.0, abs=1e-7)
    assert mari_equations.inter_ortho_loss(U[:1]).item() == 0.0


def test_balance_loss_by_hand():
    losses = torch.tensor([[1.0, 2.0], [3.0, 0.5], [0.2, 0.2]])
    q = [[math.exp(-l / 2.0) for l in row] for row in losses.tolist()]
    q = [[x / sum(row) for x in row] for row in q]
    p = [sum(row[k] for row in q) / 3 for k in range(2)]
    assert mari_equations.balance_loss(losses, T_bal=2.0).item() == pytest.approx(sum((pk - 0.5) ** 2 for pk in p), rel=1e-6)
    assert mari_equations.balance_loss(torch.ones(5, 3), 1.0).item() == pytest.approx(0.0, abs=1e-9)


def test_out_ortho_is_mean_pairwise_squared_cosine():
    g = torch.Generator().manual_seed(2)
    deltas = torch.randn(5, 3, 7, generator=g)
    ref = []
    for x in deltas:
        cos2 = [float(torch.nn.functional.cosine_similarity(x[i], x[j], dim=0)) ** 2 for i, j in itertools.combinations(range(3), 2)]
        ref.append(sum(cos2) / 3)
    assert mari_equations.out_ortho_loss(deltas).item() == pytest.approx(statistics.mean(ref), rel=1e-5)
    parallel = torch.ones(1, 2, 4)
    assert mari_equations.out_ortho_loss(parallel).item() == pytest.approx(1.0)


def test_pca_basis_and_offsubspace_penalty():
    g = torch.Generator().manual_seed(3)
    states = torch.randn(50, 3, generator=g) @ torch.randn(3, 8, generator=g)  # rank-3 data in 8 dims
    B = mari_equations.pca_basis(states, 3)
    torch.testing.assert_close(B.T @ B, torch.eye(3), atol=1e-5, rtol=0)
    centred = states - states.mean(0)
    assert mari_equations.offsubspace_penalty(centred, B).max().item() < 1e-6  # the data lie in span(B)
    v = torch.randn(4, 8, generator=g)
    expected = ((torch.eye(8) - B @ B.T) @ v.T).T.pow(2).sum(-1)
    torch.testing.assert_close(mari_equations.offsubspace_penalty(v, B), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_layers", [5, 6])
def test_energy_is_the_median_per_layer_response(n_layers):
    g = torch.Generator().manual_seed(n_layers)
    base, probed = torch.randn(n_layers, 4, generator=g), torch.randn(n_layers, 4, generator=g)
    norms = [float((probed[m] - base[m]).norm()) for m in range(n_layers)]
    assert float(mari_equations.propagation_energy(probed, base)) == pytest.approx(statistics.median(norms), rel=1e-6)


def test_threshold_is_the_rho_quantile_of_non_applicable_energies():
    energies = torch.arange(100, dtype=torch.float32)
    applicable = torch.zeros(100, dtype=torch.bool)
    applicable[::2] = True  # the odd energies are non-applicable
    tau = mari_equations.energy_threshold(energies, applicable, 0.9)
    assert tau == pytest.approx(float(np.quantile(np.arange(1, 100, 2), 0.9)))
    non = energies[~applicable]
    gated_off = (~mari_equations.gate_open(non, tau)).float().mean().item()
    assert gated_off == pytest.approx(0.9, abs=0.02)  # a fraction rho of non-applicable inputs gets the base model
    assert mari_equations.energy_threshold(energies, torch.ones(100, dtype=torch.bool), 0.9) == -math.inf


def test_option_entropy_and_routing_picks_the_lowest():
    z = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.99, 0.01]]))
    u = mari_equations.option_entropy(z)
    expected = [-(p * math.log(p) + (1 - p) * math.log(1 - p)) for p in (0.5, 0.9, 0.99)]
    torch.testing.assert_close(u, torch.tensor(expected))
    bundle = tiny_mari(K=3)
    bundle.configure(gate=False)
    run = runner.VariantRun([0, 1, 2], z, None, {})
    assert bundle.choose(run)[0] == 2


def test_winner_take_gradient_detaches_the_losers():
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x = torch.tensor([[0.5], [2.0]])
    losses = (x - w) ** 2  # [B=2, K=3]; example 0 is won by expert 0, example 1 by expert 1
    loss, winners = mari_equations.routed_loss(losses)
    loss.backward()
    assert winners.tolist() == [0, 1]
    assert w.grad[2].item() == 0.0 and w.grad[0].item() != 0.0 and w.grad[1].item() == 0.0  # (2 - 2)^2 has zero slope
    w.grad = None
    mari_equations.routed_loss((torch.tensor([[0.5], [2.5]]) - w) ** 2)[0].backward()
    assert w.grad[2].item() == 0.0 and w.grad[1].item() != 0.0


# ----------------------------------------------------------------------------- the method on a tiny model


CONTEXT = [5, 17, 33, 2, 41, 8, 9, 60, 11]
OPTIONS = [[3, 4], [70, 71, 72], [5]]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_variants_equal_scoring_each_edit_alone(family):
    model = tiny_model(family, sliding_window=6)  # the 9-token context crosses Gemma's window: batched path
    bundle = tiny_mari()
    run = score_under(model, bundle, CONTEXT, OPTIONS)
    for v in bundle.answering_variants():
        for m, option in enumerate(OPTIONS):
            ids = torch.tensor([CONTEXT + option[:-1]])
            edit = lambda h, v=v: bundle.edit_variants(h, torch.full((h.shape[0],), v))
            with torch.no_grad(), site.edit_site(model, bundle.layer, edit, torch.tensor([len(CONTEXT) - 1])):
                logp = torch.log_softmax(model(input_ids=ids).logits[0, len(CONTEXT) - 1:], -1)
            expected = logp.gather(-1, torch.tensor(option)[:, None]).sum()
            assert float(run.logprobs[run.row(v), m]) == pytest.approx(float(expected), abs=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rows_above_the_site_reuse_the_base_rows_lower_states(family):
    model = tiny_model(family)
    bundle = tiny_mari()
    variants = [runner.BASE] + bundle.variants()
    apply = lambda ids, pos: bundle.applied(model, pos, ids)
    prefix = encode_prefix(model, CONTEXT[:-1])
    plan = Plan(tuple(variants), apply, capture=tuple(bundle.captured_layers()), site_only=tuple(bundle.site_only_variants()))
    with torch.no_grad():
        whole = runner.score_variants(model, prefix, CONTEXT[-1], OPTIONS, plan)
        calls = []
        hook = site.attention_output(model, 0).register_forward_hook(lambda m, args, out: calls.append(args[0].shape[1]))
        shared = runner.score_variants(model, prefix, CONTEXT[-1], OPTIONS, dataclasses.replace(plan, edit_layer=bundle.layer))
        hook.remove()
    torch.testing.assert_close(shared.logprobs, whole.logprobs, atol=1e-4, rtol=0, equal_nan=True)
    for m in whole.site:
        torch.testing.assert_close(shared.site[m], whole.site[m], atol=1e-4, rtol=1e-4)
    # Layer 0 computed the base rows; for the other rows (started from the base rows' states) it saw one token.
    assert calls[0] == sum(len(o) for o in OPTIONS) and calls[1:] and set(calls[1:]) == {1}


def test_a_closed_gate_never_runs_the_experts():
    model = tiny_model("llama")
    bundle = tiny_mari()
    bundle.tau = math.inf
    seen = []
    variants = [runner.BASE] + bundle.variants()

    def apply(ids, pos):
        seen.extend(ids.tolist())
        return bundle.applied(model, pos, ids)

    prefix = encode_prefix(model, CONTEXT[:-1])
    plan = Plan(tuple(variants), apply, capture=tuple(bundle.captured_layers()), site_only=tuple(bundle.site_only_variants()),
                edit_layer=bundle.layer, screen=bundle.screen)
    with torch.no_grad():
        run = runner.score_variants(model, prefix, CONTEXT[-1], OPTIONS, plan)
    assert set(seen) == {bundle.probe_id}
    assert run.logprobs[[run.row(v) for v in bundle.answering_variants()]].isnan().all()
    chosen, record = bundle.choose(run)
    assert chosen == runner.BASE and record["gate_open"] is False and "expert" not in record
    assert torch.equal(run.logprobs[run.row(runner.BASE)], score_under(model, None, CONTEXT, OPTIONS).logprobs[0])


def test_prefix_cache_computes_a_shared_preamble_once_and_equals_fresh_prefixes():
    model = tiny_model("llama")
    preamble = list(range(10, 50))  # 40 tokens, as a few-shot preamble
    prompts = sorted([preamble + [1, 2, 3], preamble + [1, 2, 4, 5], preamble + [9], [7, 8, 9], preamble + [9]])
    fed = []
    hook = site.attention_output(model, 0).register_forward_hook(lambda mod, args, out: fed.append(out.shape[1]))
    cache = PrefixCache(model, min_shared=32)
    with torch.no_grad():
        runs = [runner.score_variants(model, cache.encode(p), 60, OPTIONS, VANILLA) for p in prompts]
    hook.remove()
    option_tokens = sum(len(o) for o in OPTIONS) * len(prompts)
    # the preamble once (inside the first prompt that has it), then each distinct prompt's own tokens once
    assert sum(fed) - option_tokens == 3 + 43 + 2 + 1
    assert len(cache.path) <= cache.max_depth
    for p, run in zip(prompts, runs):
        fresh = runner.score_variants(model, encode_prefix(model, p), 60, OPTIONS, VANILLA)
        torch.testing.assert_close(run.logprobs, fresh.logprobs, atol=1e-4, rtol=0)


def test_gate_with_infinite_threshold_is_exactly_vanilla():
    model = tiny_model("llama")
    bundle = tiny_mari()
    bundle.tau = math.inf
    run = score_under(model, bundle, CONTEXT, OPTIONS)
    chosen, record = bundle.choose(run)
    assert chosen == runner.BASE and record["gate_open"] is False
    vanilla = score_under(model, None, CONTEXT, OPTIONS)
    assert torch.equal(run.logprobs[run.row(chosen)], vanilla.logprobs[0])


def test_energy_is_read_from_the_probe_run():
    model = tiny_model("llama")
    bundle = tiny_mari()
    run = score_under(model, bundle, CONTEXT, OPTIONS)
    # Recompute by hand: hidden states at p* after every layer from l* on, with and without the probe.
    ids = torch.tensor([CONTEXT])
    layers = list(range(bundle.layer, 4))
    with torch.no_grad(), site.capture_site(model, layers, torch.tensor([len(CONTEXT) - 1])) as base:
        model(input_ids=ids)
    probe = lambda h: bundle.edit_variants(h, torch.full((h.shape[0],), bundle.probe_id))
    with torch.no_grad(), site.edit_site(model, bundle.layer, probe, torch.tensor([len(CONTEXT) - 1])), \
            site.capture_site(model, layers, torch.tensor([len(CONTEXT) - 1])) as probed:
        model(input_ids=ids)
    norms = [float((probed[m] - base[m]).norm()) for m in layers]
    assert float(bundle.energy(run)) == pytest.approx(statistics.median(norms), rel=1e-4)


def test_ablation_switches():
    bundle = tiny_mari(K=3)
    bundle.configure(experts="single")
    assert bundle.answering_variants() == [bundle.single_id]
    bundle.configure(experts="2", gate=False)
    assert bundle.variants() == [2] and not bundle.uses_base and bundle.tau == -math.inf
    with pytest.raises(ValueError, match="out of range: this bundle has K=3"):
        bundle.configure(experts="7")
    bundle.configure(rho=0.5)
    assert bundle.tau == pytest.approx(mari_equations.energy_threshold(bundle.tensors["ctrl_energy"],
                                                             bundle.tensors["ctrl_applicable"], 0.5))


def test_bundle_round_trip_is_identical(tmp_path):
    model = tiny_model("llama")
    bundle = tiny_mari()
    loaded = reloaded(bundle, tmp_path / "b")
    a, b = score_under(model, bundle, CONTEXT, OPTIONS), score_under(model, loaded, CONTEXT, OPTIONS)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=0, equal_nan=True)
    assert bundle.choose(a) == loaded.choose(b)


def test_inconsistent_bundle_is_refused(tmp_path):
    bundle = tiny_mari(K=3)
    bundle.config["hyperparameters"]["K"] = 4
    bundle.save(tmp_path / "b")
    with pytest.raises(methods.BundleError, match=r"expert_U has shape \(3, 32, 2\), expected \(4, 32, 2\)"):
        methods.load_bundle(tmp_path / "b")


PROMPTS = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])


def _generate(model, bundle, screened, **kw):
    mask = (PROMPTS != 0).long()
    mask[1] = 1
    apply = lambda ids, pos: bundle.applied(model, pos, ids)
    extra = dict(site_only=tuple(bundle.site_only_variants()), screen=bundle.screen, edit_layer=bundle.layer) if screened else {}
    plan = Plan((runner.BASE, *bundle.variants()), apply, bundle.choose, capture=tuple(bundle.captured_layers()), window=3,
                **extra)
    out, records = generation.generate_variants(model, PROMPTS, mask, plan, max_length=12, pad_token_id=0, do_sample=False,
                                                **kw)
    return mask, out, records


@pytest.mark.parametrize("screened", [False, True])
def test_routed_generation_keeps_the_winner_and_equals_its_own_generation(screened):
    model = tiny_model("llama")
    bundle = tiny_mari()
    if screened:  # a threshold between the two prompts' energies: one gate opens, the other stays closed
        energies = [r["energy"] for r in _generate(model, bundle, screened=False)[2]]
        bundle.tau = sum(energies) / 2
    mask, out, records = _generate(model, bundle, screened)
    assert out.shape[0] == 2 and len(records) == 2
    if screened:
        assert sorted(r["gate_open"] for r in records) == [False, True]
        # the probe rerun over the masked cache, from l* up, measures what the full variant batch measured
        assert [r["energy"] for r in records] == pytest.approx(energies, rel=1e-4)
    for p, record in enumerate(records):
        chosen = record["variant"]
        edit = (lambda h: h) if chosen == runner.BASE else (
            lambda h, c=chosen: bundle.edit_variants(h, torch.full((h.shape[0],), c)))
        with site.edit_site(model, bundle.layer, edit, None):
            alone = model.generate(input_ids=PROMPTS[p:p + 1], attention_mask=mask[p:p + 1], max_length=12,
                                   do_sample=False, pad_token_id=0)
        assert out[p, : alone.shape[1]].tolist() == alone[0].tolist()
        if screened and not record["gate_open"]:  # turned away before the experts ran
            assert chosen == runner.BASE and "entropy" not in record
        else:  # the entropies that chose it are the mean over the window of each expert's own steps
            assert len(record["entropy"]) == len(bundle.answering_variants())


def test_routed_generation_of_one_token_prompts_keeps_each_prompt_its_own():
    model = tiny_model("llama")
    bundle = tiny_mari()
    bundle.configure(gate=False)
    prompts = torch.tensor([[5], [9]])  # nothing before p*: no shared cache
    apply = lambda ids, pos: bundle.applied(model, pos, ids)
    plan = Plan(tuple(bundle.variants()), apply, bundle.choose, window=3)
    out, records = generation.generate_variants(model, prompts, torch.ones_like(prompts), plan, max_length=8, pad_token_id=0,
                                                do_sample=False)
    for p, record in enumerate(records):
        edit = lambda h, c=record["variant"]: bundle.edit_variants(h, torch.full((h.shape[0],), c))
        with site.edit_site(model, bundle.layer, edit, None):
            alone = model.generate(input_ids=prompts[p:p + 1], max_length=8, do_sample=False, pad_token_id=0)
        assert out[p, : alone.shape[1]].tolist() == alone[0].tolist()


def test_streamed_tokens_are_the_answer_only():
    model = tiny_model("llama")
    bundle = tiny_mari()
    bundle.configure(gate=False)  # every prompt is routed

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    ids, recorder = PROMPTS[1:], Recorder()
    plan = Plan(tuple(bundle.variants()), lambda v, pos: bundle.applied(model, pos, v), bundle.choose, window=3)
    out, _ = generation.generate_variants(model, ids, torch.ones_like(ids), plan, max_length=12, pad_token_id=0,
                                          do_sample=False, streamer=recorder)
    assert recorder.puts[0] == ids[0].tolist()  # the prompt, once
    assert sum(recorder.puts[1:], []) == out[0, ids.shape[1]:].tolist() and recorder.ended


# ----------------------------------------------------------------------------- training on the embedded model


@pytest.mark.needs_data
def test_training_lowers_the_routed_loss_on_the_embedded_model(smollm2_session):
    from mari_eval.training.train import attribute_data

    session = smollm2_session  # conftest: the embedded model, loaded once
    data = attribute_data(session, "truthfulqa", seed=0)
    examples = data.train[:6]
    session.prepare(examples, "test")
    hp = {**mari.DEFAULTS, "K": 2, "epochs": 3, "batch_size": 3, "lr": 2e-2}
    _, history = mari_fit.fit_experts(session, examples, 2, hp, torch.Generator().manual_seed(0), "test")
    assert history[-1]["routed"] < history[0]["routed"]
    assert len(history) == 3 and all(abs(sum(h["usage"]) - 1) < 1e-6 for h in history)


@pytest.mark.needs_data
def test_the_probe_is_trained_at_the_strength_alpha_probe_it_is_used_at(smollm2_session):
    """eq:probe_update is h + alpha_probe delta_phi(h) at training as at use (issue 22.3): at
    alpha_probe = 0 the task term sees the base model whatever the probe is, at 1 it sees the probe."""
    from mari_eval.training.train import attribute_data

    session = smollm2_session  # conftest: the embedded model, loaded once
    data = attribute_data(session, "truthfulqa", seed=0)
    examples = data.train[:4]
    session.prepare(examples, "test")
    pca_states = session.hidden_of_prompts(data.pca_prompts[:20])
    basis = mari_equations.pca_basis(pca_states, 4)
    base = statistics.mean(float(objectives.task_losses(session.run(ex, [0], lambda h, ids: h).logprobs, ex.gold)[0])
                           for ex in examples)
    tasks = {}
    for alpha in (0.0, 1.0):
        hp = {**mari.DEFAULTS, "epochs": 2, "batch_size": 4, "lr": 0.2, "alpha_probe": alpha}
        _, history = mari_fit.fit_probe(session, examples, pca_states, basis, hp, torch.Generator().manual_seed(0))
        tasks[alpha] = [h["task"] for h in history]
    assert all(t == pytest.approx(base, abs=1e-4) for t in tasks[0.0])
    assert abs(tasks[1.0][1] - base) > 1e-3  # after one step the probe moves the loss it is trained on


@pytest.mark.needs_data
def test_train_cli_writes_a_bundle_lm_eval_can_score(tmp_path):
    import json
    import subprocess

    from .conftest import HARNESS_TASKS

    out = tmp_path / "bundle"
    train = subprocess.run(
        ["mari-eval", "train", "--attribute", "truthfulqa", "--K", "2", "--epochs", "1", "--max-train", "8",
         "--max-ctrl", "2", "--max-pca", "20", "--seed", "3", "--out", str(out)], capture_output=True, text=True)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "experts (K=2) epoch 1: routed loss" in train.stderr and "gate: tau_E" in train.stderr
    config = json.loads((out / "bundle.json").read_text())
    assert config["method"] == "mari" and config["hyperparameters"]["K"] == 2 and config["seed"] == 3
    assert config["base_model"] == {"name": "smollm2-135m-instruct", "hidden_size": 576, "num_layers": 30}
    assert len(config["splits"]["train_used"]) == 8 and len(config["splits"]["ctrl_used"]) == 6
    assert not set(config["splits"]["train_used"]) & set(config["splits"]["test"])
    # Every labelling of the control set is stored (issue 22): loss and flip labels, and the sources.
    assert config["gate"]["labels"] == config["hyperparameters"]["labels"] == "loss"
    assert config["gate"]["ctrl_sources"] == ["attribute"] * 2 + ["arc_easy"] * 2 + ["mmlu"] * 2
    loaded = methods.load_bundle(out)
    assert {"ctrl_flip", "ctrl_flip_single"} <= set(loaded.tensors) and loaded.tensors["ctrl_flip"].numel() == 6
    assert set(loaded.summarize([])["control_separation"]) == {"loss", "flip", "source"}
    # ... and the energies of its one probe at every stored strength (probe_alpha=, issue 36.7c)
    assert config["gate"]["probe_alphas"] == mari_fit.probe_alpha_grid(1.0) == [0.1, 0.3, 1.0]
    assert torch.equal(loaded.tensors["ctrl_energy_by_alpha"][2], loaded.tensors["ctrl_energy"])
    results = tmp_path / "results"
    evaluate = subprocess.run(
        ["lm_eval", "--model", "mari", "--model_args", f"pretrained=smollm2-135m-instruct,bundle={out}",
         "--tasks", "truthfulqa_mc1_heldout", "--include_path", str(HARNESS_TASKS), "--limit", "2",
         # the held-out split of the bundle's own seed (another seed's test set holds its training examples)
         "--metadata", '{"split_seed": 3}', "--output_path", str(results)], capture_output=True, text=True)
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    (result_file,) = results.rglob("results_*.json")
    saved = json.loads(result_file.read_text())
    assert saved["config"]["mari_diagnostics"]["prompts"] == 2
    assert 0.0 <= saved["config"]["mari_diagnostics"]["gate_rate"] <= 1.0
