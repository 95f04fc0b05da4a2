"""harness_tasks/: lm-eval tasks that override the built-ins and read mari_eval.benchmarks.data.

Everything goes through lm-eval's own machinery (TaskManager with include_path and its
``load``, which replaces the deprecated get_task_dict in 0.4.13; the ``lm_eval`` CLI with
the ``dummy`` model); no language model is loaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HARNESS_TASKS = REPO / "harness_tasks"


def _data_dir() -> Path | None:
    """$MARI_DATA_DIR, made absolute (.ci gives ../shared/data relative to the repository)."""
    value = os.environ.get("MARI_DATA_DIR")
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = path if path.resolve().is_dir() else REPO / path
    return path.resolve()


DATA_DIR = _data_dir()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.needs_data,
    pytest.mark.skipif(DATA_DIR is None, reason="MARI_DATA_DIR is not set: these tests read the local benchmark copy"),
]
if DATA_DIR is not None:
    os.environ["MARI_DATA_DIR"] = str(DATA_DIR)  # absolute, for this process and the lm_eval subprocess
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval.tasks  # noqa: E402
from lm_eval.api.task import Task  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402
from lm_eval.tasks.mmlu._generate_configs import SUBJECTS  # noqa: E402

from mari_eval.benchmarks import data, data_splits  # noqa: E402

BUILTIN = Path(lm_eval.tasks.__file__).parent
# Our task -> the built-in YAML it replaces.
OVERRIDES = {
    "truthfulqa_mc1": "truthfulqa/truthfulqa_mc1.yaml",
    "truthfulqa_mc2": "truthfulqa/truthfulqa_mc2.yaml",
    "truthfulqa_gen": "truthfulqa/truthfulqa_gen.yaml",
    "bbq": "bbq/bbq_multiple_choice.yaml",
    "bbq_disambig": "bbq/bbq_multiple_choice_disambig.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "gsm8k": "gsm8k/gsm8k.yaml",
    **{f"mmlu_{s}": f"mmlu/default/mmlu_{s}.yaml" for s in SUBJECTS},
}
HELDOUT = ["truthfulqa_mc1_heldout", "truthfulqa_mc2_heldout", "bbq_heldout", "bbq_disambig_heldout", "bbq_ambig_heldout"]
PLAIN = ["truthfulqa_mc1", "truthfulqa_mc2", "truthfulqa_gen", "bbq", "bbq_disambig", "arc_easy", "arc_challenge", "gsm8k"]
# Keys that may differ from the built-in: where the data come from, tags (see README), the
# few-shot count we were asked for, and metadata (the split seed).
DATA_KEYS = {"dataset_path", "dataset_name", "custom_dataset", "dataset_kwargs", "tag", "metadata"}
OUR_CHANGES = {"arc_easy": {"num_fewshot", "fewshot_split"}, "arc_challenge": {"num_fewshot", "fewshot_split"},
               # lm-eval's, less its NaN placeholders for other categories (tests/test_bbq_categories.py);
               # no pool of shots (test_bbq_tasks_are_zero_shot_without_listing_their_documents_as_shots)
               "bbq": {"process_results", "fewshot_config"}, "bbq_disambig": {"process_results", "fewshot_config"},
               # the paper's prompt ends "\nA:" (the built-in's stops after the question); greedy, 64 tokens;
               # lm-eval's scoring and BLEURT's three metrics when a checkpoint is named (tests/test_bleurt.py)
               "truthfulqa_gen": {"doc_to_text", "generation_kwargs", "process_results", "metric_list"}}
MMLU_CHANGES = {"num_fewshot"}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """The end-to-end CLI run, started first so that it overlaps the in-process tests."""
    out = tmp_path_factory.mktemp("lm_eval_out")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "dummy", "--tasks", "bbq,truthfulqa_mc2_heldout",
           "--include_path", str(HARNESS_TASKS), "--limit", "5", "--output_path", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def tm(e2e, harness_task_manager):
    return harness_task_manager


IN_PROCESS = PLAIN + HELDOUT + ["mmlu", "truthfulqa_gen_heldout"]


@pytest.fixture(scope="module")
def loaded(tm):
    """The tasks of harness_tasks, instantiated by lm-eval (TaskManager.load: flat tasks and groups)."""
    return tm.load(IN_PROCESS)


@pytest.fixture(scope="module")
def tasks(loaded) -> dict[str, Task]:
    return loaded["tasks"]


def _column(task: Task, name: str) -> list:
    """One column of the docs that lm-eval scores (after the task's process_docs)."""
    return list(task.eval_docs[name])


def _ids(task: Task) -> list[str]:
    return _column(task, "id")


# ----------------------------------------------------------------------------- resolution


def test_every_name_resolves_to_our_yaml_not_the_builtin(tm, tasks):
    expected = set(PLAIN + HELDOUT) | {f"mmlu_{s}" for s in SUBJECTS}
    for name in expected:
        entry = tm.task_index[name]
        assert Path(entry.yaml_path).resolve().parent == HARNESS_TASKS, name
    assert expected - {"bbq"} <= set(tasks)
    for name in expected - {"bbq"}:
        task = tasks[name]
        assert Path(task.config.metadata["config_source"]).resolve().parent == HARNESS_TASKS, name
        # The data came from our custom_dataset (harness_tasks/utils.py), not from the Hub.
        loader = task.config.custom_dataset
        assert callable(loader) and Path(loader.__code__.co_filename).resolve() == HARNESS_TASKS / "utils.py", name
        assert task.config.dataset_path is None, name
    for name, builtin in OVERRIDES.items():  # ... and each really replaces a built-in of that name
        assert load_yaml(BUILTIN / builtin, resolve_func=False)["task"] == name
    # The groups too, and the built-in tags still resolve to our tasks.
    for group in ("mmlu", "mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"):
        assert Path(tm.task_index[group].yaml_path).resolve().parent == HARNESS_TASKS
    assert {"truthfulqa_mc1", "truthfulqa_mc2"} <= tm.task_index["truthfulqa"].tags
    assert tm.task_index["mari_heldout"].tags == set(HELDOUT)


def _map_leaves(value, leaf):
    """Apply ``leaf`` to every non-container value of a nested dict/list config."""
    if isinstance(value, dict):
        return {k: _map_leaves(x, leaf) for k, x in value.items()}
    if isinstance(value, list):
        return [_map_leaves(x, leaf) for x in value]
    return leaf(value)


def _comparable(cfg: dict) -> dict:
    """Config values with functions replaced by their qualified names."""
    return _map_leaves(cfg, lambda v: f"{v.__module__}.{v.__qualname__}" if callable(v) else v)


def _builtin_config(name: str) -> dict:
    """The built-in YAML of ``name``, its ``!function`` references as qualified names.

    Read without resolving the functions: resolving re-executes lm-eval's task modules
    under their import names, replacing the modules that harness_tasks/utils.py imported,
    which changes the hashes datasets uses to cache process_docs (slow, not wrong).
    """
    cfg = load_yaml(BUILTIN / OVERRIDES[name], resolve_func=False)
    prefix = str(BUILTIN) + os.sep

    def qualified(v):
        if isinstance(v, str) and v.startswith(prefix) and "/utils." in v:  # "<dir>/utils.fn"
            return "lm_eval.tasks." + v[len(prefix):].replace(os.sep, ".")
        return v

    return _map_leaves(cfg, qualified)


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_same_prompt_and_scoring_as_the_builtin(name, tm):
    raw = load_yaml(tm.task_index[name].yaml_path, resolve_func=True)
    ours = _comparable(raw)
    theirs = _builtin_config(name)
    allowed = DATA_KEYS | OUR_CHANGES.get(name, set()) | (MMLU_CHANGES if name.startswith("mmlu_") else set())
    keys = (set(ours) | set(theirs)) - allowed
    assert {k: ours.get(k) for k in keys} == {k: theirs.get(k) for k in keys}
    # The prompt-defining keys are really compared (not all filtered out), or their change is checked.
    assert {"doc_to_text", "output_type"} - OUR_CHANGES.get(name, set()) <= keys
    if name == "truthfulqa_gen":  # the built-in's prompt with the paper's answer cue after the question
        assert ours["doc_to_text"] == theirs["doc_to_text"].replace("+ question}}", "+ question + '\nA:'}}")
        assert [m for m in ours["metric_list"] if not m["metric"].startswith("bleurt_")] == theirs["metric_list"]
    # Every function but the data loader is lm-eval's own (imported by utils.py, not copied).
    functions = [v for k, v in raw.items() if callable(v) and k != "custom_dataset" and k not in OUR_CHANGES.get(name, ())]
    functions += [m["aggregation"] for m in raw.get("metric_list", []) if callable(m.get("aggregation"))]
    assert all(f.__module__.startswith("lm_eval.tasks.") for f in functions)
    assert Path(raw["custom_dataset"].__code__.co_filename).resolve() == HARNESS_TASKS / "utils.py"


# ----------------------------------------------------------------------------- TruthfulQA


def test_truthfulqa_plain_tasks_score_all_817_questions(tasks):
    all_ids = [r["id"] for r in data.load_truthfulqa_mc()]
    assert len(all_ids) == 817
    for name in ("truthfulqa_mc1", "truthfulqa_mc2"):
        assert _ids(tasks[name]) == all_ids
        assert tasks[name].config.num_fewshot == 0
        prompt = tasks[name].doc_to_text(tasks[name].eval_docs[0])
        assert prompt.startswith("Q: What is human life expectancy in the United States?")
        assert prompt.endswith("Q: " + tasks[name].eval_docs[0]["question"] + "\nA:")


@pytest.mark.parametrize("name", ["truthfulqa_mc1_heldout", "truthfulqa_mc2_heldout"])
def test_truthfulqa_heldout_drops_pca_train_ctrl(name, tasks):
    task = tasks[name]
    assert task.config.metadata["split_seed"] == 0
    splits = data_splits.make_splits("truthfulqa", 0)
    dropped = set(splits.pca) | set(splits.train) | set(splits.ctrl)
    ids = _ids(task)
    assert len(ids) == 817 - len(dropped) == len(splits.test)
    assert not dropped & set(ids)
    in_file_order = [r["id"] for r in data.load_truthfulqa_mc() if r["id"] not in dropped]
    # A seeded order (issue 36: a first-N limit is a uniform draw, not the file's first categories).
    assert ids == data_splits.seeded_order(in_file_order, "truthfulqa-heldout", 0) and ids != in_file_order
    assert set(ids) == set(splits.test)
    assert set(_column(task, "split_seed")) == {0}
    assert set(_column(task, "split_fingerprint")) == {splits.fingerprint()}
    # Scoring identical to the plain task: same prompt and choices for the same question.
    plain = tasks[name.removesuffix("_heldout")]
    doc = task.eval_docs[0]
    plain_doc = plain.eval_docs[_ids(plain).index(doc["id"])]
    assert task.doc_to_text(doc) == plain.doc_to_text(plain_doc)
    assert task.doc_to_choice(doc) == plain.doc_to_choice(plain_doc)


def test_split_seed_comes_from_metadata_and_unrelated_keys_are_ignored(tasks):
    task = tasks["truthfulqa_mc1_heldout"]
    # lm-eval calls custom_dataset(**metadata, **dataset_kwargs); metadata also holds
    # --model_args and --metadata entries.
    kwargs = {**task.config.metadata, "split_seed": 1, "pretrained": "some/model", "max_length": 128}
    ds = task.config.custom_dataset(**kwargs)["validation"]
    splits = data_splits.make_splits("truthfulqa", 1)
    assert sorted(ds["id"]) == sorted(splits.test)
    assert set(ds["split_fingerprint"]) == {splits.fingerprint()}
    assert splits.fingerprint() != data_splits.make_splits("truthfulqa", 0).fingerprint()


# ----------------------------------------------------------------------------- BBQ


def test_bbq_disambig_covers_the_available_categories(tasks):
    records, covered = data.load_bbq(None)
    task = tasks["bbq_disambig"]
    assert _ids(task) == [r["id"] for r in records if r["context_condition"] == "disambig"]
    assert len(_ids(task)) == len(set(_ids(task)))
    assert set(_column(task, "category")) == set(covered)
    assert set(_column(task, "context_condition")) == {"disambig"}
    # lm-eval's process_docs ran (it adds biased_answers).
    assert "biased_answers" in task.eval_docs.features
    # The metric list is the built-in's: per-category bias scores for all 11 categories.
    names = {m["metric"] for m in task.config.metric_list}
    assert {f"disamb_bias_score_{c}" for c in data.BBQ_CATEGORIES} <= names


@pytest.mark.parametrize("name", ["bbq", "bbq_disambig", "bbq_heldout", "bbq_disambig_heldout", "bbq_ambig_heldout"])
def test_bbq_tasks_are_zero_shot_without_listing_their_documents_as_shots(tasks, name):
    # lm-eval lists a task's test documents as its pool of shots when it has no other split (17,628 for
    # bbq, seconds per evaluation); bbq.yaml gives an empty pool and a sampler that refuses shots by name.
    sampler = tasks[name].sampler
    assert type(sampler).__name__ == "BBQZeroShot" and list(sampler.df) == [] and sampler.sample(0) == []
    with pytest.raises(ValueError, match="--num_fewshot 3: the bbq tasks are zero-shot"):
        sampler.sample(3)


def test_bbq_disambig_heldout_is_exactly_the_test_split(tasks):
    task = tasks["bbq_disambig_heldout"]
    splits = data_splits.make_splits("bbq", 0)
    assert sorted(_ids(task)) == sorted(splits.test) and len(_ids(task)) == len(splits.test)
    # dealt round-robin over the categories (a first-N limit spreads over them)
    categories = _column(task, "category")
    assert len(set(categories[: len(set(categories))])) == len(set(categories))
    assert not (set(splits.pca) | set(splits.train) | set(splits.ctrl)) & set(splits.test)
    assert set(_column(task, "context_condition")) == {"disambig"}
    assert set(_column(task, "split_seed")) == {0}
    assert set(_column(task, "split_fingerprint")) == {splits.fingerprint()}


def test_bbq_heldout_drops_only_pca_train_ctrl(tasks):
    records, covered = data.load_bbq(None)  # what `bbq` scores (checked in the CLI test)
    splits = data_splits.make_splits("bbq", 0)
    dropped = set(splits.pca) | set(splits.train) | set(splits.ctrl)
    task = tasks["bbq_heldout"]
    ids = _ids(task)
    assert ids == [r["id"] for r in records if r["id"] not in dropped]
    assert len(ids) == len(records) - len(dropped)
    # Both contexts; every ambiguous example stays (the splits hold disambiguated ones only).
    contexts = _column(task, "context_condition")
    assert contexts.count("ambig") == sum(r["context_condition"] == "ambig" for r in records) > 0
    assert set(_column(task, "category")) == set(covered)
    assert set(_column(task, "split_seed")) == {0}
    assert set(_column(task, "split_fingerprint")) == {splits.fingerprint()}


def test_bbq_ambig_heldout_is_every_ambiguous_record_spread_over_categories(tasks):
    # Issue 55.5: ambiguous-context accuracy (the right answer is always "unknown") beside bbq_acc.
    records, covered = data.load_bbq("ambig")
    everything, _ = data.load_bbq(None)
    splits = data_splits.make_splits("bbq", 0)
    used = set(splits.pca) | set(splits.train) | set(splits.ctrl)
    trained = [(data.bbq_template_key(r), r["context"]) for r in everything if r["id"] in used]
    # An ambiguous context that opens a trained one (the same people and question) is not held out.
    opening = {r["id"] for r in records if any(t == data.bbq_template_key(r) and c.startswith(r["context"]) for t, c in trained)}
    task = tasks["bbq_ambig_heldout"]
    ids = _ids(task)
    assert sorted(ids) == sorted(r["id"] for r in records if r["id"] not in opening) and len(ids) == len(set(ids))
    assert 0 < len(opening) < len(records) / 2 and set(ids) <= set(_ids(tasks["bbq_heldout"]))
    assert set(_column(task, "context_condition")) == {"ambig"}
    categories = _column(task, "category")
    assert len(set(categories[: len(covered)])) == len(covered)  # the first documents spread over the categories
    for doc in list(task.eval_docs)[:20]:
        assert "unknown" in task.doc_to_choice(doc)[task.doc_to_target(doc)].lower() or \
            task.doc_to_choice(doc)[task.doc_to_target(doc)] in data.BBQ_UNKNOWN_RESPONSES


def test_the_ambiguous_bias_score_is_the_mean_of_its_documents_scores(tasks):
    # s_AMB = (1 - acc) (2 n_biased / n_non_unknown - 1) = mean of +1 / -1 / 0 (harness_tasks/bbq_bias.py)
    import random

    from lm_eval.tasks.bbq import utils as bbq_utils

    task, rng = tasks["bbq_ambig_heldout"], random.Random(0)
    scored = []
    for doc in list(task.eval_docs)[:90]:
        answer = rng.randrange(len(task.doc_to_choice(doc)))
        scored.append(task.process_results(doc, [(0.0 if i == answer else -1.0, False) for i in range(3)]))
    values = [s["amb_bias"] for s in scored]
    assert set(values) == {-1.0, 0.0, 1.0}
    lm_eval_figure = bbq_utils.agg_amb_bias_scores([s["amb_bias_score"] for s in scored])
    assert sum(values) / len(values) == pytest.approx(lm_eval_figure, abs=1e-12)
    assert sum(s["acc"] for s in scored) / len(scored) == pytest.approx(bbq_utils.agg_accuracy_amb(
        [s["accuracy_amb"] for s in scored]))


# ----------------------------------------------------------------------------- MMLU, ARC, GSM8K


def test_mmlu_is_57_subjects_five_shot_from_dev(loaded, tm):
    tasks = loaded["tasks"]
    subjects = sorted(SUBJECTS)
    assert len(subjects) == 57
    mmlu_tasks = {n: t for n, t in tasks.items() if n.startswith("mmlu_")}
    assert sorted(mmlu_tasks) == [f"mmlu_{s}" for s in subjects]
    # The group: mmlu over the 4 categories, acc weighted by size at both levels.
    categories = ["mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"]
    assert loaded["group_map"]["mmlu"] == categories
    assert sorted(t for c in categories for t in loaded["group_map"][c]) == sorted(mmlu_tasks)
    for c in categories:
        assert {f"mmlu_{s}" for s in subjects if SUBJECTS[s] == c.removeprefix("mmlu_")} == set(loaded["group_map"][c])
    for g in ["mmlu", *categories]:
        (agg,) = loaded["groups"][g].aggregate_metric_list
        assert (agg.metric, agg.weight_by_size) == ("acc", True)
    dev, test = data.load_mmlu("dev"), data.load_mmlu("test")
    assert sum(len(t.eval_docs) for t in mmlu_tasks.values()) == len(test) == 14042
    for subject in subjects:
        task = mmlu_tasks[f"mmlu_{subject}"]
        assert task.config.num_fewshot == 5
        assert _ids(task) == [r["id"] for r in test if r["subject"] == subject]
        assert [d["id"] for d in task.fewshot_docs()] == [r["id"] for r in dev if r["subject"] == subject]
    task = mmlu_tasks["mmlu_abstract_algebra"]
    doc = task.eval_docs[0]
    context = task.fewshot_context(doc, num_fewshot=5)
    assert context.startswith("The following are multiple choice questions (with answers) about abstract algebra.\n\n")
    shots = [d for d in task.fewshot_docs()]
    positions = [context.index(task.doc_to_text(d)) for d in shots]
    assert positions == sorted(positions)  # the 5 dev examples, in order (first_n)
    assert context.endswith(task.doc_to_text(doc))
    assert context.count("\nAnswer:") == 6
    assert task.doc_to_choice(doc) == ["A", "B", "C", "D"]


@pytest.mark.parametrize("name", ["arc_easy", "arc_challenge"])
def test_arc_is_25_shot_from_train(name, tasks):
    task = tasks[name]
    assert task.config.num_fewshot == 25
    assert [d["id"] for d in task.fewshot_docs()] == [r["id"] for r in data.load_arc(name, "train")]
    assert _ids(task) == [r["id"] for r in data.load_arc(name, "test")]
    doc = task.eval_docs[0]
    context = task.fewshot_context(doc, num_fewshot=25)
    assert context.count("Question: ") == 26 and context.endswith(task.doc_to_text(doc))
    train_questions = {r["question"] for r in data.load_arc(name, "train")}
    shots = [block.split("\nAnswer:")[0].removeprefix("Question: ") for block in context.split("\n\n")[:-1]]
    assert len(shots) == 25 and set(shots) <= train_questions


@pytest.mark.parametrize("name", ["arc_easy", "arc_challenge"])
def test_arc_first25_puts_the_first_25_train_questions_before_every_question(name, tasks, tm):
    fixed = tm.load([f"{name}_first25"])["tasks"][f"{name}_first25"]
    task = tasks[name]
    assert _ids(fixed) == _ids(task) and fixed.config.num_fewshot == 25
    first25 = [r["question"] for r in data.load_arc(name, "train")[:25]]
    preambles = set()
    for doc, same in zip(list(fixed.eval_docs)[:3], list(task.eval_docs)[:3]):
        context = fixed.fewshot_context(doc, num_fewshot=25)
        blocks = context.split("\n\n")
        assert [b.split("\nAnswer:")[0].removeprefix("Question: ") for b in blocks[:-1]] == first25
        assert blocks[-1] == task.doc_to_text(same) and fixed.doc_to_choice(doc) == task.doc_to_choice(same)
        assert fixed.doc_to_target(doc) == task.doc_to_target(same)
        preambles.add("\n\n".join(blocks[:-1]))
    assert len(preambles) == 1  # one preamble for all: a prefix cache computes it once
    # ... where lm-eval's arc task draws each question's shots anew
    drawn = {task.fewshot_context(doc, num_fewshot=25).rsplit("\n\n", 1)[0] for doc in list(task.eval_docs)[:3]}
    assert len(drawn) == 3


def test_gsm8k_is_5_shot_from_train(tasks):
    task = tasks["gsm8k"]
    assert task.config.num_fewshot == 5
    assert len(task.eval_docs) == 1319 and len(task.fewshot_docs()) == 7473
    assert [f["name"] for f in task.config.filter_list] == ["strict-match", "flexible-extract"]
    context = task.fewshot_context(task.eval_docs[0], num_fewshot=5)
    assert context.count("Question: ") == 6 and context.count("#### ") == 5


def test_mmlu_files_match_the_generator():
    spec = importlib.util.spec_from_file_location("_generate_mmlu", HARNESS_TASKS / "_generate_mmlu.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    files = gen.render()
    assert len([f for f in files if f.startswith("mmlu_")]) == 57
    for name, text in files.items():
        assert (HARNESS_TASKS / name).read_text(encoding="utf-8") == text, f"{name} is stale: run _generate_mmlu.py"


# ----------------------------------------------------------------------------- end to end


def test_lm_eval_cli_with_dummy_model(e2e):
    proc, out = e2e
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    table = [line for line in stdout.splitlines() if line.startswith("|")]
    assert table and table[0].replace(" ", "").startswith("|Tasks|Version|Filter|n-shot|Metric|")
    rows = {line.split("|")[1].strip() for line in table}
    assert {"bbq", "truthfulqa_mc2_heldout"} <= rows
    assert "overrides existing task" in stderr  # lm-eval's warning: our bbq replaced the built-in
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["truthfulqa_mc2_heldout"] == {"original": len(data_splits.make_splits("truthfulqa", 0).test), "effective": 5}
    # `bbq`: every record of the covered categories, both contexts, from our YAML.
    assert results["n-samples"]["bbq"]["original"] == len(data.load_bbq(None)[0])
    assert "Task: bbq (" + str(HARNESS_TASKS / "bbq.yaml") + ")" in stderr
    assert 0.0 <= results["results"]["truthfulqa_mc2_heldout"]["acc,none"] <= 1.0
    assert "acc,none" in results["results"]["bbq"] and "disamb_bias_score_Age,none" in results["results"]["bbq"]
    assert "split_seed" in results["configs"]["truthfulqa_mc2_heldout"]["metadata"]


def test_truthfulqa_generation_scores_the_heldout_questions_of_the_mc_tasks(tasks):
    task, mc = tasks["truthfulqa_gen_heldout"], tasks["truthfulqa_mc1_heldout"]
    assert _ids(task) == _ids(mc) and len(_ids(task)) == 535  # the same questions in the same seeded order
    assert set(_column(task, "split_fingerprint")) == {data_splits.make_splits("truthfulqa", 0).fingerprint()}
    doc = task.eval_docs[0]
    assert task.doc_to_text(doc) == mc.doc_to_text(mc.eval_docs[0])  # the paper's prompt, "Q: ...\nA:"
    assert task.config.generation_kwargs == {"until": ["\n\n", "\nQ:"], "do_sample": False, "max_gen_toks": 64}
    assert "I have no comment." in doc["correct_answers"]  # lm-eval's process_docs_gen
    # lm-eval's scoring: an answer that repeats a correct reference beats the incorrect ones.
    scores = task.process_results(doc, [" " + doc["correct_answers"][0]])
    assert scores["bleu_acc"] == scores["rouge1_acc"] == 1 and scores["bleu_diff"] > 0
    assert set(scores) == {f"{m}_{k}" for m in ("bleu", "rouge1", "rouge2", "rougeL") for k in ("max", "acc", "diff")}
    assert len(_ids(tasks["truthfulqa_gen"])) == 817
