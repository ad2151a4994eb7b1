"""A cache's live rows out and in: what sessions, the KV store and restores use.

``LiveRows`` is ``MuseKVCache``'s (``base.py``) part for them: the rows read
out in logical order into fresh buffers (``snapshot``, ``live_rows``), rows put
in where the ring says a sequentially built ring holds them (``install``, or
planes a loader filled in place: ``install_planes``), and the undo of an
install that failed part-way. The ring decides every placement
(``Ring.installed``); an install replaces the cache's history, so open
checkpoints and a trim round hear of it (``replaced``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Tuple

import mlx.core as mx

from muser_kv.core.geometry import canonical_rows
from muser_kv.core.kernels import ReferenceBackend
from muser_kv.core.planes import Planes
from muser_kv.core.ring import Ring

Pair = Tuple[mx.array, mx.array]


class LiveRows(ABC):
    """A cache's rows out and in; the cache (``MuseKVCache``) provides the state
    declared here."""

    planes: Planes
    ring: Ring
    slot: int
    layer: int
    max_context: int
    growing: bool
    backend: ReferenceBackend

    @property
    @abstractmethod
    def capacity(self) -> int: ...

    @property
    @abstractmethod
    def kv_heads(self) -> int: ...

    @property
    @abstractmethod
    def head_dim(self) -> int: ...

    @property
    @abstractmethod
    def kv_dim(self) -> int: ...

    @property
    @abstractmethod
    def layout(self) -> str: ...

    @property
    @abstractmethod
    def dtype(self) -> mx.Dtype: ...

    @abstractmethod
    def replaced(self) -> None: ...

    @abstractmethod
    def settle(self) -> None: ...

    def snapshot(self) -> Tuple[int, mx.array, mx.array]:
        """``(start, keys, values)``: the live rows as ``[len, H, D]`` (plane type)
        in logical order from logical position ``start``; never rotated; fresh
        buffers (a snapshot never aliases a plane)."""
        k, v = self.backend.gather(*self.planes.physical(self.slot), self.layout, self.ring)
        shape = (self.ring.len, self.kv_heads, self.head_dim)
        return self.ring.origin_logical, k.reshape(shape), v.reshape(shape)

    def live_rows(self, start: int, stop: int) -> Pair:
        """``(keys, values)``: live rows ``[start, stop)`` as ``[stop - start, kv_dim]``
        (plane type) in logical order, in fresh buffers (never a view of a plane)."""
        ring = self.ring
        if not ring.origin_logical <= start < stop <= ring.end:
            raise ValueError(f"KV cache for layer {self.layer}: rows [{start}, {stop}) are not "
                             f"live (live [{ring.origin_logical}, {ring.end}))")
        run = Ring(ring.capacity, stop - start, start, ring.physical(start), self.layer)
        return self.backend.gather(*self.planes.physical(self.slot), self.layout, run)

    def install(self, start: int, keys: mx.array, values: mx.array) -> None:
        """Replace the contents with logical rows ``[n, H, D]`` (plane type) starting
        at ``start``, placed at rotation ``start % capacity``: exactly where a
        sequentially built ring with this origin holds them (``Ring.installed``)."""
        where = f"KV cache for layer {self.layer}"
        n = keys.shape[0] if keys.ndim else 0
        shape = (n, self.kv_heads, self.head_dim)
        for name, x in (("keys", keys), ("values", values)):
            if x.dtype != self.dtype:
                raise TypeError(f"{where}: installed {name} must be {self.dtype}, got {x.dtype}")
            if tuple(x.shape) != shape:
                raise ValueError(f"{where}: installed {name} must be {shape}, got {tuple(x.shape)}")
        ring = self.install_ring(start, n)
        flat = (n, self.kv_dim)
        one = self.install_shape(ring)
        k, v = self.backend.install(keys.reshape(flat), values.reshape(flat), self.layout, ring, one)
        self._installed(ring, k.reshape(one), v.reshape(one))

    def install_shape(self, ring: Ring) -> Tuple[int, ...]:
        """The one-slot memory shape (``memory_shape[1:]``) of the planes an
        install leaving ``ring`` builds: canonical for its rows for a growing
        sequence (``Planes.rows_for``), the preallocated size otherwise."""
        rows = canonical_rows(ring.extent, self.capacity) if self.growing else self.planes.limit
        return self.planes.memory_shape_for(rows)[1:]

    def install_ring(self, start: int, n: int) -> Ring:
        """The ring an install of ``n`` rows from ``start`` leaves (its live runs
        say where each row goes), or ``ValueError`` for one this cache cannot hold."""
        where = f"KV cache for layer {self.layer}"
        capacity = self.capacity
        if n > capacity or start < 0 or start + n > self.max_context:
            raise ValueError(f"{where}: cannot install {n} rows from position {start} "
                             f"(capacity {capacity}, max_context {self.max_context})")
        if n < capacity and start != 0:
            raise ValueError(f"{where}: a ring that is not full must start at position 0, "
                             f"got {start}")
        return Ring.installed(capacity, start, n, self.layer)

    def install_planes(self, ring: Ring, keys: mx.array, values: mx.array) -> None:
        """Adopt planes already holding ``ring``'s rows where its live runs put
        them and zeros elsewhere (``install_ring``'s ring; one slot in memory
        order, ``install_shape(ring)``): what ``install`` builds, made by a caller
        that wrote the rows straight into them (``load_session``)."""
        one = self.install_shape(ring)
        for name, x in (("keys", keys), ("values", values)):
            if x.dtype != self.dtype or tuple(x.shape) != one:
                raise ValueError(f"KV cache for layer {self.layer}: installed {name} planes must "
                                 f"be {self.dtype} {one}, got {x.dtype} {tuple(x.shape)}")
        self._installed(ring, keys, values)

    def _installed(self, ring: Ring, k: mx.array, v: mx.array) -> None:
        if self.planes.slots == 1:
            shape = (1,) + tuple(k.shape)
            self.planes.set(k.reshape(shape), v.reshape(shape))
        else:
            fresh = Planes(kv_heads=self.kv_heads, head_dim=self.head_dim, capacity=self.capacity,
                           layout=self.layout, dtype=self.dtype, allocate=False,
                           growing=self.planes.growing or self.growing)
            fresh.set(k.reshape((1,) + tuple(k.shape)), v.reshape((1,) + tuple(v.shape)))
            self.planes.reserve(ring.extent)
            self.planes.copy_slot(self.slot, fresh)
        self.ring.assign(ring)
        self.replaced()
        self.settle()

    def undo_point(self) -> Any:
        """What ``undo_to`` needs to put this cache back as it is now (the arrays
        are values: keeping them costs nothing until the planes are rewritten)."""
        return self.planes.k, self.planes.v, self.planes.rows, self.ring.copy()

    def undo_to(self, point: Any) -> None:
        """Put back what ``undo_point`` took (an install that failed part-way)."""
        self.planes.k, self.planes.v, self.planes.rows, ring = point
        self.ring.assign(ring)
        self.replaced()
