"""Where the frozen model computes: the placement a user chooses (``Placement``: dtype, device,
device map), and, also under accelerate's device maps and CPU offload, the device its inputs
go to, the device a decoder layer runs on, and an offloaded weight's values. (With offload
a parameter is a meta tensor; the device is named by accelerate's hook.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mari_eval.injection.site import SiteError, check_layer, decoder_layers


@dataclass(frozen=True)
class Placement:
    """Where and in which precision the frozen model runs (``mari-eval train --dtype --device --device-map``).

    ``dtype`` "auto" takes the checkpoint's own (bf16 for the paper's models), as lm-eval's
    ``--model hf`` does; ``device_map="auto"`` spreads the layers over the visible GPUs
    (and the CPU / disk beyond ``max_memory``), as ``parallelize=True`` does in lm-eval.
    Trained parameters are float32 on the site layer's device whatever is chosen here.
    """

    dtype: str = "auto"
    device: str | None = None  # default: cuda when available, else cpu
    device_map: str | None = None  # None or "auto"
    max_memory_per_gpu: str | None = None
    max_cpu_memory: str | None = None

    def __post_init__(self):
        if self.device_map not in (None, "auto"):
            raise ValueError(f"device_map={self.device_map!r}: use 'auto' (spread over the devices) or leave it unset")
        if self.device_map is None and (self.max_memory_per_gpu or self.max_cpu_memory):
            raise ValueError("max memory per device applies to device_map='auto' only; add --device-map auto")

    def model_args(self) -> dict[str, Any]:
        """MariLM / HFLM keyword arguments."""
        args: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        if self.device_map == "auto":
            args.update(parallelize=True, max_memory_per_gpu=self.max_memory_per_gpu, max_cpu_memory=self.max_cpu_memory)
        return args


def check_device(device: str | None, flag: str = "--device") -> None:
    """A ValueError naming ``device`` and the fix when torch here cannot compute on it (a name torch does not
    know, CUDA on a machine without it, a GPU index past the last): refused before any model loads, not an
    AssertionError from inside torch once it has."""
    if device is None:
        return
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{flag} {device!r}: not a device torch knows; give cpu, cuda, cuda:N or mps, or leave it "
                         "out (cuda when available, else cpu)") from None
    if found.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"{flag} {device}: {why} (torch {torch.__version__}); give {flag} cpu, or leave it out "
                             "(cuda when available, else cpu)")
        if found.index is not None and found.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif found.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag} {device}: MPS is not available here; give {flag} cpu, or leave it out")
    elif found.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{flag} {device}: a {found.type} device is not one models are placed on here; give cpu, "
                         "cuda, cuda:N or mps")


def input_device(model: nn.Module) -> torch.device:
    """Where a forward pass's inputs go: the device the embedding layer computes on.

    With a device map (accelerate), an offloaded embedding's weight is a meta tensor and
    its hook names the device it runs on; otherwise it is the weight's device.
    """
    embedding = model.get_input_embeddings()
    return _execution_device([embedding]) or embedding.weight.device


def layer_device(model: nn.Module, layer: int) -> torch.device:
    """The device decoder layer ``layer`` computes on (its accelerate hook's, else its weights')."""
    block = decoder_layers(model)[check_layer(model, layer)]
    # The hook sits on the layer, or on its submodules when offloaded.
    return _execution_device(block.modules()) or next(p.device for p in block.parameters())


def _execution_device(modules) -> torch.device | None:
    """The device the first accelerate hook on ``modules`` runs them on (None without one)."""
    for module in modules:
        for hook in _accelerate_hooks(module):
            if getattr(hook, "execution_device", None) is not None:
                return torch.device(hook.execution_device)
    return None


def _accelerate_hooks(module: nn.Module) -> list:
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(getattr(hook, "hooks", None) or [hook])


def weight_of(model: nn.Module, module: nn.Module) -> torch.Tensor:
    """``module.weight`` with its values, also when accelerate offloaded it (a meta tensor
    whose values live in a hook's weights map, on the CPU or on disk)."""
    weight = module.weight
    if weight.device.type != "meta":
        return weight
    names = {m: name for name, m in model.named_modules()}
    target = names[module]
    for owner, name in names.items():  # the hook holding the map sits on the module or on an ancestor
        if name and target != name and not target.startswith(name + "."):
            continue
        relative = target[len(name):].lstrip(".")
        for hook in _accelerate_hooks(owner):
            weights = getattr(hook, "weights_map", None)
            if weights is not None:
                try:
                    return weights[f"{relative}.weight" if relative else "weight"]
                except KeyError:
                    continue
    raise SiteError(f"The weight of {target} is offloaded and no accelerate hook holds its values")


@contextlib.contextmanager
def subnormals_flushed() -> Iterator[bool]:
    """CPU arithmetic with subnormal floats (below 1.2e-38 in float32) read and written as zero
    while the block runs (``torch.set_flush_denormal``: x86's FTZ/DAZ; GPUs are unaffected).

    Training needs it for speed only: as MARI's experts train, subnormal values appear in the
    backward pass and each CPU instruction that meets one is many times slower. On TruthfulQA's
    100 training questions (2 cores) the expert epochs took 46, 55 and 69 s; flushed, 47, 47 and
    45 s, with the same losses to five digits. Numbers that small add nothing a float32 sum keeps.
    Yields whether the CPU supports it; turned off again afterwards (torch's default; it has no getter).
    """
    supported = torch.set_flush_denormal(True)
    try:
        yield supported
    finally:
        if supported:
            torch.set_flush_denormal(False)
