"""``scale=`` at evaluation for the vector baselines (CAA, ITI, NL-ITI): it multiplies the trained
strength, is recorded in what lm-eval reports, and is refused by the methods without a vector."""

import math

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from baselines import caa, iti
from mari_eval import methods
from mari_eval.injection import site

from .helpers import capital_requests, saved_baseline_bundle, saved_mari_bundle
from .tiny import tiny_model

pytestmark = pytest.mark.e2e  # subprocesses or lm-eval runs of the embedded model throughout

MODEL = "smollm2-135m-instruct"
MULTIPLIER = 3.0


@pytest.fixture(scope="module")
def vanilla():
    return get_model("mari").create_from_arg_string(f"pretrained={MODEL},batch_size=4")


def _lm(bundle, extra=""):
    return get_model("mari").create_from_arg_string(f"pretrained={MODEL},bundle={bundle},batch_size=4{extra}")


def _caa(model, path=None, vector=None):
    d = model.config.hidden_size
    vector = torch.randn(d, generator=torch.Generator().manual_seed(1)) if vector is None else vector
    config = {"base_model": {"name": MODEL, "hidden_size": d, "num_layers": site.num_layers(model)},
              "site": {"layer": 12}, "hyperparameters": {"multiplier": MULTIPLIER}}
    bundle = caa.CAA(config, {"vector": vector})
    return bundle.save(path) if path is not None else bundle


def _with_added(model, layer, shift, context, continuation, tok):
    """The continuation's log-likelihood from one forward pass of the whole sequence, ``shift``
    added to the residual stream after ``layer`` from the last prompt token on (CAA's edit)."""
    ctx, cont = tok(context).input_ids, tok(continuation).input_ids
    p_star = torch.tensor([len(ctx) - 1])
    with torch.no_grad(), site.edit_from_site(model, layer, lambda h: h + shift.to(h), (torch.zeros_like(p_star), p_star)):
        logprobs = model(torch.tensor([ctx + cont])).logits.log_softmax(-1)[0, len(ctx) - 1:-1]
    return float(logprobs.gather(-1, torch.tensor(cont)[:, None]).sum())


# ----------------------------------------------------------------------------- the edit


@pytest.mark.parametrize("method", ["caa", "iti"])
def test_scale_zero_gives_exactly_the_untouched_models_loglikelihoods(tmp_path, vanilla, method):
    bundle = _caa(vanilla.model, tmp_path / "caa") if method == "caa" else saved_baseline_bundle(tmp_path, vanilla.model, "iti")
    off = _lm(bundle, ",scale=0")
    assert off.loglikelihood(capital_requests()) == vanilla.loglikelihood(capital_requests())  # exactly, not within a tolerance
    if method == "caa":  # the edit reaches generated tokens too: still the untouched model's answer
        request = lambda: [Instance("generate_until", {}, ("Q: Name a colour.\nA:", {"until": ["\n"], "max_gen_toks": 8}), 0)]
        assert off.generate_until(request()) == vanilla.generate_until(request())
    assert off.get_model_info()["mari_diagnostics"]["scale"] == 0.0


def test_caa_scale_two_adds_twice_the_trained_vector(tmp_path, vanilla):
    path = _caa(vanilla.model, tmp_path / "caa")
    lm = _lm(path, ",scale=2")
    vector = methods.load_bundle(path).tensors["vector"]
    for (got, _), request in zip(lm.loglikelihood(capital_requests()), capital_requests()):
        twice = _with_added(lm.model, 12, 2 * MULTIPLIER * vector, *request.args, lm.tokenizer)
        once = _with_added(lm.model, 12, MULTIPLIER * vector, *request.args, lm.tokenizer)
        assert abs(got - twice) <= 1e-4 and abs(got - once) > 1e-3
    summary = lm.get_model_info()["mari_diagnostics"]
    assert summary["scale"] == 2.0 and summary["multiplier"] == MULTIPLIER and summary["applied_multiplier"] == 2 * MULTIPLIER


