"""`KvCells` alone, with no context, plan or model: taking cells, sharing them (seq_cp), removing
them, masks, positions and token ids per sequence (the sampler's penalty window), and steps
that roll back exactly — also when KeyboardInterrupt lands between any two lines of `take` or
of the rollback itself."""

from __future__ import annotations

import copy
import sys
from types import FrameType
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowsync.kv_cells import ContextFullError, KvCells, SessionError

NEG = -np.inf


def _snapshot(kv: KvCells) -> tuple[Any, ...]:
    """Everything observable of the state, including the free stack's order."""
    s = kv._s
    return (
        s.pos.tolist(),
        s.seqs.tolist(),
        s.mask.tolist(),
        list(s.next),
        list(s.free),
        s.tok.tolist(),
    )


def _take(
    kv: KvCells, seqs: list[int], tokens: list[int] | None = None
) -> tuple[list[int], list[int]]:
    step = kv.begin()
    out = kv.take(seqs, step, tokens)
    kv.commit(step, confirmed=True)
    return out


def test_take_gives_ascending_cells_and_per_sequence_positions() -> None:
    kv = KvCells(6, n_seq=2)
    assert (kv.n_free, kv.n_rows, kv.scratch) == (6, 7, 6)
    assert _take(kv, [0, 0, 1, 0]) == ([0, 1, 2, 3], [0, 1, 0, 2])
    assert kv.cells(0) == [0, 1, 3]
    assert kv.positions(0) == [0, 1, 2]
    assert (kv.pos_max(0), kv.pos_max(1)) == (2, 0)
    assert kv.mask_row(0).tolist() == [[0, 0, NEG, 0, NEG, NEG, NEG]]
    assert kv.mask_rows([1, 0]).tolist() == [
        [NEG, NEG, 0, NEG, NEG, NEG, NEG],
        [0, 0, NEG, 0, NEG, NEG, NEG],
    ]
    assert kv.n_free == 2
    kv.check()


def test_copy_shares_cells_and_remove_frees_only_unshared_ones() -> None:
    kv = KvCells(8, n_seq=3)
    _take(kv, [0] * 5)  # cells 0..4, positions 0..4
    kv.copy(0, 1, p0=1, p1=3)  # seq 1 shares positions 1 and 2
    assert kv.cells(1) == [1, 2]
    assert kv.pos_max(1) == 2
    assert _take(kv, [1]) == ([5], [3])  # seq 1 continues at its own next position
    kv.remove(0, p0=2)  # seq 0 drops positions 2..4: cell 2 stays (seq 1), cells 3, 4 free
    assert kv.cells(0) == [0, 1]
    assert kv.pos_max(0) == 1
    assert kv.n_free == 8 - 6 + 2
    kv.check()
    assert _take(kv, [2, 2]) == ([3, 4], [0, 1])  # freed cells come back in ascending order
    kv.keep(1)
    assert (kv.cells(0), kv.cells(2), kv.cells(1)) == ([], [], [1, 2, 5])
    assert kv.pos_max(0) == -1
    kv.check()
    kv.clear()
    assert kv.n_free == 8
    assert [kv.pos_max(s) for s in range(3)] == [-1, -1, -1]
    assert _take(kv, [0]) == ([0], [0])
    kv.check()


