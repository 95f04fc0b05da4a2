"""``--executor ray``: a repro script's steps (repro/engine/steps.py) as Ray tasks, on a local cluster or
one at ``--ray-address`` (issue 40).

Each step not stored under ``--runs`` becomes one Ray task with the resources it needs (its GPUs
on a machine with GPUs, else one CPU), started once its inputs exist: an evaluation after the
bundles of its rows. A worker needs no shared filesystem: it receives its inputs' files (the
bundles an evaluation reads) from the driver through Ray, computes the step with the same code
as the local executor (the step's action, repro/engine/steps.py: ``Store.bundle``, or
``scoring.evaluate_group`` with the rows of a group still sharing one pass) under a temporary
folder of its own, and returns the files it wrote. The
driver writes them into its ``--runs`` as they arrive, each whole (a bundle through a partial
directory renamed into place, an evaluation by an atomic rename), so ``--runs`` stays the one
record: once every step is stored, the script reads the table back from it exactly as after a
local run, and the numbers are the same.

Faults. Ray runs a task again when its worker dies (``max_retries``), from the start: the
step's partial files lived in the dead worker's folder. A driver killed and started again finds
every finished step in ``--runs`` and submits only the others. Two drivers on one ``--runs`` do
not compute a step twice: before submitting a step a driver claims it (``claim``: an exclusive
``flock`` on ``runs/claims/KEY.lock``, released by the kernel when its holder exits however it
exits); a step claimed by another driver is waited for, and taken over if its claim is freed
without its files appearing.

Connecting. Ray itself waits for an address that does not answer (or a cluster that refuses this
machine) for minutes or for ever; the driver gives up sooner, naming the address and the reason:
an address nothing listens on within CONNECT_TIMEOUT_S (a TCP connection, before Ray), a cluster
that accepts the connection but does not let Ray in within INIT_TIMEOUT_S (``ray.init``).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from mari_eval.storage.files import atomic_write
from repro.engine import steps
from repro.engine.cache import Store
from repro.engine.profiles import Profile

log = logging.getLogger("repro")
MAX_RETRIES = 3  # runs of a step whose worker died, after the first
POLL_S = 2.0  # how often the driver looks for steps claimed by another driver
CONNECT_TIMEOUT_S = 10.0  # a --ray-address that takes no TCP connection within this is refused
INIT_TIMEOUT_S = float(os.environ.get("MARI_RAY_INIT_TIMEOUT_S", 120))  # then ray.init has this long
INIT_TIMEOUT_EXIT = 2  # the driver's exit status when ray.init ran out of time (argparse's for a bad argument)


def _ray():
    try:
        import ray  # optional: pip install mari-eval[ray]
    except ImportError:
        raise SystemExit("--executor ray needs Ray: pip install 'mari-eval[ray]' (or pip install ray)") from None
    return ray


def check_reachable(ray, address: str | None) -> None:
    """Refuse ``address`` (``--ray-address``: auto, HOST:PORT or ray://HOST:PORT) when nothing takes a
    TCP connection there within CONNECT_TIMEOUT_S; None (a local cluster started here) is not checked."""
    if address is None or address == "local":
        return
    target = address.removeprefix("ray://")
    if target == "auto":
        try:  # Ray's own reading of "auto" (RAY_ADDRESS, then the cluster started on this machine)
            target = ray._private.services.canonicalize_bootstrap_address(target)
        except Exception:  # noqa: BLE001 - a private helper: where it is missing or raises, ray.init speaks
            return
        if not target:
            return  # no cluster found: ray.init says so at once
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(f"--ray-address {address}: not an address (auto, HOST:PORT or ray://HOST:PORT; "
                         "`ray status` on the head node prints it)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        reason = "no answer" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise SystemExit(f"--ray-address {address}: no Ray cluster answers at {host}:{port} within "
                         f"{CONNECT_TIMEOUT_S:.0f} s ({reason}): start one there (`ray start --head`), give the "
                         "address `ray status` prints, or drop --ray-address for a local cluster") from None


def _give_up_after(seconds: float, address: str | None) -> threading.Timer:
    """A timer that ends the driver when ``ray.init`` has not returned within ``seconds``: Ray's
    client retries inside native code, where no exception reaches it; nothing has run yet."""
    def give_up():
        sys.stderr.write(f"--ray-address {address or 'local'}: Ray did not connect within {seconds:.0f} s (the address "
                         "answers but its cluster does not let this driver in: a different Ray version, a cluster "
                         "that requires authentication, or a firewall between the nodes); nothing was computed. "
                         "Check `ray status` there, or raise MARI_RAY_INIT_TIMEOUT_S\n")
        sys.stderr.flush()
        os._exit(INIT_TIMEOUT_EXIT)
    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    return timer


def connect(ray, address: str | None):
    """``ray.init`` at ``address`` (``check_reachable`` first, ``_give_up_after`` INIT_TIMEOUT_S), with
    the environment a step reads (MARI_*, HF_*, TOKENIZERS_PARALLELISM) passed to the workers."""
    check_reachable(ray, address)
    deadline = _give_up_after(INIT_TIMEOUT_S, address)
    deadline.start()
    try:
        return ray.init(address=address, ignore_reinit_error=True, logging_level=logging.WARNING,
                        runtime_env={"env_vars": {k: v for k, v in os.environ.items()
                                                  if k.startswith(("MARI_", "HF_")) or k == "TOKENIZERS_PARALLELISM"}})
    finally:
        deadline.cancel()


# ----------------------------------------------------------------------------- on the workers


def _files_under(root: Path, relative: Path) -> dict[str, bytes]:
    base = root / relative
    paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in paths}


def _place(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def run_step(action: steps.Train | steps.Evaluate, profile: Profile, placement, threads: int,
             *inputs: dict[str, bytes]) -> dict[str, bytes]:
    """Compute one step in a folder of its own and return the files it wrote ({path under --runs:
    bytes}). ``inputs``: the files of the steps it reads (bundles), as the driver sent them.
    ``threads``: the driver's CPU threads, which the step computes with (Ray gives a one-CPU task
    one thread): a float sum split over another number of threads rounds differently, and the
    table would then differ from the local executor's in the last digits."""
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="mari-eval-step-") as tmp:
        root = Path(tmp)
        for files in inputs:
            _place(root, files)
        written = action.compute(Store(root, placement=placement), profile)
        wrote = written.relative_to(root) if written is not None else Path("evaluations")  # a bundle, or evaluations
        return _files_under(root, wrote) if (root / wrote).exists() else {}


