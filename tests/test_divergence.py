"""The KL and cross-entropy columns (mari_eval/evaluation/divergence.py, issue 55.4) on a random Llama over bytes.

What a document's scores must be: zero KL for the untouched model, whose cross-entropy is its
lm-eval log-likelihood per token; and for every method, the scores of a continuation the method
itself decoded equal those read off its own decoding (``generate`` under its edit, one token at a
time over the cache), so the teacher-forced pass edits what generation edits.
"""

import math

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from mari_eval.evaluation import divergence
from mari_eval.injection.plan import BASE

from .helpers import tiny_bundles
from .test_batching import bundles, model, tokenizer  # noqa: F401 (its byte Llama's fixtures)
from .test_lora import random_bundle

TEXTS = [("The capital of France is", " a city on the Seine."), ("Fish breathe oxygen that is in", " the water.")]


@pytest.fixture(scope="module")
def all_bundles(bundles, model, tmp_path_factory):
    """test_batching's bundles (CAA, ITI, NL-ITI, MARI, ReFT on its byte Llama), a MARI whose gate never opens and a LoRA."""
    root = tmp_path_factory.mktemp("more")
    return {**bundles, "closed_mari": tiny_bundles(model, root / "closed", closed_gate=True)["mari"],
            "lora": str(random_bundle(model, scale=0.1).save(root / "lora"))}


def _lm(model, tokenizer, bundle=None):
    from mari_eval.evaluation.lm import MariLM

    return MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=bundle,
                  allow_other_model=True if bundle else None)


def _scores(lm, texts=TEXTS):
    return divergence.score_texts(lm.model, lm.plan, texts, lambda c, x: HFLM._encode_pair(lm, c, x), lm.instructed,
                                  lm.tokenizer.pad_token_id)


def test_the_untouched_model_has_no_divergence_and_its_loglikelihood_as_cross_entropy(model, tokenizer):
    lm = _lm(model, tokenizer)
    scores = _scores(lm)
    loglikelihoods = lm.loglikelihood([Instance("loglikelihood", {}, text, i) for i, text in enumerate(TEXTS)])
    for s, (ll, _) in zip(scores, loglikelihoods):
        assert s.kl == 0.0 and s.variant == BASE
        assert math.isclose(s.ce * s.tokens, -ll, rel_tol=1e-5)


@pytest.mark.parametrize("name", ["caa", "iti", "nl_iti", "reft", "lora", "mari", "closed_mari"])
def test_scores_are_those_of_the_methods_own_decoding(model, tokenizer, all_bundles, name):
    lm = _lm(model, tokenizer, all_bundles[name])
    context = HFLM._encode_pair(lm, *TEXTS[0])[0]
    variant = divergence.chosen_variant(model, lm.plan, context, lm.tokenizer.pad_token_id)
    sites = [*lm.plan.prompt_sites(len(context)), len(context) - 1]
    positions = (torch.zeros(len(sites), dtype=torch.long), torch.tensor(sites))
    ids = torch.tensor([context])
    edit = divergence.contextlib.nullcontext() if variant == BASE else lm.plan.apply(torch.full((len(sites),), variant), positions)
    with torch.no_grad(), edit:  # the method decodes 6 tokens, one forward pass each over the cache
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=lm.tokenizer.pad_token_id)
    continuation = out.sequences[0, len(context):].tolist()
    decoded = torch.log_softmax(torch.stack(out.logits, dim=1)[0].float(), -1)
    with torch.no_grad():
        base = torch.log_softmax(model(input_ids=out.sequences).logits[0, len(context) - 1:-1].float(), -1)
    scores = divergence.score_text(model, lm.plan, (context, continuation), context, lm.tokenizer.pad_token_id)
    assert scores.variant == variant and scores.tokens == 6
    assert math.isclose(scores.ce, float(-decoded.gather(-1, torch.tensor(continuation)[:, None]).mean()), rel_tol=1e-4)
    assert math.isclose(scores.kl, float((base.exp() * (base - decoded)).sum(-1).mean()), rel_tol=1e-3, abs_tol=1e-6)
    if name == "closed_mari":  # the gate never opens: the base model answers, nothing diverges
        assert variant == BASE and scores.kl == 0.0
    else:
        assert variant != BASE and scores.kl > 1e-4


