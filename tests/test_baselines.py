"""Baselines: each edit against its formula, the fit direction on the embedded model, save/load."""

import pytest
import torch

from baselines import caa
from mari_eval.evaluation import runner
from mari_eval.injection import site
from mari_eval.evaluation.prefix_cache import encode_prefix

from .iti_expect import head_shift, heads_shifted
from .tiny import reloaded, tiny_model
from .tiny import tiny_caa
from .tiny import tiny_iti
from .tiny import tiny_reft


def test_caa_edit_is_h_plus_multiplier_times_vector():
    bundle = tiny_caa()
    h = torch.randn(5, 32)
    torch.testing.assert_close(bundle.edit(h), h + 3.0 * bundle.tensors["vector"])


def test_caa_edits_p_star_and_every_later_position_only():
    model = tiny_model("llama")
    bundle = tiny_caa()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    p_star = torch.tensor([2, 4])
    every = (torch.arange(2).repeat_interleave(6), torch.arange(6).repeat(2))
    with torch.no_grad(), site.capture_site(model, [bundle.layer], every) as plain:
        model(input_ids=ids)
    with torch.no_grad(), bundle.applied(model, p_star), site.capture_site(model, [bundle.layer], every) as steered:
        model(input_ids=ids)
    moved = (steered[bundle.layer] - plain[bundle.layer]).norm(dim=-1).reshape(2, 6) > 1e-6
    assert moved.tolist() == [[False, False, True, True, True, True], [False, False, False, False, True, True]]
    # Under generate the decode steps are steered too (the original adds the vector at every new token).
    with bundle.applied(model, None) as state:
        model.generate(input_ids=ids[:1], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert state["calls"] == 3


def test_caa_round_trip_is_identical(tmp_path):
    model = tiny_model("llama")
    bundle = tiny_caa()
    loaded = reloaded(bundle, tmp_path / "caa")
    prefix = encode_prefix(model, [5, 17, 33, 2])
    runs = [runner.score_variants(model, prefix, 41, [[3, 4], [70, 71, 72]], b.plan(model)) for b in (bundle, loaded)]
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)


@pytest.mark.needs_data
def test_caa_fit_scores_its_grid_on_the_held_out_slice_and_keeps_the_best(truthfulqa_session):
    session, data, config = truthfulqa_session
    fitted = caa.CAA.fit(session, data, config, {"layers": [20], "multipliers": [0.5, -0.5]}, seed=0)
    loss, base = fitted.config["diagnostics"]["validation_loss"], fitted.config["diagnostics"]["validation_loss_base"]
    assert set(loss) == {"20:0.5", "20:-0.5"}
    # Adding m v moves the validation loss to first order in m: +m and -m move it in opposite
    # directions from the base model's. (Which direction helps is the data's: on the 4-question
    # slice of seed 0 it depends on the layer, so that is not asserted here.)
    assert (loss["20:0.5"] - base) * (loss["20:-0.5"] - base) < 0
    best = min(loss, key=loss.get)
    assert fitted.config["hyperparameters"]["multiplier"] == float(best.split(":")[1])
    assert fitted.layer == 20 and fitted.tensors["vector"].shape == (576,)


# ----------------------------------------------------------------------------- ITI and NL-ITI


def test_iti_moves_the_chosen_heads_outputs_by_alpha_sigma_theta():
    """ITI's hook on the projection's output equals shifting the heads' outputs themselves."""
    model = tiny_model("llama")
    bundle = tiny_iti(model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad(), heads_shifted(model, head_shift(model, bundle, 4.0), first=2):  # p* = 2 and every later position
        want = model(input_ids=ids).logits
    with torch.no_grad(), bundle.applied(model, torch.tensor([2])):
        got = model(input_ids=ids).logits
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[0, :2], plain[0, :2]) and not torch.allclose(got[0, 2:], plain[0, 2:])


def test_iti_mass_mean_direction_and_sigma():
    from baselines.iti import mass_mean

    x = torch.tensor([[[3.0, 0.0]], [[5.0, 0.0]], [[1.0, 2.0]], [[1.0, -2.0]]])  # [N, K=1, 2]
    y = torch.tensor([1.0, 1.0, 0.0, 0.0])
    theta, sigma = mass_mean(x, y)
    torch.testing.assert_close(theta, torch.tensor([[1.0, 0.0]]))  # (4, 0) - (1, 0), normalised
    torch.testing.assert_close(sigma, torch.tensor([3.0, 5.0, 1.0, 1.0]).std()[None])


