"""What the wheel installs: mari_eval with the baselines and the lm-eval tasks inside it (no generic
top-level package named `baselines` in site-packages), every method and task found from the
installed files alone, and the `lm_eval.models` entry point in its metadata."""

import os
import subprocess
import sys
import zipfile
from importlib import metadata

import pytest

from .conftest import HARNESS_TASKS, REPO

pytestmark = pytest.mark.e2e  # subprocesses or lm-eval runs of the embedded model throughout

ENTRY_POINT = ("lm_eval.models", "mari", "mari_eval.evaluation.lm:MariLM")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(out)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (path,) = out.glob("mari_eval-*.whl")
    zipfile.ZipFile(path).extractall(out / "site")
    return path, out / "site"


def _installed_only(site) -> str:
    """Python code putting the extracted wheel first and leaving the checkout (editable install) out."""
    return (f"import sys; sys.path = [{str(site)!r}] + [p for p in sys.path if p not in ({str(REPO)!r}, '')]\n"
            "import importlib.util; assert importlib.util.find_spec('baselines') is None\n")


def test_the_wheel_installs_the_baselines_under_mari_eval_and_finds_every_method(wheel, tmp_path):
    path, site = wheel
    names = zipfile.ZipFile(path).namelist()
    assert {"mari_eval/baselines/caa.py", "mari_eval/baselines/iti.py", "mari_eval/baselines/reft.py"} <= set(names)
    assert not [n for n in names if n.startswith("baselines/")]
    code = (_installed_only(site) + "from mari_eval import methods\n"
            "print(sorted((n, methods.method_class(n).__module__) for n in methods.method_names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([("caa", "mari_eval.baselines.caa"), ("control_vector", "mari_eval.vectors.control_vector"),
                                      ("iti", "mari_eval.baselines.iti"), ("lora", "mari_eval.baselines.lora"),
                                      ("mari", "mari_eval.mari.method"), ("nl_iti", "mari_eval.baselines.iti"),
                                      ("prompting", "mari_eval.baselines.prompting"), ("reft", "mari_eval.baselines.reft"),
                                      ("steered_config", "mari_eval.vectors.steer_config")])


def test_the_wheel_ships_every_task_file_under_mari_eval(wheel):
    path, _ = wheel
    names = set(zipfile.ZipFile(path).namelist())
    sources = sorted(p.name for p in HARNESS_TASKS.iterdir() if p.is_file() and not p.name.startswith("."))
    assert {"truthfulqa_mc1.yaml", "bbq.yaml", "utils.py", "_mmlu_template_yaml"} <= set(sources)
    assert {f"mari_eval/harness_tasks/{n}" for n in sources} <= names
    assert not [n for n in names if n.startswith("harness_tasks/") or "__pycache__" in n]


def test_the_wheel_declares_the_lm_eval_models_entry_point(wheel):
    path, _ = wheel
    with zipfile.ZipFile(path) as zf:
        (ep_file,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(ep_file).decode()
    group, name, value = ENTRY_POINT
    assert f"[{group}]\n{name} = {value}\n" in text
    # ... and the installed distribution (this environment's) carries it too.
    found = {(ep.group, ep.name, ep.value) for ep in metadata.entry_points(group=group)}
    assert ENTRY_POINT in found, f"{found}: reinstall (pip install -e .) to refresh the metadata"


def test_the_installed_tasks_are_found_without_include_path(wheel, tmp_path):
    """From the installed files alone, lm-eval's default TaskManager indexes mari_eval/harness_tasks:
    the project's names always, the built-in names (truthfulqa_mc1, bbq) only with MARI_DATA_DIR set."""
    _, site = wheel
    code = (_installed_only(site) +
            "from mari_eval.benchmarks.tasks import tasks_dir; print(tasks_dir())\n"
            "from lm_eval.tasks import TaskManager\n"
            "tm = TaskManager()\n"
            "for name in ('truthfulqa_mc1_heldout', 'truthfulqa_mc1', 'bbq'): print(tm.task_index[name].yaml_path)\n")
    env = {**os.environ, "MARI_DATA_DIR": str(tmp_path)}  # only indexed here: no data are read
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    packaged = site / "mari_eval" / "harness_tasks"
    assert out.stdout.split() == [str(packaged)] + [str(packaged / f) for f in
                                                    ("truthfulqa_mc1_heldout.yaml", "truthfulqa_mc1.yaml", "bbq.yaml")]
