"""repro/gpu_bench.py (issue 41) end to end on the CPU at the tiny shape, its renderer, and the shapes.

The benchmark is meant for a GPU at the paper's shapes; here it runs every kind of step
(training with the memory estimate, evaluations of hf and MariLM with and without bundles,
generation with MARI's gate forced closed and open) on a 4-layer random model with tiny
limits, and the renderer writes the tables and the goal table from what it measured.
"""

import json
import math

import pytest

from repro import gpu_bench
from repro.benchmark import gpu_bench_report, random_model

# The published sizes (results/memory.md, counted from the same configurations with their own vocabularies).
PUBLISHED = {"llama2_7b": 6.74e9, "llama3_8b": 8.03e9, "qwen2_5_7b": 7.61e9, "qwen2_5_14b": 14.77e9}
TINY = {"max_train": 4, "max_ctrl": 1, "max_pca": 16, "methods": ["mari", "caa"], "tqa_limit": 2,
        "mmlu_subjects": ["anatomy"], "mmlu_limit": 1, "tasks": ["truthfulqa_mc2", "mmlu"], "gen_prompts": 1,
        "gen_tokens": 3, "max_batch_size": 2, "auto_entries": ["hf", "mari"], "batch_one_first": ["vanilla"],
        "batch_one_late": ["caa"], "shared_entries": ["vanilla", "mari", "caa"]}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_build_the_published_sizes(name):
    shape = random_model.load_shape(name)
    assert "huggingface.co" in shape.source and shape.published_parameters == PUBLISHED[name]
    assert abs(random_model.parameter_count(shape) / PUBLISHED[name] - 1) < 0.02


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        random_model.load_shape("llama9_1t")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return random_model.tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


def test_published_vocabulary_keeps_the_shapes_rows_and_never_emits_them(tokenizer_dir):
    import dataclasses

    import torch

    tokenizer = random_model.load_tokenizer(tokenizer_dir)
    tiny = random_model.load_shape("tiny")
    wide = dataclasses.replace(tiny, config={**tiny.config, "vocab_size": len(tokenizer) + 64})
    assert random_model.vocabulary_size(wide, tokenizer, "tokenizer") == len(tokenizer)
    model = random_model.build(wide, tokenizer, "cpu", torch.float32, vocab="published")
    assert model.config.vocab_size == len(tokenizer) + 64
    assert model.lm_head.weight[len(tokenizer):].abs().sum() == 0
    assert model.lm_head.weight[:len(tokenizer)].abs().sum() > 0
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert int(out.max()) < len(tokenizer)
    with pytest.raises(ValueError, match="choose one of tokenizer, published"):
        random_model.vocabulary_size(wide, tokenizer, "128k")