def test_probes_rank_the_informative_head_first_and_only_the_mlp_reads_xor():
    from baselines.iti import probe_accuracy

    g = torch.Generator().manual_seed(0)
    n = 400
    y = (torch.rand(n, generator=g) > 0.5).float()
    noise = torch.randn(n, 3, 4, generator=g)
    x = noise.clone()
    x[:, 1, 0] += 3 * (2 * y - 1)  # head 1: linearly separable
    a = torch.randn(n, generator=g).sign()
    # head 2: y = 1 iff x0 and x1 have the same sign (XOR: no linear read-out exists).
    x[:, 2, 0], x[:, 2, 1] = 2 * a + 0.1 * noise[:, 2, 0], 2 * a * (2 * y - 1) + 0.1 * noise[:, 2, 1]
    fit, val = slice(0, 300), slice(300, n)
    linear = probe_accuracy(x[fit], y[fit], x[val], y[val], "linear", seed=0)
    mlp = probe_accuracy(x[fit], y[fit], x[val], y[val], "mlp", seed=0)
    assert int(linear.argmax()) == 1 and linear[1] > 0.95 and linear[0] < 0.65 and linear[2] < 0.65
    assert mlp[1] > 0.95 and mlp[2] > 0.9 and mlp[0] < 0.65


def test_nl_iti_is_iti_with_mlp_probes_and_four_tokens(tmp_path):
    from baselines import iti

    assert iti.NLITI.fit.__func__ is iti.ITI.fit.__func__ and iti.NLITI.applied is iti.ITI.applied
    assert (iti.ITI.probe, iti.ITI.tokens, iti.NLITI.probe, iti.NLITI.tokens) == ("linear", 1, "mlp", 4)
    model = tiny_model("llama")
    for cls in (iti.ITI, iti.NLITI):
        bundle = tiny_iti(model, cls=cls)
        loaded = reloaded(bundle, tmp_path / cls.method)
        prefix = encode_prefix(model, [5, 17, 33, 2])
        runs = [runner.score_variants(model, prefix, 41, [[3, 4], [70, 71, 72]], b.plan(model)) for b in (bundle, loaded)]
        assert torch.equal(runs[0].logprobs, runs[1].logprobs)


def test_iti_bundle_for_other_heads_is_refused():
    from mari_eval.methods import BundleError

    model = tiny_model("llama")
    bundle = tiny_iti(model, heads=((1, 7),))  # the tiny model has 4 heads
    with pytest.raises(BundleError, match="has 4 heads of dimension 8"):
        bundle.check_compatible(model, "tiny")


# ----------------------------------------------------------------------------- ReFT


