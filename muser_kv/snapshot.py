"""Session snapshots: the logical cut, one safetensors file per session, and a
fail-closed, rotation-preserving restore (seeds Ch 23.4).

Invariants, each with a test (``tests/test_snapshot.py``):

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
* **Atomic save.** A session file is written to a temporary file in the target's
  directory, fsynced, then ``os.replace``-d onto the target and the directory
  fsynced: a reader sees the old file or the new one, never a torn one, and a
  failed save leaves the old file untouched and removes its temporary. A save
  killed outright cannot clean up, so the next save or load of the same target
  removes that target's stale temporaries (those of no live process; never any
  other file). The tensors are written straight from MLX's buffers while
  other threads hash them (and the kernel is asked to start writing each back
  as soon as it is out), and the header (which holds their digests) last,
  into the space reserved for it: digests are fixed-length hex, so the
  header's length is known before the first tensor is written.
* **Verified load.** The header carries a sha256 over every other header field
  (``header_sha256``), checked before any field is trusted, and every tensor a
  digest of its little-endian bytes (``TENSOR_DIGESTS``: XXH3-128 from version
  3; sha256 in version 2 files, which still load); format, version, encoding,
  geometry, tensor set and dtypes are all checked before a single row is read.
  A reader thread reads the tensors in chunks into reused staging buffers
  (asking the kernel to read the next two ahead), the caller's thread copies
  each into an MLX array (the upload), and a pool hashes that MLX array's own
  bytes, so reading, upload and verification overlap, and what is verified is
  what is installed. Nothing verified late
  reaches the caller: ``read_session`` returns once every digest matched, and
  ``load_session`` installs each verified layer into a new cache list that it
  returns only once every layer is in. Whatever is wrong with a file --
  truncated, bit-flipped, nested past reason, of an unknown dtype -- the error
  is a ``SnapshotError`` naming what was expected and what came, never a
  parser's own exception.
* **What the digests protect against: accidents.** Bit rot, torn or truncated
  writes, a file edited or swapped by mistake (a random change goes unnoticed
  with a chance of about 2^-128; XXH3 is no CRC, so no error pattern is
  caught with certainty). XXH3-128 is not cryptographic, and no digest in
  the file is a signature: whoever can write the file can recompute every
  digest (sha256 included), so a session file is as trustworthy as the place
  it is kept.
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
import errno
import hashlib
import json
import os
import queue
import re
import secrets
import stat
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np
import xxhash

from . import kernels, managed, tensorfile
from .cache import make_cache_for
from .counts import optional_count
from .fingerprint import check_fingerprint, differs, model_fingerprint
from .geometry import LayerKind, MuseGeometry
from .cache import MuseKVCache
from .precision import DtypeLike, plane_dtype_for
from .ring import Ring, Run

FORMAT = "muser-kv-session"
#: The version written. Version 2 added the header checksum and the model
#: fingerprint (version 1 files, with neither, are refused: their header cannot
#: be verified); version 3 changed only the tensors' digest, sha256 -> XXH3-128
#: (sha256 hashes ~1 GB/s on a core, slower than the disks sessions live on).
VERSION = "3"
#: version read -> the digest of every tensor's bytes in files of that version
#: (the header's own checksum, ``header_sha256``, is sha256 in both).
TENSOR_DIGESTS = {"2": "sha256", "3": "xxh3-128"}
#: digest -> the length of its lowercase hex
DIGEST_HEX = {"sha256": 64, "xxh3-128": 32}
#: The digest this version writes.
TENSOR_DIGEST = TENSOR_DIGESTS[VERSION]
F16LE = "f16le"
BF16LE = "bf16le"
F32LE = "f32le"
#: encoding -> (MLX dtype in memory, safetensors dtype on disk)
ENCODINGS: Dict[str, Tuple[Any, str]] = {
    F16LE: (mx.float16, "F16"),
    BF16LE: (mx.bfloat16, "BF16"),
    F32LE: (mx.float32, "F32"),
}
#: plane dtype -> the encoding its snapshots carry
PLANE_ENCODINGS = {mx.float16: F16LE, mx.bfloat16: BF16LE}


def plane_encoding(dtype: Any) -> str:
    """The encoding of planes of ``dtype`` (f16 -> ``f16le``, bf16 -> ``bf16le``)."""
    return PLANE_ENCODINGS[dtype]
#: The geometry fields that shape the stored KV state (``num_heads`` does not).
KV_FIELDS = ("num_layers", "layer_kinds", "window", "max_context", "kv_heads", "head_dim")
#: The header field holding the sha256 over every other header field.
HEADER_CHECKSUM = "header_sha256"
#: Header keys every session file carries (``__metadata__``, str -> str), and no others.
HEADER_KEYS = ("format", "version", "geometry", "position", "encoding", "starts", "checksums",
               "user", "model", HEADER_CHECKSUM)

PathLike = Union[str, "os.PathLike[str]"]


# -- errors -------------------------------------------------------------------


class SnapshotError(ValueError):
    """Base of every snapshot refusal."""


class SnapshotMismatch(SnapshotError):
    """A snapshot does not fit its target: names the layer, field, expected, got."""

    def __init__(self, field: str, expected: Any, got: Any, layer: Optional[int] = None,
                 kind: Optional[LayerKind] = None):
        self.field = field
        self.expected = expected
        self.got = got
        self.layer = layer
        self.kind = kind
        where = "session snapshot"
        if layer is not None:
            where += f" layer {layer}" + (f" ({LayerKind(kind).value})" if kind is not None else "")
        super().__init__(f"{where}: {field} expected {expected!r}, got {got!r}")

    def __reduce__(self):  # picklable despite the keyword-rich constructor
        return type(self), (self.field, self.expected, self.got, self.layer, self.kind)


class EncodingMismatch(SnapshotError):
    """A snapshot whose encoding is not the target planes' (``convert=True`` rounds it)."""

    def __init__(self, encoding: str, expected: str = F16LE):
        self.encoding = encoding
        self.expected = expected
        super().__init__(
            f"session snapshot is {encoding}, but the live planes are "
            f"{ENCODINGS[expected][0]} and install only {expected}: pass convert=True "
            f"to round it to {expected} (nearest even)"
        )

    def __reduce__(self):
        return type(self), (self.encoding, self.expected)


class ProductionF16Required(EncodingMismatch):
    """A snapshot of another encoding (f32 interchange, or bf16) offered to f16
    production planes."""

    def __init__(self, encoding: str, expected: str = F16LE):
        super().__init__(encoding, F16LE)


