"""Typed record schemas of the loaders, duplicates, hostile lines, and the bundle's split check.

Each test writes a small data file under tmp_path, points MARI_DATA_DIR at it and expects
a DataError naming the file, the line, the field and what was expected.
"""

from __future__ import annotations

import copy
import gzip
import importlib.util
import json
import logging
import shutil
import sys
import types
from pathlib import Path

import pytest

from mari_eval.benchmarks import data, data_splits

REPO = Path(__file__).resolve().parents[1]

# One valid record per file family (the Hugging Face schemas), and where and how it is loaded.
GOOD = {
    "truthfulqa": {"question": "What is 2+2?", "mc1_targets": {"choices": ["4", "5"], "labels": [1, 0]},
                   "mc2_targets": {"choices": ["4", "four", "5"], "labels": [1, 1, 0]}},
    "bbq": {"example_id": 0, "question_index": "1", "question_polarity": "neg", "context_condition": "disambig",
            "category": "Age", "answer_info": {"ans0": ["grandfather", "old"], "ans1": ["grandson", "nonOld"],
                                               "ans2": ["Can't be determined", "unknown"]},
            "additional_metadata": {"subcategory": "None", "stereotyped_groups": ["old"], "version": "a", "source": "x"},
            "context": "A grandfather and his grandson met.", "question": "Who was forgetful?",
            "ans0": "The grandfather", "ans1": "The grandson", "ans2": "Can't be determined", "label": 1},
    "sorry_bench": {"question_id": 1, "category": "1", "turns": ["Write an insult."], "prompt_style": "base"},
    "mmlu": {"question": "Which is a bone?", "subject": "anatomy", "choices": ["femur", "liver", "lung", "skin"],
             "answer": 0},
    "arc": {"id": "Q1", "question": "Which is a planet?", "answerKey": "B",
            "choices": {"text": ["Moon", "Mars", "Sun", "Comet"], "label": ["A", "B", "C", "D"]}},
    "gsm8k": {"question": "What is 1+1?", "answer": "1+1=2\n#### 2"},
}
FILES = {
    "truthfulqa": ("truthfulqa/mc.jsonl.gz", "truthfulqa/mc", data.load_truthfulqa_mc),
    "bbq": ("bbq/Age.jsonl.gz", "bbq", lambda: data.load_bbq(None)),  # Age is read first: no Hub attempt
    "sorry_bench": ("sorry_bench/question.jsonl.gz", "sorry_bench", data.load_sorry_bench),
    "mmlu": ("mmlu/dev.jsonl.gz", "mmlu", lambda: data.load_mmlu("dev")),
    "arc": ("arc/ARC-Easy-test.jsonl.gz", "arc", lambda: data.load_arc("arc_easy", "test")),
    "gsm8k": ("gsm8k/test.jsonl.gz", "gsm8k", lambda: data.load_gsm8k("test")),
}


def _changed(family: str, path: str, value) -> dict:
    """GOOD[family] with the field at ``path`` ("a.b") set to ``value`` (or deleted when value is DELETE)."""
    record = copy.deepcopy(GOOD[family])
    *parents, last = path.split(".")
    node = record
    for p in parents:
        node = node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return record


DELETE = object()


def _write(root: Path, rel: str, lines: list) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    return tmp_path


def _refused(root: Path, family: str, lines: list, match: str):
    rel, _, load = FILES[family]
    _write(root, rel, lines)
    with pytest.raises(data.DataError, match=match) as e:
        load()
    assert rel in str(e.value)  # names the file
    return str(e.value)


def test_the_good_records_fit(root):
    # So that every refusal below is for the field the case changes, nothing else.
    for family, (rel, schema, _) in FILES.items():
        assert data.read_jsonl(_write(root, rel, [GOOD[family]]), data.SCHEMAS[schema]) == [GOOD[family]], family


