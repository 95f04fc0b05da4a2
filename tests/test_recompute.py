"""BBQ's contexts from lm-eval's logged samples to the tables (repro/engine/documents.py, repro/analysis/tables.py),
the per-document Parquet every table writes, and recomputing every cell from it (repro/recompute.py)."""

import json

import numpy as np
import pandas as pd
import pytest

from mari_eval.injection.devices import Placement
from mari_eval.storage.files import write_results_json
from repro import recompute
from repro.engine import documents
from repro.analysis import documents_file, intervals, tables
from repro.engine.cache import Store
from repro.engine.profiles import Profile


def bbq_sample(doc_id, acc, context, polarity="neg", category="Age", template="3"):
    record = {"category": category, "question_index": template, "context": context, "question_polarity": polarity}
    return {"doc_id": doc_id, "filter": "none", "metrics": ["acc"], "acc": acc, "doc": record}


def test_bbq_documents_carry_their_context_and_other_tasks_do_not():
    samples = {"bbq_disambig_heldout": [bbq_sample(0, 1.0, "Two friends met."), bbq_sample(1, 0.0, "Two friends met.", "nonneg"),
                                        bbq_sample(2, 1.0, "A nurse and a driver.", template="7")],
               "arc_easy": [{"doc_id": 0, "filter": "none", "metrics": ["acc"], "acc": 1.0, "doc": {}}]}
    scores = documents.document_scores(samples, ["bbq_disambig_heldout"], "bbq_disambig_heldout")["acc,none"]
    found, clusters, unit = documents.split_clusters(scores)
    assert found == {"0": 1.0, "1": 0.0, "2": 1.0} and unit == "context"
    assert clusters["0"] == clusters["1"] != clusters["2"]  # the paired questions of one context: one unit
    assert clusters["0"].startswith("Age|3|") and clusters["2"].startswith("Age|7|")  # its template precedes the hash
    plain = documents.document_scores(samples, ["arc_easy"], "arc_easy")["acc,none"]
    assert documents.split_clusters(plain) == ({"0": 1.0}, None, None)
    assert documents.cluster_unit("bbq_disambig_heldout") == "context" and documents.cluster_unit("mmlu") is None
    assert documents.clustered_columns() == {"bbq_acc", "bbq_amb_acc", "bbq_amb_bias"}
    with pytest.raises(ValueError, match="carry no cluster id"):
        documents.split_clusters({**scores, "9": 1.0})


def clustered(values, contexts):
    """BBQ-like per-document scores: documents 2i and 2i+1 share context i (keys as documents.py writes them)."""
    return {f"{i}@context:Age|1|c{i // 2:03d}": float(v) for i, v in enumerate(values[: 2 * contexts])}


def result(value, docs, n):
    return {"value": value, "n": n, "documents": docs, "stderr": None}


def make_cells(perturb=0.0):
    rng = np.random.default_rng(4)
    cells: dict = {}
    mc2_ref = rng.random((2, 40))
    bbq_ref = (rng.random(24) < 0.5).astype(float)
    bbq_row = np.where(rng.random(24) < 0.4, 1.0, bbq_ref)
    for seed in (0, 1):
        for label, shift in (("Vanilla", 0.0), ("MARI", 0.08), ("CAA", 0.0)):
            mc2 = 100 * np.clip(mc2_ref[seed] + shift + 0.05 * rng.standard_normal(40), 0, 1)
            mc1 = 100 * (rng.random(30) < 0.3 + shift)
            scores = {"tqa_mc2": result(mc2.mean(), {str(i): v for i, v in enumerate(mc2)}, 40),
                      "tqa_mc1": result(mc1.mean(), {str(i): v for i, v in enumerate(mc1)}, 30),
                      "gate": {"value": 0.5, "n": 30}}
            if seed == 0:
                bbq = bbq_ref if label == "Vanilla" else bbq_row
                scores["bbq_acc"] = result(bbq.mean(), clustered(bbq, 12), 24)
                refusals = {str(i): float(v) for i, v in enumerate(rng.random(20) < 0.5)}
                refusals["5"] = None  # a verdict the judge could not read: no score, left out of the rate
                scores["sorry_refusal"] = result(np.mean([v for v in refusals.values() if v is not None]), refusals, 20)
            tables.tally(cells, "m", label, scores, seed=seed)
    return cells


