"""What a bundle must hold, checked when it is loaded (docs/troubleshooting.md, bundles):
typed and ranged bundle.json fields for every method, tensors of the dtype and shape its
config implies, finite weights, readable JSON; and a bundle saved whole or not at all."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from mari_eval import mari, methods
from mari_eval.methods import intervention
from mari_eval.storage import files
from mari_eval.mari import fit as mari_fit

from .tiny import tiny_caa, tiny_iti, tiny_reft
from .tiny import tiny_mari
from .helpers import dead_pid
from .tiny import tiny_examples, tiny_session
from .tiny import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama")  # hidden size 32, 4 layers, 4 heads


MAKERS = {
    "mari": lambda model: tiny_mari(),
    "caa": lambda model: tiny_caa(),
    "iti": lambda model: tiny_iti(model),
    "reft": lambda model: tiny_reft(rank=2),
}


def _saved(tmp_path, method, model):
    return MAKERS[method](model).save(tmp_path / method)


def _tamper(path, config=None, tensors=None):
    """Rewrite a saved bundle's files: ``config(dict)`` and ``tensors(dict)`` edit them in place."""
    if config is not None:
        meta = json.loads((path / methods.BUNDLE_JSON).read_text())
        config(meta)
        (path / methods.BUNDLE_JSON).write_text(json.dumps(meta))
    if tensors is not None:
        stored = load_file(path / methods.BUNDLE_WEIGHTS)
        tensors(stored)
        save_file(stored, path / methods.BUNDLE_WEIGHTS)
    return path


def _set(key_path, value):
    def edit(meta):
        *parents, last = key_path.split(".")
        node = meta
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return edit


_DELETE = object()


# ----------------------------------------------------------------------------- non-finite weights


@pytest.mark.parametrize("method,tensor,bad,message", [
    ("mari", "expert_U", float("nan"), r"holds 3 non-finite value\(s\) of 192 \(3 NaN, 0 infinite\)"),
    ("mari", "ctrl_energy", float("inf"), r"holds 3 non-finite value\(s\) of 20 \(0 NaN, 3 infinite\)"),
    ("caa", "vector", float("nan"), r"holds 3 non-finite value\(s\) of 32 \(3 NaN, 0 infinite\)"),
    ("iti", "sigma", float("-inf"), r"holds 3 non-finite value\(s\) of 3 \(0 NaN, 3 infinite\)"),
    ("reft", "W", float("nan"), r"holds 3 non-finite value\(s\) of 64 \(3 NaN, 0 infinite\)"),
])
def test_a_bundle_with_non_finite_weights_is_refused_naming_file_tensor_and_count(tmp_path, tiny, method, tensor, bad,
                                                                                  message):
    def poison(stored):
        stored[tensor].view(-1)[:3] = bad

    path = _tamper(_saved(tmp_path, method, tiny), tensors=poison)
    with pytest.raises(methods.BundleError, match=re.escape(str(path / methods.BUNDLE_WEIGHTS)) + f": tensor {tensor} "
                       + message + r".*retrain the bundle"):
        methods.load_bundle(path)


def test_an_intervention_with_non_finite_tensors_cannot_be_made(tiny):
    bundle = tiny_caa()
    with pytest.raises(methods.BundleError, match=r"tensor vector holds 1 non-finite value"):
        type(bundle)(bundle.config, {"vector": torch.cat([bundle.tensors["vector"][:-1], torch.tensor([float("nan")])])})


def test_gate_calibration_refuses_non_finite_energies_naming_the_examples(tiny):
    session = tiny_session(tiny)
    examples = tiny_examples(session, n=3)
    tensors = {k: v for k, v in tiny_mari(K=2, rank=2).tensors.items() if not k.startswith(("ctrl_", "single_"))}
    tensors["probe_U"] = torch.full_like(tensors["probe_U"], 1e30)  # the probe's states overflow: E(x) is not finite
    tensors["probe_V"] = torch.full_like(tensors["probe_V"], 1e30)
    with pytest.raises(FloatingPointError, match=r"gate calibration: the propagation energy E\(x\) is not finite for "
                                                 r"3 of 3 D_ctrl examples \(ex0, ex1, ex2\).*lower --lr"):
        mari_fit.calibrate(session, examples, tensors, mari.DEFAULTS)
    tensors["probe_U"] = tensors["probe_V"] = torch.zeros_like(tensors["probe_V"])  # a finite probe calibrates
    assert torch.isfinite(mari_fit.calibrate(session, examples, tensors, mari.DEFAULTS)["ctrl_energy"]).all()


