"""Speculative rollback: metadata rewind for growing planes, retained rows for rings.

A draft block that is rejected must leave the cache as if it never happened.
A global (NoPE) plane grows into unused rows, so rewinding it is three
integers. A sliding ring at steady state has no unused rows: each token
overwrites the oldest live row, so the ring keeps the rows it overwrote --
at most ``retain`` of them, a few KiB per layer -- and a rollback puts them back
where they were. Nothing ever copies a plane (seeds Ch 23.6).

Rows are retained as they are overwritten, so mlx-lm's own ``trim`` protocol is
exact up to the retained depth, and refused beyond it (never silently wrong).
"""

from __future__ import annotations

from collections import deque
from typing import Deque, List, Sequence, Tuple

import mlx.core as mx

#: The longest draft block a checkpoint covers (seeds: DFlash blocks of up to 16).
MAX_BLOCK = 16

#: Rows a sliding ring retains by default, so ``trim`` is exact that deep.
DEFAULT_RETAIN = 16


class RetainedRows:
    """The newest ``limit`` rows a ring overwrote, in logical order, ending at the
    ring's ``origin_logical`` (the invariant ``trim`` relies on: no gaps). Each
    row holds K and V together, ``[2, kv_dim]``, so one copy retains both."""

    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError(f"retain must be >= 0, got {limit}")
        self.limit = limit
        self._blocks: Deque[Tuple[int, mx.array]] = deque()
        self.count = 0

    def first(self, origin_logical: int) -> int:
        """The oldest position held; ``origin_logical`` when nothing is."""
        return origin_logical - self.count

    def clear(self) -> None:
        self._blocks.clear()
        self.count = 0

    def push(self, position: int, kv: mx.array) -> None:
        """Append rows ``[m, 2, kv_dim]`` (K, V) for positions ``position .. position+m``."""
        m = kv.shape[0]
        if self.limit == 0 or m == 0:
            return
        if m > self.limit:
            kv, position, m = kv[m - self.limit:], position + m - self.limit, self.limit
        self._blocks.append((position, kv))
        self.count += m
        while self.count > self.limit:
            first, rows = self._blocks.popleft()
            drop = self.count - self.limit
            if rows.shape[0] > drop:
                self._blocks.appendleft((first + drop, rows[drop:]))
                self.count -= drop
            else:
                self.count -= rows.shape[0]

    def pop(self, count: int) -> Tuple[mx.array, mx.array]:
        """Remove and return the newest ``count`` rows as ``(keys, values)``,
        each ``[count, kv_dim]`` in logical order."""
        if count > self.count:
            raise ValueError(f"only {self.count} retained rows, asked for {count}")
        parts: List[mx.array] = []
        need = count
        while need:
            position, rows = self._blocks.pop()
            m = rows.shape[0]
            take = min(m, need)
            parts.insert(0, rows[m - take:])
            if take < m:
                self._blocks.append((position, rows[:m - take]))
            need -= take
        self.count -= count
        if not parts:
            return mx.zeros((0, 0), mx.float16), mx.zeros((0, 0), mx.float16)
        rows = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
        return rows[:, 0, :], rows[:, 1, :]

    @property
    def nbytes(self) -> int:
        """Bytes of the retained rows (a partly dropped block may still hold its
        few dropped rows: at most ``limit`` rows more)."""
        return sum(rows.nbytes for _, rows in self._blocks)


class SpeculativeCheckpoint:
    """One speculative block's transaction over a whole cache.

    ``rollback()`` returns every layer to the block's start (all or nothing:
    every layer is checked before any is touched); ``commit()`` keeps the block.
    Either ends the checkpoint.
    """

    def __init__(self, cache: Sequence, block_len: int):
        if not 1 <= block_len <= MAX_BLOCK:
            raise ValueError(f"block_len must be in [1, {MAX_BLOCK}], got {block_len}")
        offsets = {c.offset for c in cache}
        if len(offsets) != 1:
            raise ValueError(f"cache layers disagree on their position: {sorted(offsets)}")
        for c in cache:
            if c.retain_depth < block_len:
                raise ValueError(
                    f"layer {c.layer} retains {c.retain_depth} rows, a block of {block_len} "
                    f"needs that many (make_prompt_cache(..., retain={block_len}))"
                )
        self.cache = list(cache)
        self.block_len = block_len
        self.start = offsets.pop()
        self.open = True

    def _end(self) -> None:
        if not self.open:
            raise RuntimeError("this checkpoint was already committed or rolled back")
        self.open = False

    def commit(self) -> None:
        """Keep the block."""
        self._end()

    def rollback(self) -> int:
        """Undo everything written since the checkpoint; returns the tokens undone."""
        if not self.open:
            raise RuntimeError("this checkpoint was already committed or rolled back")
        n = {c.offset - self.start for c in self.cache}
        if len(n) != 1:
            raise RuntimeError(f"cache layers moved by different amounts since the checkpoint: {n}")
        count = n.pop()
        if not 0 <= count <= self.block_len:
            raise RuntimeError(
                f"{count} tokens were written since the checkpoint, more than its block of {self.block_len}"
            )
        for c in self.cache:
            if c.trimmable_depth() < count:
                raise RuntimeError(f"layer {c.layer} cannot undo {count} tokens exactly")
        for c in self.cache:
            c.trim(count)
        self._end()
        return count

    @property
    def nbytes(self) -> int:
        """What the checkpoint costs beyond the planes: the retained rows."""
        return sum(c.retained_nbytes for c in self.cache)


def checkpoint(cache: Sequence, block_len: int) -> SpeculativeCheckpoint:
    """Open a checkpoint before writing a speculative block of ``block_len`` tokens."""
    return SpeculativeCheckpoint(cache, block_len)
