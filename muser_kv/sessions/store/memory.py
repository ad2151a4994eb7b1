"""The memory tier: stored objects as MLX arrays, bounded in bytes, least
recently used first out. Holding an array holds its buffer only: every row the
store keeps is a fresh copy, never a view of a plane (a view would keep the
whole plane alive)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Tuple

from muser_kv.sessions.store.chunks import Stored, nbytes


@dataclass
class MemoryStats:
    name: str
    chunks: int
    bytes: int
    capacity: Optional[int]
    hits: int
    misses: int
    errors: int = 0


class MemoryTier:
    """Objects by key, at most ``max_bytes`` of them (an object larger than the
    bound is not kept)."""

    name = "memory"

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"memory tier bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._objects: "OrderedDict[str, Tuple[Stored, int]]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: str) -> Optional[Stored]:
        with self._lock:
            entry = self._objects.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._objects.move_to_end(key)
            self.hits += 1
            return entry[0]

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._objects

    def put(self, key: str, obj: Stored) -> bool:
        size = nbytes(obj)
        with self._lock:
            old = self._objects.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.max_bytes:
                return False
            self._objects[key] = (obj, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, gone) = self._objects.popitem(last=False)
                self._bytes -= gone
            return True

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._objects.pop(key, None)
            if old is not None:
                self._bytes -= old[1]

    def objects(self) -> List[Stored]:
        """Every object held, least recently used first."""
        with self._lock:
            return [obj for obj, _ in self._objects.values()]

    def stats(self) -> MemoryStats:
        with self._lock:
            return MemoryStats(self.name, len(self._objects), self._bytes, self.max_bytes,
                               self.hits, self.misses)