# ----------------------------------------------------------------------------- on the driver


def claim(runs: Path, key: str) -> int | None:
    """An open descriptor holding ``runs/claims/<key>.lock`` exclusively, or None when another live
    process holds it. Closing the descriptor (or the holder's exit) releases the claim."""
    lock = runs / "claims" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{socket.gethostname()} {os.getpid()} {key}\n".encode(), 0)
    return fd


def _store_files(runs: Path, step: steps.Step, files: dict[str, bytes]) -> None:
    """Write a finished step's files into ``runs``, each whole: a bundle's directory under a
    partial name renamed into place, an evaluation file by an atomic rename."""
    if step.kind == steps.TRAIN:
        final = runs / "bundles" / step.key
        partial = final.with_name(f"{final.name}.partial-driver-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        _place(runs, {name.replace(f"bundles/{step.key}/", f"bundles/{partial.name}/", 1): data
                      for name, data in files.items()})
        shutil.rmtree(final, ignore_errors=True)  # a damaged one (the plan found it not stored)
        os.replace(partial, final)
    else:
        for name, data in files.items():
            atomic_write(runs / name, data)


def _inputs(runs: Path, step: steps.Step, refs: dict) -> list:
    """The files of the steps ``step`` reads: the Ray reference of one computed now, else the
    files stored under ``runs``."""
    return [refs[need] if need in refs else _files_under(runs, Path("bundles") / need) for need in step.needs]


