"""The injection site on tiny random models of every supported family."""

import pytest
import torch

from mari_eval.injection import layer_spans, site

from .tiny import VOCAB, tiny_model as _tiny

FAMILIES = ["llama", "mistral", "qwen2", "gemma3", "gpt2"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return _tiny(request.param)


_DIRECTION = torch.linspace(-1.0, 1.0, 32)  # not constant: LayerNorm would erase a uniform shift


def _shift(delta: float):
    return lambda h: h + delta * _DIRECTION


def test_finds_layers_and_rejects_bad_layer(model):
    assert site.num_layers(model) == 4
    for bad in (-1, 4, 99):
        with pytest.raises(site.SiteError, match=f"Layer {bad} is out of range .* 4 decoder layers"):
            site.check_layer(model, bad)


def test_unknown_architecture_is_named():
    with pytest.raises(site.SiteError, match="Cannot find the decoder layers of Linear"):
        site.decoder_layers(torch.nn.Linear(2, 2))


def test_last_token_positions_left_and_right_padding():
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    assert site.last_token_positions(right).tolist() == [2, 3, 0]
    assert site.last_token_positions(left).tolist() == [3, 3, 3]
    with pytest.raises(ValueError, match="empty prompt"):
        site.last_token_positions(torch.tensor([[0, 0]]))


def test_hidden_at_site_is_the_residual_after_the_layer(model):
    ids = torch.randint(3, VOCAB, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # right padding
    pos = site.last_token_positions(mask)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for layer in (0, 2):
        got = layer_spans.hidden_at_site(model, ids, mask, layer, pos)
        want = ref[layer + 1][torch.arange(3), pos]
        torch.testing.assert_close(got, want)


def test_edit_changes_only_positions_from_p_star_on(model):
    ids = torch.randint(3, VOCAB, (1, 8))
    with torch.no_grad():
        base = model(ids).logits
        with site.edit_site(model, 1, _shift(3.0), torch.tensor([4])) as state:
            edited = model(ids).logits
    assert state["calls"] == 1
    torch.testing.assert_close(edited[:, :4], base[:, :4])  # causal: nothing before p* moves
    assert (edited[:, 4:] - base[:, 4:]).abs().amax() > 1e-3


def test_right_padded_batch_equals_unbatched(model):
    torch.manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n,)) for n in (5, 8, 3)]
    width = max(len(s) for s in seqs)
    batch = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    p_star = torch.tensor([len(s) - 1 for s in seqs])
    with torch.no_grad(), site.edit_site(model, 2, _shift(2.0), p_star):
        batched = model(batch).logits
    for i, s in enumerate(seqs):
        with torch.no_grad(), site.edit_site(model, 2, _shift(2.0), torch.tensor([len(s) - 1])):
            alone = model(s[None]).logits
        torch.testing.assert_close(batched[i, : len(s)], alone[0], atol=1e-5, rtol=1e-4)


def _greedy_without_cache(model, prompt, layer, edit, steps):
    """Reference: recompute the whole sequence every step, editing the prompt's last token."""
    seq = prompt.clone()
    for _ in range(steps):
        with torch.no_grad(), site.edit_site(model, layer, edit, torch.tensor([len(prompt) - 1])):
            nxt = model(seq[None]).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq[len(prompt):]


def test_generation_edits_once_at_prefill_with_kv_cache(model):
    torch.manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,)) for n in (6, 4)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generation uses
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    edit = _shift(4.0)
    with torch.no_grad(), site.edit_site(model, 1, edit) as state:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             use_cache=True, pad_token_id=0)
    assert state["calls"] == 1, "decode steps must not be edited again"
    for i, p in enumerate(prompts):
        want = _greedy_without_cache(model, p, 1, edit, 5)
        assert out[i, width:].tolist() == want.tolist()
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert not torch.equal(plain, out), "the edit should change what is generated"


def test_hooks_removed_on_exit_and_error(model):
    blocks = site.decoder_layers(model)
    layer = blocks[2]
    before = len(layer._forward_hooks)  # transformers may keep hooks of its own
    counts = [len(b._forward_hooks) for b in blocks]
    with pytest.raises(RuntimeError, match="boom"):
        with site.edit_site(model, 2, _shift(1.0)):
            assert len(layer._forward_hooks) == before + 1
            raise RuntimeError("boom")
    assert len(layer._forward_hooks) == before
    with site.capture_site(model, [0, 2]):
        pass
    assert [len(b._forward_hooks) for b in blocks] == counts


def test_gradient_reaches_the_editor(model):
    vec = torch.zeros(32, requires_grad=True)
    ids = torch.randint(3, VOCAB, (2, 5))
    with site.edit_site(model, 1, lambda h: h + vec, torch.tensor([2, 4])):
        loss = model(ids).logits[:, -1].logsumexp(-1).sum()
    loss.backward()
    assert vec.grad is not None and vec.grad.abs().sum() > 0


def test_capture_inside_edit_sees_the_edited_state(model):
    ids = torch.randint(3, VOCAB, (1, 6))
    pos = torch.tensor([3])
    with torch.no_grad():
        with site.capture_site(model, [1, 3], pos) as plain:
            model(ids)
        with site.edit_site(model, 1, _shift(5.0), pos), site.capture_site(model, [1, 3], pos) as edited:
            model(ids)
    torch.testing.assert_close(edited[1], plain[1] + 5.0 * _DIRECTION)
    assert (edited[3] - plain[3]).norm() > 0
