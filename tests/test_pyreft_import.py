"""pyreft's saved interventions imported as ReFT bundles (mari_eval/vectors/pyreft_save.py, issue 57.3):
a save in pyreft's on-disk format (config.json and torch.save'd intkey_*.bin), scored through
MariLM, gives the log-likelihoods of the LoReFT/NoReFT formula applied with forward hooks at the
same layers and prompt positions; with pyreft installed, those of pyreft's own forward too."""

import json
from collections import OrderedDict

import pytest
import torch
from lm_eval.api.instance import Instance

from mari_eval import cli
from mari_eval.vectors import pyreft_save
from mari_eval.methods.bundle_spec import BundleError
from mari_eval.evaluation.lm import MariLM

from .tiny import byte_llama, byte_tokenizer

# "Hi, seas?" has 9 tokens: f7+l7 edits 4 + 4 of them (each count capped at half the prompt), not the 5th
REQUESTS = [("The sea is blue and", " deep."), ("Fish live in the water", " all day."), ("Hi, seas?", " Yes."),
            ("Two and two make four", " always.")]
FIELDS = 14  # pyvene's RepresentationConfig, saved as a list of its fields


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return byte_llama(tokenizer, layers=4, hidden=64)  # a random Llama over bytes: one token per character


def _key(layer: int, k: int = 0) -> str:
    return f"layer_{layer}_comp_block_output_unit_pos_nunit_1#{k}"


def _state(kind: str, hidden: int, rank: int, seed: int) -> OrderedDict:
    """A random intervention's state dict, as pyreft's LoreftIntervention (its own state_dict) or
    NoreftIntervention (torch's, with proj_layer's bias) saves it."""
    g = torch.Generator().manual_seed(seed)
    W, b = torch.randn(rank, hidden, generator=g) * 0.3, torch.randn(rank, generator=g)
    if kind == "LoreftIntervention":
        rotate = torch.linalg.qr(torch.randn(hidden, rank, generator=g)).Q.contiguous()  # [d, r], orthonormal columns
        return OrderedDict(weight=W, bias=b, rotate_layer=rotate)
    P, c = torch.randn(rank, hidden, generator=g) * 0.2, torch.randn(rank, generator=g)
    return OrderedDict([("proj_layer.weight", P), ("proj_layer.bias", c), ("learned_source.weight", W),
                        ("learned_source.bias", b)])


def _write_save(folder, interventions, hidden=64, component="block_output"):
    """A folder as pyvene's IntervenableModel.save writes it: config.json and one intkey_<key>.bin per
    intervention (``interventions``: [(layer, class name, state dict)])."""
    folder.mkdir()
    seen: dict[int, int] = {}
    representations, keys = [], []
    for layer, kind, state in interventions:
        rank = state["rotate_layer"].shape[1] if "rotate_layer" in state else state["proj_layer.weight"].shape[0]
        representations.append([layer, component, "pos", 1, rank] + [None] * (FIELDS - 5))
        seen[layer] = seen.get(layer, -1) + 1
        keys.append(f"layer_{layer}_comp_{component}_unit_pos_nunit_1#{seen[layer]}")
        torch.save(state, folder / f"intkey_{keys[-1]}.bin")
    config = {"intervention_constant_sources": [True] * len(keys), "intervention_dimensions": [hidden] * len(keys),
              "intervention_types": [f"<class 'pyreft.interventions.{kind}'>" for _, kind, _ in interventions],
              "mode": "parallel", "representations": representations, "sorted_keys": keys,
              "transformers_version": "4.45.1"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _phi(kind: str, state: OrderedDict, h: torch.Tensor) -> torch.Tensor:
    """The formulas of Wu et al. 2024 on the saved tensors, written out here independently."""
    if kind == "LoreftIntervention":
        rotate = state["rotate_layer"]
        return h + (h @ state["weight"].T + state["bias"] - h @ rotate) @ rotate.T
    P = state["proj_layer.weight"]
    projected = h @ P.T + state["proj_layer.bias"]
    return h + (h @ state["learned_source.weight"].T + state["learned_source.bias"] - projected) @ P


def _where(length: int, first: int, last: int) -> list[int]:
    f, l = min(length // 2, first), min(length // 2, last)
    return sorted(set(range(f)) | set(range(length - l, length)))


def _hooked_loglikelihoods(model, tokenizer, interventions, first, last) -> list[float]:
    """Each request's continuation log-likelihood with forward hooks editing decoder layer L's output."""
    out = []
    for context, continuation in REQUESTS:
        ctx = tokenizer(context, add_special_tokens=False).input_ids
        cont = tokenizer(continuation, add_special_tokens=False).input_ids
        where = _where(len(ctx), first, last)

        def hook_of(kind, state):
            def hook(module, args, output):
                h = (output[0] if isinstance(output, tuple) else output).clone()
                h[:, where] = _phi(kind, state, h[:, where])
                return (h, *output[1:]) if isinstance(output, tuple) else h
            return hook

        handles = [model.model.layers[layer].register_forward_hook(hook_of(kind, state))
                   for layer, kind, state in interventions]
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].double()
        finally:
            for handle in handles:
                handle.remove()
        out.append(float(logits.log_softmax(-1).gather(-1, torch.tensor(cont)[:, None]).sum()))
    return out


def _loglikelihoods(lm) -> list[float]:
    return [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)])]


