"""Control vector files: the GGUF layout llama.cpp and repeng write, read (``read_gguf``) and
written (``write_gguf``).

The layout (written by repeng's ``ControlVector.export_gguf`` and by llama.cpp's
``llama-cvector-generator``, ``export_gguf`` in tools/cvector-generator/cvector-generator.cpp):
``general.architecture = "controlvector"``, ``controlvector.model_hint`` (the architecture the
vector was made for: repeng writes the Hugging Face ``model_type``, llama.cpp the model's GGUF
architecture), ``controlvector.layer_count``, and one 1-D F32 tensor ``direction.N`` per layer.
What ``N`` means is stated, with its sources, in ``mari_eval.vectors.control_vector``'s docstring; this
module reads the file and refuses, naming the problem and the fix, what llama.cpp would not load
(``common_control_vector_load_one`` in common/common.cpp): a file that is not a control vector, a
tensor name that is not ``direction.N`` with N >= 1, a tensor that is not 1-D F32, directions of
different widths. Non-finite values are refused too (llama.cpp would add them).

``write_gguf`` writes that layout with the ``gguf`` package's ``GGUFWriter``, the keys as repeng's
``export_gguf`` (repeng/extract.py) sets them: the architecture given to the writer (it records
``general.architecture``), ``controlvector.model_hint`` a string, ``controlvector.layer_count`` a
uint32, then ``direction.N`` per layer, N ascending. llama.cpp's loader goes by the tensors alone;
the two keys are for repeng's ``import_gguf`` and for people. Directions that ``read_gguf`` would
refuse (layer 0, different widths, non-finite values) are refused before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mari_eval.methods.bundle_spec import BundleError
from mari_eval.storage.files import atomic_write_with, file_sha256
from mari_eval.storage.numbers import NumberError, read_number
from mari_eval.storage.outputs import refuse_special

ARCHITECTURE = "controlvector"
GGUF_FORMAT = "gguf control vector"


@dataclass(frozen=True)
class VectorFile:
    """What a control vector file holds: {layer N of its ``direction.N``: the direction [d], float32},
    the model hint it names (None when absent), and its name and sha256 for the bundle's provenance."""

    directions: dict[int, torch.Tensor]
    model_hint: str | None
    file: str
    sha256: str


def _string_field(reader, key: str) -> str | None:
    """The string value of ``key``, or None when it is absent or not a string."""
    import gguf  # deferred: only importing a vector needs it

    field = reader.get_field(key)
    if field is None or not field.data or field.types[:1] != [gguf.GGUFValueType.STRING]:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    except (IndexError, TypeError, ValueError):
        return None


def read_gguf(path: str | Path) -> VectorFile:
    """The directions of the GGUF control vector at ``path``, checked (module docstring)."""
    import gguf  # deferred: only importing a vector needs it

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; give the .gguf control vector to import")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on a file that is not GGUF
        raise BundleError(f"{path} is not a GGUF file ({type(e).__name__}: {e}); give a control vector .gguf as "
                          "repeng's ControlVector.export_gguf or llama.cpp's llama-cvector-generator write it") from None
    architecture = _string_field(reader, "general.architecture")
    if architecture != ARCHITECTURE:
        what = "no general.architecture" if architecture is None else f"general.architecture {architecture!r}"
        raise BundleError(f"{path} is a GGUF file with {what}, not a control vector (general.architecture "
                          f"{ARCHITECTURE!r}): a model or a LoRA adapter cannot be imported as one. Give the .gguf "
                          "that repeng's export_gguf or llama-cvector-generator wrote")
    directions: dict[int, torch.Tensor] = {}
    for tensor in reader.tensors:
        prefix, _, number = tensor.name.partition(".")
        layer, why = None, ""
        try:  # N read by numbers.read_number: "٥" is a digit to str.isdigit and int(), not here
            layer = read_number(number, integer=True, lo=0) if prefix == "direction" else None
        except NumberError as e:
            why = f": {e.why}"
        if layer is None:
            raise BundleError(f"{path}: tensor {tensor.name!r} is not named direction.N (N a layer number{why}); "
                              "llama.cpp would refuse this file too. Rename it, or export the vector again")
        if layer == 0:
            raise BundleError(f"{path}: tensor direction.0 names layer 0, which llama.cpp refuses (its control "
                              "vectors start at layer 1, the output of the second decoder layer). Export the "
                              "vector without layer 0, or build the bundle from Python "
                              "(mari_eval.vectors.control_vector.from_steering_vector), where layer 0 is allowed")
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32 or len(tensor.shape) != 1:
            raise BundleError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name} of shape "
                              f"{tuple(int(s) for s in tensor.shape)}; a direction is a 1-D F32 tensor (llama.cpp "
                              "reads nothing else). Export the vector again in float32")
        values = torch.tensor(tensor.data.astype("float32").reshape(-1))
        # llama.cpp adds up the directions a file gives one layer; GGUF names are unique, but
        # "direction.5" and "direction.05" name the same layer.
        directions[layer] = directions[layer] + values if layer in directions else values
    if not directions:
        raise BundleError(f"{path} holds no direction.N tensor: it is an empty control vector. Export it again")
    widths = {int(v.numel()) for v in directions.values()}
    if len(widths) > 1:
        raise BundleError(f"{path}: its directions have different widths {sorted(widths)} (llama.cpp refuses such a "
                          "file); every direction must have the model's hidden size. Export the vector again")
    return VectorFile(directions, _string_field(reader, f"{ARCHITECTURE}.model_hint"), path.name, file_sha256(path))


