"""``KVStore``: exact reuse of any stored point of a conversation, by prefix.

A state at position ``n`` is rebuilt exactly from the rows of the positions
before ``n``: every global plane takes all of them, every ring the last
``window`` of them at its positional rotation, through the one restore path a
session load takes (``muser_kv.sessions.restore``). Rows of a position never change once written (a
plane only appends; a trim forgets rows, it never rewrites one), so rows kept
from a list at any later position are the rows the list held at ``n``.

What is kept (``chunks``): per 256-token chunk, its global rows (``G``); its
sliding rows (``S``) when a put saw the whole chunk in the rings; and per put
point its tail and the sliding rows of its window no ``S`` holds (``P``).

**Rebuildable positions.** Every put point, and every chunk boundary ``b``
whose window ``[b - window, b)`` lies in ``S`` chunks: the boundaries within
the window before a put point (a ring holds only the last ``window`` rows, so
rows older than that were never seen by a put). A position stays rebuildable
while every object it needs is in some tier.

**What a put costs.** A lookup per chunk of the prefix, and a copy only of
what no tier holds: the new chunks' global rows, the new whole chunks of the
window, and the point (its tail's global rows, at most two runs of sliding
rows). The copies are gathered on the device in one evaluation, each layer's
rows of a run of adjacent chunks at once, stacked layer-major and cut into
chunks (``chunks.Rows``: one block per plane for all the layers of a kind), so
neither a put nor a rebuild makes an operation per chunk and layer; writing
them to the directory or Redis tier happens behind, on one writer thread
(``flush`` waits for it).

**Faults.** A stored object that fails its digest (the byte tiers check it),
is truncated, or is not what its key says (``chunks.decode``) is a miss and is
dropped; a tier that fails is a miss and a log line. A rebuild assembles every
row before it installs any: a missing object passes the position over, for a
shallower one, and never leaves a list half-written.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from muser_kv.caches.base import MuseKVCache
from muser_kv.caches.factory import make_prompt_cache
from muser_kv.core.geometry import LayerKind
from muser_kv.sessions import restore
from muser_kv.sessions.fingerprint import differs, model_fingerprint
from muser_kv.sessions.format import ModelMismatch, plane_encoding
from muser_kv.sessions.restore import LayerCut, cache_geometry, list_model
from muser_kv.sessions.store import chunks
from muser_kv.sessions.store.chunks import CHUNK, Index, Point, Rows, Scope
from muser_kv.sessions.store.landing import DEFAULT_LANDING_BYTES, Landing
from muser_kv.sessions.store.memory import MemoryTier
from muser_kv.sessions.store.reader import TierReader, read_object
from muser_kv.sessions.store.rows import cut, fits, gather

if TYPE_CHECKING:
    from muser_kv.sessions.store.tiers import BlobTier

log = logging.getLogger("muser_kv.store")

#: The memory tier's default bound.
DEFAULT_MEMORY_BYTES = 4 << 30


@dataclass
class PutReport:
    """What one ``put`` did."""

    position: int
    #: objects copied from the live list (global and sliding chunks, the point)
    copied: int
    copied_bytes: int
    #: objects some tier already held: a lookup each
    found: int
    seconds: float


@dataclass
class StoreStats:
    tiers: List[Any]
    puts: int = 0
    copied_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    pending_writes: int = 0
    #: payload bytes read from the byte tiers (directory, Redis), and the wall
    #: seconds lookups waited for those reads (verification and migration included)
    read_bytes: int = 0
    read_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass
class _Model:
    fingerprint: Dict[str, str]
    ref: Any = field(repr=False, default=None)


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


def _tokens(tokens: Sequence[int]) -> List[int]:
    return [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]


class KVStore:
    """Chunks of K/V rows behind sessions and the server (module doc).

    ``location``: ``None`` keeps the memory tier only; a directory path adds the
    directory tier, ``redis://HOST:PORT`` the Redis tier (``open_tier``).
    ``memory_bytes`` bounds the memory tier, ``store_bytes`` the other, and
    ``landing_bytes`` the buffers a store with a byte tier makes ahead for its
    reads once ``prepare`` asks for them (``landing``)."""

    def __init__(self, location: Optional[str] = None, *, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 store_bytes: Optional[int] = None, write_behind: bool = True,
                 landing_bytes: int = DEFAULT_LANDING_BYTES):
        self.memory = MemoryTier(memory_bytes)
        self.landing = Landing(landing_bytes)
        self.tiers: List[Any] = []
        if location is not None:
            self.tiers.append(open_tier(str(location), store_bytes))
        self._reader = TierReader(self.tiers, self.landing)
        self._lock = threading.Lock()
        self._models: Dict[int, _Model] = {}
        self._stats = StoreStats(tiers=[])
        self._queue: "queue.Queue[Optional[Tuple[str, Any, str]]]" = queue.Queue()
        self._writer: Optional[threading.Thread] = None
        self._write_behind = write_behind and bool(self.tiers)

    # -- scope ------------------------------------------------------------------------

    def _fingerprint(self, model: Any) -> Dict[str, str]:
        with self._lock:
            known = self._models.get(id(model))
            if known is not None and known.ref() is model:
                return known.fingerprint
        fingerprint = model_fingerprint(model)
        try:
            ref = weakref.ref(model)
        except TypeError:  # pragma: no cover - mlx-lm models are weak-referenceable
            return fingerprint
        with self._lock:
            self._models[id(model)] = _Model(fingerprint, ref)
        return fingerprint

    def _scope(self, cache: Sequence[Any], model: Any) -> Tuple[Scope, Dict[str, str]]:
        geometry = cache_geometry(cache)
        fingerprint = self._fingerprint(model)
        return chunks.scope_for(geometry, plane_encoding(cache[0].dtype), fingerprint), fingerprint

    # -- tiers --------------------------------------------------------------------------

    def _get(self, key: str, scope: Scope) -> Any:
        return self._get_many([key], scope)[key]

    def _get_many(self, keys: Sequence[str], scope: Scope) -> Dict[str, Any]:
        """The object of every key (``None``: a miss): from the memory tier, else
        read from the byte tiers side by side (``reader``) and kept in memory."""
        out = {key: self.memory.get(key) for key in dict.fromkeys(keys)}
        read = self._reader.read([key for key, obj in out.items() if obj is None], scope.encoding)
        for key, obj in read.items():
            if obj is not None:
                self.memory.put(key, obj)
            out[key] = obj
        return out

    def _has(self, key: str) -> bool:
        return self.memory.contains(key) or any(t.contains(key) for t in self.tiers)

    def _keep(self, key: str, obj: Any, scope: Scope) -> None:
        self.memory.put(key, obj)
        if self.tiers:
            self._send(key, obj, scope.encoding)

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

    def flush(self) -> None:
        """Wait until every put so far is written to every tier."""
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

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**{k: v for k, v in vars(self._stats).items() if k != "tiers"},
                           tiers=[self.memory.stats(), *(t.stats() for t in self.tiers)])
        s.read_bytes, s.read_s = self._reader.read_bytes, self._reader.read_s
        s.pending_writes = self._queue.unfinished_tasks
        return s

    # -- put ------------------------------------------------------------------------------

    def put(self, tokens: Sequence[int], cache: Sequence[Any], model: Any = None) -> PutReport:
        """Record what the live list ``cache`` holds for ``tokens``
        (``len(tokens)`` must be every layer's offset), so that its position and
        the chunk boundaries of its window can be rebuilt (module doc). The rows
        go under the scope of the model the list was made for, where it knows
        it: ``model`` must be that model or one of its fingerprint, else
        ``ModelMismatch`` before anything is kept."""
        t0 = time.perf_counter()
        tokens = _tokens(tokens)
        n = len(tokens)
        entries = _entries(cache)
        offsets = {c.offset for c in entries}
        if offsets != {n}:
            raise ValueError(f"KV store put: the list holds {sorted(offsets)} tokens, "
                             f"got {n} tokens to record")
        owner = list_model(entries)
        model = model if model is not None else owner
        if model is None:
            raise ValueError("KV store put: the list does not know its model (built without "
                             "make_prompt_cache(model)): pass model=")
        if owner is not None and owner is not model:
            self._check_owner(owner, model)
        scope, _ = self._scope(entries, model)
        if n == 0:
            return PutReport(0, 0, 0, 0, time.perf_counter() - t0)
        c = n // CHUNK
        names = chunks.chain(scope, tokens, c)
        glob, slid = scope.global_layers, scope.sliding_layers
        # every ring holds [held, n): the window's rows (the latest origin, should they differ)
        held = max((e.ring.origin_logical for e in entries if e.kind is LayerKind.SLIDING),
                   default=n)
        glob_keys: List[str] = []
        glob_ranges: List[Tuple[int, int]] = []
        found = 0
        for j in range(c):
            key = chunks.object_key("G", names[j + 1])
            if self._has(key):
                found += 1
            else:
                glob_keys.append(key)
                glob_ranges.append((CHUNK * j, CHUNK * (j + 1)))
        first = -(-held // CHUNK) * CHUNK  # the first boundary at or after the window's start
        whole = range(first // CHUNK, c) if first <= CHUNK * c else range(0)
        slid_keys: List[str] = []
        slid_ranges: List[Tuple[int, int]] = []
        for j in whole:
            key = chunks.object_key("S", names[j + 1])
            if self._has(key):
                found += 1
            else:
                slid_keys.append(key)
                slid_ranges.append((CHUNK * j, CHUNK * (j + 1)))
        if whole:
            runs = [(held, first), (CHUNK * c, n)]
        else:
            runs = [(held, n)]
        tail = tuple(tokens[CHUNK * c:])
        point_key = chunks.object_key("P", names[c], tail)
        has_point = self._has(point_key)
        if has_point:
            found += 1
        else:
            glob_ranges.append((CHUNK * c, n))
            slid_ranges.extend((lo, hi) for lo, hi in runs if hi > lo)
        glob_rows = gather(entries, glob, glob_ranges)
        slid_rows = gather(entries, slid, slid_ranges)
        made = list(zip(glob_keys, glob_rows)) + list(zip(slid_keys, slid_rows))
        point = None
        if not has_point:
            point = Point(tail, glob_rows[-1], tuple(slid_rows[len(slid_keys):]))
        mx.eval([a for r in glob_rows + slid_rows for a in r.arrays()])
        copied = 0
        for key, rows in made:
            self._keep(key, rows, scope)
            copied += rows.nbytes
        if point is not None:
            self._keep(point_key, point, scope)
            copied += point.nbytes
        self._add_tail(names[c], len(tail), scope)
        with self._lock:
            self._stats.puts += 1
            self._stats.copied_bytes += copied
        return PutReport(n, len(made) + (point is not None), copied, found, time.perf_counter() - t0)

    def _check_owner(self, owner: Any, model: Any) -> None:
        """Refuse to put rows of a list made for ``owner`` under ``model``'s scope
        unless the two are one model (one fingerprint): another model's rows
        there would be rebuilt into every later list of ``model``, and a byte
        tier would keep them for every later process."""
        part = differs(self._fingerprint(owner), self._fingerprint(model))
        if part is not None:
            raise ModelMismatch(
                f"model fingerprint {part} (a KV store put of a list made for another model "
                "than model=; put it with the model it was made for, or with none)",
                self._fingerprint(model).get(part), self._fingerprint(owner).get(part))

    def _add_tail(self, name: bytes, r: int, scope: Scope) -> None:
        key = chunks.object_key("I", name)
        with self._lock:
            have = self.memory.get(key)
            tails = have.tails if isinstance(have, Index) else frozenset()
            if r in tails:
                return
            index = Index(tails | {r})
            self.memory.put(key, index)
        if self.tiers:
            self._send(key, index, scope.encoding)

    def _index(self, name: bytes, scope: Scope) -> frozenset:
        key = chunks.object_key("I", name)
        tails: set = set()
        have = self.memory.get(key)
        if isinstance(have, Index):
            tails |= have.tails
        for tier in self.tiers:
            obj = read_object(tier, key, scope.encoding)
            if isinstance(obj, Index):
                tails |= obj.tails
        return frozenset(tails)

    # -- lookup ------------------------------------------------------------------------

    def prepare(self, model: Any) -> None:
        """Make ready now what lookups for ``model`` need, so that the first one
        (after a restart, say) does not wait for it: ``model``'s fingerprint
        and, with a byte tier, the reader threads and the landing stock
        (``muser-kv serve`` calls this once its model is loaded)."""
        entries = _entries(fresh_list(model))
        scope, _ = self._scope(entries, model)
        if self.tiers:
            self._plan_landing(scope, entries)
            self.landing.restock(wait=True)
            self._reader.start()

    def restock(self, max_bytes: Optional[int] = None) -> int:
        """Make again, on the allocator threads, up to ``max_bytes`` of the
        landing buffers lookups took since ``prepare`` (the bytes set to be
        made). For idle time: making them slows whatever the GPU runs meanwhile."""
        return self.landing.restock(max_bytes)

    def _plan_landing(self, scope: Scope, entries: List[MuseKVCache]) -> None:
        """Stock buffers for a rebuild of lists like ``entries`` as deep as they
        go: the window's sliding chunks first, then global chunks."""
        deepest = cache_geometry(entries).max_context // CHUNK * CHUNK
        sizes = {}
        for layers, count in ((scope.sliding_layers, scope.window // CHUNK + 2),
                              (scope.global_layers, deepest // CHUNK)):
            if layers and count:
                rows = chunks.shaped_rows(scope, layers, max(0, deepest - CHUNK), CHUNK)
                sizes[chunks.encoded_size(rows, scope.encoding)] = count
        self.landing.plan(sizes)

    def longest_prefix(self, tokens: Sequence[int], model: Any, into: Optional[List[Any]] = None,
                       beyond: int = 0) -> Tuple[int, List[Any]]:
        """``(n, cache)``: the deepest position ``n <= len(tokens) - 1`` this store
        can rebuild for ``tokens``, and a list holding exactly the state the live
        list had there (``into``, an empty list of ``model``'s, or a fresh one).
        A miss is ``(0, the empty list)``; the caller prefills ``tokens[n:]``.
        Positions up to ``beyond`` are not rebuilt (a caller that can reuse that
        many tokens already): none deeper is a miss, at the cost of lookups only."""
        tokens = _tokens(tokens)
        cache = into if into is not None else fresh_list(model)
        entries = _entries(cache)
        if any(e.offset for e in entries):
            raise ValueError("KV store longest_prefix: into= must be an empty list, got one "
                             f"holding {entries[0].offset} tokens")
        scope, fingerprint = self._scope(entries, model)
        with self._lock:
            self._stats.lookups += 1
        limit = len(tokens) - 1
        if limit <= 0:
            return 0, cache
        top = limit // CHUNK
        names = chunks.chain(scope, tokens, top)
        lo, hi = 0, top  # the deepest level whose chunks are stored (a chain is kept whole)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._has(chunks.object_key("G", names[mid])):
                lo = mid
            else:
                hi = mid - 1
        for level in range(lo, -1, -1):
            base = CHUNK * level
            if base + CHUNK - 1 <= beyond:  # every position of this level and below
                break
            tails = self._index(names[level], scope)
            for r in sorted(tails, reverse=True):
                if r == 0 or base + r > limit or base + r <= beyond:
                    continue
                tail = tokens[base:base + r]
                point = self._get(chunks.object_key("P", names[level], tail), scope)
                if _is_point(point, tail) and self._rebuild(cache, entries, scope, fingerprint,
                                                              names, base + r, point):
                    return self._hit(base + r, cache)
            if level and base > beyond:
                point = (self._get(chunks.object_key("P", names[level], ()), scope)
                         if 0 in tails else None)
                if self._rebuild(cache, entries, scope, fingerprint, names, base,
                                 point if _is_point(point, []) else None):
                    return self._hit(base, cache)
        return 0, cache

    def _hit(self, n: int, cache: List[Any]) -> Tuple[int, List[Any]]:
        with self._lock:
            self._stats.hits += 1
            self._stats.reused_tokens += n
        return n, cache

    def rebuildable(self, tokens: Sequence[int], model: Any,
                    like: Optional[List[Any]] = None) -> List[int]:
        """Every position along ``tokens`` (``1 .. len(tokens)``) the store can
        rebuild now for lists like ``like`` (default: ``model``'s own), ascending."""
        tokens = _tokens(tokens)
        entries = _entries(like if like is not None else fresh_list(model))
        scope, _ = self._scope(entries, model)
        names = chunks.chain(scope, tokens, len(tokens) // CHUNK)
        found = []
        for level in range(len(names)):
            if level and not self._has(chunks.object_key("G", names[level])):
                break
            base = CHUNK * level
            tails = self._index(names[level], scope)
            for r in sorted(tails):
                if base + r > len(tokens) or (r == 0 and not level):
                    continue
                tail = tokens[base:base + r]
                point = self._get(chunks.object_key("P", names[level], tail), scope)
                if _is_point(point, tail) and self._rows_for(entries, scope, names, base + r,
                                                             point) is not None:
                    found.append(base + r)
            if level and base not in found and self._rows_for(entries, scope, names, base,
                                                              None) is not None:
                found.append(base)
        return sorted(set(found))

    # -- rebuild ---------------------------------------------------------------------------

    def _rows_for(self, entries: List[MuseKVCache], scope: Scope, names: List[bytes], n: int,
                  point: Optional[Point]) -> Optional[List[LayerCut]]:
        """Every layer's cut at ``n``, or ``None`` when an object it needs is gone."""
        level, r = divmod(n, CHUNK)
        if r and point is None:
            return None
        glob, slid = scope.global_layers, scope.sliding_layers
        glob_shape, slid_shape = scope.shape(glob), scope.shape(slid)
        # the window first: it is what a boundary between put points usually lacks
        # (a lookup walks down such boundaries to a checkpoint), and it is cheap
        capacity = min((e.capacity for e in entries if e.kind is LayerKind.SLIDING), default=0)
        start = max(0, n - capacity)
        # runs of the window: (a point's fragment, or None for an S chunk, from, to)
        runs: List[Tuple[Optional[Rows], int, int]] = []
        at = start
        fragments = {f.start: f for f in point.fragments} if point is not None else {}
        while at < n:
            frag = fragments.get(at)
            if frag is not None and frag.count and fits(frag, at, frag.count, slid, slid_shape):
                runs.append((frag, at, min(frag.end, n)))
            elif at // CHUNK + 1 >= len(names) or CHUNK * (at // CHUNK + 1) > n:
                return None  # a partial chunk: a point's alone
            else:
                runs.append((None, at, CHUNK * (at // CHUNK + 1)))
            at = runs[-1][2]
        slid_keys = {lo: chunks.object_key("S", names[lo // CHUNK + 1])
                     for frag, lo, _ in runs if frag is None}
        got = self._get_many(list(slid_keys.values()), scope)
        window: List[Rows] = []
        for frag, lo, hi in runs:
            if frag is not None:
                window.append(frag.part(lo, hi) if hi < frag.end else frag)
                continue
            rows = got[slid_keys[lo]]
            if not fits(rows, CHUNK * (lo // CHUNK), CHUNK, slid, slid_shape):
                return None
            window.append(rows.part(lo, hi))
        glob_keys = [chunks.object_key("G", names[j + 1]) for j in range(level)]
        got = self._get_many(glob_keys, scope)
        pieces: List[Rows] = []
        for j, key in enumerate(glob_keys):
            if not fits(got[key], CHUNK * j, CHUNK, glob, glob_shape):
                return None
            pieces.append(got[key])
        if point is not None and point.globals.count:
            if not fits(point.globals, CHUNK * level, r, glob, glob_shape):
                return None
            pieces.append(point.globals)
        cuts: List[Optional[LayerCut]] = [None] * len(entries)
        cut(cuts, entries, glob, glob_shape, pieces, 0)
        cut(cuts, entries, slid, slid_shape, window, start)
        return [c for c in cuts if c is not None]

    def _rebuild(self, cache: List[Any], entries: List[MuseKVCache], scope: Scope,
                 fingerprint: Dict[str, str], names: List[bytes], n: int,
                 point: Optional[Point]) -> bool:
        cuts = self._rows_for(entries, scope, names, n, point)
        if cuts is None:
            return False
        # the restore path's gate and install; the list's model is checked against
        # the fingerprint this store keeps per model (never sampled again)
        target = restore.Target.of_list(entries, fingerprint_of=self._fingerprint)
        restore.restore_cuts(entries, target, target.geometry, n, scope.encoding, fingerprint, cuts)
        return True


def fresh_list(model: Any) -> List[Any]:
    """An empty list for ``model``: its own ``make_cache()`` where that gives
    muser-kv's (a model ``muser_kv.install`` hooked, with the context and retention
    it was installed with), else ``make_prompt_cache(model)``."""
    own = model.make_cache() if hasattr(model, "make_cache") else None
    if own and all(isinstance(c, MuseKVCache) for c in own):
        return list(own)
    return make_prompt_cache(model)


def _is_point(obj: Any, tail: Sequence[int]) -> bool:
    """Whether a stored object is the point its key promises (its tail tokens)."""
    ok = isinstance(obj, Point) and list(obj.tail) == list(tail)
    if not ok and obj is not None:
        log.warning("KV store: an object under a point's key holds another point; passed over")
    return ok


def _entries(cache: Sequence[Any]) -> List[MuseKVCache]:
    if not cache or not all(isinstance(c, MuseKVCache) for c in cache):
        kinds = sorted({type(c).__name__ for c in cache})
        raise TypeError(f"KV store: expected a list of muser-kv caches (make_prompt_cache), got "
                        f"{kinds or 'an empty list'}")
    return list(cache)
