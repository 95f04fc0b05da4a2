"""Running where users run: bf16, device maps with offload, data parallelism (issue 20).

These machines have no GPU: bf16 runs on the CPU, ``parallelize=True`` with a small
``max_cpu_memory`` spreads the model over the CPU and disk (offloaded layers are meta
tensors until accelerate's hooks load them), and torchrun starts two CPU ranks (gloo).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from mari_eval.injection import site

from .conftest import HARNESS_TASKS
from .helpers import capital_requests, saved_baseline_bundle, saved_mari_bundle

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data]

METHODS = ["vanilla", "mari", "caa", "iti", "nl_iti", "reft"]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """One bundle of every method for the embedded model (random but fixed parameters)."""
    from baselines import caa, iti

    tmp = tmp_path_factory.mktemp("bundles")
    base = get_model("mari").create_from_arg_string("pretrained=smollm2-135m-instruct")
    model = base.model
    d, layers = model.config.hidden_size, site.num_layers(model)
    config = {"base_model": {"name": "smollm2-135m-instruct", "hidden_size": d, "num_layers": layers}}
    g = torch.Generator().manual_seed(1)
    iti_path = saved_baseline_bundle(tmp, model, "iti")
    from mari_eval import methods

    iti_bundle = methods.load_bundle(iti_path)
    return {
        "vanilla": None,
        "mari": saved_mari_bundle(tmp, model),
        "caa": caa.CAA({**config, "site": {"layer": 12}, "hyperparameters": {"multiplier": 4.0}},
                       {"vector": torch.randn(d, generator=g)}).save(tmp / "caa"),
        "iti": iti_path,
        "nl_iti": iti.NLITI(iti_bundle.config, iti_bundle.tensors).save(tmp / "nl_iti"),
        "reft": saved_baseline_bundle(tmp, model, "reft"),
    }


def _lm(bundle, extra=""):
    args = "pretrained=smollm2-135m-instruct,batch_size=2" + (f",bundle={bundle}" if bundle else "") + extra
    return get_model("mari").create_from_arg_string(args)


def _generations():
    prompts = ["Q: What is the capital of France?\nA:", "Q: Name a colour.\nA:"]
    return [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_gen_toks": 8}), i) for i, p in enumerate(prompts)]


# bf16 keeps 8 bits of mantissa: a continuation's summed log-likelihood on this 135M model
# moves by up to ~0.2 nats (about 3% of its size) against float32 (measured: issue 20 note);
# float16 (10 bits) by less.
def _bf16_tolerance(logprob: float) -> float:
    return 0.1 + 0.03 * abs(logprob)


@pytest.mark.parametrize("method, dtype", [(m, "bfloat16") for m in METHODS] + [("mari", "float16")])
def test_every_method_scores_and_generates_in_half_precision(bundles, method, dtype):
    fp32, bf16 = _lm(bundles[method], ",dtype=float32"), _lm(bundles[method], f",dtype={dtype}")
    assert fp32.model.dtype == torch.float32 and bf16.model.dtype == getattr(torch, dtype)
    for (a, _), (b, _) in zip(fp32.loglikelihood(capital_requests()), bf16.loglikelihood(capital_requests())):
        assert abs(a - b) <= _bf16_tolerance(a)
    answers = bf16.generate_until(_generations())
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    if bf16.intervention is not None:  # the bundle keeps float32 whatever the model's dtype
        assert all(t.dtype == torch.float32 for t in bf16.intervention.tensors.values() if t.is_floating_point())


def test_default_dtype_is_the_checkpoints_as_for_model_hf(bundles):
    assert _lm(None).model.dtype == torch.float32  # the embedded checkpoint is stored in float32


@pytest.mark.parametrize("method", METHODS)
def test_offloaded_device_map_scores_and_generates_like_one_device(bundles, method, tmp_path):
    one = _lm(bundles[method])
    spread = _lm(bundles[method], f",parallelize=True,max_cpu_memory=250MB,offload_folder={tmp_path / 'offload'}")
    assert set(spread.model.hf_device_map.values()) == {"cpu", "disk"}
    assert any(p.device.type == "meta" for p in spread.model.parameters())  # offloaded until a hook loads them
    for (a, greedy_a), (b, greedy_b) in zip(one.loglikelihood(capital_requests()), spread.loglikelihood(capital_requests())):
        assert abs(a - b) <= 1e-4 and greedy_a == greedy_b
    assert one.generate_until(_generations()) == spread.generate_until(_generations())
    # accelerate's hooks are still installed on every layer, and forward is still theirs.
    for layer in site.decoder_layers(spread.model):
        assert hasattr(layer, "_hf_hook") and "forward" in vars(layer)


def test_lm_evals_padding_copies_never_join_a_routing_group(bundles):
    """Under data parallelism lm-eval pads a rank with copies (the same object) of its last request."""
    lm = _lm(bundles["mari"], ",gate=false")
    requests = capital_requests()
    plain = lm.loglikelihood(requests)
    records = [dict(r) for r in lm.records]
    padded = lm.loglikelihood(requests + [requests[-1]] * 2)
    assert padded == plain + [plain[-1]] * 2
    assert lm.records[len(records):] == records  # same groups, same entropies, no extra record
    generations = _generations()
    answers = lm.generate_until(generations)
    before = len(lm.records)
    assert lm.generate_until(generations + [generations[-1]]) == answers + answers[-1:]
    assert len(lm.records) == before + 2  # the copy is not generated again, nor recorded


def _lm_eval(launcher: list[str], bundle, out, diagnostics):
    command = launcher + ["-m", "lm_eval", "--model", "mari", "--model_args",
                          f"pretrained=smollm2-135m-instruct,bundle={bundle},diagnostics={diagnostics}",
                          "--tasks", "truthfulqa_mc1_heldout", "--include_path", str(HARNESS_TASKS), "--limit", "5",
                          "--log_samples", "--output_path", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    run = subprocess.run(command, capture_output=True, text=True, cwd=out.parent, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    (result,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_*.jsonl")
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    return run.stderr, json.loads(result.read_text()), {s["doc_id"]: s for s in lines}, json.loads(diagnostics.read_text())


def test_two_torchrun_ranks_equal_one_process(bundles, tmp_path):
    """5 questions on 2 ranks: 3 and 2, so lm-eval pads the second rank with copies of its last request."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    _, one, one_samples, one_diag = _lm_eval([sys.executable], bundles["mari"], tmp_path / "one", tmp_path / "one.json")
    log, two, two_samples, two_diag = _lm_eval([torchrun, "--nproc_per_node", "2"], bundles["mari"], tmp_path / "two",
                                               tmp_path / "two.json")
    assert "on rank 1" in log  # two ranks, each with its share of the documents
    assert two["results"] == one["results"]
    assert sorted(two_samples) == sorted(one_samples) == list(range(5))
    for doc_id, sample in one_samples.items():
        theirs = [float(r[0][0]) for r in two_samples[doc_id]["resps"]]
        assert [float(r[0][0]) for r in sample["resps"]] == pytest.approx(theirs, abs=1e-4)
    assert len(two_diag["records"]) == len(one_diag["records"]) == 5  # no record from a padding copy
    for a, b in zip(one_diag["records"], two_diag["records"]):
        assert a["doc_id"] == b["doc_id"] and a["expert"] == b["expert"] and a["gate_open"] == b["gate_open"]
        assert a["entropy"] == pytest.approx(b["entropy"], abs=1e-4) and a["energy"] == pytest.approx(b["energy"], rel=1e-5)
    assert two_diag["summary"] == one_diag["summary"]
    assert two["config"]["mari_diagnostics"] == one["config"]["mari_diagnostics"]


