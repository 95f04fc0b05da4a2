"""Methods of other packages (issue 39.2-3): declared in the ``mari_eval.methods`` entry-point group,
read lazily, refused with both names when claimed twice; the worked example of examples/ installed,
trained by ``mari-eval train``, loaded by ``lm_eval --model mari`` and scored in the smoke main table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mari_eval.methods import registry
from mari_eval.vectors import control_vector
from tests.helpers import run_repro

MODEL = "smollm2-135m-instruct"

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "repe_reading_vector"


def _install_fake(site: Path, package: str, entry_points: dict[str, str], module: str = "", source: str = "") -> None:
    """A package installed into ``site`` as pip lays one out: its dist-info (metadata and entry
    points) and, if given, its module."""
    info = site / f"{package.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}")
    if module:
        (site / f"{module}.py").write_text(source)


PLUGIN_SOURCE = '''
from mari_eval.methods import Intervention, TensorSpec

class Shift(Intervention):
    label = "Shift"

    @classmethod
    def tensor_spec(cls, config, names):
        return {"hidden_size": config["base_model"]["hidden_size"]}, {"shift": TensorSpec(("hidden_size",))}

    def edit(self, hidden):
        return hidden + self.tensors_like(hidden)["shift"]

class NotAMethod:
    pass
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    """An empty folder on sys.path for packages installed by a test; the registry forgets what it read."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))  # plugins loaded here are forgotten after
    registry.plugin_table.cache_clear()
    yield root
    registry.plugin_table.cache_clear()
    for name in [m for m in sys.modules if m.startswith("shift_plugin")]:
        del sys.modules[name]


def test_a_plugin_method_is_found_by_name_and_imported_only_when_asked_for(site):
    _install_fake(site, "shift-plugin", {"shift": "shift_plugin:Shift"}, "shift_plugin", PLUGIN_SOURCE)
    assert "shift" in registry.method_names()
    assert "shift_plugin" not in sys.modules  # listed from the metadata alone
    assert registry.method_sources()["shift"] == "plugin shift_plugin:Shift (package shift-plugin)"
    cls = registry.method_class("shift")
    assert cls.__module__ == "shift_plugin" and cls.method == "shift" and cls.label == "Shift"
    assert registry.method_class("shift") is cls


def test_a_plugin_bundle_round_trips_through_load_bundle(site, tmp_path):
    import torch

    from mari_eval.methods import load_bundle

    _install_fake(site, "shift-plugin", {"shift": "shift_plugin:Shift"}, "shift_plugin", PLUGIN_SOURCE)
    cls = registry.method_class("shift")
    config = {"base_model": {"name": "m", "hidden_size": 4, "num_layers": 2}, "site": {"layer": 1, "position": "p*"},
              "attribute": "truthfulqa", "seed": 0, "hyperparameters": {}}
    try:
        saved = cls(config, {"shift": torch.arange(4.0)}).save(tmp_path / "bundle")
    except Exception as e:  # the common fields a bundle must hold, as the error names them
        pytest.fail(f"a minimal plugin bundle did not save: {e}")
    loaded = load_bundle(saved)
    assert type(loaded) is cls and torch.equal(loaded.tensors["shift"], torch.arange(4.0))
    assert json.loads((saved / "bundle.json").read_text())["method"] == "shift"


def test_a_name_two_packages_claim_is_an_error_naming_both(site):
    _install_fake(site, "shift-plugin", {"shift": "shift_plugin:Shift"}, "shift_plugin", PLUGIN_SOURCE)
    _install_fake(site, "other-shift", {"shift": "other_shift:Shift"})
    with pytest.raises(registry.MethodRegistryError) as error:
        registry.method_class("shift")
    message = str(error.value)
    assert "shift_plugin:Shift (package shift-plugin)" in message and "other_shift:Shift (package other-shift)" in message
    assert "shift_plugin" not in sys.modules  # neither was imported


def test_a_plugin_claiming_a_builtin_name_is_refused_naming_both(site):
    _install_fake(site, "shift-plugin", {"caa": "shift_plugin:Shift"}, "shift_plugin", PLUGIN_SOURCE)
    with pytest.raises(registry.MethodRegistryError, match=r"mari-eval's built-in .*caa:CAA.* and by shift_plugin:Shift"):
        registry.method_class("caa")
    assert registry.method_sources()["caa"].startswith("claimed twice")


@pytest.mark.parametrize("target, error", [
    ("shift_plugin:NotAMethod", "is not a subclass of mari_eval.methods.Intervention"),
    ("shift_plugin:Missing", "does not load: shift_plugin:Missing: AttributeError"),
    ("no_such_module:Shift", "does not load: no_such_module:Shift: ModuleNotFoundError"),
])
def test_a_plugin_that_is_not_a_method_is_refused_naming_its_package(site, target, error):
    _install_fake(site, "shift-plugin", {"shift": target}, "shift_plugin", PLUGIN_SOURCE)
    with pytest.raises(registry.MethodRegistryError, match="package shift-plugin") as raised:
        registry.method_class("shift")
    assert error in str(raised.value)


