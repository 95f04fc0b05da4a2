"""``lm_eval --model mari``: registration, parity with ``--model hf``, the edit through lm-eval."""

import json
import subprocess
import sys

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from mari_eval import methods
from mari_eval.injection import site

from .conftest import HARNESS_TASKS
from .helpers import saved_mari_bundle
from .helpers import saved_baseline_bundle
from .helpers import capital_requests

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data]


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    return out.stdout.strip()


def test_mari_is_registered_without_importing_anything():
    assert _python("from lm_eval.api.registry import get_model; print(get_model('mari').__module__)") == "mari_eval.evaluation.lm"
    # ... and the built-ins stay reachable beside it.
    assert _python("from lm_eval.api.registry import get_model; print(get_model('hf').__name__)") == "HFLM"


def test_startup_stays_light():
    heavy = _python(
        "import sys; print(sorted(m for m in ('torch', 'transformers', 'lm_eval', 'mari_eval.evaluation.lm') if m in sys.modules))"
    )
    assert heavy == "[]"
    assert _python("import sys; print('mari_eval_autoload' in sys.modules)") == "True"


@pytest.fixture(scope="module")
def mari_lm():
    return get_model("mari").create_from_arg_string("pretrained=smollm2-135m-instruct,batch_size=4")


@pytest.fixture(scope="module")
def hf_lm(smollm2_path):
    return get_model("hf").create_from_arg_string(f"pretrained={smollm2_path},batch_size=4,device=cpu,dtype=float32")


@pytest.fixture(scope="module")
def task_manager(harness_task_manager):
    return harness_task_manager


def _samples(lm, task_manager, tasks, limit, **kw):
    out = simple_evaluate(model=lm, tasks=tasks, limit=limit, log_samples=True, task_manager=task_manager,
                          bootstrap_iters=0, **kw)
    return {t: sorted(out["samples"][t], key=lambda s: s["doc_id"]) for t in tasks}, out["results"]


def test_vanilla_loglikelihoods_equal_hf(mari_lm, hf_lm, task_manager):
    tasks = ["truthfulqa_mc1", "truthfulqa_mc2", "bbq"]
    ours, our_results = _samples(mari_lm, task_manager, tasks, limit=3)
    theirs, their_results = _samples(hf_lm, task_manager, tasks, limit=3)
    n = 0
    for task in tasks:
        assert len(ours[task]) == len(theirs[task]) == 3
        for a, b in zip(ours[task], theirs[task]):
            assert a["arguments"] == b["arguments"]
            for (ll_a, greedy_a), (ll_b, greedy_b) in zip((r[0] for r in a["resps"]), (r[0] for r in b["resps"])):
                assert abs(float(ll_a) - float(ll_b)) <= 1e-4
                assert greedy_a == greedy_b
                n += 1
        assert our_results[task]["acc,none"] == pytest.approx(their_results[task]["acc,none"], abs=1e-4)
    assert n > 40  # every option of every question was compared


def test_vanilla_generations_equal_hf(mari_lm, hf_lm, task_manager):
    kw = dict(gen_kwargs="max_gen_toks=24")
    ours, _ = _samples(mari_lm, task_manager, ["gsm8k"], limit=2, **kw)
    theirs, _ = _samples(hf_lm, task_manager, ["gsm8k"], limit=2, **kw)
    gens = [(a["resps"][0][0], b["resps"][0][0]) for a, b in zip(ours["gsm8k"], theirs["gsm8k"])]
    assert all(x == y for x, y in gens) and all(x for x, _ in gens)


# ----------------------------------------------------------------------------- with an edit


@methods.register_method("test_shift")
class ShiftAtSite(methods.Intervention):
    """Test-only method: adds a fixed vector at p* (what a steering vector does)."""

    def edit(self, hidden):
        return hidden + self.tensors["vector"].to(hidden)


def _shift_bundle(tmp_path, model, layer=10, scale=8.0):
    d = model.config.hidden_size
    torch.manual_seed(0)
    config = {"base_model": {"name": "smollm2-135m-instruct", "hidden_size": d,
                             "num_layers": site.num_layers(model)}, "site": {"layer": layer}}
    ShiftAtSite(config, {"vector": scale * torch.randn(d)}).save(tmp_path)
    return tmp_path


