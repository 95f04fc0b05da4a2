"""On a CUDA GPU: the lm-eval class, every method, its training and the shared pass where users run them.

Skipped without a GPU (CI has none). A random Llama (GQA, 8 layers, d = 256) and a
byte-level tokenizer built in memory, so the module needs no download and no embedded model:
it runs on a bare GPU machine with the package and lm-eval installed. It checks what the
CPU tests cannot: CUDA kernels (SDPA with the packed rows' mask, bf16 matmuls), tensors
placed on the GPU, and a device map split between the GPU and the CPU.
"""

import copy

import pytest
import torch
from lm_eval.api.instance import Instance

from mari_eval.evaluation.lm import MariLM
from mari_eval.evaluation.shared_pass import SharedPass

from .helpers import QUESTIONS, tiny_bundles
from .tiny import byte_llama, byte_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

METHODS = [("vanilla", {}), ("caa", {}), ("iti", {}), ("mari", {}), ("mari", {"gate": "false"}), ("reft", {})]
PREAMBLE = "Q: Which planet is closest to the sun?\nA: Mercury.\n\nQ: How many days are in a week?\nA: Seven.\n\n"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    """Float32, on the GPU."""
    return byte_llama(tokenizer).to("cuda")


@pytest.fixture(scope="module")
def bf16_model(model):
    return copy.deepcopy(model).to(torch.bfloat16)


@pytest.fixture(scope="module")
def bundles(model, tmp_path_factory):
    return tiny_bundles(model, tmp_path_factory.mktemp("bundles"))


def _lm(model, tokenizer, bundle=None, shared=None, **options) -> MariLM:
    dtype = str(model.dtype).removeprefix("torch.")
    return MariLM(pretrained=model, tokenizer=tokenizer, device="cuda", dtype=dtype, bundle=bundle,
                  allow_other_model=True if bundle else None, shared_pass=shared, **options)


def _requests() -> list[Instance]:
    return [Instance("loglikelihood", {}, (f"{PREAMBLE}Q: {question}\nA:", option), i)
            for i, (question, mc1, mc2) in enumerate(QUESTIONS) for option in dict.fromkeys(mc1 + mc2)]


def _generations() -> list[Instance]:
    return [Instance("generate_until", {}, (f"{PREAMBLE}Q: {question}\nA:", {"until": ["\n\n"], "max_gen_toks": 12}), i)
            for i, (question, _, _) in enumerate(QUESTIONS)]


def _scores(lm) -> list[float]:
    return [x for x, _ in lm.loglikelihood(_requests())]


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def test_bf16_loglikelihoods_stay_as_close_to_float32_as_lm_evals_own_hf_model(model, bf16_model, tokenizer):
    from lm_eval.models.huggingface import HFLM

    hf = {m.dtype: _scores(HFLM(pretrained=m, tokenizer=tokenizer, batch_size=4)) for m in (model, bf16_model)}
    ours = {m.dtype: _scores(_lm(m, tokenizer)) for m in (model, bf16_model)}
    # float32: the prefix cache and packed rows give lm-eval's own numbers
    assert _worst(ours[torch.float32], hf[torch.float32]) <= 1e-3
    # bf16: no further from float32 than lm-eval's own model in bf16 (measured on the GPU: see the note)
    ours_error, hf_error = _worst(ours[torch.bfloat16], ours[torch.float32]), _worst(hf[torch.bfloat16], hf[torch.float32])
    print(f"bf16 vs float32, worst continuation: ours {ours_error:.4f} nats, lm-eval's hf {hf_error:.4f}")
    assert ours_error <= 2 * hf_error + 0.05


def test_each_method_through_the_shared_pass_on_cuda_answers_as_alone(model, tokenizer, bundles):
    alone = [_scores(_lm(model, tokenizer, bundles.get(name), **options)) for name, options in METHODS]
    shared = SharedPass(model)
    lms = [_lm(model, tokenizer, bundles.get(name), shared, **options) for name, options in METHODS]
    together = [_scores(lm) for lm in lms]
    for (name, options), a, b in zip(METHODS, alone, together):
        assert _worst(a, b) <= 1e-4, (name, options)
    assert all(_worst(a, alone[0]) > 1e-3 for a in alone[1:])  # every bundle moves the answers
    assert shared.stats["on_demand"] == 0 and shared.pending() == 0


