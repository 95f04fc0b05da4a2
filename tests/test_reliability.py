"""Bad input gets a clear error, interrupted work resumes, nothing is lost (docs/troubleshooting.md).

One section per kind of failure. Elsewhere: missing data files, bad lines and wrong schemas
(test_data.py), the judge's failures (test_judge.py), kill -9 during repro/main_table.py
(test_repro.py).
"""

import argparse
import gzip
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from mari_eval import mari, methods
from mari_eval.benchmarks import data
from mari_eval.injection import site
from mari_eval.mari import fit as mari_fit
from mari_eval.storage.checkpoint import EpochCheckpoints

from .tiny import tiny_mari
from .tiny import tiny_model
from .tiny import tiny_session
from .tiny import tiny_examples
from .helpers import dead_pid

# ----------------------------------------------------------------------------- bundles


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama")  # hidden size 32, 4 layers


def _saved(tmp_path, bundle):
    return bundle.save(tmp_path / "bundle")


def _renamed(bundle, name):
    bundle.config["base_model"]["name"] = name
    return bundle


@pytest.mark.parametrize("make,message", [
    (lambda: _renamed(tiny_mari(), "other-model"),
     r"trained for 'other-model', not 'tiny' .* pretrained=other-model, retrain it on 'tiny', or, if both names hold the "
     r"same checkpoint, pass allow_other_model=true"),
    (lambda: tiny_mari(d=64),
     r"trained for 'tiny' with hidden size 64 \(this model: 32\); it cannot be applied to 'tiny'\. Load it with pretrained=tiny or retrain"),
    (lambda: tiny_mari(layers=12),
     r"with 12 layers \(this model: 4\)"),
    (lambda: tiny_mari(layer=7),
     r"bundle's site is invalid: Layer 7 is out of range for LlamaForCausalLM with 4 decoder layers.*retrain it"),
])
def test_a_bundle_for_another_model_or_site_is_refused_with_the_fix(tmp_path, tiny, make, message):
    loaded = methods.load_bundle(_saved(tmp_path, make()))
    with pytest.raises(methods.BundleError, match=message):
        loaded.check_compatible(tiny, "tiny")


def test_another_name_for_the_same_checkpoint_is_accepted(tmp_path, tiny, smollm2_path):
    from mari_eval.storage.models import same_model

    bundle = methods.load_bundle(_saved(tmp_path, tiny_mari()))
    bundle.config["base_model"]["name"] = "other-model"
    bundle.check_compatible(tiny, "tiny", allow_other_model=True)
    # The embedded alias and the directory it is materialised into are one model.
    assert same_model("smollm2-135m-instruct", smollm2_path) and not same_model("smollm2-135m-instruct", "gemma-3-270m")


@pytest.mark.parametrize("hyperparameter,message", [
    ("K", r"expert_U has shape \(3, 32, 2\), expected \(5, 32, 2\) from bundle.json \(K=5"),
    ("rank", r"expert_U has shape \(3, 32, 2\), expected \(3, 32, 5\) from bundle.json \(K=3, rank=5"),
])
def test_a_k_or_rank_that_disagrees_with_the_tensors_is_refused(tmp_path, hyperparameter, message):
    bundle = tiny_mari(K=3, rank=2)
    bundle.config["hyperparameters"][hyperparameter] = 5
    with pytest.raises(methods.BundleError, match=message + r".*retrain it"):
        methods.load_bundle(_saved(tmp_path, bundle))


def test_missing_truncated_and_pickled_bundle_files_are_refused(tmp_path):
    path = _saved(tmp_path, tiny_mari())
    weights = path / methods.BUNDLE_WEIGHTS
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(methods.BundleError, match=r"weights.safetensors is not a readable safetensors file: it is truncated "
                                                  r"or damaged .*Copy the bundle again or retrain it"):
        methods.load_bundle(path)
    torch.save({"expert_U": torch.zeros(3)}, weights)  # what a pickle-based tool would write
    with pytest.raises(methods.BundleError, match=r"it is a pickle \(torch.save\) file\. Bundles are never unpickled"):
        methods.load_bundle(path)
    weights.unlink()
    with pytest.raises(methods.BundleError, match=r"weights.safetensors is missing: .* is not a complete bundle"):
        methods.load_bundle(path)
    (path / methods.BUNDLE_JSON).write_text('{"method": "mari", ')
    weights.write_bytes(good)
    with pytest.raises(methods.BundleError, match=r"bundle.json is not valid JSON"):
        methods.load_bundle(path)