# ----------------------------------------------------------------------------- bundle.json: types and ranges


@pytest.mark.parametrize("method,key,value,expected", [
    ("mari", "site.layer", 14.9, r"site.layer is 14.9 \(a number\); expected an integer >= 0"),
    ("mari", "site.layer", True, r"site.layer is true \(true/false\); expected an integer >= 0"),
    ("mari", "site.layer", -1, r"site.layer is -1 \(an integer\); expected an integer >= 0"),
    ("mari", "site.layer", _DELETE, r"site.layer is missing; expected an integer >= 0"),
    ("mari", "base_model.hidden_size", "32", r'base_model.hidden_size is "32" \(a string\); expected an integer >= 1'),
    ("mari", "base_model.num_layers", 0, r"base_model.num_layers is 0 \(an integer\); expected an integer >= 1"),
    ("mari", "base_model.name", None, r"base_model.name is null \(null\); expected a string"),
    ("mari", "hyperparameters.K", 3.0, r"hyperparameters.K is 3.0 \(a number\); expected an integer >= 1"),
    ("mari", "hyperparameters.rho", 1.5, r"hyperparameters.rho is 1.5 \(a number\); expected a finite number in \(0, 1\]"),
    ("mari", "hyperparameters.rho", float("nan"), r"hyperparameters.rho is NaN \(a number\); expected a finite number"),
    ("mari", "hyperparameters.T_ent", "8", r'hyperparameters.T_ent is "8" \(a string\); expected an integer >= 1'),
    ("mari", "hyperparameters.gamma", float("inf"), r"hyperparameters.gamma is Infinity \(a number\); expected a finite"),
    ("mari", "gate.tau_E", float("nan"), r"gate.tau_E is NaN \(a number\); expected a number \(not NaN\)"),
    ("mari", "seed", "0", r'seed is "0" \(a string\); expected an integer'),
    ("mari", "splits.train", ["tqa-1", 2], r"splits.train\[1\] is 2 \(an integer\); expected a string"),
    ("mari", "base_model", [32, 4], r"base_model is \[32, 4\] \(a list\); expected an object"),
    ("caa", "hyperparameters.multiplier", "4", r'hyperparameters.multiplier is "4" \(a string\); expected a finite number'),
    ("caa", "hyperparameters", _DELETE, r"hyperparameters is missing; expected an object"),
    ("iti", "hyperparameters.alpha", None, r"hyperparameters.alpha is null \(null\); expected a finite number"),
    ("iti", "hyperparameters.probe", "rbf", r'hyperparameters.probe is "rbf" \(a string\); expected a string among '
                                            r'"linear", "mlp"'),
    ("reft", "hyperparameters.first", -1, r"hyperparameters.first is -1 \(an integer\); expected an integer >= 0"),
    ("reft", "hyperparameters.last", 2.5, r"hyperparameters.last is 2.5 \(a number\); expected an integer >= 0"),
])
def test_a_bundle_json_field_of_the_wrong_type_or_range_is_refused_naming_file_key_and_expectation(
        tmp_path, tiny, method, key, value, expected):
    path = _tamper(_saved(tmp_path, method, tiny), config=_set(key, value))
    with pytest.raises(methods.BundleError, match=re.escape(str(path / methods.BUNDLE_JSON)) + ": " + expected
                       + rf".*correct {re.escape(key)}(\[\d+\])? or retrain"):
        methods.load_bundle(path)


def test_every_built_in_method_declares_its_fields_and_tensors(tiny, tmp_path):
    """Each method's bundle round-trips through the checks, and a method that reads a
    hyperparameter declares it (the fields checked are the ones the method runs on)."""
    from baselines.caa import CAA
    from baselines.iti import ITI, NLITI
    from baselines.reft import ReFT

    for cls, required in ((mari.MARI, {"K", "rank", "probe_rank", "pca_rank", "rho", "gamma", "alpha_full",
                                        "alpha_probe", "T_ent"}),
                          (CAA, {"multiplier"}), (ITI, {"alpha"}), (NLITI, {"alpha"}), (ReFT, {"first", "last"})):
        assert {k for k, f in cls.hyperparameter_fields.items() if not f.optional} == required, cls
    for method in MAKERS:
        methods.load_bundle(_saved(tmp_path, method, tiny))