def test_cells_keep_their_token_ids_through_sharing_and_removal() -> None:
    kv = KvCells(10, n_seq=2)
    _take(kv, [0, 0, 0, 0], [11, 12, 13, 14])  # seq 0: positions 0..3
    assert kv.tokens(0) == [11, 12, 13, 14]
    kv.copy(0, 1, p0=0, p1=2)  # seq 1 shares positions 0 and 1, and so their tokens
    _take(kv, [1, 0], [21, 15])
    assert kv.tokens(1) == [11, 12, 21]
    assert kv.tokens(0) == [11, 12, 13, 14, 15]
    # The penalty window of the token at position 4: positions 1..4; -1 before position 0.
    assert kv.window(0, 4, 4).tolist() == [12, 13, 14, 15]
    assert kv.window(1, 2, 5).tolist() == [-1, -1, 11, 12, 21]
    assert kv.window(0, 3, 0).tolist() == []
    kv.remove(0, p0=1, p1=3)  # a gap at positions 1 and 2 of seq 0
    assert kv.window(0, 4, 5).tolist() == [11, -1, -1, 14, 15]
    assert kv.tokens(1) == [11, 12, 21]  # position 1 stays, held by seq 1
    # A token fed on the device is unknown when its cell is taken, then set once read.
    step = kv.begin()
    (cell,), _ = kv.take([0], step, [-1])
    assert kv.tokens(0)[-1] == -1
    kv.set_token(cell, 16)
    kv.commit(step, confirmed=True)
    assert kv.tokens(0) == [11, 14, 15, 16]
    with pytest.raises(SessionError, match="not held"):
        kv.set_token(9, 1)
    with pytest.raises(SessionError, match="2 token ids for 1 cells"):
        kv.take([0], kv.begin(), [1, 2])
    kv.recover()
    kv.clear()
    kv.check()  # free cells hold no token
    assert kv.tokens(0) == []


def test_rollback_restores_the_state_exactly() -> None:
    kv = KvCells(10, n_seq=2)
    _take(kv, [0, 1, 0], [4, 5, 6])
    kv.copy(0, 1)
    kv.remove(0, p0=1)
    before = _snapshot(kv)
    first, second = kv.begin(), kv.begin()
    kv.take([1, 1, 0], first, [7, 8, 9])
    kv.take([0], second)
    assert kv.n_free == len(before[4]) - 4
    kv.rollback(second, first)  # newest first
    assert _snapshot(kv) == before
    kv.check()
    kv.rollback(second, first)  # nothing left to undo: a no-op
    assert _snapshot(kv) == before


def test_take_is_all_or_nothing_when_the_cache_is_full() -> None:
    kv = KvCells(3, n_seq=1)
    _take(kv, [0, 0])
    before = _snapshot(kv)
    step = kv.begin()
    with pytest.raises(ContextFullError, match="2 tokens need as many free KV cells"):
        kv.take([0, 0], step)
    assert step.taken == []
    assert _snapshot(kv) == before


def test_bad_arguments_raise_session_errors_and_change_nothing() -> None:
    kv = KvCells(4, n_seq=2)
    _take(kv, [0, 1])
    before = _snapshot(kv)
    calls = [
        (lambda: kv.take([0, 2], kv.begin()), r"unknown sequence id 2.*0\.\.1"),
        (lambda: kv.copy(0, 5), "unknown sequence id 5"),
        (lambda: kv.remove(-1), "unknown sequence id -1"),
        (lambda: kv.remove(0, 3, 1), "empty or negative"),
        (lambda: kv.keep(True), "must be an int"),  # type: ignore[arg-type]
        (lambda: kv.pos_max(9), "unknown sequence id 9"),
    ]
    for call, pattern in calls:
        with pytest.raises(SessionError, match=pattern):
            call()
    assert _snapshot(kv) == before
    with pytest.raises(SessionError, match="n_cells"):
        KvCells(0, 1)
    with pytest.raises(SessionError, match="n_seq"):
        KvCells(4, 0)


def test_pending_cells_are_freed_by_invalidate_until_a_confirmed_step() -> None:
    kv = KvCells(8, n_seq=2)
    _take(kv, [0, 0])  # confirmed: cells 0, 1
    step = kv.begin()
    kv.take([0, 0], step)  # cells 2, 3, committed without a wait
    kv.commit(step, confirmed=False)
    kv.copy(0, 1)  # seq 1 shares all four cells
    assert kv.n_pending == 2
    assert kv.invalidate_pending() == [2, 3]
    assert (kv.cells(0), kv.cells(1)) == ([0, 1], [0, 1])  # gone from every sequence
    assert (kv.pos_max(0), kv.pos_max(1)) == (1, 1)
    assert kv.n_pending == 0
    kv.check()

    step = kv.begin()
    kv.take([1], step)
    kv.commit(step, confirmed=False)
    kv.remove(1)  # freed already; retaken below at another position
    step = kv.begin()
    kv.take([0], step)
    kv.commit(step, confirmed=True)  # a wait on a later step confirms every earlier one
    assert kv.n_pending == 0
    assert kv.invalidate_pending() == []
    kv.check()


