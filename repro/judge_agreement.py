"""The refusal judges scored against people: XSTest's 1,800 human-labelled completions.

    python repro/judge_agreement.py                      # the keyword judge and XSTest's recorded ones
    python repro/judge_agreement.py --llm --llm-limit 50 # and an LLM judge on 50 completions per model
    python repro/judge_agreement.py --llm --llm-limit 50 --scored smollm2-135m-instruct gemma-3-270m
                                                         # and those judges scored in this process (the results)

Every refusal judge this suite uses says refusal or not; XSTest's completions (450 prompts x 4
models: GPT-4, Llama-2-chat, Mistral-Instruct with and without its guard prompt) carry the
people's adjudicated label (``mari_eval.judge.agreement``). Scored here:

* ``keyword``: the keyword judge of the SORRY-Bench column (``sorry_keyword``;
  ``mari_eval.judge.prompt.REFUSAL_PHRASES``);
* ``xstest-string-match`` and ``xstest-gpt4``: the labels XSTest's authors recorded with their
  own string matcher and with GPT-4, read from the file (not run here), as reference points;
* ``llm`` (``--llm``): the LLM judge of the SORRY-Bench tasks, the one ``MARI_JUDGE_*`` configures
  (docs/judge.md), else the embedded one started on loopback, asked with its SORRY-Bench prompt
  (a response that fulfils the request is compliance). ``--llm-limit N`` asks it about the
  first N completions of each model (by prompt id), all four models alike. Its verdicts are scored
  where the server gives log-probabilities, else parsed from its answers; the output says which.
* ``scored MODEL`` (``--scored MODEL ...``): a judge model run in this process, every verdict scored
  from the log-probabilities of the verdict digits (mari_eval/judge/scoring.py), its threshold chosen
  on one half of the completions, split by prompt, and its agreement reported on the other half
  (mari_eval/judge/calibration.py); each writes its calibration file under mari_eval/judge/thresholds/
  (what the judge reads at scoring time), with the seconds its scores took. The models are scored one
  after the other.

For each judge: accuracy and Cohen's kappa with 95% bootstrap intervals, the confusion matrix,
unparseable verdicts beside n; overall, on the 250 safe and 200 unsafe prompts apart, and per
model; under both readings of a partial refusal (the default counts it as a refusal). Then every
judge again on the held-out half alone (partial refusals counted as refusals), Mistral-instruct's
completions apart, against the kappa floor of the tables' judged columns (repro/engine/judged.py);
``judged_column`` says whether the judge of those columns reaches it. Writes
results/judge_agreement.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from mari_eval.benchmarks.data import load_xstest_completions
from mari_eval.storage.files import check_writable_dir
from mari_eval.storage.numbers import flag_type
from mari_eval.judge import agreement as A
from mari_eval.judge.prompt import REFUSAL, UNPARSEABLE, keyword_refusal
from mari_eval.judge.samples import described_label
from repro.analysis import intervals
from repro.analysis import judge_heldout as H
from repro.engine.profiles import REPO
from repro.analysis.tables import markdown_table, write_record

JUDGES = ("keyword", "xstest-string-match", "xstest-gpt4")
SHOWN_RAW = 3  # unparseable answers of the LLM judge shown in the results


def verdicts(rows: list[dict], judge: str) -> list[bool | None]:
    """One verdict per completion (True: refusal; None: none) from a judge that needs no server."""
    if judge == "keyword":
        return [keyword_refusal(r["completion"]) for r in rows]
    if judge == "xstest-string-match":
        return [A.xstest_label_refusal(r["strmatch_label"]) for r in rows]
    if judge == "xstest-gpt4":
        return [A.xstest_label_refusal(r["gpt4_label"]) for r in rows]
    raise ValueError(f"unknown judge {judge!r}: one of {list(JUDGES)}")


def llm_verdicts(rows: list[dict]) -> tuple[list[bool | None], dict]:
    """The configured LLM judge's verdicts (else the embedded judge's), and what it was: its model (an
    embedded one by its alias), prompt and settings, and the first ``SHOWN_RAW`` answers it gave
    that are not a verdict."""
    from mari_eval.judge import Judge, JudgeConfig, judge_environment, load_prompt
    from mari_eval.storage.models import display_name

    with judge_environment() as env:
        with _environment(env):
            judge = Judge(JudgeConfig.from_env(), load_prompt())
            judge.check()
            judgements = judge.judge([(r["prompt"], r["completion"]) for r in rows])
            described = judge.describe()
    for key in ("cache", "base_url"):  # a path and a port of this machine
        described.pop(key, None)
    described["model"] = display_name(described["model"])
    described["served_models"] = {display_name(k): v for k, v in described["served_models"].items()}
    described["unparseable_examples"] = [j.raw for j in judgements if j.label == UNPARSEABLE][:SHOWN_RAW]
    return [None if j.label == UNPARSEABLE else j.label == REFUSAL for j in judgements], described


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _subsets(rows: list[dict]) -> dict[str, list[int]]:
    """{subset name: indices of its completions}: all, the safe and unsafe prompts, each model."""
    out = {"all": list(range(len(rows))),
           "safe prompts": [i for i, r in enumerate(rows) if not r["type"].startswith("contrast_")],
           "unsafe prompts": [i for i, r in enumerate(rows) if r["type"].startswith("contrast_")]}
    for model in sorted({r["model"] for r in rows}):
        out[f"model {model}"] = [i for i, r in enumerate(rows) if r["model"] == model]
    return out


def score(rows: list[dict], judged: dict[str, list[bool | None]]) -> dict:
    """{reading: {judge: {subset: agreement as JSON}}}."""
    out: dict = {}
    for reading in A.READINGS:
        human = [A.human_refusal(r["final_label"], reading) for r in rows]
        out[reading] = {judge: {name: A.agreement([human[i] for i in where], [verdict[i] for i in where],
                                                  iterations=intervals.ITERATIONS, seed=intervals.SEED).as_json()
                                for name, where in _subsets(rows).items()}
                        for judge, verdict in judged.items()}
    return out


def _limited(rows: list[dict], limit: int | None) -> list[dict]:
    if limit is None:
        return rows
    by_model: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["model"], int(r["id"].rsplit("-", 1)[-1]))):
        by_model.setdefault(r["model"], []).append(r)
    return [r for model in sorted(by_model) for r in by_model[model][:limit]]


def markdown(record: dict) -> str:
    lines = ["# Refusal judges against people (XSTest)\n",
             f"Generated by `{record['command']}` in {record['wall_time_s']:.0f} s: {record['documents']['completions']} "
             "completions of XSTest (Röttger et al., 2024; 450 prompts x 4 models) with their adjudicated human label "
             "(`final_label`), from `$MARI_DATA_DIR/xstest/completions.jsonl.gz`. Accuracy and Cohen's kappa of each "
             f"judge's refusal verdicts against the people's, with {intervals.LEVEL:.0%} percentile bootstrap intervals "
             f"({intervals.ITERATIONS} resamples of completions, seed {intervals.SEED}; mari_eval/judge/agreement.py); "
             "unparseable verdicts are left out of n and counted beside it. Confusion: human refusal judged refusal / "
             "judged compliance; human compliance judged refusal / judged compliance. `keyword` is this suite's "
             "keyword judge (the `sorry_keyword` column); `xstest-string-match` and `xstest-gpt4` are the labels "
             "XSTest's authors recorded, read from the file; `llm` is the LLM judge named below.\n"]
    if record.get("llm_judge"):
        j = record["llm_judge"]
        modes = ", ".join(f"{n} {mode}" for mode, n in sorted((j.get("verdicts") or {}).items())) or "not recorded"
        lines.append(f"LLM judge: `{j['model']}` with prompt `{j['prompt']}` (sha256 {j['prompt_sha256'][:12]}), "
                     f"max_tokens {j['max_tokens']}, on {record['documents']['llm']} completions (the first "
                     f"{record['llm_limit']} of each model by prompt id; the other judges on all of them); verdicts: "
                     f"{modes} (scored: from the log-probabilities the server gave; parsed: read from its answer, "
                     "where the server gave none).\n")
        if j.get("unparseable_examples"):
            shown = "; ".join(f"`{' '.join(raw.split())[:120]}`" for raw in j["unparseable_examples"])
            lines.append(f"Answers of the LLM judge that are not a verdict (the first {len(j['unparseable_examples'])}): "
                         f"{shown}.\n")
    for reading, judges in record["readings"].items():
        default = " (the default reading)" if reading == A.DEFAULT_READING else ""
        lines.append(f"\n## {reading}{default}\n")
        lines.append(markdown_table(
            ["judge", "n", "unparseable", "accuracy", "Cohen's kappa", "confusion"],
            [[judge, s["all"]["n"], s["all"]["unparseable"], H.figure(s["all"]["accuracy"], s["all"]["accuracy_ci"]),
              H.figure(s["all"]["kappa"], s["all"]["kappa_ci"]), H.confusion_text(s["all"]["confusion"])]
             for judge, s in judges.items()]))
        subsets = [name for name in next(iter(judges.values())) if name != "all"]
        lines.append(f"\nCohen's kappa (accuracy) by subset, {reading}:\n")
        lines.append(markdown_table(
            ["judge"] + subsets,
            [[judge] + [f"{H.figure(s[name]['kappa'], None)} ({H.figure(s[name]['accuracy'], None)}, n={s[name]['n']})"
                        for name in subsets] for judge, s in judges.items()]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "results", help="where judge_agreement.{json,md} go")
    parser.add_argument("--llm", action="store_true", help="also score the LLM judge (MARI_JUDGE_*, else the embedded one)")
    parser.add_argument("--llm-limit", type=flag_type(integer=True, lo=1), help="ask the LLM judge about the first N completions of each model")
    parser.add_argument("--scored", nargs="+", metavar="MODEL", default=[],
                        help="also judge in this process with each MODEL (an embedded alias, a local folder or a Hub id), "
                             "one after the other: verdicts scored, the threshold chosen on the calibration half, "
                             "agreement on the held-out half, the calibration file written")
    parser.add_argument("--thresholds", type=Path, help="write the calibration files here (default: "
                        "mari_eval/judge/thresholds, what the judges read)")
    parser.add_argument("--limit-prompts", type=flag_type(integer=True, lo=1),
                        help="a quick check: only the first N prompts of each half in the held-out section and for the "
                             "scored judges (needs --thresholds, so that the committed calibration stays)")
    args = parser.parse_args(argv)
    if args.llm_limit is not None and (not args.llm or args.llm_limit < 1):
        parser.error("--llm-limit N needs --llm and N >= 1")
    if args.limit_prompts is not None and args.thresholds is None:
        parser.error("--limit-prompts N calibrates on a few prompts: give --thresholds DIR too, so that the committed "
                     "calibration files (mari_eval/judge/thresholds) are not overwritten")
    check_writable_dir(args.out, "--out")
    start = time.perf_counter()
    rows = load_xstest_completions()
    judged = {judge: verdicts(rows, judge) for judge in JUDGES}
    command = "python repro/judge_agreement.py" + (" --llm" if args.llm else "") + (
        f" --llm-limit {args.llm_limit}" if args.llm_limit is not None else "") + (
        f" --scored {' '.join(args.scored)}" if args.scored else "") + (
        f" --limit-prompts {args.limit_prompts}" if args.limit_prompts is not None else "")
    record = {"command": command, "data": "xstest/completions.jsonl.gz", "documents": {"completions": len(rows)},
              "uncertainty": {"interval": f"{intervals.LEVEL:.0%} percentile bootstrap over completions",
                              "iterations": intervals.ITERATIONS, "seed": intervals.SEED},
              "readings_meaning": {name: sorted(labels) for name, labels in A.READINGS.items()}}
    readings = score(rows, judged)
    heldout_judges = {name: (name if name == "keyword" else None, dict(enumerate(v))) for name, v in judged.items()}
    if args.llm:
        asked = _limited(rows, args.llm_limit)
        llm, record["llm_judge"] = llm_verdicts(asked)
        record["llm_limit"], record["documents"]["llm"] = args.llm_limit, len(asked)
        for reading, by_judge in score(asked, {"llm": llm}).items():
            readings[reading]["llm"] = by_judge["llm"]
        index = {id(r): i for i, r in enumerate(rows)}
        heldout_judges["llm"] = (described_label(record["llm_judge"]), {index[id(r)]: v for r, v in zip(asked, llm)})
    record["readings"] = readings
    split = H.halves(rows, args.limit_prompts)
    record["split"] = H.split_record(rows, split, args.limit_prompts)
    scored = {alias: H.scored_judge(alias, rows, split, command, args.thresholds,
                                             limit_prompts=args.limit_prompts) for alias in args.scored}
    record["documents"]["scored"] = {alias: s["timing"]["completions"] for alias, s in scored.items()}
    record["held_out"] = H.held_out(rows, split, heldout_judges, scored)
    record["scored_judges"] = {alias: {k: v for k, v in s.items() if k != "subsets"} for alias, s in scored.items()}
    record["judged_column"] = H.judged_column(record)
    record["wall_time_s"] = round(time.perf_counter() - start, 1)
    write_record(args.out / "judge_agreement", record, markdown(record) + H.markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
