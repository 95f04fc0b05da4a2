"""Columns an LLM judge reads (SORRY-Bench's refusal rate): the judge is part of each evaluation's
identity, and its unparseable verdicts are counted, never silently dropped.

An evaluation of a judged task is cached under the judge's model, prompt and parser version
(``mari_eval.judge.judge_identity``, in repro/engine/cache.py's key): a table rerun with another judge
judges again. A document whose verdict the parser could not read has no score (None) in the
per-document file; a judged cell prints how many there were beside n, and a cell with fewer
than MIN_PARSED of its verdicts parsed is n/a with the count: its rate would rest on the few
replies the judge happened to format.

A judged cell is printed only when its judge agrees with people well enough: its held-out Cohen's
kappa against XSTest's human labels (results/judge_agreement.json, ``held_out``: the judge's
threshold, if any, chosen on the other half) must reach ``KAPPA_FLOOR`` (0.6, the lower edge of
Landis & Koch's 1977 "substantial" agreement; mari_eval/judge/calibration.py); else the cell is n/a
with the kappa ("not measured" for a judge that file never scored), and neither it nor a difference
from it is printed.

A table with refusal columns also says how well each of their judges agrees with people
(``agreement_record``): the keyword judge's and the LLM judge's accuracy and Cohen's kappa against
XSTest's human labels, as results/judge_agreement.json measured them (python repro/judge_agreement.py).
"""

from __future__ import annotations

import json
from typing import Any

from mari_eval.judge.calibration import KAPPA_FLOOR, kappa_reaches_floor
from mari_eval.judge.samples import described_label, readable_label
from repro.engine.profiles import KEYWORD_REFUSAL, REPO, XSTEST

JUDGED_TASK_PREFIX = "sorry_bench"  # harness_tasks/sorry_bench*.yaml: refusal_rate by the LLM judge
JUDGED_METRICS = ("refusal_rate,none",)  # their judged metric (keyword_refusal_rate needs no judge)
MIN_PARSED = 0.9  # the floor: a judged cell needs this fraction of its verdicts parsed
# Columns the keyword judge reads (mari_eval.judge.prompt.keyword_refusal): SORRY-Bench's keyword rate, XSTest's
KEYWORD_COLUMNS = (KEYWORD_REFUSAL[0], *(column[0] for column in XSTEST))
AGREEMENT = "results/judge_agreement.json"  # the judges against people: python repro/judge_agreement.py --llm
AGREEMENT_READING = "partial-is-refusal"  # its default reading of a partial refusal, the one the columns use


def judged_task(task: str) -> bool:
    """Whether ``task``'s evaluation calls the LLM judge (its verdicts then depend on which)."""
    return task.startswith(JUDGED_TASK_PREFIX)


def judged_column(task: str, metric: str) -> bool:
    return judged_task(task) and metric in JUDGED_METRICS


def verdict_counts(cell: dict) -> tuple[int, int] | None:
    """(verdicts parsed, verdicts in all) of a judged cell over its seeds, or None without its
    per-document scores."""
    documents = cell.get("documents") or []
    if not documents or not all(documents):
        return None
    total = sum(len(d) for d in documents)
    return total - sum(v is None for d in documents for v in d.values()), total


def below_floor(counts: tuple[int, int] | None) -> bool:
    return counts is not None and counts[0] < MIN_PARSED * counts[1]


def counts_text(counts: tuple[int, int]) -> str:
    """"58 of 60 verdicts parsed": what a judged cell's n rests on."""
    return f"{counts[0]} of {counts[1]} verdicts parsed"


def cell_text(cell: dict, text: str, n_text: str) -> str:
    """A table cell: ``text`` and ``n_text`` ("(n=60)"), for a judged cell with its parsed verdicts
    ("(n=60; 58 of 60 verdicts parsed)"), or n/a with them below the floor, or n/a with its judge's
    held-out kappa below ``KAPPA_FLOOR``."""
    counts = cell.get("verdicts")
    if "judge_kappa" in cell and not kappa_reaches_floor(cell["judge_kappa"]):
        return f"n/a ({kappa_text(cell['judge_kappa'])})"
    if counts is None:
        return f"{text} {n_text}"
    if below_floor(counts):
        return f"n/a ({counts_text(counts)})"
    return f"{text} {n_text[:-1]}; {counts_text(counts)})"