class ModelMismatch(SnapshotMismatch):
    """A session offered to a model other than the one it was saved from (by
    fingerprint), or one that records no model: ``allow_other_model=True``
    loads it anyway."""

    def __reduce__(self):
        return type(self), (self.field, self.expected, self.got, self.layer, self.kind)


class SessionMetadataError(SnapshotError, TypeError):
    """User metadata that cannot be stored as JSON, exactly."""


def _encoding_mismatch(encoding: str, expected: str) -> EncodingMismatch:
    return ProductionF16Required(encoding) if expected == F16LE else EncodingMismatch(
        encoding, expected)


class SessionFileError(SnapshotError):
    """A session file that cannot be trusted (unreadable, truncated, unknown format
    or version, wrong encoding, missing or corrupted tensor)."""

    def __init__(self, path: PathLike, problem: str):
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"session file {self.path}: {problem}")

    def __reduce__(self):
        return type(self), (self.path, self.problem)


# -- the logical cut ----------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LayerCut:
    """One layer's rows, ``[rows, kv_heads, head_dim]`` in logical order from ``start``."""

    start: int
    keys: mx.array
    values: mx.array

    @property
    def rows(self) -> int:
        shape = getattr(self.keys, "shape", ())
        return int(shape[0]) if len(shape) else 0


def kv_geometry(geometry: MuseGeometry) -> MuseGeometry:
    """``geometry`` with ``num_heads`` normalized to ``kv_heads`` (see module doc)."""
    return dataclasses.replace(geometry, num_heads=geometry.kv_heads)


def expected_cut(geometry: MuseGeometry, layer: int, position: int) -> Tuple[int, int]:
    """``(start, rows)`` a complete restorable cut holds for ``layer`` at ``position``."""
    if geometry.layer_kind(layer) is LayerKind.SLIDING:
        count = min(position, geometry.capacity(layer))
        return position - count, count
    return 0, position


def _check_geometry(have: MuseGeometry, want: MuseGeometry) -> None:
    for name in KV_FIELDS:
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
    _check_shape(fail, tuple(x.shape), x.nbytes, rows, geometry, dtype.size)


def _check_shape(fail: Any, shape: Tuple[int, ...], nbytes: int, rows: int,
                 geometry: MuseGeometry, itemsize: int) -> None:
    if len(shape) != 3:
        fail("shape", (rows, geometry.kv_heads, geometry.head_dim), shape)
    if shape[0] != rows:
        fail("rows", rows, int(shape[0]))
    if shape[1] != geometry.kv_heads:
        fail("kv_heads", geometry.kv_heads, int(shape[1]))
    if shape[2] != geometry.head_dim:
        fail("head_dim", geometry.head_dim, int(shape[2]))
    want = rows * geometry.kv_dim * itemsize
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
        _check_shape(fail, e.shape, e.nbytes, rows, geometry, ENCODINGS[encoding][0].size)
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
        for name in ("_window", "max_context", "kv_heads", "head_dim"):
            if getattr(p, name) != getattr(first, name):
                raise SnapshotMismatch(f"cache {name}", getattr(first, name), getattr(p, name),
                                       i, p.kind)
    for i, p in enumerate(planes):
        if p.dtype != first.dtype:
            raise SnapshotMismatch("plane dtype", str(first.dtype), str(p.dtype), i, p.kind)
    geometry = MuseGeometry(
        num_layers=len(planes), window=first._window, max_context=first.max_context,
        num_heads=first.kv_heads, kv_heads=first.kv_heads, head_dim=first.head_dim,
        layer_kinds=tuple(p.kind for p in planes),
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


# -- the file -----------------------------------------------------------------


def tensor_names(layer: int) -> Tuple[str, str]:
    return f"layers.{layer}.keys", f"layers.{layer}.values"


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"tensor digest expected one of {sorted(DIGEST_HEX)}, got {algorithm!r}")