def test_lm_eval_refuses_a_bundle_for_another_model_before_scoring(tmp_path):
    bundle = tiny_mari(d=576, layers=30, layer=15)
    bundle.config["base_model"]["name"] = "HuggingFaceTB/SmolLM2-135M"  # same shapes, other weights
    path = _saved(tmp_path, bundle)
    with pytest.raises(methods.BundleError, match="pretrained=HuggingFaceTB/SmolLM2-135M"):
        get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,bundle={path}")
    lm = get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,bundle={path},allow_other_model=true")
    assert lm.intervention is not None


# ----------------------------------------------------------------------------- data files


def test_a_truncated_or_non_gzip_data_file_is_named_never_read_in_part(tmp_path, monkeypatch):
    monkeypatch.setenv("MARI_DATA_DIR", str(tmp_path))
    path = tmp_path / "gsm8k" / "test.jsonl.gz"
    path.parent.mkdir()
    lines = "".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) + "\n" for i in range(2000))
    whole = gzip.compress(lines.encode())
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(data.DataError, match=r"test.jsonl.gz: unreadable after line \d+ .*truncated or damaged, restore it"):
        data.load_gsm8k("test")
    path.write_bytes(lines.encode())  # plain text under a .gz name
    with pytest.raises(data.DataError, match=r"test.jsonl.gz: unreadable after line 0"):
        data.load_gsm8k("test")


# ----------------------------------------------------------------------------- unusual prompts and options


@pytest.fixture(scope="module")
def vanilla_lm():
    return get_model("mari").create_from_arg_string("pretrained=smollm2-135m-instruct,batch_size=4")


@pytest.fixture(scope="module")
def mari_lm(tmp_path_factory, vanilla_lm):
    from .helpers import saved_mari_bundle

    path = saved_mari_bundle(tmp_path_factory.mktemp("bundle"), vanilla_lm.model)
    return get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,bundle={path},batch_size=4,gate=false")


def _loglikelihoods(lm, pairs):
    return [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])]


def _generate(lm, prompts, tokens=6):
    return lm.generate_until([Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": tokens}), i)
                              for i, p in enumerate(prompts)])


def _whole_sequence(lm, context_ids, continuation_ids, edit_expert=None):
    """log P(continuation | context) from one forward pass, expert ``edit_expert`` at the last context token."""
    ids = torch.tensor([context_ids + continuation_ids])
    p_star = torch.tensor([len(context_ids) - 1])
    iv = lm.intervention
    with torch.no_grad(), (iv.applied(lm.model, (torch.zeros_like(p_star), p_star), torch.tensor([edit_expert]))
                           if edit_expert is not None else site.edit_site(lm.model, 0, lambda h: h, None)):
        logprobs = lm.model(ids).logits.log_softmax(-1)[0, len(context_ids) - 1 : -1]
    return float(logprobs.gather(-1, torch.tensor(continuation_ids)[:, None]).sum())


def test_an_empty_prompt_is_read_as_lm_evals_prefix_token(vanilla_lm, mari_lm):
    prefix = vanilla_lm.prefix_token_id
    (empty,) = _loglikelihoods(vanilla_lm, [("", " Paris")])
    assert empty == pytest.approx(_whole_sequence(vanilla_lm, [prefix], vanilla_lm.tok_encode(" Paris")), abs=1e-4)
    # Generation from an empty prompt starts after the same token, with and without a bundle.
    (vanilla,), (routed,) = _generate(vanilla_lm, [""]), _generate(mari_lm, [""])
    out = vanilla_lm.model.generate(torch.tensor([[prefix]]), max_new_tokens=6, do_sample=False,
                                    pad_token_id=vanilla_lm.tokenizer.pad_token_id)
    assert vanilla == vanilla_lm.tok_decode(out[0, 1:].tolist()).split("\n\n")[0]
    assert isinstance(routed, str) and mari_lm.records[-1]["expert"] in range(3)