@pytest.mark.parametrize("content,message", [
    (b'\xff\xfe{"method": "mari"}', r"is not UTF-8 text \(byte 0xff at offset 0\)"),
    (b"[" * 100_000 + b"]" * 100_000, r"is not a bundle's JSON: it is nested too deeply to read"),
    (b'["mari", 1]', r"holds a list, not a JSON object"),
    (b'"mari"', r"holds a string, not a JSON object"),
    (b'{"method": ["mari"]}', r'names method \["mari"\]; known methods'),
    (b'{"method": "mari", ', r"is not valid JSON \(Expecting property name enclosed in double quotes at line 1"),
])
def test_an_unreadable_bundle_json_is_a_bundle_error_naming_the_file(tmp_path, content, message):
    path = tiny_mari().save(tmp_path / "b")
    (path / methods.BUNDLE_JSON).write_bytes(content)
    with pytest.raises(methods.BundleError, match=re.escape(str(path / methods.BUNDLE_JSON)) + " " + message):
        methods.load_bundle(path)


def test_a_bundle_json_with_a_byte_order_mark_loads(tmp_path):
    path = tiny_mari().save(tmp_path / "b")
    meta = path / methods.BUNDLE_JSON
    meta.write_bytes(b"\xef\xbb\xbf" + meta.read_bytes())  # what some Windows editors save
    assert methods.load_bundle(path).layer == 1


# ----------------------------------------------------------------------------- tensors: dtype and shape


def _resize(name, shape):
    def edit(stored):
        stored[name] = torch.zeros(shape)
    return edit


@pytest.mark.parametrize("method,edit,message", [
    ("caa", _resize("vector", (31,)), r"tensor vector has shape \(31,\), expected \(32,\) from bundle.json \(hidden_size=32\)"),
    ("caa", lambda t: t.update(vector=torch.zeros(32, dtype=torch.long)),
     r"tensor vector has dtype int64, expected a floating dtype"),
    ("caa", lambda t: t.pop("vector"), r" lacks tensor vector \(a caa bundle holds it\)"),
    ("iti", lambda t: t.update(heads=t["heads"].float()), r"tensor heads has dtype float32, expected an integer dtype"),
    ("iti", _resize("sigma", (2,)),
     r"tensor sigma has shape \(2,\), expected \(3,\) from bundle.json \(hidden_size=32, num_heads=3 from tensor heads\)"),
    ("reft", _resize("W", (3, 32)), r"tensor W has shape \(3, 32\), expected \(2, 32\) from bundle.json "
                                    r"\(hidden_size=32, rank=2 from tensor R\)"),
    ("reft", _resize("b", (2, 1)), r"tensor b has shape \(2, 1\), expected \(2,\)"),
    ("mari", _resize("ctrl_applicable", (19,)), r"tensor ctrl_applicable has dtype float32, expected an integer dtype"),
    ("mari", lambda t: t.update(ctrl_applicable=torch.zeros(19, dtype=torch.uint8)),
     r"tensor ctrl_applicable has shape \(19,\), expected \(20,\) .*n_ctrl=20 from tensor ctrl_energy"),
    ("mari", lambda t: t.pop("single_V"), r"lacks tensor single_V \(a mari bundle holds it\)"),
    ("mari", _resize("probe_b", (3,)), r"tensor probe_b has shape \(3,\), expected \(2,\) from bundle.json "
                                       r"\(K=3, rank=2, probe_rank=2, pca_rank=16, hidden_size=32\)"),
])
def test_a_tensor_of_another_dtype_or_shape_than_its_config_implies_is_refused(tmp_path, tiny, method, edit, message):
    path = _tamper(_saved(tmp_path, method, tiny), tensors=edit)
    with pytest.raises(methods.BundleError, match=re.escape(str(path / methods.BUNDLE_WEIGHTS)) + ".*" + message
                       + r".*retrain"):
        methods.load_bundle(path)


def test_an_iti_bundle_moving_a_head_outside_the_model_is_refused(tiny):
    bundle = tiny_iti(tiny, heads=((1, 0), (9, 2)))  # the site is layer 1, valid; the tiny model has 4 layers
    with pytest.raises(methods.BundleError, match=r"moves heads \[\[1, 0\], \[9, 2\]\] \(layer, head\): a layer outside "
                                                  r"0..3 or a negative index"):
        bundle.check_compatible(tiny, "tiny")


def test_a_mari_bundle_without_the_single_adapter_still_loads(tmp_path):
    path = _tamper(tiny_mari().save(tmp_path / "b"), tensors=lambda t: [t.pop(k) for k in ("single_U", "single_V", "single_b")])
    assert "single_U" not in methods.load_bundle(path).tensors


