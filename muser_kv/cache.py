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

import weakref

import mlx.core as mx

from . import cachelist
from .counts import count
from .geometry import LayerKind, MuseGeometry
from .kernels import INPUT_DTYPES, PLANE_DTYPE, PLANE_DTYPES
from .plane import KvPlane
from .precision import DtypeLike, parse_plane_dtype, plane_dtype_for
from .ring import Ring
from .speculative import DEFAULT_RETAIN, RetainedRows

Mask = Union[None, str, mx.array]

#: ``INPUT_DTYPES`` as a set: the decode fast path's membership test (a tuple
#: scan compares dtypes one by one, ~0.1 us more per layer)
_INPUT_DTYPE_SET = frozenset(INPUT_DTYPES)
_ONE = 1


def causal_mask(n: int, offset: int, window: Optional[int] = None) -> mx.array:
    """``[n, offset + n]`` bool: query ``offset + i`` sees key ``j`` iff
    ``j <= offset + i`` (and ``offset + i - j < window``). mlx-lm's semantics."""
    keys = mx.arange(offset + n)[None]
    queries = mx.arange(offset, offset + n)[:, None]
    mask = queries >= keys
    if window is not None:
        mask = mask & (queries < keys + window)
    return mask


def _evaluated_with(kv: Tuple[mx.array, mx.array], copy: mx.array) -> Tuple[mx.array, mx.array]:
    """``kv`` with ``copy`` made part of what evaluating it computes (``mx.depends``:
    an edge, no kernel). A retained copy left lazy would keep what it reads (the
    plane before the store, or a whole staging shadow) alive, and hold the plane
    at the next store, where MLX would then copy it instead of donating it."""
    return tuple(mx.depends(list(kv), [copy]))


