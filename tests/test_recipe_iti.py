"""ITI's and NL-ITI's published recipes (``baselines.iti_published``): what the fit records, the
round trip of its bundle, and each piece the authors' recipe changes against an independent
computation: the probe rows (TruthfulQA's MC2 answers), scikit-learn's logistic regression,
NL-ITI's probe as torch.nn modules trained head by head, numpy's mass mean and population std,
the heads' outputs read from the whole sequence, and the answer-only shift against hooks on
the heads themselves; and, for both recipes (``baselines.iti_heads``), the order of heads that
tie and the record of the chosen heads."""

import dataclasses

import numpy as np
import pytest
import torch

from baselines import iti, iti_activations, iti_heads, iti_published
from baselines.common import SELECTION_KEY
from mari_eval.evaluation import runner
from mari_eval.methods.bundle_spec import BundleError
from mari_eval.evaluation.prefix_cache import encode_prefix
from mari_eval.training.train import Example

from .tiny import chat_free_session
from .iti_expect import head_shift, heads_shifted
from .tiny import reloaded, tiny_model
from .tiny import char_examples
from .tiny import attribute_of
from .tiny import tiny_config


def _mc2(examples):
    """Made-up MC2 answers, none of them an MC1 option, 1 to 3 true and 2 to 4 false per question."""
    return {ex.id: ([f"true {i}.{j}" for j in range(1 + i % 3)], [f"false {i}.{j} no" for j in range(2 + i % 3)])
            for i, ex in enumerate(examples)}


@pytest.fixture
def mc2(monkeypatch):
    """The examples' MC2 answers, served where the published fit reads TruthfulQA's data file."""
    served = {}
    monkeypatch.setattr(iti_activations, "truthfulqa_mc2", lambda: served)
    return served


@pytest.mark.parametrize("cls, probe, probe_tokens, tokens, shift_from", [
    (iti.ITI, "linear", 1, 1, "answer"), (iti.NLITI, "mlp", 4, 6, "last_prompt_token")])
def test_published_fit_records_its_recipe_and_round_trips(tmp_path, mc2, cls, probe, probe_tokens, tokens, shift_from):
    model = tiny_model("llama")
    session = chat_free_session(model)
    examples = char_examples(session)
    mc2.update(_mc2(examples))
    fitted = cls.fit(session, attribute_of(examples), tiny_config(model), {"recipe": "published"}, seed=0)
    hp, diag = fitted.config["hyperparameters"], fitted.config["diagnostics"]
    assert (hp["recipe"], hp["alpha"], hp["probe"], hp["probe_tokens"], hp["tokens"], hp["shift_from"]) == \
        ("published", 15.0, probe, probe_tokens, tokens, shift_from)
    assert hp["num_heads"] == 1 and hp["head_fraction"] == 48 / 1024  # 48/1024 of 16 heads rounds to 1
    assert hp["prompt_format"] == ("Q: {question} A: {answer}" if cls is iti.ITI else "Q: {question}\nA: {answer}")
    assert hp["probe_answers"] == "mc2"
    assert np.isfinite(diag[SELECTION_KEY]) and np.isfinite(diag["validation_loss_base"])
    assert diag[SELECTION_KEY] != diag["validation_loss_base"]  # the shift moves the validation loss
    assert set(diag["validation_ids"]) < {ex.id for ex in examples} and len(diag["validation_ids"]) == 2
    loaded = reloaded(fitted, tmp_path / cls.method)
    assert loaded.config["hyperparameters"] == hp
    # bundle.json names the shifted heads with their probes' accuracies, and lm-eval's diagnostics show them.
    chosen = loaded.config["diagnostics"]["chosen_heads"]
    assert [[c["layer"], c["head"]] for c in chosen] == fitted.tensors["heads"].tolist()
    assert [c["validation_accuracy"] for c in chosen] == pytest.approx(diag["probe_accuracy"], abs=1e-6)
    summary = loaded.summarize([])
    assert summary["chosen_heads"] == chosen and summary["heads_tied_at_boundary"] >= 1
    prefix = encode_prefix(model, [5, 17, 33, 2])
    runs = [runner.score_variants(model, prefix, 41, [[3, 4], [70, 71, 72]], b.plan(model)) for b in (fitted, loaded)]
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)


