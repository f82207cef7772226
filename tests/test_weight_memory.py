"""Weights are not copied: a session over a GGUF file reads the file's memory map in place.

The memory test counts bytes, not time: the process's anonymous memory (`Anonymous` in
/proc/self/smaps_rollup) before and after creating a session, measured in a fresh interpreter
so that nothing freed by earlier tests is reused. The other tests check what `Graph.weight`
may borrow: only memory that cannot change, read in C order; anything else is copied, so
changing it afterwards changes nothing.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lowsync as ls
from lowsync.models.llama import Llama, LlamaConfig

ROLLUP = Path("/proc/self/smaps_rollup")

# Runs in a fresh interpreter: loads the model (from the file, or copied into writeable arrays),
# creates a session and reports anonymous memory around it and a few generated tokens.
_PROBE = """
import json, sys
import numpy as np
import lowsync as ls
from lowsync.models.llama import Llama

def anon():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no Anonymous line")

path, mode, backend = sys.argv[1:4]
model = ls.load_gguf(path)
if mode == "copy":
    model = Llama(model.config, {n: np.array(w) for n, w in model.weights.items()},
                  dtypes=model.dtypes)
nbytes = sum(w.nbytes for w in model.weights.values())
before = anon()
sess = ls.Session(model, [backend], n_ctx=64, n_ubatch=8)
after = anon()
tokens = sess.generate([1, 2, 3], max_new_tokens=3)
print(json.dumps({"nbytes": nbytes, "grown": after - before, "tokens": [int(t) for t in tokens]}))
"""


def _probe(path: Path, mode: str, backend: str) -> tuple[int, int, list[int]]:
    """(weight bytes, anonymous bytes the session added, tokens it generated)."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path), mode, backend],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return int(out["nbytes"]), int(out["grown"]), [int(t) for t in out["tokens"]]


@pytest.mark.skipif(not ROLLUP.exists(), reason="needs Linux's /proc/self/smaps_rollup")
@pytest.mark.parametrize("backend", ["cpu", "cpu-async"])
def test_a_session_over_a_gguf_file_does_not_copy_its_weights(tmp_path: Path, backend: str) -> None:
    # ~34 MB of f16 matrices and a small vocabulary: the weights dwarf the KV cache and the
    # scratch memory of a 64-cell, 8-token session.
    path = tmp_path / "m.gguf"
    Llama.random(LlamaConfig(256, 512, 4, 8, 8, 2048), seed=3, dtype="f16").save_gguf(path)
    nbytes, mapped, tokens = _probe(path, "file", backend)
    same_nbytes, copied, copied_tokens = _probe(path, "copy", backend)
    assert nbytes == same_nbytes
    assert nbytes > 30 << 20
    # Read in place: the session adds far less than the weights (KV cache, scratch, plans).
    assert mapped < nbytes // 4, (mapped, nbytes)
    # The measurement sees a copy when there is one: writeable arrays are copied once.
    assert copied >= nbytes * 9 // 10, (copied, nbytes)
    assert tokens == copied_tokens


def _plan_over(w: np.ndarray, dtype: str | None = None) -> ls.Plan:
    """`x @ w` compiled on `cpu`, its input set."""
    g = ls.Graph()
    x = g.input("x", [2, 4])
    g.output("y", x @ g.weight("w", w, dtype=dtype))
    plan = ls.Context(["cpu"]).compile(g)
    plan.set_input("x", np.arange(8, dtype=np.float32).reshape(2, 4))
    return plan


def _run(plan: ls.Plan) -> np.ndarray:
    plan.compute()
    out: np.ndarray = plan.get_output("y")
    return out


def _matmul(w: np.ndarray, dtype: str | None = None) -> np.ndarray:
    return _run(_plan_over(w, dtype))


W = np.arange(12, dtype=np.float32).reshape(4, 3) * 0.5
WANT = np.arange(8, dtype=np.float32).reshape(2, 4) @ W


