"""Diagnostics records name lm-eval's document (``doc_id``, as ``--log_samples`` does) for generation
as for multiple choice; under ``--use_cache`` the diagnostics say that cached results were not recomputed."""

import json

import pytest
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from mari_eval import methods

from .helpers import saved_mari_bundle

pytestmark = pytest.mark.e2e  # subprocesses or lm-eval runs of the embedded model throughout

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    vanilla = get_model("mari").create_from_arg_string(f"pretrained={MODEL}")
    return saved_mari_bundle(tmp_path_factory.mktemp("mari"), vanilla.model)


def _lm(bundle, extra=""):
    return get_model("mari").create_from_arg_string(f"pretrained={MODEL},bundle={bundle},batch_size=2{extra}")


def _evaluate(lm, tasks, limit, manager, **kw):
    return simple_evaluate(model=lm, tasks=tasks, limit=limit, bootstrap_iters=0, log_samples=True,
                           task_manager=manager, **kw)


@pytest.mark.needs_data
def test_every_record_names_a_document_of_the_logged_samples(bundle, tmp_path, harness_task_manager):
    diagnostics = tmp_path / "diag.json"
    lm = _lm(bundle, f",gate=false,diagnostics={diagnostics}")  # every prompt routed: a record with entropies each
    out = _evaluate(lm, ["gsm8k", "truthfulqa_mc1"], limit=3, manager=harness_task_manager, gen_kwargs="max_gen_toks=4")
    # (a task with several filters, as gsm8k, logs each document once per filter)
    samples = {task: sorted({s["doc_id"] for s in out["samples"][task]}) for task in ("gsm8k", "truthfulqa_mc1")}
    records = json.loads(diagnostics.read_text())["records"]
    assert records == lm.records
    for task, doc_ids in samples.items():
        mine = [r for r in records if r["task"] == task]
        assert sorted(r["doc_id"] for r in mine) == doc_ids == list(range(3))  # one record per document
    generated = [r for r in records if r["task"] == "gsm8k"]
    assert all(len(r["entropy"]) == 3 for r in generated)  # routing records, over the bundle's 3 experts


def test_requests_sharing_a_prompt_each_get_the_record_of_their_own_generation(bundle):
    """HFLM groups generation requests by their arguments and sorts each group by prompt: the same
    prompt in two tasks, once with other arguments, still gets each request its own record."""
    lm = _lm(bundle, ",gate=false")
    shared, other = "Q: What is the capital of France?\nA:", "Q: Name a colour.\nA:"
    short, long = {"until": ["\n\n"], "max_gen_toks": 3}, {"until": ["\n\n"], "max_gen_toks": 8}
    requests = [Instance("generate_until", {}, (other, long), 4, metadata=("task_a", 4, 1)),
                Instance("generate_until", {}, (shared, short), 9, metadata=("task_b", 9, 1)),
                Instance("generate_until", {}, (shared, long), 2, metadata=("task_c", 2, 1))]
    lm.generate_until(requests)
    together = {(r["task"], r["doc_id"]): r for r in lm.records}
    assert set(together) == {("task_a", 4), ("task_b", 9), ("task_c", 2)}
    for request in requests:  # each alone: its window (3 or 8 steps) gives its entropies
        alone = _lm(bundle, ",gate=false")
        alone.generate_until([request])
        (record,) = alone.records
        assert (record["task"], record["doc_id"]) == (request.task_name, request.doc_id)
        assert together[(request.task_name, request.doc_id)]["entropy"] == pytest.approx(record["entropy"], abs=1e-3)
    # ... and the two windows do tell the two requests of the shared prompt apart.
    assert together[("task_b", 9)]["entropy"] != pytest.approx(together[("task_c", 2)]["entropy"], abs=1e-3)


@pytest.mark.needs_data
def test_results_read_from_the_cache_say_their_diagnostics_were_not_recomputed(bundle, tmp_path, harness_task_manager):
    cache = str(tmp_path / "cache" / f"mari-{methods.load_bundle(bundle).fingerprint()}")
    runs = []
    for run in (1, 2):  # the same evaluation twice: the second is answered from the cache
        diagnostics = tmp_path / f"diag{run}.json"
        lm = _lm(bundle, f",diagnostics={diagnostics}")
        out = _evaluate(lm, ["truthfulqa_mc1"], limit=3, manager=harness_task_manager, use_cache=cache)
        runs.append((out, json.loads(diagnostics.read_text())))
    (first, first_file), (second, second_file) = runs
    assert first["results"]["truthfulqa_mc1"]["acc,none"] == second["results"]["truthfulqa_mc1"]["acc,none"]
    summary = first["config"]["mari_diagnostics"]
    assert summary["diagnostics_incomplete"] is False and "diagnostics_note" not in summary  # an empty cache: all computed
    assert summary["use_cache"]["cached_results_at_start"] == 0 and summary["prompts"] == len(first_file["records"]) == 3
    summary = second["config"]["mari_diagnostics"]
    assert summary["diagnostics_incomplete"] is True and "--use_cache" in summary["diagnostics_note"]
    assert summary["use_cache"]["cached_results_at_start"] > 0 and summary["prompts"] == 0
    assert summary["use_cache"]["cache"].startswith(cache)
    # The diagnostics file is written although no request reached the model, and says the same.
    assert second_file["records"] == [] and second_file["summary"]["diagnostics_incomplete"] is True
