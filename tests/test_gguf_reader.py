"""The bounded GGUF reader (`lowsync.gguf_reader`): it agrees with the `gguf` package on valid
files, refuses every count the file cannot hold before allocating for it, and checks the tensor
table as llama.cpp does. Broken files are built byte by byte with the small writer below."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from llama_ref import VARIANTS, random_weights, write_gguf
from lowsync.gguf_reader import GGML_TYPES, GGUFError, GGUFFile, ValueType

# ---- a small GGUF writer that writes what it is told, broken or not ---------------------------


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, ValueType.UINT32, struct.pack("<I", value))


def _array(key: str, item: int, count: int, payload: bytes) -> bytes:
    return _kv(key, ValueType.ARRAY, struct.pack("<IQ", item, count) + payload)


def _tensor(name: str, ne: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    dims = struct.pack(f"<I{len(ne)}Q", len(ne), *ne)
    return _s(name) + dims + struct.pack("<IQ", ggml_type, offset)


def _raw(
    kvs: Sequence[bytes] = (),
    tensors: Sequence[bytes] = (),
    data: bytes = b"",
    *,
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
) -> bytes:
    """A GGUF file: header, keys, tensor table, padding to `alignment`, then `data`."""
    n_kv = len(kvs) if n_kv is None else n_kv
    n_tensors = len(tensors) if n_tensors is None else n_tensors
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs)
    head += b"".join(tensors)
    return head + b"\0" * (-len(head) % alignment) + data


F32 = 0


def _two_tensors(offsets: tuple[int, int], data_bytes: int = 64, **kw: Any) -> bytes:
    """Two F32 tensors of 8 elements (32 bytes each) at `offsets` in the data section."""
    table = [_tensor("a", (8,), F32, offsets[0]), _tensor("b", (8,), F32, offsets[1])]
    return _raw(tensors=table, data=b"\1" * data_bytes, **kw)


def _write(tmp_path: Path, data: bytes, name: str = "t.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _refused(tmp_path: Path, data: bytes, *patterns: str) -> str:
    path = _write(tmp_path, data)
    with pytest.raises(GGUFError) as info:
        GGUFFile(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    for p in patterns:
        assert p in msg, f"{p!r} not in {msg!r}"
    return msg


@contextmanager
def _allocates_at_most(limit_bytes: int) -> Iterator[None]:
    """Fails when the body's peak Python/numpy allocation exceeds `limit_bytes`."""
    tracemalloc.start()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= limit_bytes, f"peak allocation {peak} bytes > {limit_bytes}"


# ---- agreement with the gguf package on valid files -------------------------------------------


def _same_as_gguf_package(path: Path) -> None:
    ref = gguf.GGUFReader(path)
    ours = GGUFFile(path)
    ref_fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}  # header
    assert list(ours.fields) == list(ref_fields)
    for key, rf in ref_fields.items():
        f = ours.fields[key]
        assert int(f.type) == int(rf.types[0]), key
        value = f.value.tolist() if isinstance(f.value, np.ndarray) else f.value
        want = rf.contents()
        if f.type == ValueType.FLOAT32:
            want = float(np.float32(want))
        assert value == want, key
    assert [t.name for t in ours.tensors.values()] == [t.name for t in ref.tensors]
    for rt in ref.tensors:
        t = ours.tensors[rt.name]
        assert list(t.ne) == rt.shape.tolist()
        assert t.type.id == int(rt.tensor_type)
        assert t.nbytes == int(rt.n_bytes)
        assert ours.data_offset + t.offset == int(rt.data_offset)
        assert np.array_equal(ours.tensor_data(t), np.asarray(rt.data).view(np.uint8).ravel())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reads_what_the_gguf_package_reads(tmp_path: Path, variant: str) -> None:
    spec = VARIANTS[variant]
    _same_as_gguf_package(write_gguf(tmp_path / "m.gguf", spec, random_weights(spec)))


