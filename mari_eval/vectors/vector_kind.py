"""What an imported tensor must be before it is read as a steering vector (issue 83.4): a dense tensor
of real floating-point numbers, with values. ``check_kind`` is the one check every importer calls
(an lm-eval ``.pt`` steering config, an SAE's safetensors, a ``SteeringVector``, a pyreft save); a GGUF
direction is F32 by its reader's own check (``control_vector_files.read_gguf``).

Why: ``tensor.float()`` converts whatever it is given without a word. A complex vector loses its
imaginary part (torch warns once, then carries on), an integer or boolean tensor (a mask, indices)
becomes a "direction" of 0s and 1s, and a sparse tensor is refused later by an unrelated operation.
Each is refused here, naming the file and the key (``where``) and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from mari_eval.methods.bundle_spec import BundleError


def check_kind(tensor: Any, where: str) -> torch.Tensor:
    """``tensor`` itself when it is a dense real floating-point tensor with values; otherwise a
    BundleError naming ``where`` (the file and the key), what the tensor is and the fix."""
    if not torch.is_tensor(tensor):
        raise BundleError(f"{where} is a {type(tensor).__name__}, not a tensor; save the vector as a torch tensor")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.layout != torch.strided:
        raise BundleError(f"{where} is a sparse tensor ({str(tensor.layout).removeprefix('torch.')}); a steering "
                          "vector is dense: save tensor.to_dense() in its place")
    if tensor.is_quantized:
        raise BundleError(f"{where} is a quantized tensor ({dtype}); save tensor.dequantize() in its place")
    if tensor.is_complex():
        raise BundleError(f"{where} is complex ({dtype}): reading it as a real vector would drop its imaginary part. "
                          "Save the real vector you mean (tensor.real, or tensor.abs()) as float32")
    if not tensor.is_floating_point():
        what = "boolean (a mask?)" if tensor.dtype == torch.bool else f"of integers ({dtype}; indices or counts?)"
        raise BundleError(f"{where} is {what}, not a direction of real numbers; save the vector itself as float32 "
                          "(tensor.float() if these integers are its values)")
    if tensor.is_meta:
        raise BundleError(f"{where} is on the meta device: it has a shape but no values; save the loaded vector")
    return tensor
