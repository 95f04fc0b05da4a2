"""The repro scripts run end to end on tiny workloads (so that none rots)."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repro import main_table
from repro.engine import command_line, profiles

from .conftest import REPO
from .helpers import run_repro

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data]


def _strict(text: str):
    """A results file read as jq or JavaScript read it: NaN, Infinity are refused (missing numbers are null)."""
    def refuse(constant):
        raise ValueError(f"results JSON holds {constant}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_bench_times_hf_and_ours_on_the_same_requests(tmp_path):
    # One log-likelihood workload (BBQ); truthfulqa_mc2 runs through the same measure_task, and the
    # generation timings are bench's code too, run by the latency smoke test
    # (test_every_repro_script_runs_in_smoke_mode). A fixed batch size: at ``auto`` hf's own search
    # runs batches of 64 long BBQ rows on the CPU (48 of 65 s here); MariLM's auto batches are
    # tests/test_batching.py's.
    proc = subprocess.run(
        [sys.executable, str(REPO / "repro" / "bench.py"), "--limit", "1", "--workloads", "bbq", "--batch-size", "2",
         "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = _strict((tmp_path / "bench.json").read_text())
    assert set(record["results"]) == {"hf", "vanilla"} and record["batch_size"] == 2
    hf, ours = record["results"]["hf"], record["results"]["vanilla"]
    assert hf["bbq"]["questions"] == ours["bbq"]["questions"] == 1
    assert hf["bbq"]["acc"] == pytest.approx(ours["bbq"]["acc"], abs=1e-4)  # same requests, same answers
    for r in (hf, ours):
        assert r["bbq"]["peak_rss_mib"] > 0 and set(r) == {"bbq"}
    table = (tmp_path / "bench.md").read_text()
    assert re.search(r"^\| hf +\| ", table, re.M) and re.search(r"^\| vanilla +\| ", table, re.M)
    assert "BBQ wall (s)" in table and "TQA MC2" not in table


def test_bench_refuses_a_bundle_argument_without_a_bundle(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "repro" / "bench.py"), "--bundle", f"mari={tmp_path}"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "expected NAME=DIR with DIR/bundle.json" in proc.stderr


def test_bench_takes_lm_evals_batch_sizes():
    from repro.bench import batch_size_option

    assert batch_size_option("auto") == "auto" and batch_size_option("3") == 3


@pytest.mark.parametrize("args, error", [
    (["--workloads", "mc,gpu"], "--workloads 'mc,gpu': unknown ['gpu']; choose from mc, bbq, gen"),  # timed as gen before
    (["--batch-size", "0"], "argument --batch-size: 0 is below 1"),
    (["--workloads", ""], "--workloads is empty"),  # an unset shell variable: timed as gen before
    (["--repeats", "0"], "argument --repeats: 0 is below 1"),  # a median of no repeats
    (["--gen-prompts", "-1"], "argument --gen-prompts: -1 is below 1"),  # a slice from the end
])
def test_bench_refuses_an_unknown_workload_or_a_count_below_its_least(tmp_path, args, error):
    proc = subprocess.run([sys.executable, str(REPO / "repro" / "bench.py"), "--out", str(tmp_path), *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and error in proc.stderr and not (tmp_path / "bench.json").exists()


@pytest.mark.parametrize("option", ["--out", "--runs"])
def test_a_repro_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, option):
    """--out under a file (or --runs): the tables were written, or the first bundle saved, only after the work."""
    from repro import main_table

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    others = {"--out": ["--runs", str(tmp_path / "runs")], "--runs": ["--out", str(tmp_path / "results")]}[option]
    with pytest.raises(SystemExit) as exit_:
        main_table.main(["--smoke", option, str(blocker / "sub"), *others])
    assert exit_.value.code == 2
    assert f"{option} {blocker / 'sub'} cannot be written (" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing trained, nothing left


def test_bench_refuses_an_output_that_cannot_be_written_before_timing(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    proc = subprocess.run([sys.executable, str(REPO / "repro" / "bench.py"), "--out", str(tmp_path / "a-file")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and f"--out {tmp_path / 'a-file'} is a file, not a directory" in proc.stderr


# ----------------------------------------------------------------------------- the paper's tables, smoke mode


@pytest.fixture(scope="module")
def smoke_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    return root / "runs", root / "results"


@pytest.fixture(scope="module")
def uninterrupted(smoke_dirs):
    """The main table's smoke run, start to finish in one process."""
    run_repro("main_table.py", smoke_dirs, "--methods", "vanilla,mari")
    return _strict((smoke_dirs[1] / "main_table.json").read_text())


