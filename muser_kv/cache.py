"""Per-layer caches with mlx-lm's cache protocol, and ``make_prompt_cache``.

A Muse model asks each layer type's first cache for ``make_mask(N, window_size)``
before any layer runs, then every layer calls ``update_and_fetch``. So the mask
must describe exactly the rows ``update_and_fetch`` will return, decided from
the same ring state:

* global (NoPE) layer: rows ``[0, len + N)`` in order -> causal, offset ``len``;
* sliding layer, chunk that fits without overwriting: rows ``[0, len + N)`` read
  in place -> causal;
* sliding layer, one token on a full ring: the whole ring, rotated; every row is
  inside the window -> no mask;
* sliding layer, any other chunk (one that wraps, or is wider than the ring):
  the staging shadow, ``len`` old rows in logical order + the chunk ->
  causal with the window, offset ``len``. The chunk is committed only after the
  shadow is taken (attend before overwrite).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import mlx.core as mx

from .geometry import LayerKind, MuseGeometry
from .plane import KvPlane
from .ring import Ring

Mask = Union[None, str, mx.array]


def causal_mask(n: int, offset: int, window: Optional[int] = None) -> mx.array:
    """``[n, offset + n]`` bool: query ``offset + i`` sees key ``j`` iff
    ``j <= offset + i`` (and ``offset + i - j < window``). mlx-lm's semantics."""
    keys = mx.arange(offset + n)[None]
    queries = mx.arange(offset, offset + n)[:, None]
    mask = queries >= keys
    if window is not None:
        mask = mask & (queries < keys + window)
    return mask


