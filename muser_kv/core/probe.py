"""What a model's own code says about its caches, read off the model itself.

A layer plan is never taken from a hand-kept table or guessed from a config:

* **which layers have a cache, of which kind and window**: the model's own
  ``make_cache()`` (the class's method, never an ``install``-ed one), the list
  mlx-lm would run it with. A ``RotatingKVCache(max_size=W)`` is a sliding
  layer of window W, a ``KVCache`` a global one; a model class without
  ``make_cache`` gets a ``KVCache`` per layer from mlx-lm. Any other cache
  (chunked attention, recurrent state, quantized K/V) is named, and refused by
  the caller. mlx-lm's caches allocate nothing until written, so asking costs
  no memory.
* **each cache's K/V heads, head_dim and dtype**: the shapes of the keys and
  values the model hands each cache in a lazy forward of one token, recorded
  and passed through, never evaluated (no kernel runs: host time only).
* **how the forward uses each cache beyond that**: the window of every mask it
  asks the cache for (a model may mask a sliding layer to another span than
  its own ring holds), and whether another layer reads the cache's rows
  (``keys_and_values()``: KV sharing inside the model's forward).

The classes are named, not imported: core imports no mlx-lm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import mlx.core as mx

#: The module of mlx-lm's cache classes.
MLX_LM_CACHES = "mlx_lm.models.cache"


@dataclass(frozen=True)
class OwnCache:
    """One entry of the model's own ``make_cache()`` list."""

    #: ``"sliding"``, ``"global"``, or the qualified name of another cache class
    kind: str
    #: a ``RotatingKVCache``'s ``max_size``, as the model gave it (checked by the caller)
    window: Any = None
    #: rows a ``RotatingKVCache`` never evicts (attention-sink tokens)
    keep: Any = 0


def own_caches(model: Any) -> Optional[Tuple[OwnCache, ...]]:
    """The model's own cache list, entry by entry (see the module doc); ``None``
    for a model with neither ``make_cache`` nor a layer list."""
    own = getattr(type(model), "make_cache", None)
    if own is None:
        layers = getattr(model, "layers", None)
        return None if layers is None else (OwnCache("global"),) * len(layers)
    plan: List[OwnCache] = []
    for c in own(model):
        cls = type(c)
        name = cls.__name__ if cls.__module__ == MLX_LM_CACHES else None
        if name == "RotatingKVCache":
            plan.append(OwnCache("sliding", c.max_size, getattr(c, "keep", 0) or 0))
        elif name == "KVCache":
            plan.append(OwnCache("global"))
        else:
            plan.append(OwnCache(f"{cls.__module__}.{cls.__qualname__}"))
    return tuple(plan)


@dataclass(frozen=True)
class HandedKV:
    """The keys and values one cache is handed in a forward."""

    keys: Tuple[int, ...]
    values: Tuple[int, ...]
    dtype: Any


@dataclass(frozen=True)
class CacheUse:
    """What a model's forward did with one cache."""

    #: the keys and values it was handed; ``None``: none
    handed: Optional[HandedKV]
    #: the ``window_size`` of every ``make_mask`` it was asked for, in order
    mask_windows: Tuple[Optional[int], ...]
    #: ``keys_and_values()`` calls: another layer reading the rows it holds
    read_elsewhere: int


class _Recorder:
    """Stands in for one cache in a lazy forward: records what it is handed and
    hands it back (attention then runs, lazily, over exactly that)."""

    offset = 0

    def __init__(self) -> None:
        self.handed: Optional[HandedKV] = None
        self.last: Optional[Tuple[mx.array, mx.array]] = None
        self.mask_windows: List[Optional[int]] = []
        self.read_elsewhere = 0

    def make_mask(self, N: int, window_size: Optional[int] = None, **kwargs: Any) -> None:
        self.mask_windows.append(window_size)
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        if self.handed is None:
            self.handed = HandedKV(tuple(keys.shape), tuple(values.shape), keys.dtype)
        self.last = (keys, values)
        return keys, values

    def keys_and_values(self) -> Tuple[mx.array, mx.array]:
        if self.last is None:
            raise RuntimeError("keys_and_values() on a cache that was handed nothing")
        self.read_elsewhere += 1
        return self.last


def cache_uses(model: Any, count: int) -> List[CacheUse]:
    """What a lazy one-token forward does with each of ``count`` caches. An
    error of the forward itself (a kernel this device lacks, say) propagates."""
    recorders = [_Recorder() for _ in range(count)]
    model(mx.array([[0]], dtype=mx.int32), cache=recorders)
    return [CacheUse(r.handed, tuple(r.mask_windows), r.read_elsewhere) for r in recorders]