def test_an_instruction_moves_the_prompting_row(model, tokenizer):
    lm = _lm(model, tokenizer)
    lm.instructed = lambda context: "Answer truthfully.\n\n" + context
    scores = _scores(lm)
    assert all(s.kl > 0 and math.isfinite(s.ce) for s in scores)


def test_a_document_without_a_continuation_is_refused(model, tokenizer):
    lm = _lm(model, tokenizer)
    with pytest.raises(ValueError, match="continuation of at least one token"):
        divergence.score_text(model, lm.plan, ([1, 2, 3], []), [1, 2, 3])


def test_a_document_the_method_leaves_unedited_is_read_once(model, tokenizer, all_bundles):
    # The untouched model, and MARI where its gate stays closed, read the plain context unedited: one
    # pass gives both distributions, so the KL is exactly 0 and the cross-entropy the untouched one's.
    calls = []
    handle = model.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        for name in (None, "closed_mari"):
            lm = _lm(model, tokenizer, all_bundles[name] if name else None)
            before = len(calls)
            context, continuation = HFLM._encode_pair(lm, *TEXTS[0])
            variant = divergence.chosen_variant(model, lm.plan, context, lm.tokenizer.pad_token_id)
            choosing = len(calls) - before
            scores = divergence.score_text(model, lm.plan, (context, continuation), context, lm.tokenizer.pad_token_id)
            assert variant == BASE and scores.kl == 0.0
            assert len(calls) - before == 2 * choosing + 1  # the choice again, then one teacher-forced pass
    finally:
        handle.remove()


def test_the_rows_of_a_shared_pass_read_the_untouched_model_once_per_document(model, tokenizer, all_bundles, monkeypatch):
    # A table's general-text step scores several rows over one SharedPass: the untouched model's reading
    # of a document is computed for the first row and kept for the others, which score exactly as alone.
    from mari_eval.evaluation.lm import MariLM
    from mari_eval.evaluation.shared_pass import SharedPass
    from repro.engine import divergence_run

    names = ["caa", "reft", "mari"]
    alone = [_scores(_lm(model, tokenizer, all_bundles[name])) for name in names]
    shared = SharedPass(model)
    lms = [MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=all_bundles[name],
                  allow_other_model=True, shared_pass=shared) for name in names]
    documents = [{"id": str(i), "context": context, "continuation": continuation} for i, (context, continuation) in enumerate(TEXTS)]
    monkeypatch.setattr(divergence_run, "load_general_text", lambda: documents)
    results = [divergence_run.measure(lm, divergence.TASK, None) for lm in lms]  # the path a table's evaluation takes
    for result, scores in zip(results, alone):
        assert result["documents"]["kl,none"] == {str(i): s.kl for i, s in enumerate(scores)}
        assert result["documents"]["ce,none"] == {str(i): s.ce for i, s in enumerate(scores)}
    kept = shared.untouched_text
    assert (kept.computed, kept.served) == (len(TEXTS), len(TEXTS) * (len(names) - 1))
    # Past its byte budget nothing is kept: each row reads the untouched model again, to the same scores.
    nothing_kept = divergence.UntouchedLogProbs(max_bytes=0)
    again = [divergence.score_texts(lm.model, lm.plan, TEXTS, lambda c, x, lm=lm: HFLM._encode_pair(lm, c, x), lm.instructed,
                                    lm.tokenizer.pad_token_id, untouched=nothing_kept) for lm in lms]
    assert again == alone and (nothing_kept.computed, nothing_kept.served) == (len(TEXTS) * len(names), 0)


BENIGN = [{"id": "user_oriented_task_0", "prompt": "Rewrite this more politely.\n\nGive me the file.",
           "instances": [{"input": "Give me the file.", "output": "Could you send me the file, please?"}]},
          {"id": "user_oriented_task_1", "prompt": "Name three fruits.",
           "instances": [{"input": "", "output": "Apple, pear and plum. " * 20}]}]  # longer than the answer's cap


