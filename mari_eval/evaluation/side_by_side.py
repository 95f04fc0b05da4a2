"""``mari-eval generate BUNDLE PROMPT``: a bundle's answer to one prompt, streamed as it is decoded,
beside the untouched model's (``--compare``): the loop repeng's ``ControlModel.generate`` and
pyreft's ``generate`` offer, on any bundle of this suite.

The answer goes through the path lm-eval's generation takes (``MariLM._model_generate``): the
same sites, the same MARI routing (the energy gate, then entropy over the routing window,
eq:energy_gate_rule and eq:entropy_gen) and the same prompt rendering as a SORRY-Bench request
(one user turn of the chat template where the model has one; a method's instruction, Prompting's,
joins it). The untouched model's answer is decoded from the same loaded model with the method's
plan set aside and without its instruction. For MARI the gate's verdict and the chosen expert
are printed after the answer (its routing chooses after T_ent tokens, so its answer streams from
then on).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from mari_eval.injection import plan as plans
from mari_eval.injection.devices import check_device
from mari_eval.storage.models import check_local


@dataclass(frozen=True)
class GenerationSettings:
    """How one answer is decoded: greedy unless ``temperature`` > 0 (then sampled, seeded)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def kwargs(self) -> dict:
        if self.temperature <= 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}


class _Printer:
    """A transformers streamer that writes the answer's text to ``out`` as its tokens arrive (the
    first ``put`` is the prompt, as ``generate`` sends it; MARI's router sends the answer alone
    once its routing window is chosen, after a prompt put of its own)."""

    def __init__(self, tokenizer, out: TextIO):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = 0
        self.puts = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 1:
            return  # the prompt
        self.ids += value.reshape(-1).tolist()
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # a character split over tokens waits for its last byte
            self.out.write(text[self.shown:])
            self.out.flush()
            self.shown = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.shown:] + "\n")
        self.out.flush()

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def load(bundle: str, model: str | None, options: dict[str, str], dtype: str = "auto", device: str | None = None):
    """A ``MariLM`` with ``bundle`` on ``model`` (default: the model the bundle was trained on), with
    the method's evaluation ``options`` (scale=..., T_ent=...). Before the model loads: a bundle written
    as a local path that does not exist is named as such (``hf://org/name`` is the Hub, read as
    ``bundle=hf://`` reads it: ``hub.resolve``), the device is one torch here has (``check_device``), and
    every option is one the bundle's method takes."""
    from mari_eval.methods import hub
    from mari_eval.evaluation.lm import MariLM  # deferred: lm-eval is heavy

    if not bundle.startswith(hub.HF_PREFIX):
        check_local(bundle, "bundle")
    check_device(device)
    loaded = hub.load_bundle(bundle)
    unknown = sorted(set(options) - set(loaded.option_fields))
    if unknown:
        raise ValueError(f"{unknown[0]}={options[unknown[0]]}: a {loaded.method} bundle takes no option {unknown[0]!r}; "
                         f"its options: {', '.join(sorted(loaded.option_fields)) or 'none'} (--set KEY=VALUE; the "
                         "model's dtype and device are --dtype and --device)")
    if model is None:
        model = loaded.config["base_model"]["name"]
    args = ",".join([f"pretrained={model}", f"bundle={bundle}", f"dtype={dtype}",
                     *([f"device={device}"] if device else []), *(f"{k}={v}" for k, v in options.items())])
    return MariLM.create_from_arg_string(args)


def prompt_ids(lm, user: str, steered: bool) -> torch.Tensor:
    """``user`` as the model reads it: one user turn of the chat template (the method's instruction
    joined when ``steered``), or the text itself without a template; [1, T] token ids."""
    if steered:
        rendered = lm.chat_turn_prompt(user)
    elif getattr(lm.tokenizer, "chat_template", None):
        rendered = lm.tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                    add_generation_prompt=True)
    else:
        rendered = user + "\n"
    return torch.tensor([lm.generation_ids(rendered)], device=lm.device)


@contextlib.contextmanager
def untouched(lm) -> Iterator[None]:
    """``lm`` answering as the base model: its method's plan set aside for the block."""
    kept = lm.plan
    lm.plan = plans.VANILLA
    try:
        yield
    finally:
        lm.plan = kept


def check_fits(lm, ids: torch.Tensor, settings: GenerationSettings) -> None:
    """A ValueError when the prompt (``ids``, as the model reads it) and the answer's tokens exceed what the
    model reads (``lm.max_length``: its position embeddings): refused with both counts, not run on past it."""
    needed = ids.shape[1] + settings.max_new_tokens
    if needed > lm.max_length:
        raise ValueError(f"the prompt is {ids.shape[1]} tokens as {lm.model_name} reads it (chat template included) and "
                         f"--max-new-tokens asks {settings.max_new_tokens} more: {needed}, past the {lm.max_length} "
                         f"tokens the model reads; shorten the prompt by {needed - lm.max_length} tokens or more, or "
                         "lower --max-new-tokens")


def answer(lm, user: str, settings: GenerationSettings, steered: bool = True, out: TextIO | None = None) -> str:
    """One answer to ``user``, streamed to ``out`` (None: not shown), decoded as lm-eval decodes it."""
    ids = prompt_ids(lm, user, steered)
    check_fits(lm, ids, settings)
    printer = _Printer(lm.tokenizer, out or io.StringIO())  # not shown: written nowhere anyone reads
    torch.manual_seed(settings.seed)
    kwargs = dict(attention_mask=torch.ones_like(ids), streamer=printer, **settings.kwargs())
    with torch.no_grad(), (contextlib.nullcontext() if steered else untouched(lm)):
        lm._model_generate(ids, ids.shape[1] + settings.max_new_tokens, [], **kwargs)
    return printer.text


def routing_line(lm) -> str | None:
    """What MARI's routing did for the last prompt: the gate's energy and verdict, the expert chosen
    and the entropies it chose by; None for a method without routing."""
    if lm.intervention is None or not lm.records:
        return None
    record = lm.records[-1]
    parts = []
    if "gate_open" in record:
        parts.append(f"gate {'open' if record['gate_open'] else 'closed (the base model answered)'}, "
                     f"energy {record['energy']:.4g} (threshold {lm.intervention.tau:.4g})")
    if "expert" in record:
        parts.append(f"chosen: {lm.intervention.variant_name(record['expert'])}, entropies {record['entropy']}")
    return "; ".join(parts) or None


def run(bundle: str, prompt: str, model: str | None = None, options: dict[str, str] | None = None,
        settings: GenerationSettings = GenerationSettings(), compare: bool = False, dtype: str = "auto",
        device: str | None = None, out: TextIO = sys.stdout) -> dict[str, str]:
    """``mari-eval generate``: the bundle's answer (and the base model's with ``compare``), streamed
    to ``out`` under a heading each; returns {"steered": text, "base": text (with compare)}."""
    lm = load(bundle, model, options or {}, dtype, device)
    method = lm.intervention.label if lm.intervention is not None else "no method"
    for steered in (False, True) if compare else (True,):  # before anything is printed
        check_fits(lm, prompt_ids(lm, prompt, steered), settings)
    texts = {}
    if compare:
        out.write(f"--- {lm.model_name}, untouched\n")
        texts["base"] = answer(lm, prompt, settings, steered=False, out=out)
    out.write(f"--- {lm.model_name} with {method} ({Path(bundle).name})\n")
    texts["steered"] = answer(lm, prompt, settings, steered=True, out=out)
    routing = routing_line(lm)
    if routing:
        out.write(f"--- routing: {routing}\n")
    return texts
