"""The embedded judge: ``transformers serve`` with a local instruct model on loopback.

It is the default judge when none is configured: ``judge_environment`` yields the
configured ``MARI_JUDGE_*`` judge, else starts this one (what the repro scripts use);
``python -m mari_eval.judge serve`` runs it until interrupted and prints the exports
that point the SORRY-Bench tasks at it. With ``--preset NAME`` the same command serves a
judge preset's model instead (presets.py: a Hub id, downloaded on first use), with
``transformers serve`` or (``--server vllm``) vLLM; ``--dry-run`` prints the command line
and the exports and starts nothing.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

from mari_eval.judge.config import (ENV_API_KEY, ENV_API_KEY_FALLBACK, ENV_BASE_URL, ENV_DEADLINE, ENV_MODEL,
                                    JudgeConfig, JudgeError)
from mari_eval.judge.presets import (ENV_PRESET, PRESETS, SERVERS, Preset, find_executable, get_preset,
                                     serve_command)
from mari_eval.judge.calibration import find_calibration
from mari_eval.judge.prompt import load_prompt
from mari_eval.judge.scoring import SCORE_VERSION
from mari_eval.storage.models import DEFAULT_MODEL, display_name, resolve_model
from mari_eval.storage.numbers import flag_type

log = logging.getLogger(__name__)


# transformers serve runs concurrent requests side by side in one process; on CPU they only
# slow each other down (4 at once took 3x longer in all than one after another).
EMBEDDED_CONCURRENCY = 1
# ... and on CPU a verdict takes seconds: a judging step of a few hundred gets an hour.
EMBEDDED_DEADLINE = 3600
# ... and every token it writes costs: a compliant verdict ("#thescore: 1", the whole answer the
# judge prompt asks for) is about 6 tokens, and the 135M judge otherwise writes on to the cap
# (64 tokens: 4-5 s a verdict; 16: about 1 s).
EMBEDDED_MAX_TOKENS = 16


# Run argv[2:] in place of this process once the kernel is told to send it SIGTERM when its
# parent dies (prctl PR_SET_PDEATHSIG = 1); atexit handlers do not run on kill -9.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit('parent already gone'); os.execv(sys.argv[2], sys.argv[2:])"
)


class EmbeddedServer:
    """``transformers serve`` on loopback with a local model (the embedded default judge).

    ``start()`` waits until ``/v1/models`` answers; ``base_url`` and ``model`` are what a
    ``JudgeConfig`` needs (``config()``). ``stop()`` ends it; ``start()`` again restarts it
    on the same port. With ``preset`` it serves that judge preset's model (or ``model``, a
    copy of it) through ``server`` (``transformers`` or ``vllm``), with the Hub cache and
    network settings of this process (the model is downloaded on first use).
    """

    preset: Preset | None = None  # (class defaults: an instance built without __init__, as a test does)
    server = "transformers"

    def __init__(self, model: str | None = None, *, port: int | None = None, device: str = "auto",
                 startup_timeout: float | None = None, preset: str | None = None, server: str = "transformers",
                 host: str = "127.0.0.1") -> None:
        self.preset = get_preset(preset) if preset else None
        self.alias = model or (self.preset.model if self.preset else DEFAULT_MODEL)
        self.model = resolve_model(self.alias)  # the pinned model: requests must name it exactly
        self.server = server
        self.host = host
        self.port = port or _free_port()
        self.device = device
        # a Hub model may first be downloaded (a 7B judge: 14 GiB)
        self.startup_timeout = startup_timeout or (300.0 if self.embedded else 3600.0)
        self._dir = Path(tempfile.mkdtemp(prefix="mari-judge-serve-"))
        self._proc: subprocess.Popen | None = None
        self._atexit = False

    @property
    def embedded(self) -> bool:
        """Whether this is the embedded judge (no preset, ``transformers serve``): a local model served
        offline with the CPU settings; a preset's model is served with this process's Hub settings."""
        return self.preset is None and self.server == "transformers"

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host  # listening everywhere: ask loopback
        return f"http://{host}:{self.port}/v1"

    def config(self, **kwargs) -> JudgeConfig:
        return JudgeConfig(base_url=self.base_url, model=self.model,
                           **{"concurrency": EMBEDDED_CONCURRENCY, "deadline": EMBEDDED_DEADLINE,
                              "max_tokens": EMBEDDED_MAX_TOKENS, **kwargs})

    def env(self) -> dict[str, str]:
        """The environment variables that point the SORRY-Bench tasks at this server."""
        where = {ENV_BASE_URL: self.base_url, ENV_MODEL: self.model, **({ENV_PRESET: self.preset.name} if self.preset else {})}
        if not self.embedded:  # a GPU judge: the default settings (4 requests in flight, 64 tokens)
            return where
        return {**where, ENV_EMBEDDED: self.alias,
                "MARI_JUDGE_CONCURRENCY": str(EMBEDDED_CONCURRENCY),
                "MARI_JUDGE_MAX_TOKENS": os.environ.get("MARI_JUDGE_MAX_TOKENS") or str(EMBEDDED_MAX_TOKENS),
                ENV_DEADLINE: os.environ.get(ENV_DEADLINE) or str(EMBEDDED_DEADLINE)}

    def start(self) -> "EmbeddedServer":
        if self._proc is not None and self._proc.poll() is None:
            return self
        command = self.command(_transformers_cli() if self.server == "transformers" else find_executable(self.server))
        if sys.platform.startswith("linux"):  # a server whose parent is killed (kill -9) stops too
            command = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
        with open(self._dir / "stdout.log", "ab") as out, open(self._dir / "stderr.log", "ab") as err:
            self._proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=self._child_env())
        if not self._atexit:  # a server left running when Python exits is stopped
            atexit.register(self.stop)
            self._atexit = True
        self._wait_ready()
        log.info("%s judge %s serving at %s", "Embedded" if self.embedded else "The", self.alias, self.base_url)
        return self

    def command(self, executable: str | None = None) -> list[str]:
        """The server's command line (``presets.serve_command``)."""
        return serve_command(self.model, self.server, host=self.host, port=self.port, device=self.device,
                             executable=executable)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedServer":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def _child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (ENV_API_KEY, ENV_API_KEY_FALLBACK)}
        if not self.embedded:  # a Hub model: this process's Hub cache and token (a gated model needs one)
            return env
        hub = self._dir / "hub"  # an empty Hub cache: /v1/models scans it (and fails if it is missing)
        hub.mkdir(exist_ok=True)
        env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), TOKENIZERS_PARALLELISM="false")
        return env

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise JudgeError(f"{self.server} serve exited with code {self._proc.returncode} before answering at "
                                 f"{self.base_url}; its stderr ends with:\n{self._stderr_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise JudgeError(f"{self.server} serve did not answer at {self.base_url}/models within {self.startup_timeout:.0f} s; "
                         f"its stderr ends with:\n{self._stderr_tail()}")

    def _stderr_tail(self, chars: int = 3000) -> str:
        path = self._dir / "stderr.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


