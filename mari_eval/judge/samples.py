"""SORRY-Bench responses that outlive the judge: saved before judging, judged later.

Generating the responses is the slow part of a SORRY-Bench run; the judge comes after,
in lm-eval's aggregation step, and a judge that fails there ends ``lm_eval`` without
results or samples. So:

* ``save_generations``: before the task asks the judge anything, its responses are written
  (atomically) to ``generations/sorry_bench-<n>-<sha>.jsonl`` beside the judge cache (the
  file name is a hash of the content: a rerun with the same responses rewrites nothing).
  When judging then fails, ``resumable`` adds to the error where they are and the command
  that finishes the job without generating anything again: ``mari-eval judge FILE``.
* ``judge_file`` (``mari-eval judge FILE``): judges such a file, or the samples file of an
  lm-eval run (``--log_samples``, e.g. with ``--predict_only``, which needs no judge), with
  the judge the environment configures, through the same cache; it returns, prints and
  writes the metrics the task reports (``task_metrics``) and what the task records beside
  them (``judge_record``: the judge, the per-category rates, unparseable answers), computed
  by the same functions. Its verdicts are scored where that is possible (``make_judge``): from the
  server's log-probabilities when it gives them (else parsed from its answers), or, with no server
  configured, in this process by the embedded judge (``LocalJudge``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Sequence

from mari_eval.storage.files import atomic_write, check_writable_file, write_results_json
from mari_eval.judge.cache import default_cache_path
from mari_eval.judge.client import Judge, Judgement
from mari_eval.judge.config import ENV_BASE_URL, ENV_MODEL, JudgeConfig, JudgeError
from mari_eval.judge.prompt import UNPARSEABLE, load_prompt
from mari_eval.judge.summary import refusal_summary
from mari_eval.storage.models import DEFAULT_MODEL, display_name

log = logging.getLogger(__name__)

KIND = "mari-eval sorry-bench generations"  # the first line of a generations file says what it is
FIELDS = ("id", "category", "instruction", "response")
CATEGORIES = tuple(str(i) for i in range(1, 46))  # SORRY-Bench 202406: categories 1..45
SHOWN_RAW = 3  # unparseable answers shown (log, results, mari-eval judge), at most
RAW_CHARS = 200  # ... each cut to this many characters


# ----------------------------------------------------------------------------- metrics (shared with the task)


def rate(summary: Mapping) -> float:
    """A summary's refusal_rate as the task reports it: NaN when the judge gave no readable verdict."""
    return float("nan") if summary["refusal_rate"] is None else summary["refusal_rate"]


def judge_label(judge: Judge) -> str:
    return described_label(judge.describe())


def described_label(described: Mapping) -> str:
    """The label of a judge as ``Judge.describe`` gives it (or judge_agreement.json records it): model and
    prompt with its sha256; for a judge whose verdicts were scored, where the scores came from and the
    threshold (a judge whose verdicts were all parsed is labelled as before scoring existed)."""
    label = f"{described['model']} | prompt {described['prompt']} sha256:{described['prompt_sha256']}"
    if (described.get("verdicts") or {}).get("scored"):
        label += f" | scored {described['source']}, threshold {described['threshold']:.4g}"
    return readable_label(label)


def readable_label(label: str) -> str:
    """A judge label without this machine's folders (``mari_eval.storage.models.display_name``: the
    embedded judge is "ALIAS (embedded)"). Also applied to labels stored before this
    (repro/engine/judged.py), so that one judge has one label."""
    model, sep, rest = label.partition(" | ")
    return f"{display_name(model)}{sep}{rest}"


def task_metrics(summary: Mapping) -> dict:
    """The metrics of the sorry_bench tasks (harness_tasks/sorry_bench.yaml) from ``refusal_summary``:
    numbers only, so that lm-eval's table stays narrow (the rest is in ``judge_record``)."""
    return {
        "refusal_rate": rate(summary),
        "keyword_refusal_rate": summary["keyword_refusal_rate"],
        "judge_unparseable": summary[UNPARSEABLE],
    }


def unparseable_examples(judgements: Sequence[Judgement]) -> list[str]:
    """The first ``SHOWN_RAW`` answers the parser could not read, each cut to ``RAW_CHARS`` characters."""
    return [j.raw[:RAW_CHARS] for j in judgements if j.label == UNPARSEABLE][:SHOWN_RAW]