def test_a_prompt_longer_than_the_context_window_is_cut_from_the_left(tmp_path, vanilla_lm):
    from .helpers import saved_mari_bundle

    path = saved_mari_bundle(tmp_path, vanilla_lm.model)
    lm = get_model("mari").create_from_arg_string(
        f"pretrained=smollm2-135m-instruct,bundle={path},max_length=24,gate=false")
    context = " ".join(f"w{i}" for i in range(60))
    options = [" yes", " no thanks"]
    got = _loglikelihoods(lm, [(context, o) for o in options])
    expert = lm.records[-1]["expert"]
    ids, conts = lm.tok_encode(context), [lm.tok_encode(o) for o in options]
    kept = ids[-(24 + 1 - max(map(len, conts))):]  # every option sees the same last tokens; the longest fits
    assert len(ids) > 24 and all(abs(g - _whole_sequence(lm, kept, c, expert)) <= 1e-4 for g, c in zip(got, conts))
    # Generation: lm-eval keeps the last max_length - max_gen_toks prompt tokens.
    short = get_model("mari").create_from_arg_string("pretrained=smollm2-135m-instruct,max_length=24")
    (answer,) = _generate(short, [context], tokens=4)
    out = short.model.generate(torch.tensor([ids[-20:]]), max_new_tokens=4, do_sample=False,
                               pad_token_id=short.tokenizer.pad_token_id)
    assert answer == short.tok_decode(out[0, 20:].tolist())


def test_one_option_and_duplicate_options(mari_lm):
    (single,) = _loglikelihoods(mari_lm, [("The sky is", " blue")])
    record = mari_lm.records[-1]
    # One option: every expert's option entropy is 0, the tie goes to the first expert.
    assert record["entropy"] == [0.0, 0.0, 0.0] and record["expert"] == 0
    assert single == pytest.approx(_whole_sequence(mari_lm, mari_lm.tok_encode("The sky is"), mari_lm.tok_encode(" blue"), 0),
                                   abs=1e-4)
    # Duplicates: scored alike (to float rounding: they sit in different rows of a batch,
    # which on some CPUs differ in the 7th digit), one routing decision for the question.
    before = len(mari_lm.records)
    a, b, c = _loglikelihoods(mari_lm, [("The sky is", " blue"), ("The sky is", " blue"), ("The sky is", " green")])
    assert a == pytest.approx(b, abs=1e-5) and abs(a - c) > 1e-2 and len(mari_lm.records) == before + 1


def test_non_ascii_and_right_to_left_text_is_scored_as_tokenised(vanilla_lm, mari_lm, smollm2_path):
    hf = get_model("hf").create_from_arg_string(f"pretrained={smollm2_path},batch_size=4,device=cpu,dtype=float32")
    pairs = [("ما هي عاصمة فرنسا؟", " باريس"), ("ما هي عاصمة فرنسا؟", " ليون"), ("שלום עולם 🌍 — naïve café", " ✓ ok")]
    ours, theirs = _loglikelihoods(vanilla_lm, pairs), _loglikelihoods(hf, pairs)
    assert all(abs(a - b) <= 1e-4 for a, b in zip(ours, theirs))
    routed = _loglikelihoods(mari_lm, pairs)
    assert all(isinstance(x, float) and x < 0 for x in routed) and routed != ours
    (answer,) = _generate(mari_lm, ["ما هي عاصمة فرنسا؟"])
    assert isinstance(answer, str)


# ----------------------------------------------------------------------------- training


class Killed(Exception):
    """Stands in for SIGKILL in-process: raised from inside a training step."""


