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


# ----------------------------------------------------------------------------- the paper's tables, smoke mode


@pytest.fixture(scope="module")
def smoke_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    return root / "runs", root / "results"


def _repro(script: str, dirs, *args: str) -> subprocess.CompletedProcess:
    runs, out = dirs
    proc = subprocess.run([sys.executable, str(REPO / "repro" / script), "--smoke", "--runs", str(runs),
                           "--out", str(out), *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_main_table_smoke_writes_ours_beside_the_papers_and_resumes_without_recomputing(smoke_dirs):
    _repro("main_table.py", smoke_dirs, "--methods", "vanilla,mari")
    out = smoke_dirs[1]
    first = json.loads((out / "main_table.json").read_text())
    assert first["computed_now"]  # bundles and evaluations were computed
    rows = first["models"]["smollm2-135m-instruct"]["rows"]
    assert [r["row"] for r in rows] == ["Vanilla", "MARI"]
    vanilla = rows[0]
    assert vanilla["n"]["tqa_mc1"] == 2 and 0 <= vanilla["ours"]["tqa_mc1"]["mean"] <= 100
    assert vanilla["paper"]["tqa_mc1"] == 32.03  # the paper's Llama-2-7B figure, in its own column
    assert "| Vanilla | " in (out / "main_table.md").read_text() and "\\begin{tabular}" in (out / "main_table.tex").read_text()
    # A finished run is read back, not recomputed, and gives the same table.
    _repro("main_table.py", smoke_dirs, "--methods", "vanilla,mari")
    second = json.loads((out / "main_table.json").read_text())
    assert second["computed_now"] == []
    assert second["models"] == first["models"]


@pytest.mark.parametrize("script,args,outputs", [
    ("ablation_table.py", ["--columns", "tqa_mc1,bbq_acc"], ["ablation_table.json", "ablation_table.md", "ablation_table.tex"]),
    ("transfer_gsm8k.py", ["--rhos", "0.9"], ["transfer_gsm8k.json", "transfer_gsm8k.md"]),
    ("sensitivity.py", ["--ks", "1,4", "--rhos", "0.8"], ["sensitivity.json", "sensitivity_k.png", "sensitivity_rho.png"]),
    ("diagnostics.py", [], ["diagnostics.json", "diagnostics.md", "diagnostics_energy.png"]),
    ("latency.py", [], ["latency.json", "latency.md", "latency.tex"]),
])
def test_every_repro_script_runs_in_smoke_mode(smoke_dirs, script, args, outputs):
    _repro(script, smoke_dirs, *args)
    for name in outputs:
        assert (smoke_dirs[1] / name).stat().st_size > 0, name
    if outputs[0].endswith(".json"):
        record = json.loads((smoke_dirs[1] / outputs[0]).read_text())
        assert record["profile"] == "smoke" and record["command"].startswith("python repro/")