def judge_record(summary: Mapping, judge: Judge, judgements: Sequence[Judgement]) -> dict:
    """What the task records beside its metrics (in lm-eval's results JSON, under the task's
    ``configs``/``metadata``): the judge (its label, model, prompt and its sha256, parser), the rates
    of every category that has responses, and the first unparseable answers."""
    d = judge.describe()
    return {
        "judge": {"label": judge_label(judge), **{k: d[k] for k in ("model", "base_url", "prompt", "prompt_sha256",
                                                                       "parser", "max_tokens")},
                  **{k: d[k] for k in ("verdicts", "threshold", "calibration") if k in d}},
        "refusal_rate_bounds": summary["refusal_rate_bounds"],
        "by_category": {cat: {"name": row["name"], "n": row["n"], "refusal_rate": row["refusal_rate"],
                              "keyword_refusal_rate": row["keyword_refusal_rate"], UNPARSEABLE: row[UNPARSEABLE]}
                        for cat, row in summary["by_category"].items()},
        "unparseable_examples": unparseable_examples(judgements),
    }


def identity_line(judge: Mapping) -> str:
    """One line naming the judge (``Judge.describe()``): model, server, prompt and its sha256, parser."""
    return (f"judge {judge['model']} at {judge['base_url']} | prompt {judge['prompt']} sha256:{judge['prompt_sha256'][:16]} "
            f"| parser {judge['parser']}")


def example_lines(examples: Sequence[str], unparseable: int) -> list[str]:
    """The unparseable answers shown, one line each (line breaks as \\n)."""
    if not examples:
        return []
    head = f"{unparseable} answer(s) of the judge unparseable; the first {len(examples)}:"
    return [head, *(f"  {json.dumps(raw, ensure_ascii=False)}" for raw in examples)]


def summary_lines(summary: Mapping) -> list[str]:
    """The per-category table (and the bounds when verdicts are unparseable), as lines of text."""
    lines = [f"{'cat':<4} {'name':<40} {'n':>4} {'judged':>8} {'keyword':>8} {'unpars':>6}"]
    for cat, row in summary["by_category"].items():
        judged = "n/a" if row["refusal_rate"] is None else f"{row['refusal_rate']:.3f}"
        lines.append(f"{cat:<4} {(row['name'] or '')[:40]:<40} {row['n']:>4} {judged:>8} "
                     f"{row['keyword_refusal_rate']:>8.3f} {row[UNPARSEABLE]:>6}")
    if summary[UNPARSEABLE]:
        low, high = summary["refusal_rate_bounds"]
        lines.append(f"{summary[UNPARSEABLE]} of {summary['n']} verdicts unparseable (counted in judge_unparseable, "
                     f"left out of refusal_rate); whatever they are, the refusal rate over all responses lies in "
                     f"[{low:.3f}, {high:.3f}]")
    return lines


# ----------------------------------------------------------------------------- saving generations


def generations_dir() -> Path:
    """``generations/`` beside the judge cache (``$MARI_JUDGE_CACHE`` or the default one)."""
    return default_cache_path().parent / "generations"


def _generations_name(header: Mapping, body: str) -> str:
    """The name ``save_generations`` gives a generations file: its response count and a digest of its
    header (without the time it was written) and item lines, so that ``read_samples`` can tell an edit."""
    written = {k: v for k, v in header.items() if k != "created"}
    digest = hashlib.sha256((json.dumps(written, sort_keys=True, default=str) + body).encode("utf-8")).hexdigest()[:16]
    return f"sorry_bench-{header['items']}-{digest}.jsonl"


