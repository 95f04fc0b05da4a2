"""The report page (repro/report.py, repro/analysis/report_page.py): every table found, its figures inline
and the same bytes each run, stored completions shown where a table has them, and --check saying which
file would change (the committed page and summaries included)."""

import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mari_eval.injection.devices import Placement
from repro import report
from repro.analysis import tables
from repro.analysis.report_page import COMPLETION_COLUMNS, build
from repro.engine.cache import Store
from repro.engine.profiles import Profile

from .test_recompute import make_cells

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def root(tmp_path) -> Path:
    """A results folder of two tables: one at its top, one under profiles/p/."""
    store = Store(tmp_path / "runs", placement=Placement(dtype="float32"))
    profile = Profile(name="fixed", models=["m"], seeds=[0, 1], max_train={}, max_ctrl=None, limits={})
    for folder in (tmp_path / "results", tmp_path / "results" / "profiles" / "p"):
        tables.write_tables(folder, "main_table", "Table T", "Intro.", make_cells(), ["tqa_mc1", "bbq_acc", "gate"],
                            lambda model: ("P", {}), profile, "cmd", 1.0, store)
    return tmp_path / "results"


def test_the_page_holds_every_table_inline_and_check_names_what_would_change(root, capsys):
    assert report.main(["--root", str(root)]) == 0
    page = (root / "index.html").read_text()
    assert page.count("<section ") == 2 and page.count("<figure ") == 4  # tqa_mc1 and bbq_acc of each table
    assert page.count("<svg ") == 4
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))  # two plots never share an id
    assert not re.search(r"<script|<link|<img|src=|https?://(?!www\.w3\.org/|purl\.org/|creativecommons\.org/)", page)
    assert 'href="profiles/p/main_table_summary.md"' in page
    assert report.main(["--root", str(root), "--check"]) == 0  # the same bytes again
    summary = root / "profiles" / "p" / "main_table_summary.md"
    summary.write_text(summary.read_text() + "edited\n")
    capsys.readouterr()
    assert report.main(["--root", str(root), "--check"]) == 1
    assert f"would change: {summary}" in capsys.readouterr().err


def _completions(path: Path, columns: tuple[str, ...]) -> None:
    rows = [{"model": "m", "row": row, "task": "xstest_safe", "seed": seed, "document": str(d), "prompt": f"prompt {d}",
             "completion": f"{row} answers <{d}> seed {seed}"} for row in ("Vanilla", "MARI") for seed in (0, 1)
            for d in range(3)]
    pq.write_table(pa.Table.from_pylist([{c: r[c] for c in columns} for r in rows]), path)


def test_stored_completions_are_shown_a_few_a_row(root):
    assert "not computed: no main_table_completions.parquet beside the table" in build(root)[0]
    _completions(root / "main_table_completions.parquet", COMPLETION_COLUMNS)
    page = build(root)[0]
    assert "MARI answers &lt;0&gt; seed 0" in page and "MARI answers &lt;1&gt; seed 0" in page  # escaped
    assert "MARI answers &lt;2&gt; seed 0" not in page  # two a row
    _completions(root / "main_table_completions.parquet", tuple(c for c in COMPLETION_COLUMNS if c != "completion"))
    with pytest.raises(ValueError, match=r"main_table_completions.parquet lacks the columns \['completion'\]"):
        build(root)


def test_the_committed_page_and_summaries_are_what_the_code_gives():
    done = subprocess.run([sys.executable, "-m", "repro.report", "--check"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert re.search(r"(\d+) files checked, 0 would change", done.stdout)