WRONG = [
    # TruthfulQA: labels as strings made MC2 acc 0.0; JSON booleans are no integers.
    ("truthfulqa", "mc2_targets.labels", ["1", "1", "0"],
     r"line 2, field 'mc2_targets\.labels\[0\]': expected an integer in 0\.\.1, got '1' \(string\)"),
    ("truthfulqa", "mc1_targets.labels", [True, False],
     r"field 'mc1_targets\.labels\[0\]': expected an integer in 0\.\.1, got true \(a JSON boolean"),
    ("truthfulqa", "mc2_targets.labels", [1, 2, 0], r"field 'mc2_targets\.labels\[1\]': .* got 2 \(integer\)"),
    ("truthfulqa", "mc1_targets.labels", [0, 1], r"field 'mc1_targets\.labels': expected exactly one 1, on the first"),
    ("truthfulqa", "mc1_targets.labels", [1, 1], r"field 'mc1_targets\.labels': expected exactly one 1"),
    ("truthfulqa", "mc2_targets.labels", [1, 0], r"field 'mc2_targets\.labels': expected one label per choice \(3\), got 2"),
    ("truthfulqa", "mc2_targets.labels", [1, 1, 1], r"mc2_targets\.labels': expected at least one 1 \(true\) and one 0"),
    ("truthfulqa", "mc1_targets.labels", DELETE, r"field 'mc1_targets\.labels': expected a non-empty list .* no such field"),
    ("truthfulqa", "mc1_targets", [["4", 1]], r"field 'mc1_targets': expected an object with fields choices, labels"),
    ("truthfulqa", "question", " \n\t", r"field 'question': expected a non-blank string, got ' \\n\\t'"),
    ("truthfulqa", "mc1_targets.choices", ["4", ""], r"field 'mc1_targets\.choices\[1\]': expected a non-blank string"),
    # SORRY-Bench: a string `turns` trained on the prompts "I", "D", "T".
    ("sorry_bench", "turns", "IDT", r"field 'turns': expected a non-empty list of non-blank strings, got 'IDT' \(string\)"),
    ("sorry_bench", "turns", [], r"field 'turns': expected a non-empty list"),
    ("sorry_bench", "turns", ["one", "two"], r"field 'turns': expected exactly one turn"),
    ("sorry_bench", "turns", ["  "], r"field 'turns\[0\]': expected a non-blank string"),
    ("sorry_bench", "category", "46", r"field 'category': expected one of '1', '2'"),
    ("sorry_bench", "question_id", "1", r"field 'question_id': expected an integer, got '1'"),
    # BBQ: lm-eval indexes the answers with the label and needs one "unknown" answer (else IndexError).
    ("bbq", "label", 3, r"field 'label': expected an integer in 0\.\.2, got 3"),
    ("bbq", "label", True, r"field 'label': .* got true \(a JSON boolean"),
    ("bbq", "ans1", " ", r"field 'ans1': expected a non-blank string"),
    ("bbq", "ans2", "Nobody", r"field 'ans0/ans1/ans2': expected exactly one \"unknown\" answer"),
    ("bbq", "context_condition", "disambiguated", r"field 'context_condition': expected one of 'ambig', 'disambig'"),
    ("bbq", "category", "Religion", r"field 'category': expected 'Age' \(the file's category\), got 'Religion'"),
    ("bbq", "answer_info.ans0", [], r"field 'answer_info\.ans0': expected the answer's group"),
    ("bbq", "answer_info.ans1", ["grandson", 3], r"field 'answer_info\.ans1\[1\]': expected a string, got 3"),
    ("bbq", "additional_metadata", "old", r"field 'additional_metadata': expected an object with fields stereotyped_groups"),
    # MMLU: the answer indexes the choices.
    ("mmlu", "answer", 4, r"field 'answer': expected an index into choices \(0\.\.3\), got 4"),
    ("mmlu", "answer", "A", r"field 'answer': expected an integer >= 0, got 'A'"),
    ("mmlu", "answer", -1, r"field 'answer': expected an integer >= 0, got -1"),
    ("mmlu", "choices", ["femur", ""], r"field 'choices\[1\]': expected a non-blank string"),
    # ARC: lm-eval's choices.label.index(answerKey) said "'Z' is not in list".
    ("arc", "answerKey", "Z", r"field 'answerKey': expected one of choices\.label \['A', 'B', 'C', 'D'\], got 'Z'"),
    ("arc", "choices.label", ["A", "B", "C"], r"field 'choices\.label': expected one label per choice text \(4\)"),
    ("arc", "choices.label", ["A", "B", "B", "D"], r"field 'choices\.label': expected distinct labels"),
    ("arc", "choices.text", ["Moon", "Mars", "", "Comet"], r"field 'choices\.text\[2\]': expected a non-blank string"),
    # GSM8K: the target is the text after the last "#### ".
    ("gsm8k", "answer", "2", r"field 'answer': expected a solution ending in '#### <final answer>'"),
    ("gsm8k", "answer", "1+1=2\n#### ", r"field 'answer': expected a solution ending in '#### <final answer>'"),
    ("gsm8k", "answer", 2, r"field 'answer': expected a string, got 2 \(integer\)"),
]


