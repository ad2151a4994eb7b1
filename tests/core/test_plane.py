"""One layer's cache, driven through the public API: allocation, placement
across the wrap, fail-closed validation, logical snapshots and
rotation-preserving install, bitwise against the oracle."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import D, H, kv
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import FullHistory, bits

from muser_kv import (
    CacheDiscontinuity,
    ContextOverflow,
    LayerKind,
    MuseGeometry,
    MuseKVCache,
    make_cache_for,
)


def plane(kind, window=8, max_context=64, layer=0, layout="token_major") -> MuseKVCache:
    """One layer of ``kind``, a list of its own (so it is driven alone)."""
    geometry = MuseGeometry(num_layers=1, window=window, max_context=max_context, num_heads=H,
                            kv_heads=H, head_dim=D, layer_kinds=(kind,))
    cache = make_cache_for(geometry, sliding_layout=layout)[0]
    cache.layer = layer
    cache.ring.layer = layer
    return cache


def snapshot_equals(p: MuseKVCache, oracle: FullHistory):
    start, k, v = p.snapshot()
    s, ok, ov = oracle.live()
    assert start == s
    assert k.shape == ok.shape and v.shape == ov.shape
    np.testing.assert_array_equal(bits(k), bits(ok))
    np.testing.assert_array_equal(bits(v), bits(ov))


def physical_equals(p: MuseKVCache, oracle: FullHistory):
    """Every live position sits at ring.physical(position), in the plane's layout."""
    keys = np.array(p.keys)
    s, e = oracle.live_range()
    for pos in range(s, e):
        row = p.ring.physical(pos)
        got = keys[row].reshape(H, D) if p.layout == "token_major" else keys[:, row, :]
        np.testing.assert_array_equal(bits(got), bits(oracle.keys[pos]))


@pytest.mark.parametrize("kind,capacity,shape", [(LayerKind.SLIDING, 8, (256, 256)),
                                                 (LayerKind.GLOBAL, 64, (2, 256, 128))])
def test_allocation_zero_filled_and_exact(kind, capacity, shape):
    # the ring holds the formula's rows; the allocation rounds them to 256
    p = plane(kind)
    assert p.capacity == capacity and p.planes.rows == 256
    assert p.keys.shape == shape and p.values.shape == shape
    assert p.keys.dtype == mx.float16
    assert p.nbytes == 2 * int(np.prod(shape)) * 2
    assert not np.any(bits(p.keys)) and not np.any(bits(p.values))


def test_sliding_capacity_is_min_of_context_and_window():
    assert plane(LayerKind.SLIDING, window=8, max_context=5).capacity == 5
    assert plane(LayerKind.GLOBAL, window=8, max_context=5).capacity == 5


@pytest.mark.parametrize("kind", [LayerKind.SLIDING, LayerKind.GLOBAL])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_chunks_across_wrap_and_wider_than_ring(kind, dtype):
    p = plane(kind)
    oracle = FullHistory(8 if kind is LayerKind.SLIDING else None)
    for i, n in enumerate([1, 3, 5, 1, 1, 13, 2, 8, 1, 9]):  # 13 and 9 are wider than the ring
        k, v = kv(n, dtype, seed=i)
        p.update_and_fetch(k, v)
        oracle.append(k, v)
        snapshot_equals(p, oracle)
        physical_equals(p, oracle)
    assert p.ring.end == 44


def test_f32_rounds_to_nearest_even():
    p = plane(LayerKind.GLOBAL)
    # 1 + 2^-11 is exactly halfway between f16 1.0 and 1.0009765625: ties to even (1.0);
    # 1 + 3 * 2^-11 is halfway between 1.0009765625 and 1.001953125: ties to even (the latter).
    vals = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65519.0, -0.0], np.float32)
    k = mx.array(np.resize(vals, (1, H, 1, D)))
    p.update_and_fetch(k, k)
    _, got, _ = p.snapshot()
    expect = np.resize(np.array([1.0, 1.001953125, 65504.0, -0.0], np.float16), (1, H, D))
    np.testing.assert_array_equal(bits(got), bits(expect))


def _frozen(p):
    return (bits(p.keys).copy(), bits(p.values).copy(),
            (p.ring.len, p.ring.origin_logical, p.ring.origin_physical))


