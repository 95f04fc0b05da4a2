"""``mari-eval export-vector`` (``mari_eval.vectors.control_vector.export_gguf``): a CAA or control_vector bundle
written as a GGUF control vector in the layout repeng and llama.cpp use, ``direction.N`` being what the
bundle adds to the output of decoder layer N at scale 1; read back with ``gguf.GGUFReader`` and with
``import_gguf``; the refusals (other methods, layer 0, non-finite values, an existing file).

A CAA bundle is fitted on a random 4-layer Llama (hidden 32) through a character "tokenizer", in
about a second, on the CPU.
"""

import contextlib

import gguf
import numpy as np
import pytest
import torch

from baselines import caa
from mari_eval import methods
from mari_eval.vectors import control_vector
from mari_eval.methods.bundle_spec import BundleError
from mari_eval.methods.registry import BUILTIN_METHODS
from mari_eval.training.train import AttributeData, Example

from .test_control_vector import layer_outputs as every_layer_output
from .tiny import chat_free_session, tiny_caa, tiny_mari, tiny_model, tiny_reft

HIDDEN = 32
QUESTIONS = [("Is ice cold?", ["Yes", "No", "Warm"], 0), ("Is fire cold?", ["Yes", "No", "Wet"], 1),
             ("2+2?", ["3", "5", "4"], 2), ("Sky colour?", ["Blue", "Green", "Red"], 0),
             ("Capital of France?", ["Rome", "Paris", "Oslo"], 1), ("Do fish swim?", ["No", "Never", "Yes"], 2),
             ("Is the sun a star?", ["Yes", "No", "Moon"], 0), ("Legs of a cat?", ["Two", "Four", "Six"], 1)]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")  # 4 decoder layers, hidden 32


@pytest.fixture(scope="module")
def fitted(model):
    """A CAA bundle fitted on the tiny model: its grid has layers 1 and 3 and multipliers 2 and 3 only."""
    session = chat_free_session(model)
    examples = [Example(f"q{i}", session.encode_prompt(q + "\nA:"), [session.encode_prompt(" " + c) for c in choices],
                        gold, question=q, choices=choices) for i, (q, choices, gold) in enumerate(QUESTIONS)]
    config = {"base_model": {"name": "tiny", "hidden_size": HIDDEN, "num_layers": 4}, "site": {"layer": 1}}
    return caa.CAA.fit(session, AttributeData("tiny", None, [], examples, [], []), config,
                       {"layers": [1, 3], "multipliers": [2.0, 3.0]}, seed=0)


def read(path) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """(metadata fields, {tensor name: values}) of a GGUF file, every tensor checked to be 1-D F32."""
    reader = gguf.GGUFReader(path)
    fields = {key: reader.get_field(key).contents() for key in ("general.architecture", "controlvector.model_hint",
                                                                "controlvector.layer_count")}
    assert reader.get_field("controlvector.layer_count").types == [gguf.GGUFValueType.UINT32]  # as repeng writes it
    tensors = {}
    for tensor in reader.tensors:
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32 and len(tensor.shape) == 1
        tensors[tensor.name] = np.array(tensor.data)
    return fields, tensors


def layer_outputs(model, ids, bundle=None, positions=None) -> list[torch.Tensor]:
    """Every decoder layer's output ([T, d]) for ``ids``, under ``bundle``'s edit when given (its hooks
    installed first, so that test_control_vector's reading hooks see the edited state)."""
    with bundle.applied(model, positions) if bundle is not None else contextlib.nullcontext():
        return [out[0] for out in every_layer_output(model, ids)]


def saved(bundle, directory):
    bundle.save(directory)
    return directory


# ----------------------------------------------------------------------------- what is written