@pytest.fixture
def table(tmp_path):
    store = Store(tmp_path / "runs", placement=Placement(dtype="float32"))
    profile = Profile(name="fixed", models=["m"], seeds=[0, 1], max_train={}, max_ctrl=None, limits={})
    columns = ["tqa_mc1", "tqa_mc2", "bbq_acc", "sorry_refusal", "gate"]
    record = tables.write_tables(tmp_path, "t", "Table T", "Intro.", make_cells(), columns, lambda model: ("P", {}),
                                 profile, "cmd", 1.0, store)
    return tmp_path, record


def test_a_clustered_column_prints_its_contexts_and_resamples_them(table):
    out, record = table
    vanilla, mari, _ = record["models"]["m"]["rows"]
    bbq = mari["ours"]["bbq_acc"]
    assert bbq["clusters"] == 12 and bbq["cluster_unit"] == "context"
    assert mari["ours"]["tqa_mc2"]["clusters"] is None and mari["ours"]["tqa_mc2"]["cluster_unit"] is None
    d = bbq["difference"]
    assert d["test"] == "sign-flip" and d["clusters"] == 12 and d["pairs"] == 24 and d["cluster_unit"] == "context"
    assert d["draws"] is None  # 12 contexts: every sign vector
    assert "(n=24, 12 contexts)" in (out / "t.md").read_text()
    mc1 = mari["ours"]["tqa_mc1"]["difference"]
    assert mc1["test"] == "mcnemar" and mc1["clusters"] is None and not mc1["p_bound"]
    assert mari["ours"]["tqa_mc2"]["difference"]["test"] == "sign-flip"
    for row in (mari, record["models"]["m"]["rows"][2]):
        for column in ("tqa_mc1", "tqa_mc2", "bbq_acc", "sorry_refusal"):
            d = row["ours"][column]["difference"]
            assert (not d["ci"][0] <= 0 <= d["ci"][1]) == d["significant"], (row["row"], column)
    saved = json.loads((out / "t.json").read_text())
    assert saved["models"]["m"]["rows"][1]["ours"]["bbq_acc"]["difference"]["p_bound"] is False


def test_every_table_writes_its_documents_as_one_parquet_record_each(table):
    out, _ = table
    frame = pd.read_parquet(out / "t_documents.parquet")
    assert list(frame.columns) == ["model", "row", "column", "stratum", "seed", "document", "cluster", "cluster_unit",
                                   "reference", "score"]
    assert len(frame) == 3 * (2 * 40 + 2 * 30 + 24 + 20)  # rows x (seeds x documents); no gate rates
    assert frame["score"].isna().sum() == 3  # the unreadable verdict, kept as null
    bbq = frame[frame["column"] == "bbq_acc"]
    assert bbq["cluster"].nunique() == 12 and set(bbq["cluster_unit"]) == {"context"}
    assert frame[frame["column"] == "tqa_mc2"]["cluster"].isna().all()
    assert set(frame["seed"]) == {0, 1} and set(frame[frame["row"] == "Vanilla"]["reference"].isna()) == {True}
    assert set(frame[frame["row"] == "MARI"]["reference"]) == {"Vanilla"}
    assert (out / "t_documents.parquet").read_bytes()[:4] == b"PAR1"
    assert pq_codec(out / "t_documents.parquet") == "ZSTD"


def pq_codec(path):
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.row_group(0).column(0).compression


def test_recompute_finds_every_cell_equal(table, capsys):
    out, record = table
    mismatches, cells, differences = recompute.recompute(out / "t_documents.parquet", json.loads((out / "t.json").read_text()))
    assert mismatches == [] and cells == 12 and differences == 8
    assert recompute.main([str(out / "t")]) == 0
    assert "12 cells and 8 paired differences recomputed from t_documents.parquet: every number agrees" in capsys.readouterr().out


def test_recompute_fails_on_a_changed_score_or_a_changed_figure(table, capsys):
    out, record = table
    frame = pd.read_parquet(out / "t_documents.parquet")
    row = frame.index[(frame["row"] == "MARI") & (frame["column"] == "tqa_mc2")][0]
    frame.loc[row, "score"] += 30.0
    frame.to_parquet(out / "t_documents.parquet")
    assert recompute.main([str(out / "t.json")]) == 1
    printed = capsys.readouterr().out
    assert "m / MARI / tqa_mc2.values[0]" in printed and "m / MARI / tqa_mc2.difference.mean" in printed
    assert "m / MARI / tqa_mc2.ci[0]" in printed