def test_published_probe_rows_are_every_mc2_answer_of_the_fit_and_validation_questions(mc2, monkeypatch):
    """honest_llama ``tokenized_tqa`` and NL-ITI ``prepare_dataset``: one row per answer of
    ``mc2_targets``, label 1 for each true answer, 0 for each false one, split by question."""
    model = tiny_model("llama")
    session = chat_free_session(model)
    examples = char_examples(session)
    mc2.update(_mc2(examples))
    seen, texts = {}, []
    scored = iti_published.logistic_accuracy

    def spy(x_fit, y_fit, x_val, y_val, seed, **score):
        seen.update(fit=y_fit.clone(), val=y_val.clone(), **score)
        return scored(x_fit, y_fit, x_val, y_val, seed, **score)

    read = iti_activations.window_outputs
    monkeypatch.setattr(iti_published, "logistic_accuracy", spy)
    monkeypatch.setattr(iti_activations, "window_outputs", lambda s, t, w: texts.extend(t) or read(s, t, w))
    fitted = iti.ITI.fit(session, attribute_of(examples), tiny_config(model), {"recipe": "published"}, seed=0)
    val_ids = set(fitted.config["diagnostics"]["validation_ids"])
    for part, ids in (("fit", {ex.id for ex in examples} - val_ids), ("val", val_ids)):
        true, false = sum(len(mc2[i][0]) for i in ids), sum(len(mc2[i][1]) for i in ids)
        assert (len(seen[part]), int(seen[part].sum())) == (true + false, true), part
    assert fitted.config["diagnostics"]["probe_validation"]["rows"] == len(seen["val"])
    assert seen["score"] == fitted.config["diagnostics"]["head_score"] == "accuracy"  # no head_score given: the authors'
    answers = {target for _, target in texts}
    assert answers >= {f" {a}" for true, false in mc2.values() for a in true + false}
    assert not answers & {f" {c}" for ex in examples for c in ex.choices}  # no MC1 option is probed


def test_probe_rows_elsewhere_are_the_options_or_the_refusal():
    session = chat_free_session(tiny_model("llama"))
    examples = char_examples(session, n=2)
    kind, answers = iti_activations.probe_answers("bbq", examples)
    assert kind == "options" and answers[1] == ([examples[1].choices[1]], [examples[1].choices[0], examples[1].choices[2]])
    refusal = Example("s", [1], [[2]], None, question="Do it", choices=["I can't."])
    assert iti_activations.probe_answers("sorry_bench", [refusal]) == ("refusal", [(["I can't."], [iti_activations.COMPLIANCE_TARGET])])


def test_a_training_question_missing_from_the_truthfulqa_file_is_named(mc2):
    session = chat_free_session(tiny_model("llama"))
    with pytest.raises(ValueError, match=r"probes TruthfulQA's MC2 answers, but 2 training example\(s\) \(ex0, ex1\).*MARI_DATA_DIR"):
        iti_activations.probe_answers("truthfulqa", char_examples(session, n=2))


def test_published_recipe_refuses_the_adapted_grid():
    model = tiny_model("llama")
    session = chat_free_session(model)
    with pytest.raises(ValueError, match="published recipe fixes K and alpha.*drop --set alphas"):
        iti.ITI.fit(session, attribute_of(char_examples(session)), tiny_config(model), {"recipe": "published", "alphas": [1.0]}, seed=0)


def test_k_is_itis_share_of_the_heads():
    assert iti_published.num_heads_for(1024) == 48  # Llama-7B: the authors' K
    assert iti_published.num_heads_for(30 * 9) == 13  # SmolLM2-135M
    assert iti_published.num_heads_for(16) == 1


