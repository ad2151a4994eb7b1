"""Many sequences at once: mlx-lm's batch protocol over muser-kv's caches.

A ``BatchKVCache`` is one layer for ``B`` sequences in one forward. Its storage
is one ``Planes`` object of ``S >= B`` slots, allocated up front; sequence ``b``
is slot ``b``, and is a single-sequence cache of its own (``SlidingKVCache`` /
``GlobalKVCache`` bound to that slot) with its own exact ring state and, for a
ring, its own retained rows. So each sequence stays exact however the batch
moves, continuity is kept per sequence, and ``extract`` hands back exactly the
single-sequence cache the sequence would have had alone.

What a step costs, and what it copies:

* **decode** (one token each): every sequence's ring reserves its row, one
  scatter per plane writes all of them, and attention reads the first ``B``
  slots in place -- a ring's whole capacity, a growing plane's longest prefix --
  with an additive mask for the rows a sequence does not hold yet (none once
  every sequence holds every row read: level lengths, or every ring full). No
  plane is copied.
* **prefill** (a chunk each, right-padded as mlx-lm's ``BatchGenerator`` pads it:
  ``prepare(lengths=...)`` says how many tokens of the next prompt are real for
  each sequence): each sequence commits only its real tokens, so padding never
  evicts a row; a sliding layer attends over a staging shadow of every
  sequence (its live rows in logical order, right-aligned, then the chunk), as a
  single sequence does across the wrap.
* **merge / extend** copy each admitted sequence's rows into a free slot (only
  theirs); **filter** (a sequence finished) moves the sequences behind it down
  one slot each, keeping mlx-lm's order (only theirs); **extract** copies one
  sequence's rows out. A batch that outgrows its slots is given larger planes
  (every sequence copied once); ``make_prompt_cache(..., batch_slots=N)``
  preallocates ``N`` slots when the caches are merged, so that never happens.

A global layer's batch planes are allocated as its sequences' planes are
(``Planes.settle``): every slot holds ``canonical_rows`` of the longest sequence's
rows, settled before each write. They are preallocated when any merged sequence's
are. A sequence extracted from a batch gets planes of its own regime, canonical
for its rows.

mlx-lm's left padding (``prepare(left_padding=...)``) is not taken: its own
``BatchGenerator`` right-pads, and a left-padded batch is refused before
anything changes.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

import mlx.core as mx

from muser_kv.caches import base, cachelist, mlx_lm_attention
from muser_kv.caches.base import Mask, MuseKVCache, nothing_fetched
from muser_kv.caches.growing import GlobalKVCache
from muser_kv.caches.masks import (
    DECODE_MASK,
    additive_mask,
    batch_chunk_mask,
    batch_decode_mask,
    check_window,
    decode_read_rows,
)
from muser_kv.caches.sliding import SlidingKVCache
from muser_kv.caches.writes import ContextOverflow, evaluated_with, require_bound
from muser_kv.core import kernels
from muser_kv.core.attention import DecodeRead, KeyRead, decode_attention
from muser_kv.core.geometry import LayerKind, MuseGeometry, canonical_rows
from muser_kv.core.planes import Planes

Pair = Tuple[mx.array, mx.array]


def _bound(source: MuseKVCache, planes: Planes, slot: int) -> MuseKVCache:
    """A cache like ``source`` (same geometry, ring state and retained rows) in
    slot ``slot`` of ``planes``; the rows are the caller's to put there."""
    return cast(Any, source).bound_to(planes, slot)


