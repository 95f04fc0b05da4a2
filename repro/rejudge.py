"""A table's stored completions judged again, by any refusal judge, without generating anything (issue 81.4).

    python -m repro.rejudge results/profiles/budget/main_table --judge keyword
    python -m repro.rejudge TABLE --judge smollm2-135m-instruct            # a local model, verdicts scored here
    python -m repro.rejudge TABLE --judge embedded                         # the embedded judge, served on loopback
    python -m repro.rejudge TABLE --judge served:MODEL                     # MODEL served on loopback
    python -m repro.rejudge TABLE --judge http://HOST:PORT/v1 --judge-model NAME  # an OpenAI-compatible server
    python -m repro.rejudge TABLE --judge keyword --check                  # exit 1 unless the stored scores recur

Reads TABLE_completions.parquet (repro/analysis/completions_file.py) and asks the judge whether each answer
of a refusal task is a refusal: the tasks whose columns read a refusal or a compliance rate (SORRY-Bench,
XSTest's safe and unsafe prompts, any task scored so); the others (GSM8K, TruthfulQA generation) are listed
and left. ``keyword`` is the keyword judge of the sorry_keyword and xstest_* columns
(``mari_eval.judge.keyword_refusal``). The LLM judges read SORRY-Bench's judge prompt through the verdict
cache: a local model in this process, its verdict scored from the log-probabilities of the verdict tokens
and its calibration's threshold (issue 81.3's judge, ``in_process_judge``: the hook, used where
mari_eval.judge.local is there); a served one (``mari_eval.judge.Judge``) by its free text, an answer it
cannot read counted, never guessed. Writes TABLE_rejudged_JUDGE.parquet (model, row, seed, task, bundle, evaluation, document,
judge, refusal: 1, 0 or null without a verdict, raw: the judge's answer) and TABLE_rejudged_JUDGE.md: each
row's refusal rate per seed and task, and how the verdicts compare, document by document, with the table's
stored scores read by a judge of the same kind (the keyword judge: every stored keyword score recurs).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from repro.analysis.completions_file import SUFFIX, read_completions
from repro.analysis.documents_file import SUFFIX as DOCUMENTS_SUFFIX
from repro.analysis.documents_file import shown_path
from repro.engine.judged import judged_column
from repro.engine.profiles import REPO

KEYWORD, EMBEDDED = "keyword", "embedded"
SERVED = "served:"  # --judge served:MODEL: MODEL behind a loopback server, its free-text verdicts parsed
# How a column's metric reads a refusal verdict: the rate of refusals, or of the answers that are not one.
READS = {"refusal_rate": "refusal", "keyword_refusal_rate": "refusal", "compliance_rate": "compliance"}


def refusal_tasks(frame) -> tuple[list[str], list[str]]:
    """(the tasks of ``frame`` some column of which reads a refusal verdict, the others)."""
    tasks = list(dict.fromkeys(frame["task"]))
    reads = {task: any(m.split(",")[0] in READS for metrics in frame.loc[frame["task"] == task, "metrics"] for m in metrics)
             for task in tasks}
    return [t for t in tasks if reads[t]], [t for t in tasks if not reads[t]]


def keyword_verdicts(pairs: list[tuple[str, str]]) -> tuple[list[float | None], list[str | None], str]:
    from mari_eval.judge import keyword_refusal  # deferred: the judge package is only needed here

    return [float(keyword_refusal(completion)) for _, completion in pairs], [None] * len(pairs), "keyword"


def llm_verdicts(pairs: list[tuple[str, str]], judge) -> tuple[list[float | None], list[str | None], str]:
    """An LLM judge's verdicts (1.0 refusal, 0.0 compliance, None without a verdict) and its answers: ``judge`` a
    ``mari_eval.judge.Judge`` (a server, free text parsed) or anything with its ``check``, ``judge``, ``describe``."""
    from mari_eval.judge import REFUSAL, UNPARSEABLE  # deferred: see keyword_verdicts
    from mari_eval.judge.samples import described_label

    judge.check()
    judgements = judge.judge(pairs)
    found = [None if j.label == UNPARSEABLE else float(j.label == REFUSAL) for j in judgements]
    return found, [j.raw for j in judgements], described_label(judge.describe())


def in_process_judge(model: str):
    """The hook for the log-probability judge of issue 81.3, run in this process: ``mari_eval.judge.local.LocalJudge``
    (verdict tokens' log-probabilities after the judge prompt, thresholded by its calibration file) where the
    package has it; else SystemExit naming the judges that are there."""
    try:
        from mari_eval.judge.local import LocalJudge  # deferred: loads torch and the judge model
    except ImportError:
        raise SystemExit(f"--judge {model}: the in-process log-probability judge (mari_eval.judge.local, issue 81.3) "
                         f"is not in this checkout; --judge {SERVED}{model} serves the model on loopback and parses "
                         "its free-text verdicts") from None
    return LocalJudge(model)


def verdicts(pairs: list[tuple[str, str]], judge: str, judge_model: str | None):
    """(verdicts, the judge's answers, its label) of ``pairs`` (prompt, completion) by the judge ``--judge`` names."""
    if judge == KEYWORD:
        return keyword_verdicts(pairs)
    from mari_eval.judge import Judge, JudgeConfig, load_prompt, serve_embedded  # deferred: see keyword_verdicts

    if re.match(r"https?://", judge):
        if not judge_model:
            raise SystemExit(f"--judge {judge}: a server needs --judge-model, the model name it serves")
        return llm_verdicts(pairs, Judge(JudgeConfig.from_env(base_url=judge, model=judge_model), load_prompt()))
    if judge == EMBEDDED or judge.startswith(SERVED):
        with serve_embedded(judge.removeprefix(SERVED) if judge != EMBEDDED else None) as server:
            return llm_verdicts(pairs, Judge(server.config(), load_prompt()))
    return llm_verdicts(pairs, in_process_judge(judge))


def slug(judge: str) -> str:
    """The judge in a file name: keyword, embedded, or the model's or server's name in safe characters."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", judge.removeprefix("http://").removeprefix("https://")).strip("-")[:60]


def stored_scores(table: Path):
    """{(model, row, column, seed, document): score} of the table's per-document file."""
    import pandas as pd  # deferred: pandas is heavy; only this path needs it

    path = table.parent / f"{table.name}{DOCUMENTS_SUFFIX}"
    frame = pd.read_parquet(path, columns=["model", "row", "column", "seed", "document", "score"])
    return {(r.model, r.row, r.column, None if pd.isna(r.seed) else int(r.seed), r.document):
            None if pd.isna(r.score) else float(r.score) for r in frame.itertuples(index=False)}


def comparisons(frame, stored: dict, judge: str) -> dict[tuple[str, str], list[int]]:
    """{(task, column): [documents equal, documents compared]} of the verdicts against the stored scores of the
    columns read by a judge of the same kind (the keyword judge's columns for ``keyword``, else the LLM-judged)."""
    out: dict[tuple[str, str], list[int]] = {}
    for r in frame.itertuples(index=False):
        for column, metric in zip(r.columns, r.metrics):
            reading = READS.get(metric.split(",")[0])
            if reading is None or judged_column(r.task, metric) == (judge == KEYWORD):
                continue
            seed = None if r.seed != r.seed or r.seed is None else int(r.seed)
            key = (r.model, r.row, column, seed, r.document)
            if key not in stored:
                continue
            judged = None if r.refusal != r.refusal or r.refusal is None else (
                r.refusal if reading == "refusal" else 1.0 - r.refusal)
            count = out.setdefault((r.task, column), [0, 0])
            count[0] += judged == stored[key]
            count[1] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", type=Path, help="a table's results path without suffix, e.g. results/main_table")
    parser.add_argument("--judge", default=KEYWORD, help="keyword (default); a local model judged in this process "
                        f"(log-probability verdicts); embedded or {SERVED}MODEL (served on loopback, free text parsed); "
                        "a server's URL (with --judge-model)")
    parser.add_argument("--judge-model", help="the model name the --judge server serves")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every stored score read by a judge of this kind recurs")
    args = parser.parse_args(argv)
    table = args.table.with_suffix("") if args.table.suffix == ".json" else args.table
    frame = read_completions(table.parent / f"{table.name}{SUFFIX}.parquet")
    judged, left = refusal_tasks(frame)
    if not judged:
        raise SystemExit(f"{table}: no refusal task among its completions ({', '.join(left)}): nothing to judge")
    frame = frame[frame["task"].isin(judged)].reset_index(drop=True)
    pairs = list(zip(frame["prompt"], frame["completion"]))
    found, raw, label = verdicts(pairs, args.judge, args.judge_model)
    frame = frame.assign(judge=label, refusal=found, raw=raw)
    out = table.parent / f"{table.name}_rejudged_{slug(args.judge)}"
    kept = ["model", "row", "seed", "task", "bundle", "evaluation", "document", "judge", "refusal", "raw"]
    frame[kept].to_parquet(out.with_suffix(".parquet"), compression="zstd", index=False)
    compared = comparisons(frame, stored_scores(table), args.judge)
    text = report(frame, compared, label, left, shown_path(table, REPO), args.judge)
    out.with_suffix(".md").write_text(text)
    print(text)
    differ = [key for key, (equal, total) in compared.items() if equal != total]
    return 1 if args.check and (differ or not compared) else 0


def report(frame, compared: dict, label: str, left: list[str], table: str, judge: str) -> str:
    """The Markdown summary: refusal rates per row, seed and task; the comparison with the stored scores."""
    lines = [f"# {table}: completions judged again by {label}\n",
             f"`python -m repro.rejudge {table} --judge {judge}`: {len(frame)} stored answers of "
             f"{', '.join(dict.fromkeys(frame['task']))} judged without generating"
             + (f"; not refusal tasks, left: {', '.join(left)}" if left else "") + ".\n",
             "| row | seed | task | refusal rate | verdicts |", "|:--|--:|:--|--:|--:|"]
    for (row, seed, task), group in frame.groupby(["row", "seed", "task"], sort=False, dropna=False):
        scored = group["refusal"].dropna()
        rate = f"{scored.mean():.3f}" if len(scored) else "n/a"
        lines.append(f"| {row} | {seed} | {task} | {rate} | {len(scored)} of {len(group)} |")
    lines.append("\nAgainst the table's stored per-document scores (columns read by a judge of this kind):\n")
    lines += [f"- {column} ({task}): {equal} of {total} documents equal" for (task, column), (equal, total) in compared.items()]
    if not compared:
        lines.append("- none: no column of the table was read by a judge of this kind")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
