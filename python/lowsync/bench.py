"""Host-overhead bench on a llama-shaped synthetic decoder (`lowsync bench`).

Why: lowsync's claim is "fewer host waits per token, same results". This module measures it the
way a decode loop sees it: per step the host writes the six small inputs a llama.cpp decode
writes (token ids, positions, K and V cache slot indices, the attention mask, output row ids),
computes, and reads the sampled token back — the one wait a synchronous greedy decode needs.

Strategy: the graph is built in Python from random weights (a few decoder blocks: RMSNorm,
q/k/v projections, RoPE, a KV cache in persistent tensors written with `set_rows`, attention
over a fixed KV window with a mask, SwiGLU FFN, final argmax), compiled once per backend x sync
policy, and run for `n` steps after a warm-up. The counters come from the backends themselves
(`Context.stats()`); this module only takes differences and divides by the step count.

Invariants: the graph's shapes are fixed for the whole run (positions, slots and the valid KV
length travel as data), so every step reuses the same plan; nothing here depends on which
backend runs, and the full model bench (GGUF, `lowsync.models`) will report the same columns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lowsync._native import Context, Graph, Tensor

POLICIES: tuple[str, ...] = ("stock", "relaxed", "staged")

# Per-step counters shown by the bench, in column order.
COUNTERS: tuple[str, ...] = (
    "host_waits",
    "driver_syncs",
    "elided_syncs",
    "submits",
    "h2d_copies",
    "d2h_copies",
    "reallocs",
)

# The host-written inputs of every step, as llama.cpp's decode graph has them.
STEP_INPUTS: tuple[str, ...] = ("tokens", "pos", "k_idxs", "v_idxs", "kq_mask", "out_ids")


@dataclass(frozen=True)
class SyntheticConfig:
    """Hyper-parameters of the synthetic decoder (tiny: the bench measures the host, not FLOPs)."""

    n_vocab: int = 512
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 256
    n_layer: int = 4
    n_ctx: int = 128
    n_tokens: int = 1

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def build_synthetic_llama(cfg: SyntheticConfig | None = None, seed: int = 0) -> Graph:
    """A llama-shaped decode graph with random weights; output `"token"` (argmax, i32 [1]).

    Inputs, written every step: `tokens` i32 [T], `pos` i32 [T], `k_idxs` / `v_idxs` i32 [T]
    (KV cache slots), `kq_mask` f32 [T, n_ctx] (0 or -inf), `out_ids` i32 [1] (the row whose
    logits are sampled).
    """
    cfg = cfg or SyntheticConfig()
    rng = np.random.default_rng(seed)
    g = Graph()
    t, d, hd = cfg.n_tokens, cfg.n_embd, cfg.head_dim
    n_h, n_kv, n_ctx = cfg.n_head, cfg.n_head_kv, cfg.n_ctx

    def weight(name: str, *shape: int) -> Tensor:
        data = rng.standard_normal(shape) / math.sqrt(shape[0])
        return g.weight(name, data.astype(np.float32))

    def norm(name: str) -> Tensor:
        return g.weight(name, (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32))

    tokens = g.input("tokens", [t], "i32")
    pos = g.input("pos", [t], "i32")
    k_idxs = g.input("k_idxs", [t], "i32")
    v_idxs = g.input("v_idxs", [t], "i32")
    kq_mask = g.input("kq_mask", [t, n_ctx])
    out_ids = g.input("out_ids", [1], "i32")

    x = g.get_rows(weight("token_embd.weight", cfg.n_vocab, d), tokens)  # [T, d]
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        h = g.rms_norm(x) * norm(p + "attn_norm.weight")
        q = g.reshape(h @ weight(p + "attn_q.weight", d, n_h * hd), [t, n_h, hd])
        k = g.reshape(h @ weight(p + "attn_k.weight", d, n_kv * hd), [t, n_kv, hd])
        v = h @ weight(p + "attn_v.weight", d, n_kv * hd)  # [T, n_kv * hd]
        q = g.rope(q, pos)
        k = g.rope(k, pos)

        # The cache rows of this step, then attention over the whole (masked) window.
        k_cache = g.persistent(p + "k_cache", [n_ctx, n_kv * hd])
        v_cache = g.persistent(p + "v_cache", [n_ctx, n_kv * hd])
        k_all = g.set_rows(k_cache, g.reshape(k, [t, n_kv * hd]), k_idxs)
        v_all = g.set_rows(v_cache, v, v_idxs)
        keys = g.permute(g.reshape(k_all, [n_ctx, n_kv, hd]), [1, 2, 0])  # [n_kv, hd, n_ctx]
        values = g.permute(g.reshape(v_all, [n_ctx, n_kv, hd]), [1, 0, 2])  # [n_kv, n_ctx, hd]
        queries = g.permute(q, [1, 0, 2])  # [n_h, T, hd]
        kq = g.soft_max(queries @ keys, kq_mask, scale=1.0 / math.sqrt(hd))  # [n_h, T, n_ctx]
        att = g.cont(g.permute(kq @ values, [1, 0, 2]))  # [T, n_h, hd]
        x = x + g.reshape(att, [t, n_h * hd]) @ weight(p + "attn_output.weight", n_h * hd, d)

        h = g.rms_norm(x) * norm(p + "ffn_norm.weight")
        gate = h @ weight(p + "ffn_gate.weight", d, cfg.n_ff)
        up = h @ weight(p + "ffn_up.weight", d, cfg.n_ff)
        x = x + g.swiglu(gate, up) @ weight(p + "ffn_down.weight", cfg.n_ff, d)

    x = g.rms_norm(x) * norm("output_norm.weight")
    logits = g.get_rows(x, out_ids) @ weight("output.weight", d, cfg.n_vocab)  # [1, n_vocab]
    g.output("token", g.argmax(logits))
    return g


class StepInputs:
    """The six host-written inputs of a decode step, in buffers reused across steps."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        self.cfg = cfg
        t = cfg.n_tokens
        self.tokens = np.zeros(t, np.int32)
        self.pos = np.zeros(t, np.int32)
        self.k_idxs = np.zeros(t, np.int32)
        self.v_idxs = np.zeros(t, np.int32)
        self.kq_mask = np.full((t, cfg.n_ctx), -np.inf, np.float32)
        self.out_ids = np.array([t - 1], np.int32)

    def fill(self, start_pos: int, token: int) -> dict[str, npt.NDArray[np.generic]]:
        """Inputs for the tokens at positions `start_pos ..` (a ring over the KV window)."""
        cfg = self.cfg
        positions = start_pos + np.arange(cfg.n_tokens)
        self.tokens[:] = token % cfg.n_vocab
        self.pos[:] = positions
        self.k_idxs[:] = positions % cfg.n_ctx
        self.v_idxs[:] = self.k_idxs
        # Token i sees every cache slot written at a position <= its own.
        n_valid = np.minimum(positions + 1, cfg.n_ctx)
        self.kq_mask[:] = np.where(np.arange(cfg.n_ctx)[None, :] < n_valid[:, None], 0.0, -np.inf)
        return {
            "tokens": self.tokens,
            "pos": self.pos,
            "k_idxs": self.k_idxs,
            "v_idxs": self.v_idxs,
            "kq_mask": self.kq_mask,
            "out_ids": self.out_ids,
        }