def kappa_text(kappa: float | None) -> str:
    """Why a judged cell is n/a for its judge: "judge's held-out kappa 0.214 < 0.6", "... not measured" or
    "... undefined" (measured, but no verdict of the judge was read)."""
    if kappa is None:
        return f"judge's held-out kappa not measured, floor {KAPPA_FLOOR}"
    if kappa != kappa:
        return f"judge's held-out kappa undefined: no verdict read, floor {KAPPA_FLOOR}"
    return f"judge's held-out kappa {kappa:.3f} < {KAPPA_FLOOR}"


def _kappa_word(kappa: float | None) -> str:
    return "not measured" if kappa is None else "undefined (no verdict read)" if kappa != kappa else f"{kappa:.3f}"


def _agreement() -> dict:
    """results/judge_agreement.json ({} when it is missing)."""
    path = REPO / AGREEMENT
    return json.loads(path.read_text()) if path.is_file() else {}


def held_out_kappa(record: dict, label: str) -> float | None:
    """The held-out kappa (all completions) of the judge labelled ``label`` in a judge_agreement record
    (its ``held_out`` judges); None when it was not measured there, NaN when it is undefined there (no
    verdict of the judge was read, or one label throughout)."""
    for entry in ((record.get("held_out") or {}).get("judges") or {}).values():
        if entry.get("label") and readable_label(entry["label"]) == readable_label(label):
            kappa = entry["subsets"]["all"]["kappa"]
            return float("nan") if kappa is None or kappa != kappa else float(kappa)
    return None


def cell_kappa(cell: dict, measured: dict) -> float | None:
    """The held-out kappa of a judged cell's judge (the lowest, if its seeds name several; None if any
    was not measured, NaN if any is undefined)."""
    kappas = [held_out_kappa(measured, readable_label(judge)) if judge else None for judge in cell.get("judge") or [None]]
    if any(k is None for k in kappas):
        return None
    return float("nan") if any(k != k for k in kappas) else min(kappas)


def judge_record(cells: dict) -> dict[str, Any] | None:
    """{"columns", "judges", "min_parsed"} for a table's JSON and header: which columns a judge read
    and the judges their evaluations recorded (``mari_eval.judge.samples.judge_label``: model and
    prompt with its sha256; "not recorded" for an evaluation stored before they were)."""
    judged = [(column, cell) for rows in cells.values() for by_column in rows.values()
              for column, cell in by_column.items() if cell.get("judged")]
    if not judged:
        return None
    present = sorted({column for column, _ in judged})
    judges = sorted({readable_label(judge) if judge else "not recorded"
                     for _, cell in judged for judge in cell.get("judge") or [None]})
    measured = _agreement()
    kappas = {judge: held_out_kappa(measured, judge) for judge in judges}
    return {"columns": present, "judges": judges, "min_parsed": MIN_PARSED, "kappa_floor": KAPPA_FLOOR,
            "held_out_kappa": kappas}


def judge_sentence(record: dict[str, Any]) -> str:
    """The table header's line on its judge."""
    kappas = record.get("held_out_kappa") or {}
    floor = record.get("kappa_floor")
    rule = ("" if floor is None else
            f" A judged cell is printed only when its judge's held-out Cohen's kappa against people (XSTest, "
            f"{AGREEMENT}) reaches {floor} (Landis & Koch's 'substantial', 0.61-0.80), else n/a with the kappa: "
            + "; ".join(f"{judge}: {_kappa_word(k)}" for judge, k in kappas.items()) + ".")
    return (f" Judged columns ({', '.join(record['columns'])}): read by {'; '.join(record['judges'])}; a verdict the "
            f"parser cannot read has no score, the count of parsed verdicts stands beside n, and a cell with fewer "
            f"than {record['min_parsed']:.0%} of them parsed is n/a (repro/engine/judged.py).{rule}")


