"""The kernels' edge cases: values where a conversion to a plane type is
delicate, and the K/V and planes built from them in every memory layout a
caller can hand over. ``muser-kv selftest`` runs the kernels on them on this
machine's GPU; the kernel tests (``tests/kernel_cases.py``) run them on the
host and the emulators. One set, so a case added here is checked everywhere."""

from __future__ import annotations

from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np

from muser_kv.core.kernels import TOKEN_MAJOR

# f32 values where the conversion to each plane type is delicate: ties to even
# for f16 and bf16, the largest finite f16 (both signs) and what rounds past
# it, f32's largest, f16 and bf16 subnormals, signed zeros, NaN, inf.
F32_EDGES = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8,
                      65504.0, -65504.0, 65519.0, 65520.0, -65520.0, 3.4e38, 2.0 ** -24,
                      2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -133, 1e-45, -0.0, 0.0, float("nan"),
                      -float("nan"), float("inf"), -float("inf")], np.float32)
# bit patterns of the 16-bit types: signed zeros, subnormals, the largest
# finite values, infinities, quiet and signalling NaNs with payloads, both signs
F16_EDGE_BITS = [0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x3C00, 0x3C01, 0x7BFF, 0xFBFF, 0x7C00,
                 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x7FFF, 0xFD01]
BF16_EDGE_BITS = [0x0000, 0x8000, 0x0001, 0x007F, 0x8001, 0x3F80, 0x3F81, 0x477F, 0x4780, 0x7F7F,
                  0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC0, 0x7FFF, 0xFFA1]
EDGE_BITS: Dict[mx.Dtype, List[int]] = {mx.float16: F16_EDGE_BITS, mx.bfloat16: BF16_EDGE_BITS}

#: (ring capacity, rows already live, origin, chunk) of a store: empty, no wrap,
#: wraps, full and wrapped, as wide as the ring, wider than it, a ring of 4
STORE_CASES: Tuple[Tuple[int, int, int, int], ...] = (
    (16, 0, 0, 5), (16, 14, 0, 5), (16, 16, 7, 3), (16, 16, 9, 16), (16, 5, 0, 37),
    (16, 16, 3, 40), (4, 3, 0, 1))
#: (capacity, live rows, origin) of a ring to gather from or install into
RING_STATES: Tuple[Tuple[int, int, int], ...] = (
    (16, 0, 0), (16, 5, 0), (16, 16, 0), (16, 16, 11), (16, 16, 37), (4, 1, 0))

#: the memory layouts of model-shaped K/V ``model_kv`` builds
LAYOUTS = ("contiguous", "strided", "broadcast", "offset", "reversed")


def edge_values(shape: Tuple[int, ...], dtype: mx.Dtype, seed: int = 0) -> mx.array:
    """Random values of ``dtype`` with its edge cases at every third element
    (f32 edges, or raw f16 / bf16 bit patterns: no conversion makes them)."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(shape) * 8).astype(np.float32)
    if dtype == mx.float32:
        flat = base.reshape(-1)
        flat[::3] = np.resize(F32_EDGES, flat[::3].size)
        return mx.array(base)
    bits = np.array(mx.array(base, mx.float32).astype(dtype).view(mx.uint16)).reshape(-1)
    bits[::3] = np.resize(np.array(EDGE_BITS[dtype], np.uint16), bits[::3].size)
    return mx.array(bits.reshape(shape)).view(dtype)


def model_kv(n: int, dtype: mx.Dtype, seed: int, layout: str, h: int, d: int) -> mx.array:
    """Model-shaped K or V ``[1, h, n, d]`` in one of ``LAYOUTS`` (none copied
    to contiguous, none evaluated):

    * contiguous: ``[1, h, n, d]`` row-major;
    * strided: the model's own case, a transposed view of ``[1, n, h, d]``;
    * broadcast: one token row broadcast along the tokens (stride 0);
    * offset: a slice of a longer chunk (a non-zero offset into the buffer);
    * reversed: the tokens in reverse (a negative stride)."""
    if layout not in LAYOUTS:
        raise ValueError(f"a K/V layout is one of {LAYOUTS}, got {layout!r}")
    if layout == "strided":
        return edge_values((1, n, h, d), dtype, seed).transpose(0, 2, 1, 3)
    if layout == "broadcast":
        return mx.broadcast_to(edge_values((1, h, 1, d), dtype, seed), (1, h, n, d))
    if layout == "offset":
        return edge_values((1, h, n + 3, d), dtype, seed)[:, :, 3:, :]
    if layout == "reversed":
        return edge_values((1, h, n, d), dtype, seed)[:, :, ::-1, :]
    return edge_values((1, h, n, d), dtype, seed)


def plane_buffer(layout: str, rows: int, plane: mx.Dtype, seed: int, h: int,
                 d: int) -> Tuple[mx.array, mx.array]:
    """A key and a value plane of ``rows`` allocated rows in ``layout``, with edge values."""
    shape = (rows, h * d) if layout == TOKEN_MAJOR else (h, rows, d)
    return edge_values(shape, plane, seed), edge_values(shape, plane, seed + 1)

#: (end, held, query tokens, window or 0, head_dim) of a decode attention the
#: selftest and the tests check: a short plane, one past a chunk, a wrapped
#: ring, a speculative block in a window, one of more than ``FOLD`` chunks
ATTENTION_CASES: Tuple[Tuple[int, int, int, int, int], ...] = (
    (1, 1, 1, 0, 128), (300, 300, 1, 0, 128), (5000, 256, 1, 256, 128), (600, 259, 4, 256, 128),
    (4500, 4500, 2, 0, 128), (777, 777, 3, 0, 64))
