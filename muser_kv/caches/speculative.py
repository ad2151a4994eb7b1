"""Speculative rollback: metadata rewind for growing planes, retained rows for rings.

A draft block that is rejected must leave the cache as if it never happened.
A global (NoPE) plane grows into unused rows, so rewinding it is three
integers. A sliding ring at steady state has no unused rows: each token
overwrites the oldest live row, so the ring keeps the rows it overwrote --
at most ``retain`` of them, a few KiB per layer -- and a rollback puts them back
where they were. Nothing ever copies a plane.

Rows are retained before they are overwritten, so mlx-lm's own ``trim`` protocol
is exact up to the retained depth, and refused beyond it (never silently wrong).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Tuple

import mlx.core as mx

from muser_kv.core.counts import count

#: The longest draft block a checkpoint covers (a speculative draft of up to 16 tokens).
MAX_BLOCK = 16

#: Rows a sliding ring retains by default, so ``trim`` is exact that deep: deep
#: enough for mlx-lm's speculative decoding with any usual draft length (mlx-lm's
#: default is 3) on both the model's and the draft model's caches, for at most
#: two blocks of 64 rows per layer (6% of a 2,048-row ring's bytes).
DEFAULT_RETAIN = 64


class RetainedRows:
    """Copies of a ring's rows by logical position: one contiguous run
    ``[start, end)`` of ``[2, kv_dim]`` (K, V) rows.

    Invariant ``trim`` relies on: every position the ring has overwritten since
    ``start`` is here (``end >= origin_logical``). Positions at or past
    ``origin_logical`` are copies taken ahead of time, a block of ``limit`` rows
    at once, so a one-token store has nothing to copy: the row it overwrites
    was copied up to ``limit`` tokens earlier, while attention read the ring
    anyway. A position's row never changes while the position exists, so a copy
    stays valid until ``truncate`` drops positions that a ``trim`` removed.
    """

    def __init__(self, limit: int):
        self.limit = count(limit, "retain")
        self._blocks: Deque[Tuple[int, mx.array]] = deque()
        self.start = self.end = 0
        #: copies added since the cache's ``state`` was last read (see ``pending``)
        self._recent: List[mx.array] = []

    def copy(self) -> "RetainedRows":
        """An independent copy (the rows are immutable arrays: shared, not copied)."""
        other = RetainedRows(self.limit)
        other._blocks = deque(self._blocks)
        other.start, other.end = self.start, self.end
        other._recent = list(self._recent)
        return other

    def clear(self) -> None:
        self._blocks.clear()
        self._recent = []
        self.start = self.end = 0

    def covers(self, position: int) -> bool:
        return self.start <= position < self.end  # empty: start == end

    def first(self, origin_logical: int) -> int:
        """The oldest position held; ``origin_logical`` when nothing is."""
        return self.start if self._blocks else origin_logical

    def add(self, position: int, kv: mx.array, origin_logical: int) -> None:
        """Hold rows ``[m, 2, kv_dim]`` for positions ``position .. position+m``,
        replacing what was held from ``position`` on; rows more than ``limit``
        below ``origin_logical`` are let go."""
        m = kv.shape[0]
        if self.limit == 0 or m == 0:
            return
        self.truncate(position)
        if not self._blocks or position != self.end:
            self.clear()
            self.start = position
        self._blocks.append((position, kv))
        self._recent.append(kv)
        self.end = position + m
        floor = origin_logical - self.limit
        while len(self._blocks) > 1 and self._blocks[0][0] + self._blocks[0][1].shape[0] <= floor:
            self._blocks.popleft()
            self.start = self._blocks[0][0]

    def blocks(self) -> Optional[Tuple[int, List[mx.array]]]:
        """``(start, blocks)``: the rows retained, as the contiguous blocks they were
        copied in (``None`` when none are); ``adopt`` takes them back."""
        if not self._blocks:
            return None
        return self.start, [rows for _, rows in self._blocks]

    def adopt(self, start: int, blocks: Sequence[mx.array]) -> None:
        """Hold ``blocks`` (``[m, 2, kv_dim]`` each) for the positions from
        ``start`` on, in order (what ``held`` gave); the caller has checked them."""
        self.clear()
        position = start
        for rows in blocks:
            self._blocks.append((position, rows))
            position += rows.shape[0]
        self.start, self.end = start, position

    def pending(self) -> List[mx.array]:
        """The copies added since the last call, handed over once. A copy is made
        part of what attention evaluates; a caller that evaluates only the
        cache's ``state`` (mlx-lm's prefill does, and so does a fill that never
        reads the outputs) must evaluate it too, or, left lazy, it would hold
        the plane it reads and MLX would copy that plane at the next store."""
        out, self._recent = self._recent, []
        return out

    def truncate(self, position: int) -> None:
        """Let go of the rows for positions ``>= position``."""
        while self._blocks and self._blocks[-1][0] >= position:
            self._blocks.pop()
        if not self._blocks:
            self.clear()
            return
        last, rows = self._blocks[-1]
        if last + rows.shape[0] > position:
            self._blocks[-1] = (last, rows[:position - last])
        self.end = min(self.end, position)

    def rows(self, first: int, stop: int) -> Tuple[mx.array, mx.array]:
        """``(keys, values)`` ``[stop - first, kv_dim]`` for positions ``first .. stop``."""
        if first == stop:
            return mx.zeros((0, 0), mx.float16), mx.zeros((0, 0), mx.float16)
        if not (self._blocks and self.start <= first and stop <= self.end):
            raise ValueError(f"rows [{first}, {stop}) not held (held [{self.start}, {self.end}))")
        parts: List[mx.array] = []
        for position, block in self._blocks:
            lo, hi = max(first, position), min(stop, position + block.shape[0])
            if lo < hi:
                parts.append(block[lo - position:hi - position])
        rows = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return rows[:, 0, :], rows[:, 1, :]

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held (a block cut by ``truncate`` may still hold the
        rows it lost until it is let go)."""
        return sum(rows.nbytes for _, rows in self._blocks)


