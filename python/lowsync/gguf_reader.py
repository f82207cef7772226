"""A bounded GGUF reader: the header, metadata and tensor table of a GGUF v2/v3 file.

Why: a GGUF header is untrusted input that says how much to read. The `gguf` package's reader
trusts its counts and builds Python objects per array element, so a few hundred bytes claiming
an array of 2**40 values, or a valid array of a few million, cost minutes and many times the
file's size in memory; and it accepts tensor tables that overlap, are misaligned or point past
the end of the file. lowsync loads weights straight from the file's memory map, so the table
has to be right before any weight is touched.

Strategy: the file is memory-mapped once (`numpy.memmap`, read-only) and parsed front to back
by a cursor that checks every count (keys, tensors, string and array lengths, dimensions)
against the bytes that remain before it reads or allocates anything. Arrays of numbers become
one `numpy.frombuffer` view each (no object per element); arrays of strings are checked
(lengths, UTF-8) element by element and kept as a `StringArray` over the map, which decodes an
element when it is read (a vocabulary and its merges, ~100k strings, held 8 MiB of `str` objects
that running a model from token ids never reads), and each element takes at least 8 bytes of
the file; nested arrays are refused, as
llama.cpp does. The tensor table is then checked the way llama.cpp's loader checks it: a known
type, at most 4 dimensions, rows a whole number of blocks, offsets aligned to
`general.alignment` (a power of two, default 32), every tensor inside the file, no overlap, and
the tensors laid out in order without gaps. Time and memory are proportional to the file's size.

Invariants: every problem with the file is a `GGUFError` whose message names the file and the
key or tensor; nothing here reads tensor data; tensor data is exposed as views of the map.
"""

from __future__ import annotations

import itertools
import os
import stat
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from lowsync._native import LowsyncError

Array = npt.NDArray[Any]

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME (64) less the terminating NUL
_HEADER_BYTES = 24  # magic, version, tensor count, key count
_MIN_KV_BYTES = 8 + 4 + 1  # an empty key, the value type and the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # an empty name, n_dims = 0, the type and the offset


class GGUFError(LowsyncError, ValueError):
    """A GGUF file lowsync cannot load: the message names the file, the key or tensor, and
    what is supported."""


