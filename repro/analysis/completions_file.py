"""A table's generated answers as files beside its per-document scores (issue 81.4): NAME_completions.parquet,
every answer of every generation column (``write_completions``, called by ``repro.analysis.tables.write_tables``;
``read_completions``, ``python -m repro.rejudge``'s input), and NAME_completions.md, the first answers of each
row to read (the first safe XSTest prompts: whether a row refuses everything shows there).

One record per model, row, seed, task and document, zstd-compressed Parquet with the columns

    model, row, seed (None: unknown), stratum (0, 1, ...: the seeds in the order tallied), task,
    columns and metrics (the table's columns scored from these answers, each with its metric),
    bundle (its directory under the runs folder; None: the untouched model), bundle_fingerprint,
    model_args, evaluation (the step's file under evaluations/), document (its id, as in
    NAME_documents.parquet), prompt, chat_turn (whether the prompt is one chat user turn, rendered
    through the model's chat template), completion, and the decoding: max_gen_toks, do_sample,
    temperature, until

(repro/engine/completions.py says what prompt and completion hold). An evaluation stored without
completions (before they were kept) is never written as an empty answer: the Markdown file names it
and the command that generates it again, and the table has no Parquet file when none was stored.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mari_eval.storage.files import atomic_write
from repro.analysis.documents_file import cell_seeds, shown_path
from repro.engine.profiles import REPO

log = logging.getLogger("repro")

SUFFIX = "_completions"  # NAME_completions.parquet and NAME_completions.md
SHOWN_DOCUMENTS = 5  # answers shown per task and row in the Markdown file
SHOWN_CHARS = 200  # ... each cut to this many characters, as its prompt
SHOWN_FIRST = ("xstest_safe",)  # tasks shown before the others: over-refusal is what a glance must catch
SCHEMA = pa.schema([("model", pa.string()), ("row", pa.string()), ("seed", pa.int64()), ("stratum", pa.int32()),
                    ("task", pa.string()), ("columns", pa.list_(pa.string())), ("metrics", pa.list_(pa.string())),
                    ("bundle", pa.string()), ("bundle_fingerprint", pa.string()), ("model_args", pa.string()),
                    ("evaluation", pa.string()), ("document", pa.string()), ("prompt", pa.string()),
                    ("chat_turn", pa.bool_()), ("completion", pa.string()), ("max_gen_toks", pa.int64()),
                    ("do_sample", pa.bool_()), ("temperature", pa.float64()), ("until", pa.list_(pa.string()))])


def _answers(cells: dict, columns: list[str], profile) -> dict[tuple, dict]:
    """{(model, row, stratum, task, step file): the cell's completions record with its seed and the table's
    columns and metrics read from it}, for every generation cell of ``cells`` (``tables.tally``'s)."""
    found: dict[tuple, dict] = {}
    for model, rows in cells.items():
        for label, by_column in rows.items():
            for column in columns:
                cell = by_column.get(column) or {}
                if not cell.get("completions"):
                    continue
                for stratum, (seed, record) in enumerate(zip(cell_seeds(cell, profile, column), cell["completions"])):
                    key = (model, label, stratum, record["task"], record["evaluation"])
                    entry = found.setdefault(key, {**record, "seed": seed, "columns": [], "metrics": []})
                    entry["columns"].append(column)
                    entry["metrics"].append(record["metric"])
    return found


def write_completions(out: Path, name: str, cells: dict, columns: list[str], profile, command: str) -> Path | None:
    """NAME_completions.parquet and NAME_completions.md under ``out`` for the generation columns of ``cells``;
    nothing for a table without any (or cells read back from files, which carry no completions:
    ``repro.rerender``). The Parquet file's path, or None when no step of the table stored completions."""
    answers = _answers(cells, columns, profile)
    if not answers:
        return None
    out_records: dict[str, list] = {field: [] for field in SCHEMA.names}
    missing = []
    for (model, label, stratum, task, _), entry in answers.items():
        if entry["documents"] is None:
            missing.append((model, label, entry))
            continue
        decoding = entry["decoding"]
        for document, answer in entry["documents"].items():
            values = {"model": model, "row": label, "stratum": stratum, "document": document, **answer, **decoding,
                      **{k: entry[k] for k in ("seed", "task", "columns", "metrics", "bundle", "bundle_fingerprint",
                                               "model_args", "evaluation")}}
            for field in SCHEMA.names:
                out_records[field].append(values[field])
    parquet = out / f"{name}{SUFFIX}.parquet"
    written = bool(out_records["document"])
    if written:
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table(out_records, schema=SCHEMA), sink, compression="zstd")
        atomic_write(parquet, sink.getvalue().to_pybytes())
    elif parquet.exists():  # an earlier run's answers would pass for this table's
        parquet.unlink()
        log.warning("%s removed: none of this table's evaluations stored completions", parquet)
    for model, label, entry in missing:
        log.warning("%s, %s, seed %s, %s: no completions stored (evaluations/%s); %s", model, label, entry["seed"],
                    entry["task"], entry["evaluation"], _recompute(command))
    table = shown_path(out / name, REPO)
    text = [f"# Completions of {table}\n",
            f"Written by `{command}` with the table. "
            + (f"Every answer of its generation columns ({len(out_records['document'])}) is in "
               f"{name}{SUFFIX}.parquet (model, row, seed, bundle, document, prompt, completion, decoding settings); "
               f"`python -m repro.rejudge {table} --judge keyword` judges them again without generating. "
               if written else "No evaluation of this table stored its completions: no Parquet file. ")
            + f"Below, each row's answer to the first {SHOWN_DOCUMENTS} documents of each generation task at its "
              f"first seed, prompt and answer cut to {SHOWN_CHARS} characters (a line break shows as ⏎).\n"]
    if missing:
        text.append("\n## No completions stored\n")
        text += [f"- {model}, {label}, seed {entry['seed']}, {entry['task']}: evaluations/{entry['evaluation']} was stored "
                 f"before completions were kept; {_recompute(command)}" for model, label, entry in missing]
    text += _shown(answers)
    atomic_write(out / f"{name}{SUFFIX}.md", "\n".join(text) + "\n")
    return parquet if written else None