def _tiny_training(n_pca=20):
    """A Session around a tiny bf16 model (bf16 backward is slow on CPUs) and an attribute's data."""
    from mari_eval.training.train import AttributeData, Example

    from .tiny import tiny_session
    from .tiny import tiny_model

    session = tiny_session(tiny_model("llama").to(torch.bfloat16))
    session.memory_budget = 2**30
    session.encode_prompt = lambda text: [5, 6, 7]  # CAA's A/B prompts (the tiny model has no tokenizer)
    session.chat_prompt = lambda user, without_template: without_template
    g = torch.Generator().manual_seed(2)
    make = lambda i: Example(f"ex{i}", torch.randint(1, 97, (9,), generator=g).tolist(),
                             [torch.randint(1, 97, (2,), generator=g).tolist() for _ in range(3)], i % 3,
                             question=f"q{i}", choices=["a", "b", "c"])
    data = AttributeData("tiny", None, [torch.randint(1, 97, (6,), generator=g).tolist() for _ in range(n_pca)],
                         [make(i) for i in range(10)], [make(10 + i) for i in range(6)], ["attribute"] * 6)
    config = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1}}
    return session, data, config


@pytest.mark.parametrize("method", ["mari", "reft", "caa", "iti"])
def test_a_bundle_trained_in_bfloat16_keeps_float32_and_loads_in_float32(method, tmp_path):
    from mari_eval import methods

    from .tiny import tiny_model

    session, data, config = _tiny_training()
    hp = {"mari": {"K": 2, "epochs": 1, "pca_rank": 4}, "reft": {"epochs": 1},
          "caa": {"layers": [1], "multipliers": [1.0]}, "iti": {"head_fractions": [0.2], "alphas": [2.0]}}[method]
    trained = methods.method_class(method).fit(session, data, config, hp, seed=0)
    floats = {k: v for k, v in trained.tensors.items() if v.is_floating_point()}
    assert floats and all(v.dtype == torch.float32 and bool(v.isfinite().all()) for v in floats.values())
    loaded = methods.load_bundle(trained.save(tmp_path / method))
    ids = torch.tensor([data.train[0].context])
    for model in (tiny_model("llama"), session.model):  # the same bundle edits a float32 and a bf16 model
        with torch.no_grad(), loaded.applied(model, None):
            assert bool(model(ids).logits.isfinite().all())


def test_too_few_pca_prompts_for_the_rank_stop_training_before_it_starts():
    from mari_eval import mari

    session, data, config = _tiny_training(n_pca=3)
    session.prepare = lambda *a, **k: pytest.fail("training started")
    with pytest.raises(ValueError, match="D_pca has 3 prompts, fewer than pca_rank=4: raise --max-pca"):
        mari.MARI.fit(session, data, config, {"K": 2, "epochs": 1, "pca_rank": 4}, seed=0)
