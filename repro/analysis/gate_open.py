"""How often a row's gate opened on each evaluation set a table reads (issue 81.1).

A method with a gate (MARI's energy gate, eq:energy_gate_rule) records, for every prompt it answers, whether
the gate opened, and its evaluation's diagnostics hold the share (``Intervention.summarize``: ``gate_rate``;
for the KL and cross-entropy measures, over each document's choice, repro/engine/divergence_run.py). Those
rates were in the cached step files only; here they are gathered per row, per seed and per evaluation set,
for the tables' JSON (``gate_open`` in each gated row) and the diagnostics. An evaluation set is one task
under one attribute's bundle, named ``TASK@TAG`` (``xstest_safe@sorry``, ``benign_text@bbq``,
``truthfulqa_mc1_heldout@tqa``); the columns that read one evaluation (``kl`` and ``ce``) give it once. A row
without a gate (Vanilla, the baselines, MARI with ``gate=false``) records none and has no entry.
"""

from __future__ import annotations

from repro.engine.profiles import ATTRIBUTE_TAGS, Profile

# {model: {row label: {evaluation set: {"task", "bundle", "n", "seeds": [...], "values": [gate rate per seed]}}}}
GateOpen = dict[str, dict[str, dict[str, dict]]]


def evaluation_set(task: str, attribute: str) -> str:
    """The name of ``task`` evaluated under ``attribute``'s bundle: "TASK@TAG"."""
    return f"{task}@{ATTRIBUTE_TAGS[attribute]}"


def gate_rate(result: dict) -> float | None:
    """The share of an evaluation's documents on which the gate opened (None: the method has no gate)."""
    rate = (result.get("diagnostics") or {}).get("gate_rate")
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None


def add(gates: GateOpen, model: str, label: str, seed: int, profile: Profile, columns: list[tuple],
        scores: dict[str, dict]) -> None:
    """Add one seed of one row: ``scores`` are ``repro.engine.scoring.score``'s for ``columns``."""
    for column, task, _, attribute in columns:
        rate = gate_rate(scores[column])
        if rate is None:
            continue
        name = evaluation_set(profile.task(task), attribute)
        entry = gates.setdefault(model, {}).setdefault(label, {}).setdefault(
            name, {"task": profile.task(task), "bundle": attribute, "n": scores[column]["n"], "seeds": [], "values": []})
        if seed in entry["seeds"]:  # another column of the same evaluation
            continue
        entry["seeds"].append(seed)
        entry["values"].append(rate)


def rows(gates: GateOpen) -> list[list[str]]:
    """The Markdown rows of ``gates``: model, row, evaluation set, n, each seed's rate and their mean."""
    out = []
    for model, by_row in gates.items():
        for label, sets in by_row.items():
            for name, entry in sets.items():
                values = entry["values"]
                per_seed = ", ".join(f"{seed}: {value:.2f}" for seed, value in zip(entry["seeds"], values))
                out.append([model, label, name, str(entry["n"]), per_seed, f"{sum(values) / len(values):.2f}"])
    return out


HEADERS = ["model", "row", "evaluation set", "n", "gate open, per seed", "mean"]
