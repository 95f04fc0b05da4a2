"""LoRA bundles and peft's LoRA adapters, both ways (issue 39: "a LoRA row (peft ...)").

``export_peft`` (``mari-eval export-lora BUNDLE --out DIR``) writes a ``lora`` bundle as a peft adapter
directory: ``adapter_config.json`` (``peft_config``, peft's own ``LoraConfig``) and ``adapter_model.safetensors``
under the names peft's ``save_pretrained`` uses (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``),
so ``PeftModel.from_pretrained`` scores what the bundle's hooks score. ``import_peft`` (``mari-eval import-lora
ADAPTER_DIR --model M --out BUNDLE``) reads a peft LoRA adapter with JSON and safetensors only (never
``adapter_model.bin``: unpickling runs code) and refuses, naming the fix, what a bundle cannot hold exactly: other
peft methods, DoRA, biases, ``modules_to_save``, per-module ranks or alphas, modules that are not Linears of decoder
layers, targets missing from some layers. rsLoRA is supported: the bundle's alpha is lora_alpha * sqrt(r), so its
alpha / r is rsLoRA's scaling. An imported bundle has no training history (no diagnostics): it evaluates like any
bundle, but repro/'s recipe comparison (``selection_loss``) has nothing to read from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mari_eval.injection import site
from mari_eval.methods.bundle_spec import BundleError, check_bundle_directory
from mari_eval.methods.bundles import load_bundle
from mari_eval.storage.files import check_replaceable
from mari_eval.storage.models import resolve_model, same_model

from .lora import LoRA
from .lora_hooks import target_modules

log = logging.getLogger(__name__)

PEFT_FORMAT = "peft LoRA adapter"
CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
PREFIX = "base_model.model."  # peft's PeftModel (.base_model: the LoraModel, .model: the causal LM)
# Where each target sits in a decoder layer of Llama, Mistral, Qwen2, Gemma 3 (export_peft without a model)
PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# adapter_config.json settings that make peft compute more than W x + scaling * B A x
UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "a bias on lora_B", "layer_replication": "replicated layers",
               "trainable_token_indices": "trained token embeddings", "alora_invocation_tokens": "activated LoRA",
               "use_qalora": "QA-LoRA", "target_parameters": "LoRA on parameters", "megatron_config": "Megatron"}
REFUSED = "a lora bundle holds only W x + (alpha / r) B A x on Linear modules"


def peft_config(bundle: LoRA):
    """The bundle's settings as peft's own ``LoraConfig``."""
    from peft import LoraConfig  # deferred: peft is needed by these conversions only

    hp = bundle.config["hyperparameters"]
    return LoraConfig(r=int(hp["rank"]), lora_alpha=float(hp["alpha"]), target_modules=list(hp["targets"]),
                      layers_to_transform=[int(layer) for layer in hp["layers"]], lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=bundle.config["base_model"]["name"])


def module_names(bundle: LoRA, model: nn.Module | None = None) -> dict[tuple[str, int], str]:
    """{(target, index in layers): the module's name in the causal LM}: ``model``'s own names, or
    without it the Llama family's (``PARENTS``)."""
    hp = bundle.config["hyperparameters"]
    if model is not None:
        names = {id(m): name for name, m in model.named_modules()}
        return {key: names[id(m)] for key, m in target_modules(model, hp["layers"], hp["targets"]).items()}
    unknown = [t for t in hp["targets"] if t not in PARENTS]
    if unknown:
        raise BundleError(f"export_peft: where {unknown} sit in a decoder layer is not known here (only "
                          f"{', '.join(PARENTS)}): call export_peft(bundle, out, model=the model) from Python")
    return {(t, j): f"model.layers.{layer}.{PARENTS[t]}.{t}" for j, layer in enumerate(hp["layers"]) for t in hp["targets"]}


def export_peft(bundle: LoRA | str | Path, out_dir: str | Path, model: nn.Module | None = None) -> Path:
    """``bundle`` (or the bundle directory) written as a peft adapter directory ``out_dir``."""
    from safetensors.torch import save_file  # deferred: only the conversions need it

    bundle = bundle if isinstance(bundle, LoRA) else load_bundle(bundle)
    if not isinstance(bundle, LoRA):
        raise BundleError(f"this is a {bundle.method} bundle: only lora bundles are peft LoRA adapters")
    out = Path(out_dir)
    check_replaceable(out, lambda name: name in (CONFIG_FILE, WEIGHTS_FILE, "README.md"))
    tensors = {}
    for (target, j), name in sorted(module_names(bundle, model).items(), key=lambda item: item[1]):
        tensors[f"{PREFIX}{name}.lora_A.weight"] = bundle.tensors[f"{target}.A"][j].float().clone()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = bundle.tensors[f"{target}.B"][j].float().clone()
    out.mkdir(parents=True, exist_ok=True)
    peft_config(bundle).save_pretrained(str(out))
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def _described(model: str | nn.Module) -> tuple[str, nn.Module]:
    """(name, module) of ``model``; a name (embedded alias, Hub id, directory) is built on the meta
    device from its config: its module names and shapes, no weights."""
    if not isinstance(model, str):
        return getattr(model, "name_or_path", "") or type(model).__name__, model
    from transformers import AutoConfig, AutoModelForCausalLM  # deferred: heavy

    config = AutoConfig.from_pretrained(resolve_model(model))
    with torch.device("meta"):
        return model, AutoModelForCausalLM.from_config(config)


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """adapter_config.json, refused (naming the fix) unless the adapter is plain LoRA."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise BundleError(f"{directory} is not a peft adapter directory: it has no {CONFIG_FILE} (save the adapter "
                          "with PeftModel.save_pretrained)")
    try:
        config = json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is not valid JSON ({e}): copy the adapter again") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise BundleError(f"{path}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}, "
                          f"not 'LORA': only LoRA adapters become lora bundles ({REFUSED})")
    if config.get("bias", "none") != "none":
        raise BundleError(f"{path}: bias is {config['bias']!r} (the model's biases were trained too), but {REFUSED}; "
                          "retrain it with bias='none'")
    if config.get("modules_to_save"):
        raise BundleError(f"{path}: modules_to_save {config['modules_to_save']} (whole trained modules), but "
                          f"{REFUSED}; retrain without modules_to_save, or merge the adapter into the model")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise BundleError(f"{path}: {key} is set ({what}), but {REFUSED}; retrain the adapter without it, "
                              "or merge it into the model (merge_and_unload) and evaluate that model")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if type(r) is not int or r < 1 or isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not math.isfinite(alpha) or alpha <= 0:
        raise BundleError(f"{path}: r {r!r} and lora_alpha {alpha!r} must be a positive integer and a positive "
                          "number: the file is damaged, save the adapter again")
    for key, value in (("rank_pattern", r), ("alpha_pattern", alpha)):
        if any(v != value for v in (config.get(key) or {}).values()):
            raise BundleError(f"{path}: {key} {config[key]} gives some modules another rank or alpha, but a lora "
                              "bundle has one rank and one alpha for all its modules; retrain the adapter without it")
    return config


def import_peft(adapter_dir: str | Path, model: str | nn.Module, out: str | Path, allow_other_model: bool = False) -> Path:
    """``mari-eval import-lora``: the peft LoRA adapter in ``adapter_dir`` as a lora bundle for
    ``model`` (a name or a loaded model), saved to ``out`` (refused first if it holds other files)."""
    from safetensors.torch import load  # deferred: only the conversions need it

    check_bundle_directory(out)
    directory = Path(adapter_dir)
    config = read_adapter_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        pickled = (directory / PICKLE_FILE).is_file()
        raise BundleError(f"{directory} has no {WEIGHTS_FILE}" + (
            f", only {PICKLE_FILE}, a pickle, never read here (unpickling runs code): convert to safetensors "
            "(load it with PeftModel.from_pretrained where you trust it, then save_pretrained(dir, "
            "safe_serialization=True))" if pickled else ": save the adapter with PeftModel.save_pretrained"))
    raw = weights.read_bytes()
    try:
        stored = load(raw)
    except Exception as e:  # safetensors raises its own error type for a damaged file
        raise BundleError(f"{weights} is not a readable safetensors file ({e}): copy the adapter again") from None
    name, net = _described(model)
    hint = config.get("base_model_name_or_path")
    if hint and not same_model(hint, name):
        message = f"{directory} was trained on {hint!r} (base_model_name_or_path), not {name!r}"
        if not allow_other_model:
            raise BundleError(f"{message}: its update belongs to other weights. Import it with --model {hint}, or "
                              "pass --allow-other-model if both names hold the same checkpoint")
        log.warning("%s; imported anyway (--allow-other-model)", message)
    blocks = site.decoder_layers(net)
    prefix = next(n for n, m in net.named_modules() if m is blocks)
    linears = {f"{prefix}.{i}.{n}": (i, n.rsplit(".", 1)[-1]) for i, block in enumerate(blocks)
               for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in stored.items():
        module, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        if not key.startswith(PREFIX) or kind not in ("A.weight", "B.weight"):
            raise BundleError(f"{weights} holds {key}, not a lora_A or lora_B weight (an embedding's LoRA, a bias, a "
                              f"saved module...): {REFUSED}; retrain the adapter on Linear modules only")
        if module not in linears:
            raise BundleError(f"{weights}: {module} is not a Linear module of a decoder layer of {name!r}: the adapter "
                              f"targets another model or other modules; import it with --model naming its model, or "
                              "retrain it on the decoder layers' Linear modules")
        if not bool(torch.isfinite(tensor).all()):
            raise BundleError(f"{weights}: {key} holds {int((~torch.isfinite(tensor)).sum())} non-finite value(s) "
                              "(NaN or infinite): its training diverged or the file is damaged; retrain or copy it again")
        parts.setdefault(linears[module], {})[kind[0]] = tensor.float()
    layers = sorted({layer for layer, _ in parts})
    targets = [t for t in dict.fromkeys(target for _, target in linears.values()) if any(t == x for _, x in parts)]
    missing = [f"{t} of layer {layer}" for layer in layers for t in targets if len(parts.get((layer, t), {})) != 2]
    if not parts or missing:
        raise BundleError(f"{weights}: " + ("holds no LoRA weights" if not parts else
                          f"lacks lora_A or lora_B of {', '.join(missing[:4])}") + ": a lora bundle holds every target "
                          "on every one of its layers; retrain the adapter with the same target_modules on each layer")
    r = config["r"]
    try:
        modules = target_modules(net, layers, targets)
    except site.SiteError as e:
        raise BundleError(f"{weights}: {e}; the adapter does not fit {name!r}") from None
    for (t, j), m in modules.items():
        A, B = parts[layers[j], t]["A"], parts[layers[j], t]["B"]
        if A.shape != (r, m.in_features) or B.shape != (m.out_features, r):
            raise BundleError(f"{weights}: {t} of layer {layers[j]} has lora_A {tuple(A.shape)} and lora_B "
                              f"{tuple(B.shape)}; r={r} and {name!r}'s {t} ({m.out_features} x {m.in_features}) need "
                              f"({r}, {m.in_features}) and ({m.out_features}, {r}): the adapter was trained for "
                              "another model; import it with --model naming that model")
    tensors = {f"{t}.{kind}": torch.stack([parts[layer, t][kind] for layer in layers]).contiguous()
               for t in targets for kind in "AB"}
    alpha = float(config["lora_alpha"]) * (math.sqrt(r) if config.get("use_rslora") else 1.0)
    bundle_config = {
        "base_model": {"name": name, "hidden_size": int(net.config.get_text_config().hidden_size),
                       "num_layers": len(blocks)},
        "site": {"layer": layers[0], "position": "every token (prompt, options, generated tokens) through "
                 f"{', '.join(targets)} of layers {layers[0]}..{layers[-1]}"},
        "hyperparameters": {"rank": r, "alpha": alpha, "targets": targets, "layers": layers},
        "source": {"format": PEFT_FORMAT, "file": str(weights), "sha256": hashlib.sha256(raw).hexdigest(),
                   "base_model_name_or_path": hint, "peft_version": config.get("peft_version"),
                   "lora_alpha": config["lora_alpha"], "use_rslora": bool(config.get("use_rslora"))},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return LoRA(bundle_config, tensors).save(out)
