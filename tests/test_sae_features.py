"""lm-eval's SAE-feature steering CSVs imported from local SAE safetensors (mari_eval/vectors/sae_features.py,
issue 57.3): the bundle scores as lm-eval's own SteeredModel given the config its derive_steer_config
builds from the same files. sparsify and sae_lens are not installed: derive_steer_config runs with
two stand-ins that read the SAE files as those libraries' load functions would (W_dec, b_dec)."""

import json
import sys
import types

import pytest
import torch
from lm_eval.models.hf_steered import SteeredModel
from safetensors.torch import load_file, save_file

from mari_eval import cli, methods
from mari_eval.vectors import steer_config
from mari_eval.methods.bundle_spec import BundleError
from mari_eval.evaluation.lm import MariLM

from .test_steer_config import _loglikelihoods
from .test_batching import model, tokenizer  # noqa: F401 (its byte Llama's fixtures)

HEADER = "loader,action,sparse_model,hookpoint,feature_index,steering_coefficient,head_index,sae_id,description"
FEATURES = 32


def write_sae(path, hidden, seed=0, transposed=False, drop=()):
    """An SAE's safetensors as sparsify and sae_lens save one: W_dec [features, d_model], b_dec [d_model]."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"W_enc": torch.randn(hidden, FEATURES, generator=g), "W_dec": torch.randn(FEATURES, hidden, generator=g),
               "b_dec": 0.1 * torch.randn(hidden, generator=g)}
    if transposed:
        tensors["W_dec"] = tensors["W_dec"].T.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(path))
    (path.parent / "cfg.json").write_text(json.dumps({"d_in": hidden, "num_latents": FEATURES}))
    return path


def write_csv(path, rows):
    path.write_text("\n".join([HEADER] + rows) + "\n")
    return path


@pytest.fixture()
def saes(tmp_path, model):
    """A sparsify folder (one SAE per hookpoint, lm-eval's layout) and a sae_lens save_model folder."""
    hidden = model.config.hidden_size
    write_sae(tmp_path / "sparsify" / "layers.1" / "sae.safetensors", hidden, seed=1)
    write_sae(tmp_path / "sparsify" / "layers.3" / "sae.safetensors", hidden, seed=3)
    write_sae(tmp_path / "saelens" / "sae_weights.safetensors", hidden, seed=2)
    return tmp_path


@pytest.fixture()
def stand_ins(monkeypatch):
    """sparsify.SparseCoder.load_from_disk and sae_lens.SAE.from_pretrained reading local files."""
    def coder(weights):
        tensors = load_file(str(weights))
        return types.SimpleNamespace(W_dec=tensors["W_dec"], b_dec=tensors["b_dec"],
                                     cfg=types.SimpleNamespace(hook_name="blocks.0.hook_resid_post"))

    sparsify = types.ModuleType("sparsify")
    sparsify.SparseCoder = types.SimpleNamespace(load_from_disk=lambda path: coder(path / "sae.safetensors"))
    sae_lens = types.ModuleType("sae_lens")
    sae_lens.SAE = types.SimpleNamespace(from_pretrained=lambda release, sae_id: (coder(f"{release}/sae_weights.safetensors"),))
    monkeypatch.setitem(sys.modules, "sparsify", sparsify)
    monkeypatch.setitem(sys.modules, "sae_lens", sae_lens)


def lm_evals_config(csv_path) -> dict:
    """derive_steer_config's own config, the bias of add rows dropped (its SteeredModel refuses one)."""
    config = SteeredModel.derive_steer_config(str(csv_path))
    return {hookpoint: {**entry, "bias": entry["bias"] if entry["action"] == "clamp" else None, "head_index": None}
            for hookpoint, entry in config.items()}


def test_an_sae_csv_scores_as_lm_evals_steered_model(saes, model, tokenizer, stand_ins, tmp_path, capsys):
    csv_path = write_csv(tmp_path / "features.csv", [
        f"sparsify,add,{saes / 'sparsify'},layers.1,5,4.0,,,more of feature 5",
        f"sae_lens,clamp,{saes / 'saelens'},layers.2,7,-1.5,,,feature 7 held at -1.5"])
    torch.save(lm_evals_config(csv_path), tmp_path / "theirs.pt")
    model.save_pretrained(tmp_path / "model")  # the command reads its config
    assert cli.main(["import-vector", str(csv_path), "--model", str(tmp_path / "model"), "--out", str(tmp_path / "b")]) == 0
    assert f"bundle: {tmp_path / 'b'}" in capsys.readouterr().out
    theirs = _loglikelihoods(SteeredModel(pretrained=model, tokenizer=tokenizer, steer_path=str(tmp_path / "theirs.pt"),
                                          device="cpu", dtype="float32"))
    ours = _loglikelihoods(MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32",
                                  bundle=str(tmp_path / "b"), allow_other_model=True))
    plain = _loglikelihoods(MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32"))
    assert ours == pytest.approx(theirs, abs=1e-4)  # measured: max |difference| 3.8e-6
    assert max(abs(a - b) for a, b in zip(theirs, plain)) > 1e-2  # the features do steer
    bundle = methods.load_bundle(tmp_path / "b")
    w1 = load_file(str(saes / "sparsify" / "layers.1" / "sae.safetensors"))
    w2 = load_file(str(saes / "saelens" / "sae_weights.safetensors"))
    assert torch.equal(bundle.tensors["vectors"], torch.stack([w1["W_dec"][5], w2["W_dec"][7]]))
    assert torch.equal(bundle.tensors["biases"], torch.stack([torch.zeros(model.config.hidden_size), w2["b_dec"]]))
    source = bundle.config["source"]
    assert source["format"] == steer_config.CSV_FORMAT and source["file"] == "features.csv"
    assert [f["file"] for f in source["sae_files"]] == ["layers.1/sae.safetensors", "saelens/sae_weights.safetensors"]
    # why an add row's bias is dropped: lm-eval 0.4.13 attaches b_dec to every row, and its own add refuses a bias
    with pytest.raises(AssertionError, match="Bias is not supported"):
        SteeredModel(pretrained=model, tokenizer=tokenizer, steer_path=str(csv_path), device="cpu", dtype="float32")


def test_a_later_row_on_one_hookpoint_replaces_the_earlier_as_in_lm_eval(saes, model, stand_ins, tmp_path, caplog):
    csv_path = write_csv(tmp_path / "twice.csv", [
        f"sparsify,add,{saes / 'sparsify'},layers.1,5,4.0,,,",
        f"sparsify,add,{saes / 'sparsify'},layers.3,2,1.0,,,",
        f"sparsify,clamp,{saes / 'sparsify'},layers.1,9,2.5,,,"])
    bundle = methods.load_bundle(steer_config.import_steer_file(csv_path, model, tmp_path / "b"))
    theirs = lm_evals_config(csv_path)
    assert bundle.config["hyperparameters"] == {"layers": [1, 3], "actions": ["clamp", "add"], "coefficients": [2.5, 1.0]}
    assert [theirs[h]["action"] for h in ("layers.1", "layers.3")] == ["clamp", "add"]
    assert torch.equal(bundle.tensors["vectors"], torch.stack([theirs["layers.1"]["steering_vector"],
                                                               theirs["layers.3"]["steering_vector"]]))
    assert torch.equal(bundle.tensors["biases"][0], theirs["layers.1"]["bias"])
    assert "row 4 replaces row 2 on hookpoint layers.1" in caplog.text


def test_a_bare_safetensors_file_and_a_relative_path_read_the_same_sae(saes, model, tmp_path):
    folder = write_csv(tmp_path / "folder.csv", [f"sparsify,add,{saes / 'sparsify'},layers.1,5,4.0,,,"])
    bare = write_csv(tmp_path / "bare.csv", ["sparsify,add,sparsify/layers.1/sae.safetensors,layers.1,5,4.0,,,"])
    a = methods.load_bundle(steer_config.import_steer_file(folder, model, tmp_path / "a"))
    b = methods.load_bundle(steer_config.import_steer_file(bare, model, tmp_path / "b"))  # relative to the CSV's folder
    assert torch.equal(a.tensors["vectors"], b.tensors["vectors"])


@pytest.mark.parametrize("row, match", [
    ("sparsify,add,EleutherAI/sae-pythia-70m-32k,layers.1,5,4.0,,,", "not a local file or folder. lm-eval would download"),
    ("sparsify,add,{sparsify},layers.1,32,4.0,,,", "feature_index 32 is beyond the SAE's 32 features"),
    ("sparsify,add,{sparsify},layers.1,-1,4.0,,,", "feature_index '-1' is not a feature's row"),
    ("sparsify,add,{sparsify},layers.1,5,nan,,,", "steering_coefficient 'nan' is not a finite number"),
    ("sparsify,add,{sparsify},layers.1,5,4.0,3,,", "head_index '3': lm-eval's CSV reader ignores this column"),
    ("sae_lens,add,{saelens},,5,4.0,,,", "no hookpoint. lm-eval would take the SAE's cfg hook_name"),
    ("sparsify,scale,{sparsify},layers.1,5,4.0,,,", "action 'scale' is neither add nor clamp"),
    ("dictionary,add,{sparsify},layers.1,5,4.0,,,", "loader 'dictionary' is neither sparsify nor sae_lens"),
    ("sparsify,add,{transposed},layers.1,5,4.0,,,", r"is \[64, 32\]: stored transposed"),
    ("sparsify,add,{narrow},layers.1,5,4.0,,,", "its rows have 48 values, the model's hidden size is 64"),
    ("sparsify,add,{no_w_dec},layers.1,5,4.0,,,", "holds no W_dec tensor"),
    ("sparsify,clamp,{no_b_dec},layers.1,5,4.0,,,", "a clamp is centred on the SAE's b_dec"),
    ("sparsify,add,{saelens},layers.1,5,4.0,,,", "no sae.safetensors in"),
    ("sparsify,add,{sparsify},layers.1.mlp,5,4.0,,,", "only a decoder layer's output"),
])
def test_what_cannot_be_imported_is_refused_naming_the_fix(saes, model, tmp_path, row, match):
    hidden = model.config.hidden_size
    files = {"sparsify": saes / "sparsify", "saelens": saes / "saelens",
             "transposed": write_sae(tmp_path / "t" / "sae.safetensors", hidden, transposed=True),
             "narrow": write_sae(tmp_path / "n" / "sae.safetensors", 48),
             "no_w_dec": write_sae(tmp_path / "w" / "sae.safetensors", hidden, drop=("W_dec",)),
             "no_b_dec": write_sae(tmp_path / "d" / "sae.safetensors", hidden, drop=("b_dec",))}
    if "{sparsify},layers.1.mlp" in row:
        write_sae(saes / "sparsify" / "layers.1.mlp" / "sae.safetensors", hidden)
    csv_path = write_csv(tmp_path / "bad.csv", [row.format(**files)])
    with pytest.raises(BundleError, match=match):
        steer_config.import_steer_file(csv_path, model, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


def test_a_csv_without_lm_evals_columns_or_rows_is_refused(model, tmp_path):
    (tmp_path / "cols.csv").write_text("sparse_model,feature_index\nx,1\n")
    with pytest.raises(BundleError, match="no column loader, hookpoint, steering_coefficient"):
        steer_config.import_steer_file(tmp_path / "cols.csv", model, tmp_path / "b")
    with pytest.raises(BundleError, match="no rows under the header"):
        steer_config.import_steer_file(write_csv(tmp_path / "empty.csv", []), model, tmp_path / "b")
