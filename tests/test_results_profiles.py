"""Every committed table was computed at the sizes of the profile it names, by a command that names it.

A table's JSON records its profile's name, its command and the sizes it ran at (training subsets,
D_ctrl, test documents, generation lengths, task stand-ins). Changing a profile without regenerating
its tables, or a table whose command would now run another profile (the default is ``quick``, the
committed tables are ``standard``'s), fails here, naming the table and the field.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from repro.engine.command_line import add_common_args
from repro.engine.profiles import PROFILES

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _names_a_profile(path: Path) -> bool:
    table = json.loads(path.read_text())
    return isinstance(table, dict) and isinstance(table.get("profile"), str)


TABLES = sorted(p for p in RESULTS.rglob("*.json") if p.parent.name != "paper" and _names_a_profile(p))


def _profile_of(command: str) -> str:
    """The profile a recorded ``python repro/X.py ...`` command runs, as the scripts' own parser reads it."""
    parser = argparse.ArgumentParser()
    add_common_args(parser)
    return parser.parse_known_args(shlex.split(command)[2:])[0].profile


def test_the_committed_tables_are_found():
    names = {str(p.relative_to(RESULTS)) for p in TABLES}
    assert {"main_table.json", "ablation_table.json", "sensitivity.json", "tqa_generation/main_table.json"} <= names


@pytest.mark.parametrize("path", TABLES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_committed_table_ran_at_the_sizes_of_the_profile_its_command_names(path):
    table = json.loads(path.read_text())
    assert _profile_of(table["command"]) == table["profile"], (
        f"{path}: its command {table['command']!r} runs profile {_profile_of(table['command'])!r}, "
        f"but the table records {table['profile']!r}: regenerate it, or name the profile in the command")
    profile = PROFILES[table["profile"]]
    for field in ("max_train", "limits", "gen_tokens", "tasks"):
        recorded = table.get(field) or {}
        expected = getattr(profile, field)
        differ = {k: (v, expected.get(k)) for k, v in recorded.items() if expected.get(k) != v}
        assert not differ, f"{path}: {field} (recorded, profile {profile.name}'s) differ: {differ}; regenerate the table"
    if "max_ctrl" in table:
        assert table["max_ctrl"] == profile.max_ctrl, f"{path}: max_ctrl {table['max_ctrl']} vs {profile.max_ctrl}"
    if "seeds" in table and "--seeds" not in table["command"]:
        assert table["seeds"] == profile.seeds, f"{path}: seeds {table['seeds']} vs {profile.seeds}"
