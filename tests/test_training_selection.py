"""repro/training_selection.py: how each baseline bundle chose what it kept, read from the stored bundles
(issue 55.2), for the bundles stored, with the others named; a damaged bundle is not read."""

from __future__ import annotations

import json

import pytest

from repro import training_selection
from repro.engine import cache, profiles, recipes

MODEL = "smollm2-135m-instruct"
SMOKE = profiles.PROFILES["smoke"]

ITI_DIAGNOSTICS = {"boundary_accuracy": 0.92, "heads": [[21, 1], [17, 0]], "heads_tied_at_boundary": 4, "tied_heads_chosen": 1,
                   "chosen_heads": [{"layer": 21, "head": 1, "validation_accuracy": 0.924}, {"layer": 17, "head": 0, "validation_accuracy": 0.92}],
                   "probe_validation": {"majority_accuracy": 0.9167, "rows": 2400},
                   "selection_warnings": ["4 heads tie at the K-th accuracy"]}
# What each (method, attribute) bundle records: (hyperparameters, diagnostics).
RECORDS = {
    ("iti", "truthfulqa"): ({"recipe": "published", "head_selection": "cv", "validation": "ctrl"},
                            {**ITI_DIAGNOSTICS, "validation_loss_selected": 11.15, "validation_loss_base": 10.0, "validation_ids": ["a", "b"]}),
    ("reft", "truthfulqa"): ({"recipe": "published", "epoch_selection": "best", "epoch_kept": 3},
                             {"history": [{"validation_loss": 3.0}, {"validation_loss": 2.0}, {"validation_loss": 1.5}],
                              "validation_loss_selected": 1.5, "validation_loss_base": 2.5, "validation_ids": ["a"]}),
    ("lora", "bbq"): ({"epoch_kept": 2}, {"history": [{"validation_loss": 1.0}, {"validation_loss": 0.8}, {"validation_loss": 0.9}],
                                          "validation_loss_selected": 0.8, "validation_loss_base": 0.97, "validation_ids": ["a"]}),
    # Heads ranked by balanced accuracy (head_score=auto on BBQ's 91.67% majority, issue 81.5): its bar is 0.5.
    ("nl_iti", "bbq"): ({"recipe": "published", "head_selection": "cv", "head_score": "auto"},
                       {**ITI_DIAGNOSTICS, "boundary_accuracy": 0.55, "head_score": "balanced_accuracy", "head_score_setting": "auto",
                        "probe_validation": {"majority_accuracy": 0.9167, "rows": 2400, "true_rows": 200},
                        "validation_loss_selected": 0.95, "validation_loss_base": 0.97, "validation_ids": ["a"]}),
    # Last: the fixture edits it by hand.
    ("caa", "bbq"): ({"recipe": "published"}, {"validation_loss_selected": 0.9719, "validation_loss_base": 0.9717, "validation_ids": ["a"]}),
}


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """A --runs folder holding four of the smoke main table's bundles, trained by a stand-in that writes
    only their records; the CAA one then edited by hand (its digest no longer matches)."""
    def train(method, attribute, model, seed, out, **kwargs):
        hyperparameters, diagnostics = RECORDS[method, attribute]
        out.mkdir(parents=True)
        (out / "bundle.json").write_text(json.dumps({"method": method, "hyperparameters": hyperparameters,
                                                     "diagnostics": diagnostics, "train_seconds": 1.0}))
        return out

    monkeypatch.setattr("mari_eval.training.train.train", train)
    store = cache.Store(tmp_path / "runs")
    for method, attribute in RECORDS:
        bundle = recipes.table_bundle(store, method, attribute, MODEL, 0, SMOKE)
    (bundle / "bundle.json").write_text((bundle / "bundle.json").read_text().replace("0.9719", "0.9000"))
    return tmp_path / "runs"


