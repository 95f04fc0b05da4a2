"""``--executor ray`` (repro/engine/ray_executor.py) on a local Ray cluster: the same table as the local
executor with a worker killed in the middle of a step, and two drivers on one ``--runs``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from repro.engine import ray_executor, steps

ray = pytest.importorskip("ray")  # installed by the test extra (pyproject.toml)

REPO = Path(__file__).resolve().parents[1]
SELECTION = ["--smoke", "--methods", "vanilla,caa", "--columns", "tqa_mc1,tqa_mc2"]  # MC2: a float, not 0/1


def main_table(runs: Path, out: Path, *extra: str, wait: bool = True):
    command = [sys.executable, str(REPO / "repro" / "main_table.py"), *SELECTION, "--runs", str(runs), "--out", str(out),
               *extra]
    if not wait:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def numbers(out: Path) -> dict:
    return json.loads((out / "main_table.json").read_text())["models"]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    root = tmp_path_factory.mktemp("local")
    main_table(root / "runs", root / "out")
    return root


def test_an_address_nothing_listens_on_is_refused_at_once_naming_it_and_the_reason():
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(SystemExit, match=rf"--ray-address 127.0.0.1:{port}: no Ray cluster answers at 127.0.0.1:{port} "
                                         r"within 10 s \(Connection refused\)"):
        ray_executor.connect(ray, f"127.0.0.1:{port}")
    assert time.monotonic() - started < ray_executor.CONNECT_TIMEOUT_S  # refused, not waited out
    with pytest.raises(SystemExit, match="--ray-address nohost: not an address"):
        ray_executor.connect(ray, "nohost")


def test_an_address_that_answers_but_never_lets_ray_in_ends_the_driver_with_the_address():
    # A TCP listener that accepts and says nothing: Ray's client waits on it for ever on its own.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.run([sys.executable, "-c", "import sys; from repro.engine import ray_executor as r; "
                               "r.connect(r._ray(), sys.argv[1]); print('connected')", address],
                              capture_output=True, text=True, cwd=REPO, timeout=300,
                              env={**os.environ, "MARI_RAY_INIT_TIMEOUT_S": "5", "RAY_ADDRESS": ""})
    assert proc.returncode == ray_executor.INIT_TIMEOUT_EXIT, proc.stdout + proc.stderr[-3000:]
    assert f"--ray-address {address}: Ray did not connect within 5 s" in proc.stderr
    assert "connected" not in proc.stdout


def test_a_claim_is_exclusive_and_freed_when_its_holder_exits(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from repro.engine.ray_executor import claim; fd = claim(Path(sys.argv[1]), 'step'); "
                               "print(fd is not None, flush=True); time.sleep(60)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "True"
        assert ray_executor.claim(tmp_path, "step") is None  # held by the other process
        other = ray_executor.claim(tmp_path, "another step")
        assert other is not None
        os.close(other)
    finally:
        holder.kill()
        holder.wait()
    fd = ray_executor.claim(tmp_path, "step")  # its holder died: the kernel freed it
    assert fd is not None
    os.close(fd)


def _step_worker(label: str) -> int | None:
    """The pid of the Ray worker running the task named ``label`` (its process title), if any."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if label in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    return int(proc.name)
            except OSError:
                continue
    return None


@pytest.mark.e2e
@pytest.mark.needs_data
def test_a_worker_killed_mid_step_is_run_again_and_the_table_equals_the_local_executors(local, tmp_path):
    # One Ray run covers both: every number equal to the local executor's, and a killed worker's step run again.
    driver = main_table(tmp_path / "runs", tmp_path / "out", "--executor", "ray", wait=False)
    killed, deadline = None, time.time() + 300
    while killed is None and time.time() < deadline and driver.poll() is None:
        pid = _step_worker("ray::step train caa")
        if pid is not None:
            time.sleep(3)  # in the middle of the step
            os.kill(pid, signal.SIGKILL)
            killed = pid
        time.sleep(0.5)
    output, _ = driver.communicate(timeout=900)
    assert killed is not None, "the training step's worker was never seen running: " + output[-2000:]
    assert driver.returncode == 0, output[-4000:]
    assert numbers(tmp_path / "out") == numbers(local / "out")
    assert "steps done 2/2" in output  # the progress view
    assert sorted(p.name for p in (tmp_path / "runs" / "bundles").iterdir() if p.is_dir()) == \
        sorted(p.name for p in (local / "runs" / "bundles").iterdir() if p.is_dir())


@pytest.mark.e2e
@pytest.mark.needs_data
def test_a_step_another_driver_claimed_is_waited_for_not_computed(local, tmp_path, monkeypatch):
    from repro import main_table as table
    from repro.engine import cache, profiles

    runs = tmp_path / "runs"
    profile = profiles.PROFILES["smoke"]
    store = cache.Store(runs)
    columns = [c for c in table.BENCHMARKS if c[0] == "tqa_mc1"]
    planned = table.plan(profile, store, ["vanilla", "caa"], columns)
    (train,) = [s for s in planned.steps.values() if s.kind == "train"]
    graph = steps.Graph({train.key: train})  # the training step alone: what two drivers could both compute
    fd = ray_executor.claim(runs, train.key)  # "another driver" holds the training step

    def the_other_driver_finishes():
        time.sleep(8)
        shutil.copytree(local / "runs" / "bundles" / train.key, runs / "bundles" / train.key)
        os.close(fd)

    monkeypatch.setattr(ray_executor, "POLL_S", 0.5)
    other = threading.Thread(target=the_other_driver_finishes)
    other.start()
    try:
        counts = ray_executor.run(graph, store, profile)
    finally:
        other.join()
        ray.shutdown()
    assert counts == {"computed": 0, "by_another_driver": 1, "seconds": counts["seconds"]}
    assert counts["seconds"] >= 8  # it waited for the other driver's bundle
    assert not list((runs / "bundles").glob(f"{train.key}.partial-*"))
    assert (runs / "bundles" / train.key / "weights.safetensors").read_bytes() == \
        (local / "runs" / "bundles" / train.key / "weights.safetensors").read_bytes()
