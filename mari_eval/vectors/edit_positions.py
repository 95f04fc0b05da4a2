"""Where a vector method edits, chosen at evaluation: ``positions=`` and ``layers=`` in lm-eval's
``--model_args`` (issue 57.4), for the methods that add a fixed vector to decoder layers' outputs
(CAA, control vectors, lm-eval steered configs).

What each library offers, and what each value here is:

* ``positions=all``: every token of the prompt (and the options, and every generated token):
  llama.cpp's control vectors, lm-eval's ``steered`` model, repeng, steering-vectors' default
  (``min_token_index=0``). The default of control vectors and steered configs.
* ``positions=from_last``: the prompt's last token p* and every later one (options, generated
  tokens): CAA's ``add_vector_after_position`` after the user's instruction. CAA's default.
* ``positions=last``: p* alone, the site MARI and ReFT's last position edit; later tokens untouched.
* ``positions=from:N``: the prompt's token N (0-based) and every later one: steering-vectors'
  ``min_token_index=N`` (from p* on when the prompt has no token N before p*).
* ``layers=A-B`` (or ``layers=A``): for CAA, its vector added after each decoder layer A..B
  instead of its own layer (ActAdd-style multi-layer injection); for a control vector or a
  steered config, only its directions at layers A..B (the others left out).

The table scripts never set these: each method is scored at its published setting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mari_eval.injection import site
from mari_eval.methods.options import Option
from mari_eval.storage.numbers import NumberError, read_number

RULES = ("all", "from_last", "last", "from:N")
# The ``positions=`` evaluation option of every method that takes it (``EditPositions.parse`` reads it).
POSITIONS_OPTION = Option(str, "positions=all (or from_last, last, from:4)")


@dataclass(frozen=True)
class EditPositions:
    """One ``positions=`` value: ``rule`` in all, from_last, last, from (with ``start``, token N)."""

    rule: str
    start: int = 0

    @classmethod
    def parse(cls, text: str) -> "EditPositions":
        value = str(text).strip()
        if value.startswith("from:"):  # N read by numbers.read_number: "from:٣" is refused, not token 3
            try:
                return cls("from", read_number(value.removeprefix("from:"), integer=True, lo=0))
            except NumberError as e:
                raise ValueError(f"positions={text!r} in --model_args: give one of {', '.join(RULES)} (N a token index, "
                                 f"a whole number >= 0, e.g. positions=from:4; here {e.why})") from None
        if value in ("all", "from_last", "last"):
            return cls(value)
        raise ValueError(f"positions={text!r} in --model_args: give one of {', '.join(RULES)} (N a token index, e.g. "
                         "positions=from:4)")

    def __str__(self) -> str:
        return f"from:{self.start}" if self.rule == "from" else self.rule

    def prompt_sites(self, length: int) -> list[int]:
        """The prompt positions before p* this rule edits (the runner then encodes the prompt under the edit)."""
        if self.rule == "all":
            return list(range(length - 1))
        if self.rule == "from":
            return list(range(min(self.start, length - 1), length - 1))
        return []

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module, layers: list[int], edits: Callable[[int], Callable],
                positions) -> Iterator[dict]:
        """``edits(layer)`` applied after each of ``layers`` where this rule says, while the block runs
        (the hooks go on when it is entered); ``positions``: the plan's sites (the prompt sites, then
        p*, per row), from which edit_from_site starts; ``all``: every position of every pass. Yields the
        first layer's state (``state["calls"]``: the forward passes it edited)."""
        with contextlib.ExitStack() as stack:
            states = []
            for layer in layers:
                if self.rule == "last":
                    states.append(stack.enter_context(site.edit_site(model, layer, edits(layer), _last_site(positions))))
                elif self.rule == "all":
                    states.append(stack.enter_context(site.edit_every_position(model, layer, edits(layer))))
                else:
                    states.append(stack.enter_context(site.edit_from_site(model, layer, edits(layer), positions)))
            yield states[0] if states else {"calls": 0}


def _last_site(positions):
    """p* of each row: the last of its sites (None: the last column)."""
    if positions is None or torch.is_tensor(positions):
        return positions
    rows, cols = positions
    last: dict[int, int] = {}
    for row, col in zip(rows.tolist(), cols.tolist()):
        last[row] = max(col, last.get(row, col))
    order = sorted(last)
    return (torch.tensor(order, device=rows.device), torch.tensor([last[r] for r in order], device=cols.device))


def parse_layers(text: str, num_layers: int) -> list[int]:
    """``layers=A-B`` (or ``A``) as the decoder layers A..B of a model of ``num_layers``."""
    low_text, dash, high_text = str(text).partition("-")
    try:  # A and B read by numbers.read_number: "1_0" or "٣" is refused, not layer 10 or 3
        low = read_number(low_text, integer=True)
        high = read_number(high_text, integer=True) if dash else low
    except NumberError as e:
        raise ValueError(f"layers={text!r} in --model_args: give A-B or A (decoder layers, 0-based), e.g. layers=10-14 "
                         f"({e.why})") from None
    if not low <= high < num_layers:
        raise ValueError(f"layers={text!r} in --model_args: give A <= B within the model's decoder layers 0..{num_layers - 1}")
    return list(range(low, high + 1))
