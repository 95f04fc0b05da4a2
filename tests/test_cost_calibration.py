"""repro/engine/costs.py's calibration (issue 59.4): its ratios are the ones the committed GPU runs give,
and GPU-seconds, the CPU estimate and generation are priced as its docstring says."""

import dataclasses
import json
import math

import pytest

from repro.benchmark import cost_check
from repro.engine import costs, steps
from repro.engine.profiles import PROFILES, REPO

RUNS = REPO / "results" / "gpu_bench_runs"


def _runs() -> list[dict]:
    out = []
    for path in sorted(RUNS.glob("run*.json")):
        raw = json.loads(path.read_text())
        out.append({"run": path.name, "shape": raw["settings"]["shape"], "steps": cost_check.estimates(raw)})
    return out


def test_the_calibration_is_what_the_committed_runs_give():
    # A constant edited by hand, or a run added without deriving again, fails here (3 significant digits).
    derived = cost_check.derive(_runs())
    c = costs.CALIBRATION
    assert set(c.runs) <= {p.name for p in RUNS.glob("run*.json")}
    assert set(derived["train"]) == set(c.train) - {"lora"} and c.train["lora"] == c.train["reft"]
    for method, ratio in derived["train"].items():
        assert c.train[method] == pytest.approx(ratio, rel=5e-3), method
    assert c.evaluate == pytest.approx(derived["evaluate"], rel=5e-3) and derived["evaluate_steps"] >= 5
    assert c.decode_step_s == pytest.approx(derived["decode_step_s"], rel=5e-3)


def test_gpu_seconds_are_flop_seconds_at_the_measured_ratio_of_their_kind(monkeypatch):
    monkeypatch.setitem(costs.EMBEDDED_PARAMETERS, "m", 10**9)
    c = dataclasses.replace(costs.CALIBRATION, evaluate=3.0, train={"reft": 2.0}, decode_step_s=0.5)
    scoring = costs.TaskSize(documents=10, prompt=100, requests=4, option=5, generation=False)
    flops = costs.evaluation_flops("m", scoring, [None, "reft"], None)
    assert costs.evaluation_seconds("m", scoring, [None, "reft"], None, calibration=c) == pytest.approx(3.0 * flops / costs.EFFECTIVE_FLOPS)
    # Generation: prompts at the evaluation ratio, then one step per token per batch of prompts;
    # MARI's experts add their routing window (K x T_ent steps).
    generating = costs.TaskSize(documents=20, prompt=50, requests=0, option=0, generation=True)
    prompts = 2 * 1e9 * 20 * 50 * 2 / costs.EFFECTIVE_FLOPS * 3.0
    expected = prompts + math.ceil(20 / 8) * (16 + 16 + costs.MARI_K * costs.MARI_WINDOW) * 0.5
    assert costs.evaluation_seconds("m", generating, [None, "mari"], 16, calibration=c, batch=8) == pytest.approx(expected)
    quick = PROFILES["quick"]
    trained = costs.training_flops("m", "reft", "truthfulqa", quick, 2)
    assert costs.training_seconds("m", "reft", "truthfulqa", quick, 2, calibration=c) == pytest.approx(2.0 * trained / costs.EFFECTIVE_FLOPS)
    # A method no GPU run trained is charged its FLOP-seconds.
    assert costs.training_seconds("m", "caa", "truthfulqa", quick, None, calibration=c) == pytest.approx(
        costs.training_flops("m", "caa", "truthfulqa", quick, None) / costs.EFFECTIVE_FLOPS)


def test_the_cpu_estimate_stays_on_flop_seconds():
    # CPU_SLOWDOWN was measured against FLOP-seconds: the GPU calibration does not move the CPU figure.
    graph = steps.Graph()
    graph.add(steps.Step("A", steps.TRAIN, "A", flops=2.6e14, seconds=50.0))
    graph.add(steps.Step("B", steps.EVALUATE, "B", flops=1.3e14, seconds=7.0, cached=True))
    summary = graph.summary((1,))
    assert summary["gpu_hours"] == pytest.approx(50.0 / 3600)
    assert summary["cpu_hours"] == pytest.approx(2 * costs.CPU_SLOWDOWN / 3600)
    assert "on 2 CPU cores about" in steps.render(graph, "t")
