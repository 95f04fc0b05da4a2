"""lm-eval's ``batch_size`` on ``--model mari``: several questions per forward pass score as one at a time.

A random Llama (GQA, 4 layers) over a byte tokenizer, float32 on the CPU; tests/test_cuda.py
runs the same comparison on a GPU in bf16 and float32. Questions with and without a shared
few-shot preamble, repeated prompts (TruthfulQA's mc1 and mc2 of a doc) and options of
different counts and lengths, so batches hold prompts of several shapes.
"""

import pytest
from lm_eval.api.instance import Instance

from mari_eval.evaluation import batching
from mari_eval.evaluation.lm import MariLM

from .tiny import tiny_iti
from .helpers import PREAMBLE, QUESTIONS, tiny_bundles
from .tiny import byte_llama, byte_tokenizer

# (name, MariLM keyword arguments): every method, MARI with its gate and without
METHODS = [("vanilla", {}), ("caa", {}), ("iti", {}), ("nl_iti", {}), ("mari", {}), ("mari", {"gate": "false"}),
           ("reft", {})]
MORE = [("Name a primary colour.", [" Red.", " Pink."], [" Red.", " Blue.", " Pink.", " Grey."]),
        ("What do bees make?", [" Honey.", " Milk."], [" Honey.", " Silk."])]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return byte_llama(tokenizer, layers=4, hidden=64)


@pytest.fixture(scope="module")
def bundles(model, tmp_path_factory):
    from baselines import iti

    root = tmp_path_factory.mktemp("bundles")
    made = tiny_bundles(model, root)
    made["nl_iti"] = str(tiny_iti(model, heads=((2, 1), (3, 2)), alpha=5.0, cls=iti.NLITI).save(root / "nl_iti"))
    return made


def _requests() -> list[Instance]:
    """Every question with the preamble (mc1 and mc2), and the MORE ones without it."""
    out = []
    for doc_id, (question, mc1, mc2) in enumerate(QUESTIONS + MORE):
        prompt = f"{PREAMBLE if doc_id < len(QUESTIONS) else ''}Q: {question}\nA:"
        doc = {"mc1_targets": {"choices": mc1, "labels": [1] + [0] * (len(mc1) - 1)},
               "mc2_targets": {"choices": mc2, "labels": [1] + [0] * (len(mc2) - 1)}}
        for task, options in (("truthfulqa_mc1", mc1), ("truthfulqa_mc2", mc2)):
            out += [Instance("loglikelihood", doc, (prompt, option), i, metadata=(task, doc_id, 1))
                    for i, option in enumerate(options)]
    return out


def _lm(model, tokenizer, bundle, batch_size, **options) -> MariLM:
    return MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=bundle,
                  allow_other_model=True if bundle else None, batch_size=batch_size, **options)


def _forward_passes(model, lm) -> tuple[list, int]:
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        answers = lm.loglikelihood(_requests())
    finally:
        handle.remove()
    return answers, len(calls)


@pytest.mark.parametrize("name, options", METHODS)
@pytest.mark.parametrize("batch_size", [6, "auto"])
def test_batched_scoring_equals_one_question_at_a_time(model, tokenizer, bundles, name, options, batch_size):
    alone_lm, batched_lm = (_lm(model, tokenizer, bundles.get(name), size, **options) for size in (1, batch_size))
    alone, alone_passes = _forward_passes(model, alone_lm)
    batched, batched_passes = _forward_passes(model, batched_lm)
    assert max(abs(a - b) for (a, _), (b, _) in zip(alone, batched)) <= 1e-4
    assert [g for _, g in alone] == [g for _, g in batched]
    assert batched_passes < alone_passes  # the batch size was not ignored: questions shared passes
    # the same choices (routing, gate), question by question; their figures (entropies, energies) to rounding
    assert _close(batched_lm.records, alone_lm.records)


