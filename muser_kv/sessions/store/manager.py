"""The store's tier manager: stored objects by key, in the memory tier and the
byte tiers behind it.

It knows nothing of tokens or positions (the planner, ``planner``, names every
key): it keeps an object in memory and sends it to the byte tiers, on one
writer thread when writing behind (``flush`` waits for it); it reads what the
memory tier lacks from the byte tiers side by side (``reader``), into the
landing stock (``landing``), and keeps what it read in memory. The one object
that changes, a name's ``Index`` of tail lengths, is merged, never replaced:
in memory under a lock, and in a byte tier with what that tier holds (another
process may have added to it).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from muser_kv.sessions.store import chunks
from muser_kv.sessions.store.chunks import Index
from muser_kv.sessions.store.landing import DEFAULT_LANDING_BYTES, Landing
from muser_kv.sessions.store.memory import MemoryTier
from muser_kv.sessions.store.reader import TierReader, read_object

if TYPE_CHECKING:
    from muser_kv.sessions.store.tiers import BlobTier

log = logging.getLogger("muser_kv.store")

#: The memory tier's default bound.
DEFAULT_MEMORY_BYTES = 4 << 30


def open_tier(location: str, max_bytes: Optional[int] = None, *, create: bool = True) -> "BlobTier":
    """``redis://HOST:PORT[/db]`` (or ``rediss://``) -> ``RedisTier``;
    anything else is a directory path -> ``DirectoryTier`` (made a store there
    unless ``create=False``: then only an existing store, else ``ValueError``)."""
    if not isinstance(location, (str, os.PathLike)):
        raise TypeError(f"a store location is a directory path or redis:// URL, got {location!r}")
    text = os.fspath(location)
    if text.startswith(("redis://", "rediss://", "unix://")):
        from muser_kv.sessions.store.redis_tier import RedisTier  # a tier's code loads once one is opened

        return RedisTier(text, max_bytes)
    from muser_kv.sessions.store.directory import DirectoryTier

    return DirectoryTier(text, max_bytes, create=create)


class TierManager:
    """The memory tier (``memory_bytes``), and the byte tier at ``location``
    (``open_tier``; ``None``: none) bounded by ``store_bytes``, with its
    reads' landing stock of at most ``landing_bytes`` (module doc)."""

    def __init__(self, location: Optional[str] = None, *, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 store_bytes: Optional[int] = None, write_behind: bool = True,
                 landing_bytes: int = DEFAULT_LANDING_BYTES):
        self.memory = MemoryTier(memory_bytes)
        self.landing = Landing(landing_bytes)
        self.tiers: List[Any] = []
        if location is not None:
            self.tiers.append(open_tier(str(location), store_bytes))
        self._reader = TierReader(self.tiers, self.landing)
        self._lock = threading.Lock()  # a name's index: read, merged, kept as one step
        self._queue: "queue.Queue[Optional[Tuple[str, Any, str]]]" = queue.Queue()
        self._writer: Optional[threading.Thread] = None
        self._write_behind = write_behind and bool(self.tiers)

    # -- reads ------------------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return self.memory.contains(key) or any(t.contains(key) for t in self.tiers)

    def get(self, key: str, encoding: str) -> Any:
        return self.get_many([key], encoding)[key]

    def get_many(self, keys: Sequence[str], encoding: str) -> Dict[str, Any]:
        """The object of every key (``None``: a miss): from the memory tier, else
        read from the byte tiers side by side and kept in memory."""
        out = {key: self.memory.get(key) for key in dict.fromkeys(keys)}
        read = self._reader.read([key for key, obj in out.items() if obj is None], encoding)
        for key, obj in read.items():
            if obj is not None:
                self.memory.put(key, obj)
            out[key] = obj
        return out

    def tails(self, key: str, encoding: str) -> frozenset:
        """The tail lengths the index ``key`` lists in any tier."""
        tails: set = set()
        have = self.memory.get(key)
        if isinstance(have, Index):
            tails |= have.tails
        for tier in self.tiers:
            obj = read_object(tier, key, encoding)
            if isinstance(obj, Index):
                tails |= obj.tails
        return frozenset(tails)

    # -- writes -----------------------------------------------------------------------------

    def keep_all(self, items: Sequence[Tuple[str, Any]], encoding: str) -> None:
        """Keep every ``(key, object)`` in memory and send it to the byte tiers,
        as ``chunks.for_host`` gives it (the memory tier's own arrays are never
        read on the host: on MLX CUDA that would move them out of GPU memory)."""
        for key, obj in items:
            self.memory.put(key, obj)
        if self.tiers:
            for (key, _), sent in zip(items, chunks.for_host([obj for _, obj in items])):
                self._send(key, sent, encoding)

    def add_tail(self, key: str, r: int, encoding: str) -> None:
        """Add the tail length ``r`` to the index ``key``."""
        with self._lock:
            have = self.memory.get(key)
            tails = have.tails if isinstance(have, Index) else frozenset()
            if r in tails:
                return
            index = Index(tails | {r})
            self.memory.put(key, index)
        if self.tiers:
            self._send(key, index, encoding)

    def _send(self, key: str, obj: Any, encoding: str) -> None:
        if not self._write_behind:
            self._write(key, obj, encoding)
            return
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._drain, name="muser-kv-store-writer",
                                            daemon=True)
            self._writer.start()
        self._queue.put((key, obj, encoding))

    def _drain(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            except Exception:  # a tier's failure is a log line, never the writer's end
                log.exception("KV store: writing %s failed", job[0] if job else None)
            finally:
                self._queue.task_done()

    def _write(self, key: str, obj: Any, encoding: str) -> None:
        for tier in self.tiers:
            if isinstance(obj, Index):
                have = read_object(tier, key, encoding)
                if isinstance(have, Index):
                    if obj.tails <= have.tails:
                        continue
                    obj = Index(obj.tails | have.tails)
                tier.put(key, chunks.encode(obj, encoding), replace=True)
            elif not tier.contains(key):
                tier.put(key, chunks.encode(obj, encoding))

    # -- readiness, stats, lifetime ------------------------------------------------------------

    def prepare(self, sizes: Mapping[int, int]) -> None:
        """With a byte tier: stock landing buffers of these payload sizes
        (``Landing.plan``) and start the reader threads, now."""
        if self.tiers:
            self.landing.plan(sizes)
            self.landing.restock(wait=True)
            self._reader.start()

    def restock(self, max_bytes: Optional[int] = None) -> int:
        return self.landing.restock(max_bytes)

    @property
    def read_bytes(self) -> int:
        return self._reader.read_bytes

    @property
    def read_s(self) -> float:
        return self._reader.read_s

    @property
    def pending_writes(self) -> int:
        return self._queue.unfinished_tasks

    def tier_stats(self) -> List[Any]:
        """Each tier's stats, the memory tier's first."""
        return [self.memory.stats(), *(t.stats() for t in self.tiers)]

    def flush(self) -> None:
        """Wait until every object kept so far is written to every tier."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._reader.close()
        for tier in self.tiers:
            tier.close()