def _dies_after(fn, calls):
    """``fn`` wrapped to raise Killed on call number ``calls + 1``, and the count of its calls."""
    count = {"n": 0}

    def wrapper(*args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise Killed
        return fn(*args, **kwargs)

    return wrapper, count


HP = {**mari.DEFAULTS, "K": 2, "epochs": 3, "batch_size": 2, "lr": 2e-2}


def test_a_non_finite_loss_stops_training_naming_epoch_step_and_examples(tiny):
    session = tiny_session(tiny)
    examples = tiny_examples(session)
    with pytest.raises(FloatingPointError, match=r"experts: loss is nan at epoch 1, step 2 \(examples ex\d, ex\d...\); lower --lr"):
        mari_fit.fit_experts(session, examples, 2, {**HP, "lr": float("inf")}, torch.Generator().manual_seed(0), "experts")


def test_a_collapsing_expert_is_warned_about(tiny, caplog):
    session = tiny_session(tiny)
    examples = tiny_examples(session, n=2)
    with caplog.at_level(logging.WARNING, logger="mari_eval.mari"):
        _, history = mari_fit.fit_experts(session, examples, 4, {**HP, "epochs": 1}, torch.Generator().manual_seed(0), "experts")
    assert min(history[0]["usage"]) < 1 / 16  # 2 examples cannot reach 4 experts
    assert "has an expert below 1/(4K): it is collapsing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mari_eval.mari"):
        mari_fit.fit_experts(session, examples, 1, {**HP, "epochs": 1}, torch.Generator().manual_seed(0), "experts")
    assert "collapsing" not in caplog.text


def test_killed_mari_training_resumes_from_its_last_epoch_bit_identically(tiny, tmp_path):
    def fit(session):
        gen = torch.Generator().manual_seed(0)
        tensors, history = mari_fit.fit_experts(session, examples, 2, HP, gen, "experts")
        return tensors, history, gen.get_state()

    session = tiny_session(tiny)
    examples = tiny_examples(session)
    reference = fit(session)
    assert all(torch.equal(a, b) for a, b in zip(reference[0].values(), fit(session)[0].values()))  # deterministic

    checkpoints = EpochCheckpoints(tmp_path / "ckpt", key="run-a")
    killed = tiny_session(tiny, checkpoints)
    killed.run, _ = _dies_after(killed.run, 6 + 3)  # one epoch is 6 runs: dies during the second epoch
    with pytest.raises(Killed):
        fit(killed)
    resumed = tiny_session(tiny, checkpoints)
    resumed.run, count = _dies_after(resumed.run, 10**9)
    tensors, history, generator = fit(resumed)
    assert count["n"] == 2 * 6  # epochs 2 and 3 only
    assert all(torch.equal(tensors[k], reference[0][k]) for k in tensors)
    assert history == reference[1] and torch.equal(generator, reference[2])
    # A checkpoint written by another configuration is never resumed from.
    other = tiny_session(tiny, EpochCheckpoints(tmp_path / "ckpt", key="run-b"))
    other.run, count = _dies_after(other.run, 10**9)
    fit(other)
    assert count["n"] == 3 * 6


def test_killed_reft_training_resumes_from_its_last_epoch_bit_identically(tiny, tmp_path, monkeypatch):
    import baselines.reft as reft
    from baselines.reft import ReFT

    def fit(session):
        config = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1}}
        return ReFT.fit(session, SimpleNamespace(train=examples), config, {"epochs": 3, "batch": 2, "first": 2, "last": 2}, 0)

    session = tiny_session(tiny)
    examples = tiny_examples(session, n=5)
    reference = fit(session)
    checkpoints = EpochCheckpoints(tmp_path / "ckpt", key="reft")
    monkeypatch.setattr(reft, "task_loss", _dies_after(reft.task_loss, 7)[0])  # dies in the second epoch
    with pytest.raises(Killed):
        fit(tiny_session(tiny, checkpoints))
    monkeypatch.undo()
    counted, count = _dies_after(reft.task_loss, 10**9)
    monkeypatch.setattr(reft, "task_loss", counted)
    resumed = fit(tiny_session(tiny, checkpoints))
    assert count["n"] == 2 * 5  # epochs 2 and 3 only (4 training examples + 1 validation example each)
    assert resumed.fingerprint() == reference.fingerprint()
    assert resumed.config["diagnostics"]["history"] == reference.config["diagnostics"]["history"]


