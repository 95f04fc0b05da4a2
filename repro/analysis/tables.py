"""The paper's tables beside ours: reading the paper's figures, tallying seeds, and writing
results/<name>.{json,md,tex} and figures atomically.

The Markdown and LaTeX tables are rendered by tabulate (``markdown_table``, ``latex_table``);
the JSON is strict (``mari_eval.storage.files.write_results_json``: a missing number is null, never a
bare NaN), and such a cell reads "n/a" in the tables. Beside them, results/<name>_documents.parquet
holds every per-document score behind the intervals and tests (repro/recompute.py: ``python -m
repro.recompute results/<name>`` recomputes every cell from it and compares it with the JSON)."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

from tabulate import LATEX_ESCAPE_RULES, tabulate

from mari_eval.storage.files import atomic_write, write_results_json
from repro.analysis import intervals
from repro.engine.cache import Store
from repro.engine.cache_keys import resolved_dtype
from repro.analysis.differences import comparisons_json, reference_differences
from repro.engine.documents import clustered_columns, split_clusters
from repro.analysis.documents_file import DIGEST_FIELD, cell_clusters, cell_documents, shown_path, write_documents
from repro.analysis.completions_file import write_completions
from repro.analysis.report_page import write_readings
from repro.engine.judged import (agreement_record, agreement_sentence, cell_text, judge_record, judge_sentence,
                                 withhold_below_floor)
from repro.engine.profiles import COLUMN_DIGITS, PAPER, PERCENT_COLUMNS, REPO, Profile, column_header, describe

# ----------------------------------------------------------------------------- the paper's tables


def paper_rows(name: str) -> list[dict[str, str]]:
    """Rows of one of the paper's tables (results/paper/<name>.csv, copied from ../shared/paper)."""
    path = PAPER / f"{name}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: copy it from ../shared/paper/{name}.csv")
    with open(path) as fh:
        return list(csv.DictReader(fh))


def mean_std(values: list[float]) -> tuple[float, float | None]:
    if not values:
        return float("nan"), None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt(mean: float, std: float | None, digits: int = 2) -> str:
    if mean != mean:  # NaN
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def add_gate_rates(scores: dict[str, dict], columns: dict[str, str]) -> dict[str, dict]:
    """``scores`` plus a column per {new column: benchmark column}: the fraction of that
    benchmark's documents on which MARI's energy gate opened (from its evaluation's
    diagnostics; NaN where there is no gate)."""
    for gate_column, column in columns.items():
        rate = (scores[column]["diagnostics"] or {}).get("gate_rate")
        scores[gate_column] = {"value": float("nan") if rate is None else rate, "n": scores[column]["n"]}
    return scores


def tally(cells: dict, model: str, label: str, scores: dict[str, dict], seed: int | None = None) -> None:
    """Add one seed's ``score`` results to ``cells`` = {model: {row label: {column: {"values", "n",
    "documents", "clusters", "cluster_unit", "seeds", "stderr"}}}}: per seed, the figure, its
    per-document scores (None where the column has none, e.g. a gate rate), their clusters (None
    where each document is its own unit; repro/engine/documents.py ``split_clusters``), the seed (None:
    not given) and lm-eval's standard error (None where it has none)."""
    for column, result in scores.items():
        cell = cells.setdefault(model, {}).setdefault(label, {}).setdefault(
            column, {"values": [], "n": result["n"], "documents": [], "clusters": [], "cluster_unit": None,
                     "seeds": [], "stderr": []})
        found, clusters, unit = split_clusters(result.get("documents") or {})
        if found and clusters is None and column in clustered_columns():
            raise ValueError(f"{model} {label} {column}: its documents carry no cluster ids (an evaluation stored "
                             "before repro/engine/documents.py kept BBQ's contexts); evaluate it again (--force, or a new "
                             "repro.engine.cache_keys.DOCUMENTS_VERSION)")
        cell["values"].append(result["value"])
        cell["documents"].append(found or None)
        cell["clusters"].append(clusters)
        cell["cluster_unit"] = cell["cluster_unit"] or unit
        cell["seeds"].append(seed)
        cell["stderr"].append(result.get("stderr"))
        if "completions" in result:  # a generation column's answers (repro/analysis/completions_file.py)
            cell.setdefault("completions", []).append(result["completions"])
        if result.get("judged"):  # repro/engine/judged.py
            cell["judged"] = True
            cell.setdefault("judge", []).append(result.get("judge"))


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt  # deferred: matplotlib is heavy; only this path needs it

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display on CI or servers)."""
    import matplotlib  # deferred: matplotlib is heavy; only this path needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: matplotlib is heavy; only this path needs it

    return plt


# ----------------------------------------------------------------------------- writing tables


class Rerendered(NamedTuple):
    """A table written again from its own files (``repro.rerender``)."""

    command: str  # what wrote it again, with the date
    generated: str  # the first sentence of its header as the run that computed its steps wrote it


def cost(store: Store) -> str:
    """What the steps behind a table cost, whether this run computed them or read them back."""
    reused = sum(1 for name in store.step_seconds if name not in store.computed)
    return (f"its {len(store.step_seconds)} training and evaluation steps took {store.compute_seconds():.0f} s of "
            f"computation ({reused} of them read back from the cache under {store.root.as_posix()}/)")


def write_record(stem: Path, record: dict, text: str) -> None:
    """``stem``.json (strict JSON) and ``stem``.md (``text``, also printed): a result beside its reading."""
    write_results_json(stem.with_name(f"{stem.name}.json"), record)
    atomic_write(stem.with_name(f"{stem.name}.md"), text)
    print(text)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown (GitHub pipe) table of ``rows`` under ``headers``, cells as given (strings,
    never re-parsed as numbers), a "|" inside one escaped."""
    cell = lambda c: str(c).replace("\n", " ").replace("|", "\\|")  # noqa: E731
    return tabulate([[cell(c) for c in row] for row in rows], headers=[cell(h) for h in headers], tablefmt="pipe",
                    disable_numparse=True)


