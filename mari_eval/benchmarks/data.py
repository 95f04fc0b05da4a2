"""Benchmark loading: every dataset the suite reads, as records with stable ids.

Every loader returns a list of records in the Hugging Face schema of the dataset,
each with an added stable ``id``: the dataset's own id where it has one (BBQ, SORRY-Bench,
ARC), otherwise one derived from the record's content (``content_id``), so that no id moves
when a line is added to or removed from a file. Records come from the local copy under
``$MARI_DATA_DIR`` when that variable is set (layout of ``shared/data``: see the loaders
and ``data_splits.ATTRIBUTE_FILES``), otherwise from the Hugging Face Hub, and are checked
against the schema of its family first (``data_schema.py``: types, shapes, duplicates; a bad
record raises ``DataError`` naming the file, line and field).

The paper's splits of these records (Appendix B) are ``mari_eval.benchmarks.data_splits``'s.
"""

from __future__ import annotations

import csv
import functools
import gzip
import hashlib
import io
import json
import logging
import os
import zlib
from pathlib import Path
from typing import Iterable

# The record schemas and their checks (data_schema.py); the names below are also read as data.X.
from .data_schema import (BBQ_CATEGORIES, BBQ_UNKNOWN_RESPONSES, MAX_DEPTH, REQUIRED_FIELDS, SCHEMAS,  # noqa: F401
                          SORRY_BENCH_CATEGORIES, DataError, Records, Schema, check_records)

log = logging.getLogger(__name__)

