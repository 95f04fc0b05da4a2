"""LoRA bundles and peft adapters, both ways (baselines/lora_peft.py): an adapter peft itself saved
imports and scores what peft's PeftModel scores; an exported bundle loads with
PeftModel.from_pretrained under the names peft itself saves and scores what the bundle's hooks
score; export then import gives the tensors back exactly; what a bundle cannot hold is refused,
naming the fix; the two commands work."""

import copy
import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from baselines import lora_peft
from mari_eval import cli, methods
from mari_eval.methods.bundle_spec import BundleError

from .test_lora import by_hand, peft_model, random_bundle, score
from .tiny import tiny_model

CONTEXT, OPTIONS = [3, 14, 15, 92, 65, 35, 89, 79], [[32, 38], [46, 26, 43], [7]]


def gap(model, bundle, reference):
    """Largest difference between the bundle's scores (hooks) and ``reference``'s (a PeftModel), and
    between the bundle's and the untouched model's."""
    got = score(model, bundle, CONTEXT, OPTIONS)
    expected = [by_hand(reference, CONTEXT, option) for option in OPTIONS]
    untouched = [by_hand(model, CONTEXT, option) for option in OPTIONS]
    return (max(abs(float(a) - b) for a, b in zip(got, expected)),
            max(abs(float(a) - b) for a, b in zip(got, untouched)))


@pytest.fixture
def saved(tmp_path):
    """(model, bundle, a PeftModel holding the bundle's A and B, the directory peft saved it to)."""
    model = tiny_model("llama")
    bundle = random_bundle(model, layers=[1, 3])
    reference = peft_model(model, bundle)
    reference.save_pretrained(tmp_path / "adapter")
    return model, bundle, reference, tmp_path / "adapter"


