"""`KvCells`: which KV-cache cell holds which position of which sequences, without a backend.

Why: a `Session` turns this bookkeeping into graph inputs every step (slot indices, positions,
mask rows), and a mistake in it is silent: a cell held but never written, or a position given
twice, makes later steps attend garbage with no error anywhere. Kept apart from the session, it
can be tested exhaustively with no context, no plan and no model.

Strategy: a unified cache like llama.cpp's: `n_cells` cells, each with a position (-1: free),
a set of sequences and the token id decoded into it (what the sampler's penalty window reads;
shared cells share it, so `copy` and `remove` keep it right with no extra work), so `copy`
(seq_cp) shares cells without copying data. Each sequence has
a mask row over the `n_cells + 1` cache rows (0 on its cells, -inf elsewhere and always on the
last row, the scratch row padded tokens write to) and a next position (its largest + 1). Free
cells are a stack kept sorted, lowest on top. The hot operation, `take`, changes the state in
place but first journals each cell in the caller's `Step`, so `rollback` restores the state
before the step exactly. The cold operations (`copy`, `remove`, `keep`, `clear`) build the new
state on a copy and swap it in with one assignment.

Invariants: every operation either completes or leaves the state as it was, also when
KeyboardInterrupt arrives between any two bytecodes: `take` journals before it changes anything,
`rollback` can run again after an interruption (its steps are idempotent), and a step left open
by an interruption that landed before any handler ran is rolled back by `recover`, so once no
step is open the state `check` verifies holds. Cells whose KV rows the device may not have
written yet (`pending`: taken by steps committed without a completed wait) can be freed at once
by `invalidate_pending`, for when a failure may have cancelled queued work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from lowsync._native import LowsyncError

_NEG_INF = np.float32(-np.inf)


class SessionError(LowsyncError, ValueError):
    """Bad input to a `Session`: an unknown sequence id, a token id out of range, ..."""


class ContextFullError(SessionError):
    """The KV cache has too few free cells for the tokens of a decode."""


@dataclass(eq=False)  # steps are told apart by identity (`KvCells` keeps the open ones)
class Step:
    """The cells one step took, journalled before each was taken: (cell, sequence, the
    sequence's next position before the cell). Made by `KvCells.begin`."""

    taken: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class _State:
    pos: npt.NDArray[np.int64]  # [n_cells]: the cell's position, -1 when free
    seqs: npt.NDArray[np.bool_]  # [n_cells, n_seq]: the sequences holding the cell
    mask: npt.NDArray[np.float32]  # [n_seq, n_cells + 1]: 0 where the sequence attends
    next: list[int]  # per sequence: its largest position + 1 (0 when it holds none)
    free: list[int]  # a stack of free cells; the top is the lowest
    tok: npt.NDArray[np.int32]  # [n_cells]: the token decoded into the cell, -1 when free

    def copy(self) -> _State:
        return _State(
            self.pos.copy(),
            self.seqs.copy(),
            self.mask.copy(),
            list(self.next),
            list(self.free),
            self.tok.copy(),
        )


class KvCells:
    """The cell bookkeeping of a unified KV cache of `n_cells` cells shared by `n_seq` sequences.

    Example::

        kv = KvCells(8, n_seq=2)
        step = kv.begin()
        cells, positions = kv.take([0, 0, 0], step)  # ([0, 1, 2], [0, 1, 2])
        kv.commit(step, confirmed=True)              # the device finished the step
        kv.copy(0, 1, p0=0, p1=2)                    # seq 1 shares cells 0 and 1
        kv.remove(0, p0=1)                           # cell 2 is free again; cell 1 stays (seq 1)
    """

    def __init__(self, n_cells: int, n_seq: int) -> None:
        if isinstance(n_cells, bool) or not isinstance(n_cells, int) or n_cells < 1:
            raise SessionError(f"KvCells: n_cells must be a positive int, got {n_cells!r}")
        if isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq < 1:
            raise SessionError(f"KvCells: n_seq must be a positive int, got {n_seq!r}")
        self.n_cells = n_cells
        self.n_seq = n_seq
        self._s = _State(
            pos=np.full(n_cells, -1, np.int64),
            seqs=np.zeros((n_cells, n_seq), bool),
            mask=np.full((n_seq, n_cells + 1), _NEG_INF, np.float32),
            next=[0] * n_seq,
            free=list(range(n_cells - 1, -1, -1)),
            tok=np.full(n_cells, -1, np.int32),
        )
        self._pending: list[tuple[int, int]] = []  # (cell, position) not known to be written
        self._open: list[Step] = []  # begun, neither committed nor rolled back

    # ---- facts --------------------------------------------------------------------------------

    @property
    def n_rows(self) -> int:
        """Rows of the cache tensors: the cells plus the scratch row."""
        return self.n_cells + 1

    @property
    def scratch(self) -> int:
        """The row padded tokens write to; no mask row ever admits it."""
        return self.n_cells

    @property
    def n_free(self) -> int:
        """Cells no sequence holds."""
        return len(self._s.free)

    @property
    def n_pending(self) -> int:
        """Cells taken by committed steps the device is not known to have finished."""
        return len(self._pending)

    def pos_max(self, seq: int) -> int:
        """The largest position `seq` holds, or -1 when it holds none."""
        self._check_seq(seq)
        return self._s.next[seq] - 1

    def cells(self, seq: int) -> list[int]:
        """The cells `seq` holds, in cell order."""
        self._check_seq(seq)
        return [int(c) for c in np.flatnonzero(self._s.seqs[:, seq])]

    def positions(self, seq: int) -> list[int]:
        """The positions `seq` holds, in the order of `cells(seq)`."""
        self._check_seq(seq)
        return [int(p) for p in self._s.pos[self._s.seqs[:, seq]]]

    def tokens(self, seq: int) -> list[int]:
        """The token ids `seq`'s cells hold, in position order (-1: taken without a token)."""
        self._check_seq(seq)
        s = self._s
        cells = np.flatnonzero(s.seqs[:, seq])
        return [int(t) for t in s.tok[cells[np.argsort(s.pos[cells], kind="stable")]]]

    def window(self, seq: int, last: int, n: int) -> npt.NDArray[np.int32]:
        """The tokens `seq` holds at positions `last - n + 1 .. last`, oldest first, -1 where
        it holds none: the penalty window of the token at `last` (a new int32 array of `n`)."""
        out = np.full(n, -1, np.int32)
        if n <= 0:
            return out
        s = self._s
        first = last - n + 1
        cells = np.flatnonzero(s.seqs[:, seq] & (s.pos >= first) & (s.pos <= last))
        out[s.pos[cells] - first] = s.tok[cells]
        return out

    def mask_row(self, seq: int) -> npt.NDArray[np.float32]:
        """`seq`'s mask row as a [1, n_rows] view (valid until the next change)."""
        return self._s.mask[seq : seq + 1]

    def mask_rows(self, seqs: Sequence[int]) -> npt.NDArray[np.float32]:
        """The mask rows of `seqs`, [len(seqs), n_rows] (a copy)."""
        return self._s.mask[list(seqs)]

    # ---- sequences (cold: built on a copy, swapped in whole) ----------------------------------

    def copy(self, src: int, dst: int, p0: int = 0, p1: int | None = None) -> None:
        """Makes `dst` share `src`'s cells with positions in [p0, p1): no data is copied."""
        self._check_seq(src)
        self._check_seq(dst)
        cells = self._range(src, p0, p1)
        if src == dst or cells.size == 0:
            return
        s = self._s.copy()
        s.seqs[cells, dst] = True
        s.mask[dst, cells] = 0.0
        s.next[dst] = max(s.next[dst], int(s.pos[cells].max()) + 1)
        self._s = s

    def remove(self, seq: int, p0: int = 0, p1: int | None = None) -> None:
        """Removes `seq` from its cells with positions in [p0, p1); frees cells left empty."""
        self._check_seq(seq)
        cells = self._range(seq, p0, p1)
        if cells.size:
            s = self._s.copy()
            _drop(s, seq, cells)
            self._s = s

    def keep(self, seq: int) -> None:
        """Removes every other sequence."""
        self._check_seq(seq)
        s = self._s.copy()
        for other in range(self.n_seq):
            if other != seq:
                _drop(s, other, np.flatnonzero(s.seqs[:, other]))
        self._s = s

    def clear(self) -> None:
        """Frees every cell."""
        s = self._s.copy()
        for seq in range(self.n_seq):
            _drop(s, seq, np.flatnonzero(s.seqs[:, seq]))
        self._s = s
        self._pending = []

    # ---- steps (hot: journalled in place) -----------------------------------------------------

    def begin(self) -> Step:
        """A new step to take cells in; `commit` or `rollback` it (or `recover` does)."""
        step = Step()
        self._open.append(step)
        return step

    def is_open(self, step: Step) -> bool:
        """Whether `step` was begun and is neither committed nor rolled back."""
        return step in self._open

    @property
    def n_open(self) -> int:
        """Steps begun and neither committed nor rolled back."""
        return len(self._open)

    def recover(self) -> None:
        """Rolls back every open step, newest first: those an interruption left behind (it
        may land even before the caller's handler runs). The owner calls this when no step of
        its own is open, e.g. on entry to each of its calls."""
        if self._open:
            self.rollback(*reversed(self._open))

    def take(
        self, seqs: Sequence[int], step: Step, tokens: Sequence[int] | None = None
    ) -> tuple[list[int], list[int]]:
        """Gives each token of `seqs` a free cell and its sequence's next position; all or none
        (ContextFullError when too few cells are free). Journalled in `step`. `tokens`: the
        token id decoded into each cell (-1, unknown, without them; see `set_token`)."""
        for seq in set(seqs):
            self._check_seq(seq)
        if tokens is not None and len(tokens) != len(seqs):
            raise SessionError(f"take: {len(tokens)} token ids for {len(seqs)} cells")
        s = self._s
        if len(seqs) > len(s.free):
            raise ContextFullError(
                f"{len(seqs)} tokens need as many free KV cells; the cache has {len(s.free)} "
                f"free of {self.n_cells}"
            )
        cells: list[int] = []
        positions: list[int] = []
        for i, seq in enumerate(seqs):
            c = s.free[-1]
            p = s.next[seq]
            # Journal first: an interruption after this line is undone by `rollback`.
            step.taken.append((c, seq, p))
            s.free.pop()
            s.next[seq] = p + 1
            s.pos[c] = p
            s.seqs[c, seq] = True
            s.mask[seq, c] = 0.0
            s.tok[c] = -1 if tokens is None else tokens[i]
            cells.append(c)
            positions.append(p)
        return cells, positions

    def set_token(self, cell: int, token: int) -> None:
        """Records the token decoded into a held `cell`, once the host knows it (a token fed on
        the device is read only after the step that decodes it was queued)."""
        if not 0 <= cell < self.n_cells or self._s.pos[cell] < 0:
            raise SessionError(f"set_token: cell {cell} is not held by any sequence")
        self._s.tok[cell] = token

    def commit(self, step: Step, confirmed: bool) -> None:
        """Keeps `step`'s cells. `confirmed`: a wait on the step's output completed, so the
        device wrote its rows and those of every step before it (stream order); otherwise its
        cells are pending until a later confirmed step."""
        if confirmed:
            self._pending = []
        else:
            self._pending.extend((c, p) for c, _, p in step.taken)
        # Interrupted before the next line, the step is still open and `recover` undoes it:
        # the call it belongs to raised, so its cells go back (pending entries of freed cells
        # are ignored by `invalidate_pending`).
        self._open.remove(step)
        step.taken = []

    def rollback(self, *steps: Step) -> None:
        """Undoes `steps`, newest first: the state is exactly what it was before the oldest.

        A KeyboardInterrupt inside the rollback's loop does not stop it: the rollback completes,
        then the interrupt is raised. One that lands before the loop leaves the steps open, for
        `recover`."""
        interrupted = None
        while True:
            try:
                for step in steps:
                    self._undo(step)
                    if step in self._open:
                        self._open.remove(step)
                break
            except KeyboardInterrupt as e:  # each undo step is idempotent: run it again
                interrupted = e
        if interrupted is not None:
            raise interrupted

    def invalidate_pending(self) -> list[int]:
        """Frees, in every sequence, the pending cells that still hold the position they were
        taken at (their rows may never have been written: Ctrl-C cancels queued work); returns
        them. Sequences' next positions follow what they still hold."""
        s = self._s
        cells = np.array(sorted({c for c, p in self._pending if s.pos[c] == p}), np.intp)
        if cells.size:
            new = s.copy()
            for seq in range(self.n_seq):
                _drop(new, seq, cells[new.seqs[cells, seq]])
            self._s = new
        self._pending = []
        return [int(c) for c in cells]

    def check(self) -> None:
        """Asserts the invariants of the state (for tests): no step is open; a cell is free iff
        no sequence holds it iff its position is -1; a free cell holds no token (-1); the free
        stack holds each free cell once, lowest on top; each mask row admits exactly its
        sequence's cells; each next position is the largest + 1."""
        assert not self._open, f"{len(self._open)} step(s) still open"
        s = self._s
        held = s.seqs.any(axis=1)
        assert s.free == sorted(set(s.free), reverse=True), f"free stack out of order: {s.free}"
        assert s.free[::-1] == [int(c) for c in np.flatnonzero(~held)], (s.free, held)
        assert bool(np.all((s.pos >= 0) == held)), s.pos
        assert bool(np.all(s.tok[~held] == -1)), s.tok
        for seq in range(self.n_seq):
            want = np.full(self.n_rows, _NEG_INF, np.float32)
            want[: self.n_cells][s.seqs[:, seq]] = 0.0
            assert np.array_equal(s.mask[seq], want), f"mask row of sequence {seq}"
            p = s.pos[s.seqs[:, seq]]
            assert s.next[seq] == (int(p.max()) + 1 if p.size else 0), (seq, s.next[seq])

    # ---- internals ----------------------------------------------------------------------------

    def _check_seq(self, seq: int) -> None:
        if isinstance(seq, bool) or not isinstance(seq, int | np.integer):
            raise SessionError(f"sequence id must be an int, got {seq!r}")
        if not 0 <= seq < self.n_seq:
            raise SessionError(
                f"unknown sequence id {seq}: this session has sequences 0..{self.n_seq - 1} "
                f"(n_seq={self.n_seq})"
            )

    def _range(self, seq: int, p0: int, p1: int | None) -> npt.NDArray[np.intp]:
        hi = np.iinfo(np.int64).max if p1 is None else p1
        if p0 < 0 or hi < p0:
            raise SessionError(f"position range [{p0}, {p1}) is empty or negative")
        s = self._s
        return np.flatnonzero(s.seqs[:, seq] & (s.pos >= p0) & (s.pos < hi))

    def _undo(self, step: Step) -> None:
        s = self._s
        taken = step.taken
        while taken:
            c, seq, p = taken[-1]
            # Each line may run twice (an interrupted rollback runs again): all are
            # assignments, and the push checks whether the cell is back already. A taken cell
            # was free, so no other sequence holds it.
            s.seqs[c, seq] = False
            s.mask[seq, c] = _NEG_INF
            s.pos[c] = -1
            s.tok[c] = -1
            s.next[seq] = p
            if not s.free or s.free[-1] != c:
                s.free.append(c)
            taken.pop()


def _drop(s: _State, seq: int, cells: npt.NDArray[np.intp]) -> None:
    """Removes `seq` from `cells` in `s` and frees the cells no sequence holds any more."""
    if cells.size == 0:
        return
    s.seqs[cells, seq] = False
    s.mask[seq, cells] = _NEG_INF
    emptied = cells[~s.seqs[cells].any(axis=1)]
    s.pos[emptied] = -1
    s.tok[emptied] = -1
    # The stack stays sorted, lowest on top: a take gets the lowest free cell whatever the
    # history, so a cleared cache allocates as a new one does.
    s.free = sorted({*s.free, *(int(c) for c in emptied)}, reverse=True)
    held = s.pos[s.seqs[:, seq]]
    s.next[seq] = int(held.max()) + 1 if held.size else 0
