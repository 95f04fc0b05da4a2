"""Control vectors (``mari_eval.vectors.control_vector``): a GGUF written in repeng's layout, or a
``steering_vectors.SteeringVector``, imported as a bundle that adds each direction after its layer at
every position (llama.cpp's application), times ``scale=``; and the refusals of what does not fit.

A random Llama (4 layers, hidden 64) over a byte tokenizer, float32 on the CPU; references are
computed by hand with forward hooks on a copy of the model.
"""

import copy
import hashlib
import json
import logging

import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance

from mari_eval import methods
from mari_eval.vectors import control_vector
from mari_eval.methods.bundle_spec import BundleError
from mari_eval.evaluation.lm import MariLM

from .tiny import byte_llama, byte_tokenizer

HIDDEN, LAYERS = 64, 4
PAIRS = [("Q: What is the capital of France?\nA:", " Paris."), ("Q: What is the capital of France?\nA:", " Lyon."),
         ("The sky is", " blue"), ("Water boils at", " 100 degrees.")]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return byte_llama(tokenizer, layers=LAYERS, hidden=HIDDEN)


def directions(layers=(1, 3), width=HIDDEN, seed=0) -> dict[int, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    return {layer: (2.0 * torch.randn(width, generator=g)).numpy() for layer in layers}


def write_gguf(path, vectors: dict, hint="llama", architecture="controlvector", dtype=np.float32):
    """A control vector file laid out as repeng's ``ControlVector.export_gguf`` writes one."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    if hint is not None:
        writer.add_string(f"{architecture}.model_hint", hint)
    writer.add_uint32(f"{architecture}.layer_count", len(vectors))
    for layer, vector in vectors.items():
        writer.add_tensor(f"direction.{layer}", np.asarray(vector, dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def imported(tmp_path, model, vectors=None, scale=1.0, name="cv", **kwargs):
    path = write_gguf(tmp_path / f"{name}.gguf", directions() if vectors is None else vectors, **kwargs)
    return control_vector.import_gguf(path, model, tmp_path / name, scale=scale)


def hooked_copy(model, vectors: dict, scale: float):
    """A copy of ``model`` whose decoder layer i adds ``scale * vectors[i]`` to its output, everywhere."""
    other = copy.deepcopy(model)
    for layer, vector in vectors.items():
        shift = scale * torch.as_tensor(vector, dtype=torch.float32)

        def hook(module, args, output, shift=shift):
            if isinstance(output, tuple):
                return (output[0] + shift, *output[1:])
            return output + shift

        other.model.layers[layer].register_forward_hook(hook)
    return other


def reference_loglikelihoods(model, tokenizer, pairs=PAIRS) -> list[float]:
    """Each continuation's log-likelihood from one forward pass of the whole sequence."""
    out = []
    for context, continuation in pairs:
        ctx, cont = tokenizer(context).input_ids, tokenizer(continuation).input_ids
        with torch.no_grad():
            logprobs = model(torch.tensor([ctx + cont])).logits.log_softmax(-1)[0, len(ctx) - 1:-1]
        out.append(float(logprobs.gather(-1, torch.tensor(cont)[:, None]).sum()))
    return out


def requests():
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]


def lm_for(model, tokenizer, bundle=None, batch_size=1, **options) -> MariLM:
    return MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=None if bundle is None else str(bundle),
                  allow_other_model=True if bundle else None, batch_size=batch_size, **options)


def scores(lm) -> list[float]:
    return [ll for ll, _ in lm.loglikelihood(requests())]


# ----------------------------------------------------------------------------- the edit


