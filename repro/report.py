"""The report page and every table's summary, from the committed tables.

    python -m repro.report            # writes results/index.html and each table's NAME_summary.md
    python -m repro.report --check    # writes nothing; exits 1 naming each file that would change

The tables are found, not listed: every NAME.json beside a NAME_documents.parquet under results/ and
results/profiles/*/ (repro/analysis/summary.py ``find_tables``). The page (repro/analysis/report_page.py)
needs no network to be viewed: inline SVG figures, inline style, no script. The table scripts,
``repro.rerender`` and ``repro.seed_level`` write it again when they write a table under results/, as
they write the table's summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mari_eval.storage.files import atomic_write
from repro.analysis.report_page import build
from repro.analysis.summary import RESULTS
from repro.analysis.summary_text import markdown


def outputs(root: Path) -> dict[Path, str]:
    """{file: its text}: the page and every table's summary."""
    page, summaries = build(root)
    return {root / "index.html": page, **{s.table.with_name(f"{s.table.name}_summary.md"): markdown(s) for s in summaries}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=RESULTS, help="the results folder (default: the repository's)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")
    args = parser.parse_args(argv)
    try:
        found = outputs(args.root)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"repro.report: {e}") from None
    changed = [path for path, text in found.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in changed:
            print(f"would change: {path}", file=sys.stderr)
        print(f"{len(found)} files checked, {len(changed)} would change")
        return 1 if changed else 0
    for path in changed:
        atomic_write(path, found[path])
    print(f"{len(found)} files ({len(found) - 1} summaries and {args.root / 'index.html'}): {len(changed)} written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