# ----------------------------------------------------------------------------- concurrent writers


WRITER = textwrap.dedent("""
    import json, sys
    from mari_eval.storage.files import atomic_write_json
    from mari_eval.judge import JudgeCache
    path, cache, me = sys.argv[1], sys.argv[2], sys.argv[3]
    payload = {"writer": me, "cells": [me * 50] * 400}  # ~20 kB: many write() calls each
    for i in range(150):
        atomic_write_json(path, {**payload, "i": i})
        JudgeCache(cache).append({"key": f"{me}-{i}", "label": "refusal", "text": me * 3000})
""")


def test_two_processes_writing_the_same_files_never_corrupt_them(tmp_path):
    path, cache = tmp_path / "evaluation.json", tmp_path / "judge.jsonl"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(cache), me]) for me in "ab"]
    reads = 0
    while any(w.poll() is None for w in writers):
        if path.exists():
            record = json.loads(path.read_text())  # a reader never sees half a file
            assert record["cells"] == [record["writer"] * 50] * 400
            reads += 1
    assert [w.returncode for w in writers] == [0, 0] and reads > 0
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind
    lines = cache.read_text().splitlines()
    assert len(lines) == 300 and {json.loads(line)["key"] for line in lines} == {f"{m}-{i}" for m in "ab" for i in range(150)}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_atomically_written_file_has_an_ordinary_files_permissions(tmp_path, umask):
    from mari_eval.storage.files import atomic_write
    before = os.umask(umask)
    try:
        written = atomic_write(tmp_path / "table.json", "{}")
    finally:
        os.umask(before)
    assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~umask  # not mkstemp's private 0600



# ----------------------------------------------------------------------------- half-trained repro bundles, hosts sharing runs/


def test_a_partial_bundle_is_removed_only_by_its_own_host_once_its_process_is_gone(tmp_path, caplog, monkeypatch):
    from repro.engine import cache

    monkeypatch.setattr(cache.socket, "gethostname", lambda: "gpu-node-3.cluster")  # dashes and dots, as hosts have
    final = tmp_path / "mari-truthfulqa-s0-0123456789abcdef0123"
    mine = cache.partial_dir(final)
    assert mine.name == f"{final.name}.partial-gpu_node_3.cluster-{os.getpid()}"
    assert cache._partial_owner(mine) == ("gpu_node_3.cluster", os.getpid())
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        dead = dead_pid()
        partials = {
            "another host, its process unknown here": f"other_host-{dead}",
            "another host, a pid alive here": f"other_host-{live.pid}",
            "this host, process gone": f"gpu_node_3.cluster-{dead}",
            "this host, process alive": f"gpu_node_3.cluster-{live.pid}",
            "earlier name (no host), process gone": f"{dead}",
            "earlier name (no host), process alive": f"{live.pid}",
        }
        for suffix in partials.values():
            (tmp_path / f"{final.name}.partial-{suffix}").mkdir()
        with caplog.at_level(logging.INFO, logger="repro"):
            cache._remove_abandoned(tmp_path.glob(f"{final.name}.partial-*"))
        left = {what for what, suffix in partials.items() if (tmp_path / f"{final.name}.partial-{suffix}").is_dir()}
        assert left == {"another host, its process unknown here", "another host, a pid alive here",
                        "this host, process alive", "earlier name (no host), process alive"}
        assert f"a partial bundle of host other_host (pid {dead}), not this one" in caplog.text
    finally:
        live.kill()
        live.wait()