def digest_bytes(data: Any, algorithm: str = TENSOR_DIGEST) -> str:
    """``algorithm``'s lowercase hex digest of a C-contiguous buffer's bytes, in one
    call (both hashes let go of the GIL while they hash a large buffer)."""
    h = _hasher(algorithm)
    h.update(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return h.hexdigest()


def tensor_digest(array: np.ndarray, algorithm: str = TENSOR_DIGEST) -> str:
    """``algorithm`` (hex) of an array's raw little-endian bytes."""
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return digest_bytes(a.view(np.uint8).reshape(-1), algorithm)


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def tensor_digests(arrays: Mapping[str, np.ndarray],
                   algorithm: str = TENSOR_DIGEST) -> Dict[str, str]:
    """``tensor_digest`` of every array, on a few threads (the hashes let go of
    the GIL, so a full-depth session's 104 tensors hash in parallel)."""
    names = list(arrays)
    if not names:
        return {}
    with ThreadPoolExecutor(min(len(names), _workers())) as pool:
        return dict(zip(names, pool.map(lambda n: tensor_digest(arrays[n], algorithm), names)))


def geometry_to_json(geometry: MuseGeometry) -> str:
    g = {name: getattr(geometry, name) for name in KV_FIELDS}
    g["layer_kinds"] = [k.value for k in geometry.layer_kinds]
    return json.dumps(g, sort_keys=True, separators=(",", ":"))


def header_digest(metadata: Mapping[str, str]) -> str:
    """The ``header_sha256`` of a header: sha256 (hex) of the compact, ASCII
    JSON array of ``[key, value]`` pairs of every other field, sorted by key.
    It covers every byte of every field's key and value, so no field can change
    -- nor one appear or go -- without it changing."""
    pairs = sorted([k, v] for k, v in metadata.items() if k != HEADER_CHECKSUM)
    text = json.dumps(pairs, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _show(value: Any) -> str:
    """A short repr of a value read from a file, safe at any nesting depth."""
    return tensorfile.show(value)


def _json(metadata: Mapping[str, str], key: str, path: PathLike) -> Any:
    """A header field's JSON value; anything that does not parse (malformed,
    nested past what the parser takes, numbers past its limits) is refused."""
    try:
        return json.loads(metadata[key])
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise SessionFileError(path, f"header field {key!r}: expected JSON, got text that is "
                                     f"not ({why})") from None


def _geometry_from_json(metadata: Mapping[str, str], path: PathLike) -> MuseGeometry:
    g = _json(metadata, "geometry", path)
    try:
        if not isinstance(g, dict) or set(g) != set(KV_FIELDS):
            raise ValueError(f"fields expected {sorted(KV_FIELDS)}, got "
                             f"{_show(sorted(g)) if isinstance(g, dict) else type(g).__name__}")
        if not isinstance(g["layer_kinds"], list):
            raise ValueError(f"layer_kinds expected a list, got {type(g['layer_kinds']).__name__}")
        g = dict(g, num_heads=g["kv_heads"], layer_kinds=tuple(g["layer_kinds"]))
        return MuseGeometry(**g)
    except (ValueError, TypeError, KeyError) as e:
        raise SessionFileError(path, f"bad geometry in header: {e}") from None


@dataclass(frozen=True)
class SessionHeader:
    """The parsed ``__metadata__`` of a session file."""

    format: str
    version: str
    geometry: MuseGeometry
    position: int
    encoding: str
    starts: Tuple[int, ...]
    checksums: Dict[str, str]
    user: Dict[str, Any]
    model: Optional[Dict[str, str]] = None

    @property
    def tensor_names(self) -> List[str]:
        return [n for i in range(self.geometry.num_layers) for n in tensor_names(i)]

    @property
    def digest(self) -> str:
        """The digest of this file's tensors (``TENSOR_DIGESTS[version]``)."""
        return TENSOR_DIGESTS[self.version]


def parse_header(metadata: Optional[Mapping[str, str]], path: PathLike) -> SessionHeader:
    """Check and parse a session file's header; ``SessionFileError`` names what is wrong.

    Format and version are compared with constants first (so a file that is
    not a session, or of another version, says so); then the header checksum
    is verified, before any other field is read."""
    metadata = metadata or {}
    fmt = metadata.get("format")
    if fmt != FORMAT:
        raise SessionFileError(path, f"format expected {FORMAT!r}, got {_show(fmt)}")
    version = metadata.get("version")
    if version not in TENSOR_DIGESTS:
        why = (" (version 1 files carry no header checksum and no model fingerprint, so "
               "their header cannot be verified: rebuild the session from its prompt)"
               if version == "1" else "")
        raise SessionFileError(path, f"unsupported version: expected one of "
                                     f"{sorted(TENSOR_DIGESTS)}, got {_show(version)}{why}")
    recorded = metadata.get(HEADER_CHECKSUM)
    if not isinstance(recorded, str) or not _HEX64.fullmatch(recorded):
        raise SessionFileError(path, f"header checksum ({HEADER_CHECKSUM}) expected 64 lowercase "
                                     f"hex digits, got {_show(recorded)}")
    computed = header_digest(metadata)
    if computed != recorded:
        raise SessionFileError(path, f"corrupted header (checksum mismatch): {HEADER_CHECKSUM} "
                                     f"expected {recorded}, got {computed}")
    missing = [k for k in HEADER_KEYS if k not in metadata]
    if missing:
        raise SessionFileError(path, f"header fields missing: {missing}")
    extra = sorted(set(metadata) - set(HEADER_KEYS))
    if extra:
        raise SessionFileError(path, f"header fields expected {list(HEADER_KEYS)}, got also "
                                     f"{_show(extra)}")
    encoding = metadata["encoding"]
    if encoding not in ENCODINGS:
        raise SessionFileError(path, f"unknown encoding: expected one of {sorted(ENCODINGS)}, "
                                     f"got {_show(encoding)}")
    geometry = _geometry_from_json(metadata, path)
    position = _json(metadata, "position", path)
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        raise SessionFileError(path, f"position expected a non-negative int, got {_show(position)}")
    starts = _json(metadata, "starts", path)
    if (not isinstance(starts, list) or len(starts) != geometry.num_layers
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in starts)):
        raise SessionFileError(path, f"starts expected {geometry.num_layers} ints, got "
                                     f"{_show(starts)}")
    checksums = _json(metadata, "checksums", path)
    if not isinstance(checksums, dict) or not all(isinstance(v, str) for v in checksums.values()):
        raise SessionFileError(path, f"checksums expected a JSON object of hex strings, got "
                                     f"{_show(checksums)}")
    user = _json(metadata, "user", path)
    if not isinstance(user, dict):
        raise SessionFileError(path, f"user metadata expected a JSON object, got {_show(user)}")
    try:
        model = check_fingerprint(_json(metadata, "model", path))
    except ValueError as e:
        raise SessionFileError(path, f"model fingerprint: {e}") from None
    return SessionHeader(fmt, version, geometry, position, encoding, tuple(starts),
                         checksums, user, model)


def _unreadable(path: PathLike, e: BaseException) -> SessionFileError:
    """A reader's failure as muser-kv's refusal (``FileNotFoundError`` is not one)."""
    if isinstance(e, tensorfile.TensorFileError):
        return SessionFileError(path, f"unreadable: truncated, or not a safetensors file ({e})")
    return SessionFileError(path, f"unreadable: {e}")


def _read_raw(path: PathLike) -> Tuple[Dict[str, str], Dict[str, tensorfile.Tensor]]:
    """Header metadata and every tensor; unreadable or malformed -> ``SessionFileError``."""
    try:
        return tensorfile.read(path)
    except FileNotFoundError:
        raise
    except (tensorfile.TensorFileError, OSError) as e:
        raise _unreadable(path, e) from None


@dataclass(frozen=True)
class TensorCheck:
    """One tensor's verification: ``status`` is OK, MISSING, UNEXPECTED, DTYPE or MISMATCH."""

    name: str
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "OK"


def _table_checks(h: SessionHeader, stored: Mapping[str, str]) -> Dict[str, TensorCheck]:
    """What the header and the tensor table (name -> safetensors dtype) say
    before a byte of data is read: every tensor present, of the header's
    encoding, with a checksum, and none the header does not name. Tensors that
    pass are absent from the result (their digest decides)."""
    want = ENCODINGS[h.encoding][1]
    out: Dict[str, TensorCheck] = {}
    for name in h.tensor_names:
        dtype = stored.get(name)
        if dtype is None:
            out[name] = TensorCheck(name, "MISSING", "tensor missing from the file")
        elif dtype != want:
            out[name] = TensorCheck(name, "DTYPE", f"encoding {h.encoding} expects dtype "
                                    f"{tensorfile.DTYPE_NAMES[want]}, got "
                                    f"{tensorfile.DTYPE_NAMES[dtype]}")
        elif name not in h.checksums:
            out[name] = TensorCheck(name, "MISMATCH", "no checksum in the header")
    expected = set(h.tensor_names)
    for n in sorted(set(stored) - expected):
        out[n] = TensorCheck(n, "UNEXPECTED", "tensor not named by the header")
    for n in sorted(set(h.checksums) - expected):
        out[n] = TensorCheck(n, "UNEXPECTED", "checksum for a tensor the geometry does not have")
    return out


def _digest_check(h: SessionHeader, name: str, digest: str) -> TensorCheck:
    if digest != h.checksums[name]:
        return TensorCheck(name, "MISMATCH", f"{h.digest} expected {h.checksums[name]}, "
                                             f"got {digest}")
    return TensorCheck(name, "OK")


def _refusal(path: PathLike, check: TensorCheck) -> SessionFileError:
    what = {"MISSING": "missing tensor", "UNEXPECTED": "unexpected tensor",
            "DTYPE": "wrong encoding for tensor",
            "MISMATCH": "corrupted tensor (checksum mismatch)"}[check.status]
    return SessionFileError(path, f"{what} {check.name!r}: {check.detail}")


def _first_refusal(path: PathLike, h: SessionHeader, checks: Mapping[str, TensorCheck]) -> None:
    """Raise for the first failing check: the header's tensors in order, then the rest."""
    for name in h.tensor_names + sorted(set(checks) - set(h.tensor_names)):
        check = checks.get(name)
        if check is not None and not check.ok:
            raise _refusal(path, check)


@dataclass(frozen=True, eq=False)
class SessionFile:
    """A session file as read whole: raw metadata, parsed header, tensors as
    stored (what ``muser-kv inspect`` reports on; loads stream instead)."""

    path: Path
    metadata: Dict[str, str]
    header: SessionHeader
    tensors: Dict[str, tensorfile.Tensor]

    def verify(self) -> List[TensorCheck]:
        """Every expected tensor present, of the header's encoding, with its
        checksum (the digest of the file's version); no tensor the header does
        not name."""
        h = self.header
        table = _table_checks(h, {n: t.dtype for n, t in self.tensors.items()})
        digests = tensor_digests({n: t.data for n, t in self.tensors.items()
                                  if n in h.checksums and n not in table}, h.digest)
        out = [table.get(name) or _digest_check(h, name, digests[name])
               for name in h.tensor_names]
        return out + [table[n] for n in sorted(set(table) - set(h.tensor_names))]

    def snapshot(self) -> SessionSnapshot:
        """The verified snapshot; refuses on the first failing tensor or shape."""
        _first_refusal(self.path, self.header, {c.name: c for c in self.verify()})
        h = self.header
        dtype = ENCODINGS[h.encoding][0]
        cuts = []
        for i, start in enumerate(h.starts):
            k, v = (_to_mlx(self.tensors[n].data, dtype) for n in tensor_names(i))
            cuts.append(LayerCut(start, k, v))
        mx.eval([a for c in cuts for a in (c.keys, c.values)])
        snapshot = SessionSnapshot(h.geometry, h.position, h.encoding, tuple(cuts), h.model)
        snapshot.check(h.geometry)
        return snapshot


def _to_mlx(data: np.ndarray, dtype: Any) -> mx.array:
    """Stored bytes -> an MLX array of ``dtype`` (bf16 arrives as its uint16 bits)."""
    if dtype == mx.bfloat16:
        return mx.array(data).view(mx.bfloat16)
    return mx.array(data)


def _to_numpy(x: mx.array) -> np.ndarray:
    """An MLX array's bytes as numpy, evaluating it if need be (a view of MLX's
    buffer, no copy; bf16 as its uint16 bits)."""
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.asarray(x)


def open_session(path: PathLike, *, tidy: bool = True) -> SessionFile:
    """Read a whole session file and parse its header (tensors are not yet
    verified). ``tidy`` removes the target's stale temporaries first (see
    ``tidy_temporaries``)."""
    if tidy:
        tidy_temporaries(path)
    metadata, tensors = _read_raw(path)
    return SessionFile(Path(path), metadata, parse_header(metadata, path), tensors)


# -- reading, streamed ----------------------------------------------------------------

#: MLX storage of each stored dtype (bf16 arrives as its uint16 bits, then a view).
_MLX_STORAGE = {"F16": mx.float16, "BF16": mx.uint16, "F32": mx.float32}


class _Allocators:
    """Daemon threads that allocate a load's fresh arrays side by side, each
    on a CPU stream it made itself: first touches of fresh memory run in
    parallel, and every array comes back evaluated.

    MLX streams belong to the thread that made them (another thread's eval of
    an array on one raises "There is no Stream(cpu, N) in current thread"), so
    the streams live in these threads, not in whichever thread first loaded a
    session; and a load from a new thread (a server's request threads) makes
    no streams of its own, which MLX would never free. One set per process."""

    def __init__(self, workers: int):
        self._next = 0
        self._lock = threading.Lock()
        self._queues: List["queue.SimpleQueue[Tuple[Tuple[int, ...], Any, Future[mx.array]]]"] = []
        for i in range(workers):
            jobs: "queue.SimpleQueue[Tuple[Tuple[int, ...], Any, Future[mx.array]]]" = \
                queue.SimpleQueue()
            self._queues.append(jobs)
            threading.Thread(target=self._run, args=(jobs,), daemon=True,
                             name=f"muser-kv allocator {i}").start()

    @staticmethod
    def _run(jobs: "queue.SimpleQueue[Tuple[Tuple[int, ...], Any, Future[mx.array]]]") -> None:
        stream = mx.new_stream(mx.cpu)
        while True:
            shape, dtype, done = jobs.get()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                x = mx.zeros(shape, dtype, stream=stream)
                mx.eval(x)
                done.set_result(x)
            except BaseException as e:  # handed to the caller
                done.set_exception(e)

    def zeros(self, shape: Sequence[int], dtype: Any) -> "Future[mx.array]":
        """A new evaluated zero array, allocated by one of the threads in turn."""
        done: "Future[mx.array]" = Future()
        with self._lock:
            jobs = self._queues[self._next % len(self._queues)]
            self._next += 1
        jobs.put((tuple(shape), dtype, done))
        return done


_ALLOCATORS: Optional[_Allocators] = None
_ALLOCATORS_LOCK = threading.Lock()


def _allocators() -> _Allocators:
    global _ALLOCATORS
    with _ALLOCATORS_LOCK:
        if _ALLOCATORS is None:
            _ALLOCATORS = _Allocators(_workers())
        return _ALLOCATORS


def _destination(entry: tensorfile.Entry) -> "Future[mx.array]":
    """A new MLX array of ``entry``'s storage dtype and shape in host-visible
    memory (allocated by a CPU stream, evaluated when the future is done)."""
    return _allocators().zeros(entry.shape, _MLX_STORAGE[entry.dtype])


def _writable(x: mx.array) -> np.ndarray:
    """The bytes of the evaluated array ``x`` that no one else holds, as a
    writable numpy view of MLX's own buffer. The read lands there and the
    digest is taken there: what is verified is what the cache installs."""
    view = _to_numpy(x)
    if view.nbytes and not view.flags.writeable:
        raise RuntimeError("session load: MLX gave a read-only view of a new array; "
                           "refusing to read into it")
    return view


def _read_verified(fd: int, entry: tensorfile.Entry, view: np.ndarray, algorithm: str) -> str:
    """One reader thread's task: ``entry``'s bytes into ``view`` (its whole range
    asked of the kernel first, so the device has it queued), then their digest;
    then, on CUDA, the bytes moved to the GPU in bulk while the other readers
    read on (``managed.to_gpu``), so the install finds them there."""
    tensorfile.prefetch(fd, entry.begin, entry.nbytes)
    tensorfile.read_at(fd, entry, view)
    digest = digest_bytes(view, algorithm)
    managed.to_gpu(view)
    return digest


@dataclass(frozen=True)
class Placement:
    """Where a tensor's logical rows go in a plane the host can write: the new
    plane (evaluated, held by no one else), its layout, and the live runs of the
    ring the install leaves (``MuseKVCache.install_ring``: the ring decides)."""

    plane: mx.array
    layout: str
    runs: Tuple[Run, ...]


#: Bytes a reader thread stages at a time on the way into a plane.
PLACE_CHUNK = 4 << 20


def _scatter(plane: np.ndarray, layout: str, runs: Sequence[Run], rows: np.ndarray,
             first: int) -> None:
    """Logical rows ``first .. first + len(rows)`` (``[m, H, D]``) into the plane
    (``[R, H*D]`` token-major, ``[H, R, D]`` head-major) along the runs."""
    last = first + rows.shape[0]
    for run in runs:
        lo, hi = max(first, run.source), min(last, run.source + run.length)
        if lo >= hi:
            continue
        at = run.physical + lo - run.source
        part = rows[lo - first:hi - first]
        if layout == kernels.TOKEN_MAJOR:
            plane[at:at + hi - lo] = part.reshape(hi - lo, -1)
        else:
            plane[:, at:at + hi - lo, :] = part.transpose(1, 0, 2)


def _read_placed(fd: int, entry: tensorfile.Entry, plane: np.ndarray, where: Placement,
                 algorithm: str, free: "queue.Queue[np.ndarray]") -> str:
    """One reader thread's task for a placed tensor: its bytes, ``PLACE_CHUNK``
    at a time, into a staging buffer the thread reuses, hashed there and copied
    (bits, never values) into the plane where the runs say; returns the digest."""
    tensorfile.prefetch(fd, entry.begin, entry.nbytes)
    h = _hasher(algorithm)
    n = entry.shape[0]
    if not entry.nbytes:
        return h.hexdigest()
    row = entry.nbytes // n
    buf = free.get()
    try:
        per = max(1, buf.nbytes // row)
        for a in range(0, n, per):
            b = min(n, a + per)
            part = buf[:(b - a) * row]
            tensorfile.read_at(fd, dataclasses.replace(
                entry, begin=entry.begin + a * row, end=entry.begin + b * row), part)
            h.update(part)
            _scatter(plane, where.layout, where.runs,
                     part.view(plane.dtype).reshape(b - a, *entry.shape[1:]), a)
    finally:
        free.put(buf)
    return h.hexdigest()


class _Reader:
    """One session file, opened for a streamed, verified read.

    Opening reads only the header: it is verified and parsed, and the tensor
    table is checked against it, before any data is read. ``layers()`` then
    yields ``(layer, start, keys, values)`` for every layer whose two tensors
    were read and verified, in file order.

    Every tensor is read straight into MLX memory: the caller's thread hands a
    view of each destination's buffer to a pool of reader threads, which read
    with positional reads of the one open file (several tensors in flight: the
    device sees a queue, the page cache several copies at once). A destination
    is either a new array of the tensor's shape (allocated on a few CPU
    streams, side by side), hashed where the bytes landed, or the plane of a
    ``Placement``: the bytes are staged a chunk at a time, hashed there, and
    placed along the ring's runs. No one else holds a destination until it is
    yielded, so nothing reads it while a reader writes it. A digest that does
    not match raises ``SessionFileError`` naming the tensor, and nothing of
    that layer is yielded."""

    def __init__(self, path: PathLike, *, tidy: bool = True):
        self.path = path
        self._active: Optional[Iterator[Any]] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        if tidy:
            tidy_temporaries(path)
        try:
            self._file: Optional[BinaryIO] = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _unreadable(path, e) from None
        try:
            try:
                metadata, entries = tensorfile.read_table(self._file)
            except (tensorfile.TensorFileError, OSError) as e:
                raise _unreadable(path, e) from None
            self.header = parse_header(metadata, path)
            self.entries = {e.name: e for e in entries}
            _first_refusal(path, self.header, _table_checks(
                self.header, {n: e.dtype for n, e in self.entries.items()}))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the readers (queued reads are dropped, running ones finish: they
        write only into this load's own arrays), then close the file."""
        if self._active is not None:
            self._active.close()
            self._active = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def layers(self, placements: Optional[Mapping[str, Placement]] = None,
               ) -> Iterator[Tuple[int, int, mx.array, mx.array]]:
        """Start reading now (the readers run ahead of the caller, who may do
        other work first), and iterate over the verified layers. A tensor with
        a placement is read into its plane (and the plane is what is yielded);
        any other into a new array of its own shape."""
        placements = placements or {}
        order = sorted(self.entries.values(), key=lambda e: e.begin)
        f = self._file
        assert f is not None and self._pool is None
        if managed.ENABLED:
            managed.prefetcher()  # built here, before the readers ask for it
        fresh = {e.name: _destination(e) for e in order if e.name not in placements}
        arrays = [placements[e.name].plane if e.name in placements else fresh[e.name].result()
                  for e in order]
        workers = _workers()
        free: "queue.Queue[np.ndarray]" = queue.Queue()
        if placements:  # each at least a row, at most the largest tensor
            largest = max(e.nbytes for e in order)
            row = max((e.nbytes // e.shape[0] for e in order if e.shape[0]), default=1)
            for _ in range(workers):
                free.put(np.empty(max(row, min(PLACE_CHUNK, largest)), np.uint8))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="muser-kv session reader")
        digests: Dict[str, "Future[str]"] = {}
        for e, x in zip(order, arrays):
            where = placements.get(e.name)
            if where is None:
                task = (_read_verified, f.fileno(), e, _writable(x).reshape(-1).view(np.uint8),
                        self.header.digest)
            else:
                task = (_read_placed, f.fileno(), e, _writable(x).view(np.uint16), where,
                        self.header.digest, free)
            digests[e.name] = self._pool.submit(*task)
        self._active = self._consume(order, arrays, digests)
        return self._active

    def _consume(self, order: Sequence[tensorfile.Entry], arrays: Sequence[mx.array],
                 digests: Mapping[str, "Future[str]"],
                 ) -> Iterator[Tuple[int, int, mx.array, mx.array]]:
        h = self.header
        arrays_of = {e.name: x for e, x in zip(order, arrays)}
        layer_of = {n: i for i in range(h.geometry.num_layers) for n in tensor_names(i)}
        for layer in dict.fromkeys(layer_of[e.name] for e in order):  # file order
            out = []
            for name in tensor_names(layer):
                try:
                    digest = digests[name].result()
                except (tensorfile.TensorFileError, OSError) as exc:
                    raise _unreadable(self.path, exc) from None
                check = _digest_check(h, name, digest)
                if not check.ok:
                    raise _refusal(self.path, check)
                x = arrays_of[name]
                out.append(x.view(mx.bfloat16) if x.dtype == mx.uint16 else x)  # bf16 bits
            yield layer, h.starts[layer], out[0], out[1]


def read_session(path: PathLike) -> SessionSnapshot:
    """The snapshot in a session file, with every checksum and shape verified."""
    with _Reader(path) as reader:
        h = reader.header
        cuts: List[Optional[LayerCut]] = [None] * h.geometry.num_layers
        for layer, start, k, v in reader.layers():
            cuts[layer] = LayerCut(start, k, v)
    mx.eval([a for c in cuts if c is not None for a in (c.keys, c.values)])
    snapshot = SessionSnapshot(h.geometry, h.position, h.encoding, tuple(cuts), h.model)
    snapshot.check(h.geometry)
    return snapshot


# -- writing ---------------------------------------------------------------------------


def user_metadata(metadata: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``metadata`` as the header stores it: a mapping with string keys of JSON
    values (what comes back is ``json.loads(json.dumps(metadata))``: tuples come
    back as lists), or ``SessionMetadataError`` naming what cannot be stored."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise SessionMetadataError(
            f"session metadata expected a mapping (str -> JSON value), got "
            f"{type(metadata).__name__}")
    user = dict(metadata)
    odd = [k for k in user if not isinstance(k, str)]
    if odd:
        raise SessionMetadataError(
            f"session metadata keys expected strings (JSON turns others into strings), got "
            f"{tensorfile.show(odd)}")
    try:
        json.dumps(user, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise SessionMetadataError(f"session metadata expected JSON values, got one that is "
                                   f"not ({why})") from None
    return user


def _header_fields(snapshot: SessionSnapshot, user: Mapping[str, Any]) -> Dict[str, str]:
    """Every header field but the two that depend on the tensors' bytes
    (``checksums``, and ``header_sha256`` over everything)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "geometry": geometry_to_json(snapshot.geometry),
        "position": json.dumps(snapshot.position),
        "encoding": snapshot.encoding,
        "starts": json.dumps([c.start for c in snapshot.layers]),
        "user": json.dumps(dict(user), sort_keys=True, allow_nan=False),
        "model": json.dumps(snapshot.model, sort_keys=True),
    }


def _signed(fields: Mapping[str, str], digests: Mapping[str, str]) -> Dict[str, str]:
    header = dict(fields, checksums=json.dumps(dict(digests), sort_keys=True))
    header[HEADER_CHECKSUM] = header_digest(header)
    return header


def session_arrays(snapshot: SessionSnapshot) -> Dict[str, np.ndarray]:
    """Every tensor of ``snapshot`` by its name in a session file, as numpy
    views of MLX's buffers (evaluated; the snapshot keeps them alive)."""
    return {name: np.ascontiguousarray(_to_numpy(x)) for name, x in _tensors(snapshot)}


def session_header(snapshot: SessionSnapshot, arrays: Mapping[str, np.ndarray],
                   user: Mapping[str, Any]) -> Dict[str, str]:
    """The header a session file of ``snapshot`` carries (``session_arrays``'
    digests, the header checksum over every field): what a reader verifies,
    whether the bytes come from a file or another process (``handoff``)."""
    return _signed(_header_fields(snapshot, user), tensor_digests(arrays))


def check_geometry(have: MuseGeometry, want: MuseGeometry) -> None:
    """Refuse a session of geometry ``have`` for a cache of geometry ``want``
    (``SnapshotMismatch`` naming the first field that differs)."""
    _check_geometry(have, want)


def _tensors(snapshot: SessionSnapshot) -> List[Tuple[str, mx.array]]:
    return [(name, x) for i, cut in enumerate(snapshot.layers)
            for name, x in zip(tensor_names(i), (cut.keys, cut.values))]


@dataclass(frozen=True)
class PlaneRows:
    """A session tensor as it lies in a plane the host reads in place: its
    logical rows (``shape``, the file's ``[rows, H, D]``) along the ring's live
    runs, in a numpy view of the plane (``[R, H*D]`` token-major, ``[H, R, D]``
    head-major). The inverse of ``_scatter``: the ring decides where each row
    is, the writer follows the runs."""

    plane: np.ndarray
    layout: str
    runs: Tuple[Run, ...]
    shape: Tuple[int, ...]

    @property
    def row(self) -> int:
        """Elements per logical row."""
        return int(np.prod(self.shape[1:]))

    def blocks(self, staging: np.ndarray) -> Iterator[np.ndarray]:
        """The rows in logical order as C-contiguous blocks: a token-major run is
        a view of the plane; head-major rows are transposed through ``staging``
        (of the plane's dtype, at least a row), as many rows at a time as it holds."""
        row = self.row
        per = staging.size // row
        for run in self.runs:
            if self.layout == kernels.TOKEN_MAJOR:
                yield self.plane[run.physical:run.physical + run.length]
                continue
            for a in range(0, run.length, per):
                m = min(per, run.length - a)
                at = run.physical + a
                out = staging[:m * row].reshape(m, *self.shape[1:])
                np.copyto(out, self.plane[:, at:at + m, :].transpose(1, 0, 2))
                yield out


def _plane_rows(cache: Sequence[MuseKVCache]) -> List[Tuple[str, PlaneRows]]:
    """Every tensor of a cache list's session, read from its planes in place."""
    out = []
    for i, c in enumerate(cache):
        runs = tuple(c.ring.live_runs())
        shape = (c.ring.len, c.kv_heads, c.head_dim)
        for name, plane in zip(tensor_names(i), c.planes.physical(c.slot)):
            out.append((name, PlaneRows(_to_numpy(plane), c.layout, runs, shape)))
    return out


Source = Union[mx.array, PlaneRows]


#: Tensors whose gather is started ahead of the one being written.
AHEAD = 4


def _write_tensors(path: PathLike, tensors: Sequence[Tuple[str, Source]],
                   fields: Dict[str, str]) -> Dict[str, str]:
    """The one writer (tests replace it to fail mid-save): the file at ``path``
    (which exists) becomes the session, its header ``fields`` signed with the
    tensors' digests; returns that header.

    The data goes first, at the offset the header will end at (its length is
    fixed before any digest is known: digests are fixed-length hex), each
    tensor's writeback started as soon as it is out; then the header. An MLX
    array goes straight from its buffer while a pool hashes the same buffer and
    the next ``AHEAD`` arrays are gathered; ``PlaneRows`` go block by block
    from the plane, each block hashed as it is written."""
    if sys.byteorder != "little":
        raise SnapshotError("session files are little-endian; this host is not")
    stored = ENCODINGS[fields["encoding"]][1]
    algorithm = TENSOR_DIGESTS[fields["version"]]
    table = [(n, stored, tuple(x.shape)) for n, x in tensors]
    names = [n for n, _ in tensors]
    reserved = len(tensorfile.head(table, _signed(fields, {
        n: "0" * DIGEST_HEX[algorithm] for n in names})))
    digests: List[Union[str, "Future[str]"]] = []
    staging: Optional[np.ndarray] = None
    with open(path, "r+b", buffering=0) as f, ThreadPoolExecutor(
            _workers(), thread_name_prefix="muser-kv digest") as pool:
        fd = f.fileno()
        os.lseek(fd, reserved, os.SEEK_SET)
        for i, (name, x) in enumerate(tensors):
            at = os.lseek(fd, 0, os.SEEK_CUR)
            if isinstance(x, PlaneRows):
                if (staging is None or staging.dtype != x.plane.dtype
                        or staging.size < x.row):
                    staging = np.empty(max(x.row, PLACE_CHUNK // x.plane.itemsize),
                                       x.plane.dtype)
                h = _hasher(algorithm)
                for block in x.blocks(staging):
                    data = block.reshape(-1).view(np.uint8)
                    h.update(data)
                    tensorfile.write_all(fd, data)
                digests.append(h.hexdigest())
            else:
                mx.async_eval([t for _, t in tensors[i:i + 1 + AHEAD]
                               if isinstance(t, mx.array)])  # this one first
                data = np.ascontiguousarray(_to_numpy(x))  # waits for x's gather; a view
                digests.append(pool.submit(digest_bytes, data, algorithm))
                tensorfile.write_all(fd, data)
            end = os.lseek(fd, 0, os.SEEK_CUR)
            if end > at:
                tensorfile.start_writeback(fd, at, end - at)
        header = _signed(fields, {n: d if isinstance(d, str) else d.result()
                                  for n, d in zip(names, digests)})
        head = tensorfile.head(table, header)
        if len(head) != reserved:  # cannot happen while digests are fixed-length hex
            raise SnapshotError(f"session header expected {reserved} bytes, got {len(head)}")
        os.lseek(fd, 0, os.SEEK_SET)
        tensorfile.write_all(fd, head)
    return header


def _fsync_path(path: PathLike, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(os.fspath(path), flags)
    except OSError:
        if directory:  # platforms that cannot open a directory (Windows)
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Temporaries this process is writing now (never stale, whatever their name says).
_IN_FLIGHT: set = set()
_IN_FLIGHT_LOCK = threading.Lock()


def _temporary_pattern(path: Path) -> "re.Pattern[str]":
    """Names of ``path``'s temporaries: ``.NAME.<pid>-<16 hex>.tmp`` (and the
    ``.NAME.<16 hex>.tmp`` earlier versions wrote, which name no process)."""
    return re.compile(rf"\.{re.escape(path.name)}\.(?:(\d+)-)?[0-9a-f]{{16}}\.tmp")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError, OSError):
        return True  # exists (someone else's), or cannot tell: keep its file
    return True


def tidy_temporaries(path: PathLike) -> List[Path]:
    """Remove the stale temporaries of the session file ``path`` -- those a save
    that was killed outright left behind -- and return them. A temporary is
    stale when the process its name records is gone (or, for this process, when
    no save of this process is writing it). Only regular files named as this
    target's temporaries are touched, never any other file; failures to list
    or remove are ignored (tidying is best effort, never a reason to fail)."""
    target = Path(path)
    directory = target.parent
    pattern = _temporary_pattern(target)
    removed = []
    try:
        names = os.listdir(directory if str(directory) else ".")
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        tmp = directory / name
        with _IN_FLIGHT_LOCK:
            if str(tmp) in _IN_FLIGHT:
                continue
        pid = m.group(1)
        if pid is not None and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        try:
            if not stat.S_ISREG(os.lstat(tmp).st_mode):
                continue
            os.unlink(tmp)
            removed.append(tmp)
        except OSError:
            pass
    return removed


def _saving(path: Path, e: OSError) -> OSError:
    """``e`` restated about the caller's ``path`` (not our temporary)."""
    if e.errno is None:
        return e
    return OSError(e.errno, f"cannot save the session to {os.fspath(path)}: "
                            f"{e.strerror or e}", os.fspath(path))


def _atomic_write(path: Path, tensors: Sequence[Tuple[str, Source]],
                  fields: Dict[str, str]) -> SessionHeader:
    """Temp file beside ``path`` -> written and closed -> fsync (its bytes are on
    disk) -> ``os.replace`` (atomic rename) -> fsync the directory (the rename
    is on disk). Any failure before the rename removes the temp file and leaves
    ``path`` as it was; stale temporaries of ``path`` (killed saves) go first.
    Returns the header written, parsed before the rename (nothing after it can
    fail but the directory's fsync)."""
    directory = path.parent
    if not directory.is_dir():
        raise OSError(errno.ENOENT, f"cannot save the session to {os.fspath(path)}: directory "
                                    f"{os.fspath(directory)} does not exist", os.fspath(path))
    tidy_temporaries(path)
    tmp = directory / f".{path.name}.{os.getpid()}-{secrets.token_hex(8)}.tmp"
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.add(str(tmp))
    try:
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # umask applies
        except OSError as e:
            raise _saving(path, e) from e
        try:
            header = parse_header(_write_tensors(tmp, tensors, fields), path)
            _fsync_path(tmp)
            os.replace(tmp, path)
        except BaseException as e:
            with suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError):
                raise _saving(path, e) from e
            raise
    finally:
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.discard(str(tmp))
    _fsync_path(directory, directory=True)
    return header


#: Whether the host reads and writes planes in place (``None``: decide by
#: device): a save then writes rows straight from the planes and a load reads
#: them straight into new planes. Right where the planes are memory the host
#: touches in place -- the CPU, Metal's unified memory; on CUDA a host access
#: would move a plane into managed memory for good, so there a save writes a
#: gathered cut and a load uploads arrays of their own that the install kernel
#: places on the GPU.
HOST_PLACES: Optional[bool] = None


def _host_places() -> bool:
    if HOST_PLACES is not None:
        return HOST_PLACES
    return mx.default_device().type == mx.DeviceType.cpu or mx.metal.is_available()


def save_session(path: PathLike, cache: Union[Sequence[Any], SessionSnapshot],
                 metadata: Optional[Mapping[str, Any]] = None, *,
                 encoding: Optional[str] = None, model: Any = None) -> SessionHeader:
    """Write a session (a live cache list, or a snapshot) to ``path``, atomically.

    The file carries the planes' own encoding (``f16le`` or ``bf16le``) unless
    ``encoding`` says otherwise: ``"f32le"`` writes an f32 interchange file (an
    exact widening); installing it later needs ``convert=True``. ``metadata`` is
    a mapping of string keys to JSON values, stored under ``user``
    (``SessionMetadataError`` otherwise, before the disk is touched). The file
    records the fingerprint of ``model``, else of the model the cache list was
    built for, else the snapshot's (none, for a list built from a bare
    geometry). Returns the header written (what ``open_session`` reads back);
    ``SessionSnapshot.capture`` takes the rows themselves into memory.

    Where the host reads planes in place (``HOST_PLACES``), a live list's rows
    in its own encoding are written straight from the planes; elsewhere a cut
    is gathered, a few tensors ahead of the one being written."""
    user = user_metadata(metadata)  # refused before touching the disk
    if isinstance(cache, SessionSnapshot):
        snapshot = cache
        if model is not None:
            snapshot = dataclasses.replace(snapshot, model=model_fingerprint(model))
    else:
        snapshot = SessionSnapshot._capture(cache, model)  # lazy: the gate, and the header
    encoding = encoding or snapshot.encoding
    direct = (not isinstance(cache, SessionSnapshot) and encoding == snapshot.encoding
              and _host_places())
    snapshot = snapshot.encoded(encoding)
    snapshot.check(snapshot.geometry)
    tensors: Sequence[Tuple[str, Source]] = (
        _plane_rows(cache) if direct else _tensors(snapshot))
    return _atomic_write(Path(path), tensors, _header_fields(snapshot, user))


def _placements(cache: Sequence[MuseKVCache], h: SessionHeader, rows: Sequence[int],
                ) -> Tuple[List[Ring], Dict[str, Placement]]:
    """For every layer: the ring its install of ``rows[layer]`` rows leaves and
    two new zero planes its rows are read into."""
    rings, planes = [], {}
    for layer, c in enumerate(cache):
        ring = c.install_ring(h.starts[layer], rows[layer])
        rings.append(ring)
        runs = tuple(ring.live_runs())
        for name in tensor_names(layer):
            planes[name] = (_allocators().zeros(c.planes.memory_shape[1:], c.dtype), c.layout,
                            runs)
    return rings, {name: Placement(plane.result(), layout, runs)
                   for name, (plane, layout, runs) in planes.items()}


def load_session(path: PathLike, model: Any, max_context: Optional[int] = None, *,
                 convert: bool = False, plane_dtype: DtypeLike = None,
                 allow_other_model: bool = False) -> List[Any]:
    """A new cache list for ``model`` holding the session in ``path``, restored
    bit for bit, or an exception (never a partially restored cache).

    ``max_context`` defaults to the file's; any other value is another geometry
    and is refused, as is a model whose layers, window or heads differ. The
    planes are of the model's type (``plane_dtype`` overrides it, as in
    ``make_prompt_cache``); a file of another encoding needs ``convert=True``.
    The session must come from ``model`` itself (by fingerprint: its config and
    a sample of its weights); a file from another model, or one that records no
    model, is refused (``ModelMismatch``) unless ``allow_other_model=True``.

    Everything the header decides (geometry, model, encoding) is checked before
    the first tensor is read; each layer is installed, into a list no one else
    holds, as soon as both its tensors are verified, so installing overlaps
    reading, and the list is returned only once every layer is in."""
    max_context = optional_count(max_context, "max_context", minimum=1)
    args = getattr(model, "args", None)
    if args is None:
        raise TypeError(
            f"load_session needs an mlx-lm model with .args, got {type(model).__name__}")
    with _Reader(path) as reader:
        h = reader.header
        file_geometry = h.geometry
        context = file_geometry.max_context if max_context is None else max_context
        limit = MuseGeometry.from_model_args(args).max_context
        if context > limit:
            raise SnapshotMismatch(
                f"geometry.max_context (expected: within the model's max_position_embeddings; "
                f"got: file {os.fspath(path)})", f"<= {limit}", context)
        target = MuseGeometry.from_model_args(args, context)
        try:
            _check_geometry(file_geometry, kv_geometry(target))
        except SnapshotMismatch as e:
            raise SnapshotMismatch(
                f"{e.field} (expected: the model's; got: file {os.fspath(path)})",
                e.expected, e.got) from None
        if not allow_other_model:
            check_model(h.model, model_fingerprint(model),
                        f"the model ({type(model).__name__})")
        dtype = plane_dtype_for(model, plane_dtype)
        encoding = plane_encoding(dtype)
        geometry = kv_geometry(target)
        _check_whole(file_geometry, h.encoding, h.position, geometry)
        if h.encoding != encoding and not convert:
            raise _encoding_mismatch(h.encoding, encoding)
        # planes unallocated: each layer's install makes its own
        cache = make_cache_for(MuseGeometry.from_model(model, context), plane_dtype=dtype,
                               model=model, allocate=False)
        # every layer's start and shapes, from the table, before a byte is read
        rows = [_check_entries(geometry, h.encoding, h.position, layer, h.starts[layer],
                               reader.entries) for layer in range(len(cache))]
        rings, placements = None, None
        if h.encoding == encoding and _host_places():
            rings, placements = _placements(cache, h, rows)
        layers = reader.layers(placements)  # reading starts now
        installed = 0
        for layer, start, k, v in layers:
            if rings is not None:  # read straight into this layer's planes
                cache[layer].install_planes(rings[layer], k, v)
            else:
                if h.encoding != encoding:  # convert=True: round to nearest even
                    k, v = k.astype(dtype), v.astype(dtype)
                cache[layer].install(start, k, v)
            mx.async_eval(cache[layer].kv_state)
            installed += 1
    if installed != len(cache):  # the reader yields every layer or raises
        raise SnapshotMismatch("layers installed", len(cache), installed)
    mx.eval([a for c in cache for a in c.kv_state])
    return cache