def test_recompute_fails_on_an_edited_p_and_a_missing_file(table, capsys):
    out, record = table
    saved = json.loads((out / "t.json").read_text())
    saved["models"]["m"]["rows"][1]["ours"]["bbq_acc"]["difference"]["p_holm"] = 0.001
    write_results_json(out / "t.json", saved)
    assert recompute.main([str(out / "t_documents.parquet")]) == 1
    assert "m / MARI / bbq_acc.difference.p_holm: 0.001 in the JSON" in capsys.readouterr().out
    (out / "t_documents.parquet").unlink()
    assert recompute.main([str(out / "t")]) == 2


def test_a_bbq_column_without_contexts_is_refused():
    with pytest.raises(ValueError, match="no cluster ids"):
        tables.tally({}, "m", "Vanilla", {"bbq_acc": result(0.5, {"0": 1.0, "1": 0.0}, 2)})
    cells: dict = {}
    tables.tally(cells, "m", "Vanilla", {"bbq_acc": {"value": 0.5, "n": 2}})  # no documents at all: nothing to resample
    assert cells["m"]["Vanilla"]["bbq_acc"]["clusters"] == [None]


def test_the_seed_of_each_stratum_comes_from_the_profile_when_not_tallied():
    profile = Profile(name="p", models=["m"], seeds=[0], max_train={}, max_ctrl=None, limits={},
                      column_seeds={"tqa_mc1": [0, 1, 2]})
    assert documents_file.cell_seeds({"values": [1, 2, 3]}, profile, "tqa_mc1") == [0, 1, 2]
    assert documents_file.cell_seeds({"values": [1]}, profile, "bbq_acc") == [0]
    assert documents_file.cell_seeds({"values": [1, 2]}, profile, "bbq_acc") == [None, None]
    assert documents_file.cell_seeds({"values": [1, 2], "seeds": [5, 7]}, profile, "bbq_acc") == [5, 7]


def test_interval_and_tests_do_not_depend_on_the_order_documents_were_logged_in():
    rng = np.random.default_rng(9)
    ref, row = rng.random(60), rng.random(60)
    docs = lambda v, order: {str(i): float(v[i]) for i in order}  # noqa: E731
    forward, backward = range(60), reversed(range(60))
    assert intervals.interval([docs(ref, forward)]) == intervals.interval([docs(ref, reversed(range(60)))])
    assert intervals.paired([docs(row, forward)], [docs(ref, range(60))]) == intervals.paired([docs(row, backward)],
                                                                                               [docs(ref, range(60))])


def test_a_table_compares_named_pairs_of_rows_in_a_family_of_their_own(tmp_path, capsys):
    # The ablation's EG-MARI against the single adapter (issue 36.7): the same paired tests as against
    # Vanilla, between two rows, Holm-adjusted over these comparisons alone, recomputable from the Parquet.
    store = Store(tmp_path / "runs", placement=Placement(dtype="float32"))
    profile = Profile(name="fixed", models=["m"], seeds=[0, 1], max_train={}, max_ctrl=None, limits={})
    columns = ["tqa_mc1", "tqa_mc2", "bbq_acc"]
    cells = make_cells()
    record = tables.write_tables(tmp_path, "t", "Table T", "Intro.", cells, columns, lambda model: ("P", {}),
                                 profile, "cmd", 1.0, store, comparisons=[("MARI", "CAA")])
    [compared] = record["models"]["m"]["comparisons"]
    assert (compared["row"], compared["against"]) == ("MARI", "CAA") and set(compared["columns"]) == set(columns)
    mc2 = compared["columns"]["tqa_mc2"]
    expected = intervals.paired(cells["m"]["MARI"]["tqa_mc2"]["documents"], cells["m"]["CAA"]["tqa_mc2"]["documents"])
    assert (mc2["mean"], mc2["p"], mc2["reference"]) == (expected.mean, expected.p, "CAA")
    family = [compared["columns"][c]["p"] for c in columns]
    assert [compared["columns"][c]["p_holm"] for c in columns] == intervals.holm(family)
    assert "MARI - CAA" in (tmp_path / "t.md").read_text()
    assert recompute.main([str(tmp_path / "t")]) == 0
    saved = json.loads((tmp_path / "t.json").read_text())
    saved["models"]["m"]["comparisons"][0]["columns"]["tqa_mc2"]["mean"] += 1.0
    write_results_json(tmp_path / "t.json", saved)
    assert recompute.main([str(tmp_path / "t")]) == 1
    assert "m / comparisons[0].columns.tqa_mc2.mean" in capsys.readouterr().out
