"""ReFT's published recipe (baselines/reft_published.py): the authors' settings recorded in the
bundle, one LoReFT per layer applied at every layer at pyreft's positions, the language-modelling
loss of the answer, nn.Linear's initialisation, Hugging Face's schedule (its warm-up started a step
earlier), the step rule (at least 100 optimizer steps), a training that converges, and old bundles
unchanged. The references here are computed by other paths: hooks written in the test on the
whole sequence, transformers' own scheduler, torch.nn.Linear's own bounds, norms taken here."""

import math
from types import SimpleNamespace

import pytest
import torch

from baselines import reft, reft_published
from baselines.common import SELECTION_KEY
from baselines.loreft import continuous_rows, distance_from_init, dropped, initial_parameters
from baselines.reft_published import evaluation_loss, fit_published, step_plan, warmup_linear

from .tiny import reloaded, tiny_examples, tiny_model, tiny_session

CONFIG = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1}}


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama").requires_grad_(False)  # frozen, as every trained method's base model
    session = tiny_session(model)
    return model, session, tiny_examples(session, n=10)


def _fit(tiny, min_steps=6, examples=None, **given):
    """The published fit with ``min_steps`` (default: 6, so that the tests' fits take 6 epochs of one
    step; the recipe's 100 is ``test_published_fit_records_the_authors_settings_and_round_trips``'s)."""
    model, session, tiny_examples = tiny
    data = SimpleNamespace(train=examples or tiny_examples)
    given = {"recipe": "published", **given}
    return fit_published(reft.ReFT, session, data, CONFIG, given, seed=0, min_steps=min_steps)


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
    # The rule's least step count, MIN_STEPS (100), lowered to 12 for speed as a profile lowers it (--set min_steps=12).
    fitted = reft.ReFT.fit(session, SimpleNamespace(train=examples), CONFIG, {"recipe": "published", "min_steps": 12}, seed=0)
    hp, diag = fitted.config["hyperparameters"], fitted.config["diagnostics"]
    assert hp["recipe"] == "published"
    # stanfordnlp/pyreft examples/loreft/README.md, commonsense reasoning: -l all -r 8 -p f7+l7 -e 6 -lr 9e-4,
    # batch 16 x 2, dropout 0.00, warm-up 0.1.
    assert {k: hp[k] for k in ("rank", "first", "last", "lr", "min_epochs", "batch", "dropout", "warmup_ratio",
                               "layers")} == \
        {"rank": 8, "first": 7, "last": 7, "lr": 9e-4, "min_epochs": 6, "batch": 32, "dropout": 0.0,
         "warmup_ratio": 0.1, "layers": [0, 1, 2, 3]}
    # 8 fit examples, one batch: one step per epoch, so 12 epochs make the 12 steps.
    assert {k: hp[k] for k in ("min_steps", "steps_per_epoch", "epochs", "steps", "warmup_steps", "epoch_kept")} == \
        {"min_steps": 12, "steps_per_epoch": 1, "epochs": 12, "steps": 12, "warmup_steps": 2, "epoch_kept": 12}
    assert [record["epoch"] for record in diag["history"]] == list(range(1, 13))
    assert all(math.isfinite(record["validation_loss"]) for record in diag["history"])
    assert diag[SELECTION_KEY] == diag["history"][-1]["validation_loss"]  # the last epoch is kept
    assert math.isfinite(diag["validation_loss_base"]) and math.isfinite(diag["validation_loss_init"])
    assert set(diag["distance_from_init"]) == {"W_relative", "R_relative", "b", "b_relative"}
    assert set(diag["validation_ids"]) < {ex.id for ex in examples}
    assert {k: tuple(v.shape) for k, v in fitted.tensors.items()} == {"R": (4, 8, 32), "W": (4, 8, 32), "b": (4, 8)}
    for R in fitted.tensors["R"]:
        torch.testing.assert_close(R @ R.T, torch.eye(8), atol=1e-5, rtol=0)
    loaded = reloaded(fitted, tmp_path / "reft")
    assert loaded.config["hyperparameters"] == hp and loaded.prompt_sites(9) == [0, 1, 2, 3, 5, 6, 7]


