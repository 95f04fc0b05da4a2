"""``--model mari`` refuses what would give a silent wrong number: an empty ``bundle=``, MARI switches
without a bundle, values of the wrong type, a diagnostics file it could not write at the end, and
non-finite numbers while scoring or generating."""

import re

import pytest
import torch
import transformers
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from mari_eval.benchmarks import data_splits
from mari_eval.evaluation import lm as mari_lm
from mari_eval.evaluation import lm_checks
from mari_eval.storage.models import resolve_model

from .tiny import tiny_mari


@pytest.fixture(scope="module")
def tiny_lm():
    # A tiny random model with SmolLM2's tokenizer: lm-eval's request handling, no real weights needed.
    tok = transformers.AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval(), tok


def _lm(tiny_lm, bundle=None, **model_args):
    model, tok = tiny_lm
    return mari_lm.MariLM(pretrained=model, tokenizer=tok, bundle=None if bundle is None else str(bundle),
                          device="cpu", dtype="float32", batch_size=2, **model_args)


def _requests():
    pairs = [("Q: Is the sky blue?\nA:", " Yes."), ("Q: Is the sky blue?\nA:", " No."), ("The sea is", " salty")]
    return [Instance("loglikelihood", {}, p, i, metadata=("tqa", i // 2, 1)) for i, p in enumerate(pairs)]


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_bundle_is_refused_not_read_as_no_bundle(value):
    # As a shell writes it: bundle=$UNSET_VARIABLE. Refused before any model is loaded.
    with pytest.raises(ValueError, match="bundle= is empty .*unset shell variable"):
        get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,bundle={value}")


@pytest.mark.parametrize("arg", ["scale=", "rho=", "gate=", "experts=", "labels= ", "diagnostics=", "allow_other_model="])
def test_an_empty_option_is_refused_not_read_as_the_bundles_default(arg, tmp_path):
    # scale=$UNSET in a sweep evaluated the bundle's own strength (issue 37). Refused before the
    # bundle or the model is read (the bundle directory here does not even exist).
    name = arg.split("=")[0]
    with pytest.raises(ValueError, match=f"{name}= in --model_args is empty .*unset shell variable.*give a value"):
        get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,bundle={tmp_path / 'b'},{arg}")


@pytest.mark.parametrize("arg", ["gate=false", "rho=0.5", "experts=1", "diagnostics=d.json", "allow_other_model=true"])
def test_mari_switches_without_a_bundle_are_refused(arg):
    name = arg.split("=")[0]
    with pytest.raises(ValueError, match=f"{name} in --model_args need a bundle"):
        get_model("mari").create_from_arg_string(f"pretrained=smollm2-135m-instruct,{arg}")


def test_values_of_the_wrong_type_name_their_argument(tiny_lm, tmp_path):
    path = tiny_mari(K=3, d=32, layers=4, layer=1).save(tmp_path / "b")
    with pytest.raises(ValueError, match=r"rho='abc' in --model_args is not a number"):
        _lm(tiny_lm, path, rho="abc", allow_other_model=True)
    with pytest.raises(ValueError, match=r"allow_other_model='maybe' in --model_args: use true or false"):
        _lm(tiny_lm, path, allow_other_model="maybe")
    with pytest.raises(ValueError, match=r"gate='maybe' in --model_args"):
        _lm(tiny_lm, path, gate="maybe", allow_other_model=True)
    with pytest.raises(ValueError, match=r"rho='nan' in --model_args is not a finite number"):  # numbers.read_number
        _lm(tiny_lm, path, rho="nan", allow_other_model=True)


def test_an_unwritable_diagnostics_path_is_refused_before_scoring(tiny_lm, tmp_path, monkeypatch):
    path = tiny_mari(K=3, d=32, layers=4, layer=1).save(tmp_path / "b")
    scored = []
    monkeypatch.setattr(mari_lm.MariLM, "_loglikelihood_tokens", lambda self, *a, **k: scored.append(1))
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="diagnostics=.*a-file/d.json cannot be written"):
        _lm(tiny_lm, path, allow_other_model=True, diagnostics=str(tmp_path / "a-file" / "d.json"))
    with pytest.raises(ValueError, match="is a directory: give a file name"):
        _lm(tiny_lm, path, allow_other_model=True, diagnostics=str(tmp_path))
    assert not scored
    # A writable path in a folder that does not exist yet is fine (the folder is made when the file is
    # written), and the check leaves nothing behind.
    _lm(tiny_lm, path, allow_other_model=True, diagnostics=str(tmp_path / "new" / "d.json"))
    assert not (tmp_path / "new").exists()


def _overflowing_bundle(expert: int):
    bundle = tiny_mari(K=3, d=32, layers=4, layer=1)
    bundle.tensors["expert_U"][expert] = 1e20  # finite weights whose edit overflows float32
    bundle.tensors["expert_b"][expert] = 1e20
    return bundle


def test_a_non_finite_log_likelihood_stops_scoring_naming_document_and_variant(tiny_lm, tmp_path):
    path = _overflowing_bundle(expert=1).save(tmp_path / "b")
    lm = _lm(tiny_lm, path, allow_other_model=True, gate=False)
    with pytest.raises(lm_checks.NonFiniteError, match=r"task tqa, document 0: .*log-likelihood of expert 1"):
        lm.loglikelihood(_requests())
    assert lm.records == []  # nothing was recorded as an answer


def test_a_nan_expert_is_not_silently_replaced_by_the_base_model(tiny_lm, tmp_path):
    # Before: NaN entropies read as "experts not run", so the base model answered while the gate said open.
    path = _overflowing_bundle(expert=0).save(tmp_path / "b")
    lm = _lm(tiny_lm, path, allow_other_model=True, rho=0.0)  # tau_E at the lowest control energy: gate open
    with pytest.raises(lm_checks.NonFiniteError, match="expert 0"):
        lm.loglikelihood(_requests())


def test_non_finite_scores_while_generating_stop_naming_the_prompt(tiny_lm, tmp_path):
    from baselines.caa import CAA

    caa = CAA({"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1},
               "hyperparameters": {"multiplier": 1e20}}, {"vector": torch.full((32,), 1e20)})
    lm = _lm(tiny_lm, caa.save(tmp_path / "caa"), allow_other_model=True)
    request = Instance("generate_until", {}, ("Tell me a story.", {"until": ["\n\n"], "max_gen_toks": 3}), 0,
                       metadata=("story", 0, 1))
    with pytest.raises(lm_checks.NonFiniteError, match=r"while generating \(task story, prompt '.*Tell me a story\."):
        lm.generate_until([request])


def _trained_on_truthfulqa(seed: int = 0):
    bundle = tiny_mari(K=3, d=32, layers=4, layer=1)
    splits = data_splits.make_splits("truthfulqa", seed)
    bundle.config.update(splits={**splits.to_json(), "fingerprint": splits.fingerprint()},
                         data_files=data_splits.data_fingerprint("truthfulqa"))
    return bundle


def _heldout_requests(seed: int, fingerprint: str):
    doc = {"split_dataset": "truthfulqa", "split_seed": seed, "split_fingerprint": fingerprint}
    return [Instance("loglikelihood", doc, p, i, metadata=("truthfulqa_mc1_heldout", 0, 1))
            for i, p in enumerate([("Q: Is the sky blue?\nA:", " Yes."), ("Q: Is the sky blue?\nA:", " No.")])]


def test_a_heldout_set_of_another_seed_or_of_changed_data_is_refused(tiny_lm, tmp_path, monkeypatch):
    import gzip
    import shutil

    from mari_eval.benchmarks import data

    bundle = _trained_on_truthfulqa(seed=0)
    fingerprint = bundle.config["splits"]["fingerprint"]
    lm = _lm(tiny_lm, bundle.save(tmp_path / "b"), allow_other_model=True)
    assert len(lm.loglikelihood(_heldout_requests(0, fingerprint))) == 2  # the split it was trained on: scored
    other = data_splits.make_splits("truthfulqa", 1).fingerprint()
    with pytest.raises(data.DataError, match=r"split of seed 1, but the bundle was trained on the split of seed 0.*"
                                             r"--metadata '\{\"split_seed\": 0\}'"):
        lm.loglikelihood(_heldout_requests(1, other))
    # The TruthfulQA file with its first line deleted: other ids, another split, held-out questions trained on.
    root = tmp_path / "data"
    shutil.copytree(data.data_dir() / "truthfulqa", root / "truthfulqa")
    shutil.copytree(data.data_dir() / "arc", root / "arc")
    shutil.copytree(data.data_dir() / "mmlu", root / "mmlu")  # D_ctrl's MMLU validation questions
    path = root / "truthfulqa" / "mc.jsonl.gz"
    lines = gzip.open(path, "rt", encoding="utf-8").read().splitlines(keepends=True)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.writelines(lines[1:])
    monkeypatch.setenv(data.DATA_ENV, str(root))
    changed = data_splits.make_splits("truthfulqa", 0).fingerprint()
    lm = _lm(tiny_lm, tmp_path / "b", allow_other_model=True)
    with pytest.raises(data.DataError, match=f"fingerprint {fingerprint}; the current data .* give fingerprint {changed}"
                                             r".*truthfulqa/mc.jsonl.gz \(sha256 recorded"):
        lm.loglikelihood(_heldout_requests(0, changed))


@pytest.mark.parametrize("args, message", [
    (["--max-pca", "4"], r"--max-pca 4 is below the PCA rank pca_rank=16"),
    (["--rho", "1.5"], r"hyperparameters.rho is 1.5 .*expected a finite number in \(0, 1\]"),
    (["--rho", "0"], r"hyperparameters.rho is 0"),
    (["--K", "0"], r"hyperparameters.K is 0"),
    (["--max-train", "0"], r"--max-train 0: give a positive number"),
    (["--max-ctrl", "-3"], r"--max-ctrl -3: give a positive number"),
    (["--set", "K=abc"], r'hyperparameters.K is "abc" \(a string\)'),
    (["--set", "unknown=1"], r"unknown MARI hyperparameters \['unknown'\]"),
    (["--method", "reft", "--set", "rank=0"], r"ReFT hyperparameters: hyperparameters.rank is 0"),
    (["--method", "caa", "--set", "layers=[1.5]"], r"CAA's grid"),
])
def test_train_refuses_inconsistent_arguments_before_loading_anything(args, message, tmp_path, monkeypatch, capsys):
    from mari_eval import cli
    from mari_eval.training import train

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(train, "Session", no_model)
    code = cli.main(["train", "--attribute", "truthfulqa", "--out", str(tmp_path / "b"), *args])
    assert code == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_unreadable_request_text_names_the_task_and_document(tiny_lm):
    lm = _lm(tiny_lm)
    surrogate = [Instance("loglikelihood", {}, ("Q: what is \ud800?\nA:", " x"), 0, metadata=("tqa", 7, 1))]
    with pytest.raises(ValueError, match=r"task tqa, document 7: the text holds a lone surrogate '\\ud800' at character 11"):
        lm.loglikelihood(surrogate)
    with pytest.raises(ValueError, match=r"task gen, document 3: the text holds a lone surrogate"):
        lm.generate_until([Instance("generate_until", {}, ("\udfff", {"until": ["\n"]}), 0, metadata=("gen", 3, 1))])
    blank = [Instance("loglikelihood", {}, ("   ", " yes"), 0, metadata=("tqa", 4, 1))]
    with pytest.raises(ValueError, match=r"task tqa, document 4: the context has no tokens .*whitespace-only prompt"):
        lm.loglikelihood(blank)


def test_a_second_training_into_the_same_out_is_refused_while_the_first_runs(tmp_path):
    # Issue 37: two `mari-eval train ... --out DIR` at once both reported success, one bundle overwriting
    # the other. The first holds DIR's lock (here, this test); the second is refused before loading anything.
    from mari_eval.storage.files import writing_alone
    from mari_eval.training.train import train

    out = tmp_path / "bundle"
    with writing_alone(out, "--out "):
        with pytest.raises(FileExistsError, match=rf"--out {out} is being written by another process \(pid \d+"):
            train("caa", "truthfulqa", "smollm2-135m-instruct", 0, out)
    with writing_alone(out, "--out "):  # released once the first finished: the next may write
        pass
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no lock file is left beside the output


@pytest.mark.parametrize("multiplier", [4e18, 1e30])
def test_an_edit_whose_square_overflows_the_norm_layer_stops_scoring(tiny_lm, tmp_path, multiplier):
    # Issue 37: a strength large enough that the edited state stays finite (4e18 is enough at d = 32) but its
    # square overflows float32 in the next RMSNorm (variance inf, the state normed to 0): every option of
    # every question got the same finite log-likelihood (tokens x -log(vocabulary size)), and the accuracy
    # was what ties produce.
    from baselines.caa import CAA

    caa = CAA({"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1},
               "hyperparameters": {"multiplier": 1.0}}, {"vector": torch.full((32,), multiplier)})
    lm = _lm(tiny_lm, caa.save(tmp_path / "caa"), allow_other_model=True)
    with pytest.raises(ArithmeticError, match=r"layer 1.* magnitude .*overflows float32 in the next norm layer"):
        lm.loglikelihood(_requests())


def test_an_lm_eval_output_path_that_cannot_be_written_is_refused_before_the_model_loads(tiny_lm, tmp_path, monkeypatch):
    # Issue 37: lm-eval writes results and samples after the whole run and, failing, warns and exits 0.
    blocker = tmp_path / "a-file"
    blocker.write_text("x\n")
    for given, shown in ((["--output_path", str(blocker / "out")], f"{blocker}/out"),
                         ([f"--output_path={blocker}/r.json"], f"{blocker}/r.json"), (["-o", str(blocker)], str(blocker))):
        monkeypatch.setattr("sys.argv", ["/usr/bin/lm_eval", "--model", "mari", *given])
        with pytest.raises(ValueError, match=rf"lm_eval --output_path {re.escape(shown)} (cannot be written|is a file)"):
            _lm(tiny_lm)
    assert lm_checks.is_lm_eval_command(["/x/site-packages/lm_eval/__main__.py"])
    assert not lm_checks.is_lm_eval_command(["/x/site-packages/pytest/__main__.py", "-o", "addopts="])
    monkeypatch.setattr("sys.argv", ["/usr/bin/lm_eval", "--model", "mari", "--output_path", str(tmp_path / "new" / "out")])
    _lm(tiny_lm)  # writable: accepted, and the check leaves nothing behind
    assert not (tmp_path / "new").exists()
