"""The shared pass (mari_eval.shared_pass): several methods' lm-eval log-likelihood runs computed
together give each method what its own MariLM run gives, while the frozen model encodes each
question's prompt once for all of them. A tiny random Llama (tests/tiny.py's sizes, the
SmolLM2 tokenizer's vocabulary, so that lm-eval's requests are real text) and tiny bundles of
every method: vanilla, CAA, ITI (edits inside its site layer), MARI with its gate (reads the
untouched rows) and without (experts only), ReFT (edits the prompt: its own prefix)."""

import math

import pytest
import torch
import transformers
from lm_eval.api.instance import Instance

from mari_eval import site
from mari_eval.lm import MariLM
from mari_eval.shared_pass import SharedPass

PREAMBLE = ("Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius.\n\n"
            "Q: Which planet is closest to the sun?\nA: Mercury.\n\n")
# (question, mc1 options, mc2 options): truthfulqa_mc1 and _mc2 share each prompt; the second
# question's two tasks have the same options too (as some TruthfulQA docs do): one group twice
QUESTIONS = [
    ("What colour is the sky on a clear day?", [" Blue.", " Green.", " Red."], [" Blue.", " It is blue.", " Green."]),
    ("How many legs does a spider have?", [" Eight.", " Six.", " Ten."], [" Eight.", " Six.", " Ten."]),
    ("What is the capital of France?", [" Paris.", " Lyon.", " Marseille."], [" Paris.", " Nice."]),
]
DISTINCT_GROUPS = 5  # (context, options) pairs among the 6 lm-eval groups (3 questions, mc1 and mc2)
# (name, MariLM keyword arguments); bundles are written by the ``bundles`` fixture
METHODS = [("vanilla", {}), ("caa", {}), ("iti", {}), ("mari", {}), ("mari", {"gate": "false"}), ("reft", {})]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def model(tokenizer):
    # tests/tiny.py's llama, with the tokenizer's vocabulary instead of its VOCAB ids
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def bundles(model, tmp_path_factory):
    return tiny_bundles(model, tmp_path_factory.mktemp("bundles"))


def tiny_bundles(model, root, closed_gate: bool = False) -> dict[str, str]:
    """A small bundle of CAA, ITI, MARI (K = 3; ``closed_gate``: one that never opens) and ReFT for
    ``model``, saved under ``root``: name -> its directory."""
    from baselines import reft

    from .test_baselines import _caa, _iti
    from .test_mari import _bundle

    d, layers = model.config.hidden_size, site.num_layers(model)
    g = torch.Generator().manual_seed(0)
    R = reft.orthonormal_rows(torch.randn(2, d, generator=g))
    never = dict(energies=torch.full((20,), 1e9), applicable=torch.zeros(20, dtype=torch.uint8)) if closed_gate else {}
    made = {
        "caa": _caa(d=d, layers=layers, layer=2, multiplier=3.0),
        "iti": _iti(model, heads=((2, 0), (2, 3), (3, 1)), alpha=6.0),
        "mari": _bundle(K=3, d=d, layers=layers, layer=1, **never),
        "reft": reft.ReFT({"base_model": {"name": "tiny", "hidden_size": d, "num_layers": layers}, "site": {"layer": 2},
                           "hyperparameters": {"first": 2, "last": 2}},
                          {"R": R, "W": R + 0.5 * torch.randn(2, d, generator=g), "b": torch.randn(2, generator=g)}),
    }
    return {name: str(bundle.save(root / name)) for name, bundle in made.items()}


def _lm(model, tokenizer, bundles, name, options, shared=None) -> MariLM:
    bundle = bundles.get(name)
    return MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=bundle,
                  allow_other_model=True if bundle else None, shared_pass=shared, **options)


def _requests(questions=QUESTIONS) -> list[Instance]:
    out = []
    for doc_id, (question, mc1, mc2) in enumerate(questions):
        doc = {"mc1_targets": {"choices": mc1, "labels": [1] + [0] * (len(mc1) - 1)},
               "mc2_targets": {"choices": mc2, "labels": [1, 0 if mc2 == mc1 else 1] + [0] * (len(mc2) - 2)}}
        for task, options in (("truthfulqa_mc1", mc1), ("truthfulqa_mc2", mc2)):
            for i, option in enumerate(options):
                out.append(Instance("loglikelihood", doc, (f"{PREAMBLE}Q: {question}\nA:", option), i,
                                    metadata=(task, doc_id, 1)))
    return out


