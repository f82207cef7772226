"""A llama-shaped synthetic decode graph with random weights, for scheduler and policy tests.

Why: the scheduler's behaviour (host waits per policy, identical results across backends) is
best checked on a graph that looks like a decoder step — six host-written inputs per step, a KV
cache in persistent tensors written with `set_rows`, masked attention, argmax — but needs no
model file, no KV bookkeeping and no session. The real model graph is `lowsync.models.llama`.

Strategy: one graph of fixed shape (`SyntheticConfig`); `StepInputs` fills the step inputs for
a position, treating the KV window as a ring, so any number of steps reuse the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from lowsync._native import Graph, Tensor


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