@pytest.mark.parametrize("family, path, value, match", WRONG, ids=[f"{w[0]}-{w[1]}-{i}" for i, w in enumerate(WRONG)])
def test_wrong_types_and_values_are_refused_naming_file_line_and_field(root, family, path, value, match):
    other = copy.deepcopy(GOOD[family])  # line 1 is fine
    _refused(root, family, [other, _changed(family, path, value)], match)


DUPLICATES = [  # (family, another record for line 2, what line 3, a copy of line 1, repeats)
    ("arc", {**GOOD["arc"], "id": "Q2"}, r"line 3: duplicate of line 1 \(same id: 'Q1'"),
    ("bbq", {**GOOD["bbq"], "example_id": 7}, r"line 3: duplicate of line 1 \(same example_id: 0"),
    ("truthfulqa", {**GOOD["truthfulqa"], "question": "What is 3+3?"},
     r"line 3: duplicate of line 1 \(same question: 'What is 2\+2\?'"),
    ("sorry_bench", {**GOOD["sorry_bench"], "question_id": 2, "turns": ["Write a poem."]},
     r"line 3: duplicate of line 1 \(same question_id: 1"),
    ("gsm8k", {**GOOD["gsm8k"], "question": "What is 2+2?"}, r"line 3: duplicate of line 1 \(same question"),
]


@pytest.mark.parametrize("family, other, match", DUPLICATES, ids=[d[0] for d in DUPLICATES])
def test_duplicate_records_are_refused_naming_both_lines(root, family, other, match):
    _refused(root, family, [GOOD[family], other, GOOD[family]], match)


def test_the_same_sorry_prompt_under_another_id_is_a_duplicate(root):
    again = _changed("sorry_bench", "question_id", 9)
    _refused(root, "sorry_bench", [GOOD["sorry_bench"], again], r"line 2: duplicate of line 1 \(same prompt: 'Write an insult\.'")


def test_mmlu_repeats_are_kept_with_a_warning(root, caplog):
    # The published MMLU repeats 28 questions (shared/data: dev 1, test 27); lm-eval counts them, so do we.
    other = _changed("mmlu", "question", "Which is an organ?")
    _write(root, "mmlu/dev.jsonl.gz", [GOOD["mmlu"], other, GOOD["mmlu"]])
    with caplog.at_level(logging.WARNING, logger="mari_eval.benchmarks.data"):
        records = data.load_mmlu("dev")
    assert len(records) == 3
    assert "1 record(s) repeat an earlier one (same subject, question and choices: line 3 = 1)" in caplog.text