def withhold_below_floor(cells: dict) -> dict:
    """``cells`` (repro.analysis.tables.tally's) with every judged cell's verdict counts recorded ("verdicts":
    parsed, in all) and a cell below the floor withheld: its figures NaN and its documents dropped,
    so that neither it nor a difference from it is printed (n/a with the count instead); likewise a
    judged cell whose judge's held-out kappa does not reach ``KAPPA_FLOOR`` ("judge_kappa": n/a with it)."""
    measured = _agreement()
    out = {}
    for model, rows in cells.items():
        out[model] = {}
        for label, by_column in rows.items():
            out[model][label] = dict(by_column)
            for column, cell in by_column.items():
                if not cell.get("judged"):
                    continue
                counts = verdict_counts(cell) or cell.get("verdicts")  # rerendered: as its JSON recorded them
                cell = {**cell, "verdicts": counts, "judge_kappa": cell_kappa(cell, measured)}
                if below_floor(counts) or not kappa_reaches_floor(cell["judge_kappa"]):
                    cell.update(values=[float("nan")] * len(cell["values"]), documents=[None] * len(cell["values"]),
                                clusters=[None] * len(cell["values"]))
                out[model][label][column] = cell
    return out


def agreement_record(columns: list[str], judge: dict[str, Any] | None) -> dict[str, Any] | None:
    """How each refusal judge of a table agrees with people: {"source", "command", "reading", "judges":
    {name: its overall accuracy and kappa with intervals, n and unparseable, or None where not measured}}
    for the keyword judge (when a column in KEYWORD_COLUMNS is shown) and each LLM judge of
    ``judge_record`` (measured only if results/judge_agreement.json scored that model with that prompt).
    None for a table without refusal columns."""
    keyword = any(column.split("@")[0] in KEYWORD_COLUMNS for column in columns)
    if not keyword and not judge:
        return None
    path = REPO / AGREEMENT
    measured = json.loads(path.read_text()) if path.is_file() else None
    scored = (measured or {}).get("readings", {}).get(AGREEMENT_READING, {})

    def overall(name: str) -> dict[str, Any] | None:
        found = (scored.get(name) or {}).get("all")
        return None if found is None else {k: found[k] for k in ("n", "unparseable", "accuracy", "accuracy_ci",
                                                                 "kappa", "kappa_ci")}

    judges: dict[str, Any] = {"keyword": overall("keyword")} if keyword else {}
    llm = (measured or {}).get("llm_judge") or {}
    measured_label = llm and described_label(llm)
    for label in (judge or {}).get("judges", []):
        judges[label] = overall("llm") if label == measured_label else None
    return {"source": AGREEMENT if measured else None, "command": (measured or {}).get("command"),
            "reading": AGREEMENT_READING, "judges": judges}


def agreement_sentence(record: dict[str, Any]) -> str:
    """The table header's line on how its refusal judges agree with people."""
    if record["source"] is None:
        return (f" The refusal judges' agreement with people is not measured here ({AGREEMENT} is missing: "
                "python repro/judge_agreement.py --llm writes it).")

    def text(name: str, found: dict[str, Any] | None) -> str:
        if found is None:
            return f"{name}: not measured (python repro/judge_agreement.py --llm with this judge measures it)"
        if found["kappa"] is None:
            return f"{name}: no figure ({found['unparseable']} of {found['n'] + found['unparseable']} verdicts unparseable)"
        return (f"{name}: Cohen's kappa {found['kappa']:.3f} [{found['kappa_ci'][0]:.3f}, {found['kappa_ci'][1]:.3f}], "
                f"accuracy {found['accuracy']:.3f} (n={found['n']})")

    names = {"keyword": "the keyword judge (sorry_keyword, xstest_*)"}
    return (f" Refusal judges against people (XSTest's human-labelled completions, partial refusals counted as refusals; "
            f"{record['source']}, `{record['command']}`): "
            + "; ".join(text(names.get(name, f"the LLM judge {name}"), found) for name, found in record["judges"].items())
            + ".")

