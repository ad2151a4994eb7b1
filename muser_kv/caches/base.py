"""What the per-layer caches share: mlx-lm's cache protocol.

Two regimes, one class each, shaped like mlx-lm's ``KVCache`` /
``RotatingKVCache``: ``GlobalKVCache`` (``growing.py``: a plane that fills from
row 0 and never wraps) and ``SlidingKVCache`` (``sliding.py``: a ring with its
staging shadow and retained rows). ``MuseKVCache`` is what they share: the
protocol members, the list and checkpoint hooks and state; a cache's rows out
and in (sessions) are ``LiveRows``'s (``live_rows.py``).

A Muse model asks each layer type's first cache for ``make_mask(N, window_size)``
before any layer runs, then every layer calls ``update_and_fetch``. So the mask
must describe exactly the rows ``update_and_fetch`` will return; both come from
the ring's answer for the write (``Ring.read_for`` / ``Ring.write``):

* rows ``[0, len + N)`` in order (``Read.PREFIX``: a global plane, or a ring that
  has not wrapped) -> causal, offset ``len``;
* one token on a full ring (``Read.RING``): the whole ring, rotated; every row is
  inside the window -> no mask;
* any other chunk (``Read.SHADOW``): ``len`` old rows in logical order + the chunk
  -> causal with the window, offset ``len``. The chunk is committed only after
  the shadow is taken (attend before overwrite).

Every cache belongs to a list (``cachelist``): it writes only in step with its
neighbours, and a trim of it checks the whole list first. A cache's ``ring`` is
one object for the cache's life (plans are committed into it with
``Ring.assign``), which is what its neighbour reads.
"""

from __future__ import annotations

import copy
import weakref
from abc import abstractmethod
from operator import attrgetter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union

import mlx.core as mx

from muser_kv.caches import cachelist, saved_state
from muser_kv.caches.live_rows import LiveRows, Pair
from muser_kv.caches.masks import DecodeMask
from muser_kv.caches.writes import ContextOverflow
from muser_kv.core import kernels
from muser_kv.core.attention import DecodeRead, KeyRead
from muser_kv.core.counts import count
from muser_kv.core.geometry import LayerKind
from muser_kv.core.kernels import INPUT_DTYPES
from muser_kv.core.planes import Planes
from muser_kv.core.ring import Ring, Trim, Write

Mask = Union[None, str, mx.array, DecodeMask]
#: ``(keys, values, meta_state, retained)``: see ``MuseKVCache.state``
State = Tuple[mx.array, mx.array, Tuple[str, ...], Any]

#: ``INPUT_DTYPES`` as a set: the decode fast path's membership test
INPUT_DTYPE_SET = frozenset(INPUT_DTYPES)

_Cache = TypeVar("_Cache", bound="MuseKVCache")


def nothing_fetched() -> None:
    """A cache's last fetch before it has made one (a weak reference's answer
    once its array is gone): no keys."""
    return None