def _manual_loglikelihood(model, tok, bundle, context, continuation):
    """The continuation's log-likelihood from one forward pass of the whole sequence under the bundle."""
    ctx = tok(context).input_ids
    cont = tok(continuation).input_ids
    ids = torch.tensor([ctx + cont])
    cols = torch.tensor(bundle.plan(model).prompt_sites(len(ctx)) + [len(ctx) - 1])
    with torch.no_grad(), bundle.applied(model, (torch.zeros_like(cols), cols)):
        logprobs = model(ids).logits.log_softmax(-1)[0, len(ctx) - 1 : -1]
    return float(logprobs.gather(-1, torch.tensor(cont)[:, None]).sum())


def test_bundle_edit_at_last_prompt_token_batched_equals_unbatched(tmp_path, mari_lm):
    path = _shift_bundle(tmp_path, mari_lm.model)
    lm = get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,bundle={path},batch_size=4")
    lm1 = get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,bundle={path},batch_size=1")
    edited, edited_one_by_one = lm.loglikelihood(capital_requests()), lm1.loglikelihood(capital_requests())
    plain = mari_lm.loglikelihood(capital_requests())
    for (a, _), (b, _), (c, _), req in zip(edited, edited_one_by_one, plain, capital_requests()):
        assert abs(a - b) <= 1e-4
        assert abs(a - c) > 1e-3  # the bundle does something
        want = _manual_loglikelihood(lm.model, lm.tokenizer, lm.intervention, *req.args)
        assert abs(a - want) <= 1e-4


def test_bundle_generation_is_edited_once_at_the_prompt(tmp_path, mari_lm):
    path = _shift_bundle(tmp_path, mari_lm.model, scale=20.0)
    lm = get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,bundle={path},batch_size=2")
    prompt = "Q: What is the capital of France?\nA:"
    req = [Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 12}), 0)]
    ours = lm.generate_until(req)[0]
    ids = lm.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad(), site.edit_site(lm.model, lm.intervention.layer, lm.intervention.edit) as state:
        out = lm.model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert state["calls"] == 1
    want = lm.tokenizer.decode(out[0, ids.input_ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
    assert ours == want
    assert ours != mari_lm.generate_until(req)[0]


def test_bundle_for_another_model_is_refused(tmp_path, mari_lm):
    config = {"base_model": {"name": "gemma-3-270m", "hidden_size": 640, "num_layers": 18}, "site": {"layer": 3}}
    ShiftAtSite(config, {"vector": torch.zeros(640)}).save(tmp_path)
    with pytest.raises(methods.BundleError, match=r"trained for 'gemma-3-270m' with hidden size 640 \(this model: 576\)"):
        methods.load_bundle(tmp_path).check_compatible(mari_lm.model, "smollm2-135m-instruct")


def test_cli_prints_its_table_offline(tmp_path):
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        ["lm_eval", "--model", "mari", "--model_args", "pretrained=smollm2-135m-instruct",
         "--tasks", "truthfulqa_mc1_heldout,bbq", "--include_path", str(HARNESS_TASKS), "--limit", "3",
         "--output_path", str(out_dir)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "truthfulqa_mc1_heldout" in proc.stdout and "|bbq" in proc.stdout.replace(" ", "")
    (result_file,) = out_dir.rglob("results_*.json")
    results = json.loads(result_file.read_text())["results"]
    assert 0.0 <= results["truthfulqa_mc1_heldout"]["acc,none"] <= 1.0
    assert results["bbq"]["alias"] == "bbq"


# ----------------------------------------------------------------------------- baselines through lm-eval


@pytest.mark.parametrize("method", ["reft", "iti"])
def test_baseline_loglikelihoods_equal_the_whole_sequence_under_the_edit(tmp_path, mari_lm, method):
    """ReFT's edited prompt and ITI's shifted heads give what one full forward pass gives."""
    lm = _mari(saved_baseline_bundle(tmp_path, mari_lm.model, method))
    plain = mari_lm.loglikelihood(capital_requests())
    for (got, _), (base, _), req in zip(lm.loglikelihood(capital_requests()), plain, capital_requests()):
        want = _manual_loglikelihood(lm.model, lm.tokenizer, lm.intervention, *req.args)
        assert abs(got - want) <= 1e-4 and abs(got - base) > 1e-3


def test_reft_generation_edits_each_left_padded_prompt_at_its_own_positions(tmp_path, mari_lm):
    lm = _mari(saved_baseline_bundle(tmp_path, mari_lm.model, "reft"))
    prompts = ["Q: What is the capital of France?\nA:", "The sky is"]
    reqs = [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 10}), i) for i, p in enumerate(prompts)]
    batched = lm.generate_until(reqs)  # one left-padded batch of two prompts of different lengths
    iv = lm.intervention
    for prompt, ours in zip(prompts, batched):
        ids = lm.tokenizer(prompt, return_tensors="pt")
        n = ids.input_ids.shape[1]
        cols = torch.tensor(iv.prompt_sites(n) + [n - 1])
        with torch.no_grad(), site.edit_site(lm.model, iv.layer, iv.edit, (torch.zeros_like(cols), cols)) as state:
            out = lm.model.generate(**ids, max_new_tokens=10, do_sample=False)
        assert state["calls"] == 1  # the prompt only: LoReFT does not edit generated tokens
        assert ours == lm.tokenizer.decode(out[0, n:], skip_special_tokens=True).split("\n")[0]