def test_main_table_smoke_writes_ours_beside_the_papers_and_resumes_without_recomputing(smoke_dirs, uninterrupted):
    out = smoke_dirs[1]
    first = uninterrupted
    assert first["computed_now"]  # bundles and evaluations were computed
    # SORRY-Bench's column was read by the embedded judge, and the table names it (issue 56.2, 57.5)
    assert first["judge"]["columns"][0] == "sorry_refusal" and "not recorded" not in first["judge"]["judges"]
    rows = first["models"]["smollm2-135m-instruct"]["rows"]
    assert [r["row"] for r in rows] == ["Vanilla", "MARI"]
    vanilla = rows[0]
    assert vanilla["n"]["tqa_mc1"] == 2 and 0 <= vanilla["ours"]["tqa_mc1"]["mean"] <= 100
    assert vanilla["paper"]["tqa_mc1"] == 32.03  # the paper's Llama-2-7B figure, in its own column
    # General capability under every attribute's bundle (issue 36.3): the base model's answers are one
    # evaluation, whichever attribute's column they stand in.
    for tag in ("bbq", "sorry"):
        for column in ("mmlu", "arc_e", "arc_c"):
            assert vanilla["ours"][f"{column}@{tag}"]["values"] == vanilla["ours"][column]["values"]
            assert rows[1]["n"][f"{column}@{tag}"] == rows[1]["n"][column] > 0
    assert re.search(r"^\| Vanilla +\| ", (out / "main_table.md").read_text(), re.M)
    assert re.search(r"^ ?Vanilla +& ", (out / "main_table.tex").read_text(), re.M)
    # A finished run is read back, not recomputed, and gives the same table.
    run_repro("main_table.py", smoke_dirs, "--methods", "vanilla,mari")
    second = _strict((out / "main_table.json").read_text())
    assert second["computed_now"] == []
    assert second["models"] == first["models"]
    # ...and still says what its steps cost when they were computed (the first run's figure).
    assert second["compute_time_s"] == first["compute_time_s"] > 0
    assert f"took {first['compute_time_s']:.0f} s of computation" in (out / "main_table.md").read_text()


def test_truthfulqa_generation_is_a_column_when_named(tmp_path, smoke_dirs, uninterrupted):
    # Issue 42: greedy answers scored by lm-eval's truthfulqa_gen metrics, every row, paired against Vanilla;
    # not in the default table (uninterrupted has none of them).
    columns = [c for c, *_ in profiles.TQA_GENERATION]
    assert not set(columns) & set(uninterrupted["models"]["smollm2-135m-instruct"]["rows"][0]["ours"])
    out = tmp_path / "results"
    run_repro("main_table.py", (smoke_dirs[0], out), "--methods", "vanilla,mari", "--columns", ",".join(columns))
    rows = {r["row"]: r for r in _strict((out / "main_table.json").read_text())["models"]["smollm2-135m-instruct"]["rows"]}
    assert list(rows) == ["Vanilla", "MARI"]
    for column in columns:
        assert rows["Vanilla"]["n"][column] == rows["MARI"]["n"][column] == 2  # the smoke profile's 2 questions
        assert rows["MARI"]["ours"][column]["difference"]["reference"] == "Vanilla"
    assert 0 <= rows["Vanilla"]["ours"]["tqa_gen_bleu_acc"]["mean"] <= 1
    assert rows["MARI"]["ours"]["tqa_gen_bleu_acc"]["difference"]["test"] == "mcnemar"  # 0/1 per document
    assert rows["MARI"]["ours"]["tqa_gen_rouge1_diff"]["difference"]["test"] == "sign-flip"
    with pytest.raises(SystemExit, match=r"and, when named, \['tqa_gen_bleu_acc'"):
        command_line.select(profiles.BENCHMARKS, "tqa_gen_typo", profiles.TQA_GENERATION)


