"""ReFT's published recipe (baselines/reft_published.py): the authors' settings recorded in the
bundle, one LoReFT per layer applied at every layer at pyreft's positions, the language-modelling
loss of the answer, nn.Linear's initialisation, Hugging Face's schedule, and old bundles unchanged.
The references here are computed by other paths: hooks written in the test on the whole
sequence, transformers' own scheduler, torch.nn.Linear's own bounds."""

import math
from types import SimpleNamespace

import pytest
import torch

from baselines import reft
from baselines.common import SELECTION_KEY
from baselines.reft_published import dropped, warmup_linear

from .test_reliability import _tiny_examples, _tiny_session
from .tiny import reloaded, tiny_model

CONFIG = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1}}


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama").requires_grad_(False)  # frozen, as every trained method's base model
    session = _tiny_session(model)
    return model, session, _tiny_examples(session, n=10)


def _fit(tiny, **given):
    model, session, examples = tiny
    return reft.ReFT.fit(session, SimpleNamespace(train=examples), CONFIG, {"recipe": "published", **given}, seed=0)


def _pyreft_sites(length, first, last):
    """pyreft's get_intervention_locations (share_weights): the first min(L//2, f) and the last
    min(L//2, l) prompt positions; the last one is p*."""
    f, l = min(length // 2, first), min(length // 2, last)
    return sorted(set(range(f)) | set(range(length - l, length)))


def _answer_logprobs(model, bundle, context, answer):
    """log p(answer tokens) with the whole sequence run once, LoReFT hooked by hand on every layer
    the bundle names at pyreft's positions of the prompt (gradients flow when enabled)."""
    hp = bundle.config["hyperparameters"]
    cols = torch.tensor(_pyreft_sites(len(context), hp["first"], hp["last"]))
    handles = []
    for i, layer in enumerate(hp["layers"]):
        R, W, b = (bundle.tensors[k][i] for k in ("R", "W", "b"))

        def hook(module, args, output, R=R, W=W, b=b):
            h = output[0] if isinstance(output, tuple) else output
            x = h[0, cols]
            h = h.index_put((torch.zeros_like(cols), cols), x + (x @ W.T + b - x @ R.T) @ R)
            return (h, *output[1:]) if isinstance(output, tuple) else h

        handles.append(model.model.layers[layer].register_forward_hook(hook))
    try:
        logits = model(torch.tensor([context + answer])).logits[0, len(context) - 1 : -1]
    finally:
        for handle in handles:
            handle.remove()
    return logits.log_softmax(-1).gather(-1, torch.tensor(answer)[:, None])[:, 0]


def test_published_fit_records_the_authors_settings_and_round_trips(tiny, tmp_path):
    model, session, examples = tiny
    fitted = _fit(tiny)
    hp, diag = fitted.config["hyperparameters"], fitted.config["diagnostics"]
    assert hp["recipe"] == "published"
    # stanfordnlp/pyreft examples/loreft/README.md, commonsense reasoning: -l all -r 8 -p f7+l7 -e 6 -lr 9e-4,
    # batch 16 x 2, dropout 0.00, warm-up 0.1.
    assert {k: hp[k] for k in ("rank", "first", "last", "lr", "epochs", "batch", "dropout", "warmup_ratio", "layers")} == \
        {"rank": 8, "first": 7, "last": 7, "lr": 9e-4, "epochs": 6, "batch": 32, "dropout": 0.0, "warmup_ratio": 0.1,
         "layers": [0, 1, 2, 3]}
    assert hp["epoch_kept"] == 6 and len(diag["history"]) == 6
    assert math.isfinite(diag[SELECTION_KEY]) and math.isfinite(diag["validation_loss_base"])
    assert set(diag["validation_ids"]) < {ex.id for ex in examples}
    assert {k: tuple(v.shape) for k, v in fitted.tensors.items()} == {"R": (4, 8, 32), "W": (4, 8, 32), "b": (4, 8)}
    for R in fitted.tensors["R"]:
        torch.testing.assert_close(R @ R.T, torch.eye(8), atol=1e-5, rtol=0)
    loaded = reloaded(fitted, tmp_path / "reft")
    assert loaded.config["hyperparameters"] == hp and loaded.prompt_sites(9) == [0, 1, 2, 3, 5, 6, 7]


@pytest.mark.parametrize("given", [{}, {"layers": [1, 3], "dropout": 0.05}])
def test_the_selection_loss_is_the_bundles_option_loss_with_every_layer_edited(tiny, given):
    # The validation-slice number equals the option cross-entropy of the bundle applied by hand
    # at each of its layers over the whole sequence (7-token prompts: pyreft's cap edits 3 + 3
    # tokens, not the middle one); dropout acts in training only.
    model, session, examples = tiny
    fitted = _fit(tiny, **given)
    assert fitted.tensors["R"].shape[0] == len(given.get("layers", range(4)))
    by_id = {ex.id: ex for ex in examples}
    losses = []
    for ex in map(by_id.get, fitted.config["diagnostics"]["validation_ids"]):
        with torch.no_grad():
            scores = torch.stack([_answer_logprobs(model, fitted, ex.context, option).sum() for option in ex.options])
        losses.append(float(torch.nn.functional.cross_entropy(scores[None], torch.tensor([ex.gold]))))
    assert fitted.config["diagnostics"][SELECTION_KEY] == pytest.approx(sum(losses) / len(losses), abs=1e-4)


def test_the_loss_is_the_token_mean_nll_of_the_gold_answers_and_one_step_follows_its_gradient(tiny):
    model, session, examples = tiny
    # warm-up over the one step: it runs at learning rate 0 (as Hugging Face's schedule), so the
    # bundle holds the initial parameters and the logged loss is theirs.
    start = _fit(tiny, epochs=1, warmup_ratio=1.0)
    assert start.tensors["W"].abs().max() <= 1 / math.sqrt(32)  # nn.Linear(32, 8)'s bound, not W = R
    assert start.tensors["b"].abs().max() <= 1 / math.sqrt(32)
    assert not torch.allclose(start.tensors["W"], start.tensors["R"], atol=0.05)
    held_out = set(start.config["diagnostics"]["validation_ids"])
    fit = [ex for ex in examples if ex.id not in held_out]
    W = start.tensors["W"].clone().requires_grad_(True)
    b = start.tensors["b"].clone().requires_grad_(True)
    probe = reft.ReFT(start.config, {**start.tensors, "W": W, "b": b})
    nll = -sum(_answer_logprobs(model, probe, ex.context, ex.options[ex.gold]).sum() for ex in fit)
    mean = nll / sum(len(ex.options[ex.gold]) for ex in fit)
    mean.backward()
    assert start.config["diagnostics"]["history"][0]["train_loss"] == pytest.approx(float(mean.detach()), abs=1e-5)
    # The same seed without warm-up takes one AdamW step at 9e-4: its first step moves every
    # coordinate by the learning rate against the sign of the gradient.
    stepped = _fit(tiny, epochs=1, warmup_ratio=0.0)
    for name, grad in (("W", W.grad), ("b", b.grad)):
        moved = start.tensors[name] - stepped.tensors[name]
        clear = grad.abs() > 1e-3 * grad.abs().max()
        assert torch.equal(torch.sign(moved[clear]), torch.sign(grad[clear]))
        torch.testing.assert_close(moved[clear].abs(), torch.full_like(moved[clear], 9e-4), atol=1e-5, rtol=0.02)


def test_the_schedule_is_hugging_faces_linear_schedule_with_warmup():
    from transformers import get_linear_schedule_with_warmup

    total, ratio = 18, 0.1
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_linear_schedule_with_warmup(optimizer, math.ceil(total * ratio), total)
    for step in range(total):
        assert warmup_linear(step, total, ratio) == pytest.approx(optimizer.param_groups[0]["lr"], abs=1e-9)
        optimizer.step()
        theirs.step()


def test_dropout_zeroes_a_fraction_and_rescales_the_rest():
    h = torch.full((200, 50), 3.0)
    out = dropped(h, 0.2, torch.Generator().manual_seed(0))
    zero = out == 0
    assert 0.17 < float(zero.float().mean()) < 0.23
    torch.testing.assert_close(out[~zero], torch.full_like(out[~zero], 3.0 / 0.8))
    assert dropped(h, 0.0, torch.Generator()) is h


def test_recipes_refuse_each_others_settings_and_bad_layers(tiny):
    model, session, examples = tiny
    with pytest.raises(ValueError, match="adapted recipe does not read \\['dropout'\\]"):
        reft.ReFT.fit(session, SimpleNamespace(train=examples), CONFIG, {"dropout": 0.05}, seed=0)
    with pytest.raises(ValueError, match="distinct layers in 0..3"):
        _fit(tiny, layers=[2, 7])


def test_a_bundle_without_layers_is_applied_at_its_site_alone():
    # Adapted bundles (and those from before recipes) keep 2-D tensors, edit l* only, and keep
    # their uncapped prompt positions.
    g = torch.Generator().manual_seed(0)
    config = {**CONFIG, "hyperparameters": {"first": 2, "last": 3}}
    R = reft.orthonormal_rows(torch.randn(3, 32, generator=g))
    W, b = torch.randn(3, 32, generator=g), torch.randn(3, generator=g)
    bundle = reft.ReFT(config, {"R": R, "W": W, "b": b})
    model, ids = tiny_model("llama"), torch.tensor([[5, 6, 7, 8]])

    def by_hand(layer):
        def hook(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            x = h[:, -1]
            h = h.clone()
            h[:, -1] = x + (x @ W.T + b - x @ R.T) @ R
            return (h, *output[1:]) if isinstance(output, tuple) else h

        handle = model.model.layers[layer].register_forward_hook(hook)
        try:
            return model(ids).logits
        finally:
            handle.remove()

    with torch.no_grad():
        with bundle.applied(model, None):
            applied = model(ids).logits
        torch.testing.assert_close(applied, by_hand(1))
        assert not torch.allclose(applied, by_hand(2), atol=1e-4)
    assert bundle.prompt_sites(9) == [0, 1, 6, 7]  # no cap at half the prompt


def test_a_shared_preamble_runs_once_per_step_with_the_same_loss_and_gradient():
    from baselines.reft_published import batch_gradient, shared_length
    from mari_eval.plan import Plan
    from mari_eval.train import Example

    model = tiny_model("llama").requires_grad_(False)
    session = _tiny_session(model)
    g = torch.Generator().manual_seed(3)
    preamble = torch.randint(1, 97, (12,), generator=g).tolist()
    examples = [Example(f"q{i}", preamble + torch.randint(1, 97, (9 + i,), generator=g).tolist(),
                        [torch.randint(1, 97, (2,), generator=g).tolist() for _ in range(3)], i % 3) for i in range(3)]
    # Prompts of 21-23 tokens: f7 edits 0..6 inside the preamble for all; l7 starts at 14 or later.
    assert shared_length(examples, 7, 7) == 12
    params = {"free": torch.randn(4, 8, 32, generator=g), "W": torch.randn(4, 8, 32, generator=g) * 0.1,
              "b": torch.randn(4, 8, generator=g) * 0.1}
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    R = reft.orthonormal_rows(params["free"])
    plan = Plan((0,), lambda ids, positions: reft.edits_at_layers(
        model, [0, 1, 2, 3], lambda i, h: reft.loreft(h, R[i], params["W"][i], params["b"][i]), positions))
    sites = lambda length: reft.pyreft_positions(length, 7, 7)
    whole = batch_gradient(session, examples, plan, sites, params, 0)
    once = batch_gradient(session, examples, plan, sites, params, 12)
    assert once[0] == pytest.approx(whole[0], abs=1e-5)
    for name in params:
        torch.testing.assert_close(once[1][name], whole[1][name], atol=1e-5, rtol=1e-4)
        assert float(whole[1][name].abs().max()) > 0
