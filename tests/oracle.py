"""The seeds' CPU oracle, in numpy: not a ring. Full history per layer, f16
rows converted by numpy (round to nearest even), the window applied as a rule
over logical positions. Independent of MLX's conversion and of the Ring."""

from __future__ import annotations

import numpy as np
import mlx.core as mx


def to_f16_rows(x: mx.array) -> np.ndarray:
    """Model-shaped [1, H, N, D] -> numpy f16 [N, H, D] via f32 (exact for
    f16/bf16 inputs, one RNE rounding for f32)."""
    a = np.array(x.astype(mx.float32))[0].transpose(1, 0, 2)
    return a.astype(np.float16)


def bits(x) -> np.ndarray:
    """f16 contents as uint16, for bitwise comparison (NaN-safe, -0 != +0)."""
    a = np.array(x) if isinstance(x, mx.array) else np.asarray(x)
    assert a.dtype == np.float16, a.dtype
    return a.view(np.uint16)


class FullHistory:
    def __init__(self, window: int | None):
        self.window = window
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def append(self, k: mx.array, v: mx.array) -> None:
        self.keys.extend(to_f16_rows(k))
        self.values.extend(to_f16_rows(v))

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
        k = np.stack(self.keys[s:e]) if e > s else np.zeros(shape, np.float16)
        v = np.stack(self.values[s:e]) if e > s else np.zeros(shape, np.float16)
        return s, k, v

    def visible(self, query_position: int) -> range:
        lo = 0 if self.window is None else max(0, query_position - self.window + 1)
        return range(lo, query_position + 1)
