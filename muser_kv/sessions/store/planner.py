"""The store's planner: tokens -> chain names -> the objects a position needs.

It knows nothing of tiers: every function here is a rule over a scope, tokens
and positions, and whatever it must know of what is stored (a chain's depth,
a name's index, the objects fetched for a rebuild) is handed to it. The tier
manager (``manager``) keeps the objects; the facade (``store.KVStore``) asks
this module what to copy or fetch and the manager for it.

**Rebuildable positions** (``candidates``, the one statement of the rule):
along a chain whose global chunks are stored up to level ``L``, the positions
of each level ``l <= L`` are ``CHUNK * l + r`` for every tail length ``r > 0``
its index lists (a put point: rebuilt from its ``P``), and the boundary
``CHUNK * l`` itself when ``l > 0`` (rebuilt from ``S`` chunks, and from the
fragments of the boundary's own point where a put stopped there). Such a
position is rebuildable while every object ``plan_rows`` names for it is
stored and is what its key promises (``fits``, ``is_point``): the window first,
since it is what a boundary between put points usually lacks.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from muser_kv.sessions.fingerprint import model_fingerprint
from muser_kv.sessions.format import plane_encoding
from muser_kv.sessions.restore import cache_geometry
from muser_kv.sessions.store import chunks
from muser_kv.sessions.store.chunks import CHUNK, Point, Rows, Scope

log = logging.getLogger("muser_kv.store")  # the store's own: one logger for its lines

Shape = Tuple[Tuple[Tuple[int, ...], int], ...]


# -- scopes ------------------------------------------------------------------------------


class Scopes:
    """The scope of a list (its geometry, plane encoding and model), with each
    model's fingerprint sampled once while the model lives: sampling reads
    weights (0.1 s for Muse Glimmer), and every put and lookup needs it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: Dict[int, Tuple[Dict[str, str], Any]] = {}  # id -> (fingerprint, weakref)

    def fingerprint(self, model: Any) -> Dict[str, str]:
        with self._lock:
            known = self._known.get(id(model))
            if known is not None and known[1]() is model:
                return known[0]
        fingerprint = model_fingerprint(model)
        try:
            ref = weakref.ref(model)
        except TypeError:  # pragma: no cover - mlx-lm models are weak-referenceable
            return fingerprint
        with self._lock:
            self._known[id(model)] = (fingerprint, ref)
        return fingerprint

    def of(self, cache: Sequence[Any], model: Any) -> Tuple[Scope, Dict[str, str]]:
        """``(scope, fingerprint)`` of the list ``cache`` holding ``model``'s rows."""
        fingerprint = self.fingerprint(model)
        scope = chunks.scope_for(cache_geometry(cache), plane_encoding(cache[0].dtype), fingerprint)
        return scope, fingerprint


# -- a put ---------------------------------------------------------------------------------

#: An object to make from a live list: its key and the positions ``[lo, hi)`` of its rows.
Span = Tuple[str, int, int]


@dataclass(frozen=True)
class PutPlan:
    """What a put at ``n = len(tokens)`` records: of its objects -- the global
    chunks below ``n`` (``G``), the whole chunks of the window (``S``) and the
    point (``P``: its tail's global rows ``point_globals`` and the window's
    sliding rows no ``S`` covers, ``runs``) -- those no tier holds yet
    (``glob``, ``slid``, ``has_point``), and how many some tier holds (``found``)."""

    n: int
    glob: List[Span]
    slid: List[Span]
    point_key: str
    tail: Tuple[int, ...]
    point_globals: Tuple[int, int]
    runs: List[Tuple[int, int]]
    index_key: str
    has_point: bool
    found: int

    def global_ranges(self) -> List[Tuple[int, int]]:
        """The global rows to copy: each missing ``G`` chunk's, then the point's."""
        out = [(lo, hi) for _, lo, hi in self.glob]
        return out if self.has_point else out + [self.point_globals]

    def sliding_ranges(self) -> List[Tuple[int, int]]:
        """The sliding rows to copy: each missing ``S`` chunk's, then the point's runs."""
        out = [(lo, hi) for _, lo, hi in self.slid]
        return out if self.has_point else out + self.runs