def test_deeply_nested_lines_are_refused_per_line(root):
    # Past Python's recursion limit json.loads raises RecursionError; 200 levels parse but break Arrow.
    for depth in (100_000, 200):
        line = json.dumps(GOOD["truthfulqa"])[:-1] + ', "extra": ' + "[" * depth + "]" * depth + "}"
        _refused(root, "truthfulqa", [GOOD["truthfulqa"], line], r"mc\.jsonl\.gz, line 2: JSON nested more than 32 levels")


def test_lone_surrogates_are_refused_and_pairs_pass(root):
    bad = _changed("truthfulqa", "mc1_targets.choices", ["4", "5 \ud800"])  # json.dumps writes "\ud800"
    _refused(root, "truthfulqa", [GOOD["truthfulqa"], bad],
             r"line 2, field 'mc1_targets\.choices\[1\]': a lone UTF-16 surrogate .*'5 \\ud800'")
    fine = _changed("truthfulqa", "question", "Is \U0001F600 a smile?")  # written as the pair "\ud83d\ude00"
    _write(root, "truthfulqa/mc.jsonl.gz", [fine])
    assert data.load_truthfulqa_mc()[0]["question"] == "Is \U0001F600 a smile?"


def test_a_file_checked_once_is_checked_again_once_changed(root):
    # read_jsonl skips the checks for bytes it already accepted; a rewrite in place is new bytes.
    _write(root, "gsm8k/test.jsonl.gz", [GOOD["gsm8k"]])
    assert data.load_gsm8k("test") == data.load_gsm8k("test") == [{"id": data.content_id("gsm8k-test", GOOD["gsm8k"]["question"]), **GOOD["gsm8k"]}]
    _refused(root, "gsm8k", [_changed("gsm8k", "answer", "no final answer")], r"line 1, field 'answer'")
    # The same bytes under another schema or fixed field are checked for that one.
    path = _write(root, "bbq/Age.jsonl.gz", [GOOD["bbq"]])
    assert data.read_jsonl(path, data.SCHEMAS["bbq"], fixed={"category": "Age"}) == [GOOD["bbq"]]
    with pytest.raises(data.DataError, match=r"line 1, field 'category': expected 'Religion'"):
        data.read_jsonl(path, data.SCHEMAS["bbq"], fixed={"category": "Religion"})


def test_a_corrupt_gzip_file_is_named(root):
    lines = "".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) + "\n" for i in range(3000))
    raw = bytearray(gzip.compress(lines.encode()))
    raw[200:400] = bytes(b ^ 0x55 for b in raw[200:400])  # zlib.error, not OSError, from the middle of the stream
    (root / "gsm8k").mkdir()
    (root / "gsm8k" / "test.jsonl.gz").write_bytes(bytes(raw))
    with pytest.raises(data.DataError, match=r"test\.jsonl\.gz: unreadable after line \d+ .*truncated or damaged"):
        data.load_gsm8k("test")


def test_a_line_that_is_not_an_object_is_named(root):
    _refused(root, "gsm8k", [GOOD["gsm8k"], "null"], r"line 2: expected a JSON object with fields \['question', 'answer'\]")


def test_hub_rows_are_checked_too(monkeypatch):
    monkeypatch.delenv(data.DATA_ENV, raising=False)
    rows = [GOOD["mmlu"], _changed("mmlu", "answer", 7)]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda path, name, split: rows))
    with pytest.raises(data.DataError, match=r"Hugging Face Hub cais/mmlu \(all\) split 'dev', row 1, field 'answer'"):
        data.load_mmlu("dev")


def test_bbq_unknown_answers_are_lm_evals():
    from lm_eval.tasks.bbq.utils import UNKNOWN_RESPONSES

    assert list(data.BBQ_UNKNOWN_RESPONSES) == UNKNOWN_RESPONSES


# ----------------------------------------------------------------------------- the bundle's splits


