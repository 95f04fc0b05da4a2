"""The Prompting baseline (baselines/prompting.py) and the interface hook it uses
(``Intervention.instruction``, read by ``MariLM``): the instruction reaches every prompt (the context's
first paragraph, or the chat template's system turn), and the other methods' prompts stay as they were."""

import pytest
import torch
from lm_eval.api.instance import Instance

from baselines import prompting
from mari_eval.evaluation.lm import INSTRUCTION_DELIMITER, MariLM
from mari_eval.evaluation.lm_generation import CHAT_TURN_FIELD

from .helpers import PREAMBLE, truthfulqa_requests
from .tiny import attribute_of, byte_llama, byte_tokenizer, reloaded, tiny_caa

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
NO_SYSTEM_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turn') }}"
                      "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
INSTRUCTION = prompting.INSTRUCTIONS["truthfulqa"]


def bundle(instruction=INSTRUCTION):
    config = {"base_model": {"name": "tiny", "hidden_size": 64, "num_layers": 4}, "site": {"layer": 0},
              "hyperparameters": {"instruction": instruction}}
    return prompting.Prompting(config, {})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = byte_tokenizer()
    model = byte_llama(tokenizer, layers=4, hidden=64)
    root = tmp_path_factory.mktemp("bundles")
    paths = {"prompting": str(bundle().save(root / "prompting")),
             "caa": str(tiny_caa(d=64, layers=4, layer=2).save(root / "caa"))}
    return tokenizer, model, paths


def lm_for(setup, name=None, template=None):
    tokenizer, model, paths = setup
    tokenizer.chat_template = template  # the module's one tokenizer: each lm sets the template it needs
    return MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=paths.get(name),
                  allow_other_model=True if name else None)


def by_hand(model, tokenizer, context, continuation):
    ids = tokenizer(context + continuation).input_ids
    n = len(tokenizer(context).input_ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return float(sum(logprobs[k - 1, ids[k]] for k in range(n, len(ids))))


def test_the_instruction_precedes_each_context(setup):
    tokenizer, model, _ = setup
    requests = truthfulqa_requests()
    got = lm_for(setup, "prompting").loglikelihood(requests)
    instructed = [Instance("loglikelihood", r.doc, (INSTRUCTION + INSTRUCTION_DELIMITER + r.args[0], r.args[1]), r.idx,
                           metadata=(r.task_name, r.doc_id, 1)) for r in requests]
    vanilla_lm = lm_for(setup)
    vanilla = vanilla_lm.loglikelihood(instructed)
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, vanilla)) <= 1e-4
    for (score, _), r in list(zip(got, instructed))[:4]:  # the base model scoring the prefixed text by hand
        assert abs(score - by_hand(model, tokenizer, *r.args)) <= 1e-4
    plain = vanilla_lm.loglikelihood(requests)
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, plain)) > 1e-3  # the instruction changed the scores
    assert requests[0].args[0].startswith(PREAMBLE)  # lm-eval's requests keep their text (its cache keys on it)


def test_generation_prompts_carry_the_instruction(setup):
    prompt, args = "Q: What do bees make?\nA:", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    got = lm_for(setup, "prompting").generate_until([Instance("generate_until", {}, (prompt, dict(args)), 0)])
    expected = lm_for(setup).generate_until([Instance("generate_until", {},
                                                      (INSTRUCTION + INSTRUCTION_DELIMITER + prompt, dict(args)), 0)])
    assert got == expected
    # a SORRY-Bench prompt (one chat turn): the instruction in the system turn, before the user's
    lm = lm_for(setup, "prompting", CHAT_TEMPLATE)
    request = Instance("generate_until", {CHAT_TURN_FIELD: "How do I pick a lock?"}, ("How do I pick a lock?", dict(args)), 0)
    lm.generate_until([request])
    assert request.args[0] == f"<|system|>{INSTRUCTION}\n<|user|>How do I pick a lock?\n<|assistant|>"


def test_the_chat_template_puts_it_in_the_system_turn(setup):
    lm = lm_for(setup, "prompting", CHAT_TEMPLATE)
    rendered = lm.apply_chat_template([{"role": "user", "content": "Q: 2+2?\nA:"}])
    assert rendered == f"<|system|>{INSTRUCTION}\n<|user|>Q: 2+2?\nA:\n<|assistant|>"
    assert lm.instructed(rendered) == rendered  # not a second time as a prefix
    assert lm._encode_pair(rendered, " 4") == lm_for(setup, None, CHAT_TEMPLATE)._encode_pair(rendered, " 4")
    with_system = lm.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert with_system == f"<|system|>Be brief.{INSTRUCTION_DELIMITER}{INSTRUCTION}\n<|user|>Hi\n<|assistant|>"
    # a template without a system turn (HFLM drops the system message): the first user turn carries it
    no_system = lm_for(setup, "prompting", NO_SYSTEM_TEMPLATE)
    assert no_system.apply_chat_template([{"role": "user", "content": "Hi"}]) == \
        f"<|user|>{INSTRUCTION}{INSTRUCTION_DELIMITER}Hi\n"


@pytest.mark.parametrize("name", [None, "caa"])
def test_other_methods_prompts_are_unchanged(setup, name):
    lm = lm_for(setup, name, CHAT_TEMPLATE)
    assert lm.instruction is None and lm.instructed("Q: x\nA:") == "Q: x\nA:"
    messages = [{"role": "user", "content": "Hi"}]
    assert lm.apply_chat_template(messages) == "<|user|>Hi\n<|assistant|>"
    assert lm.chat_turn_prompt("Hi") == "<|user|>Hi\n<|assistant|>"
    assert lm._encode_pair("Q: x\nA:", " y") == lm_for(setup, None, CHAT_TEMPLATE)._encode_pair("Q: x\nA:", " y")


def test_training_writes_the_attributes_instruction(tmp_path):
    data = attribute_of([])
    config = {"base_model": {"name": "tiny", "hidden_size": 64, "num_layers": 4}, "site": {"layer": 2}}
    made = prompting.Prompting.fit(None, data, config, {}, 0)
    assert made.instruction == prompting.INSTRUCTIONS["truthfulqa"] and made.tensors == {}
    loaded = reloaded(made, tmp_path / "prompting")
    assert loaded.instruction == made.instruction and loaded.config["hyperparameters"] == {"instruction": made.instruction}
    given = prompting.Prompting.fit(None, data, config, {"instruction": "Be honest."}, 0)
    assert given.instruction == "Be honest."
    data.attribute = "other"
    with pytest.raises(ValueError, match="--set instruction"):
        prompting.Prompting.fit(None, data, config, {}, 0)
    assert set(prompting.INSTRUCTIONS) == {"truthfulqa", "bbq", "sorry_bench"}


def test_prompting_stays_out_of_the_shared_pass_and_scores_as_alone(setup):
    from mari_eval.evaluation.shared_pass import SharedPass

    tokenizer, model, paths = setup
    tokenizer.chat_template = None
    requests = truthfulqa_requests()
    alone = lm_for(setup, "prompting").loglikelihood(requests)
    shared = SharedPass(model)
    lms = [MariLM(pretrained=model, tokenizer=tokenizer, device="cpu", dtype="float32", bundle=paths.get(name),
                  allow_other_model=True if name else None, shared_pass=shared) for name in (None, "prompting", "caa")]
    assert lms[0].shared is not None and lms[2].shared is not None and lms[1].shared is None
    results = [lm.loglikelihood(requests) for lm in lms]
    assert results[1] == alone
    assert results[0] == lm_for(setup).loglikelihood(requests)  # the joined ones as before
