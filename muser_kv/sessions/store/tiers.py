"""The byte tiers of the KV store: encoded chunks held as opaque bytes by key,
in a local directory (:class:`~muser_kv.sessions.store.directory.DirectoryTier`,
the embedded default) or in Redis
(:class:`~muser_kv.sessions.store.redis_tier.RedisTier`, shared between processes
and machines); ``manager.open_tier`` picks one for a location. This module holds
what they share: the frame, the counters and the :class:`BlobTier` interface.

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
import functools
import logging
import os
import re
import struct
import threading
import time
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np
import xxhash

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

PathLike = Union[str, "os.PathLike[str]"]
Blob = Union[bytes, bytearray, memoryview]
#: ``get_into``'s destination: ``n`` -> a new writable C-contiguous uint8 array of ``n`` bytes.
Alloc = Callable[[int], np.ndarray]


def check_key(key: object) -> str:
    """``key`` if it is a chunk key (32 to 64 lowercase hex digits), else ``ValueError``."""
    if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
        raise ValueError(f"a chunk key is 32 to 64 lowercase hex digits, got {key!r}")
    return key


def payload_view(blob: object) -> memoryview:
    """``blob``'s bytes as a flat byte view, else ``TypeError``."""
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


def unframe(key: str, value: bytes) -> memoryview:
    """The payload of the whole stored ``value`` of ``key`` (a view of it),
    verified; ``FrameError`` otherwise."""
    n, digest = parse_header(key, value)
    payload = memoryview(value)[frame_size(key):]
    check_payload(key, n, digest, payload)
    return payload


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
    def get_into(self, key: str, alloc: Alloc) -> Optional[np.ndarray]:
        """``get``, with the payload landing in ``alloc(len(payload))``, which is
        returned (the directory reads and verifies it there, with no copy)."""

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


def check_bound(max_bytes: Optional[int]) -> Optional[int]:
    """``max_bytes`` if it is a byte bound (an int >= 0) or None, else ``ValueError``."""
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes is a byte count >= 0 or None, got {max_bytes!r}")
    return max_bytes