def latex_escape(text: str) -> str:
    """``text`` for LaTeX's text mode: the characters LaTeX reads as commands escaped as
    tabulate's LaTeX formats escape them (%, _, &, #, $, braces, ...), "±" as $\\pm$."""
    return "".join(LATEX_ESCAPE_RULES.get(c, c) for c in str(text).replace("\n", " ")).replace("±", "$\\pm$")


def latex_table(headers: list[str], blocks: list[tuple[str | None, list[list[str]]]]) -> str:
    """A booktabs ``tabular`` (first column left, the others centred) of the rows of ``blocks``
    = [(title, rows)], each block under a row spanning the table with its title in italics
    (none for a title None). Every cell and title is escaped (``latex_escape``)."""
    rows = [[latex_escape(c) for c in row] for _, block in blocks for row in block]
    # Escaped before tabulate lays the columns out (its raw format), so that they line up as written.
    text = tabulate(rows, headers=[latex_escape(h) for h in headers], tablefmt="latex_raw", disable_numparse=True,
                    colalign=["left"] + ["center"] * (len(headers) - 1))
    lines = text.split("\n")  # \begin{tabular}, a rule, the header, a rule, a line per row, a rule, \end{tabular}
    head, body, tail = lines[:4], lines[4:-2], lines[-2:]
    if len(body) != len(rows) or not head[0].startswith("\\begin{tabular}") or tail[1] != "\\end{tabular}":
        raise RuntimeError(f"unexpected LaTeX from tabulate:\n{text}")
    out, start = [head[0], "\\toprule", head[2], "\\midrule"], 0
    for title, block in blocks:
        if title is not None:
            out.append(f"\\multicolumn{{{len(headers)}}}{{c}}{{\\textit{{{latex_escape(title)}}}}} \\\\")
        out += body[start:start + len(block)]
        start += len(block)
    return "\n".join(out + ["\\bottomrule", tail[1]]) + "\n"


def cell_interval(cell: dict) -> tuple[intervals.Interval | None, int | None]:
    """The cell's interval (None without per-document scores) and its cluster count (None: unclustered)."""
    documents = cell_documents(cell)
    if documents is None:
        return None, None
    clusters = cell_clusters(cell)
    return intervals.interval(documents, clusters), intervals.cluster_count(documents, clusters)


def _interval_text(ci, digits: int) -> str:
    return "" if ci is None else f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def p_text(p: float, bound: bool = False) -> str:
    """"p=0.008"; below 0.001 in two digits ("p=3.2e-06", never "p=0.000"); a Monte Carlo floor as
    the bound it is ("p<1e-05": no random sign vector was as extreme)."""
    if bound:
        return f"p<{10.0 ** math.ceil(math.log10(p)):.0e}"
    return f"p={p:.3f}" if p >= 0.0005 else f"p={p:.1e}"