def _close(a, b, tol: float = 1e-4) -> bool:
    """Equal, numbers to ``tol``, at any depth of lists and dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= tol
    return a == b


def test_batches_keep_requests_and_tokens_within_their_limits():
    preamble = list(range(100, 140))
    prompts = [preamble + [i, i + 1] for i in range(6)] + [[7] * 50]
    rows, requests = [4, 4, 4, 4, 4, 4, 3], [2, 2, 2, 2, 2, 2, 1]
    by_requests = batching.question_batches(prompts, rows, requests, batching.Batching(5, 1000))
    assert by_requests == [[0, 1], [2, 3], [4, 5, 6]]
    # own tokens: beyond the prefix a batch shares (the preamble); the unrelated prompt shares none
    by_tokens = batching.question_batches(prompts, rows, requests, batching.Batching(None, 60))
    assert by_tokens == [[0, 1, 2, 3, 4, 5], [6]]
    assert batching.question_batches(prompts, rows, requests, batching.Batching(1, 1024)) == [[i] for i in range(7)]
    assert batching.question_batches([[1] * 5000], [9000], [3], batching.Batching(None, 100)) == [[0]]  # alone, over


def test_batch_size_reads_lm_evals_values(model):
    assert batching.Batching.of(1, 64, model).one_at_a_time
    assert batching.Batching.of("8", 64, model).max_requests == 8
    auto = batching.Batching.of("auto:4", 64, model)
    assert auto.max_requests == 64 and auto.max_tokens == batching.CPU_TOKENS
    with pytest.raises(ValueError, match="positive number of requests"):
        batching.Batching.of(0, 64, model)
    # batch_tokens: the user's budget per pass, whatever batch_size says
    assert batching.Batching.of("auto", None, model, 512) == batching.Batching(None, 512)
    assert batching.Batching.of(1, None, model, 300).max_tokens == 300 and batching.Batching.of("8", None, model, 300).max_tokens == 300
    for bad in (0, -5, 2.5, True, "many"):
        with pytest.raises(ValueError, match=r"batch_tokens=.*positive whole number of tokens"):
            batching.Batching.of("auto", None, model, bad)


def test_auto_batches_are_sized_by_tokens_unless_the_user_caps_the_requests(model, tokenizer):
    # Issue 59: lm-eval's max_batch_size defaults to 64 requests, which held BBQ's batches (about 13
    # options a question) to about 5 questions; MariLM caps the requests only when the user gives it.
    auto = _lm(model, tokenizer, None, "auto")
    assert auto.request_cap is None and auto.max_batch_size == 64  # HFLM keeps its own default for generation
    ordered = [("t", i, [1, 2, 3, 4, 5, 6 + i], [0] * 13, [[7, 8]] * 13) for i in range(20)]  # 20 questions, 13 options
    assert len(auto._question_batches(ordered)[1]) == 1  # 260 requests, 520 row tokens: one pass
    capped = _lm(model, tokenizer, None, "auto", max_batch_size=64)
    assert [len(b) for b in capped._question_batches(ordered)[1]] == [4, 4, 4, 4, 4]  # 4 x 13 = 52 <= 64 requests
    small = _lm(model, tokenizer, None, "auto", batch_tokens=100)
    assert [len(b) for b in small._question_batches(ordered)[1]] == [3, 3, 3, 3, 3, 3, 2]  # 3 x 26 = 78 <= 100 row tokens
    with pytest.raises(ValueError, match="batch_tokens=0: give a positive whole number"):
        _lm(model, tokenizer, None, "auto", batch_tokens=0)


def test_a_shared_preamble_is_computed_once_per_batch_sequence(model, tokenizer):
    """Questions of one few-shot preamble, batched: the preamble's tokens go through the model once."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True)
    try:
        _lm(model, tokenizer, None, 4).loglikelihood([r for r in _requests() if r.doc_id < len(QUESTIONS)])
    finally:
        handle.remove()
    preamble = len(tokenizer(PREAMBLE)["input_ids"])
    assert len(seen) > 3 and sum(n >= preamble for n in seen) == 1  # several batches, one pass holding the preamble


