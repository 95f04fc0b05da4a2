"""ITI and NL-ITI's adapted fit scores its validation grid in one run per question
(every (K, alpha) cell a variant of one plan) and reads head outputs without the vocabulary
projection. These tests keep the slow path as a reference and check that the fitted bundle is
the same: the same cell chosen, the same grid losses and tensors to 1e-5."""

import pytest
import torch

from baselines import iti
from baselines.common import held_out_slice, validation_loss
from mari_eval.evaluation import runner
from mari_eval.injection import site
from mari_eval.injection.plan import BASE, Plan
from mari_eval.evaluation.prefix_cache import broadcast_cache, encode_prefix, with_cache

from .tiny import chat_free_session
from .tiny import attribute_of, char_examples, tiny_config
from .tiny import tiny_model

FRACTIONS, ALPHAS = [0.125, 0.25, 0.5], [2.5, 15.0]  # K = 2, 4, 8 of the tiny model's 16 heads


@torch.no_grad()
def _reference_head_outputs(session, ex, continuations, tokens):
    """The head outputs as read before: every position's logits computed."""
    model = session.model
    rows = [[ex.context[-1]] + list(c) for c in continuations]
    width = max(map(len, rows))
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows])
    owner, cols = [], []
    for r, row in enumerate(rows):
        span = range(max(1, len(row) - tokens), len(row))
        owner += [r] * len(span)
        cols += list(span)
    owner_t = torch.tensor(owner)
    cache = broadcast_cache(session.prefix(ex).cache, len(rows))
    with site.capture_attention_heads(model, range(session.num_layers), (owner_t, torch.tensor(cols))) as seen:
        model(input_ids=ids, **with_cache(model, cache), use_cache=cache is not None)
    count = torch.bincount(owner_t, minlength=len(rows))[:, None].float()
    return torch.stack([torch.zeros(len(rows), seen[l].shape[-1]).index_add_(0, owner_t, seen[l].float()) / count
                        for l in range(session.num_layers)], 1)


