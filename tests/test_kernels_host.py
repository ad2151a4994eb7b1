"""CI executes every kernel body: the real source text, compiled by g++ behind
the host prelude, compared bitwise with the MLX reference path for both
layouts, wrap and no wrap, a chunk wider than the ring, every input dtype and
non-contiguous inputs."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from muser_kv import Ring
from muser_kv.kernels import HEAD_MAJOR, TOKEN_MAJOR, ReferenceBackend
from host_kernels import HostKernels

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (CI has it)")

H, D = 2, 128
KV = H * D
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
REF = ReferenceBackend()


@pytest.fixture(scope="module")
def host():
    return HostKernels(H, D)


def to_host(x: mx.array) -> np.ndarray:
    """MLX array -> numpy with the same bits (bf16 as uint16 patterns)."""
    if x.dtype == mx.bfloat16:
        return np.array(x.view(mx.uint16))
    return np.array(x)


def model_kv(n, dtype, seed, transposed):
    """K and V as ``(mlx [1, H, n, D], host buffer, element strides)``.

    transposed=True is the model's own case: a strided view of ``[1, n, H, D]``
    (the kernels read it through ``key_strides``, no copy)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        # values over many binades, with exact f16 rounding ties sprinkled in
        a = (rng.standard_normal((1, n, H, D)) * 8).astype(np.float32)
        a.flat[::7] = 1 + 2.0 ** -11
        base = mx.array(a).astype(DTYPES[dtype])  # [1, n, H, D]
        if transposed:
            x = base.transpose(0, 2, 1, 3)
            host, strides = to_host(base), [n * H * D, D, H * D, 1]
        else:
            x = mx.contiguous(base.transpose(0, 2, 1, 3))
            host, strides = to_host(x), [H * n * D, n * D, D, 1]
        out.append((x, np.ascontiguousarray(host), np.array(strides, np.int64)))
    return out


def bits16(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16)


CASES = [  # (ring capacity, rows already live, origin, chunk): no wrap, wrap, wider than ring
    (16, 0, 0, 5), (16, 14, 0, 5), (16, 16, 7, 3), (16, 16, 9, 16), (16, 5, 0, 37), (16, 16, 3, 40),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transposed", [False, True], ids=["contig", "strided"])
def test_batch_store(host, dtype, layout, case, transposed):
    capacity, length, origin, n = case
    ring = Ring(capacity, length, origin, origin % capacity)
    start = ring.end
    first, count = ring.append_batch(start, n)
    (k, hk, ks), (v, hv, vs) = model_kv(n, dtype, seed=n + length, transposed=transposed)
    ref_k, ref_v = REF.store(k, v, layout, first, count)
    mx.eval(ref_k, ref_v)
    shape = tuple(ref_k.shape)
    out_k = np.zeros(shape, np.float16)
    out_v = np.zeros(shape, np.float16)
    dest = np.full(count, -1, np.int32)
    params = np.array([first, count, start, ring.capacity, ring.origin_logical,
                       ring.origin_physical], np.int32)
    host.call("batch_store", dtype, layout == HEAD_MAJOR,
              [hk, ks, hv, vs, params, out_k, out_v, dest], count * KV)
    np.testing.assert_array_equal(bits16(out_k), bits16(np.array(ref_k)))
    np.testing.assert_array_equal(bits16(out_v), bits16(np.array(ref_v)))
    expect = [ring.physical(start + first + j) for j in range(count)]
    np.testing.assert_array_equal(dest, expect)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("case", CASES)
def test_stage(host, dtype, layout, case):
    capacity, length, origin, n = case
    rng = np.random.default_rng(length)
    ring = Ring(capacity, length, origin, origin % capacity)
    shape = (capacity, KV) if layout == TOKEN_MAJOR else (H, capacity, D)
    plane_k = mx.array(rng.standard_normal(shape).astype(np.float16))
    plane_v = mx.array(rng.standard_normal(shape).astype(np.float16))
    (k, hk, ks), (v, hv, vs) = model_kv(n, dtype, seed=3, transposed=True)
    ref_k, ref_v = REF.stage(plane_k, plane_v, ring, k, v, layout)
    mx.eval(ref_k, ref_v)
    out_k = np.zeros(ref_k.shape, np.float16)
    out_v = np.zeros(ref_v.shape, np.float16)
    params = np.array([ring.len, ring.origin_physical, ring.capacity, n], np.int32)
    host.call("stage", dtype, layout == HEAD_MAJOR,
              [np.array(plane_k), np.array(plane_v), hk, ks, hv, vs, params, out_k, out_v],
              (ring.len + n) * KV)
    np.testing.assert_array_equal(bits16(out_k), bits16(np.array(ref_k)))
    np.testing.assert_array_equal(bits16(out_v), bits16(np.array(ref_v)))


def _plane(layout, capacity, seed):
    rng = np.random.default_rng(seed)
    shape = (capacity, KV) if layout == TOKEN_MAJOR else (H, capacity, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float16)),
            mx.array(rng.standard_normal(shape).astype(np.float16)))


@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("ring_state", [(16, 0, 0), (16, 5, 0), (16, 16, 0), (16, 16, 11), (16, 16, 37)])
def test_gather_and_install(host, layout, ring_state):
    capacity, length, origin = ring_state
    ring = Ring(capacity, length, origin, origin % capacity)
    pk, pv = _plane(layout, capacity, seed=length + origin)
    ref_k, ref_v = REF.gather(pk, pv, layout, ring)
    mx.eval(ref_k, ref_v)
    out_k = np.zeros((length, KV), np.float16)
    out_v = np.zeros((length, KV), np.float16)
    params = np.array([ring.len, ring.origin_physical, ring.capacity], np.int32)
    host.call("gather", "float16", layout == HEAD_MAJOR,
              [np.array(pk), np.array(pv), params, out_k, out_v], length * KV)
    np.testing.assert_array_equal(bits16(out_k), bits16(np.array(ref_k)))
    np.testing.assert_array_equal(bits16(out_v), bits16(np.array(ref_v)))

    # install the gathered rows back: a fresh plane, rows at the same rotation, zeros elsewhere
    shape = tuple(pk.shape)
    ik, iv = REF.install(ref_k, ref_v, layout, ring, shape)
    mx.eval(ik, iv)
    hk = np.full(shape, np.float16(7), np.float16)  # the kernel must write every element
    hv = np.full(shape, np.float16(7), np.float16)
    host.call("install", "float16", layout == HEAD_MAJOR,
              [np.array(ref_k), np.array(ref_v), params, hk, hv], capacity * KV)
    np.testing.assert_array_equal(bits16(hk), bits16(np.array(ik)))
    np.testing.assert_array_equal(bits16(hv), bits16(np.array(iv)))
    # and the live rows of the installed plane equal the original plane's, where they sat
    for pos in range(ring.origin_logical, ring.end):
        r = ring.physical(pos)
        a = np.array(pk)[r] if layout == TOKEN_MAJOR else np.array(pk)[:, r]
        b = hk[r] if layout == TOKEN_MAJOR else hk[:, r]
        np.testing.assert_array_equal(bits16(a), bits16(b))
