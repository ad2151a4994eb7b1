"""Inputs shared by the kernel tests: ring states that do and do not wrap,
chunks wider than the ring, K/V in every dtype and memory layout the model can
hand over, planes of either type, and values where conversion is delicate."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from muser_kv import Ring
from muser_kv.core import kernel_cases
from muser_kv.core.geometry import allocated_rows

H, D = 2, 128
KV = H * D
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
PLANES = {"float16": mx.float16, "bfloat16": mx.bfloat16}

# the stores and ring states the selftest checks on a GPU (muser_kv.core.kernel_cases)
CASES = list(kernel_cases.STORE_CASES)
RING_STATES = list(kernel_cases.RING_STATES)
# a plane allocates whole granules of rows past its ring's capacity (geometry.ROW_GRANULE)
ROWS = {"exact": lambda c: c, "padded": allocated_rows}

# the kernels' edge values and the K/V and planes built from them are the
# package's (muser_kv.core.kernel_cases): the selftest checks the same ones on a GPU
EDGES = kernel_cases.F32_EDGES
F16_EDGE_BITS = kernel_cases.F16_EDGE_BITS
BF16_EDGE_BITS = kernel_cases.BF16_EDGE_BITS
LAYOUTS = kernel_cases.LAYOUTS
edge_values = kernel_cases.edge_values


def bits16(x) -> np.ndarray:
    """A 16-bit MLX array's (or numpy array's) elements as uint16 patterns."""
    if isinstance(x, mx.array):
        return np.array(x.view(mx.uint16))
    return np.asarray(x).view(np.uint16)


def ring(capacity: int, length: int, origin: int) -> Ring:
    return Ring(capacity, length, origin, origin % capacity)


def model_kv(n: int, dtype: mx.Dtype, seed: int, layout: str, h: int = H, d: int = D) -> mx.array:
    """``kernel_cases.model_kv`` evaluated: model-shaped K or V ``[1, h, n, d]``
    in one of ``LAYOUTS``."""
    x = kernel_cases.model_kv(n, dtype, seed, layout, h, d)
    mx.eval(x)
    return x


def plane_buffer(layout: str, rows: int, plane: mx.Dtype, seed: int, h: int = H, d: int = D):
    """A key and a value plane of ``rows`` allocated rows with edge values."""
    k, v = kernel_cases.plane_buffer(layout, rows, plane, seed, h, d)
    mx.eval(k, v)
    return k, v
