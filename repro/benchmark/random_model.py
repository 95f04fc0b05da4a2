"""A model of a paper model's shape with random weights, built on the device it runs on (issue 41).

No 7B-32B checkpoint can reach a lent GPU machine, and none is needed to time or size the
suite: a model of the same shape does the same arithmetic. ``repro/benchmark/shapes/*.json`` hold the
public ``config.json`` of Llama-2-7B, Llama-3-8B and Qwen2.5-14B (each file names its source)
and a tiny Llama for the CPU tests. ``build`` makes that model in bf16 directly on the target
device (no 7B copy in CPU memory), with the embedded SmolLM2 tokenizer, so that the benchmarks'
real text is tokenised as users' would be; the special token ids are the tokenizer's (Llama-3's BOS
id 128000 is beyond SmolLM2's 49,152), and the vocabulary is the tokenizer's length or, with
``vocab="published"``, the shape's own (its extra rows zero: ``build``).

Weights: every matrix (embeddings, projections, LM head) drawn from N(0, 0.02^2), the shape's
``initializer_range`` (the initialisation transformers applies to these families), norms at
1, biases at 0. Activations stay finite through 32-48 layers in bf16, and generation emits
arbitrary tokens, so generation lengths are forced (``min_new_tokens``, as repro/bench.py does).

``tokenizer_folder`` copies the tokenizer files of the embedded model into a small folder that
a GPU run can carry (``repro/gpu_bench.sh``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mari_eval.storage.models import resolve_model

SHAPES = Path(__file__).resolve().parent / "shapes"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
# config.json fields that describe the checkpoint file, not the model's shape (the dtype is chosen here).
NOT_SHAPE = ("torch_dtype", "dtype", "transformers_version", "_name_or_path")


@dataclass(frozen=True)
class Shape:
    """One ``repro/benchmark/shapes/*.json`` file: a public configuration and where it comes from."""

    key: str  # the file's stem: llama2_7b, llama3_8b, qwen2_5_14b, tiny
    name: str  # the model's name as the paper writes it
    source: str  # the Hub repository and file the configuration was copied from
    config: dict[str, Any]
    published_parameters: float | None  # with the published vocabulary (results/memory.md)

    @property
    def model_name(self) -> str:
        """What bundles and results name the random model by (``name_or_path``)."""
        return f"random-weights/{self.key}"


def shape_names() -> list[str]:
    return sorted(p.stem for p in SHAPES.glob("*.json"))


def load_shape(name: str) -> Shape:
    """The shape ``name`` (a file stem under repro/benchmark/shapes, or a path to such a JSON file)."""
    path = Path(name) if name.endswith(".json") else SHAPES / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"shape {name!r}: no {path}; choose one of {', '.join(shape_names())} or give a JSON file")
    raw = json.loads(path.read_text())
    return Shape(path.stem, raw["name"], raw["source"], raw["config"], raw.get("published_parameters"))


def hf_config(shape: Shape, vocab_size: int | None = None, special_tokens: dict[str, int] | None = None):
    """The transformers configuration of ``shape``, with another vocabulary size and special
    token ids when given (the tokenizer's)."""
    from transformers import AutoConfig  # deferred: transformers is heavy; only this path needs it

    fields = {k: v for k, v in shape.config.items() if k not in NOT_SHAPE}
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    fields.update(special_tokens or {})
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def parameter_count(shape: Shape) -> int:
    """Parameters of ``shape`` with its published vocabulary, counted on the meta device (no memory)."""
    from transformers import \
        AutoModelForCausalLM  # deferred: transformers is heavy; only this path needs it

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def load_tokenizer(folder: str | Path):
    """The tokenizer in ``folder`` (``tokenizer_folder``'s copy), with a pad token."""
    from transformers import AutoTokenizer  # deferred: transformers is heavy; only this path needs it

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_folder(out: str | Path, model: str = "smollm2-135m-instruct") -> Path:
    """Copy the tokenizer files of ``model`` (an embedded alias or a model directory) to ``out``."""
    source, out = Path(resolve_model(model)), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"{source} has no tokenizer.json")
    for name in copied:
        shutil.copyfile(source / name, out / name)
    return out


@torch.no_grad()
def randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Every weight matrix from N(0, std^2), every norm at 1 and every bias at 0, in place on the
    model's own device (one generator per device, seeded)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            param.normal_(0.0, std, generator=generator)
        elif "norm" in name:
            param.fill_(1.0)
        else:
            param.zero_()


VOCABULARIES = ("tokenizer", "published")


def vocabulary_size(shape: Shape, tokenizer, vocab: str = "tokenizer") -> int:
    """The random model's vocabulary: the tokenizer's length (``tokenizer``), or the shape's published
    vocabulary where it is larger (``published``: Llama-3's 128,256 or Qwen2.5's 152,064 rows of
    embeddings, LM head and logits, so that their memory and time are the real model's)."""
    if vocab not in VOCABULARIES:
        raise ValueError(f"vocab={vocab!r}: choose one of {', '.join(VOCABULARIES)}")
    if vocab == "tokenizer":
        return len(tokenizer)
    return max(len(tokenizer), int(shape.config["vocab_size"]))


def build(shape: Shape, tokenizer, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          vocab: str = "tokenizer"):
    """The random model of ``shape`` on ``device`` in ``dtype``, frozen, in eval mode, named
    ``shape.model_name``; its special tokens are ``tokenizer``'s, its vocabulary ``vocabulary_size``'s.

    With the published vocabulary, the rows past the tokenizer's length (ids no text encodes to) are
    zero in the embeddings and the LM head: their logits are 0, far below the largest of the
    tokenizer's random logits, so greedy generation never emits an id the tokenizer cannot decode."""
    from transformers import \
        AutoModelForCausalLM  # deferred: transformers is heavy; only this path needs it

    specials = {f"{kind}_token_id": getattr(tokenizer, f"{kind}_token_id") for kind in ("bos", "eos", "pad")
                if getattr(tokenizer, f"{kind}_token_id", None) is not None}
    config = hf_config(shape, vocab_size=vocabulary_size(shape, tokenizer, vocab), special_tokens=specials)
    with torch.device(device):  # parameters are allocated on the device itself, never on the CPU first
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    placed = {p.device.type for p in model.parameters()}
    if placed != {torch.device(device).type}:
        raise RuntimeError(f"the model of {shape.name}'s shape was built on {sorted(placed)}, not {device}: this "
                           "transformers version ignores the default device, and moving 7B weights would time the copy")
    randomize(model, float(shape.config.get("initializer_range", 0.02)), seed)
    with torch.no_grad():
        for matrix in {model.get_input_embeddings().weight, model.get_output_embeddings().weight}:
            matrix[len(tokenizer):].zero_()
    model.requires_grad_(False).eval()
    model.config.name_or_path = shape.model_name  # bundles and MariLM name the model by this
    model.name_or_path = shape.model_name
    for kind, value in specials.items():
        setattr(model.generation_config, kind, value)
    return model
