"""The judge in the tables (issue 56.2): part of every judged evaluation's cache key, named in the
table, and its unparseable verdicts counted beside n, with a cell below the floor printed n/a."""

from __future__ import annotations

import json

import pytest

from mari_eval.injection.devices import Placement
from mari_eval.judge import OWN_PROMPT
from repro.engine import judged
from repro.analysis import tables
from repro.engine.cache import Store
from repro.engine.profiles import Profile

JUDGE = "judge-model | prompt base-#thescore sha256:abc"


def judged_cell(scores: list[float | None], prefix: str = "d") -> dict:
    docs = {f"{prefix}{i}": s for i, s in enumerate(scores)}
    parsed = [s for s in scores if s is not None]
    return {"values": [sum(parsed) / len(parsed) if parsed else float("nan")], "n": len(scores), "documents": [docs],
            "judged": True, "judge": [JUDGE]}


def measured(tmp_path, monkeypatch, kappas: dict[str, float | None]) -> None:
    """A judge_agreement.json measuring each judge's held-out kappa (None: undefined), read by the tables."""
    path = tmp_path / "judge_agreement.json"
    path.write_text(json.dumps({"held_out": {"judges": {
        f"judge {i}": {"label": label, "subsets": {"all": {"kappa": kappa}}} for i, (label, kappa) in enumerate(kappas.items())}}}))
    monkeypatch.setattr(judged, "AGREEMENT", str(path))  # REPO / an absolute path is that path


@pytest.fixture
def agreeing_judge(tmp_path, monkeypatch):
    measured(tmp_path, monkeypatch, {JUDGE: 0.7})  # above the kappa floor: its cells are printed


def write(tmp_path, cells):
    store = Store(tmp_path / "runs", placement=Placement(dtype="float32"))
    profile = Profile(name="fixed", models=["m"], seeds=[0], max_train={}, max_ctrl=None, limits={})
    return tables.write_tables(tmp_path, "t", "Table T", "Intro.", cells, ["sorry_refusal"], lambda model: ("P", {}),
                               profile, "cmd", 1.0, store)


def test_unparseable_verdicts_are_counted_and_a_cell_below_the_floor_is_na(tmp_path, agreeing_judge):
    # The reported case: half the verdicts unparseable printed "1.000 [1.000, 1.000] (n=2)" from one verdict.
    cells = {"m": {"Vanilla": {"sorry_refusal": judged_cell([0.0] * 50 + [1.0] * 10)},
                   "Half": {"sorry_refusal": judged_cell([1.0, None])},
                   "Most": {"sorry_refusal": judged_cell([1.0] * 40 + [0.0] * 18 + [None] * 2)}}}
    record = write(tmp_path, cells)
    vanilla, half, most = record["models"]["m"]["rows"]
    assert half["verdicts"]["sorry_refusal"] == {"parsed": 1, "total": 2}
    assert half["ours"]["sorry_refusal"]["mean"] != half["ours"]["sorry_refusal"]["mean"]  # withheld: NaN
    written = json.loads((tmp_path / "t.json").read_text())["models"]["m"]["rows"][1]["ours"]["sorry_refusal"]
    assert written["mean"] is None and written["ci"] is None  # strict JSON: null
    assert half["ours"]["sorry_refusal"]["difference"] is None
    assert most["verdicts"]["sorry_refusal"] == {"parsed": 58, "total": 60}
    assert most["ours"]["sorry_refusal"]["difference"] is not None
    assert record["judge"] == {"columns": ["sorry_refusal"], "judges": [JUDGE], "min_parsed": judged.MIN_PARSED,
                               "kappa_floor": 0.6, "held_out_kappa": {JUDGE: 0.7}}
    md = (tmp_path / "t.md").read_text()
    assert "| Half    | n/a (1 of 2 verdicts parsed)" in md
    assert "(n=60; 58 of 60 verdicts parsed)" in md and "(n=60; 60 of 60 verdicts parsed)" in md
    assert f"Judged columns (sorry_refusal): read by {JUDGE}" in md
    assert "1.000 [1.000, 1.000] (n=2)" not in md


def test_a_table_without_a_judged_column_names_no_judge(tmp_path):
    cells = {"m": {"Vanilla": {"sorry_refusal": {"values": [0.5], "n": 2, "documents": [{"a": 1.0, "b": 0.0}]}}}}
    record = write(tmp_path, cells)
    assert "judge" not in record and "verdicts" not in record["models"]["m"]["rows"][0]
    assert "Judged columns" not in (tmp_path / "t.md").read_text()


