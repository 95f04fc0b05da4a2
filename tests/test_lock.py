"""The environment lock (requirements-lock.txt, applied by `make install`): its keyed pins are the versions
every committed step was computed with, the installed environment satisfies it, and on it the budget
main table's `--plan` reads every committed step back (issue 83), the steps of columns added since aside."""

import importlib.metadata as md
import json
import re
import subprocess
import sys

import pytest

from repro import main_table
from repro.engine import planning, profiles
from repro.engine.cache_keys import KEYED_PACKAGES, generation_task

from .conftest import REPO

LOCK = REPO / "requirements-lock.txt"
BUDGET_STEPS = REPO / "results" / "budget_steps"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)\s*$")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"requirements-lock.txt: {line!r} is not NAME==VERSION"
        pins[_normalise(match.group(1))] = match.group(2)
    return pins


def _release(version: str) -> str:
    """A version without its local label (torch's '2.13.0+cpu' is 2.13.0, as pip's '==2.13.0' reads it)."""
    return version.split("+", 1)[0]


def test_the_lock_pins_the_versions_every_committed_bundle_records():
    pins = _pins()
    records = sorted(BUDGET_STEPS.glob("bundles/*/bundle.json"))
    assert len(records) > 50, "the committed step cache lost its bundles"
    keyed = [p for p in KEYED_PACKAGES if p != "mari-eval"]  # the project itself is installed from the checkout
    for path in records:
        versions = json.loads(path.read_text())["versions"]
        for package in keyed:
            assert _normalise(package) in pins, f"requirements-lock.txt does not pin {package}"
            assert _release(versions[package]) == pins[_normalise(package)], (
                f"{path.parent.name} was computed under {package} {versions[package]}, the lock pins "
                f"{pins[_normalise(package)]}: re-key or regenerate the committed steps with the pin")


def test_the_installed_environment_satisfies_the_lock():
    """What `make install` resolved: each locked package that is installed has the locked version (CI
    installs through the lock, so a mismatch means the Makefile stopped applying it)."""
    mismatched = []
    for name, version in _pins().items():
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            continue
        if _release(installed) != version:
            mismatched.append(f"{name} {installed} (locked {version})")
    for package in KEYED_PACKAGES:
        if package != "mari-eval":
            md.version(package)  # every keyed package is installed
    assert not mismatched, "installed versions differ from requirements-lock.txt: " + ", ".join(mismatched)


# The budget profile's columns added after its steps were committed (issue 81.1: the out-of-source columns), whose
# steps the lead engineer computes apart; every other column's steps are committed.
ADDED = {c[0] for c in profiles.BENIGN_TEXT + profiles.BENIGN_REFUSAL}


@pytest.mark.needs_data
def test_the_budget_plan_reads_every_committed_step_back():
    """The README's promise on a fresh install: the budget main table's steps are all in the committed
    cache, under this environment's keys, but for the steps of the columns added since (``ADDED``). `--plan`
    runs and writes nothing."""
    budget = profiles.PROFILES["budget"]
    committed = [c[0] for c in main_table.BENCHMARKS + main_table.EXTRA] + [c for c in budget.more_columns if c not in ADDED]
    assert ADDED <= set(budget.more_columns) and len(committed) == 24
    proc = subprocess.run([sys.executable, str(REPO / "repro" / "main_table.py"), "--profile", "budget",
                           "--runs", str(BUDGET_STEPS), "--plan", "--columns", ",".join(committed)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"(\d+) steps, (\d+) cached", proc.stdout + proc.stderr)
    assert match, (proc.stdout + proc.stderr)[-3000:]
    total, cached = map(int, match.groups())
    # Issue 81.4: a generation task's evaluations now keep its completions (cache_keys.documents_version), so the
    # committed ones (SORRY-Bench's and XSTest's: 2 steps per seed) are generated again; every other step is read back.
    regenerated = 2 * len(budget.seeds)
    assert total == 84 and cached >= total - regenerated, f"{cached} of {total} committed steps read back: {proc.stderr[-2000:]}"
    # The whole table's plan: the same steps, and the added columns' own steps (repro/engine/profiles.py own_step),
    # which alone may be left to compute beside the generation steps.
    graph, _, _ = planning.graph_of(main_table.main, ["--profile", "budget", "--runs", str(BUDGET_STEPS)])
    added = {c[1] for c in profiles.BENIGN_TEXT + profiles.BENIGN_REFUSAL}
    assert len(graph.steps) == total + 2 * len(budget.seeds)
    for step in graph.steps.values():
        assert step.cached or (step.kind == "evaluate" and (set(step.action.tasks) <= added or all(
            map(generation_task, step.action.tasks)))), step.label
