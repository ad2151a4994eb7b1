"""KvPlane: one layer's two planes (f16, or bf16 for a bf16 model), its ring,
and its layout.

Invariants, each with a test:

* Planes are zero-filled at allocation (a wrapped row can never expose
  uninitialised storage). The ring holds exactly the footprint formula's rows;
  the allocation rounds them up to a multiple of 256 (``geometry.ROW_GRANULE``),
  the row stride MLX's CUDA attention needs for its fast path, and the rows past
  the ring's capacity are never read or written.
* Every write is validated in full (shape, dtype, batch, continuity, context
  limit) before any array changes, and the ring is committed only after the
  rows are placed: a refused write leaves planes and origins as they were.
* Snapshots leave in logical order; installs put rows back at rotation
  ``origin_logical % capacity``, where sequential appends would have left them,
  because attention sums rows in physical order and the rotation is part of the
  numbers (seeds Ch 15.6).
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx

from . import kernels
from .geometry import LayerKind, allocated_rows
from .ring import Ring


class ContextOverflow(ValueError):
    """A write past the cache's ``max_context``. The cache never shifts on its
    own; deciding what to keep is the context policy's job."""

    def __init__(self, layer: int, end: int, max_context: int):
        self.layer = layer
        self.end = end
        self.max_context = max_context
        super().__init__(
            f"KV cache for layer {layer}: writing up to position {end} exceeds "
            f"max_context {max_context}"
        )