def _recompute(command: str) -> str:
    """How to get a step's completions: generate it again."""
    return (f"recompute with: delete that file from the runs folder, then `{command}` (it generates only what is "
            "not stored)")


def _cut(text: str, head: bool = True) -> str:
    """``text`` on one line within SHOWN_CHARS: its start (``head``) or its end (a few-shot context's question)."""
    text = text.replace("\r", "").replace("\n", "⏎")
    if len(text) <= SHOWN_CHARS:
        return text
    return text[:SHOWN_CHARS] + "…" if head else "…" + text[-SHOWN_CHARS:]


def _decoding_text(decoding: dict) -> str:
    """"greedy, at most 48 tokens, until []" (or "sampled at temperature 0.7, ...")."""
    how = f"sampled at temperature {decoding['temperature']:g}" if decoding["do_sample"] else "greedy"
    return f"{how}, at most {decoding['max_gen_toks']} tokens, until {decoding['until']}"


def _shown(answers: dict[tuple, dict]) -> list[str]:
    """The Markdown sections: per model and task, the first documents at each row's first seed."""
    first: dict[tuple, dict] = {}  # (model, task, row): its stored entry of the lowest stratum
    for (model, label, stratum, task, _), entry in sorted(answers.items(), key=lambda item: item[0][2]):
        if entry["documents"] is not None:
            first.setdefault((model, task, label), entry)
    lines = []
    models = list(dict.fromkeys(model for model, _, _ in first))
    tasks = list(dict.fromkeys(task for _, task, _ in first))
    tasks = [t for t in SHOWN_FIRST if t in tasks] + [t for t in tasks if t not in SHOWN_FIRST]
    for model in models:
        for task in tasks:
            rows = {label: entry for (m, t, label), entry in first.items() if m == model and t == task}
            if not rows:
                continue
            decodings = {_decoding_text(entry["decoding"]) for entry in rows.values()}
            seeds = sorted({entry["seed"] for entry in rows.values()}, key=str)
            lines.append(f"\n## {model}: {task} (seed {', '.join(map(str, seeds))}; {'; '.join(sorted(decodings))})\n")
            reference = next(iter(rows.values()))["documents"]
            for document in list(reference)[:SHOWN_DOCUMENTS]:
                answer = reference[document]
                lines.append(f"**{document}.** {_cut(answer['prompt'], head=answer['chat_turn'])}\n")
                for label, entry in rows.items():
                    found = entry["documents"].get(document)
                    lines.append(f"- {label}: {_cut(found['completion']) if found else '(not among its documents)'}")
                lines.append("")
    return lines


def read_completions(path: Path):
    """NAME_completions.parquet as a pandas DataFrame (one row per answer, ``SCHEMA``'s columns); SystemExit
    naming the file and what writes it when it is not there."""
    import pandas as pd  # deferred: pandas is heavy; only this path needs it

    if not path.is_file():
        raise SystemExit(f"{path} is missing: a table with generation columns writes it (run its command again, e.g. "
                         "python repro/main_table.py ... --columns xstest_safe_refusal); a table whose evaluations "
                         "stored no completions has none (its NAME_completions.md says which)")
    frame = pd.read_parquet(path)
    wrong = [field for field in SCHEMA.names if field not in frame.columns]
    if wrong:
        raise SystemExit(f"{path} lacks the columns {wrong}: not a completions file of this version (write the table again)")
    return frame
