"""The one restore path: one gate and one install loop behind every restore of
a session's rows into a cache list -- ``SessionSnapshot.install`` (and
``restore_into``), ``load_session``, a ``KVStore`` rebuild and ``recv_session``.

* **One gate, each check once.** ``Target`` is where a restore goes: the KV
  geometry of the list, its planes' encoding and the fingerprint of its model,
  each read once by the caller (``Target.of_list`` for a live list; a caller
  that holds a verified fingerprint -- the store keeps one per model -- passes
  it in, so nothing samples the weights again). ``check_session`` then settles
  everything a session's header says -- encoding, geometry, position, model,
  the conversion its encoding needs -- and ``check_start`` / ``check_cut`` /
  ``check_stored`` each layer's start and tensors, in that order, every one
  before the first plane changes. Every restore kind refuses the same input
  with the same error (``SnapshotMismatch``, ``ModelMismatch``,
  ``EncodingMismatch`` / ``ProductionF16Required``).
* **One install loop.** ``Install`` puts each verified layer in through its
  cache (``MuseKVCache.install``: rotation ``start % capacity``, planes
  allocated by ``install_shape``, the one sizing rule a load's placed planes
  use too), converting rows to the planes' type only where the gate allowed it.
  On a list someone holds (``rollback=True``) it keeps what each layer held, so
  a failure part-way puts every layer back as it was; a new list that no one
  holds is dropped instead, and its layers' evaluations overlap.

The module also owns the KV geometry of a live list (``cache_geometry``) and
of a model (``kv_geometry``), and the cut a restorable session holds
(``expected_cut``, ``LayerCut``): the gate's terms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import mlx.core as mx

from muser_kv.caches.base import MuseKVCache
from muser_kv.core.geometry import LayerKind, MuseGeometry
from muser_kv.core.ring import Ring
from muser_kv.sessions.fingerprint import differs, model_fingerprint
from muser_kv.sessions.format import (
    ENCODINGS,
    KV_EXTRA_FIELDS,
    KV_FIELDS,
    ModelMismatch,
    SnapshotMismatch,
    encoding_mismatch,
    kv_num_heads,
    plane_encoding,
)

Fingerprint = Mapping[str, str]

# -- the terms -------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LayerCut:
    """One layer's rows, ``[rows, kv_heads, head_dim]`` in logical order from ``start``."""

    start: int
    keys: mx.array
    values: mx.array

    @property
    def rows(self) -> int:
        shape: Tuple[int, ...] = getattr(self.keys, "shape", ())
        return int(shape[0]) if len(shape) else 0


def kv_geometry(geometry: MuseGeometry) -> MuseGeometry:
    """``geometry`` with ``num_heads`` normalized to its K/V heads (the query
    heads never enter the KV state; the least multiple of both kinds' where
    they differ)."""
    return dataclasses.replace(geometry, num_heads=kv_num_heads(geometry.kv_heads,
                                                                geometry.global_kv_heads))


def expected_cut(geometry: MuseGeometry, layer: int, position: int) -> Tuple[int, int]:
    """``(start, rows)`` a complete restorable cut holds for ``layer`` at ``position``."""
    if geometry.layer_kind(layer) is LayerKind.SLIDING:
        count = min(position, geometry.capacity(layer))
        return position - count, count
    return 0, position


def _ours(cache_entry: Any, index: int) -> MuseKVCache:
    if not isinstance(cache_entry, MuseKVCache):
        raise TypeError(
            f"session snapshot: cache entry {index} is a {type(cache_entry).__name__}, "
            "not a muser_kv cache (make_prompt_cache / make_cache_for)"
        )
    return cache_entry


