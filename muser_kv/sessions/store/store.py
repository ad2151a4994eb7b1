"""``KVStore``: exact reuse of any stored point of a conversation, by prefix.

The facade of three parts: ``planner`` knows tokens and positions (the names,
the objects a put makes or a position needs, which positions are
rebuildable), ``manager`` knows keys and objects (the tiers); ``KVStore``
checks its arguments, asks the planner what to copy or fetch and the manager
for it, moves rows between live lists and objects (``rows``) and installs
through the restore path. Neither part calls the other.

A state at position ``n`` is rebuilt exactly from the rows of the positions
before ``n``: every global plane takes all of them, every ring the last
``window`` of them at its positional rotation, through the one restore path a
session load takes (``muser_kv.sessions.restore``). Rows of a position never change once written (a
plane only appends; a trim forgets rows, it never rewrites one), so rows kept
from a list at any later position are the rows the list held at ``n``.

What is kept (``chunks``): per 256-token chunk, its global rows (``G``); its
sliding rows (``S``) when a put saw the whole chunk in the rings; and per put
point its tail and the sliding rows of its window no ``S`` holds (``P``).

Which positions are rebuildable is the planner's rule (``planner`` module
doc, ``planner.candidates``), which ``longest_prefix`` and ``rebuildable`` both walk.

**What a put costs.** A lookup per chunk of the prefix, and a copy only of
what no tier holds: the new chunks' global rows, the new whole chunks of the
window, and the point (its tail's global rows, at most two runs of sliding
rows). The copies are gathered on the device in one evaluation, each layer's
rows of a run of adjacent chunks at once, stacked layer-major and cut into
chunks (``chunks.Rows``: one block per plane for all the layers of a kind), so
neither a put nor a rebuild makes an operation per chunk and layer; writing
them to the directory or Redis tier happens behind, on the manager's writer
thread (``flush`` waits for it).

**Faults.** A stored object that fails its digest (the byte tiers check it),
is truncated, or is not what its key says (``chunks.decode``) is a miss and is
dropped; a tier that fails is a miss and a log line. A rebuild assembles every
row before it installs any: a missing object passes the position over, for a
shallower one, and never leaves a list half-written.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from muser_kv.caches.base import MuseKVCache
from muser_kv.caches.factory import make_prompt_cache
from muser_kv.core.geometry import LayerKind
from muser_kv.sessions import restore
from muser_kv.sessions.fingerprint import differs
from muser_kv.sessions.format import ModelMismatch
from muser_kv.sessions.restore import LayerCut, cache_geometry, list_model
from muser_kv.sessions.store import planner, rows
from muser_kv.sessions.store.chunks import Point, Scope
from muser_kv.sessions.store.landing import DEFAULT_LANDING_BYTES, Landing
from muser_kv.sessions.store.manager import DEFAULT_MEMORY_BYTES, TierManager, open_tier
from muser_kv.sessions.store.memory import MemoryTier
from muser_kv.sessions.store.planner import Candidate

__all__ = ["DEFAULT_MEMORY_BYTES", "KVStore", "PutReport", "StoreStats", "fresh_list", "open_tier"]


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
        self._tiers = TierManager(location, memory_bytes=memory_bytes, store_bytes=store_bytes,
                                  write_behind=write_behind, landing_bytes=landing_bytes)
        self._scopes = planner.Scopes()
        self._lock = threading.Lock()  # the counters
        self._stats = StoreStats(tiers=[])

    @property
    def memory(self) -> MemoryTier:
        return self._tiers.memory

    @property
    def landing(self) -> Landing:
        return self._tiers.landing

    @property
    def tiers(self) -> List[Any]:
        """The byte tiers (none, or the one at ``location``)."""
        return self._tiers.tiers

    def flush(self) -> None:
        """Wait until every put so far is written to every tier."""
        self._tiers.flush()

    def close(self) -> None:
        self._tiers.close()

    def read_totals(self) -> Tuple[int, float]:
        """``(read_bytes, read_s)`` of ``stats`` alone, without asking the tiers
        (a caller timing one lookup takes them before and after it)."""
        return self._tiers.read_bytes, self._tiers.read_s

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**{k: v for k, v in vars(self._stats).items() if k != "tiers"},
                           tiers=self._tiers.tier_stats())
        s.read_bytes, s.read_s = self.read_totals()
        s.pending_writes = self._tiers.pending_writes
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
        scope, _ = self._scopes.of(entries, model)
        if n == 0:
            return PutReport(0, 0, 0, 0, time.perf_counter() - t0)
        plan = planner.plan_put(scope, tokens, rows.window_start(entries, n), self._tiers.has)
        glob, slid = plan.glob, plan.slid
        glob_rows = rows.gather(entries, scope.global_layers, plan.global_ranges())
        slid_rows = rows.gather(entries, scope.sliding_layers, plan.sliding_ranges())
        made = [(key, r) for (key, _, _), r in zip(glob + slid, glob_rows[:len(glob)] + slid_rows)]
        point = None if plan.has_point else Point(plan.tail, glob_rows[-1],
                                                  tuple(slid_rows[len(slid):]))
        mx.eval([a for r in glob_rows + slid_rows for a in r.arrays()])
        kept = made + ([(plan.point_key, point)] if point is not None else [])
        self._tiers.keep_all(kept, scope.encoding)
        copied = sum(obj.nbytes for _, obj in kept)
        self._tiers.add_tail(plan.index_key, len(plan.tail), scope.encoding)
        with self._lock:
            self._stats.puts += 1
            self._stats.copied_bytes += copied
        return PutReport(n, len(made) + (point is not None), copied, plan.found,
                         time.perf_counter() - t0)

    def _check_owner(self, owner: Any, model: Any) -> None:
        """Refuse to put rows of a list made for ``owner`` under ``model``'s scope
        unless the two are one model (one fingerprint): another model's rows
        there would be rebuilt into every later list of ``model``, and a byte
        tier would keep them for every later process."""
        fingerprint = self._scopes.fingerprint
        part = differs(fingerprint(owner), fingerprint(model))
        if part is not None:
            raise ModelMismatch(
                f"model fingerprint {part} (a KV store put of a list made for another model "
                "than model=; put it with the model it was made for, or with none)",
                fingerprint(model).get(part), fingerprint(owner).get(part))

    # -- lookup ------------------------------------------------------------------------

    def prepare(self, model: Any) -> None:
        """Make ready now what lookups for ``model`` need, so that the first one
        (after a restart, say) does not wait for it: ``model``'s fingerprint
        and, with a byte tier, the reader threads and the landing stock
        (``muser-kv serve`` calls this once its model is loaded)."""
        entries = _entries(fresh_list(model))
        scope, _ = self._scopes.of(entries, model)
        self._tiers.prepare(planner.landing_sizes(scope, cache_geometry(entries).max_context))

    def restock(self, max_bytes: Optional[int] = None) -> int:
        """Make again, on the allocator threads, up to ``max_bytes`` of the
        landing buffers lookups took since ``prepare`` (the bytes set to be
        made). For idle time: making them slows whatever the GPU runs meanwhile."""
        return self._tiers.restock(max_bytes)

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
        scope, fingerprint = self._scopes.of(entries, model)
        with self._lock:
            self._stats.lookups += 1
        limit = len(tokens) - 1
        if limit <= 0:
            return 0, cache
        names = planner.names(scope, tokens, limit)
        for candidate in self._candidates(scope, names, tokens, beyond, limit):
            cuts = self._cuts(entries, scope, names, candidate)
            if cuts is not None:
                # the restore path's gate and install; the list's model is checked against
                # the fingerprint this store keeps per model (never sampled again)
                target = restore.Target.of_list(entries, fingerprint_of=self._scopes.fingerprint)
                restore.restore_cuts(entries, target, target.geometry, candidate.n, scope.encoding,
                                     fingerprint, cuts)
                with self._lock:
                    self._stats.hits += 1
                    self._stats.reused_tokens += candidate.n
                return candidate.n, cache
        return 0, cache

    def rebuildable(self, tokens: Sequence[int], model: Any,
                    like: Optional[List[Any]] = None) -> List[int]:
        """Every position along ``tokens`` (``1 .. len(tokens)``) the store can
        rebuild now for lists like ``like`` (default: ``model``'s own), ascending."""
        tokens = _tokens(tokens)
        entries = _entries(like if like is not None else fresh_list(model))
        scope, _ = self._scopes.of(entries, model)
        names = planner.names(scope, tokens, len(tokens))
        return sorted(c.n for c in self._candidates(scope, names, tokens, 0, len(tokens))
                      if self._cuts(entries, scope, names, c) is not None)

    # -- rebuild ---------------------------------------------------------------------------

    def _candidates(self, scope: Scope, names: List[bytes], tokens: List[int], floor: int,
                    limit: int) -> Iterator[Candidate]:
        """The positions in ``(floor, limit]`` the planner names, deepest first,
        each level's index read only once the deeper levels are tried."""
        top = planner.deepest_level(names, self._tiers.has)
        for level in planner.levels(top, floor):
            tails = self._tiers.tails(planner.index_key(names, level), scope.encoding)
            yield from planner.candidates(names, level, tails, tokens, floor, limit)

    def _cuts(self, entries: List[MuseKVCache], scope: Scope, names: List[bytes],
              candidate: Candidate) -> Optional[List[LayerCut]]:
        """Every layer's cut at ``candidate.n``, or ``None`` when an object it
        needs is gone: the window's objects are fetched, then the global ones."""
        point = None
        if candidate.point_key is not None:
            point = self._tiers.get(candidate.point_key, scope.encoding)
            if not planner.is_point(point, candidate.tail):
                if candidate.needs_point:
                    return None
                point = None
        capacity = min((e.capacity for e in entries if e.kind is LayerKind.SLIDING), default=0)
        plan = planner.plan_rows(scope, names, candidate.n, capacity, point)
        if plan is None:
            return None
        window = planner.window_rows(scope, plan, self._tiers.get_many(list(plan.slid_keys.values()),
                                                                         scope.encoding))
        if window is None:
            return None
        pieces = planner.global_rows(scope, plan, self._tiers.get_many(plan.glob_keys, scope.encoding))
        if pieces is None:
            return None
        return rows.cuts(entries, scope, plan.start, window, pieces)


def fresh_list(model: Any) -> List[Any]:
    """An empty list for ``model``: its own ``make_cache()`` where that gives
    muser-kv's (a model ``muser_kv.install`` hooked, with the context and retention
    it was installed with), else ``make_prompt_cache(model)``."""
    own = model.make_cache() if hasattr(model, "make_cache") else None
    if own and all(isinstance(c, MuseKVCache) for c in own):
        return list(own)
    return make_prompt_cache(model)


def _entries(cache: Sequence[Any]) -> List[MuseKVCache]:
    if not cache or not all(isinstance(c, MuseKVCache) for c in cache):
        kinds = sorted({type(c).__name__ for c in cache})
        raise TypeError(f"KV store: expected a list of muser-kv caches (make_prompt_cache), got "
                        f"{kinds or 'an empty list'}")
    return list(cache)
