"""Decode attention, muser-kv's own: the one rule for its bits, and the
reference every backend's kernels are checked against.

A decode step (1 to ``MAX_QUERIES`` query tokens per sequence: a token, or a
speculative block being verified) attends over keys where they lie -- a ring
rotated anywhere, a plane allocated any size, a slot of a batch -- described
by integers, never by a mask (``KeyRead``). Its output is a function of the
sequence's own rows and positions alone, because the arithmetic is fixed by
logical position:

* the keys are split into chunks of ``CHUNK`` logical positions (chunk ``c``
  holds positions ``c * CHUNK .. (c + 1) * CHUNK - 1``), a constant: not a
  function of the allocation, the batch, the ring's origin or the device;
* each chunk's partial softmax (its max, its sum, its weighted values) is
  computed in f32, every key of the chunk in ascending position;
* the partials are combined in ascending chunk order against their common max
  (the kernels first fold them ``FOLD`` at a time, in ascending order, then
  the folds in ascending order: a sequence's grouping is its own);
* a query sees a key iff it is at or before the query's position and (on a
  sliding layer) inside its window, and a row outside the keys a sequence
  holds is never read: a stale NaN there cannot reach the output.

So a sequence gets the same bits alone or in a batch of any size, order, slot
and lengths, from any allocation and any rotation, run after run. Each
backend is bitwise equal to itself; the kernels agree with ``reference``
within rounding (a chunk's sums are taken in another order there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

#: Keys per chunk, in logical positions: the one constant the bits depend on.
CHUNK = 256
#: Chunks folded into one partial, in ascending order, before the partials of
#: a sequence are combined (so the combine's loops stay short at any depth).
FOLD = 16
#: The f32 scores the reference computes at once for a long chunk (its blocks' size).
REFERENCE_BLOCK_BYTES = 64 << 20
#: The most query tokens per sequence decode attention takes (a decode token,
#: or a speculative block under verification); longer chunks are prefill.
MAX_QUERIES = 16


@dataclass(frozen=True)
class KeyRead:
    """Where one sequence's keys lie along the row axis of the ``[S, H, R, D]``
    K/V arrays attention is handed: slot ``slot``; the sequence holds the
    ``held`` keys of positions ``end - held .. end - 1``, the first at row
    ``origin`` and each next one row on, wrapping to row 0 after ``wrap`` rows
    (a ring's capacity; a plane never wraps). These are the ring's own origin
    and capacity after the write: the ring turned positions into rows."""

    slot: int
    end: int
    held: int
    origin: int
    wrap: int

    def first(self, queries: int, window: Optional[int]) -> int:
        """The first position any of ``queries`` tokens (the last ones, ending at
        ``end``) sees: the keys held, within the first query's window."""
        start = self.end - self.held
        if window is None:
            return start
        return max(start, self.end - queries - window + 1)

    def chunks(self, queries: int, window: Optional[int]) -> Tuple[int, int]:
        """``(first chunk, count)`` of the chunks holding keys a query sees."""
        lo = self.first(queries, window)
        if lo >= self.end:
            return lo // CHUNK, 0
        first = lo // CHUNK
        return first, (self.end - 1) // CHUNK - first + 1


@dataclass(frozen=True)
class DecodeRead:
    """What one layer's cache handed attention for a decode step: the K/V arrays
    ``update_and_fetch`` returned (``[S, H, R, D]``, any strides) and where
    each sequence's keys lie in them (``sequences[b]`` for query row ``b``).
    ``window``: a sliding layer's window (``None``: global)."""

    keys: mx.array
    values: mx.array
    sequences: Tuple[KeyRead, ...]
    window: Optional[int]

    def max_chunks(self, queries: int) -> int:
        return max([s.chunks(queries, self.window)[1] for s in self.sequences] + [1])


def check_queries(queries: mx.array, read: DecodeRead,
                  most: int = MAX_QUERIES) -> Tuple[int, int, int, int]:
    """``(B, query heads, tokens, head_dim)`` of ``queries``, refused unless they
    fit ``read`` (one row per sequence, whole GQA groups, the same head_dim, at
    most ``most`` tokens)."""
    if queries.ndim != 4:
        raise ValueError(f"decode attention: queries must be [B, heads, tokens, head_dim], "
                         f"got shape {tuple(queries.shape)}")
    b, hq, n, d = queries.shape
    _, hkv, _, dk = read.keys.shape
    if b != len(read.sequences) or d != dk or hq % hkv or not 1 <= n <= most:
        raise ValueError(
            f"decode attention: queries {tuple(queries.shape)} do not fit keys "
            f"{tuple(read.keys.shape)} for {len(read.sequences)} sequences "
            f"(1 to {most} tokens, query heads a multiple of {hkv}, head_dim {dk})")
    return b, hq, n, d


def _rows_and_seen(s: KeyRead, n: int, g: int, window: Optional[int], first: int,
                   count: int) -> Tuple[np.ndarray, np.ndarray]:
    """For the ``count`` chunks from ``first``: the row of each position (a
    position the sequence does not hold reads its first held row, which no
    query sees) and ``[count, n*g, CHUNK]`` which positions each query row
    sees (row ``i * g + j``: token ``i``). The ring's origin and wrap say
    where a position lies (``KeyRead``)."""
    start = s.end - s.held
    pos = first * CHUNK + np.arange(count * CHUNK, dtype=np.int64)
    held = (pos >= start) & (pos < s.end)
    rows = (s.origin + np.where(held, pos - start, 0)) % s.wrap
    qpos = s.end - n + np.arange(n * g) // g
    seen = (pos[None] <= qpos[:, None]) & held[None]
    if window is not None:
        seen &= pos[None] > qpos[:, None] - window
    return rows.astype(np.int32), seen.reshape(n * g, count, CHUNK).transpose(1, 0, 2)


def _chunked(qr: mx.array, kc: mx.array, vc: mx.array, seen: mx.array, scale: float,
             sink: Optional[mx.array]) -> mx.array:
    """The rule's arithmetic for one sequence's block of query rows ``qr``
    ``[h, 1, M, d]`` over its chunks ``kc``/``vc`` ``[h, count, CHUNK, d]``
    (``seen`` ``[count, M, CHUNK]``: which keys each row sees; ``sink``
    ``[h, M]`` or ``None``): ``[h, M, d]`` f32. Each row's arithmetic
    is its own (a row's products and reductions never mix with another's)."""
    scores = mx.where(seen, (qr @ kc.transpose(0, 1, 3, 2)) * scale, -mx.inf)
    m = scores.max(axis=-1)                                     # [h, count, M]
    e = mx.exp(scores - mx.where(m == -mx.inf, 0, m)[..., None])
    l_c = e.sum(axis=-1)
    o_c = e @ vc                                                # [h, count, M, d]
    if kc.shape[1] == 1 and sink is None:  # one chunk: its weight is exp(0) = 1, exactly
        total, out = l_c[:, 0], o_c[:, 0]
        return mx.where(total[..., None] > 0, out / total[..., None], 0)
    top = m.max(axis=1)                                         # [h, M]
    if sink is not None:
        top = mx.maximum(top, sink)
    w = mx.where(m == -mx.inf, 0, mx.exp(m - top[:, None]))
    # combined in ascending chunk order, one after another (a scan): a row's
    # chunks before its window weigh exactly 0, so whichever block it was
    # computed in, its sums are the same additions
    total = mx.cumsum(w * l_c, axis=1)[:, -1]
    if sink is not None:
        total = total + mx.exp(sink - top)
    out = mx.cumsum(w[..., None] * o_c, axis=1)[:, -1]
    return mx.where(total[..., None] > 0, out / total[..., None], 0)


def _reference_one(q: mx.array, k: mx.array, v: mx.array, s: KeyRead, window: Optional[int],
                   scale: float, sinks: Optional[mx.array], dtype: mx.Dtype) -> mx.array:
    """One sequence: ``q`` ``[Hq, n, D]``, ``k``/``v`` its slot ``[H, R, D]``."""
    hq, n, d = q.shape
    h = k.shape[0]
    g = hq // h
    first, count = s.chunks(n, window)
    if count == 0:  # no key: nothing to weigh (a sink alone takes all the weight)
        return mx.zeros((hq, n, d), dtype)
    rows, seen = _rows_and_seen(s, n, g, window, first, count)
    index = mx.array(rows)
    kc = mx.take(k, index, axis=1).astype(mx.float32).reshape(h, count, CHUNK, d)
    vc = mx.take(v, index, axis=1).astype(mx.float32).reshape(h, count, CHUNK, d)
    # query rows per K/V head: token-major, its group's heads within (row i * g + j)
    qr = q.astype(mx.float32).reshape(h, g, n, d).transpose(0, 2, 1, 3)
    qr = qr.reshape(h, 1, n * g, d)
    sink = None
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(h, 1, g)
        sink = mx.broadcast_to(sink, (h, n, g)).reshape(h, n * g)
    out = _chunked(qr, kc, vc, mx.array(seen), scale, sink)
    return out.reshape(h, n, g, d).transpose(0, 2, 1, 3).reshape(hq, n, d).astype(dtype)


def reference(queries: mx.array, read: DecodeRead, scale: float,
              sinks: Optional[mx.array] = None) -> mx.array:
    """Decode attention in plain MLX ops, sequence by sequence (so a sequence's
    work has the same shapes whatever the batch): ``queries`` ``[B, Hq, n, D]``
    -> ``[B, Hq, n, D]`` in the queries' dtype. ``sinks``: GPT-OSS's
    per-head logit that joins every softmax's denominator. Any number of
    tokens, in blocks of whole ``MAX_QUERIES``: each token's answer is its own,
    so a prefill chunk's is the same bits as its tokens' one at a time."""
    b, hq, n, _ = check_queries(queries, read, most=1 << 30)
    outs: List[mx.array] = []
    for i, s in enumerate(read.sequences):
        parts = []
        # as many tokens at a time as keep the block's f32 scores near
        # REFERENCE_BLOCK_BYTES (whole MAX_QUERIES blocks): every token's rows of
        # the products are its own, whatever block it is in
        per_token = hq * (s.chunks(n, read.window)[1] + 1) * CHUNK * 4
        step = max(MAX_QUERIES, REFERENCE_BLOCK_BYTES // per_token // MAX_QUERIES * MAX_QUERIES)
        for lo in range(0, n, step):  # the block's keys end at its last token
            hi = min(n, lo + step)
            block = KeyRead(s.slot, s.end - (n - hi), s.held - (n - hi), s.origin, s.wrap)
            parts.append(_reference_one(queries[i, :, lo:hi], read.keys[s.slot],
                                        read.values[s.slot], block, read.window, scale, sinks,
                                        queries.dtype))
        outs.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1))
    return mx.stack(outs) if b > 1 else outs[0][None]


