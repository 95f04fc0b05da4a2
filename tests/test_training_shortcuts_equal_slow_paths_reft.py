"""ReFT's published fit runs a batch's prompts packed in one pass (``packed_nll``)
instead of one prompt at a time. The one-at-a-time path stays (sliding windows, dropout) and is
the reference: the same losses, gradients and fitted bundle to 1e-5."""

from types import SimpleNamespace

import pytest
import torch

from baselines import loreft, reft, reft_published, reft_step
from baselines.common import SELECTION_KEY
from mari_eval.training.train import Example

from .tiny import tiny_session
from .tiny import tiny_model

CONFIG = {"base_model": {"name": "tiny", "hidden_size": 32, "num_layers": 4}, "site": {"layer": 1}}


def _examples(preamble, n=10):
    gen = torch.Generator().manual_seed(5)
    draw = lambda k: torch.randint(1, 97, (k,), generator=gen).tolist()
    return [Example(f"ex{i}", preamble + draw(3 + i % 7), [draw(1 + (i + j) % 3) for j in range(3)], i % 3)
            for i in range(n)]


def _one_at_a_time(monkeypatch):
    original = reft_published.batch_gradient
    monkeypatch.setattr(reft_published, "batch_gradient", lambda *args: original(*args[:6], packed=False))


@pytest.mark.parametrize("preamble", [list(range(40, 52)), []])  # a preamble shared by every prompt, or none
@pytest.mark.parametrize("max_tokens", [1024, 30])  # one packed pass per step, or several
def test_packed_steps_fit_the_bundle_one_prompt_at_a_time_fitted(preamble, max_tokens, monkeypatch):
    monkeypatch.setattr(reft_published, "MIN_STEPS", 4)  # the step rule's 100 steps are not what this tests
    model = tiny_model("llama").requires_grad_(False)
    session = tiny_session(model)
    session.max_tokens = max_tokens
    examples = _examples(preamble)
    session.prepare(examples, "tiny", lower=False)
    given = {"recipe": "published", "epochs": 2, "batch": 4}
    fitted = reft.ReFT.fit(session, SimpleNamespace(train=examples), CONFIG, given, seed=0)
    with monkeypatch.context() as m:
        _one_at_a_time(m)
        reference = reft.ReFT.fit(session, SimpleNamespace(train=examples), CONFIG, given, seed=0)
    for name in ("R", "W", "b"):
        torch.testing.assert_close(fitted.tensors[name], reference.tensors[name], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fitted.tensors["W"][0], loreft.linear_init(torch.Generator().manual_seed(0), 8, 32))
    got, expected = fitted.config["diagnostics"], reference.config["diagnostics"]
    assert got[SELECTION_KEY] == pytest.approx(expected[SELECTION_KEY], abs=1e-5)
    for a, b in zip(got["history"], expected["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_a_packed_step_has_the_one_at_a_time_loss_and_gradient():
    model = tiny_model("llama").requires_grad_(False)
    session = tiny_session(model)
    examples = _examples(list(range(40, 52)), n=5)
    session.prepare(examples, "tiny", lower=False)
    gen = torch.Generator().manual_seed(1)
    params = {"free": torch.randn(4, 8, 32, generator=gen), "W": torch.randn(4, 8, 32, generator=gen) * 0.1,
              "b": torch.randn(4, 8, generator=gen) * 0.1}
    params = {k: v.requires_grad_(True) for k, v in params.items()}

    def plan():  # R's graph is freed by each step's last backward pass: one plan per step
        R = loreft.orthonormal_rows(params["free"])
        return reft_published.Plan((0,), lambda ids, pos: loreft.edits_at_layers(
            model, [0, 1, 2, 3], lambda i, h: loreft.loreft(h, R[i], params["W"][i], params["b"][i]), pos))

    sites = lambda length: loreft.pyreft_positions(length, 7, 7)
    shared = reft_step.shared_length(examples, 7, 7)
    assert shared > 1  # the preamble runs once per step in both paths
    packed = reft_step.batch_gradient(session, examples, plan(), sites, params, shared, packed=True)
    alone = reft_step.batch_gradient(session, examples, plan(), sites, params, shared, packed=False)
    assert packed[0] == pytest.approx(alone[0], abs=1e-5)
    for name in params:
        torch.testing.assert_close(packed[1][name], alone[1][name], atol=1e-5, rtol=1e-4)
        assert packed[1][name].abs().sum() > 0