class MuseKVCache:
    """One layer's cache: a ``KvPlane`` behind mlx-lm's cache protocol.

    Batch size 1 only. ``offset`` is the logical position of the next token and
    is read-only: only ``update_and_fetch``, ``trim`` and a snapshot install move it.
    """

    def __init__(self, plane: KvPlane):
        self.plane = plane

    # -- identity ------------------------------------------------------------

    @property
    def kind(self) -> LayerKind:
        return self.plane.kind

    @property
    def layer(self) -> int:
        return self.plane.layer

    @property
    def ring(self) -> Ring:
        return self.plane.ring

    @property
    def offset(self) -> int:
        return self.plane.ring.end

    @property
    def window(self) -> Optional[int]:
        return self.plane.window if self.kind is LayerKind.SLIDING else None

    def __repr__(self) -> str:
        r = self.ring
        return (
            f"MuseKVCache(layer={self.layer}, kind={self.kind.value}, capacity={r.capacity}, "
            f"len={r.len}, origin_logical={r.origin_logical}, origin_physical={r.origin_physical})"
        )

    # -- the protocol mlx-lm's models call -----------------------------------

    def _reads_in_place(self, n: int) -> bool:
        """True when this chunk is attended straight from the plane after it is
        stored; False when it needs the staging shadow."""
        if self.kind is LayerKind.GLOBAL:
            return True
        ring = self.ring
        if n == 1 and ring.len == ring.capacity:
            return True
        return ring.origin_physical == 0 and ring.len + n <= ring.capacity

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        plane = self.plane
        n = plane.check_input(keys, values)
        plane.check_write(self.offset, n)
        if self._reads_in_place(n):
            plane.write(self.offset, keys, values)
            return plane.view()
        shadow = plane.shadow(keys, values)
        plane.write(self.offset, keys, values)
        return shadow

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ) -> Mask:
        """The mask for the rows the next ``update_and_fetch(N tokens)`` returns."""
        if N < 1:
            raise ValueError(f"make_mask needs N >= 1, got {N}")
        offset = self.ring.len
        if self.kind is LayerKind.GLOBAL:
            if window_size is not None:
                return causal_mask(N, offset, window_size)
            if return_array:
                return causal_mask(N, offset)
            return None if N == 1 else "causal"
        if window_size is not None and window_size != self.plane.window:
            raise ValueError(
                f"layer {self.layer}: sliding cache built for window {self.plane.window}, "
                f"asked for a mask with window {window_size}"
            )
        if not self._reads_in_place(N):
            return causal_mask(N, offset, self.plane.window)
        if N == 1:
            # One token: every returned row (at most the whole ring) is visible.
            rows = min(offset + 1, self.ring.capacity)
            return mx.ones((1, rows), dtype=mx.bool_) if return_array else None
        return causal_mask(N, offset) if return_array else "causal"

    # -- state ---------------------------------------------------------------

    @property
    def state(self) -> Tuple[mx.array, mx.array]:
        """The live planes, physical (rotated) layout: what ``meta_state`` describes."""
        return self.plane.keys, self.plane.values

    @property
    def meta_state(self) -> Tuple[str, ...]:
        p, r = self.plane, self.ring
        return tuple(
            str(x)
            for x in (
                p.kind.value, p.layer, p.kv_heads, p.head_dim, p.window, p.max_context,
                r.capacity, r.len, r.origin_logical, r.origin_physical,
            )
        )

    @classmethod
    def from_state(cls, state: Tuple[mx.array, mx.array], meta_state: Tuple[str, ...]) -> "MuseKVCache":
        """Rebuild a cache from ``state`` and ``meta_state`` (both are required:
        the planes are meaningless without their ring origins)."""
        if meta_state is None or len(meta_state) != 10:
            raise ValueError(f"MuseKVCache.from_state needs the 10-field meta_state, got {meta_state!r}")
        kind = LayerKind(meta_state[0])
        layer, heads, dim, window, max_context, capacity, length, ol, op = map(int, meta_state[1:])
        plane = KvPlane(
            kind, kv_heads=heads, head_dim=dim, window=window, max_context=max_context, layer=layer
        )
        keys, values = state
        for name, x, ref in (("keys", keys, plane.keys), ("values", values, plane.values)):
            if x.dtype != ref.dtype or tuple(x.shape) != tuple(ref.shape):
                raise ValueError(
                    f"layer {layer}: state {name} must be {ref.dtype} {tuple(ref.shape)}, "
                    f"got {x.dtype} {tuple(x.shape)}"
                )
        if capacity != plane.capacity:
            raise ValueError(f"layer {layer}: meta capacity {capacity} != plane {plane.capacity}")
        plane.ring = Ring(capacity, length, ol, op, layer)
        plane.keys, plane.values = keys, values
        return cls(plane)

    # -- trimming ------------------------------------------------------------

    def trimmable_depth(self) -> int:
        """How many newest tokens ``trim`` can remove exactly."""
        if self.kind is LayerKind.GLOBAL or not self.ring.wrapped:
            return self.ring.len
        return 0

    def is_trimmable(self) -> bool:
        return self.kind is LayerKind.GLOBAL or not self.ring.wrapped

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens, exactly, or refuse (never silently wrong)."""
        if n < 0:
            raise ValueError(f"layer {self.layer}: cannot trim a negative count {n}")
        depth = self.trimmable_depth()
        if n > depth:
            raise ValueError(
                f"layer {self.layer}: can trim at most {depth} tokens exactly, asked for {n}"
            )
        self.plane.ring.rewind(n)
        return n

    # -- sizes ---------------------------------------------------------------

    def size(self) -> int:
        return self.ring.len

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        return self.plane.nbytes


def make_prompt_cache(model: Any, max_context: Optional[int] = None) -> List[MuseKVCache]:
    """One ``MuseKVCache`` per layer of an mlx-lm Muse model, sized from its args.

    ``max_context`` defaults to the model's ``max_position_embeddings``; the
    planes are allocated (zero-filled) now, at exactly the footprint formula.
    """
    args = getattr(model, "args", None)
    if args is None:
        raise TypeError(f"make_prompt_cache needs an mlx-lm model with .args, got {type(model).__name__}")
    geometry = MuseGeometry.from_model_args(args, max_context)
    return make_cache_for(geometry)


def make_cache_for(geometry: MuseGeometry) -> List[MuseKVCache]:
    """One cache per layer of ``geometry``."""
    return [
        MuseKVCache(
            KvPlane(
                geometry.layer_kind(i),
                kv_heads=geometry.kv_heads,
                head_dim=geometry.head_dim,
                window=geometry.window,
                max_context=geometry.max_context,
                layer=i,
            )
        )
        for i in range(geometry.num_layers)
    ]