def test_a_partial_name_of_another_form_is_left_alone_with_a_warning(tmp_path, caplog):
    from repro.engine import cache

    final = tmp_path / "mari-truthfulqa-s0-0123456789abcdef0123"
    odd = ["old", "²", "99999999999999999999", f"{cache._host()}-99999999999", "0", f"{cache._host()}-"]
    for suffix in odd:
        (tmp_path / f"{final.name}.partial-{suffix}").mkdir()
    not_a_directory = tmp_path / f"{final.name}.partial-{cache._host()}-{dead_pid()}"
    not_a_directory.write_text("a file, not a bundle directory")
    with caplog.at_level(logging.INFO, logger="repro"):
        cache._remove_abandoned(sorted(tmp_path.glob(f"{final.name}.partial-*")))  # raised ValueError/OverflowError
    assert all((tmp_path / f"{final.name}.partial-{suffix}").is_dir() for suffix in odd) and not_a_directory.is_file()
    assert caplog.text.count("left alone") == len(odd) + 1
    assert f"{final.name}.partial-old: not a partial bundle of ours (a directory NAME.partial-HOST-PID); left alone" \
        in caplog.text


# ----------------------------------------------------------------------------- damaged caches under runs/


@pytest.mark.parametrize("damage", ['{"metrics": {"acc,none": 0.5}, "n": 2', '{"metrics": {"acc,none": 0.5}, "n": 2}',
                                    "\udcff", "[]"])
def test_a_damaged_cached_evaluation_is_evaluated_again_with_a_warning_naming_it(tmp_path, monkeypatch, caplog, damage):
    """Not JSON, missing "seconds" (or "documents"), not UTF-8, not an object: evaluated again (it is a cache of what this
    run can recompute), where it raised JSONDecodeError or KeyError: 'seconds' before."""
    from repro.engine import cache, lm_eval_run

    calls = []

    def evaluate(model, tasks, limit, bundle, model_args, gen_tokens, split_seed, placement, lm=None):
        calls.append(tasks)
        return {t: {"metrics": {"acc,none": 0.75}, "n": limit, "seconds": 4.0, "documents": {}} for t in tasks}

    monkeypatch.setattr(lm_eval_run, "evaluate", evaluate)
    store = cache.Store(tmp_path)
    first = store.evaluations("smollm2-135m-instruct", ["arc_easy", "arc_challenge"], 2)
    (path,) = (tmp_path / "evaluations").glob("arc_easy-*.json")
    path.write_bytes(damage.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING, logger="repro"):
        again = cache.Store(tmp_path).evaluations("smollm2-135m-instruct", ["arc_easy", "arc_challenge"], 2)
    assert calls == [["arc_easy", "arc_challenge"], ["arc_easy"]]  # the damaged one only
    assert again == first and json.loads(path.read_text())["seconds"] == 4.0
    assert f"{path} is damaged (" in caplog.text and "evaluating again, the new result replaces it" in caplog.text


def _cut_one_document(stored):
    del stored["documents"]["acc,none"]["1"]  # a file merged or cut by hand: 1 document behind n = 2


def _edit_the_figure(stored):
    stored["metrics"]["acc,none"] = 0.9  # the figure edited, the documents left: mean 0.75


def _claim_more_documents(stored):
    stored["n"] = 3


def _copied_from_another_task(stored):
    stored["config"]["task"] = "arc_challenge"  # arc_challenge's file copied under arc_easy's name


@pytest.mark.parametrize("damage, why", [
    (_cut_one_document, "documents 'acc,none' holds 1 documents, its header says n = 2"),
    (_claim_more_documents, "documents 'acc,none' holds 2 documents, its header says n = 3"),
    (_edit_the_figure, "the mean of documents 'acc,none' is 0.75, its figure in metrics is 0.9"),
    (_copied_from_another_task, "it records another configuration than its name's (task: 'arc_challenge' where 'arc_easy' is "
                                "expected): copied or renamed from another step?"),
])
def test_a_cached_evaluation_whose_content_contradicts_its_header_or_name_is_evaluated_again(
        tmp_path, monkeypatch, caplog, damage, why):
    """Its documents against its n and its figure, its recorded configuration against the one its name is the hash of:
    each was read back as it stood before (a table from 1 document under n = 2, or another task's figures)."""
    from repro.engine import cache, lm_eval_run

    calls = []

    def evaluate(model, tasks, limit, bundle, model_args, gen_tokens, split_seed, placement, lm=None):
        calls.append(tasks)
        return {t: {"metrics": {"acc,none": 0.75}, "n": 2, "seconds": 4.0,
                    "documents": {"acc,none": {"0": 1.0, "1": 0.5}}} for t in tasks}

    monkeypatch.setattr(lm_eval_run, "evaluate", evaluate)
    first = cache.Store(tmp_path).evaluations("smollm2-135m-instruct", ["arc_easy"], 2)
    (path,) = (tmp_path / "evaluations").glob("arc_easy-*.json")
    stored = json.loads(path.read_text())
    damage(stored)
    path.write_text(json.dumps(stored))
    with caplog.at_level(logging.WARNING, logger="repro"):
        store = cache.Store(tmp_path)
        assert store.missing("smollm2-135m-instruct", ["arc_easy"], 2) == ["arc_easy"]
        again = store.evaluations("smollm2-135m-instruct", ["arc_easy"], 2)
    assert calls == [["arc_easy"], ["arc_easy"]] and again == first
    assert f"{path} is damaged ({why}" in caplog.text


