"""Round five (issue 83): refusals checked on the path users type, numbers read one way everywhere
(``mari_eval/storage/numbers.py``), imported tensors checked for kind (``mari_eval/vectors/vector_kind.py``),
and the inputs that used to end in an unclear error (upper-case suffixes, a Latin-1 or ragged SAE CSV,
an overflowing ``combine``, a SteeringVector without layers)."""

import argparse
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mari_eval import cli
from mari_eval.evaluation import lm_args
from mari_eval.evaluation.lm import MariLM
from mari_eval.methods import options
from mari_eval.methods.bundle_spec import BundleError
from mari_eval.storage.numbers import NumberError, meant_as_number, read_number
from mari_eval.vectors import combine, control_vector, pyreft_save, steer_config
from mari_eval.vectors.control_vector_files import write_gguf
from mari_eval.vectors.vector_kind import check_kind

from .tiny import tiny_caa, tiny_mari, tiny_model

HEADER = "loader,action,sparse_model,hookpoint,feature_index,steering_coefficient,head_index,sae_id,description"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (hidden size 32, 4 decoder layers) saved where a command line can name it."""
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    tiny_model("llama").save_pretrained(path)
    return str(path)


def caa_bundle(directory: Path, name: str, d: int = 32, layers: int = 4, layer: int = 2) -> str:
    bundle = tiny_caa(d=d, layers=layers, layer=layer)
    bundle.config["base_model"]["name"] = name
    return str(bundle.save(directory))


# ----------------------------------------------------------------------------- the number reader (issue 83.2)


@pytest.mark.parametrize("text, integer, expected", [
    ("3", True, 3), (" -12 ", True, -12), ("+4", True, 4), ("0.5", False, 0.5), ("-2", False, -2.0), (".5", False, 0.5),
    ("1e-3", False, 1e-3), ("3e38", False, 3e38), (7, True, 7), (3.0, True, 3), (2, False, 2.0)])
def test_well_written_numbers_are_read(text, integer, expected):
    value = read_number(text, "x=", integer=integer)
    assert value == expected and type(value) is (int if integer else float)


@pytest.mark.parametrize("text, integer, why", [
    ("\u0663", True, r"'\u0663' is U\+0663 ARABIC-INDIC DIGIT THREE, a digit outside ASCII"),
    ("\uff13", False, r"U\+FF13 FULLWIDTH DIGIT THREE"),
    ("3_0", True, "holds an underscore"), ("1_0.5", False, "holds an underscore"),
    ("3.0", True, "a decimal point or an exponent where a whole number is meant"),
    ("1e3", True, "a decimal point or an exponent"),
    ("inf", False, "infinity and NaN are not read"), ("nan", False, "infinity and NaN are not read"),
    ("1e400", False, "it overflows a float"), ("", False, "it is empty"), ("0x10", True, "its form is not that of a number"),
    (True, True, "a truth value is not a number"), (2.5, True, "it is not whole"), (float("nan"), False, "not read"),
])
def test_badly_written_numbers_are_refused_naming_the_input_and_the_rule(text, integer, why):
    with pytest.raises(NumberError, match=rf"^rho={re.escape(repr(text))} in --model_args is not .*{why}.*digits 0-9"):
        read_number(text, "rho=", integer=integer, where="in --model_args")


def test_a_number_out_of_range_names_the_range():
    with pytest.raises(NumberError, match=r"layer '9' is out of range: give an integer from 0 to 3, e.g. 2"):
        read_number("9", "layer", integer=True, lo=0, hi=3, example="2")
    assert read_number("3", integer=True, lo=0, hi=3) == 3
    with pytest.raises(NumberError, match="above 0"):
        read_number("0", lo=0, lo_open=True)


@pytest.mark.parametrize("text, meant", [("1_0", True), ("\u0662", True), (".5", True), ("-inf", True), ("NaN", True),
                                         ("/dir", False), ("3 rules", False), ("f7+l7", False), ("10-14", False)])
def test_text_meant_as_a_number_is_told_from_a_name(text, meant):
    assert meant_as_number(text) is meant


def test_command_line_flags_read_numbers_one_way(capsys):
    for flag, value, why in (("--lr", "1_0", "underscore"), ("--K", "\u0663", "U+0663"), ("--layer", "3.0", "decimal point"),
                             ("--rho", "inf", "not a finite number")):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["train", "--attribute", "truthfulqa", "--out", "x", flag, value])
        assert f"argument {flag}: {value!r} is not" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError, match="'2_0' is not an integer"):
        options.positive_int("2_0")


def test_train_set_values_are_read_as_typed():
    assert options.set_value("lambda_bal", "0.5") == 0.5 and options.set_value("layers", "[3,9]") == [3, 9]
    assert options.set_value("instruction", "3 rules: be honest") == "3 rules: be honest"
    assert options.set_value("lr", ".5") == 0.5
    for text, shown, why in (("1_0", "'1_0' is not an integer", "underscore"), ("\u0662", "'\u0662' is not an integer", "U+0662"),
                             ("NaN", "'NaN' is not a finite number", "NaN"), ("[1e999]", "'1e999' is not a finite number", "overflows")):
        with pytest.raises(NumberError, match=re.escape(f"--set lambda_bal={shown}") + ".*" + re.escape(why)):
            options.set_value("lambda_bal", text)


def test_repro_lists_read_numbers_one_way():
    from repro.engine import command_line

    assert command_line.listed("1,2,4", "--ks", int) == [1, 2, 4]
    with pytest.raises(SystemExit, match=r"--ks '1,1_0': '1_0' is not an integer \(it holds an underscore"):
        command_line.listed("1,1_0", "--ks", int)
    with pytest.raises(SystemExit, match=r"--rhos '0.5,\u0662': '\u0662' is not a number"):
        command_line.listed("0.5,\u0662", "--rhos", float)
    with pytest.raises(argparse.ArgumentTypeError, match="U\\+0663"):
        command_line.at_least(1)("\u0663")


def test_a_judge_setting_is_read_one_way(monkeypatch):
    from mari_eval.judge.config import JudgeConfig, JudgeError

    monkeypatch.setenv("MARI_JUDGE_ATTEMPTS", "1_0")
    with pytest.raises(JudgeError, match=r"MARI_JUDGE_ATTEMPTS='1_0' is not a whole number \(it holds an underscore"):
        JudgeConfig.from_env(base_url="http://localhost:1/v1", model="m")


# ----------------------------------------------------------------------------- model args on the Python path


def test_model_args_numbers_are_read_from_the_text_on_the_python_path(tmp_path):
    bundle = caa_bundle(tmp_path / "caa", "/nonexistent")
    # lm-eval's simple_parse_args_string reads "1_0" as 10.0 and Arabic-Indic "٢" as 2: refused here, before any model
    for given, shown in (("scale=1_0", "scale='1_0'"), ("scale=\u0662", "scale='\u0662'"), ("layers=\u0663", "layers='\u0663'"),
                         ("batch_tokens=1_000", "batch_tokens='1_000'")):
        with pytest.raises(ValueError, match=re.escape(shown)):
            MariLM.create_from_arg_string(f"pretrained=/nonexistent,bundle={bundle},{given}")
    with pytest.raises(ValueError, match=r"max_length='1_000' in --model_args is not a number"):  # one of HFLM's own
        MariLM.create_from_arg_string("pretrained=/nonexistent,max_length=1_000")
    mari = tiny_mari()
    with pytest.raises(ValueError, match=r"experts='\u0661' in --model_args is not an integer"):
        mari.configure(experts="\u0661")


def test_model_args_read_again_from_the_lm_eval_command_line():
    argv = ["--model", "mari", "--model_args", "pretrained=x,bundle=b,scale=1_0", "-a", "max_length=2048", "--tasks", "t"]
    assert lm_args.command_line_pairs(argv) == [("pretrained", "x"), ("bundle", "b"), ("scale", "1_0"), ("max_length", "2048")]
    typed = lm_args.from_command_line({"pretrained": "x", "bundle": "b", "scale": 10.0, "max_length": 2048}, argv,
                                     lambda: {"scale"})
    assert typed == {"pretrained": "x", "bundle": "b", "scale": "1_0", "max_length": 2048}  # the option reads "1_0" itself
    for twice in (["--model_args", "rho=0.0,rho=1.0"], ["--model_args", "rho=0.0", "--model_args", "rho=1.0"],
                  ["--model_args", "rho=0.0", "rho=1.0"], ["run", "--model_args", '{"rho": 0.0, "rho": 1.0}']):
        with pytest.raises(ValueError, match="rho given more than once in --model_args"):
            lm_args.from_command_line({"rho": 1.0}, twice, lambda: {"rho"})
    with pytest.raises(ValueError, match="after a JSON object lm-eval reads nothing more"):
        lm_args.command_line_pairs(["--model_args", '{"rho": 0.5}', "bundle=b"])


# ----------------------------------------------------------------------------- the lm_eval command line (issue 83.1)


def test_every_lm_eval_refusal_holds_on_the_command_line_users_type(tmp_path):
    """Each refusal claimed for `lm_eval --model mari`, on its own verbatim command line, in a subprocess:
    lm-eval's CLI hands a dict to create_from_arg_obj, so a check made only in create_from_arg_string is
    never reached there (`scale=0.0,scale=1.0` ran at 1.0 with exit code 0). Each is refused before the
    model loads; the command lines run side by side."""
    bundle = caa_bundle(tmp_path / "caa", "smollm2-135m-instruct", d=576, layers=30, layer=15)
    blocker = tmp_path / "a-file"
    blocker.write_text("x\n")
    base = f"pretrained=smollm2-135m-instruct,bundle={bundle}"
    cases = {  # the words after `lm_eval --model mari` -> what stderr must say
        "a key given twice": (["--model_args", f"{base},scale=0.0,scale=1.0"], r"scale given more than once in --model_args"),
        "an unknown option": (["--model_args", f"{base},rho=0.5"], r"rho in --model_args: not an option of"),
        "an unwritable output path": (["--model_args", base, "--output_path", f"{blocker}/out"],
                                      r"lm_eval --output_path .*a-file/out (cannot be written|is a file)"),
        "output paths that disagree": (["--model_args", base, "--output_path", str(tmp_path / "o1"), "-o", str(tmp_path / "o2")],
                                       r"lm_eval --output_path is given 2 times"),
        "batch_tokens=0": (["--model_args", f"{base},batch_tokens=0"], r"batch_tokens='0': give a positive whole number"),
        "positions=": (["--model_args", f"{base},positions=sideways"], r"positions='sideways' in --model_args: give one of"),
        "layers=": (["--model_args", f"{base},layers=10-99"], r"layers='10-99' in --model_args: give A <= B within .*0\.\.29"),
        "a number lm-eval reads loosely": (["--model_args", f"{base},scale=1_0"], r"scale='1_0' in --model_args is not a number"),
    }
    lm_eval = str(Path(sys.executable).with_name("lm_eval"))
    failures = []
    names = list(cases)
    for start in range(0, len(names), 3):  # three at a time: each process holds torch and lm-eval's task index
        running = {name: subprocess.Popen([lm_eval, "--model", "mari", *cases[name][0], "--tasks", "truthfulqa_mc1",
                                           "--limit", "1"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True) for name in names[start:start + 3]}
        for name, proc in running.items():
            out, err = proc.communicate(timeout=600)
            if proc.returncode == 0 or not re.search(cases[name][1], err):
                failures.append(f"{name}: rc {proc.returncode}, stderr ends {err[-600:]!r}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- imported tensors checked for kind (83.4)


KINDS = {"complex": torch.ones(32, dtype=torch.complex64), "sparse": torch.ones(32).to_sparse(),
         "integer": torch.ones(32, dtype=torch.int64), "boolean": torch.ones(32, dtype=torch.bool)}
KIND_WORDS = {"complex": "is complex .*imaginary part", "sparse": "is a sparse tensor", "integer": "is of integers",
              "boolean": "is boolean"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_steering_vector_of_another_kind_is_refused_naming_file_and_key(kind, tmp_path):
    model = tiny_model("llama")
    config = {"layers.1": {"steering_vector": KINDS[kind], "steering_coefficient": 1.0, "action": "add", "bias": None,
                           "head_index": None}}
    torch.save(config, tmp_path / "v.pt")
    with pytest.raises(BundleError, match=rf"v\.pt: hookpoint 'layers\.1': steering_vector {KIND_WORDS[kind]}"):
        steer_config.import_steer_file(tmp_path / "v.pt", model, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_steering_vector_object_of_another_kind_is_refused(kind, tmp_path):
    model = tiny_model("llama")
    vector = types.SimpleNamespace(layer_type="decoder_block", layer_activations={1: KINDS[kind]})
    with pytest.raises(BundleError, match=rf"layer_activations\[1\] {KIND_WORDS[kind]}"):
        control_vector.from_steering_vector(vector, model, tmp_path / "bundle")


def test_an_sae_decoder_of_integers_is_refused_naming_the_file(tmp_path):
    model = tiny_model("llama")
    save_file({"W_dec": torch.ones(8, 32, dtype=torch.int32), "b_dec": torch.zeros(32)}, str(tmp_path / "sae.safetensors"))
    (tmp_path / "f.csv").write_text(f"{HEADER}\nsparsify,add,{tmp_path / 'sae.safetensors'},layers.1,3,2.0,,,\n")
    with pytest.raises(BundleError, match=r"f\.csv, row 2: W_dec in .*sae\.safetensors is of integers \(int32"):
        steer_config.import_steer_file(tmp_path / "f.csv", model, tmp_path / "bundle")


def test_a_pyreft_tensor_of_another_kind_is_refused():
    state = {"weight": torch.ones(2, 32, dtype=torch.complex64)}
    with pytest.raises(BundleError, match=r"intkey\.bin: weight is complex"):
        pyreft_save._tensor(Path("intkey.bin"), state, "weight", (2, 32), 32, "m")


def test_a_real_dense_float_tensor_passes_the_kind_check():
    vector = torch.ones(4, dtype=torch.bfloat16)
    assert check_kind(vector, "v") is vector


# ----------------------------------------------------------------------------- inputs once unclear (83.5)


def test_numbers_in_an_sae_csv_are_read_one_way(tmp_path):
    model = tiny_model("llama")
    save_file({"W_dec": torch.randn(32, 32), "b_dec": torch.zeros(32)}, str(tmp_path / "sae.safetensors"))
    for feature, why in (("\u0663", "U+0663"), ("3_0", "underscore"), ("3.0", "decimal point")):
        (tmp_path / "f.csv").write_text(f"{HEADER}\nsparsify,add,{tmp_path / 'sae.safetensors'},layers.1,{feature},2.0,,,\n",
                                        encoding="utf-8")
        with pytest.raises(BundleError, match=rf"f\.csv, row 2: feature_index '{feature}' is not a feature's row in "
                                              rf"W_dec, an integer >= 0 \(.*{re.escape(why)}"):
            steer_config.import_steer_file(tmp_path / "f.csv", model, tmp_path / "bundle")


def test_a_latin1_or_ragged_sae_csv_is_named_with_the_fix(tmp_path):
    model = tiny_model("llama")
    row = f"sparsify,add,{tmp_path / 'sae.safetensors'},layers.1,3,2.0,,,caf\u00e9"
    (tmp_path / "latin.csv").write_bytes(f"{HEADER}\n{row}\n".encode("latin-1"))
    with pytest.raises(BundleError, match=r"latin\.csv is not UTF-8 text \(byte 0xe9 at byte \d+.*save it as UTF-8"):
        steer_config.import_steer_file(tmp_path / "latin.csv", model, tmp_path / "bundle")
    (tmp_path / "ragged.csv").write_text(f"{HEADER}\n{row},extra\n")
    with pytest.raises(BundleError, match=r"ragged\.csv, row 2: 10 fields under a header of 9 \('extra' beyond it\): "
                                          r"a comma inside a value\? Quote that value"):
        steer_config.import_steer_file(tmp_path / "ragged.csv", model, tmp_path / "bundle")


def test_upper_case_suffixes_are_read_as_their_format(tmp_path, model_dir, capsys):
    # FILE.PT was read as a GGUF file ("is not a GGUF file"), FILE.CSV too
    g = torch.Generator().manual_seed(0)
    torch.save({"layers.1": {"steering_vector": torch.randn(32, generator=g), "steering_coefficient": 2.0, "action": "add",
                             "bias": None, "head_index": None}}, tmp_path / "VECTOR.PT")
    assert cli.main(["import-vector", str(tmp_path / "VECTOR.PT"), "--model", model_dir, "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "bundle.json").read_text())["method"] == "steered_config"
    (tmp_path / "FEATURES.CSV").write_text(f"{HEADER}\nsparsify,add,{tmp_path / 'none.safetensors'},layers.1,3,2.0,,,\n")
    assert cli.main(["import-vector", str(tmp_path / "FEATURES.CSV"), "--model", model_dir, "--out", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "FEATURES.CSV, row 2: sparse_model" in err and "GGUF" not in err
    write_gguf(tmp_path / "V.GGUF", {1: torch.ones(32)}, "llama")
    combined = combine.combine([f"{tmp_path / 'V.GGUF'}:2"], tmp_path / "d", model=model_dir)
    assert json.loads((combined / "bundle.json").read_text())["source"]["file"] == "2 x V.GGUF"


def test_combine_weights_are_read_one_way_on_the_command_line(tmp_path, model_dir):
    write_gguf(tmp_path / "a.gguf", {1: torch.ones(32)}, "llama")
    for weight, why in (("1_0", "underscore"), ("\u0662", "U+0662")):
        proc = subprocess.run([sys.executable, "-m", "mari_eval.cli", "combine", f"{tmp_path / 'a.gguf'}:{weight}",
                               "--model", model_dir, "--out", str(tmp_path / "out")], capture_output=True, text=True)
        assert proc.returncode == 1 and re.search(rf"the weight '{weight}' is not a number.*{re.escape(why)}", proc.stderr), proc.stderr
        assert not (tmp_path / "out").exists()


def test_a_combined_sum_that_overflows_says_so_and_the_fix(tmp_path, model_dir):
    # was: "the combined vector: the direction of layer 1 holds 32 non-finite value(s) ... The vector is damaged"
    write_gguf(tmp_path / "a.gguf", {1: torch.ones(32)}, "llama")
    terms = [f"{tmp_path / 'a.gguf'}:3e38", f"{tmp_path / 'a.gguf'}:3e38"]
    with pytest.raises(BundleError, match=r"the weighted sum 3e\+38 x a\.gguf \+ 3e\+38 x a\.gguf overflows float32 at "
                                          r"layer 1 .*lower the weights") as refused:
        combine.combine(terms, tmp_path / "out", model=model_dir)
    assert "damaged" not in str(refused.value) and not (tmp_path / "out").exists()


def test_a_steering_vector_without_layers_is_refused_with_the_fix(tmp_path):
    model = tiny_model("llama")
    vector = types.SimpleNamespace(layer_type="decoder_block", layer_activations={})
    with pytest.raises(BundleError, match=r"the SteeringVector holds no direction at any layer.*layers=\["):
        control_vector.from_steering_vector(vector, model, tmp_path / "bundle")


@pytest.mark.parametrize("key", [1.0, "\u0661", True, 9])
def test_a_steering_vector_layer_key_is_read_one_way(key, tmp_path):
    vector = types.SimpleNamespace(layer_type="decoder_block", layer_activations={key: torch.ones(32)})
    with pytest.raises(BundleError, match=r"layer_activations has key\(s\) .*a layer is an integer from -4 to 3"):
        control_vector.from_steering_vector(vector, tiny_model("llama"), tmp_path / "bundle")
