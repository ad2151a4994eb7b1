"""The masks a cache hands attention, in mlx-lm's semantics: which keys each
query of a write sees (``causal_mask``), that rule in attention's additive
form (``additive_mask``), and the masks of a batch's chunk and decode step,
per sequence (``batch_chunk_mask``, ``batch_decode_mask``)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import mlx.core as mx

from muser_kv.core.geometry import LayerKind
from muser_kv.core.ring import Ring, Run


def check_window(layer: int, built: int, asked: Optional[int]) -> None:
    """Refuse a sliding mask asked for another window than the cache's: its
    rows were kept for ``built``, and any other window would be silently wrong."""
    if asked is not None and asked != built:
        raise ValueError(f"layer {layer}: sliding cache built for window {built}, "
                         f"asked for a mask with window {asked}")


def causal_mask(n: int, offset: int, window: Optional[int] = None) -> mx.array:
    """``[n, offset + n]`` bool: query ``offset + i`` sees key ``j`` iff
    ``j <= offset + i`` (and ``offset + i - j < window``). mlx-lm's semantics."""
    keys = mx.arange(offset + n)[None]
    queries = mx.arange(offset, offset + n)[:, None]
    mask = queries >= keys
    if window is not None:
        mask = mask & (queries < keys + window)
    return mask


