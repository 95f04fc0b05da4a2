"""A table's paired differences: each row against the reference row (``reference_differences``) or
named pairs of rows (``comparisons_json``), per column, on the documents both scored, as JSON, with
Holm's adjustment over each family of tests (repro/analysis/intervals.py computes each test). Monte Carlo p
values whose decision is not yet stable are drawn again with more sign vectors (``paired_family``).
"""

from __future__ import annotations

from repro.analysis import intervals
from repro.analysis.documents_file import cell_clusters, cell_documents
from repro.engine.profiles import PERCENT_COLUMNS, continuous_column


def _pair_clusters(mine: dict, theirs: dict) -> list | None:
    """The clusters of a row and of its reference, one per seed: a document in one cluster in both."""
    a, b = cell_clusters(mine), cell_clusters(theirs)
    if a is None and b is None:
        return None
    if a is None or b is None:
        raise ValueError("a clustered cell paired with an unclustered one")
    for x, y in zip(a, b):
        if any(y.get(doc, c) != c for doc, c in x.items()):
            raise ValueError("a document in different clusters in a row and its reference")
    return [{**y, **x} for x, y in zip(a, b)]


def reference_differences(rows: dict, columns: list[str], reference: str | None) -> dict[tuple[str, str], dict]:
    """{(row label, column): the paired difference from ``reference`` as JSON}, with Holm's
    adjustment over every test of the table (one model)."""
    if reference not in rows:
        return {}
    return {(label, column): d for (label, _, column), d in
            paired_family(rows, columns, [(label, reference) for label in rows if label != reference]).items()}


def paired_family(rows: dict, columns: list[str], pairs: list[tuple[str, str]]) -> dict[tuple[str, str, str], dict]:
    """{(row, against, column): ``row`` minus ``against`` on the documents both scored, as JSON}
    for every pair in ``pairs`` and column where both have documents, with Holm's adjustment
    over all of them (one family of tests)."""
    found: dict[tuple[str, str, str], tuple[intervals.Difference, str | None]] = {}

    def test(key: tuple[str, str, str], draws: int | None = None) -> intervals.Difference | None:
        mine, theirs = rows[key[0]].get(key[2], {}), rows[key[1]].get(key[2], {})
        if cell_documents(mine) is None or cell_documents(theirs) is None:
            return None
        return intervals.paired(cell_documents(mine), cell_documents(theirs), _pair_clusters(mine, theirs), draws=draws,
                                unit=100.0 if key[2] in PERCENT_COLUMNS else 1.0, continuous=continuous_column(key[2]))

    for label, against in pairs:
        if label not in rows or against not in rows:
            continue
        for column in columns:
            difference = test((label, against, column))
            if difference is not None:
                found[label, against, column] = difference, rows[label][column].get("cluster_unit")
    while True:  # Monte Carlo p values drawn again where a decision is within STABLE_SE standard errors of its line
        ps = [d.p for d, _ in found.values()]
        unstable = [key for (key, (d, _)), line in zip(found.items(), intervals.holm_thresholds(ps))
                    if d.draws is not None and not d.p_bound and d.draws < intervals.MAX_PERMUTATIONS
                    and min(abs(d.p - line), abs(d.p - intervals.ALPHA)) < intervals.STABLE_SE * intervals.monte_carlo_se(d.p, d.draws)]
        if not unstable:
            break
        for key in unstable:
            found[key] = test(key, 10 * found[key][0].draws), found[key][1]
    adjusted = dict(zip(found, intervals.holm([d.p for d, _ in found.values()])))
    return {key: {"reference": key[1], "mean": d.mean, "ci": [d.interval.low, d.interval.high], "p": d.p,
                  "p_bound": d.p_bound, "p_holm": adjusted[key], "test": d.test, "draws": d.draws,
                  "p_mc_se": intervals.monte_carlo_se(d.p, d.draws) if d.draws else None, "pairs": d.pairs,
                  "clusters": d.clusters, "cluster_unit": unit if d.clusters is not None else None,
                  "discordant": list(d.discordant) if d.discordant else None, "interval_agrees": d.interval_agrees,
                  "significant": d.p < intervals.ALPHA, "significant_holm": adjusted[key] < intervals.ALPHA}
            for key, (d, unit) in found.items()}


def comparisons_json(rows: dict, columns: list[str], pairs: list[tuple[str, str]]) -> list[dict]:
    """The table's extra paired comparisons between rows (``write_tables(comparisons=...)``), as
    JSON: one entry per pair, {"row", "against", "columns": {column: difference}}."""
    family = paired_family(rows, columns, pairs)
    return [{"row": label, "against": against,
             "columns": {c: family[label, against, c] for c in columns if (label, against, c) in family}}
            for label, against in pairs if label in rows and against in rows]
