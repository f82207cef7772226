"""`SamplerParams`: how `Session.generate` draws each token, checked once, written as graph inputs.

Why: sampling runs on the device (`Graph.penalize` then `Graph.sample` after the output head,
ARCHITECTURE §6.1), so the logits never leave it and a sampled token costs what a greedy one
does. What the host still owns is the choice of parameters; a bad one (a NaN temperature, a
top-k of 2.5) must be a clear error here, before anything runs, not a silently odd draw.

Strategy: a frozen dataclass shaped like llama.cpp's sampler settings (the same names and
"off" values), validated in `__post_init__`. It turns itself into the rows the graph reads:
`penalty_row()` for `penalize` (repeat, frequency, presence) and `params_row()` for `sample`
(temperature, top_k, top_p, min_p), and `resolve_seed()` gives the 32-bit seed of the
counter-based key `(seed, position)` (`lowsync_graph::sampling`), fresh from `os.urandom` when
`seed` is None.

Invariants: a `SamplerParams` that exists is valid; `is_greedy` is exactly "the argmax graph
gives the same tokens" (temperature <= 0 and no penalty), which is what a session built
without sampling can serve.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from lowsync.kv_cells import SessionError

__all__ = ["SamplerError", "SamplerParams"]

# f32 holds every integer up to 2**24 exactly; a larger top_k keeps every token of any
# vocabulary lowsync runs, so it is clamped there rather than rounded.
_TOP_K_MAX = 1 << 24


class SamplerError(SessionError):
    """A bad sampler parameter (the message names it and the accepted range); a `SessionError`,
    so a `LowsyncError` and a `ValueError`."""


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplerError(f"SamplerParams.{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise SamplerError(f"SamplerParams.{name} must be finite, got {value!r}")
    return v


@dataclass(frozen=True)
class SamplerParams:
    """How each generated token is drawn, llama.cpp's way: penalties over the recent tokens,
    then top-k, top-p and min-p truncations of the logits, then a draw at `temperature`.

    `temperature <= 0` is greedy (the argmax). `top_k <= 0`, `top_p >= 1` and `min_p <= 0`
    turn their truncation off; `top_p` of 0 and `min_p` of 1 keep only the most likely token.
    `repeat_penalty` (> 0, 1 is off) divides positive logits and multiplies negative ones of
    tokens in the penalty window; `frequency_penalty` and `presence_penalty` subtract
    `count * frequency + presence` from them. `seed`: None draws a fresh seed per call; an int
    is taken mod 2**32, and the same seed gives the same tokens on every backend.

    Example::

        sp = SamplerParams(temperature=0.7, top_k=40, top_p=0.9, seed=1234)
        sess = Session(model, backends=["cpu-async"], sampling=True)
        ids = sess.generate(prompt, max_new_tokens=32, sampler=sp)
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise SamplerError(
                f"SamplerParams.top_k must be an int (<= 0: off), got {self.top_k!r}"
            )
        if self.top_p < 0:
            raise SamplerError(f"SamplerParams.top_p must be >= 0 (>= 1: off), got {self.top_p!r}")
        if self.min_p > 1:
            # A threshold above the largest probability would keep no token at all.
            raise SamplerError(
                f"SamplerParams.min_p must be at most 1 (<= 0: off), got {self.min_p!r}"
            )
        repeat = _real("repeat_penalty", self.repeat_penalty)
        if repeat <= 0:
            raise SamplerError(
                f"SamplerParams.repeat_penalty must be > 0 (1: off), got {self.repeat_penalty!r}"
            )
        object.__setattr__(self, "repeat_penalty", repeat)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise SamplerError(f"SamplerParams.seed must be an int or None, got {self.seed!r}")

    @classmethod
    def greedy(cls) -> SamplerParams:
        """The argmax, no penalties: what `generate` does without a sampler."""
        return cls(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes a logit."""
        return (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_greedy(self) -> bool:
        """Whether the tokens are the plain argmax of the logits (no draw, no penalty)."""
        return self.temperature <= 0 and not self.has_penalties

    def params_row(self) -> tuple[float, float, float, float]:
        """`Graph.sample`'s parameter row: (temperature, top_k, top_p, min_p)."""
        k = 0 if self.top_k <= 0 else min(self.top_k, _TOP_K_MAX)
        return (self.temperature, float(k), self.top_p, self.min_p)

    def penalty_row(self) -> tuple[float, float, float]:
        """`Graph.penalize`'s parameter row: (repeat, frequency, presence)."""
        return (self.repeat_penalty, self.frequency_penalty, self.presence_penalty)

    def resolve_seed(self) -> int:
        """The 32-bit seed of one call: `seed` mod 2**32, or a fresh one when it is None."""
        if self.seed is None:
            return int.from_bytes(os.urandom(4), "little")
        return self.seed % (1 << 32)
