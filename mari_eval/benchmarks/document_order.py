"""The order of held-out documents: dealt across categories (and for BBQ templates and whole
contexts), so that lm-eval's ``--limit N``, which takes the first N documents, draws a spread
sample instead of the first categories of a file. A run over all documents scores the same
documents in either order (harness_tasks/utils.py's loaders use these)."""

from __future__ import annotations

from mari_eval.benchmarks.data import bbq_context_key, bbq_template_key
from mari_eval.benchmarks.data_splits import seeded_order


def spread_over_categories(records: list[dict]) -> list[dict]:
    """``records`` dealt round-robin by ``category`` (categories in order of first appearance,
    each category's records in their own order): the same documents, ordered so that lm-eval's
    ``--limit N`` (the first N documents) spreads N evenly over the categories instead of
    taking the first one or two. A run over all documents scores exactly the same."""
    by_category: dict[str, list[dict]] = {}
    for record in records:
        by_category.setdefault(str(record["category"]), []).append(record)
    queues = list(by_category.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def spread_bbq(records: list[dict], seed: int) -> list[dict]:
    """BBQ ``records`` ordered so that the first N documents spread over categories, templates and
    whole contexts: within each category, the templates (``bbq_template_key``) in a seeded order
    take turns, each giving its next context (``bbq_context_key``; a template's contexts in a
    seeded order) with its questions adjacent, in file order; the categories are then dealt
    round-robin (``spread_over_categories``). So a first N even per category holds whole
    contexts only, and covers every template of a category before any gives a second context.
    The same documents: a run over all of them scores exactly the same."""
    by_category: dict[str, dict[str, dict[str, list[dict]]]] = {}
    for r in records:
        templates = by_category.setdefault(str(r["category"]), {})
        templates.setdefault(bbq_template_key(r), {}).setdefault(bbq_context_key(r), []).append(r)
    dealt: list[dict] = []
    for templates in by_category.values():
        queues = [[contexts[c] for c in seeded_order(contexts, "bbq-spread-context", seed)]
                  for contexts in (templates[t] for t in seeded_order(templates, "bbq-spread-template", seed))]
        dealt += [r for i in range(max(map(len, queues))) for q in queues if i < len(q) for r in q[i]]
    return spread_over_categories(dealt)