def test_a_profile_lowers_the_published_step_count_in_the_bundles_key_and_the_adapted_recipe_refuses_it():
    # The quick and standard profiles' budgets (repro/engine/profiles.py QUICK_REFT_STEPS, STANDARD_REFT_STEPS):
    # published ReFT's least step count, passed as --set min_steps=N, so it is in the bundle's
    # hyperparameters and its cache key.
    from repro.engine import recipes
    from repro.engine.profiles import PROFILES, QUICK_REFT_STEPS, STANDARD_REFT_STEPS

    asked = []

    class Store:
        def bundle(self, method, attribute, model, seed, profile, hyperparameters=None):
            asked.append((method, hyperparameters))

    for method in ("reft", "caa"):
        for recipe in ("published", "adapted"):
            recipes.recipe_bundle(Store(), method, "bbq", "m", 0, PROFILES["quick"], recipe)
    recipes.recipe_bundle(Store(), "reft", "bbq", "m", 0, PROFILES["standard"], "published")
    recipes.recipe_bundle(Store(), "reft", "bbq", "m", 0, PROFILES["large"], "published")
    assert asked == [("reft", {"recipe": "published", "min_steps": QUICK_REFT_STEPS}), ("reft", None),
                     ("caa", {"recipe": "published"}), ("caa", None),
                     ("reft", {"recipe": "published", "min_steps": STANDARD_REFT_STEPS}), ("reft", {"recipe": "published"})]
    # The budget profile keeps the recipe's own least step count (MIN_STEPS) and selects the epoch on D_ctrl.
    asked.clear()
    recipes.recipe_bundle(Store(), "reft", "bbq", "m", 0, PROFILES["budget"], "published")
    assert asked == [("reft", {"recipe": "published", "epoch_selection": "best", "validation": "ctrl"})]
    # Its adapted recipes select on D_ctrl too: one labelled-data budget for both recipes and MARI's gate.
    asked.clear()
    for method in ("caa", "iti", "nl_iti", "reft"):
        recipes.recipe_bundle(Store(), method, "truthfulqa", "m", 0, PROFILES["budget"], "adapted")
    assert asked == [(m, {"validation": "ctrl"}) for m in ("caa", "iti", "nl_iti", "reft")]
    # Methods other than the four baselines: the profile's settings (the quick profile's LoRA epochs), else none.
    assert recipes.table_settings("lora", PROFILES["quick"]) == {"epochs": 5}
    assert recipes.table_settings("lora", PROFILES["standard"]) is None and recipes.table_settings("mari", PROFILES["quick"]) is None
    assert reft_published.published_hyperparameters(reft.ReFT, {"min_steps": 20}, 4)["min_steps"] == 20
    with pytest.raises(ValueError, match=r"hyperparameters.min_steps is 0"):
        reft_published.published_hyperparameters(reft.ReFT, {"min_steps": 0}, 4)
    with pytest.raises(ValueError, match=r"adapted recipe does not read \['min_steps'\]"):
        reft.ReFT.fit(None, None, CONFIG, {"min_steps": 20}, seed=0)


def test_the_step_rule_gives_at_least_100_steps_and_6_epochs():
    # pyreft README.md's few-example run: 10 examples, batch 10, 100 epochs.
    assert reft_published.MIN_STEPS == 100
    # (n_fit, batch, least epochs) -> (steps per epoch, epochs, steps): the standard profile's 20 fit examples,
    # TruthfulQA's whole D_train (80), 8 examples in batches of 3, and pyreft's commonsense data (~170k,
    # where 6 epochs stay 6).
    assert step_plan(20, 32, 6) == (1, 100, 100)
    assert step_plan(80, 32, 6) == (3, 34, 102)
    assert step_plan(8, 3, 6) == (3, 34, 102)
    assert step_plan(170_000, 32, 6) == (5313, 6, 31_878)
    assert step_plan(8, 32, 6, min_steps=1) == (1, 6, 6) and step_plan(8, 32, 1, min_steps=1) == (1, 1, 1)
    for total in (6, 100, 102, 31_878):
        assert warmup_linear(0, total, 0.1) > 0  # the first step learns
    with pytest.raises(ValueError, match="at least 1"):
        step_plan(0, 32, 6)
    # What a plan prices, from D_train's size and the settings alone: the budget profile's (validation=ctrl:
    # fit on all of D_train) on BBQ's 200, TruthfulQA's 100 and SORRY-Bench's 45; the standard profile's 20
    # steps on 24 examples less their 20% validation slice.
    assert [reft_published.planned_epochs(n, {"validation": "ctrl"}) for n in (200, 100, 45)] == [15, 25, 50]
    assert reft_published.planned_epochs(24, {"min_steps": 20}) == step_plan(20, 32, 6, min_steps=20)[1] == 20


def test_the_fit_takes_the_rules_steps_on_the_schedule(tiny):
    # 8 fit examples in batches of 3 with at least 30 steps: 3 steps per epoch, 10 epochs; each epoch's
    # last step ran at the schedule's rate for its index.
    fitted = _fit(tiny, min_steps=30, batch=3)
    hp, history = fitted.config["hyperparameters"], fitted.config["diagnostics"]["history"]
    assert (hp["steps_per_epoch"], hp["epochs"], hp["steps"], hp["warmup_steps"]) == (3, 10, 30, 3)
    assert len(history) == 10
    for epoch, record in enumerate(history):
        assert record["lr_last"] == pytest.approx(9e-4 * warmup_linear(3 * epoch + 2, 30, 0.1), rel=1e-12)


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


