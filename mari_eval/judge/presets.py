"""Judge presets: the judge model a SORRY-Bench refusal rate is read by, with the prompt it is asked
with (and so the parser of its answers), and the command that serves it.

* ``sorry-bench-base``: Mistral-7B-Instruct-v0.2 asked with SORRY-Bench's "base-#thescore" template
  (it answers ``#thescore: 0/1``): a prompt-based judge, not SORRY-Bench's official scorer.
* ``sorry-bench-ft``: SORRY-Bench's fine-tuned Mistral-7B-Instruct-v0.2 judge, asked with the
  template it was trained on (it answers ``0`` or ``1``): the judge of SORRY-Bench's own
  fulfilment rates (Xie et al., 2024).

``MARI_JUDGE_PRESET=NAME`` picks one: the prompt follows (``prompt.load_prompt``), and with it the
parser and the judge's identity (``server.judge_identity``). ``MARI_JUDGE_BASE_URL`` and
``MARI_JUDGE_MODEL`` still say where the judge is served and under which name.
``serve_command`` is the command line that serves a model with ``transformers serve`` or vLLM
(``python -m mari_eval.judge serve --preset NAME [--server vllm]`` runs it and prints the exports).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from mari_eval.judge.config import JudgeError

ENV_PRESET = "MARI_JUDGE_PRESET"
SERVERS = ("transformers", "vllm")  # what serves a judge: ``transformers serve`` or ``vllm serve``


@dataclass(frozen=True)
class Preset:
    name: str
    model: str  # the judge model's Hugging Face id
    prompt: str  # the prompt it is asked with (a ``load_prompt`` name; the prompt names its parser)
    about: str


PRESETS = {p.name: p for p in (
    Preset("sorry-bench-base", "mistralai/Mistral-7B-Instruct-v0.2", "base-#thescore",
           "Mistral-7B-Instruct-v0.2 with SORRY-Bench's base-#thescore prompt (a prompt-based judge; the "
           "prompt is read from $MARI_DATA_DIR/sorry_bench/judge_prompts.jsonl.gz)"),
    Preset("sorry-bench-ft", "sorry-bench/ft-mistral-7b-instruct-v0.2-sorry-bench-202406",
           "base-ft-mistral-7b-instruct-v0.2",
           "SORRY-Bench's fine-tuned judge with the prompt it was trained on (answers 0 or 1)"),
)}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise JudgeError(f"No judge preset named {name!r} ({ENV_PRESET} or --preset): the presets are "
                         f"{', '.join(sorted(PRESETS))}; pick one, or unset {ENV_PRESET} for the default prompt")
    return PRESETS[name]


def current_preset() -> Preset | None:
    """The preset ``$MARI_JUDGE_PRESET`` names (None when unset)."""
    name = os.environ.get(ENV_PRESET, "").strip()
    return get_preset(name) if name else None


def serve_command(model: str, server: str = "transformers", *, host: str = "127.0.0.1", port: int = 8000,
                  device: str = "auto", executable: str | None = None) -> list[str]:
    """The command line that serves ``model`` on ``host:port`` with an OpenAI-compatible API, under the
    name ``model`` (what MARI_JUDGE_MODEL is then set to). ``transformers serve`` answers requests for
    that model alone (it is preloaded); vLLM serves it under that name by default and picks its GPUs
    from CUDA_VISIBLE_DEVICES (``device`` is for ``transformers serve``)."""
    if server not in SERVERS:
        raise JudgeError(f"No judge server {server!r}: it is one of {', '.join(SERVERS)}")
    program = executable or server
    if server == "vllm":
        return [program, "serve", model, "--host", host, "--port", str(port)]
    return [program, "serve", model, "--host", host, "--port", str(port), "--device", device, "--log-level", "warning"]


def find_executable(server: str) -> str:
    """The ``transformers`` or ``vllm`` command beside this Python, else on PATH; the fix when missing."""
    beside = Path(sys.executable).with_name(server)
    found = str(beside) if beside.exists() else shutil.which(server)
    if found:
        return found
    install = ("pip install vllm (on a machine with a GPU), or serve with --server transformers" if server == "vllm"
               else "reinstall transformers (pip install 'mari-eval[serve]')")
    raise JudgeError(f"The '{server}' command was not found beside this Python or on PATH: {install}")