def _difference_text(difference: dict | None, digits: int) -> str:
    if difference is None:
        return "n/a"
    mark = "†" if difference["significant_holm"] else "*" if difference["significant"] else ""
    mark += "" if difference.get("interval_agrees", True) else "‡"
    p = p_text(difference["p"], difference.get("p_bound", False))
    return f"{difference['mean']:+.{digits}f}{_interval_text(difference['ci'], digits)} {p}{mark}"


def _n_text(n: int, clusters: int | None, unit: str | None, seeds: int) -> str:
    """"(n=504)", or with the clusters the interval resamples: "(n=504, 308 contexts)" ("... over 3 seeds")."""
    if clusters is None:
        return f"(n={n})"
    return f"(n={n}, {clusters} {unit}s{f' over {seeds} seeds' if seeds > 1 else ''})"


def _digits(column: str) -> int:
    return 2 if column in PERCENT_COLUMNS or column not in COLUMN_DIGITS else COLUMN_DIGITS[column]


UNCERTAINTY = (f"Ours: the figure with its {intervals.LEVEL:.0%} bootstrap interval in brackets ({intervals.ITERATIONS} "
               f"resamples of documents, or of BBQ's contexts with their paired questions, seed {intervals.SEED}; "
               "repro/analysis/intervals.py). Differences from the reference row are paired on the same documents: McNemar's "
               "exact test for 0/1 scores with Tango's score interval of the paired difference (unconditional on the "
               "number of discordant pairs; ‡ where it excludes 0 and the exact test does not reject: the test "
               "decides), else a paired sign-flip permutation test (over contexts for BBQ; exact up to "
               f"{intervals.EXACT_UNITS} units, else {intervals.PERMUTATIONS:,} seeded sign vectors, ten times as many "
               f"again up to {intervals.MAX_PERMUTATIONS:,} while p is within {intervals.STABLE_SE:g} Monte Carlo "
               "standard errors of 0.05 or of its Holm threshold, \"p<1e-05\" where none was as extreme) with the "
               "interval that inverts it, which excludes 0 exactly when p < 0.05; * p < 0.05, † still "
               "< 0.05 after Holm's correction over every test of the table.")


# Accuracy (%) of guessing uniformly among a question's options: MMLU's 4; ARC's 4 for all but 18 of its
# 3,548 test questions (25.02% over them, 25.0 over the first 100 of each task). A column whose reference row
# (Vanilla) holds it in its interval is marked: no difference there reads as a change of capability.
CHANCE = {"mmlu": 25.0, "arc_e": 25.0, "arc_c": 25.0}


def at_chance_note(at_chance: dict[str, list[float]], reference: str) -> str:
    """The line under a table naming its columns at chance (``at_chance``: {column: the reference's interval})."""
    named = ", ".join(f"{column} ({reference} [{ci[0]:.2f}, {ci[1]:.2f}] holds {CHANCE[column.split('@')[0]]:g})"
                      for column, ci in at_chance.items())
    return (f"\n- At chance for this model: {named}, the accuracy of guessing among 4 options; a difference "
            "there is not a change of general capability (the kl and ce columns, on general text, can move).")


def _documents_note(out: Path, name: str) -> str:
    """Where the table's per-document scores are and the command that recomputes it, by the path the
    table was written to (``results/profiles/budget/main_table`` for a budget table)."""
    return (f" Per-document scores: {name}_documents.parquet (`python -m repro.recompute {shown_path(out / name, REPO)}` "
            "recomputes every cell from them).")


