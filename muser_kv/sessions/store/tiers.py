"""The byte tiers of the KV store: encoded chunks held as opaque bytes by key,
in a local directory (:class:`DirectoryTier`, the embedded default) or in
Redis (:class:`RedisTier`, shared between processes and machines).

Invariants every tier keeps, because the store above trusts what a tier hands
back as the exact rows of a prefix:

* **Nothing unverified is served.** Every value is stored framed (magic,
  version, the key, the payload's length, the payload's XXH3-128 digest) and
  ``get`` returns the payload only when the frame is whole, names this key and
  the digest matches. A corrupt or truncated chunk is a miss: counted, logged
  once with its key, and deleted from the tier.
* **A fault is a miss, never an exception.** Redis down or killed mid-request,
  a full disk, a permission error, a vanished directory: ``get`` returns
  ``None``, ``put`` and ``contains`` ``False``, with one ``log.warning`` per
  fault (repeats of the same fault within :data:`WARN_INTERVAL_S` are counted in
  ``errors``, not logged again). Only a caller's own mistakes raise: a key that
  is not 32 to 64 lowercase hex digits, a blob that is not bytes.
* **A chunk is whole or absent.** The directory writes a temporary, fsyncs it
  and renames it over the target; Redis sets a whole value in one command.
"""

from __future__ import annotations

import atexit
import errno
import functools
import json
import logging
import os
import re
import secrets
import struct
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import xxhash

from muser_kv.sessions.temporaries import _alive

log = logging.getLogger("muser_kv.store")

#: A chunk key: the store's hash-chain digest in lowercase hex. Keys become file
#: names and Redis keys, so nothing else is accepted.
KEY_PATTERN = re.compile(r"[0-9a-f]{32,64}")
MAGIC = b"MKVCHUNK"
FRAME_VERSION = 1
#: magic, frame version, key length, payload length, XXH3-128 of the payload;
#: the key's ASCII follows, then the payload.
_HEAD = struct.Struct("<8sHHQ16s")
#: The same fault (tier, operation, kind) is logged at most once in this many seconds.
WARN_INTERVAL_S = 10.0
#: Hit/miss/error counters are written out at most this often (and on close/exit).
FLUSH_INTERVAL_S = 2.0
#: A directory tier at its bound rescans the directory (to see other processes'
#: chunks and reads) at most this often; ``stats`` and ``gc`` always rescan.
RESCAN_INTERVAL_S = 2.0
#: Redis's default ``proto-max-bulk-len``: a longer value would make the server drop
#: the connection (which would read as an outage), so such a put is refused here.
REDIS_MAX_VALUE = 512 << 20
STORE_FORMAT = "muser-kv-store"
STORE_VERSION = 1

PathLike = Union[str, "os.PathLike[str]"]
Blob = Union[bytes, bytearray, memoryview]


def check_key(key: object) -> str:
    """``key`` if it is a chunk key (32 to 64 lowercase hex digits), else ``ValueError``."""
    if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
        raise ValueError(f"a chunk key is 32 to 64 lowercase hex digits, got {key!r}")
    return key


def _payload_view(blob: object) -> memoryview:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"a chunk is bytes, bytearray or memoryview, got {type(blob).__name__}")
    return memoryview(blob).cast("B")


def frame_size(key: str) -> int:
    """Bytes a frame adds before the payload of ``key``."""
    return _HEAD.size + len(key)


def frame_header(key: str, payload: memoryview) -> bytes:
    """The frame that precedes ``payload`` when stored under ``key``."""
    digest = xxhash.xxh3_128_digest(payload)
    return _HEAD.pack(MAGIC, FRAME_VERSION, len(key), payload.nbytes, digest) + key.encode("ascii")


class FrameError(Exception):
    """A stored value that is not a whole, verified frame of its key (the reason)."""