def _bench(tokenizer_dir, raw, *extra):
    return gpu_bench.main(["--shape", "tiny", "--device", "cpu", "--tokenizer", str(tokenizer_dir), "--raw", str(raw),
                           "--settings", json.dumps(TINY), *extra])


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.e2e  # trains and times every method on a tiny model through the benchmark's steps
@pytest.mark.needs_data
def test_tiny_run_measures_every_step_and_renders(tokenizer_dir, tmp_path):
    raw_path = tmp_path / "raw.json"
    assert _bench(tokenizer_dir, raw_path) == 0
    raw = json.loads(raw_path.read_text())
    assert raw["complete"] and raw["model"]["name"] == "random-weights/tiny" and raw["model"]["dtype"] == "bfloat16"
    assert raw["versions"]["torch"] and raw["shape"]["key"] == "tiny"
    steps = {s["step"]: s for s in raw["steps"]}
    assert [s for s in steps.values() if s["status"] != "done"] == []
    assert {"train/mari", "train/caa", "warm/task_index", "warm/truthfulqa_mc2", "warm/mmlu",
            "eval/truthfulqa_mc2/hf/bsauto", "eval/truthfulqa_mc2/mari/bsauto", "eval/truthfulqa_mc2/vanilla/bs1",
            "eval/truthfulqa_mc2/caa/bs1", "eval/mmlu/hf/bsauto", "eval/mmlu/mari/bsauto", "gen/base",
            "gen/mari_gate_closed", "gen/mari_gate_open", "gen/mari_gate_open_t1",
            "eval-shared/truthfulqa_mc2/vanilla+mari+caa"} == set(steps)
    for name, step in steps.items():
        assert _positive(step["step_s"]), name
        if name.startswith(("train/", "eval/", "gen/")):
            assert _positive(step["wall_s"]), name
        if name.startswith("eval/"):
            assert _positive(step["model_s"]) and step["model_s"] <= step["wall_s"], name
            assert all(isinstance(v, float) for v in step["metrics"].values()), name
    # The repro's path: the three entries' rows of each question computed when the first asks, served to the others.
    joined = steps["eval-shared/truthfulqa_mc2/vanilla+mari+caa"]
    assert joined["entries"] == ["vanilla", "mari", "caa"] and _positive(joined["model_s"])
    assert joined["shared_stats"]["groups"] > 0 and joined["shared_stats"]["served"] == 2 * joined["shared_stats"]["groups"]
    assert joined["shared_stats"].get("on_demand", 0) == 0
    assert steps["eval/truthfulqa_mc2/hf/bsauto"]["batch_sizes_detected"]  # HFLM's auto search ran
    (one,) = steps["eval/truthfulqa_mc2/vanilla/bs1"]["mari_batches"]  # MariLM's batches are recorded
    assert one["questions"] == one["batches"] == 2 and one["largest_batch_questions"] == 1
    memory = steps["train/mari"]["memory"]
    assert _positive(memory["held_estimate_bytes"]) and memory["estimate_bytes"] > memory["weights_bytes"] > 0
    assert memory["peak_allocated_bytes"] is None  # GPU memory only
    gates = {mode: steps[f"gen/{mode}"] for mode in ("base", "mari_gate_closed", "mari_gate_open", "mari_gate_open_t1")}
    assert gates["mari_gate_closed"]["gate_rate"] == 0.0 and gates["mari_gate_open"]["gate_rate"] == 1.0
    assert gates["mari_gate_open_t1"]["gate_rate"] == 1.0 and gates["base"]["T_ent"] is None
    assert (gates["mari_gate_open"]["T_ent"], gates["mari_gate_open_t1"]["T_ent"]) == (8, 1)  # the bundle's; T_ent=1
    for gen in gates.values():
        assert gen["tokens_produced"] == [3] and _positive(gen["first_token_s"]) and _positive(gen["tokens_per_s"])

    out = tmp_path / "results"
    assert gpu_bench.main(["--render", str(raw_path), "--out", str(out)]) == 0
    rendered = json.loads((out / "gpu_bench.json").read_text(), parse_constant=pytest.fail)  # strict JSON
    goals = {g["goal"]: g for g in rendered["derived"]["goals"]}
    assert len(goals) == 7 and goals["vanilla (MariLM, no bundle) wall time vs hf"]["reached"] in ("yes", "no")
    assert goals["training (MARI, ReFT, LoRA): peak GPU memory / estimate"]["reached"] == "not measured"
    first = next(g for g in rendered["derived"]["generation"] if g["mode"] == "mari_gate_open")
    assert first["first_token_s_paper_x_base"] == pytest.approx(43.53 / 22.12)  # Table 4's MARI / Base Model
    assert first["first_token_s_x_base"] == pytest.approx(gates["mari_gate_open"]["first_token_s"]
                                                          / gates["base"]["first_token_s"])  # its own run's base
    assert goals["the same, routing over T_ent = 1 greedy step (T_ent=1) instead of the bundle's 8"]["reached"] != \
        "not measured"
    md = (out / "gpu_bench.md").read_text()
    for heading in ("## Goals", "## Evaluation wall time", "## The repro's evaluation path", "## Training",
                    "## Training memory", "## Generation"):
        assert heading in md
    assert "Issue 41's goals are set for the 7B shape" in md

    # repro/engine/costs.py priced against the same run's steps (issue 59.4)
    from repro.benchmark import cost_check

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "run1.json").write_text(raw_path.read_text())
    assert cost_check.main(["--runs", str(runs), "--out", str(out), "--calibration-runs", "run1.json"]) == 0
    checked = json.loads((out / "cost_check.json").read_text(), parse_constant=pytest.fail)
    rows = checked["runs"][0]["steps"]
    assert {"train mari", "train caa", "evaluate truthfulqa_mc2 (batch auto)", "evaluate mmlu (batch auto)",
            "evaluate truthfulqa_mc2 (shared pass, 3 rows)", "generate one prompt (base)"} <= {r["kind"] for r in rows}
    assert checked["derived"]["evaluate_from"] == "the shared pass's steps"  # the repro's own path, once timed
    assert not any("/hf/" in r["step"] for r in rows)  # lm-eval's own model is not what costs.py prices
    for r in rows:
        assert r["estimated_s"] > 0 and r["ratio"] == pytest.approx(r["measured_s"] / r["estimated_s"])
    assert "| train mari" in (out / "cost_check.md").read_text()


