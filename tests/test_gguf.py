"""GGUF loading and saving: hyper-parameters and variants, round trips, and one clear error per
kind of bad file (each names the file, the key or tensor, and what is supported)."""

from __future__ import annotations

import ast
import re
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

import lowsync as ls
from llama_ref import VARIANTS, Spec, random_weights, write_gguf
from lowsync.gguf import GGUFError, load_gguf, save_gguf
from lowsync.models.llama import Llama, LlamaConfig

TOKENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


def _logits(model: Llama, tokens: list[int] = TOKENS) -> np.ndarray:
    sess = ls.Session(model, backends=["cpu"], n_ctx=16, n_ubatch=4)
    out = sess.decode(tokens, logits="all")
    assert out is not None
    return out


def _file(tmp_path: Path, spec: Spec | None = None, **kw: object) -> Path:
    spec = spec or Spec()
    w = random_weights(spec)
    for name in [k for k, v in kw.items() if v is None]:
        del w[name.replace("__", ".")]
    return write_gguf(tmp_path / "model.gguf", spec, w)


# ---- what a file becomes --------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_load_with_their_hyper_parameters(tmp_path: Path, variant: str) -> None:
    spec = VARIANTS[variant]
    model = load_gguf(write_gguf(tmp_path / "m.gguf", spec, random_weights(spec)))
    c = model.config
    assert c.arch == spec.arch
    assert (c.n_vocab, c.n_embd, c.n_layer, c.n_ff) == (300, 64, 2, 96)
    assert (c.n_head, c.n_head_kv, c.head_dim, c.rope_dims) == (
        spec.n_head,
        spec.n_head_kv,
        spec.head_dim,
        spec.rope_dims,
    )
    assert c.rope_mode == ("neox" if spec.arch in ("qwen2", "qwen3") else "normal")
    assert c.rope_theta == pytest.approx(spec.theta)
    assert c.rms_eps == pytest.approx(spec.eps)
    assert (c.qkv_bias, c.qk_norm, c.tied_embeddings) == (spec.bias, spec.qk_norm, spec.tied)
    assert model.name == f"test-{spec.arch}"
    # F32 tensors stay memory-mapped, in numpy order ([out, in]).
    q = model.weights["blk.0.attn_q.weight"]
    assert q.shape == (spec.n_head * spec.head_dim, spec.n_embd)
    assert isinstance(q.base, np.memmap) or isinstance(q, np.memmap)


@pytest.mark.parametrize("wtype", ["F16", "BF16", "Q8_0", "Q4_1"])
def test_tensor_types_load_to_their_values(tmp_path: Path, wtype: str) -> None:
    spec = Spec(wtype=wtype)
    w = random_weights(spec)
    model = load_gguf(write_gguf(tmp_path / "m.gguf", spec, w))
    t = gguf.GGMLQuantizationType[wtype]
    want = gguf.quants.dequantize(gguf.quants.quantize(w["blk.1.ffn_down.weight"], t), t)
    got = model.weights["blk.1.ffn_down.weight"]
    if wtype == "BF16":
        assert model.dtypes["blk.1.ffn_down.weight"] == "bf16"
        assert got.dtype == np.float32
        assert np.array_equal(got, want)
    elif wtype == "F16":
        assert got.dtype == np.float16
        assert np.array_equal(got, want.astype(np.float16))
    else:  # quantized types stay quantized: their raw blocks
        assert model.dtypes["blk.1.ffn_down.weight"] == wtype.lower()
        assert got.dtype == np.uint8
        assert np.array_equal(ls.dequantize(got, wtype.lower()), want)
    assert model.weights["blk.1.ffn_norm.weight"].dtype == np.float32


# ---- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_random_model_round_trip_gives_identical_logits(tmp_path: Path, dtype: str) -> None:
    model = Llama.random(LlamaConfig(300, 64, 2, 4, 2, 96), seed=5, dtype=dtype)
    path = tmp_path / "rt.gguf"
    model.save_gguf(path)
    loaded = ls.load_gguf(path)
    assert loaded.config == model.config
    assert loaded.dtypes == model.dtypes
    for name, data in model.weights.items():
        assert np.array_equal(loaded.weights[name], data), name
    assert np.array_equal(_logits(loaded), _logits(model))


