"""The runner on its own: a toy plan (each variant adds its own vector at the site) scored and
generated through mari_eval.evaluation.runner / mari_eval.evaluation.generation against running each edit alone
on the whole sequence. No method is involved: what is tested is the runner's bookkeeping
(packing, the shared prefix, lower states, site-only rows, the screen, the choice)."""

import dataclasses

import pytest
import torch

from mari_eval.evaluation import generation, runner
from mari_eval.injection import site
from mari_eval.injection.plan import BASE, VANILLA, Plan, VariantRun
from mari_eval.evaluation.prefix_cache import encode_prefix

from .tiny import tiny_model

LAYER = 1
CONTEXT = [5, 17, 33, 2, 41, 8, 9, 60, 11]
OPTIONS = [[3, 4], [70, 71, 72], [5]]


def _shifts(d: int = 32, n: int = 3) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(1))


def _toy_plan(model, shifts: torch.Tensor, variants=(BASE, 0, 1, 2), **fields) -> Plan:
    """Variant v adds shifts[v] to the state after LAYER; BASE rows pass through."""

    def edit(h, ids):
        return torch.where((ids >= 0)[:, None], h + shifts.to(h)[ids.clamp_min(0)], h)

    return dataclasses.replace(Plan.at_site(model, LAYER, edit, variants), **fields)


def _alone(model, shift: torch.Tensor | None, context, option) -> float:
    """log p(option | context) with ``shift`` added at p* after LAYER, on the whole sequence."""
    ids = torch.tensor([context + option[:-1]])
    edit = (lambda h: h) if shift is None else (lambda h: h + shift.to(h))
    with torch.no_grad(), site.edit_site(model, LAYER, edit, torch.tensor([len(context) - 1])):
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(context) - 1:].float(), -1)
    return float(logp.gather(-1, torch.tensor(option)[:, None]).sum())


def _score(model, plan, context=CONTEXT, options=OPTIONS) -> VariantRun:
    with torch.no_grad():
        return runner.score_variants(model, encode_prefix(model, context[:-1]), context[-1], options, plan)


@pytest.mark.parametrize("family, window", [("llama", 16), ("gemma3", 16), ("gemma3", 6)])
def test_every_variant_equals_its_edit_run_alone(family, window):
    # gemma3 with a 6-token window: the rows cross it, so the runner takes its padded-batch path
    model = tiny_model(family, sliding_window=window)
    shifts = _shifts()
    run = _score(model, _toy_plan(model, shifts))
    assert run.variants == [BASE, 0, 1, 2] and run.scored is not None and run.scored == {BASE, 0, 1, 2}
    for v in run.variants:
        for m, option in enumerate(OPTIONS):
            expected = _alone(model, None if v == BASE else shifts[v], CONTEXT, option)
            assert float(run.logprobs[run.row(v), m]) == pytest.approx(expected, abs=1e-4)


def test_vanilla_plan_scores_the_untouched_model_and_flags_greedy_options():
    model = tiny_model("llama")
    run = _score(model, VANILLA)
    for m, option in enumerate(OPTIONS):
        assert float(run.logprobs[0, m]) == pytest.approx(_alone(model, None, CONTEXT, option), abs=1e-4)
    with torch.no_grad():  # the greedy continuation of the context, two tokens long, is flagged greedy
        first = int(model(input_ids=torch.tensor([CONTEXT])).logits[0, -1].argmax())
        second = int(model(input_ids=torch.tensor([CONTEXT + [first]])).logits[0, -1].argmax())
    greedy = _score(model, VANILLA, options=[[first, second], [(first + 1) % 97, second]]).greedy
    assert greedy.tolist() == [[True, False]]


def test_edited_rows_start_from_the_untouched_rows_states_below_the_site():
    model = tiny_model("llama")
    plan = _toy_plan(model, _shifts())
    whole = _score(model, plan)
    fed = []
    hook = site.attention_output(model, 0).register_forward_hook(lambda m, args, out: fed.append(args[0].shape[1]))
    shared = _score(model, dataclasses.replace(plan, edit_layer=LAYER))
    hook.remove()
    torch.testing.assert_close(shared.logprobs, whole.logprobs, atol=1e-4, rtol=0)
    # layer 0 read the prompt before p*, then the BASE rows (every option token once); for the edited
    # rows, which begin above it, it saw a single placeholder token (layer_spans.start_after)
    assert fed[:2] == [len(CONTEXT) - 1, sum(len(o) for o in OPTIONS)] and set(fed[2:]) == {1}


