"""A CPU oracle, in numpy: not a ring. Full history per layer, rows
converted by numpy (f16: numpy's own round to nearest even; bf16: the bit rule
below), the window applied as a rule over logical positions. Independent of
MLX's conversion and of the Ring."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def to_f16_rows(x: mx.array) -> np.ndarray:
    """Model-shaped [1, H, N, D] -> numpy f16 [N, H, D] via f32 (exact for
    f16/bf16 inputs, one RNE rounding for f32)."""
    a = np.array(x.astype(mx.float32))[0].transpose(1, 0, 2)
    return a.astype(np.float16)


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bit patterns (uint16), round to nearest even, NaN -> 0x7FC0."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FC0), rounded)


def to_bf16_rows(x: mx.array) -> np.ndarray:
    """Model-shaped [1, H, N, D] -> bf16 bit patterns [N, H, D] (uint16)."""
    return f32_to_bf16_bits(np.array(x.astype(mx.float32))[0].transpose(1, 0, 2))


def bits(x) -> np.ndarray:
    """f16 contents as uint16, for bitwise comparison (NaN-safe, -0 != +0)."""
    a = np.array(x) if isinstance(x, mx.array) else np.asarray(x)
    assert a.dtype == np.float16, a.dtype
    return a.view(np.uint16)


def bits16(x) -> np.ndarray:
    """The uint16 patterns of f16 or bf16 contents (an MLX array or f16 numpy)."""
    if isinstance(x, mx.array):
        assert x.dtype in (mx.float16, mx.bfloat16), x.dtype
        return np.array(x.view(mx.uint16))
    a = np.asarray(x)
    assert a.dtype in (np.float16, np.uint16), a.dtype
    return a.view(np.uint16)


def copy_array(x: mx.array) -> mx.array:
    """A deep copy (new buffer, same bits) of an f16 / bf16 / f32 array."""
    if x.dtype == mx.bfloat16:
        return mx.array(np.array(x.view(mx.uint16))).view(mx.bfloat16)
    return mx.array(np.array(x))


class FullHistory:
    def __init__(self, window: int | None, dtype: mx.Dtype = mx.float16):
        self.window = window
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self._rows = to_bf16_rows if dtype == mx.bfloat16 else to_f16_rows

    def append(self, k: mx.array, v: mx.array) -> None:
        self.keys.extend(self._rows(k))
        self.values.extend(self._rows(v))

    @property
    def position(self) -> int:
        return len(self.keys)

    def live_range(self) -> tuple[int, int]:
        """Logical [start, end) a cache must hold: the window's tail for a
        sliding layer, everything for a global one."""
        end = self.position
        start = 0 if self.window is None else max(0, end - self.window)
        return start, end

    def live(self) -> tuple[int, np.ndarray, np.ndarray]:
        s, e = self.live_range()
        shape = (0,) + (self.keys[0].shape if self.keys else (0, 0))
        dtype = self.keys[0].dtype if self.keys else np.float16
        k = np.stack(self.keys[s:e]) if e > s else np.zeros(shape, dtype)
        v = np.stack(self.values[s:e]) if e > s else np.zeros(shape, dtype)
        return s, k, v

    def visible(self, query_position: int) -> range:
        lo = 0 if self.window is None else max(0, query_position - self.window + 1)
        return range(lo, query_position + 1)