@pytest.mark.needs_data
def test_the_judge_is_part_of_a_judged_evaluations_key_only(tmp_path, monkeypatch):
    store = Store(tmp_path / "runs", placement=Placement(dtype="float32"))

    def paths():
        found, configs = store._evaluation_paths("smollm2-135m-instruct", ["sorry_bench_heldout", "xstest_safe"], 10,
                                                 None, "", 48, 0)
        return found, configs

    monkeypatch.setenv("MARI_JUDGE_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("MARI_JUDGE_MODEL", "judge-a")
    first, configs = paths()
    assert configs["sorry_bench_heldout"]["judge"]["model"] == "judge-a"
    assert configs["sorry_bench_heldout"]["judge"]["parser"] >= 1 and "judge" not in configs["xstest_safe"]
    monkeypatch.setenv("MARI_JUDGE_MODEL", "judge-b")
    other_model, _ = paths()
    assert other_model["sorry_bench_heldout"] != first["sorry_bench_heldout"]
    assert other_model["xstest_safe"] == first["xstest_safe"]  # the keyword judge's task: no LLM judge in it
    monkeypatch.setenv("MARI_JUDGE_MODEL", "judge-a")
    monkeypatch.setenv("MARI_JUDGE_PROMPT", OWN_PROMPT)
    other_prompt, _ = paths()
    assert other_prompt["sorry_bench_heldout"] not in (first["sorry_bench_heldout"], other_model["sorry_bench_heldout"])
    monkeypatch.delenv("MARI_JUDGE_PROMPT")
    assert paths()[0] == first


def test_a_rerendered_table_keeps_its_judge_and_withheld_cells(tmp_path, agreeing_judge):
    from repro import rerender

    cells = {"m": {"Vanilla": {"sorry_refusal": judged_cell([0.0] * 50 + [1.0] * 10)},
                   "Half": {"sorry_refusal": judged_cell([1.0, None])}}}
    write(tmp_path, cells)
    again = rerender._cells(json.loads((tmp_path / "t.json").read_text()), {}, {})
    assert again["m"]["Half"]["sorry_refusal"]["verdicts"] == (1, 2)
    assert judged.judge_record(judged.withhold_below_floor(again))["judges"] == [JUDGE]


@pytest.mark.needs_data
def test_the_embedded_judge_has_one_identity_before_and_after_it_starts(monkeypatch):
    # repro starts the embedded judge in the middle of a table (lm_eval_run._ensure_judge), which sets
    # MARI_JUDGE_*: a key computed after that must be the one computed before, or the next run recomputes.
    from mari_eval.judge import server

    for name in ("MARI_JUDGE_BASE_URL", "MARI_JUDGE_MODEL", server.ENV_EMBEDDED):
        monkeypatch.delenv(name, raising=False)
    before = server.judge_identity()
    embedded = server.EmbeddedServer.__new__(server.EmbeddedServer)
    embedded.alias, embedded.model, embedded.host, embedded.port = "smollm2-135m-instruct", "/some/dir", "127.0.0.1", 9
    for name, value in embedded.env().items():
        monkeypatch.setenv(name, value)
    assert server.judge_identity() == before
    monkeypatch.delenv(server.ENV_EMBEDDED)  # a judge the user configured: named by its model
    assert server.judge_identity()["model"] == "/some/dir"


def test_the_judge_label_is_read_from_the_tasks_recorded_metadata():
    # mari_eval/judge/sorry_bench.py records the judge in lm-eval's results under configs/TASK/metadata
    # (its table keeps three numbers); a table that read it elsewhere named no judge ("not recorded").
    from repro.engine.lm_eval_run import judge_label

    out = {"results": {"sorry_bench_heldout": {"refusal_rate,none": 0.5}},
           "configs": {"sorry_bench_heldout": {"metadata": {"judge": {"label": "m @ prompt sha256:ab", "parser": 2}}},
                       "xstest_safe": {"metadata": {"version": 1.0}}}}
    assert judge_label(out, "sorry_bench_heldout") == "m @ prompt sha256:ab"
    assert judge_label(out, "xstest_safe") is None and judge_label({"results": {}}, "sorry_bench_heldout") is None


def test_a_judge_given_as_a_local_folder_is_named_by_the_folder_not_the_machines_path():
    from mari_eval.storage.models import display_name

    assert display_name("/data/judges/my-judge") == "my-judge (local files)"
    assert display_name("smollm2-135m-instruct") == "smollm2-135m-instruct (embedded)"
    assert display_name("mistralai/Mistral-7B-Instruct-v0.2") == "mistralai/Mistral-7B-Instruct-v0.2"
    label = "/root/.cache/mari-eval/models/smollm2-135m-instruct | prompt base-#thescore sha256:ab"
    stored = {"m": {"Vanilla": {"sorry_refusal": {**judged_cell([0.0, 1.0]), "judge": [label]}},
                    "Hub": {"sorry_refusal": {**judged_cell([1.0]), "judge": ["mistralai/Mistral-7B | prompt p sha256:cd"]}}}}
    assert judged.judge_record(stored)["judges"] == [
        "mistralai/Mistral-7B | prompt p sha256:cd",
        "smollm2-135m-instruct (embedded) | prompt base-#thescore sha256:ab"]


def test_refusal_columns_carry_their_judges_agreement_with_people(tmp_path, monkeypatch):
    # issue 55.6: the SORRY-Bench column names the judge it used and its measured agreement
    committed = json.loads((judged.REPO / judged.AGREEMENT).read_text())
    keyword = committed["readings"]["partial-is-refusal"]["keyword"]["all"]
    llm = committed["llm_judge"]
    measured = f"{llm['model']} | prompt {llm['prompt']} sha256:{llm['prompt_sha256']}"
    record = judged.agreement_record(["tqa_mc1", "sorry_keyword", "sorry_refusal"],
                                     {"judges": [measured, "other-judge | prompt p sha256:ef"]})
    assert record["source"] == judged.AGREEMENT and record["command"] == committed["command"]
    assert record["judges"]["keyword"]["kappa"] == keyword["kappa"]
    assert record["judges"][measured]["n"] + record["judges"][measured]["unparseable"] > 0
    assert record["judges"]["other-judge | prompt p sha256:ef"] is None  # another judge: not measured, said so
    sentence = judged.agreement_sentence(record)
    assert f"Cohen's kappa {keyword['kappa']:.3f}" in sentence and "other-judge | prompt p sha256:ef: not measured" in sentence
    assert judged.agreement_record(["tqa_mc1", "bbq_acc"], None) is None  # no refusal column: nothing to say
    assert judged.agreement_record(["xstest_safe_refusal@sorry"], None)["judges"].keys() == {"keyword"}
    monkeypatch.setattr(judged, "AGREEMENT", "results/no_such_file.json")
    missing = judged.agreement_record(["sorry_keyword"], None)
    assert missing["source"] is None and "is missing" in judged.agreement_sentence(missing)


@pytest.mark.parametrize("kappa, says", [(0.59, "n/a (judge's held-out kappa 0.590 < 0.6)"),
                                         (None, "n/a (judge's held-out kappa not measured, floor 0.6)"),
                                         ("undefined", "n/a (judge's held-out kappa undefined: no verdict read, floor 0.6)"),
                                         (0.6, "0.167")])
def test_a_judged_column_is_printed_only_when_its_judges_held_out_kappa_reaches_the_floor(tmp_path, monkeypatch,
                                                                                       kappa, says):
    # issue 81.3: the floor is 0.6 (Landis & Koch's "substantial" begins above it); a judge the agreement file
    # never scored is not measured, one it scored without a readable verdict (kappa null there) undefined
    found = {JUDGE: None} if kappa == "undefined" else {JUDGE: kappa} if kappa is not None else {
        "another judge | prompt p sha256:x": 0.9}
    measured(tmp_path, monkeypatch, found)
    cells = {"m": {"Vanilla": {"sorry_refusal": judged_cell([0.0] * 50 + [1.0] * 10)},
                   "Row": {"sorry_refusal": judged_cell([1.0] * 50 + [0.0] * 10, prefix="d")}}}
    record = write(tmp_path, cells)
    vanilla, row = record["models"]["m"]["rows"]
    md = (tmp_path / "t.md").read_text()
    assert f"| Vanilla | {says}" in md
    printed = isinstance(kappa, float) and kappa >= 0.6
    assert (vanilla["ours"]["sorry_refusal"]["mean"] == vanilla["ours"]["sorry_refusal"]["mean"]) is printed  # NaN: withheld
    assert (row["ours"]["sorry_refusal"]["difference"] is not None) is printed
    written = json.loads((tmp_path / "t.json").read_text())["judge"]
    assert written["held_out_kappa"] == {JUDGE: kappa if isinstance(kappa, float) else None}  # undefined: null
    assert written["kappa_floor"] == 0.6
    assert "reaches 0.6 (Landis & Koch's 'substantial'" in md
