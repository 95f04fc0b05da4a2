"""Seeds as the unit of training variance: each seed's difference and a seed-level interval.

    python -m repro.seed_level results/main_table      # writes results/main_table_seeds.{json,md}

A table's paired difference (repro/analysis/intervals.py) pools the documents of every seed as if the
trained bundles were fixed: its interval and test answer "these bundles against the reference
on these documents", conditional on the training runs. A claim about a *method* must also carry
the variation between training runs, and each seed trains its own bundles on its own split. For
every difference of a table whose cells have two seeds or more, read from its per-document file
(results/NAME_documents.parquet), this prints and records:

* each seed's difference d_s (the row minus the reference on that seed's shared documents) and
  their mean D (the table's difference) and standard deviation;
* the seed-level t interval D +- t_{S-1} sd(d_s) / sqrt(S) and the one-sample t test of mean
  zero over the S seed differences (Student, 1908): seeds are the units, documents only make
  each d_s; with 3 seeds it has 2 degrees of freedom, so it is wide by construction;
* a hierarchical bootstrap interval (seeds then documents): S seeds drawn with replacement,
  then each drawn seed's paired documents (BBQ: contexts) drawn with replacement, D recomputed
  (``intervals.ITERATIONS`` draws, seed ``intervals.SEED``; Davison & Hinkley, *Bootstrap Methods*,
  1997, sec. 3.8, two-stage sampling). With 3 seeds its seed stage has 10 distinct outcomes, and
  it understates between-seed spread (a draw of three seeds reuses one seed about 7 times in 9);
  the t interval is the one to read, except where every seed gave the same difference: the t
  statistic is then D / 0, no test (a p of 0 would claim certainty from three equal counts), and
  the t interval and p are "undefined" (null), left out of Holm's family; the hierarchical
  interval is then the seed-level figure. Holm's adjustment runs over the t tests of each family (the
  differences from the reference row; the table's other comparisons), as the table's own do.
* beside them, the table's own conditional interval and p, labelled as such.

Columns scored under one seed get no seed-level figure (said in the output). Before computing, the
per-document file is checked against the table's JSON (rows, columns, seeds and the digest the JSON
records: repro/analysis/documents_check.py); another table's file, or one with a seed's rows dropped,
is refused naming both files.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from scipy import stats

from repro.analysis import intervals
from repro.analysis.documents_check import checked_table
from repro.analysis.documents_file import SUFFIX, shown_path, table_command_line
from repro.engine.profiles import REPO
from repro.analysis.report_page import write_readings
from repro.analysis.tables import markdown_table, p_text, write_record


def _paired(mine: dict, theirs: dict, clusters: dict | None) -> list[np.ndarray]:
    """Per unit (a document, or a cluster of them), the row-minus-reference differences of its documents."""
    shared = sorted(k for k in set(mine) & set(theirs) if mine[k] is not None and theirs[k] is not None)
    units: dict = {}
    for k in shared:
        units.setdefault(clusters.get(k, k) if clusters else k, []).append(mine[k] - theirs[k])
    return [np.array(v) for v in units.values()]


def t_figures(per_seed: list[float]) -> dict:
    """The seeds' differences as units: their mean, standard deviation and count, the t interval and the
    two-sided one-sample t test of mean zero (S - 1 degrees of freedom); ``t_ci`` and ``t_p`` None where every
    seed gave the same difference (t is D / 0, or 0 / 0: not a test)."""
    mean, spread, count = float(np.mean(per_seed)), float(np.std(per_seed, ddof=1)), len(per_seed)
    t_ci, p = None, None
    if spread > 1e-12 * max(1.0, abs(mean)):  # not float noise between equal counts
        half = stats.t.ppf(1 - (1 - intervals.LEVEL) / 2, count - 1) * spread / math.sqrt(count)
        t_ci, p = [mean - half, mean + half], float(2 * stats.t.sf(abs(mean) / (spread / math.sqrt(count)), count - 1))
    return {"mean": mean, "std": spread, "seeds": count, "t_ci": t_ci, "t_p": p}


def seed_level(row: dict, reference: dict, iterations: int = intervals.ITERATIONS, seed: int = intervals.SEED) -> dict | None:
    """The seed-level figures of ``row`` minus ``reference`` (cells as ``read_documents`` gives them);
    None when they share fewer than two seeds."""
    strata = []
    for s, (mine, theirs) in enumerate(zip(row["documents"], reference["documents"])):
        clusters = {**(reference.get("clusters") or [{}] * (s + 1))[s], **(row.get("clusters") or [{}] * (s + 1))[s]}
        units = _paired(mine, theirs, clusters)
        if units:
            strata.append(units)
    if len(strata) < 2:
        return None
    per_seed = [float(np.concatenate(units).mean()) for units in strata]
    figures = t_figures(per_seed)
    count = figures["seeds"]
    rng = np.random.default_rng(seed)
    draws = np.empty(iterations)
    sums = [np.array([u.sum() for u in units]) for units in strata]
    sizes = [np.array([u.size for u in units]) for units in strata]
    for i in range(iterations):
        means = []
        for s in rng.integers(0, count, size=count):
            pick = rng.integers(0, len(sums[s]), size=len(sums[s]))
            means.append(sums[s][pick].sum() / sizes[s][pick].sum())
        draws[i] = np.mean(means)
    tail = (1 - intervals.LEVEL) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return {"per_seed": per_seed, **figures, "hierarchical_ci": [float(low), float(high)]}


def analyse(table: Path) -> dict:
    """{"command", "table", "models": {model: [{"row", "against", "column", seed-level figures, "conditional"}]},
    "one_seed_columns"}, from the table's files once they agree (``checked_table``)."""
    record, _, (cells, references, columns) = checked_table(table)
    shown = shown_path(table, REPO)
    out = {"command": f"python -m repro.seed_level {shown}", "table": table.name,
           "table_command": record.get("command"), "iterations": intervals.ITERATIONS, "seed": intervals.SEED,
           "level": intervals.LEVEL, "models": {}}
    for model, entry in record["models"].items():
        rows, reference = cells.get(model, {}), references.get(model)
        found = out["models"][model] = []
        pairs = [(r["row"], reference, {c: v.get("difference") for c, v in r["ours"].items()})
                 for r in entry["rows"] if r["row"] != reference]
        pairs += [(c["row"], c["against"], c["columns"]) for c in entry.get("comparisons", [])]
        for label, against, conditional in pairs:
            for column in columns:
                mine, theirs = rows.get(label, {}).get(column), rows.get(against, {}).get(column)
                if mine is None or theirs is None:
                    continue
                figures = seed_level(mine, theirs)
                if figures is None:
                    continue
                given = conditional.get(column) or {}
                found.append({"row": label, "against": against, "column": column, **figures,
                              "conditional": {"ci": given.get("ci"), "p": given.get("p"), "p_bound": given.get("p_bound"),
                                              "test": given.get("test")}})
        adjust(found, reference)
    multi = {f["column"] for found in out["models"].values() for f in found}
    out["one_seed_columns"] = [c for c in columns if c not in multi]
    return out