def kernel_params(sequences: Sequence[KeyRead], queries: int,
                  window: Optional[int]) -> Tuple[List[int], int]:
    """The kernels' per-sequence params (five int32 each: slot, end, held,
    origin, wrap) and the most chunks any sequence has (``KeyRead.chunks``,
    inline: every layer of every step asks, for every sequence)."""
    out: List[int] = []
    most = 1
    for s in sequences:
        end, held = s.end, s.held
        lo = end - held
        if window is not None and end - queries - window + 1 > lo:
            lo = end - queries - window + 1
        if lo < end and (end - 1) // CHUNK - lo // CHUNK + 1 > most:
            most = (end - 1) // CHUNK - lo // CHUNK + 1
        out += [s.slot, end, held, s.origin, s.wrap]
    return out, most


#: ``MUSER_KV_ATTENTION``: ``muser`` (the default) gives every muser-kv cache's
#: decode step this attention; ``mlx`` leaves it to MLX's
#: ``scaled_dot_product_attention`` with the caches' masks (for comparison).
ATTENTION_ENV = "MUSER_KV_ATTENTION"
ATTENTIONS = ("muser", "mlx")


def _from_env() -> str:
    name = os.environ.get(ATTENTION_ENV) or "muser"
    if name not in ATTENTIONS:
        raise ValueError(f"{ATTENTION_ENV} must be one of {ATTENTIONS}, got {name!r}")
    return name


_choice = [_from_env()]


def set_decode_attention(name: str) -> None:
    """Choose the decode attention of every muser-kv cache from now on (see
    ``ATTENTION_ENV``); ``muser`` by default."""
    if name not in ATTENTIONS:
        raise ValueError(f"decode attention must be one of {ATTENTIONS}, got {name!r}")
    _choice[0] = name


def decode_attention() -> str:
    """The decode attention chosen (``set_decode_attention``)."""
    return _choice[0]