@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "tied", "mistral"])
def test_loaded_variant_round_trip(tmp_path: Path, variant: str) -> None:
    spec = VARIANTS[variant]
    model = load_gguf(write_gguf(tmp_path / "a.gguf", spec, random_weights(spec)))
    save_gguf(model, tmp_path / "b.gguf")
    again = load_gguf(tmp_path / "b.gguf")
    # mistral files are written as llama (same tensors and keys); everything else is kept.
    assert again.config == (
        model.with_config(arch="llama").config if variant == "mistral" else model.config
    )
    assert np.array_equal(_logits(again), _logits(model))
    # The file's own vocabulary is written back.
    reader = gguf.GGUFReader(tmp_path / "b.gguf")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert tokens.contents()[:3] == ["t0", "t1", "t2"]


def test_saved_random_model_has_a_byte_level_spm_vocab(tmp_path: Path) -> None:
    model = Llama.random(LlamaConfig(300, 64, 1, 4, 2, 96), seed=0)
    model.save_gguf(tmp_path / "v.gguf")
    r = gguf.GGUFReader(tmp_path / "v.gguf")
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["tokenizer.ggml.model"].contents() == "llama"
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == 300
    assert len(set(tokens)) == 300
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3] == "<0x00>"
    assert tokens[258] == "<0xFF>"
    assert types[3:259] == [int(gguf.TokenType.BYTE)] * 256
    assert r.fields["tokenizer.ggml.bos_token_id"].contents() == 1
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == 2
    assert r.fields["llama.rope.dimension_count"].contents() == 16
    # ne order in the file: attn_q is ne [n_embd, n_head * head_dim].
    q = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    assert q.shape.tolist() == [64, 64]
    out = next(t for t in r.tensors if t.name == "output.weight")
    assert out.shape.tolist() == [64, 300]


# ---- bad files ------------------------------------------------------------------------------


def _raises(path: Path, *patterns: str) -> None:
    with pytest.raises(GGUFError) as info:
        load_gguf(path)
    msg = str(info.value)
    assert path.name in msg, msg
    for p in patterns:
        assert re.search(p, msg), f"{p!r} not in {msg!r}"
    assert isinstance(info.value, ls.LowsyncError)
    assert isinstance(info.value, ValueError)


def test_other_architecture(tmp_path: Path) -> None:
    _raises(
        _file(tmp_path, Spec(arch="gpt2")),
        r"general\.architecture",
        "gpt2",
        "llama, mistral, qwen2, qwen3",
    )


def test_quantized_types_load_quantized(tmp_path: Path) -> None:
    model = load_gguf(_file(tmp_path, Spec(wtype="Q4_0")))
    assert model.dtypes["token_embd.weight"] == "q4_0"
    assert model.weights["token_embd.weight"].shape == (300, 64 // 32 * 18)


def test_truncated_files(tmp_path: Path) -> None:
    path = _file(tmp_path)
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40, 3):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        _raises(short, "truncated")


def test_corrupt_magic(tmp_path: Path) -> None:
    path = _file(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"XXXX" + path.read_bytes()[4:])
    _raises(bad, "not a readable GGUF file")


def test_missing_tensor(tmp_path: Path) -> None:
    _raises(
        _file(tmp_path, blk__1__ffn_down__weight=None),
        r"missing tensors `blk\.1\.ffn_down\.weight`",
    )


def test_missing_key(tmp_path: Path) -> None:
    path = _file(tmp_path)
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "nokey.gguf"), "llama")
    for key in ("llama.context_length", "llama.block_count", "llama.attention.head_count"):
        w.add_uint32(key, int(reader.fields[key].contents()))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.feed_forward_length", 96)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _raises(tmp_path / "nokey.gguf", r"missing key `llama\.embedding_length`")


def test_inconsistent_hyper_parameters(tmp_path: Path) -> None:
    # 4 query heads cannot be grouped over 3 KV heads.
    spec = Spec()
    w = random_weights(spec.with_(n_head_kv=4))
    p = write_gguf(tmp_path / "heads.gguf", spec.with_(n_head_kv=3), w)
    _raises(p, "inconsistent hyper-parameters", "n_head_kv")
    # The feed-forward length disagrees with the tensors.
    w = random_weights(spec)
    p = write_gguf(tmp_path / "ff.gguf", spec.with_(n_ff=128), w)
    _raises(p, r"`blk\.0\.ffn_gate\.weight`", r"\(128, 64\)", r"\(96, 64\)")
    # The vocabulary and the embedding table disagree.
    p = write_gguf(tmp_path / "vocab.gguf", spec.with_(n_vocab=301), w)
    _raises(p, "301 tokens", "300 rows")
    # V heads of another size than K heads.
    p = write_gguf(
        tmp_path / "vdim.gguf", spec.with_(extra_keys={"llama.attention.value_length": 8}), w
    )
    _raises(p, r"`llama\.attention\.value_length` is 8", "equal K and V")