def test_a_cached_bundle_renamed_from_another_configuration_is_trained_again(tmp_path, monkeypatch, caplog):
    """A bundle directory copied under another step's name (another seed's) was used as that step's bundle."""
    from repro.engine import cache, profiles

    trained = []

    def train(method, attribute, model, seed, out, **kwargs):
        trained.append(seed)
        return tiny_mari().save(out)

    monkeypatch.setattr("mari_eval.training.train.train", train)
    smoke = profiles.PROFILES["smoke"]
    seed0 = cache.Store(tmp_path).bundle("caa", "truthfulqa", "smollm2-135m-instruct", 0, smoke)
    seed1 = cache.Store(tmp_path).bundle("caa", "truthfulqa", "smollm2-135m-instruct", 1, smoke)
    shutil.rmtree(seed1)
    shutil.copytree(seed0, seed1)
    with caplog.at_level(logging.WARNING, logger="repro"):
        again = cache.Store(tmp_path).bundle("caa", "truthfulqa", "smollm2-135m-instruct", 1, smoke)
    assert again == seed1 and trained == [0, 1, 1]
    assert json.loads((seed1 / "repro_config.json").read_text())["seed"] == 1
    assert (f"{seed1 / 'repro_config.json'} is damaged ({seed1.name}/repro_config.json records another configuration "
            "than its name's (seed: 0 where 1 is expected)") in caplog.text
    assert cache.Store(tmp_path).bundle("caa", "truthfulqa", "smollm2-135m-instruct", 0, smoke) == seed0
    assert trained == [0, 1, 1]  # the original still read back


def test_a_task_under_several_attributes_bundles_gets_each_bundles_result_in_its_own_column(tmp_path, monkeypatch):
    """MMLU under the TruthfulQA bundle (column mmlu) and under the BBQ bundle (mmlu@bbq): the second attribute's
    evaluation replaced the first's, so every mmlu column showed the last bundle's figures."""
    from repro.engine import cache, lm_eval_run, profiles, scoring

    bundles = {"truthfulqa": tiny_mari().save(tmp_path / "tqa"), "bbq": tiny_mari(layer=7).save(tmp_path / "bbq")}
    accuracy = {bundles["truthfulqa"].name: 0.25, bundles["bbq"].name: 0.75}

    def evaluate(model, tasks, limit, bundle, model_args, gen_tokens, split_seed, placement, lm=None):
        return {t: {"metrics": {"acc,none": accuracy[Path(bundle).name]}, "n": 4, "seconds": 1.0,
                    "documents": {}} for t in tasks}

    monkeypatch.setattr(lm_eval_run, "evaluate", evaluate)
    columns = [("mmlu", "mmlu", "acc,none", "truthfulqa"), ("mmlu@bbq", "mmlu", "acc,none", "bbq")]
    out = scoring.score(cache.Store(tmp_path / "runs"), profiles.PROFILES["smoke"], "smollm2-135m-instruct", 0,
                        columns, bundles)
    assert {c: out[c]["value"] for c in ("mmlu", "mmlu@bbq")} == {"mmlu": 25.0, "mmlu@bbq": 75.0}