def save_generations(items: Sequence[Mapping], run: Mapping | None = None) -> Path | None:
    """Write the task's responses (``FIELDS`` of each item) before they are judged; the file's path.

    ``run`` says what generated them (the task's metadata: model arguments, split seed).
    Tried beside the judge cache, then in the temporary directory; None (and a warning) when
    neither can be written: judging goes on, since these are a safeguard only.
    """
    rows = [{k: item[k] for k in FIELDS} for item in items]
    header = {"kind": KIND, "items": len(rows), "run": dict(run or {})}
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    name = _generations_name(header, body)
    header["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    text = json.dumps(header, ensure_ascii=False, default=str) + "\n" + body
    errors = []
    for folder in (generations_dir(), Path(tempfile.gettempdir()) / "mari-eval-generations"):
        path = folder / name
        try:
            if not path.is_file():
                atomic_write(path, text)
                log.info("SORRY-Bench: %d responses saved in %s before judging", len(rows), path)
            return path
        except OSError as e:
            errors.append(f"{folder}: {e.strerror or e}")
    log.warning("SORRY-Bench: the responses could not be saved before judging (%s)", "; ".join(errors))
    return None


def resumable(error: JudgeError, saved: Path | None, n: int) -> JudgeError:
    """``error`` (same type) saying where the responses are and the command that judges them."""
    if saved is None:
        note = ("\nThe responses could not be saved (see the warning above). To keep them next time, generate with "
                "--predict_only --log_samples --output_path OUT, then judge OUT's samples_sorry_bench*.jsonl with "
                "mari-eval judge.")
    else:
        note = (f"\nNo response is lost: the {n} responses are saved in {saved}, and nothing needs generating again. "
                f"Once the judge works, run\n    mari-eval judge {saved}\nwith the same MARI_JUDGE_* settings: it asks "
                f"only for the verdicts not in the cache and prints the task's metrics (--out FILE writes them as JSON).")
    return type(error)(str(error) + note)


# ----------------------------------------------------------------------------- judging saved samples


def read_samples(path: str | Path) -> tuple[list[dict], dict]:
    """The items (``FIELDS``) of a generations file or an lm-eval samples file, and the run they came from.

    lm-eval's samples (``--log_samples``) hold one object per doc, with the doc and its
    ``filtered_resps``; the response judged is ``filtered_resps[0]``, what the task's
    process_results receives.
    """
    path = Path(path)
    if not path.is_file():
        raise JudgeError(f"{path} is not a file: pass a samples_sorry_bench*.jsonl file written by lm_eval "
                           f"--log_samples, or a generations file named in a judge error")
    items, run, seen = [], None, set()
    body = []  # the item lines as written, for a generations file's digest
    with path.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise JudgeError(f"{path}, line {lineno}: not JSON ({e.msg}); the file is damaged or not JSON lines") from None
            if isinstance(row, dict) and row.get("kind") == KIND:
                if run is not None or items:
                    raise JudgeError(f"{path}, line {lineno}: a second generations header; a generations file has one, "
                                       "on its first line (two files joined?): judge each file on its own")
                run = row
                continue
            item, problem = _item(row)
            if item is None:
                raise JudgeError(f"{path}, line {lineno}: not a SORRY-Bench response: {problem}. Expected an lm-eval "
                                   f"sample of sorry_bench or sorry_bench_heldout (a doc with 'instruction' and "
                                   f"'category', and 'filtered_resps') or an object with {list(FIELDS)}")
            if item["id"] in seen:
                raise JudgeError(f"{path}, line {lineno}: doc {item['id']!r} appears twice (one file per task and "
                                   f"filter, please)")
            seen.add(item["id"])
            items.append(item)
            body.append(line if line.endswith("\n") else line + "\n")
    if not items:
        raise JudgeError(f"{path} holds no responses")
    if run is not None:
        _check_complete(path, run, len(items), "".join(body))
    return items, (run or {}).get("run") or {}


def _check_complete(path: Path, header: dict, n: int, body: str) -> None:
    """Refuse a generations file that does not hold what its header says: fewer or more responses
    than ``items`` (a copy cut at a line boundary, a full disk, lines added), or, for a file still
    under the name ``save_generations`` gave it, lines that are not the ones it wrote."""
    claimed = header.get("items")
    if type(claimed) is not int or claimed < 1:
        raise JudgeError(f"{path}: its header gives items={claimed!r}, not a count of responses; the file is damaged: "
                           "use the generations file as written, or generate again")
    if claimed != n:
        raise JudgeError(f"{path}: its header says the run had {claimed} responses, but the file holds {n}: it was "
                           f"{'cut short (an interrupted copy or a full disk)' if n < claimed else 'added to'}, and a "
                           f"refusal rate over {n} of them would not be the run's. Copy the file again from where it "
                           "was saved, or generate again")
    name = path.name.removesuffix(".jsonl").split("-")
    if len(name) == 3 and name[0] == "sorry_bench" and name[1] == str(claimed):  # still under the name it was saved as
        expected = _generations_name(header, body)
        if expected != path.name:
            raise JudgeError(f"{path}: its content does not match the digest in its name (the content gives "
                               f"{expected}): a response or its header was changed after it was saved. Copy the file "
                               "again from where it was saved, or generate again")


def _item(row) -> tuple[dict | None, str]:
    """(the response of a file's line, "") or (None, what is wrong with it, naming the field)."""
    if not isinstance(row, dict):
        return None, f"the line holds a JSON {type(row).__name__}, not an object"
    if all(k in row for k in FIELDS):
        item = {k: row[k] for k in FIELDS}
    elif isinstance(row.get("doc"), dict) and isinstance(row.get("filtered_resps"), list) and row["filtered_resps"]:
        doc = row["doc"]
        missing = [k for k in ("instruction", "category") if k not in doc]
        if missing:
            return None, f"its doc lacks {' and '.join(repr(k) for k in missing)}"
        item = {"id": doc.get("id", row.get("doc_id")), "category": doc["category"], "instruction": doc["instruction"],
                "response": row["filtered_resps"][0]}
    else:
        missing = [k for k in FIELDS if k not in row]
        return None, f"it lacks {', '.join(repr(k) for k in missing)} (and is not an lm-eval sample)"
    for field in ("instruction", "response"):
        if not isinstance(item[field], str):
            return None, f"field {field!r} is {json.dumps(item[field])[:40]}, not text"
    item["category"] = str(item["category"])
    if item["category"] not in CATEGORIES:
        return None, f"field 'category' is {item['category']!r}, not a SORRY-Bench category (1 to {len(CATEGORIES)})"
    return item, ""


def make_judge(*, base_url: str | None = None, model: str | None = None, cache: str | Path | None = None,
               prompt: str | None = None, local: str | None = None):
    """The judge of ``mari-eval judge``: ``LocalJudge(local)`` (scored in this process) when ``local`` is
    given, else the server that the arguments or ``MARI_JUDGE_*`` configure (scored from its
    log-probabilities where it gives them), else, with none configured, the embedded judge in this process."""
    import os  # deferred: keeps this module's imports to what every caller needs

    if local is not None and (base_url or model):
        raise JudgeError("mari-eval judge: --local judges in this process; --base-url and --model name a server: "
                         "give one or the other")
    if local is None and not ((base_url or os.environ.get(ENV_BASE_URL)) and (model or os.environ.get(ENV_MODEL))):
        if base_url or model or os.environ.get(ENV_BASE_URL) or os.environ.get(ENV_MODEL):
            JudgeConfig.from_env(base_url, model)  # half a server configured: its error names the missing half
        local = DEFAULT_MODEL
        log.info("No judge server configured (%s, %s): judging in this process with %s, its verdicts scored",
                 ENV_BASE_URL, ENV_MODEL, local)
    if local is not None:
        from mari_eval.judge.local import LocalJudge  # deferred: loads torch and transformers

        return LocalJudge(local, load_prompt(prompt), cache)
    return Judge(JudgeConfig.from_env(base_url, model), load_prompt(prompt), cache)


def judge_file(path: str | Path, *, base_url: str | None = None, model: str | None = None, cache: str | Path | None = None,
               prompt: str | None = None, out: str | Path | None = None, local: str | None = None) -> dict:
    """Judge the responses in ``path`` as the task would; ``{"metrics", "summary", ...}`` (also written to ``out``)."""
    if out is not None:  # before any verdict is asked for, not after
        check_writable_file(Path(out), "--out ", "judge.json")
    items, run = read_samples(path)
    judge = make_judge(base_url=base_url, model=model, cache=cache, prompt=prompt, local=local)
    judge.check()
    try:
        judgements = judge.judge([(i["instruction"], i["response"]) for i in items])
    except JudgeError as e:
        raise type(e)(f"{e}\nRun the same command again once the judge works: the verdicts above are kept.") from None
    summary = refusal_summary(items, [j.label for j in judgements], judge=judge)
    result = {"source": str(path), "run": run, "metrics": task_metrics(summary),
              **judge_record(summary, judge, judgements), "summary": summary}
    if out is not None:
        write_results_json(out, result, ensure_ascii=False)  # strict JSON: NaN as null
    return result


def print_result(result: Mapping) -> None:
    """What ``mari-eval judge`` prints: the judge, the table, unparseable answers, then the task's metrics."""
    summary, metrics = result["summary"], result["metrics"]
    print(f"{result['source']}: {summary['n']} responses; {identity_line(summary['judge'])}; "
          f"cache {summary['judge']['cache']}")
    print("\n".join(summary_lines(summary) + example_lines(result["unparseable_examples"], summary[UNPARSEABLE])))
    for name, value in metrics.items():
        print(f"{name}: {value}")
    print("judge:", result["judge"]["label"])
    modes = summary["judge"].get("verdicts") or {}
    print("verdicts: " + ", ".join(f"{n} {mode}" for mode, n in sorted(modes.items())) + " (scored: from the log-"
          "probabilities of the verdict digits, against the judge's threshold; parsed: read from its answer)")
    sys.stdout.flush()