def test_the_report_reads_each_stored_bundles_selection_and_names_the_rest(runs, tmp_path, caplog):
    assert training_selection.main(["--smoke", "--runs", str(runs), "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "training_selection.json").read_text())
    rows = {(r["method"], r["attribute"]): r for r in record["bundles"]}
    assert set(rows) == {("iti", "truthfulqa"), ("reft", "truthfulqa"), ("lora", "bbq"), ("nl_iti", "bbq")}  # not the edited CAA
    assert "does not match its record" in caplog.text
    assert "computed again" not in caplog.text  # bundles that record no package versions are not compared
    iti, reft, lora = rows["iti", "truthfulqa"], rows["reft", "truthfulqa"], rows["lora", "bbq"]
    assert iti["worse_than_untouched"] and not reft["worse_than_untouched"] and not lora["worse_than_untouched"]
    assert iti["validation_examples"] == 2 and iti["epochs"] is None
    # 0.92 - 0.9167 of 2400 rows is 7.9 rows, 0.59 standard errors of the majority share sqrt(2400 x 0.9167 x 0.0833) = 13.5 rows.
    # A bundle that records no head_score (all before issue 81.5): the published recipe's plain accuracy.
    assert iti["heads"] == {"k": 2, "selection": "cv", "score": "accuracy", "score_setting": None, "kth_accuracy": 0.92,
                            "majority_accuracy": 0.9167, "probe_rows": 2400,
                            "kth_above_majority": {"excess_rows": 7.9, "z": 0.59, "told_apart": False}, "kth_above_chance": None,
                            "tied_at_kth": 4, "tied_chosen": 1, "warnings": ["4 heads tie at the K-th accuracy"],
                            "chosen": [{"layer": 21, "head": 1, "accuracy": 0.924}, {"layer": 17, "head": 0, "accuracy": 0.92}]}
    assert reft["epochs"] == {"epochs": 3, "epoch_kept": 3, "validation_loss_by_epoch": [3.0, 2.0, 1.5], "selection": "best",
                              "still_falling_at_last": True}
    assert lora["epochs"]["still_falling_at_last"] is False and lora["epochs"]["epoch_kept"] == 2 and lora["heads"] is None
    # Balanced accuracy 0.55 over 200 true and 2,200 false rows: 0.05 / (0.25 sqrt(1/200 + 1/2200)) = 2.71 standard errors.
    balanced = rows["nl_iti", "bbq"]["heads"]
    assert (balanced["score"], balanced["score_setting"], balanced["kth_above_majority"]) == ("balanced_accuracy", "auto", None)
    assert balanced["kth_above_chance"] == {"excess": 0.05, "z": 2.71, "told_apart": True}
    missing = {(m["method"], m["attribute"]) for m in record["not_trained"]}
    assert len(missing) == 5 * 3 - 4 and ("caa", "bbq") in missing and ("iti", "truthfulqa") not in missing
    text = (tmp_path / "out" / "training_selection.md").read_text()
    assert "Kept configuration worse than no edit on validation: 1 of 4 bundles (ITI 1 of 1, NL-ITI 0 of 1, ReFT 0 of 1, LoRA 0 of 1)" in text
    assert "| ITI      | truthfulqa  | 0      | published | ctrl (2)         | 10.0000     | 11.1500 | +1.1500" in text
    assert "3.0000, 2.0000, **1.5000**" in text and "1.0000, **0.8000**, 0.9000" in text
    assert "21.1 (0.924), 17.0 (0.920)" in text and "4 (1)" in text
    assert "+8 rows, z 0.59: not told apart" in text and "| balanced_accuracy (auto) | 2 " in text and "| +0.0500 over 0.5, z 2.71 " in text
    assert ("not told apart from always answering the majority class (plain accuracy) or from 0.5 (balanced accuracy, AUROC): "
            "1 of 2 bundles (ITI truthfulqa seed 0).") in text
    assert f"- {MODEL}, seed 0: CAA bbq (stored but damaged: not read), CAA sorry_bench" in text


def test_a_probe_is_told_apart_from_the_majority_class_only_beyond_two_standard_errors():
    # SORRY-Bench's probes: 90 rows, half refusals; every row right is 45 rows, 9.49 standard errors above.
    assert training_selection.above_majority(1.0, 0.5, 90) == {"excess_rows": 45.0, "z": 9.49, "told_apart": True}
    assert training_selection.above_majority(0.7, 0.5, 100)["told_apart"]  # 20 rows of a 5-row standard error
    assert not training_selection.above_majority(0.55, 0.5, 100)["told_apart"]  # 5 rows: one standard error
    assert not training_selection.above_majority(0.9, 0.95, 100)["told_apart"]  # below the majority class
    assert training_selection.above_majority(0.9, None, 100) is None and training_selection.above_majority(0.9, 0.5, None) is None


def test_balanced_accuracy_and_auroc_are_told_apart_from_half_beyond_two_standard_errors_of_no_signal():
    # SORRY-Bench's 90 rows, 45 refusals: AUROC's null standard error sqrt(91 / (12 x 45 x 45)) = 0.0612.
    assert training_selection.above_chance(0.6, "auroc", 90, 45) == {"excess": 0.1, "z": 1.63, "told_apart": False}
    assert training_selection.above_chance(0.65, "auroc", 90, 45)["told_apart"]  # 2.45 standard errors
    # BBQ's 2,400 rows, 200 true: balanced accuracy's 0.25 sqrt(1/200 + 1/2200) = 0.0185.
    assert training_selection.above_chance(0.52, "balanced_accuracy", 2400, 200) == {"excess": 0.02, "z": 1.08, "told_apart": False}
    assert training_selection.above_chance(0.45, "balanced_accuracy", 2400, 200)["z"] < 0  # below 0.5
    assert training_selection.above_chance(0.6, "auroc", 90, None) is None and training_selection.above_chance(0.6, "auroc", 90, 0) is None
    # Before issue 81.5 a bundle recorded no head_score: the published recipe's plain accuracy, the adapted one's balanced.
    assert training_selection.head_score({}, {"recipe": "published"}) == "accuracy"
    assert training_selection.head_score({}, {"recipe": "adapted"}) == "balanced_accuracy" == training_selection.head_score({}, {})
