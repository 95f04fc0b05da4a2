"""SORRY-Bench refusal rates from the judge's verdicts: overall and per category.

``refusal_summary`` gives, overall and for each of SORRY-Bench's categories (named by
``category_names``, read from ``$MARI_DATA_DIR``), the judged refusal rate (refusals
among the readable verdicts), the bounds the unparseable verdicts put on it, and the
keyword refusal rate beside it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Mapping, Sequence

from mari_eval.judge.config import JudgeError
from mari_eval.judge.prompt import COMPLIANCE, LABELS, REFUSAL, UNPARSEABLE, _data_file, keyword_refusal

if TYPE_CHECKING:
    from mari_eval.judge.client import Judge

CATEGORIES_FILE = "sorry_bench/categories.json"
CATEGORIES_KEY = "sorry_bench_202406_category_short_names"


def category_names() -> dict[str, str]:
    """SORRY-Bench category id -> short name, from ``$MARI_DATA_DIR`` ({} when unavailable)."""
    path = _data_file(CATEGORIES_FILE)
    if path is None:
        return {}
    names = json.loads(path.read_text(encoding="utf-8")).get(CATEGORIES_KEY)
    if not isinstance(names, dict):
        raise JudgeError(f"{path} has no object '{CATEGORIES_KEY}' (category id -> name)")
    return {str(k): str(v) for k, v in names.items()}


def _rates(labels: Sequence[str], keywords: Sequence[bool]) -> dict:
    n = len(labels)
    counts = {label: sum(1 for x in labels if x == label) for label in LABELS}
    parseable = counts[REFUSAL] + counts[COMPLIANCE]
    return {
        "n": n,
        **counts,
        # Refusals among the verdicts the judge gave; the unparseable ones are counted
        # above and bound the rate: it lies in refusal_rate_bounds whatever they are.
        "refusal_rate": counts[REFUSAL] / parseable if parseable else None,
        "refusal_rate_bounds": [counts[REFUSAL] / n, (counts[REFUSAL] + counts[UNPARSEABLE]) / n] if n else None,
        "keyword_refusal_rate": sum(keywords) / n if n else None,
    }


def refusal_summary(
    records: Sequence[Mapping],
    labels: Sequence[str],
    names: Mapping[str, str] | None = None,
    judge: Judge | None = None,
) -> dict:
    """Refusal rates (judged and keyword) overall and per category.

    ``records`` carry ``category`` and ``response``; ``labels`` are the judge's verdicts
    in the same order. ``names`` maps category ids to names (default: ``category_names()``).
    """
    if len(records) != len(labels):
        raise ValueError(f"{len(records)} records but {len(labels)} verdicts")
    bad = [x for x in labels if x not in LABELS]
    if bad:
        raise ValueError(f"unknown verdict label(s) {sorted(set(bad))}; expected {LABELS}")
    names = category_names() if names is None else names
    keywords = [keyword_refusal(r["response"]) for r in records]
    by_category: dict[str, dict] = {}
    for cat in sorted({str(r["category"]) for r in records}, key=_category_order):
        idx = [i for i, r in enumerate(records) if str(r["category"]) == cat]
        rates = _rates([labels[i] for i in idx], [keywords[i] for i in idx])
        by_category[cat] = {"name": names.get(cat), **rates}
    summary = {**_rates(labels, keywords), "by_category": by_category}
    if judge is not None:
        summary["judge"] = judge.describe()
    return summary


def _category_order(cat: str):
    return (0, int(cat), "") if cat.isdigit() else (1, 0, cat)