def test_the_loss_is_the_token_mean_nll_of_the_gold_answers_and_the_first_step_follows_its_gradient(tiny):
    model, session, examples = tiny
    # The start: drawn from the seed's generator; W and b within nn.Linear(32, 8)'s bound, W not R.
    start = initial_parameters(torch.Generator().manual_seed(0), 4, 8, 32)
    assert start["W"].abs().max() <= 1 / math.sqrt(32)  # nn.Linear(32, 8)'s bound, for W and b alike
    assert start["b"].abs().max() <= 1 / math.sqrt(32)
    R0 = continuous_rows(start["free"])
    assert not torch.allclose(start["W"], R0, atol=0.05)
    one = _fit(tiny, min_steps=1, epochs=1, warmup_ratio=0.0)  # one AdamW step at the full rate
    held_out = set(one.config["diagnostics"]["validation_ids"])
    fit = [ex for ex in examples if ex.id not in held_out]
    W = start["W"].clone().requires_grad_(True)
    b = start["b"].clone().requires_grad_(True)
    probe = reft.ReFT(one.config, {"R": R0, "W": W, "b": b})
    nll = -sum(_answer_logprobs(model, probe, ex.context, ex.options[ex.gold]).sum() for ex in fit)
    mean = nll / sum(len(ex.options[ex.gold]) for ex in fit)
    mean.backward()
    # The logged loss is the start's (taken before the step)...
    assert one.config["diagnostics"]["history"][0]["train_loss"] == pytest.approx(float(mean.detach()), abs=1e-5)
    # ...and Adam's first step moves every coordinate by the learning rate against the sign of the
    # gradient: 9e-4 without warm-up; with the recipe's 10% warm-up of one step, half that (Hugging
    # Face's schedule would run this step at 0).
    warm = _fit(tiny, min_steps=1, epochs=1)
    for fitted, lr in ((one, 9e-4), (warm, 4.5e-4)):
        for name, grad in (("W", W.grad), ("b", b.grad)):
            moved = start[name] - fitted.tensors[name]
            clear = grad.abs() > 1e-3 * grad.abs().max()
            assert torch.equal(torch.sign(moved[clear]), torch.sign(grad[clear]))
            torch.testing.assert_close(moved[clear].abs(), torch.full_like(moved[clear], lr), atol=lr / 50, rtol=0.02)


def _learnable_examples(session, n=10):
    """Random prompts whose gold option is always the tokens [5, 6] (among two random ones): a
    preference an edit can learn from the fit examples and show on the held-out ones."""
    from mari_eval.training.train import Example

    g = torch.Generator().manual_seed(2)
    examples = []
    for i in range(n):
        options = [torch.randint(7, 97, (2,), generator=g).tolist() for _ in range(3)]
        options[i % 3] = [5, 6]
        examples.append(Example(f"learn{i}", torch.randint(1, 97, (9,), generator=g).tolist(), options, i % 3))
    session.prepare(examples, "learnable")
    return examples


def test_training_lowers_the_validation_loss_and_moves_the_edit_from_its_start(tiny):
    model, session, _ = tiny
    fitted = _fit(tiny, min_steps=30, examples=_learnable_examples(session))
    diag = fitted.config["diagnostics"]
    history = diag["history"]
    assert len(history) == 30 and fitted.config["hyperparameters"]["steps"] == 30
    # The validation loss falls from the random start's, epoch after epoch, and ends below the untouched
    # model's; so does the training loss.
    losses = [diag["validation_loss_init"]] + [record["validation_loss"] for record in history]
    assert all(later <= earlier + 1e-3 for earlier, later in zip(losses, losses[1:]))
    assert history[-1]["validation_loss"] < diag["validation_loss_init"] - 0.05
    assert history[-1]["validation_loss"] < diag["validation_loss_base"] - 0.05
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.05
    # The recorded distances, taken here from the seed's start and the bundle's tensors.
    start = initial_parameters(torch.Generator().manual_seed(0), 4, 8, 32)
    start["R"] = continuous_rows(start["free"])
    for key, name, relative in (("W_relative", "W", True), ("R_relative", "R", True), ("b", "b", False)):
        per_layer = [float(torch.linalg.norm(fitted.tensors[name][i] - start[name][i]) /
                           (torch.linalg.norm(start[name][i]) if relative else 1)) for i in range(4)]
        assert diag["distance_from_init"][key]["mean"] == pytest.approx(sum(per_layer) / 4, abs=1e-5)
        assert diag["distance_from_init"][key]["max"] == pytest.approx(max(per_layer), abs=1e-5)
    assert diag["distance_from_init"]["W_relative"]["mean"] > 0.05 and diag["distance_from_init"]["b"]["mean"] > 0.01
    same = distance_from_init({k: start[k] for k in "RWb"}, {k: start[k] for k in "RWb"})
    assert all(v == {"mean": 0.0, "max": 0.0} for v in same.values())