def test_hyperparameters_a_bundle_would_be_refused_for_fail_before_training():
    from baselines.caa import CAA
    from baselines.iti import ITI
    from baselines.reft import ReFT

    # No session and no data: each fails before touching them.
    with pytest.raises(ValueError, match=r"MARI hyperparameters: hyperparameters.rho is 1.5 \(a number\); expected a "
                                         r"finite number in \(0, 1\]"):
        mari.MARI.fit(None, None, {}, {"rho": 1.5}, 0)
    with pytest.raises(ValueError, match=r"hyperparameters.rank is 4.0 \(a number\); expected an integer >= 1"):
        mari.MARI.fit(None, None, {}, {"rank": 4.0}, 0)
    with pytest.raises(ValueError, match=r"ReFT hyperparameters: hyperparameters.first is true"):
        ReFT.fit(None, None, {}, {"first": True}, 0)
    with pytest.raises(ValueError, match=r"CAA's grid: hyperparameters.layers\[0\] is 14.9 \(a number\); expected an "
                                         r"integer >= 0"):
        CAA.fit(None, None, {}, {"layers": [14.9]}, 0)
    with pytest.raises(ValueError, match=r"iti's grid: hyperparameters.head_fractions\[0\] is 0 \(an integer\)"):
        ITI.fit(None, None, {}, {"head_fractions": [0]}, 0)


# ----------------------------------------------------------------------------- saving whole


def test_a_failed_save_leaves_the_previous_bundle_whole_and_loadable(tmp_path, monkeypatch):
    old, new = tiny_mari(layer=1, seed=0), tiny_mari(layer=2, seed=1)
    path = old.save(tmp_path / "bundle")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(intervention, "atomic_write_json", disk_full)  # the second file of the bundle fails
    with pytest.raises(OSError, match="No space left"):
        new.save(path)
    monkeypatch.undo()
    loaded = methods.load_bundle(path)
    assert loaded.layer == 1 and loaded.fingerprint() == old.fingerprint()  # old config with the old weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # the temporary copy is gone
    new.save(path)
    assert methods.load_bundle(path).fingerprint() == new.fingerprint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_replacing_without_an_atomic_exchange_also_leaves_one_whole_bundle(tmp_path, monkeypatch):
    """Where the two names cannot be swapped in one step (not Linux, or a file system without
    renameat2): the old bundle is renamed aside, the new one in, the old one deleted; a writer
    killed between the two renames has the old one put back by the next load."""
    old, new = tiny_mari(layer=1, seed=0), tiny_mari(layer=2, seed=1)
    path = old.save(tmp_path / "bundle")
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    new.save(path)
    assert methods.load_bundle(path).fingerprint() == new.fingerprint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]

    # The state a writer killed between its renames leaves: no bundle, the old one aside, the new one beside it.
    owner = f"{files._host()}-{dead_pid()}"
    aside, unfinished = tmp_path / f".bundle.old-{owner}-1a2b", tmp_path / f".bundle.saving-{owner}-x9y8"
    path.rename(aside)
    old.save(unfinished)
    assert not path.exists()
    assert methods.load_bundle(path).fingerprint() == new.fingerprint()  # the previous bundle, put back whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # the dead writer's copy removed
    # A live writer's temporary directory is never touched.
    live = tmp_path / f".bundle.saving-{files._host()}-1-zz"  # pid 1 always exists
    live.mkdir()
    old.save(path)
    assert live.is_dir() and methods.load_bundle(path).fingerprint() == old.fingerprint()


def test_saving_into_a_directory_that_holds_other_files_is_refused_before_writing(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    refused = r"out already holds files that would be deleted with it \(notes.txt\); move them away or write to another"
    with pytest.raises(FileExistsError, match=refused):
        methods.check_bundle_directory(target)  # what `mari-eval train` asks before training
    with pytest.raises(FileExistsError, match=refused):
        tiny_mari().save(target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # An empty directory, or a bundle's own files (repro's record beside them included), are replaced.
    (target / "notes.txt").unlink()
    tiny_mari().save(target)
    (target / "repro_config.json").write_text("{}")
    bundle = tiny_mari(seed=3)
    bundle.save(target)
    assert methods.load_bundle(target).fingerprint() == bundle.fingerprint()
    assert sorted(p.name for p in target.iterdir()) == [methods.BUNDLE_JSON, methods.BUNDLE_WEIGHTS]
    methods.check_bundle_directory(target)  # a bundle, or nothing yet: training may go ahead
    methods.check_bundle_directory(tmp_path / "not-yet")