def test_memory_that_can_change_is_copied() -> None:
    # A writeable array.
    a = W.copy()
    plan = _plan_over(a)
    a[:] = 0
    np.testing.assert_allclose(_run(plan), WANT)
    # A read-only view of a writeable array: its base can still change.
    a = W.copy()
    v = a.view()
    v.flags.writeable = False
    plan = _plan_over(v)
    a[:] = 0
    np.testing.assert_allclose(_run(plan), WANT)
    # A read-only array that owns its data: it can be made writeable again.
    a = W.copy()
    a.flags.writeable = False
    plan = _plan_over(a)
    a.flags.writeable = True
    a[:] = 0
    np.testing.assert_allclose(_run(plan), WANT)


def test_read_only_maps_and_bytes_are_read_in_c_order(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    W.tofile(path)
    c = np.memmap(path, np.float32, mode="r", shape=(4, 3))
    assert not c.flags.writeable
    np.testing.assert_allclose(_matmul(c), WANT)
    # The same bytes mapped in Fortran order are another matrix: read in logical order.
    f = np.memmap(path, np.float32, mode="r", shape=(4, 3), order="F")
    np.testing.assert_allclose(_matmul(f), np.arange(8, dtype=np.float32).reshape(2, 4) @ f)
    # A transposed view of a map is not C-contiguous either.
    t = np.memmap(path, np.float32, mode="r", shape=(3, 4)).T
    np.testing.assert_allclose(_matmul(t), np.arange(8, dtype=np.float32).reshape(2, 4) @ t)
    # Read-only bytes, viewed by numpy.
    b = np.frombuffer(W.tobytes(), np.float32).reshape(4, 3)
    np.testing.assert_allclose(_matmul(b), WANT)
    # A float16 map given as bf16 is converted (never reinterpreted).
    h = W.astype(np.float16)
    h.tofile(tmp_path / "h.bin")
    hm = np.memmap(tmp_path / "h.bin", np.float16, mode="r", shape=(4, 3))
    np.testing.assert_allclose(_matmul(hm), WANT, rtol=1e-3)
    with pytest.raises(ls.InputError):
        _matmul(hm, dtype="bf16")


def test_borrowed_weights_outlive_their_python_names(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    W.tofile(path)
    plan = _plan_over(np.memmap(path, np.float32, mode="r", shape=(4, 3)))
    # Nothing in Python refers to the map any more: the graph and context keep it alive.
    gc.collect()
    np.testing.assert_allclose(_run(plan), WANT)


# Runs in a fresh interpreter: a prompt that reads rows all over a file-mapped token embedding,
# then the embedding's resident pages in this process (`/proc/self/pagemap`'s present bit).
_ROWS_PROBE = """
import json, struct, sys
import numpy as np
import lowsync as ls

path = sys.argv[1]
model = ls.load_gguf(path)
emb = model.weights["token_embd.weight"]
assert "output.weight" in model.weights  # the products never read the embedding
lo, n = emb.ctypes.data, emb.nbytes
sess = ls.Session(model, ["cpu"], n_ctx=512, n_ubatch=256)
n_vocab = emb.shape[0]
prompt = [int(t) for t in np.linspace(0, n_vocab - 1, 256)]
sess.generate(prompt, max_new_tokens=4)
with open("/proc/self/pagemap", "rb") as f:
    present = 0
    for p in range(lo // 4096, (lo + n + 4095) // 4096):
        f.seek(p * 8)
        present += struct.unpack("<Q", f.read(8))[0] >> 63
print(json.dumps({"table_bytes": n, "resident": present * 4096}))
"""


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux's pagemap")
def test_embedding_rows_read_from_the_file_do_not_stay_resident(tmp_path: Path) -> None:
    # An 8 MiB f16 embedding that only `get_rows` reads: a 256-token prompt spread over the
    # whole vocabulary maps the page-cache folios around every row it reads, and the backend
    # releases them after the gather, so the process keeps at most the 2 MiB around a row.
    path = tmp_path / "m.gguf"
    Llama.random(LlamaConfig(8192, 512, 1, 8, 8, 512), seed=5, dtype="f16").save_gguf(path)
    done = subprocess.run(
        [sys.executable, "-c", _ROWS_PROBE, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["table_bytes"] == 8192 * 512 * 2
    assert out["resident"] <= 2 << 20, out
