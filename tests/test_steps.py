"""The step graph of a repro script (repro/engine/steps.py) and its costs (repro/engine/costs.py): scheduling on N
GPUs, the critical path, the plans of the main table, the ablation table and the sensitivity
sweep (every step, its inputs, what is cached) and ``--plan``, which runs nothing."""

from __future__ import annotations

import json

import pytest

from repro import ablation_table, baseline_recipes, diagnostics, figures, latency, main_table, sensitivity, transfer_gsm8k
from repro.engine import cache, cache_digests, costs, profiles, steps

from .tiny import tiny_caa


def hand_graph() -> steps.Graph:
    graph = steps.Graph()
    graph.add(steps.Step("A", steps.TRAIN, "A", seconds=10))
    graph.add(steps.Step("B", steps.TRAIN, "B", seconds=4))
    graph.add(steps.Step("C", steps.EVALUATE, "C", needs=("A", "B"), seconds=5))
    graph.add(steps.Step("D", steps.EVALUATE, "D", seconds=8))
    return graph


def test_the_schedule_waits_for_inputs_and_fills_free_gpus():
    graph = hand_graph()
    assert graph.critical_path() == 15  # A then C
    assert graph.makespan(1) == 27  # one after the other
    # two GPUs: A and B at 0, D when B ends (4..12), C when A ends (10..15)
    assert graph.makespan(2) == 15
    assert graph.makespan(32) == 15  # never below the critical path
    assert [s.key for s in graph.order()].index("C") > max([s.key for s in graph.order()].index(k) for k in "AB")


def test_cached_steps_cost_nothing_and_a_wide_step_takes_its_gpus():
    graph = steps.Graph()
    graph.add(steps.Step("A", steps.TRAIN, "A", seconds=10, cached=True))
    graph.add(steps.Step("C", steps.EVALUATE, "C", needs=("A",), seconds=5))
    graph.add(steps.Step("W", steps.EVALUATE, "W", seconds=6, gpus=2))
    assert graph.critical_path() == 6
    assert graph.makespan(2) == 11  # W holds both GPUs, C waits (or the reverse)
    assert graph.makespan(1) == 17  # W on one GPU: its 12 GPU-seconds, then C
    summary = graph.summary((1, 2))
    assert summary["cached"] == 1 and summary["gpu_hours"] == pytest.approx((5 + 12) / 3600)


def test_a_broken_graph_is_refused():
    graph = hand_graph()
    graph.add(steps.Step("A", steps.TRAIN, "A", seconds=10))  # the same step twice is one step
    with pytest.raises(ValueError, match="two different steps under one key 'A'"):
        graph.add(steps.Step("A", steps.TRAIN, "A", seconds=11))
    graph.add(steps.Step("E", steps.EVALUATE, "E", needs=("Z",)))
    with pytest.raises(ValueError, match="need steps the graph does not hold"):
        graph.order()
    cyclic = steps.Graph()
    cyclic.add(steps.Step("X", steps.TRAIN, "X", needs=("Y",)))
    cyclic.add(steps.Step("Y", steps.TRAIN, "Y", needs=("X",)))
    with pytest.raises(ValueError, match="cycle"):
        cyclic.order()


def test_evaluation_flops_count_the_prompt_once_plus_each_row_that_edits_it(monkeypatch):
    monkeypatch.setitem(costs.EMBEDDED_PARAMETERS, "m", 10**9)
    size = costs.TaskSize(documents=10, prompt=100, requests=4, option=5, generation=False)
    # prompt read twice (frozen prefix, ReFT's edited one); options: 1 + (K + 2) + 1 rows per option
    assert costs.evaluation_flops("m", size, [None, "mari", "reft"], None) == 2e9 * 10 * (100 * 2 + 4 * 5 * 8)
    generation = costs.TaskSize(documents=3, prompt=50, requests=0, option=0, generation=True)
    assert costs.evaluation_flops("m", generation, [None], 16) == 2e9 * 3 * (50 + 16)
    # the KL/CE measure: the untouched model reads the whole text once for the group (Prompting, outside
    # the shared pass, once more for itself), and every row that edits reads it again under its edit
    divergence = costs.TaskSize.of("general_text", 10)
    assert divergence.alone and costs.TaskSize.of("benign_text", None).alone and not costs.TaskSize.of("mmlu", 1).alone
    text = divergence.prompt + divergence.requests * divergence.option
    window = costs.MARI_K * costs.MARI_WINDOW
    assert costs.evaluation_flops("m", divergence, [None, "mari"], None) == pytest.approx(2e9 * 10 * (text + text + window))
    assert costs.evaluation_flops("m", divergence, [None, "caa", "prompting"], None) == pytest.approx(2e9 * 10 * (2 * text + 2 * text))
    with pytest.raises(ValueError, match="no parameter count for 'org/unknown'"):
        costs.parameters("org/unknown")