def test_kl_cross_entropy_and_ambiguous_bbq_are_columns_when_named(tmp_path, smoke_dirs):
    # Issue 55.4: invasiveness on general text under each attribute's bundle, paired against Vanilla;
    # 55.5: BBQ's ambiguous-context accuracy, clustered by context as bbq_acc.
    columns = ["kl", "ce", "kl@sorry"]
    out = tmp_path / "results"
    run_repro("main_table.py", (smoke_dirs[0], out), "--methods", "vanilla,mari", "--columns",
              ",".join(columns + ["bbq_amb_acc", "bbq_amb_bias"]))
    rows = {r["row"]: r for r in _strict((out / "main_table.json").read_text())["models"]["smollm2-135m-instruct"]["rows"]}
    assert rows["MARI"]["n"]["bbq_amb_acc"] == 2
    assert rows["MARI"]["ours"]["bbq_amb_acc"]["difference"]["test"] == "sign-flip"  # over contexts, as bbq_acc
    assert 0 <= rows["Vanilla"]["ours"]["bbq_amb_acc"]["mean"] <= 1 and -1 <= rows["MARI"]["ours"]["bbq_amb_bias"]["mean"] <= 1
    assert rows["Vanilla"]["ours"]["kl"]["mean"] == rows["Vanilla"]["ours"]["kl@sorry"]["mean"] == 0.0
    assert rows["Vanilla"]["ours"]["ce"]["mean"] > 0 and rows["MARI"]["ours"]["ce"]["mean"] > 0
    assert rows["MARI"]["ours"]["kl"]["mean"] >= 0
    for column in columns:
        assert rows["MARI"]["n"][column] == 4  # the smoke profile's 4 general-text documents
        assert rows["MARI"]["ours"][column]["difference"]["test"] == "sign-flip"
    assert "kl" not in profiles.PROFILES["quick"].more_columns and "kl@bbq" in profiles.PROFILES["budget"].more_columns


def test_out_of_source_columns_and_the_gates_open_rates_when_named(tmp_path, smoke_dirs):
    # Issue 81.1: KL and cross-entropy on Self-Instruct's requests under each attribute's bundle, their benign
    # over-refusal under SORRY-Bench's, beside the in-source columns; each gated row's open rate per evaluation set.
    columns = ["kl", "kl_benign", "ce_benign", "kl_benign@sorry", "benign_refusal", "xstest_safe_refusal"]
    out = tmp_path / "results"
    run_repro("main_table.py", (smoke_dirs[0], out), "--methods", "vanilla,mari", "--columns", ",".join(columns))
    record = _strict((out / "main_table.json").read_text())
    rows = {r["row"]: r for r in record["models"]["smollm2-135m-instruct"]["rows"]}
    vanilla, mari = rows["Vanilla"]["ours"], rows["MARI"]["ours"]
    assert vanilla["kl_benign"]["mean"] == vanilla["kl_benign@sorry"]["mean"] == 0.0 and vanilla["ce_benign"]["mean"] > 0
    assert rows["MARI"]["n"]["kl_benign"] == 4 and rows["MARI"]["n"]["benign_refusal"] == 2  # the smoke profile's limits
    assert mari["kl_benign"]["difference"]["test"] == "sign-flip" and 0 <= mari["benign_refusal"]["mean"] <= 1
    gates = rows["MARI"]["gate_open"]
    assert "gate_open" not in rows["Vanilla"]
    assert set(gates) == {"general_text@tqa", "benign_text@tqa", "benign_text@sorry", "benign_instructions@sorry",
                          "xstest_safe@sorry"}  # one per evaluation: kl_benign and ce_benign read one
    assert all(e["seeds"] == [0] and 0 <= e["values"][0] <= 1 for e in gates.values())
    md = (out / "main_table.md").read_text()
    assert "in-source kl (ours)" in md and "kl_benign (ours)" in md and "out of source" in md


