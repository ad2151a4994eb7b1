"""Every count argument of the public API takes ints only (issue #10, item 5):
``cache.trim(1.5)`` once made a ring 3.5 rows long. Floats and bools are
refused, whatever their value, before anything changes; numpy integers are ints."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.models.cache import trim_prompt_cache
from oracle import bits

import muser_kv

NOT_INTS = [1.5, 2.0, True, False, "2", None]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def cache(model):
    cache = muser_kv.make_prompt_cache(model, 64)
    model(mx.array([list(range(1, 21))]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def snapshot(cache):
    return [(c.meta_state, bits(c.keys).copy()) for c in cache]


@pytest.fixture
def short(model):
    """Five tokens: no ring has wrapped, so a fractional trim met no row copy
    that would have refused it by accident (trim(1.5) left len 3.5)."""
    cache = muser_kv.make_prompt_cache(model, 64)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("n", NOT_INTS)
@pytest.mark.parametrize("which", ["wrapped", "short"])
def test_trim_takes_ints_only(cache, short, which, n):
    cache = {"wrapped": cache, "short": short}[which]
    before = snapshot(cache)
    for layer in (0, 3):  # a ring and a growing plane
        with pytest.raises((TypeError, ValueError), match="trim count must be an int"):
            cache[layer].trim(n)
    with pytest.raises((TypeError, ValueError), match="trim count must be an int"):
        trim_prompt_cache(cache, n)
    for (meta, k), c in zip(before, cache):
        assert c.meta_state == meta and type(c.ring.len) is int
        np.testing.assert_array_equal(bits(c.keys), k)


def test_numpy_integers_are_ints(cache):
    assert trim_prompt_cache(cache, np.int64(2)) == 2
    assert all(type(c.offset) is int and c.offset == 18 for c in cache)
    cp = muser_kv.checkpoint(cache, np.int32(3))
    assert cp.block_len == 3 and type(cp.block_len) is int


@pytest.mark.parametrize("n", NOT_INTS)
def test_checkpoint_block_len_takes_ints_only(cache, n):
    with pytest.raises((TypeError, ValueError)):
        muser_kv.checkpoint(cache, n)


@pytest.mark.parametrize("n", [1.5, 64.0, True])
def test_cache_builders_take_ints_only(model, n):
    with pytest.raises((TypeError, ValueError)):
        muser_kv.make_prompt_cache(model, max_context=n)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.make_prompt_cache(model, 64, retain=n)
    geo = muser_kv.MuseGeometry.from_model_args(model.args, 64)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.make_cache_for(geo, retain=n)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.footprint(geo, n)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.footprint(geo, 64, slots=n)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.SlotPool(model, slots=1, max_context=n)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.SlotPool(model, slots=1, max_context=64, retain=n)


def test_make_mask_takes_ints_only(cache):
    with pytest.raises((TypeError, ValueError)):
        cache[0].make_mask(1.0, window_size=16)
    with pytest.raises((TypeError, ValueError)):
        cache[0].make_mask(True, window_size=16)


def test_load_session_max_context_takes_ints_only(model, cache, tmp_path):
    path = tmp_path / "s.safetensors"
    muser_kv.save_session(path, cache)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.load_session(path, model, max_context=64.0)
    assert muser_kv.load_session(path, model, max_context=np.int64(64))[0].offset == 20


@pytest.mark.parametrize("n", [1.5, 2.0, True])
def test_pool_and_policy_counts_take_ints_only(model, n):
    with pytest.raises((TypeError, ValueError)):
        muser_kv.SlotPool(model, slots=n, max_context=64)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.SlotPool(model, slots=1, max_context=64, prefill_chunk=n)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.compact_raw(list(range(10)), max_context=n)
    with pytest.raises((TypeError, ValueError)):
        muser_kv.shift_chat([muser_kv.Message("user", (1, 2))], max_context=n)
