"""What ranks ITI's and NL-ITI's heads in the published recipe (issue 81.5: ``head_score``,
baselines/iti_heads.py): plain accuracy (the authors'), balanced accuracy or AUROC, and "auto"
(balanced accuracy above a majority share of 0.6); what the bundle records of it; the variant
recipe that prices the switch (repro/engine/recipes.py); and the committed budget bundles, trained
without it, keeping their keys and reading as plain accuracy."""

import json

import pytest
import torch

from baselines import iti, iti_heads, iti_published
from mari_eval.methods.bundles import load_bundle
from repro import main_table, training_selection
from repro.engine import cache, planning, profiles, recipes

from .conftest import REPO
from .test_recipe_iti import mc2  # noqa: F401 (the fixture serving MC2 answers)
from .tiny import attribute_of, char_examples, chat_free_session, reloaded, tiny_config, tiny_model

# 20 probe rows, 2 true (majority share 0.9, as BBQ's correct option among the others).
SKEWED = torch.tensor([1.0, 1.0] + [0.0] * 18)
# Decisions [20 rows, 2 heads]: head 0 always answers the majority class ("false"); head 1 finds both true
# rows and calls 3 of the 18 false ones true.
DECISIONS = torch.stack([torch.full((20,), -1.0), torch.tensor([2.0, 1.5] + [0.5] * 3 + [-1.0] * 15)], 1)


def test_a_head_that_always_answers_the_majority_scores_half_in_balanced_accuracy_and_is_not_chosen():
    accuracy = iti_heads.head_scores(DECISIONS, SKEWED, "accuracy")
    balanced = iti_heads.head_scores(DECISIONS, SKEWED, "balanced_accuracy")
    auroc = iti_heads.head_scores(DECISIONS, SKEWED, "auroc")
    assert accuracy.tolist() == pytest.approx([18 / 20, 17 / 20])  # plain accuracy prefers the majority head
    assert balanced.tolist() == pytest.approx([0.5, 0.5 * (2 / 2 + 15 / 18)])  # the mean of the two recalls
    assert auroc.tolist() == pytest.approx([0.5, 1.0])  # every true row above every false one; all tied: 0.5
    assert iti_heads.rank_heads(accuracy)[0] == 0
    assert iti_heads.rank_heads(balanced)[0] == 1 and iti_heads.rank_heads(auroc)[0] == 1


def test_auroc_is_the_probability_a_true_row_outranks_a_false_one_ties_half():
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(0)
    y = (torch.rand(60, generator=g) > 0.8).float()
    decisions = torch.randint(-3, 4, (60, 5), generator=g).double() + y[:, None]  # integers: many ties
    ours = iti_heads.head_scores(decisions, y, "auroc")
    assert ours.tolist() == pytest.approx([roc_auc_score(y.numpy(), decisions[:, h].numpy()) for h in range(5)], abs=1e-6)


def test_auto_takes_balanced_accuracy_only_above_a_majority_share_of_0_6():
    assert iti_heads.AUTO_MAJORITY == 0.6
    share = lambda true, rows: torch.tensor([1.0] * true + [0.0] * (rows - true))
    assert iti_heads.resolve_head_score("auto", share(6, 10)) == "accuracy"  # 0.6 is not above 0.6
    assert iti_heads.resolve_head_score("auto", share(4, 10)) == "accuracy"  # the majority may be either class
    assert iti_heads.resolve_head_score("auto", share(3, 10)) == "balanced_accuracy"  # 0.7
    assert iti_heads.resolve_head_score("auto", SKEWED) == "balanced_accuracy"
    assert iti_heads.resolve_head_score("auroc", share(5, 10)) == "auroc"  # a named score is taken as named
    assert iti_heads.resolve_head_score("accuracy", SKEWED) == "accuracy"
    with pytest.raises(ValueError, match=r"head_score='f1': use one of accuracy, balanced_accuracy, auroc, auto"):
        iti_heads.resolve_head_score("f1", SKEWED)


def test_a_slice_of_one_class_is_refused_for_balanced_scores_and_scored_for_plain_accuracy():
    one_class = torch.zeros(4)
    assert iti_heads.head_scores(DECISIONS[:4], one_class, "accuracy").tolist() == [1.0, 0.0]  # head 1 calls all 4 true
    for score in ("balanced_accuracy", "auroc"):
        with pytest.raises(ValueError, match="one class only; use more training examples or head_score=accuracy"):
            iti_heads.head_scores(DECISIONS[:4], one_class, score)


