"""GlobalKVCache: a global (NoPE) layer's growing plane.

Little more than an offset and a slice assignment, as mlx-lm's ``KVCache``:
position ``p`` lives at row ``p`` (the ring of ``max_context`` rows never wraps
inside its bounds), a write is one slice update per plane, the read is rows
``[0, offset)``, and a trim rewinds the offset (the rows past it are never read
again, and a later write overwrites them).

The allocation is the planes' business (``Planes``): preallocated to
``max_context`` rows (rounded up to 256), or growing, settled before each
write on ``geometry.canonical_rows`` of the rows live after it (doubling from
256 rows as decode goes on: one bitwise copy per doubling; after a trim or a
``fit`` the next write moves back to it). A read returns rows ``[0, offset)``
of that allocation, so a list hands attention the same views however it came
to its offset; the decode path pays two comparisons for it.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

import mlx.core as mx

from muser_kv.caches.base import INPUT_DTYPE_SET, REGIMES, Mask, MuseKVCache
from muser_kv.caches.masks import causal_mask
from muser_kv.core.geometry import LayerKind
from muser_kv.core.planes import Planes
from muser_kv.core.ring import Ring, Trim


class GlobalKVCache(MuseKVCache):
    """A head-major plane of ``max_context`` rows: preallocated (rounded up to
    256) or growing (``Planes.growing``)."""

    kind = LayerKind.GLOBAL

    def __init__(self, planes: Planes, *, window: int, max_context: int, layer: int = 0,
                 slot: int = 0):
        super().__init__(planes, capacity=max_context, window=window, max_context=max_context,
                         layer=layer, slot=slot)
        self.retain = 0

    @classmethod
    def build(cls, planes: Planes, *, window: int, max_context: int, layer: int,
              retain: int) -> "GlobalKVCache":
        return cls(planes, window=window, max_context=max_context, layer=layer)

    @classmethod
    def _check_state_retained(cls, retained: Any, ring: Ring, dtype: Any, kv_dim: int,
                              retain: int) -> None:
        if retained is not None or retain:
            raise ValueError(f"layer {ring.layer}: a global plane retains no rows, got retain "
                             f"{retain} and retained {type(retained).__name__}")
        return None

    def _adopt_retained(self, start: int, blocks: List[mx.array]) -> None:
        raise ValueError(f"layer {self.layer}: a global plane retains no rows")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """One token of the model's shape (the decode hot path) takes the fewest
        calls: ``Ring.step`` checks the list and the limit and reserves the row,
        the planes settle only when the live rows leave their allocation's
        band, ``Planes.put_token`` writes the row and reads the prefix back.
        Every other write takes the checked path."""
        ring = self.ring
        if keys.shape == self._one_token and values.shape == self._one_token:
            dtype = keys.dtype
            if dtype == values.dtype and dtype in INPUT_DTYPE_SET:
                row = ring.step(self._prev, self._lead, self.max_context)
                if row >= 0:
                    planes = self.planes
                    if dtype != planes.dtype:
                        keys, values = self._plane_rows(keys, values)
                    live = ring.len  # the ring's extent (it never wraps)
                    if not planes.low < live <= planes.high:
                        planes.settle(live)
                    kv = planes.put_token(row, keys, values, self.slot, live)
                    self._fetched = weakref.ref(kv[0])
                    return kv
        n = self.check_input(keys, values)
        self.check_write(n)
        plan = ring.write(ring.end, n)
        self.planes.settle(plan.after.extent)
        self.store(keys, values, plan)
        ring.assign(plan.after)
        kv = self.planes.prefix(ring.len, self.slot)
        self._fetched = weakref.ref(kv[0])
        return kv

    def bound_to(self, planes: Planes, slot: int) -> "GlobalKVCache":
        """A cache like this one (geometry, ring state, growth) in slot ``slot``
        of ``planes``; the rows are the caller's to put there."""
        other = GlobalKVCache(planes, window=self._window, max_context=self.max_context,
                              layer=self.layer, slot=slot)
        other.ring.assign(self.ring)
        other.growing = self.growing
        return other

    def _mask(self, n: int, window_size: Optional[int], return_array: bool) -> Mask:
        offset = self.ring.len
        if window_size is not None:
            return causal_mask(n, offset, window_size)
        if return_array:
            return causal_mask(n, offset)
        return None if n == 1 else "causal"

    # -- trimming ----------------------------------------------------------------------

    def trimmable_depth(self) -> int:
        return self.ring.len

    def undoable_block(self) -> int:
        return self.max_context

    @property
    def retain_depth(self) -> int:
        return self.max_context

    @property
    def retained_nbytes(self) -> int:
        return 0

    def is_trimmable(self) -> bool:
        return self.in_step()

    def _rewind(self, plan: Trim) -> None:
        self.ring.assign(plan.after)


REGIMES[LayerKind.GLOBAL] = GlobalKVCache