def test_a_profile_scores_some_columns_under_more_seeds():
    # The quick profile's TruthfulQA columns under seeds 0, 1, 2 (issue 36.8); the others under its seeds only.
    from repro.engine.profiles import BENCHMARKS, Profile

    profile = Profile("p", ["m"], [0], {}, None, {}, column_seeds={"tqa_mc1": [0, 1, 2], "tqa_mc2": [2]})
    by_seed = {seed: [c[0] for c in columns] for seed, columns in profile.seeded_columns(BENCHMARKS).items()}
    assert by_seed == {0: [c[0] for c in BENCHMARKS], 1: ["tqa_mc1"], 2: ["tqa_mc1", "tqa_mc2"]}
    assert Profile("p", ["m"], [0, 1], {}, None, {}).seeded_columns(BENCHMARKS[:1]) == {0: BENCHMARKS[:1], 1: BENCHMARKS[:1]}
    # --seeds gives every column exactly those seeds: the quick profile's TruthfulQA seeds 1 and 2 go too.
    from types import SimpleNamespace

    from repro.engine.command_line import profile_from_args

    only = profile_from_args(SimpleNamespace(profile="quick", seeds="0", model=None))
    assert only.seeds == [0] and list(only.seeded_columns(BENCHMARKS)) == [0]
    assert list(profile_from_args(SimpleNamespace(profile="quick", seeds=None, model=None)).seeded_columns(BENCHMARKS)) == [0, 1, 2]


def test_the_same_tasks_under_every_attributes_bundle_share_one_pass(monkeypatch):
    # MMLU under the TruthfulQA, BBQ and SORRY-Bench bundles (issue 36.3): one shared pass for the
    # three attributes' runs, Vanilla joined once, each run still its own cached evaluation.
    from repro.engine import scoring
    from repro.engine.profiles import BENCHMARKS, GENERAL_UNDER_OTHERS, PROFILES

    columns = [c for c in BENCHMARKS if c[0] == "mmlu"] + [c for c in GENERAL_UNDER_OTHERS if c[0].startswith("mmlu")]
    passes, evaluated = [], []

    class Store:
        placement = None

        def missing(self, *args):
            return True

        def evaluations(self, model, tasks, limit, bundle, model_args, gen_tokens, seed, lm=None):
            evaluated.append((tuple(tasks), bundle, model_args, lm))
            return {t: {"metrics": {"acc,none": 0.5}, "n": 1, "documents": {}} for t in tasks}

    class Pass:
        stats: dict = {}

    monkeypatch.setattr(scoring, "shared_pass_over", lambda model, placement: passes.append(Pass()) or passes[-1])
    monkeypatch.setattr(scoring, "mari_lm", lambda model, bundle, args, placement, shared: (bundle, shared))
    bundles = {a: f"{a}-bundle" for a in ("truthfulqa", "bbq", "sorry_bench")}
    rows = {"Vanilla": ({}, ""), "MARI": (bundles, ""), "MARI ungated": (bundles, "gate=false")}
    out = scoring.score_rows(Store(), PROFILES["quick"], "m", 0, columns, rows)
    assert len(passes) == 1
    joined = [(bundle, args) for tasks, bundle, args, lm in evaluated if lm is not None]
    assert joined == [(None, "")] + [(bundles[a], args) for a in ("truthfulqa", "bbq", "sorry_bench") for args in ("", "gate=false")]
    assert all(lm[1] is passes[0] for *_, lm in evaluated if lm is not None)
    assert set(out) == set(rows) and set(out["MARI"]) == {c[0] for c in columns}