class MuseKVCache(LiveRows):
    """One layer's cache for one sequence: planes, a ``Ring``, mlx-lm's protocol.

    ``offset`` is the logical position of the next token and is read-only: only
    ``update_and_fetch``, ``trim`` and ``install`` move it. Batch size 1; ``merge``
    makes a batch of several sequences (``batch.py``). A cache may own its
    planes or be one slot of planes shared with other sequences (``slot``).

    Each regime provides ``update_and_fetch``, ``_mask`` (the rows its next write
    returns), ``trimmable_depth`` (every count up to it trims exactly, one more is
    refused), ``undoable_block`` (the longest block written from here that a trim
    can always undo: a checkpoint opens only for blocks every layer can undo),
    ``is_trimmable`` and ``_rewind`` (a trim plan, committed); the base declares
    each abstract, and each regime's class implements it.
    """

    kind: LayerKind
    #: overwritten rows a ring keeps for exact trims (``speculative``); 0 for a
    #: global plane. Set by each regime's ``__init__``; part of ``meta_state``.
    retain: int

    def __init__(self, planes: Planes, *, capacity: int, window: int, max_context: int,
                 layer: int = 0, slot: int = 0):
        self.planes = planes
        self.slot = slot
        self.ring = Ring(capacity, layer=layer)
        self.layer = layer
        self.max_context = max_context
        self._window = window
        self.backend = kernels.get_backend()
        self._one_token = (1, planes.kv_heads, 1, planes.head_dim)
        #: the keys the last fetch returned, weakly (a reference would keep the
        #: plane from being donated to the next store), and where they lie when
        #: not where the ring says (a staging shadow): what ``decode_read`` describes
        self._fetched: Callable[[], Optional[mx.array]] = nothing_fetched
        self._fetched_read: Optional[KeyRead] = None
        # its place in a list (cachelist.bind); alone, a cache is a list of one:
        # its own predecessor, always in step with itself
        self._list: Optional[cachelist.CacheList] = None
        self._index = 0
        self._prev: Ring = self.ring
        self._lead = 0
        self._first_of_kind = False
        self._checkpoints: Optional["weakref.WeakSet"] = None  # open checkpoints over it
        #: slots a batch merged from this cache preallocates (``batch.py``)
        self.batch_slots = 1
        #: whether planes made for this sequence alone (an install, an extract
        #: from a batch) are sized for its rows and grow (``Planes.growing``)
        self.growing = planes.growing

    # -- identity -------------------------------------------------------------------

    def join(self, group: "cachelist.CacheList", index: int, prev: Ring,
             first_of_kind: bool) -> None:
        """Take place ``index`` of list ``group`` (``cachelist.bind``): ``prev`` is
        its predecessor's ring (the last layer's, for layer 0), read by every
        write's in-step check; ``first_of_kind``: the cache a model asks for its
        kind's mask before a forward."""
        self._list = group
        self._index = index
        self._prev = prev
        self._lead = 1 if index else 0
        self._first_of_kind = first_of_kind

    @property
    def list_index(self) -> int:
        """This cache's place in its list (0 for a cache alone)."""
        return self._index

    @property
    def predecessor_end(self) -> int:
        """Where the cache before this one in its list is (layer 0: the last
        layer; a cache alone: itself)."""
        return self._prev.end

    @property
    def window_size(self) -> int:
        """The window the cache was built with, whatever its kind."""
        return self._window

    def reset(self) -> None:
        """Empty this cache in place: every row of its slot zero, the ring empty,
        nothing retained, open checkpoints told: a fresh cache's state, bit for
        bit, in the same planes and list."""
        self.planes.clear_slot(self.slot)
        self.ring.assign(Ring(self.capacity, layer=self.layer))
        self.settle()
        self.replaced()

    offset = property(attrgetter("ring.end"), doc=(
        "The logical position of the next token: ``Ring.end``, read with no Python call "
        "(RoPE reads it once per layer per forward)."))

    @property
    def cache_list(self) -> Optional[cachelist.CacheList]:
        """The list this cache belongs to (``None``: a cache alone)."""
        return self._list

    @property
    def window(self) -> Optional[int]:
        """The sliding window (``None`` for a global layer)."""
        return self._window if self.kind is LayerKind.SLIDING else None

    @property
    def capacity(self) -> int:
        return self.ring.capacity

    @property
    def kv_heads(self) -> int:
        return self.planes.kv_heads

    @property
    def head_dim(self) -> int:
        return self.planes.head_dim

    @property
    def kv_dim(self) -> int:
        return self.planes.kv_dim

    @property
    def layout(self) -> str:
        return self.planes.layout

    @property
    def dtype(self) -> mx.Dtype:
        return self.planes.dtype

    def __repr__(self) -> str:
        r = self.ring
        return (
            f"{type(self).__name__}(layer={self.layer}, kind={self.kind.value}, capacity="
            f"{r.capacity}, len={r.len}, origin_logical={r.origin_logical}, "
            f"origin_physical={r.origin_physical})"
        )

    # -- input checks -----------------------------------------------------------------

    def check_input(self, keys: mx.array, values: mx.array) -> int:
        """Validate model-shaped ``[1, kv_heads, N, head_dim]`` K/V; return N."""
        where = f"KV cache for layer {self.layer}"
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, mx.array):
                raise TypeError(f"{where}: {name} must be an mx.array, got {type(x).__name__}")
            if x.dtype not in INPUT_DTYPES:
                raise TypeError(
                    f"{where}: {name} dtype must be float32, float16 or bfloat16, got {x.dtype}")
            if x.ndim != 4:
                raise ValueError(f"{where}: {name} must be [batch, kv_heads, tokens, head_dim], "
                                 f"got shape {tuple(x.shape)}")
            b, h, n, d = x.shape
            if b != 1:
                raise ValueError(f"{where}: batch size must be 1, got {b} (merge caches to batch)")
            if h != self.kv_heads:
                raise ValueError(f"{where}: expected {self.kv_heads} KV heads, got {h}")
            if d != self.head_dim:
                raise ValueError(f"{where}: expected head_dim {self.head_dim}, got {d}")
            if n < 1:
                raise ValueError(f"{where}: expected at least one token, got {n}")
        if tuple(keys.shape) != tuple(values.shape) or keys.dtype != values.dtype:
            raise ValueError(f"{where}: keys {keys.dtype} {tuple(keys.shape)} and values "
                             f"{values.dtype} {tuple(values.shape)} differ")
        return keys.shape[2]

    def check_write(self, n: int) -> None:
        """Room for ``n`` more tokens below ``max_context``, and the list in step."""
        if self.offset + n > self.max_context:
            raise ContextOverflow(self.layer, self.offset + n, self.max_context)
        ahead = self._prev.end
        if ahead != self.offset + (n if self._index else 0):
            group = self._list
            # alone, a cache is its own predecessor (ahead == offset): never here
            assert group is not None, "a cache of no list is always in step"
            raise group.out_of_step(self, n)

    def in_step(self) -> bool:
        """Whether this cache is at its predecessor's position in its list (a
        cache alone always is). Every cache of a list in step says so; after a
        write or a trim that stopped part-way, some cache says not: then
        ``is_trimmable`` is False for it, so mlx-lm's ``trim_prompt_cache``
        refuses the list (returns 0) before any layer changes."""
        return self._prev.end == self.ring.end

    def _plane_rows(self, keys: mx.array, values: mx.array) -> Pair:
        """One model-shaped token ``[1, H, 1, D]`` of another dtype in the planes'
        dtype (the store kernel: one rounding to nearest even)."""
        k, v = self.backend.store(keys, values, self.layout, 0, 1, None, 0, self.dtype)
        return k.reshape(keys.shape), v.reshape(values.shape)

    def store(self, keys: mx.array, values: mx.array, plan: Write) -> None:
        """Place a write's surviving rows along its runs (the store kernel converts
        and lays them out; MLX's updates place them)."""
        first = plan.runs[0].source
        kept = sum(r.length for r in plan.runs)
        k_rows, v_rows = self.backend.store(keys, values, self.layout, first, kept, plan.after,
                                            plan.position, self.dtype)
        runs = [type(r)(r.physical, r.length, r.source - first) for r in plan.runs]
        self.planes.place(k_rows, v_rows, runs, self.slot)

    # -- decode attention ---------------------------------------------------------------

    def decode_read(self, keys: mx.array, values: mx.array) -> Optional[DecodeRead]:
        """Where the keys this cache's last ``update_and_fetch`` returned lie
        (``core.attention``), when ``keys`` are those; ``None`` otherwise. The
        ring after the write says it, unless the write returned a staging
        shadow (``_fetched_read``)."""
        if self._fetched() is not keys:
            return None
        read = self._fetched_read
        if read is None:
            ring = self.ring
            read = KeyRead(0, ring.end, ring.len, ring.origin_physical, ring.capacity)
        return DecodeRead(keys, values, (read,),
                          self._window if self.kind is LayerKind.SLIDING else None)

    # -- masks --------------------------------------------------------------------------

    def make_mask(self, N: int, window_size: Optional[int] = None,
                  return_array: bool = False) -> Mask:
        """The mask for the rows the next ``update_and_fetch(N tokens)`` returns.

        A model asks its layer types' first caches before any layer writes: those
        refuse a list that is out of step, and a model whose layers do not fit
        the list (``cachelist``), before anything is written. Any other cache of
        a list, asked by a model, was handed to it in less than the whole list
        (a slice): it refuses that (``CacheList.check_asked``)."""
        # the int 1 exactly (True, 1.0, numpy's 1 take the checked path below)
        if N.__class__ is int and N == 1 and not return_array and not self._first_of_kind and (
                window_size is None or window_size == self._window):
            if self._list is not None:
                self._list.check_asked()
            return None  # one token sees every row it is handed (at most the window)
        if N.__class__ is not int or N < 1:
            N = count(N, f"layer {self.layer}: make_mask N", minimum=1)
        if self._first_of_kind:
            self._before_forward(N)
        elif self._list is not None:
            self._list.check_asked()
        return self._mask(N, window_size, return_array)

    @abstractmethod
    def _mask(self, n: int, window_size: Optional[int], return_array: bool) -> Mask:
        """The mask for the rows this regime's next write of ``n`` tokens returns
        (``make_mask`` has checked ``n`` and the list)."""

    def _before_forward(self, n: int) -> None:
        """A layer type's first cache, asked for a mask: the model must fit the
        list, and the list must be in step (this layer level with its
        predecessor, or one write of ``n`` behind it if that layer went first)."""
        group = self._list
        if group is None:  # rebuilt alone (from_state): join the list the model hands
            group = cachelist.adopt(self)
            if group is None:
                self._first_of_kind = False  # driven alone: a list of one, as ever
                return
        if not self._index:  # the model asks layer 0 first: once per forward
            group.check_caller()
        ahead, here = self._prev.end, self.ring.end
        if ahead != here and not (self._index and ahead == here + n):
            raise group.out_of_step(self, n if self._index else 0)

    # -- state -----------------------------------------------------------------------------

    @property
    def keys(self) -> mx.array:
        """The key plane of this sequence as rows: ``[rows, H*D]`` token-major,
        ``[H, rows, D]`` head-major, the whole allocation (a view; holding it
        keeps MLX from donating the plane to the next store)."""
        return self.planes.physical(self.slot)[0]

    @property
    def values(self) -> mx.array:
        return self.planes.physical(self.slot)[1]

    @property
    def state(self) -> State:
        """``(keys, values, meta_state, retained)``: the live planes in their
        physical (rotated) layout, the ring that describes them
        (``meta_state``), and the overwritten rows kept for exact trims
        (``None`` when none are). Everything ``from_state(state)`` -- mlx-lm's
        one-argument call, as ``load_prompt_cache`` makes it -- needs to rebuild
        this cache exactly; evaluating it evaluates the planes."""
        k, v = self.kv_state
        return k, v, self.meta_state, None

    @property
    def kv_state(self) -> Pair:
        """The first two parts of ``state`` alone: what a caller that only
        evaluates the cache (a decode loop, every step) needs, without building
        the description."""
        return self.planes.physical(self.slot)

    @property
    def meta_state(self) -> Tuple[str, ...]:
        r = self.ring
        return tuple(str(x) for x in (
            self.kind.value, self.layout, self.layer, self.kv_heads, self.head_dim, self._window,
            self.max_context, r.capacity, r.len, r.origin_logical, r.origin_physical,
            self.retain))

    @classmethod
    def from_state(cls, state: Any, meta_state: Optional[Sequence[str]] = None) -> "MuseKVCache":
        """Rebuild a cache from its ``state`` (mlx-lm's one-argument form) or from
        ``(keys, values)`` and ``meta_state``, all checked first (``saved_state``);
        bound into the list its model hands it at the first forward (``adopt``)."""
        saved = saved_state.read_state(state, meta_state)
        regime = REGIMES[saved.kind]
        held = regime._check_state_retained(saved.retained, saved.ring, saved.dtype,
                                            saved.kv_dim, saved.retain)
        planes = saved_state.planes_of(saved)
        cache = regime.build(planes, window=saved.window, max_context=saved.max_context,
                             layer=saved.layer, retain=saved.retain)
        cache.ring.assign(saved.ring)
        if held is not None:
            cache._adopt_retained(*held)
        else:
            cache.settle()
        cache._first_of_kind = True  # asked for a mask first: binds the list it is handed
        return cache

    def settle(self) -> None:
        """After the contents changed wholesale (an install, a restore): evaluate
        what the next write will need, so it never waits in that write's graph
        (a regime holding nothing beside its planes has nothing to evaluate)."""
        return None

    @abstractmethod
    def _adopt_retained(self, start: int, blocks: List[mx.array]) -> None:
        """Hold the retained rows a state carried (``_check_state_retained``'s
        answer; only a regime that retains rows gives one)."""

    # -- copies ----------------------------------------------------------------------------

    def __deepcopy__(self, memo: Dict[int, Any]) -> "MuseKVCache":
        """An independent cache (mlx-lm's server prompt cache deep-copies the
        lists it reuses). Copying one cache of a list copies the whole list,
        bound anew, so a copied list is one unit again (``cachelist``); the
        other copies wait in ``memo`` for ``deepcopy`` of the list to pick up."""
        group = self._list
        if group is None:
            return self._detached()
        members = group.caches()
        copies = [c._detached() for c in members]
        cachelist.bind(copies, group.model, group.model_layers)
        for c, d in zip(members, copies):
            memo[id(c)] = d
        return memo[id(self)]

    def _detached(self: _Cache) -> _Cache:
        """This cache alone: its own planes (one slot, arrays shared until a
        write), ring and retained rows; no list, no checkpoints."""
        other = copy.copy(self)
        other.planes = self.planes.detached(self.slot)
        other.slot = 0
        other.ring = self.ring.copy()
        other._list, other._index, other._prev, other._lead = None, 0, other.ring, 0
        other._first_of_kind = False
        other._checkpoints = None
        return other

    # -- trimming --------------------------------------------------------------------------

    @abstractmethod
    def trimmable_depth(self) -> int:
        """Every count up to this trims exactly; one more is refused."""

    @abstractmethod
    def undoable_block(self) -> int:
        """The longest block written from here that a trim can always undo (a
        checkpoint opens only for blocks every layer can undo)."""

    @abstractmethod
    def is_trimmable(self) -> bool:
        """mlx-lm's question: whether ``trim`` can be exact for this cache (never
        while its list is out of step: ``in_step``)."""

    @abstractmethod
    def _rewind(self, plan: Trim) -> None:
        """Commit a trim plan (``Ring.trimmed``): the rows and ring it leaves."""

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens, exactly, or refuse (never silently wrong)."""
        n = count(n, f"layer {self.layer}: trim count", minimum=None)
        if n < 0:
            raise ValueError(f"layer {self.layer}: cannot trim a negative count {n}")
        depth = self.trimmable_depth()
        if n > depth:
            raise ValueError(
                f"layer {self.layer}: can trim at most {depth} tokens exactly, asked for {n}")
        if n == 0:
            return 0
        if self._list is not None:
            self._list.before_trim(self, n)  # the whole list can, or none changes
        self._rewind(self.ring.trimmed(n))
        if self._checkpoints:
            for cp in list(self._checkpoints):
                cp.cache_trimmed(self, self.offset)
        return n

    # -- checkpoints (speculative.py) --------------------------------------------------

    def watch(self, checkpoint: Any) -> None:
        """Tell ``checkpoint`` of every move that is not a write: a trim (its
        ``cache_trimmed(cache, position)``) and a restore (``cache_replaced(cache)``)."""
        if self._checkpoints is None:
            self._checkpoints = weakref.WeakSet()
        self._checkpoints.add(checkpoint)

    def unwatch(self, checkpoint: Any) -> None:
        if self._checkpoints is not None:
            self._checkpoints.discard(checkpoint)

    def replaced(self) -> None:
        """The contents were replaced wholesale (an install): the history open
        checkpoints and a trim round describe is gone."""
        if self._checkpoints:
            for cp in list(self._checkpoints):
                cp.cache_replaced(self)
        if self._list is not None:
            self._list.forget_round()

    # -- sizes ------------------------------------------------------------------------------

    def size(self) -> int:
        return self.ring.len

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Plane bytes this sequence holds (its slot's share of shared planes)."""
        return self.planes.slot_nbytes()

    def fit(self) -> None:
        """Growing planes of this sequence alone sized for its rows (``Planes.fit``):
        a cache that is kept, not written, holds its rows and no growth headroom."""
        if self.planes.slots == 1:
            self.planes.fit(self.ring.extent)

    # -- batches (batch.py) -----------------------------------------------------------------

    @classmethod
    def merge(cls, caches: List["MuseKVCache"]) -> Any:
        """One batch of these single-sequence caches (mlx-lm's ``BatchGenerator``
        calls it): see ``batch.BatchKVCache.merge``."""
        if BATCH is None:  # pragma: no cover - muser_kv imports caches.batch
            raise RuntimeError("muser_kv.caches.batch is not imported: no batch class to merge into")
        return BATCH.merge(caches)

    @classmethod
    @abstractmethod
    def build(cls, planes: Planes, *, window: int, max_context: int, layer: int,
              retain: int) -> "MuseKVCache":
        """A cache of this regime over ``planes`` (``from_state``'s constructor)."""

    @classmethod
    @abstractmethod
    def _check_state_retained(cls, retained: Any, ring: Ring, dtype: Any, kv_dim: int,
                              retain: int) -> Any:
        """The retained rows of a state, checked (``None``: none to adopt)."""


#: The class of each storage regime, by layer kind. Each regime's module enters
#: itself here: the base cannot import them, since they build on it.
REGIMES: Dict[LayerKind, Type[MuseKVCache]] = {}

#: The batch class ``merge`` builds (``caches.batch`` enters it, for the same reason).
BATCH: Optional[Any] = None
