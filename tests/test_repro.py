"""The repro scripts run end to end on tiny workloads (so that none rots)."""

import json
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.needs_data


def test_bench_times_hf_and_ours_on_the_same_requests(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "repro" / "bench.py"), "--limit", "1", "--gen-prompts", "1", "--gen-tokens", "3",
         "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "bench.json").read_text())
    assert set(record["results"]) == {"hf", "vanilla"}
    hf, ours = record["results"]["hf"], record["results"]["vanilla"]
    assert hf["mc"]["questions"] == ours["mc"]["questions"] == 1
    assert hf["mc"]["acc"] == pytest.approx(ours["mc"]["acc"], abs=1e-4)  # same requests, same answers
    for r in (hf, ours):
        assert r["gen"]["prompts"] == 1 and r["gen"]["tokens_per_s"] > 0 and r["mc"]["peak_rss_mib"] > 0
    table = (tmp_path / "bench.md").read_text()
    assert "| hf | " in table and "| vanilla | " in table and "3-token latency" in table


def test_bench_refuses_a_bundle_argument_without_a_bundle(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "repro" / "bench.py"), "--bundle", f"mari={tmp_path}"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "expected NAME=DIR with DIR/bundle.json" in proc.stderr