@pytest.mark.parametrize("argv, message", [
    (["--seeds", ""], r"--seeds is empty \(an unset shell variable\?\)"),
    (["--seeds", "0,,1"], r"--seeds '0,,1' holds an empty item"),
    (["--seeds", "0,x"], r"--seeds '0,x': every item must be an integer"),
    (["--columns", ""], r"--columns is empty"),
    (["--columns", "tqa_mc1,"], r"--columns 'tqa_mc1,' holds an empty item"),
    (["--methods", "vanilla,,mari"], r"--methods 'vanilla,,mari' holds an empty item"),
    (["--extra-bundle", "steer"], r"--extra-bundle 'steer': give NAME=DIR"),
    (["--extra-bundle", "1x=somewhere"], r"a row name is a letter then"),
    (["--extra-bundle", "mari=somewhere"], r"another row is named 'mari'"),
    (["--extra-bundle", "CAA=somewhere"], r"another row is named 'CAA'"),  # CAA's label
    (["--extra-bundle", "steer=/nonexistent/bundle"], r"--extra-bundle 'steer=/nonexistent/bundle': .*is missing"),
])
def test_an_empty_or_half_empty_list_option_is_refused_not_read_as_the_default(argv, message, tmp_path):
    # Issue 37's sweep: `--seeds ''` (an unset variable) ran the profile's seeds, `--ks 1,,4` failed with
    # a bare int() error. Refused before anything is trained.
    from repro import main_table

    with pytest.raises(SystemExit, match=message):
        main_table.main(["--smoke", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *argv])
    assert not (tmp_path / "runs" / "bundles").exists()


def _finished(runs) -> set[str]:
    """Cells stored under ``runs``: evaluation files and complete bundle directories."""
    bundles = {p.name for p in (runs / "bundles").glob("*") if (p / "bundle.json").is_file() and "." not in p.name}
    return bundles | {p.name for p in (runs / "evaluations").glob("*.json")}


def _running(pid: str) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_the_main_table_tests_every_row_but_vanilla_against_mari():
    rows = ["Vanilla", "Prompting", "CAA", "LoRA", "MARI", "steer"]  # "steer": an --extra-bundle row
    assert main_table.against_mari(rows) == [("Prompting", "MARI"), ("CAA", "MARI"), ("LoRA", "MARI"), ("steer", "MARI")]
    assert main_table.against_mari(["Vanilla", "CAA"]) == []  # no MARI row: no such family


