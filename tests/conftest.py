"""Shared fixtures: the embedded model (materialised once per machine) and the data folder."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HARNESS_TASKS = REPO / "harness_tasks"

# Nothing here may reach the Hub; .ci/run sets this too.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# MARI_DATA_DIR may be relative (.ci/run uses ../shared/data from the repository root);
# make it absolute so that subprocesses started in another directory see the same folder.
if os.environ.get("MARI_DATA_DIR"):
    os.environ["MARI_DATA_DIR"] = str(Path(os.environ["MARI_DATA_DIR"]).resolve())


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MARI_DATA_DIR"):
        return
    skip = pytest.mark.skip(reason="MARI_DATA_DIR is not set: these tests read the local benchmark copy")
    for item in items:
        if "needs_data" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_data: reads benchmarks from $MARI_DATA_DIR")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from mari_eval.models import resolve_model

    return resolve_model("smollm2-135m-instruct")
