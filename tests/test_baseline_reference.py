"""Each baseline against its original's formula or code, computed here by another path:
CAA's vector against the mean difference of transformers' own hidden states; ITI's head
ranking against scikit-learn logistic-regression probes on the same activations; ITI's and
NL-ITI's head representations against the attention output projection's inputs on the whole
sequence, over their token windows; LoReFT against pyreft's LoreftIntervention (when pyreft
is installed)."""

import numpy as np
import pytest
import torch

from baselines import caa, iti, reft
from mari_eval.training.train import Example

from .tiny import tiny_session
from .tiny import tiny_model
from .tiny import chat_free_session


def test_caa_vector_is_the_mean_difference_of_the_layers_hidden_states_at_the_answer_letter():
    model = tiny_model("llama")
    session = chat_free_session(model)
    pairs = [("Is ice cold?", "Yes", "No"), ("Is fire cold?", "No", "Yes"), ("2+2?", "4", "5"), ("Sky?", "Blue", "Green")]
    layer = 2
    vector = caa.steering_vector(session, pairs, layer)

    # CAA (Rimsky et al., 2024): mean over pairs of a(positive letter) - a(negative letter), the residual
    # stream after the layer at the answer letter's token; read here from output_hidden_states.
    def state(question, first, second, letter):
        ids = torch.tensor([caa.ab_prompt(session, question, first, second, letter)])
        with torch.no_grad():
            return model(input_ids=ids, output_hidden_states=True).hidden_states[layer + 1][0, -1]

    diffs = []
    for i, (question, positive, negative) in enumerate(pairs):
        first, second = (positive, negative) if i % 2 == 0 else (negative, positive)  # the letter alternates
        pos, neg = ("A", "B") if i % 2 == 0 else ("B", "A")
        diffs.append(state(question, first, second, pos) - state(question, first, second, neg))
    torch.testing.assert_close(vector, torch.stack(diffs).mean(0), atol=1e-5, rtol=1e-5)


def test_iti_ranks_heads_as_scikit_learn_logistic_regression_probes_do():
    from sklearn.linear_model import LogisticRegression

    g = torch.Generator().manual_seed(0)
    n, heads, dim = 240, 5, 6
    y = (torch.arange(n) % 2).float()
    signal = torch.tensor([0.0, 1.5, 0.4, 3.0, 0.8])  # how far apart the classes are on each head
    x = torch.randn(n, heads, dim, generator=g)
    x[:, :, 0] += (2 * y[:, None] - 1) * signal[None, :] / 2
    fit, val = slice(0, 160), slice(160, n)
    ours = iti.probe_accuracy(x[fit], y[fit], x[val], y[val], "linear", seed=0)
    # Li et al. (2023): one logistic-regression probe per head, ranked by validation accuracy.
    theirs = torch.tensor([LogisticRegression(max_iter=1000).fit(x[fit, h].numpy(), y[fit].numpy())
                           .score(x[val, h].numpy(), y[val].numpy()) for h in range(heads)])
    top_ours, top_theirs = iti.rank_heads(ours)[:3].tolist(), theirs.argsort(descending=True)[:3].tolist()
    assert top_ours == top_theirs and top_ours[:2] == [3, 1]  # the two strongest heads by construction first
    assert np.corrcoef(ours.numpy(), theirs.numpy())[0, 1] > 0.9


@pytest.mark.parametrize("tokens", [1, 4])  # ITI reads the last token; NL-ITI the last 4 (Hoscilowicz et al., 2024)
def test_head_outputs_average_the_attention_projection_inputs_over_the_last_tokens(tokens):
    model = tiny_model("llama")
    session = tiny_session(model)
    context, continuations = [5, 17, 33, 2, 41], [[3, 4, 6, 7, 8], [70, 71]]
    ex = Example("ex", context, continuations, 0)
    session.prepare([ex], "test", lower=False)
    got = iti.head_outputs(session, ex, continuations, tokens)  # [M, layers, heads * head_dim]
    for m, continuation in enumerate(continuations):
        seen = {}
        hooks = [layer.self_attn.o_proj.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(i, args[0][0])) for i, layer in enumerate(model.model.layers)]
        with torch.no_grad():
            model(input_ids=torch.tensor([context + continuation]))
        for h in hooks:
            h.remove()
        end = len(context) + len(continuation)
        window = slice(max(len(context), end - tokens), end)  # the continuation's last tokens, never the prompt's
        expected = torch.stack([seen[i][window].mean(0) for i in range(len(model.model.layers))])
        torch.testing.assert_close(got[m], expected, atol=1e-5, rtol=1e-4)


def test_loreft_equals_pyreft_loreft_intervention():
    pytest.importorskip("pyreft")
    from pyreft.interventions import LoreftIntervention

    g = torch.Generator().manual_seed(0)
    d, r = 16, 3
    R = reft.orthonormal_rows(torch.randn(r, d, generator=g))
    W, b, h = torch.randn(r, d, generator=g), torch.randn(r, generator=g), torch.randn(7, d, generator=g)
    theirs = LoreftIntervention(embed_dim=d, low_rank_dimension=r, dtype=torch.float32)
    theirs.load_state_dict({"weight": W, "bias": b, "rotate_layer": R.T.contiguous()})
    with torch.no_grad():
        torch.testing.assert_close(reft.loreft(h, R, W, b), theirs(h), atol=1e-5, rtol=1e-5)
