"""Ring controller: where every row goes. Plain integers, no MLX.

Physical placement is never derived from an absolute position: the only
translation is ``(origin_physical + logical - origin_logical) % capacity``.
Carrying both origins explicitly costs two integers and makes the rotation a
fact that can be inspected, snapshotted and rolled back, rather than a modulus
recomputed on demand.

Continuity fails closed: a write at any position other than
``origin_logical + len`` raises ``CacheDiscontinuity`` and changes nothing, so a
skipped or replayed position can never silently alias a live row.

This module is the one place positions become rows. ``Ring.write`` answers,
for ``n`` tokens at a position, everything the rest of the code needs (where
the rows go, which old rows leave the window, whether the call reads the plane
in place or through the staging shadow, which rows it returns and so which
mask); ``Ring.trimmed`` answers the same for a rewind, ``Ring.installed`` for a
restore, ``Ring.runs`` for any live span (the rows about to be overwritten are
``runs(origin_logical, n)``), ``Ring.step`` for the decode hot path's one token.
Nothing else does modular arithmetic on positions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import List, Optional, Tuple


class CacheDiscontinuity(ValueError):
    """A write at a position other than the one the ring expects next."""

    def __init__(self, layer: int, expected: int, got: int):
        self.layer = layer
        self.expected = expected
        self.got = got
        super().__init__(
            f"KV cache for layer {layer} expected logical position {expected}, got {got}"
        )


@dataclass(frozen=True)
class Run:
    """A contiguous stretch of physical rows: ``length`` rows from ``physical``,
    holding source rows ``source .. source + length`` of whatever was handed in."""

    physical: int
    length: int
    source: int


class Read(str, enum.Enum):
    """How a write's rows are read back."""

    #: rows ``[0, after.len)`` of the plane, in logical order (the ring has not
    #: wrapped, or is a growing plane)
    PREFIX = "prefix"
    #: the whole ring as it lies, rotated (one token into a full ring: every
    #: row is inside the window, order does not matter to attention)
    RING = "ring"
    #: the staging shadow: the old live rows in logical order, then the chunk
    #: (a chunk that wraps, or one into a ring whose live rows are split)
    SHADOW = "shadow"


@dataclass(frozen=True)
class Write:
    """Everything a write of ``count`` tokens at ``before.end`` means for one ring.

    ``runs`` place the chunk rows that stay live (``Run.source`` indexes the
    chunk); ``evicted`` is the logical range ``[lo, hi)`` of positions that leave
    the window with this write: the old rows it overwrites, and the head of a
    chunk wider than the ring, which never lands; ``rows`` is how many rows the
    call returns and ``offset`` how many of them precede the chunk's first query
    (the mask's offset)."""

    before: "Ring"
    after: "Ring"
    count: int
    runs: Tuple[Run, ...]
    evicted: Tuple[int, int]
    read: Read

    @property
    def rows(self) -> int:
        if self.read is Read.SHADOW:
            return self.before.len + self.count
        return self.after.len

    @property
    def offset(self) -> int:
        return self.rows - self.count

    @property
    def position(self) -> int:
        return self.before.end


@dataclass(frozen=True)
class Trim:
    """A rewind of ``count`` tokens: the ring it leaves and the logical range
    ``[lo, hi)`` of overwritten rows that must be put back (from retained copies),
    at ``runs`` (``Run.source`` counts from ``lo``)."""

    before: "Ring"
    after: "Ring"
    count: int
    restore: Tuple[int, int]
    runs: Tuple[Run, ...]