def parse_header(key: str, head: bytes) -> Tuple[int, bytes]:
    """(payload length, digest) from the frame header ``head`` of ``key``."""
    if len(head) < frame_size(key):
        raise FrameError(f"truncated frame: {len(head)} bytes, the header alone is {frame_size(key)}")
    magic, version, key_len, n, digest = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise FrameError(f"magic {magic!r}, expected {MAGIC!r}")
    if version != FRAME_VERSION:
        raise FrameError(f"frame version {version}, expected {FRAME_VERSION}")
    stored_key = head[_HEAD.size:_HEAD.size + key_len]
    if key_len != len(key) or stored_key != key.encode("ascii"):
        raise FrameError(f"the frame is of key {stored_key!r}")
    return n, digest


def check_payload(key: str, n: int, digest: bytes, payload: Any) -> None:
    """``payload`` is ``n`` bytes whose XXH3-128 is ``digest``, else ``FrameError``."""
    got = memoryview(payload).nbytes
    if got != n:
        raise FrameError(f"payload {got} bytes, the frame says {n}")
    if xxhash.xxh3_128_digest(payload) != digest:
        raise FrameError("the payload's XXH3-128 does not match the frame's")


def unframe(key: str, value: bytes) -> bytes:
    """The payload of the whole stored ``value`` of ``key``, verified; ``FrameError`` otherwise."""
    n, digest = parse_header(key, value)
    payload = memoryview(value)[frame_size(key):]
    check_payload(key, n, digest, payload)
    return bytes(payload)


@dataclass
class TierStats:
    """What a tier holds and how it has served (counters: since the tier was
    created for a directory or a Redis database, all processes together, plus
    this process's not yet written out)."""

    name: str            # "dir" / "redis"
    chunks: int
    bytes: int           # stored payload bytes (Redis: the memory Redis reports for our keys)
    capacity: Optional[int]  # the byte bound, None: unbounded
    hits: int
    misses: int
    errors: int          # failures degraded to misses / refused puts

    @property
    def hit_rate(self) -> Optional[float]:
        """hits / (hits + misses), ``None`` before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else None


class _Counters:
    """Hits, misses and errors not yet written to the tier's shared counters."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.errors = 0
        self.flushed_at = time.monotonic()

    def add(self, hits: int = 0, misses: int = 0, errors: int = 0) -> None:
        with self.lock:
            self.hits += hits
            self.misses += misses
            self.errors += errors

    def take(self) -> Tuple[int, int, int]:
        with self.lock:
            out = (self.hits, self.misses, self.errors)
            self.hits = self.misses = self.errors = 0
            self.flushed_at = time.monotonic()
            return out

    def give_back(self, counts: Tuple[int, int, int]) -> None:
        self.add(*counts)

    def due(self) -> bool:
        return time.monotonic() - self.flushed_at >= FLUSH_INTERVAL_S and bool(
            self.hits or self.misses or self.errors)


def _flush_at_exit(ref: "weakref.ReferenceType[BlobTier]") -> None:
    tier = ref()
    if tier is not None:
        tier.flush()


class BlobTier(ABC):
    """Encoded chunks as bytes by key; see the module doc for the invariants."""

    name: str

    def __init__(self) -> None:
        self._counts = _Counters()
        self._warned: Dict[str, float] = {}
        self._warn_lock = threading.Lock()
        self._exit_hook = functools.partial(_flush_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)

    @abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The blob, or None: absent, corrupt, truncated, or the tier failed."""

    @abstractmethod
    def put(self, key: str, blob: bytes, replace: bool = False) -> bool:
        """True: stored whole (or already present: then a lookup, not a write,
        unless ``replace``: the one object that changes, a chunk's index of put
        points); False: failed."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored (False on failure); refreshes nothing."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    @abstractmethod
    def stats(self) -> TierStats:
        """What the tier holds now and its counters."""

    @abstractmethod
    def gc(self, max_bytes: Optional[int] = None) -> int:
        """Evict least recently used chunks until within ``max_bytes`` (default:
        the tier's bound); the number evicted."""

    @abstractmethod
    def flush(self) -> None:
        """Write this process's counters out to the tier's shared counters."""

    def close(self) -> None:
        """Write the counters out and release what the tier holds."""
        self.flush()
        atexit.unregister(self._exit_hook)

    def __enter__(self) -> "BlobTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- faults ---------------------------------------------------------------

    def _warn(self, what: str, message: str, *args: object) -> None:
        """Log ``message`` unless the fault ``what`` was logged within WARN_INTERVAL_S."""
        now = time.monotonic()
        with self._warn_lock:
            last = self._warned.get(what)
            if last is not None and now - last < WARN_INTERVAL_S:
                return
            self._warned[what] = now
        log.warning(message, *args)

    def _maybe_flush(self) -> None:
        if self._counts.due():
            self.flush()