def cache_geometry(cache: Sequence[Any]) -> MuseGeometry:
    """The KV geometry a live cache list was built for (fails on a mixed list)."""
    if not cache:
        raise SnapshotMismatch("cache layers", "at least one", 0)
    planes = [_ours(c, i) for i, c in enumerate(cache)]
    first = planes[0]
    for i, p in enumerate(planes):
        for name in ("_window", "max_context"):
            if getattr(p, name) != getattr(first, name):
                raise SnapshotMismatch(f"cache {name}", getattr(first, name), getattr(p, name),
                                       i, p.kind)
    dims: Dict[LayerKind, Tuple[int, int]] = {}
    for i, p in enumerate(planes):
        got = dims.setdefault(p.kind, (p.kv_heads, p.head_dim))
        if (p.kv_heads, p.head_dim) != got:
            raise SnapshotMismatch(f"cache (kv_heads, head_dim) of {p.kind.value} layers", got,
                                   (p.kv_heads, p.head_dim), i, p.kind)
        if p.dtype != first.dtype:
            raise SnapshotMismatch("plane dtype", str(first.dtype), str(p.dtype), i, p.kind)
    heads, dim = dims.get(LayerKind.SLIDING) or dims[LayerKind.GLOBAL]
    g_heads, g_dim = dims.get(LayerKind.GLOBAL, (heads, dim))
    group = first.cache_list
    if group is not None:  # a slice of a list is not a list of fewer layers
        group.check_whole(cache, "a session of a KV cache list")
    model_layers = group.model_layers if group is not None else 0
    geometry = MuseGeometry(
        num_layers=len(planes), window=first.window_size, max_context=first.max_context,
        num_heads=kv_num_heads(heads, 0 if g_heads == heads else g_heads), kv_heads=heads,
        head_dim=dim, layer_kinds=tuple(p.kind for p in planes),
        global_kv_heads=0 if g_heads == heads else g_heads,
        global_head_dim=0 if g_dim == dim else g_dim,
        model_layers=0 if model_layers == len(planes) else model_layers,
    )
    for i, p in enumerate(planes):
        if p.capacity != geometry.capacity(i):
            raise SnapshotMismatch("plane capacity", geometry.capacity(i), p.capacity, i, p.kind)
    return geometry


def list_model(cache: Sequence[Any]) -> Any:
    """The model a cache list was built for, when every layer belongs to one
    list that knows it (``make_prompt_cache(model)``), else None."""
    lists = {id(getattr(c, "cache_list", None)): getattr(c, "cache_list", None) for c in cache}
    if len(lists) != 1:
        return None
    group = next(iter(lists.values()))
    return group.model if group is not None else None