def test_a_caa_bundle_is_written_as_its_vector_times_its_multiplier_at_its_layer(fitted, model, tmp_path):
    layer, multiplier = fitted.layer, fitted.config["hyperparameters"]["multiplier"]
    assert layer in (1, 3) and multiplier in (2.0, 3.0)
    exported = control_vector.export_gguf(saved(fitted, tmp_path / "caa"), tmp_path / "caa.gguf", model_hint="llama")
    assert exported.layers == [layer] and exported.method == "caa" and exported.model_hint == "llama"
    fields, tensors = read(tmp_path / "caa.gguf")
    assert fields == {"general.architecture": "controlvector", "controlvector.model_hint": "llama",
                      "controlvector.layer_count": 1}
    assert list(tensors) == [f"direction.{layer}"]
    written = tensors[f"direction.{layer}"]
    assert np.array_equal(written, (multiplier * fitted.tensors["vector"]).numpy())
    # exactly what the bundle's edit adds, bit for bit
    assert np.array_equal(written, fitted.edit(torch.zeros(1, HIDDEN))[0].numpy())
    # ... and where: to the output of model.model.layers[layer] (llama.cpp's direction.N, N = layer), at p*
    ids = torch.tensor([[5, 17, 40, 3, 60]])
    base, steered = layer_outputs(model, ids), layer_outputs(model, ids, fitted, torch.tensor([4]))
    assert torch.equal(steered[layer - 1], base[layer - 1])
    assert torch.allclose(steered[layer][4] - base[layer][4], torch.from_numpy(written), atol=1e-5)


def test_export_then_import_gives_the_same_direction_and_the_documented_positions(fitted, model, tmp_path):
    path = control_vector.export_gguf(saved(fitted, tmp_path / "caa"), tmp_path / "caa.gguf", model_hint="llama").path
    imported = methods.load_bundle(control_vector.import_gguf(path, model, tmp_path / "cv"))
    layer = fitted.layer
    assert imported.layers == [layer] and imported.strength() == 1.0
    assert imported.config["source"]["model_hint"] == "llama"
    assert torch.equal(imported.tensors["directions"][0], fitted.config["hyperparameters"]["multiplier"]
                       * fitted.tensors["vector"])
    # exporting the imported bundle writes the same file's tensors and hint (its own hint is kept)
    again = control_vector.export_gguf(tmp_path / "cv", tmp_path / "again.gguf")
    (fields, tensors), (fields_again, tensors_again) = read(path), read(again.path)
    assert again.positions == control_vector.EVERY_POSITION and fields_again == fields
    assert list(tensors_again) == list(tensors) and all(np.array_equal(tensors_again[k], tensors[k]) for k in tensors)
    # the difference docs/methods.md states: CAA leaves the prompt tokens before p* alone, llama.cpp's
    # application (the imported bundle's) adds the same direction at every position
    ids = torch.tensor([[5, 17, 40, 3, 60]])
    base = layer_outputs(model, ids)[layer]
    by_caa = layer_outputs(model, ids, fitted, torch.tensor([4]))[layer] - base
    everywhere = layer_outputs(model, ids, imported)[layer] - base
    assert torch.equal(by_caa[:4], torch.zeros(4, HIDDEN))
    assert torch.allclose(everywhere, imported.tensors["directions"][0].expand(5, HIDDEN), atol=1e-5)


def test_a_control_vector_bundle_of_several_layers_is_written_with_its_strength(model, tmp_path):
    g = torch.Generator().manual_seed(1)
    vectors = {1: torch.randn(HIDDEN, generator=g), 3: torch.randn(HIDDEN, generator=g)}
    source = {"format": control_vector.GGUF_FORMAT, "sha256": "0" * 64, "model_hint": "mistral"}
    control_vector.build(vectors, model, source, strength=0.5).save(tmp_path / "cv")
    exported = control_vector.export_gguf(tmp_path / "cv", tmp_path / "cv.gguf")
    fields, tensors = read(exported.path)
    assert exported.layers == [1, 3] and fields["controlvector.layer_count"] == 2
    assert fields["controlvector.model_hint"] == "mistral"  # the imported vector's own hint
    assert list(tensors) == ["direction.1", "direction.3"]
    for layer, vector in vectors.items():
        assert np.array_equal(tensors[f"direction.{layer}"], (0.5 * vector).numpy())


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("method", ["mari", "reft"])
def test_a_method_that_is_not_a_single_direction_is_refused(tmp_path, method):
    bundle = tiny_mari() if method == "mari" else tiny_reft()
    with pytest.raises(BundleError, match=rf"method '{method}' \({bundle.label}\) cannot be exported as a control "
                                          r"vector.*Methods that can be: caa, control_vector"):
        control_vector.export_gguf(saved(bundle, tmp_path / method), tmp_path / "v.gguf", model_hint="llama")
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".*")) == []


