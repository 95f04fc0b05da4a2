"""Held-out tasks ordered so that lm-eval's first-N limit spreads over categories (issue 26.2)."""

from collections import Counter

import pytest

from repro.engine.documents import _task_utils


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


def _bbq(category, template, context, n=2):
    return [{"id": f"{category}-{template}-{context}-{q}", "category": category, "question_index": str(template),
             "context": f"context {context}"} for q in range(n)]


def test_bbq_deals_templates_in_turn_and_keeps_each_contexts_questions_adjacent():
    # Category A: template 1 with 3 contexts, template 2 with 1, in file order; category B: one template.
    records = (_bbq("A", 1, "a") + _bbq("A", 1, "b") + _bbq("A", 1, "c") + _bbq("A", 2, "d")
               + _bbq("B", 3, "e") + _bbq("B", 3, "f"))
    spread = _task_utils().spread_bbq(records, seed=0)
    assert sorted(r["id"] for r in spread) == sorted(r["id"] for r in records)
    assert [r["category"] for r in spread] == list("ABABABABAAAA")  # round-robin over the categories
    a = [r for r in spread if r["category"] == "A"]
    assert all(a[k]["context"] == a[k + 1]["context"] for k in range(0, len(a), 2))  # both questions adjacent
    assert {a[0]["question_index"], a[2]["question_index"]} == {"1", "2"}  # each template before a second context
    assert [r["id"] for r in a if r["context"] == "context a"] == ["A-1-a-0", "A-1-a-1"]  # file order within one


@pytest.mark.needs_data
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name, per_category, templates_expected", [("standard", 72, 6 * 25 + 36), ("quick", 16, 7 * 8)])
def test_a_profiles_bbq_documents_spread_over_templates_and_whole_contexts(seed, name, per_category, templates_expected):
    from mari_eval.benchmarks import data, data_splits
    from repro.engine.profiles import PROFILES

    n = PROFILES[name].limits["bbq_disambig_heldout"]
    docs = _task_utils().load_bbq_disambig_heldout(split_seed=seed)["test"].to_list()
    assert sorted(d["id"] for d in docs) == sorted(data_splits.make_splits("bbq", seed).test)  # the same set, reordered
    first = docs[:n]
    contexts = Counter(data.bbq_context_key(d) for d in first)
    templates = {data.bbq_template_key(d) for d in first}
    categories = Counter(d["category"] for d in first)
    # File order gave 33 templates and 308 contexts, 196 of them whole. Now, in the standard profile,
    # 36 whole contexts per category: all 25 templates of six categories and 36 of Gender_identity's
    # 50; in the quick profile 8 whole contexts per category, each from its own template.
    assert n == 7 * per_category and set(categories.values()) == {per_category} and len(categories) == 7
    assert len(contexts) == n // 2 and set(contexts.values()) == {2}
    assert len(templates) == templates_expected