class ValueType(IntEnum):
    """GGUF metadata value types (the numbers stored in the file)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Fixed-size value types: struct format and numpy dtype, both little-endian.
_FIXED: dict[int, tuple[str, str]] = {
    ValueType.UINT8: ("<B", "<u1"),
    ValueType.INT8: ("<b", "<i1"),
    ValueType.UINT16: ("<H", "<u2"),
    ValueType.INT16: ("<h", "<i2"),
    ValueType.UINT32: ("<I", "<u4"),
    ValueType.INT32: ("<i", "<i4"),
    ValueType.FLOAT32: ("<f", "<f4"),
    ValueType.BOOL: ("<B", "<u1"),
    ValueType.UINT64: ("<Q", "<u8"),
    ValueType.INT64: ("<q", "<i8"),
    ValueType.FLOAT64: ("<d", "<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGMLType:
    """A ggml tensor type: its name, elements per block and bytes per block."""

    id: int
    name: str
    block: int
    block_bytes: int


# The ggml tensor types a GGUF file may name (ggml's type ids, block sizes and block bytes).
GGML_TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "F32", 1, 4),
        GGMLType(1, "F16", 1, 2),
        GGMLType(2, "Q4_0", 32, 18),
        GGMLType(3, "Q4_1", 32, 20),
        GGMLType(6, "Q5_0", 32, 22),
        GGMLType(7, "Q5_1", 32, 24),
        GGMLType(8, "Q8_0", 32, 34),
        GGMLType(9, "Q8_1", 32, 36),
        GGMLType(10, "Q2_K", 256, 84),
        GGMLType(11, "Q3_K", 256, 110),
        GGMLType(12, "Q4_K", 256, 144),
        GGMLType(13, "Q5_K", 256, 176),
        GGMLType(14, "Q6_K", 256, 210),
        GGMLType(15, "Q8_K", 256, 292),
        GGMLType(16, "IQ2_XXS", 256, 66),
        GGMLType(17, "IQ2_XS", 256, 74),
        GGMLType(18, "IQ3_XXS", 256, 98),
        GGMLType(19, "IQ1_S", 256, 50),
        GGMLType(20, "IQ4_NL", 32, 18),
        GGMLType(21, "IQ3_S", 256, 110),
        GGMLType(22, "IQ2_S", 256, 82),
        GGMLType(23, "IQ4_XS", 256, 136),
        GGMLType(24, "I8", 1, 1),
        GGMLType(25, "I16", 1, 2),
        GGMLType(26, "I32", 1, 4),
        GGMLType(27, "I64", 1, 8),
        GGMLType(28, "F64", 1, 8),
        GGMLType(29, "IQ1_M", 256, 56),
        GGMLType(30, "BF16", 1, 2),
        GGMLType(34, "TQ1_0", 256, 54),
        GGMLType(35, "TQ2_0", 256, 66),
        GGMLType(39, "MXFP4", 32, 17),
        GGMLType(40, "NVFP4", 64, 36),
        GGMLType(41, "Q1_0", 128, 18),
    )
}


class StringArray(Sequence[str]):
    """A GGUF array of strings, read from the file's map: an element is decoded when it is read
    (its length and UTF-8 were checked when the file was parsed). Compares equal to any
    sequence of the same strings; `list(a)` gives the plain list."""

    __slots__ = ("_buf", "_starts")

    def __init__(self, buf: memoryview, starts: Array) -> None:
        self._buf = buf
        self._starts = starts  # each element's first byte, after its 8-byte length

    def __len__(self) -> int:
        return len(self._starts)

    def _decode(self, start: int) -> str:
        (n,) = _U64.unpack_from(self._buf, start - 8)
        return str(self._buf[start : start + n], "utf-8")

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._decode(s) for s in self._starts[i].tolist()]
        return self._decode(int(self._starts[i]))  # numpy's IndexError when out of range

    def __iter__(self) -> Iterator[str]:
        return map(self._decode, self._starts.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str) or not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type[list[str]], tuple[list[str]]]:
        # A map cannot be pickled or copied: a copy is the plain list.
        return list, (list(self),)

    def __repr__(self) -> str:
        head = ", ".join(map(repr, self[:3]))
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], {len(self)} items)"


@dataclass(frozen=True)
class Field:
    """One metadata key. `value` is an int, float, bool or str for a scalar; for an array, a
    read-only numpy array (numbers; bools as numpy bools) or a `StringArray`. `item_type` is
    the element type of an array, None for a scalar."""

    key: str
    type: ValueType
    value: Any
    item_type: ValueType | None = None

    def __len__(self) -> int:
        return len(self.value) if self.type == ValueType.ARRAY else 1


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. `ne` is GGUF's dimension order (ne0 first); `offset` is
    relative to the data section, as stored; `nbytes` is the size of its data."""

    name: str
    ne: tuple[int, ...]
    type: GGMLType
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy shape (`ne` reversed: `[out, in]` for a projection)."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.ne:
            n *= d
        return n


def _describe_non_file(mode: int) -> str:
    for test, what in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