class _InterruptAt:
    """A trace function that raises KeyboardInterrupt at the `n`-th line event in kv_cells."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0
        self.fired = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename.endswith("kv_cells.py"):
            if event == "line":
                self.seen += 1
                if self.seen == self.n:
                    self.fired = True
                    raise KeyboardInterrupt
            return self
        return None


def _interrupted(fn: Any, n: int) -> bool:
    """Runs `fn` with a KeyboardInterrupt at line `n` of kv_cells; whether it fired."""
    trace = _InterruptAt(n)
    sys.settrace(trace)
    try:
        fn()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return trace.fired


def test_an_interrupt_anywhere_in_take_is_undone_by_rollback() -> None:
    base = KvCells(6, n_seq=2)
    _take(base, [0, 1])
    before = _snapshot(base)
    n = 1
    while True:
        kv = copy.deepcopy(base)
        step = kv.begin()
        fired = _interrupted(lambda kv=kv, step=step: kv.take([0, 1, 0], step, [3, 4, 5]), n)
        kv.rollback(step)
        assert _snapshot(kv) == before, f"interrupted at line {n} of take"
        kv.check()
        if not fired:
            break
        n += 1
    assert n > 10  # every line of take was hit


def test_an_interrupted_rollback_finishes_or_is_recovered() -> None:
    base = KvCells(6, n_seq=2)
    _take(base, [0, 1])
    before = _snapshot(base)
    n = 1
    while True:
        kv = copy.deepcopy(base)
        older, newer = kv.begin(), kv.begin()
        kv.take([0, 1], older, [7, 8])
        kv.take([1], newer, [9])
        trace = _InterruptAt(n)
        sys.settrace(trace)
        try:
            kv.rollback(newer, older)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        # Landed before the rollback's loop, the steps are still open: the owner's next call
        # recovers them.
        kv.recover()
        assert _snapshot(kv) == before, f"interrupted at line {n} of the rollback"
        kv.check()
        if not trace.fired:
            break
        n += 1
    assert n > 10


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["take", "fail", "cp", "rm", "keep", "clear", "pend", "inval"]),
            st.integers(0, 2),
            st.integers(0, 2),
            st.integers(0, 6),
        ),
        max_size=40,
    )
)
def test_random_operations_keep_the_invariants(ops: list[tuple[str, int, int, int]]) -> None:
    kv = KvCells(8, n_seq=3)
    taken_with: dict[int, int] = {}  # cell -> the token it was last taken with
    for op, a, b, n in ops:
        if op in ("take", "fail", "pend"):
            seqs = [a, b, a][: n % 4]
            if len(seqs) > kv.n_free:
                continue
            before = _snapshot(kv)
            step = kv.begin()
            tokens = [100 * s + n for s in seqs]
            cells, _ = kv.take(seqs, step, tokens)
            assert len(set(cells)) == len(cells)
            if op == "fail":
                kv.rollback(step)
                assert _snapshot(kv) == before
            else:
                kv.commit(step, confirmed=op == "take")
                taken_with.update(zip(cells, tokens, strict=True))
        elif op == "cp":
            kv.copy(a, b, p0=n // 2)
        elif op == "rm":
            kv.remove(a, p0=n)
        elif op == "keep":
            kv.keep(a)
        elif op == "clear":
            kv.clear()
        else:
            kv.invalidate_pending()
        kv.check()
        for c in np.flatnonzero(kv._s.pos >= 0):  # a held cell keeps the token it was taken with
            assert kv._s.tok[c] == taken_with[int(c)]
