"""mlx-lm's prompt-cache files with muser-kv caches: ``save_prompt_cache`` then
``load_prompt_cache`` (mlx-lm's one-argument ``from_state``) give back caches
whose next logits are bitwise the live cache's, rotation and retained rows
intact; mlx-lm's own caches still load as mlx-lm's classes; a file is refused
clearly where it cannot be restored exactly."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache, trim_prompt_cache
from oracle import bits16 as bits

import muser_kv

CONTEXT = 96
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def model(request):
    return tiny_model(getattr(mx, request.param))


def wrapped_cache(model, retain=8):
    """Past the wrap (rotated rings), with retained rows from a chunk and from
    one-token steps, and a global plane part-way."""
    cache = muser_kv.make_prompt_cache(model, CONTEXT, retain=retain)
    rng = np.random.default_rng(3)
    model(mx.array([rng.integers(0, 256, 27).tolist()]), cache=cache)
    for t in rng.integers(0, 256, 6).tolist():
        model(mx.array([[t]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def continue_logits(model, cache, tokens):
    out = [model(mx.array([[t]]), cache=cache) for t in tokens]
    return [bits(x) if x.dtype != mx.float32 else np.array(x) for x in out]


def test_a_prompt_cache_file_restores_the_live_cache_bit_for_bit(model, tmp_path):
    live = wrapped_cache(model)
    assert live[0].ring.origin_physical != 0 and live[0].retained_nbytes > 0
    path = str(tmp_path / "chat.safetensors")
    save_prompt_cache(path, live, metadata={"note": "turn 1"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "turn 1"}
    assert [type(c) for c in loaded] == [type(c) for c in live]
    assert [c.meta_state for c in loaded] == [c.meta_state for c in live]
    assert [c.trimmable_depth() for c in loaded] == [c.trimmable_depth() for c in live]
    assert loaded[0].dtype == live[0].dtype
    # the retained rows came back: the deepest trim both allow leaves the same state
    depth = min(c.trimmable_depth() for c in live)
    assert depth >= 8  # retain, and the copies taken ahead of the next overwrites
    twin = load_prompt_cache(path)
    trim_prompt_cache(twin, depth)
    trim_prompt_cache(live_copy := load_prompt_cache(path), depth)
    for a, b in zip(twin, live_copy):
        _, ka, va = a.snapshot()
        _, kb, vb = b.snapshot()
        np.testing.assert_array_equal(bits(ka), bits(kb))
    tokens = [11, 200, 7, 7, 64]
    for a, b in zip(continue_logits(model, loaded, tokens), continue_logits(model, live, tokens)):
        np.testing.assert_array_equal(a, b)


def test_trims_after_a_load_equal_trims_of_the_live_cache(model, tmp_path):
    live = wrapped_cache(model)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, live)
    loaded = load_prompt_cache(path)
    for cache in (live, loaded):
        assert trim_prompt_cache(cache, 5) == 5
    tokens = [1, 2, 3, 4, 5, 6]
    for a, b in zip(continue_logits(model, loaded, tokens), continue_logits(model, live, tokens)):
        np.testing.assert_array_equal(a, b)


def test_a_loaded_list_is_one_unit_from_its_first_forward(model, tmp_path):
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, wrapped_cache(model))
    loaded = load_prompt_cache(path)
    model(mx.array([[9]]), cache=loaded)
    one = mx.zeros((1, 2, 1, 128), loaded[1].dtype)
    with pytest.raises(muser_kv.CacheOutOfStep):
        loaded[1].update_and_fetch(one, one)  # a layer written alone
    short = load_prompt_cache(path)[:4]  # a list cut short, handed to the whole model
    with pytest.raises(muser_kv.CacheListMismatch):
        model(mx.array([[9]]), cache=short)
    assert all(c.offset == 33 for c in short)  # refused before a layer wrote


def test_mlx_lms_own_caches_still_load_as_mlx_lms_classes(model, tmp_path):
    cache = model.make_cache()
    model(mx.array([list(range(30))]), cache=cache)
    path = str(tmp_path / "lm.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert not any(isinstance(c, muser_kv.MuseKVCache) for c in loaded)
    a, b = model(mx.array([[5]]), cache=loaded), model(mx.array([[5]]), cache=cache)
    np.testing.assert_array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


def test_without_muser_kv_imported_the_load_names_what_is_missing(tmp_path):
    model = tiny_model(mx.float16)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), muser_kv.make_prompt_cache(model, CONTEXT))
    code = ("from mlx_lm.models.cache import load_prompt_cache; "
            f"load_prompt_cache({str(path)!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    assert "KeyError: 'muser_kv.SlidingKVCache'" in out.stderr


@pytest.mark.parametrize("order", ["mlx_lm first", "muser_kv first, then registered"])
def test_a_file_loads_wherever_muser_kv_was_imported_and_its_import_pulls_in_no_mlx_lm(tmp_path, order):
    """Importing muser_kv imports no mlx-lm (whose package imports transformers:
    seconds); its classes reach mlx-lm's loader when muser_kv is imported after
    mlx-lm, or when ``register_prompt_files()`` (or building a list, or
    ``install``) runs after it."""
    model = tiny_model(mx.float16)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), muser_kv.make_prompt_cache(model, CONTEXT))
    load = f"from mlx_lm.models.cache import load_prompt_cache; print(len(load_prompt_cache({str(path)!r})))"
    if order == "mlx_lm first":
        code = f"import mlx_lm.models.cache; import muser_kv; {load}"
    else:
        code = ("import sys, muser_kv; assert 'mlx_lm' not in sys.modules, 'mlx_lm imported'; "
                f"muser_kv.register_prompt_files(); {load}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(len(model.layers))


def test_one_argument_from_state_refuses_what_is_not_a_cache_state(model):
    live = wrapped_cache(model)
    k, v, meta, held = live[0].state
    start, blocks = held
    c = muser_kv.MuseKVCache.from_state((k, v, meta, held))  # mlx-lm's call
    assert c.meta_state == live[0].meta_state
    end = int(meta[9]) + int(meta[8])  # origin_logical + len
    bad = {
        "parts": (k, v, meta),
        "meta_state": (k, v, meta[:-1], held),
        "keys must be": (k[:4], v, meta, held),
        "blocks": (k, v, meta, (start, [])),
        "each block": (k, v, meta, (start, [blocks[0].astype(mx.float32)])),
        "run past": (k, v, meta, (end, blocks)),
        "start must be": (k, v, meta, (-1, blocks)),
    }
    for match, state in bad.items():
        with pytest.raises(ValueError, match=match):
            muser_kv.MuseKVCache.from_state(state)
    g = live[3].state
    with pytest.raises(ValueError, match="retains no rows"):
        muser_kv.MuseKVCache.from_state((g[0], g[1], g[2], held))


def test_a_batch_is_not_restored_from_a_file(model, tmp_path):
    batch = muser_kv.MuseKVCache.merge([c for c in [wrapped_cache(model)[0]]])
    with pytest.raises(ValueError, match="extract"):
        type(batch).from_state(batch.state)