def write_tables(out: Path, name: str, title: str, intro: str, cells: dict, columns: list[str], paper_lookup,
                 profile: Profile, command: str, wall: float, store: Store, notes: dict | None = None,
                 reference: str | None = "Vanilla", comparisons: list[tuple[str, str]] = (),
                 rerendered: Rerendered | None = None, gate_open: dict | None = None) -> dict:  # repro/analysis/gate_open.py
    """results/<name>.{json,md,tex}, <name>_documents.parquet (and <name>_differences.png) from
    ``cells`` = {model: {row label: {column: {"values", "n", "documents", "clusters", ...}}}} (``tally``).

    Every cell with per-document scores gets its bootstrap interval (over clusters where its
    documents have them, their count beside n); every row but
    ``reference`` (when the table has that row) its paired difference from it per column,
    with the test's p and Holm's adjustment over the table (``repro.analysis.differences``).
    ``paper_lookup(model) -> (paper model, {row label: {column: figure}})`` gives the paper's
    figures, shown in their own column beside ours and never mixed into them. ``notes`` =
    {model: {row label: [lines]}}: what a row was made with (the baselines' recipes), listed
    under the Markdown table and kept in the row's JSON ("notes"). ``comparisons``: further
    (row, against) pairs tested the same way, one more family for Holm's adjustment, in a table
    of their own and under the model's "comparisons" in the JSON (the ablation's EG-MARI against
    the single adapter, say, where the claim is about two methods rather than one and Vanilla).
    ``rerendered``: the table written again from its files (``repro.rerender``): its header keeps the
    run's own first sentence and says what wrote it again; its JSON records that command.
    """
    cells, headers = withhold_below_floor(cells), [column_header(c) for c in columns]  # repro/engine/judged.py; "in-source kl"
    judge = judge_record(cells)
    agreement = agreement_record(columns, judge)  # how the refusal columns' judges agree with people (XSTest)
    record = {"command": command, "profile": profile.name, "seeds": profile.seeds, "max_train": profile.max_train,
              "max_ctrl": profile.max_ctrl, "limits": profile.limits, "gen_tokens": profile.gen_tokens, "tasks": profile.tasks,
              "placement": asdict(store.placement), "uncertainty": {
                  "interval": f"{intervals.LEVEL:.0%} percentile bootstrap over documents (BBQ: over contexts), "
                              "stratified by seed",
                  "iterations": intervals.ITERATIONS, "seed": intervals.SEED, "alpha": intervals.ALPHA,
                  "tests": "mcnemar (exact; Tango's score interval) for 0/1 scores of equal-size strata, else "
                           "sign-flip (paired permutation over units, interval by inverting it)",
                  "permutations": intervals.PERMUTATIONS, "max_permutations": intervals.MAX_PERMUTATIONS,
                  "stable_se": intervals.STABLE_SE, "exact_units": intervals.EXACT_UNITS,
                  "reference": reference, "documents": f"{name}_documents.parquet"},
              "wall_time_s": round(wall, 1), "compute_time_s": store.compute_seconds(), "computed_now": store.computed,
              **({"step_seconds": dict(store.step_seconds)} if store.step_seconds is not None else {}),
              **({"rerendered": rerendered.command} if rerendered else {}),
              **({"judge": judge} if judge else {}),
              **({"judge_agreement": agreement} if agreement else {}),
              DIGEST_FIELD: None,  # the per-document file written, once it is (documents_file.documents_record)
              "models": {}}
    generated = (rerendered.generated if rerendered else
                 f"Generated by `{command}` (profile `{profile.name}`, seeds {profile.seeds}, "
                 f"{describe(store.placement)}) in {wall:.0f} s; {cost(store)}.")
    md = [f"# {title}\n", f"{generated} {intro} {UNCERTAINTY}{_documents_note(out, name)}"
          + (judge_sentence(judge) if judge else "") + (agreement_sentence(agreement) if agreement else "")
          + (f" Re-rendered by {rerendered.command} from the figures and per-document scores its steps gave, with the "
             "intervals and tests of today's code (repro/rerender.py)." if rerendered else "") + "\n"]
    tex_blocks, tex_differences = [], []
    for model, rows in cells.items():
        paper_model, paper = paper_lookup(model)
        entry = record["models"][model] = {"paper_model": paper_model, "dtype": resolved_dtype(store.placement.dtype, model),
                                           "rows": []}
        differences = reference_differences(rows, columns, reference)
        md_rows, tex_rows, md_diff_rows, at_chance = [], [], [], {}
        for label, by_column in rows.items():
            row = {"row": label, "ours": {}, "n": {}, "paper": {}}
            if (notes or {}).get(model, {}).get(label):
                row["notes"] = notes[model][label]
            row.update({"gate_open": gate_open[model][label]} if label in (gate_open or {}).get(model, {}) else {})  # gated
            md_cells, tex_cells, diff_cells = [label], [label], [label]
            for column in columns:
                cell = by_column.get(column, {"values": [], "n": 0})
                mean, std = mean_std([v for v in cell["values"] if v is not None and v == v])  # NaN, None: missing
                found, clusters = cell_interval(cell) if mean == mean else (None, None)
                ci = [found.low, found.high] if found is not None else None
                unit = cell.get("cluster_unit") if clusters is not None else None
                difference = differences.get((label, column))
                figure = paper.get(label, {}).get(column)
                row["ours"][column] = {"mean": mean, "std": std, "values": cell["values"], "ci": ci,
                                       "clusters": clusters, "cluster_unit": unit,
                                       "lm_eval_stderr": cell.get("stderr") or [None] * len(cell["values"]),
                                       "difference": difference}
                row["n"][column] = cell["n"]
                if cell.get("verdicts"):
                    row.setdefault("verdicts", {})[column] = dict(zip(("parsed", "total"), cell["verdicts"]))
                chance = CHANCE.get(column.split("@")[0])
                if label == reference and chance is not None and ci is not None and ci[0] <= chance <= ci[1]:
                    at_chance[column] = ci
                row["paper"][column] = float(figure) if figure not in (None, "") else None
                digits = _digits(column)
                text = fmt(mean, std, digits) + ("" if mean != mean else _interval_text(ci, digits))
                md_cells += [cell_text(cell, text, _n_text(cell['n'], clusters, unit, len(cell['values']))), figure or "-"]
                tex_cells.append(text)
                diff_cells.append(_difference_text(difference, digits))
            entry["rows"].append(row)
            md_rows.append(md_cells)
            tex_rows.append(tex_cells)
            if label != reference and differences:
                md_diff_rows.append(diff_cells)
        md += [f"\n## {model} ({entry['dtype']}; paper column: {paper_model})\n",
               markdown_table(["row"] + [f"{c} ({who})" for c in headers for who in ("ours", "paper")], md_rows)]
        md += [f"\n- {label}: {'; '.join(lines)}" for label, lines in (notes or {}).get(model, {}).items()]
        if at_chance:
            entry["at_chance"] = {column: CHANCE[column.split("@")[0]] for column in at_chance}
            md.append(at_chance_note(at_chance, reference))
        if md_diff_rows:
            md += [f"\n### {model}: difference from {reference} (paired, same documents)\n",
                   markdown_table(["row"] + headers, md_diff_rows)]
            tex_differences.append((f"{model}: difference from {reference}", md_diff_rows))
        tex_blocks.append((model, tex_rows))
        if comparisons:
            entry["comparisons"] = comparisons_json(rows, columns, list(comparisons))
            compared = [[f"{c['row']} - {c['against']}"] + [_difference_text(c["columns"].get(column), _digits(column))
                                                           for column in columns] for c in entry["comparisons"]]
            md += [f"\n### {model}: paired comparisons between rows (Holm over these tests alone)\n",
                   markdown_table(["rows"] + headers, compared)]
            tex_differences.append((f"{model}: paired comparisons between rows", compared))
    record[DIGEST_FIELD] = write_documents(out / f"{name}_documents.parquet", cells, columns, reference, profile)
    write_results_json(out / f"{name}.json", record)  # strict: a missing number (NaN) is null
    write_completions(out, name, cells, columns, profile, command)
    atomic_write(out / f"{name}.md", "\n".join(md) + "\n")
    tex = latex_table(["Row"] + headers, tex_blocks)
    if tex_differences:
        tex += "\n" + latex_table(["Row"] + headers, tex_differences)
        plot_differences(record, columns, out / f"{name}_differences.png", title)
    atomic_write(out / f"{name}.tex", tex)
    write_readings(out / name)  # NAME_summary.md; results/index.html for a table of results/ (repro/report.py)
    print("\n".join(md))
    return record


