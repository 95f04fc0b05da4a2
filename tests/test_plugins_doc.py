"""docs/plugins.md's script, run as written (issue 57.6): a method defined in a script trains with
``mari_eval.training.train.train`` and scores through ``lm_eval.simple_evaluate`` from the doc's text alone."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


@pytest.mark.e2e
@pytest.mark.needs_data
def test_the_docs_script_trains_and_scores_a_method(tmp_path):
    section = DOC.read_text().split("## A method in a script, from training to a score", 1)[1]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "meandiff.py").write_text(script)
    proc = subprocess.run([sys.executable, "meandiff.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    accuracy = float(proc.stdout.strip().splitlines()[-1])
    assert 0.0 <= accuracy <= 1.0
    assert (tmp_path / "bundles" / "meandiff" / "weights.safetensors").is_file()
