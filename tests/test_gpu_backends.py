"""The llama decode end to end on each GPU backend present (Vulkan runs in CI on Mesa's
lavapipe; CUDA where a device exists): the same greedy tokens and bit-identical logits under
every policy, the same tokens as `cpu`, and the per-token counts each policy promises.

Marked `vulkan` / `cuda`: skipped without the device, a failure for Vulkan when
`LOWSYNC_REQUIRE_VULKAN=1` (set by `.ci/run`).
"""

from __future__ import annotations

import numpy as np
import pytest

import lowsync as ls
from helpers import assert_step_counts, steps_queued
from lowsync._native import device_type
from lowsync.models.llama import LlamaConfig

# Small enough for lavapipe (a CPU implementation of Vulkan) to decode in a second.
MICRO = LlamaConfig(n_vocab=256, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128)
PROMPT = [3, 17, 42, 101, 7]
N_GEN = 8

DEVICES = [
    pytest.param("vulkan", marks=pytest.mark.vulkan),
    pytest.param("cuda", marks=pytest.mark.cuda),
]


def _family(kernel: str) -> str:
    """A profiled kernel's family: its name before the first dot, without the `_t` that marks a
    row kernel's one-invocation-per-row layout (`LOWSYNC_VK_ROW_LANES`, a CPU-type device's
    default)."""
    return kernel.split(".")[0].removesuffix("_t")


def run(backend: str, policy: str) -> tuple[list[int], np.ndarray, ls.session.GenerateStats]:
    model = ls.Llama.random(MICRO, seed=4)
    sess = ls.Session(model, backends=[backend], n_ctx=64, n_ubatch=8, policy=policy)
    logits = sess.decode(PROMPT, seq_id=0, logits="all")
    assert logits is not None
    sess.seq_rm(0)
    tokens = sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=0)
    stats = sess.last_generate
    assert stats is not None
    assert sess.launch_ahead == (policy == "staged" and backend != "cpu")
    return tokens, logits, stats


@pytest.mark.parametrize("backend", DEVICES)
def test_policies_agree_bit_for_bit_and_match_the_cpu_tokens(
    backend: str, clean_env: pytest.MonkeyPatch
) -> None:
    cpu_tokens, cpu_logits, _ = run("cpu", "staged")
    runs = {p: run(backend, p) for p in ("stock", "relaxed", "staged")}
    tokens, logits, _ = runs["staged"]
    for policy, (t, lg, _) in runs.items():
        assert t == tokens, policy
        assert np.array_equal(lg, logits), policy
    assert tokens == cpu_tokens
    rel = np.max(np.abs(logits - cpu_logits)) / np.max(np.abs(cpu_logits))
    assert rel < 1e-4


@pytest.mark.parametrize("backend", DEVICES)
def test_staged_decode_makes_one_host_wait_and_one_upload_per_token(
    backend: str, clean_env: pytest.MonkeyPatch
) -> None:
    _, _, stats = run(backend, "staged")
    assert_step_counts(stats, launch_ahead=True)


@pytest.mark.vulkan
def test_vulkan_legacy_switch_shows_ggmls_empty_submits(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LOWSYNC_VK_LEGACY_SUBMITS", "0")
    _, _, off = run("vulkan", "stock")
    assert [d["empty_submits"] for d in off.steps] == [0] * off.n_steps
    # Per step the scheduler synchronizes 4 times with nothing queued (all elided here), and
    # the token's read makes a copy submission of its own unless the buffer is read through a
    # host-cached mapping (lavapipe: 1 submit per step; a discrete GPU such as the H200: 2).
    assert [d["elided_syncs"] for d in off.steps] == [4] * off.n_steps
    mapped = [d["submits"] == 1 for d in off.steps]
    assert all(d["submits"] in (1, 2) for d in off.steps)
    clean_env.setenv("LOWSYNC_VK_LEGACY_SUBMITS", "1")
    _, _, on = run("vulkan", "stock")
    # ggml's empty submit at every synchronize, and one more where the read of a mapped buffer
    # drains through a synchronize: exact per step.
    assert [d["empty_submits"] for d in on.steps] == [4 + m for m in mapped]


def _vulkan_decode(
    record: str, env: pytest.MonkeyPatch
) -> tuple[list[int], np.ndarray, ls.session.GenerateStats]:
    """Tokens, prompt logits and counts of a second generation (launch-ahead on) with
    `LOWSYNC_VK_RECORD=record`; the first one recorded every plan the second replays."""
    env.setenv("LOWSYNC_VK_RECORD", record)
    model = ls.Llama.random(MICRO, seed=4)
    sess = ls.Session(model, backends=["vulkan"], n_ctx=64, n_ubatch=8, policy="staged")
    assert sess.launch_ahead
    assert sess.plans[0].n_splits == 1
    logits = sess.decode(PROMPT, seq_id=0, logits="all")
    assert logits is not None
    sess.seq_rm(0)
    sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=0)
    sess.seq_rm(0)
    tokens = sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=0)
    stats = sess.last_generate
    assert stats is not None
    return tokens, logits, stats