def test_scale_multiplies_the_trained_strength_and_a_negative_one_reverses_the_vector():
    model = tiny_model("llama")
    d = model.config.hidden_size
    bundle = _caa(model, vector=torch.arange(d, dtype=torch.float32))
    h = torch.randn(5, d)
    assert torch.equal(bundle.edit(h), h + MULTIPLIER * bundle.tensors["vector"])  # the default: as trained
    bundle.configure_from({"scale": "-1"})
    assert torch.allclose(bundle.edit(h), h - MULTIPLIER * bundle.tensors["vector"])
    bundle.configure_from({"scale": "0"})
    assert torch.equal(bundle.edit(h), h)
    # ITI (and NL-ITI, its subclass): alpha times scale in every head's shift.
    heads = torch.tensor([[1, 0], [2, 3]])
    config = {"base_model": {"name": "tiny", "hidden_size": d, "num_layers": 4}, "site": {"layer": 1},
              "hyperparameters": {"alpha": 5.0}}
    for cls in (iti.ITI, iti.NLITI):
        shifted = cls(config, {"heads": heads, "sigma": torch.tensor([1.0, 2.0]),
                               "directions": torch.nn.functional.normalize(torch.randn(2, 8), dim=-1)})
        trained = shifted.shifts(model)
        shifted.configure_from({"scale": 2.5})
        assert trained.keys() == shifted.shifts(model).keys()
        for layer, shift in shifted.shifts(model).items():
            assert torch.allclose(shift, 2.5 * trained[layer], atol=1e-6)
        assert shifted.summarize([])["applied_alpha"] == 12.5


@pytest.mark.needs_data
def test_scale_is_recorded_in_the_results(tmp_path, vanilla, harness_task_manager):
    from lm_eval import simple_evaluate

    lm = _lm(_caa(vanilla.model, tmp_path / "caa"), ",scale=-0.5")
    out = simple_evaluate(model=lm, tasks=["truthfulqa_mc1"], limit=2, bootstrap_iters=0,
                          task_manager=harness_task_manager)
    summary = out["config"]["mari_diagnostics"]
    assert summary["scale"] == -0.5 and summary["applied_multiplier"] == -0.5 * MULTIPLIER and summary["prompts"] == 2


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("method", ["reft", "mari"])
def test_scale_is_refused_by_a_method_without_a_vector_naming_the_methods_that_take_it(tmp_path, vanilla, method):
    path = saved_mari_bundle(tmp_path, vanilla.model) if method == "mari" else saved_baseline_bundle(tmp_path, vanilla.model, "reft")
    message = rf"scale in --model_args: not an option of {method} bundles .*scale is an option of caa, control_vector, iti, nl_iti, steered_config bundles only"
    with pytest.raises(ValueError, match=message):
        methods.load_bundle(path).configure_from({"scale": "2"})
    with pytest.raises(ValueError, match=message):  # through lm-eval, before the model is loaded
        _lm(path, ",scale=2")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999"])
def test_a_non_finite_scale_is_refused(value):
    bundle = _caa(tiny_model("llama"))
    with pytest.raises(ValueError, match=rf"scale='{value}' in --model_args is not a finite number"):
        bundle.configure_from({"scale": value})
    with pytest.raises(ValueError, match="scale='twice' in --model_args is not a number"):
        bundle.configure_from({"scale": "twice"})
    assert bundle.scale == 1.0 and math.isfinite(bundle.strength())


def test_a_scale_needs_a_bundle():
    with pytest.raises(ValueError, match="scale in --model_args need a bundle"):
        get_model("mari").create_from_arg_string(f"pretrained={MODEL},scale=2")


def test_the_use_cache_path_must_name_the_bundle_and_its_options(tmp_path, vanilla):
    path = _caa(vanilla.model, tmp_path / "caa")
    bundle = methods.load_bundle(path)
    assert bundle.cache_fingerprint() == bundle.fingerprint()  # no option: the bundle's fingerprint, as before
    keys = set()
    for scale in ("0", "2", "-1"):
        bundle.configure_from({"scale": scale})
        keys.add(bundle.cache_fingerprint())
    assert len(keys) == 3 and bundle.fingerprint() not in keys
    lm = _lm(path, ",scale=2")

    class Hook:  # what CachingLM hands over: its SqliteDict, named by the --use_cache path
        class dbdict:
            filename = f"cache/mari-{bundle.fingerprint()}_rank0.db"

    with pytest.raises(ValueError, match=rf"fingerprint of this bundle with scale=2.0 in the cache path, e.g. "
                                         rf"--use_cache cache/mari-{lm.intervention.cache_fingerprint()}"):
        lm.set_cache_hook(Hook())