class GGUFFile:
    """A GGUF file, memory-mapped, with its metadata (`fields`) and tensor table (`tensors`,
    in file order) parsed and checked; `tensor_data` gives a tensor's bytes as a view.

    Example::

        f = GGUFFile("model.gguf")
        arch = f.fields["general.architecture"].value
        raw = f.tensor_data(f.tensors["token_embd.weight"])  # uint8 view of the map
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        st = os.stat(self.path)  # FileNotFoundError / PermissionError name the path themselves
        if stat.S_ISDIR(st.st_mode):
            raise self.err("is a directory, not a GGUF file")
        if not stat.S_ISREG(st.st_mode):
            raise self.err(f"is not a regular file ({_describe_non_file(st.st_mode)})")
        if st.st_size == 0:
            raise self.err("is empty (0 bytes), not a GGUF file")
        if st.st_size < _HEADER_BYTES:
            raise self.err(
                f"is too short to be a GGUF file ({st.st_size} bytes; a header alone is "
                f"{_HEADER_BYTES}): truncated?"
            )
        self.map: np.memmap[Any, np.dtype[np.uint8]] = np.memmap(self.path, np.uint8, mode="r")
        self.size = int(self.map.shape[0])
        cur = _Cursor(self, self.map.data)
        self.version = _read_preamble(self, cur)
        n_tensors, n_kv = cur.u64(), cur.u64()
        left = self.size - cur.pos
        need = n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES
        if need > left:
            raise self.err(
                f"the header claims {n_kv} keys and {n_tensors} tensors, which need at least "
                f"{need} bytes, but only {left} follow: truncated or corrupt"
            )
        self.fields: dict[str, Field] = {}
        for i in range(n_kv):
            field = _read_field(cur, i)
            if field.key in self.fields:
                raise self.err(f"key `{field.key[:100]}` appears twice")
            self.fields[field.key] = field
        self.alignment = self._alignment()
        infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for info in infos:
            if info.name in self.tensors:
                raise self.err(f"tensor `{info.name}` appears twice in the tensor table")
            self.tensors[info.name] = info
        self._check_layout(infos)

    def err(self, msg: str) -> GGUFError:
        """A `GGUFError` whose message starts with this file's path."""
        return GGUFError(f"{self.path}: {msg}")

    def tensor_data(self, info: TensorInfo) -> Array:
        """The bytes of a tensor: a read-only uint8 view of the file's map (no copy)."""
        start = self.data_offset + info.offset
        view: Array = self.map[start : start + info.nbytes]
        return view

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return DEFAULT_ALIGNMENT
        if field.type != ValueType.UINT32:
            raise self.err(
                f"key `general.alignment` has type {field.type.name}; GGUF stores it as UINT32"
            )
        value = int(field.value)
        if value == 0 or value & (value - 1):
            raise self.err(f"key `general.alignment` is {value}, which is not a power of two")
        return value

    def _check_layout(self, infos: list[TensorInfo]) -> None:
        """Each tensor aligned and inside the file; no two overlap; in order, without gaps."""
        data_bytes = self.size - self.data_offset
        if infos and data_bytes < 0:
            raise self.err(
                f"the data section would start at byte {self.data_offset} (the header padded to "
                f"{self.alignment}), past the end of the file ({self.size} bytes): truncated"
            )
        for t in infos:
            if t.offset % self.alignment:
                raise self.err(
                    f"tensor `{t.name}`: its data offset {t.offset} is not a multiple of the "
                    f"alignment {self.alignment}"
                )
            end = t.offset + t.nbytes
            if end >= 2**64:
                raise self.err(
                    f"tensor `{t.name}`: offset {t.offset} + size {t.nbytes} wraps around 64 bits"
                )
            if end > data_bytes:
                raise self.err(
                    f"tensor `{t.name}`: its data (bytes {t.offset}..{end} of the data section) "
                    f"lies past the end of the file, whose data section holds {max(data_bytes, 0)}"
                    " bytes: truncated or corrupt"
                )
        by_offset = sorted((t for t in infos if t.nbytes), key=lambda t: t.offset)
        for a, b in itertools.pairwise(by_offset):
            if b.offset < a.offset + a.nbytes:
                raise self.err(
                    f"tensors `{a.name}` (bytes {a.offset}..{a.offset + a.nbytes}) and `{b.name}` "
                    f"(from byte {b.offset}) overlap in the data section"
                )
        expected = 0
        for t in infos:
            if t.offset != expected:
                raise self.err(
                    f"tensor `{t.name}` has data offset {t.offset} where {expected} was expected: "
                    "GGUF tensors are stored in table order, each padded to the alignment, "
                    "without gaps (llama.cpp refuses this file too)"
                )
            expected += -(-t.nbytes // self.alignment) * self.alignment


class _Cursor:
    """A read position in the map; every read is bounded by the bytes left."""

    def __init__(self, file: GGUFFile, buf: memoryview) -> None:
        self.file = file
        self.buf = buf
        self.pos = 0
        self.end = len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise self.file.err(
                f"{what} needs {n} bytes at byte {self.pos}, but only {self.end - self.pos} "
                "remain: truncated or corrupt"
            )

    def u32(self, what: str = "the header") -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self, what: str = "the header") -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        start = self.pos
        self.pos += n
        try:
            return str(self.buf[start : self.pos], "utf-8")
        except UnicodeDecodeError as e:
            raise self.file.err(
                f"{what} is not valid UTF-8 ({e.reason} at byte {start + e.start})"
            ) from None

    def fixed(self, vtype: int, what: str) -> Any:
        fmt, _ = _FIXED[vtype]
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v != 0 if vtype == ValueType.BOOL else v

    def numbers(self, vtype: int, count: int, what: str) -> Array:
        _, dtype = _FIXED[vtype]
        size = np.dtype(dtype).itemsize
        self.need(count * size, what)
        out: Array = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * size
        if vtype == ValueType.BOOL:
            out = out != 0
            out.flags.writeable = False
        return out

    def strings(self, count: int, what: str) -> StringArray:
        self.need(count * 8, what)  # each element is at least its 8-byte length
        buf, end, pos = self.buf, self.end, self.pos
        unpack = _U64.unpack_from
        starts = np.empty(count, np.int64)
        i = 0
        try:
            for i in range(count):
                n = unpack(buf, pos)[0] if end - pos >= 8 else end
                if n > end - pos - 8:
                    self.pos = pos
                    self.string(f"{what}, element {i},")  # raises, naming what ran short
                pos += 8
                starts[i] = pos
                str(buf[pos : pos + n], "utf-8")  # checked now, decoded again when read
                pos += n
        except UnicodeDecodeError as e:
            raise self.file.err(
                f"{what}, element {i}, is not valid UTF-8 ({e.reason} at byte {pos + e.start})"
            ) from None
        self.pos = pos
        return StringArray(buf, starts)


