"""Free-text generation under a method's ``Plan``: the prompt once, every variant for a few steps, the chosen one on.

The prompt before p* is computed once; a closed gate hands the prompt to the untouched
model, otherwise every variant runs as one batch for a few greedy steps (the routing
window), the plan's ``choose`` picks a variant per prompt, and decoding continues from
the winner's cache.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from mari_eval.injection import devices, layer_spans, site
from mari_eval.injection.plan import BASE, ApplyEdits, Plan, VariantRun
from mari_eval.evaluation.prefix_cache import cache_of, cache_rows, with_cache

Cache = Any  # a transformers key/value cache (DynamicCache and kin)


class Streamer(Protocol):
    """What ``generate`` streams tokens to (transformers' ``TextStreamer`` and kin)."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...




def step_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) over the last axis (eq:entropy_def), at the shared temperature 1."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _eos_ids(model: torch.nn.Module) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


@torch.no_grad()
def generate_variants(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    plan: Plan,
    max_length: int,
    pad_token_id: int | None = None,
    stopping_criteria: Callable[[int, int], object] | None = None,
    streamer: Streamer | None = None,
    **generation_kwargs: Any,
) -> tuple[torch.Tensor, list[dict]]:
    """Greedy generation where each prompt is answered by the variant ``plan.choose`` picks.

    The prompts are left-padded rows of ``input_ids``, so p* is the last column.

    * With ``plan.screen`` (MARI's gate): the untouched model reads each prompt once and
      proposes its first token, as ``generate`` alone would; the site-only variants
      (the probe) then rerun p* alone over that cache, from ``plan.edit_layer`` up. A prompt
      that ``screen`` turns away keeps the untouched model's answer, decoded on at base
      speed. For the others, the untouched p* is masked out of the cache and p* is fed
      again under every remaining variant.
    * Without it, the prompts before p* are computed once and every variant starts at p*.

    The variants then run as one batch for ``plan.window`` greedy steps (eq:entropy_gen's
    T_ent); ``choose`` sees each prompt's mean next-token entropies and its states at p*,
    and decoding continues from the chosen rows' tokens and cache, so nothing is
    recomputed. ``stopping_criteria(rows, prompt_width)`` builds the criteria of a batch;
    a ``streamer`` (one prompt) receives the answer only, the routing window's once chosen.
    Returns the sequences (prompt + answer, pad after the first end-of-sequence token) and
    the ``choose`` records.
    """
    n_prompts, width = input_ids.shape
    apply, capture, site_only, screen, edit_layer = plan.apply, plan.capture, plan.site_only, plan.screen, plan.edit_layer
    choose = plan.pick
    stop = stopping_criteria or (lambda rows, prompt_width: None)
    kwargs = dict(pad_token_id=pad_token_id, use_cache=True, **generation_kwargs)
    screened = [BASE, *site_only] if screen is not None else []
    answering = [v for v in plan.variants if v not in screened]
    device = input_ids.device

    def run_of(p: int, states: dict, entropy: torch.Tensor | None) -> VariantRun:
        """Prompt p's run over screened + answering variants (NaN for what was not run)."""
        nan = lambda n: torch.full((n,), float("nan"), device=device)
        u = torch.cat([nan(len(screened)), entropy if entropy is not None else nan(len(answering))])
        site_states = {m: torch.cat([h, h[:1].new_full((len(screened) + len(answering) - len(h), h.shape[-1]), float("nan"))])
                       for m, h in states.items()}
        return VariantRun(screened + answering, None, None, site_states, u,
                          scored=frozenset(answering if entropy is not None else []), prompt=p)

    answers: dict[int, torch.Tensor] = {}
    records: dict[int, dict] = {}
    states = {p: {} for p in range(n_prompts)}
    routed = list(range(n_prompts))
    if screened:
        first, base = _base_first_token(model, input_ids, attention_mask, capture, edit_layer, kwargs)
        probe = _probe_at_p_star(model, input_ids, attention_mask, cache_of(first), site_only, apply,
                                 capture, edit_layer, base)
        n = len(site_only)
        states = {p: {m: torch.cat([base[m][p:p + 1], probe[m][p * n:(p + 1) * n]]) for m in capture} for p in range(n_prompts)}
        routed = [p for p in range(n_prompts) if screen(run_of(p, states[p], None))]
        kept = [p for p in range(n_prompts) if p not in routed]
        if kept:  # the untouched model answers, decoding on from its first token
            out = _continue(model, first.sequences[kept], attention_mask[kept], cache_rows(cache_of(first), kept),
                            width, max_length, stop(len(kept), width), streamer, kwargs)
            for j, p in enumerate(kept):
                answers[p] = out[j]
                records[p] = choose(run_of(p, states[p], None))[1]
        # The routed prompts feed p* again over the untouched cache, whose p* is masked out.
        ids, mask = torch.cat([input_ids, input_ids[:, -1:]], dim=1), _p_star_fed_again(attention_mask)
        cache = cache_of(first)
    else:
        ids, mask, cache = input_ids, attention_mask, _prefill(model, input_ids[:, :-1], attention_mask[:, :-1])
    if routed:
        n_var = len(answering)
        index = [p for p in routed for _ in range(n_var)]
        steps = max(1, min(plan.window, max_length - width))
        variant_ids = torch.tensor(answering, device=device).repeat(len(routed))
        window_out, entropy, seen = _routing_window(model, ids[index], mask[index], variant_ids, apply,
                                                    () if screened else capture, steps, cache=cache_rows(cache, index), **kwargs)
        chosen_rows = []
        for j, p in enumerate(routed):
            rows = slice(j * n_var, (j + 1) * n_var)
            run = run_of(p, states[p] or {m: h[rows] for m, h in seen.items()}, entropy[rows])
            chosen, record = choose(run)
            chosen_rows.append(j * n_var + answering.index(chosen))
            records[p] = record
        cache = cache_of(window_out)
        cache.batch_select_indices(torch.tensor(chosen_rows, device=device))
        extra = ids.shape[1] - width  # the re-fed p*, dropped from the answer
        out = _continue(model, window_out.sequences[chosen_rows], mask[routed], cache, ids.shape[1],
                        max_length + extra, stop(len(routed), ids.shape[1]), streamer, kwargs)
        answers.update(zip(routed, torch.cat([out[:, :width], out[:, ids.shape[1]:]], dim=1)))
    longest = max(len(a) for a in answers.values())
    pad = pad_token_id if pad_token_id is not None else 0
    sequences = torch.stack([F.pad(answers[p], (0, longest - len(answers[p])), value=pad) for p in range(n_prompts)])
    return _pad_after_eos(sequences, width, _eos_ids(model), pad_token_id), [records[p] for p in range(n_prompts)]


