"""The committed report page in a real browser (issue 82.3): headless Chromium (Debian's ``chromium``,
which .ci/run installs where apt-get can) opens results/index.html through tools/headless_page.py; every
figure must have drawn something, nothing may be logged as an error, nothing fetched. The screenshots
stay in ``ARTIFACTS`` (printed). Without Chromium the tests are skipped, saying why."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("MARI_TEST_ARTIFACTS", REPO / ".ci-artifacts")) / "report-browser"
BROWSER = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no chromium on PATH: install Debian's chromium (apt-get install "
                                "chromium; .ci/run does where apt-get works) or set CHROMIUM to a Chromium binary")


def _open(page: Path, out: Path) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "tools/headless_page.py", str(page), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    print(f"screenshots of {page}: {out}")
    assert done.returncode in (0, 1), f"Chromium did not run: {done.stderr[-3000:]}"
    return done.returncode, json.loads(done.stdout)


def test_every_figure_of_the_report_renders():
    page = REPO / "results" / "index.html"
    code, found = _open(page, ARTIFACTS)
    assert found["failures"] == [] and code == 0, f"{found['failures']} (screenshots: {ARTIFACTS})"
    assert len(found["figures"]) == page.read_text().count("<figure ") > 0
    assert all(f["drawing"] and f["ink"] >= 0.01 for f in found["figures"])
    assert found["console"] == [] and found["requests"] == []
    assert (ARTIFACTS / "page.png").stat().st_size > 0
    assert len(list(ARTIFACTS.glob("figure-*.png"))) >= len(found["figures"])


def test_a_blank_figure_an_error_and_a_fetch_are_caught(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><body><figure id="blank"><svg width="300" height="120"></svg></figure>'
                    '<figure id="drawn"><svg width="300" height="120"><rect width="300" height="60" fill="navy"/></svg>'
                    '</figure><script>console.error("boom")</script><img src="http://127.0.0.1:9/x.png"></body></html>')
    code, found = _open(page, tmp_path / "shots")
    assert code == 1
    assert [f["id"] for f in found["figures"] if f["ink"] < 0.01] == ["blank"]
    assert any("boom" in json.dumps(c) for c in found["console"])
    assert found["requests"] == ["http://127.0.0.1:9/x.png"]