def test_a_damaged_cached_bundle_json_is_trained_again_with_a_warning_naming_it(tmp_path, monkeypatch, caplog):
    from repro.engine import cache, profiles

    trained = []

    def train(method, attribute, model, seed, out, **kwargs):
        trained.append(out)
        methods_bundle = tiny_mari()  # a real bundle, written as training writes it
        methods_bundle.config["train_seconds"] = 2.0
        return methods_bundle.save(out)

    monkeypatch.setattr("mari_eval.training.train.train", train)
    final = cache.Store(tmp_path).bundle("caa", "truthfulqa", "smollm2-135m-instruct", 0, profiles.PROFILES["smoke"])
    (final / "bundle.json").write_text('{"method": "mari", "train_sec')  # cut short
    with caplog.at_level(logging.WARNING, logger="repro"):
        store = cache.Store(tmp_path)
        again = store.bundle("caa", "truthfulqa", "smollm2-135m-instruct", 0, profiles.PROFILES["smoke"])
    assert again == final and len(trained) == 2 and store.step_seconds == {final.name: 2.0}
    assert methods.load_bundle(final).config["train_seconds"] == 2.0
    assert f"{final / 'bundle.json'} is damaged (JSONDecodeError" in caplog.text


# ----------------------------------------------------------------------------- round four (issue 56.3): options parsed strictly


@pytest.mark.parametrize("value, parsed", [(2.7, None), ("2.7", None), ("\u0663", None), (True, None), ("3", 3), (3.0, 3),
                                           (" +4 ", 4), (5, 5)])
def test_an_integer_option_is_an_integer_never_truncated(value, parsed):
    from mari_eval.methods.options import Option

    option = Option(int, "T_ent=1")
    if parsed is None:  # lm-eval hands "2.7" over as 2.7, which int() read as 2
        with pytest.raises(ValueError, match="T_ent=.* is not an integer: e.g. T_ent=1"):
            option.parse("T_ent", value)
    else:
        assert option.parse("T_ent", value) == parsed


def test_a_model_args_key_given_twice_is_refused_before_the_model_loads():
    from mari_eval.evaluation.lm import MariLM

    with pytest.raises(ValueError, match=r"rho given more than once in --model_args.*give each key once"):
        MariLM.create_from_arg_string("pretrained=/nonexistent,rho=0.0,gate=true,rho=1.0")


@pytest.mark.parametrize("given", ["99999999999999999999999", "-1"])
def test_a_seed_the_code_cannot_use_is_refused_by_a_run_and_its_plan_alike(given):
    from mari_eval.methods import options
    from repro.engine import command_line

    with pytest.raises(argparse.ArgumentTypeError, match="is out of range: give 0 to 4294967295"):
        options.seed(given)
    with pytest.raises(SystemExit, match=f"--seeds '{re.escape(given)}': seed .* is out of range: give 0 to 4294967295"):
        command_line.listed(given, "--seeds", options.seed)
    with pytest.raises(SystemExit, match="--seeds '2.5': every item must be an integer"):
        command_line.listed("2.5", "--seeds", options.seed)
    assert options.seed("4294967295") == 2**32 - 1


# ----------------------------------------------------------------------------- round four (issue 56.7): missing local paths


@pytest.mark.parametrize("name", ["/nonexistent/model", "./no-such-folder", "~/no/such/model", "a/b/c"])
def test_a_local_model_path_with_nothing_there_is_named_before_any_hub_message(name):
    from mari_eval.storage import models

    with pytest.raises(FileNotFoundError, match=r"model '.*': no such local directory .*check the path"):
        models.resolve_model(name)


def test_an_overflowing_scale_is_named_as_the_users_option():
    from .tiny import tiny_caa

    bundle = tiny_caa(multiplier=3.0)
    with pytest.raises(ValueError, match=r"scale=1e\+40 in --model_args makes the multiplier 3 x 1e\+40, beyond float32.*smaller scale="):
        bundle.configure_from({"scale": "1e40"})
    bundle.configure_from({"scale": "2"})  # an ordinary scale still applies
    assert bundle.strength() == 6.0
