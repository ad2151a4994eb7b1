"""A cache's state as mlx-lm saves it (``cache.state`` / ``meta_state``, a
prompt-cache file's arrays and strings), read back and checked before any
cache exists: the planes are meaningless without their ring, and a retained
row at the wrong position would make a later trim silently wrong.
``MuseKVCache.from_state`` builds the cache from what this returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx

from muser_kv.core import kernels
from muser_kv.core.geometry import ROW_GRANULE, LayerKind
from muser_kv.core.kernels import PLANE_DTYPE, PLANE_DTYPES
from muser_kv.core.planes import Planes
from muser_kv.core.ring import Ring


@dataclass(frozen=True)
class SavedState:
    """One layer's saved state, checked: its planes (not yet holding the saved
    arrays: ``planes_of``), ring and retained rows (unchecked here: each regime
    checks its own), and the cache's parameters."""

    kind: LayerKind
    layer: int
    window: int
    max_context: int
    retain: int
    ring: Ring
    planes: Planes
    dtype: mx.Dtype
    kv_dim: int
    retained: Any
    keys: mx.array
    values: mx.array


def read_state(state: Any, meta_state: Optional[Sequence[str]] = None) -> SavedState:
    """``state`` in mlx-lm's one-argument form (the four parts ``state`` gives,
    as tuples or, read back from a file, lists), or ``(keys, values)`` and
    ``meta_state``; ``ValueError`` naming what is wrong."""
    parts = list(state) if isinstance(state, (list, tuple)) else None
    if meta_state is None:
        if parts is None or len(parts) != 4:
            raise ValueError(
                "MuseKVCache.from_state needs the 4-part state (keys, values, meta_state, "
                "retained) that .state gives, or (keys, values) and the 12-field meta_state; "
                f"got {type(state).__name__} of {len(parts) if parts else 0} parts")
        meta_state, retained = parts[2], parts[3]
    elif parts is None or len(parts) not in (2, 4):
        raise ValueError("MuseKVCache.from_state: state must be (keys, values[, meta_state, "
                         f"retained]), got {type(state).__name__}")
    else:
        retained = parts[3] if len(parts) == 4 else None
    meta = list(meta_state) if isinstance(meta_state, (list, tuple)) else None
    if meta is None or len(meta) != 12 or not all(isinstance(x, str) for x in meta):
        raise ValueError(
            f"MuseKVCache.from_state needs the 12-field meta_state, got {meta_state!r}")
    try:
        kind, layout = LayerKind(meta[0]), meta[1]
        layer, heads, dim, window, max_context, capacity, length, ol, op, retain = map(
            int, meta[2:])
    except ValueError as e:
        raise ValueError(f"MuseKVCache.from_state: bad meta_state {meta!r} ({e})") from None
    keys, values = parts[0], parts[1]
    expected = min(max_context, window) if kind is LayerKind.SLIDING else max_context
    if capacity != expected:
        raise ValueError(f"layer {layer}: meta capacity {capacity} != plane {expected}")
    ring = Ring(capacity, length, ol, op, layer)
    dtype = keys.dtype if keys.dtype in PLANE_DTYPES else PLANE_DTYPE
    planes = Planes(kv_heads=heads, head_dim=dim, capacity=capacity, layout=layout,
                    dtype=dtype, allocate=False)
    # a global plane saved while it was growing holds fewer rows than the
    # preallocated size: it is restored growing, at that allocation
    rows = keys.shape[1] if layout == kernels.HEAD_MAJOR and keys.ndim == 3 else planes.rows
    if (kind is LayerKind.GLOBAL and ring.extent <= rows < planes.rows
            and rows % ROW_GRANULE == 0):
        planes = Planes(kv_heads=heads, head_dim=dim, capacity=capacity, layout=layout,
                        dtype=dtype, allocate=False, growing=True, rows=rows)
    physical = planes.memory_shape[1:]
    for name, x in (("keys", keys), ("values", values)):
        if (x.dtype not in PLANE_DTYPES or x.dtype != keys.dtype
                or tuple(x.shape) != physical):
            raise ValueError(
                f"layer {layer}: state {name} must be float16 or bfloat16 {physical} "
                f"(keys and values alike), got {x.dtype} {tuple(x.shape)}")
    return SavedState(kind, layer, window, max_context, retain, ring, planes, keys.dtype,
                      heads * dim, retained, keys, values)


def planes_of(saved: SavedState) -> Planes:
    """The saved planes, adopted (a cache is built over them only once every
    part, the retained rows too, has been checked)."""
    planes = saved.planes
    planes.set(saved.keys.reshape(planes.memory_shape), saved.values.reshape(planes.memory_shape))
    return planes