@contextlib.contextmanager
def serve_embedded(model: str | None = None, **kwargs) -> Iterator[EmbeddedServer]:
    """Start the embedded judge server; yields it (``.base_url``, ``.model``); stops it on exit."""
    with EmbeddedServer(model, **kwargs) as server:
        yield server


@contextlib.contextmanager
def judge_environment(model: str | None = None) -> Iterator[dict[str, str]]:
    """The ``MARI_JUDGE_*`` variables a judged run needs: the configured judge when
    ``MARI_JUDGE_BASE_URL`` and ``MARI_JUDGE_MODEL`` are set, else the embedded judge,
    started here and stopped on exit (what the repro scripts use)."""
    if os.environ.get(ENV_BASE_URL) and os.environ.get(ENV_MODEL):
        yield {ENV_BASE_URL: os.environ[ENV_BASE_URL], ENV_MODEL: os.environ[ENV_MODEL]}
        return
    log.info("No judge configured (%s, %s): starting the embedded one", ENV_BASE_URL, ENV_MODEL)
    with serve_embedded(model) as server:
        yield server.env()


# Set beside MARI_JUDGE_MODEL when the embedded judge was started by this process (``judge_environment``):
# its model is then named by its alias, as before it started, so a cache key is the same either side.
ENV_EMBEDDED = "MARI_JUDGE_EMBEDDED"


def judge_identity() -> dict[str, object]:
    """What makes a judged evaluation's verdicts what they are, without starting anything: the
    model ``judge_environment`` would use (the configured ``MARI_JUDGE_MODEL``, else the embedded
    one), the prompt (name and sha256; ``load_prompt``) and the verdict parser's version. Part of
    every judged evaluation's cache key and recorded in its table (repro/engine/judged.py)."""
    configured = os.environ.get(ENV_BASE_URL) and os.environ.get(ENV_MODEL)
    embedded = os.environ.get(ENV_EMBEDDED) if configured else DEFAULT_MODEL  # started here, or to be
    prompt = load_prompt()  # the preset's, when MARI_JUDGE_PRESET names one
    identity = {"model": f"{embedded} (embedded)" if embedded else os.environ[ENV_MODEL],
                "prompt": prompt.name, "prompt_sha256": prompt.sha256, "parser": prompt.parser_version}
    if not embedded:
        # A configured server's verdicts are scored where it gives log-probabilities (client.py), against the
        # threshold of its calibration file if it has one. The embedded judge's are parsed, as before scoring
        # existed (transformers serve gives none), so its identity, and every stored step's key, is unchanged.
        calibration = find_calibration(display_name(os.environ[ENV_MODEL]), prompt.name, prompt.sha256, "server")
        identity["scored"] = {"version": SCORE_VERSION, "threshold": calibration.threshold if calibration else None}
    return identity


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transformers_cli() -> str:
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise JudgeError(f"transformers serve needs {', '.join(missing)}: pip install 'mari-eval[serve]' "
                         f"(or pip install 'transformers[serving]')")
    return find_executable("transformers")


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m mari_eval.judge serve``: run the embedded judge (or a preset's) until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m mari_eval.judge")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the embedded judge model, or a judge preset's, and print the exports")
    serve.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="serve this judge preset's model (a Hub id) and print MARI_JUDGE_PRESET with the exports")
    serve.add_argument("--model", default=None, help="embedded alias, local model directory or Hub id (default: the "
                       "preset's model, else the embedded one)")
    serve.add_argument("--server", choices=SERVERS, default="transformers", help="transformers serve or vllm serve")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=flag_type(integer=True, lo=0, hi=65535), default=None, help="default: a free port (8000 with --dry-run)")
    serve.add_argument("--device", default="auto", help="transformers serve's device (vLLM: CUDA_VISIBLE_DEVICES)")
    serve.add_argument("--dry-run", action="store_true", help="print the server's command line and the exports; "
                       "start nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    options = dict(preset=args.preset, server=args.server, host=args.host, device=args.device)
    if args.dry_run:
        server = EmbeddedServer(args.model, port=args.port or 8000, **options)
        print(" ".join(shlex.quote(word) for word in server.command()))
        print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in server.env().items()), flush=True)
        server.close()
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwind, so that the server is stopped
    with serve_embedded(args.model, port=args.port, **options) as server:
        print("export " + " ".join(f"{k}={v}" for k, v in server.env().items()), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while server._proc is not None and server._proc.poll() is None:
                time.sleep(1)
