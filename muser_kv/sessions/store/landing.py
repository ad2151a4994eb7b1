"""Where the byte tiers' reads land: host-visible MLX buffers, made ahead.

A chunk read from the directory or Redis lands in a new host-visible MLX
buffer (a CPU stream's allocation), is verified there and decoded into views
of it (``chunks.decode``). On MLX CUDA that memory is managed, and the first
touch of each of its pages is a fault the driver serves one at a time, which
costs a reader more than reading, hashing and migrating the chunk
([store.md](../../../docs/store.md), "Reading a tier"). So a store keeps a stock of buffers
made ahead, off the request's path, in the sizes its chunks have, and a read
takes one. What lookups took is made again when asked (``restock``: a server
asks while it idles, a little at a time, since making managed memory while
the GPU works slows that work down).

A stocked buffer is used once and never returned (the views a decode makes
keep it alive for as long as the rows live, which the store does not track),
so a buffer in use is never written again. The stock is bounded in bytes;
a read finding none of its size allocates one then, as it would without it.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from typing import Dict, List, Mapping, Optional, Tuple

import mlx.core as mx
import numpy as np

from muser_kv.sessions import reading

#: A stocked buffer's size is its payload's rounded up to this (payloads of one
#: kind differ by a few header bytes: one size serves them all).
GRAIN = 4096
#: The stock's default bound: a 32k rebuild of Muse Glimmer reads 517 MB.
DEFAULT_LANDING_BYTES = 1 << 30


def size_class(n: int) -> int:
    return max(GRAIN, -(-n // GRAIN) * GRAIN)


class Landing:
    """Buffers made ahead for tier reads, at most ``max_bytes`` of them
    (module doc). Thread-safe: reader threads take, allocator threads stock."""

    def __init__(self, max_bytes: int = DEFAULT_LANDING_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"landing_bytes is a byte count >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._made = threading.Condition(self._lock)  # notified as each stocked buffer lands
        self._stock: Dict[int, List[mx.array]] = {}
        self._want: Dict[int, int] = {}
        self._pending: Dict[int, int] = {}
        self._closed = False

    @property
    def nbytes(self) -> int:
        """Bytes stocked now."""
        with self._lock:
            return sum(size * len(xs) for size, xs in self._stock.items())

    def plan(self, wants: Mapping[int, int]) -> None:
        """Keep ``wants[n]`` buffers for payloads of ``n`` bytes, in the order
        given, as many as fit in ``max_bytes``."""
        left, want = self.max_bytes, {}  # type: Tuple[int, Dict[int, int]]
        for n, count in wants.items():
            size = size_class(n)
            take = min(count, left // size)
            if take > 0:
                want[size] = want.get(size, 0) + take
                left -= take * size
        with self._lock:
            self._want = want

    def take(self, n: int) -> Tuple[mx.array, np.ndarray]:
        """A buffer of at least ``n`` bytes, from the stock if it has one of that
        size, and a writable view of its first ``n`` bytes (a view, not an MLX
        slice: any thread may take, and MLX ops belong to the caller's thread)."""
        size = size_class(n)
        with self._lock:
            stocked = self._stock.get(size)
            x = stocked.pop() if stocked else None
        if x is None:
            return reading.host_bytes(n)
        return x, reading.writable(x)[:n]

    def restock(self, max_bytes: Optional[int] = None, wait: bool = False) -> int:
        """Make what the plan lacks, at most ``max_bytes`` of it, on the
        allocator threads; ``wait``: return once everything being made has
        landed. The bytes set to be made."""
        sizes: List[int] = []
        with self._lock:
            if self._closed:
                return 0
            left = self.max_bytes if max_bytes is None else max_bytes
            for size, count in self._want.items():
                have = len(self._stock.get(size, [])) + self._pending.get(size, 0)
                make = max(0, min(count - have, left // size))
                sizes += [size] * make
                self._pending[size] = self._pending.get(size, 0) + make
                left -= make * size
        for size in sizes:
            reading.host_zeros((size,), mx.uint8).add_done_callback(
                functools.partial(self._stocked, size))
        if wait:
            with self._made:
                self._made.wait_for(lambda: not any(self._pending.values()))
        return sum(sizes)

    def _stocked(self, size: int, made: "Future[mx.array]") -> None:
        with self._made:
            self._pending[size] -= 1
            if made.exception() is None and not self._closed:
                self._stock.setdefault(size, []).append(made.result())
            self._made.notify_all()

    def close(self) -> None:
        """Drop the stock; nothing is made again."""
        with self._lock:
            self._closed = True
            self._stock.clear()