class MuseKVCache:
    """One layer's cache: a ``KvPlane`` behind mlx-lm's cache protocol.

    Batch size 1 only. ``offset`` is the logical position of the next token and
    is read-only: only ``update_and_fetch``, ``trim`` and a snapshot install move it.

    A sliding cache retains the newest ``retain`` rows its ring overwrote, so
    ``trim(n)`` (mlx-lm's speculative rewind) is exact for ``n <= retain`` even
    after the window wrapped, and refused beyond that; ``trimmable_depth()`` is
    exactly how far it can go.

    A cache is one layer of a list (``cachelist``): it writes only in step with
    its neighbours, and a trim of it checks the whole list first.
    """

    def __init__(self, plane: KvPlane, retain: int = DEFAULT_RETAIN):
        self.plane = plane
        self.retain = retain if plane.kind is LayerKind.SLIDING else 0
        self._retained = RetainedRows(self.retain)
        # no ring seen yet: the first update settles the rows a full ring
        # (rebuilt by from_state) will overwrite, as after an install
        self._ring_seen = None
        self._one_token = (1, plane.kv_heads, 1, plane.head_dim)
        # its place in a list (cachelist.bind); alone, a cache is a list of one:
        # its own predecessor, always in step with itself
        self._list: Optional[cachelist.CacheList] = None
        self._index = 0
        self._prev = plane
        self._lead = 0
        self._first_of_kind = False
        self._checkpoints: Optional["weakref.WeakSet"] = None  # open checkpoints over it

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
        ring = plane.ring
        if (ring is self._ring_seen and keys.shape == self._one_token
                and values.shape == self._one_token):
            dtype = keys.dtype
            end = ring.origin_logical + ring.len
            prev = self._prev.ring  # in step with the list (cachelist): one read
            if (dtype == values.dtype and dtype in _INPUT_DTYPE_SET and end < plane.max_context
                    and prev.origin_logical + prev.len == end + self._lead):
                if ring.len == ring.capacity:
                    return self._decode_one(keys, values, dtype)
                if ring.origin_physical == 0:  # filling from row 0
                    kv = plane.write_one(keys, values, dtype)
                    return self._copy_ahead(kv) if ring.len == ring.capacity else kv
        n = plane.check_input(keys, values)
        plane.check_write(self.offset, n)
        self._check_in_step(n)
        self._check_ring_owner()
        ring = plane.ring
        # positions [origin_logical, origin_logical + lost) leave the window
        lost = max(0, ring.len + n - ring.capacity) if self.retain else 0
        if self._reads_in_place(n):
            row = None
            if lost and not self._retained.covers(ring.origin_logical):
                row = self._retain_now(ring.origin_logical)  # one token overwrites the oldest row
            plane.write_checked(ring.end, keys, values, n)
            out = plane.view()
            if row is not None:
                out = _evaluated_with(out, row)
        else:
            k_rows, v_rows = plane.shadow_rows(keys, values)
            plane.write_checked(ring.end, keys, values, n)
            if lost:  # the shadow starts at origin_logical: its first rows are the lost ones
                keep = mx.arange(lost - min(lost, self.retain), lost)
                rows = mx.stack([mx.take(k_rows, keep, axis=0), mx.take(v_rows, keep, axis=0)], 1)
                self._retained.add(ring.origin_logical + lost - keep.size, rows,
                                   plane.ring.origin_logical)
            out = plane.shadow_view(k_rows), plane.shadow_view(v_rows)
            if lost:  # left lazy, the copy would hold the shadow
                out = _evaluated_with(out, rows)
        self._ring_seen = plane.ring
        return self._copy_ahead(out)

    def _decode_one(self, keys: mx.array, values: mx.array, dtype: mx.Dtype) -> Tuple[mx.array, mx.array]:
        """One token into a full ring, read in place: the decode hot path, with
        the input checks settled by the caller and the least host work per layer
        (this is where a decode step's time goes: dispatch and Python, not bytes).
        The row it overwrites was copied ahead, so retention costs nothing here."""
        if not self.retain:
            return self.plane.write_one(keys, values, dtype)
        ring, retained = self.plane.ring, self._retained
        # retained.covers(origin_logical), inlined (this runs once per layer per token)
        if not retained.start <= ring.origin_logical < retained.end:
            row = self._retain_now(ring.origin_logical)
            kv = _evaluated_with(self.plane.write_one(keys, values, dtype), row)
        else:
            kv = self.plane.write_one(keys, values, dtype)
        if not retained.start <= ring.origin_logical < retained.end:
            return self._copy_ahead(kv)
        return kv

    def _check_in_step(self, n: int) -> None:
        """Refuse a write of ``n`` tokens unless the list is where it belongs
        (``cachelist``: layer 0 level with the last layer, layer i one write
        behind layer i - 1)."""
        ahead = self._prev.ring.end
        if ahead != self.offset + (n if self._index else 0):
            raise self._list.out_of_step(self, n)

    # -- retained rows (see speculative.py) ------------------------------------

    def _check_ring_owner(self) -> None:
        """Retained rows describe this cache's own history: if the plane's ring was
        replaced behind its back (a snapshot install), they are dropped, and so is
        every open checkpoint's claim on that history."""
        ring = self.plane.ring
        if ring is not self._ring_seen:
            if self._ring_seen is not None:
                self.replaced()
            self._retained.clear()
            self._ring_seen = ring
            if self.retain and ring.len == ring.capacity:
                # Copy ahead now and settle it (once per install): taken in the same
                # graph as the next store, it would make MLX copy the ring.
                mx.eval(self._take_ahead())

    def _retain_now(self, position: int) -> mx.array:
        """Copy the row about to be overwritten in the same graph as the store (only
        when no copy was taken ahead: MLX then copies this ring once). The caller
        evaluates the copy with attention (``mx.depends``): left lazy, it would
        keep the whole pre-store ring alive until it is let go."""
        row = self.plane.copy_rows(position, 1)
        self._retained.add(position, row, position)
        return row

    def _copy_ahead(self, kv: Tuple[mx.array, mx.array]) -> Tuple[mx.array, mx.array]:
        """On a full ring whose next victim has no copy yet, copy the next
        ``retain`` rows to be overwritten now, while this step reads the plane
        anyway, and make the copy part of what attention evaluates
        (``mx.depends``: an edge, no kernel). Left pending, it would still hold the
        plane at the next store, and MLX would copy the plane instead of donating it."""
        ring = self.plane.ring
        if not self.retain or ring.len < ring.capacity or self._retained.covers(ring.origin_logical):
            return kv
        return _evaluated_with(kv, self._take_ahead())

    def _take_ahead(self) -> mx.array:
        """Retain copies of the next ``retain`` rows a full ring will overwrite."""
        ring = self.plane.ring
        ahead = self.plane.copy_rows(ring.origin_logical, min(self.retain, ring.len))
        self._retained.add(ring.origin_logical, ahead, ring.origin_logical)
        return ahead

    @property
    def retain_depth(self) -> int:
        """The deepest speculative block this cache can always undo."""
        return self.retain if self.kind is LayerKind.SLIDING else self.plane.max_context

    def undoable_block(self) -> int:
        """The longest block of tokens written from here that ``trim`` can always
        undo exactly: a growing plane any (up to its context); a ring the rows
        it has free plus the overwritten rows it retains (the newest
        ``retain``). A checkpoint opens only for blocks every layer can undo."""
        if self.kind is LayerKind.GLOBAL:
            return self.plane.max_context
        ring = self.ring
        return ring.capacity - ring.len + self.retain

    @property
    def retained_nbytes(self) -> int:
        return self._retained.nbytes

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ) -> Mask:
        """The mask for the rows the next ``update_and_fetch(N tokens)`` returns.

        A model asks its layer types' first caches before any layer writes: those
        refuse a list that is out of step, and a model whose layers do not fit
        the list (``cachelist``), before anything is written."""
        # ``N is _ONE``: the int 1 exactly (CPython keeps one object for it; any
        # other 1 -- True, 1.0, numpy's -- takes the checked path below)
        if N is _ONE and not return_array and not self._first_of_kind and (
            window_size is None or window_size == self.plane.window
        ):
            return None  # one token sees every row it is handed (at most the window)
        if N.__class__ is not int or N < 1:
            N = count(N, f"layer {self.layer}: make_mask N", minimum=1)
        if self._first_of_kind:
            self._before_forward(N)  # (the check in cachelist's module doc)
        if N == 1 and not return_array and (
            window_size is None or window_size == self.plane.window
        ):
            return None
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

    def _before_forward(self, n: Any) -> None:
        """A layer type's first cache, asked for a mask: the model must fit the
        list, and the list must be in step (this layer level with its
        predecessor, or one write of ``n`` behind it if that layer went first)."""
        if not self._index:  # the model asks layer 0 first: once per forward
            self._list.check_caller(3)  # 0 check_caller, 1 here, 2 make_mask, 3 its caller
        prev, ring = self._prev.ring, self.plane.ring
        ahead, here = prev.origin_logical + prev.len, ring.origin_logical + ring.len
        if ahead != here and not (self._index and ahead == here + n):
            raise self._list.out_of_step(self, n if self._index else 0)

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
                p.kind.value, p.layout, p.layer, p.kv_heads, p.head_dim, p.window,
                p.max_context, r.capacity, r.len, r.origin_logical, r.origin_physical,
            )
        )

    @classmethod
    def from_state(cls, state: Tuple[mx.array, mx.array], meta_state: Tuple[str, ...]) -> "MuseKVCache":
        """Rebuild a cache from ``state`` and ``meta_state`` (both are required:
        the planes are meaningless without their ring origins)."""
        if meta_state is None or len(meta_state) != 11:
            raise ValueError(f"MuseKVCache.from_state needs the 11-field meta_state, got {meta_state!r}")
        kind, layout = LayerKind(meta_state[0]), meta_state[1]
        layer, heads, dim, window, max_context, capacity, length, ol, op = map(int, meta_state[2:])
        plane = KvPlane(kind, kv_heads=heads, head_dim=dim, window=window, max_context=max_context,
                        layer=layer, sliding_layout=layout, allocate=False)
        keys, values = state
        for name, x in (("keys", keys), ("values", values)):
            if x.dtype not in PLANE_DTYPES or x.dtype != keys.dtype or tuple(x.shape) != plane.shape:
                raise ValueError(
                    f"layer {layer}: state {name} must be float16 or bfloat16 {plane.shape} "
                    f"(keys and values alike), got {x.dtype} {tuple(x.shape)}"
                )
        if capacity != plane.capacity:
            raise ValueError(f"layer {layer}: meta capacity {capacity} != plane {plane.capacity}")
        plane.dtype = keys.dtype
        plane.ring = Ring(capacity, length, ol, op, layer)
        plane.keys, plane.values = keys, values
        return cls(plane)

    # -- trimming ------------------------------------------------------------

    def trimmable_depth(self) -> int:
        """How many newest tokens ``trim`` can remove exactly: every count up to
        it trims exactly, one more is refused."""
        self._check_ring_owner()
        ring = self.ring
        if self.kind is LayerKind.GLOBAL:
            return ring.len
        first = self._retained.first(ring.origin_logical)
        if first == 0:  # every row ever overwritten is held: back to position 0
            return ring.end
        # trimming to position e puts back rows [e - capacity, origin_logical):
        # exact while e - capacity >= first, the oldest row held
        return max(0, ring.end - ring.capacity - first)

    def is_trimmable(self) -> bool:
        return self.kind is LayerKind.GLOBAL or self.retain > 0 or not self.ring.wrapped

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens, exactly, or refuse (never silently wrong).

        A growing plane rewinds its length. A ring also puts back the rows those
        tokens overwrote, from its retained rows, and moves both origins back."""
        n = count(n, f"layer {self.layer}: trim count", minimum=None)
        if n < 0:
            raise ValueError(f"layer {self.layer}: cannot trim a negative count {n}")
        depth = self.trimmable_depth()
        if n > depth:
            raise ValueError(
                f"layer {self.layer}: can trim at most {depth} tokens exactly, asked for {n}"
            )
        if n == 0:
            return 0
        if self._list is not None:
            self._list.before_trim(self, n)  # the whole list can, or none changes
        ring = self.ring
        if self.kind is LayerKind.GLOBAL:
            ring = ring.copy()
            ring.rewind(n)
            self.plane.restore(ring, 0, mx.zeros((0, 0)), mx.zeros((0, 0)))
        else:
            end = ring.end - n
            origin = max(0, end - ring.capacity)
            back = ring.origin_logical - origin
            # positions [origin, origin_logical) come back; those at or past the new
            # end were trimmed too (a chunk wider than the ring never stored them)
            keys, values = self._retained.rows(origin, min(ring.origin_logical, end))
            earlier = Ring(ring.capacity, end - origin, origin,
                           (ring.origin_physical - back) % ring.capacity, self.layer)
            self.plane.restore(earlier, origin, keys, values)
            self._retained.truncate(end)  # trimmed positions may be written again
        # No evaluation here: a sync per layer would cost more than the one small
        # ring copy MLX may make at the next store.
        self._ring_seen = self.plane.ring
        if self._checkpoints:
            for cp in list(self._checkpoints):
                cp._trimmed(self, self.offset)
        return n

    # -- checkpoints (speculative.py) -------------------------------------------

    def watch(self, checkpoint: Any) -> None:
        """Tell ``checkpoint`` of every move that is not a write: a trim (its
        ``_trimmed(cache, position)``) and a restore (``_replaced(cache)``)."""
        if self._checkpoints is None:
            self._checkpoints = weakref.WeakSet()
        self._checkpoints.add(checkpoint)

    def unwatch(self, checkpoint: Any) -> None:
        if self._checkpoints is not None:
            self._checkpoints.discard(checkpoint)

    def replaced(self) -> None:
        """The planes were restored from elsewhere (a snapshot install): the
        history open checkpoints and a trim round describe is gone."""
        if self._checkpoints:
            for cp in list(self._checkpoints):
                cp._replaced(self)
        if self._list is not None:
            self._list.forget_round()

    # -- sizes ---------------------------------------------------------------

    def size(self) -> int:
        return self.ring.len

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        return self.plane.nbytes


def make_prompt_cache(
    model: Any,
    max_context: Optional[int] = None,
    retain: int = DEFAULT_RETAIN,
    sliding_layout: str = "token_major",
    plane_dtype: DtypeLike = None,
) -> List[MuseKVCache]:
    """One ``MuseKVCache`` per layer of an mlx-lm Muse model, sized from its args.

    ``max_context`` defaults to the model's ``max_position_embeddings``; the
    planes are allocated (zero-filled) now, at the footprint formula's rows
    rounded up to a multiple of 256 (``footprint`` reports exactly that).
    ``retain`` is how many overwritten rows each sliding ring keeps, i.e. how
    deep ``trim`` and speculative rollback are exact past the wrap (0 turns the
    retention and its one extra copy per token off). ``sliding_layout`` picks the
    rings' layout (``token_major``, the seeds' default, or ``head_major``).
    ``plane_dtype`` (f16 or bf16) overrides the planes' type, which otherwise
    follows the model: bf16 for a model whose attention runs in bf16, else f16
    (``muser_kv.precision``).

    The caches form one list (``muser_kv.cachelist``): drive them together, in
    list order, as mlx-lm does; a layer written alone puts the list out of step.
    A model without the fields muser-kv needs, or with a layer type it does not
    serve, raises ``UnsupportedModel`` naming the field.
    """
    geometry = MuseGeometry.from_model(model, max_context)
    return make_cache_for(geometry, retain, sliding_layout, plane_dtype_for(model, plane_dtype),
                          model=model)


def make_cache_for(
    geometry: MuseGeometry, retain: int = DEFAULT_RETAIN, sliding_layout: str = "token_major",
    plane_dtype: DtypeLike = PLANE_DTYPE, *, model: Any = None,
) -> List[MuseKVCache]:
    """One cache per layer of ``geometry``, with planes of ``plane_dtype``, bound
    into one list (``muser_kv.cachelist``); ``model``, when given, is the model
    the list serves (a session saved from it records that model's fingerprint)."""
    if not isinstance(geometry, MuseGeometry):
        raise TypeError(f"make_cache_for needs a MuseGeometry, got {type(geometry).__name__}")
    retain = count(retain, "retain")
    dtype = parse_plane_dtype(plane_dtype) or PLANE_DTYPE
    caches = [
        MuseKVCache(
            KvPlane(
                geometry.layer_kind(i),
                kv_heads=geometry.kv_heads,
                head_dim=geometry.head_dim,
                window=geometry.window,
                max_context=geometry.max_context,
                layer=i,
                sliding_layout=sliding_layout,
                dtype=dtype,
            ),
            retain,
        )
        for i in range(geometry.num_layers)
    ]
    cachelist.bind(caches, model)
    return caches