def test_rows_of_one_mari_bundle_are_priced_its_variants_once(monkeypatch):
    # The shared pass hands a bundle's later rows the variants its earlier rows computed (one edit
    # fingerprint); a later row computes only the probe strength or single adapter its options add.
    rows = [(None, None, ""), ("mari", "b", ""), ("mari", "b", "rho=0.7,labels=source"), ("mari", "b", "gate=false"),
            ("mari", "b", "probe_alpha=0.1"), ("mari", "b", "experts=single"), ("mari", "c", "labels=flip"),
            ("caa", "v", ""), ("caa", "v", "scale=2")]  # another method's options change its edit: priced again
    per_row = costs.row_variants(rows)
    assert per_row == [1, 6, 0, 0, 1, 1, 6, 1, 1]
    monkeypatch.setitem(costs.EMBEDDED_PARAMETERS, "m", 10**9)
    size = costs.TaskSize(documents=10, prompt=100, requests=4, option=5, generation=False)
    methods = [method for method, _, _ in rows]
    assert costs.evaluation_flops("m", size, methods, None, per_row=per_row) == 2e9 * 10 * (100 + 4 * 5 * 17)
    assert costs.evaluation_flops("m", size, methods, None) == 2e9 * 10 * (100 + 4 * 5 * (1 + 6 * 6 + 2))


def test_a_model_larger_than_one_gpu_asks_for_several():
    assert costs.gpus_needed("smollm2-135m-instruct", training=True) == 1
    assert costs.gpus_needed("meta-llama/Llama-2-7b-chat-hf", training=False) == 1
    assert costs.gpus_needed("Qwen/Qwen2.5-32B-Instruct", training=True) == 2  # 61 GiB of weights + 20 GiB of state


def test_the_main_tables_plan_names_every_step_and_its_inputs(tmp_path):
    profile = profiles.PROFILES["smoke"]
    store = cache.Store(tmp_path / "runs")
    methods = ["vanilla", "caa", "mari"]
    graph = main_table.plan(profile, store, methods)
    train = [s for s in graph.steps.values() if s.kind == steps.TRAIN]
    evaluate = [s for s in graph.steps.values() if s.kind == steps.EVALUATE]
    assert len(train) == 2 * 3  # CAA and MARI on three attributes
    assert {s.key.split("-")[0] for s in train} == {"caa", "mari"}
    assert evaluate and all(set(s.needs) <= {t.key for t in train} for s in evaluate)
    assert all(s.needs for s in evaluate)  # every group holds a trained row
    assert not any(s.cached for s in graph.steps.values()) and all(s.seconds > 0 for s in evaluate)
    assert not (tmp_path / "runs").exists()  # planning wrote nothing

    # a bundle stored under its step's name is cached; its step costs nothing
    final, config = store.bundle_target("caa", "truthfulqa", "smollm2-135m-instruct", 0, profile,
                                        {"recipe": "published"})
    tiny_caa().save(final)  # any complete bundle: the cache checks its name's configuration and its files' digests
    (final / "repro_config.json").write_text(json.dumps({**config, "files": cache_digests.bundle_digests(final)}))
    again = main_table.plan(profile, store, methods)
    assert again.steps[final.name].cached and again.steps[final.name].cost == 0
    assert sum(s.cached for s in again.steps.values()) == 1


