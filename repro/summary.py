"""A table's summary on the terminal: one row per method, one column per attribute's primary metric and
per cost, each cell the row's seed-level difference from the reference row with its interval and verdict.

    python -m repro.summary results/profiles/budget/main_table     # prints it
    python -m repro.summary results/main_table --write             # and writes results/main_table_summary.md

The same text as NAME_summary.md, which the table scripts, ``repro.seed_level`` and ``repro.report`` write
beside each table (repro/analysis/summary.py says where each cell comes from). Reads the table's JSON
files only, never its Parquet, so it answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from repro.analysis.summary import is_table, load
from repro.analysis.summary_text import markdown, write_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", type=Path, help="a table's results path without suffix, e.g. results/main_table")
    parser.add_argument("--write", action="store_true", help="also write NAME_summary.md beside the table")
    args = parser.parse_args(argv)
    table = args.table.with_suffix("") if args.table.suffix in (".json", ".md") else args.table
    if not is_table(table.with_suffix(".json")):
        parser.error(f"{args.table}: not a table (needs {table.name}.json and {table.name}_documents.parquet beside "
                     "it), e.g. results/main_table")
    try:
        text = markdown(load(table))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"{table}: {e}") from None
    print(text, end="")
    if args.write:
        write_summary(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