class SpeculativeCheckpoint:
    """One speculative block's transaction over a whole cache.

    ``rollback()`` returns every layer to the block's start (all or nothing:
    every layer is checked before any is touched); ``commit()`` keeps the block.
    Either ends the checkpoint.

    A checkpoint is opened only for a block every layer can undo exactly, and a
    rollback either restores the state at the checkpoint exactly or refuses with
    the cache unchanged: it refuses once anything but writes moved the cache
    since the checkpoint -- a trim below the block's start, or a restore from a
    snapshot -- since the rows before the start are then no longer the
    checkpoint's. (A trim inside the block is a rollback of part of it, and
    keeps the checkpoint good.)
    """

    def __init__(self, cache: Sequence, block_len: int):
        block_len = count(block_len, "block_len")
        if not 1 <= block_len <= MAX_BLOCK:
            raise ValueError(f"block_len must be in [1, {MAX_BLOCK}], got {block_len}")
        cache = list(cache)
        if not cache:
            raise ValueError("checkpoint needs a cache list with at least one layer")
        offsets = {c.offset for c in cache}
        if len(offsets) != 1:
            raise ValueError(f"cache layers disagree on their position: {sorted(offsets)}")
        for c in cache:
            if c.undoable_block() < block_len:
                raise ValueError(
                    f"layer {c.layer} retains {c.retain_depth} rows and can undo a block of at "
                    f"most {c.undoable_block()} tokens from position {c.offset}, asked for "
                    f"{block_len} (make_prompt_cache(..., retain={block_len}))"
                )
        self.cache = cache
        self.block_len = block_len
        self.start = offsets.pop()
        self.open = True
        self._broken: Optional[str] = None
        for c in cache:
            c.watch(self)

    # -- what the caches report (MuseKVCache.watch) -----------------------------

    def cache_trimmed(self, cache: Any, position: int) -> None:
        if position < self.start and self._broken is None:
            self._broken = (f"layer {cache.layer} was trimmed to position {position}, below the "
                            f"checkpoint's start {self.start}")

    def cache_replaced(self, cache: Any) -> None:
        if self._broken is None:
            self._broken = f"layer {cache.layer} was restored from a snapshot"

    def _end(self) -> None:
        if not self.open:
            raise RuntimeError("this checkpoint was already committed or rolled back")
        self.open = False
        for c in self.cache:
            c.unwatch(self)

    def commit(self) -> None:
        """Keep the block."""
        self._end()

    def rollback(self) -> int:
        """Undo everything written since the checkpoint; returns the tokens undone."""
        if not self.open:
            raise RuntimeError("this checkpoint was already committed or rolled back")
        depths = [c.trimmable_depth() for c in self.cache]  # also notices a restore
        if self._broken is not None:
            raise RuntimeError(
                f"cannot roll back to position {self.start}: {self._broken} since the "
                "checkpoint, so the state at the checkpoint is gone (the cache is unchanged)")
        n = {c.offset - self.start for c in self.cache}
        if len(n) != 1:
            raise RuntimeError(f"cache layers moved by different amounts since the checkpoint: {n}")
        written = n.pop()
        if not 0 <= written <= self.block_len:
            raise RuntimeError(
                f"{written} tokens were written since the checkpoint, more than its block of "
                f"{self.block_len}"
            )
        for c, depth in zip(self.cache, depths):
            if depth < written:
                raise RuntimeError(f"layer {c.layer} cannot undo {written} tokens exactly")
        for c in self.cache:
            c.trim(written)
        self._end()
        return written

    @property
    def nbytes(self) -> int:
        """What the checkpoint costs beyond the planes: the retained rows."""
        return sum(c.retained_nbytes for c in self.cache)


def checkpoint(cache: Sequence, block_len: int) -> SpeculativeCheckpoint:
    """Open a checkpoint before writing a speculative block of ``block_len`` tokens."""
    return SpeculativeCheckpoint(cache, block_len)
