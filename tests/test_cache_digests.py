"""A cache that knows its contents (issue 56.1): every bundle and evaluation under --runs records
digests of what it holds; a read-back that does not match recomputes with a warning naming the file,
or stops under --strict-cache; ``repro.recompute`` checks each cell's n, clusters and seeds."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from repro.engine import cache, cache_digests, lm_eval_run, profiles
from tests.tiny import tiny_mari

MODEL = "smollm2-135m-instruct"
SMOKE = profiles.PROFILES["smoke"]


@pytest.fixture
def trained(monkeypatch):
    """``mari_eval.training.train.train`` replaced by writing a small real bundle; the seeds it was called with."""
    seeds = []

    def train(method, attribute, model, seed, out, **kwargs):
        seeds.append(seed)
        return tiny_mari(seed=seed).save(out)

    monkeypatch.setattr("mari_eval.training.train.train", train)
    return seeds


def _add_100_to_a_weight(bundle):
    tensors = load_file(bundle / "weights.safetensors")
    tensors["expert_b"] = tensors["expert_b"].clone()
    tensors["expert_b"][0, 0] += 100
    save_file(tensors, bundle / "weights.safetensors")


def _flip_one_byte(bundle):
    data = bytearray((bundle / "weights.safetensors").read_bytes())
    data[-1] ^= 0x01
    (bundle / "weights.safetensors").write_bytes(bytes(data))


def _edit_a_hyperparameter(bundle):
    config = json.loads((bundle / "bundle.json").read_text())
    config["hyperparameters"]["rank"] = 4  # as an edited multiplier: valid JSON, another bundle
    (bundle / "bundle.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage, file", [(_add_100_to_a_weight, "weights.safetensors"),
                                          (_flip_one_byte, "weights.safetensors"),
                                          (_edit_a_hyperparameter, "bundle.json")])
def test_a_cached_bundle_changed_after_training_is_trained_again_naming_the_file(tmp_path, trained, caplog, damage, file):
    final = cache.Store(tmp_path).bundle("caa", "truthfulqa", MODEL, 0, SMOKE)
    original = (final / file).read_bytes()
    damage(final)
    with caplog.at_level(logging.WARNING, logger="repro"):
        again = cache.Store(tmp_path).bundle("caa", "truthfulqa", MODEL, 0, SMOKE)
    assert again == final and trained == [0, 0]
    assert f"{final.name}/{file} differs from the file trained" in caplog.text
    assert (final / file).read_bytes() == original  # the same configuration trains the same bundle


def test_another_steps_files_copied_beside_a_bundles_record_are_caught(tmp_path, trained, caplog):
    seed0 = cache.Store(tmp_path).bundle("caa", "truthfulqa", MODEL, 0, SMOKE)
    seed1 = cache.Store(tmp_path).bundle("caa", "truthfulqa", MODEL, 1, SMOKE)
    for name in ("bundle.json", "weights.safetensors"):  # the record left as it was
        shutil.copy(seed0 / name, seed1 / name)
    with caplog.at_level(logging.WARNING, logger="repro"):
        cache.Store(tmp_path).bundle("caa", "truthfulqa", MODEL, 1, SMOKE)
    assert trained == [0, 1, 1] and "differs from the file trained" in caplog.text


def test_strict_cache_stops_at_a_damaged_bundle_and_trains_nothing(tmp_path, trained):
    final = cache.Store(tmp_path).bundle("caa", "truthfulqa", MODEL, 0, SMOKE)
    _flip_one_byte(final)
    with pytest.raises(SystemExit, match=rf"{final} is damaged \({final.name}/weights.safetensors differs .*--strict-cache "
                                         "stops here"):
        cache.Store(tmp_path, strict=True).bundle("caa", "truthfulqa", MODEL, 0, SMOKE)
    assert trained == [0]


@pytest.mark.parametrize("removal", [lambda r: r.pop(cache_digests.BUNDLE_FIELD), lambda r: r.update(files=None),
                                     lambda r: r.update(files="ok"), lambda r: r.update(files={})])
def test_a_bundle_whose_digests_were_removed_is_trained_again_and_refused_when_strict(tmp_path, trained, caplog, removal):
    # Issue 83.3: deleting the digests once switched the check off (read back "unverified").
    final = cache.Store(tmp_path).bundle("caa", "truthfulqa", MODEL, 0, SMOKE)
    _add_100_to_a_weight(final)
    record = json.loads((final / "repro_config.json").read_text())
    removal(record)
    (final / "repro_config.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=rf"{final} is damaged \({final.name}/repro_config.json records no digest"):
        cache.Store(tmp_path, strict=True).bundle("caa", "truthfulqa", MODEL, 0, SMOKE)
    assert trained == [0]
    with caplog.at_level(logging.WARNING, logger="repro"):
        assert cache.Store(tmp_path).bundle("caa", "truthfulqa", MODEL, 0, SMOKE) == final
    assert trained == [0, 0] and "records no digest, which every mari-eval since 2026-11-28 writes" in caplog.text
    assert "unverified" not in caplog.text
    assert cache_digests.BUNDLE_FIELD in json.loads((final / "repro_config.json").read_text())  # written again, whole


def test_a_file_where_a_cached_bundle_directory_belongs_is_refused_before_training(tmp_path, trained):
    final, _ = cache.Store(tmp_path).bundle_target("caa", "truthfulqa", MODEL, 0, SMOKE)
    final.parent.mkdir(parents=True)
    final.write_text("not a bundle")
    with pytest.raises(SystemExit, match=rf"{final} is not a bundle directory but a file"):
        cache.Store(tmp_path).bundle("caa", "truthfulqa", MODEL, 0, SMOKE)
    assert trained == [] and final.read_text() == "not a bundle"


@pytest.fixture
def evaluated(monkeypatch):
    calls = []

    def evaluate(model, tasks, limit, bundle, model_args, gen_tokens, split_seed, placement, lm=None):
        calls.append(tasks)
        return {t: {"metrics": {"acc,none": 0.5}, "n": 2, "seconds": 1.0,
                    "documents": {"acc,none": {"0": 0.5, "1": 0.5}}} for t in tasks}

    monkeypatch.setattr(lm_eval_run, "evaluate", evaluate)
    return calls


def test_an_evaluation_with_n_and_a_document_edited_together_is_evaluated_again(tmp_path, evaluated, caplog):
    # n = 1 and one document deleted: the header and documents still agree with each other, and the
    # mean is unchanged; only the digest of what was written tells.
    first = cache.Store(tmp_path).evaluations(MODEL, ["arc_easy"], 2)
    (path,) = (tmp_path / "evaluations").glob("arc_easy-*.json")
    stored = json.loads(path.read_text())
    stored["n"] = 1
    del stored["documents"]["acc,none"]["1"]
    path.write_text(json.dumps(stored))
    with caplog.at_level(logging.WARNING, logger="repro"):
        again = cache.Store(tmp_path).evaluations(MODEL, ["arc_easy"], 2)
    assert evaluated == [["arc_easy"], ["arc_easy"]] and again == first
    assert f"{path} is damaged (its content (metrics, n or per-document scores) differs from what was written" in caplog.text
    path.write_text(json.dumps({**stored, "n": 1}))
    with pytest.raises(SystemExit, match=rf"{path} is damaged .*--strict-cache stops here"):
        cache.Store(tmp_path, strict=True).evaluations(MODEL, ["arc_easy"], 2)
    assert len(evaluated) == 2


@pytest.mark.parametrize("removal", [lambda r: r.pop(cache_digests.EVALUATION_FIELD), lambda r: r.update(digest=None)])
def test_an_evaluation_forged_with_its_digest_removed_is_evaluated_again(tmp_path, evaluated, caplog, removal):
    # Issue 83.3: a figure forged to 50.00 with its digest deleted was read back with one log line.
    first = cache.Store(tmp_path).evaluations(MODEL, ["arc_easy"], 2)
    (path,) = (tmp_path / "evaluations").glob("arc_easy-*.json")
    stored = json.loads(path.read_text())
    stored["metrics"]["acc,none"] = 1.0
    stored["documents"]["acc,none"] = {"0": 1.0, "1": 1.0}  # header and documents agree with each other
    removal(stored)
    path.write_text(json.dumps(stored))
    with pytest.raises(SystemExit, match=rf"{path} is damaged \(it records no digest.*--strict-cache stops here"):
        cache.Store(tmp_path, strict=True).evaluations(MODEL, ["arc_easy"], 2)
    with caplog.at_level(logging.WARNING, logger="repro"):
        again = cache.Store(tmp_path).evaluations(MODEL, ["arc_easy"], 2)
    assert evaluated == [["arc_easy"], ["arc_easy"]] and again == first
    assert again["arc_easy"]["metrics"]["acc,none"] == 0.5 and "unverified" not in caplog.text


def test_recompute_checks_each_cells_n_against_the_documents(tmp_path):
    from repro import recompute
    from repro.analysis import tables
    from repro.engine.cache import Store
    from mari_eval.injection.devices import Placement

    docs = {f"d{i}": float(i % 2) for i in range(8)}
    cells = {"m": {"Vanilla": {"acc": {"values": [0.5], "n": 8, "documents": [docs], "seeds": [0]}}}}
    profile = profiles.Profile(name="fixed", models=["m"], seeds=[0], max_train={}, max_ctrl=None, limits={})
    tables.write_tables(tmp_path, "t", "T", "Intro.", cells, ["acc"], lambda m: ("P", {}), profile, "cmd", 1.0,
                        Store(tmp_path / "runs", placement=Placement(dtype="float32")))
    assert recompute.main([str(tmp_path / "t")]) == 0
    record = json.loads((tmp_path / "t.json").read_text())
    record["models"]["m"]["rows"][0]["n"]["acc"] = 500
    (tmp_path / "t.json").write_text(json.dumps(record))
    mismatches, _, _ = recompute.recompute(tmp_path / "t_documents.parquet", record)
    assert mismatches == ["m / Vanilla / acc.n: 500 in the JSON, 8 documents in t_documents.parquet (per seed: [8])"]
    record["models"]["m"]["rows"][0]["n"]["acc"] = 8


def test_recompute_refuses_a_seed_named_twice_in_the_documents(tmp_path):
    from repro.analysis import documents_check

    cell = {"documents": [{"a": 1.0}, {"a": 0.0}], "seeds": [0, 0]}
    assert documents_check.header_disagreements("m / r / c", 1, cell, "t_documents.parquet") == [
        "m / r / c.seeds: t_documents.parquet names seeds [0, 0], one of them twice"]
    assert documents_check.header_disagreements("m / r / c", 1, {**cell, "seeds": [0, 1]}, "f") == []


def test_digests_are_of_the_files_written(tmp_path):
    bundle = tiny_mari().save(tmp_path / "b")
    digests = cache_digests.bundle_digests(bundle)
    assert sorted(digests) == ["bundle.json", "weights.safetensors"]
    assert cache_digests.bundle_mismatch(bundle, digests) is None
    (bundle / "extra.txt").write_text("x")
    assert cache_digests.bundle_mismatch(bundle, digests) == "extra.txt was not there at training"
    assert torch.is_tensor(load_file(bundle / "weights.safetensors")["expert_U"])
