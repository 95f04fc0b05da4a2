"""The primary family: the small set of seed-level tests, fixed in repro/primary_family.json before the
numbers it tests, on which every reading of a method's effect rests (issue 81.6).

    python -m repro.primary_family results/profiles/budget/main_table   # writes ..._primary.{json,md}
    python -m repro.primary_family --power --seeds 3,5                  # its size and what it can detect

A table holds hundreds of differences; Holm over all of them (123 in the budget main table's Vanilla
family) needs |t| > 49.6 at 2 degrees of freedom, so "nothing survives" says more about the family's size
than about the methods. This family is small and named in advance: MARI against Vanilla and against each
other row on one primary column per attribute, and each row's out-of-source cost against Vanilla. Each
member is tested at the seed level (repro/seed_level.py: the one-sample t over the seeds' differences),
and Holm runs over these members alone.

Power (``detectable``): the smallest true mean difference, in units of the between-seed standard
deviation of the differences (sigma_d), that a two-sided t test with S - 1 degrees of freedom rejects with
probability ``POWER`` at level alpha / m (Holm's first, strictest step) and at alpha (its last), from the
noncentral t distribution (noncentrality delta sqrt(S); e.g. Cohen, *Statistical Power Analysis*, 1988, ch. 2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import optimize, stats

from mari_eval.storage.numbers import NumberError, read_number
from repro.analysis import intervals
from repro.analysis.documents_check import checked_table
from repro.analysis.documents_file import shown_path, table_argument
from repro.analysis.report_page import write_readings
from repro.analysis.summary import FAMILY_SPEC, judged_sorry
from repro.analysis.tables import markdown_table, write_record
from repro.engine.profiles import REPO
from repro.seed_level import seed_level, t_figures

FAMILY_FILE = FAMILY_SPEC
POWER = 0.8


@dataclass(frozen=True)
class Member:
    """One test of the family: ``row`` minus ``against`` on ``columns`` (their per-seed differences averaged
    when there are several), named ``label``."""

    kind: str  # "effect" or "cost"
    label: str
    row: str
    against: str
    columns: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    members: tuple[Member, ...]
    alpha: float
    method: str
    reference: str
    sorry_fallback: str

    @property
    def size(self) -> int:
        return len(self.members)


def load_family(path: Path = FAMILY_FILE, sorry_column: str | None = None) -> Family:
    """The family of ``path``, its SORRY-Bench primary column resolved (``sorry_column``, else
    ``summary.judged_sorry``); refuses a file whose members do not add up to its stated size."""
    spec = json.loads(path.read_text())
    method, reference, rows = spec["method"], spec["reference"], spec["rows"]
    primary = {attribute: entry["column"] for attribute, entry in spec["primary"].items()}
    primary["sorry_bench"] = sorry_column or judged_sorry(spec)[0]
    members = [Member("effect", f"{method} - {against}: {column}", method, against, (column,))
               for against in [reference, *rows] for column in primary.values()]
    for name, cost in spec["costs"].items():
        if cost["combine"] != "mean":
            raise ValueError(f"{path}: cost {name} combines by {cost['combine']!r}; only 'mean' is defined")
        members += [Member("cost", f"{row} - {reference}: {name}", row, reference, tuple(cost["columns"]))
                    for row in [method, *rows]]
    if len(members) != spec["size"]:
        raise ValueError(f"{path} states a family of {spec['size']} tests but names {len(members)}: correct 'size' "
                         "in the same commit that changes the members, and say why there")
    return Family(tuple(members), float(spec["alpha"]), method, reference, spec["primary"]["sorry_bench"]["fallback"])


def detectable(members: int, seeds: int, alpha: float = 0.05, power: float = POWER) -> tuple[float, float]:
    """The smallest mean difference in sigma_d units detected with probability ``power`` at Holm's first
    step (alpha / members) and at its last (alpha), with ``seeds`` seeds (see the module docstring)."""
    df = seeds - 1
    # P(|T'| > c) for T' = (Z + nc) / sqrt(V / df), V ~ chi2(df): averaged over V's quantiles (midpoints of
    # 4,000 equal-probability bins), which stays finite where scipy's nct returns NaN at large nc.
    scale = np.sqrt(stats.chi2.ppf((np.arange(4000) + 0.5) / 4000, df) / df)

    def needed(level: float) -> float:
        critical = stats.t.ppf(1 - level / 2, df)
        reject = lambda d: float(np.mean(stats.norm.sf(critical * scale - d * math.sqrt(seeds))  # noqa: E731
                                         + stats.norm.cdf(-critical * scale - d * math.sqrt(seeds))))
        return float(optimize.brentq(lambda d: reject(d) - power, 1e-6, 1e4))
    return needed(alpha / members), needed(alpha)


def _per_seed(cells: dict, member: Member) -> list[float] | None:
    """The member's per-seed differences (averaged over its columns), or None when any column is missing."""
    rows = [[cells.get(member.row, {}).get(c), cells.get(member.against, {}).get(c)] for c in member.columns]
    if any(mine is None or theirs is None for mine, theirs in rows):
        return None
    found = [seed_level(mine, theirs, iterations=1) for mine, theirs in rows]
    if any(f is None for f in found) or len({f["seeds"] for f in found}) != 1:
        return None
    return [float(np.mean(d)) for d in zip(*(f["per_seed"] for f in found))]


