"""The project's import graph (tools/import_graph.py): no circles, no package importing one above it,
no module over 400 lines."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_graph_has_no_circle_no_upward_import_and_no_large_module():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("0 circles, 0 upward imports, 0 modules over 400 lines"), out.stdout


def test_the_graph_tool_finds_a_circle_and_an_upward_import():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "tools"))
    edges = {"mari_eval.a": {"mari_eval.b"}, "mari_eval.b": {"mari_eval.a", "repro.c"}, "repro.c": set()}
    assert import_graph.circles(edges) == [["mari_eval.a", "mari_eval.b"]]
    assert import_graph.upward(edges) == [("mari_eval.b", "repro.c")]
    assert import_graph.longest_chain({"mari_eval.a": {"mari_eval.b"}, "mari_eval.b": set()}) == ["mari_eval.a", "mari_eval.b"]


def test_every_name_of_a_from_import_is_an_edge(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "tools"))
    source = tmp_path / "c.py"
    source.write_text("from mari_eval import a, b\nfrom mari_eval.d import thing\n\ndef f():\n    from . import e\n")
    modules = {name: tmp_path / f"{name}.py" for name in ("mari_eval", "mari_eval.a", "mari_eval.b", "mari_eval.d",
                                                         "mari_eval.e")}
    assert import_graph.imported("mari_eval.c", source, modules) == {"mari_eval.a", "mari_eval.b", "mari_eval.d",
                                                                     "mari_eval.e"}


def test_a_lower_wing_importing_a_higher_one_is_an_upward_import():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "tools"))
    edges = {"mari_eval.storage.files": {"mari_eval.evaluation.lm"}, "mari_eval.evaluation.lm": {"mari_eval.methods"},
             "mari_eval.methods": {"mari_eval.storage.files"}, "mari_eval.cli": {"mari_eval.evaluation.lm"},
             "repro.engine.cache": {"repro.analysis.tables"}, "repro.analysis.tables": {"repro.engine.cache"}}
    assert import_graph.upward(edges) == [("mari_eval.storage.files", "mari_eval.evaluation.lm"),
                                          ("repro.engine.cache", "repro.analysis.tables")]
    assert import_graph.unknown_wings() == []  # every folder of mari_eval/ and repro/ has its place in the order


def test_the_public_names_keep_working():
    # issue 58: moved modules keep no alias, but these names are what users and plugins import
    from mari_eval.control_vector import from_steering_vector
    from mari_eval.methods import Intervention, Option, register_method
    from mari_eval.vectors import control_vector

    assert from_steering_vector is control_vector.from_steering_vector
    assert Intervention and Option and register_method
    import importlib.metadata

    (entry,) = [e for e in importlib.metadata.entry_points(group="lm_eval.models") if e.name == "mari"]
    assert entry.value == "mari_eval.evaluation.lm:MariLM"