def test_loreft_formula_and_orthonormal_rows():
    from baselines.loreft import loreft, orthonormal_rows

    bundle = tiny_reft()
    R, W, b = (bundle.tensors[k] for k in ("R", "W", "b"))
    torch.testing.assert_close(R @ R.T, torch.eye(3), atol=1e-5, rtol=0)
    h = torch.randn(5, 32)
    torch.testing.assert_close(bundle.edit(h), h + (h @ W.T + b - h @ R.T) @ R)
    # The subspace component becomes W h + b; the orthogonal complement is untouched.
    edited = bundle.edit(h)
    torch.testing.assert_close(edited @ R.T, h @ W.T + b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(edited - edited @ R.T @ R, h - h @ R.T @ R, atol=1e-5, rtol=1e-5)
    # W = R, b = 0 (the initialisation) is the identity.
    torch.testing.assert_close(loreft(h, R, R, torch.zeros(3)), h)
    assert orthonormal_rows(torch.randn(4, 32)).shape == (4, 32)


def test_reft_edits_the_first_and_last_prompt_tokens():
    from baselines.loreft import first_and_last

    assert tiny_reft(first=2, last=3).prompt_sites(10) == [0, 1, 7, 8]  # p* = 9 is the site itself
    assert first_and_last(3, 5, 5) == [0, 1]  # short prompts: every position once
    assert first_and_last(1, 5, 5) == []


def test_reft_runner_with_an_edited_prompt_equals_the_whole_sequence(tmp_path):
    model = tiny_model("llama")
    bundle = reloaded(tiny_reft(), tmp_path / "reft")
    context, options = [5, 17, 33, 2, 8, 9, 11, 41], [[3, 4], [70, 71, 72]]
    plan = bundle.plan(model)
    with torch.no_grad():
        prefix = encode_prefix(model, context[:-1], apply=plan.apply, sites=plan.prompt_sites(len(context)))
        run = runner.score_variants(model, prefix, context[-1], options, plan)
        plain = runner.score_variants(model, encode_prefix(model, context[:-1]), context[-1], options, plan)
    for m, option in enumerate(options):
        ids = torch.tensor([context + option])
        cols = torch.tensor(bundle.prompt_sites(len(context)) + [len(context) - 1])
        with torch.no_grad(), site.edit_site(model, bundle.layer, bundle.edit, (torch.zeros_like(cols), cols)):
            logprobs = model(ids).logits.log_softmax(-1)[0, len(context) - 1 : -1]
        want = logprobs.gather(-1, torch.tensor(option)[:, None]).sum()
        torch.testing.assert_close(run.logprobs[0, m], want, atol=1e-4, rtol=0)
        assert abs(float(plain.logprobs[0, m] - want)) > 1e-4  # the prompt edits matter


def test_reft_fit_trains_and_keeps_the_best_validation_epoch():
    # On the tiny model (the fit's code path; the embedded model's behaviour is not what is checked):
    # 10 examples, one step per epoch. The training loss falls while the validation loss rises
    # after the first epoch, so keeping the last epoch instead of the best would fail here.
    from types import SimpleNamespace

    from baselines.reft import ReFT

    from .tiny import tiny_examples, tiny_session

    session = tiny_session(tiny_model("llama").requires_grad_(False))
    data = SimpleNamespace(train=tiny_examples(session, n=10))
    config = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1}}
    fitted = ReFT.fit(session, data, config, {"epochs": 3}, seed=0)
    history = fitted.config["diagnostics"]["history"]
    assert history[2]["train_loss"] < history[1]["train_loss"] < history[0]["train_loss"]
    best = min(history, key=lambda h: h["validation_loss"])
    assert best["epoch"] != len(history)
    assert fitted.config["hyperparameters"]["epoch_kept"] == best["epoch"]
    # The kept tensors are that epoch's: the same seed stopped after it trains the same steps.
    stopped = ReFT.fit(session, data, config, {"epochs": best["epoch"]}, seed=0)
    for name in ("R", "W", "b"):
        assert torch.equal(fitted.tensors[name], stopped.tensors[name]), name
    R = fitted.tensors["R"]
    torch.testing.assert_close(R @ R.T, torch.eye(4), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- fitted on the embedded model


@pytest.mark.needs_data
@pytest.mark.parametrize("method, fraction, k", [("iti", 0.025, 7), ("nl_iti", 0.1, 27)])
def test_iti_fit_direction_helps_and_its_opposite_hurts_on_the_embedded_model(truthfulqa_session, method, fraction, k):
    from mari_eval.methods import method_class

    session, data, config = truthfulqa_session
    fitted = method_class(method).fit(session, data, config, {"head_fractions": [fraction], "alphas": [2.5, -2.5]}, seed=0)
    diag, hp = fitted.config["diagnostics"], fitted.config["hyperparameters"]
    # k = 2.5% of 30 x 9 heads for ITI, 10% for NL-ITI. NL-ITI's MLP probes tie on most heads on this 4-question
    # slice, so which few heads come first is left to its seeded tie order and to the last bits of the probes'
    # arithmetic (at 5 heads, along and against swapped places between two CI runs of one commit); over 27
    # heads the direction's effect is larger than that. The claim is the direction's, on the heads chosen; the
    # tie rule has its own tests (test_recipe_iti.py).
    # Shifting them along the mass-mean direction (towards the true answers) helps and shifting them against it
    # hurts, relative to the base model, on the held-out slice.
    loss, base = diag["validation_loss"], diag["validation_loss_base"]
    assert loss[f"{k}:2.5"] < base < loss[f"{k}:-2.5"]
    assert hp["num_heads"] == k and hp["alpha"] == 2.5 and fitted.tensors["directions"].shape == (k, 64)
    assert len(set(map(tuple, diag["heads"]))) == k  # distinct heads, the best probes first
    assert diag["probe_accuracy"] == sorted(diag["probe_accuracy"], reverse=True)
    assert [[c["layer"], c["head"]] for c in diag["chosen_heads"]] == diag["heads"]
    assert set(diag["validation_ids"]) < {ex.id for ex in data.train}