@pytest.mark.vulkan
@pytest.mark.parametrize("no_rebar", ["0", "1"])
def test_vulkan_replays_a_recorded_step_per_token_with_the_counts_of_recording_it(
    no_rebar: str, clean_env: pytest.MonkeyPatch
) -> None:
    """`LOWSYNC_VK_RECORD` on and off, on both memory paths: the same tokens and bit-identical
    logits; per step queued, one graph launch and no kernel recorded (nothing captured: the
    first generation recorded every plan) against the graph's nodes recorded every step; and
    every other count of every step the same: per step, one submission for each step queued,
    which carries the token's read too, no empty submit."""
    clean_env.setenv("LOWSYNC_VK_NO_HOST_VISIBLE_VRAM", no_rebar)
    tokens_on, logits_on, on = _vulkan_decode("1", clean_env)
    tokens_off, logits_off, off = _vulkan_decode("0", clean_env)
    assert tokens_on == tokens_off
    assert np.array_equal(logits_on, logits_off)
    launches = off.steps[1]["kernel_launches"]
    assert launches > 10  # a recorded step records every node of the decode graph
    assert_step_counts(
        on,
        launch_ahead=True,
        per_queued={"graph_launches": 1, "kernel_launches": 0, "graph_captures": 0},
    )
    assert_step_counts(
        off, launch_ahead=True, per_queued={"graph_launches": 0, "kernel_launches": launches}
    )
    queued = steps_queued(on.n_steps, launch_ahead=True)
    assert [d["submits"] for d in on.steps] == queued
    for key in ("submits", "host_waits", "driver_syncs", "elided_syncs", "d2d_copies"):
        assert [d[key] for d in on.steps] == [d[key] for d in off.steps], key


@pytest.mark.vulkan
@pytest.mark.parametrize("no_rebar", ["0", "1"])
@pytest.mark.parametrize("ahead", [True, False])
def test_vulkan_staged_decode_is_one_submission_per_token_on_both_memory_paths(
    no_rebar: str, ahead: bool, clean_env: pytest.MonkeyPatch
) -> None:
    """Under `staged`, with launch-ahead or without: each step and its token's read are one
    submission (the read's copy ends the step's command buffer), so a token is one submit
    whether or not the host can read device memory directly."""
    clean_env.setenv("LOWSYNC_VK_NO_HOST_VISIBLE_VRAM", no_rebar)
    model = ls.Llama.random(MICRO, seed=4)
    sess = ls.Session(
        model, backends=["vulkan"], n_ctx=64, n_ubatch=8, policy="staged", launch_ahead=ahead
    )
    sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=0)
    sess.seq_rm(0)
    sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=0)
    stats = sess.last_generate
    assert stats is not None
    assert_step_counts(stats, launch_ahead=ahead)
    queued = steps_queued(stats.n_steps, launch_ahead=ahead)
    assert [d["submits"] for d in stats.steps] == queued


@pytest.mark.vulkan
def test_vulkan_profile_times_every_kernel_of_a_step_without_changing_tokens(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """`LOWSYNC_VK_PROFILE=1`: the same tokens as unprofiled; `kernel_times()` names each
    kernel variant of the decode with its dispatches counted once per step since
    `reset_stats()`, device time and bytes read; a reset forgets them; off, it is empty."""
    tokens_off, _, _ = _vulkan_decode("1", clean_env)
    clean_env.setenv("LOWSYNC_VK_PROFILE", "1")
    model = ls.Llama.random(MICRO, seed=4)
    sess = ls.Session(model, backends=["vulkan"], n_ctx=64, n_ubatch=8, policy="staged")
    sess.generate([PROMPT[0]], max_new_tokens=N_GEN, seq_id=0)
    sess.seq_rm(0)
    sess.context.synchronize()
    sess.context.reset_stats()
    # A one-token prompt: every step, the prompt's included, runs the decode graph.
    sess.generate([PROMPT[0]], max_new_tokens=N_GEN, seq_id=0)
    sess.context.synchronize()
    times = sess.context.kernel_times()
    assert times, "lavapipe's compute queue writes timestamps"
    assert {t["backend"] for t in times} == {"vulkan"}
    assert [t["device_ns"] for t in times] == sorted((t["device_ns"] for t in times), reverse=True)
    for t in times:
        assert t["count"] > 0, t
        assert t["count"] % N_GEN == 0, t
        assert t["read_bytes"] > 0, t
    names = {_family(t["name"]) for t in times}
    # Fused (LOWSYNC_VK_FUSION, on by default): the attention has no soft_max of its own, and
    # each norm runs with its weight in one dispatch or (this f32 model's float products) in
    # the products reading it.
    assert {"rope", "argmax"} <= names
    assert "rms_norm" not in names
    assert {"mul_mat_vec_vn", "mul_mat_vec_vn_g"} <= names or "rms_norm_mul" in names
    # One workgroup per KV head on a CPU-type device, split over keys with 16-byte loads on a
    # GPU (the defaults).
    assert names & {"attn_dec", "attn_split", "attn_split_g", "attn_split_v"}
    assert any(n.startswith("mul_mat_vec") for n in names)
    sess.context.reset_stats()
    assert sess.context.kernel_times() == []
    sess.seq_rm(0)
    sess.context.reset_stats()
    assert sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=0) == tokens_off
    assert sess.context.kernel_times()
    clean_env.setenv("LOWSYNC_VK_PROFILE", "0")
    plain = ls.Session(model, backends=["vulkan"], n_ctx=64, n_ubatch=8, policy="staged")
    plain.generate(PROMPT, max_new_tokens=2, seq_id=0)
    assert plain.context.kernel_times() == []


