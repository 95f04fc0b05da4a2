"""Where a vector method edits, chosen at evaluation (mari_eval/vectors/edit_positions.py, issue 57.4):
``positions=all|from_last|last|from:N`` and ``layers=A-B`` for CAA, control vectors and steered
configs, checked against the hidden states each rule should move."""

import pytest
import torch
from lm_eval.api.instance import Instance

from mari_eval.injection import site
from mari_eval.vectors import control_vector
from mari_eval.vectors.edit_positions import EditPositions, parse_layers
from mari_eval.evaluation.lm import MariLM

from .test_batching import bundles, model, tokenizer  # noqa: F401 (its byte Llama's fixtures)

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])
EVERY = (torch.zeros(6, dtype=torch.long), torch.arange(6))


def _moved(model, bundle, layer: int) -> list[bool]:
    """Which of IDS's positions the bundle's plan moves after ``layer`` (p*: the last position)."""
    plan = bundle.plan(model)
    sites = [*plan.prompt_sites(6), 5]
    positions = (torch.zeros(len(sites), dtype=torch.long), torch.tensor(sites))
    with torch.no_grad(), site.capture_site(model, [layer], EVERY) as plain:
        model(input_ids=IDS)
    with torch.no_grad(), plan.apply(None, positions), site.capture_site(model, [layer], EVERY) as steered:
        model(input_ids=IDS)
    return ((steered[layer] - plain[layer]).norm(dim=-1) > 1e-6).tolist()


@pytest.mark.parametrize("positions, moved", [
    (None, [False] * 5 + [True]),  # CAA's own: p* (and later tokens)
    ("from_last", [False] * 5 + [True]),
    ("last", [False] * 5 + [True]),
    ("all", [True] * 6),
    ("from:2", [False, False, True, True, True, True]),
    ("from:40", [False] * 5 + [True]),  # beyond the prompt: from p* on
])
def test_caa_edits_where_positions_says(model, bundles, positions, moved):
    from mari_eval.methods import hub

    bundle = hub.load_bundle(bundles["caa"])  # loaded as the lm-eval class loads it
    bundle.configure_from({} if positions is None else {"positions": positions})
    assert _moved(model, bundle, bundle.layer) == moved


def test_last_leaves_the_generated_tokens_alone_and_from_last_edits_them(model, bundles):
    from mari_eval.methods import hub

    calls = {}
    for rule in ("last", "from_last"):
        bundle = hub.load_bundle(bundles["caa"])
        bundle.configure_from({"positions": rule})
        with bundle.plan(model).apply(None, None) as state:
            model.generate(input_ids=IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)
        calls[rule] = state["calls"]
    assert calls == {"last": 1, "from_last": 3}  # the prefill alone, or every decode step too


def test_caa_layers_adds_its_vector_after_each_layer_of_the_range(model, bundles):
    from mari_eval.methods import hub

    bundle = hub.load_bundle(bundles["caa"])
    bundle.configure_from({"layers": "1-3"})
    plan = bundle.plan(model)
    with torch.no_grad(), site.capture_site(model, [1, 2, 3], EVERY) as plain:
        model(input_ids=IDS)
    with torch.no_grad(), site.capture_site(model, [0], EVERY) as plain0:
        model(input_ids=IDS)
    with torch.no_grad(), plan.apply(None, None), site.capture_site(model, [0, 1, 2, 3], EVERY) as steered:
        model(input_ids=IDS)
    assert torch.equal(steered[0], plain0[0])  # below the range: untouched
    vector = bundle.strength() * bundle.tensors["vector"]
    for layer in (1, 2, 3):  # p* moved after each layer of the range; the prompt before it not
        assert (steered[layer][5] - plain[layer][5]).norm() > 1e-6
        assert torch.allclose(steered[layer][:5], plain[layer][:5])
    # after layer 1, p* is exactly the plain state plus the vector (nothing below it was edited)
    assert torch.allclose(steered[1][5], plain[1][5] + vector, atol=1e-5)
    assert bundle.summarize([])["layers"] == [1, 2, 3]


def test_a_control_vector_keeps_only_its_directions_in_the_range_and_can_edit_from_p_star(model, tmp_path):
    directions = {1: torch.randn(model.config.hidden_size), 3: torch.randn(model.config.hidden_size)}
    path = control_vector.build(directions, model, {"format": control_vector.GGUF_FORMAT, "sha256": "x"}).save(tmp_path / "cv")
    from mari_eval.methods import hub

    bundle = hub.load_bundle(path)
    assert _moved(model, bundle, 1) == [True] * 6  # llama.cpp's: every position
    bundle.configure_from({"layers": "2-3", "positions": "last"})
    assert bundle.applied_layers() == [(1, 3)]
    assert _moved(model, bundle, 1) == [False] * 6  # layer 1's direction left out
    assert _moved(model, bundle, 3) == [False] * 5 + [True]
    with pytest.raises(ValueError, match=r"layers=0 in --model_args: this bundle has directions at layers \[1, 3\]"):
        bundle.configure_from({"layers": "0"})


def test_positions_change_the_scores_through_the_lm_eval_class(model, tokenizer, bundles):
    requests = [Instance("loglikelihood", {}, ("The sea is", " blue."), 0)]
    scores = {}
    for rule in ("from_last", "all"):
        lm = MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=bundles["caa"],
                    allow_other_model=True, positions=rule)
        scores[rule] = lm.loglikelihood(requests)[0][0]
        assert lm.intervention.summarize([])["positions"] == rule
    default = MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=bundles["caa"],
                     allow_other_model=True).loglikelihood(requests)[0][0]
    assert default == scores["from_last"] and abs(scores["all"] - default) > 1e-4


@pytest.mark.parametrize("text, match", [("everywhere", "give one of all, from_last, last, from:N"),
                                         ("from:-1", "give one of")])
def test_a_positions_value_that_is_not_a_rule_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        EditPositions.parse(text)


@pytest.mark.parametrize("text, expected", [("2-4", [2, 3, 4]), ("3", [3]), (" 1 - 2 ", [1, 2])])
def test_layers_parse(text, expected):
    assert parse_layers(text, 6) == expected


@pytest.mark.parametrize("text", ["4-2", "0-6", "a-b", "1.5"])
def test_layers_outside_the_model_or_not_a_range_are_refused(text):
    with pytest.raises(ValueError, match=f"layers={text!r} in --model_args"):
        parse_layers(text, 6)
