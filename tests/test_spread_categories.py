"""Held-out tasks ordered so that lm-eval's first-N limit spreads over categories (issue 26.2)."""

from collections import Counter

import pytest

from repro.documents import _task_utils


def test_round_robin_keeps_every_record_and_each_categorys_order():
    records = [{"category": c, "i": i} for i, c in enumerate("AAAABBC")]
    spread = _task_utils().spread_over_categories(records)
    assert [r["category"] for r in spread] == list("ABCABAA")
    assert sorted(r["i"] for r in spread) == list(range(7))
    assert [r["i"] for r in spread if r["category"] == "A"] == [0, 1, 2, 3]


@pytest.mark.needs_data
def test_the_first_documents_of_bbq_disambig_heldout_cover_every_category():
    docs = _task_utils().load_bbq_disambig_heldout(split_seed=0)["test"]
    categories = Counter(docs["category"])
    first = Counter(docs["category"][: 10 * len(categories)])
    assert len(categories) >= 7 and set(first) == set(categories)
    assert max(first.values()) - min(first.values()) <= 1 or min(categories.values()) < 10