def plot_differences(record: dict, columns: list[str], path: Path, title: str) -> None:
    """One panel per column: each row's paired difference from the reference with its 95%
    interval (filled marker: p < 0.05), per model; zero marked. The picture to read first."""
    plt = pyplot()
    shown = [c for c in columns if any((r["ours"][c].get("difference") for m in record["models"].values()
                                         for r in m["rows"] if c in r["ours"]))]
    if not shown:
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(2.6 * len(shown) + 1, 0.4 * 8 + 1.5), squeeze=False)
    for ax, column in zip(axes[0], shown):
        y = 0
        labels = []
        for model, entry in record["models"].items():
            for row in entry["rows"]:
                d = row["ours"][column].get("difference")
                if d is None:
                    continue
                ax.errorbar(d["mean"], y, xerr=[[d["mean"] - d["ci"][0]], [d["ci"][1] - d["mean"]]], fmt="o",
                            color="C0", mfc="C0" if d["significant"] else "white", capsize=3)
                labels.append(row["row"] if len(record["models"]) == 1 else f"{row['row']} ({model})")
                y += 1
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_yticks(range(len(labels)), labels if column == shown[0] else [""] * len(labels))
        ax.invert_yaxis()
        ax.set_title(column_header(column), fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"{title}: difference from {record['uncertainty']['reference']} (95% CI; filled: p < 0.05)",
                 fontsize=9)
    save_figure(fig, path)