def test_logistic_probes_score_by_the_score_asked_and_plain_accuracy_as_predict_does():
    from sklearn.linear_model import LogisticRegression

    g = torch.Generator().manual_seed(1)
    y = (torch.rand(120, generator=g) > 0.85).float()
    x = torch.randn(120, 3, 4, generator=g) + 0.8 * y[:, None, None] * torch.tensor([0.0, 1.0, 0.2])[:, None]
    fit, val = slice(0, 80), slice(80, 120)
    plain = iti_published.logistic_accuracy(x[fit], y[fit], x[val], y[val], seed=0)
    balanced = iti_published.logistic_accuracy(x[fit], y[fit], x[val], y[val], seed=0, score="balanced_accuracy")
    for h in range(3):
        probe = LogisticRegression(C=1.0, max_iter=1000, random_state=0).fit(x[fit, h].double().numpy(), y[fit].numpy() > 0.5)
        hit = probe.predict(x[val, h].double().numpy()) == (y[val].numpy() > 0.5)
        # Bit for bit what the code before head_score returned (torch.tensor of predict's accuracies, float32): the
        # bundles keyed before it train the same heads.
        assert plain[h].item() == torch.tensor([float(hit.mean())]).item()
        gold = y[val].numpy() > 0.5
        assert balanced[h].item() == pytest.approx(0.5 * (hit[gold].mean() + hit[~gold].mean()), abs=1e-6)


def test_warnings_on_balanced_accuracy_compare_with_half_and_count_ties_on_it():
    scores = torch.tensor([0.55] * 2 + [0.5] * 4)  # heads of 3 per layer; K = 3: the K-th at 0.5, 4 tied
    record = iti_heads.choice_record(scores, iti_heads.rank_heads(scores), 3, 3, SKEWED, "balanced_accuracy")
    assert record["head_score"] == "balanced_accuracy" and record["probe_validation"]["majority_accuracy"] == 0.9
    assert iti_heads.selection_warnings(record, 3) == [
        "the K-th head's probe balanced accuracy 0.5000 is within one of the 2 rows of the minority class of 0.5, "
        "what a probe without signal scores",
        "4 heads tie at the K-th balanced accuracy, more than K = 3: the seeded order chose 1 of them"]
    # Plain accuracy keeps its own bar, the majority share 0.9: two rows above it no warning, one row a warning.
    record = iti_heads.choice_record(torch.tensor([1.0, 0.95, 0.9]), torch.tensor([0, 1, 2]), 1, 3, SKEWED)
    assert record["head_score"] == "accuracy" and iti_heads.selection_warnings(record, 1) == []
    record = iti_heads.choice_record(torch.tensor([1.0, 0.95, 0.9]), torch.tensor([0, 1, 2]), 2, 3, SKEWED)
    assert iti_heads.selection_warnings(record, 2) == [
        "the K-th head's probe accuracy 0.9500 is within one of 20 rows of always answering the majority class (0.9000)"]


def _skewed_mc2(examples):
    """One true and four false MC2 answers per question: 80% of the probe rows false."""
    return {ex.id: ([f"true {i}"], [f"false {i}.{j} no" for j in range(4)]) for i, ex in enumerate(examples)}


@pytest.mark.parametrize("cls, setting, selection, used", [
    (iti.ITI, "auto", "validation", "balanced_accuracy"), (iti.NLITI, "auroc", "cv", "auroc")])
def test_the_bundle_records_the_score_used_and_the_majority_share(tmp_path, mc2, monkeypatch, cls, setting, selection, used):
    model = tiny_model("llama")
    session = chat_free_session(model)
    examples = char_examples(session)
    mc2.update(_skewed_mc2(examples))
    asked = []
    name = "logistic_accuracy" if cls is iti.ITI else "mlp_accuracy"
    scored = getattr(iti_published, name)
    monkeypatch.setattr(iti_published, name, lambda *a, score: asked.append(score) or scored(*a, score=score))
    hp = {"recipe": "published", "head_score": setting, **({"head_selection": "cv"} if selection == "cv" else {})}
    fitted = cls.fit(session, attribute_of(examples), tiny_config(model), hp, seed=0)
    hp, diag = fitted.config["hyperparameters"], fitted.config["diagnostics"]
    assert set(asked) == {used}  # every probe (every fold under cv) scored by it
    assert hp["head_score"] == setting and (diag["head_score"], diag["head_score_setting"]) == (used, setting)
    assert diag["probe_validation"]["majority_accuracy"] == pytest.approx(0.8)
    assert diag.get("head_score_threshold") == (0.6 if setting == "auto" else None)
    assert loaded_diag(fitted, tmp_path / cls.method)["head_score"] == used
    row = training_selection.bundle_record({"hyperparameters": hp, "diagnostics": diag})["heads"]
    assert row["score"] == used and row["kth_above_majority"] is None and row["kth_above_chance"] is not None