class PrefixEncodings:
    """Counts the model's forward passes that encode a prompt before p* (``encode_prefix`` asks
    for the last position's logits only) and the tokens the first layer reads in all passes."""

    def __init__(self, model):
        self.prefixes = self.tokens = 0
        self.hooks = [
            model.register_forward_pre_hook(self._model_call, with_kwargs=True),
            site.decoder_layers(model)[0].register_forward_pre_hook(self._layer_call, with_kwargs=True),
        ]

    def _model_call(self, module, args, kwargs):
        self.prefixes += kwargs.get("logits_to_keep") == 1

    def _layer_call(self, module, args, kwargs):
        states = args[0] if args else kwargs["hidden_states"]
        self.tokens += states.shape[0] * states.shape[1]

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def _evaluate(lm: MariLM, requests, model) -> tuple[list, list, PrefixEncodings]:
    counter = PrefixEncodings(model)
    try:
        answers = lm.loglikelihood(requests)
    finally:
        counter.remove()
    return answers, list(lm.records), counter


def _close(a, b, tol=1e-5) -> bool:
    """Equal records: the same keys and values, numbers to ``tol``."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) and not isinstance(b, bool):
        return math.isclose(a, b, abs_tol=tol) or (math.isnan(a) and math.isnan(b))
    return a == b


def test_each_method_through_the_shared_pass_gets_its_own_runs_answers(model, tokenizer, bundles):
    alone = [_evaluate(_lm(model, tokenizer, bundles, name, options), _requests(), model) for name, options in METHODS]

    shared = SharedPass(model)
    lms = [_lm(model, tokenizer, bundles, name, options, shared) for name, options in METHODS]  # all, before evaluating
    together = [_evaluate(lm, _requests(), model) for lm in lms]

    for (name, options), (answers, records, _), (got, got_records, _) in zip(METHODS, alone, together):
        assert len(got) == len(answers) == len(_requests())
        for (x, greedy), (y, greedy_shared) in zip(answers, got):
            assert y == pytest.approx(x, abs=1e-5) and greedy_shared == greedy, (name, options)
        assert (len(got_records), len(records)) == ((6, 6) if name != "vanilla" else (0, 0))
        assert _close(got_records, records), (name, options, got_records, records)
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
    vanilla, caa, mari = (_lm(model, tokenizer, bundles, name, {}, shared) for name in ("vanilla", "caa", "mari"))
    first, later = _requests(QUESTIONS[:2]), _requests(QUESTIONS)
    vanilla.loglikelihood(first)  # 3 distinct groups (the second question's mc1 and mc2 are one)
    assert shared.stats["groups"] == 3 and shared.pending() == 6  # CAA's and MARI's runs, 3 groups each
    got = caa.loglikelihood(later)  # 3 groups stored; the third question's 2 were never seen: computed now
    assert shared.stats["served"] == 3 and shared.stats["groups"] == 5 and shared.pending() == 3 + 2
    mine = _lm(model, tokenizer, bundles, "caa", {}).loglikelihood(later)
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
    from mari_eval import runner
    from mari_eval.prefix_cache import encode_prefix
    from mari_eval.shared_pass import EditedPrefix

    reft = _lm(model, tokenizer, bundles, "reft", {})
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

    from .test_mari import _bundle

    # The fixture's MARI bundle with every control energy midway between the questions' energies:
    # tau_E lies there at any rho, so the gate opens on some questions and not on others.
    _, records, _ = _evaluate(_lm(model, tokenizer, bundles, "mari", {}), _requests(), model)
    energies = sorted({r["energy"] for r in records})
    midway = torch.full((20,), (energies[0] + energies[-1]) / 2)
    bundles = {"mari": str(_bundle(K=3, d=model.config.hidden_size, layers=site.num_layers(model), layer=1,
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
        alone.append(_evaluate(_lm(model, tokenizer, bundles, "mari", options), _requests(), model))
        counts.append(experts_and_probe())
    shared = SharedPass(model)
    lms = [_lm(model, tokenizer, bundles, "mari", options, shared) for options in rows]
    together = [_evaluate(lm, _requests(), model) for lm in lms]
    experts, probes = experts_and_probe()

    for options, (answers, records, _), (got, got_records, _) in zip(rows, alone, together):
        assert [x for x, _ in got] == pytest.approx([x for x, _ in answers], abs=1e-5), options
        assert _close(got_records, records), (options, got_records, records)
    assert {r["gate_open"] for r in alone[0][1]} == {True, False}
    # Together: each distinct group's expert rows once (the gate-free row needs them all; the gated
    # rows take theirs), and its probe row once for both gated rows. Alone, every row ran its own
    # (and each method ran the repeated group again).
    option_rows = sum(len(o) for _, o in {(q, tuple(o)) for q, mc1, mc2 in QUESTIONS for o in (mc1, mc2)})
    assert experts == 3 * option_rows and probes == DISTINCT_GROUPS
    assert sum(e for e, _ in counts) > counts[1][0] > experts and counts[0][1] == counts[2][1] > probes