def _vulkan_steps(
    fusion: str, env: pytest.MonkeyPatch, dtype: str = "f32", kv: str = "f32"
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens of a generation and the logits of one-token decode steps (each runs the
    decode graph, its attention fused or not) with `LOWSYNC_VK_FUSION=fusion`, `dtype`
    weights and a `kv` cache."""
    env.setenv("LOWSYNC_VK_FUSION", fusion)
    model = ls.Llama.random(MICRO, seed=4, dtype=dtype)
    sess = ls.Session(
        model, backends=["vulkan"], n_ctx=64, n_ubatch=8, policy="staged", kv_dtype=kv
    )
    tokens = sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=0)
    sess.seq_rm(0)
    steps = []
    for t in PROMPT + tokens:
        lg = sess.decode([t], seq_id=0, logits="all")
        assert lg is not None
        steps.append(lg)
    return tokens, steps


def _dispatches_per_step(
    fusion: str, env: pytest.MonkeyPatch, dtype: str = "f32", kv: str = "f32"
) -> dict[str, float]:
    """Profiled dispatches per decode step, per kernel family, with `LOWSYNC_VK_FUSION=fusion`,
    `dtype` weights and a `kv` cache."""
    env.setenv("LOWSYNC_VK_FUSION", fusion)
    env.setenv("LOWSYNC_VK_PROFILE", "1")
    model = ls.Llama.random(MICRO, seed=4, dtype=dtype)
    sess = ls.Session(
        model, backends=["vulkan"], n_ctx=64, n_ubatch=8, policy="staged", kv_dtype=kv
    )
    sess.generate([PROMPT[0]], max_new_tokens=N_GEN, seq_id=0)
    sess.seq_rm(0)
    sess.context.synchronize()
    sess.context.reset_stats()
    sess.generate([PROMPT[0]], max_new_tokens=N_GEN, seq_id=0)
    sess.context.synchronize()
    per: dict[str, float] = {}
    for t in sess.context.kernel_times():
        name = _family(t["name"])
        per[name] = per.get(name, 0) + t["count"] / N_GEN
    env.delenv("LOWSYNC_VK_PROFILE")
    return per


@pytest.mark.vulkan
@pytest.mark.parametrize(
    ("dtype", "kv"), [("f32", "f32"), ("f16", "f16"), ("q4_0", "f16"), ("q8_0", "f32")]
)
def test_vulkan_fusion_keeps_tokens_and_cuts_dispatches(
    clean_env: pytest.MonkeyPatch, dtype: str, kv: str
) -> None:
    """`LOWSYNC_VK_FUSION` on and off: the same greedy tokens, every decode step's logits within
    1e-5 of the largest (only the attention's summation order differs; 1e-4 over blocks), the
    same counts per step; fused, each layer's scores, soft_max, p @ V and copy are one
    `attn_dec` dispatch, each norm with its weight's product one `rms_norm_mul` (or none,
    folded into the products reading it), the residual adds and SwiGLU run in the store of the
    product they consume (`mul_mat_vec_*_e`) or SwiGLU with both its products
    (`mul_mat_vec_*_g`), K's rope and V's product write their KV-cache rows themselves
    (`rope_set_rows`, `mul_mat_vec_*_r`): 8 dispatches fewer per layer (9 with the pair) and
    1 per norm (2 folded). The attention is pinned unsplit and per head
    (`LOWSYNC_VK_ATTN_SPLIT=0`, `LOWSYNC_VK_ATTN_GROUP=0`, `LOWSYNC_VK_ATTN_VEC=0`)."""
    clean_env.setenv("LOWSYNC_VK_ATTN_SPLIT", "0")
    clean_env.setenv("LOWSYNC_VK_ATTN_GROUP", "0")
    clean_env.setenv("LOWSYNC_VK_ATTN_VEC", "0")
    # The norm folded into float products: on by default on a GPU, asked for on lavapipe.
    clean_env.setenv("LOWSYNC_VK_NORM_FOLD", "1")
    tokens_on, steps_on = _vulkan_steps("1", clean_env, dtype, kv)
    tokens_off, steps_off = _vulkan_steps("0", clean_env, dtype, kv)
    assert tokens_on == tokens_off
    # On a GPU with integer dot products Q4_0 and Q8_0 take the integer-dot body (`idot`),
    # which quantizes each product's x to 16 bits: an f32 rounding difference upstream can
    # move one of x's integers by one, so the block types get 1e-4 (measured 1.4e-5 on an H100).
    bound = 1e-4 if dtype in ("q4_0", "q8_0") else 1e-5
    for on, off in zip(steps_on, steps_off, strict=True):
        assert np.max(np.abs(on - off)) <= bound * np.max(np.abs(off))
    clean_env.setenv("LOWSYNC_VK_FUSION", "1")
    _, _, rec_on = _vulkan_decode("1", clean_env)
    clean_env.setenv("LOWSYNC_VK_FUSION", "0")
    _, _, rec_off = _vulkan_decode("1", clean_env)
    for key in ("submits", "host_waits", "graph_launches", "kernel_launches", "d2d_copies"):
        assert [d[key] for d in rec_on.steps] == [d[key] for d in rec_off.steps], key
    on = _dispatches_per_step("1", clean_env, dtype, kv)
    off = _dispatches_per_step("0", clean_env, dtype, kv)
    layers = MICRO.n_layer
    assert on.get("attn_dec") == layers
    assert "attn_dec" not in off
    assert off["soft_max"] == layers
    assert "soft_max" not in on
    norms = 2 * layers + 1
    # A norm whose every reader is a product that normalises x itself (the 16-byte float
    # mat-vec) runs no dispatch of its own; block weights keep it.
    folded = norms - on.get("rms_norm_mul", 0)
    assert folded == (norms if dtype in ("f32", "f16") else 0)
    assert "rms_norm" not in on
    assert off["rms_norm"] == norms
    # Two residual adds and a SwiGLU per layer; with the norms' products and the attention's
    # copies, no element-wise dispatch is left. The SwiGLU runs with the gate and up products
    # in one `_g` dispatch where the kernel computing a pair of rows takes both weights (the
    # 16-byte float mat-vec; the two-row block body, the default on GPUs), else in the up
    # product's store.
    pairs = sum(v for k, v in on.items() if k.endswith("_g"))
    assert pairs == layers if dtype in ("f32", "f16") else pairs in (0, layers)
    assert sum(v for k, v in on.items() if k.endswith("_e")) + pairs == 3 * layers
    assert off["eltwise"] == 3 * layers + norms + layers
    assert "eltwise" not in on
    assert on.get("rope_set_rows") == layers
    assert (on["rope"], off["rope"]) == (layers, 2 * layers)
    assert (
        sum(v for k, v in on.items() if k.startswith("mul_mat_vec") and k.endswith("_r")) == layers
    )
    assert (on.get("set_rows", 0), off["set_rows"]) == (0, 2 * layers)
    assert sum(off.values()) - sum(on.values()) == 8 * layers + norms + pairs + folded


def _split_steps(
    split: str | None, env: pytest.MonkeyPatch, kv: str, profile: bool = False
) -> tuple[list[int], list[np.ndarray], dict[str, float]]:
    """With `LOWSYNC_VK_ATTN_SPLIT=split` (unset where `None`) and a `kv` cache: the greedy
    tokens after a 150-token prompt, the logits of 4 one-token decode steps after them (depth
    158-161, so a split head takes 3 chunks of at least 64 keys) and, profiled, the dispatches
    per step of each kernel family."""
    if split is None:
        env.delenv("LOWSYNC_VK_ATTN_SPLIT", raising=False)
    else:
        env.setenv("LOWSYNC_VK_ATTN_SPLIT", split)
    env.setenv("LOWSYNC_VK_PROFILE", "1" if profile else "0")
    model = ls.Llama.random(MICRO, seed=4, dtype="f32")
    sess = ls.Session(
        model, backends=["vulkan"], n_ctx=256, n_ubatch=32, policy="staged", kv_dtype=kv
    )
    prompt = [(7 * i + 3) % MICRO.n_vocab for i in range(150)]
    tokens = sess.generate(prompt, max_new_tokens=N_GEN, seq_id=0)
    sess.context.synchronize()
    sess.context.reset_stats()
    steps = []
    for t in tokens[:4]:
        lg = sess.decode([t], seq_id=0, logits="all")
        assert lg is not None
        steps.append(lg)
    sess.context.synchronize()
    per: dict[str, float] = {}
    for t in sess.context.kernel_times():
        name = _family(t["name"])
        per[name] = per.get(name, 0) + t["count"] / len(steps)
    env.delenv("LOWSYNC_VK_PROFILE")
    return tokens, steps, per


@pytest.mark.vulkan
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_vulkan_attn_split_keeps_tokens(clean_env: pytest.MonkeyPatch, kv: str) -> None:
    """`LOWSYNC_VK_ATTN_SPLIT` 0, 1 and 2 at depth 150-161: the same greedy tokens, decode
    logits within 1e-5 of the largest (only the softmax's summation order differs); split, each
    layer's attention is one `attn_split` dispatch (its last chunk merges) instead of `attn_dec`
    (per-head kernels with 4-byte loads: `LOWSYNC_VK_ATTN_GROUP=0`, `LOWSYNC_VK_ATTN_VEC=0`)."""
    clean_env.setenv("LOWSYNC_VK_ATTN_GROUP", "0")
    clean_env.setenv("LOWSYNC_VK_ATTN_VEC", "0")
    tokens_off, steps_off, _ = _split_steps("0", clean_env, kv)
    for split in ("1", "2"):
        tokens, steps, _ = _split_steps(split, clean_env, kv)
        assert tokens == tokens_off, split
        for on, off in zip(steps, steps_off, strict=True):
            assert np.max(np.abs(on - off)) <= 1e-5 * np.max(np.abs(off)), split
    layers = MICRO.n_layer
    _, _, per_on = _split_steps("1", clean_env, kv, profile=True)
    _, _, per_off = _split_steps("0", clean_env, kv, profile=True)
    assert per_on.get("attn_split") == layers
    assert "attn_merge" not in per_on
    assert "attn_dec" not in per_on
    assert per_off.get("attn_dec") == layers
    assert "attn_split" not in per_off


@pytest.mark.vulkan
@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_vulkan_attn_group_keeps_tokens(clean_env: pytest.MonkeyPatch, kv: str) -> None:
    """`LOWSYNC_VK_ATTN_GROUP=1`, the split on and off: a KV head's two query heads share one
    workgroup (`attn_split_g`, one dispatch a layer), with the greedy tokens of the per-head
    unsplit attention and decode logits within 1e-5 of the largest."""
    clean_env.setenv("LOWSYNC_VK_ATTN_GROUP", "0")
    clean_env.setenv("LOWSYNC_VK_ATTN_VEC", "0")
    tokens_off, steps_off, _ = _split_steps("0", clean_env, kv)
    clean_env.delenv("LOWSYNC_VK_ATTN_VEC")
    clean_env.setenv("LOWSYNC_VK_ATTN_GROUP", "1")
    for split in ("1", "0"):
        tokens, steps, _ = _split_steps(split, clean_env, kv)
        assert tokens == tokens_off, split
        for on, off in zip(steps, steps_off, strict=True):
            assert np.max(np.abs(on - off)) <= 1e-5 * np.max(np.abs(off)), split
        _, _, per = _split_steps(split, clean_env, kv, profile=True)
        assert per.get("attn_split_g") == MICRO.n_layer, split
        assert "attn_split" not in per
        assert "attn_dec" not in per


@pytest.mark.vulkan
def test_vulkan_attn_split_default_follows_the_device_type(clean_env: pytest.MonkeyPatch) -> None:
    """`LOWSYNC_VK_ATTN_SPLIT`, `LOWSYNC_VK_ATTN_GROUP` and `LOWSYNC_VK_ATTN_VEC` unset: a
    CPU-type device (lavapipe) runs one workgroup per KV head (`attn_split_g`, unsplit), a GPU
    the per-head kernel with 16-byte loads (`attn_split_v`, in one workgroup a head below 256
    keys); either way the greedy tokens are those of the per-head unsplit kernel."""
    clean_env.setenv("LOWSYNC_VK_ATTN_GROUP", "0")
    clean_env.setenv("LOWSYNC_VK_ATTN_VEC", "0")
    tokens_off, _, _ = _split_steps("0", clean_env, "f32")
    clean_env.delenv("LOWSYNC_VK_ATTN_GROUP")
    clean_env.delenv("LOWSYNC_VK_ATTN_VEC")
    tokens, _, per = _split_steps(None, clean_env, "f32", profile=True)
    assert tokens == tokens_off
    layers = MICRO.n_layer
    if device_type("vulkan") == "cpu":
        assert per.get("attn_split_g") == layers
        assert "attn_dec" not in per
    else:
        assert per.get("attn_split_v") == layers
        assert "attn_dec" not in per


@pytest.mark.vulkan
def test_vulkan_attn_split_bad_value_names_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    """A chunk count above 64 or a word is an error naming `LOWSYNC_VK_ATTN_SPLIT`."""
    model = ls.Llama.random(MICRO, seed=4, dtype="f32")
    for bad in ("65", "on"):
        clean_env.setenv("LOWSYNC_VK_ATTN_SPLIT", bad)
        with pytest.raises(ls.EnvError, match="LOWSYNC_VK_ATTN_SPLIT"):
            ls.Session(model, backends=["vulkan"], n_ctx=64, n_ubatch=8, policy="staged")


@pytest.mark.vulkan
@pytest.mark.parametrize(
    ("var", "bad"),
    [
        ("LOWSYNC_VK_TILE", "16"),
        ("LOWSYNC_VK_TILE", "wide"),
        ("LOWSYNC_VK_SPLIT_K", "1"),
        ("LOWSYNC_VK_SPLIT_K", "9"),
        ("LOWSYNC_VK_SPLIT_K", "max"),
    ],
)
def test_vulkan_tile_settings_bad_value_names_the_variable(
    clean_env: pytest.MonkeyPatch, var: str, bad: str
) -> None:
    """A tile size other than 4 or 8, or a split other than 0, auto or 2 to 8, is an error
    naming the variable, and a Session made after it is unset works."""
    model = ls.Llama.random(MICRO, seed=4, dtype="f32")
    clean_env.setenv(var, bad)
    with pytest.raises(ls.EnvError, match=var):
        ls.Session(model, backends=["vulkan"], n_ctx=64, n_ubatch=8, policy="staged")
    clean_env.delenv(var)
    sess = ls.Session(model, backends=["vulkan"], n_ctx=64, n_ubatch=8, policy="staged")
    assert len(sess.generate(PROMPT, max_new_tokens=2, seq_id=0)) == 2


PREFILL_PROMPT = [1 + (7 * i + 3) % (MICRO.n_vocab - 1) for i in range(48)]


def _vk_prompt_logits(
    env: pytest.MonkeyPatch, settings: dict[str, str], dtype: str
) -> tuple[np.ndarray, set[str]]:
    """The logits of every row of a 48-token prompt prefilled as one ubatch on Vulkan with the
    environment `settings`, and the kernel families that ran (profiled)."""
    for var, value in settings.items():
        env.setenv(var, value)
    env.setenv("LOWSYNC_VK_PROFILE", "1")
    model = ls.Llama.random(MICRO, seed=4, dtype=dtype)
    sess = ls.Session(model, backends=["vulkan"], n_ctx=64, n_ubatch=48, policy="staged")
    logits = sess.decode(PREFILL_PROMPT, seq_id=0, logits="all")
    assert logits is not None
    sess.context.synchronize()
    names = {_family(t["name"]) for t in sess.context.kernel_times()}
    env.delenv("LOWSYNC_VK_PROFILE")
    return np.asarray(logits), names


@pytest.mark.vulkan_gpu
@pytest.mark.parametrize("dtype", ["f16", "q4_0"])
def test_vulkan_coopmat_prefill_matches_the_shader_core_products(
    clean_env: pytest.MonkeyPatch, dtype: str
) -> None:
    """`LOWSYNC_VK_COOPMAT=1` on a GPU with cooperative matrices: a prompt's products run on them
    (`mul_mat_cm` for the float ones, `mul_mat_qcm` over block weights) and every row's logits
    stay within the f16 rounding of the operands (1% of the largest) of the f32 products', with
    the same argmax on nearly every row. Skipped where the device has none."""
    on, names = _vk_prompt_logits(clean_env, {"LOWSYNC_VK_COOPMAT": "1"}, dtype)
    if not names & {"mul_mat_cm", "mul_mat_qcm"}:
        pytest.skip("this Vulkan device has no cooperative matrices for the products")
    assert ("mul_mat_qcm" in names) == (dtype != "f16"), names
    off, names_off = _vk_prompt_logits(clean_env, {"LOWSYNC_VK_COOPMAT": "0"}, dtype)
    assert not names_off & {"mul_mat_cm", "mul_mat_qcm"}
    assert np.all(np.isfinite(on))
    assert np.max(np.abs(on - off)) <= 1e-2 * np.max(np.abs(off))
    agree = np.mean(np.argmax(on, axis=-1) == np.argmax(off, axis=-1))
    assert agree >= 0.9, agree


def _tiles(**more: str) -> dict[str, str]:
    """The tiled prefill products forced (`LOWSYNC_VK_ROW_LANES=0`, `LOWSYNC_VK_QMM=tiles`: a
    CPU-type device's default is the row layouts), plus `more`."""
    return {"LOWSYNC_VK_ROW_LANES": "0", "LOWSYNC_VK_QMM": "tiles", **more}


@pytest.mark.vulkan
@pytest.mark.parametrize("dtype", ["f16", "q4_0"])
def test_vulkan_eight_by_eight_tiles_prefill_the_same_bits(
    clean_env: pytest.MonkeyPatch, dtype: str
) -> None:
    """`LOWSYNC_VK_TILE=8`: a whole prompt's tiled products (`mul_mat8` for the float ones,
    `mul_mat_qt8` over block weights) give the 4x4 tiles' logits bit for bit on every row."""
    four, names4 = _vk_prompt_logits(clean_env, _tiles(LOWSYNC_VK_TILE="4"), dtype)
    eight, names8 = _vk_prompt_logits(clean_env, _tiles(LOWSYNC_VK_TILE="8"), dtype)
    tiled = {"f16": "mul_mat", "q4_0": "mul_mat_qt"}[dtype]
    assert tiled in names4, names4
    assert tiled + "8" not in names4, names4
    assert tiled + "8" in names8, names8
    assert tiled not in names8, names8
    assert np.all(np.isfinite(four))
    assert np.array_equal(four.view(np.uint32), eight.view(np.uint32))


def _split_k_prompts(
    env: pytest.MonkeyPatch, split: str, dtype: str
) -> tuple[list[np.ndarray], list[dict[str, int]], set[str]]:
    """The 48-token prompt prefilled as one ubatch on Vulkan twice (the sequence removed
    between, so the second replays the first's recorded plan) with the tiled products forced
    and `LOWSYNC_VK_SPLIT_K=split`: each run's logits of every row and its counters; and the
    kernel families of a profiled session's run."""
    for var, value in _tiles(LOWSYNC_VK_SPLIT_K=split).items():
        env.setenv(var, value)
    model = ls.Llama.random(MICRO, seed=4, dtype=dtype)
    keys = ("submits", "host_waits", "graph_launches", "graph_captures", "kernel_launches")
    sess = ls.Session(model, backends=["vulkan"], n_ctx=64, n_ubatch=48, policy="staged")
    logits, counts = [], []
    for _ in range(2):
        before = sess.stats()["total"]
        out = sess.decode(PREFILL_PROMPT, seq_id=0, logits="all")
        assert out is not None
        sess.context.synchronize()
        after = sess.stats()["total"]
        logits.append(np.asarray(out))
        counts.append({k: after[k] - before[k] for k in keys})
        sess.seq_rm(0)
    _, names = _vk_prompt_logits(env, {}, dtype)
    return logits, counts, names


@pytest.mark.vulkan
@pytest.mark.parametrize("dtype", ["f16", "q4_0"])
def test_vulkan_split_k_prefill_matches_the_unsplit_products(
    clean_env: pytest.MonkeyPatch, dtype: str
) -> None:
    """`LOWSYNC_VK_SPLIT_K=3`: a prompt's tiled products sum k in up to three ranges and
    `split_sum` adds them; every row's logits stay within f32 reordering of the unsplit
    products' (1e-5 of the largest) with the same argmax, a replayed prompt gives the first's
    bits, and the counts (submits, host waits, graph launches and captures, kernel launches:
    the graph's nodes) are the unsplit run's."""
    split, c_split, names = _split_k_prompts(clean_env, "3", dtype)
    plain, c_plain, names_plain = _split_k_prompts(clean_env, "0", dtype)
    assert "split_sum" in names, names
    assert "split_sum" not in names_plain, names_plain
    assert np.array_equal(split[0].view(np.uint32), split[1].view(np.uint32))
    assert c_split == c_plain
    assert c_split[1]["graph_captures"] == 0, c_split
    assert np.all(np.isfinite(split[0]))
    assert np.max(np.abs(split[0] - plain[0])) <= 1e-5 * np.max(np.abs(plain[0]))
    assert np.array_equal(np.argmax(split[0], axis=-1), np.argmax(plain[0], axis=-1))


def _cuda_decode(
    graphs: str, env: pytest.MonkeyPatch, pdl: str = "1", rehearse: str = "1"
) -> tuple[list[int], ls.session.GenerateStats, int]:
    """Tokens and counts of a second generation (launch-ahead on), and the kernel launches of
    one decode step as the CUDA backend plans them (`cuda_fusion_plan`)."""
    env.setenv("LOWSYNC_CUDA_GRAPHS", graphs)
    env.setenv("LOWSYNC_CUDA_TUNE", f"pdl={pdl},rehearse={rehearse}")
    model = ls.Llama.random(MICRO, seed=4)
    sess = ls.Session(model, backends=["cuda"], n_ctx=64, n_ubatch=8, policy="staged")
    assert sess.launch_ahead
    assert sess.plans[0].n_splits == 1
    sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=0)
    sess.seq_rm(0)
    # The second generation only replays: every graph of both buckets was captured already.
    tokens = sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=0)
    stats = sess.last_generate
    assert stats is not None
    return tokens, stats, len(ls._native.cuda_fusion_plan(sess.plans[0]))


@pytest.mark.cuda
def test_cuda_graph_replay_is_one_launch_per_token_and_bit_identical(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """Per step, exactly: with graph replay one graph launch per step queued and no eager
    kernel; without it, per step queued, the launches the fusion plan lists, and no graph."""
    tokens_on, on, _ = _cuda_decode("1", clean_env)
    tokens_off, off, launches = _cuda_decode("0", clean_env)
    assert tokens_on == tokens_off
    assert_step_counts(
        on,
        launch_ahead=True,
        per_queued={"graph_launches": 1, "kernel_launches": 0, "graph_captures": 0},
    )
    assert_step_counts(
        off, launch_ahead=True, per_queued={"graph_launches": 0, "kernel_launches": launches}
    )
    assert launches > 10  # an eager step is the fusion plan's kernels, one launch each


@pytest.mark.cuda
@pytest.mark.parametrize(
    "knob",
    [
        # Kernels launched before their producer finishes, waiting on the device.
        "pdl",
        # Attention, launched ahead, runs its path once before its wait, on inputs its
        # producer is still writing: nothing of that pass may reach a result.
        "rehearse",
    ],
)
def test_cuda_launch_knobs_change_no_token_or_count(
    knob: str, clean_env: pytest.MonkeyPatch
) -> None:
    for graphs in ("1", "0"):
        tokens_on, on, _ = _cuda_decode(graphs, clean_env, **{knob: "1"})
        tokens_off, off, _ = _cuda_decode(graphs, clean_env, **{knob: "0"})
        assert tokens_on == tokens_off, f"{knob}, graphs={graphs}"
        keys = ("host_waits", "h2d_copies", "d2h_copies", "kernel_launches", "graph_launches")
        for key in keys:
            got = ([d[key] for d in on.steps], [d[key] for d in off.steps])
            assert got[0] == got[1], f"{knob}, graphs={graphs}: {key}"


# Head dim 64 over 2 kv heads of 4 query heads, an f16 cache of 704 cells and a 600-token
# prompt: decode attention's window (704 keys) is past one round trip of keys (256), so with
# `attn_split` on each head's valid keys (600 and more) run in several blocks.
SPLIT = LlamaConfig(n_vocab=256, n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512)
SPLIT_PROMPT = [(11 * i + 5) % 256 for i in range(600)]


def _split_decode(
    split: str, env: pytest.MonkeyPatch
) -> tuple[list[int], ls.session.GenerateStats, list[np.ndarray]]:
    """With `LOWSYNC_CUDA_TUNE=attn_split=split`: the tokens and counts of a generation after
    the 600-token prompt (a second one, which only replays captured graphs), then the logits of
    one-token decode steps from that depth."""
    env.setenv("LOWSYNC_CUDA_TUNE", f"attn_split={split}")
    model = ls.Llama.random(SPLIT, seed=6)
    sess = ls.Session(
        model, backends=["cuda"], n_ctx=704, n_ubatch=512, kv_dtype="f16", policy="staged"
    )
    sess.generate(SPLIT_PROMPT, max_new_tokens=N_GEN, seq_id=0)
    sess.seq_rm(0)
    tokens = sess.generate(SPLIT_PROMPT, max_new_tokens=3 * N_GEN, seq_id=0)
    stats = sess.last_generate
    assert stats is not None
    steps = []
    for t in tokens[:N_GEN]:
        lg = sess.decode([t], seq_id=0, logits="all")
        assert lg is not None
        steps.append(lg)
    return tokens, stats, steps


@pytest.mark.cuda
def test_cuda_split_decode_attention_keeps_tokens_logits_and_counts(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """Decode attention split over keys (`attn_split=1`, the default) against one block per
    head (`attn_split=0`) at a depth of 600-640 keys: the same greedy tokens, every
    step's logits within 1e-4 of the largest (only the attention's summation order differs;
    the products round activations to 16 bits), and per step the same waits, copies and
    launches (the split stays one kernel of the replayed graph, whose valid length grows
    every step)."""
    tokens_on, on, steps_on = _split_decode("1", clean_env)
    tokens_off, off, steps_off = _split_decode("0", clean_env)
    assert tokens_on == tokens_off
    for a, b in zip(steps_on, steps_off, strict=True):
        assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(b))
    keys = ("host_waits", "h2d_copies", "d2h_copies", "kernel_launches", "graph_launches")
    for key in keys:
        assert [d[key] for d in on.steps] == [d[key] for d in off.steps], key
    assert_step_counts(
        on,
        launch_ahead=True,
        per_queued={"graph_launches": 1, "kernel_launches": 0, "graph_captures": 0},
    )


# Head dim 32 over 2 kv heads of 4 query heads: a 40-token prefill is three query tiles of the
# fused prefill attention (`attn_prefill`), the last one partial.
PREFILL = LlamaConfig(n_vocab=256, n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=256)
PREFILL_PROMPT = [(7 * i + 3) % 256 for i in range(40)]


def _prefill_logits(backend: str, weights: str, kv_dtype: str, n_ubatch: int = 40) -> np.ndarray:
    model = ls.Llama.random(PREFILL, seed=5, dtype=weights)
    sess = ls.Session(model, backends=[backend], n_ctx=64, n_ubatch=n_ubatch, kv_dtype=kv_dtype)
    logits = sess.decode(PREFILL_PROMPT, seq_id=0, logits="all")
    assert logits is not None
    return logits


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("weights", ["f16", "q4_0"])
def test_cuda_fused_prefill_attention_keeps_every_rows_logits(
    weights: str, kv_dtype: str, clean_env: pytest.MonkeyPatch
) -> None:
    """A one-ubatch prefill's logits, every row, with the fused prefill attention (tune key
    `attn_prefill`, default on) and with the unfused chain (cuBLAS products, softmax, copy),
    and against `cpu`. The products round the activations to the weights' 16 bits, so an f32
    difference in attention can move a later value by an f16 ulp: on the H200 fused and
    unfused differed by 1.4e-4 (Q4_0) and 2.5e-4 (F16) with an f32 cache, and both stood
    exactly as far from `cpu` (5.2e-4, 4.2e-4). The fused kernel keeps p in f32 where the
    unfused products on an f16 cache may round it, hence the looser bound there. `cpu` runs
    the prompt in ubatches of 5 rows: its prefill products of 6 rows or more round the
    activations to 8 bits (`LOWSYNC_CPU_PREFILL_ACT`), 1.1e-2 from its own 16-bit path on
    Q4_0 here, which would measure the oracle, not the device."""
    on = _prefill_logits("cuda", weights, kv_dtype)
    clean_env.setenv("LOWSYNC_CUDA_TUNE", "attn_prefill=0")
    off = _prefill_logits("cuda", weights, kv_dtype)
    clean_env.delenv("LOWSYNC_CUDA_TUNE")
    cpu = _prefill_logits("cpu", weights, kv_dtype, n_ubatch=5)
    scale = np.max(np.abs(off))
    assert np.max(np.abs(on - off)) / scale < (1e-3 if kv_dtype == "f32" else 2e-3)
    assert np.max(np.abs(on - cpu)) / np.max(np.abs(cpu)) < 2e-3


@pytest.mark.cuda
def test_cuda_launch_ahead_is_bit_identical_with_the_same_counts(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """Step t+1 queued before token t is read (the token fed on the device): the same tokens
    and logits after, per token one wait, one upload, one 4-byte read, one graph launch, and
    the token's device copy on every step after the first. Submissions: without launch-ahead
    three per step (the copy batch with the upload, the graph, the batch with the read, which
    the wait launches); with it two per step queued (the graph, and one batch holding the
    previous token's read, the upload and the feed), the last read's batch launched by its
    wait. A third would mean something launched the read's batch early, which makes the wait
    for the token before it last until the step queued ahead ends."""
    model = ls.Llama.random(MICRO, seed=4)
    runs = {}
    for ahead in (False, True):
        sess = ls.Session(model, backends=["cuda"], n_ctx=64, n_ubatch=8, launch_ahead=ahead)
        assert sess.launch_ahead == ahead
        sess.generate(PROMPT, max_new_tokens=4)  # warm-up: captures
        sess.clear()
        tokens = sess.generate(PROMPT, max_new_tokens=N_GEN)
        stats = sess.last_generate
        assert stats is not None
        stopped = sess.generate(PROMPT, max_new_tokens=N_GEN, seq_id=1, stop=[tokens[2]])
        after = sess.decode([9, 8], seq_id=1, logits="all")
        runs[ahead] = (tokens, stopped, after, stats)
    (t0, s0, a0, plain), (t1, s1, a1, st) = runs[False], runs[True]
    assert (t1, s1) == (t0, s0)
    assert np.array_equal(a1, a0)
    assert_step_counts(st, launch_ahead=True, per_queued={"graph_launches": 1})
    assert_step_counts(plain, launch_ahead=False, per_queued={"graph_launches": 1})
    queued = steps_queued(st.n_steps, launch_ahead=True)
    assert [d["submits"] for d in st.steps] == [2 * q for q in queued[:-1]] + [1]
    assert [d["submits"] for d in plain.steps] == [3] * plain.n_steps


@pytest.mark.parametrize("device", DEVICES)
def test_soft_max_propagates_nan_on_the_device(device: str) -> None:
    # An all-NaN row must not look fully masked (zeros); a NaN anywhere makes its row NaN, and a
    # fully masked row still gives zeros, as on the CPU oracle.
    x = np.array(
        [[np.nan] * 5, [1.0, np.nan, 3.0, 0.5, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0], [0.0] * 5],
        np.float32,
    )
    mask = np.zeros((4, 5), np.float32)
    mask[3] = -np.inf
    g = ls.Graph()
    a = g.input("a", [4, 5])
    m = g.input("m", [4, 5])
    g.output("p", g.soft_max(g.cpy(a, "f32"), m))
    plan = ls.Context([device, "cpu"]).compile(g)
    assert plan.split_backends[0] == device
    plan.set_input("a", x)
    plan.set_input("m", mask)
    plan.compute()
    p = plan.get_output("p")
    assert np.isnan(p[:2]).all(), p
    np.testing.assert_allclose(p[2], np.exp(x[2] - 5) / np.exp(x[2] - 5).sum(), rtol=1e-6)
    np.testing.assert_array_equal(p[3], np.zeros(5, np.float32))


# Peaked enough that truncations and penalties change the draws (see tests/test_sampling.py).
DRAWN = ls.SamplerParams(
    temperature=0.9,
    top_k=40,
    top_p=0.9,
    min_p=0.02,
    repeat_penalty=1.3,
    frequency_penalty=0.2,
    presence_penalty=0.1,
    seed=2**32 - 7,
)


def _sampling_run(backend: str, ahead: bool) -> tuple[list[int], ls.session.GenerateStats]:
    model = ls.Llama.random(MICRO, seed=4)
    model.weights["output.weight"] = model.weights["output.weight"] * np.float32(20)
    sess = ls.Session(
        model, backends=[backend], n_ctx=64, n_ubatch=8, sampling=True, launch_ahead=ahead
    )
    assert all(p.split_backends == [backend] for p in sess.plans)  # the sampler runs there too
    sess.generate(PROMPT, max_new_tokens=3, sampler=DRAWN)  # warm-up (CUDA: captures)
    sess.clear()
    tokens = sess.generate(PROMPT, max_new_tokens=N_GEN, sampler=DRAWN)
    stats = sess.last_generate
    assert stats is not None
    return tokens, stats


@pytest.mark.parametrize("backend", DEVICES)
def test_sampled_generation_on_the_device_draws_the_cpus_tokens_at_a_greedy_steps_cost(
    backend: str, clean_env: pytest.MonkeyPatch
) -> None:
    """`Session(sampling=True)` on the device, penalties on: the seeded tokens of `cpu`, the
    same with launch-ahead on and off (the penalty window's last column fed on the device),
    and per step exactly one host wait, one upload, one 4-byte read (and the fed token)."""
    want, _ = _sampling_run("cpu", ahead=False)
    ahead, st = _sampling_run(backend, ahead=True)
    plain, _ = _sampling_run(backend, ahead=False)
    assert ahead == plain == want
    assert_step_counts(st, launch_ahead=True)


@pytest.mark.parametrize("device", DEVICES)
def test_a_process_opens_and_closes_many_contexts_on_the_device(device: str) -> None:
    # Every context is created, runs one step and is dropped before the next; the driver must
    # keep loading (NVIDIA's Vulkan driver, unloaded and loaded again with each context, ran
    # out of static TLS at the 30th).
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for i in range(40):
        g = ls.Graph()
        a = g.input("a", [2, 3])
        g.output("y", g.cpy(a, "f32") * 2.0)
        ctx = ls.Context([device])
        plan = ctx.compile(g)
        plan.set_input("a", x + i)
        plan.compute()
        np.testing.assert_array_equal(plan.get_output("y"), (x + i) * 2.0)
        del plan, ctx
