"""BLEURT for TruthfulQA generation (mari_eval/benchmarks/bleurt.py, harness_tasks/utils.process_results_gen):
scored from a checkpoint the task's metadata names, a BERT regression model as Google's
checkpoints are converted (here a tiny one with random weights, written to a folder), and
skipped with a warning when none is named."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from mari_eval.benchmarks import bleurt

WORDS = ["the", "sun", "is", "a", "star", "moon", "cheese", "made", "of", "no", "comment", "i", "have", "."]


def tiny_bleurt(folder, outputs: int = 1) -> str:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, num_labels=outputs, initializer_range=0.1)
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return str(folder)


def test_scores_are_the_checkpoints_regression_output_on_reference_candidate_pairs(tmp_path):
    checkpoint = tiny_bleurt(tmp_path)
    refs, cands = ["the sun is a star .", "i have no comment ."] * 10, ["the moon is made of cheese ."] * 20
    scores = bleurt.scorer(checkpoint)(refs, cands)  # 20 pairs: two batches of BATCH
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        direct = model(**tokenizer(refs[:2], cands[:2], padding=True, return_tensors="pt")).logits[:, 0]
    assert len(scores) == 20 and scores[0] != scores[1]
    assert scores[:2] == pytest.approx(direct.tolist(), abs=1e-4)
    assert scores[2:4] == pytest.approx(scores[:2], abs=1e-4)  # the same pairs in the second batch

    got = bleurt.truthfulqa_scores(checkpoint, "the moon is made of cheese .", ["the sun is a star ."],
                                   ["i have no comment .", "the moon is a star ."])
    correct = scores[0]
    incorrect = max(bleurt.scorer(checkpoint)(["i have no comment .", "the moon is a star ."],
                                              ["the moon is made of cheese ."] * 2))
    assert got["bleurt_max"] == pytest.approx(correct, abs=1e-5)
    assert got["bleurt_diff"] == pytest.approx(correct - incorrect, abs=1e-5)
    assert got["bleurt_acc"] == int(got["bleurt_diff"] > 0) and abs(got["bleurt_diff"]) > 1e-3


def test_a_checkpoint_with_several_outputs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has 2 outputs; a BLEURT checkpoint is a regression model with one"):
        bleurt.scorer(tiny_bleurt(tmp_path, outputs=2))


def test_the_task_scores_bleurt_when_its_metadata_names_a_checkpoint_and_says_so_when_not(tmp_path, caplog):
    from harness_tasks import utils

    checkpoint = tiny_bleurt(tmp_path)
    doc = {"question": "What is the sun?", "correct_answers": ["The sun is a star."],
           "incorrect_answers": ["The sun is made of cheese."]}
    named = utils.process_results_gen({**doc, "bleurt": checkpoint}, ["The sun is a star."])
    assert named["bleu_acc"] == 1 and {"bleurt_max", "bleurt_acc", "bleurt_diff"} <= set(named)
    assert named["bleurt_max"] == pytest.approx(bleurt.scorer(checkpoint)(["The sun is a star."],
                                                                          ["The sun is a star."])[0], abs=1e-4)
    utils._bleurt_skipped.cache_clear()
    with caplog.at_level(logging.WARNING, logger="lm_eval"):
        plain = utils.process_results_gen({**doc, "bleurt": ""}, ["The sun is a star."])
        utils.process_results_gen({**doc, "bleurt": ""}, ["The sun is a star."])
    assert not any(key.startswith("bleurt") for key in plain) and plain["bleu_acc"] == 1
    said = [r.getMessage() for r in caplog.records if "BLEURT not computed" in r.getMessage()]
    assert len(said) == 1 and '--metadata \'{"bleurt": ' in said[0]  # once, with what to add


@pytest.mark.needs_data
def test_the_loaders_carry_the_named_checkpoint_to_every_document():
    from harness_tasks import utils

    named = utils.load_truthfulqa_generation_heldout(split_seed=0, bleurt="some/checkpoint")["validation"]
    plain = utils.load_truthfulqa_generation_heldout(split_seed=0)["validation"]
    assert set(named["bleurt"]) == {"some/checkpoint"} and set(plain["bleurt"]) == {""}
    assert named["id"] == plain["id"]


def test_a_missing_local_checkpoint_is_refused_when_the_tasks_are_indexed_before_any_answer(tmp_path):
    from lm_eval.tasks import TaskManager

    import mari_eval  # noqa: F401 (wraps TaskManager, as `lm_eval --model mari` does)

    missing = str(tmp_path / "bleurt-base-512")
    with pytest.raises(FileNotFoundError, match=rf"BLEURT checkpoint .*'{missing}': no such local directory"):
        TaskManager(metadata={"bleurt": missing})
    with pytest.raises(FileNotFoundError, match="no such local directory"):
        bleurt.scorer(missing)