def test_main_table_killed_mid_training_then_rerun_equals_an_uninterrupted_run(tmp_path, smoke_dirs, uninterrupted):
    runs, out = tmp_path / "runs", tmp_path / "results"
    # TruthfulQA's columns alone (one attribute's bundles, one evaluation): the same cells as the
    # uninterrupted table's, computed again from nothing.
    columns = ["tqa_mc1", "tqa_mc2"]
    # main_table trains every row's bundles first, then scores the rows together (one shared pass):
    # CAA's bundles are finished when MARI's training is killed, and nothing is evaluated yet.
    selection = ["--methods", "vanilla,caa,mari", "--columns", ",".join(columns)]
    proc = subprocess.Popen([sys.executable, str(REPO / "repro" / "main_table.py"), "--smoke", "--runs", str(runs),
                             "--out", str(out), *selection],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # kill -9 as soon as MARI's training has checkpointed an epoch: mid-training, after CAA's bundles.
    deadline = time.monotonic() + 900
    while not list(runs.glob("bundles/mari-*.checkpoint/*.safetensors")):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()  # none expected yet
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    while any(map(_running, children)):  # they stop with their parent, none is orphaned
        assert time.monotonic() < deadline, f"processes {children} outlived their killed parent"
        time.sleep(0.1)
    before = _finished(runs)
    assert before and not (out / "main_table.json").exists()

    rerun = run_repro("main_table.py", (runs, out), *selection)
    assert "from its checkpoint after epoch" in rerun.stderr  # the killed training resumed, not restarted
    result = _strict((out / "main_table.json").read_text())
    assert result["computed_now"] and not set(result["computed_now"]) & before  # nothing computed twice
    model = "smollm2-135m-instruct"
    reference = {r["row"]: r for r in uninterrupted["models"][model]["rows"]}
    rows = [row for row in result["models"][model]["rows"] if row["row"] in reference]
    assert [row["row"] for row in rows] == ["Vanilla", "MARI"]
    compared = result["models"][model]["comparisons"]  # every row but Vanilla against MARI, its own Holm family
    assert [(c["row"], c["against"]) for c in compared] == [("CAA", "MARI")]
    assert {c: d["test"] for c, d in compared[0]["columns"].items()} == {"tqa_mc1": "mcnemar", "tqa_mc2": "sign-flip"}
    # Every cell equals the uninterrupted run's (which has no CAA row); Holm's adjusted p depends
    # on how many tests the table makes (CAA's add some), so it is left out of the comparison.
    holm = ("p_holm", "significant_holm")
    same = lambda cell: {k: v if k != "difference" or v is None else {d: x for d, x in v.items() if d not in holm}
                         for k, v in cell.items()}  # noqa: E731
    for row in rows:
        assert {c: same(row["ours"][c]) for c in columns} == {c: same(reference[row["row"]]["ours"][c]) for c in columns}, row["row"]
        assert {c: row["n"][c] for c in columns} == {c: reference[row["row"]]["n"][c] for c in columns}
    bundles = [p for p in (runs / "bundles").iterdir()]
    assert all("." not in p.name for p in bundles)  # no half-trained bundle or checkpoint left behind
    for bundle in [b for b in bundles if b.name.startswith("mari-")]:  # same seed, same machine: bit-identical weights
        reference = smoke_dirs[0] / "bundles" / bundle.name / "weights.safetensors"
        assert (bundle / "weights.safetensors").read_bytes() == reference.read_bytes(), bundle.name


@pytest.mark.parametrize("script,args,outputs", [
    ("ablation_table.py", ["--columns", "tqa_mc1,bbq_acc"], ["ablation_table.json", "ablation_table.md", "ablation_table.tex"]),
    ("transfer_gsm8k.py", ["--rhos", "0.9"], ["transfer_gsm8k.json", "transfer_gsm8k.md"]),
    ("sensitivity.py", ["--ks", "4", "--rhos", "0.8", "--labellings", "loss,source", "--alphas", "1,0.5"],
     ["sensitivity.json", "sensitivity_k.png", "sensitivity_rho.png", "sensitivity_alpha.png"]),
    ("diagnostics.py", ["--columns", "tqa_mc1,bbq_acc"], ["diagnostics.json", "diagnostics.md", "diagnostics_energy.png"]),
    ("latency.py", ["--prompts", "3", "--methods", "lora,mari"], ["latency.json", "latency.md", "latency.tex"]),
    ("baseline_recipes.py", ["--methods", "caa"], ["baseline_recipes.json", "baseline_recipes.md", "baseline_recipes.tex"]),
    ("figures.py", [], ["figures.json", "figures.md", "figure1.png", "figure5a.png", "figure5b.png", "figure6.png"]),
])
def test_every_repro_script_runs_in_smoke_mode(smoke_dirs, script, args, outputs):
    run_repro(script, smoke_dirs, *args)
    for name in outputs:
        assert (smoke_dirs[1] / name).stat().st_size > 0, name
    if outputs[0].endswith(".json"):
        record = _strict((smoke_dirs[1] / outputs[0]).read_text())
        assert record["profile"] == "smoke" and record["command"].startswith("python repro/")
    if script == "figures.py":  # issue 42: the numbers behind Figures 1, 5a, 5b and 6, from the main table's bundle
        figures = record["models"]["smollm2-135m-instruct"]["0"]
        assert figures["bundle"] in {p.name for p in (smoke_dirs[0] / "bundles").iterdir()} and figures["energy_drift"] < 1e-2
        assert 0 < figures["figure1"]["questions"] and 0 <= figures["figure1"]["wrong"] <= figures["figure1"]["questions"]
        assert len(figures["figure5a"]["experts"]) == figures["K"] and figures["figure5a"]["test"]["p"] is not None
        assert set(figures["figure5b"]) == set(figures["figure6"]) == {"loss", "flip", "source"}
        source = figures["figure5b"]["source"]
        assert source["applicable"] == [s == "attribute" for s in figures["ctrl_sources"]]
        assert 0 <= source["auroc_energy"]["value"] <= 1 and 0.5 <= source["auroc_pc1"]["value"] <= 1
        assert figures["figure6"]["source"]["applicable"]["paper"] == 119.76 and figures["figure6"]["source"][
            "non_applicable"]["shift"] >= 0
    for row in (record["models"]["smollm2-135m-instruct"]["rows"] if script in GATE_COLUMNS else []):
        for column in GATE_COLUMNS[script]:  # MARI's gate rate on every benchmark, generation and groups included
            rate = row["ours"][column]["mean"]
            assert (rate is None) if row["row"] in UNGATED_ROWS else 0 <= rate <= 1, (row["row"], column, rate)
    if script == "ablation_table.py":  # EG-MARI with tau_E recalibrated on each labelling (issue 22)
        rows = [r["row"] for r in record["models"]["smollm2-135m-instruct"]["rows"]]
        # and EG-MARI whose gate is also calibrated on Self-Instruct seed tasks, its own bundles (issue 81.2)
        assert rows[-4:] == ["EG-MARI", "EG-MARI (labels=flip)", "EG-MARI (labels=source)", "EG-MARI (requests in D_ctrl)"]
        compared = record["models"]["smollm2-135m-instruct"]["comparisons"]  # issue 36.7
        assert [(c["row"], c["against"]) for c in compared] == [("EG-MARI", "w/o Multi-Adapter"),
                                                                 ("EG-MARI (requests in D_ctrl)", "EG-MARI")]
        assert all(c["columns"] for c in compared)
        requests = [b for b in (smoke_dirs[0] / "bundles").iterdir() if b.name.startswith("mari-")
                    and (b / "bundle.json").is_file()
                    and json.loads((b / "bundle.json").read_text())["hyperparameters"].get("gate_requests")]
        assert requests and all("requests" in json.loads((b / "bundle.json").read_text())["gate"]["ctrl_sources"]
                                for b in requests)
    if script == "sensitivity.py":  # the rho sweep per labelling, the alpha_probe axis (issue 22)
        rows = {r["row"]: r for r in record["models"]["smollm2-135m-instruct"]["rows"]}
        assert list(rows) == ["Vanilla", "K=4", "rho=0.8, labels=loss", "rho=0.8, labels=source", "alpha_probe=1.0",
                              "alpha_probe=0.5", "probe_alpha=0.1 (fixed probe)", "probe_alpha=0.3 (fixed probe)",
                              "probe_alpha=1.0 (fixed probe)"]  # Vanilla: the reference of the paired tests (issue 26)
        assert rows["K=4"]["ours"] == rows["probe_alpha=1.0 (fixed probe)"]["ours"]  # the trained strength: the bundle as is
        assert rows["Vanilla"]["ours"]["tqa_mc1"]["difference"] is None
        assert rows["K=4"]["ours"]["tqa_mc1"]["difference"]["reference"] == "Vanilla"
        assert rows["K=4"]["ours"] == rows["alpha_probe=1.0"]["ours"]  # the same bundle and evaluation
        for row in rows.values():
            assert all(v is None or 0 <= v <= 1 for c in ("auroc_loss", "auroc_source") for v in row["ours"][c]["values"])
    if script == "baseline_recipes.py":  # both recipes of every baseline, the main table's (published) marked (issue 36.5)
        rows = {r["row"]: r for r in record["models"]["smollm2-135m-instruct"]["rows"]}
        assert list(rows) == ["Vanilla", "CAA (adapted)", "CAA (published)"]
        assert ["notes" in rows[f"CAA ({r})"] for r in ("adapted", "published")] == [False, True]
        assert all(row["ours"]["val_loss"]["mean"] > 0 for row in rows.values())  # reported beside, not used to choose
    if script == "latency.py":  # the smoke profile's 2 prompts are a default: a given --prompts was ignored (issue 37)
        assert "3 SORRY-Bench prompts, 4 greedy tokens each" in (smoke_dirs[1] / "latency.md").read_text()
    if script == "diagnostics.py":
        rates = record["gate_rates"]["smollm2-135m-instruct"]
        assert set(rates) == {"loss", "flip", "source"}
        for by_column in rates.values():
            assert set(by_column) == {"tqa_mc1", "bbq_acc"}
            assert all(0 <= v <= 1 for cell in by_column.values() for v in cell["values"])
        for bundle in record["bundles"]["smollm2-135m-instruct"].values():
            assert set(bundle["separation"]) == set(bundle["ctrl_labels"]) == set(bundle["tau_E_by_labels"]) == {
                "loss", "flip", "source"}
            assert bundle["ctrl_labels"]["source"] == [s == "attribute" for s in bundle["ctrl_sources"]]
        assert "AUROC (all)" in (smoke_dirs[1] / "diagnostics.md").read_text()


def test_profile_time_counts_each_stored_step_once_across_the_tables(smoke_dirs, uninterrupted, tmp_path):
    # Runs after the smoke scripts above (same module's folders): each table's steps rebuilt from its
    # recorded command; the seconds it reads are the computation its own JSON records, each step counted once.
    from repro import profile_time

    results = smoke_dirs[1]
    assert profile_time.main(["--results", str(results), "--out", str(tmp_path)]) == 0
    record = _strict((tmp_path / "profile_time.json").read_text())
    by_table = {row["table"]: row for row in record["tables"]}
    assert "main_table" in by_table and by_table["main_table"]["steps_added"] == by_table["main_table"]["steps_read"]
    for table, row in by_table.items():
        own = _strict((results / f"{table}.json").read_text())
        if table != "figures":
            assert row["seconds_read"] == pytest.approx(own["compute_time_s"], abs=0.2), table
            # what the table recorded is what its command's steps, rebuilt and read back from runs/, hold
            assert own["step_seconds"] == pytest.approx(profile_time.step_seconds(table, own["command"])), table
        assert row["steps_added"] <= row["steps_read"] and row["seconds_added"] >= 0
    assert record["total_seconds"] == pytest.approx(sum(r["seconds_added"] for r in record["tables"]), abs=0.5)
    assert record["steps"] == sum(r["steps_added"] for r in record["tables"])
    assert "Total:" in (tmp_path / "profile_time.md").read_text()


GATE_COLUMNS = {"transfer_gsm8k.py": ["gate_tqa", "gate_gsm8k"], "sensitivity.py": ["gate_tqa", "gate_mmlu"],
                "latency.py": ["gate_rate"]}
UNGATED_ROWS = {"Vanilla", "Base Model", "ITI", "NLITI", "ReFT", "Prompting", "LoRA"}  # no gate: no rate


def test_bench_from_runs_times_the_repro_scripts_own_bundles(tmp_path, monkeypatch):
    # bench --from-runs PROFILE takes each method's bundles from the repro cache (trained there
    # when missing): TruthfulQA on the multiple-choice workload, SORRY-Bench on generation.
    from repro import bench
    from repro.engine import profiles
    from repro.engine.cache import Store

    asked = []

    def bundle(self, method, attribute, model, seed, profile, hyperparameters=None):
        asked.append((method, attribute, model, seed, profile.name, self.root))
        return tmp_path / "runs" / f"{method}-{attribute}"

    monkeypatch.setattr(Store, "bundle", bundle)
    monkeypatch.chdir(tmp_path)
    mc, gen = bench.repro_bundles("quick", "smollm2-135m-instruct", str(tmp_path / "runs"), None)
    methods = ["mari", "caa", "iti", "nl_iti", "reft"]
    assert mc == {**{m: f"runs/{m}-truthfulqa" for m in methods}, "mari_open": "runs/mari-truthfulqa,gate=false"}
    assert gen == {**{m: f"runs/{m}-sorry_bench" for m in methods}, "mari_open": "runs/mari-sorry_bench,gate=false"}
    seed = profiles.PROFILES["quick"].seeds[0]
    assert {a[2:] for a in asked} == {("smollm2-135m-instruct", seed, "quick", tmp_path / "runs")}
    with pytest.raises(SystemExit, match="--from-runs 'fast': choose one of"):
        bench.repro_bundles("fast", "smollm2-135m-instruct", str(tmp_path / "runs"), None)