def layer_outputs(model, ids) -> list[torch.Tensor]:
    """Every decoder layer's output, read by hooks installed last (after any edit's hooks; transformers'
    own ``hidden_states`` may be recorded before them)."""
    seen = []
    handles = [layer.register_forward_hook(lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).clone()))
               for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_direction_n_is_added_to_the_output_of_decoder_layer_n(tmp_path, model):
    vector = directions(layers=(2,))
    bundle = methods.load_bundle(imported(tmp_path, model, vector))
    ids = torch.tensor([[5, 17, 40, 3, 99]])
    base = layer_outputs(model, ids)
    with bundle.applied(model, None):
        edited = layer_outputs(model, ids)
    assert torch.equal(edited[1], base[1])  # the output of layers[1] (hidden_states[2]): untouched
    shift = edited[2] - base[2]  # the output of layers[2] (hidden_states[3]), at every position
    assert torch.allclose(shift, torch.as_tensor(vector[2]).expand_as(shift), atol=1e-5)
    assert not torch.allclose(edited[3], base[3])
    assert bundle.config["site"]["layer"] == 2 and bundle.layers == [2]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_loglikelihoods_equal_the_directions_added_by_hand(tmp_path, model, tokenizer, batch_size):
    vectors = directions()
    lm = lm_for(model, tokenizer, imported(tmp_path, model, vectors), batch_size=batch_size)
    expected = reference_loglikelihoods(hooked_copy(model, vectors, 1.0), tokenizer)
    untouched = reference_loglikelihoods(model, tokenizer)
    got = scores(lm)
    assert np.allclose(got, expected, atol=1e-4)
    assert all(abs(g - u) > 1e-2 for g, u in zip(got, untouched))  # the vector does move every score
    # a p*-on edit (CAA's) would leave the prompt tokens before p* untouched, and score otherwise
    assert lm.plan.prompt_sites(6) == [0, 1, 2, 3, 4]


def test_scale_multiplies_the_directions_and_scale_zero_is_the_untouched_model(tmp_path, model, tokenizer):
    vectors = directions()
    path = imported(tmp_path, model, vectors, scale=0.5)  # --scale: the strength recorded in the bundle
    twice = lm_for(model, tokenizer, path, scale="2")
    assert np.allclose(scores(twice), reference_loglikelihoods(hooked_copy(model, vectors, 1.0), tokenizer), atol=1e-4)
    reversed_ = lm_for(model, tokenizer, path, scale="-4")
    assert np.allclose(scores(reversed_), reference_loglikelihoods(hooked_copy(model, vectors, -2.0), tokenizer), atol=1e-4)
    off = lm_for(model, tokenizer, path, scale="0")
    assert scores(off) == scores(lm_for(model, tokenizer))  # exactly, not within a tolerance
    summary = twice.get_model_info()["mari_diagnostics"]
    assert summary["scale"] == 2.0 and summary["strength"] == 0.5 and summary["applied_strength"] == 1.0


def test_generated_tokens_are_steered_too(tmp_path, model, tokenizer):
    vectors = directions(seed=3)
    request = lambda: [Instance("generate_until", {}, ("Q: Name a colour.\nA:", {"until": ["\n"], "max_gen_toks": 6}), 0)]
    steered = lm_for(model, tokenizer, imported(tmp_path, model, vectors), scale="3").generate_until(request())
    by_hand = lm_for(hooked_copy(model, vectors, 3.0), tokenizer).generate_until(request())
    untouched = lm_for(model, tokenizer).generate_until(request())
    assert steered == by_hand and steered != untouched


# ----------------------------------------------------------------------------- the bundle


def test_the_bundle_records_where_the_vector_came_from(tmp_path, model):
    path = imported(tmp_path, model, scale=1.5)
    config = json.loads((path / "bundle.json").read_text())
    assert config["method"] == "control_vector"
    assert config["base_model"] == {"name": "LlamaForCausalLM", "hidden_size": HIDDEN, "num_layers": LAYERS}
    assert config["site"]["layer"] == 1 and config["hyperparameters"] == {"layers": [1, 3], "strength": 1.5}
    digest = hashlib.sha256((tmp_path / "cv.gguf").read_bytes()).hexdigest()
    assert config["source"] == {"format": "gguf control vector", "file": "cv.gguf", "sha256": digest, "model_hint": "llama"}
    assert methods.load_bundle(path).tensors["directions"].shape == (2, HIDDEN)


