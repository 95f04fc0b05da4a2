"""What the wheel installs: mari_eval with the baselines inside it (no generic top-level package
named `baselines` in site-packages), and every method found from the installed files alone."""

import subprocess
import sys
import zipfile

from .conftest import REPO


def test_the_wheel_installs_the_baselines_under_mari_eval_and_finds_every_method(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(tmp_path)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("mari_eval-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"mari_eval/baselines/caa.py", "mari_eval/baselines/iti.py", "mari_eval/baselines/reft.py"} <= set(names)
    assert not [n for n in names if n.startswith("baselines/")]
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    # The installed files alone: the checkout (on sys.path through the editable install) is left out.
    code = (f"import sys; sys.path = [{str(tmp_path / 'site')!r}] + [p for p in sys.path if p not in ({str(REPO)!r}, '')]\n"
            "import importlib.util; assert importlib.util.find_spec('baselines') is None\n"
            "from mari_eval import methods\n"
            "print(sorted((n, methods.method_class(n).__module__) for n in methods.method_names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([("caa", "mari_eval.baselines.caa"), ("iti", "mari_eval.baselines.iti"),
                                      ("mari", "mari_eval.mari"), ("nl_iti", "mari_eval.baselines.iti"),
                                      ("reft", "mari_eval.baselines.reft")])