def test_the_exportable_methods_listed_are_those_that_define_added_directions():
    found = {name for name in BUILTIN_METHODS
             if callable(getattr(methods.method_class(name), "added_directions", None))}
    assert found == set(control_vector.EXPORTABLE_METHODS)


@pytest.mark.parametrize("case, match", [
    ("layer zero", r"decoder layer 0, which would be direction.0: llama.cpp cannot load it.*layer of 1 or more"),
    ("overflow", r"non-finite value\(s\).*lower its strength"),
    ("no hint", r"model hint \(.*'tiny'\) cannot be read.*--model-hint llama"),
])
def test_what_llama_cpp_could_not_load_is_refused_naming_the_fix(tmp_path, case, match):
    bundle = {"layer zero": lambda: tiny_caa(layer=0), "overflow": lambda: tiny_caa(multiplier=3e38),
              "no hint": tiny_caa}[case]()
    hint = None if case == "no hint" else "llama"
    with pytest.raises(BundleError, match=match):
        control_vector.export_gguf(saved(bundle, tmp_path / "caa"), tmp_path / "v.gguf", model_hint=hint)
    assert not (tmp_path / "v.gguf").exists()


def test_an_existing_file_is_replaced_only_with_force(tmp_path):
    target = tmp_path / "v.gguf"
    target.write_bytes(b"mine")
    bundle_dir = saved(tiny_caa(), tmp_path / "caa")
    with pytest.raises(FileExistsError, match="exists: pass --force"):
        control_vector.export_gguf(bundle_dir, target, model_hint="llama")
    assert target.read_bytes() == b"mine"
    control_vector.export_gguf(bundle_dir, target, model_hint="llama", force=True)
    assert list(read(target)[1]) == ["direction.2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["caa", "v.gguf"]  # no temporary file left


# ----------------------------------------------------------------------------- the command


def test_export_vector_command_writes_the_file_and_refuses_with_an_error(model, tmp_path, capsys):
    from mari_eval import cli

    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    bundle = tiny_caa(layer=2, multiplier=3.0)
    bundle.config["base_model"]["name"] = str(model_dir)  # the hint is read from its config: model_type llama
    target = tmp_path / "out" / "caa.gguf"
    assert cli.main(["export-vector", str(saved(bundle, tmp_path / "caa")), str(target)]) == 0
    out = capsys.readouterr().out
    assert f"control vector: {target} (direction.2; model hint 'llama')" in out
    assert "note: the caa bundle adds it at the last prompt token and every later token" in out
    assert f"--control-vector-scaled {target}:S" in out  # today's llama.cpp syntax (issue 57.6)
    fields, tensors = read(target)
    assert fields["controlvector.model_hint"] == "llama"
    assert np.array_equal(tensors["direction.2"], (3.0 * bundle.tensors["vector"]).numpy())

    assert cli.main(["export-vector", str(tmp_path / "caa"), str(target)]) == 1  # exists, no --force
    assert "exists: pass --force" in capsys.readouterr().err
    assert cli.main(["export-vector", str(tmp_path / "caa"), str(target), "--force", "--model-hint", "qwen2"]) == 0
    assert read(target)[0]["controlvector.model_hint"] == "qwen2"

    assert cli.main(["export-vector", str(saved(tiny_mari(), tmp_path / "mari")), str(tmp_path / "m.gguf")]) == 1
    err = capsys.readouterr().err
    assert "error: method 'mari'" in err and "caa, control_vector" in err and not (tmp_path / "m.gguf").exists()
