"""``load_session``: a session file into a new cache list for a model, bit for bit,
or an exception (never a partially restored cache)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from muser_kv.caches.base import MuseKVCache
from muser_kv.caches.factory import make_cache_for
from muser_kv.core.counts import optional_count
from muser_kv.core.geometry import MuseGeometry, context_limit
from muser_kv.core.precision import DtypeLike, plane_dtype_for
from muser_kv.core.ring import Ring
from muser_kv.sessions import restore
from muser_kv.sessions.fingerprint import model_fingerprint
from muser_kv.sessions.format import (
    PathLike,
    SessionHeader,
    SnapshotMismatch,
    plane_encoding,
    tensor_names,
)
from muser_kv.sessions.reading import Placement, Reader, host_places, host_zeros


def _placements(cache: Sequence[MuseKVCache], h: SessionHeader, rows: Sequence[int],
                ) -> Tuple[List[Ring], Dict[str, Placement]]:
    """For every layer: the ring its install of ``rows[layer]`` rows leaves and
    two new zero planes its rows are read into, of the shape its install would
    allocate (``install_shape``: the one sizing rule)."""
    rings, planes = [], {}
    for layer, c in enumerate(cache):
        ring = c.install_ring(h.starts[layer], rows[layer])
        rings.append(ring)
        runs = tuple(ring.live_runs())
        for name in tensor_names(layer):
            planes[name] = (host_zeros(c.install_shape(ring), c.dtype), c.layout, runs)
    return rings, {name: Placement(plane.result(), layout, runs)
                   for name, (plane, layout, runs) in planes.items()}


def load_session(path: PathLike, model: Any, max_context: Optional[int] = None, *,
                 convert: bool = False, plane_dtype: DtypeLike = None,
                 allow_other_model: bool = False, preallocate: bool = False) -> List[Any]:
    """A new cache list for ``model`` holding the session in ``path``, restored
    bit for bit, or an exception (never a partially restored cache).

    ``max_context`` defaults to the file's; any other value is another geometry
    and is refused, as is a model whose layers, window or heads differ. The
    planes are of the model's type (``plane_dtype`` overrides it, as in
    ``make_prompt_cache``); a file of another encoding needs ``convert=True``.
    The session must come from ``model`` itself (by fingerprint: its config and
    a sample of its weights); a file from another model, or one that records no
    model, is refused (``ModelMismatch``) unless ``allow_other_model=True``.
    Global planes are sized for the rows they hold and grow from there, as
    ``make_prompt_cache``'s do; ``preallocate=True`` gives them the whole
    ``max_context`` now, as ``make_prompt_cache(..., preallocate=True)`` does.

    Everything the header decides (geometry, position, model, encoding) and
    every layer's start and shapes pass the restore gate
    (``muser_kv.sessions.restore``) before the first tensor is read; each layer
    is installed by its install loop, into a list no one else holds, as soon as
    both its tensors are verified, so installing overlaps reading, and the list
    is returned only once every layer is in."""
    max_context = optional_count(max_context, "max_context", minimum=1)
    args = getattr(model, "args", None)
    if args is None:
        raise TypeError(
            f"load_session needs an mlx-lm model with .args, got {type(model).__name__}")
    with Reader(path) as reader:
        h = reader.header
        context = h.geometry.max_context if max_context is None else max_context
        limit = context_limit(model)
        if limit is not None and context > limit:
            raise SnapshotMismatch(
                f"geometry.max_context (expected: within the model's max_position_embeddings; "
                f"got: file {os.fspath(path)})", f"<= {limit}", context)
        model_geometry = MuseGeometry.from_model(model, context)
        dtype = plane_dtype_for(model, plane_dtype)
        target = restore.Target(restore.kv_geometry(model_geometry), plane_encoding(dtype),
                                None if allow_other_model else model_fingerprint(model),
                                f"the model ({type(model).__name__})")
        restore.check_session(target, h.geometry, h.position, h.encoding, h.model,
                              convert=convert, whose=("the model's", f"file {os.fspath(path)}"))
        # planes unallocated: each layer's install makes its own
        cache = make_cache_for(model_geometry, plane_dtype=dtype,
                               model=model, allocate=False, preallocate=preallocate)
        # every layer's start and shapes, from the table, before a byte is read
        rows = []
        for layer in range(len(cache)):
            entries = [reader.entries[t] for t in tensor_names(layer)]
            rows.append(restore.check_stored(
                target.geometry, h.encoding, h.position, layer, h.starts[layer],
                [(name, e.shape, e.nbytes) for name, e in zip(("keys", "values"), entries)]))
        rings = None
        placements = None
        if h.encoding == target.encoding and host_places():
            rings, placements = _placements(cache, h, rows)
        install = restore.Install(cache, rollback=False)  # a new list: dropped on a failure
        for layer, start, k, v in reader.layers(placements):  # reading starts now
            if rings is not None:  # read straight into this layer's planes
                install.placed(layer, rings[layer], k, v)
            else:
                install.layer(layer, start, k, v)
    install.finish()  # the reader yields every layer or raises
    return cache