def _read_preamble(f: GGUFFile, cur: _Cursor) -> int:
    magic = bytes(cur.buf[:4])
    cur.pos = 4
    if magic != MAGIC:
        raise f.err(
            f"not a readable GGUF file: it starts with {magic!r} where a GGUF file starts with "
            f"{MAGIC!r}"
        )
    version = cur.u32()
    if version & 0xFFFF == 0 and version:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        raise f.err(
            f"the version field reads {version:#x} (version {swapped} byte-swapped): a big-endian "
            "GGUF file; lowsync reads little-endian GGUF files only"
        )
    if version not in SUPPORTED_VERSIONS:
        raise f.err(
            f"GGUF version {version} is not supported (supported: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))})"
        )
    return version


def _value_type(f: GGUFFile, raw: int, what: str) -> ValueType:
    try:
        return ValueType(raw)
    except ValueError:
        raise f.err(f"{what} has unknown value type {raw}") from None


def _read_field(cur: _Cursor, index: int) -> Field:
    f = cur.file
    key = cur.string(f"key #{index}")
    label = key if len(key) <= 100 else key[:100] + "..."  # messages stay readable
    what = f"the value of key `{label}`"
    vtype = _value_type(f, cur.u32(what), f"key `{label}`")
    if vtype == ValueType.STRING:
        return Field(key, vtype, cur.string(what))
    if vtype != ValueType.ARRAY:
        return Field(key, vtype, cur.fixed(vtype, what))
    item = _value_type(f, cur.u32(what), f"the items of key `{label}`")
    count = cur.u64(what)
    what = f"the array of key `{label}` ({count} {item.name} items)"
    if item == ValueType.ARRAY:
        raise f.err(f"key `{label}` is an array of arrays, which GGUF readers do not support")
    if item == ValueType.STRING:
        return Field(key, vtype, cur.strings(count, what), item)
    return Field(key, vtype, cur.numbers(item, count, what), item)


def _read_tensor_info(cur: _Cursor, index: int) -> TensorInfo:
    f = cur.file
    name = cur.string(f"the name of tensor #{index}")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise f.err(
            f"tensor #{index} has a {len(name.encode())}-byte name `{name[:80]}`; ggml allows at "
            f"most {MAX_NAME_BYTES}"
        )
    what = f"the table entry of tensor `{name}`"
    n_dims = cur.u32(what)
    if n_dims > MAX_DIMS:
        raise f.err(f"tensor `{name}` has {n_dims} dimensions; ggml allows at most {MAX_DIMS}")
    ne = tuple(cur.u64(what) for _ in range(n_dims))
    n = 1
    for d in ne:
        if d >= 2**63:
            raise f.err(f"tensor `{name}` has a negative dimension (ne {list(ne)} as uint64)")
        n *= d
    if n >= 2**63:
        raise f.err(f"tensor `{name}` has ne {list(ne)}: 2**63 elements or more")
    type_id = cur.u32(what)
    gtype = GGML_TYPES.get(type_id)
    if gtype is None:
        raise f.err(f"tensor `{name}` has unknown ggml type id {type_id}")
    row = ne[0] if ne else 1
    if row % gtype.block:
        raise f.err(
            f"tensor `{name}` of type {gtype.name} has rows of {row} elements, not a multiple of "
            f"its block size {gtype.block}"
        )
    offset = cur.u64(what)
    return TensorInfo(name, ne, gtype, offset, n // gtype.block * gtype.block_bytes)