# -- the gate ------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where a restore goes: the list's KV geometry, its planes' encoding, and
    the verified fingerprint of the model the restored rows must come from
    (None: no model check -- the list knows no model, or the caller allowed
    another). ``model`` names it in a refusal."""

    geometry: MuseGeometry
    encoding: str
    fingerprint: Optional[Fingerprint] = None
    model: str = "the cache list's model"

    @classmethod
    def of_list(cls, cache: Sequence[Any], *, allow_other_model: bool = False,
                fingerprint_of: Optional[Callable[[Any], Fingerprint]] = None) -> "Target":
        """The target a live list is: its geometry and encoding, and, unless
        ``allow_other_model``, the fingerprint of the model it knows, from
        ``fingerprint_of`` (a caller that keeps verified fingerprints passes
        its own lookup; default: sample the model, ``model_fingerprint``)."""
        geometry = cache_geometry(cache)
        model = None if allow_other_model else list_model(cache)
        if model is None:
            return cls(geometry, plane_encoding(cache[0].dtype))
        of = fingerprint_of if fingerprint_of is not None else model_fingerprint
        return cls(geometry, plane_encoding(cache[0].dtype), of(model))


def check_geometry(have: MuseGeometry, want: MuseGeometry) -> None:
    """Refuse a session of KV geometry ``have`` for a target of ``want``
    (``SnapshotMismatch`` naming the first field that differs)."""
    for name in KV_FIELDS + KV_EXTRA_FIELDS:
        got, expected = getattr(have, name), getattr(want, name)
        if got != expected:
            if name == "layer_kinds":
                expected = [k.value for k in expected]
                got = [k.value for k in got]
            raise SnapshotMismatch(f"geometry.{name}", expected, got)


def check_model(recorded: Optional[Fingerprint], fingerprint: Fingerprint, target: str) -> None:
    """Refuse a session whose recorded model fingerprint is not ``fingerprint``
    (``ModelMismatch``; the caller's ``allow_other_model=True`` skips this)."""
    if recorded is None:
        raise ModelMismatch(
            f"model fingerprint (the session records none; {target} is known: pass "
            "allow_other_model=True to restore it anyway)", dict(fingerprint), None)
    part = differs(recorded, fingerprint)
    if part is not None:
        raise ModelMismatch(
            f"model fingerprint {part} (the session was saved from another model than "
            f"{target}: other weights or config; pass allow_other_model=True to restore it "
            "anyway)", fingerprint.get(part), recorded.get(part))


def check_session(target: Target, geometry: MuseGeometry, position: Any, encoding: str,
                  model: Optional[Fingerprint], *, convert: bool = False,
                  whose: Optional[Tuple[str, str]] = None) -> None:
    """Everything a session's header settles, before any of its rows: its
    encoding is known, its KV geometry is the target's, its position lies in
    ``[0, max_context]``, it comes from the target's model (when the target
    has a fingerprint) and its encoding is the planes' (else
    ``convert=True`` rounds it into them). ``whose`` (the target's, the
    session's) names both sides in a geometry refusal."""
    if encoding not in ENCODINGS:
        raise SnapshotMismatch("encoding", sorted(ENCODINGS), encoding)
    try:
        check_geometry(geometry, target.geometry)
    except SnapshotMismatch as e:
        if whose is None:
            raise
        raise SnapshotMismatch(f"{e.field} (expected: {whose[0]}; got: {whose[1]})",
                               e.expected, e.got) from None
    if isinstance(position, bool) or not isinstance(position, int) or not (
            0 <= position <= geometry.max_context):
        raise SnapshotMismatch("position", f"an int in [0, {geometry.max_context}]", position)
    if target.fingerprint is not None:
        check_model(model, target.fingerprint, target.model)
    if encoding != target.encoding and not convert:
        raise encoding_mismatch(encoding, target.encoding)


def check_start(geometry: MuseGeometry, position: int, layer: int, start: Any) -> int:
    """Layer ``layer``'s start against the cut a session at ``position`` holds;
    returns the layer's rows."""
    want, rows = expected_cut(geometry, layer, position)
    if start != want:
        raise SnapshotMismatch("start", want, start, layer, geometry.layer_kind(layer))
    return rows


def check_shape(fail: Callable[[str, Any, Any], None], shape: Tuple[int, ...], nbytes: int,
                rows: int, dims: Tuple[int, int], itemsize: int) -> None:
    """One tensor's shape and size: ``[rows, heads, dim]`` of ``itemsize`` bytes."""
    heads, dim = dims
    if len(shape) != 3:
        fail("shape", (rows, heads, dim), shape)
    if shape[0] != rows:
        fail("rows", rows, int(shape[0]))
    if shape[1] != heads:
        fail("kv_heads", heads, int(shape[1]))
    if shape[2] != dim:
        fail("head_dim", dim, int(shape[2]))
    want = rows * heads * dim * itemsize
    if nbytes != want:
        fail("bytes", want, int(nbytes))


def _failer(geometry: MuseGeometry, layer: int, name: str) -> Callable[[str, Any, Any], None]:
    kind = geometry.layer_kind(layer)

    def fail(field: str, expected: Any, got: Any) -> None:
        raise SnapshotMismatch(f"{name} {field}", expected, got, layer, kind)

    return fail


def check_cut(geometry: MuseGeometry, encoding: str, position: int, layer: int,
              cut: Any) -> None:
    """Layer ``layer``'s cut in memory: its type, start, and both tensors' type,
    dtype (the encoding's), shape and size."""
    if not isinstance(cut, LayerCut):
        raise SnapshotMismatch("type", "LayerCut", type(cut).__name__, layer,
                               geometry.layer_kind(layer))
    rows = check_start(geometry, position, layer, cut.start)
    dtype = ENCODINGS[encoding][0]
    for name in ("keys", "values"):
        x = getattr(cut, name)
        fail = _failer(geometry, layer, name)
        if not isinstance(x, mx.array):
            fail("type", "mlx.core.array", type(x).__name__)
        if x.dtype != dtype:
            fail(f"dtype (encoding {encoding})", str(dtype), str(x.dtype))
        check_shape(fail, tuple(x.shape), x.nbytes, rows, geometry.layer_dims(layer), dtype.size)


def check_cuts(geometry: MuseGeometry, encoding: str, position: int,
               layers: Sequence[Any]) -> None:
    """Every layer's cut (``check_cut``), and one per layer of ``geometry``."""
    if len(layers) != geometry.num_layers:
        raise SnapshotMismatch("layers", geometry.num_layers, len(layers))
    for i, cut in enumerate(layers):
        check_cut(geometry, encoding, position, i, cut)


def check_stored(geometry: MuseGeometry, encoding: str, position: int, layer: int, start: int,
                 tensors: Sequence[Tuple[str, Tuple[int, ...], int]]) -> int:
    """Layer ``layer`` of a session not yet read, from what its store says of it
    (a file's table): its start and each ``(name, shape, nbytes)`` (their
    dtypes are the table's to check). Returns the layer's rows."""
    rows = check_start(geometry, position, layer, start)
    for name, shape, nbytes in tensors:
        check_shape(_failer(geometry, layer, name), shape, nbytes, rows,
                    geometry.layer_dims(layer), ENCODINGS[encoding][0].size)
    return rows


# -- the install loop ---------------------------------------------------------------------


class Install:
    """The one install loop: each verified layer into its cache, as it comes.

    ``rollback=True`` (a list someone holds): each layer's state is held before
    it changes and every layer is evaluated at once, so a failure -- in the
    install, or anything of the caller's between layers -- is caught while
    ``undo`` can still put back every layer touched (the peak: two copies of
    the list). ``rollback=False`` (a new list no one else holds): nothing is
    held and each layer's evaluation overlaps the next; the caller drops the
    list on a failure. ``finish`` returns once every layer is in and evaluated;
    ``undo`` still puts the list back after it (a caller whose own last step
    fails: a handoff's final verdict)."""

    def __init__(self, cache: Sequence[Any], *, rollback: bool):
        self.cache = cache
        self.rollback = rollback
        self._undo: List[Tuple[Any, Any]] = []
        self._done: Set[int] = set()

    def layer(self, i: int, start: int, keys: mx.array, values: mx.array) -> None:
        """Install layer ``i``'s logical rows from ``start`` (checked by the gate),
        rounded to the planes' type where the gate allowed a conversion."""
        c = self.cache[i]
        if keys.dtype != c.dtype:  # convert=True: round to nearest even
            keys, values = keys.astype(c.dtype), values.astype(c.dtype)
        self._keep_undo_point(c)
        c.install(start, keys, values)
        self._installed(i, c)

    def placed(self, i: int, ring: Ring, keys: mx.array, values: mx.array) -> None:
        """Adopt planes already holding layer ``i``'s rows where ``ring`` puts them
        (``MuseKVCache.install_planes``: a load that read them in place)."""
        c = self.cache[i]
        self._keep_undo_point(c)
        c.install_planes(ring, keys, values)
        self._installed(i, c)

    def _keep_undo_point(self, c: Any) -> None:
        if self.rollback:  # kept first: a plane that fails half-way is put back too
            self._undo.append((c, c.undo_point()))

    def _installed(self, i: int, c: Any) -> None:
        self._done.add(i)
        if self.rollback:
            mx.eval(c.kv_state)  # a lazy failure surfaces here, while undo can act
        else:
            mx.async_eval(c.kv_state)

    def undo(self) -> None:
        """Put back every layer installed so far, as it was."""
        for c, point in reversed(self._undo):
            c.undo_to(point)
        self._undo.clear()
        self._done.clear()

    def finish(self) -> None:
        """Every layer is in (``SnapshotMismatch`` otherwise) and evaluated."""
        if len(self._done) != len(self.cache):
            raise SnapshotMismatch("layers installed", len(self.cache), len(self._done))
        mx.eval([a for c in self.cache for a in c.kv_state])


def restore_cuts(cache: Sequence[Any], target: Target, geometry: MuseGeometry, position: int,
                 encoding: str, model: Optional[Fingerprint], layers: Sequence[Any], *,
                 convert: bool = False) -> None:
    """The whole path for rows in memory (a snapshot, a store's rows): the gate
    (``check_session``, then every cut), then every layer installed into
    ``cache``, all or none (``rollback=True``)."""
    check_session(target, geometry, position, encoding, model, convert=convert)
    check_cuts(target.geometry, encoding, position, layers)
    install = Install(cache, rollback=True)
    try:
        for i, cut in enumerate(layers):
            install.layer(i, cut.start, cut.keys, cut.values)
        install.finish()
    except BaseException:
        install.undo()
        raise
