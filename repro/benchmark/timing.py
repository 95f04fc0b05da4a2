"""Generation timings shared by repro/bench.py, repro/latency.py (through bench) and repro/gpu_bench.py.

One greedy generation at a time of a fixed number of tokens (``min_new_tokens`` suppresses the
end-of-sequence token, so a random-weight model produces as many tokens as a trained one):
first-token latency (until the first answer token is streamed; for MARI that is after its
routing window when the gate opens), total latency, and tokens/s of decoding after the
first token. Medians over prompts and repeats. MARI's cost depends on how often its gate
opens, so its gate rate is reported beside its timings.
"""

from __future__ import annotations

import statistics
import time

from mari_eval.benchmarks import data


class FirstTokenTimer:
    """A transformers streamer that notes when the first answer token arrives (generate's first
    ``put`` is the prompt; MARI's router streams the answer once its routing window is chosen)."""

    def __init__(self):
        self.start, self.first, self.puts = time.perf_counter(), None, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self):
        pass


def gate_rate(lm) -> float | None:
    """The fraction of prompts whose MARI gate opened in this process's runs (None for other entries)."""
    summary = lm.diagnostics_summary() if hasattr(lm, "diagnostics_summary") else {}
    return summary.get("gate_rate")


def sorry_prompt_ids(lm, prompts: int) -> list:
    """The first ``prompts`` SORRY-Bench prompts as one chat user turn each, token ids [1, T] each."""
    import torch  # deferred: torch is heavy; only this path needs it

    tok = lm.tokenizer
    records = data.load_sorry_bench()[:prompts]
    texts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], tokenize=False, add_generation_prompt=True)
             for r in records]
    return [torch.tensor([tok(t, add_special_tokens=False).input_ids]) for t in texts]


def _synchronize() -> None:
    import torch  # deferred: torch is heavy; only this path needs it

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def generate_once(lm, ids, tokens: int) -> tuple[float, float, int]:
    """(first-token latency, total latency, tokens produced) of one greedy generation of ``tokens``
    tokens from ``ids`` through ``lm._model_generate`` (lm-eval's generation path)."""
    import torch  # deferred: torch is heavy; only this path needs it

    _synchronize()
    timer = FirstTokenTimer()
    kwargs = dict(do_sample=False, attention_mask=torch.ones_like(ids), min_new_tokens=tokens, streamer=timer)
    with torch.no_grad():
        out = lm._model_generate(ids, ids.shape[1] + tokens, [], **kwargs)
    _synchronize()
    return timer.first - timer.start, time.perf_counter() - timer.start, out.shape[1] - ids.shape[1]


def time_generation(lm, encoded: list, tokens: int, repeats: int = 1) -> dict:
    """Medians of first-token latency, total latency and decoding tokens/s over ``encoded``
    prompts and ``repeats``, after a 4-token warm-up that is not timed."""
    generate_once(lm, encoded[0].to(lm.device), 4)  # warm-up
    if hasattr(lm, "records"):
        lm.records.clear()
    first, total, rate, produced_all = [], [], [], []
    for _ in range(repeats):
        for ids in encoded:
            ftl, seconds, produced = generate_once(lm, ids.to(lm.device), tokens)
            first.append(ftl)
            total.append(seconds)
            produced_all.append(produced)
            rate.append((produced - 1) / (seconds - ftl))  # decoding speed after the first token
    return {"first_token_s": statistics.median(first), "total_s": statistics.median(total),
            "tokens_per_s": statistics.median(rate), "prompts": len(encoded), "tokens": tokens,
            "tokens_produced": sorted(set(produced_all)), "gate_rate": gate_rate(lm)}