def _benign(lm, monkeypatch):
    from repro.engine import divergence_run

    asked = []
    monkeypatch.setattr(divergence_run, "load_benign_instructions",
                        lambda name, use: asked.append((name, use)) or [dict(r) for r in BENIGN])
    result = divergence_run.measure(lm, divergence.BENIGN_TASK, None)  # the path a table's evaluation takes
    assert asked == [("user_oriented_instructions", "evaluation")]  # the evaluation-only set, asked for as such
    return result


def test_the_benign_text_is_the_authors_answer_after_the_request_as_generation_reads_it(model, tokenizer, monkeypatch):
    # Out of source (issue 81.1): the context is the request as generation renders and tokenises it (p* the token
    # generation edits), the continuation the first BENIGN_ANSWER_TOKENS tokens of the authors' answer.
    lm = _lm(model, tokenizer)
    result = _benign(lm, monkeypatch)
    assert result["n"] == 2 and result["tasks_run_together"] == [divergence.BENIGN_TASK]
    for record in BENIGN:
        context = lm.generation_ids(lm.chat_turn_prompt(record["prompt"]))  # this tokenizer has no template: prompt + "\n"
        answer = lm.tok_encode(record["instances"][0]["output"], add_special_tokens=False)[:divergence.BENIGN_ANSWER_TOKENS]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([context + answer])).logits[0, len(context) - 1:-1].float(), -1)
        ce = float(-lp.gather(-1, torch.tensor(answer)[:, None]).mean())
        assert result["documents"]["kl,none"][record["id"]] == 0.0
        assert math.isclose(result["documents"]["ce,none"][record["id"]], ce, rel_tol=1e-5)
    assert result["diagnostics"]["continuation_tokens"] == 35 + divergence.BENIGN_ANSWER_TOKENS  # the second one cut


def test_the_untouched_rendering_is_the_chat_turn_generation_uses(model, smollm2_path):
    # The untouched model's context must be what --model mari generates from without a bundle, template or not.
    import transformers

    from repro.engine.divergence_run import untouched_turn

    request = BENIGN[0]["prompt"]
    for tok in (transformers.AutoTokenizer.from_pretrained(smollm2_path), _byte_tokenizer()):
        lm = _lm(model, tok)
        assert untouched_turn(tok, request) == lm.chat_turn_prompt(request)
    assert untouched_turn(_byte_tokenizer(), request) == request + "\n"


def _byte_tokenizer():
    from .tiny import byte_tokenizer

    return byte_tokenizer()


@pytest.mark.parametrize("name, opened", [("mari", True), ("closed_mari", False)])
def test_a_gated_rows_benign_text_records_its_gate_rate(model, tokenizer, all_bundles, monkeypatch, name, opened):
    lm = _lm(model, tokenizer, all_bundles[name])
    result = _benign(lm, monkeypatch)
    diagnostics = result["diagnostics"]
    assert diagnostics["gate"] is True and diagnostics["prompts"] == 2
    untouched = diagnostics["answered_by"].get("the untouched model", 0)
    assert diagnostics["gate_rate"] == (2 - untouched) / 2 == (1.0 if opened else 0.0)
    kl = result["documents"]["kl,none"].values()
    assert all(v > 0 for v in kl) if opened else all(v == 0.0 for v in kl)


def test_an_instruction_moves_the_benign_row_and_not_the_answer(model, tokenizer, monkeypatch):
    # Prompting reads its own rendering of the request; the answer's tokens, and the untouched reading, stay.
    plain = _benign(_lm(model, tokenizer), monkeypatch)
    lm = _lm(model, tokenizer)
    lm.chat_turn_prompt = lambda user: "Answer helpfully.\n\n" + user + "\n"
    instructed = _benign(lm, monkeypatch)
    assert all(v > 0 for v in instructed["documents"]["kl,none"].values())
    assert instructed["diagnostics"]["continuation_tokens"] == plain["diagnostics"]["continuation_tokens"]


def test_a_measure_that_is_not_one_is_refused(model, tokenizer):
    from repro.engine import divergence_run

    with pytest.raises(ValueError, match="'benign' is not a KL and cross-entropy measurement; choose one of general_text"):
        divergence_run.measure(_lm(model, tokenizer), "benign", None)
