"""Shared fixtures: the embedded model (materialised once per machine) and the data folder."""

import inspect
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HARNESS_TASKS = REPO / "harness_tasks"

# Nothing here may reach the Hub; .ci/run sets this too.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs two pytest-xdist workers, one per core: each of them, and every subprocess it
# starts, computes on one thread (two workers of two threads each would oversubscribe two cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# MARI_DATA_DIR may be relative (.ci/run uses ../shared/data from the repository root);
# make it absolute so that subprocesses started in another directory see the same folder.
if os.environ.get("MARI_DATA_DIR"):
    os.environ["MARI_DATA_DIR"] = str(Path(os.environ["MARI_DATA_DIR"]).resolve())


# What makes a test ``e2e`` (left out by ``make test-fast``; CI runs everything): a module that runs
# subprocesses or lm-eval on the embedded model throughout (``pytestmark`` there), a fixture that
# loads the embedded model or starts a server, or a test whose own code does either.
E2E_FIXTURES = {"smollm2_session", "truthfulqa_session", "mari_lm", "hf_lm", "embedded", "task_run", "wheel"}
E2E_CALLS = re.compile(r"subprocess\.|simple_evaluate\(|create_from_arg_string\(|get_model\(\"mari\"\)|"
                       r"Session\(\"smollm2|run_repro\(|_lm_eval\(|cli\.main\(|serve_embedded\(|judge_environment\(")


def _is_e2e(item) -> bool:
    if E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    function = getattr(item, "function", None)
    try:
        return bool(function and E2E_CALLS.search(inspect.getsource(function)))
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_e2e(item):
            item.add_marker(pytest.mark.e2e)
    if os.environ.get("MARI_DATA_DIR"):
        return
    skip = pytest.mark.skip(reason="MARI_DATA_DIR is not set: these tests read the local benchmark copy")
    for item in items:
        if "needs_data" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def harness_task_manager():
    """lm-eval's task index with harness_tasks/ included, built once for every test: indexing the
    built-in tasks' YAML files takes seconds each time."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(HARNESS_TASKS))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from mari_eval.storage.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_session():
    """A training Session around the embedded model, loaded once for every test that fits on it."""
    from mari_eval.training.train import Session

    return Session("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def truthfulqa_session(smollm2_session):
    """(session, data, config): the embedded model on 20 TruthfulQA training questions (seed 0)."""
    from mari_eval.benchmarks.data_splits import make_splits
    from mari_eval.training.train import attribute_data, provenance

    data = attribute_data(smollm2_session, "truthfulqa", seed=0, max_train=20, max_ctrl=1)
    config = provenance(smollm2_session, "truthfulqa", 0, make_splits("truthfulqa", 0), [ex.id for ex in data.train])
    return smollm2_session, data, config