@pytest.mark.parametrize("name, options", METHODS)
def test_every_method_scores_and_generates_in_bf16_on_cuda(model, bf16_model, tokenizer, bundles, name, options):
    fp32, bf16 = _lm(model, tokenizer, bundles.get(name), **options), _lm(bf16_model, tokenizer, bundles.get(name), **options)
    for a, b in zip(_scores(fp32), _scores(bf16)):
        assert abs(a - b) <= 0.1 + 0.03 * abs(a)  # tests/test_scale.py's bf16 tolerance
    answers = bf16.generate_until(_generations())
    assert len(answers) == len(QUESTIONS) and all(isinstance(a, str) for a in answers)


@pytest.mark.parametrize("name, options", METHODS)
def test_batched_scoring_on_cuda_equals_one_question_at_a_time(model, tokenizer, bundles, name, options):
    """lm-eval's batch_size (several questions per pass, mari_eval.evaluation.batching) in float32 on the GPU."""
    alone = _scores(_lm(model, tokenizer, bundles.get(name), batch_size=1, **options))
    for size in (4, "auto"):
        assert _worst(alone, _scores(_lm(model, tokenizer, bundles.get(name), batch_size=size, **options))) <= 1e-4


@pytest.mark.parametrize("name", ["vanilla", "caa", "mari", "reft"])
def test_batched_generation_on_cuda_equals_one_prompt_at_a_time(model, tokenizer, bundles, name):
    batched = _lm(model, tokenizer, bundles.get(name), batch_size=4).generate_until(_generations())
    alone = [_lm(model, tokenizer, bundles.get(name), batch_size=1).generate_until([r])[0] for r in _generations()]
    assert batched == alone


def test_a_gate_that_never_opens_is_exactly_vanilla_in_bf16_on_cuda(bf16_model, tokenizer, tmp_path):
    closed = tiny_bundles(bf16_model, tmp_path, closed_gate=True)["mari"]
    mari, vanilla = _lm(bf16_model, tokenizer, closed), _lm(bf16_model, tokenizer)
    assert mari.loglikelihood(_requests()) == vanilla.loglikelihood(_requests())
    assert mari.generate_until(_generations()) == vanilla.generate_until(_generations())
    assert mari.records and not any(r.get("gate_open") for r in mari.records)


def test_a_device_map_over_the_gpu_and_the_cpu_scores_like_the_gpu_alone(model, tokenizer, bundles, tmp_path):
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    one = _lm(model, tokenizer, bundles["mari"])
    spread = MariLM(pretrained=str(tmp_path / "model"), bundle=bundles["mari"], allow_other_model=True, dtype="float32",
                    parallelize=True, max_memory_per_gpu="12MB", max_cpu_memory="2GB")
    assert {str(d) for d in spread.model.hf_device_map.values()} == {"0", "cpu"}
    assert _worst(_scores(one), _scores(spread)) <= 1e-4
    assert one.generate_until(_generations()) == spread.generate_until(_generations())


@pytest.fixture(scope="module")
def checkpoint(model, tokenizer, tmp_path_factory):
    """The random model and its tokenizer saved as a checkpoint directory (what training loads)."""
    path = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.needs_data
@pytest.mark.parametrize("method", ["mari", "caa", "iti", "nl_iti", "reft"])
def test_every_method_trains_in_bf16_on_cuda_and_its_bundle_scores(checkpoint, method, tmp_path):
    from mari_eval import methods
    from mari_eval.injection.devices import Placement
    from mari_eval.training.train import train

    placement = Placement(dtype="bfloat16", device="cuda")
    path = train(method, "truthfulqa", checkpoint, seed=0, out=tmp_path / method, max_train=8, max_ctrl=8, max_pca=16,
                 placement=placement)
    bundle = methods.load_bundle(path)  # on the CPU, float32, whatever it was trained on
    assert all(t.device.type == "cpu" and torch.isfinite(t.float()).all() for t in bundle.tensors.values()
               if t.is_floating_point())
    # MARI's gate, calibrated on 8 control examples of a random model, may stay shut: its experts are scored
    experts = {"gate": "false"} if method == "mari" else {}
    edited = MariLM(pretrained=checkpoint, bundle=str(path), **placement.model_args(), **experts)
    vanilla = MariLM(pretrained=checkpoint, **placement.model_args())
    assert edited.model.device.type == "cuda" and edited.model.dtype == torch.bfloat16
    ours, base = _scores(edited), _scores(vanilla)
    assert all(torch.isfinite(torch.tensor(ours))) and ours != base