class KvPlane:
    """Two planes of one type (``dtype``: f16 or bf16) plus a ``Ring``.

    Sliding layers are token-major ``[rows, kv_heads * head_dim]`` with a ring of
    ``capacity = min(max_context, window)`` (a rotation moves whole tokens);
    global layers are head-major ``[kv_heads, rows, head_dim]`` with
    ``capacity = max_context`` (each head's history is one span); ``rows`` is the
    capacity rounded up to a multiple of 256. A sliding ring
    may be built head-major instead (``sliding_layout``), for attention kernels
    that read head-major spans faster; the ring arithmetic does not change.

    Each plane is held in the shape attention reads, ``[1, H, rows, D]``;
    a token-major plane is that shape over token-major memory (strides
    ``R*H*D, D, H*D, 1``). MLX keeps a donated buffer's strides through every
    slice update, so the memory order never changes, and a decode step costs
    what mlx-lm's caches cost: one slice update per plane, and no op at all to
    read a full ring. ``keys`` / ``values`` are the rows the kernels index.
    """

    def __init__(
        self,
        kind: LayerKind,
        *,
        kv_heads: int,
        head_dim: int,
        window: int,
        max_context: int,
        layer: int = 0,
        sliding_layout: str = kernels.TOKEN_MAJOR,
        allocate: bool = True,
        dtype: mx.Dtype = kernels.PLANE_DTYPE,
    ):
        if dtype not in kernels.PLANE_DTYPES:
            raise TypeError(f"plane dtype must be float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.kind = LayerKind(kind)
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.window = window
        self.max_context = max_context
        self.layer = layer
        if sliding_layout not in (kernels.TOKEN_MAJOR, kernels.HEAD_MAJOR):
            raise ValueError(f"sliding_layout must be token_major or head_major, got {sliding_layout!r}")
        if self.kind is LayerKind.SLIDING:
            capacity = min(max_context, window)
            self.layout = sliding_layout
        else:
            capacity = max_context
            self.layout = kernels.HEAD_MAJOR
        self.rows = allocated_rows(capacity)
        if self.layout == kernels.TOKEN_MAJOR:
            shape: Tuple[int, ...] = (self.rows, kv_heads * head_dim)
        else:
            shape = (kv_heads, self.rows, head_dim)
        self.shape = shape
        self.ring = Ring(capacity, layer=layer)
        self.backend = kernels.get_backend()
        if allocate:  # (False only for a caller that sets keys/values itself)
            self.keys = mx.zeros(shape, dtype=dtype)
            self.values = mx.zeros(shape, dtype=dtype)
            mx.eval(self._k, self._v)

    # -- the planes ------------------------------------------------------------

    @property
    def keys(self) -> mx.array:
        """The key plane as rows: ``[rows, H*D]`` token-major, ``[H, rows, D]``
        head-major, the whole allocation (a view; holding it keeps MLX from
        donating the plane)."""
        return kernels.physical_view(self._k, self.layout)

    @keys.setter
    def keys(self, plane: mx.array) -> None:
        self._k = self._attention(plane)

    @property
    def values(self) -> mx.array:
        """The value plane, as ``keys``."""
        return kernels.physical_view(self._v, self.layout)

    @values.setter
    def values(self, plane: mx.array) -> None:
        self._v = self._attention(plane)

    def _attention(self, plane: mx.array) -> mx.array:
        if tuple(plane.shape) != self.shape or plane.dtype != self.dtype:
            raise ValueError(f"layer {self.layer}: plane must be {self.dtype} {self.shape}, "
                             f"got {plane.dtype} {tuple(plane.shape)}")
        # contiguous first: a broadcast or strided plane would give the first
        # store a buffer in some other memory order, kept from then on
        return kernels.attention_view(mx.contiguous(plane), self.layout, self.kv_heads, self.head_dim)

    def _handles(self) -> Tuple[mx.array, mx.array]:
        """The whole planes as new array handles (no op: a same-dtype astype
        returns the same node). The planes' own handles are rebound by the next
        store, and K/V a caller kept must not change with them."""
        return self._k.astype(self.dtype), self._v.astype(self.dtype)

    # -- facts ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.ring.capacity

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    @property
    def contiguous(self) -> bool:
        """True when the live rows are one physical span from row 0 (logical order)
        or the whole ring (rotated): attention can read the plane in place."""
        ring = self.ring
        return ring.origin_physical == 0 or ring.len == ring.capacity

    # -- validation ----------------------------------------------------------

    def check_input(self, keys: mx.array, values: mx.array) -> int:
        """Validate model-shaped ``[1, kv_heads, N, head_dim]`` K/V; return N."""
        where = f"KV cache for layer {self.layer}"
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, mx.array):
                raise TypeError(f"{where}: {name} must be an mx.array, got {type(x).__name__}")
            if x.dtype not in kernels.INPUT_DTYPES:
                raise TypeError(
                    f"{where}: {name} dtype must be float32, float16 or bfloat16, got {x.dtype}"
                )
            if x.ndim != 4:
                raise ValueError(
                    f"{where}: {name} must be [batch, kv_heads, tokens, head_dim], "
                    f"got shape {tuple(x.shape)}"
                )
            b, h, n, d = x.shape
            if b != 1:
                raise ValueError(f"{where}: batch size must be 1, got {b}")
            if h != self.kv_heads:
                raise ValueError(f"{where}: expected {self.kv_heads} KV heads, got {h}")
            if d != self.head_dim:
                raise ValueError(f"{where}: expected head_dim {self.head_dim}, got {d}")
            if n < 1:
                raise ValueError(f"{where}: expected at least one token, got {n}")
        if tuple(keys.shape) != tuple(values.shape) or keys.dtype != values.dtype:
            raise ValueError(
                f"{where}: keys {keys.dtype} {tuple(keys.shape)} and values "
                f"{values.dtype} {tuple(values.shape)} differ"
            )
        return keys.shape[2]

    def check_write(self, position: int, count: int) -> None:
        self.ring.check(position)
        if position + count > self.max_context:
            raise ContextOverflow(self.layer, position + count, self.max_context)

    # -- the write path ------------------------------------------------------

    def write(self, position: int, keys: mx.array, values: mx.array) -> None:
        """Store a chunk of K/V (any width, across the wrap) at ``position``."""
        n = self.check_input(keys, values)
        self.check_write(position, n)
        self.write_checked(position, keys, values, n)

    def write_checked(self, position: int, keys: mx.array, values: mx.array, n: int) -> None:
        """``write`` for input the caller has validated (``check_input``,
        ``check_write``): rows placed first, the ring committed last."""
        ring = self.ring.copy()
        first, count = ring.append_batch(position, n)
        k_rows, v_rows = self.backend.store(keys, values, self.layout, first, count, ring, position,
                                            self.dtype)
        self._place(k_rows, v_rows, ring.runs(position + first, count))
        self.ring = ring

    def write_one(self, keys: mx.array, values: mx.array,
                  dtype: Optional[mx.Dtype] = None) -> Tuple[mx.array, mx.array]:
        """The decode hot path: one token, already validated by the caller
        (``[1, H, 1, D]``, a float dtype, room below ``max_context``, the plane
        full or filled from row 0). The same placement as ``write`` -- one slice
        update per plane at the row the ring reserves -- with the ring advanced
        in place once the rows are placed; returns ``view()``. ``dtype`` is the
        input's, when the caller has it at hand."""
        ring = self.ring
        full = ring.len == ring.capacity
        row = ring.origin_physical if full else (ring.origin_physical + ring.len) % ring.capacity
        if (dtype or keys.dtype) != self.dtype:
            shape = keys.shape
            k, v = self.backend.store(keys, values, self.layout, 0, 1, ring, ring.end, self.dtype)
            keys, values = k.reshape(shape), v.reshape(shape)
        # the model's [1, H, 1, D] is the plane's own shape: nothing to reshape
        self._k[:, :, row:row + 1, :] = keys
        self._v[:, :, row:row + 1, :] = values
        if full:  # the ring's append, settled by the caller's checks
            ring.origin_logical += 1
            ring.origin_physical = (ring.origin_physical + 1) % ring.capacity
        else:
            ring.len += 1
        return self._live()

    def copy_rows(self, logical: int, count: int) -> mx.array:
        """Fresh copies ``[count, 2, H*D]`` (K, V) of live rows ``logical ..
        logical+count`` (never a view: a view would share the plane's buffer and
        keep MLX from donating it to the next store)."""
        first = self.ring.physical(logical)
        if first + count <= self.capacity:  # one span (the decode case): the stack is the copy
            k = self._k[:, :, first:first + count, :].transpose(0, 2, 1, 3)
            v = self._v[:, :, first:first + count, :].transpose(0, 2, 1, 3)
            return mx.stack([k, v], axis=2).reshape(count, 2, self.kv_dim)
        ring = Ring(self.capacity, count, logical, first, self.layer)
        k, v = self.backend.gather(self.keys, self.values, self.layout, ring)
        return mx.stack([k, v], axis=1)

    def _place(self, k_rows: mx.array, v_rows: mx.array, runs) -> None:
        """The one placement mechanism (see ``kernels.place``)."""
        self._k = kernels.place(self._k, k_rows, runs, self.layout)
        self._v = kernels.place(self._v, v_rows, runs, self.layout)

    # -- the read path -------------------------------------------------------

    def view(self) -> Tuple[mx.array, mx.array]:
        """K/V ``[1, H, len, D]`` read in place, in physical order (``contiguous``
        must hold: a wrapped full ring reads rotated, which is exact)."""
        if not self.contiguous:
            raise RuntimeError(
                f"KV cache for layer {self.layer}: live rows are split in the plane "
                f"(origin_physical {self.ring.origin_physical}, len {self.ring.len}); "
                "read them through a staging shadow"
            )
        return self._live()

    def _live(self) -> Tuple[mx.array, mx.array]:
        """``view`` without the check (the caller knows the rows are one span)."""
        ring = self.ring
        if ring.len == self.rows:
            return self._handles()  # a full, unpadded ring is read as it lies: no op
        return self._k[:, :, :ring.len, :], self._v[:, :, :ring.len, :]

    def shadow_rows(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """The staging shadow for a chunk, as token-major rows ``[len + N, H*D]``:
        the live rows in logical order, then the chunk's rows. Attention reads it
        before the chunk is committed, so a chunk that wraps never overwrites rows
        its own queries need. The caller has validated the input (``check_input``)."""
        if self.kind is not LayerKind.SLIDING:
            raise RuntimeError(f"layer {self.layer}: only sliding rings are staged")
        return self.backend.stage(self.keys, self.values, self.ring, keys, values, self.layout)

    def shadow_view(self, rows: mx.array) -> mx.array:
        """Token-major shadow rows as the ``[1, H, L, D]`` view attention reads."""
        return kernels.attention_view(rows, kernels.TOKEN_MAJOR, self.kv_heads, self.head_dim)

    def restore(self, ring: Ring, logical: int, keys: mx.array, values: mx.array) -> None:
        """Adopt ``ring`` (an earlier state of this plane's ring), putting back the
        token-major rows ``[m, H*D]`` it holds for positions ``logical .. logical+m``
        at the rows its translation gives them (speculative rollback)."""
        if ring.capacity != self.capacity:
            raise ValueError(f"layer {self.layer}: ring capacity {ring.capacity} != {self.capacity}")
        m = keys.shape[0]
        if m:
            if self.kind is not LayerKind.SLIDING:
                raise RuntimeError(f"layer {self.layer}: a growing plane restores no rows")
            if self.layout == kernels.HEAD_MAJOR:
                shape = (m, self.kv_heads, self.head_dim)
                keys = keys.reshape(shape).transpose(1, 0, 2)
                values = values.reshape(shape).transpose(1, 0, 2)
            self._place(keys, values, ring.runs(logical, m))
        self.ring = ring

    # -- snapshots -----------------------------------------------------------

    def snapshot(self) -> Tuple[int, mx.array, mx.array]:
        """``(start, keys, values)``: the live rows as ``[len, H, D]`` (plane type)
        in logical order from logical position ``start``; never rotated."""
        k, v = self.backend.gather(self.keys, self.values, self.layout, self.ring)
        shape = (self.ring.len, self.kv_heads, self.head_dim)
        return self.ring.origin_logical, k.reshape(shape), v.reshape(shape)

    def install(self, start: int, keys: mx.array, values: mx.array) -> None:
        """Replace the contents with logical rows ``[n, H, D]`` (plane type) starting at
        ``start``, placed at rotation ``start % capacity``: exactly where a
        sequentially built ring with this origin holds them."""
        where = f"KV cache for layer {self.layer}"
        shape = (keys.shape[0], self.kv_heads, self.head_dim)
        for name, x in (("keys", keys), ("values", values)):
            if x.dtype != self.dtype:
                raise TypeError(f"{where}: installed {name} must be {self.dtype}, got {x.dtype}")
            if tuple(x.shape) != shape:
                raise ValueError(f"{where}: installed {name} must be {shape}, got {tuple(x.shape)}")
        n = shape[0]
        if n > self.capacity or start < 0 or start + n > self.max_context:
            raise ValueError(
                f"{where}: cannot install {n} rows from position {start} "
                f"(capacity {self.capacity}, max_context {self.max_context})"
            )
        if n < self.capacity and start != 0:
            raise ValueError(
                f"{where}: a ring that is not full must start at position 0, got {start}"
            )
        ring = Ring(self.capacity, n, start, start % self.capacity, self.layer)
        flat = (n, self.kv_dim)
        k, v = self.backend.install(keys.reshape(flat), values.reshape(flat), self.layout, ring,
                                    self.shape)
        self.keys, self.values, self.ring = k, v, ring
