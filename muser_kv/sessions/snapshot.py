"""The logical cut of a cache list (``SessionSnapshot``) and its restore.
Invariants, each with a test (``tests/sessions/``):

* **Logical order out, never rotation.** A snapshot carries, per layer, the rows
  a restore needs in ascending logical order: a sliding layer exactly the last
  ``min(position, capacity)`` rows from ``position - count`` (``capacity =
  min(max_context, window)``), a global layer exactly ``[0, position)``. The
  physical rotation of a ring is not data: it is a function of the logical
  origin, so bytes on disk are layout-stable across backends and builds, and
  ``MuseKVCache.install`` rebuilds it.
* **A session carries its encoding and its model.** Planes are f16 (``f16le``,
  the production encoding) or bf16 (``bf16le``, for a model whose attention
  runs in bf16), and a snapshot records which, and the fingerprint of the
  model its rows came from (``muser_kv.sessions.fingerprint``). Changing the
  encoding rounds, except the exact widening to ``f32le`` (an interchange
  file), so it needs ``convert=True``; the restore gate
  (``muser_kv.sessions.restore``) refuses another encoding or another model
  likewise, so two runtimes never silently share state only one of them
  defined.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import mlx.core as mx

from muser_kv.core.geometry import MuseGeometry
from muser_kv.sessions import restore
from muser_kv.sessions.fingerprint import model_fingerprint
from muser_kv.sessions.format import (
    ENCODINGS,
    F32LE,
    SnapshotMismatch,
    encoding_mismatch,
    plane_encoding,
)
from muser_kv.sessions.restore import LayerCut, cache_geometry


@dataclass(frozen=True, eq=False)
class SessionSnapshot:
    """A complete restorable cut of one session.

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
        snapshot = lazy_capture(cache, model)
        mx.eval([a for cut in snapshot.layers for a in (cut.keys, cut.values)])
        return snapshot

    # -- the gate ---------------------------------------------------------------

    def check(self, geometry: MuseGeometry) -> None:
        """Fail-closed shape gate against ``geometry`` (``restore``'s, with no model
        and this snapshot's own encoding): raises ``SnapshotMismatch`` naming the
        layer, field, expected and got, or returns having changed nothing."""
        restore.check_session(restore.Target(geometry, self.encoding), self.geometry,
                              self.position, self.encoding, None)
        restore.check_cuts(geometry, self.encoding, self.position, self.layers)

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
            raise encoding_mismatch(self.encoding, encoding)
        dtype = ENCODINGS[encoding][0]
        cuts = tuple(LayerCut(c.start, c.keys.astype(dtype), c.values.astype(dtype))
                     for c in self.layers)
        mx.eval([a for c in cuts for a in (c.keys, c.values)])
        return dataclasses.replace(self, encoding=encoding, layers=cuts)

    # -- restore ------------------------------------------------------------------

    def install(self, cache: Sequence[Any], *, convert: bool = False,
                allow_other_model: bool = False) -> None:
        """Restore into a live cache list, all layers or none, through the one
        restore path (``muser_kv.sessions.restore``).

        The gate checks geometry, position, model, encoding and every layer
        first; then each layer is installed at rotation ``start % capacity``
        (rows of another encoding rounded into the planes, with ``convert``).
        Should a plane still refuse mid-way (nothing the gate knows about), the
        layers already installed get their previous planes and rings back, so
        the cache is as it was. That costs holding the replaced planes until
        the last layer is in (peak: two copies of the cache). When the list
        knows its model, the snapshot must come from that model
        (``ModelMismatch`` otherwise, unless ``allow_other_model``)."""
        target = restore.Target.of_list(cache, allow_other_model=allow_other_model)
        restore.restore_cuts(cache, target, self.geometry, self.position, self.encoding,
                             self.model, self.layers, convert=convert)

    @property
    def nbytes(self) -> int:
        return sum(c.keys.nbytes + c.values.nbytes for c in self.layers)


def lazy_capture(cache: Sequence[Any], model: Any = None) -> SessionSnapshot:
    """``SessionSnapshot.capture`` with the cuts not yet evaluated: each is a
    gather of the planes as they are now (MLX arrays are values: a later store
    into the cache makes new planes, never changes these), so evaluating the
    cuts later, one by one while earlier ones are written, still gives this
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
    model = model if model is not None else restore.list_model(cache)
    fingerprint = model_fingerprint(model) if model is not None else None
    snapshot = SessionSnapshot(geometry, offsets[0], plane_encoding(cache[0].dtype), tuple(cuts),
                               fingerprint)
    snapshot.check(geometry)
    return snapshot


def restore_into(cache: Sequence[Any], snapshot: SessionSnapshot, *, convert: bool = False,
                 allow_other_model: bool = False) -> None:
    """``snapshot.install(cache, convert=convert, allow_other_model=allow_other_model)``.

    ``snapshot`` is a ``SessionSnapshot``, never a file: ``read_session(path)``
    reads one, verified (``load_session(path, model)`` builds a new list
    holding it). Anything else, a path included, is refused (``TypeError``)
    before the cache is touched."""
    if not isinstance(snapshot, SessionSnapshot):
        came = (f"the path {os.fspath(snapshot)!r}"
                if isinstance(snapshot, (str, bytes, os.PathLike)) else
                f"a {type(snapshot).__name__}")
        raise TypeError(f"restore_into takes a SessionSnapshot, got {came}: read a session "
                        "file's with "
                        "muser_kv.read_session(path), or load it into a new cache list with "
                        "muser_kv.load_session(path, model)")
    snapshot.install(cache, convert=convert, allow_other_model=allow_other_model)
