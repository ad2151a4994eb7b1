"""The logical cut of a cache list and its fail-closed, rotation-preserving
restore (seeds Ch 23.4). Invariants, each with a test (``tests/sessions/``):

* **Logical order out, never rotation.** A snapshot carries, per layer, the rows
  a restore needs in ascending logical order: a sliding layer exactly the last
  ``min(position, capacity)`` rows from ``position - count`` (``capacity =
  min(max_context, window)``), a global layer exactly ``[0, position)``. The
  physical rotation of a ring is not data: it is a function of the logical
  origin, so bytes on disk are layout-stable across backends and builds.
* **Rotation rebuilt on install.** ``MuseKVCache.install`` puts a ring's rows back at
  ``origin_logical % capacity``, where sequential appends would have left them.
  Attention sums rows in physical order and float addition is not associative,
  so this is what makes a restored session replay the live one bit for bit.
* **Fail closed, all or nothing.** Every layer is checked (rows, start, bytes,
  dtype vs encoding, head geometry, layer kind) and converted *before* the first
  plane changes; a refusal names the layer, the field, the expected and the got
  value. ``load_session`` only ever returns a fully restored cache.
* **A session carries its encoding.** Planes are f16 (``f16le``, the production
  encoding) or bf16 (``bf16le``, for a model whose attention runs in bf16), and
  a snapshot records which. One of another encoding -- bf16 into f16 planes, f16
  into bf16, or an ``f32le`` interchange file (e.g. from a CPU oracle) -- is
  refused (``EncodingMismatch``; ``ProductionF16Required`` when the planes are
  f16) unless the caller asks for the conversion (``convert=True``: round to
  nearest even), so two runtimes never silently share state only one of them
  defined.
* **A session knows its model.** The header records the fingerprint of the
  model whose cache was saved (``muser_kv.fingerprint``: its config and a few
  small slices of every weight); a load into a model with another fingerprint,
  or from a file that records none, is refused (``ModelMismatch``) unless the
  caller passes ``allow_other_model=True``.

The file records the *KV geometry*: every ``MuseGeometry`` field that shapes the
stored state (layer count and kinds, window, max_context, KV heads, head_dim).
The query head count never enters the KV state and a cache does not know it, so
a snapshot normalizes ``num_heads`` to ``kv_heads`` and comparisons ignore it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import mlx.core as mx

from muser_kv.caches.base import MuseKVCache
from muser_kv.core.geometry import LayerKind, MuseGeometry
from muser_kv.sessions import tensorfile
from muser_kv.sessions.fingerprint import differs, model_fingerprint
from muser_kv.sessions.format import (
    ENCODINGS,
    F32LE,
    KV_EXTRA_FIELDS,
    KV_FIELDS,
    ModelMismatch,
    SnapshotMismatch,
    _encoding_mismatch,
    kv_num_heads,
    plane_encoding,
    tensor_names,
)

# -- the logical cut ----------------------------------------------------------


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
    """``geometry`` with ``num_heads`` normalized to its K/V heads (see module doc:
    the least multiple of both kinds' where they differ)."""
    return dataclasses.replace(geometry, num_heads=kv_num_heads(geometry.kv_heads,
                                                                geometry.global_kv_heads))


def expected_cut(geometry: MuseGeometry, layer: int, position: int) -> Tuple[int, int]:
    """``(start, rows)`` a complete restorable cut holds for ``layer`` at ``position``."""
    if geometry.layer_kind(layer) is LayerKind.SLIDING:
        count = min(position, geometry.capacity(layer))
        return position - count, count
    return 0, position


def _check_geometry(have: MuseGeometry, want: MuseGeometry) -> None:
    for name in KV_FIELDS + KV_EXTRA_FIELDS:
        got, expected = getattr(have, name), getattr(want, name)
        if got != expected:
            if name == "layer_kinds":
                expected = [k.value for k in expected]
                got = [k.value for k in got]
            raise SnapshotMismatch(f"geometry.{name}", expected, got)


def _check_tensor(name: str, x: Any, rows: int, geometry: MuseGeometry, encoding: str,
                  layer: int, kind: LayerKind) -> None:
    def fail(field: str, expected: Any, got: Any) -> None:
        raise SnapshotMismatch(f"{name} {field}", expected, got, layer, kind)

    dtype = ENCODINGS[encoding][0]
    if not isinstance(x, mx.array):
        fail("type", "mlx.core.array", type(x).__name__)
    if x.dtype != dtype:
        fail(f"dtype (encoding {encoding})", str(dtype), str(x.dtype))
    _check_shape(fail, tuple(x.shape), x.nbytes, rows, geometry.layer_dims(layer), dtype.size)


def _check_shape(fail: Any, shape: Tuple[int, ...], nbytes: int, rows: int,
                 dims: Tuple[int, int], itemsize: int) -> None:
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


def _check_entries(geometry: MuseGeometry, encoding: str, position: int, layer: int,
                   start: int, entries: Mapping[str, tensorfile.Entry]) -> int:
    """``_check_cut`` for a layer not yet read, from the file's table: its start
    and both tensors' shapes and sizes (their dtypes are the table checks').
    Returns the layer's rows."""
    kind = geometry.layer_kind(layer)
    want, rows = expected_cut(geometry, layer, position)
    if start != want:
        raise SnapshotMismatch("start", want, start, layer, kind)
    for name, tensor in zip(("keys", "values"), tensor_names(layer)):
        def fail(field: str, expected: Any, got: Any, name: str = name) -> None:
            raise SnapshotMismatch(f"{name} {field}", expected, got, layer, kind)

        e = entries[tensor]
        _check_shape(fail, e.shape, e.nbytes, rows, geometry.layer_dims(layer),
                     ENCODINGS[encoding][0].size)
    return rows


def _check_whole(have: MuseGeometry, encoding: str, position: Any, geometry: MuseGeometry) -> None:
    """The gate's checks that need no rows: encoding, geometry, position."""
    if encoding not in ENCODINGS:
        raise SnapshotMismatch("encoding", sorted(ENCODINGS), encoding)
    _check_geometry(have, geometry)
    if isinstance(position, bool) or not isinstance(position, int) or not (
            0 <= position <= geometry.max_context):
        raise SnapshotMismatch("position", f"an int in [0, {geometry.max_context}]", position)


def _check_cut(geometry: MuseGeometry, encoding: str, position: int, layer: int,
               cut: Any) -> None:
    """The gate for layer ``layer``'s cut: its start and both tensors."""
    kind = geometry.layer_kind(layer)
    if not isinstance(cut, LayerCut):
        raise SnapshotMismatch("type", "LayerCut", type(cut).__name__, layer, kind)
    start, rows = expected_cut(geometry, layer, position)
    if cut.start != start:
        raise SnapshotMismatch("start", start, cut.start, layer, kind)
    for name in ("keys", "values"):
        _check_tensor(name, getattr(cut, name), rows, geometry, encoding, layer, kind)


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
        num_layers=len(planes), window=first._window, max_context=first.max_context,
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


@dataclass(frozen=True, eq=False)
class SessionSnapshot:
    """A complete restorable cut of one session (seeds 23.4's SessionCacheSnapshot).

    ``position`` is the logical position of the next token (every layer's
    ``offset``); ``layers[i]`` holds layer ``i``'s rows in logical order, f16 for
    ``f16le``, bf16 for ``bf16le``, f32 for ``f32le``."""

    geometry: MuseGeometry
    position: int
    encoding: str
    layers: Tuple[LayerCut, ...]
    #: the fingerprint of the model the session came from (None: not known)
    model: Optional[Dict[str, str]] = None

    # -- building -------------------------------------------------------------

    @classmethod
    def capture(cls, cache: Sequence[Any], model: Any = None) -> "SessionSnapshot":
        """Cut a live cache list. Every layer must be at the same position and hold
        exactly its contract rows; the rows are evaluated now (a point-in-time copy).
        The snapshot records the fingerprint of ``model``, or of the model the
        list was built for (``make_prompt_cache(model)``), if either is known."""
        snapshot = cls._capture(cache, model)
        mx.eval([a for cut in snapshot.layers for a in (cut.keys, cut.values)])
        return snapshot

    @classmethod
    def _capture(cls, cache: Sequence[Any], model: Any = None) -> "SessionSnapshot":
        """``capture`` with the cuts not yet evaluated: each is a gather of the
        planes as they are now (MLX arrays are values: a later store into the
        cache makes new planes, never changes these), so evaluating the cuts
        later, one by one while earlier ones are written, still gives this
        point in time."""
        geometry = cache_geometry(cache)
        offsets = [c.offset for c in cache]
        if len(set(offsets)) != 1:
            odd = next(i for i, o in enumerate(offsets) if o != offsets[0])
            raise SnapshotMismatch("position (cache offset)", offsets[0], offsets[odd], odd,
                                   geometry.layer_kind(odd))
        cuts = []
        for c in cache:
            start, keys, values = c.snapshot()
            cuts.append(LayerCut(int(start), keys, values))
        model = model if model is not None else _list_model(cache)
        fingerprint = model_fingerprint(model) if model is not None else None
        snapshot = cls(geometry, offsets[0], plane_encoding(cache[0].dtype), tuple(cuts),
                       fingerprint)
        snapshot.check(geometry)
        return snapshot

    # -- the gate ---------------------------------------------------------------

    def check(self, geometry: MuseGeometry) -> None:
        """Fail-closed shape gate against ``geometry``: raises ``SnapshotMismatch``
        naming the layer, field, expected and got, or returns having changed nothing."""
        _check_whole(self.geometry, self.encoding, self.position, geometry)
        if len(self.layers) != geometry.num_layers:
            raise SnapshotMismatch("layers", geometry.num_layers, len(self.layers))
        for i, cut in enumerate(self.layers):
            _check_cut(geometry, self.encoding, self.position, i, cut)

    # -- encodings --------------------------------------------------------------

    def encoded(self, encoding: str, *, convert: bool = False) -> "SessionSnapshot":
        """This snapshot in ``encoding``. Widening to f32 is exact; anything else
        rounds (f32 -> f16 / bf16, f16 <-> bf16: nearest even) and so needs
        ``convert=True``, else ``EncodingMismatch`` (``ProductionF16Required`` into f16)."""
        for have in (encoding, self.encoding):
            if have not in ENCODINGS:
                raise SnapshotMismatch("encoding", sorted(ENCODINGS), have)
        if encoding == self.encoding:
            return self
        if encoding != F32LE and not convert:
            raise _encoding_mismatch(self.encoding, encoding)
        dtype = ENCODINGS[encoding][0]
        cuts = tuple(LayerCut(c.start, c.keys.astype(dtype), c.values.astype(dtype))
                     for c in self.layers)
        mx.eval([a for c in cuts for a in (c.keys, c.values)])
        return dataclasses.replace(self, encoding=encoding, layers=cuts)

    # -- restore ------------------------------------------------------------------

    def install(self, cache: Sequence[Any], *, convert: bool = False,
                allow_other_model: bool = False) -> None:
        """Restore into a live cache list, all layers or none.

        Gate and convert every layer first; then install each at rotation
        ``start % capacity``. Should a plane still refuse mid-way (nothing the gate
        knows about), the layers already installed get their previous planes and
        rings back, so the cache is as it was. That costs holding the replaced
        planes until the last layer is in (peak: two copies of the cache).
        When the list knows its model, the snapshot must come from that model
        (``ModelMismatch`` otherwise, unless ``allow_other_model``)."""
        target = cache_geometry(cache)
        ready = self._installable(target, plane_encoding(cache[0].dtype), convert)
        model = _list_model(cache)
        if model is not None and not allow_other_model:
            check_model(self.model, model_fingerprint(model), "the cache list's model")
        _install(cache, ready, rollback=True)

    def _installable(self, target: MuseGeometry, encoding: str,
                     convert: bool) -> "SessionSnapshot":
        self.check(target)
        ready = self.encoded(encoding, convert=convert)
        ready.check(target)
        return ready

    @property
    def nbytes(self) -> int:
        return sum(c.keys.nbytes + c.values.nbytes for c in self.layers)


def restore_into(cache: Sequence[Any], snapshot: SessionSnapshot, *, convert: bool = False,
                 allow_other_model: bool = False) -> None:
    """``snapshot.install(cache, convert=convert, allow_other_model=allow_other_model)``."""
    snapshot.install(cache, convert=convert, allow_other_model=allow_other_model)


def _list_model(cache: Sequence[Any]) -> Any:
    """The model a cache list was built for, when every layer belongs to one
    list that knows it (``make_prompt_cache(model)``)."""
    lists = {id(getattr(c, "_list", None)): getattr(c, "_list", None) for c in cache}
    if len(lists) != 1:
        return None
    group = next(iter(lists.values()))
    return group.model if group is not None else None


def check_model(recorded: Optional[Mapping[str, str]], fingerprint: Mapping[str, str],
                target: str) -> None:
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


def _install(cache: Sequence[Any], ready: SessionSnapshot, *, rollback: bool) -> None:
    """Install every layer through its cache (``MuseKVCache.install``: rotation
    rebuilt, retained rows and checkpoints' claims dropped); should one fail,
    the layers already installed get back what they held."""
    previous = [c.hold() for c in cache] if rollback else []
    done = 0
    try:
        for c, cut in zip(cache, ready.layers):
            done += 1  # counted first: a plane that fails half-way is rolled back too
            c.install(cut.start, cut.keys, cut.values)
            mx.eval(c.kv_state)  # a lazy failure surfaces here, inside the try
    except BaseException:
        for c, held in zip(cache[:done], previous[:done]):
            c.release(held)
        raise