def _assert_unchanged(p, before):
    after = _frozen(p)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert after[2] == before[2]


@pytest.mark.parametrize("kind", [LayerKind.SLIDING, LayerKind.GLOBAL])
def test_discontinuous_write_changes_nothing(kind):
    """A write where the list does not expect one (layer 1 of a two-layer list
    written twice in a row) is a CacheDiscontinuity naming the layer, the
    position expected and the one the write would take, and changes nothing."""
    geometry = MuseGeometry(num_layers=2, window=8, max_context=64, num_heads=H, kv_heads=H,
                            head_dim=D, layer_kinds=(kind, kind))
    first, p = make_cache_for(geometry)
    for i in range(3):
        k, v = kv(5, seed=i)
        first.update_and_fetch(k, v)
        p.update_and_fetch(k, v)
    before = _frozen(p)
    for n in (1, 2, 7):
        with pytest.raises(CacheDiscontinuity) as e:
            p.update_and_fetch(*kv(n, seed=9))
        assert (e.value.layer, e.value.expected, e.value.got) == (1, 15 - n, 15)
        _assert_unchanged(p, before)


@pytest.mark.parametrize("kind", [LayerKind.SLIDING, LayerKind.GLOBAL])
def test_bad_input_refused_before_anything_changes(kind):
    p = plane(kind, max_context=20)
    p.update_and_fetch(*kv(6))
    before = _frozen(p)
    k, v = kv(3)
    w = p.update_and_fetch
    cases = [
        (ContextOverflow, "max_context 20", lambda: w(*kv(15))),
        (ValueError, "batch size must be 1", lambda: w(mx.concatenate([k, k]), mx.concatenate([v, v]))),
        (ValueError, "expected 2 KV heads, got 4", lambda: w(mx.concatenate([k, k], 1), mx.concatenate([v, v], 1))),
        (ValueError, "expected head_dim 128, got 64", lambda: w(k[..., :64], v[..., :64])),
        (TypeError, "dtype must be float32, float16 or bfloat16, got mlx.core.int32", lambda: w(k.astype(mx.int32), v)),
        (ValueError, "differ", lambda: w(k, v[:, :, :2])),
        (ValueError, "got shape", lambda: w(k[0], v[0])),
        (ValueError, "at least one token", lambda: w(k[:, :, :0], v[:, :, :0])),
    ]
    for exc, message, call in cases:
        with pytest.raises(exc, match=message):
            call()
        _assert_unchanged(p, before)
    w(k, v)  # the right write still works afterwards
    assert p.ring.end == 9


@pytest.mark.parametrize("kind", [LayerKind.SLIDING, LayerKind.GLOBAL])
@pytest.mark.parametrize("position", [1, 7, 8, 9, 13, 31])
def test_install_reproduces_the_live_rotation(kind, position):
    """A restore of the logical snapshot into a fresh plane lands every row at
    the physical slot the live, sequentially built plane holds it in."""
    live = plane(kind)
    done = 0
    while done < position:
        n = min(3, position - done)
        live.update_and_fetch(*kv(n, seed=done))
        done += n
    start, k, v = live.snapshot()
    fresh = plane(kind)
    fresh.install(start, k, v)
    assert (fresh.ring.len, fresh.ring.origin_logical, fresh.ring.origin_physical) == (
        live.ring.len, live.ring.origin_logical, live.ring.origin_physical)
    np.testing.assert_array_equal(bits(fresh.keys), bits(live.keys))
    np.testing.assert_array_equal(bits(fresh.values), bits(live.values))


def test_install_refuses_bad_snapshots():
    p = plane(LayerKind.SLIDING)
    rows = mx.zeros((8, H, D), mx.float16)
    with pytest.raises(TypeError, match="float16"):
        p.install(0, rows.astype(mx.float32), rows)
    with pytest.raises(ValueError, match=r"\(8, 2, 128\)"):
        p.install(0, rows, rows[:, :, :64])
    with pytest.raises(ValueError, match="cannot install 9 rows"):
        p.install(0, mx.zeros((9, H, D), mx.float16), mx.zeros((9, H, D), mx.float16))
    with pytest.raises(ValueError, match="must start at position 0"):
        p.install(3, rows[:5], rows[:5])


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.integers(1, 20), min_size=1, max_size=8),
       window=st.integers(1, 12), kind=st.sampled_from(list(LayerKind)))