def test_unsupported_features(tmp_path: Path) -> None:
    spec = Spec(extra_keys={"llama.rope.scaling.type": "yarn"})
    _raises(_file(tmp_path, spec), r"rope\.scaling\.type", "yarn")
    w = random_weights(Spec())
    w["rope_freqs.weight"] = np.ones(8, np.float32)
    _raises(write_gguf(tmp_path / "freqs.gguf", Spec(), w), r"`rope_freqs\.weight`")
    w = random_weights(Spec())
    w["blk.2.attn_norm.weight"] = np.ones(64, np.float32)  # a block past block_count
    _raises(
        write_gguf(tmp_path / "extra.gguf", Spec(), w), r"`blk\.2\.attn_norm\.weight`", "not part"
    )


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_top_level_exports_are_lazy() -> None:
    assert ls.load_gguf is load_gguf
    assert ls.GGUFError is GGUFError
    assert ls.Llama is Llama


def test_partial_rope_is_refused_at_save_because_llama_cpp_cannot_load_it(
    tmp_path: Path,
) -> None:
    """llama.cpp's llama/qwen2/qwen3 require rope.dimension_count == head size."""
    model = Llama.random(LlamaConfig(300, 64, 1, 4, 2, 96, rope_dims=8), seed=0)
    with pytest.raises(GGUFError, match=r"llama\.rope\.dimension_count = 8"):
        model.save_gguf(tmp_path / "p.gguf")
    assert not (tmp_path / "p.gguf").exists()


# ---- strict and bounded loading: each of these loaded silently, or hung, before --------------


def _saved(tmp_path: Path, name: str = "saved.gguf") -> Path:
    model = Llama.random(LlamaConfig(300, 64, 1, 4, 2, 96), seed=2)
    model.save_gguf(tmp_path / name)
    return tmp_path / name


def _offset_field(data: bytes, path: Path, name: str) -> int:
    """The byte position of tensor `name`'s data offset in its table entry."""
    n_dims = len(next(t for t in gguf.GGUFReader(path).tensors if t.name == name).shape)
    raw = name.encode()
    at = data.index(struct.pack("<Q", len(raw)) + raw)
    return at + 8 + len(raw) + 4 + 8 * n_dims + 4


def _patched(path: Path, changes: dict[str, int | str]) -> Path:
    """A copy of `path` whose tensors get new data offsets: a number, or another's offset."""
    data = bytearray(path.read_bytes())
    names = set(changes) | {v for v in changes.values() if isinstance(v, str)}
    at = {n: _offset_field(bytes(data), path, n) for n in names}
    old = {n: struct.unpack_from("<Q", data, at[n])[0] for n in names}
    for n, new in changes.items():
        struct.pack_into("<Q", data, at[n], old[new] if isinstance(new, str) else new)
    out = path.with_name("patched.gguf")
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(
    ("changes", "patterns"),
    [
        ({"blk.0.attn_k.weight": "blk.0.attn_q.weight"}, [r"`blk\.0\.attn_k\.weight`", "overlap"]),
        ({"blk.0.attn_k.weight": 2**40}, [r"`blk\.0\.attn_k\.weight`", "past the end"]),
        ({"blk.0.attn_k.weight": 2**64 - 32}, [r"`blk\.0\.attn_k\.weight`", "wraps around"]),
        # attn_k and attn_v have one shape: exchanged offsets pass every check but llama.cpp's
        # layout rule, and would load with K and V exchanged.
        (
            {
                "blk.0.attn_k.weight": "blk.0.attn_v.weight",
                "blk.0.attn_v.weight": "blk.0.attn_k.weight",
            },
            [
                r"`blk\.0\.attn_k\.weight` has data offset \d+ where \d+ was expected",
                "without gaps",
            ],
        ),
    ],
)
def test_invalid_tensor_offsets_are_refused(
    tmp_path: Path, changes: dict[str, int | str], patterns: list[str]
) -> None:
    _raises(_patched(_saved(tmp_path), changes), *patterns)


def test_misaligned_tensor_offset_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    at = _offset_field(bytes(data), path, "blk.0.ffn_up.weight")
    struct.pack_into("<Q", data, at, struct.unpack_from("<Q", data, at)[0] + 4)
    bad = tmp_path / "misaligned.gguf"
    bad.write_bytes(bytes(data))
    _raises(bad, r"`blk\.0\.ffn_up\.weight`", "not a multiple of the alignment 32")


