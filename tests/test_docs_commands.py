"""Every command the README and the docs show still parses, so none goes stale.

Commands are read from the fenced ``bash`` blocks of README.md, docs/*.md, results/README.md and
harness_tasks/README.md, and from inline code that shows a whole command (``python repro/...``,
``python -m ...``, ``lm_eval --...``, ``make ...``); a command with an elided part (``...``) is
left out. Each is handed to the parser of the program it names, stopped right
after parsing (``argparse.ArgumentParser.parse_args`` is wrapped): ``mari-eval`` (mari_eval.cli),
``python repro/X.py`` and ``python -m repro.X`` (the script's own ``main``),
``python -m mari_eval.judge`` and ``python tools/X.py``; ``lm_eval`` (and ``accelerate launch -m
lm_eval``) by lm-eval's own parser, then its tasks looked up in lm-eval's task index and, for
``--model mari``, its model arguments among ``MariLM``'s, HFLM's and the methods' options;
``make T`` against the Makefile's targets. What runs them for real: the tests of each program
(tests/test_repro.py runs every repro script in smoke mode, tests/test_lm_eval.py and
tests/test_task_discovery.py the lm_eval command) and CI (``make test``). Programs that are not
this project's (``export``, ``pip``, ``vllm``, ``python -c``) are listed in ``NOT_OURS``; a
command of any other program fails the test until it is checked here.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md",
         ROOT / "harness_tasks" / "README.md"]
NOT_OURS = {"export", "pip", "vllm", "git", "cd", "jq"}
# Inline code naming a whole command (prose names ``mari-eval train`` as a word, shown in full in a block).
INLINE = re.compile(r"`((?:python (?:-m )?repro[/.]|python -m mari_eval|lm_eval --|make )[^`]+)`")


def _commands(text: str) -> list[str]:
    found, block, line_so_far = [], False, ""
    for line in text.split("\n"):
        fence = line.strip()
        if fence.startswith("```"):
            block = (not block) and fence in ("```bash", "```sh", "```shell")
            continue
        if block:
            if line.rstrip().endswith("\\"):
                line_so_far += line.rstrip()[:-1] + " "
                continue
            found.append(line_so_far + line)
            line_so_far = ""
    found += [" ".join(m.group(1).split()) for m in INLINE.finditer(text)]
    return [c.strip() for c in found if c.strip() and not c.strip().startswith("#")]


def _documented() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for command in _commands(page.read_text()):
            words = shlex.split(command, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value before the program
                words = words[1:]
            if words and not any("..." in w for w in words):  # "mari-eval train --method caa ...": elided
                out.append((f"{page.relative_to(ROOT)}: {command}", words))
    return out


COMMANDS = _documented()


class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


@pytest.fixture
def parse_only(monkeypatch):
    original = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)


def _parse_main(main, argv: list[str], program: str, monkeypatch) -> argparse.Namespace:
    """``main``'s parsed command line for ``argv``; a usage error fails the test with its message."""
    monkeypatch.setattr(sys, "argv", [program, *argv])
    try:
        main(argv) if inspect.signature(main).parameters else main()
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as e:
        pytest.fail(f"{program} {' '.join(argv)}: usage error (exit {e.code})")
    pytest.fail(f"{program} {' '.join(argv)}: its main returned without parsing a command line")


def _python(words: list[str], monkeypatch) -> None:
    if words[1] == "-c":
        return  # a one-line snippet, not a program of ours
    if words[1] == "-m":
        module, argv = words[2], words[3:]
    else:
        path = Path(words[1])
        assert (ROOT / path).is_file(), f"{path} does not exist"
        if path.parts[0] == "tools":
            sys.path.insert(0, str(ROOT / "tools"))
            module = path.stem
        elif path.parts[0] == "repro":
            module = ".".join(path.with_suffix("").parts)
        else:
            return  # a generator script (harness_tasks/_generate_mmlu.py): its existence is what is checked
        argv = words[2:]
    loaded = importlib.import_module(module)
    if getattr(loaded, "main", None) is None:  # a package run by its __main__ (python -m mari_eval.judge)
        loaded = importlib.import_module(module + ".__main__")
    main = loaded.main
    _parse_main(main, argv, words[1], monkeypatch)


@functools.lru_cache(maxsize=None)
def _known_tasks() -> frozenset[str]:
    from lm_eval.tasks import TaskManager

    return frozenset(TaskManager().all_tasks)  # lm-eval's own index, which finds ours too


def _lm_eval(words: list[str], monkeypatch) -> None:
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.models.huggingface import HFLM

    from mari_eval.evaluation.lm import MariLM
    from mari_eval.methods.registry import option_names

    args = _parse_main(lambda: cli_evaluate(), words[1:], "lm_eval", monkeypatch)
    known = _known_tasks()
    assert not set(args.tasks or []) - known, f"unknown tasks {sorted(set(args.tasks) - known)}"
    if args.model == "mari":
        allowed = (set(inspect.signature(MariLM.__init__).parameters) | set(inspect.signature(HFLM.__init__).parameters)
                   | option_names())
        unknown = set(args.model_args or {}) - allowed
        assert not unknown, f"--model mari takes no model args {sorted(unknown)}"


def _make(words: list[str]) -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    wanted = [w for w in words[1:] if "=" not in w]
    assert set(wanted) <= targets, f"Makefile has no target {sorted(set(wanted) - targets)}"


def test_the_pages_show_commands_of_every_kind():
    programs = {words[0] for _, words in COMMANDS}
    assert {"python", "mari-eval", "lm_eval", "make"} <= programs


@pytest.mark.parametrize("where,words", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_parses(where, words, parse_only, monkeypatch):
    program = words[0]
    if program in NOT_OURS:
        return
    if program == "accelerate" and "lm_eval" in words:
        words = words[words.index("lm_eval"):]
        program = "lm_eval"
    if program == "mari-eval":
        from mari_eval import cli

        _parse_main(cli.main, words[1:], "mari-eval", monkeypatch)
    elif program == "python":
        _python(words, monkeypatch)
    elif program == "lm_eval":
        _lm_eval(words, monkeypatch)
    elif program == "make":
        _make(words)
    else:
        pytest.fail(f"{where}: a command of {program!r}, which this test does not check; check it here or list it "
                    "in NOT_OURS")