def test_random_chunks_match_oracle(chunks, window, kind):
    p = plane(kind, window=window, max_context=200)
    oracle = FullHistory(window if kind is LayerKind.SLIDING else None)
    for i, n in enumerate(chunks):
        k, v = kv(n, mx.float16, seed=i)
        p.update_and_fetch(k, v)
        oracle.append(k, v)
    snapshot_equals(p, oracle)


@pytest.mark.parametrize("kind", [LayerKind.SLIDING, LayerKind.GLOBAL])
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_planes_stay_row_contiguous_when_a_chunk_covers_them(kind, layout):
    """A write that covers a whole plane (a chunk wider than the ring) must not
    leave the plane aliasing the chunk's strided view: the kernels index planes
    as row-contiguous memory (caught on the H200 with head-major rings)."""
    p = plane(kind, window=8, max_context=16 if kind is LayerKind.SLIDING else 8, layout=layout)
    k = mx.array(np.random.default_rng(0).standard_normal((1, 12, H, D)).astype(np.float16))
    k = k.transpose(0, 2, 1, 3)  # the model's strided [1, H, N, D]
    if kind is LayerKind.GLOBAL:
        p.update_and_fetch(k[:, :, :8], k[:, :, :8])
    else:
        p.update_and_fetch(k, k)
    mx.eval(p.keys)
    flat = np.array(p.keys).reshape(-1)
    raw = np.frombuffer(memoryview(p.keys), dtype=np.float16)  # the buffer, as a kernel sees it
    np.testing.assert_array_equal(raw.view(np.uint16), flat.view(np.uint16))


def _address(x: mx.array) -> int:
    mx.eval(x)
    return np.asarray(x).__array_interface__["data"][0]  # strided export: no copy


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("kind", [LayerKind.SLIDING, LayerKind.GLOBAL])
def test_every_write_path_keeps_the_layouts_memory_order(kind, layout):
    """Planes are held attention-shaped ([1, H, C, D]) over memory in their
    layout's order. The rows the kernels index (``keys``) must stay a view of
    the same buffer, never a copy, through decode, wrapping chunks, a chunk that
    covers the plane, a rollback restore and an install; each step is checked
    against the oracle too. A plane that lost its order would make ``keys`` a
    reshaped copy (another address), and the kernels would read stale rows."""
    window, context = 8, 40
    p = plane(kind, window=window, max_context=context, layout=layout)
    oracle = FullHistory(window if kind is LayerKind.SLIDING else None)
    pos = 0

    def check():
        for planes in ((p.planes.k, p.keys), (p.planes.v, p.values)):
            assert _address(planes[0]) == _address(planes[1])
            assert np.asarray(planes[1]).flags["C_CONTIGUOUS"]
        physical_equals(p, oracle)

    # a chunk that covers the ring exactly from row 0 (sliding: 16 = 2 windows),
    # decode, chunks across the wrap, one wider than the ring at a rotation
    for n in (16, 1, 1, 5, 1, 9, 1, 1, 3):
        k, v = kv(n, mx.float16, seed=pos)
        p.update_and_fetch(k, v)  # n == 1: the decode fast path
        oracle.append(k, v)
        pos += n
        check()
    # rollback: the ring and rows of an earlier state put back (a ring from its retained rows)
    k, v = kv(2, mx.float16, seed=99)
    p.update_and_fetch(k, v)
    assert p.trim(2) == 2
    check()
    start, rows_k, rows_v = p.snapshot()
    p.install(start, rows_k, rows_v)
    check()
    # a chunk that fills a whole plane in one run
    p = plane(kind, window=window, max_context=window, layout=layout)
    oracle = FullHistory(window if kind is LayerKind.SLIDING else None)
    raw = mx.array(np.random.default_rng(7).standard_normal((1, window, H, D)).astype(np.float16))
    k = raw.transpose(0, 2, 1, 3)  # the model's strided [1, H, N, D]
    p.update_and_fetch(k, k)
    oracle.append(k, k)
    check()
