"""Ring controller: where every row goes. Plain integers, no MLX.

Physical placement is never derived from an absolute position: the only
translation is ``(origin_physical + logical - origin_logical) % capacity``.
Carrying both origins explicitly costs two integers and makes the rotation a
fact that can be inspected, snapshotted and rolled back, rather than a modulus
recomputed on demand (seeds Ch 15.2, 23.8).

Continuity fails closed: a write at any position other than
``origin_logical + len`` raises ``CacheDiscontinuity`` and changes nothing, so a
skipped or replayed position can never silently alias a live row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Tuple


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

    # -- queries -------------------------------------------------------------

    @property
    def end(self) -> int:
        """The next logical position: ``origin_logical + len``."""
        return self.origin_logical + self.len

    @property
    def wrapped(self) -> bool:
        """True once any row has been overwritten (the window has slid)."""
        return self.origin_logical > 0

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

    # -- reservations (seeds Ch 15.5, 23.2) ----------------------------------

    def append(self, position: int) -> int:
        """Reserve the physical row for ``position``; advance the origins on a wrap."""
        self.check(position)
        if self.len < self.capacity:
            write = (self.origin_physical + self.len) % self.capacity
            self.len += 1
            return write
        write = self.origin_physical
        self.origin_logical += 1
        self.origin_physical = (self.origin_physical + 1) % self.capacity
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

    def rewind(self, count: int) -> None:
        """Forget the newest ``count`` rows; exact only while nothing they replaced
        is needed back (the caller proves that: an unwrapped ring, a growing plane,
        or rows restored from a checkpoint)."""
        if not 0 <= count <= self.len:
            raise ValueError(f"layer {self.layer}: cannot rewind {count} of {self.len} rows")
        self.len -= count