@dataclass(frozen=True)
class BenchRow:
    """One (backend, policy) run: throughput and counters per step."""

    backend: str
    policy: str
    steps: int
    seconds: float
    per_step: dict[str, float]

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else math.inf

    def as_dict(self) -> dict[str, str | int | float]:
        row: dict[str, str | int | float] = {
            "backend": self.backend,
            "policy": self.policy,
            "steps": self.steps,
            "seconds": self.seconds,
            "steps_per_s": self.steps_per_s,
        }
        row.update(self.per_step)
        return row


def run_bench(
    backend: str,
    policy: str,
    n_steps: int = 32,
    warmup: int = 2,
    cfg: SyntheticConfig | None = None,
) -> BenchRow:
    """Greedy-decodes `n_steps` tokens (after `warmup`) on one backend under one policy."""
    cfg = cfg or SyntheticConfig()
    ctx = Context([backend], policy=policy)
    plan = ctx.compile(build_synthetic_llama(cfg))
    inputs = StepInputs(cfg)
    token, pos = 1, 0

    def step() -> None:
        nonlocal token, pos
        for name, data in inputs.fill(pos, token).items():
            plan.set_input(name, data)
        plan.compute()
        token = int(plan.get_output("token")[0])  # the one host wait a greedy step needs
        pos += cfg.n_tokens

    for _ in range(warmup):
        step()
    before = ctx.stats()["total"]
    start = time.perf_counter()
    for _ in range(n_steps):
        step()
    seconds = time.perf_counter() - start
    after = ctx.stats()["total"]
    per_step = {c: (after[c] - before[c]) / max(n_steps, 1) for c in COUNTERS}
    return BenchRow(backend, policy, n_steps, seconds, per_step)


def format_table(rows: Sequence[BenchRow]) -> str:
    """A llama-bench-like text table; counters are per step."""
    header = ["backend", "policy", "steps/s", *COUNTERS]
    body = [
        [r.backend, r.policy, f"{r.steps_per_s:.1f}", *(f"{r.per_step[c]:.2f}" for c in COUNTERS)]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: Sequence[str]) -> str:
        cells = [
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        return "| " + " | ".join(cells) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(header), rule, *(fmt(line) for line in body)])