def test_a_steering_vector_gives_the_same_bundle_tensors_as_the_gguf(tmp_path, model):
    from steering_vectors import SteeringVector

    vectors = directions()
    gguf_bundle = methods.load_bundle(imported(tmp_path, model, vectors))
    steering = SteeringVector({1: torch.as_tensor(vectors[1]), -1: torch.as_tensor(vectors[3])}, "decoder_block")
    sv_bundle = methods.load_bundle(control_vector.from_steering_vector(steering, model, tmp_path / "sv"))
    assert torch.equal(sv_bundle.tensors["directions"], gguf_bundle.tensors["directions"])
    assert sv_bundle.config["hyperparameters"] == gguf_bundle.config["hyperparameters"]
    assert sv_bundle.config["source"]["format"] == "steering_vectors.SteeringVector"


def test_steering_vectors_own_application_scores_the_same(tmp_path, model, tokenizer):
    from steering_vectors import SteeringVector

    vectors = directions(seed=5)
    steering = SteeringVector({k: torch.as_tensor(v) for k, v in vectors.items()}, "decoder_block")
    lm = lm_for(model, tokenizer, control_vector.from_steering_vector(steering, model, tmp_path / "sv", scale=2.0))
    with steering.apply(model, multiplier=2.0):
        expected = reference_loglikelihoods(model, tokenizer)
    assert np.allclose(scores(lm), expected, atol=1e-4)


