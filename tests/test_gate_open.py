"""The out-of-source columns' plumbing (issue 81.1): each gated row's open rate per evaluation set and seed
(repro/analysis/gate_open.py) in the tables' JSON, kept by a re-render; the in-source columns' headers; and
columns added to a profile after its steps were committed evaluated in steps of their own."""

import json

from mari_eval.injection.devices import Placement
from repro import rerender
from repro.analysis import gate_open, tables
from repro.engine import profiles, scoring
from repro.engine.cache import Store
from repro.engine.profiles import Profile

from .test_recompute import make_cells, result

COLUMNS = profiles.XSTEST + profiles.BENIGN_REFUSAL + profiles.GENERAL_TEXT + profiles.BENIGN_TEXT


def _scores(rate_of: dict[str, float | None]) -> dict[str, dict]:
    """A row's ``scoring.score`` results for COLUMNS: each task's gate rate (None: no gate recorded)."""
    out = {}
    for column, task, _, _ in COLUMNS:
        rate = rate_of.get(task)
        out[column] = {"value": 0.0, "n": 7, "diagnostics": {"prompts": 7, **({} if rate is None else {"gate_rate": rate})}}
    return out


def test_a_gated_rows_open_rate_is_kept_once_per_evaluation_set_and_seed():
    profile = profiles.PROFILES["budget"]
    gates: dict = {}
    for seed, rate in ((0, 1.0), (1, 0.5)):
        gate_open.add(gates, "m", "MARI", seed, profile, COLUMNS,
                      _scores({"xstest_safe": rate, "benign_instructions": rate, "benign_text": rate / 2}))
    gate_open.add(gates, "m", "CAA", 0, profile, COLUMNS, _scores({}))  # no gate: no entry
    assert list(gates["m"]) == ["MARI"]
    sets = gates["m"]["MARI"]
    # kl_benign and ce_benign read one evaluation per bundle: one entry each, one value per seed
    assert sorted(sets) == ["benign_instructions@sorry", "benign_text@bbq", "benign_text@sorry", "benign_text@tqa",
                            "xstest_safe@sorry"]
    assert sets["xstest_safe@sorry"] == {"task": "xstest_safe", "bundle": "sorry_bench", "n": 7, "seeds": [0, 1],
                                         "values": [1.0, 0.5]}
    assert sets["benign_text@bbq"]["values"] == [0.5, 0.25]
    assert gate_open.rows(gates)[0][2:] == ["xstest_safe@sorry", "7", "0: 1.00, 1: 0.50", "0.75"]


def test_the_tables_json_keeps_each_gated_rows_open_rates_and_a_rerender_keeps_them(tmp_path):
    cells = make_cells()
    for seed in (0, 1):  # an in-source column beside the fixture's
        for label in ("Vanilla", "MARI", "CAA"):
            tables.tally(cells, "m", label, {"kl": result(0.0 if label == "Vanilla" else 0.1, {"0": 0.1, "1": 0.2}, 2)},
                         seed=seed)
    gates = {"m": {"MARI": {"xstest_safe@sorry": {"task": "xstest_safe", "bundle": "sorry_bench", "n": 250,
                                                  "seeds": [0, 1], "values": [1.0, 1.0]}}}}
    store = Store(tmp_path / "runs", placement=Placement(dtype="float32"))
    profile = Profile(name="fixed", models=["m"], seeds=[0, 1], max_train={}, max_ctrl=None, limits={})
    tables.write_tables(tmp_path, "t", "Table T", "Intro.", cells, ["tqa_mc1", "tqa_mc2", "bbq_acc", "sorry_refusal",
                        "gate", "kl"], lambda model: ("P", {}), profile, "cmd", 1.0, store, gate_open=gates)
    written = json.loads((tmp_path / "t.json").read_text())
    rows = {r["row"]: r for r in written["models"]["m"]["rows"]}
    assert rows["MARI"]["gate_open"] == gates["m"]["MARI"] and "gate_open" not in rows["CAA"]
    assert "kl" in rows["MARI"]["ours"]  # the JSON keeps the column's key
    headers = [[cell.strip() for cell in line.strip("|").split("|")] for line in (tmp_path / "t.md").read_text().splitlines()
               if line.startswith("| row")]
    assert headers[0][-2:] == ["in-source kl (ours)", "in-source kl (paper)"] and headers[1][-1] == "in-source kl"
    assert "in-source kl" in (tmp_path / "t.tex").read_text()
    assert rerender.main([str(tmp_path / "t"), "--date", "2026-12-08"]) == 0
    again = json.loads((tmp_path / "t.json").read_text())
    again.pop("rerendered")
    assert again == written


def test_only_the_kl_and_ce_columns_are_labelled_in_source():
    assert [profiles.column_header(c) for c in ("kl", "ce@bbq", "kl_benign", "ce_benign@sorry", "mmlu")] == [
        "in-source kl", "in-source ce@bbq", "kl_benign", "ce_benign@sorry", "mmlu"]


def test_a_task_of_a_profiles_own_steps_is_evaluated_apart_the_other_groups_as_before():
    budget = profiles.PROFILES["budget"]
    groups = {key: tasks for key, tasks in scoring.task_groups(budget, COLUMNS).items()}
    # XSTest's group keeps its two tasks (its committed steps' key); the benign tasks run in steps of their own
    assert groups[("sorry_bench", None, 48, None)] == ["xstest_safe", "xstest_unsafe"]
    assert groups[("sorry_bench", None, 48, "benign_instructions")] == ["benign_instructions"]
    assert groups[("truthfulqa", None, None, None)] == ["general_text"]
    assert groups[("truthfulqa", None, None, "benign_text")] == ["benign_text"]
    together = Profile(**{**budget.__dict__, "own_step": ()})
    assert scoring.task_groups(together, COLUMNS)[("sorry_bench", None, 48, None)] == [
        "xstest_safe", "xstest_unsafe", "benign_instructions"]  # without it, the new task would join the old step