def test_plan_prints_the_steps_and_runs_nothing(tmp_path, capsys):
    assert main_table.main(["--smoke", "--plan", "--methods", "vanilla,caa", "--runs", str(tmp_path / "runs"),
                            "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "main table, profile smoke" in printed and "0 cached" in printed and "ideal wall time: 1 GPU" in printed
    assert "on 2 CPU cores about " in printed  # a CPU user's time, not only a GPU's (issue 57.6)
    assert not (tmp_path / "runs" / "bundles").exists() and not (tmp_path / "out" / "main_table.json").exists()


def test_every_optional_column_of_the_main_table_is_priced(tmp_path, capsys):
    # The budget profile's default columns (BBQ's ambiguous contexts, XSTest, KL and cross-entropy in and out of
    # source, benign over-refusal) and the others: --plan failed on general_text and bbq_ambig_heldout, which
    # repro/engine/token_counts.json lacked.
    from repro.engine import profiles

    optional = (profiles.TQA_GENERATION + profiles.BBQ_AMBIGUOUS + profiles.XSTEST + profiles.GENERAL_TEXT
                + profiles.BENIGN_TEXT + profiles.BENIGN_REFUSAL)
    assert main_table.main(["--profile", "budget", "--plan", "--methods", "vanilla,caa", "--seeds", "0", "--columns",
                            ",".join(c[0] for c in optional), "--runs", str(tmp_path / "runs"),
                            "--out", str(tmp_path / "out")]) == 0
    assert "main table, profile budget" in capsys.readouterr().out


def test_the_ablation_and_sensitivity_plans_share_the_main_tables_mari_bundles(tmp_path):
    profile = profiles.PROFILES["smoke"]
    store = cache.Store(tmp_path / "runs")
    main = {s.key for s in main_table.plan(profile, store, ["mari"]).steps.values() if s.kind == steps.TRAIN}
    ablation = ablation_table.plan(profile, store)
    trained = {s.key for s in ablation.steps.values() if s.kind == steps.TRAIN}
    # the main table's three bundles (running both trains each once), and the three of the row whose gate is also
    # calibrated on Self-Instruct seed tasks (issue 81.2), trained with that one setting
    requests = {s.key for s in ablation.steps.values() if s.kind == steps.TRAIN and "gate_requests" in s.label}
    assert len(trained) == 6 and trained - requests == main and len(requests) == 3
    evaluations = [s for s in ablation.steps.values() if s.kind == steps.EVALUATE]
    assert evaluations and all(set(s.needs) <= trained for s in evaluations)
    assert any(set(s.needs) & requests for s in evaluations)
    rows = {args for s in evaluations for _, args in s.action.rows}
    assert rows == {"", "gate=false", "experts=single", "labels=flip", "labels=source"}  # Vanilla and EG-MARI: ""

    sweep = sensitivity.points(profile, ks=[1, 4], rhos=[0.8], labellings=["source"], alphas=[0.3], probe_alphas=[0.1])
    assert [(label, trained) for label, trained, _ in sweep] == [
        ("K=1", {"K": 1}), ("K=4", {}), ("rho=0.8, labels=source", {}), ("alpha_probe=0.3", {"alpha_probe": 0.3}),
        ("probe_alpha=0.1 (fixed probe)", {})]  # K = 4 is the default bundle: no retraining
    assert sensitivity.comparisons([1, 2, 4], [0.9, 0.7], ["loss"]) == [
        ("K=2", "K=1"), ("K=4", "K=1"), ("K=4", "K=2"), ("rho=0.9, labels=loss", "rho=0.7, labels=loss")]
    assert sensitivity.comparisons([4], [0.8], ["loss", "source"]) == []  # nothing to pair
    graph = sensitivity.plan(profile, store, sweep)
    train = {s.key: s for s in graph.steps.values() if s.kind == steps.TRAIN}
    assert len(train) == 3 and len(trained & set(train)) == 1  # K=1, alpha_probe=0.3 and the main table's bundle
    assert sorted(s.label.split(" (")[-1] for s in train.values() if "(" in s.label) == ['{"K": 1})',
                                                                                        '{"alpha_probe": 0.3})']
    (tqa,) = [s for s in graph.steps.values() if s.kind == steps.EVALUATE and "truthfulqa" in s.key]
    assert set(tqa.needs) == set(train)
    assert {args for _, args in tqa.action.rows} == {"", "rho=0.8,labels=source", "probe_alpha=0.1"}
    assert not (tmp_path / "runs").exists()  # planning wrote nothing


@pytest.mark.parametrize("script, title", [(ablation_table, "ablation table, profile smoke"),
                                           (sensitivity, "sensitivity, profile smoke"),
                                           (transfer_gsm8k, "gsm8k transfer, profile smoke"),
                                           (baseline_recipes, "baseline recipes, profile smoke"),
                                           (diagnostics, "diagnostics, profile smoke"),
                                           (latency, "latency, profile smoke"),
                                           (figures, "figures, profile smoke")])
def test_every_table_script_plans_and_runs_nothing(script, title, tmp_path, capsys):
    assert script.main(["--smoke", "--plan", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert title in printed and "0 cached" in printed and "ideal wall time: 1 GPU" in printed
    assert not (tmp_path / "runs" / "bundles").exists() and not list((tmp_path / "out").glob("*.json"))


def test_the_other_scripts_plans_read_the_main_tables_bundles(tmp_path):
    profile = profiles.PROFILES["smoke"]
    store = cache.Store(tmp_path / "runs")
    mari = {s.key for s in main_table.plan(profile, store, ["mari"]).steps.values() if s.kind == steps.TRAIN}
    graph = diagnostics.plan(profile, store)
    assert {s.key for s in graph.steps.values() if s.kind == steps.TRAIN} == mari
    evaluations = [s for s in graph.steps.values() if s.kind == steps.EVALUATE]
    own = [s for s in evaluations if s.key.endswith("(each bundle's task)")]
    by_labels = [s for s in evaluations if s.key.endswith("(gate rates per labelling)")]
    gates = [s for s in evaluations if s.key.endswith("(gate open per evaluation set)")]
    assert len(own) + len(by_labels) + len(gates) == len(evaluations)
    assert {args for s in own for _, args in s.action.rows} == {"", "gate=false"}
    assert {args for s in by_labels for _, args in s.action.rows} == {"", "labels=flip", "labels=source"}
    # the gate's open rate on each attribute's test set (issue 81.1): the main table's MARI row, its evaluations
    assert {args for s in gates for _, args in s.action.rows} == {""}
    assert {t for s in gates for t in s.action.tasks} == {"truthfulqa_mc1_heldout", "truthfulqa_mc2_heldout",
                                                          "bbq_disambig_heldout", "sorry_bench_heldout"}
    bbq = [s for s in evaluations if "bbq_disambig_heldout" in s.action.tasks]
    assert len(bbq) == 3  # BBQ in every part, kept apart under their names

    (tqa,) = [s for s in transfer_gsm8k.plan(profile, store).steps.values() if s.kind == steps.TRAIN]
    assert tqa.key in mari and "truthfulqa" in tqa.label
    recipes = baseline_recipes.plan(profile, store, ["caa"])
    assert len([s for s in recipes.steps.values() if s.kind == steps.TRAIN]) == 2  # adapted and published
    published = {s.key for s in main_table.plan(profile, store, ["caa"]).steps.values() if s.kind == steps.TRAIN}
    assert len(published & set(recipes.steps)) == 1  # the main table's TruthfulQA CAA bundle is the published one
    timed = latency.plan(profile, store, latency.rows_of(["caa", "mari"]))
    assert all(s.kind == steps.TRAIN and "sorry_bench" in s.label for s in timed.steps.values())
    table = {s.key for s in main_table.plan(profile, store, ["caa", "mari"]).steps.values() if s.kind == steps.TRAIN}
    assert len(timed.steps) == 2 and set(timed.steps) <= table  # the main table's bundles, CAA's published one
    assert not (tmp_path / "runs").exists()