def _continue(model: torch.nn.Module, sequences: torch.Tensor, prompt_mask: torch.Tensor, cache: Cache | None, answer_from: int,
              max_length: int, criteria: object, streamer: Streamer | None, kwargs: dict[str, Any]) -> torch.Tensor:
    """Decode on from ``sequences`` (the cache holds all but their last token); the tokens from
    ``answer_from`` on are the answer so far, streamed before decoding goes on."""
    if streamer is not None:
        streamer.put(sequences[0, :answer_from].cpu())
        for token in sequences[0, answer_from:]:
            streamer.put(token[None].cpu())
    if sequences.shape[1] >= max_length:
        if streamer is not None:
            streamer.end()
        return sequences
    mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, prompt_mask.shape[1]:])], dim=1)
    return model.generate(input_ids=sequences, attention_mask=mask, **with_cache(model, cache), max_length=max_length,
                          stopping_criteria=criteria, streamer=_SkipPrompt(streamer) if streamer is not None else None,
                          **kwargs)


def _base_first_token(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Sequence[int],
                      edit_layer: int | None, kwargs: dict[str, Any]) -> tuple[Any, dict[int, torch.Tensor]]:
    """generate's first step of the untouched model, with its states at p* after ``capture`` and ``edit_layer``."""
    layers = sorted(set(capture) | ({edit_layer} if edit_layer is not None else set()))
    with site.capture_site(model, layers, None) as seen:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=1,
                             return_dict_in_generate=True, **kwargs)
    return out, dict(seen)


