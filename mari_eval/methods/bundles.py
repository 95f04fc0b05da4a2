"""Reading a bundle back (``load_bundle``): bundle.json, then the weights (safetensors, never a
pickle), each checked against what its method declares (``mari_eval.methods.bundle_spec``) once, with the
file named in every error; the method's class found by name (``mari_eval.methods.registry``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mari_eval.methods.bundle_spec import (BUNDLE_JSON, BUNDLE_WEIGHTS, BundleError, _json_type, _shown, check_config,
                                           check_tensors)
from mari_eval.storage.files import recover_directory
from mari_eval.methods.intervention import Intervention
from mari_eval.methods.registry import method_class, method_names


def load_bundle(directory: str | Path, source: dict[str, Any] | None = None) -> Intervention:
    """The bundle in ``directory``, checked (``bundle_spec``); ``source``: where it was fetched from
    (``mari_eval.methods.hub``: a Hub bundle), reported by ``describe``. A Hub reference is ``hub.load_bundle``'s."""
    from safetensors import SafetensorError  # deferred: safetensors is heavy; only this path needs it
    from safetensors.torch import load_file  # deferred: safetensors is heavy; only this path needs it

    directory = Path(directory)
    meta_path, weights_path = directory / BUNDLE_JSON, directory / BUNDLE_WEIGHTS
    if not meta_path.is_file():
        recover_directory(directory)  # a save that died between its renames: the previous bundle goes back
    for path in (meta_path, weights_path):
        if not path.is_file():
            raise BundleError(f"{path} is missing: '{directory}' is not a complete bundle (train one with `mari-eval train`)")
    config = _read_config(meta_path)
    name = config.pop("method", None)
    if not isinstance(name, str) or name not in method_names():
        raise BundleError(f"{meta_path} names method {_shown(name)}; known methods: {method_names()}")
    cls = method_class(name)
    check_config(cls, config, str(meta_path))  # before the weights: a bad config is named as such
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError, ValueError) as e:
        raise BundleError(f"{weights_path} is not a readable safetensors file: {_why_unreadable(weights_path, e)}") from None
    check_tensors(cls, config, tensors, str(meta_path), str(weights_path))
    bundle = cls(config, tensors, checked=True)
    bundle.source = source
    return bundle


def _read_config(path: Path) -> dict[str, Any]:
    """bundle.json as a dict, or a BundleError naming the file and what is wrong with it."""
    damaged = "the bundle is damaged: copy it again or retrain it"
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BundleError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); {damaged}") from None
    except OSError as e:
        raise BundleError(f"{path} cannot be read ({e.strerror or e}); check its permissions") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise BundleError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {damaged}") from None
    except RecursionError:
        raise BundleError(f"{path} is not a bundle's JSON: it is nested too deeply to read; {damaged}") from None
    if not isinstance(config, dict):
        raise BundleError(f"{path} holds {_json_type(config)}, not a JSON object; {damaged}")
    return config


def _why_unreadable(path: Path, error: Exception) -> str:
    head = path.read_bytes()[:2]
    # torch.save writes a zip archive ("PK"); a bare pickle starts with the PROTO opcode 0x80.
    if head == b"PK" or head[:1] == b"\x80":
        return ("it is a pickle (torch.save) file. Bundles are never unpickled, since unpickling runs code; "
                "save the tensors with safetensors.torch.save_file, or retrain with `mari-eval train`.")
    return f"it is truncated or damaged ({error}). Copy the bundle again or retrain it."