@dataclass
class Ring:
    """Explicit ring bookkeeping for one plane.

    ``origin_logical`` is the logical position of the oldest live row and
    ``origin_physical`` the row it occupies; ``len`` rows are live. A growing
    (NoPE) plane is the same ring with ``capacity = max_context``: it never
    wraps inside valid bounds, so its origins stay 0 and the modulus never fires.
    """

    capacity: int
    len: int = 0
    origin_logical: int = 0
    origin_physical: int = 0
    layer: int = 0
    #: the next logical position, ``origin_logical + len``: a stored field that
    #: every method moving the ring keeps (so reading it is no call: a cache's
    #: ``offset`` is read once per layer per token)
    end: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError(f"ring capacity must be positive, got {self.capacity}")
        if not 0 <= self.len <= self.capacity:
            raise ValueError(f"ring len {self.len} outside [0, {self.capacity}]")
        if self.origin_logical < 0 or not 0 <= self.origin_physical < self.capacity:
            raise ValueError(
                f"ring origins ({self.origin_logical}, {self.origin_physical}) invalid "
                f"for capacity {self.capacity}"
            )
        self.end = self.origin_logical + self.len

    # -- queries -------------------------------------------------------------

    @property
    def wrapped(self) -> bool:
        """True once any row has been overwritten (the window has slid)."""
        return self.origin_logical > 0

    @property
    def extent(self) -> int:
        """One past the highest physical row holding a live row: the rows a plane
        must allocate to hold this ring (``len`` until the live rows wrap
        around the capacity; a growing plane's ring never does)."""
        return min(self.capacity, self.origin_physical + self.len)

    def physical(self, logical: int) -> int:
        """The physical row holding live logical position ``logical``."""
        if not self.origin_logical <= logical < self.end:
            raise IndexError(
                f"layer {self.layer}: logical {logical} not live "
                f"(live [{self.origin_logical}, {self.end}))"
            )
        return (self.origin_physical + logical - self.origin_logical) % self.capacity

    def runs(self, logical: int, count: int) -> List[Run]:
        """Physical runs (at most two) for ``count`` rows starting at ``logical``,
        translated from this ring's origins; sources count from 0."""
        if count <= 0:
            return []
        if count > self.capacity:
            raise ValueError(f"{count} rows do not fit a ring of {self.capacity}")
        first = (self.origin_physical + logical - self.origin_logical) % self.capacity
        head = min(count, self.capacity - first)
        out = [Run(first, head, 0)]
        if head < count:
            out.append(Run(0, count - head, head))
        return out

    def live_runs(self) -> List[Run]:
        """The live rows in logical order, as physical runs (the un-rotation)."""
        return self.runs(self.origin_logical, self.len)

    def check(self, position: int) -> None:
        """Raise ``CacheDiscontinuity`` unless ``position`` is the next one."""
        if position != self.end:
            raise CacheDiscontinuity(self.layer, self.end, position)

    def copy(self) -> "Ring":
        return replace(self)

    # -- reservations ------------------------------------------------------

    def append(self, position: int) -> int:
        """Reserve the physical row for ``position``; advance the origins on a wrap."""
        if position != self.origin_logical + self.len:
            raise CacheDiscontinuity(self.layer, self.end, position)
        self.end = position + 1
        if self.len < self.capacity:
            write = (self.origin_physical + self.len) % self.capacity
            self.len += 1
            return write
        write = self.origin_physical
        self.origin_logical += 1
        self.origin_physical = (self.origin_physical + 1) % self.capacity
        return write

    def step(self, prev: "Ring", lead: int, limit: int) -> int:
        """The decode hot path's one token at ``end``: reserve its physical row
        (as ``append``) and return it, when ``prev`` (the list neighbour's ring)
        is exactly ``lead`` positions ahead, ``end`` is below ``limit`` and the
        token is read in place (``read_for(1)`` is not ``Read.SHADOW``); else
        return -1 and change nothing (the caller takes the checked path, which
        raises the error or reads the shadow). One call does what the gate, the
        read and the append each did, because this runs once per layer per token."""
        end = self.end
        if end >= limit or prev.end != end + lead:
            return -1
        n = self.len
        if n == self.capacity:
            write = self.origin_physical
            self.origin_logical += 1
            self.origin_physical = (write + 1) % self.capacity
        elif self.origin_physical:  # a split ring: read through the shadow
            return -1
        else:
            self.len = n + 1
            write = n
        self.end = end + 1
        return write

    def append_batch(self, start: int, count: int) -> Tuple[int, int]:
        """Reserve rows for ``count`` positions from ``start``.

        Returns ``(source_first, source_count)``: which of the handed-in rows are
        still live once the reservation is done. Only a chunk wider than the ring
        loses its own head (``source_first > 0``).
        """
        self.check(start)
        if count < 0:
            raise ValueError(f"layer {self.layer}: negative batch size {count}")
        self.end = start + count
        total = self.len + count
        if total <= self.capacity:
            self.len = total
        else:
            overflow = total - self.capacity
            self.origin_logical += overflow
            self.origin_physical = (self.origin_physical + overflow) % self.capacity
            self.len = self.capacity
        source_first = max(self.origin_logical - start, 0)
        return source_first, count - source_first

    # -- plans: what an operation means, computed before anything changes -----

    def write(self, position: int, count: int) -> Write:
        """The plan for ``count`` tokens at ``position`` (continuity checked;
        this ring is not changed: commit ``plan.after`` once the rows are placed)."""
        self.check(position)
        if count < 1:
            raise ValueError(f"layer {self.layer}: a write needs at least one token, got {count}")
        after = replace(self)
        first, kept = after.append_batch(position, count)
        runs = tuple(Run(r.physical, r.length, r.source + first)
                     for r in after.runs(position + first, kept))
        evicted = (self.origin_logical, after.origin_logical)
        return Write(self.copy(), after, count, runs, evicted, self.read_for(count))

    def read_for(self, count: int) -> Read:
        """How a write of ``count`` tokens into this ring is read back (see ``Read``)."""
        if count == 1 and self.len == self.capacity:
            return Read.RING
        if self.origin_physical == 0 and self.len + count <= self.capacity:
            return Read.PREFIX
        return Read.SHADOW

    def assign(self, other: "Ring") -> None:
        """Take ``other``'s state (a plan's ``after``) in place: a ring is one
        object for its cache's life, so its neighbours read it directly."""
        if other.capacity != self.capacity:
            raise ValueError(f"layer {self.layer}: ring capacity {other.capacity} != {self.capacity}")
        self.len, self.origin_logical, self.origin_physical, self.end = (
            other.len, other.origin_logical, other.origin_physical, other.end)

    def trimmable(self, first_retained: Optional[int]) -> int:
        """How many newest tokens can be trimmed exactly, when every position
        overwritten from ``first_retained`` up to ``origin_logical`` is held
        (``None``: none is). Trimming to end ``e`` needs the positions
        ``[max(0, e - capacity), origin_logical)`` back."""
        if self.origin_logical == 0:
            return self.len  # nothing was ever overwritten
        if first_retained is None:
            return max(0, self.len - self.capacity)
        if first_retained == 0:
            return self.end
        return max(0, self.end - self.capacity - first_retained)

    def trimmed(self, count: int) -> Trim:
        """The plan for forgetting the newest ``count`` tokens (the caller has
        checked ``trimmable``): the earlier ring, and which overwritten
        positions come back (those at or past the new end were trimmed too)."""
        if not 0 <= count <= self.end:
            raise ValueError(f"layer {self.layer}: cannot trim {count} of {self.end} positions")
        end = self.end - count
        origin = max(0, end - self.capacity)
        back = self.origin_logical - origin
        after = Ring(self.capacity, end - origin, origin,
                     (self.origin_physical - back) % self.capacity, self.layer)
        lo, hi = origin, min(self.origin_logical, end)
        runs = tuple(after.runs(lo, hi - lo)) if hi > lo else ()
        return Trim(self.copy(), after, count, (lo, max(lo, hi)), runs)

    @classmethod
    def installed(cls, capacity: int, start: int, count: int, layer: int = 0) -> "Ring":
        """The ring a sequential build leaves holding ``count`` rows from
        ``start``: the rotation is ``start % capacity``, so a ring installed from
        stored rows and one built token by token hold every row in the same place."""
        return cls(capacity, count, start, start % capacity, layer)