DATA_ENV = "MARI_DATA_DIR"
ARC_CONFIGS = {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge"}

# ----------------------------------------------------------------------------- sources


def data_dir() -> Path | None:
    value = os.environ.get(DATA_ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise DataError(f"{DATA_ENV}={value} is not a directory; point it at a folder laid out like shared/data")
    return path


def read_jsonl(path: Path, required: "Schema | Iterable[str]", fixed: dict | None = None) -> list[dict]:
    """Read a (gzipped) JSON-lines file, refusing missing files, bad lines and records that do not fit.

    ``required`` is a ``Schema`` (types, shapes, duplicates; see ``SCHEMAS``) or just the field
    names every record must carry. ``fixed``: fields whose value every record must equal.
    """
    schema = required if isinstance(required, Schema) else Schema(str(path), tuple((k, None) for k in required))
    if not path.exists():
        raise DataError(
            f"Missing data file {path} (under {DATA_ENV}). Restore it, or unset {DATA_ENV} to read from the Hub."
        )
    out = Records(str(path), schema, fixed=fixed)
    lineno = 0
    try:
        raw = path.read_bytes()
        # The checks are a pure function of the bytes: bytes already checked in this process
        # (the tests read the real files many times) are only parsed.
        verdict = (hashlib.sha256(raw).digest(), schema.family, schema.required, tuple(sorted((fixed or {}).items())))
        stream = io.BytesIO(raw)
        text = gzip.open(stream, "rt", encoding="utf-8") if path.suffix == ".gz" else io.TextIOWrapper(stream, "utf-8")
        with text as fh:
            if verdict in _checked:
                return [json.loads(line) for line in fh if line.strip()]
            for lineno, line in enumerate(fh, start=1):
                if line.strip():
                    out.add_line(line, lineno)
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as e:  # truncated or corrupt gzip, not gzip, not UTF-8
        raise DataError(f"{path}: unreadable after line {lineno} ({e}); the file is truncated or damaged, restore it") from None
    records = out.done()
    _checked.add(verdict)
    return records


_checked: set[tuple] = set()  # (sha256 of a file's bytes, schema, fixed fields) that read_jsonl accepted


def _hub(path: str, name: str | None, split: str, family: str | None = None) -> list[dict]:
    import datasets  # deferred: datasets is heavy; only this path needs it

    try:
        rows = list(datasets.load_dataset(path, name, split=split))
    except Exception as e:  # offline, gated, renamed...: say what to do instead
        raise DataError(
            f"Could not load {path}" + (f" ({name})" if name else "") + f" split '{split}' from the Hugging Face Hub: "
            f"{type(e).__name__}: {e}. Set {DATA_ENV} to a folder holding a local copy (see shared/data/SOURCES.md)."
        ) from None
    if family is None:
        return rows
    return check_records(rows, family, f"Hugging Face Hub {path}" + (f" ({name})" if name else "") + f" split '{split}'")


def _local_or_hub(rel: str, family: str, hub: tuple[str, str | None, str]) -> list[dict]:
    root = data_dir()
    if root is not None:
        return read_jsonl(root / rel, SCHEMAS[family])
    return _hub(*hub, family=family)


# ----------------------------------------------------------------------------- loaders


def content_id(prefix: str, *content: object) -> str:
    """``prefix-`` and 12 hex digits of the sha256 of ``content`` (as JSON, runs of whitespace in
    its strings read as one space): an id that names the example, not its line, so that it stays
    put when other lines are added or removed. (TruthfulQA's two published files differ in one
    question by a trailing space; it keeps one id.)"""
    def norm(x: object) -> object:
        return " ".join(x.split()) if isinstance(x, str) else [norm(v) for v in x] if isinstance(x, (list, tuple)) else x
    digest = hashlib.sha256(json.dumps(norm(content), ensure_ascii=False).encode("utf-8")).hexdigest()
    return f"{prefix}-{digest[:12]}"


def _with_content_ids(rows: list[dict], id_of) -> list[dict]:
    """``rows`` with ``id = id_of(row)``; a repeated record (MMLU publishes 28, kept on purpose,
    see data_schema) gets ``-r2``, ``-r3``... after the first, in file order."""
    count: dict[str, int] = {}
    out = []
    for r in rows:
        rid = id_of(r)
        n = count[rid] = count.get(rid, 0) + 1
        out.append({"id": rid if n == 1 else f"{rid}-r{n}", **r})
    return out


def load_truthfulqa_mc() -> list[dict]:
    rows = _local_or_hub("truthfulqa/mc.jsonl.gz", "truthfulqa/mc", ("truthfulqa/truthful_qa", "multiple_choice", "validation"))
    return _with_content_ids(rows, lambda r: content_id("tqa", r["question"]))


def load_truthfulqa_gen() -> list[dict]:
    """TruthfulQA's generation config; a question has the same id here as in ``load_truthfulqa_mc``
    (the two published files list the questions in different orders)."""
    rows = _local_or_hub("truthfulqa/generation.jsonl.gz", "truthfulqa/generation", ("truthfulqa/truthful_qa", "generation", "validation"))
    return _with_content_ids(rows, lambda r: content_id("tqa", r["question"]))


def load_bbq(context: str | None = "disambig") -> tuple[list[dict], list[str]]:
    """BBQ records (``context``: "disambig", "ambig" or None for both) and the categories covered.

    Every category present under $MARI_DATA_DIR/bbq is read; the others are fetched from
    the Hub when it is reachable and otherwise skipped with a warning. Results that use
    BBQ must name the returned categories.
    """
    root = data_dir()
    rows: list[dict] = []
    covered: list[str] = []
    for category in BBQ_CATEGORIES:
        local = root / "bbq" / f"{category}.jsonl.gz" if root is not None else None
        if local is not None and local.exists():
            part = read_jsonl(local, SCHEMAS["bbq"], fixed={"category": category})
        else:
            try:
                part = _hub("oskarvanderwal/bbq", category, "test", family="bbq")
            except DataError as e:
                log.warning("BBQ category %s is not available locally or from the Hub; skipped (%s)", category, e)
                continue
        covered.append(category)
        rows.extend(part)
    if not rows:
        raise DataError(f"No BBQ category could be read (looked in {root and root / 'bbq'} and on the Hub)")
    records = []
    seen: set[str] = set()
    for r in rows:
        rid = f"bbq-{r['category']}-{r['example_id']}"
        if rid in seen:  # across Hub configs (a file's records have its category and distinct example_ids)
            raise DataError(f"BBQ: two records have category {r['category']!r} and example_id {r['example_id']}; "
                            f"each record must appear once. Restore the data.")
        seen.add(rid)
        if context is not None and r["context_condition"] != context:
            continue
        records.append({"id": rid, **r})
    return records, covered


def bbq_context_key(record: dict) -> str:
    """The BBQ context a record belongs to: its category, template (``question_index``) and
    context text. The paired questions of one context (negative and non-negative polarity)
    share it, so they are one sampling unit: splits keep a context on one side, and intervals
    and paired tests resample contexts, not questions (issue 36.4)."""
    return f"{record['category']}|{record['question_index']}|{record['context']}"


def bbq_template_key(record: dict) -> str:
    """The BBQ template (category and ``question_index``) a record was generated from."""
    return f"{record['category']}|{record['question_index']}"


def load_sorry_bench() -> list[dict]:
    root = data_dir()
    if root is not None:
        rows = read_jsonl(root / "sorry_bench" / "question.jsonl.gz", SCHEMAS["sorry_bench"])
    else:
        rows = _hub_sorry_bench()
    return [{"id": f"sorry-{r['question_id']}", **r} for r in rows]


def _hub_sorry_bench() -> list[dict]:
    try:
        from huggingface_hub import hf_hub_download  # deferred: huggingface_hub is heavy; only the Hub path needs it

        path = hf_hub_download("sorry-bench/sorry-bench-202406", "question.jsonl", repo_type="dataset")
    except Exception as e:
        raise DataError(
            f"Could not fetch SORRY-Bench (gated dataset sorry-bench/sorry-bench-202406) from the Hub: {e}. "
            f"Accept its terms and log in, or set {DATA_ENV} to a local copy."
        ) from None
    rows = read_jsonl(Path(path), REQUIRED_FIELDS["sorry_bench"])
    base = [r for r in rows if r.get("prompt_style", "base") == "base"]
    return check_records(base, "sorry_bench", f"{path} (its prompt_style 'base' records)")


def load_xstest_prompts() -> list[dict]:
    """XSTest's 450 prompts (Röttger et al., 2024): 250 safe ones a model should answer, 200 unsafe
    contrasts it should refuse, each with its ``id`` ("xstest-N", N the authors' row id). Local:
    ``xstest/xstest_prompts.csv.gz``; else the Hub copy walledai/XSTest (ids by its row order)."""
    root = data_dir()
    if root is None:
        rows = _hub("walledai/XSTest", None, "test")
        rows = [{"id": str(i + 1), **{k: r.get(k) or "" for k in ("prompt", "type", "label", "focus", "note")}}
                for i, r in enumerate(rows)]
        source = "Hugging Face Hub walledai/XSTest split 'test'"
    else:
        path = root / "xstest" / "xstest_prompts.csv.gz"
        if not path.exists():
            raise DataError(f"Missing data file {path} (under {DATA_ENV}). Restore it, or unset {DATA_ENV} to read from the Hub.")
        try:
            with gzip.open(path, "rt", encoding="utf-8", newline="") as fh:
                rows = list(csv.DictReader(fh))
        except (EOFError, OSError, zlib.error, UnicodeDecodeError, csv.Error) as e:
            raise DataError(f"{path}: unreadable ({e}); the file is truncated or damaged, restore it") from None
        source = str(path)
    records = check_records(rows, "xstest/prompts", source)
    return [{**r, "id": f"xstest-{r['id']}"} for r in records]


def load_xstest_completions() -> list[dict]:
    """XSTest's 1,800 model completions with their two human labels and the adjudicated
    ``final_label`` (Röttger et al., 2024); local only: the labelled completions are in the
    authors' repository, not on the Hub."""
    root = data_dir()
    if root is None:
        raise DataError(f"XSTest's labelled completions are read from ${DATA_ENV}/xstest/completions.jsonl.gz "
                        f"(shared/data/SOURCES.md says how it was made); set {DATA_ENV} to a folder holding it")
    return read_jsonl(root / "xstest" / "completions.jsonl.gz", SCHEMAS["xstest/completions"])


# Self-Instruct's two sets, and what each may be read for (shared/data/SOURCES.md): the authors ask that the
# user-oriented instructions never be trained on; here they are never calibrated or selected on either.
BENIGN_SETS = {"seed_tasks": ("calibration", "selection"), "user_oriented_instructions": ("evaluation",)}
BENIGN_USES = ("calibration", "selection", "training", "evaluation")


def load_benign_instructions(name: str, use: str = "calibration") -> list[dict]:
    """Self-Instruct's human-written requests (Wang et al., ACL 2023; shared/data/SOURCES.md), local only:
    ``seed_tasks`` (175, which may serve a gate's calibration or a selection) or ``user_oriented_instructions``
    (252, evaluation only). ``use`` says what the caller reads them for; a set asked for a use it may not serve
    (the evaluation set for calibration, selection or training; the seed tasks for training or evaluation) is
    refused with a ``DataError``. Each record keeps its own ``id`` ("seed_task_N", "user_oriented_task_N": no
    split of another dataset holds one) and gains ``prompt``: the instruction, or the instruction, a blank line
    and its first instance's input when that is not empty."""
    if name not in BENIGN_SETS:
        raise ValueError(f"benign_instructions/{name}: choose one of {', '.join(BENIGN_SETS)}")
    if use not in BENIGN_USES:
        raise ValueError(f"use={use!r}: choose one of {', '.join(BENIGN_USES)}")
    if use not in BENIGN_SETS[name]:
        other = next(n for n, uses in BENIGN_SETS.items() if use in uses) if use != "training" else None
        raise DataError(f"benign_instructions/{name} may serve {' or '.join(BENIGN_SETS[name])} only, not {use} "
                        f"(shared/data/SOURCES.md)" + (f"; read {other} for {use}" if other else
                                                       "; no Self-Instruct set is read for training"))
    root = data_dir()
    if root is None:
        raise DataError(f"The benign instructions are read from ${DATA_ENV}/benign_instructions/{name}.jsonl.gz "
                        f"(shared/data/SOURCES.md says how they were made); set {DATA_ENV} to a folder holding them")
    rows = read_jsonl(root / "benign_instructions" / f"{name}.jsonl.gz", SCHEMAS[f"benign_instructions/{name}"])
    out = []
    for r in rows:
        extra = r["instances"][0]["input"].strip()
        out.append({**r, "prompt": r["instruction"].strip() + (f"\n\n{extra}" if extra else "")})
    return out


def load_mmlu(split: str) -> list[dict]:
    rows = _local_or_hub(f"mmlu/{split}.jsonl.gz", "mmlu", ("cais/mmlu", "all", split))
    return _with_content_ids(rows, lambda r: content_id(f"mmlu-{split}-{r['subject']}", r["question"], r["choices"], r["answer"]))


def load_arc(task: str, split: str) -> list[dict]:
    config = ARC_CONFIGS[task]
    return _local_or_hub(f"arc/{config}-{split}.jsonl.gz", "arc", ("allenai/ai2_arc", config, split))


def load_gsm8k(split: str) -> list[dict]:
    rows = _local_or_hub(f"gsm8k/{split}.jsonl.gz", "gsm8k", ("openai/gsm8k", "main", split))
    return _with_content_ids(rows, lambda r: content_id(f"gsm8k-{split}", r["question"]))


def dataset_on_disk(name: str, records: list[dict]):
    """``records`` as a memory-mapped Arrow file under the datasets cache, for tasks with process_docs.

    lm-eval runs a task's process_docs (for BBQ a ``datasets.map`` over every doc, about 5 s
    for the 17,628 docs) each time it asks for the docs, two or three times per task. On an
    in-memory dataset datasets cannot cache that map; on a file-backed one it does, as it does
    for the built-in's Hub download. The file name holds a hash of the content, so changed
    data (or another split seed) get a new file. Falls back to an in-memory dataset when the
    cache folder cannot be written. (The records of harness_tasks/utils.py's BBQ tasks.)
    """
    import datasets  # deferred: only the lm-eval tasks need it
    import pyarrow as pa

    ds = datasets.Dataset.from_list(records)
    if not datasets.is_caching_enabled():
        return ds
    digest = hashlib.sha256(json.dumps(records, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = Path(datasets.config.HF_DATASETS_CACHE) / "mari_eval_harness" / f"{name}-{digest}.arrow"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            table = ds.data.table
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
            os.replace(tmp, path)
        return datasets.Dataset.from_file(str(path))
    except OSError as e:
        log.warning("Could not write %s (%s); using an in-memory dataset (process_docs is then not cached)", path, e)
        return ds


GENERAL_TEXT_PER_SOURCE = 100  # documents from each of MMLU's and ARC-Challenge's test questions
GENERAL_TEXT_MIN_WORDS = 16


def _read_general_text() -> tuple[dict, ...]:
    """General-domain text none of the suite's methods trains or calibrates on (D_ctrl reads MMLU's
    validation and ARC-Easy's train split), for the KL and cross-entropy columns (mari_eval/evaluation/divergence.py):
    question texts of MMLU's and ARC-Challenge's test splits with at least GENERAL_TEXT_MIN_WORDS words,
    the first GENERAL_TEXT_PER_SOURCE of each in the order of their ids' sha256 (all subjects mixed),
    alternating; each cut at its middle word into ``context`` and ``continuation`` (" " + the rest)."""
    def take(rows: list[dict], source: str) -> list[dict]:
        long = [r for r in rows if len(r["question"].split()) >= GENERAL_TEXT_MIN_WORDS]
        long.sort(key=lambda r: hashlib.sha256(r["id"].encode("utf-8")).hexdigest())
        out = []
        for r in long[:GENERAL_TEXT_PER_SOURCE]:
            words = r["question"].split()
            out.append({"id": f"{source}:{r['id']}", "context": " ".join(words[:len(words) // 2]),
                        "continuation": " " + " ".join(words[len(words) // 2:])})
        return out

    mmlu, arc = take(load_mmlu("test"), "mmlu"), take(load_arc("arc_challenge", "test"), "arc_challenge")
    return tuple(doc for pair in zip(mmlu, arc) for doc in pair)


@functools.lru_cache(maxsize=2)
def _general_text_from(folder: str | None) -> tuple[dict, ...]:
    return _read_general_text()


def load_general_text() -> tuple[dict, ...]:
    """``_read_general_text``, read once per data folder ($MARI_DATA_DIR) for the process: a table
    measures every row on the same documents. The dicts are shared: read them, never change them."""
    folder = data_dir()
    return _general_text_from(str(folder) if folder else None)