class BatchKVCache:
    """One layer's cache for a batch of sequences (see the module doc)."""

    def __init__(self, planes: Planes, seqs: List[MuseKVCache]):
        if not seqs:
            raise ValueError("a batch needs at least one sequence")
        if len(seqs) > planes.slots:
            raise ValueError(f"{len(seqs)} sequences do not fit {planes.slots} slots")
        self.planes = planes
        self.seqs = seqs
        first = seqs[0]
        self.kind = first.kind
        self.layer = first.layer
        self._window = first.window_size
        self.max_context = first.max_context
        self._remaining: Optional[List[int]] = None  # real tokens left per sequence (prepare)
        self._offsets: Optional[mx.array] = None
        #: which sequences a decode step writes (``None``: all); a sequence left
        #: out keeps its state, and its query (a placeholder) sees its own rows
        self.active: Optional[List[bool]] = None
        self.backend = first.backend
        #: the keys the last step returned, weakly (decode_read), and after a
        #: chunk where each sequence's keys lie
        self._fetched: Callable[[], Optional[mx.array]] = nothing_fetched
        self._chunk_reads: Optional[Tuple[KeyRead, ...]] = None

    # -- building ---------------------------------------------------------------------

    @classmethod
    def merge(cls, caches: Sequence[MuseKVCache], slots: Optional[int] = None) -> "BatchKVCache":
        """A batch of these single-sequence caches, in order: each one's rows,
        ring state and retained rows copied into its own slot (``slots`` slots in
        all: default the caches' ``batch_slots``, at least as many as there are
        caches). The caches themselves are left as they were."""
        caches = list(caches)
        if not caches:
            raise ValueError("merge needs at least one cache")
        first = caches[0]
        for i, c in enumerate(caches):
            if not isinstance(c, MuseKVCache):
                raise TypeError(f"merge: cache {i} is a {type(c).__name__}, not a muser-kv cache")
            mine = (c.kind, c.layout, c.dtype, c.kv_heads, c.head_dim, c.window_size, c.max_context,
                    c.capacity, getattr(c, "retain", 0))
            want = (first.kind, first.layout, first.dtype, first.kv_heads, first.head_dim,
                    first.window_size, first.max_context, first.capacity, getattr(first, "retain", 0))
            if mine != want:
                raise ValueError(f"merge: cache {i} (kind, layout, dtype, kv_heads, head_dim, window, "
                                 f"max_context, capacity, retain) = {mine}, expected {want}")
        size = max(len(caches), slots or 0, max(getattr(c, "batch_slots", 1) for c in caches))
        growing = all(c.growing for c in caches)
        planes = Planes(kv_heads=first.kv_heads, head_dim=first.head_dim,
                        capacity=first.capacity, layout=first.layout, dtype=first.dtype,
                        slots=size, growing=growing,
                        rows=_rows(growing, max(c.ring.extent for c in caches), first.capacity))
        seqs = []
        for b, c in enumerate(caches):
            if not c.empty():
                planes.copy_slot(b, c.planes, c.slot)
            seqs.append(_bound(c, planes, b))
        mx.eval(planes.k, planes.v)
        return cls(planes, seqs)

    # -- identity -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    @property
    def offset(self) -> mx.array:
        """Every sequence's next position (``[B]`` int32: what RoPE reads)."""
        if self._offsets is None:
            self._offsets = _offsets(tuple([s.offset for s in self.seqs]))
        return self._offsets

    def offsets(self) -> List[int]:
        return [s.offset for s in self.seqs]

    def __repr__(self) -> str:
        return (f"BatchKVCache(layer={self.layer}, kind={self.kind.value}, sequences="
                f"{len(self.seqs)}, slots={self.planes.slots}, offsets={self.offsets()})")

    # -- prompts (mlx-lm's BatchGenerator) ---------------------------------------------

    def prepare(self, *, left_padding: Optional[Sequence[int]] = None,
                lengths: Optional[Sequence[int]] = None,
                right_padding: Optional[Sequence[int]] = None) -> None:
        """Before a right-padded prompt: ``lengths[b]`` of the coming tokens are
        sequence ``b``'s own, the rest padding (never stored). mlx-lm's
        ``BatchGenerator`` also passes ``right_padding``; ``lengths`` already
        says everything it does, so it is accepted and not read."""
        if left_padding is not None and any(int(p) for p in left_padding):
            raise ValueError(
                "muser-kv batches take right-padded prompts (mlx-lm's BatchGenerator pads "
                f"right); left padding {list(left_padding)} is not supported")
        if lengths is not None:
            lengths = [int(x) for x in lengths]
            if len(lengths) != len(self.seqs) or min(lengths) < 0:
                raise ValueError(f"prepare: lengths {lengths} for {len(self.seqs)} sequences")
            for s, n in zip(self.seqs, lengths):
                if s.offset + n > s.max_context:
                    raise ValueError(f"prepare: sequence at {s.offset} + {n} tokens exceeds "
                                     f"max_context {s.max_context}")
            self._remaining = lengths

    def finalize(self) -> None:
        """After a right-padded prompt: nothing to move (padding was never stored)."""
        self._remaining = None

    def _real(self, n: int) -> List[int]:
        """How many of the next ``n`` tokens are each sequence's own."""
        if self._remaining is None:
            return [n] * len(self.seqs)
        return [min(n, r) for r in self._remaining]

    # -- the protocol mlx-lm's models call ----------------------------------------------

    def _check_input(self, keys: mx.array, values: mx.array) -> int:
        where = f"KV cache for layer {self.layer} (batch of {len(self.seqs)})"
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, mx.array) or x.ndim != 4:
                raise ValueError(f"{where}: {name} must be [batch, kv_heads, tokens, head_dim]")
            if x.dtype not in kernels.INPUT_DTYPES:
                raise TypeError(f"{where}: {name} dtype must be float32, float16 or bfloat16, "
                                f"got {x.dtype}")
        b, h, n, d = keys.shape
        if b != len(self.seqs):
            raise ValueError(f"{where}: expected batch {len(self.seqs)}, got {b}")
        if (h, d) != (self.planes.kv_heads, self.planes.head_dim):
            raise ValueError(f"{where}: expected {self.planes.kv_heads} KV heads x "
                             f"{self.planes.head_dim}, got {h} x {d}")
        if tuple(values.shape) != tuple(keys.shape) or n < 1:
            raise ValueError(f"{where}: keys {tuple(keys.shape)} and values "
                             f"{tuple(values.shape)} differ or are empty")
        return n

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Pair:
        n = self._check_input(keys, values)
        real = self._real(n)
        for s, r in zip(self.seqs, real):
            if s.offset + r > s.max_context:
                raise ContextOverflow(s.layer, s.offset + r, s.max_context)
        self._offsets = None
        if n == 1 and self._remaining is None:
            return self._decode(keys, values)
        out = self._chunk(keys, values, real)
        if self._remaining is not None:
            self._remaining = [r - k for r, k in zip(self._remaining, real)]
        return out

    def _decode(self, keys: mx.array, values: mx.array) -> Pair:
        """One token per sequence: rows reserved by each ring, one scatter per plane."""
        held: List[mx.array] = []
        rows, slots, ahead = [], [], []
        active = self.active or [True] * len(self.seqs)
        read = decode_read_rows(self.kind, [s.ring for s in self.seqs], active)
        if self.kind is LayerKind.GLOBAL:
            self.planes.settle(read)  # the longest ring after its token: room for every one
            for b, (s, on) in enumerate(zip(self.seqs, active)):
                if on:
                    rows.append(s.ring.append(s.ring.end))
                    slots.append(b)
        else:
            for b, (s, on) in enumerate(zip(_rings(self.seqs), active)):
                if on:
                    row, kept, due = s.decode_row()
                    rows.append(row)
                    slots.append(b)
                    if kept is not None:
                        held.append(kept)
                    if due:
                        ahead.append(s)
        if keys.dtype != self.planes.dtype:
            keys, values = keys.astype(self.planes.dtype), values.astype(self.planes.dtype)
        if len(slots) < len(self.seqs):
            index = mx.array(slots, dtype=mx.int32)
            keys, values = mx.take(keys, index, axis=0), mx.take(values, index, axis=0)
            self.planes.put_rows(rows, keys, values, slots)
        else:
            self.planes.put_rows(rows, keys, values)
        out = self.planes.prefix(read, slots=len(self.seqs))
        for s in ahead:  # after the write, as the single path's
            copy = s.copy_ahead()
            if copy is not None:
                held.append(copy)
        for h in held:
            out = evaluated_with(out, h)
        self._fetched = weakref.ref(out[0])
        self._chunk_reads = None
        return out

    def decode_read(self, keys: mx.array, values: mx.array) -> Optional[DecodeRead]:
        """Where each sequence's keys lie in what the last step returned
        (``core.attention``), when ``keys`` are those: after a decode step, slot
        ``b`` of the first ``B`` as sequence ``b``'s ring says (a placeholder's
        rows as it holds them); after a chunk, as ``_chunk`` placed them (the
        wrapper decides whether a chunk takes this attention: every one on the
        CPU, none longer than ``MAX_QUERIES`` tokens on a GPU). ``None`` when
        the keys are not those (or a chunk ran past the planes' limit)."""
        if self._fetched() is not keys:
            return None
        reads = self._chunk_reads or tuple([
            KeyRead(b, r.end, r.len, r.origin_physical, r.capacity)
            for b, r in enumerate([s.ring for s in self.seqs])])
        window = self._window if self.kind is LayerKind.SLIDING else None
        return DecodeRead(keys, values, reads, window)

    def _chunk(self, keys: mx.array, values: mx.array, real: List[int]) -> Pair:
        """A chunk per sequence, its first ``real[b]`` tokens its own."""
        n = keys.shape[2]
        held: List[mx.array] = []
        self._fetched = nothing_fetched
        before = [s.ring.end for s in self.seqs]
        if self.kind is LayerKind.GLOBAL:
            rows = min(max(s.ring.len for s in self.seqs) + n, self.planes.limit)
            self.planes.settle(rows)  # the rows the read spans, padding included
            for b, (s, r) in enumerate(zip(self.seqs, real)):
                if r:
                    plan = s.ring.write(s.ring.end, r)
                    s.store(keys[b:b + 1, :, :r], values[b:b + 1, :, :r], plan)
                    s.ring.assign(plan.after)
            kv = self.planes.prefix(rows, slots=len(self.seqs))
            # each sequence's chunk as if whole: a real query (i < real[b]) sees
            # only rows its sequence wrote; a padding one's answer is never read
            if max(before) + n <= rows:
                self._fetch(kv, tuple([KeyRead(b, e + n, e + n, 0, rows)
                                       for b, e in enumerate(before)]))
            return kv
        # sliding: the staging shadow of every sequence, right-aligned
        old = [s.ring.len for s in self.seqs]
        width = max(old)
        dtype = self.planes.dtype
        shadows_k, shadows_v = [], []
        for b, (s, r) in enumerate(zip(_rings(self.seqs), real)):
            k_b, v_b = keys[b:b + 1], values[b:b + 1]
            old_k, old_v = s.backend.gather(*self.planes.physical(b), s.layout, s.ring)
            chunk_k = _token_rows(k_b, dtype)
            chunk_v = _token_rows(v_b, dtype)
            pad = width - s.ring.len
            if pad:
                zeros = mx.zeros((pad, self.planes.kv_dim), dtype)
                old_k, old_v = mx.concatenate([zeros, old_k]), mx.concatenate([zeros, old_v])
            shadows_k.append(mx.concatenate([old_k, chunk_k]))
            shadows_v.append(mx.concatenate([old_v, chunk_v]))
            if r:
                plan = s.ring.write(s.ring.end, r)
                kept = s.keep_from_shadow(plan, shadows_k[-1], shadows_v[-1], pad)
                if kept is not None:
                    held.append(kept)
                s.store(k_b[:, :, :r], v_b[:, :, :r], plan)
                s.ring.assign(plan.after)
                ahead = s.copy_ahead()
                if ahead is not None:
                    held.append(ahead)
        h, d = self.planes.kv_heads, self.planes.head_dim
        shadow_k = mx.stack(shadows_k).reshape(len(self.seqs), width + n, h, d).transpose(0, 2, 1, 3)
        shadow_v = mx.stack(shadows_v).reshape(len(self.seqs), width + n, h, d).transpose(0, 2, 1, 3)
        out = (shadow_k, shadow_v)
        for x in held:
            out = evaluated_with(out, x)
        # sequence b: its old rows right-aligned to width, then the chunk
        self._fetch(out, tuple([KeyRead(b, e + n, m + n, width - m, width + n)
                                for b, (e, m) in enumerate(zip(before, old))]))
        return out

    def _fetch(self, kv: Pair, reads: Tuple[KeyRead, ...]) -> None:
        """Record a chunk's keys for ``decode_read``."""
        self._fetched = weakref.ref(kv[0])
        self._chunk_reads = reads

    def make_mask(self, N: int, window_size: Optional[int] = None,
                  return_array: bool = False) -> Mask:
        """The mask for the rows the next ``update_and_fetch(N tokens)`` returns.

        A decode step (``N == 1``) under muser-kv's decode attention gets
        ``DECODE_MASK``: no array, since that attention reads each sequence's
        keys as integers (``decode_read``), at any lengths. Otherwise (MLX's
        attention, ``return_array``, a chunk):

        ``None`` (or ``"causal"`` for a chunk) wherever every sequence sees the
        same rows as the others -- equal lengths, every ring full -- since MLX's
        CUDA attention reads at the bandwidth limit only without an array mask
        (docs/performance.md, "What does a mask cost MLX CUDA's attention?").
        Otherwise the additive form (``masks.additive_mask``, in the
        planes' dtype), built once per call: the model asks once per layer kind
        and every layer of the kind shares it. That is exact because every query
        row of a batch sees at least one row (its own token, or a placeholder's
        origin row), and every row it may be handed is one a model wrote or the
        planes' zero fill, never a non-finite one. ``return_array`` gives the bool
        form, as mlx-lm's caches give it, for callers that combine masks."""
        if isinstance(N, bool) or not isinstance(N, int) or N < 1:
            raise ValueError(f"make_mask needs an int N >= 1, got {N!r}")
        if self.kind is LayerKind.SLIDING:
            check_window(self.layer, self._window, window_size)
        if N == 1 and self._remaining is None:
            if not return_array and decode_attention() == "muser":
                return DECODE_MASK  # the lengths go to attention as integers (decode_read)
            mask: Union[None, str, mx.array] = batch_decode_mask(
                self.kind, [s.ring for s in self.seqs], self.active, window_size, return_array)
        else:
            mask = batch_chunk_mask(self.kind, [s.ring.len for s in self.seqs], N, window_size,
                                    self._window, self.planes.limit, return_array)
        if mask is None or isinstance(mask, str) or return_array:
            return mask
        return additive_mask(mask, self.planes.dtype)

    # -- batch membership ---------------------------------------------------------------

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only these sequences, in this order (mlx-lm's, ascending): each kept
        sequence behind a dropped one moves down into the freed slot."""
        keep = [int(i) for i in batch_indices]
        if sorted(set(keep)) != keep or (keep and not 0 <= keep[0] <= keep[-1] < len(self.seqs)):
            raise ValueError(f"filter: indices {keep} are not ascending indices of "
                             f"{len(self.seqs)} sequences")
        if not keep:
            raise ValueError("filter: a batch needs at least one sequence (drop the batch instead)")
        seqs = []
        for j, src in enumerate(keep):
            s = self.seqs[src]
            if src != j:
                self.planes.copy_slot(j, self.planes, src)
                s.slot = j
            seqs.append(s)
        self.seqs = seqs
        if self._remaining is not None:
            self._remaining = [self._remaining[i] for i in keep]
        self._offsets = None

    def extend(self, other: "BatchKVCache") -> None:
        """Admit ``other``'s sequences after this batch's: their rows are copied into
        free slots (larger planes, every sequence copied once, if none are left).
        ``other`` is consumed (mlx-lm drops it after ``extend``): once the copy is
        evaluated, its planes are released, so admitting sequences holds one
        layer's second copy of them at a time, never all layers'."""
        if not isinstance(other, BatchKVCache) or (other.kind, other.planes.layout,
                                                   other.planes.dtype, other.planes.limit) != (
                self.kind, self.planes.layout, self.planes.dtype, self.planes.limit):
            raise ValueError("extend: the other batch has another kind, layout, dtype or geometry")
        start = len(self.seqs)
        need = start + len(other.seqs)
        if need > self.planes.slots:
            self._grow(max(need, 2 * self.planes.slots))
        self.planes.reserve(max(s.ring.extent for s in other.seqs))
        for i, s in enumerate(other.seqs):
            self.planes.copy_slot(start + i, other.planes, s.slot)
            self.seqs.append(_bound(s, self.planes, start + i))
        if self._remaining is not None or other._remaining is not None:
            mine = self._remaining or [0] * start
            theirs = other._remaining or [0] * len(other.seqs)
            self._remaining = mine + theirs
        self._offsets = None
        mx.eval(self.planes.k, self.planes.v)
        other.seqs = []
        del other.planes

    def _grow(self, slots: int) -> None:
        old = self.planes
        planes = Planes(kv_heads=old.kv_heads, head_dim=old.head_dim, capacity=old.capacity,
                        layout=old.layout, dtype=old.dtype, slots=slots, growing=old.growing,
                        rows=old.rows)
        for b, s in enumerate(self.seqs):
            planes.copy_slot(b, old, b)
            s.planes = planes
        mx.eval(planes.k, planes.v)
        self.planes = planes

    def extract(self, idx: int) -> MuseKVCache:
        """Sequence ``idx`` alone: a single-sequence cache of its own planes, ring
        state and retained rows, exactly as it would be had it run alone. Its rows
        are copied (and evaluated) now, so nothing lazy holds the batch's planes."""
        s = self.seqs[int(idx)]
        planes = Planes(kv_heads=s.kv_heads, head_dim=s.head_dim, capacity=s.capacity,
                        layout=s.layout, dtype=s.dtype, growing=s.growing,
                        rows=_rows(s.growing, s.ring.extent, s.capacity))
        planes.copy_slot(0, self.planes, s.slot)
        out = _bound(s, planes, 0)
        mx.eval(planes.k, planes.v)
        return out

    # -- state, sizes, trims, copies ------------------------------------------------------

    @property
    def state(self) -> Pair:
        """The planes (every slot), with the sequences' retained copies made since
        the last read attached (``RetainedRows.pending``)."""
        pending = [x for s in self.seqs if isinstance(s, SlidingKVCache)
                   for x in s.pending_retained()]
        kv = (self.planes.k, self.planes.v)
        return tuple(mx.depends(list(kv), pending)) if pending else kv

    @property
    def meta_state(self) -> Tuple[str, ...]:
        return tuple(",".join(x for x in s.meta_state) for s in self.seqs)

    @property
    def nbytes(self) -> int:
        """Bytes of the planes, every slot (preallocated) included."""
        return self.planes.nbytes

    def size(self) -> int:
        return max(s.size() for s in self.seqs)

    def empty(self) -> bool:
        return all(s.empty() for s in self.seqs)

    def is_trimmable(self) -> bool:
        return all(s.is_trimmable() for s in self.seqs)

    def trimmable_depth(self) -> int:
        return min(s.trimmable_depth() for s in self.seqs)

    def trim(self, n: int) -> int:
        """Forget every sequence's newest ``n`` tokens, exactly, or refuse (all or
        nothing: every sequence is checked first)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"trim needs an int >= 0, got {n!r}")
        depth = self.trimmable_depth()
        if n > depth:
            raise ValueError(f"layer {self.layer}: the batch can trim at most {depth} tokens "
                             f"exactly, asked for {n}")
        for s in self.seqs:
            s.trim(n)
        self._offsets = None
        return n

    @classmethod
    def from_state(cls, state: Any, meta_state: Any = None) -> "BatchKVCache":
        """Refused: a batch's planes hold several sequences, and a prompt-cache
        file of them would restore none exactly; save each sequence's cache
        (``extract(i)``) instead."""
        raise ValueError(
            "muser-kv batch caches are not restored from a state: a batch's rows belong to "
            "several sequences; save and load each sequence's cache (BatchKVCache.extract(i))")

    def __deepcopy__(self, memo: Dict[int, Any]) -> "BatchKVCache":
        """An independent batch: the arrays are shared until either side writes
        (MLX arrays are values), everything else is copied."""
        planes = copy.copy(self.planes)
        planes.k, planes.v = self.planes.handles()
        seqs = [_bound(s, planes, s.slot) for s in self.seqs]
        other = BatchKVCache(planes, seqs)
        other._remaining = None if self._remaining is None else list(self._remaining)
        return other


_OFFSETS: dict = {}


def _offsets(positions: Tuple[int, ...]) -> mx.array:
    """``positions`` as an int32 array, built once for every layer of a step."""
    out = _OFFSETS.get(positions)
    if out is None:
        if len(_OFFSETS) > 64:
            _OFFSETS.clear()
        out = _OFFSETS[positions] = mx.array(positions, dtype=mx.int32)
    return out


def _rows(growing: bool, extent: int, capacity: int) -> Optional[int]:
    """The allocation of new planes for rows ``[0, extent)``: canonical for them
    when growing, else the preallocated size (``None``)."""
    return canonical_rows(extent, capacity) if growing else None


def _token_rows(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """Model-shaped ``[1, H, N, D]`` -> token-major rows ``[N, H*D]`` of ``dtype``."""
    _, h, n, d = x.shape
    return x.astype(dtype)[0].transpose(1, 0, 2).reshape(n, h * d)


def make_slot_caches(geometry: MuseGeometry, slots: int, retain: int, plane_dtype: mx.Dtype,
                     sliding_layout: str = kernels.TOKEN_MAJOR, model: Any = None
                     ) -> Tuple[List[BatchKVCache], List[List[MuseKVCache]]]:
    """``slots`` sequences over shared planes (one ``Planes`` of ``slots`` slots per
    layer, allocated now): for each slot, a bound cache list a model can run
    alone; for each layer, a batch over every slot (``active`` picks whom a
    decode step writes). Every plane is allocated whole: ``geometry`` needs a
    bound (``require_bound``)."""
    require_bound(geometry, "shared slot planes (SlotPool)")
    per_slot: List[List[MuseKVCache]] = [[] for _ in range(slots)]
    batches = []
    for i in range(geometry.num_layers):
        sliding = geometry.layer_kind(i) is LayerKind.SLIDING
        heads, dim = geometry.layer_dims(i)
        planes = Planes(kv_heads=heads, head_dim=dim,
                        capacity=geometry.capacity(i),
                        layout=sliding_layout if sliding else kernels.HEAD_MAJOR,
                        dtype=plane_dtype, slots=slots)
        seqs: List[MuseKVCache] = []
        for s in range(slots):
            c: MuseKVCache
            if sliding:
                c = SlidingKVCache(planes, window=geometry.window, max_context=geometry.max_context,
                                   layer=i, slot=s, retain=retain)
            else:
                c = GlobalKVCache(planes, window=geometry.window, max_context=geometry.max_context,
                                  layer=i, slot=s)
            seqs.append(c)
            per_slot[s].append(c)
        batches.append(BatchKVCache(planes, seqs))
    for caches in per_slot:
        cachelist.bind(caches, model, model_layers=geometry.model_layers or geometry.num_layers)
    if model is not None:
        mlx_lm_attention.route(model)  # its decode steps attend with muser-kv's attention
    return batches, per_slot


def _rings(seqs: List[MuseKVCache]) -> List[SlidingKVCache]:
    """A sliding layer's sequences as the rings they are: every sequence of a
    batch is of the batch's kind (``merge`` checks it; ``_bound`` keeps it)."""
    return cast(List[SlidingKVCache], seqs)


base.BATCH = BatchKVCache