def test_family(table: Path, family: Family) -> dict:
    """Each member's seed-level test on ``table``'s per-document file, Holm over the family."""
    _, _, (cells_by_model, _, _) = checked_table(table)  # the file its JSON was written with
    out = {"command": f"python -m repro.primary_family {shown_path(table, REPO)}", "family": str(FAMILY_FILE.relative_to(REPO)),
           "size": family.size, "alpha": family.alpha, "models": {}}
    for model, cells in cells_by_model.items():
        results = []
        for member in family.members:
            per_seed = _per_seed(cells, member)
            entry = {"kind": member.kind, "label": member.label, "row": member.row, "against": member.against,
                     "columns": list(member.columns), "per_seed": per_seed, "mean": None, "t_ci": None, "t_p": None}
            if per_seed is not None:
                entry.update(t_figures(per_seed))
            results.append(entry)
        adjusted = intervals.holm([1.0 if r["t_p"] is None else r["t_p"] for r in results])
        for entry, p in zip(results, adjusted):
            entry["t_p_holm"] = p
            entry["rejected"] = entry["t_p"] is not None and p <= family.alpha
        seeds = max((r.get("seeds") or 0 for r in results), default=0)
        out["models"][model] = {"members": results, "seeds": seeds,
                                "detectable_sd": list(detectable(family.size, seeds, family.alpha)) if seeds > 1 else None}
    return out


def markdown(result: dict, sorry_reason: str) -> str:
    lines = [f"# The primary family ({result['size']} tests, fixed in {result['family']} before its numbers)\n",
             f"Generated by `{result['command']}`. Seed-level two-sided t test over the seeds' differences; Holm over "
             f"these {result['size']} members alone (a member not computed counts as p = 1). SORRY-Bench's primary "
             f"column: {sorry_reason}.\n"]
    for model, entry in result["models"].items():
        lines.append(f"\n## {model}\n")
        if entry["detectable_sd"]:
            first, last = entry["detectable_sd"]
            lines.append(f"With {entry['seeds']} seeds the family detects (power {POWER:.0%}) a mean difference of "
                         f"{first:.1f} sigma_d at Holm's first step and {last:.1f} sigma_d at its last (sigma_d: the "
                         "between-seed standard deviation of the difference).\n")
        lines.append(markdown_table(
            ["test", "per seed", "mean", "seed-level t 95%", "p", "Holm p", "verdict"],
            [[r["label"], "not computed" if r["per_seed"] is None else " / ".join(f"{d:+.3f}" for d in r["per_seed"]),
              "" if r["mean"] is None else f"{r['mean']:+.3f}",
              "" if r["t_ci"] is None else f"[{r['t_ci'][0]:+.3f}, {r['t_ci'][1]:+.3f}]",
              "" if r["t_p"] is None else f"{r['t_p']:.4f}", f"{r['t_p_holm']:.4f}",
              "rejected" if r["rejected"] else ("not computed" if r["per_seed"] is None else "not rejected")]
             for r in entry["members"]]))
    return "\n".join(lines) + "\n"


def power_text(family: Family, seed_counts: list[int]) -> str:
    rows = [[str(s), *(f"{d:.2f}" for d in detectable(family.size, s, family.alpha))] for s in seed_counts]
    return (f"The primary family ({FAMILY_FILE.relative_to(REPO)}): {family.size} tests, alpha {family.alpha}, Holm.\n"
            + markdown_table(["seeds", f"detectable at alpha/{family.size} (sigma_d)", "detectable at alpha (sigma_d)"], rows)
            + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", nargs="?", type=Path, help="a table's results path without suffix")
    parser.add_argument("--power", action="store_true", help="print the family's size and detectable differences")
    parser.add_argument("--seeds", default="3,5", help="seed counts for --power (comma-separated)")
    args = parser.parse_args(argv)
    spec = json.loads(FAMILY_FILE.read_text())
    column, reason = judged_sorry(spec)
    family = load_family(sorry_column=column)
    if args.power:
        try:
            counts = [read_number(text, "--seeds", integer=True, lo=2, example="--seeds 3,5") for text in args.seeds.split(",")]
        except NumberError as e:
            parser.error(str(e))
        print(power_text(family, counts))
        return 0
    if args.table is None:
        parser.error("name a table (e.g. results/profiles/budget/main_table) or give --power")
    table = table_argument(args.table)
    result = test_family(table, family)
    result["sorry_primary"] = {"column": column, "reason": reason}
    write_record(table.parent / f"{table.name}_primary", result, markdown(result, reason))
    write_readings(table)  # the summary's verdicts are this family's; results/index.html (repro/report.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
