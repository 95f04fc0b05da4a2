"""The shared pass (mari_eval.evaluation.shared_pass): several methods' lm-eval log-likelihood runs computed
together give each method what its own MariLM run gives, while the frozen model encodes each
question's prompt once for all of them. A tiny random Llama (tests/tiny.py's sizes, the
SmolLM2 tokenizer's vocabulary, so that lm-eval's requests are real text) and tiny bundles of
every method: vanilla, CAA, ITI (edits inside its site layer), MARI with its gate (reads the
untouched rows) and without (experts only), ReFT (edits the prompt: its own prefix)."""

import pytest
import torch
import transformers

from mari_eval.injection import site
from mari_eval.evaluation.lm import MariLM
from mari_eval.evaluation.shared_pass import SharedPass

from .helpers import DISTINCT_GROUPS, PREAMBLE, QUESTIONS, PrefixEncodings, close, evaluate
from .helpers import lm_for, model, tokenizer, truthfulqa_requests, tiny_bundles  # noqa: F401 (fixtures)

# (name, MariLM keyword arguments); bundles are written by the ``bundles`` fixture
METHODS = [("vanilla", {}), ("caa", {}), ("iti", {}), ("mari", {}), ("mari", {"gate": "false"}), ("reft", {})]


@pytest.fixture(scope="module")
def bundles(model, tmp_path_factory):
    return tiny_bundles(model, tmp_path_factory.mktemp("bundles"))


def test_each_method_through_the_shared_pass_gets_its_own_runs_answers(model, tokenizer, bundles):
    alone = [evaluate(lm_for(model, tokenizer, bundles, name, options), truthfulqa_requests(), model) for name, options in METHODS]

    shared = SharedPass(model)
    lms = [lm_for(model, tokenizer, bundles, name, options, shared) for name, options in METHODS]  # all, before evaluating
    together = [evaluate(lm, truthfulqa_requests(), model) for lm in lms]

    for (name, options), (answers, records, _), (got, got_records, _) in zip(METHODS, alone, together):
        assert len(got) == len(answers) == len(truthfulqa_requests())
        for (x, greedy), (y, greedy_shared) in zip(answers, got):
            assert y == pytest.approx(x, abs=1e-5) and greedy_shared == greedy, (name, options)
        assert (len(got_records), len(records)) == ((6, 6) if name != "vanilla" else (0, 0))
        assert close(got_records, records), (name, options, got_records, records)
    # the bundles do something: each edited method's answers differ from the untouched model's
    vanilla = [x for x, _ in alone[0][0]]
    for answers, _, _ in alone[1:]:
        assert max(abs(x - v) for (x, _), v in zip(answers, vanilla)) > 1e-3

    # The first method's run computed every method's run of each distinct question group; the
    # others found theirs, and each method's group asked twice in a row was computed once.
    assert shared.stats["groups"] == DISTINCT_GROUPS and shared.stats["on_demand"] == 0
    assert shared.stats["served"] == DISTINCT_GROUPS * (len(METHODS) - 1) and shared.pending() == 0
    assert shared.stats["repeated"] == len(METHODS)
    # Each prompt was encoded once (mc1 and mc2 share it) by the frozen model for every method, and
    # once under ReFT's edit of the prompt, where each method alone encoded it once for itself.
    assert [counts.prefixes for _, _, counts in alone] == [len(QUESTIONS)] * len(METHODS)
    assert [counts.prefixes for _, _, counts in together] == [2 * len(QUESTIONS)] + [0] * (len(METHODS) - 1)
    # ... and the first layer read fewer tokens in all than the methods' own runs read together
    assert sum(c.tokens for _, _, c in together) < sum(c.tokens for _, _, c in alone)


def test_a_run_not_computed_ahead_is_computed_on_demand(model, tokenizer, bundles):
    shared = SharedPass(model)
    vanilla, caa, mari = (lm_for(model, tokenizer, bundles, name, {}, shared) for name in ("vanilla", "caa", "mari"))
    first, later = truthfulqa_requests(QUESTIONS[:2]), truthfulqa_requests(QUESTIONS)
    vanilla.loglikelihood(first)  # 3 distinct groups (the second question's mc1 and mc2 are one)
    assert shared.stats["groups"] == 3 and shared.pending() == 6  # CAA's and MARI's runs, 3 groups each
    got = caa.loglikelihood(later)  # 3 groups stored; the third question's 2 were never seen: computed now
    assert shared.stats["served"] == 3 and shared.stats["groups"] == 5 and shared.pending() == 3 + 2
    mine = lm_for(model, tokenizer, bundles, "caa", {}).loglikelihood(later)
    assert [x for x, _ in got] == pytest.approx([x for x, _ in mine], abs=1e-5)
    # asked again, CAA's runs are no longer stored (it took them): computed for it alone
    again = caa.loglikelihood(later)
    assert shared.stats["on_demand"] == DISTINCT_GROUPS and [x for x, _ in again] == pytest.approx([x for x, _ in got], abs=1e-5)
    mari.loglikelihood(later)
    assert shared.pending() == 0  # every stored run was taken by its method


