"""The masks a cache hands attention, in mlx-lm's semantics: which keys each
query of a write sees (``causal_mask``), and that rule in attention's additive
form (``additive_mask``)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


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
    head first: for a 2,048-token chunk over a 4,095-row window that was 1.0 GiB
    of temporaries and 4.0 ms against 0.06 GiB and 1.05 ms (H200, bf16). Only
    for rows that always see a key (a sliding chunk sees itself): a fully masked
    row, or a NaN key, would need the bool form's select."""
    return mx.where(mask, mx.array(0, dtype), mx.array(-float("inf"), dtype))
