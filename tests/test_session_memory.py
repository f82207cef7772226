"""A session's memory: output rows per graph (`n_outputs`) and a KV cache resident only as far
as it is used.

`n_outputs` bounds the rows of logits each graph computes; a ubatch then ends after that many
wanted outputs, so every result must equal a session with one row per token, whatever the mix
of flags. The memory test runs in a fresh interpreter and compares the anonymous memory
(`RssAnon`) of a session whose KV cache is large (n_ctx 8192) with one whose cache is small,
both decoding the same few tokens: the cells they never write must not be resident.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lowsync as ls
from helpers import assert_step_counts
from lowsync.models.llama import Llama, LlamaConfig
from lowsync.session import SessionError

CONFIG = LlamaConfig(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)
PROMPT = [12, 7, 250, 3, 3, 99, 41, 0, 18, 77, 5, 6, 140, 29, 8, 201, 64, 2, 9, 33]


@pytest.fixture(scope="module")
def model() -> Llama:
    return Llama.random(CONFIG, seed=1)


@pytest.mark.parametrize("n_outputs", [1, 3])
def test_fewer_output_rows_give_the_same_logits_and_tokens(model: Llama, n_outputs: int) -> None:
    full = ls.Session(model, backends=["cpu"], n_ctx=96, n_seq=2, n_ubatch=8)
    few = ls.Session(model, backends=["cpu"], n_ctx=96, n_seq=2, n_ubatch=8, n_outputs=n_outputs)
    assert few.n_outputs == n_outputs
    assert full.n_outputs == 8
    flags = [i % 3 != 1 for i in range(len(PROMPT))]
    for logits in ("all", "last", flags):
        a = full.decode(PROMPT, seq_id=0, logits=logits)
        b = few.decode(PROMPT, seq_id=0, logits=logits)
        assert a is not None
        assert b is not None
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
        full.clear()
        few.clear()
    assert few.generate(PROMPT, 6, seq_id=1) == full.generate(PROMPT, 6, seq_id=1)
    # Tokens of two sequences in one call: each wanted row still comes back, in order.
    assert few.step({0: 5, 1: 9}) == full.step({0: 5, 1: 9})


def test_a_prompt_read_for_its_last_token_runs_the_same_ubatches(model: Llama) -> None:
    # A prompt whose last token alone is wanted runs in ubatches of n_ubatch tokens with one
    # output row as with eight: the same launches, uploads and waits; decode steps keep their
    # per-token counts.
    def prompt_counts(sess: ls.Session) -> tuple[int, ...]:
        names = ("kernel_launches", "h2d_copies", "host_waits", "d2h_copies")
        before = sess.stats()["total"]
        sess.decode(PROMPT, logits="last")
        after = sess.stats()["total"]
        return tuple(after[c] - before[c] for c in names)

    def session(**kw: int) -> ls.Session:
        return ls.Session(model, backends=["cpu-async"], n_ctx=64, n_seq=1, n_ubatch=8, **kw)

    few, full = session(n_outputs=1), session()
    assert prompt_counts(few) == prompt_counts(full)
    few.clear()
    few.generate(PROMPT, 5)
    assert few.last_generate is not None
    assert_step_counts(few.last_generate, few.launch_ahead)


@pytest.mark.parametrize("bad", [0, 9, -1, True, 2.0])
def test_n_outputs_must_be_from_one_to_n_ubatch(model: Llama, bad: object) -> None:
    with pytest.raises(SessionError, match="n_outputs"):
        ls.Session(model, backends=["cpu"], n_ctx=32, n_ubatch=8, n_outputs=bad)  # type: ignore[arg-type]


# Runs in a fresh interpreter: the anonymous memory a session adds by its creation and a short
# generation, at the n_ctx given.
_PROBE = """
import json, sys
import lowsync as ls
from lowsync.models.llama import Llama, LlamaConfig

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no RssAnon line")

n_ctx, backend = int(sys.argv[1]), sys.argv[2]
model = Llama.random(LlamaConfig(256, 256, 4, 4, 4, 512), seed=0)
before = anon()
sess = ls.Session(model, [backend], n_ctx=n_ctx, n_seq=1, n_ubatch=8)
tokens = sess.generate(list(range(1, 9)), max_new_tokens=8)
print(json.dumps({"grown": anon() - before, "tokens": [int(t) for t in tokens]}))
"""


def _session_growth(n_ctx: int, backend: str) -> tuple[int, list[int]]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(n_ctx), backend],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return int(out["grown"]), [int(t) for t in out["tokens"]]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("backend", ["cpu", "cpu-async"])
def test_kv_cells_never_written_are_not_resident(backend: str) -> None:
    # 4 layers x K and V x 8193 rows x 256 floats: 64 MiB of cache at n_ctx 8192, of which 16
    # tokens write 16 rows.
    kv_bytes = 4 * 2 * 8193 * 256 * 4
    small, small_tokens = _session_growth(64, backend)
    large, large_tokens = _session_growth(8192, backend)
    assert large_tokens == small_tokens
    # The large session's scratch (attention over 8192 masked rows) is larger too, a few MiB;
    # a cache resident in full would add all of its 64 MiB.
    assert large - small < kv_bytes // 4, (large, small, kv_bytes)
