"""The files of this suite's task folder (``mari_eval.benchmarks.tasks.tasks_dir``) that an evaluation of
one task reads: what its cache key hashes (``repro.engine.cache_keys.task_fingerprint``), so that an edit to
bbq.yaml evaluates the BBQ tasks again and leaves TruthfulQA's stored evaluations valid.

A task's files, as lm-eval resolves a name in an include path:

* the YAML whose ``task:`` (or ``group:``) is the name, else every YAML tagged with it (``tag:``);
* for a group, its members (``task:`` list: names resolved the same way, or inline configurations);
* each YAML's ``include:`` chain;
* each Python module a YAML calls (``!function utils.name``), and the folder's modules those import.

A name no YAML of the folder defines (a task of lm-eval's own, whose files and code its version in
the key covers; the KL/cross-entropy measure, keyed by its own version) reads none of the folder's
files. Prose (``*.md``) and bytecode never count.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

_FUNCTION = "!function"


class _Loader(yaml.SafeLoader):
    """YAML as lm-eval writes it: ``!function module.name`` read as a marked string."""


_Loader.add_constructor(_FUNCTION, lambda loader, node: f"{_FUNCTION} {loader.construct_scalar(node)}")
_IMPORT = re.compile(r"^\s*(?:from\s+([A-Za-z_]\w*)\s+import|import\s+([A-Za-z_]\w*))", re.MULTILINE)


def definition_files(root: Path) -> list[Path]:
    """Every file of the folder that can define a task (what the whole-folder fingerprint hashed)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix not in (".md", ".pyc"))


def _index(root: Path) -> tuple[dict[str, list[Path]], dict[Path, Any]]:
    """({task, group or tag name: the YAML files that define it or carry it}, {YAML file: its content})."""
    names: dict[str, list[Path]] = {}
    contents: dict[Path, Any] = {}
    for path in sorted(root.rglob("*.yaml")):
        content = contents[path] = yaml.load(path.read_text(), Loader=_Loader) or {}
        if not isinstance(content, dict):
            continue
        for key in ("task", "group"):
            if isinstance(content.get(key), str):
                names.setdefault(content[key], []).append(path)
        tags = content.get("tag") or []
        for tag in [tags] if isinstance(tags, str) else tags:
            names.setdefault(tag, []).append(path)
    return names, contents


def _strings(value: Any):
    """Every string inside a YAML value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


class _Resolver:
    """The files one task name reaches (``task_files``), over one reading of the folder."""

    def __init__(self, root: Path):
        self.root = root
        self.names, self.contents = _index(root)
        self.found: set[Path] = set()
        self.seen: set[str] = set()

    def name(self, name: str) -> None:
        """Add the files of task, group or tag ``name`` (none when no YAML of the folder defines it)."""
        if name in self.seen:
            return
        self.seen.add(name)
        for path in self.names.get(name, []):
            self.file(path)

    def file(self, path: Path) -> None:
        if path in self.found:
            return
        self.found.add(path)
        content = self.contents.get(path)
        if content is None and path.is_file():  # an include target without the .yaml suffix
            content = yaml.load(path.read_text(), Loader=_Loader)
        self.configuration(content, path)

    def configuration(self, content: Any, base: Path) -> None:
        """Add a YAML configuration's includes, called modules and, for a group, its members."""
        if not isinstance(content, dict):
            return
        include = content.get("include")
        if isinstance(include, str):
            self.file(base.parent / include)
        for text in _strings(content):
            if text.startswith(_FUNCTION):
                self.module(text.split()[1].split(".")[0])
        members = content.get("task")
        if "group" in content and isinstance(members, list):
            for member in members:
                if isinstance(member, str):
                    self.name(member)
                else:  # an inline configuration
                    self.configuration(member, base)

    def module(self, module: str) -> None:
        """Add a module of the folder and the folder's modules it imports."""
        path = self.root / f"{module}.py"
        if path in self.found or not path.is_file():
            return
        self.found.add(path)
        for match in _IMPORT.finditer(path.read_text()):
            self.module(match.group(1) or match.group(2))


def task_files(root: Path, task: str) -> list[Path]:
    """The files of ``root`` an evaluation of ``task`` reads (module docstring), sorted."""
    resolver = _Resolver(root)
    resolver.name(task)
    return sorted(resolver.found)


GENERATE = "generate_until"  # lm-eval's output type of a task that generates text (SORRY-Bench, XSTest, GSM8K)


def generates(root: Path, task: str) -> bool:
    """Whether ``task`` generates text: its YAML (or the first YAML of its ``include:`` chain that says)
    declares ``output_type: generate_until``, or, for a group or tag, one of its members does. A name no
    YAML of the folder defines (lm-eval's own tasks; the KL/cross-entropy measure): False."""
    names, contents = _index(root)
    seen: set[str] = set()

    def declared(content: Any, base: Path) -> str | None:
        while isinstance(content, dict):
            if "output_type" in content:
                return content["output_type"]
            include = content.get("include")
            if not isinstance(include, str) or not (base.parent / include).is_file():
                return None
            base = base.parent / include
            content = contents.get(base) or yaml.load(base.read_text(), Loader=_Loader)
        return None

    def of(content: Any, base: Path) -> bool:
        members = content.get("task") if isinstance(content, dict) else None
        if isinstance(content, dict) and "group" in content and isinstance(members, list):
            return any(named(m) if isinstance(m, str) else of(m, base) for m in members)
        return declared(content, base) == GENERATE

    def named(name: str) -> bool:
        if name in seen:
            return False
        seen.add(name)
        return any(of(contents.get(path), path) for path in names.get(name, []))

    return named(task)
