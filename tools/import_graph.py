"""The project's import graph: circles, upward imports and the longest import chain; and its
modules' sizes (one idea per module: at most ``MAX_LINES`` lines).

    python tools/import_graph.py [--dot FILE]

Reads every module of the project's packages (``mari_eval``, ``baselines``, ``harness_tasks``,
``repro``) with ``ast`` (nothing is imported) and draws an edge A -> B for every import of B
in A: at the top, inside functions and under ``TYPE_CHECKING`` alike, since each ties A to B.
A package's ``__init__`` counts as the package. Prints the module count, the longest import
chain, every circle (strongly connected component of more than one module) and every upward
import (a package importing one listed above it in ``LAYERS``); exits 1 if there is a circle or
an upward import, or a module over ``MAX_LINES`` lines, so CI keeps the graph a tree of
layers and the modules small.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Lowest first: a package or wing may import its own modules and those of the ones before it. A module
# belongs to the longest entry its name starts with: the wings of mari_eval/ and repro/ (issue 58), then
# the packages' top-level modules (the command line, the public doors, the table scripts), above them all.
WINGS = {
    "mari_eval": ["storage", "benchmarks", "judge", "injection", "methods", "vectors", "evaluation", "training", "mari"],
    "repro": ["engine", "analysis", "plots", "benchmark"],
}
LAYERS = [f"mari_eval.{wing}" for wing in WINGS["mari_eval"]] + ["mari_eval", "baselines", "harness_tasks"] + [
    f"repro.{wing}" for wing in WINGS["repro"]] + ["repro"]
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(name: str) -> int:
    """The index in ``LAYERS`` of the wing or package module ``name`` belongs to (its longest prefix)."""
    return max((i for i, layer in enumerate(LAYERS) if name == layer or name.startswith(layer + ".")),
               key=lambda i: len(LAYERS[i]))


def unknown_wings() -> list[str]:
    """Folders of mari_eval/ or repro/ holding modules that ``WINGS`` does not name (their place in the order is unknown)."""
    return sorted(f"{package}/{folder.name}" for package, wings in WINGS.items() for folder in (ROOT / package).iterdir()
                  if folder.is_dir() and folder.name not in wings and any(folder.glob("*.py")))


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in ["mari_eval", "baselines", "harness_tasks", "repro"]:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[module_name(path)] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` (at ``path``) imports, resolved to the longest known module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from package import module`` imports the module; ``from module import name`` the module
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    layer = {name: layer_of(name) for name in edges}
    return sorted((a, b) for a, targets in edges.items() for b in targets if layer[b] > layer[a])


def longest_chain(edges: dict[str, set[str]]) -> list[str]:
    """The longest import chain (modules in one circle are walked once)."""
    best: dict[str, list[str]] = {}

    def walk(v: str, seen: frozenset) -> list[str]:
        if v in best:
            return best[v]
        chains = [walk(w, seen | {v}) for w in edges[v] if w not in seen]
        chain = [v] + max(chains, key=len, default=[])
        if not any(v in c for c in circles_found):
            best[v] = chain
        return chain

    circles_found = circles(edges)
    return max((walk(v, frozenset()) for v in sorted(edges)), key=len)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dot", help="also write the graph in Graphviz dot format here")
    args = parser.parse_args(argv)
    edges = graph()
    found, up, chain = circles(edges), upward(edges), longest_chain(edges)
    sizes = {name: len(path.read_text().splitlines()) for name, path in project_modules().items()}
    large = sorted((n, name) for name, n in sizes.items() if n > MAX_LINES)
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports; longest chain "
          f"({len(chain)} modules): {' -> '.join(chain)}")
    for component in found:
        print("circle:", " <-> ".join(component))
    for a, b in up:
        print(f"upward: {a} -> {b}")
    for i, layer in enumerate(LAYERS):
        members = sorted(name for name in edges if layer_of(name) == i)
        inside = {name: edges[name] & set(members) for name in members}
        levels = len(longest_chain(inside)) if inside else 0
        print(f"  {layer:24} {len(members):3} modules, {levels:2} import levels")
    biggest = max(sizes, key=sizes.get)
    print(f"{sum(sizes.values())} lines; the largest module: {biggest} ({sizes[biggest]} lines)")
    for n, name in large:
        print(f"over {MAX_LINES} lines: {name} ({n})")
    for folder in unknown_wings():
        print(f"unknown wing: {folder} (add it to WINGS in tools/import_graph.py, in import order)")
    print(f"{len(found)} circles, {len(up)} upward imports, {len(large)} modules over {MAX_LINES} lines")
    if args.dot:
        lines = ["digraph imports {"] + [f'  "{a}" -> "{b}";' for a in sorted(edges) for b in sorted(edges[a])] + ["}"]
        Path(args.dot).write_text("\n".join(lines) + "\n")
    return 1 if found or up or large or unknown_wings() else 0


if __name__ == "__main__":
    sys.exit(main())