def test_export_writes_the_names_and_config_peft_saves(saved, tmp_path):
    model, bundle, _, adapter = saved
    out = lora_peft.export_peft(bundle, tmp_path / "exported")
    theirs, ours = load_file(adapter / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in ours
    assert sorted(ours) == sorted(theirs) and len(ours) == 8
    assert all(ours[k].shape == theirs[k].shape and torch.equal(ours[k], theirs[k]) for k in ours)
    mine, peft_own = (json.loads((d / "adapter_config.json").read_text()) for d in (out, adapter))
    for key in ("peft_type", "r", "lora_alpha", "layers_to_transform", "bias", "lora_dropout", "use_rslora", "use_dora"):
        assert mine[key] == peft_own[key], key
    assert sorted(mine["target_modules"]) == sorted(peft_own["target_modules"])
    assert mine["task_type"] == "CAUSAL_LM" and mine["base_model_name_or_path"] == "tiny"
    # with the model given, its own module names: the same
    again = lora_peft.export_peft(bundle, tmp_path / "named", model=model)
    assert sorted(load_file(again / "adapter_model.safetensors")) == sorted(theirs)


def test_exported_adapter_scores_as_the_bundle_in_peft(tmp_path):
    from peft import PeftModel

    model = tiny_model("llama")
    bundle = random_bundle(model)
    out = lora_peft.export_peft(bundle, tmp_path / "exported")
    reference = PeftModel.from_pretrained(copy.deepcopy(model), str(out)).eval()
    difference, effect = gap(model, bundle, reference)
    assert difference <= 1e-4 and effect > 1e-2


def test_an_adapter_peft_saved_imports_and_scores_as_peft(saved, tmp_path):
    model, bundle, reference, adapter = saved
    path = lora_peft.import_peft(adapter, model, tmp_path / "bundle")
    loaded = methods.load_bundle(path)
    assert type(loaded).method == "lora" and set(loaded.config["hyperparameters"]) == {"rank", "alpha", "targets", "layers"}
    assert loaded.config["hyperparameters"] == {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"], "layers": [1, 3]}
    assert "diagnostics" not in loaded.config
    source = loaded.config["source"]
    assert source["format"] == "peft LoRA adapter" and source["use_rslora"] is False
    assert source["sha256"] == hashlib.sha256((adapter / "adapter_model.safetensors").read_bytes()).hexdigest()
    loaded.check_compatible(model, loaded.config["base_model"]["name"])
    difference, effect = gap(model, loaded, reference)
    assert difference <= 1e-4 and effect > 1e-2


def test_rslora_scaling_is_alpha_over_sqrt_r(tmp_path):
    from peft import get_peft_model

    model = tiny_model("llama")
    bundle = random_bundle(model, rank=4, alpha=8.0)  # alpha / r = 2; rsLoRA's alpha / sqrt(r) = 4
    config = lora_peft.peft_config(bundle)
    config.use_rslora = True
    reference = get_peft_model(copy.deepcopy(model), config).eval()
    reference.load_state_dict(peft_model(model, bundle).state_dict())
    assert {m.scaling["default"] for m in reference.modules() if hasattr(m, "lora_A")} == {4.0}
    reference.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["use_rslora"] is True
    loaded = methods.load_bundle(lora_peft.import_peft(tmp_path / "adapter", model, tmp_path / "bundle"))
    assert loaded.scaling == pytest.approx(4.0) and loaded.config["source"]["use_rslora"] is True
    assert gap(model, loaded, reference)[0] <= 1e-4
    assert gap(model, bundle, reference)[0] > 1e-3  # the same A and B at alpha / r score otherwise


def test_export_then_import_gives_the_tensors_back_exactly(tmp_path):
    model = tiny_model("llama")
    bundle = random_bundle(model, targets=("q_proj", "k_proj", "v_proj", "o_proj"), layers=[0, 2, 3])
    lora_peft.export_peft(bundle, tmp_path / "adapter")
    back = methods.load_bundle(lora_peft.import_peft(tmp_path / "adapter", model, tmp_path / "bundle",
                                                     allow_other_model=True))
    assert back.config["hyperparameters"] == bundle.config["hyperparameters"]
    assert back.tensors.keys() == bundle.tensors.keys()
    assert all(torch.equal(back.tensors[k], bundle.tensors[k]) for k in bundle.tensors)


# ----------------------------------------------------------------------------- refusals


def edited_config(adapter, **changes):
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edited_weights(adapter, edit):
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


Q1 = "base_model.model.model.layers.1.self_attn.q_proj"
REFUSALS = {
    "not lora": (lambda a: edited_config(a, peft_type="IA3"), "not 'LORA'"),
    "dora": (lambda a: edited_config(a, use_dora=True), "use_dora is set.*retrain the adapter without it"),
    "bias": (lambda a: edited_config(a, bias="all"), "retrain it with bias='none'"),
    "modules_to_save": (lambda a: edited_config(a, modules_to_save=["lm_head"]), "retrain without modules_to_save"),
    "rank_pattern": (lambda a: edited_config(a, rank_pattern={"v_proj": 2}), "rank_pattern.*one rank"),
    "alpha_pattern": (lambda a: edited_config(a, alpha_pattern={"v_proj": 16}), "alpha_pattern.*retrain"),
    "pickle": (lambda a: (a / "adapter_model.safetensors").rename(a / "adapter_model.bin"), "convert to safetensors"),
    "non-finite": (lambda a: edited_weights(a, lambda t: t[f"{Q1}.lora_A.weight"].__setitem__((0, 0), float("nan"))),
                   "non-finite.*retrain"),
    "not a decoder Linear": (lambda a: edited_weights(a, lambda t: t.update(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32), "base_model.model.lm_head.lora_B.weight":
         torch.zeros(97, 4)})), "lm_head is not a Linear module of a decoder layer.*--model"),
    "embedding": (lambda a: edited_weights(a, lambda t: t.update(
        {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 97)})), "Linear modules only"),
    "shape": (lambda a: edited_weights(a, lambda t: t.update({f"{Q1}.lora_B.weight": torch.zeros(16, 4)})),
              "trained for another model; import it with --model"),
    "missing": (lambda a: edited_weights(a, lambda t: t.pop(f"{Q1}.lora_B.weight")), "lacks lora_A or lora_B of q_proj"),
    "other model": (lambda a: edited_config(a, base_model_name_or_path="meta-llama/Llama-3.2-1B"),
                    "--allow-other-model"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_a_bundle_cannot_hold_is_refused_with_the_fix(saved, tmp_path, case):
    model, _, _, adapter = saved
    lora_peft.import_peft(adapter, model, tmp_path / "fine")  # as saved: imported
    edit, fix = REFUSALS[case]
    edit(adapter)
    with pytest.raises(BundleError, match=fix):
        lora_peft.import_peft(adapter, model, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


def test_trivial_patterns_are_accepted_and_other_model_can_be_allowed(saved, tmp_path):
    model, bundle, _, adapter = saved
    edited_config(adapter, rank_pattern={"v_proj": 4}, alpha_pattern={"q_proj": 8},
                  base_model_name_or_path="meta-llama/Llama-3.2-1B")
    path = lora_peft.import_peft(adapter, model, tmp_path / "bundle", allow_other_model=True)
    loaded = methods.load_bundle(path)
    assert loaded.config["source"]["base_model_name_or_path"] == "meta-llama/Llama-3.2-1B"
    assert all(torch.equal(loaded.tensors[k], bundle.tensors[k]) for k in bundle.tensors)


def test_an_out_holding_other_files_and_a_bundle_of_another_method_are_refused(saved, tmp_path):
    from .tiny import tiny_caa

    model, bundle, _, adapter = saved
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        lora_peft.import_peft(adapter, model, tmp_path / "busy")
    with pytest.raises(FileExistsError, match="notes.txt"):
        lora_peft.export_peft(bundle, tmp_path / "busy")
    with pytest.raises(BundleError, match="only lora bundles"):
        lora_peft.export_peft(tiny_caa().save(tmp_path / "caa"), tmp_path / "caa_adapter")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- the commands


def test_import_lora_and_export_lora_commands(saved, tmp_path, capsys):
    model, bundle, reference, adapter = saved
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    args = ["import-lora", str(adapter), "--model", str(model_dir), "--out", str(tmp_path / "b")]
    assert cli.main(args) == 0
    assert f"bundle: {tmp_path / 'b'}" in capsys.readouterr().out
    imported = methods.load_bundle(tmp_path / "b")
    assert imported.config["base_model"] == {"name": str(model_dir), "hidden_size": 32, "num_layers": 4}
    imported.check_compatible(model, str(model_dir))
    assert gap(model, imported, reference)[0] <= 1e-4
    assert cli.main(["export-lora", str(tmp_path / "b"), "--out", str(tmp_path / "a")]) == 0
    assert "peft adapter:" in capsys.readouterr().out
    exported = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert exported.keys() == load_file(adapter / "adapter_model.safetensors").keys()
    # an adapter for another model name: an error, unless allowed
    edited_config(tmp_path / "a", base_model_name_or_path="tiny")
    again = ["import-lora", str(tmp_path / "a"), "--model", str(model_dir), "--out", str(tmp_path / "c")]
    assert cli.main(again) == 1
    assert "--allow-other-model" in capsys.readouterr().err and not (tmp_path / "c").exists()
    assert cli.main([*again, "--allow-other-model"]) == 0
    back = methods.load_bundle(tmp_path / "c")
    assert all(torch.equal(back.tensors[k], bundle.tensors[k]) for k in bundle.tensors)