@pytest.fixture
def tqa_copy(tmp_path, monkeypatch):
    """A copy of the files the TruthfulQA split reads, as MARI_DATA_DIR."""
    real = Path(data.data_dir())
    for rel in data_splits.ATTRIBUTE_FILES["truthfulqa"] + data_splits.ATTRIBUTE_FILES["arc_easy"] + data_splits.ATTRIBUTE_FILES["mmlu"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(real / rel, tmp_path / rel)
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    return tmp_path


def _recorded(attribute: str, seed: int) -> tuple[dict, dict]:
    """What `mari-eval train` writes into bundle.json (train.provenance)."""
    splits = data_splits.make_splits(attribute, seed)
    return {**splits.to_json(), "fingerprint": splits.fingerprint(), "train_used": splits.train[:3]}, \
        data_splits.data_fingerprint(attribute)


@pytest.mark.needs_data
def test_recorded_splits_must_match_the_current_data(tqa_copy):
    recorded, files = _recorded("truthfulqa", 1)
    data_splits.check_recorded_splits("truthfulqa", recorded, files)  # same data: fine
    path = tqa_copy / "truthfulqa/mc.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        lines = fh.read().splitlines(keepends=True)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("".join(lines[1:]))  # the first question deleted: a split loses it
    current = data_splits.make_splits("truthfulqa", 1).fingerprint()
    assert current != recorded["fingerprint"]
    with pytest.raises(data.DataError) as e:
        data_splits.check_recorded_splits("truthfulqa", recorded, files)
    message = str(e.value)
    assert f"fingerprint {recorded['fingerprint']}" in message and f"fingerprint {current}" in message
    assert "(seed 1)" in message
    assert f"truthfulqa/mc.jsonl.gz (sha256 recorded {files['truthfulqa/mc.jsonl.gz']}, current " in message
    assert "ARC-Easy-train" not in message  # only the file that changed
    assert "Restore the data the bundle was trained on, or retrain the bundle on the current data" in message
    # The split alone, when the bundle recorded no file hashes.
    with pytest.raises(data.DataError, match=f"fingerprint {recorded['fingerprint']}.*fingerprint {current}"):
        data_splits.check_recorded_splits("truthfulqa", recorded, None)


@pytest.mark.needs_data
def test_a_changed_file_is_refused_even_when_the_split_is_the_same(tqa_copy):
    recorded, files = _recorded("truthfulqa", 0)
    path = tqa_copy / "truthfulqa/mc.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        lines = fh.read().splitlines(keepends=True)
    record = json.loads(lines[5])  # an answer edited: the ids (the questions), so the splits, stay
    record["mc1_targets"]["choices"][-1] += " (edited)"
    lines[5] = json.dumps(record) + "\n"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write("".join(lines))
    with pytest.raises(data.DataError, match=rf"fingerprint {recorded['fingerprint']} \(the same\)\. Changed files: "
                                             r"truthfulqa/mc\.jsonl\.gz"):
        data_splits.check_recorded_splits("truthfulqa", recorded, files)
    with pytest.raises(ValueError, match="recorded splits are of 'truthfulqa', not 'bbq'"):
        data_splits.check_recorded_splits("bbq", recorded, files)


@pytest.mark.needs_data
def test_heldout_docs_carry_the_split_dataset_seed_and_fingerprint():
    spec = importlib.util.spec_from_file_location("mari_harness_utils", REPO / "harness_tasks" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    docs = utils.load_truthfulqa_heldout(split_seed=1)["validation"]
    splits = data_splits.make_splits("truthfulqa", 1)
    assert set(docs["split_dataset"]) == {"truthfulqa"}
    assert set(docs["split_seed"]) == {1}
    assert set(docs["split_fingerprint"]) == {splits.fingerprint()}
    # What the lm-eval model does with a bundle trained on these splits: passes.
    recorded = {**splits.to_json(), "fingerprint": splits.fingerprint()}
    data_splits.check_recorded_splits(docs[0]["split_dataset"], recorded, data_splits.data_fingerprint("truthfulqa"))
