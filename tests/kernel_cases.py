"""Inputs shared by the kernel tests: ring states that do and do not wrap,
chunks wider than the ring, K/V in every dtype and memory layout the model can
hand over, planes of either type, and values where conversion is delicate."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from muser_kv import Ring
from muser_kv.core.geometry import allocated_rows
from muser_kv.core.kernels import TOKEN_MAJOR

H, D = 2, 128
KV = H * D
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
PLANES = {"float16": mx.float16, "bfloat16": mx.bfloat16}

# (ring capacity, rows already live, origin, chunk): no wrap, wrap, wider than the ring
CASES = [(16, 0, 0, 5), (16, 14, 0, 5), (16, 16, 7, 3), (16, 16, 9, 16), (16, 5, 0, 37),
         (16, 16, 3, 40)]
# (capacity, len, origin_logical) of a ring to snapshot / install
RING_STATES = [(16, 0, 0), (16, 5, 0), (16, 16, 0), (16, 16, 11), (16, 16, 37)]
# a plane allocates whole granules of rows past its ring's capacity (geometry.ROW_GRANULE)
ROWS = {"exact": lambda c: c, "padded": allocated_rows}

# f32 values where the conversion to each plane type is delicate: ties to even,
# the largest finite values and overflow, subnormals, signed zero, NaN, inf.
EDGES = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 65504.0,
                  65519.0, 65520.0, -65520.0, 3.4e38, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25,
                  2.0 ** -133, 1e-45, -0.0, 0.0, float("nan"), -float("nan"), float("inf"),
                  -float("inf")], np.float32)
# bit patterns of the 16-bit types: signed zeros, subnormals, the largest
# finite values, infinities, quiet and signalling NaNs with payloads, both signs
F16_EDGE_BITS = [0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x3C00, 0x3C01, 0x7BFF, 0xFBFF, 0x7C00,
                 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x7FFF, 0xFD01]
BF16_EDGE_BITS = [0x0000, 0x8000, 0x0001, 0x007F, 0x8001, 0x3F80, 0x3F81, 0x477F, 0x4780, 0x7F7F,
                  0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC0, 0x7FFF, 0xFFA1]


def bits16(x) -> np.ndarray:
    """A 16-bit MLX array's (or numpy array's) elements as uint16 patterns."""
    if isinstance(x, mx.array):
        return np.array(x.view(mx.uint16))
    return np.asarray(x).view(np.uint16)


def ring(capacity: int, length: int, origin: int) -> Ring:
    return Ring(capacity, length, origin, origin % capacity)


def edge_values(shape, dtype: mx.Dtype, seed: int = 0) -> mx.array:
    """Random values of ``dtype`` with every edge case of that dtype sprinkled in
    (f32 edges, or raw f16 / bf16 bit patterns: no conversion makes them)."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(shape) * 8).astype(np.float32)
    if dtype == mx.float32:
        flat = base.reshape(-1)
        flat[::3] = np.resize(EDGES, flat[::3].size)
        return mx.array(base)
    pattern = F16_EDGE_BITS if dtype == mx.float16 else BF16_EDGE_BITS
    bits = np.array(mx.array(base).astype(dtype).view(mx.uint16))
    flat = bits.reshape(-1)
    flat[::3] = np.resize(np.array(pattern, np.uint16), flat[::3].size)
    return mx.array(bits).view(dtype)


LAYOUTS = ("contiguous", "strided", "broadcast", "offset", "reversed")


def model_kv(n: int, dtype: mx.Dtype, seed: int, layout: str, h: int = H, d: int = D) -> mx.array:
    """Model-shaped K or V ``[1, h, n, d]`` in one of the memory layouts a
    caller can hand over (all evaluated, none copied to contiguous):

    * contiguous: ``[1, h, n, d]`` row-major;
    * strided: the model's own case, a transposed view of ``[1, n, h, d]``;
    * broadcast: one token row broadcast along the tokens (stride 0);
    * offset: a slice of a longer chunk (a non-zero offset into the buffer);
    * reversed: the tokens in reverse (a negative stride)."""
    if layout == "strided":
        x = edge_values((1, n, h, d), dtype, seed).transpose(0, 2, 1, 3)
    elif layout == "broadcast":
        x = mx.broadcast_to(edge_values((1, h, 1, d), dtype, seed), (1, h, n, d))
    elif layout == "offset":
        x = edge_values((1, h, n + 3, d), dtype, seed)[:, :, 3:, :]
    elif layout == "reversed":
        x = edge_values((1, h, n, d), dtype, seed)[:, :, ::-1, :]
    else:
        x = edge_values((1, h, n, d), dtype, seed)
    mx.eval(x)
    return x


def plane_buffer(layout: str, rows: int, plane: mx.Dtype, seed: int, h: int = H, d: int = D):
    """A key and a value plane of ``rows`` allocated rows with edge values."""
    shape = (rows, h * d) if layout == TOKEN_MAJOR else (h, rows, d)
    k, v = edge_values(shape, plane, seed), edge_values(shape, plane, seed + 1)
    mx.eval(k, v)
    return k, v