def test_heads_that_tie_are_ordered_by_the_seed_not_by_their_index():
    # SmolLM2's 30 x 9 heads on 4 accuracies, as a validation slice of a few questions scores them.
    n_layers, n_heads = 30, 9
    accuracy = torch.tensor([0.5, 0.75, 0.625, 1.0])[torch.arange(n_layers * n_heads) * 7 % 4]
    ranked = iti_heads.rank_heads(accuracy, seed=0)
    assert sorted(ranked.tolist()) == list(range(n_layers * n_heads))
    assert accuracy[ranked].tolist() == sorted(accuracy.tolist(), reverse=True)  # best first
    assert torch.equal(ranked, iti_heads.rank_heads(accuracy, seed=0))  # the same seed, the same order
    assert not torch.equal(ranked, iti_heads.rank_heads(accuracy, seed=1))
    best = ranked[: int((accuracy == 1.0).sum())].tolist()
    assert best != sorted(best) and best != sorted(best, reverse=True)  # neither by index nor by reversed index
    # No layer is favoured: with every head tied, the top 13's mean layer over 200 seeds is the middle one, 14.5
    # (ties by index gave 0.3, the reversed stable argsort 28.7).
    tied = torch.full((n_layers * n_heads,), 0.5)
    layers = torch.stack([iti_heads.rank_heads(tied, seed)[:13] // n_heads for seed in range(200)]).float()
    assert abs(layers.mean().item() - 14.5) < 1.0


def test_the_choice_record_names_the_heads_and_counts_those_tied_at_the_kth_accuracy():
    accuracy = torch.tensor([0.6, 0.9, 0.8, 0.8, 0.5, 0.8, 0.7, 0.8, 0.4])  # 3 layers x 3 heads; four at 0.8
    labels = torch.tensor([1.0, 0, 0, 0, 1, 0])
    record = iti_heads.choice_record(accuracy, iti_heads.rank_heads(accuracy, seed=3), 3, 3, labels)
    chosen = record["chosen_heads"]
    assert chosen[0] == {"layer": 0, "head": 1, "validation_accuracy": 0.9}
    assert [c["validation_accuracy"] for c in chosen[1:]] == [0.8, 0.8]
    assert {(c["layer"], c["head"]) for c in chosen[1:]} < {(0, 2), (1, 0), (1, 2), (2, 1)}
    assert (record["boundary_accuracy"], record["heads_tied_at_boundary"], record["tied_heads_chosen"]) == (0.8, 4, 2)
    assert record["probe_validation"] == {"rows": 6, "true_rows": 2, "majority_accuracy": round(4 / 6, 6),
                                          "accuracy_min": 0.4, "accuracy_max": 0.9}
    with pytest.raises(ValueError, match="K = 10 heads asked of 9"):
        iti_heads.choice_record(accuracy, iti_heads.rank_heads(accuracy), 10, 3)


def test_a_bundle_without_the_record_loads_and_shows_its_heads_and_a_damaged_record_is_refused(tmp_path):
    model = tiny_model("llama")
    plain = _published_bundle(model, "answer")
    old = iti.ITI({**plain.config, "diagnostics": {"probe_accuracy": [0.9, 0.75], "heads": [[1, 0], [2, 3]]}}, plain.tensors)
    summary = reloaded(old, tmp_path / "old").summarize([])
    assert summary["chosen_heads"] == [{"layer": 1, "head": 0, "validation_accuracy": 0.9},
                                       {"layer": 2, "head": 3, "validation_accuracy": 0.75}]
    assert summary["head_tie_rule"].startswith("not recorded") and "heads_tied_at_boundary" not in summary
    damaged = {"chosen_heads": [{"layer": 1, "head": 0, "validation_accuracy": 1.5}]}
    with pytest.raises(BundleError, match=r"diagnostics\.chosen_heads\[0\]\.validation_accuracy is 1\.5"):
        iti.ITI({**plain.config, "diagnostics": damaged}, plain.tensors)


def _newton_logistic(x: np.ndarray, y: np.ndarray, C: float = 1.0) -> tuple[np.ndarray, float]:
    """argmin 0.5 |w|^2 + C sum log(1 + exp(-s (x w + b))), the intercept unpenalised, by Newton's method."""
    X = np.hstack([x, np.ones((len(x), 1))])
    reg = np.ones(X.shape[1])
    reg[-1] = 0
    theta = np.zeros(X.shape[1])
    for _ in range(100):
        p = 1 / (1 + np.exp(-X @ theta))
        grad = C * X.T @ (p - y) + reg * theta
        if np.abs(grad).max() < 1e-10:
            break
        theta -= np.linalg.solve(C * (X.T * (p * (1 - p))) @ X + np.diag(reg), grad)
    return theta[:-1], theta[-1]


def test_itis_probes_are_l2_logistic_regressions_on_raw_outputs_ranked_by_plain_accuracy():
    g = torch.Generator().manual_seed(0)
    n, heads, dim = 300, 6, 8
    y = (torch.rand(n, generator=g) > 0.75).float()  # unbalanced, as one true answer among several
    scale = torch.tensor([0.05, 0.3, 1.0, 3.0, 0.5, 10.0])  # raw head outputs differ in scale: nothing is standardised
    x = torch.randn(n, heads, dim, generator=g) * scale[:, None] + 0.3 * y[:, None, None] * scale[:, None]
    fit, val = slice(0, 220), slice(220, n)
    ours = iti_published.logistic_accuracy(x[fit], y[fit], x[val], y[val], seed=0)
    xs, ys = x.double().numpy(), y.numpy()
    for h in range(heads):
        # Li et al. (2023), honest_llama train_probes: LogisticRegression() (L2, C = 1), accuracy_score on the validation split.
        w, b = _newton_logistic(xs[fit, h], ys[fit])
        plain = ((xs[val, h] @ w + b > 0) == (ys[val] > 0.5)).mean()
        assert ours[h].item() == pytest.approx(plain, abs=1e-6), h
    # Plain, not balanced, accuracy: head 0's outputs are too small to move its probe off "false" (the
    # majority), which scores the share of false answers (balanced accuracy would give it 0.5).
    assert ours[0].item() == pytest.approx(float((y[val] < 0.5).float().mean()), abs=1e-6)


def test_mlp_probes_are_nl_itis_probe_trained_head_by_head():
    from torch import nn

    g = torch.Generator().manual_seed(0)
    n, heads, dim, seed = 100, 3, 8, 5
    y = (torch.rand(n, generator=g) > 0.5).float()
    x = torch.randn(n, heads, dim, generator=g)
    x[:, 1, :2] += 1.5 * (2 * y[:, None] - 1)  # head 1 carries the label
    fit, val = slice(0, 80), slice(80, n)
    ours = iti_published.mlp_accuracy(x[fit], y[fit], x[val], y[val], seed)

    # NL-ITI (probes.MLP_S, probing.train_model): Linear-BatchNorm-ReLU-Linear-Sigmoid, BCELoss, Adam(5e-4, wd 1e-4),
    # 10 epochs of shuffled batches of 32 (drop_last), the validation accuracy of the best epoch. Every head starts
    # from the same weights (its seed) and sees the same batch order (one permutation per epoch from the seed).
    init = torch.Generator().manual_seed(seed)
    draw = lambda shape, fan_in: (torch.rand(shape, generator=init) * 2 - 1) / fan_in**0.5
    w1, b1, w2, b2 = draw((dim, 16), dim), draw((16,), dim), draw((16,), 16), draw((), 16)
    orders = torch.Generator().manual_seed(seed)
    epochs = [torch.randperm(80, generator=orders) for _ in range(10)]
    for h in range(heads):
        probe = nn.Sequential(nn.Linear(dim, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
        with torch.no_grad():
            probe[0].weight.copy_(w1.T), probe[0].bias.copy_(b1), probe[3].weight.copy_(w2[None]), probe[3].bias.copy_(b2[None])
        opt = torch.optim.Adam(probe.parameters(), lr=5e-4, weight_decay=1e-4)
        best = -1.0
        for order in epochs:
            probe.train()
            for start in range(0, 80 - 32 + 1, 32):
                batch = order[start : start + 32]
                opt.zero_grad()
                nn.BCELoss()(probe(x[fit][batch, h]), y[fit][batch, None]).backward()
                opt.step()
            probe.eval()
            with torch.no_grad():
                accuracy = ((probe(x[val, h]) > 0.5).float()[:, 0] == y[val]).float().mean().item()
            best = max(best, accuracy)
        assert ours[h].item() == pytest.approx(best, abs=1e-6), h
    assert int(ours.argmax()) == 1


def test_direction_is_the_mass_mean_and_sigma_the_population_std_of_the_tuning_projections():
    g = torch.Generator().manual_seed(0)
    x, tuning = torch.randn(40, 3, 5, generator=g), torch.randn(25, 3, 5, generator=g)
    y = (torch.arange(40) % 4 == 0).float()
    theta, sigma = iti_published.direction_and_sigma(x, y, tuning)
    xs, ts = x.numpy().astype(np.float64), tuning.numpy().astype(np.float64)
    for k in range(3):  # honest_llama get_com_directions and get_interventions_dict, in numpy
        direction = xs[y.numpy() == 1, k].mean(0) - xs[y.numpy() == 0, k].mean(0)
        direction /= np.linalg.norm(direction)
        np.testing.assert_allclose(theta[k].numpy(), direction, rtol=1e-5, atol=1e-6)
        assert sigma[k].item() == pytest.approx(np.std(ts[:, k] @ direction), rel=1e-5)  # ddof 0


@pytest.mark.parametrize("windows", [(1,), (4, 6)])
def test_window_outputs_average_the_heads_over_the_targets_last_tokens(windows):
    model = tiny_model("llama")
    session = chat_free_session(model)
    texts = [("Q: Why?\nA:", " Because it is"), ("Q: Why?\nA:", " No"), ("Q: Why?\nA: No\n\nQ:", " Where is it?")]
    got = iti_activations.window_outputs(session, texts, windows)
    for r, (before, target) in enumerate(texts):
        ids = session.encode_prompt(before + target)
        seen = {}
        hooks = [layer.self_attn.o_proj.register_forward_hook(lambda mod, args, out, i=i, seen=seen: seen.__setitem__(i, args[0][0]))
                 for i, layer in enumerate(model.model.layers)]
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        for h in hooks:
            h.remove()
        for w, out in zip(windows, got):
            span = min(w, len(target))  # never the text before the target (" No" has 3 tokens here)
            expected = torch.stack([seen[i][len(ids) - span :].mean(0) for i in range(len(model.model.layers))])
            torch.testing.assert_close(out[r], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("other", ["Why not?", "A long other question, " * 12 + "as BBQ's contexts are?"])
def test_answer_and_sigma_rows_read_the_same_in_one_pass_or_two(monkeypatch, other):
    """recipe_activations runs the answer rows and sigma's rows apart when one pass would pad the
    short answer rows to a long other question (BBQ); both layouts read the same head outputs."""
    session = chat_free_session(tiny_model("llama"))
    examples = [Example("q0", [1, 2, 3], [[4], [5]], 0)]
    examples[0].question = "Which is it?"
    answers = [(["It is this one."], ["That.", "Neither of them, I think."])]
    recipe = iti_activations.NL_ITI_RECIPE
    texts = [recipe.qa("Which is it?", a) for a in answers[0][0] + answers[0][1]]
    ends = [recipe.end_q("Which is it?", a, other) for a in answers[0][0] + answers[0][1]]
    one = iti_activations.padded_tokens(session, texts + ends)
    two = iti_activations.padded_tokens(session, texts) + iti_activations.padded_tokens(session, ends)
    assert one > two or len(other) < 100  # a long other question makes two passes cheaper
    got = iti_activations.recipe_activations(session, recipe, examples, [other], answers)
    monkeypatch.setattr(iti_activations, "padded_tokens", lambda s, t: -len(t))  # force one pass for all rows
    merged = iti_activations.recipe_activations(session, recipe, examples, [other], answers)
    for key in ("probe", "direction", "sigma"):
        torch.testing.assert_close(got[key], merged[key], atol=1e-5, rtol=1e-4)


def _published_bundle(model, shift_from):
    g = torch.Generator().manual_seed(0)
    heads = torch.tensor([[1, 0], [2, 3]])
    theta = torch.randn(2, 8, generator=g)
    hp = {"alpha": 4.0, "recipe": "published", **({"shift_from": shift_from} if shift_from else {})}
    config = {**tiny_config(model), "hyperparameters": hp}
    return iti.ITI(config, {"heads": heads, "directions": theta / theta.norm(dim=-1, keepdim=True),
                            "sigma": torch.tensor([0.7, 1.3])})


@pytest.mark.parametrize("shift_from, first", [("answer", 3), ("last_prompt_token", 2), (None, 2)])
def test_the_shift_starts_where_the_bundle_says(shift_from, first):
    """honest_llama adds ITI's shift to the heads' outputs from the answer's first token on; a bundle
    without ``shift_from`` (older ones, NL-ITI) from p* on. Checked against a hook adding it to the heads."""
    model = tiny_model("llama")
    bundle = _published_bundle(model, shift_from)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])  # p* = 2: the prompt is 5 6 7, the answer 8 9 10
    with torch.no_grad(), heads_shifted(model, head_shift(model, bundle, 4.0), first):
        want = model(input_ids=ids).logits
    with torch.no_grad(), bundle.applied(model, torch.tensor([2])):
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_answer_shift_leaves_each_options_first_token_to_the_untouched_model():
    """In lm-eval scoring (packed options over the prompt's cache) the answer-only shift scores every
    option's first token as the untouched model does, and the rest as the whole sequence under the shift."""
    model = tiny_model("llama")
    context, options = [5, 17, 33, 2, 41], [[3, 4, 6], [70, 71], [9]]
    answer = _published_bundle(model, "answer")
    with torch.no_grad():
        prefix = encode_prefix(model, context[:-1])
        plain = runner.score_variants(model, prefix, context[-1], options, _published_bundle(model, None).plan(model))
        run = runner.score_variants(model, prefix, context[-1], options, answer.plan(model))
        untouched = model(input_ids=torch.tensor([context])).logits[0, -1].log_softmax(-1)
    for m, option in enumerate(options):
        ids = torch.tensor([context + option])
        with torch.no_grad(), answer.applied(model, torch.tensor([len(context) - 1])):
            logprobs = model(ids).logits[0].log_softmax(-1)
        want = untouched[option[0]] + sum(logprobs[len(context) - 1 + t, option[t]] for t in range(1, len(option)))
        torch.testing.assert_close(run.logprobs[0, m], want, atol=1e-4, rtol=0)
        if len(option) > 1:  # the p*-on shift (older bundles) moves the first token too
            assert abs(float(plain.logprobs[0, m] - run.logprobs[0, m])) > 1e-4


def test_in_generation_an_answer_shift_starts_with_the_first_generated_token():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    kwargs = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        plain = model.generate(input_ids=ids, **kwargs)
        with _published_bundle(model, "answer").applied(model, None) as state:
            shifted = model.generate(input_ids=ids, **kwargs)
    assert state["calls"] == 3  # the prefill and two decode steps went through the hook
    torch.testing.assert_close(shifted.logits[0], plain.logits[0])  # the prompt, p* included, is not shifted
    assert not torch.allclose(shifted.logits[1], plain.logits[1])  # the first generated token is


@pytest.mark.needs_data
def test_published_iti_on_the_embedded_model_shifts_13_heads_of_its_270(truthfulqa_session):
    session, data, config = truthfulqa_session  # conftest: the embedded model on 20 TruthfulQA questions
    # 10 of them (8 to fit, 2 to validate) suffice for the recipe's pieces on the real model's 270 heads; the
    # head outputs of every answer of every question are most of the fit's time.
    data = dataclasses.replace(data, train=data.train[:10])
    fitted = iti.ITI.fit(session, data, config, {"recipe": "published"}, seed=0)
    hp, diag = fitted.config["hyperparameters"], fitted.config["diagnostics"]
    assert hp["num_heads"] == 13 and fitted.tensors["directions"].shape == (13, 64) and hp["shift_from"] == "answer"
    assert len(set(map(tuple, diag["heads"]))) == 13
    assert diag["probe_accuracy"] == sorted(diag["probe_accuracy"], reverse=True)
    # The probes read every MC2 answer of the validation questions, as the data file lists them.
    from mari_eval.benchmarks.data import load_truthfulqa_mc

    mc2 = {r["id"]: r["mc2_targets"]["labels"] for r in load_truthfulqa_mc()}
    assert hp["probe_answers"] == "mc2"
    assert diag["probe_validation"]["rows"] == sum(len(mc2[i]) for i in diag["validation_ids"])
    assert diag["probe_validation"]["true_rows"] == sum(sum(mc2[i]) for i in diag["validation_ids"])
    assert [[c["layer"], c["head"]] for c in diag["chosen_heads"]] == diag["heads"]
    assert np.isfinite(diag[SELECTION_KEY]) and diag[SELECTION_KEY] != diag["validation_loss_base"]
    assert (fitted.tensors["sigma"] > 0).all()


def test_cross_validated_accuracy_scores_every_row_by_a_probe_fitted_without_its_question():
    # 6 questions of 3 rows each; a stand-in probe whose "accuracy" on each held-out row is 1 when the
    # row's question was not among those it was fitted on, so any leak shows as a value below 1.
    owner = torch.arange(6).repeat_interleave(3)
    y = torch.tensor([1.0, 0, 0] * 6)
    x = torch.stack([owner.float()] * 2, 1)[:, :, None]  # [18 rows, 2 heads, 1]: a row carries its question
    folds = []

    def score(x_fit, y_fit, x_val, y_val, seed):
        fitted, held = set(x_fit[:, 0, 0].tolist()), set(x_val[:, 0, 0].tolist())
        folds.append(held)
        return torch.tensor([float(not fitted & held), 0.5])

    accuracy = iti_heads.cross_validated_accuracy(score, x, y, owner, seed=0, folds=3)
    assert accuracy.tolist() == [1.0, 0.5]  # every row scored once, none by a probe that saw its question
    assert len(folds) == 3 and set().union(*folds) == set(range(6)) and all(len(f) == 2 for f in folds)
    with pytest.raises(ValueError, match="one class only"):
        iti_heads.cross_validated_accuracy(score, x, torch.tensor([1.0] * 15 + [0.0] * 3), owner, seed=0, folds=3)


def test_selection_warnings_name_an_uninformative_choice_of_heads():
    labels = torch.tensor([1.0] * 19 + [0.0] * 16)  # 35 rows, majority 19/35, as the reviewed TruthfulQA slice
    accuracy = torch.tensor([21 / 35] * 13 + [20 / 35] * 5)  # the K-th head two rows above the majority: no warning
    record = iti_heads.choice_record(accuracy, iti_heads.rank_heads(accuracy), 5, 3, labels)
    assert iti_heads.selection_warnings(record, 5) == [
        "13 heads tie at the K-th accuracy, more than K = 5: the seeded order chose 5 of them"]
    accuracy = torch.tensor([20 / 35] * 3 + [0.5] * 3)  # one row above the majority class
    record = iti_heads.choice_record(accuracy, iti_heads.rank_heads(accuracy), 3, 3, labels)
    assert iti_heads.selection_warnings(record, 3) == [
        "the K-th head's probe accuracy 0.5714 is within one of 35 rows of always answering the majority class (0.5429)"]


@pytest.mark.parametrize("cls", [iti.ITI, iti.NLITI])
def test_published_fit_with_cross_validated_heads_records_it(tmp_path, mc2, cls):
    model = tiny_model("llama")
    session = chat_free_session(model)
    examples = char_examples(session)
    mc2.update(_mc2(examples))
    fitted = cls.fit(session, attribute_of(examples), tiny_config(model), {"recipe": "published", "head_selection": "cv"},
                     seed=0)
    hp, diag = fitted.config["hyperparameters"], fitted.config["diagnostics"]
    assert (hp["head_selection"], hp["probe_folds"], diag["head_selection"]) == ("cv", iti_heads.CV_FOLDS, "cv")
    rows = sum(len(t) + len(f) for t, f in mc2.values())  # every MC2 answer of every training question
    assert diag["probe_validation"]["rows"] == rows and isinstance(diag["selection_warnings"], list)
    assert reloaded(fitted, tmp_path / cls.method).config["diagnostics"]["head_selection"] == "cv"
    with pytest.raises(ValueError, match=r"adapted recipe does not read \['head_selection'\]"):
        cls.fit(session, attribute_of(examples), tiny_config(model), {"head_selection": "cv"}, seed=0)
