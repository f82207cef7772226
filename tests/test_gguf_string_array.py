"""GGUF string arrays are read from the file's map when used (`StringArray`), not held as `str`.

A vocabulary and its merges are ~100k strings that running a model from token ids never reads:
the reader checks them when it parses the file (lengths, UTF-8: the errors are tested with the
reader's) and keeps only each element's offset, 8 bytes, where a list held a `str` of ~60.
"""

from __future__ import annotations

import copy
import pickle
import tracemalloc
from pathlib import Path

import pytest

from lowsync.gguf_reader import GGUFFile, StringArray, ValueType
from test_gguf_reader import _array, _raw, _s, _write

WORDS = ["", "a", "héllo", "日本", " space", "x" * 300]


def _file(tmp_path: Path, words: list[str]) -> GGUFFile:
    payload = b"".join(_s(w) for w in words)
    return GGUFFile(
        _write(tmp_path, _raw([_array("k.words", ValueType.STRING, len(words), payload)]))
    )


def test_elements_read_back_by_index_slice_and_iteration(tmp_path: Path) -> None:
    value = _file(tmp_path, WORDS).fields["k.words"].value
    assert isinstance(value, StringArray)
    assert len(value) == len(WORDS)
    assert list(value) == WORDS
    assert [value[i] for i in range(-len(WORDS), len(WORDS))] == WORDS + WORDS
    assert value[1:4] == WORDS[1:4]
    assert value[::-2] == WORDS[::-2]
    assert value == WORDS
    words = list(WORDS)
    assert words == value  # list.__eq__ gives way to StringArray's
    assert value == tuple(WORDS)
    assert value != WORDS[:-1]
    assert value != [*WORDS[:-1], "y"]
    assert value != "".join(WORDS)
    with pytest.raises(IndexError):
        value[len(WORDS)]
    assert "héllo" in value
    assert value.index("日本") == 3
    assert pickle.loads(pickle.dumps(value)) == WORDS
    assert copy.deepcopy(value) == WORDS
    assert repr(value) == "StringArray(['', 'a', 'héllo', ...], 6 items)"


def test_many_strings_cost_their_offsets_not_their_objects(tmp_path: Path) -> None:
    words = [f"token{i}" for i in range(100_000)]
    payload = b"".join(_s(w) for w in words)
    path = _write(tmp_path, _raw([_array("k.words", ValueType.STRING, len(words), payload)]))
    tracemalloc.start()
    try:
        f = GGUFFile(path)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 8 bytes of offset per element and some slack; a list of str held ~60 bytes per element.
    assert held < 12 * len(words) + (256 << 10), held
    assert f.fields["k.words"].value == words
