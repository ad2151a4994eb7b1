"""SlidingKVCache: a sliding-window (RoPE) layer's ring, its staging shadow and
its retained rows.

The ring (``ring.py``) answers where every write goes and how it is read back.
A chunk that the ring cannot take in place (one that wraps, or one into a ring
whose live rows are split) attends over the staging shadow -- the live rows in
logical order, then the chunk -- and is committed only afterwards: the ring
never grows past its capacity and never overwrites rows its own queries need.

Retained rows (``speculative.RetainedRows``) make ``trim`` exact past the wrap:
the ring keeps the newest ``retain`` rows it overwrote. On a full ring they are
copied ahead of being overwritten, ``retain`` rows at a time, while attention
reads the ring anyway, so a one-token store has nothing to copy; every copy is
made part of what attention evaluates (``evaluated_with``), because a copy left
lazy would hold the plane at the next store and MLX would copy the plane.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

import mlx.core as mx

from muser_kv.caches.base import INPUT_DTYPE_SET, REGIMES, Mask, MuseKVCache, State
from muser_kv.caches.masks import additive_mask, causal_mask, check_window
from muser_kv.caches.speculative import DEFAULT_RETAIN, RetainedRows
from muser_kv.caches.writes import evaluated_with
from muser_kv.core import kernels
from muser_kv.core.attention import KeyRead
from muser_kv.core.geometry import LayerKind
from muser_kv.core.planes import Planes
from muser_kv.core.ring import Read, Ring, Trim, Write

Pair = Tuple[mx.array, mx.array]


class SlidingKVCache(MuseKVCache):
    """A ring of ``min(max_context, window)`` rows (allocated rounded up to 256)."""

    kind = LayerKind.SLIDING

    def __init__(self, planes: Planes, *, window: int, max_context: int, layer: int = 0,
                 slot: int = 0, retain: int = DEFAULT_RETAIN):
        super().__init__(planes, capacity=min(max_context, window), window=window,
                         max_context=max_context, layer=layer, slot=slot)
        self.retain = retain
        self._retained = RetainedRows(retain)

    # -- the protocol mlx-lm's models call ---------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Pair:
        """One token of the model's shape (the decode hot path) takes the fewest
        calls: ``Ring.step`` checks the list and the limit and reserves the row,
        ``Planes.put_token`` writes it and reads the ring back, ``copy_ahead``
        runs only when the next victim has no copy. A token whose victim has no
        copy yet, and every other write, take ``_write``."""
        ring = self.ring
        if keys.shape == self._one_token and values.shape == self._one_token:
            dtype = keys.dtype
            retained = self._retained
            # not _victim_uncovered() before the write, and it after, inlined:
            # the decode path's calls are counted (tests/caches/test_decode_calls.py)
            if (dtype == values.dtype and dtype in INPUT_DTYPE_SET and (
                    not self.retain or ring.len < ring.capacity
                    or retained.start <= ring.origin_logical < retained.end)):
                row = ring.step(self._prev, self._lead, self.max_context)
                if row >= 0:
                    planes = self.planes
                    if dtype != planes.dtype:
                        keys, values = self._plane_rows(keys, values)
                    kv = planes.put_token(row, keys, values, self.slot, ring.len)
                    self._fetched_read = None
                    if (self.retain and ring.len == ring.capacity
                            and not retained.start <= ring.origin_logical < retained.end):
                        kv = evaluated_with(kv, self._take_ahead())  # copy_ahead's work
                    self._fetched = weakref.ref(kv[0])
                    return kv
        return self._write(keys, values)

    def _write(self, keys: mx.array, values: mx.array) -> Pair:
        """Any write: validated in full before anything changes, planned by the
        ring, rows placed, the ring committed last."""
        n = self.check_input(keys, values)
        self.check_write(n)
        plan = self.ring.write(self.ring.end, n)
        held = None
        if plan.read is Read.SHADOW:
            k_rows, v_rows = self.backend.stage(*self.planes.physical(self.slot), self.ring,
                                                keys, values, self.layout)
            held = self.keep_from_shadow(plan, k_rows, v_rows, 0)
            out = (kernels.attention_view(k_rows, kernels.TOKEN_MAJOR, self.kv_heads, self.head_dim),
                   kernels.attention_view(v_rows, kernels.TOKEN_MAJOR, self.kv_heads, self.head_dim))
            self.store(keys, values, plan)
        else:
            held = self.keep_overwritten(*plan.evicted)
            self.store(keys, values, plan)
            out = None
        self.ring.assign(plan.after)
        if out is None:
            rows = self.ring.capacity if plan.read is Read.RING else self.ring.len
            out = self.planes.prefix(rows, self.slot)
            self._fetched_read = None
        else:  # the shadow: the old live rows in logical order, then the chunk
            self._fetched_read = KeyRead(0, plan.after.end, plan.rows, 0, plan.rows)
        if held is not None:
            out = evaluated_with(out, held)
        ahead = self.copy_ahead()
        if ahead is not None:
            out = evaluated_with(out, ahead)
        self._fetched = weakref.ref(out[0])
        return out

    def _mask(self, n: int, window_size: Optional[int], return_array: bool) -> Mask:
        check_window(self.layer, self._window, window_size)
        ring = self.ring
        read = ring.read_for(n)
        if read is Read.SHADOW:  # every query sees itself: the additive form is exact
            return additive_mask(causal_mask(n, ring.len, self._window), self.planes.dtype)
        if n == 1:  # one token: every returned row (at most the whole ring) is visible
            rows = min(ring.len + 1, ring.capacity)
            return mx.ones((1, rows), dtype=mx.bool_) if return_array else None
        return causal_mask(n, ring.len) if return_array else "causal"

    # -- retained rows (speculative.py) -----------------------------------------------

    def _copy_rows(self, logical: int, count: int) -> mx.array:
        """Fresh copies ``[count, 2, H*D]`` (K, V) of live rows ``logical ..
        logical + count`` (never a view: a view would share the plane's buffer and
        keep MLX from donating it to the next store)."""
        runs = self.ring.runs(logical, count)
        if len(runs) == 1:  # one span (the decode case): slices, and the stack is the copy
            k, v = self.planes.span(runs[0].physical, count, self.slot)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            return mx.stack([k, v], axis=2).reshape(count, 2, self.kv_dim)
        segment = type(self.ring)(self.ring.capacity, count, logical, runs[0].physical, self.layer)
        k, v = self.backend.gather(*self.planes.physical(self.slot), self.layout, segment)
        return mx.stack([k, v], axis=1)

    # The one rule of retention: a row a write overwrites is kept before the
    # write (``keep_overwritten``, ``keep_from_shadow``) unless a copy was taken
    # ahead; after a write that leaves a full ring whose next victim has no
    # copy, the next ``retain`` victims are copied ahead (``copy_ahead``). The
    # single and the batch paths call these three; a batch's decode asks
    # ``decode_row`` per sequence, which applies them to one token.

    def decode_row(self) -> Tuple[int, Optional[mx.array], bool]:
        """A batch decode's token for this sequence: keep the row it overwrites
        (``keep_overwritten``, called only where no copy covers that row),
        reserve its row, and say whether a copy ahead is due once the batch has
        written it (``_victim_uncovered``, after the reservation; the caller then
        calls ``copy_ahead``). ``(row, kept copy or None, due)``: one call per
        sequence and layer in the steady state, where both checks are inlined."""
        ring, retained = self.ring, self._retained
        kept = None
        if self.retain and ring.len == ring.capacity \
                and not retained.start <= ring.origin_logical < retained.end:
            kept = self.keep_overwritten(ring.origin_logical, ring.origin_logical + 1)
        row = ring.append(ring.end)
        due = bool(self.retain) and ring.len == ring.capacity \
            and not retained.start <= ring.origin_logical < retained.end
        return row, kept, due

    def keep_overwritten(self, lo: int, hi: int) -> Optional[mx.array]:
        """Before a write that overwrites live positions ``[lo, hi)`` in place:
        copy them (in the same graph as the store: MLX then copies this ring
        once) unless they are covered. The caller evaluates the copy with
        attention (``evaluated_with``); ``None`` when there is nothing to keep."""
        if not self.retain or hi <= lo or self._retained.covers(lo):
            return None
        rows = self._copy_rows(lo, hi - lo)
        self._retained.add(lo, rows, lo)
        return rows

    def keep_from_shadow(self, plan: Write, k_rows: mx.array, v_rows: mx.array,
                         first: int) -> Optional[mx.array]:
        """Before a write read through a staging shadow (token-major rows, row
        ``first`` holding position ``plan.evicted[0]``): keep the newest
        ``retain`` of the positions leaving the window, from the shadow."""
        lo, hi = plan.evicted
        if not self.retain or hi <= lo:
            return None
        keep = min(hi - lo, self.retain)
        span = slice(first + hi - lo - keep, first + hi - lo)
        held = mx.stack([k_rows[span], v_rows[span]], 1)
        self._retained.add(hi - keep, held, plan.after.origin_logical)
        return held

    def copy_ahead(self) -> Optional[mx.array]:
        """After a write: on a full ring whose next victim has no copy, copy the
        next ``retain`` rows to be overwritten now, while this step reads the
        plane anyway. The caller makes the copy part of what attention
        evaluates (``evaluated_with``); ``None`` when nothing is due."""
        return self._take_ahead() if self._victim_uncovered() else None

    def _victim_uncovered(self) -> bool:
        """Whether this is a full ring whose next victim (its oldest row, the
        next write's) has no retained copy: the one condition for a copy ahead."""
        ring = self.ring
        return bool(self.retain) and ring.len == ring.capacity \
            and not self._retained.covers(ring.origin_logical)

    def _take_ahead(self) -> mx.array:
        """Retain copies of the next ``retain`` rows a full ring will overwrite."""
        ring = self.ring
        ahead = self._copy_rows(ring.origin_logical, min(self.retain, ring.len))
        self._retained.add(ring.origin_logical, ahead, ring.origin_logical)
        return ahead

    def settle(self) -> None:
        """Retained rows describe this cache's own history: after a wholesale
        replacement they are dropped, and a full ring's copy ahead is taken and
        evaluated now (taken in the same graph as the next store, it would make
        MLX copy the ring)."""
        self._retained.clear()
        if self._victim_uncovered():
            mx.eval(self._take_ahead())

    @property
    def kv_state(self) -> Pair:
        """The live planes, with the retained copies made since the last read
        attached (evaluating them evaluates the copies: see
        ``RetainedRows.pending``)."""
        kv = self.planes.physical(self.slot)
        pending = self._retained.pending()
        return tuple(mx.depends(list(kv), pending)) if pending else kv

    @property
    def state(self) -> State:
        k, v = self.kv_state
        return k, v, self.meta_state, self._retained.blocks()

    @classmethod
    def build(cls, planes: Planes, *, window: int, max_context: int, layer: int,
              retain: int) -> "SlidingKVCache":
        return cls(planes, window=window, max_context=max_context, layer=layer, retain=retain)

    @classmethod
    def _check_state_retained(cls, retained: Any, ring: Ring, dtype: Any, kv_dim: int,
                              retain: int) -> Optional[Tuple[int, List[mx.array]]]:
        return cls.check_retained(retained, ring, dtype, kv_dim, retain)

    @staticmethod
    def check_retained(retained: Any, ring: Ring, dtype: mx.Dtype, kv_dim: int,
                       retain: int) -> Optional[Tuple[int, List[mx.array]]]:
        """``state``'s retained part, checked against the ring it comes with:
        ``None``, or ``(start, blocks)`` of ``[m, 2, kv_dim]`` rows of the plane
        dtype for positions ``[start, end)`` with ``end`` at most the ring's end."""
        if retained is None:
            return None
        where = f"layer {ring.layer}: state's retained rows"
        if not isinstance(retained, (list, tuple)) or len(retained) != 2:
            raise ValueError(f"{where} must be (start, blocks) or None, got {retained!r:.80}")
        start, blocks = retained
        if isinstance(start, mx.array) and start.size == 1:
            start = start.item()
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"{where}: start must be an int >= 0, got {start!r}")
        if not isinstance(blocks, (list, tuple)) or not blocks:
            raise ValueError(f"{where}: blocks must be a non-empty list, got {blocks!r:.80}")
        if not retain:
            raise ValueError(f"{where}: a ring with retain=0 holds none, got {len(blocks)} blocks")
        rows = 0
        for b in blocks:
            if (not isinstance(b, mx.array) or b.dtype != dtype or b.ndim != 3
                    or tuple(b.shape[1:]) != (2, kv_dim) or b.shape[0] < 1):
                raise ValueError(f"{where}: each block must be {dtype} [m >= 1, 2, {kv_dim}], "
                                 f"got {getattr(b, 'dtype', type(b).__name__)} "
                                 f"{tuple(getattr(b, 'shape', ()))}")
            rows += b.shape[0]
        if start + rows > ring.end:
            raise ValueError(f"{where}: positions [{start}, {start + rows}) run past the ring's "
                             f"end {ring.end}")
        return start, list(blocks)

    def _adopt_retained(self, start: int, blocks: List[mx.array]) -> None:
        """Hold rows ``state`` carried (checked by ``check_retained``), then, on a
        full ring whose next victim they do not cover, take the copy ahead now."""
        self._retained.adopt(start, blocks)
        if self._victim_uncovered():
            mx.eval(self._take_ahead())
        else:
            mx.eval(blocks)

    def undo_point(self) -> Any:
        return super().undo_point(), self._retained.copy()

    def undo_to(self, point: Any) -> None:
        base, retained = point
        super().undo_to(base)
        self._retained = retained

    def _detached(self) -> "SlidingKVCache":
        other = super()._detached()
        other._retained = self._retained.copy()
        return other

    def bound_to(self, planes: Planes, slot: int) -> "SlidingKVCache":
        """A cache like this one (geometry, ring state, retained rows) in slot
        ``slot`` of ``planes``; the rows are the caller's to put there."""
        other = SlidingKVCache(planes, window=self._window, max_context=self.max_context,
                               layer=self.layer, slot=slot, retain=self.retain)
        other.ring.assign(self.ring)
        other._retained = self._retained.copy()
        return other

    def pending_retained(self) -> List[mx.array]:
        """The retained copies made since the last read (``RetainedRows.pending``)."""
        return self._retained.pending()

    @property
    def retain_depth(self) -> int:
        """The deepest speculative block this cache can always undo."""
        return self.retain

    @property
    def retained_nbytes(self) -> int:
        return self._retained.nbytes

    # -- trimming ----------------------------------------------------------------------

    def trimmable_depth(self) -> int:
        retained, ring = self._retained, self.ring
        held = retained.start if retained.start < retained.end and retained.end >= ring.origin_logical \
            else None
        return ring.trimmable(held)

    def undoable_block(self) -> int:
        ring = self.ring
        return ring.capacity - ring.len + self.retain

    def is_trimmable(self) -> bool:
        """Fixed for the cache's life while its list is in step, so a caller
        that asks once (mlx-lm's speculative decoding does, before its first
        token) is never misled later: a ring that keeps no overwritten rows
        (``retain=0``) and can wrap is never trimmable, even before it wraps.
        A list out of step is trimmable by no mlx-lm caller (``in_step``)."""
        return (self.retain > 0 or self.max_context <= self.ring.capacity) and self.in_step()

    def _rewind(self, plan: Trim) -> None:
        """Put back the rows the trimmed tokens overwrote (from the retained rows)
        at the rows the earlier ring holds them, then move both origins back."""
        lo, hi = plan.restore
        if hi > lo:
            keys, values = self._retained.rows(lo, hi)
            if self.layout == kernels.HEAD_MAJOR:
                shape = (hi - lo, self.kv_heads, self.head_dim)
                keys = keys.reshape(shape).transpose(1, 0, 2)
                values = values.reshape(shape).transpose(1, 0, 2)
            self.planes.place(keys, values, plan.runs, self.slot)
        self.ring.assign(plan.after)
        self._retained.truncate(plan.after.end)  # trimmed positions may be written again


REGIMES[LayerKind.SLIDING] = SlidingKVCache