def test_non_utf8_metadata_names_file_and_key(tmp_path: Path) -> None:
    model = Llama.random(LlamaConfig(300, 64, 1, 4, 2, 96), seed=2)
    model.name = "NAMEXXXX"
    model.save_gguf(tmp_path / "n.gguf")
    data = (tmp_path / "n.gguf").read_bytes()
    (tmp_path / "name.gguf").write_bytes(data.replace(b"NAMEXXXX", b"NAME\xff\xfeXX"))
    _raises(tmp_path / "name.gguf", r"`general\.name` is not valid UTF-8")
    (tmp_path / "tok.gguf").write_bytes(data.replace(b"<unk>", b"<\xc3nk>"))
    _raises(tmp_path / "tok.gguf", r"`tokenizer\.ggml\.tokens`", "element 0", "UTF-8")


def test_huge_array_count_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    key = b"tokenizer.ggml.tokens"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 8  # type, item type
    assert struct.unpack_from("<Q", data, at)[0] == 300
    struct.pack_into("<Q", data, at, 2**40)
    bad = tmp_path / "huge.gguf"
    bad.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        _raises(bad, r"`tokenizer\.ggml\.tokens`", str(2**40), "truncated or corrupt")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_q8_0_values_beyond_f16_stay_exact(tmp_path: Path) -> None:
    spec = Spec(wtype="Q8_0")
    w = random_weights(spec)
    w["blk.1.ffn_down.weight"][3, 5] = 1e5  # above f16's 65504
    model = load_gguf(write_gguf(tmp_path / "big.gguf", spec, w))
    t = gguf.GGMLQuantizationType.Q8_0
    name = "blk.1.ffn_down.weight"
    want = gguf.quants.dequantize(gguf.quants.quantize(w[name], t), t)
    assert model.dtypes[name] == "q8_0"
    got = ls.dequantize(model.weights[name], "q8_0")
    assert np.isfinite(got).all()
    assert np.array_equal(got, want)
    assert np.isfinite(_logits(model)).all()


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: p.write_bytes(b""), r"is empty \(0 bytes\)"),
        (lambda p: p.write_bytes(b"GGUF"), r"too short to be a GGUF file \(4 bytes"),
    ],
)
def test_paths_that_are_not_gguf_files_say_what_they_are(
    tmp_path: Path, make: Callable[[Path], object], pattern: str
) -> None:
    make(tmp_path / "x.gguf")
    _raises(tmp_path / "x.gguf", pattern)


def test_dev_null_is_not_a_regular_file() -> None:
    with pytest.raises(GGUFError, match=r"/dev/null: is not a regular file \(a character device"):
        load_gguf("/dev/null")


def test_a_large_valid_array_costs_memory_in_proportion_to_its_bytes(tmp_path: Path) -> None:
    # Real vocabularies carry ~150k merges; the gguf package's reader took ~20 s and 80x the
    # array's bytes for 200k of them (numpy views per element).
    merges = [f"m{i} x" for i in range(100_000)]
    spec = Spec(extra_keys={"tokenizer.ggml.merges": merges})
    path = write_gguf(tmp_path / "merges.gguf", spec, random_weights(spec))
    array_bytes = sum(8 + len(m) for m in merges)
    tracemalloc.start()
    try:
        model = load_gguf(path)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 8 * array_bytes, (peak, array_bytes)
    assert model.metadata["tokenizer.ggml.merges"][0] == merges


def _lowsync_imports(path: Path) -> set[str]:
    """The `lowsync.*` modules a source file imports, at top level or inside functions."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lowsync"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lowsync")}
    return found


def test_gguf_and_model_modules_import_without_a_circle() -> None:
    root = Path(ls.__file__).parent
    modules = {
        "lowsync.gguf": root / "gguf.py",
        "lowsync.gguf_reader": root / "gguf_reader.py",
        "lowsync.gguf_writer": root / "gguf_writer.py",
        "lowsync.models": root / "models" / "__init__.py",
        "lowsync.models.llama": root / "models" / "llama.py",
    }
    graph = {m: _lowsync_imports(p) & set(modules) for m, p in modules.items()}
    assert "lowsync.gguf" not in graph["lowsync.models.llama"]
    assert not graph["lowsync.gguf_writer"] & {"lowsync.models", "lowsync.models.llama"}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start]
        )

    assert [m for m in modules if reaches(m, m, set())] == []
