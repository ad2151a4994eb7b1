"""The Redis tier: chunks as Redis strings, shared between processes and
machines (the invariants every tier keeps: ``tiers``)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional

import numpy as np

from muser_kv.sessions.store.tiers import (
    Alloc,
    BlobTier,
    FrameError,
    TierStats,
    check_bound,
    check_key,
    frame_header,
    frame_size,
    log,
    payload_view,
    unframe,
)

#: Redis's default ``proto-max-bulk-len``: a longer value would make the server drop
#: the connection (which would read as an outage), so such a put is refused here.
REDIS_MAX_VALUE = 512 << 20


class _Failed:
    """A Redis call that did not complete (the tier is down or the command failed)."""


_FAILED = _Failed()


class _WrongType:
    """A key of ours that holds another Redis type than a string (a list, a hash)."""


_WRONG_TYPE = _WrongType()


class RedisTier(BlobTier):
    """Chunks as Redis strings ``muser-kv:chunk:<key>``, each one framed value
    set whole by one ``SET NX`` (atomic; a second put of the key is a ``TOUCH``,
    a lookup that refreshes its recency, not a write). A key of ours holding
    another type (a list, a hash) is no chunk: ``contains`` says so, and ``get``
    and ``put`` delete it, as they would a corrupt string.

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
        self.max_bytes = check_bound(max_bytes)
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
        view = self._get(key)
        return None if view is None else bytes(view)

    def get_into(self, key: str, alloc: Alloc) -> Optional[np.ndarray]:
        view = self._get(key)
        if view is None:
            return None
        out = alloc(view.nbytes)
        out[...] = np.frombuffer(view, dtype=np.uint8)
        return out

    def _get(self, key: str) -> Optional[memoryview]:
        """The verified payload of ``key``'s value, as a view of it; None: a miss."""
        check_key(key)
        value = self._call("get", lambda c: self._value(c, key))
        if value is _FAILED or value is None:
            self._counts.add(misses=1)
            return None
        try:
            if value is _WRONG_TYPE:
                raise FrameError("a Redis value of another type than a string")
            payload = unframe(key, value)
        except FrameError as e:
            self._drop(key, str(e), "a miss")
            self._counts.add(misses=1)
            return None
        self._counts.add(hits=1)
        self._maybe_flush()
        return payload

    def _value(self, client: Any, key: str) -> Any:
        """``GET`` of ``key``; ``_WRONG_TYPE`` where the key holds another type:
        a value that is not what its key promises, to drop like a corrupt one
        (as a fault of the tier it would be kept, and every later put of the
        key would find it present)."""
        try:
            return client.get(self._k(key))
        except self._redis.ResponseError as e:
            if str(e).startswith("WRONGTYPE"):
                return _WRONG_TYPE
            raise

    def _drop(self, key: str, why: str, then: str) -> None:
        """Delete ``key``'s value, which is not what its key promises (``why``)."""
        log.warning("redis %s: chunk %s is corrupt (%s): deleted, %s", self.url, key, why, then)
        self._call("delete", lambda c: c.delete(self._k(key)))
        self._counts.add(errors=1)

    def _kind(self, client: Any, key: str) -> str:
        """The Redis type of ``key`` (``none``: absent), its recency refreshed
        where present: ``TYPE`` and ``TOUCH`` in one round trip."""
        pipe = client.pipeline(transaction=False)
        pipe.type(self._k(key))
        pipe.touch(self._k(key))
        kind = pipe.execute()[0]
        return kind.decode() if isinstance(kind, bytes) else str(kind)

    def put(self, key: str, blob: bytes, replace: bool = False) -> bool:
        check_key(key)
        payload = payload_view(blob)
        kind = "none" if replace else self._call("touch", lambda c: self._kind(c, key))
        if kind is _FAILED:
            return False
        if kind == "string":
            return True
        if kind != "none":
            self._drop(key, f"a Redis value of type {kind}, not a string", "stored again")
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
        """Whether ``key`` holds a chunk (a value of another type does not)."""
        check_key(key)
        out = self._call("contains", lambda c: c.type(self._k(key)))
        return out is not _FAILED and out in (b"string", "string")

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
        bound = check_bound(max_bytes)
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
