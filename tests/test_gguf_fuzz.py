"""A seeded mutation fuzz of `load_gguf`: thousands of corrupted copies of two small valid files,
each of which must load as a model or raise a `LowsyncError` (a `GGUFError` naming the file),
never another exception — in-process, so a crash or a hang fails the run as well.

Mutations aim at the header (keys, tensor table, padding), where a count or an offset steers
the reader: flipped bytes, boundary numbers written over 4 or 8 bytes, truncation, inserted and
deleted bytes, a duplicated chunk; a few flip bytes of the tensor data (NaN and inf weights must
load, not raise). The seed and case number of a failure reproduce it.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

import lowsync as ls
from llama_ref import Spec, random_weights, write_gguf
from lowsync.gguf import load_gguf
from lowsync.gguf_reader import GGUFFile
from lowsync.models.llama import Llama, LlamaConfig

CASES = 2500  # per seed file; two files: 5000 loads, ~5 s on two cores
BOUNDARY = (0, 1, 2, 3, 4, 31, 32, 33, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40)
BOUNDARY_64 = (*BOUNDARY, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1)

Mutation = Callable[[random.Random, bytearray, int], bytearray]


def _flip(rng: random.Random, data: bytearray, header: int) -> bytearray:
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(header)] ^= rng.randint(1, 255)
    return data


def _boundary(rng: random.Random, data: bytearray, header: int) -> bytearray:
    at = rng.randrange(header - 8)
    if rng.random() < 0.5:
        struct.pack_into("<I", data, at, rng.choice(BOUNDARY) % 2**32)
    else:
        struct.pack_into("<Q", data, at, rng.choice(BOUNDARY_64) % 2**64)
    return data


def _truncate(rng: random.Random, data: bytearray, header: int) -> bytearray:
    return data[: rng.randrange(len(data))]


def _insert(rng: random.Random, data: bytearray, header: int) -> bytearray:
    at = rng.randrange(header)
    return data[:at] + bytearray(rng.randbytes(rng.randint(1, 16))) + data[at:]


def _delete(rng: random.Random, data: bytearray, header: int) -> bytearray:
    at = rng.randrange(header)
    return data[:at] + data[at + rng.randint(1, 16) :]


def _duplicate(rng: random.Random, data: bytearray, header: int) -> bytearray:
    a = rng.randrange(header)
    b = min(header, a + rng.randint(1, 64))
    return data[:b] + data[a:b] + data[b:]


def _flip_data(rng: random.Random, data: bytearray, header: int) -> bytearray:
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(header, len(data))] ^= rng.randint(1, 255)
    return data


MUTATIONS: list[tuple[Mutation, int]] = [
    (_flip, 30),
    (_boundary, 30),
    (_truncate, 8),
    (_insert, 8),
    (_delete, 8),
    (_duplicate, 8),
    (_flip_data, 8),
]


def _f16_file(path: Path) -> Path:
    model = Llama.random(LlamaConfig(64, 32, 1, 2, 1, 32), seed=1, dtype="f16")
    model.save_gguf(path)
    return path


def _q8_0_file(path: Path) -> Path:
    spec = Spec(n_vocab=48, n_embd=32, n_layer=1, n_head=2, n_head_kv=1, n_ff=32, wtype="Q8_0")
    return write_gguf(path, spec, random_weights(spec))


@pytest.mark.parametrize(("make", "seed"), [(_f16_file, 11), (_q8_0_file, 12)])
def test_every_mutated_file_loads_or_raises_a_lowsync_error(
    tmp_path: Path, make: Callable[[Path], Path], seed: int
) -> None:
    valid = make(tmp_path / "valid.gguf")
    assert isinstance(load_gguf(valid), Llama)
    original = valid.read_bytes()
    header = GGUFFile(valid).data_offset
    rng = random.Random(seed)
    mutations, weights = zip(*MUTATIONS, strict=True)
    outcomes = {"loaded": 0, "refused": 0}
    unexpected: list[str] = []
    path = tmp_path / "case.gguf"
    for case in range(CASES):
        mutate = rng.choices(mutations, weights)[0]
        data = mutate(rng, bytearray(original), header)
        path.unlink(missing_ok=True)  # a new inode: an earlier case's map never sees this one
        path.write_bytes(bytes(data))
        try:
            model = load_gguf(path)
        except ls.LowsyncError as e:
            if str(path) not in str(e):
                unexpected.append(f"case {case} ({mutate.__name__}): message lacks the path: {e}")
            outcomes["refused"] += 1
        except Exception as e:  # any other type (a warning too: they are errors here) fails
            unexpected.append(f"case {case} ({mutate.__name__}): {type(e).__name__}: {e}")
        else:
            assert isinstance(model, Llama)
            outcomes["loaded"] += 1
        if len(unexpected) >= 10:
            break
    assert not unexpected, f"seed {seed}:\n" + "\n".join(unexpected)
    # Both outcomes occur: the mutations reach past the first check, and not every one is fatal.
    assert outcomes["refused"] > CASES // 4, outcomes
    assert outcomes["loaded"] > CASES // 50, outcomes
