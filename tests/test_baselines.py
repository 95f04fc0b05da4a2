"""Baselines: each edit against its formula, the fit direction on the embedded model, save/load."""

import pytest
import torch

from baselines import caa
from mari_eval import runner, site

from .tiny import reloaded, tiny_model


def _caa(d=32, layers=4, layer=2, multiplier=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    config = {"base_model": {"name": "tiny", "hidden_size": d, "num_layers": layers}, "site": {"layer": layer},
              "hyperparameters": {"multiplier": multiplier}}
    return caa.CAA(config, {"vector": torch.randn(d, generator=g)})


def test_caa_edit_is_h_plus_multiplier_times_vector():
    bundle = _caa()
    h = torch.randn(5, 32)
    torch.testing.assert_close(bundle.edit(h), h + 3.0 * bundle.tensors["vector"])


def test_caa_edits_p_star_and_every_later_position_only():
    model = tiny_model("llama")
    bundle = _caa()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    p_star = torch.tensor([2, 4])
    every = (torch.arange(2).repeat_interleave(6), torch.arange(6).repeat(2))
    with torch.no_grad(), site.capture_site(model, [bundle.layer], every) as plain:
        model(input_ids=ids)
    with torch.no_grad(), bundle.applied(model, p_star), site.capture_site(model, [bundle.layer], every) as steered:
        model(input_ids=ids)
    moved = (steered[bundle.layer] - plain[bundle.layer]).norm(dim=-1).reshape(2, 6) > 1e-6
    assert moved.tolist() == [[False, False, True, True, True, True], [False, False, False, False, True, True]]
    # Under generate the decode steps are steered too (the original adds the vector at every new token).
    with bundle.applied(model, None) as state:
        model.generate(input_ids=ids[:1], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert state["calls"] == 3


def test_caa_round_trip_is_identical(tmp_path):
    model = tiny_model("llama")
    bundle = _caa()
    loaded = reloaded(bundle, tmp_path / "caa")
    prefix = runner.encode_prefix(model, [5, 17, 33, 2])
    runs = [runner.score_variants(model, prefix, 41, [[3, 4], [70, 71, 72]], [0],
                                  lambda ids, pos, b=b: b.applied(model, pos, ids)) for b in (bundle, loaded)]
    assert torch.equal(runs[0].logprobs, runs[1].logprobs)


@pytest.mark.needs_data
def test_caa_fit_lowers_the_held_out_training_loss_on_the_embedded_model():
    from mari_eval.data import make_splits
    from mari_eval.train import Session, attribute_data, provenance

    session = Session("smollm2-135m-instruct")
    data = attribute_data(session, "truthfulqa", seed=0, max_train=20, max_ctrl=1)
    config = provenance(session, "truthfulqa", 0, make_splits("truthfulqa", 0), [ex.id for ex in data.train])
    fitted = caa.CAA.fit(session, data, config, {"layers": [20], "multipliers": [4.0]}, seed=0)
    diag = fitted.config["diagnostics"]
    assert diag["validation_loss"]["20:4.0"] < diag["validation_loss_base"]  # steering toward the truthful answers helps
    assert fitted.layer == 20 and fitted.tensors["vector"].shape == (576,)