def _reference_fit(cls, session, examples, seed=0):
    """The adapted fit as it ran before: one validation run per grid cell, each cell's shift alone."""
    fit_examples, val_examples = held_out_slice(examples, seed)
    session.prepare(examples, "reference", lower=False)
    n_heads, head_dim = site.attention_heads(session.model)
    feats, labels, owner = [], [], []
    for i, ex in enumerate(fit_examples + val_examples):
        positive, negative = ex.contrast()
        acts = _reference_head_outputs(session, ex, positive + negative, cls.tokens)
        feats.append(acts.reshape(len(acts), session.num_layers * n_heads, head_dim))
        labels += [1.0] * len(positive) + [0.0] * len(negative)
        owner += [i] * len(acts)
    x, y, owner = torch.cat(feats), torch.tensor(labels), torch.tensor(owner)
    is_fit = owner < len(fit_examples)
    accuracy = iti.probe_accuracy(x[is_fit], y[is_fit], x[~is_fit], y[~is_fit], cls.probe, seed)
    ranked = iti.rank_heads(accuracy)
    base = validation_loss(session, val_examples)
    scores = {}
    for fraction in FRACTIONS:
        k = max(1, round(fraction * session.num_layers * n_heads))
        top = ranked[:k]
        theta, sigma = iti.mass_mean(x[is_fit][:, top], y[is_fit])
        heads = torch.stack([top // n_heads, top % n_heads], 1)
        for alpha in ALPHAS:
            shifts = iti.layer_shifts(session.model, heads, alpha * sigma[:, None] * theta)
            plan = Plan((0,), lambda ids, pos, shifts=shifts: site.shift_attention_from_site(session.model, shifts, pos))
            scores[(k, alpha)] = validation_loss(session, val_examples, plan)
    k, alpha = min(scores, key=scores.get)
    top = ranked[:k]
    theta, sigma = iti.mass_mean(x[:, top], y)
    return {"scores": scores, "base": base, "k": k, "alpha": alpha, "heads": torch.stack([top // n_heads, top % n_heads], 1),
            "directions": theta, "sigma": sigma, "x": x}


@pytest.mark.parametrize("cls", [iti.ITI, iti.NLITI])
def test_the_one_pass_grid_fits_the_bundle_the_per_cell_runs_fitted(cls):
    model = tiny_model("llama")
    session = chat_free_session(model)
    examples = char_examples(session, n=20)
    reference = _reference_fit(cls, session, examples)
    fitted = cls.fit(session, attribute_of(examples), tiny_config(model), {"head_fractions": FRACTIONS, "alphas": ALPHAS}, seed=0)
    hp, diag = fitted.config["hyperparameters"], fitted.config["diagnostics"]
    assert (hp["num_heads"], hp["alpha"]) == (reference["k"], reference["alpha"])
    assert list(diag["validation_loss"]) == [f"{k}:{a}" for k, a in reference["scores"]]  # the grid, in its order
    assert diag["validation_loss"] == pytest.approx({f"{k}:{a}": v for (k, a), v in reference["scores"].items()}, abs=1e-5)
    assert diag["validation_loss_base"] == pytest.approx(reference["base"], abs=1e-5)
    assert len(set(reference["scores"].values())) > 1  # the cells differ: the grid is not trivially equal
    assert torch.equal(fitted.tensors["heads"], reference["heads"])
    torch.testing.assert_close(fitted.tensors["directions"], reference["directions"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fitted.tensors["sigma"], reference["sigma"], atol=1e-5, rtol=1e-5)


def test_head_outputs_read_without_the_vocabulary_projection_are_the_same():
    model = tiny_model("llama")
    session = chat_free_session(model)
    ex = char_examples(session, n=1)[0]
    session.prepare([ex], "test", lower=False)
    for tokens in (1, 4):
        torch.testing.assert_close(iti.head_outputs(session, ex, ex.options, tokens),
                                   _reference_head_outputs(session, ex, ex.options, tokens), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3's 6-token window: the padded-batch path
def test_grid_variants_in_one_run_equal_each_cells_shift_alone(family):
    model = tiny_model(family, sliding_window=6)
    n_heads, _ = site.attention_heads(model)
    gen = torch.Generator().manual_seed(0)
    cells = []
    for layers in ([1], [0, 2], [3]):
        heads = torch.tensor([[layer, h % n_heads] for h, layer in enumerate(layers)])
        cells.append(iti.layer_shifts(model, heads, torch.randn(len(layers), site.attention_heads(model)[1], generator=gen)))
    prefix = encode_prefix(model, [5, 17, 33, 2, 9, 11])
    options = [[3, 4], [70, 71, 72], [8]]
    together = runner.score_variants(model, prefix, 41, options, iti.grid_plan(model, cells))
    assert together.variants == [BASE, 0, 1, 2]
    alone = [runner.score_variants(model, prefix, 41, options, runner.VANILLA).logprobs[0]]
    for shifts in cells:
        plan = Plan((0,), lambda ids, pos, shifts=shifts: site.shift_attention_from_site(model, shifts, pos))
        alone.append(runner.score_variants(model, prefix, 41, options, plan).logprobs[0])
    torch.testing.assert_close(together.logprobs, torch.stack(alone), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(together.logprobs[1], together.logprobs[0])  # the shifts move the scores


def _reference_probe_accuracy(x_fit, y_fit, x_val, y_val, kind, seed):
    """``iti.probe_accuracy`` as it was: einsums over [N, G, d] features (the same training loop)."""
    gen = torch.Generator().manual_seed(seed)
    mean, std = x_fit.mean(0), x_fit.std(0) + 1e-6
    x_fit, x_val = (x_fit - mean) / std, (x_val - mean) / std
    groups, dim = x_fit.shape[1:]
    if kind == "linear":
        params = [torch.zeros(groups, dim), torch.zeros(groups)]
        logits = lambda x, w, b: torch.einsum("ngd,gd->ng", x, w) + b
    else:
        params = [torch.randn(groups, dim, iti.MLP_WIDTH, generator=gen) / dim**0.5, torch.zeros(groups, iti.MLP_WIDTH),
                  torch.randn(groups, iti.MLP_WIDTH, generator=gen) / iti.MLP_WIDTH**0.5, torch.zeros(groups)]
        logits = lambda x, w1, b1, w2, b2: torch.einsum("ngm,gm->ng", torch.relu(torch.einsum("ngd,gdm->ngm", x, w1) + b1), w2) + b2
    return iti.fit_probes(logits, params, x_fit, y_fit, x_val, y_val)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_head_major_probes_equal_the_einsum_probes(kind, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(60, 12, 8, generator=gen) * torch.rand(12, 8, generator=gen) * 3
    y = torch.arange(60) % 4 == 0
    x[y, :, 0] += 1.0  # a signal the probes can find
    monkeypatch.setattr(iti, "PROBE_STEPS", 40)
    expected = _reference_probe_accuracy(x[:40], y[:40].float(), x[40:], y[40:].float(), kind, 0)
    got = iti.probe_accuracy(x[:40], y[:40].float(), x[40:], y[40:].float(), kind, 0)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert float(got.max()) > 0.5  # the probes learnt something