def _probe_at_p_star(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Cache, variants: Sequence[int],
                     apply: ApplyEdits, capture: Sequence[int], edit_layer: int | None,
                     base: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """p* fed again under each of ``variants`` (rows prompt-major) over ``cache`` (the prompt,
    with its untouched p* masked out): the states after ``capture`` layers at p*, [P * V, d]."""
    index = [p for p in range(input_ids.shape[0]) for _ in variants]
    prompt_mask = attention_mask[index]
    mask = _p_star_fed_again(prompt_mask)
    variant_ids = torch.tensor(list(variants), device=input_ids.device).repeat(input_ids.shape[0])
    skip = contextlib.nullcontext()
    if edit_layer is not None and layer_spans.can_start_after(model):  # below the site, p* is the untouched model's
        skip = layer_spans.start_after(model, edit_layer, base[edit_layer][index][:, None])
    with skip, apply(variant_ids, None), site.capture_site(model, capture, None) as seen:
        layer_spans.run_through(model, max(capture), input_ids=input_ids[index, -1:], attention_mask=mask,
                         position_ids=_positions(prompt_mask)[:, -1:], **with_cache(model, cache_rows(cache, index)), use_cache=True)
    return dict(seen)


def _p_star_fed_again(attention_mask: torch.Tensor) -> torch.Tensor:
    """The mask of a prompt whose cached p* (the last column) is hidden and fed again as a new column."""
    last = attention_mask[:, -1:]
    return torch.cat([attention_mask[:, :-1], torch.zeros_like(last), torch.ones_like(last)], dim=1)


class _SkipPrompt:
    """A streamer that ignores generate's first ``put`` (the prompt and the tokens already streamed)."""

    def __init__(self, streamer: Streamer):
        self.streamer, self.started = streamer, False

    def put(self, value: torch.Tensor) -> None:
        if self.started:
            self.streamer.put(value)
        self.started = True

    def end(self) -> None:
        self.streamer.end()


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows, as ``generate`` computes them."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def _prefill(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Cache | None:
    """The untouched model's cache of left-padded prompts (None when they are empty)."""
    if input_ids.shape[1] == 0:
        return None
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_positions(attention_mask),
                use_cache=True, logits_to_keep=1)
    return cache_of(out)


def _routing_window(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, variant_ids: torch.Tensor,
                    apply: ApplyEdits, capture: Sequence[int], steps: int, cache: Cache | None = None,
                    **generation_kwargs: Any) -> tuple[Any, torch.Tensor, dict[int, torch.Tensor]]:
    """Rows of prompts, row i under variant ``variant_ids[i]``, for ``steps`` greedy steps.

    ``cache`` (optional) holds each row's prompt before p*. Returns generate's output,
    each row's mean next-token entropy over the window up to its end-of-sequence token
    (eq:entropy_gen), and the captured states at p*.
    """
    with apply(variant_ids, None), site.capture_site(model, capture, None) as seen:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=steps, output_logits=True,
                             return_dict_in_generate=True, **with_cache(model, cache), **generation_kwargs)
    per_step = step_entropy(torch.stack(out.logits, dim=1)).to(input_ids.device)  # [rows, steps]
    generated = out.sequences[:, input_ids.shape[1]:]
    ended = torch.isin(generated, torch.tensor(_eos_ids(model) or [-1], device=input_ids.device)).long()
    live = ((ended.cumsum(-1) - ended) == 0).float()
    return out, (per_step * live).sum(-1) / live.sum(-1).clamp_min(1), dict(seen)


@torch.no_grad()
def routing_entropy(model: torch.nn.Module, prompt: Sequence[int], plan: Plan, window: int) -> torch.Tensor:
    """u_k of eq:entropy_gen for one prompt under each of ``plan``'s variants ([V]), over ``window`` steps."""
    device = devices.input_device(model)
    ids = torch.tensor([list(prompt)] * len(plan.variants), device=device)
    pad = getattr(model.generation_config, "pad_token_id", None)
    _, entropy, _ = _routing_window(model, ids, torch.ones_like(ids), torch.tensor(list(plan.variants), device=device),
                                    plan.apply, (), window,
                                    pad_token_id=pad if pad is not None else (_eos_ids(model) or [0])[0], do_sample=False)
    return entropy


def _pad_after_eos(sequences: torch.Tensor, prompt_len: int, eos: list[int], pad: int | None) -> torch.Tensor:
    """Tokens after a row's first end-of-sequence token become padding (as generate does)."""
    if not eos or pad is None:
        return sequences
    generated = sequences[:, prompt_len:]
    is_eos = torch.isin(generated, torch.tensor(eos, device=generated.device))
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0
    return torch.cat([sequences[:, :prompt_len], generated.masked_fill(after, pad)], dim=1)
