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