@pytest.mark.parametrize("wtype", ["F16", "BF16", "Q8_0", "Q4_0"])
def test_reads_other_tensor_types_as_the_gguf_package(tmp_path: Path, wtype: str) -> None:
    spec = VARIANTS["llama"].with_(wtype=wtype)
    _same_as_gguf_package(write_gguf(tmp_path / "m.gguf", spec, random_weights(spec)))


def test_every_value_type_and_a_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    vt = gguf.GGUFValueType
    for i, t in enumerate([vt.UINT8, vt.INT8, vt.UINT16, vt.INT16, vt.UINT32, vt.INT32]):
        w.add_key_value(f"k.int{i}", -3 if t.name.startswith("INT") else 7, t)
    w.add_key_value("k.u64", 2**63 + 5, vt.UINT64)
    w.add_key_value("k.i64", -(2**62), vt.INT64)
    w.add_key_value("k.f32", 0.25, vt.FLOAT32)
    w.add_key_value("k.f64", 1e300, vt.FLOAT64)
    w.add_key_value("k.bool", True, vt.BOOL)
    w.add_key_value("k.str", "héllo ▁", vt.STRING)
    w.add_array("k.arr_i32", [1, -2, 3])
    w.add_array("k.arr_f32", [0.5, 1.5])
    w.add_array("k.arr_bool", [True, False, True])
    w.add_array("k.arr_str", ["", "a", "▁b"])
    w.add_array("k.empty", [])
    w.add_tensor("x", np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    w.add_tensor("y", np.ones(5, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf_package(path)
    f = GGUFFile(path)
    assert f.alignment == 64
    assert f.fields["k.arr_bool"].value.dtype == np.bool_
    assert f.tensors["x"].shape == (2, 3, 4)


def test_ggml_type_table_matches_the_gguf_package() -> None:
    ref = {int(t): (t.name, *sizes) for t, sizes in gguf.GGML_QUANT_SIZES.items()}
    ours = {t.id: (t.name, t.block, t.block_bytes) for t in GGML_TYPES.values()}
    # ggml's block_q8_1 is two f16 (d, s) and 32 int8: 36 bytes; gguf-py still says 40.
    assert ours.pop(9) == ("Q8_1", 32, 36)
    ref.pop(9)
    assert ours == ref


# ---- counts bounded by the bytes left (issue: header parsing amplifies) -----------------------


def test_huge_array_count_is_refused_before_allocating(tmp_path: Path) -> None:
    # A few hundred bytes claiming 2**40 elements: the count exceeds the bytes that follow.
    for item in (ValueType.UINT8, ValueType.FLOAT64, ValueType.STRING):
        data = _raw([_u32("general.alignment", 32), _array("k.big", item, 2**40, b"\0" * 200)])
        assert len(data) < 400
        with _allocates_at_most(256 * 1024):
            msg = _refused(tmp_path, data, "`k.big`", str(2**40), "truncated or corrupt")
        assert item.name in msg


def test_huge_key_and_tensor_counts_are_refused_before_parsing(tmp_path: Path) -> None:
    for n_kv, n_tensors in ((2**40, 0), (0, 2**40), (2**64 - 1, 2**64 - 1), (20, 0)):
        data = _raw([_u32("general.alignment", 32)], n_kv=n_kv, n_tensors=n_tensors)
        with _allocates_at_most(256 * 1024):
            _refused(tmp_path, data, f"claims {n_kv} keys and {n_tensors} tensors")


def test_huge_string_lengths_are_refused(tmp_path: Path) -> None:
    key = struct.pack("<Q", 2**63) + b"general.name"
    _refused(tmp_path, _raw([key + b"\0" * 64]), "key #0 needs 9223372036854775808 bytes")
    value = _kv("general.name", ValueType.STRING, struct.pack("<Q", 2**40) + b"abc")
    _refused(tmp_path, _raw([value]), "`general.name` needs 1099511627776 bytes")
    # One element of an array of strings claims more than is left.
    items = _s("ok") + struct.pack("<Q", 1000) + b"short"
    _refused(tmp_path, _raw([_array("k.s", ValueType.STRING, 2, items)]), "element 1")
    name = struct.pack("<Q", 2**50) + b"blk"
    _refused(tmp_path, _raw(tensors=[name + b"\0" * 32]), "the name of tensor #0")


def test_nested_arrays_are_refused(tmp_path: Path) -> None:
    inner = struct.pack("<IQ", ValueType.UINT8, 3) + b"abc"
    data = _raw([_array("k.nest", ValueType.ARRAY, 1, inner)])
    _refused(tmp_path, data, "`k.nest` is an array of arrays")


def test_a_valid_array_of_millions_of_numbers_is_one_view(tmp_path: Path) -> None:
    values = np.arange(3_000_000, dtype=np.uint32)
    path = _write(
        tmp_path, _raw([_array("k.many", ValueType.UINT32, values.size, values.tobytes())])
    )
    with _allocates_at_most(1024 * 1024):  # the 12 MB array is not copied
        f = GGUFFile(path)
    got = f.fields["k.many"].value
    assert np.shares_memory(got, f.map)
    assert np.array_equal(got, values)
    assert not got.flags.writeable


def test_a_valid_array_of_many_strings_costs_a_small_multiple_of_its_bytes(tmp_path: Path) -> None:
    words = [f"w{i}" for i in range(300_000)]
    payload = b"".join(_s(w) for w in words)
    path = _write(tmp_path, _raw([_array("k.words", ValueType.STRING, len(words), payload)]))
    with _allocates_at_most(8 * len(payload)):
        f = GGUFFile(path)
    assert f.fields["k.words"].value == words


def test_unknown_types_and_duplicates_are_refused(tmp_path: Path) -> None:
    _refused(tmp_path, _raw([_kv("k.x", 13, b"\0" * 8)]), "`k.x` has unknown value type 13")
    data = _raw([_array("k.y", 99, 1, b"\0" * 8)])
    _refused(tmp_path, data, "the items of key `k.y` has unknown value type 99")
    _refused(tmp_path, _raw([_u32("k.a", 1), _u32("k.a", 2)]), "key `k.a` appears twice")
    table = [_tensor("a", (8,), F32, 0), _tensor("a", (8,), F32, 32)]
    data = _raw(tensors=table, data=b"\0" * 64)
    _refused(tmp_path, data, "tensor `a` appears twice")


def test_bad_tensor_table_entries_are_refused(tmp_path: Path) -> None:
    def one(ne: tuple[int, ...], ggml_type: int = F32, name: str = "w") -> bytes:
        return _raw(tensors=[_tensor(name, ne, ggml_type, 0)], data=b"\0" * 64)

    _refused(tmp_path, one((1, 1, 1, 1, 1)), "`w` has 5 dimensions", "at most 4")
    _refused(tmp_path, one((2**64 - 4,)), "`w` has a negative dimension")
    _refused(tmp_path, one((2**32, 2**32)), "2**63 elements or more")
    _refused(tmp_path, one((8,), 31), "`w` has unknown ggml type id 31")
    _refused(tmp_path, one((48,), 8), "`w` of type Q8_0 has rows of 48", "block size 32")
    _refused(tmp_path, one((8,), name="n" * 64), "64-byte name", "at most 63")


# ---- the header itself ------------------------------------------------------------------------


def test_versions_and_byte_order(tmp_path: Path) -> None:
    _refused(tmp_path, _raw(version=1), "GGUF version 1 is not supported", "2, 3")
    _refused(tmp_path, _raw(version=4), "GGUF version 4 is not supported")
    assert GGUFFile(_write(tmp_path, _raw(version=2), "v2.gguf")).version == 2
    # A big-endian file written by the gguf package.
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("x", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="big-endian"):
        GGUFFile(path)


def test_non_utf8_strings_name_the_key(tmp_path: Path) -> None:
    value = _kv("general.name", ValueType.STRING, _s(b"caf\xe9"))
    _refused(tmp_path, _raw([value]), "`general.name` is not valid UTF-8")
    _refused(tmp_path, _raw([_kv(b"k\xff", ValueType.UINT8, b"\0")]), "key #0 is not valid UTF-8")
    items = _s("ok") + _s(b"\xc3")
    data = _raw([_array("tokenizer.ggml.tokens", ValueType.STRING, 2, items)])
    _refused(tmp_path, data, "`tokenizer.ggml.tokens`", "element 1, is not valid UTF-8")
    name = _s(b"blk.\xed\xa0\x80") + b"\0" * 24  # an encoded surrogate is not UTF-8 either
    _refused(tmp_path, _raw(tensors=[name]), "the name of tensor #0 is not valid UTF-8")


# ---- the tensor table, checked as llama.cpp checks it -----------------------------------------


def test_valid_two_tensor_layout(tmp_path: Path) -> None:
    f = GGUFFile(_write(tmp_path, _two_tensors((0, 32))))
    assert [t.offset for t in f.tensors.values()] == [0, 32]
    assert f.data_offset % 32 == 0


@pytest.mark.parametrize(
    ("offsets", "patterns"),
    [
        ((0, 16), ["`b`", "16 is not a multiple of the alignment 32"]),
        ((0, 0), ["`a`", "`b`", "overlap"]),
        ((0, 64), ["`b`", "past the end of the file", "truncated"]),
        ((0, 2**40), ["`b`", "past the end of the file"]),
        ((0, 2**64 - 32), ["`b`", "wraps around 64 bits"]),
        ((32, 0), ["`a`", "data offset 32 where 0 was expected", "without gaps"]),
    ],
)
def test_bad_offsets_are_refused(
    tmp_path: Path, offsets: tuple[int, int], patterns: list[str]
) -> None:
    _refused(tmp_path, _two_tensors(offsets), *patterns)


def test_a_gap_between_tensors_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, _two_tensors((0, 64), data_bytes=96), "`b`", "64 where 32 was expected")


def test_alignment_key_must_be_a_uint32_power_of_two(tmp_path: Path) -> None:
    for value in (0, 48):
        kv = _u32("general.alignment", value)
        data = _raw([kv], [_tensor("a", (8,), F32, 0)], b"\0" * 32, alignment=64)
        _refused(tmp_path, data, f"`general.alignment` is {value}", "not a power of two")
    kv = _kv("general.alignment", ValueType.UINT64, struct.pack("<Q", 32))
    _refused(tmp_path, _raw([kv]), "`general.alignment` has type UINT64")
    # Offsets aligned to 32 but not to the file's 64: the data section's layout is wrong.
    kv = _u32("general.alignment", 64)
    table = [_tensor("a", (8,), F32, 0), _tensor("b", (8,), F32, 32)]
    data = _raw([kv], table, b"\0" * 64, alignment=64)
    _refused(tmp_path, data, "`b`", "32 is not a multiple of the alignment 64")


def test_the_data_section_start_past_the_end_is_truncated(tmp_path: Path) -> None:
    data = _raw(tensors=[_tensor("a", (8,), F32, 0)])  # the table ends at byte 57, data at 64
    cut = 60  # inside the padding before the data section
    _refused(tmp_path, data[:cut], "past the end of the file", "truncated")


# ---- what the path is -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: p.write_bytes(b""), "is empty"),
        (lambda p: p.write_bytes(b"GGUF\3\0\0\0"), r"too short to be a GGUF file \(8 bytes"),
    ],
)
def test_paths_that_are_not_gguf_files_say_what_they_are(
    tmp_path: Path, make: Callable[[Path], object], pattern: str
) -> None:
    path = tmp_path / "x.gguf"
    make(path)
    with pytest.raises(GGUFError, match=pattern):
        GGUFFile(path)


def test_a_device_is_not_a_regular_file() -> None:
    with pytest.raises(GGUFError, match=r"/dev/null: is not a regular file \(a character device"):
        GGUFFile("/dev/null")
