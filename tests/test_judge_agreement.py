"""Refusal judges against people (XSTest): the agreement figures, the readings of a partial
refusal, and the committed command on the real labelled completions."""

from __future__ import annotations

import gzip
import json
import math
import os

import pytest

from mari_eval.judge import agreement as A
from mari_eval.judge.prompt import keyword_refusal


def test_accuracy_kappa_and_confusion_by_hand():
    # 20 human refusals judged refusal, 5 judged compliance; 10 human compliances judged refusal, 15 compliance;
    # and two completions without a verdict. p_o = 35/50 = 0.7; the people refuse 25/50, the judge 30/50:
    # p_e = 0.5 * 0.6 + 0.5 * 0.4 = 0.5; kappa = (0.7 - 0.5) / (1 - 0.5) = 0.4.
    human = [True] * 25 + [False] * 25 + [True, False]
    judged = [True] * 20 + [False] * 5 + [True] * 10 + [False] * 15 + [None, None]
    found = A.agreement(human, judged, iterations=500, seed=3)
    assert (found.n, found.unparseable) == (50, 2)
    assert found.accuracy == pytest.approx(0.7) and found.kappa == pytest.approx(0.4)
    assert found.confusion == {"human refusal": {"judge refusal": 20, "judge compliance": 5},
                               "human compliance": {"judge refusal": 10, "judge compliance": 15}}
    assert found.kappa_ci[0] < 0.4 < found.kappa_ci[1] and found.accuracy_ci[0] < 0.7 < found.accuracy_ci[1]
    assert A.agreement(human, judged, iterations=500, seed=3) == found  # seeded: the same interval every run
    assert A.cohen_kappa(human[:50], judged[:50]) == pytest.approx(0.4)


def test_degenerate_and_mismatched_inputs():
    assert math.isnan(A.cohen_kappa([True, True], [True, True]))  # both raters constant: kappa undefined
    nothing = A.agreement([True, False], [None, None])
    assert nothing.n == 0 and nothing.unparseable == 2 and math.isnan(nothing.accuracy) and nothing.kappa_ci is None
    with pytest.raises(ValueError, match="one verdict per completion"):
        A.agreement([True], [True, False])


def test_readings_of_a_partial_refusal():
    assert A.human_refusal("3_partial_refusal") is True  # the default reading
    assert A.human_refusal("3_partial_refusal", "partial-is-compliance") is False
    assert A.human_refusal("2_full_refusal", "partial-is-compliance") is True
    assert A.human_refusal("1_full_compliance") is False
    with pytest.raises(ValueError, match="not an XSTest human label"):
        A.human_refusal("refusal")
    with pytest.raises(ValueError, match="unknown reading"):
        A.human_refusal("2_full_refusal", "partial")
    assert A.xstest_label_refusal("I'm sorry, but I can't assist with that.") is None  # GPT-4's free text
    assert A.xstest_label_refusal("3_partial_refusal") is True


@pytest.mark.needs_data
def test_committed_command_on_the_labelled_completions(tmp_path):
    from sklearn.metrics import cohen_kappa_score

    from repro import judge_agreement

    assert judge_agreement.main(["--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "judge_agreement.json").read_text())
    with gzip.open(os.path.join(os.environ["MARI_DATA_DIR"], "xstest", "completions.jsonl.gz"), "rt") as fh:
        rows = [json.loads(line) for line in fh]
    people = [r["final_label"] != "1_full_compliance" for r in rows]
    keyword = [keyword_refusal(r["completion"]) for r in rows]
    found = record["readings"]["partial-is-refusal"]["keyword"]
    assert found["all"]["n"] == 1800 and found["all"]["unparseable"] == 0
    assert found["all"]["kappa"] == pytest.approx(cohen_kappa_score(people, keyword))
    assert found["safe prompts"]["n"] == 1000 and found["unsafe prompts"]["n"] == 800  # 250 and 200 prompts x 4 models
    # GPT-4's free-text answers are unparseable, not guessed
    assert record["readings"]["partial-is-refusal"]["xstest-gpt4"]["all"]["unparseable"] > 0
    assert "| keyword" in (tmp_path / "judge_agreement.md").read_text()


def test_llm_limit_needs_llm(capsys):
    from repro import judge_agreement

    with pytest.raises(SystemExit):
        judge_agreement.main(["--llm-limit", "5"])
    assert "--llm-limit N needs --llm" in capsys.readouterr().err