@pytest.mark.parametrize("preamble", [PREAMBLE, ""], ids=["few-shot", "zero-shot"])
def test_edited_prompts_are_encoded_in_one_pass_after_their_shared_edited_preamble(model, tokenizer, bundles, preamble):
    # Issue 59.2: ReFT edits the first and last prompt tokens, so a few-shot preamble under its edit is the
    # same for every question: it is computed once, then every prompt's own tokens in one packed pass.
    # Prompts without such a preamble (zero-shot BBQ; one at a time before, 1.2-1.3x hf's time on an H200)
    # go through the model whole in one packed pass. Each prompt keeps the keys and values it has alone.
    import torch

    from mari_eval.evaluation.shared_pass import EditedPrefix

    plan = _lm(model, tokenizer, bundles["reft"], 4).plan
    contexts = [tokenizer(f"{preamble}Q: {question}\nA:")["input_ids"] for question, *_ in QUESTIONS + MORE]
    assert all(plan.prompt_sites(len(c)) for c in contexts)  # the prompts themselves are edited
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        packed = EditedPrefix(model, plan).encode_many(contexts)
    finally:
        handle.remove()
    if preamble:
        assert len(calls) == 2  # the edited preamble, then the prompts' own tokens together (was one pass per prompt)
        assert packed.shared >= len(tokenizer(preamble)["input_ids"]) - 1
    else:
        assert len(calls) == 1 and packed.shared == 0
    for i, context in enumerate(contexts):
        alone = EditedPrefix(model, plan).encode(context)
        start, stop = packed.shared + packed.spans[i][0], packed.shared + packed.spans[i][1]
        for layer, own in zip(packed.cache.layers, alone.cache.layers):
            keys = torch.cat([layer.keys[..., :packed.shared, :], layer.keys[..., start:stop, :]], dim=-2)
            assert torch.allclose(keys, own.keys, atol=1e-5)
            values = torch.cat([layer.values[..., :packed.shared, :], layer.values[..., start:stop, :]], dim=-2)
            assert torch.allclose(values, own.values, atol=1e-5)


def _generations(n: int = 6) -> list[Instance]:
    prompts = [f"Q: {q}\nA:" for q, _, _ in (QUESTIONS + MORE)][:n]
    return [Instance("generate_until", {}, (p, {"until": ["\n\n"], "max_new_tokens": 10}), i) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", ["vanilla", "mari"])
def test_auto_generation_batches_are_sized_by_tokens_and_generate_as_one_prompt_at_a_time(model, tokenizer, bundles, name):
    """Issue 59: batch_size=auto sizes generation batches from the token budget (batch_tokens=N here),
    the longest prompt plus its max_new_tokens (lm-eval's alias of max_gen_toks), and the rows
    each prompt runs (MARI's variants), not by HFLM's search; the answers are one prompt's at a time."""
    probe = _lm(model, tokenizer, bundles.get(name), "auto")
    longest = max(len(probe.tok_encode(r.args[0])) for r in _generations()) + 10
    rows = len(probe.plan.variants)
    budget = 2 * longest * rows + 1  # two prompts' rows per batch
    lm = _lm(model, tokenizer, bundles.get(name), "auto", batch_tokens=budget)
    want = 2
    seen = []
    original = lm._model_generate
    lm._model_generate = lambda context, *args, **kwargs: seen.append(len(context)) or original(context, *args, **kwargs)
    batched = lm.generate_until(_generations())
    assert seen and max(seen) == want and sum(seen) == len(_generations()), (seen, want)
    assert want < len(_generations())  # the budget, not the number of prompts, cut the batches
    alone = [_lm(model, tokenizer, bundles.get(name), 1).generate_until([r])[0] for r in _generations()]
    assert batched == alone
    assert batching.generation_batch(longest, rows, budget, max_requests=1) == 1  # a --max_batch_size the user gives caps it
    assert batching.generation_batch(longest, rows, budget, max_requests=None) == 2
