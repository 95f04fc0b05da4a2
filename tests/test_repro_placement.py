"""The repro scripts' placement flags (--dtype, --device, --device-map): one Placement for
training and evaluation, the profile's defaults, and the dtype in every cache key."""

import argparse
import json
from pathlib import Path

import pytest

from mari_eval.injection.devices import Placement

from repro.engine import cache, cache_keys, command_line, lm_eval_run, profiles

from .helpers import run_repro

pytestmark = pytest.mark.e2e  # subprocesses or lm-eval runs of the embedded model throughout

MODEL = "smollm2-135m-instruct"  # a float32 checkpoint


def _placement(monkeypatch, cuda: bool, *argv: str) -> Placement:
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    parser = argparse.ArgumentParser()
    command_line.add_common_args(parser)
    args = parser.parse_args(argv)
    return command_line.placement_from_args(args, command_line.profile_from_args(args))


@pytest.mark.parametrize("cuda,argv,expected", [
    (True, ["--profile", "paper"], Placement(dtype="bfloat16", device_map="auto")),
    (False, ["--profile", "paper"], Placement()),  # no CUDA: mari-eval train's defaults
    (True, ["--profile", "quick"], Placement()),
    # An explicit flag wins over the profile's default: --dtype over its dtype, --device over its device map.
    (True, ["--profile", "paper", "--dtype", "float32"], Placement(dtype="float32", device_map="auto")),
    (True, ["--profile", "paper", "--dtype", "auto"], Placement(device_map="auto")),
    (True, ["--profile", "paper", "--device", "cuda:1"], Placement(dtype="bfloat16", device="cuda:1")),
    (True, ["--profile", "paper", "--max-memory-per-gpu", "70GiB"],
     Placement(dtype="bfloat16", device_map="auto", max_memory_per_gpu="70GiB")),
    (False, ["--smoke", "--dtype", "float16", "--device", "cpu"], Placement(dtype="float16", device="cpu")),
])
def test_the_paper_profile_runs_in_bf16_over_the_gpus_unless_the_flags_say_otherwise(monkeypatch, cuda, argv, expected):
    assert _placement(monkeypatch, cuda, *argv) == expected


def test_memory_caps_without_a_device_map_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="add --device-map auto"):  # train.Placement's own check
        _placement(monkeypatch, False, "--max-cpu-memory", "10GiB")


def test_every_script_documents_the_flags_and_the_paper_default():
    parser = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter)
    command_line.add_common_args(parser)
    text = " ".join(parser.format_help().split())
    for flag in ("--dtype {auto,float32,bfloat16,float16}", "--device DEVICE", "--device-map {auto}", "--max-memory"):
        assert flag in text
    assert "--profile paper on a machine with CUDA defaults to --dtype bfloat16 --device-map auto" in text
    assert "--dtype bfloat16 --device-map auto" in " ".join(profiles.Profile.__doc__.split())


def test_the_dtype_enters_cache_keys_and_the_default_keeps_the_earlier_keys():
    config = {"kind": "evaluation", "model": MODEL, "task": "truthfulqa_mc1_heldout", "limit": 2}  # as before placements
    keyed = lambda placement, model=MODEL: cache_keys.config_key(cache_keys.with_placement(config, placement, model))
    earlier = cache_keys.config_key(config)
    # dtype auto on a float32 checkpoint computes in float32, as every step cached before the flags did: same key.
    assert cache_keys.resolved_dtype("auto", MODEL) == "float32"
    assert keyed(Placement()) == keyed(Placement(dtype="float32")) == earlier
    # Devices and device maps move results by rounding only: not in the key.
    assert keyed(Placement(dtype="float32", device="cpu")) == earlier
    assert keyed(Placement(device_map="auto", max_cpu_memory="9GiB")) == earlier
    # Another dtype is another key, each its own.
    others = {keyed(Placement(dtype=d)) for d in ("bfloat16", "float16")}
    assert len(others) == 2 and earlier not in others
    # dtype auto that cannot be resolved (a model not on this machine, offline) is keyed apart from float32.
    assert cache_keys.placement_key(Placement(), "no-such-org/no-such-model") == {"dtype": "auto"}


# The configurations every step was cached under before placements existed (repro/engine/cache.py, Store):
# the default placement must keep these keys, so that runs/ stays valid.
# A baseline's key has carried no max_ctrl since issue 22 (only MARI reads D_ctrl).
EARLIER_BUNDLE = {"kind": "bundle", "method": "caa", "attribute": "truthfulqa", "model": MODEL, "seed": 0, "max_train": 4,
                  "max_pca": 24, "hyperparameters": {}}