def _check_bound(max_bytes: Optional[int]) -> Optional[int]:
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes is a byte count >= 0 or None, got {max_bytes!r}")
    return max_bytes


def _write_all(fd: int, *parts: memoryview) -> None:
    """Write every byte of ``parts`` to ``fd`` (the one place chunk bytes reach a file)."""
    for part in parts:
        view = part
        while view.nbytes:
            n = os.write(fd, view[:1 << 30])
            view = view[n:]


_TEMPORARY = re.compile(r"\.([0-9a-f]{32,64})\.(\d+)-[0-9a-f]{16}\.tmp")
_OWN_FILES = {"store.json", "stats.json", ".lock"}
_OWN_TEMPORARY = re.compile(r"\.(?:store|stats)\.json\.\d+-[0-9a-f]{16}\.tmp")
_SHARD = re.compile(r"[0-9a-f]{2}")


class DirectoryTier(BlobTier):
    """Chunks as files ``path/<first 2 hex of the key>/<key>``, bounded in
    payload bytes, least recently used evicted first.

    * Writes go to ``.<key>.<pid>-<random>.tmp`` beside the target, are fsynced
      and renamed over it (``os.replace``): a reader, or a process killed
      mid-put, never sees a torn chunk. Temporaries of dead processes are
      removed on open. No directory fsync: a power cut may lose the latest
      puts, never tear one.
    * Recency is the file's mtime, which a read sets (``os.utime``); the index
      (key -> payload bytes, in LRU order) is rebuilt from the directory on
      open, so a restart keeps chunks and their order.
    * Several threads and processes may share a directory: the same key put
      twice leaves one copy (the last rename wins, both whole). The bound is
      exact within a process; a process sees the others' chunks when it
      rescans (on open, ``stats``, ``gc``, and when at its bound at most every
      RESCAN_INTERVAL_S), so several writers can pass it by what they put
      between rescans.
    * ``store.json`` marks the directory as a store and records the bound (a
      tier opened with ``max_bytes=None`` uses the recorded one); ``stats.json``
      holds the hit/miss/error counters of every process, updated under
      ``flock`` at most every FLUSH_INTERVAL_S and on close.
    """

    name = "dir"

    def __init__(self, path: PathLike, max_bytes: Optional[int] = None):
        super().__init__()
        self.path = Path(path)
        bound = _check_bound(max_bytes)
        self._lock = threading.RLock()
        self._index: "OrderedDict[str, int]" = OrderedDict()  # key -> payload bytes, LRU first
        self._bytes = 0
        self._reserved = 0
        self._clock = 0
        self._scanned_at = 0.0
        self._writing: set = set()
        recorded = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            recorded = self._open_marker(bound)
        except OSError as e:
            self._warn("open", "store directory %s cannot be opened (%s): every lookup misses until it can",
                       self.path, e)
        self.max_bytes = bound if bound is not None else recorded
        self._rescan(tidy=True)

    # -- layout -----------------------------------------------------------------

    def _file(self, key: str) -> Path:
        return self.path / key[:2] / key

    def _open_marker(self, bound: Optional[int]) -> Optional[int]:
        """Check (or write) ``store.json``; the bound it records."""
        marker = self.path / "store.json"
        try:
            meta = json.loads(marker.read_text())
        except FileNotFoundError:
            foreign = sorted(n for n in os.listdir(self.path)
                             if n not in _OWN_FILES and not _SHARD.fullmatch(n)
                             and not _OWN_TEMPORARY.fullmatch(n))
            if foreign:
                raise ValueError(f"{self.path} is not a muser-kv store directory: it has no store.json "
                                 f"and holds other files ({', '.join(foreign[:5])})") from None
            meta = None
        except ValueError as e:
            raise ValueError(f"{marker}: expected a muser-kv store marker (JSON), got unreadable "
                             f"content ({e})") from None
        if meta is not None:
            if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
                raise ValueError(f"{marker}: expected format {STORE_FORMAT!r}, got {meta!r}")
            if meta.get("version") != STORE_VERSION:
                raise ValueError(f"{marker}: expected store version {STORE_VERSION}, "
                                 f"got {meta.get('version')!r}")
        recorded = meta.get("max_bytes") if meta else None
        if meta is None or (bound is not None and bound != recorded):
            self._write_json("store.json", {"format": STORE_FORMAT, "version": STORE_VERSION,
                                            "max_bytes": bound})
            return bound
        return recorded if isinstance(recorded, int) else None

    def _write_json(self, name: str, value: object) -> None:
        tmp = self.path / f".{name}.{os.getpid()}-{secrets.token_hex(8)}.tmp"
        try:
            tmp.write_text(json.dumps(value))
            os.replace(tmp, self.path / name)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _tick(self) -> int:
        """A recency stamp (ns), strictly increasing within this tier."""
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            return self._clock

    def _rescan(self, tidy: bool = False) -> None:
        """Rebuild the index from the directory (LRU order by mtime); with
        ``tidy``, remove the temporaries of processes that are gone."""
        found: List[Tuple[int, str, int]] = []
        try:
            shards = [s for s in os.listdir(self.path) if _SHARD.fullmatch(s)]
        except OSError:
            shards = []
        me = os.getpid()
        for shard in shards:
            try:
                names = os.listdir(self.path / shard)
            except OSError:
                continue
            for name in names:
                if KEY_PATTERN.fullmatch(name) and name[:2] == shard:
                    try:
                        st = os.stat(self.path / shard / name)
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, name, max(st.st_size - frame_size(name), 0)))
                elif tidy:
                    m = _TEMPORARY.fullmatch(name)
                    if m and int(m.group(2)) != me and not _alive(int(m.group(2))):
                        try:
                            os.unlink(self.path / shard / name)
                        except OSError:
                            pass
        found.sort()
        with self._lock:
            self._index = OrderedDict((k, n) for _, k, n in found)
            self._bytes = sum(self._index.values())
            if found:
                self._clock = max(self._clock, found[-1][0])
            self._scanned_at = time.monotonic()

    # -- the interface ------------------------------------------------------------

    def get(self, key: str) -> Optional[bytes]:
        check_key(key)
        path = self._file(key)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            with self._lock:
                n = self._index.pop(key, None)
                if n is not None:
                    self._bytes -= n
            self._counts.add(misses=1)
            return None
        except OSError as e:
            self._counts.add(misses=1, errors=1)
            self._warn(f"get:{e.errno}", "store directory %s: reading chunk %s failed (%s): a miss",
                       self.path, key, e)
            return None
        with f:
            st: Optional[os.stat_result] = None
            try:
                st = os.fstat(f.fileno())
                head = f.read(frame_size(key))
                n, digest = parse_header(key, head)
                if st.st_size - frame_size(key) != n:
                    raise FrameError(f"file of {st.st_size} bytes, the frame says "
                                     f"{frame_size(key)} + {n}")
                payload = f.read(n) if n else b""
                check_payload(key, n, digest, payload)
            except FrameError as e:
                log.warning("store directory %s: chunk %s is corrupt (%s): deleted, a miss", self.path, key, e)
                self._discard_if_same(key, path, st)
                self._counts.add(misses=1, errors=1)
                return None
            except OSError as e:
                self._counts.add(misses=1, errors=1)
                self._warn(f"get:{e.errno}", "store directory %s: reading chunk %s failed (%s): a miss",
                           self.path, key, e)
                return None
            now = self._tick()
            try:
                os.utime(f.fileno(), ns=(now, now))
            except OSError:
                pass  # a read-only directory serves, without refreshing recency
        with self._lock:
            if key not in self._index:
                self._bytes += n
            self._index[key] = n
            self._index.move_to_end(key)
        self._counts.add(hits=1)
        self._maybe_flush()
        return payload

    def _discard_if_same(self, key: str, path: Path, st: Optional[os.stat_result]) -> None:
        """Delete the corrupt file ``st`` unless another put has replaced it since."""
        try:
            now = os.stat(path)
            if st is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)
        except OSError:
            pass
        with self._lock:
            n = self._index.pop(key, None)
            if n is not None:
                self._bytes -= n

    def put(self, key: str, blob: bytes, replace: bool = False) -> bool:
        check_key(key)
        payload = _payload_view(blob)
        n = payload.nbytes
        path = self._file(key)
        try:
            os.stat(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            return self._put_failed(key, e)
        else:
            if replace:
                return self._write(key, path, payload, n)
            now = self._tick()
            try:
                os.utime(path, ns=(now, now))
            except OSError:
                pass
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            return True
        if self.max_bytes is not None and n > self.max_bytes:
            self._counts.add(errors=1)
            self._warn("put:bound", "store directory %s: chunk %s of %d bytes is larger than the bound "
                       "(%d bytes): not stored", self.path, key, n, self.max_bytes)
            return False
        return self._write(key, path, payload, n)

    def _write(self, key: str, path: Path, payload: memoryview, n: int) -> bool:
        self._reserve(n)
        tmp = path.parent / f".{key}.{os.getpid()}-{secrets.token_hex(8)}.tmp"
        try:
            try:
                path.parent.mkdir(exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
                try:
                    _write_all(fd, memoryview(frame_header(key, payload)), payload)
                    now = self._tick()  # recency from one clock: the kernel's mtime is coarser
                    os.utime(fd, ns=(now, now))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as e:
            with self._lock:
                self._reserved -= n
            return self._put_failed(key, e)
        with self._lock:
            self._reserved -= n
            self._bytes += n - self._index.get(key, 0)
            self._index[key] = n
            self._index.move_to_end(key)
        self._maybe_flush()
        return True

    def _put_failed(self, key: str, e: OSError) -> bool:
        self._counts.add(errors=1)
        what = "disk full" if e.errno == errno.ENOSPC else "failed"
        self._warn(f"put:{e.errno}", "store directory %s: writing chunk %s %s (%s): not stored",
                   self.path, key, what, e)
        return False

    def _reserve(self, n: int) -> None:
        """Evict least recently used chunks until ``n`` more bytes fit the bound,
        and count them as on their way."""
        with self._lock:
            if self.max_bytes is None:
                self._reserved += n
                return
            if (self._bytes + self._reserved + n > self.max_bytes
                    and time.monotonic() - self._scanned_at >= RESCAN_INTERVAL_S):
                self._rescan()
            self._evict_until(self.max_bytes - n - self._reserved)
            self._reserved += n

    def _evict_until(self, limit: int) -> int:
        evicted = 0
        with self._lock:
            while self._index and self._bytes > max(limit, 0):
                key, n = self._index.popitem(last=False)
                self._bytes -= n
                try:
                    os.unlink(self._file(key))
                    evicted += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self._warn(f"evict:{e.errno}", "store directory %s: evicting chunk %s failed (%s)",
                               self.path, key, e)
        return evicted

    def contains(self, key: str) -> bool:
        check_key(key)
        try:
            os.stat(self._file(key))
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            self._counts.add(errors=1)
            self._warn(f"contains:{e.errno}", "store directory %s: looking up chunk %s failed (%s)",
                       self.path, key, e)
            return False

    def delete(self, key: str) -> None:
        check_key(key)
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn(f"delete:{e.errno}", "store directory %s: deleting chunk %s failed (%s)",
                       self.path, key, e)
        with self._lock:
            n = self._index.pop(key, None)
            if n is not None:
                self._bytes -= n

    def _shared_counts(self) -> Tuple[int, int, int]:
        try:
            d = json.loads((self.path / "stats.json").read_text())
            return int(d["hits"]), int(d["misses"]), int(d["errors"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0, 0, 0

    def stats(self) -> TierStats:
        self._rescan()
        hits, misses, errors = self._shared_counts()
        with self._counts.lock:
            hits += self._counts.hits
            misses += self._counts.misses
            errors += self._counts.errors
        with self._lock:
            return TierStats(self.name, len(self._index), self._bytes, self.max_bytes, hits, misses, errors)

    def gc(self, max_bytes: Optional[int] = None) -> int:
        bound = _check_bound(max_bytes)
        bound = self.max_bytes if bound is None else bound
        self._rescan()
        if bound is None:
            return 0
        return self._evict_until(bound)

    def flush(self) -> None:
        counts = self._counts.take()
        if not any(counts):
            return
        import fcntl

        try:
            fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                hits, misses, errors = self._shared_counts()
                self._write_json("stats.json", {"hits": hits + counts[0], "misses": misses + counts[1],
                                                "errors": errors + counts[2]})
            finally:
                os.close(fd)  # releases the lock
        except OSError as e:
            self._counts.give_back(counts)
            log.debug("store directory %s: counters not written (%s)", self.path, e)


class _Failed:
    """A Redis call that did not complete (the tier is down or the command failed)."""


_FAILED = _Failed()


class RedisTier(BlobTier):
    """Chunks as Redis strings ``muser-kv:chunk:<key>``, each one framed value
    set whole by one ``SET NX`` (atomic; a second put of the key is a ``TOUCH``,
    a lookup that refreshes its recency, not a write).

    * **The bound is Redis's own** ``maxmemory`` with ``maxmemory-policy
      allkeys-lru``, set by whoever runs the server: Redis is shared by many
      processes and machines, and only the server can evict atomically and in
      one LRU order for all of them (a client-side bound would need a shared
      index written on every read, and would drift whenever Redis evicts by
      itself). ``max_bytes`` is the bound ``gc`` evicts to (SCAN over our keys,
      most idle first by ``OBJECT IDLETIME``) and the capacity ``stats``
      reports; without it, the capacity is the server's ``maxmemory``.
    * ``stats`` counts our keys by SCAN, their bytes by ``MEMORY USAGE`` (what
      Redis spends on them: payload, frame and per-key overhead; neither touches
      recency). Counters live in the hash ``muser-kv:stats``.
    * **Faults and back-off.** Every command has ``timeout`` seconds (connect
      and each socket operation) and no client retries. A connection failure
      or timeout marks the tier down for ``backoff`` seconds, doubling to
      ``backoff_max`` while it keeps failing: meanwhile every call is a miss at
      once, without touching the network, so a dead Redis costs at most one
      timeout per back-off period. The first call after it tries again on a
      fresh connection; after Redis is back the tier works again by itself.
    """

    name = "redis"
    PREFIX = "muser-kv:chunk:"
    STATS_KEY = "muser-kv:stats"

    def __init__(self, url: str, max_bytes: Optional[int] = None, timeout: float = 1.0,
                 backoff: float = 0.5, backoff_max: float = 5.0):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError(f"the Redis tier ({url}) needs the redis package, which is not installed: "
                              f"pip install -e '.[store]'") from e
        if not (timeout > 0 and backoff > 0 and backoff_max >= backoff):
            raise ValueError(f"timeout and backoff must be > 0 and backoff_max >= backoff, got "
                             f"timeout={timeout!r}, backoff={backoff!r}, backoff_max={backoff_max!r}")
        super().__init__()
        self.url = url
        self.max_bytes = _check_bound(max_bytes)
        self._redis = redis
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._backoff = (backoff, backoff_max)
        self._state_lock = threading.Lock()
        self._down_until = 0.0
        self._delay = backoff
        self._down = False

    def _k(self, key: str) -> str:
        return self.PREFIX + key

    def _call(self, op: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)``, or _FAILED (logged once per outage) when Redis fails or is backed off."""
        with self._state_lock:
            if time.monotonic() < self._down_until:
                self._counts.add(errors=1)
                return _FAILED
        try:
            out = fn(self._client)
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as e:
            with self._state_lock:
                delay = self._delay
                self._down_until = time.monotonic() + delay
                self._delay = min(delay * 2, self._backoff[1])
                first = not self._down
                self._down = True
            try:
                self._client.connection_pool.disconnect()
            except Exception:  # dropping dead sockets must not raise
                pass
            self._counts.add(errors=1)
            if first:
                log.warning("redis %s: %s failed (%s): misses until it answers (retrying after %.1f s, "
                            "backing off to %.1f s)", self.url, op, e, delay, self._backoff[1])
            return _FAILED
        except self._redis.RedisError as e:
            self._counts.add(errors=1)
            self._warn(f"{op}:{type(e).__name__}", "redis %s: %s failed (%s)", self.url, op, e)
            return _FAILED
        if self._down:
            with self._state_lock:
                was_down, self._down = self._down, False
                self._delay = self._backoff[0]
            if was_down:
                log.warning("redis %s answers again", self.url)
        return out

    def get(self, key: str) -> Optional[bytes]:
        check_key(key)
        value = self._call("get", lambda c: c.get(self._k(key)))
        if value is _FAILED or value is None:
            self._counts.add(misses=1)
            return None
        try:
            payload = unframe(key, value)
        except FrameError as e:
            log.warning("redis %s: chunk %s is corrupt (%s): deleted, a miss", self.url, key, e)
            self._call("delete", lambda c: c.delete(self._k(key)))
            self._counts.add(misses=1, errors=1)
            return None
        self._counts.add(hits=1)
        self._maybe_flush()
        return payload

    def put(self, key: str, blob: bytes, replace: bool = False) -> bool:
        check_key(key)
        payload = _payload_view(blob)
        present = False if replace else self._call("touch", lambda c: c.touch(self._k(key)))
        if present is _FAILED:
            return False
        if present:
            return True
        if payload.nbytes + frame_size(key) > REDIS_MAX_VALUE:
            self._counts.add(errors=1)
            self._warn("put:size", "redis %s: chunk %s of %d bytes is larger than a Redis value may be "
                       "(%d bytes with its frame): not stored", self.url, key, payload.nbytes, REDIS_MAX_VALUE)
            return False
        value = frame_header(key, payload) + payload
        done = self._call("put", lambda c: c.set(self._k(key), value, nx=not replace))
        self._maybe_flush()
        return done is not _FAILED  # None: another client set it first, one copy

    def contains(self, key: str) -> bool:
        check_key(key)
        out = self._call("contains", lambda c: c.exists(self._k(key)))
        return out is not _FAILED and bool(out)

    def delete(self, key: str) -> None:
        check_key(key)
        self._call("delete", lambda c: c.delete(self._k(key)))

    def _our_keys(self) -> Optional[List[bytes]]:
        keys = self._call("scan", lambda c: list(c.scan_iter(match=self.PREFIX + "*", count=1000,
                                                             _type="string")))
        return None if keys is _FAILED else keys

    def _usage(self, keys: List[bytes]) -> List[int]:
        """MEMORY USAGE of each key (0 for one gone since), in batches."""
        sizes: List[int] = []
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]

            def run(c: Any, batch: List[bytes] = batch) -> List[Any]:
                p = c.pipeline(transaction=False)
                for k in batch:
                    p.memory_usage(k, samples=0)
                return p.execute(raise_on_error=False)

            out = self._call("stats", run)
            if out is _FAILED:
                return []
            sizes.extend(int(v) if isinstance(v, int) else 0 for v in out)
        return sizes

    def _capacity(self) -> Optional[int]:
        if self.max_bytes is not None:
            return self.max_bytes
        info = self._call("stats", lambda c: c.info("memory"))
        if info is _FAILED:
            return None
        return int(info.get("maxmemory", 0)) or None

    def stats(self) -> TierStats:
        keys = self._our_keys() or []
        sizes = self._usage(keys)
        shared = self._call("stats", lambda c: c.hgetall(self.STATS_KEY))
        counts = {"hits": 0, "misses": 0, "errors": 0}
        if shared is not _FAILED:
            for k, v in shared.items():
                name = k.decode() if isinstance(k, bytes) else str(k)
                if name in counts:
                    counts[name] = int(v)
        with self._counts.lock:
            counts["hits"] += self._counts.hits
            counts["misses"] += self._counts.misses
            counts["errors"] += self._counts.errors
        present = sum(1 for s in sizes if s)
        return TierStats(self.name, present, sum(sizes), self._capacity(), counts["hits"],
                         counts["misses"], counts["errors"])

    def gc(self, max_bytes: Optional[int] = None) -> int:
        bound = _check_bound(max_bytes)
        bound = self._capacity() if bound is None else bound
        if bound is None:
            return 0
        keys = self._our_keys()
        if not keys:
            return 0
        sizes = self._usage(keys)
        if len(sizes) != len(keys):
            return 0

        def idle(c: Any) -> List[Any]:
            p = c.pipeline(transaction=False)
            for k in keys:
                p.object("idletime", k)
            return p.execute(raise_on_error=False)

        idles = self._call("gc", idle)
        if idles is _FAILED:
            return 0
        order = sorted(range(len(keys)), key=lambda i: -(idles[i] if isinstance(idles[i], int) else 0))
        total = sum(sizes)
        evicted = 0
        for i in order:
            if total <= bound:
                break

            def evict(c: Any, k: bytes = keys[i]) -> Any:
                return c.delete(k)

            if self._call("gc", evict) is _FAILED:
                break
            total -= sizes[i]
            evicted += 1
        return evicted

    def flush(self) -> None:
        counts = self._counts.take()
        if not any(counts):
            return

        def add(c: Any) -> Any:
            p = c.pipeline(transaction=True)
            for name, v in zip(("hits", "misses", "errors"), counts):
                if v:
                    p.hincrby(self.STATS_KEY, name, v)
            return p.execute()

        with self._state_lock:
            down = time.monotonic() < self._down_until
        if down:
            self._counts.give_back(counts)
            return
        try:
            add(self._client)
        except self._redis.RedisError:
            self._counts.give_back(counts)

    def close(self) -> None:
        super().close()
        try:
            self._client.close()
        except Exception:  # closing sockets must not raise
            pass


def open_tier(location: str, max_bytes: Optional[int] = None) -> BlobTier:
    """``redis://HOST:PORT[/db]`` (or ``rediss://``) -> :class:`RedisTier`;
    anything else is a directory path -> :class:`DirectoryTier`."""
    if not isinstance(location, (str, os.PathLike)):
        raise TypeError(f"a store location is a directory path or redis:// URL, got {location!r}")
    text = os.fspath(location)
    if text.startswith(("redis://", "rediss://", "unix://")):
        return RedisTier(text, max_bytes)
    return DirectoryTier(text, max_bytes)
