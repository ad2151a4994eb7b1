"""Reading stored objects from the byte tiers (directory, Redis) for a lookup.

The objects a rebuild needs are read side by side, on reader threads that
each read one payload straight into a host-visible MLX buffer (``landing``),
verify it there and, on MLX CUDA, move it to the GPU in bulk
(``managed.to_gpu``). Decoding them into views of those buffers
(``chunks.decode``) stays on the calling thread, which owns the MLX streams
the views are built on. An object that is not what its key says is dropped
from its tier, with a log line, and the next tier is asked.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from muser_kv.sessions import managed
from muser_kv.sessions.store import chunks
from muser_kv.sessions.store.landing import Landing
from muser_kv.sessions.tensorfile import workers

log = logging.getLogger("muser_kv.store")

#: What a reader thread hands back: (tier index, buffer, payload bytes).
Fetched = Tuple[int, mx.array, int]


class TierReader:
    """Reads for one store's byte tiers (module doc); ``read_bytes`` and
    ``read_s`` count the payload bytes read and the wall seconds lookups
    waited for them."""

    def __init__(self, tiers: Sequence[Any], landing: Landing):
        self.tiers, self.landing = list(tiers), landing
        self.read_bytes, self.read_s = 0, 0.0
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None

    def read(self, keys: Sequence[str], encoding: str) -> Dict[str, Any]:
        """The object of every key (distinct keys; ``None``: a miss)."""
        if not keys or not self.tiers:
            return {key: None for key in keys}
        t0 = time.perf_counter()
        if len(keys) > 1:
            fetched = list(self._readers().map(self._fetch, keys))
        else:
            fetched = [self._fetch(keys[0])]
        with self._lock:
            self.read_s += time.perf_counter() - t0
            self.read_bytes += sum(got[2] for got in fetched if got is not None)
        return {key: self._decode(key, got, encoding) for key, got in zip(keys, fetched)}

    def start(self) -> None:
        """Start the reader threads and the CUDA prefetcher now, not in a lookup."""
        self._readers()
        managed.prefetcher()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()
        self.landing.close()

    def _readers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(workers(), thread_name_prefix="muser-kv store reader")
            return self._pool

    def _fetch(self, key: str, first: int = 0) -> Optional[Fetched]:
        """The payload of ``key`` from the first tier from ``first`` on that
        holds it whole: read into a landing buffer, verified, migrated."""
        for i in range(first, len(self.tiers)):
            landed: List[mx.array] = []
            view = self.tiers[i].get_into(key, functools.partial(self._land, landed))
            if view is not None:
                managed.to_gpu(view)
                return i, landed[-1], view.nbytes
        return None

    def _land(self, landed: List[mx.array], n: int) -> Any:
        x, view = self.landing.take(n)
        landed.append(x)
        return view

    def _decode(self, key: str, got: Optional[Fetched], encoding: str) -> Any:
        while got is not None:
            i, buffer, n = got
            obj = decoded(self.tiers[i], key, buffer if buffer.size == n else buffer[:n], encoding)
            if obj is not None:
                return obj
            got = self._fetch(key, i + 1)
        return None


def decoded(tier: Any, key: str, payload: chunks.Payload, encoding: str) -> Any:
    """The object ``payload`` (read from ``tier`` under ``key``) encodes, or
    ``None``: it is not what its key says, and is dropped from the tier."""
    try:
        return chunks.decode(payload, encoding)
    except chunks.ChunkFormatError as e:
        log.warning("KV store: %s tier: object %s is not what its key says (%s); dropped",
                    tier.name, key, e)
        tier.delete(key)
        return None


def read_object(tier: Any, key: str, encoding: str) -> Any:
    """The object ``tier`` holds under ``key`` as bytes (a small one: an
    index), or ``None``: absent, or not what its key says."""
    blob = tier.get(key)
    return None if blob is None else decoded(tier, key, blob, encoding)
