"""How rows move: the data path between the model's K/V and the planes.

Every function here is a copy plus one f32/bf16 -> f16 conversion (round to
nearest even), so every backend that implements it must give the same bits.
Positions never reach this module: the ring hands over physical runs, and the
functions move the rows they are told to move.

This is the pure-MLX reference path. It runs on every MLX backend (CPU, Metal,
CUDA) and is the oracle the custom kernels are compared against bitwise.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .ring import Run

PLANE_DTYPE = mx.float16
INPUT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

TOKEN_MAJOR = "token_major"
HEAD_MAJOR = "head_major"


def to_layout(x: mx.array, layout: str, first: int = 0) -> mx.array:
    """Model-shaped ``[1, H, N, D]`` K or V -> f16 rows in the plane's layout,
    dropping the first ``first`` source rows (a chunk wider than the ring).

    Token-major rows are ``[N, H * D]`` (one token's heads adjacent); head-major
    rows are ``[H, N, D]`` (one head's tokens adjacent).
    """
    if first:
        x = x[:, :, first:, :]
    x = x.astype(PLANE_DTYPE)
    if layout == TOKEN_MAJOR:
        _, h, n, d = x.shape
        return x[0].transpose(1, 0, 2).reshape(n, h * d)
    return x[0]


def place(plane: mx.array, rows: mx.array, runs: Sequence[Run], layout: str) -> None:
    """Write ``rows`` (already in the plane's layout) into ``plane`` along ``runs``.

    This is the one placement mechanism of a plane. It uses MLX's slice update,
    which reuses the plane's buffer when MLX can donate it (O(rows)) and copies
    it otherwise; it never writes memory MLX does not know about.
    """
    for run in runs:
        src = slice(run.source, run.source + run.length)
        dst = slice(run.physical, run.physical + run.length)
        if layout == TOKEN_MAJOR:
            plane[dst] = rows[src]
        else:
            plane[:, dst, :] = rows[:, src, :]


def gather(plane: mx.array, runs: Sequence[Run], layout: str) -> mx.array:
    """Rows along ``runs``, concatenated in run order, in the plane's layout."""
    parts = []
    for run in runs:
        dst = slice(run.physical, run.physical + run.length)
        parts.append(plane[dst] if layout == TOKEN_MAJOR else plane[:, dst, :])
    if not parts:
        return plane[:0] if layout == TOKEN_MAJOR else plane[:, :0, :]
    if len(parts) == 1:
        return parts[0]
    return mx.concatenate(parts, axis=0 if layout == TOKEN_MAJOR else 1)


def stage(old: mx.array, new: mx.array, layout: str) -> mx.array:
    """The staging shadow: old rows (logical order) followed by the chunk's rows,
    one contiguous span that attention reads before the chunk is committed."""
    return mx.concatenate([old, new], axis=0 if layout == TOKEN_MAJOR else 1)


def attention_view(rows: mx.array, layout: str, kv_heads: int, head_dim: int) -> mx.array:
    """Rows in either layout as the ``[1, H, L, D]`` view attention reads.

    Token-major rows become a strided view (strides ``L*H*D, D, H*D, 1``) that
    ``scaled_dot_product_attention`` reads without a copy."""
    if layout == TOKEN_MAJOR:
        n = rows.shape[0]
        return rows.reshape(1, n, kv_heads, head_dim).transpose(0, 2, 1, 3)
    return rows[None]


def to_logical(rows: mx.array, layout: str, kv_heads: int, head_dim: int) -> mx.array:
    """Rows in either layout -> the interchange shape ``[n, H, D]`` (token order)."""
    if layout == TOKEN_MAJOR:
        return rows.reshape(rows.shape[0], kv_heads, head_dim)
    return rows.transpose(1, 0, 2)


def from_logical(rows: mx.array, layout: str) -> mx.array:
    """Interchange ``[n, H, D]`` f16 rows -> the plane's layout."""
    if layout == TOKEN_MAJOR:
        return rows.reshape(rows.shape[0], -1)
    return rows.transpose(1, 0, 2)
