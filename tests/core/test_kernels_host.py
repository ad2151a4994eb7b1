"""CI executes every kernel body: the real source text, compiled by g++ behind
the host prelude, compared bitwise with the MLX reference path for both
layouts, wrap and no wrap, a chunk wider than the ring, every input dtype and
non-contiguous inputs. The reference runs on MLX's CPU stream whatever the
default device: the host header models MLX's CPU conversions, and a GPU
converts NaN payloads its own way (``muser-kv selftest`` compares the GPU's
kernels with the GPU's reference there)."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from host_kernels import HostKernels, geometry_params
from kernel_cases import CASES, EDGES, PLANES, ROWS, edge_values

from muser_kv import Ring
from muser_kv.core.geometry import allocated_rows
from muser_kv.core.kernels import HEAD_MAJOR, TOKEN_MAJOR, ReferenceBackend

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (CI has it)")

H, D = 2, 128
KV = H * D
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
REF = ReferenceBackend()


@pytest.fixture(scope="module")
def host():
    return HostKernels()


@pytest.fixture(autouse=True)
def reference_on_the_cpu():
    with mx.stream(mx.cpu):
        yield


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


def zeros_like_host(shape, plane: str) -> np.ndarray:
    """A host output buffer for a plane type, pre-filled with a non-zero pattern."""
    return np.full(shape, 0x7777, np.uint16)


def plane_buffer(layout, capacity, rows, plane, seed):
    """A random plane of ``rows`` allocated rows (rows past ``capacity`` are never read)."""
    rng = np.random.default_rng(seed)
    shape = (rows, KV) if layout == TOKEN_MAJOR else (H, rows, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(PLANES[plane]),
            mx.array(rng.standard_normal(shape).astype(np.float32)).astype(PLANES[plane]))


@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transposed", [False, True], ids=["contig", "strided"])
def test_batch_store(host, plane, dtype, layout, case, transposed):
    capacity, length, origin, n = case
    ring = Ring(capacity, length, origin, origin % capacity)
    start = ring.end
    first, count = ring.append_batch(start, n)
    (k, hk, ks), (v, hv, vs) = model_kv(n, dtype, seed=n + length, transposed=transposed)
    ref_k, ref_v = REF.store(k, v, layout, first, count, dtype=PLANES[plane])
    mx.eval(ref_k, ref_v)
    assert ref_k.dtype == PLANES[plane]
    shape = tuple(ref_k.shape)
    out_k, out_v = zeros_like_host(shape, plane), zeros_like_host(shape, plane)
    dest = np.full(count, -1, np.int32)
    params = np.array([first, count, start, ring.capacity, ring.origin_logical,
                       ring.origin_physical, *geometry_params(H, D, layout == HEAD_MAJOR)],
                      np.int32)
    host.call("batch_store", dtype, [hk, ks, hv, vs, params, out_k, out_v, dest], count * KV,
              plane=plane)
    np.testing.assert_array_equal(out_k, bits16(to_host(ref_k)))
    np.testing.assert_array_equal(out_v, bits16(to_host(ref_v)))
    expect = [ring.physical(start + first + j) for j in range(count)]
    np.testing.assert_array_equal(dest, expect)


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("case", CASES)
def test_stage(host, rows, plane, dtype, layout, case):
    capacity, length, origin, n = case
    ring = Ring(capacity, length, origin, origin % capacity)
    allocated = ROWS[rows](capacity)
    plane_k, plane_v = plane_buffer(layout, capacity, allocated, plane, seed=length)
    (k, hk, ks), (v, hv, vs) = model_kv(n, dtype, seed=3, transposed=True)
    ref_k, ref_v = REF.stage(plane_k, plane_v, ring, k, v, layout)
    mx.eval(ref_k, ref_v)
    assert ref_k.dtype == PLANES[plane]
    out_k, out_v = zeros_like_host(ref_k.shape, plane), zeros_like_host(ref_v.shape, plane)
    params = np.array([ring.len, ring.origin_physical, ring.capacity, n, allocated,
                       *geometry_params(H, D, layout == HEAD_MAJOR)], np.int32)
    host.call("stage", dtype,
              [to_host(plane_k), to_host(plane_v), hk, ks, hv, vs, params, out_k, out_v],
              (ring.len + n) * KV, plane=plane)
    np.testing.assert_array_equal(out_k, bits16(to_host(ref_k)))
    np.testing.assert_array_equal(out_v, bits16(to_host(ref_v)))


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("ring_state", [(16, 0, 0), (16, 5, 0), (16, 16, 0), (16, 16, 11), (16, 16, 37)])
def test_gather_and_install(host, rows, plane, layout, ring_state):
    capacity, length, origin = ring_state
    ring = Ring(capacity, length, origin, origin % capacity)
    allocated = ROWS[rows](capacity)
    pk, pv = plane_buffer(layout, capacity, allocated, plane, seed=length + origin)
    ref_k, ref_v = REF.gather(pk, pv, layout, ring)
    mx.eval(ref_k, ref_v)
    out_k, out_v = zeros_like_host((length, KV), plane), zeros_like_host((length, KV), plane)
    params = np.array([ring.len, ring.origin_physical, ring.capacity, allocated,
                       *geometry_params(H, D, layout == HEAD_MAJOR)], np.int32)
    host.call("gather", plane, [to_host(pk), to_host(pv), params, out_k, out_v], length * KV,
              plane=plane)
    np.testing.assert_array_equal(out_k, bits16(to_host(ref_k)))
    np.testing.assert_array_equal(out_v, bits16(to_host(ref_v)))

    # install the gathered rows back: a fresh plane, rows at the same rotation, zeros elsewhere
    # (the allocation's padding rows included)
    shape = tuple(pk.shape)
    ik, iv = REF.install(ref_k, ref_v, layout, ring, shape)
    mx.eval(ik, iv)
    assert ik.dtype == PLANES[plane]
    hk, hv = zeros_like_host(shape, plane), zeros_like_host(shape, plane)  # every element written
    host.call("install", plane, [to_host(ref_k), to_host(ref_v), params, hk, hv], allocated * KV,
              plane=plane)
    np.testing.assert_array_equal(hk, bits16(to_host(ik)))
    np.testing.assert_array_equal(hv, bits16(to_host(iv)))
    # and the live rows of the installed plane equal the original plane's, where they sat
    original = bits16(to_host(pk))
    for pos in range(ring.origin_logical, ring.end):
        r = ring.physical(pos)
        a = original[r] if layout == TOKEN_MAJOR else original[:, r]
        b = hk[r] if layout == TOKEN_MAJOR else hk[:, r]
        np.testing.assert_array_equal(a, b)
    padding = hk[capacity:] if layout == TOKEN_MAJOR else hk[:, capacity:]
    assert not padding.any()


@pytest.mark.parametrize("plane", list(PLANES))
def test_conversion_edges_match_mlx(host, plane):
    """One conversion, every backend: the host kernel rounds the edge cases to the
    plane type exactly as MLX's own CPU astype does (the host header models MLX's
    CPU conversions; a GPU converts NaN its own way, on both of its paths, which
    ``muser-kv selftest`` compares there)."""
    n = 8
    a = np.resize(EDGES, (1, H, n, D)).astype(np.float32)
    k = mx.array(a)
    with mx.stream(mx.cpu):
        ref_k, _ = REF.store(k, k, TOKEN_MAJOR, 0, n, dtype=PLANES[plane])
        mx.eval(ref_k)
    out_k, out_v = zeros_like_host((n, KV), plane), zeros_like_host((n, KV), plane)
    strides = np.array([H * n * D, n * D, D, 1], np.int64)
    params = np.array([0, n, 0, n, 0, 0, *geometry_params(H, D, False)], np.int32)
    host.call("batch_store", "float32",
              [a, strides, a, strides, params, out_k, out_v, np.zeros(n, np.int32)], n * KV,
              plane=plane)
    np.testing.assert_array_equal(out_k, bits16(to_host(ref_k)))


@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("kernel", ["batch_store", "stage"])
def test_input_of_the_plane_type_is_copied(host, kernel, plane):
    """K/V already of the plane type keep their bits, NaN payloads included, as
    MLX's astype keeps them; a round trip through f32 would not (MLX's CPU, like
    a GPU, writes back the NaN of its choice)."""
    n, dtype = 6, PLANES[plane]
    k = edge_values((1, H, n, D), dtype, seed=1)
    hk = to_host(k)
    strides = np.array([H * n * D, n * D, D, 1], np.int64)
    out_k, out_v = zeros_like_host((n, KV), plane), zeros_like_host((n, KV), plane)
    if kernel == "batch_store":
        params = np.array([0, n, 0, n, 0, 0, *geometry_params(H, D, False)], np.int32)
        args = [hk, strides, hk, strides, params, out_k, out_v, np.zeros(n, np.int32)]
    else:
        empty = np.zeros((16, KV), np.uint16)
        params = np.array([0, 0, 16, n, 16, *geometry_params(H, D, False)], np.int32)
        args = [empty, empty, hk, strides, hk, strides, params, out_k, out_v]
    host.call(kernel, plane, args, n * KV, plane=plane)
    expect = bits16(to_host(k)[0].transpose(1, 0, 2).reshape(n, KV))
    np.testing.assert_array_equal(out_k, expect)
    np.testing.assert_array_equal(out_v, expect)


# Head geometry and layout are runtime values (the last three params): the one
# library built for the types serves every geometry, both layouts.
OTHER_GEOMETRIES = [(1, 4), (4, 32), (3, 8)]


def test_one_function_per_kernel_and_type_pair(host):
    """16 functions: batch_store and stage 3 input types x 2 plane types, gather
    and install 2 plane types; no geometry or layout among what is compiled."""
    assert len(host.funcs) == 16
    assert sorted({k[0] for k in host.funcs}) == ["batch_store", "gather", "install", "stage"]


@pytest.mark.parametrize("plane", list(PLANES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", [TOKEN_MAJOR, HEAD_MAJOR])
@pytest.mark.parametrize("geometry", OTHER_GEOMETRIES, ids=lambda g: f"H{g[0]}xD{g[1]}")
def test_every_kernel_at_other_geometries(host, geometry, layout, dtype, plane):
    h, d = geometry
    kv, hm, p = h * d, layout == HEAD_MAJOR, PLANES[plane]
    geo = geometry_params(h, d, hm)
    capacity, length, origin, n = 8, 7, 5, 4  # the chunk wraps the ring
    r = Ring(capacity, length, origin, origin % capacity)
    start = r.end
    first, count = r.append_batch(start, n)
    k = edge_values((1, h, n, d), DTYPES[dtype], seed=h + d)
    v = edge_values((1, h, n, d), DTYPES[dtype], seed=h + d + 1)
    strides = np.array([h * n * d, n * d, d, 1], np.int64)
    hk, hv = to_host(k), to_host(v)

    ref_k, ref_v = REF.store(k, v, layout, first, count, dtype=p)
    out_k, out_v = zeros_like_host(ref_k.shape, plane), zeros_like_host(ref_v.shape, plane)
    dest = np.full(count, -1, np.int32)
    params = np.array([first, count, start, r.capacity, r.origin_logical, r.origin_physical,
                       *geo], np.int32)
    host.call("batch_store", dtype, [hk, strides, hv, strides, params, out_k, out_v, dest],
              count * kv, plane=plane)
    np.testing.assert_array_equal(out_k, bits16(to_host(ref_k)))
    np.testing.assert_array_equal(out_v, bits16(to_host(ref_v)))
    np.testing.assert_array_equal(dest, [r.physical(start + first + j) for j in range(count)])

    live = Ring(capacity, length, origin, origin % capacity)
    rows = allocated_rows(capacity)
    shape = (rows, kv) if layout == TOKEN_MAJOR else (h, rows, d)
    pk, pv = edge_values(shape, p, seed=3), edge_values(shape, p, seed=4)
    ref_k, ref_v = REF.stage(pk, pv, live, k, v, layout)
    out_k, out_v = zeros_like_host(ref_k.shape, plane), zeros_like_host(ref_v.shape, plane)
    params = np.array([live.len, live.origin_physical, live.capacity, n, rows, *geo], np.int32)
    host.call("stage", dtype, [to_host(pk), to_host(pv), hk, strides, hv, strides, params,
                               out_k, out_v], (live.len + n) * kv, plane=plane)
    np.testing.assert_array_equal(out_k, bits16(to_host(ref_k)))
    np.testing.assert_array_equal(out_v, bits16(to_host(ref_v)))

    if dtype != plane:
        return  # gather and install read planes only: once per plane type
    # the backend hands a token-major plane over as one head of kv_dim (kernels.py)
    plane_geo = geo if hm else geometry_params(1, kv, False)
    ref_k, ref_v = REF.gather(pk, pv, layout, live)
    out_k, out_v = zeros_like_host(ref_k.shape, plane), zeros_like_host(ref_v.shape, plane)
    params = np.array([live.len, live.origin_physical, live.capacity, rows, *plane_geo], np.int32)
    host.call("gather", plane, [to_host(pk), to_host(pv), params, out_k, out_v], live.len * kv,
              plane=plane)
    np.testing.assert_array_equal(out_k, bits16(to_host(ref_k)))
    np.testing.assert_array_equal(out_v, bits16(to_host(ref_v)))
    ik, iv = REF.install(ref_k, ref_v, layout, live, shape)
    out_k, out_v = zeros_like_host(shape, plane), zeros_like_host(shape, plane)
    host.call("install", plane, [to_host(ref_k), to_host(ref_v), params, out_k, out_v],
              rows * kv, plane=plane)
    np.testing.assert_array_equal(out_k, bits16(to_host(ik)))
    np.testing.assert_array_equal(out_v, bits16(to_host(iv)))