def test_site_only_variants_run_p_star_alone_and_are_not_scored():
    model = tiny_model("llama")
    shifts = _shifts()
    fed = []
    plan = _toy_plan(model, shifts, variants=(BASE, 0, 1), site_only=(1,), capture=(LAYER, 3))
    hook = site.attention_output(model, 0).register_forward_hook(lambda m, args, out: fed.append(args[0].shape[1]))
    run = _score(model, plan)
    hook.remove()
    assert run.scored == {BASE, 0} and not run.was_scored(1) and run.logprobs[run.row(1)].isnan().all()
    assert sorted(run.site) == [LAYER, 3] and all(states.shape == (3, 32) for states in run.site.values())
    # the site-only row's state after LAYER is the untouched state plus its shift
    torch.testing.assert_close(run.site[LAYER][run.row(1)], run.site[LAYER][run.row(BASE)] + shifts[1], atol=1e-5, rtol=0)
    n_tokens = sum(len(o) for o in OPTIONS)
    # the prompt before p*; BASE and variant 0 score every option token; variant 1 is p* alone
    assert sum(fed) == len(CONTEXT) - 1 + 2 * n_tokens + 1


def test_a_screen_that_says_no_leaves_the_answering_variants_unrun():
    model = tiny_model("llama")
    asked = []

    def screen(run):
        asked.append(sorted(run.scored))
        return False

    plan = _toy_plan(model, _shifts(), variants=(BASE, 0, 1, 2), site_only=(2,), capture=(LAYER,), screen=screen)
    run = _score(model, plan)
    assert asked == [[BASE]]  # it saw the untouched run and the site-only rows only
    assert run.logprobs[[run.row(0), run.row(1)]].isnan().all() and run.scored == {BASE}
    assert torch.equal(run.logprobs[run.row(BASE)], _score(model, VANILLA).logprobs[0])  # bit-identical to vanilla
    assert run.nonfinite() == []  # placeholders of unrun variants are not non-finite results


def test_nonfinite_names_the_variant_and_what_is_not_finite():
    run = VariantRun([BASE, 0], torch.tensor([[-1.0, -2.0], [float("nan"), -1.0]]), None,
                     {3: torch.tensor([[0.0, 1.0], [float("inf"), 1.0]])})
    assert run.nonfinite() == [(0, "log-likelihood"), (0, "hidden state at p* after layer 3")]


def test_generation_continues_each_prompt_with_the_variant_choose_picks():
    model = tiny_model("llama")
    shifts = _shifts() * 4  # large enough that the variants generate different text
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    picks = {0: 2, 1: 0}

    def choose(run):
        assert run.entropy is not None and run.was_scored(0)  # every variant ran the routing window
        return picks[run.prompt], {"picked": picks[run.prompt]}

    plan = _toy_plan(model, shifts, variants=(0, 1, 2), choose=choose, window=3)
    out, records = generation.generate_variants(model, prompts, torch.ones_like(prompts), plan, max_length=12,
                                                pad_token_id=0, do_sample=False)
    assert records == [{"picked": 2}, {"picked": 0}]
    for p, v in picks.items():
        with site.edit_site(model, LAYER, lambda h, v=v: h + shifts[v].to(h), None):
            alone = model.generate(input_ids=prompts[p:p + 1], max_length=12, do_sample=False, pad_token_id=0)
        assert out[p, : alone.shape[1]].tolist() == alone[0].tolist()


def test_routing_entropy_is_the_mean_next_token_entropy_of_each_variants_window():
    model = tiny_model("llama")
    shifts = _shifts()
    prompt = [5, 6, 7, 8]
    plan = _toy_plan(model, shifts, variants=(0, 1))
    u = generation.routing_entropy(model, prompt, plan, window=2)
    for v in (0, 1):
        with torch.no_grad(), site.edit_site(model, LAYER, lambda h, v=v: h + shifts[v].to(h), None):
            out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=2, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
        steps = [generation.step_entropy(logits[0]) for logits in out.logits]
        assert float(u[v]) == pytest.approx(float(sum(steps) / len(steps)), abs=1e-4)