# The float32 key without a placement entry (the evaluations since per-document scores were kept).
EARLIER_EVALUATION = {"kind": "evaluation", "model": MODEL, "task": "arc_easy", "limit": 2, "bundle": None, "model_args": "",
                      "gen_tokens": None, "documents": cache_keys.DOCUMENTS_VERSION,
                      "tasks": cache_keys.task_fingerprint("arc_easy"),  # its own files since issue 59 (repro.engine.rekey)
                      "split_seed": None}


def test_bundles_are_trained_in_the_placement_and_keyed_by_its_dtype(tmp_path, monkeypatch):
    calls = []

    def train(method, attribute, model, seed, out, **kwargs):  # records its arguments, writes an empty bundle
        calls.append(kwargs)
        Path(out).mkdir(parents=True)
        (Path(out) / "bundle.json").write_text('{"train_seconds": 1.0}')
        return Path(out)

    monkeypatch.setattr("mari_eval.training.train.train", train)
    placements = {"default": Placement(), "float32": Placement(dtype="float32", device="cpu"),
                  "bf16": Placement(dtype="bfloat16"), "bf16 mapped": Placement(dtype="bfloat16", device_map="auto")}
    bundles = {name: cache.Store(tmp_path, placement=p, max_memory="1GiB").bundle("caa", "truthfulqa", MODEL, 0,
                                                                                   profiles.PROFILES["smoke"])
               for name, p in placements.items()}
    assert bundles["default"].name == f"caa-truthfulqa-s0-{cache_keys.config_key(EARLIER_BUNDLE)}"  # the earlier key
    assert bundles["float32"] == bundles["default"] != bundles["bf16"] == bundles["bf16 mapped"]
    # Trained twice (the float32 and the mapped bf16 requests read back the first two), in the placement asked for.
    assert [c["placement"] for c in calls] == [placements["default"], placements["bf16"]]
    assert all(c["max_memory"] == "1GiB" for c in calls)
    recorded = json.loads((bundles["bf16"] / "repro_config.json").read_text())
    assert recorded["placement"] == {"dtype": "bfloat16"} and recorded["placement_used"]["dtype"] == "bfloat16"


def test_evaluations_run_in_the_placement_and_are_keyed_by_its_dtype(tmp_path, monkeypatch):
    calls = []

    def evaluate(model, tasks, limit, bundle, model_args, gen_tokens, split_seed, placement, lm=None):
        calls.append(placement)
        return {t: {"metrics": {}, "n": limit, "seconds": 1.0, "model_dtype": placement.dtype, "documents": {}}
                for t in tasks}

    monkeypatch.setattr(lm_eval_run, "evaluate", evaluate)
    files = {}
    for name, placement in {"default": Placement(), "float32": Placement(dtype="float32"),
                            "bf16": Placement(dtype="bfloat16")}.items():
        cache.Store(tmp_path, placement=placement).evaluations(MODEL, ["arc_easy"], 2)
        files[name] = {p.name for p in (tmp_path / "evaluations").iterdir()} - set().union(*files.values())
    assert files["default"] == {f"arc_easy-{cache_keys.config_key(EARLIER_EVALUATION)}.json"}  # the earlier key
    assert files["float32"] == set() and len(files["bf16"]) == 1  # float32 read back the default's; bf16 its own
    assert calls == [Placement(), Placement(dtype="bfloat16")]


def test_an_edited_task_definition_is_evaluated_again_not_read_back(tmp_path, monkeypatch):
    # The evaluation key holds a hash of the task's files (its YAML, includes, utils.py): an edited
    # prompt or metric is not read back from an evaluation computed under the old one; an edit to
    # another task's files leaves it read back.
    import shutil

    from mari_eval.benchmarks import tasks

    calls = []

    def evaluate(model, task_names, limit, bundle, model_args, gen_tokens, split_seed, placement, lm=None):
        calls.append(list(task_names))
        return {t: {"metrics": {}, "n": limit, "seconds": 1.0, "documents": {}} for t in task_names}

    monkeypatch.setattr(lm_eval_run, "evaluate", evaluate)
    folder = shutil.copytree(tasks.tasks_dir(), tmp_path / "tasks")
    monkeypatch.setattr(cache_keys, "tasks_dir", lambda: folder)
    store = cache.Store(tmp_path / "runs")
    for name, edit in (("arc_easy", ""), ("arc_easy", ""), ("arc_easy", "# a changed prompt\n"),
                       ("arc_easy", "# a changed prompt\n"), ("bbq", "# a changed BBQ prompt\n")):
        if edit:
            (folder / f"{name}.yaml").write_text((folder / f"{name}.yaml").read_text().split("# a changed")[0] + edit)
        cache_keys.task_fingerprint.cache_clear()
        store.evaluations(MODEL, ["arc_easy"], 2)
    cache_keys.task_fingerprint.cache_clear()
    assert calls == [["arc_easy"], ["arc_easy"]]  # once per definition of arc_easy; each repeat read back
    assert len(list((tmp_path / "runs" / "evaluations").glob("arc_easy-*.json"))) == 2
    (folder / "README.md").write_text("prose only")  # not a definition: the key stays
    before = cache_keys.tasks_fingerprint()
    cache_keys.tasks_fingerprint.cache_clear()
    assert cache_keys.tasks_fingerprint() == before
    cache_keys.tasks_fingerprint.cache_clear()


