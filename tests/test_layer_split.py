"""Layer split (pipeline placement across devices), checked on two `cpu-async` streams standing
in for two GPUs: each stage's layers, weights and KV cache on its own device, the activations
crossing the boundary by a device-to-device copy ordered on the devices, never by a host wait.

The same tokens and logits as one device; per decode step exactly the host waits of one device
(1 under staged), one 4-byte read, and at the boundary device waits and peer copies only."""

from __future__ import annotations

import numpy as np
import pytest

import lowsync as ls
from lowsync.session import _layer_backends

PROMPT = [1, 5, 300, 7, 42]
STAGES = ["cpu-async:0", "cpu-async:1"]


@pytest.fixture(scope="module")
def model() -> ls.Llama:
    return ls.Llama.random("tiny", seed=4)


def test_layers_go_to_backends_in_contiguous_runs() -> None:
    two = ["a", "b"]
    assert _layer_backends(two, None, 4) is None
    assert _layer_backends(two, "even", 4) == ["a", "a", "b", "b"]
    assert _layer_backends(two, [1, 3], 4) == ["a", "b", "b", "b"]
    assert _layer_backends(two, [0, 1], 3) == ["b", "b", "b"]
    assert _layer_backends(["a", "b", "c"], [1, 0, 1], 2) == ["a", "c"]
    assert _layer_backends(["a", "b", "c"], "even", 7) == ["a", "a", "b", "b", "b", "c", "c"]
    # llama.cpp-style fractions work as well as counts.
    assert _layer_backends(two, [0.25, 0.75], 8) == ["a", "a", *["b"] * 6]


@pytest.mark.parametrize(
    ("split", "match"),
    [
        ([1], "1 weights for 2 backends"),
        ([1, 2, 3], "3 weights for 2 backends"),
        ([1, -1], "finite, >= 0"),
        ([0, 0], "not all 0"),
        ([1, float("nan")], "finite"),
        ("odd", '"even" or weights'),
        ([1, "x"], "one number per backend"),
        (3, "one number per backend"),
    ],
)
def test_bad_layer_splits_are_clear_errors(model: ls.Llama, split: object, match: str) -> None:
    with pytest.raises(ls.SessionError, match=match):
        ls.Session(model, backends=STAGES, n_ctx=32, layer_split=split)  # type: ignore[arg-type]


def test_graph_builder_checks_layer_backends(model: ls.Llama) -> None:
    with pytest.raises(ValueError, match="a backend for each of the 2 layers"):
        model.build_graph(1, 16, 1, layer_backends=["cpu-async:0"])
    with pytest.raises(ValueError, match="not both"):
        model.build_graph(1, 16, 1, backend="cpu", layer_backends=STAGES)


def test_numbered_cpu_async_streams_are_backends() -> None:
    ctx = ls.Context(["cpu-async:0", "cpu-async:7"])
    assert ctx.backends == ["cpu-async:0", "cpu-async:7"]
    for bad in ("cpu:1", "noop:0", "cpu-async:x", "cpu-async:-1"):
        with pytest.raises(ls.LowsyncError):
            ls.Context([bad])


@pytest.mark.parametrize("ahead", [False, True])
def test_two_stages_give_one_devices_tokens_and_logits(model: ls.Llama, ahead: bool) -> None:
    one = ls.Session(model, backends=["cpu-async"], n_ctx=64, policy="staged")
    two = ls.Session(
        model, backends=STAGES, n_ctx=64, policy="staged", layer_split="even", launch_ahead=ahead
    )
    for plan in two.plans:
        assert plan.split_backends == STAGES
    want = one.decode(PROMPT, logits="all")
    got = two.decode(PROMPT, logits="all")
    np.testing.assert_array_equal(got, want)  # the same kernels in the same order
    assert two.generate(PROMPT, 12, seq_id=1) == one.generate(PROMPT, 12, seq_id=1)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_stage_boundary_costs_the_host_nothing(model: ls.Llama, ahead: bool) -> None:
    """Per decode step, exactly: one host wait (the token's read, on the last stage), one
    4-byte read, one staged upload per stage (each device's own inputs), and at the boundary
    the activations' peer copies, each one device wait on either side; under launch-ahead the
    token crosses back to the first stage the same way. The first stage never waits for the
    host and is never read."""
    sess = ls.Session(
        model, backends=STAGES, n_ctx=64, policy="staged", layer_split=[1, 1], launch_ahead=ahead
    )
    assert sess.launch_ahead == ahead
    sess.generate(PROMPT, 3)  # warm-up
    before = sess.stats()
    sess.generate(PROMPT, 9, seq_id=1)
    after = sess.stats()
    st = sess.last_generate
    assert st is not None
    assert st.n_steps == 8
    steps = st.steps if not ahead else st.steps[1:-1]  # launch-ahead's steady steps
    for d in steps:
        assert d["host_waits"] == 1, d
        assert (d["d2h_copies"], d["d2h_bytes"]) == (1, 4), d
        assert d["h2d_copies"] == 2, d  # one staged upload per stage
        # Every device-to-device copy is a peer copy (the activations at the boundary and,
        # under launch-ahead, the token fed from the last stage into the first): one device
        # wait on either side of each.
        assert d["d2d_copies"] >= 1 + ahead, d
        assert d["device_waits"] == 2 * d["d2d_copies"], d
    assert len({d["d2d_copies"] for d in steps}) == 1, steps  # the same every step
    first = {k: after["cpu-async:0"][k] - before["cpu-async:0"][k] for k in after["cpu-async:0"]}
    assert (first["host_waits"], first["d2h_copies"]) == (0, 0), first


