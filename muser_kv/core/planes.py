"""Planes: one layer's K and V storage for one or more sequences. It never sees
a position: callers hand it rows and physical runs (the ring decides them).

The two arrays are held in the shape attention reads, ``[S, H, R, D]`` (``S``
sequence slots): over token-major memory (a token's ``H*D`` values adjacent,
strides ``R*H*D, D, H*D, 1``: a rotation moves whole tokens) or head-major
memory (each head's rows one span). MLX keeps a donated buffer's strides
through every slice update, so the memory order never changes, and a decode
step costs what mlx-lm's caches cost: one update per plane, and no op at all to
read a whole plane of one sequence.

``R`` is the allocation, always a multiple of 256 (``geometry.ROW_GRANULE``),
the row stride MLX's CUDA attention needs for its fast path. Preallocated
planes (``growing=False``) allocate the ring's capacity
rounded up to 256 once, and rows past the capacity are zero and never read or
written. Growing planes (``growing=True``: a global layer's plane where a
server holds many short chats) allocate ``geometry.canonical_rows`` of their
live rows whenever they are written (``settle``: one bitwise copy into
zero-filled planes of the new allocation, before the write that needs it), so
they hold at most twice their live rows rounded up to 256, and what attention
is handed depends on the live rows alone, never on how the planes got there.

Every write goes through MLX's own updates (slice update, scatter), which reuse
a donatable buffer (O(rows)) and copy it otherwise; either way MLX tracks the
write, so no reader can race it. Planes are zero-filled at allocation, so a
wrapped row can never expose uninitialised storage.

A ``Planes`` object is the one holder of its arrays: the caches of every slot
(and a batch over them) write through it, so each sees the others' writes.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence, Tuple

import mlx.core as mx

from muser_kv.core import kernels
from muser_kv.core.geometry import ROW_GRANULE, allocated_rows, canonical_rows, canonical_span, compact_rows
from muser_kv.core.ring import Run

Pair = Tuple[mx.array, mx.array]


class Planes:
    """K and V of ``slots`` sequences: ``[slots, kv_heads, rows, head_dim]`` each."""

    def __init__(self, *, kv_heads: int, head_dim: int, capacity: int, layout: str,
                 dtype: mx.Dtype, slots: int = 1, allocate: bool = True, growing: bool = False,
                 rows: Optional[int] = None):
        """``rows`` is the allocation (default: the preallocated size, or one
        granule for growing planes); preallocated planes take no other."""
        if layout not in (kernels.TOKEN_MAJOR, kernels.HEAD_MAJOR):
            raise ValueError(f"layout must be token_major or head_major, got {layout!r}")
        if dtype not in kernels.PLANE_DTYPES:
            raise TypeError(f"plane dtype must be float16 or bfloat16, got {dtype}")
        if not isinstance(growing, bool):
            raise TypeError(f"growing must be a bool, got {growing!r}")
        self.kv_heads, self.head_dim, self.capacity = kv_heads, head_dim, capacity
        self.layout, self.dtype, self.slots = layout, dtype, slots
        self.growing = growing
        #: the most rows these planes ever allocate: the preallocated size
        self.limit = allocated_rows(capacity)
        self.rows = self._check_rows(
            rows if rows is not None else canonical_rows(0, capacity) if growing else self.limit)
        #: a write that leaves ``n`` rows live needs no ``settle`` when ``low < n <= high``
        self.low, self.high = self._span(self.rows)
        self.k: mx.array
        self.v: mx.array
        if allocate:
            self.set(mx.zeros(self.memory_shape, dtype), mx.zeros(self.memory_shape, dtype))
            mx.eval(self.k, self.v)

    # -- shapes ------------------------------------------------------------------

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def memory_shape(self) -> Tuple[int, ...]:
        """The arrays' memory order: ``[S, R, H*D]`` token-major, ``[S, H, R, D]`` head-major."""
        return self.memory_shape_for(self.rows)

    def memory_shape_for(self, rows: int) -> Tuple[int, ...]:
        """``memory_shape`` at an allocation of ``rows`` rows."""
        if self.layout == kernels.TOKEN_MAJOR:
            return (self.slots, rows, self.kv_dim)
        return (self.slots, self.kv_heads, rows, self.head_dim)

    @property
    def attention_shape(self) -> Tuple[int, ...]:
        return (self.slots, self.kv_heads, self.rows, self.head_dim)

    def rows_for(self, extent: int) -> int:
        """The allocation attention reads with physical rows ``[0, extent)`` live
        (``geometry.canonical_rows`` on growing planes, the preallocated size
        otherwise): what an install, a merge or an extract builds."""
        return canonical_rows(extent, self.capacity) if self.growing else self.limit

    def _span(self, rows: int) -> Tuple[int, int]:
        return canonical_span(rows, self.capacity) if self.growing else (0, self.limit)

    def _check_rows(self, rows: int) -> int:
        if (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1
                or rows % ROW_GRANULE or rows > self.limit
                or (not self.growing and rows != self.limit)):
            raise ValueError(
                f"planes of capacity {self.capacity} allocate "
                f"{'a multiple of %d rows up to ' % ROW_GRANULE if self.growing else ''}"
                f"{self.limit} rows, got {rows!r}")
        return rows

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def slot_nbytes(self) -> int:
        return self.nbytes // self.slots

    # -- the arrays ----------------------------------------------------------------

    def set(self, k: mx.array, v: mx.array) -> None:
        """Adopt planes given in memory order (``memory_shape``) or as attention
        reads them (``attention_shape``), of this dtype; any strides (a broadcast
        or strided array would give the first store a buffer in some other memory
        order, so it is made contiguous in this layout's order first). Growing
        planes take any allocation they may have (``rows`` follows it)."""
        rows = self._rows_of(k)
        if self._rows_of(v) != rows:
            raise ValueError(f"keys and values planes differ: {tuple(k.shape)} and {tuple(v.shape)}")
        self.k, self.v = self._adopt(k, rows), self._adopt(v, rows)
        self.rows = rows
        self.low, self.high = self._span(rows)

    def _rows_of(self, x: mx.array) -> int:
        shape = tuple(x.shape)
        rows = shape[1] if len(shape) == 3 else shape[2] if len(shape) == 4 else -1
        if (x.dtype != self.dtype or rows < 1
                or shape not in (self.memory_shape_for(rows),
                                 (self.slots, self.kv_heads, rows, self.head_dim))):
            raise ValueError(f"planes must be {self.dtype} {self.memory_shape} (memory order) or "
                             f"{self.attention_shape}, got {x.dtype} {shape}")
        return self._check_rows(rows)

    def _adopt(self, x: mx.array, rows: int) -> mx.array:
        token_major = self.layout == kernels.TOKEN_MAJOR
        if x.ndim == 4 and token_major:
            x = x.transpose(0, 2, 1, 3)  # to memory order, so contiguous keeps the layout
        x = mx.contiguous(x)
        if token_major:
            return x.reshape(self.slots, rows, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return x

    def reserve(self, extent: int) -> None:
        """Hold physical rows ``[0, extent)`` without giving up any row held now:
        growing planes too small for them move to ``canonical_rows(extent)``
        (``settle``); planes that hold them already are left as they are
        (preallocated planes always do, up to their capacity). For a caller that
        adds one slot's rows beside others' (an install into a batch, an
        extend); a write settles on the extent of every slot instead."""
        if extent <= self.rows:
            return
        if not self.growing:
            raise ValueError(f"preallocated planes of {self.rows} rows cannot hold {extent}")
        self.settle(extent)

    def settle(self, extent: int) -> None:
        """Make the allocation ``rows_for(extent)``, ``extent`` being the rows
        live in every slot once the coming write is done: growing planes that
        allocate other rows move to it, holding rows ``[0, extent)`` bit for bit
        (one copy per plane; rows past ``extent`` are never read).
        Called before every write, so no write is ever half done and attention
        always reads the canonical allocation. The copy is evaluated at once,
        so the old planes are released before another layer moves: a growth
        holds one layer's old planes at a time (what ``muser-kv serve
        --kv-memory`` counts), at the cost of one wait on the rare step that
        moves."""
        if extent > self.limit:
            raise ValueError(f"planes of capacity {self.capacity} hold at most {self.limit} "
                             f"rows, asked for {extent}")
        rows = self.rows_for(extent)
        if rows != self.rows:
            self._move(rows)

    def fit(self, extent: int) -> None:
        """Growing planes that allocate more than ``compact_rows(extent)`` rows move
        to that allocation, holding rows ``[0, extent)`` bit for bit (one evaluated
        copy per plane); other planes are left as they are. For a list that is
        kept rather than written (a prompt-cache entry); its next write settles
        it back on the canonical allocation."""
        rows = compact_rows(extent, self.capacity)
        if self.growing and rows < self.rows:
            self._move(rows)

    def _move(self, rows: int) -> None:
        """New planes of ``rows`` rows holding the first ``min(rows, self.rows)``
        rows of these bit for bit, zeros after; evaluated."""
        token_major = self.layout == kernels.TOKEN_MAJOR
        axis = 1 if token_major else 2  # the rows' axis in memory order
        moved = []
        for plane in (self.k, self.v):
            if token_major:  # memory order [S, R, H, D]
                plane = plane.transpose(0, 2, 1, 3)
            if rows < self.rows:
                plane = mx.contiguous(mx.split(plane, [rows], axis=axis)[0])
            else:
                pad = list(plane.shape)
                pad[axis] = rows - self.rows
                plane = mx.concatenate([plane, mx.zeros(pad, self.dtype)], axis=axis)
            moved.append(plane.reshape(self.slots, rows, self.kv_dim) if token_major else plane)
        self.set(*moved)
        mx.eval(self.k, self.v)

    def physical(self, slot: int = 0) -> Pair:
        """Slot ``slot``'s rows as the kernels index them: ``[R, H*D]`` token-major,
        ``[H, R, D]`` head-major (views of the same buffers)."""
        k, v = (self.k, self.v) if self.slots == 1 else (self.k[slot:slot + 1],
                                                         self.v[slot:slot + 1])
        return kernels.physical_view(k, self.layout), kernels.physical_view(v, self.layout)

    def handles(self) -> Pair:
        """The whole planes as new array handles (no op: a same-dtype astype
        returns the same node). The planes' own handles are rebound by the next
        store, and K/V a caller kept must not change with them."""
        return self.k.astype(self.dtype), self.v.astype(self.dtype)

    def prefix(self, n: int, slot: Optional[int] = None, slots: Optional[int] = None) -> Pair:
        """Rows ``[0, n)`` as attention reads them (views): of slot ``slot``, or of
        the first ``slots`` slots (all of them when neither is given). A whole
        one-slot plane is read with no op at all."""
        if slot is not None and self.slots > 1:
            return self.k[slot:slot + 1, :, :n, :], self.v[slot:slot + 1, :, :n, :]
        if slots is not None and slots < self.slots:
            return self.k[:slots, :, :n, :], self.v[:slots, :, :n, :]
        if n == self.rows:
            return self.handles()
        return self.k[:, :, :n, :], self.v[:, :, :n, :]

    def span(self, first: int, count: int, slot: int = 0) -> Pair:
        """Physical rows ``first .. first + count`` of slot ``slot``, as attention
        reads them (views)."""
        s = slice(None) if self.slots == 1 else slice(slot, slot + 1)
        return self.k[s, :, first:first + count, :], self.v[s, :, first:first + count, :]

    def detached(self, slot: int = 0) -> "Planes":
        """One-slot planes holding slot ``slot``'s rows, independent of these: the
        arrays are shared until either side writes (MLX arrays are values; the
        first store on either side then copies its plane once)."""
        other = copy.copy(self)
        if self.slots == 1:
            other.k, other.v = self.handles()
        else:
            other.slots = 1
            other.set(self.k[slot:slot + 1], self.v[slot:slot + 1])
        return other

    # -- writes --------------------------------------------------------------------

    def place(self, k_rows: mx.array, v_rows: mx.array, runs: Sequence[Run], slot: int = 0) -> None:
        """Write rows (in this layout: ``[n, H*D]`` token-major, ``[H, n, D]``
        head-major; ``Run.source`` indexes them) along ``runs`` of slot ``slot``."""
        index = None if self.slots == 1 else slot
        self.k = kernels.place(self.k, k_rows, runs, self.layout, index)
        self.v = kernels.place(self.v, v_rows, runs, self.layout, index)

    def put_token(self, row: int, k: mx.array, v: mx.array, slot: int, rows: int) -> Pair:
        """The decode write and read in one call: one token ``[1, H, 1, D]``
        (already of this dtype) at physical ``row`` of slot ``slot`` (one slice
        update per plane), then rows ``[0, rows)`` of that slot as ``prefix``
        reads them (a whole one-slot plane with no op). One call, because this
        runs once per layer per token."""
        if self.slots == 1:
            self.k[:, :, row:row + 1, :] = k
            self.v[:, :, row:row + 1, :] = v
            if rows == self.rows:
                return self.k.astype(self.dtype), self.v.astype(self.dtype)
            return self.k[:, :, :rows, :], self.v[:, :, :rows, :]
        self.k[slot:slot + 1, :, row:row + 1, :] = k
        self.v[slot:slot + 1, :, row:row + 1, :] = v
        return self.k[slot:slot + 1, :, :rows, :], self.v[slot:slot + 1, :, :rows, :]

    def put_rows(self, rows: Sequence[int], k: mx.array, v: mx.array,
                 slots: Optional[Sequence[int]] = None) -> None:
        """One token per slot: ``k``/``v`` ``[B, H, 1, D]`` (of this dtype) at physical
        row ``rows[i]`` of slot ``slots[i]`` (default: slot ``i``). Sequences at
        one row of the first ``B`` slots take one slice update per plane (what
        mlx-lm's batch caches cost); any others one scatter per plane, over a flat
        view of the planes' memory order, so MLX can donate the buffer and the
        layout never changes. Every layer of a step has the same rows, so the
        scatter's index is built once per step (``_flat_index``)."""
        b, s, r = k.shape[0], self.slots, self.rows
        if slots is None and len(set(rows)) == 1:
            row = rows[0]
            self.k[:b, :, row:row + 1, :] = k
            self.v[:b, :, row:row + 1, :] = v
            return
        index = _flat_index(tuple(rows), None if slots is None else tuple(slots), self.layout,
                            self.kv_heads, r)
        if self.layout == kernels.TOKEN_MAJOR:
            out = []
            for plane, new in ((self.k, k), (self.v, v)):
                flat = plane.transpose(0, 2, 1, 3).reshape(s * r, self.kv_dim)
                flat[index] = new.transpose(0, 2, 1, 3).reshape(b, self.kv_dim)
                out.append(flat.reshape(s, r, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3))
            self.k, self.v = out
            return
        out = []
        for plane, new in ((self.k, k), (self.v, v)):
            flat = plane.reshape(s * self.kv_heads * r, self.head_dim)
            flat[index] = new.reshape(b * self.kv_heads, self.head_dim)
            out.append(flat.reshape(s, self.kv_heads, r, self.head_dim))
        self.k, self.v = out

    def clear_slot(self, slot: int) -> None:
        """Zero every row of slot ``slot`` (one sequence's rows)."""
        zeros = mx.zeros((1,) + self.memory_shape[1:], self.dtype)
        if self.slots == 1:
            self.set(zeros, zeros)  # (a whole-array update would adopt the update's strides)
            return
        if self.layout == kernels.TOKEN_MAJOR:
            zeros = zeros.reshape(1, self.rows, self.kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        self.k[slot:slot + 1] = zeros
        self.v[slot:slot + 1] = zeros

    def copy_slot(self, dst: int, src: "Planes", src_slot: int = 0) -> None:
        """Copy the whole of ``src``'s slot ``src_slot`` into slot ``dst`` (planes of
        one geometry): one sequence's rows, one slice update per plane. Planes of
        another allocation (growing planes) give their first ``rows`` rows, padded
        with zeros to this allocation; the caller has reserved room for every
        live row. A copy within these planes is made separately first, so the
        update can still reuse this buffer (an update whose source is a view of
        its own target would make MLX copy the whole planes)."""
        if (src.layout, src.dtype, src.kv_heads, src.head_dim) != (
                self.layout, self.dtype, self.kv_heads, self.head_dim):
            raise ValueError("copy_slot needs planes of one geometry, layout and dtype")
        k, v = src.k[src_slot:src_slot + 1], src.v[src_slot:src_slot + 1]
        if src.rows > self.rows:
            k, v = k[:, :, :self.rows, :], v[:, :, :self.rows, :]
        elif src.rows < self.rows:
            pad = mx.zeros((1, self.kv_heads, self.rows - src.rows, self.head_dim), self.dtype)
            k, v = mx.concatenate([k, pad], axis=2), mx.concatenate([v, pad], axis=2)
        if self.slots == 1:
            # MLX answers an update covering the whole array with the update
            # itself, strides and all: adopt it in this layout's memory order
            self.set(k, v)
            return
        k, v = mx.contiguous(k), mx.contiguous(v)
        if src is self:
            mx.eval(k, v)
        self.k[dst:dst + 1] = k
        self.v[dst:dst + 1] = v


_INDEX: dict = {}


def _flat_index(rows: Tuple[int, ...], slots: Optional[Tuple[int, ...]], layout: str,
                kv_heads: int, allocated: int) -> mx.array:
    """The flat row index ``put_rows`` scatters to (memoised: every layer of a
    decode step writes the same rows, so each step builds it once). Computed on
    the host from the integers it is given, so building it evaluates nothing
    and a decode step's graph is built without waiting for the device."""
    key = (rows, slots, layout, kv_heads, allocated)
    index = _INDEX.get(key)
    if index is None:
        if len(_INDEX) > 64:
            _INDEX.clear()
        slot = range(len(rows)) if slots is None else slots
        if layout == kernels.TOKEN_MAJOR:
            flat = [s * allocated + at for s, at in zip(slot, rows)]
        else:
            flat = [(s * kv_heads + h) * allocated + at for s, at in zip(slot, rows)
                    for h in range(kv_heads)]
        index = mx.array(flat, dtype=mx.int32)
        _INDEX[key] = index
    return index