@pytest.mark.needs_data
def test_a_bf16_run_evaluates_in_bf16_and_records_it(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "results"
    # Vanilla on one MMLU question: the cheapest real evaluation (the bundles' placement is tested above).
    run_repro("main_table.py", (runs, out), "--methods", "vanilla", "--columns", "mmlu", "--dtype", "bfloat16")
    record = json.loads((out / "main_table.json").read_text())
    assert record["placement"]["dtype"] == "bfloat16" and record["models"][MODEL]["dtype"] == "bfloat16"
    assert "dtype bfloat16" in (out / "main_table.md").read_text()
    [path] = (runs / "evaluations").glob("*.json")
    stored = json.loads(path.read_text())
    assert stored["model_dtype"] == "bfloat16" and stored["placement_used"]["dtype"] == "bfloat16"  # computed in bf16
    assert stored["config"]["placement"] == {"dtype": "bfloat16"}
    assert path.stem.endswith(cache_keys.config_key(stored["config"]))  # stored under its bf16 configuration's key...
    float32 = {k: v for k, v in stored["config"].items() if k != "placement"}
    assert not path.stem.endswith(cache_keys.config_key(float32))  # ...not the float32 (default) request's


def test_only_the_methods_reading_the_control_set_are_keyed_by_its_size(tmp_path, monkeypatch):
    trained = []

    def train(method, attribute, model, seed, out, **kwargs):  # records what it was asked, writes an empty bundle
        trained.append((method, kwargs["max_ctrl"]))
        Path(out).mkdir(parents=True)
        (Path(out) / "bundle.json").write_text('{"train_seconds": 1.0}')
        return Path(out)

    monkeypatch.setattr("mari_eval.training.train.train", train)
    smoke = profiles.PROFILES["smoke"]
    whole = profiles.Profile(**{**smoke.__dict__, "max_ctrl": None})
    store = cache.Store(tmp_path, max_memory="1GiB")
    names = {(m, p.max_ctrl): store.bundle(m, "truthfulqa", MODEL, 0, p).name for m in ("caa", "mari") for p in (smoke, whole)}
    assert names[("caa", 2)] == names[("caa", None)]  # one CAA bundle: it never reads D_ctrl
    assert names[("mari", 2)] != names[("mari", None)]  # MARI's gate is calibrated on it
    assert trained == [("caa", None), ("mari", 2), ("mari", None)]


def _stored_bundle(runs: Path, name: str, versions: dict) -> None:
    (runs / "bundles" / name).mkdir(parents=True)
    (runs / "bundles" / name / "bundle.json").write_text(json.dumps({"versions": {**versions, "python": "3.11.7"}}))


def test_a_step_cache_stored_under_other_package_versions_is_named_before_any_work(tmp_path, caplog):
    runs, current = tmp_path / "runs", cache_keys._versions()
    older = {**current, "transformers": "5.0.0"}
    for i in range(3):
        _stored_bundle(runs, f"caa-truthfulqa-s{i}-0", older)
    start = lambda: command_line.start("doc", "main_table.py", ["--runs", str(runs), "--out", str(tmp_path / "out")])
    with caplog.at_level("WARNING", logger="repro"):
        start()
    (message,) = [r.getMessage() for r in caplog.records if "computed again" in r.getMessage()]
    assert "3 bundle(s)" in message and "'transformers': '5.0.0'" in message and "pip install 'transformers==5.0.0'" in message
    assert f"'transformers': '{current['transformers']}'" in message and "torch" not in message
    # One bundle under this environment's versions: its steps are read back, nothing to say.
    _stored_bundle(runs, "caa-bbq-s0-0", current)
    caplog.clear()
    with caplog.at_level("WARNING", logger="repro"):
        start()
    assert not [r for r in caplog.records if "computed again" in r.getMessage()]
