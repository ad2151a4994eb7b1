"""Reading session files: the verified, streamed reader behind ``read_session``
and ``load_session``, and the host memory it reads into.

* **Verified load.** The header is checked before any field is trusted
  (``format.parse_header``: its checksum first) and the tensor table against
  it (``verify``) before a single row is read. A reader thread reads the
  tensors in chunks into reused staging buffers (asking the kernel to read
  the next two ahead), the caller's thread copies each into an MLX array (the
  upload), and a pool hashes that MLX array's own bytes, so reading, upload
  and verification overlap, and what is verified is what is installed.
  Nothing verified late reaches the caller: ``read_session`` returns once
  every digest matched, and ``load_session`` installs each verified layer
  into a new cache list that it returns only once every layer is in.
* **One kind of refusal.** Whatever is wrong with a file -- truncated,
  bit-flipped, nested past reason, of an unknown dtype -- the error is a
  ``SnapshotError`` naming what was expected and what came, never a parser's
  own exception. A missing file is not a wrong one: ``FileNotFoundError``.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Dict, Generator, Iterator, List, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from muser_kv.core import kernels
from muser_kv.core.ring import Run
from muser_kv.sessions import managed, tensorfile
from muser_kv.sessions.format import (
    ENCODINGS,
    PathLike,
    SessionFileError,
    SessionHeader,
    digest_bytes,
    hasher,
    parse_header,
    stored_view,
    tensor_digests,
    tensor_names,
)
from muser_kv.sessions.snapshot import LayerCut, SessionSnapshot
from muser_kv.sessions.temporaries import tidy_temporaries
from muser_kv.sessions.verify import (
    TensorCheck,
    digest_check,
    first_refusal,
    refusal,
    table_checks,
)


@contextmanager
def _refusing(path: PathLike) -> Iterator[None]:
    """A reader's failure as muser-kv's refusal of ``path`` (``SessionFileError``).
    A missing file is not a file that cannot be trusted: ``FileNotFoundError``
    passes through, as ``open``'s does."""
    try:
        yield
    except (tensorfile.TensorFileError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        if isinstance(e, tensorfile.TensorFileError):
            raise SessionFileError(path, f"unreadable: truncated, or not a safetensors file "
                                         f"({e})") from None
        raise SessionFileError(path, f"unreadable: {e}") from None


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
        table = table_checks(h, {n: t.dtype for n, t in self.tensors.items()})
        digests = tensor_digests({n: t.data for n, t in self.tensors.items()
                                  if n in h.checksums and n not in table}, h.digest)
        out = [table.get(name) or digest_check(h, name, digests[name])
               for name in h.tensor_names]
        return out + [table[n] for n in sorted(set(table) - set(h.tensor_names))]

    def snapshot(self) -> SessionSnapshot:
        """The verified snapshot; refuses on the first failing tensor or shape."""
        first_refusal(self.path, self.header, {c.name: c for c in self.verify()})
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


def open_session(path: PathLike, *, tidy: bool = True) -> SessionFile:
    """Read a whole session file and parse its header (tensors are not yet
    verified). ``tidy`` removes the target's stale temporaries first (see
    ``tidy_temporaries``)."""
    if tidy:
        tidy_temporaries(path)
    with _refusing(path):
        metadata, tensors = tensorfile.read(path)
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
                # hold nothing while idle: a plane this thread still referenced
                # would not be donatable, and every store into it would copy it
                del x
            except BaseException as e:  # handed to the caller
                done.set_exception(e)
            del done

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
            _ALLOCATORS = _Allocators(tensorfile.workers())
        return _ALLOCATORS


def _destination(entry: tensorfile.Entry) -> "Future[mx.array]":
    """A new MLX array of ``entry``'s storage dtype and shape in host-visible
    memory (allocated by a CPU stream, evaluated when the future is done)."""
    return _allocators().zeros(entry.shape, _MLX_STORAGE[entry.dtype])


def host_zeros(shape: Sequence[int], dtype: Any) -> "Future[mx.array]":
    """A new MLX array of zeros in host-visible memory, made on the allocator
    threads (so from any thread: see ``_Allocators``), evaluated when done."""
    return _allocators().zeros(shape, dtype)


def host_bytes(n: int) -> Tuple[mx.array, np.ndarray]:
    """A new evaluated ``uint8`` MLX array of ``n`` bytes in host-visible memory
    and its bytes as a writable view (``writable``)."""
    x = host_zeros((n,), mx.uint8).result()
    return x, writable(x)


def writable(x: mx.array) -> np.ndarray:
    """The bytes of the evaluated array ``x`` that no one else holds, as a
    writable numpy view of MLX's own buffer. The read lands there and the
    digest is taken there: what is verified is what the cache installs."""
    view = stored_view(x)
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
        kernels.host_rows(plane, layout, at, hi - lo, rows.shape[-1])[...] = rows[lo - first:hi - first]


def _read_placed(fd: int, entry: tensorfile.Entry, plane: np.ndarray, where: Placement,
                 algorithm: str, free: "queue.Queue[np.ndarray]") -> str:
    """One reader thread's task for a placed tensor: its bytes, ``PLACE_CHUNK``
    at a time, into a staging buffer the thread reuses, hashed there and copied
    (bits, never values) into the plane where the runs say; returns the digest."""
    tensorfile.prefetch(fd, entry.begin, entry.nbytes)
    h = hasher(algorithm)
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


class Reader:
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
        self._active: Optional[Generator[Any, None, None]] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        if tidy:
            tidy_temporaries(path)
        with _refusing(path):
            f = open(path, "rb", buffering=0)
        self._file: Optional[BinaryIO] = f
        try:
            with _refusing(path):
                metadata, entries = tensorfile.read_table(f)
            self.header = parse_header(metadata, path)
            self.entries = {e.name: e for e in entries}
            first_refusal(path, self.header, table_checks(
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

    def __enter__(self) -> "Reader":
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
        workers = tensorfile.workers()
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
                digests[e.name] = self._pool.submit(
                    _read_verified, f.fileno(), e, writable(x).reshape(-1).view(np.uint8),
                    self.header.digest)
            else:
                digests[e.name] = self._pool.submit(
                    _read_placed, f.fileno(), e, writable(x).view(np.uint16), where,
                    self.header.digest, free)
        self._active = self._consume(order, arrays, digests)
        return self._active

    def _consume(self, order: Sequence[tensorfile.Entry], arrays: Sequence[mx.array],
                 digests: Mapping[str, "Future[str]"],
                 ) -> Generator[Tuple[int, int, mx.array, mx.array], None, None]:
        h = self.header
        arrays_of = {e.name: x for e, x in zip(order, arrays)}
        layer_of = {n: i for i in range(h.geometry.num_layers) for n in tensor_names(i)}
        for layer in dict.fromkeys(layer_of[e.name] for e in order):  # file order
            out = []
            for name in tensor_names(layer):
                with _refusing(self.path):
                    digest = digests[name].result()
                check = digest_check(h, name, digest)
                if not check.ok:
                    raise refusal(self.path, check)
                x = arrays_of[name]
                out.append(x.view(mx.bfloat16) if x.dtype == mx.uint16 else x)  # bf16 bits
            yield layer, h.starts[layer], out[0], out[1]


def read_session(path: PathLike) -> SessionSnapshot:
    """The snapshot in a session file, with every checksum and shape verified."""
    with Reader(path) as reader:
        h = reader.header
        cuts: Dict[int, LayerCut] = {}
        for layer, start, k, v in reader.layers():
            cuts[layer] = LayerCut(start, k, v)
    missing = [i for i in range(h.geometry.num_layers) if i not in cuts]
    if missing:  # the table checks refuse a file without every layer's tensors first
        raise SessionFileError(path, f"layers {missing} were not read")
    layers = tuple(cuts[i] for i in range(h.geometry.num_layers))
    mx.eval([a for c in layers for a in (c.keys, c.values)])
    snapshot = SessionSnapshot(h.geometry, h.position, h.encoding, layers, h.model)
    snapshot.check(h.geometry)
    return snapshot


#: Whether the host reads and writes planes in place (``None``: decide by
#: device): a save then writes rows straight from the planes and a load reads
#: them straight into new planes. Right where the planes are memory the host
#: touches in place -- the CPU, Metal's unified memory; on CUDA a host access
#: would move a plane into managed memory for good, so there a save writes a
#: gathered cut and a load uploads arrays of their own that the install kernel
#: places on the GPU.
HOST_PLACES: Optional[bool] = None


def host_places() -> bool:
    """Whether the host writes planes in place here (a load reads straight into them,
    a save reads from them): on the CPU and on Apple's unified memory, or as
    ``HOST_PLACES`` says when set."""
    if HOST_PLACES is not None:
        return HOST_PLACES
    return mx.default_device().type == mx.DeviceType.cpu or mx.metal.is_available()
