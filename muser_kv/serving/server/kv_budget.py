"""What ``muser-kv serve`` admits into its KV memory (``--kv-memory``): one
sequence's planes as a batching server holds them (``SequencePlanes``) and the
admission rule over the admitted sequences (``KVBudget``). Plain integers from
the geometry; no arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from muser_kv.core.geometry import LayerKind, MuseGeometry, allocated_rows


@dataclass(frozen=True)
class SequencePlanes:
    """What one sequence's planes may cost a batching server (growing global
    planes; ``muser-kv serve --kv-memory``), from the geometry's integers.

    A sequence that writes ``P`` positions (its prompt plus ``max_tokens``)
    holds its sliding rings whole and global planes that grow to hold ``P``
    rows. In mlx-lm's batches, every slot of a global layer's planes holds the
    rows of the longest sequence, and a right-padded prompt chunk reads up to
    ``min(prefill_step, P)`` rows past the longest one's prompt; a growth
    doubles, so it allocates less than twice what it must hold. ``bytes`` is
    that bound for one slot.

    Replacing one layer's planes (a growth, or a batch admitting a sequence
    into more slots) holds the old planes until the copy into the new ones has
    run, one layer at a time: ``transient`` is the largest such old plane."""

    ring_bytes: int  #: every sliding ring of one sequence, K and V
    row_bytes: int  #: one row of every global plane, K and V
    max_context: int
    prefill_step: int
    layer_row_bytes: int = 0  #: one row of the widest single global layer, K and V
    layer_ring_bytes: int = 0  #: the largest single sliding ring, K and V

    @classmethod
    def of(cls, geometry: MuseGeometry, prefill_step: int) -> "SequencePlanes":
        rings = [geometry.allocated(i) * geometry.kind_row_bytes(LayerKind.SLIDING)
                 for i in range(geometry.num_layers)
                 if geometry.layer_kind(i) is LayerKind.SLIDING]
        row = geometry.kind_row_bytes(LayerKind.GLOBAL)
        return cls(sum(rings), geometry.global_layers * row, geometry.max_context, prefill_step,
                   row if geometry.global_layers else 0, max(rings, default=0))

    def rows(self, positions: int) -> int:
        """The most rows a global plane holding ``positions`` positions allocates
        in a batch whose longest sequence writes as many."""
        reach = min(self.max_context, positions + min(self.prefill_step, positions))
        # a growth doubles while the plane is short of what it must hold, so it
        # ends below twice that (a plane sized from scratch holds what it must)
        return min(allocated_rows(self.max_context), allocated_rows(max(2 * reach - 1, 1)))

    def bytes(self, positions: int) -> int:
        """One slot's planes, for a batch whose longest sequence writes ``positions``."""
        return self.ring_bytes + self.row_bytes * self.rows(positions)

    def transient(self, slots: int, positions: int) -> int:
        """The old planes of one layer of a ``slots``-slot batch, held while they
        are copied into new ones (a growth, or more slots for a new sequence)."""
        return slots * max(self.layer_row_bytes * self.rows(positions), self.layer_ring_bytes)


class KVMemoryExceeded(ValueError):
    """A request whose planes alone would need more than the server's KV budget."""


class KVBudget:
    """The admission rule of a server with ``--kv-memory BYTES``: admitted
    sequences (each by the positions it may write) cost ``len(admitted)`` slots
    at the planes of the longest (``SequencePlanes.bytes``) plus one layer's
    old planes while they are replaced (``SequencePlanes.transient``), and a
    sequence is admitted only while that stays within the budget; the rest
    wait, in order. Plain integers; the caller holds the lock (one generation
    thread)."""

    def __init__(self, budget: int, planes: SequencePlanes):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"a KV budget must be a positive int of bytes, got {budget!r}")
        self.budget, self.planes = budget, planes
        self.admitted: dict = {}

    def cost(self, positions: Iterable[int]) -> int:
        each = list(positions)
        if not each:
            return 0
        longest = max(each)
        return len(each) * self.planes.bytes(longest) + self.planes.transient(len(each), longest)

    @property
    def admitted_bytes(self) -> int:
        return self.cost(self.admitted.values())

    def check(self, positions: int) -> None:
        """Raise ``KVMemoryExceeded`` for a sequence that could never be admitted."""
        need = self.cost([positions])
        if need > self.budget:
            raise KVMemoryExceeded(
                f"this request's KV planes need {need:,} bytes ({positions} positions: its "
                f"prompt and max_tokens), more than this server's --kv-memory {self.budget:,}")

    def fits(self, positions: int) -> bool:
        return self.cost(list(self.admitted.values()) + [positions]) <= self.budget

    def admit(self, key: object, positions: int) -> None:
        self.admitted[key] = positions

    def release(self, key: object) -> None:
        self.admitted.pop(key, None)