def plan_put(scope: Scope, tokens: Sequence[int], window_start: int,
             stored: Callable[[str], bool]) -> PutPlan:
    """The put of ``tokens`` from a list whose rings hold ``[window_start, n)``,
    where ``stored(key)`` says whether some tier holds an object already."""
    n = len(tokens)
    c = n // CHUNK
    names = chunks.chain(scope, tokens, c)
    glob = [(chunks.object_key("G", names[j + 1]), CHUNK * j, CHUNK * (j + 1)) for j in range(c)]
    first = -(-window_start // CHUNK) * CHUNK  # the first boundary at or after it
    whole = range(first // CHUNK, c) if first <= CHUNK * c else range(0)
    slid = [(chunks.object_key("S", names[j + 1]), CHUNK * j, CHUNK * (j + 1)) for j in whole]
    runs = [(window_start, first), (CHUNK * c, n)] if whole else [(window_start, n)]
    tail = tuple(tokens[CHUNK * c:])
    point_key = chunks.object_key("P", names[c], tail)
    missing_glob = [span for span in glob if not stored(span[0])]
    missing_slid = [span for span in slid if not stored(span[0])]
    has_point = stored(point_key)
    found = len(glob) - len(missing_glob) + len(slid) - len(missing_slid) + has_point
    return PutPlan(n, missing_glob, missing_slid, point_key, tail, (CHUNK * c, n),
                   [(lo, hi) for lo, hi in runs if hi > lo], chunks.object_key("I", names[c]),
                   has_point, found)


# -- a lookup --------------------------------------------------------------------------------


def names(scope: Scope, tokens: Sequence[int], limit: int) -> List[bytes]:
    """``K[0] .. K[limit // CHUNK]``: the chain names of every level a position
    ``<= limit`` can lie on."""
    return chunks.chain(scope, tokens, limit // CHUNK)


def deepest_level(names: Sequence[bytes], stored: Callable[[str], bool]) -> int:
    """The deepest level whose global chunk ``stored`` says is kept, by bisection
    (a chain is kept whole below it; a hole only costs the levels above it
    their rebuild, which ``plan_rows``'s objects then lack)."""
    lo, hi = 0, len(names) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if stored(chunks.object_key("G", names[mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo


def levels(top: int, floor: int) -> range:
    """Levels from ``top`` down that hold a position past ``floor`` (a level's
    positions are ``CHUNK * level .. CHUNK * level + CHUNK - 1``)."""
    lowest = max(0, (floor + 1) // CHUNK)  # the level of position floor + 1
    return range(top, lowest - 1, -1)


def index_key(names: Sequence[bytes], level: int) -> str:
    return chunks.object_key("I", names[level])


@dataclass(frozen=True)
class Candidate:
    """A position ``n`` to try, and its point: the key to read (``None``: no
    point was put there) and the tail it must hold; ``needs_point``: without
    that point ``n`` is not rebuildable (a put point), else its window may come
    from ``S`` chunks alone (a chunk boundary)."""

    n: int
    point_key: Optional[str]
    tail: Tuple[int, ...]
    needs_point: bool


def candidates(names: Sequence[bytes], level: int, tails: frozenset, tokens: Sequence[int],
               floor: int, limit: int) -> List[Candidate]:
    """The positions of ``level`` in ``(floor, limit]``, deepest first (module doc)."""
    base = CHUNK * level
    out = []
    for r in sorted(tails, reverse=True):
        if r and floor < base + r <= limit:
            tail = tuple(tokens[base:base + r])
            out.append(Candidate(base + r, chunks.object_key("P", names[level], tail), tail, True))
    if level and floor < base <= limit:
        key = chunks.object_key("P", names[level], ()) if 0 in tails else None
        out.append(Candidate(base, key, (), False))
    return out


def is_point(obj: Any, tail: Sequence[int]) -> bool:
    """Whether a stored object is the point its key promises (its tail tokens)."""
    ok = isinstance(obj, Point) and list(obj.tail) == list(tail)
    if not ok and obj is not None:
        log.warning("KV store: an object under a point's key holds another point; passed over")
    return ok


def fits(rows: Any, start: int, count: int, layers: Tuple[int, ...], shape: Shape) -> bool:
    """Whether a stored object is the rows its key promises, kept as its scope
    keeps them (``Scope.shape``); else it is passed over."""
    ok = (isinstance(rows, Rows) and rows.start == start and rows.count == count
          and rows.layers == layers and rows.shape == shape)
    if not ok and rows is not None:
        log.warning("KV store: an object under a key for rows [%d, %d) holds other rows; "
                    "passed over", start, start + count)
    return ok


# -- a rebuild ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowsPlan:
    """What a rebuild at ``n`` reads: the window ``[start, n)`` as runs (a
    point's fragment, or ``None`` for an ``S`` chunk, and the positions it
    gives), the ``S`` keys by run start, the ``G`` keys below ``n``'s level,
    and the point (its tail's global rows)."""

    n: int
    start: int
    runs: List[Tuple[Optional[Rows], int, int]]
    slid_keys: Dict[int, str]
    glob_keys: List[str]
    point: Optional[Point]


def plan_rows(scope: Scope, names: Sequence[bytes], n: int, capacity: int,
              point: Optional[Point]) -> Optional[RowsPlan]:
    """The objects a rebuild at ``n`` needs for rings of ``capacity`` rows, or
    ``None`` when no stored object can give some row (``n`` off a boundary
    without its point, or a partial chunk no fragment covers)."""
    level, r = divmod(n, CHUNK)
    if r and point is None:
        return None
    slid = scope.sliding_layers
    slid_shape = scope.shape(slid)
    start = max(0, n - capacity)
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
    glob_keys = [chunks.object_key("G", names[j + 1]) for j in range(level)]
    return RowsPlan(n, start, runs, slid_keys, glob_keys, point)


def window_rows(scope: Scope, plan: RowsPlan, got: Mapping[str, Any]) -> Optional[List[Rows]]:
    """The window's rows from the ``S`` objects fetched (``got``), or ``None``
    when one is missing or not what its key promises."""
    slid = scope.sliding_layers
    slid_shape = scope.shape(slid)
    window: List[Rows] = []
    for frag, lo, hi in plan.runs:
        if frag is not None:
            window.append(frag.part(lo, hi) if hi < frag.end else frag)
            continue
        rows = got[plan.slid_keys[lo]]
        if not fits(rows, CHUNK * (lo // CHUNK), CHUNK, slid, slid_shape):
            return None
        window.append(rows.part(lo, hi))
    return window


def global_rows(scope: Scope, plan: RowsPlan, got: Mapping[str, Any]) -> Optional[List[Rows]]:
    """The global rows ``[0, n)`` from the ``G`` objects fetched and the point's
    tail, or ``None`` when one is missing or not what its key promises."""
    glob = scope.global_layers
    glob_shape = scope.shape(glob)
    pieces: List[Rows] = []
    for j, key in enumerate(plan.glob_keys):
        rows = got[key]
        if not fits(rows, CHUNK * j, CHUNK, glob, glob_shape):
            return None
        pieces.append(rows)
    point = plan.point
    if point is not None and point.globals.count:
        level, r = divmod(plan.n, CHUNK)
        if not fits(point.globals, CHUNK * level, r, glob, glob_shape):
            return None
        pieces.append(point.globals)
    return pieces


def landing_sizes(scope: Scope, max_context: int) -> Dict[int, int]:
    """Payload sizes (and counts) of a rebuild of lists of ``max_context`` as
    deep as they go: the window's sliding chunks first, then global chunks."""
    deepest = max_context // CHUNK * CHUNK
    sizes = {}
    for layers, count in ((scope.sliding_layers, scope.window // CHUNK + 2),
                          (scope.global_layers, deepest // CHUNK)):
        if layers and count:
            rows = chunks.shaped_rows(scope, layers, max(0, deepest - CHUNK), CHUNK)
            sizes[chunks.encoded_size(rows, scope.encoding)] = count
    return sizes