def test_a_bundle_edited_by_hand_to_name_unordered_layers_is_refused(tmp_path, model):
    path = imported(tmp_path, model)
    config = json.loads((path / "bundle.json").read_text())
    config["hyperparameters"]["layers"] = [3, 1]
    (path / "bundle.json").write_text(json.dumps(config))
    with pytest.raises(BundleError, match="import the vector again"):
        methods.load_bundle(path)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("case, match", [
    ("not gguf", "is not a GGUF file.*repeng's ControlVector.export_gguf"),
    ("a model", "general.architecture 'llama', not a control vector.*Give the .gguf"),
    ("width", "has 48 values.*hidden size is 64.*--model naming"),
    ("beyond", "layer 4 is beyond.*4 decoder layers.*--model naming"),
    ("layer zero", "direction.0 names layer 0.*from_steering_vector"),
    ("nan", "non-finite.*export it again"),
    ("other architecture", "made for a 'qwen2' model.*--allow-other-model"),
    ("other names", "not named direction.N.*Rename it"),
    ("a digit that is not ASCII", "'direction.\u0665' is not named direction.N"),  # str.isdigit's "5" in Arabic-Indic
])
def test_what_does_not_fit_is_refused_naming_the_fix(tmp_path, model, case, match):
    path = tmp_path / "v.gguf"
    if case == "not gguf":
        path.write_bytes(b"PK\x03\x04 not a gguf file at all" * 10)
    elif case == "a model":
        write_gguf(path, directions(), architecture="llama")
    elif case == "width":
        write_gguf(path, directions(width=48))
    elif case == "beyond":
        write_gguf(path, directions(layers=(1, LAYERS)))
    elif case == "layer zero":
        write_gguf(path, directions(layers=(0, 1)))
    elif case == "nan":
        vectors = directions()
        vectors[3][7] = np.nan
        write_gguf(path, vectors)
    elif case == "other architecture":
        write_gguf(path, directions(), hint="qwen2")
    elif case == "a digit that is not ASCII":
        write_gguf(path, {"\u0665": directions()[1]})
    else:
        import gguf

        writer = gguf.GGUFWriter(str(path), "controlvector")
        writer.add_tensor("steer.1", directions()[1])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    with pytest.raises(BundleError, match=match):
        control_vector.import_gguf(path, model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_another_architectures_vector_imports_with_allow_other_model_and_a_warning(tmp_path, model, caplog):
    path = write_gguf(tmp_path / "v.gguf", directions(), hint="qwen2")
    with caplog.at_level(logging.WARNING, logger="mari_eval.vectors.control_vector"):
        out = control_vector.import_gguf(path, model, tmp_path / "out", allow_other_model=True)
    assert "qwen2" in caplog.text and methods.load_bundle(out).config["source"]["model_hint"] == "qwen2"
    # the spellings of one architecture in repeng's hints (model_type) and llama.cpp's (GGUF arch) agree
    for hint in ("mistral", "LLaMA"):
        control_vector.import_gguf(write_gguf(tmp_path / f"{hint}.gguf", directions(), hint=hint), model,
                                   tmp_path / hint)


def test_an_out_holding_other_files_is_refused_before_reading(tmp_path, model):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt.*move them away"):
        control_vector.import_gguf(tmp_path / "missing.gguf", model, out)
    assert (out / "notes.txt").read_text() == "mine"


def test_a_steering_vector_of_other_layers_is_refused(tmp_path, model):
    from steering_vectors import SteeringVector

    steering = SteeringVector({1: torch.ones(HIDDEN)}, "mlp")
    with pytest.raises(BundleError, match="'mlp' layers.*layer_type='decoder_block'"):
        control_vector.from_steering_vector(steering, model, tmp_path / "sv")


@pytest.mark.parametrize("key", [5.7, "3", True, 99])
def test_a_steering_vectors_layer_key_is_an_integer_in_range(tmp_path, model, key):
    # int(5.7) would have steered layer 5 (issue 56.3); a bool is not a layer either.
    from steering_vectors import SteeringVector

    with pytest.raises(BundleError, match=r"layer_activations has key\(s\).*a layer is an integer from -4 to 3"):
        control_vector.from_steering_vector(SteeringVector({key: torch.ones(HIDDEN)}, "decoder_block"), model, tmp_path / "sv")
    assert not (tmp_path / "sv").exists()


def test_a_control_vector_is_not_trained_but_imported():
    cls = methods.method_class("control_vector")
    assert cls.label == "Control vector"
    with pytest.raises(ValueError, match="mari-eval import-vector"):
        cls.training_hyperparameters({})
    with pytest.raises(ValueError, match="from_steering_vector"):
        cls.fit(None, None, {}, {}, 0)


def test_scale_must_be_a_finite_number(tmp_path, model, tokenizer):
    path = imported(tmp_path, model)
    with pytest.raises(ValueError, match="not a finite number"):
        lm_for(model, tokenizer, path, scale="inf")
    with pytest.raises(ValueError, match="not a finite number"):
        control_vector.import_gguf(tmp_path / "cv.gguf", model, tmp_path / "other", scale=float("nan"))


# ----------------------------------------------------------------------------- the command


def test_import_vector_command_writes_a_bundle_and_refuses_with_an_error(tmp_path, model, capsys):
    from mari_eval import cli

    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    vectors = directions()
    gguf_path = write_gguf(tmp_path / "v.gguf", vectors)
    assert cli.main(["import-vector", str(gguf_path), "--model", str(model_dir), "--out", str(tmp_path / "b"),
                     "--scale", "2"]) == 0
    assert f"bundle: {tmp_path / 'b'}" in capsys.readouterr().out
    bundle = methods.load_bundle(tmp_path / "b")
    assert bundle.config["base_model"]["name"] == str(model_dir) and bundle.strength() == 2.0
    assert np.allclose(bundle.tensors["directions"].numpy(), np.stack([vectors[1], vectors[3]]))
    bundle.check_compatible(model, str(model_dir))
    bad = write_gguf(tmp_path / "bad.gguf", directions(width=48))
    assert cli.main(["import-vector", str(bad), "--model", str(model_dir), "--out", str(tmp_path / "c")]) == 1
    assert "error:" in capsys.readouterr().err and not (tmp_path / "c").exists()
