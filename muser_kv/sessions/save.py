"""Writing session files: ``save_session``.

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
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import secrets
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from muser_kv.caches.base import MuseKVCache
from muser_kv.core import kernels
from muser_kv.core.ring import Run
from muser_kv.sessions import reading, tensorfile
from muser_kv.sessions.fingerprint import model_fingerprint
from muser_kv.sessions.format import (
    DIGEST_HEX,
    ENCODINGS,
    FORMAT,
    HEADER_CHECKSUM,
    TENSOR_DIGESTS,
    VERSION,
    PathLike,
    SessionHeader,
    SessionMetadataError,
    SnapshotError,
    digest_bytes,
    geometry_to_json,
    hasher,
    header_digest,
    parse_header,
    stored_view,
    tensor_digests,
    tensor_names,
)
from muser_kv.sessions.reading import host_places
from muser_kv.sessions.snapshot import SessionSnapshot, lazy_capture
from muser_kv.sessions.temporaries import IN_FLIGHT, IN_FLIGHT_LOCK, tidy_temporaries

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
    return {name: np.ascontiguousarray(stored_view(x)) for name, x in _tensors(snapshot)}


def session_header(snapshot: SessionSnapshot, arrays: Mapping[str, np.ndarray],
                   user: Mapping[str, Any]) -> Dict[str, str]:
    """The header a session file of ``snapshot`` carries (``session_arrays``'
    digests, the header checksum over every field): what a reader verifies,
    whether the bytes come from a file or another process (``handoff``)."""
    return _signed(_header_fields(snapshot, user), tensor_digests(arrays))


def _tensors(snapshot: SessionSnapshot) -> List[Tuple[str, mx.array]]:
    return [(name, x) for i, cut in enumerate(snapshot.layers)
            for name, x in zip(tensor_names(i), (cut.keys, cut.values))]


@dataclass(frozen=True)
class PlaneRows:
    """A session tensor as it lies in a plane the host reads in place: its
    logical rows (``shape``, the file's ``[rows, H, D]``) along the ring's live
    runs, in a numpy view of the plane (``[R, H*D]`` token-major, ``[H, R, D]``
    head-major). The inverse of a placed load (``reading.Placement``): the ring
    decides where each row is, the writer follows the runs."""

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
        row, head_dim = self.row, self.shape[-1]
        per = staging.size // row
        for run in self.runs:
            if self.layout == kernels.TOKEN_MAJOR:  # contiguous already
                yield kernels.host_rows(self.plane, self.layout, run.physical, run.length, head_dim)
                continue
            for a in range(0, run.length, per):
                m = min(per, run.length - a)
                out = staging[:m * row].reshape(m, *self.shape[1:])
                np.copyto(out, kernels.host_rows(self.plane, self.layout, run.physical + a, m,
                                                 head_dim))
                yield out


def plane_rows(cache: Sequence[MuseKVCache]) -> List[Tuple[str, PlaneRows]]:
    """Every tensor of a cache list's session, read from its planes in place."""
    out = []
    for i, c in enumerate(cache):
        runs = tuple(c.ring.live_runs())
        shape = (c.ring.len, c.kv_heads, c.head_dim)
        for name, plane in zip(tensor_names(i), c.planes.physical(c.slot)):
            out.append((name, PlaneRows(stored_view(plane), c.layout, runs, shape)))
    return out


Source = Union[mx.array, PlaneRows]


#: Tensors whose gather is started ahead of the one being written.
AHEAD = 4


def write_tensors(path: PathLike, tensors: Sequence[Tuple[str, Source]],
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
            tensorfile.workers(), thread_name_prefix="muser-kv digest") as pool:
        fd = f.fileno()
        os.lseek(fd, reserved, os.SEEK_SET)
        for i, (_name, x) in enumerate(tensors):
            at = os.lseek(fd, 0, os.SEEK_CUR)
            if isinstance(x, PlaneRows):
                if (staging is None or staging.dtype != x.plane.dtype
                        or staging.size < x.row):
                    staging = np.empty(max(x.row, reading.PLACE_CHUNK // x.plane.itemsize),
                                       x.plane.dtype)
                h = hasher(algorithm)
                for block in x.blocks(staging):
                    data = block.reshape(-1).view(np.uint8)
                    h.update(data)
                    tensorfile.write_all(fd, data)
                digests.append(h.hexdigest())
            else:
                mx.async_eval([t for _, t in tensors[i:i + 1 + AHEAD]
                               if isinstance(t, mx.array)])  # this one first
                data = np.ascontiguousarray(stored_view(x))  # waits for x's gather; a view
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


def fsync_path(path: PathLike, directory: bool = False) -> None:
    """Flush ``path`` (a file, or with ``directory`` a directory) to the device."""
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
    with IN_FLIGHT_LOCK:
        IN_FLIGHT.add(str(tmp))
    try:
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # umask applies
        except OSError as e:
            raise _saving(path, e) from e
        try:
            header = parse_header(write_tensors(tmp, tensors, fields), path)
            fsync_path(tmp)
            os.replace(tmp, path)
        except BaseException as e:
            with suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError):
                raise _saving(path, e) from e
            raise
    finally:
        with IN_FLIGHT_LOCK:
            IN_FLIGHT.discard(str(tmp))
    fsync_path(directory, directory=True)
    return header



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
        snapshot = lazy_capture(cache, model)  # the gate, and the header, before a gather
    encoding = encoding or snapshot.encoding
    # a live list in its own encoding, where the host reads planes in place: its
    # rows are written straight from the planes
    live = cache if (not isinstance(cache, SessionSnapshot) and encoding == snapshot.encoding
                     and host_places()) else None
    snapshot = snapshot.encoded(encoding)
    snapshot.check(snapshot.geometry)
    tensors: Sequence[Tuple[str, Source]] = (
        plane_rows(live) if live is not None else _tensors(snapshot))
    return _atomic_write(Path(path), tensors, _header_fields(snapshot, user))
