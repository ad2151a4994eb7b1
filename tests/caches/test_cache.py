"""MuseKVCache: mlx-lm's cache protocol, and the rule that the mask describes
exactly the rows update_and_fetch returns."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import kv
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import FullHistory, bits

import muser_kv
from muser_kv import CacheDiscontinuity, LayerKind, MuseGeometry, MuseKVCache, make_cache_for

H, D = 2, 128


LAYOUTS = ["token_major", "head_major"]


def caches(window=8, max_context=64, layers=4, retain=16, layout="token_major"):
    return make_cache_for(MuseGeometry(num_layers=layers, window=window, max_context=max_context,
                                       num_heads=4, kv_heads=H, head_dim=D), retain, layout)


def lone(layer=0, window=8, max_context=64, retain=16, layout="token_major"):
    """Layer ``layer``'s kind of cache (3 of every 4 sliding), alone: a list of
    one layer, which a test may drive by itself (a layer of a longer list must
    be driven with its list)."""
    kind = LayerKind.GLOBAL if layer % 4 == 3 else LayerKind.SLIDING
    return make_cache_for(MuseGeometry(num_layers=1, window=window, max_context=max_context,
                                       num_heads=4, kv_heads=H, head_dim=D, layer_kinds=(kind,)),
                          retain, layout)[0]


def mask_as_array(mask, n, rows):
    if mask is None:
        return np.ones((n, rows), bool)
    if isinstance(mask, str):
        assert mask == "causal"
        return np.arange(rows)[None] <= (rows - n + np.arange(n))[:, None]
    a = np.array(mask.astype(mx.float32)) if mask.dtype != mx.bool_ else np.array(mask)
    if a.dtype != bool:  # the additive form: 0 where a key is seen, -inf where not
        assert set(np.unique(a)) <= {0.0, -np.inf}, np.unique(a)
        a = a == 0
    return np.broadcast_to(a, (n, rows))


def check_step(cache: MuseKVCache, oracle: FullHistory, n: int, seed: int):
    """One update: mask and returned rows must give every query exactly the
    rows the oracle says it may see."""
    window = cache.window
    L = cache.offset
    mask = cache.make_mask(n, window_size=window)
    arr = cache.make_mask(n, window_size=window, return_array=True)
    k, v = kv(n, mx.float16, seed)
    keys, values = cache.update_and_fetch(k, v)
    oracle.append(k, v)
    assert keys.shape == values.shape and keys.shape[:2] == (1, H) and keys.shape[3] == D
    assert keys.dtype == mx.float16
    rows = keys.shape[2]
    full = mask_as_array(mask, n, rows)
    np.testing.assert_array_equal(full, mask_as_array(arr, n, rows))
    got_k = np.array(keys)[0].transpose(1, 0, 2)  # [rows, H, D]
    got_v = np.array(values)[0].transpose(1, 0, 2)
    for i in range(n):
        vis = oracle.visible(L + i)
        expect_k = sorted(bits(oracle.keys[p]).tobytes() for p in vis)
        seen_k = sorted(bits(got_k[j]).tobytes() for j in np.nonzero(full[i])[0])
        assert seen_k == expect_k, f"query {L + i}: wrong visible key rows"
        expect_v = sorted(bits(oracle.values[p]).tobytes() for p in vis)
        seen_v = sorted(bits(got_v[j]).tobytes() for j in np.nonzero(full[i])[0])
        assert seen_v == expect_v


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.integers(1, 21), min_size=1, max_size=10), layer=st.sampled_from([0, 3]))
def test_mask_and_rows_agree(layout, chunks, layer):
    cache = lone(layer, layout=layout)
    oracle = FullHistory(cache.window)
    for i, n in enumerate(chunks):
        if cache.offset + n > 64:
            break
        check_step(cache, oracle, n, seed=i)


def test_decode_on_full_ring_needs_no_mask_and_reads_in_place():
    c = lone(0)
    c.update_and_fetch(*kv(11, seed=1))  # wrapped by a chunk
    assert c.make_mask(1, window_size=8) is None
    k, _ = c.update_and_fetch(*kv(1, seed=2))
    assert k.shape == (1, H, 8, D)
    # the returned keys are the plane itself, viewed: no staging copy
    np.testing.assert_array_equal(bits(np.array(k)[0].transpose(1, 0, 2).reshape(8, -1)), bits(c.keys[:8]))


def test_protocol_surface():
    c, g = lone(0), lone(3)
    assert c.kind is LayerKind.SLIDING and g.kind is LayerKind.GLOBAL
    assert c.offset == 0 and c.empty() and c.size() == 0
    # rings of 8 and planes of 64 rows allocate one 256-row granule each
    assert c.ring.capacity == 8 and g.ring.capacity == 64
    assert c.nbytes == 256 * 256 * 2 * 2 and g.nbytes == 256 * 256 * 2 * 2
    assert bool(c)  # mlx-lm's create_attention_mask tests `if cache`
    c.update_and_fetch(*kv(5))
    assert c.offset == 5 and c.size() == 5 and not c.empty()
    with pytest.raises(AttributeError):
        c.offset = 3  # offset moves only through the cache's own operations
    with pytest.raises(ValueError, match="window 8, asked for a mask with window 4"):
        c.make_mask(2, window_size=4)


def test_state_round_trip_is_exact():
    cs = caches()
    for c in cs:
        c.update_and_fetch(*kv(11, seed=c.layer))
    for c in cs:
        d = MuseKVCache.from_state(c.state, c.meta_state)
        assert d.meta_state == c.meta_state
        np.testing.assert_array_equal(bits(d.state[0]), bits(c.state[0]))
        k1, _ = c.update_and_fetch(*kv(1, seed=7))
        k2, _ = d.update_and_fetch(*kv(1, seed=7))
        np.testing.assert_array_equal(bits(k1), bits(k2))
    with pytest.raises(ValueError, match="meta_state"):
        MuseKVCache.from_state(cs[0].state[:2], None)
    bad = (cs[0].state[0][:4], cs[0].state[1])
    with pytest.raises(ValueError, match="state keys must be"):
        MuseKVCache.from_state(bad, cs[0].meta_state)


def test_trim_exact_or_refused_without_retention():
    c, g = lone(0, retain=0), lone(3, retain=0)
    # a ring that keeps nothing and can wrap tells mlx-lm's callers it cannot be
    # trimmed from the start (they ask once); its own trim stays exact before the wrap
    assert not c.is_trimmable() and g.is_trimmable()
    for x in (c, g):
        x.update_and_fetch(*kv(6, seed=1))
        assert x.trim(2) == 2 and x.offset == 4
        k, _ = x.update_and_fetch(*kv(2, seed=3))  # rewrite positions 4, 5
        assert x.offset == 6
        with pytest.raises(ValueError, match="negative"):
            x.trim(-1)
        with pytest.raises(ValueError, match="at most 6"):
            x.trim(7)
    c.update_and_fetch(*kv(5, seed=4))  # wraps: rows 0..2 are gone
    assert not c.is_trimmable()
    before = (c.ring.len, c.ring.origin_logical, c.ring.origin_physical)
    with pytest.raises(ValueError, match="at most 0"):
        c.trim(1)
    assert (c.ring.len, c.ring.origin_logical, c.ring.origin_physical) == before
    assert c.trim(0) == 0


def test_discontinuity_through_the_protocol_changes_nothing():
    c = lone(0)
    c.update_and_fetch(*kv(3))
    state = (bits(c.keys).copy(), c.meta_state)
    # a caller that bypasses offset cannot reach the ring out of order: the
    # ring's plan itself refuses
    with pytest.raises(CacheDiscontinuity):
        c.ring.write(5, 1)
    np.testing.assert_array_equal(bits(c.keys), state[0])
    assert c.meta_state == state[1]


def test_make_prompt_cache_from_model(model_f32):
    cache = muser_kv.make_prompt_cache(model_f32, max_context=128)
    args = model_f32.args
    assert len(cache) == args.num_hidden_layers
    for c, t in zip(cache, args.layer_types):
        assert c.kind.value == t
        assert c.capacity == (16 if t == "sliding_attention" else 128)
    fp = muser_kv.footprint(MuseGeometry.from_model_args(args, 128), 128)
    assert sum(c.nbytes for c in cache) == fp.slot_bytes
    with pytest.raises(TypeError):
        muser_kv.make_prompt_cache(object())


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.just("write"), st.integers(1, 11)),
                              st.tuples(st.just("trim"), st.integers(0, 20))),
                    min_size=1, max_size=25),
       retain=st.sampled_from([0, 1, 4, 16]), layer=st.sampled_from([0, 3]))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_trim_after_wrap_matches_a_cache_that_never_saw_the_tokens(layout, ops, retain, layer):
    """Random writes and trims: every trim is exact (contents, origins and the
    physical placement equal a fresh cache fed the surviving history) or refused
    with nothing changed."""
    cache = lone(layer, retain=retain, layout=layout)
    history = []  # (k, v) one token each, as written
    seed = 0
    for op, n in ops:
        if op == "write":
            if cache.offset + n > 64:
                continue
            k, v = kv(n, mx.float16, seed=seed)
            seed += 1
            cache.update_and_fetch(k, v)
            history.extend((k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(n))
            continue
        depth = cache.trimmable_depth()
        before = (bits(cache.keys).copy(), cache.meta_state)
        if n > depth:
            with pytest.raises(ValueError, match="at most"):
                cache.trim(n)
            np.testing.assert_array_equal(bits(cache.keys), before[0])
            assert cache.meta_state == before[1]
            continue
        assert cache.trim(n) == n
        del history[len(history) - n:]
        fresh = lone(layer, retain=retain, layout=layout)
        for k, v in history:
            fresh.update_and_fetch(k, v)
        assert cache.meta_state == fresh.meta_state
        for a, b in zip(cache.snapshot(), fresh.snapshot()):
            if isinstance(a, int):
                assert a == b
            else:
                np.testing.assert_array_equal(bits(a), bits(b))
        if cache.ring.len == cache.ring.capacity:  # every row live; rotation is data
            np.testing.assert_array_equal(bits(cache.keys), bits(fresh.keys))
            np.testing.assert_array_equal(bits(cache.values), bits(fresh.values))
    if retain >= 1 and cache.kind is LayerKind.SLIDING and cache.ring.wrapped and cache.offset < 64:
        cache.update_and_fetch(*kv(1, mx.float16, seed=seed))  # overwrites, so retains a row
        assert cache.is_trimmable() and cache.trimmable_depth() >= 1


def test_trim_depth_is_the_retained_rows():
    c = lone(0, retain=4)
    c.update_and_fetch(*kv(20, seed=1))  # wide chunk: 12 rows lost, last 4 retained
    assert c.trimmable_depth() == 4
    for i in range(3):  # the rows these overwrite were copied ahead, 4 at a time
        c.update_and_fetch(*kv(1, seed=10 + i))
    assert c.trimmable_depth() == 7
    # held: 4 lost rows + a block of 4 copied ahead, K and V, [2, 256] f16 each
    assert c.retained_nbytes == 8 * 2 * 256 * 2
    before = c.meta_state
    with pytest.raises(ValueError, match="at most 7"):
        c.trim(8)
    assert c.meta_state == before
    c.trim(7)
    assert c.offset == 16 and c.trimmable_depth() == 0


@pytest.mark.parametrize("retain", [0, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kept_outputs_never_change(layout, retain):
    """K/V returned by update_and_fetch are values: a caller that keeps them
    sees the rows of that step, whatever later stores do to the plane (a full
    ring hands out the whole plane, so it must hand out a new handle, not the
    plane's own, which the next store rebinds)."""
    c = caches(layers=1, retain=retain, layout=layout)[0]
    for i in range(10):
        c.update_and_fetch(*kv(1, mx.float16, seed=i))
    kept = []
    for i in range(10, 20):
        k, v = c.update_and_fetch(*kv(1, mx.float16, seed=i))
        mx.eval(k, v)
        kept.append((k, v, bits(k).copy(), bits(v).copy()))
    for k, v, k_bits, v_bits in kept:
        np.testing.assert_array_equal(bits(k), k_bits)
        np.testing.assert_array_equal(bits(v), v_bits)


def _address(x: mx.array) -> int:
    mx.eval(x)
    return np.asarray(x).__array_interface__["data"][0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_from_state_of_any_memory_order_keeps_the_layout(layout):
    """State may arrive broadcast or strided; the planes rebuilt from it are
    laid out as the layout says, so the kernels' rows stay views of the planes
    (not per-call copies) through later stores."""
    c = caches(layers=1, layout=layout)[0]
    shape = tuple(c.state[0].shape)
    meta = c.meta_state
    z = mx.broadcast_to(mx.array(0, mx.float16), shape)
    t = mx.zeros(shape[::-1], mx.float16).T  # column-major
    for state in ((z, z), (t, t)):
        r = MuseKVCache.from_state(state, meta)
        for i in range(3):
            r.update_and_fetch(*kv(1, mx.float16, seed=i))
            assert _address(r.planes.k) == _address(r.keys)
            assert _address(r.planes.v) == _address(r.values)


def test_decode_after_from_state_holds_no_old_ring():
    """The first decode into a full ring rebuilt by from_state copies the rows
    it will overwrite; that copy is settled, so no step keeps the pre-store ring
    alive (it held a whole extra ring for ``retain`` steps before)."""
    geo = MuseGeometry(num_layers=1, window=1024, max_context=4096, num_heads=8, kv_heads=8,
                       head_dim=D, layer_kinds=(LayerKind.SLIDING,))
    c0 = make_cache_for(geo)[0]
    fill = mx.random.normal((1, 8, 1024, D)).astype(mx.float16)
    c0.update_and_fetch(fill, fill)
    state = tuple(mx.array(np.array(x)) for x in c0.state[:2])
    meta = c0.meta_state
    del c0, fill
    c = MuseKVCache.from_state(state, meta)
    del state
    mx.eval(c.planes.k, c.planes.v)
    mx.synchronize()
    before = mx.get_active_memory()
    q = mx.ones((1, 8, 1, D), mx.float16)
    worst = 0
    for _i in range(20):
        x = mx.random.normal((1, 8, 1, D)).astype(mx.float16)
        k, v = c.update_and_fetch(x, x)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)
        del k, v
        mx.eval(o)
        del o
        mx.synchronize()
        worst = max(worst, mx.get_active_memory() - before)
    assert worst < c.nbytes // 4, (worst, c.nbytes)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_token_into_a_split_ring_reads_its_rows_in_logical_order(layout):
    """A ring whose live rows are split around its end and not full (a state
    rebuilt by from_state can be one) reads one token through the staging
    shadow, never in place: the token's query sees the old rows in logical
    order, then itself."""
    cache = lone(window=8, layout=layout)
    rows = [kv(1, mx.float16, seed) for seed in range(3)]
    for k, v in rows:
        cache.update_and_fetch(k, v)
    # the same three rows, held at physical rows 6, 7, 0 (rotation 6)
    k, v, meta, retained = cache.state
    meta = list(meta)
    meta[10] = "6"  # origin_physical
    axis = 0 if layout == "token_major" else 1
    perm = list(range(k.shape[axis]))  # physical row j takes old row perm[j]
    perm[0], perm[1], perm[2], perm[6], perm[7] = 2, 6, 7, 0, 1  # old 6, 7: zeros
    index = mx.array(perm)
    moved_k, moved_v = mx.take(k, index, axis=axis), mx.take(v, index, axis=axis)
    split = MuseKVCache.from_state((moved_k, moved_v, tuple(meta), retained))
    assert (split.ring.len, split.ring.origin_physical) == (3, 6)
    k4, v4 = kv(1, mx.float16, 9)
    keys, values = split.update_and_fetch(k4, v4)
    want_k = mx.concatenate([r[0] for r in rows] + [k4], axis=2)
    want_v = mx.concatenate([r[1] for r in rows] + [v4], axis=2)
    assert keys.shape == want_k.shape
    np.testing.assert_array_equal(bits(keys), bits(want_k))
    np.testing.assert_array_equal(bits(values), bits(want_v))