def _mari(model, tokenizer, bundle=None) -> MariLM:
    return MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=bundle and str(bundle),
                  allow_other_model=True if bundle else None)


CASES = {  # name: (interventions, --positions)
    "loreft_two_layers_two_ranks": ([(1, "LoreftIntervention", 4, 0), (3, "LoreftIntervention", 2, 1)], None),
    "noreft_with_proj_bias": ([(2, "NoreftIntervention", 3, 2)], "f2+l3"),
}


@pytest.mark.parametrize("case", CASES)
def test_an_imported_save_scores_as_the_formula_applied_with_hooks(model, tokenizer, tmp_path, case):
    specs, positions = CASES[case]
    interventions = [(layer, kind, _state(kind, 64, rank, seed)) for layer, kind, rank, seed in specs]
    folder = _write_save(tmp_path / "save", interventions)
    bundle = pyreft_save.import_pyreft_save(folder, model, tmp_path / "bundle", positions=positions)
    first, last = pyreft_save.parse_positions(positions or pyreft_save.DEFAULT_POSITIONS)
    plain = _loglikelihoods(_mari(model, tokenizer))
    assert plain == pytest.approx(_hooked_loglikelihoods(model, tokenizer, [], first, last), abs=1e-4)  # same tokens
    theirs = _hooked_loglikelihoods(model, tokenizer, interventions, first, last)
    ours = _loglikelihoods(_mari(model, tokenizer, bundle))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(theirs, plain)) > 1e-2  # the interventions do steer
    config = json.loads((bundle / "bundle.json").read_text())
    assert (config["method"], config["hyperparameters"]["layers"]) == ("reft", sorted(s[0] for s in specs))
    assert config["hyperparameters"]["recipe"] == "imported"  # not labelled as trained with the published recipe
    assert config["source"]["interventions"] == [kind for _, kind, _, _ in specs]


def test_the_default_positions_are_the_published_recipes():
    from baselines.reft_published import PUBLISHED

    assert pyreft_save.parse_positions(pyreft_save.DEFAULT_POSITIONS) == (PUBLISHED["first"], PUBLISHED["last"])


def _loreft(layer=1, hidden=64, kind="LoreftIntervention"):
    return (layer, kind, _state("LoreftIntervention", hidden, 4, 0))


@pytest.mark.parametrize("interventions, edit, options, match", [
    ([_loreft(kind="ConsreftIntervention")], None, {}, "is a ConsreftIntervention: only"),
    ([_loreft(hidden=32)], None, {}, "hidden size is 64: the intervention was trained for another model"),
    ([_loreft(9)], None, {}, "decoder layers 0..3"),
    ([_loreft(1), _loreft(1)], None, {}, "a second intervention at layer 1"),
    ([_loreft()], "component", {}, "component 'mlp_output'"),
    ([_loreft()], "no_tensors", {}, "is missing: the save is incomplete"),
    ([_loreft()], "no_config", {}, "config.json is missing"),
    ([_loreft()], "pickled_code", {}, "weights_only=True"),
    ([_loreft()], "no_rotation", {}, "lacks 'rotate_layer'"),
    ([_loreft()], None, {"positions": "f7"}, "always edits the last prompt token"),
])
def test_what_a_bundle_cannot_hold_is_refused_with_the_reason(model, tmp_path, interventions, edit, options, match):
    folder = _write_save(tmp_path / "save", interventions, component="mlp_output" if edit == "component" else "block_output")
    tensors = folder / f"intkey_{_key(1)}.bin"
    if edit == "no_tensors":
        tensors.unlink()
    elif edit == "no_config":
        (folder / "config.json").unlink()
    elif edit == "no_rotation":
        torch.save(OrderedDict(weight=torch.zeros(4, 64), bias=torch.zeros(4)), tensors)
    elif edit == "pickled_code":
        class Payload:  # what weights_only=False would construct (and run) while reading
            def __reduce__(self):
                return (print, ("ran",))

        torch.save({"weight": Payload()}, tensors)
    with pytest.raises(BundleError, match=match):
        pyreft_save.import_pyreft_save(folder, model, tmp_path / "bundle", **options)
    assert not (tmp_path / "bundle").exists()