def run(graph: steps.Graph, store: Store, profile: Profile, address: str | None = None) -> dict:
    """Run every step of ``graph`` not stored under ``store.root`` on Ray (``address``: a running
    cluster, ``auto`` for the one this machine belongs to; None: a local cluster started here);
    returns counts of the steps computed here and by another driver."""
    if any(not s.cached and not s.action for s in graph.steps.values()):
        raise ValueError("a step without an action cannot run on Ray: build the graph with the script's plan()")
    ray = _ray()
    started = time.time()
    context = connect(ray, address)
    url = getattr(context, "dashboard_url", None)
    if url:
        log.info("Ray dashboard: http://%s", url)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    threads = step_threads(ray)  # every step computes as this process would (run_step)
    remote = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(run_step)
    runs, tail = store.root, graph.tail()
    pending = sorted((s for s in graph.order() if not s.cached), key=lambda s: -tail[s.key])
    done = {s.key for s in graph.steps.values() if s.cached}
    refs: dict[str, object] = {}  # step key -> Ray reference of its files (steps submitted by this driver)
    in_flight: dict[object, tuple[steps.Step, int]] = {}  # Ray reference -> (step, claim)
    counts = {"computed": 0, "by_another_driver": 0}
    while pending or in_flight:
        for step in list(pending):
            if not all(n in done or n in refs for n in step.needs):
                continue
            if _stored(store, step):  # another driver finished it meanwhile
                pending.remove(step)
                done.add(step.key)
                counts["by_another_driver"] += 1
                continue
            fd = claim(runs, step.key)
            if fd is None:
                continue  # another driver computes it: looked at again at the next poll
            resources = {"num_gpus": min(step.gpus, gpus)} if gpus else {"num_cpus": threads}
            ref = remote.options(**resources, name=f"step {step.label}").remote(
                step.action, profile, store.placement, threads, *_inputs(runs, step, refs))
            refs[step.key], in_flight[ref] = ref, (step, fd)
            pending.remove(step)
        if not in_flight:
            time.sleep(POLL_S)
            continue
        ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=POLL_S)
        for ref in ready:
            step, fd = in_flight.pop(ref)
            try:
                _store_files(runs, step, ray.get(ref))
            finally:
                os.close(fd)  # the claim
            done.add(step.key)
            counts["computed"] += 1
            _progress(graph, done, in_flight, pending, started)
    return {**counts, "seconds": round(time.time() - started, 1)}


def step_threads(ray) -> int:
    """The CPU threads (and, on a cluster without GPUs, the CPUs) each step takes: this process's
    torch threads, so that a step's float sums round as in a local run and the table is the local
    executor's number for number; at most the CPUs of the largest node, where a warning says the
    last digits may then differ."""
    threads = torch.get_num_threads()
    largest = max((int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")), default=threads)
    if largest < threads:
        log.warning("the largest Ray node has %d CPUs against this process's %d threads: steps compute with %d, "
                    "and their float results may differ from a local run's in the last digits", largest, threads, largest)
    return max(1, min(threads, largest))


def _stored(store: Store, step: steps.Step) -> bool:
    """Whether a step's outputs are in ``store`` now (written by another driver after the plan)."""
    if step.kind == steps.TRAIN:  # a bundle directory appears whole (renamed into place)
        return (store.root / "bundles" / step.key / "bundle.json").is_file()
    return step.action.stored(store)


def _progress(graph: steps.Graph, done: set, in_flight: dict, pending: list, started: float) -> None:
    """Steps done / running / waiting, and the time left by the cost estimates (scaled by the
    pace so far)."""
    left = sum(graph.steps[k].seconds for k in graph.steps if k not in done)
    spent = sum(graph.steps[k].seconds for k in done if not graph.steps[k].cached)
    pace = (time.time() - started) / spent if spent else 1.0
    log.info("[ray] steps done %d/%d, running %d, waiting %d; about %.0f s left", len(done), len(graph.steps),
             len(in_flight), len(pending), left * pace)