def additive_mask(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """A bool mask as attention's additive form in ``dtype`` (0 where a key is
    seen, -inf where not): the same attention, bit for bit, for any row that
    sees at least one key with finite scores. MLX's CUDA attention takes this
    form in its fused kernel but turns a bool mask into a float one of every
    head first, a temporary per head and a slower chunk (docs/performance.md,
    "What does a mask cost MLX CUDA's attention?"). Only
    for rows that always see a key (a sliding chunk sees itself): a fully masked
    row, or a NaN key, would need the bool form's select."""
    return mx.where(mask, mx.array(0, dtype), mx.array(-float("inf"), dtype))


def batch_chunk_mask(kind: LayerKind, lens: Sequence[int], N: int, window_size: Optional[int],
                     window: int, limit: int, return_array: bool) -> Union[str, mx.array]:
    """A batch's chunk of ``N`` tokens each (padding included), for sequences
    holding ``lens`` rows in a layer of ``kind`` (sliding: the batch's
    ``window``; global: planes of at most ``limit`` rows): ``[B or 1, 1, N, L]``
    bool, or ``"causal"`` where that is what it says."""
    B = len(lens)
    level = len(set(lens)) == 1
    i = mx.arange(N).reshape(1, N, 1)
    if kind is LayerKind.GLOBAL:
        rows = min(max(lens) + N, limit)
        if level and rows == lens[0] + N:
            if window_size is None:
                return causal_mask(N, lens[0])[None, None] if return_array else "causal"
            return causal_mask(N, lens[0], window_size)[None, None]
        j = mx.arange(rows).reshape(1, 1, rows)
        at = mx.array(list(lens), dtype=mx.int32).reshape(B, 1, 1)
        mask = j <= at + i
        if window_size is not None:
            mask = mask & (at + i - j < window_size)
        return mask[:, None]
    # sliding: the staging shadow, old rows right-aligned to the longest ring
    width = max(lens)
    if level:
        if not return_array and width + N <= window:  # the window never binds
            return "causal"
        return causal_mask(N, width, window)[None, None]
    pad = mx.array([width - n for n in lens], dtype=mx.int32).reshape(B, 1, 1)
    j = mx.arange(width + N).reshape(1, 1, width + N)
    rel = j - width  # the chunk's token index; negative for old rows
    mask = (j >= pad) & (rel <= i) & (i - rel < window)
    return mask[:, None]


def batch_decode_mask(kind: LayerKind, rings: Sequence[Ring], active: Optional[Sequence[bool]],
                      window_size: Optional[int], return_array: bool) -> Optional[mx.array]:
    """A batch's decode step, one token each, for sequences whose state is
    ``rings`` (``active``: whom the step writes; ``None``: every sequence):
    ``[B, 1, 1, L]`` bool, or ``None`` when every sequence sees every row it is
    handed. A ring row is valid once its sequence holds it (every row of a full
    ring); a plane row below the sequence's length."""
    B = len(rings)
    on_list = list(active) if active else [True] * B
    # rows each sequence holds after the write (a placeholder sees at least one)
    after = [r.len + 1 if on else max(1, r.len) for r, on in zip(rings, on_list)]
    if kind is LayerKind.GLOBAL:
        rows = decode_read_rows(kind, rings, on_list)
        if len(set(after)) == 1 and (window_size is None or rows <= window_size) \
                and not return_array:
            return None
        j = mx.arange(rows).reshape(1, rows)
        valid = j < mx.array(after, dtype=mx.int32).reshape(B, 1)
        if window_size is not None:
            valid = valid & (mx.array(after).reshape(B, 1) - 1 - j < window_size)
        return valid.reshape(B, 1, 1, rows)
    rows = decode_read_rows(kind, rings, on_list)
    if not return_array:
        for r in rings:
            if r.len != r.capacity:
                break
        else:  # every ring full, before and after the token: each holds every row read
            return None
    # each ring's live rows once the token is written (a placeholder: the
    # rows it holds, at least its origin row), as the ring's physical runs
    runs = [_runs_after_decode(r, on) for r, on in zip(rings, on_list)]
    if not return_array and all(sum(r.length for r in rs) == rows for rs in runs):
        return None  # every sequence holds every row read: full rings, or level ones
    first = [rs[0] for rs in runs]
    second = [rs[1] if len(rs) > 1 else Run(0, 0, 0) for rs in runs]
    j = mx.arange(rows, dtype=mx.int32).reshape(1, rows)
    inside = []
    for part in (first, second):
        lo = mx.array([r.physical for r in part], dtype=mx.int32).reshape(B, 1)
        hi = lo + mx.array([r.length for r in part], dtype=mx.int32).reshape(B, 1)
        inside.append((j >= lo) & (j < hi))
    return (inside[0] | inside[1]).reshape(B, 1, 1, rows)


def decode_read_rows(kind: LayerKind, rings: Sequence[Ring],
                     active: Optional[Sequence[bool]]) -> int:
    """The rows of every sequence a batch decode step reads (and its mask
    spans), for sequences whose rings are ``rings`` before the step
    (``active``: whom it writes; ``None``: every sequence): a plane's longest
    prefix after the token; a ring's capacity, or while no ring has moved its
    origin row the longest ring after the token. The batch's read and its mask
    both ask here, so they always agree."""
    # plain loops: every layer of every decode step asks
    on = active if active else None
    longest, moved = 1, False
    for i, r in enumerate(rings):
        after = r.len + 1 if on is None or on[i] else r.len
        if after > longest:
            longest = after
        if r.origin_physical:
            moved = True
    if kind is LayerKind.GLOBAL:
        return longest
    capacity = rings[0].capacity
    return capacity if moved else min(longest, capacity)


def _runs_after_decode(ring: Ring, active: bool) -> List[Run]:
    """The physical runs a decode step's attention may read in ``ring``: its live
    rows after the token is appended, or for an inactive placeholder the rows it
    holds (its origin row when it holds none)."""
    if not active:
        return ring.live_runs() if ring.len else [Run(ring.origin_physical, 1, 0)]
    after = ring.copy()
    after.append(after.end)
    return after.live_runs()


class DecodeMask:
    """A batch's decode-step mask when muser-kv's decode attention reads it:
    no array at all, since that attention takes each sequence's keys as
    integers (``core.attention``). MLX's attention refuses it (it is no array
    and no ``"causal"``), so a step that missed muser-kv's attention fails
    instead of attending without the sequences' lengths."""

    def __repr__(self) -> str:
        return "DecodeMask()"


#: the one instance every batch's decode step hands the model
DECODE_MASK = DecodeMask()