# ----------------------------------------------------------------------------- MARI through lm-eval


def _mari(path, extra=""):
    return get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,bundle={path},batch_size=4{extra}")


def test_mari_gate_that_never_opens_is_exactly_vanilla(tmp_path, mari_lm):
    lm = _mari(saved_mari_bundle(tmp_path, mari_lm.model, gate_never_opens=True))
    assert lm.loglikelihood(capital_requests()) == mari_lm.loglikelihood(capital_requests())
    summary = lm.get_model_info()["mari_diagnostics"]
    assert summary["gate_rate"] == 0.0 and summary["prompts"] == 3  # three distinct contexts
    # Generation: the closed gate hands every prompt to the untouched model before any expert runs.
    req = lambda: [Instance("generate_until", {}, (q, {"until": ["\n\n"], "max_gen_toks": 16}), i)
                   for i, q in enumerate(["Q: What is the capital of France?\nA:", "Q: Name a colour.\nA:"])]
    assert lm.generate_until(req()) == mari_lm.generate_until(req())
    assert all(r["variant"] == -1 and "entropy" not in r for r in lm.records[-2:])


def test_mari_routed_answer_is_the_chosen_experts_answer(tmp_path, mari_lm):
    path = saved_mari_bundle(tmp_path, mari_lm.model)
    diag = tmp_path / "diag.json"
    routed = _mari(path, f",gate=false,diagnostics={diag}")
    answers = routed.loglikelihood(capital_requests())
    records = json.loads(diag.read_text())["records"]
    assert len(records) == 3 and all(0 <= r["expert"] < 3 for r in records)
    assert records[0]["expert"] == min(range(3), key=lambda k: records[0]["entropy"][k])  # eq:entropy_route
    assert answers != mari_lm.loglikelihood(capital_requests())  # the experts do something
    for k in range(3):
        forced = _mari(path, f",gate=false,experts={k}").loglikelihood(capital_requests())
        by_context = {}
        for req, ans in zip(capital_requests(), forced):
            by_context.setdefault(req.args[0], []).append(ans)
        for record, context in zip(records, dict.fromkeys(r.args[0] for r in capital_requests())):
            if record["expert"] == k:
                mine = [a for req, a in zip(capital_requests(), answers) if req.args[0] == context]
                assert [x for x, _ in mine] == pytest.approx([x for x, _ in by_context[context]], abs=1e-4)
    usage = routed.get_model_info()["mari_diagnostics"]["expert_usage"]
    assert sum(usage.values()) == pytest.approx(1.0)


def test_mari_generation_routes_over_the_first_steps(tmp_path, mari_lm):
    lm = _mari(saved_mari_bundle(tmp_path, mari_lm.model))
    req = [Instance("generate_until", {}, ("Q: What is the capital of France?\nA:", {"until": ["\n"], "max_gen_toks": 12}), 0,
                    metadata=("gsm8k", 0, 1))]
    out = lm.generate_until(req)
    record = lm.records[-1]
    assert isinstance(out[0], str) and len(record["entropy"]) == 3 and "energy" in record
    assert record["task"] == "gsm8k"  # a call holding one task's requests names it (per-task diagnostics)
    assert lm.intervention.summarize([])["gate_rate"] is None  # no prompt seen: no rate, not 0


def test_mari_ablation_args_are_checked(tmp_path, mari_lm):
    path = saved_mari_bundle(tmp_path, mari_lm.model)
    with pytest.raises(ValueError, match="out of range: this bundle has K=3"):
        _mari(path, ",experts=5")
    with pytest.raises(ValueError, match="gate='maybe'"):
        _mari(path, ",gate=maybe")