def test_the_shared_pass_is_refused_for_another_model_or_as_a_model_arg(model, tokenizer, bundles):
    shared = SharedPass(model)
    other = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    with pytest.raises(ValueError, match="shared pass's model"):
        MariLM(pretrained=other, tokenizer=tokenizer, device="cpu", dtype="float32", shared_pass=shared)
    with pytest.raises(TypeError, match="cannot be given in --model_args"):
        MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", shared_pass="yes")


def test_reft_reuses_its_edited_preamble_and_answers_as_if_each_prompt_were_encoded_anew(model, tokenizer, bundles):
    from mari_eval.evaluation import runner
    from mari_eval.evaluation.prefix_cache import encode_prefix
    from mari_eval.evaluation.shared_pass import EditedPrefix

    reft = lm_for(model, tokenizer, bundles, "reft", {})
    plan = reft.plan
    preamble = tokenizer(PREAMBLE * 2)["input_ids"]  # 2 x 2 few-shot answers: a preamble past min_shared
    prompts = [preamble + tokenizer(f"Q: {q}\nA:")["input_ids"] for q, _, _ in QUESTIONS]
    options = [tokenizer(o)["input_ids"] for o in QUESTIONS[0][1]]
    assert plan.prompt_sites(len(prompts[0]))[:2] == [0, 1]  # the preamble's first tokens are edited

    def scores(prefixes: EditedPrefix) -> tuple[list, int]:
        counter = PrefixEncodings(model)
        try:
            out = [runner.score_variants(model, prefixes.encode(p), p[-1], options, plan, 1024).logprobs for p in prompts]
        finally:
            counter.remove()
        return out, counter.tokens

    reused, reused_tokens = scores(EditedPrefix(model, plan))
    anew, anew_tokens = scores(EditedPrefix(model, plan, min_shared=10**9))  # nothing reused
    for a, b in zip(reused, anew):
        assert torch.allclose(a, b, atol=1e-5)
    # the preamble (with its edited first tokens) was encoded once instead of once per prompt
    assert anew_tokens - reused_tokens >= (len(prompts) - 1) * (len(preamble) - 2)
    # ... and it carries the edit: over the frozen model's prefix, ReFT's answers differ
    frozen = runner.score_variants(model, encode_prefix(model, prompts[1][:-1]), prompts[1][-1], options, plan, 1024).logprobs
    assert (frozen - reused[1]).abs().max() > 1e-4


def test_mari_rows_over_one_bundle_compute_each_expert_and_probe_row_once(model, tokenizer, bundles, monkeypatch,
                                                                          tmp_path):
    from collections import Counter

    from mari_eval.mari import MARI

    from .tiny import tiny_mari

    # The fixture's MARI bundle with every control energy midway between the questions' energies:
    # tau_E lies there at any rho, so the gate opens on some questions and not on others.
    _, records, _ = evaluate(lm_for(model, tokenizer, bundles, "mari", {}), truthfulqa_requests(), model)
    energies = sorted({r["energy"] for r in records})
    midway = torch.full((20,), (energies[0] + energies[-1]) / 2)
    bundles = {"mari": str(tiny_mari(K=3, d=model.config.hidden_size, layers=site.num_layers(model), layer=1,
                                   energies=midway).save(tmp_path / "mari"))}

    edited = Counter()  # variant id -> rows MARI's edit was applied to
    original = MARI.edit_variants

    def counting(self, hidden, variant_ids):
        edited.update(variant_ids.tolist())
        return original(self, hidden, variant_ids)

    monkeypatch.setattr(MARI, "edit_variants", counting)
    rows = [{}, {"gate": "false"}, {"rho": "0.5"}, {"experts": "single"}]  # the ablation's and sensitivity's rows

    def experts_and_probe() -> tuple[int, int]:
        counts = dict(edited)
        edited.clear()
        return sum(n for v, n in counts.items() if v < 3), counts.get(4, 0)  # K = 3: experts 0..2, single 3, probe 4

    alone, counts = [], []
    for options in rows:
        alone.append(evaluate(lm_for(model, tokenizer, bundles, "mari", options), truthfulqa_requests(), model))
        counts.append(experts_and_probe())
    shared = SharedPass(model)
    lms = [lm_for(model, tokenizer, bundles, "mari", options, shared) for options in rows]
    together = [evaluate(lm, truthfulqa_requests(), model) for lm in lms]
    experts, probes = experts_and_probe()

    for options, (answers, records, _), (got, got_records, _) in zip(rows, alone, together):
        assert [x for x, _ in got] == pytest.approx([x for x, _ in answers], abs=1e-5), options
        assert close(got_records, records), (options, got_records, records)
    assert {r["gate_open"] for r in alone[0][1]} == {True, False}
    # Together: each distinct group's expert rows once (the gate-free row needs them all; the gated
    # rows take theirs), and its probe row once for both gated rows. Alone, every row ran its own
    # (and each method ran the repeated group again).
    option_rows = sum(len(o) for _, o in {(q, tuple(o)) for q, mc1, mc2 in QUESTIONS for o in (mc1, mc2)})
    assert experts == 3 * option_rows and probes == DISTINCT_GROUPS
    assert sum(e for e, _ in counts) > counts[1][0] > experts and counts[0][1] == counts[2][1] > probes