def adjust(found: list[dict], reference: str | None) -> None:
    """Each difference's ``t_p_holm``: Holm over each family, as the table's own tests (the differences
    from ``reference``; the other comparisons); an undefined t test is not in its family (None)."""
    for family in {f["against"] == reference for f in found}:
        members = [f for f in found if (f["against"] == reference) == family]
        tested = [f for f in members if f["t_p"] is not None]
        for f in members:
            f["t_p_holm"] = None
        for f, adjusted in zip(tested, intervals.holm([f["t_p"] for f in tested])):
            f["t_p_holm"] = adjusted


def markdown(result: dict, one_seed: list[str]) -> str:
    lines = [f"# {result['table']}: seeds as the unit of training variance\n",
             f"Generated by `{result['command']}` from {result['table']}{SUFFIX} (the table: "
             f"`{result['table_command']}`). Each seed trains its own bundles on its own split; d_s is a row minus "
             "the row it is compared with on seed s's documents. Seed-level: the t interval and test over the "
             f"seeds' differences (S - 1 degrees of freedom) and a {result['level']:.0%} hierarchical bootstrap "
             f"(seeds, then documents or BBQ contexts; {result['iterations']} draws, seed {result['seed']}; "
             "repro/seed_level.py). Conditional: the table's own interval and p, which pool the documents of "
             "every seed as if the trained bundles were fixed.\n"]
    if one_seed:
        lines.append(f"Columns under one seed (no seed-level figure): {', '.join(one_seed)}.\n")
    for model, found in result["models"].items():
        lines.append(f"\n## {model}\n")
        lines.append(markdown_table(
            ["rows", "column", "per seed", "mean (std)", "seed-level t 95%", "t p (Holm)", "hierarchical 95%",
             "conditional 95%", "conditional p"],
            [[f"{f['row']} - {f['against']}", f["column"], " / ".join(f"{d:+.2f}" for d in f["per_seed"]),
              f"{f['mean']:+.2f} ({f['std']:.2f})",
              *(["undefined (no spread)", "undefined"] if f["t_p"] is None else
                [f"[{f['t_ci'][0]:.2f}, {f['t_ci'][1]:.2f}]", f"{f['t_p']:.3f} ({f['t_p_holm']:.3f})"]),
              f"[{f['hierarchical_ci'][0]:.2f}, {f['hierarchical_ci'][1]:.2f}]",
              "n/a" if not f["conditional"]["ci"] else f"[{f['conditional']['ci'][0]:.2f}, {f['conditional']['ci'][1]:.2f}]",
              "n/a" if f["conditional"]["p"] is None else p_text(f["conditional"]["p"], bool(f["conditional"]["p_bound"]))]
             for f in found]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    table = table_command_line(__doc__, argv)
    result = analyse(table)
    write_record(table.parent / f"{table.name}_seeds", result, markdown(result, result["one_seed_columns"]))
    write_readings(table)  # the summary's cells are these figures; results/index.html (repro/report.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