# -- writing ---------------------------------------------------------------------------------


def check_directions(directions: dict[int, torch.Tensor], where: str) -> None:
    """Refuse (BundleError), naming ``where`` and the fix, directions llama.cpp would not load as
    meant: none, a layer number below 1, a tensor that is not 1-D, different widths, non-finite values."""
    if not directions:
        raise BundleError(f"{where}: there is no direction to write; a control vector holds at least one")
    for layer, vector in sorted(directions.items()):
        if not isinstance(layer, int) or layer < 1:
            raise BundleError(f"{where}: a direction at layer {layer} would be written as direction.{layer}, which "
                              "llama.cpp cannot load (its control vectors start at direction.1, the output of the "
                              "second decoder layer; common_control_vector_load_one refuses direction.0). Make the "
                              "vector at a layer of 1 or more")
        if vector.ndim != 1:
            raise BundleError(f"{where}: the direction of layer {layer} has shape {tuple(vector.shape)}; a direction "
                              "is 1-D, one value per hidden unit")
        bad = int((~torch.isfinite(vector.detach().float())).sum())
        if bad:
            raise BundleError(f"{where}: the direction of layer {layer} holds {bad} non-finite value(s) (NaN or "
                              "infinite), which llama.cpp would add to every token. Retrain the bundle, or lower "
                              "its strength if it overflowed float32")
    widths = {int(v.numel()) for v in directions.values()}
    if len(widths) > 1:
        raise BundleError(f"{where}: the directions have different widths {sorted(widths)}; llama.cpp refuses such "
                          "a file. Every direction must have the model's hidden size")


def write_gguf(path: str | Path, directions: dict[int, torch.Tensor], model_hint: str, force: bool = False) -> Path:
    """Write ``directions`` ({layer N: [d]}) as the GGUF control vector ``path`` (module docstring),
    as float32, atomically (``files.atomic_write_with``). An existing ``path`` is refused unless ``force``;
    anything but a regular file there (a device node such as /dev/null, a FIFO, a socket, a link) always."""
    import gguf  # deferred: only importing and exporting a vector need it

    path = Path(path)
    check_directions(directions, str(path))
    if not isinstance(model_hint, str) or not model_hint.strip():
        raise BundleError(f"{path}: the model hint is empty; give the Hugging Face model_type of the model the "
                          "vector steers, e.g. --model-hint llama")
    refuse_special(path)  # /dev/null, a FIFO, a link: never replaced, even with --force
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory: give the file to write, e.g. {path / 'vector.gguf'}")
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists: pass --force to replace it, or give another file name")

    def fill(draft: Path) -> None:  # the hidden file beside ``path`` that then takes its place whole
        writer = gguf.GGUFWriter(draft, ARCHITECTURE)
        writer.add_string(f"{ARCHITECTURE}.model_hint", model_hint.strip())
        writer.add_uint32(f"{ARCHITECTURE}.layer_count", len(directions))
        for layer in sorted(directions):
            writer.add_tensor(f"direction.{layer}", directions[layer].detach().cpu().float().contiguous().numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return atomic_write_with(path, fill)  # checked non-empty; a failure names ``path``, not the hidden file