def test_R_follows_its_free_matrix_continuously():
    # Along a straight path of the free matrix, QR's Householder signs flip a row of
    # reft.orthonormal_rows (a jump of norm 2); continuous_rows spans the same rows and moves smoothly.
    g = torch.Generator().manual_seed(0)
    free, direction = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    path = [free + t * direction for t in torch.linspace(0, 1, 2001)]
    jumps = lambda f: max(float((f(a) - f(b)).norm()) for a, b in zip(path, path[1:]))
    assert jumps(reft.orthonormal_rows) > 1.9
    assert jumps(continuous_rows) < 0.05
    for point in path[::500]:
        R = continuous_rows(point)
        torch.testing.assert_close(R @ R.T, torch.eye(8), atol=1e-5, rtol=0)
        theirs = reft.orthonormal_rows(point)
        torch.testing.assert_close(R.T @ R, theirs.T @ theirs, atol=1e-5, rtol=0)  # the same row space
    stacked = torch.stack(path[:3])
    torch.testing.assert_close(continuous_rows(stacked), torch.stack([continuous_rows(p) for p in path[:3]]))


def test_the_schedule_is_hugging_faces_linear_schedule_with_its_warmup_started_a_step_earlier():
    from transformers import get_linear_schedule_with_warmup

    for total, ratio in ((18, 0.1), (100, 0.1), (102, 0.1), (6, 0.1), (10, 0.0), (4, 1.0)):
        warmup = math.ceil(total * ratio)
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        theirs = get_linear_schedule_with_warmup(optimizer, warmup, total)
        for step in range(total):
            ours = warmup_linear(step, total, ratio)
            if step >= warmup:  # the decay: theirs
                assert ours == pytest.approx(optimizer.param_groups[0]["lr"], abs=1e-9)
            else:  # the ramp: from 0 one step before the first step to the peak at step `warmup`
                assert ours == pytest.approx((step + 1) / (warmup + 1), abs=1e-12)
            optimizer.step()
            theirs.step()
        assert 0 < warmup_linear(0, total, ratio) <= 1


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
    from mari_eval.injection.plan import Plan
    from mari_eval.training.train import Example

    model = tiny_model("llama").requires_grad_(False)
    session = tiny_session(model)
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

    # The validation loss reads the preamble once too: the option cross-entropy by hooks on whole sequences.
    config = {**CONFIG, "hyperparameters": {"first": 7, "last": 7, "layers": [0, 1, 2, 3], "recipe": "published"}}
    bundle = reft.ReFT(config, {"R": R.detach(), "W": params["W"].detach(), "b": params["b"].detach()})
    with torch.no_grad():
        by_hand = [float(torch.nn.functional.cross_entropy(torch.stack(
            [_answer_logprobs(model, bundle, ex.context, option).sum() for option in ex.options])[None],
            torch.tensor([ex.gold]))) for ex in examples]
    assert evaluation_loss(session, bundle, examples) == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-4)


def test_epoch_selection_best_keeps_the_epoch_of_the_lowest_validation_loss(tiny):
    """--set epoch_selection=best (pyreft's GLUE practice): the kept tensors are the best validation epoch's,
    recorded as epoch_kept, and the selection loss is that epoch's, recomputed from the kept bundle."""
    model, session, examples = tiny
    fitted = _fit(tiny, min_steps=12, epoch_selection="best")
    hp, diag = fitted.config["hyperparameters"], fitted.config["diagnostics"]
    losses = [record["validation_loss"] for record in diag["history"]]
    assert hp["epoch_selection"] == "best" and len(losses) == 12
    assert hp["epoch_kept"] == 1 + losses.index(min(losses))
    assert diag[SELECTION_KEY] == min(losses)
    val = [ex for ex in examples if ex.id in set(diag["validation_ids"])]
    assert reft_published.evaluation_loss(session, fitted, val) == pytest.approx(min(losses), abs=1e-5)
    last = _fit(tiny, min_steps=12)  # the default keeps the last epoch: the same run, other tensors unless it is the best
    assert "epoch_selection" not in last.config["hyperparameters"] and last.config["hyperparameters"]["epoch_kept"] == 12
    assert [r["validation_loss"] for r in last.config["diagnostics"]["history"]] == losses
    with pytest.raises(ValueError, match=r"adapted recipe does not read \['epoch_selection'\]"):
        reft.ReFT.fit(session, SimpleNamespace(train=examples), CONFIG, {"epoch_selection": "best"}, seed=0)
    with pytest.raises(ValueError, match="epoch_selection"):
        _fit(tiny, epoch_selection="first")