@pytest.mark.parametrize("failure", ["raise RuntimeError('no GPU driver')", "import sys; sys.exit(3)", "1/0"])
def test_a_plugin_that_fails_at_import_names_itself_and_leaves_the_other_methods_working(site, failure, caplog):
    _install_fake(site, "shift-plugin", {"shift": "shift_plugin:Shift"}, "shift_plugin", failure + "\n")
    with pytest.raises(registry.MethodRegistryError, match=r"method 'shift' of package shift-plugin does not load: "
                                                              r"shift_plugin:Shift: (RuntimeError|SystemExit|ZeroDivisionError)"):
        registry.method_class("shift")
    # What every `lm_eval --model mari` run reads to check its model args, vanilla's included: the broken
    # plugin is warned about by name, the built-in methods' options are all there.
    options = registry.option_methods()
    assert "caa" in options["scale"] and "mari" in options["T_ent"]
    assert "package shift-plugin does not load" in caplog.text
    assert registry.method_class("caa").method == "caa"


def test_a_class_registered_under_another_name_is_refused(site):
    source = PLUGIN_SOURCE + "\nfrom mari_eval.methods import register_method\nregister_method('other')(Shift)\n"
    _install_fake(site, "shift-plugin", {"shift": "shift_plugin:Shift"}, "shift_plugin", source)
    with pytest.raises(registry.MethodRegistryError, match="registers itself as 'other': make the two names agree"):
        registry.method_class("shift")


def test_an_unknown_method_names_the_plugin_group(site):
    with pytest.raises(ValueError, match="unknown method 'nope'.*mari_eval.methods entry-point group"):
        registry.method_class("nope")


def test_repro_methods_refuse_a_name_nobody_declares_before_any_work(tmp_path):
    from repro import main_table

    with pytest.raises(SystemExit, match="--methods: unknown method 'nope'"):
        main_table.main(["--smoke", "--methods", "vanilla,nope", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "runs" / "bundles").exists()


# -- the worked example, installed as a user installs it ---------------------------------------


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """examples/repe_reading_vector pip-installed into a folder of its own (put on PYTHONPATH by
    the tests that use it): the test environment is not changed for the other tests."""
    target = tmp_path_factory.mktemp("plugin_site")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
               str(target), str(EXAMPLE)]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (target / "mari_eval_repe.py").is_file()
    return target


@pytest.fixture
def with_example(installed_example, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(installed_example), os.environ.get("PYTHONPATH")])))
    return installed_example


@pytest.mark.e2e
@pytest.mark.needs_data
def test_the_example_plugin_trains_loads_in_lm_eval_and_scores_in_the_main_table(with_example, tmp_path):
    # 1. `mari-eval train --method repe`: the name alone, nothing imported by hand.
    bundle = tmp_path / "repe-bundle"
    train = subprocess.run([sys.executable, "-m", "mari_eval.cli", "train", "--method", "repe", "--attribute", "truthfulqa",
                            "--max-train", "6", "--max-pca", "8", "--set", "coefficient=2", "--out", str(bundle)],
                           capture_output=True, text=True)
    assert train.returncode == 0, train.stderr[-4000:]
    saved = json.loads((bundle / "bundle.json").read_text())
    assert saved["method"] == "repe" and saved["hyperparameters"]["coefficient"] == 2.0
    assert saved["hyperparameters"]["gap"] > 0 and saved["diagnostics"]["pairs"] == 6
    # 2. lm_eval --model mari loads it by the method name in bundle.json.
    out = tmp_path / "lm_eval_out"
    lm_eval = Path(sys.executable).with_name("lm_eval")
    evaluated = subprocess.run([str(lm_eval), "--model", "mari", "--model_args", f"bundle={bundle},scale=0.5",
                                "--tasks", "truthfulqa_mc1", "--limit", "2", "--output_path", str(out)],
                               capture_output=True, text=True)
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["config"]["mari_intervention"]["method"] == "repe"
    assert 0 <= results["results"]["truthfulqa_mc1"]["acc,none"] <= 1
    # 3. The smoke main table with the plugin's row beside the untouched model's, with intervals and paired tests
    #    (the built-in methods' rows come from the same code: tests/test_repro.py).
    #    Beside it, a bundle made elsewhere (a steering-vectors SteeringVector, imported) by --extra-bundle:
    #    copied under runs/ by its content and scored the same way.
    from steering_vectors import SteeringVector

    steering = SteeringVector({10: torch.randn(576, generator=torch.Generator().manual_seed(0))}, "decoder_block")
    vector = control_vector.from_steering_vector(steering, MODEL, tmp_path / "vector")
    dirs = (tmp_path / "runs", tmp_path / "results")
    run_repro("main_table.py", dirs, "--methods", "vanilla,repe", "--columns", "tqa_mc1,tqa_mc2",
              "--extra-bundle", f"steer={vector}")
    table = json.loads((dirs[1] / "main_table.json").read_text())
    rows = {row["row"]: row for row in table["models"][MODEL]["rows"]}
    assert set(rows) == {"Vanilla", "RepE", "steer"}
    for row in ("RepE", "steer"):
        for column in ("tqa_mc1", "tqa_mc2"):
            cell = rows[row]["ours"][column]
            assert cell["ci"][0] <= cell["mean"] <= cell["ci"][1]
            assert cell["difference"]["p"] is not None and cell["difference"]["reference"] == "Vanilla"
    assert rows["steer"]["ours"]["tqa_mc2"]["mean"] != rows["Vanilla"]["ours"]["tqa_mc2"]["mean"]  # it steered
    (copied,) = (dirs[0] / "bundles").glob("extra-steer-*")
    assert (copied / "weights.safetensors").read_bytes() == (vector / "weights.safetensors").read_bytes()
    assert "| RepE " in (dirs[1] / "main_table.md").read_text() and "| steer " in (dirs[1] / "main_table.md").read_text()