def test_a_prompt_of_several_ubatches_crosses_the_stages_without_a_host_wait(
    model: ls.Llama,
) -> None:
    """A prompt cut into ubatches is queued whole: stage 0 may start ubatch i + 1 while stage 1
    still runs ubatch i (the pipeline of llama.cpp's n_copies, bounded here by the boundary
    copy's back edge). Across the whole prompt, one host wait (the logits' read) and each
    ubatch's boundary copies with a device wait on either side; the logits are one device's."""
    prompt = [(11 * i + 5) % 256 for i in range(64)]
    one = ls.Session(model, backends=["cpu-async"], n_ctx=128, n_ubatch=8, policy="staged")
    two = ls.Session(
        model, backends=STAGES, n_ctx=128, n_ubatch=8, policy="staged", layer_split="even"
    )
    want = one.decode(prompt, logits="last")
    two.decode(prompt[:8], seq_id=1)  # one ubatch: its boundary copies
    b1 = two.stats()["total"]
    two.decode(prompt[:8], seq_id=2)
    a1 = two.stats()["total"]
    per_ubatch = a1["d2d_copies"] - b1["d2d_copies"]
    assert per_ubatch >= 1
    got = two.decode(prompt, seq_id=0, logits="last")
    after = two.stats()["total"]
    d = {k: after[k] - a1[k] for k in ("host_waits", "d2d_copies", "device_waits")}
    assert d == {"host_waits": 1, "d2d_copies": 8 * per_ubatch, "device_waits": 16 * per_ubatch}
    np.testing.assert_array_equal(got, want)


def test_an_uneven_split_over_three_stages(model: ls.Llama) -> None:
    """A backend given no layers stays out of the plans; the others hold their layers."""
    three = ["cpu-async:0", "cpu-async:1", "cpu-async:2"]
    sess = ls.Session(model, backends=three, n_ctx=32, policy="staged", layer_split=[1, 0, 1])
    assert all(p.split_backends == ["cpu-async:0", "cpu-async:2"] for p in sess.plans)
    one = ls.Session(model, backends=["cpu"], n_ctx=32)
    np.testing.assert_allclose(
        sess.decode(PROMPT, logits="all"), one.decode(PROMPT, logits="all"), rtol=0, atol=1e-5
    )


# Two CUDA streams of one GPU stand in for two GPUs where a machine has one: "cuda" and "cuda:0"
# are separate backends (each its own stream and buffers) on the same device, so the boundary
# is a copy between streams ordered by events, as between two devices.
CUDA_STAGES = ["cuda", "cuda:0"]


@pytest.mark.cuda
def test_two_cuda_streams_give_one_gpus_tokens(model: ls.Llama) -> None:
    one = ls.Session(model, backends=["cuda"], n_ctx=64, policy="staged")
    for ahead in (False, True):
        two = ls.Session(
            model,
            backends=CUDA_STAGES,
            n_ctx=64,
            policy="staged",
            layer_split="even",
            launch_ahead=ahead,
        )
        for plan in two.plans:
            assert plan.split_backends == CUDA_STAGES
        np.testing.assert_allclose(
            two.decode(PROMPT, logits="all"),
            one.decode(PROMPT, logits="all", seq_id=1),
            rtol=0,
            atol=1e-5,
        )
        assert two.generate(PROMPT, 12, seq_id=2) == one.generate(PROMPT, 12, seq_id=2)
        one.clear()


@pytest.mark.cuda
@pytest.mark.parametrize("ahead", [False, True])
def test_a_cuda_stage_boundary_costs_the_host_nothing(model: ls.Llama, ahead: bool) -> None:
    """As on `cpu-async`: per decode step one host wait (the token's read on the last stage),
    one 4-byte read, and each boundary copy ordered by one device wait on either stream."""
    sess = ls.Session(
        model,
        backends=CUDA_STAGES,
        n_ctx=64,
        policy="staged",
        layer_split=[1, 1],
        launch_ahead=ahead,
    )
    sess.generate(PROMPT, 3)  # warm-up (captures)
    before = sess.stats()
    sess.generate(PROMPT, 9, seq_id=1)
    after = sess.stats()
    st = sess.last_generate
    assert st is not None
    steps = st.steps if not ahead else st.steps[1:-1]
    for d in steps:
        assert d["host_waits"] == 1, d
        assert (d["d2h_copies"], d["d2h_bytes"]) == (1, 4), d
        assert d["d2d_copies"] >= 1 + ahead, d
        assert d["device_waits"] == 2 * d["d2d_copies"], d
    assert len({d["d2d_copies"] for d in steps}) == 1, steps
    first = {k: after["cuda"][k] - before["cuda"][k] for k in after["cuda"]}
    assert (first["host_waits"], first["d2h_copies"]) == (0, 0), first