def loaded_diag(fitted, directory):
    return reloaded(fitted, directory).config["diagnostics"]


def test_without_head_score_the_published_recipe_keeps_plain_accuracy_and_the_adapted_one_refuses_it(mc2):
    model = tiny_model("llama")
    session = chat_free_session(model)
    examples = char_examples(session)
    mc2.update(_skewed_mc2(examples))
    fitted = iti.ITI.fit(session, attribute_of(examples), tiny_config(model), {"recipe": "published"}, seed=0)
    assert "head_score" not in fitted.config["hyperparameters"]  # nothing added to what a key names
    assert (fitted.config["diagnostics"]["head_score"], fitted.config["diagnostics"]["head_score_setting"]) == ("accuracy", "accuracy")
    with pytest.raises(ValueError, match=r"adapted recipe does not read \['head_score'\]"):
        iti.ITI.fit(session, attribute_of(examples), tiny_config(model), {"head_score": "auto"}, seed=0)


def test_the_variant_recipe_keys_iti_and_nl_iti_apart_and_leaves_every_other_bundle_shared(tmp_path):
    budget = profiles.PROFILES["budget"]
    assert recipes.recipe_settings("iti", budget, recipes.HEAD_SCORE_AUTO) == {
        "recipe": "published", "head_selection": "cv", "validation": "ctrl", "head_score": "auto"}
    assert recipes.recipe_settings("caa", budget, recipes.HEAD_SCORE_AUTO) == recipes.recipe_settings("caa", budget, "published")
    with pytest.raises(ValueError, match="recipe 'balanced': use one of adapted, published, published_head_score_auto"):
        recipes.recipe_settings("iti", budget, "balanced")
    # The path a user types: main_table.py --recipe published_head_score_auto --plan (the smoke profile, nothing stored).
    plans = {recipe: planning.graph_of(main_table.main, ["--smoke", "--runs", str(tmp_path / "runs"), "--recipe", recipe])[0]
             for recipe in ("published", recipes.HEAD_SCORE_AUTO)}
    trained = {recipe: {s.key for s in g.steps.values() if s.kind == "train"} for recipe, g in plans.items()}
    new = trained[recipes.HEAD_SCORE_AUTO] - trained["published"]
    assert new and {name.split("-")[0] for name in new} == {"iti", "nl_iti"}  # bundle directories: method-attribute-seed-key
    assert {n for n in trained["published"] if not n.startswith(("iti-", "nl_iti-"))} <= trained[recipes.HEAD_SCORE_AUTO]
    labels = [s.label for s in plans[recipes.HEAD_SCORE_AUTO].steps.values() if s.key in new]
    assert all('"head_score": "auto"' in label for label in labels)


BUDGET_STEPS = REPO / "results" / "budget_steps"


def test_the_committed_budget_iti_bundles_keep_their_keys_and_read_as_plain_accuracy():
    """No committed bundle names head_score: each is found under the key the main table computes today,
    loads under the new schema, and reads as the authors' plain accuracy; their evaluations are read back
    (the plan of their rows on tqa_mc1, tqa_mc2 and bbq_acc computes nothing)."""
    budget = profiles.PROFILES["budget"]
    found, missing = training_selection.main_table_bundles(budget, cache.Store(BUDGET_STEPS), ("iti", "nl_iti"))
    assert len(found) == 18 and not missing
    for *_, directory in found:
        bundle = load_bundle(directory)
        hp, diag = bundle.config["hyperparameters"], bundle.config["diagnostics"]
        assert "head_score" not in hp and "head_score" not in diag
        assert training_selection.head_score(diag, hp) == "accuracy"
        assert json.loads((directory / "bundle.json").read_text())["hyperparameters"] == hp
    graph, _, _ = planning.graph_of(main_table.main, ["--profile", "budget", "--runs", str(BUDGET_STEPS), "--methods",
                                                      "vanilla,iti,nl_iti", "--columns", "tqa_mc1,tqa_mc2,bbq_acc"])
    assert graph.steps and all(step.cached for step in graph.steps.values()), [s.label for s in graph.steps.values() if not s.cached]


def test_mari_eval_train_refuses_an_unknown_head_score_before_loading_anything(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mari_eval.cli", "train", "--method", "nl_iti", "--attribute", "bbq",
                           "--set", "head_score=balanced", "--out", str(tmp_path / "bundle")], capture_output=True, text=True)
    assert proc.returncode != 0 and not (tmp_path / "bundle").exists()
    assert 'hyperparameters.head_score is "balanced"' in proc.stderr
    assert '"accuracy", "balanced_accuracy", "auroc", "auto"' in proc.stderr