def test_the_command_imports_a_pyreft_folder(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    # SmolLM2-135M's hidden size (its config alone is read); the tensors converted to safetensors
    state = _state("LoreftIntervention", 576, 2, 0)
    folder = _write_save(tmp_path / "save", [(3, "LoreftIntervention", state)], 576)
    (folder / f"intkey_{_key(3)}.bin").unlink()
    save_file(dict(state), folder / f"intkey_{_key(3)}.safetensors")
    assert cli.main(["import-vector", str(folder), "--model", "smollm2-135m-instruct", "--out", str(tmp_path / "b"),
                     "--positions", "f5+l5"]) == 0
    assert "bundle:" in capsys.readouterr().out
    config = json.loads((tmp_path / "b" / "bundle.json").read_text())
    assert {k: config["hyperparameters"][k] for k in ("first", "last", "layers", "rank", "positions")} == \
        {"first": 5, "last": 5, "layers": [3], "rank": 2, "positions": "f5+l5"}
    assert config["source"]["format"] == "pyreft"
    weights = load_file(tmp_path / "b" / "weights.safetensors")
    assert torch.equal(weights["R"][0], state["rotate_layer"].T) and torch.equal(weights["W"][0], state["weight"])
    for extra, said in ((["--scale", "2"], "no strength"), (["--allow-other-model"], "names no model")):
        assert cli.main(["import-vector", str(folder), "--model", "smollm2-135m-instruct", "--out",
                         str(tmp_path / "c"), *extra]) == 1
        assert said in capsys.readouterr().err
    (tmp_path / "v.gguf").write_bytes(b"GGUF")
    assert cli.main(["import-vector", str(tmp_path / "v.gguf"), "--model", "smollm2-135m-instruct",
                     "--out", str(tmp_path / "d"), "--positions", "f5+l5"]) == 1
    assert "--positions applies to a pyreft save" in capsys.readouterr().err


def test_a_save_written_by_pyreft_scores_as_pyrefts_own_forward(model, tokenizer, tmp_path):
    pyreft = pytest.importorskip("pyreft")
    from pyreft.dataset import get_intervention_locations

    hidden, first, last = model.config.hidden_size, 3, 3
    torch.manual_seed(1)
    config = pyreft.ReftConfig(representations=[
        {"layer": 1, "component": "block_output", "low_rank_dimension": 4,
         "intervention": pyreft.LoreftIntervention(embed_dim=hidden, low_rank_dimension=4, dtype=torch.float32)},
        {"layer": 3, "component": "block_output", "low_rank_dimension": 2,
         "intervention": pyreft.NoreftIntervention(embed_dim=hidden, low_rank_dimension=2, add_bias=True,
                                                   dtype=torch.float32)}])
    reft_model = pyreft.get_reft_model(model, config, set_device=False, disable_model_grads=False)
    reft_model.eval()
    with torch.no_grad():
        for intervention in reft_model.interventions.values():
            for name, p in intervention.named_parameters():
                if "learned_source" in name or "proj_layer" in name:
                    p.mul_(6)  # a visible edit: torch.nn.Linear's initialisation is small
    reft_model.save(str(tmp_path / "save"))
    theirs = []
    for context, continuation in REQUESTS:
        ctx = tokenizer(context, add_special_tokens=False).input_ids
        cont = tokenizer(continuation, add_special_tokens=False).input_ids
        assert len(ctx) >= 2 * max(first, last)  # no capping: pyreft would pad the locations
        locations = get_intervention_locations(last_position=len(ctx), first_n=first, last_n=last, share_weights=True,
                                               num_interventions=2)
        with torch.no_grad():
            _, steered = reft_model({"input_ids": torch.tensor([ctx + cont])},
                                    unit_locations={"sources->base": (None, [[where] for where in locations])})
        logits = steered.logits[0, len(ctx) - 1:-1].double()
        theirs.append(float(logits.log_softmax(-1).gather(-1, torch.tensor(cont)[:, None]).sum()))
    bundle = pyreft_save.import_pyreft_save(tmp_path / "save", model, tmp_path / "bundle", positions="f3+l3")
    ours = _loglikelihoods(_mari(model, tokenizer, bundle))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(theirs, _loglikelihoods(_mari(model, tokenizer)))) > 1e-2