@pytest.mark.needs_data
def test_steps_past_the_deadline_are_skipped_and_still_render(tokenizer_dir, tmp_path):
    raw_path = tmp_path / "raw.json"
    assert _bench(tokenizer_dir, raw_path, "--deadline-s", "0") == 0
    raw = json.loads(raw_path.read_text())
    assert raw["complete"] and raw["steps"]
    assert all(s["status"] == "skipped" and s["reason"] in ("deadline 0 s", "no mari bundle", "no caa bundle",
                                                            "no mari, caa bundle") for s in raw["steps"])
    derived = gpu_bench_report.derive(raw)
    assert {g["reached"] for g in derived["goals"]} == {"not measured"}
    assert "## Steps not done" in gpu_bench_report.markdown(raw, derived)


def test_runs_merge_into_one_record_with_each_step_counted_once():
    step = lambda name, status, **rest: {"step": name, "status": status, **rest}
    run = lambda steps: {"command": "c", "started": "t", "device": "NVIDIA H200", "steps": steps}
    first = run([step("eval/a/hf/bsauto", "done"), step("eval/b/hf/bsauto", "skipped", reason="deadline"),
                 step("eval/c/hf/bsauto", "skipped", reason="deadline 1")])
    second = run([step("eval/b/hf/bsauto", "done"), step("eval/c/hf/bsauto", "skipped", reason="deadline 2")])
    merged = gpu_bench_report.merge([first, second])
    assert [(s["run"], s["step"], s["status"]) for s in merged["steps"]] == [
        (1, "eval/a/hf/bsauto", "done"), (2, "eval/b/hf/bsauto", "done"), (2, "eval/c/hf/bsauto", "skipped")]
    assert [r["run"] for r in merged["runs"]] == [1, 2]
    with pytest.raises(ValueError, match="different devices"):
        gpu_bench_report.merge([first, {**second, "device": "NVIDIA H100"}])


def test_memory_marks_split_the_peak_into_held_state_preparation_and_a_training_step():
    gib = 2**30
    mark = lambda at, allocated, peak: {"at": at, "allocated_bytes": allocated * gib, "peak_so_far_bytes": peak * gib}
    memory = {"allocated_before_bytes": 10 * gib, "held_estimate_bytes": 2 * gib,
              "marks": [mark("prepare 4 examples", 10, 10), mark("experts start", 12.5, 13), mark("experts end", 12.5, 15)]}
    stages = gpu_bench_report.memory_stages(memory)
    assert stages == {"held_measured_bytes": 2.5 * gib, "held_measured_over_estimate": 1.25, "prepare_peak_bytes": 13 * gib,
                      "training_step_above_held_bytes": 2.5 * gib}
    memory["marks"][-1] = mark("experts end", 12.5, 13)  # the steps stayed below the peak while preparing
    assert gpu_bench_report.memory_stages(memory)["training_step_above_held_bytes"] is None
    assert gpu_bench_report.memory_stages({**memory, "marks": []}) == {}  # no marks off CUDA
