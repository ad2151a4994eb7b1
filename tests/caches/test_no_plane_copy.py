"""A store never copies a plane: decode through mlx-lm's real (pipelined)
generate_step holds peak memory at what the planes already hold, and in a
synchronous loop every plane keeps its buffer. A negative control (a view of a
plane kept alive, which blocks MLX's donation) shows the measurement catches a
copy."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.generate import generate_step

import muser_kv

CONTEXT = 65536  # NoPE planes of 2 x 65,536 x 128 f16 = 32 MiB each: a copy cannot hide


@pytest.fixture(scope="module")
def model():
    return tiny_model(mx.float16, max_position_embeddings=CONTEXT)


def decode_peak_extra(model, cache, tokens=24):
    """Peak memory above the memory held before decode, over a pipelined decode."""
    prompt = mx.array(np.random.default_rng(0).integers(0, 256, 40), mx.uint32)
    base = None
    for i, _ in enumerate(generate_step(prompt, model, prompt_cache=cache, max_tokens=tokens,
                                        prefill_step_size=16)):
        if i == 2:
            mx.synchronize()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
    mx.synchronize()
    return mx.get_peak_memory() - base


def test_pipelined_decode_peak_is_the_planes(model):
    cache = muser_kv.make_prompt_cache(model, preallocate=True)
    extra = decode_peak_extra(model, cache)
    plane = cache[3].keys.nbytes
    assert plane == 32 * 2**20
    assert extra < plane / 16, f"decode allocated {extra} B beyond the planes (a plane is {plane} B)"


class Holder:
    """Keeps every K/V view a layer returned alive, as a careless caller might:
    each view shares its plane's buffer, so MLX cannot donate that buffer to the
    next store and must copy the plane."""

    def __init__(self, cache):
        self._cache, self.held = cache, []

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def update_and_fetch(self, keys, values):
        self.held.append(self._cache.update_and_fetch(keys, values))
        return self.held[-1]


def test_negative_control_a_held_view_forces_copies(model):
    cache = muser_kv.make_prompt_cache(model, preallocate=True)
    cache[3] = Holder(cache[3])
    extra = decode_peak_extra(model, cache, tokens=6)
    assert extra >= cache[3].keys.nbytes


def _address(x: mx.array) -> int:
    a = np.array(x, copy=False)
    try:
        return a.__array_interface__["data"][0]
    finally:
        del a


def assert_stores_keep_buffers(model, cache, steps: int) -> None:
    """``steps`` synchronous one-token steps; every plane keeps its buffer."""
    before = [(_address(c.keys), _address(c.values)) for c in cache]
    for t in range(steps):
        out = model(mx.array([[t % 256]]), cache=cache)
        mx.eval(out, [c.state for c in cache])
        del out
        after = [(_address(c.keys), _address(c.values)) for c in cache]
        assert after == before, f"step {t}: a plane moved to a new buffer"


def test_synchronous_stores_keep_every_buffer(model):
    cache = muser_kv.make_prompt_cache(model, max_context=4096)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    mx.eval([c.state for c in cache])
    assert_stores_keep_buffers(model, cache, 40)  # wraps the 16-row rings twice


@pytest.mark.parametrize("places", [True, False], ids=["read-into-planes", "install-kernel"])
def test_a_loaded_session_keeps_every_buffer(model, tmp_path, monkeypatch, places):
    """``load_session`` hands over planes no one else holds, whichever way the
    rows reached them (read straight into the planes, or uploaded and placed by
    the install): every store after the load reuses the plane's buffer."""
    import muser_kv.sessions.reading as reading

    monkeypatch.setattr(reading, "HOST_PLACES", places)
    live = muser_kv.make_prompt_cache(model, max_context=4096)
    model(mx.array([list(range(1, 41))]), cache=live)  # past the 16-row rings' wrap
    muser_kv.save_session(tmp_path / "s.safetensors", live)
    cache = muser_kv.load_session(tmp_path / "s.safetensors", model)
    assert_stores_keep_buffers(model, cache, 20)


@pytest.mark.parametrize("places", [True, False], ids=["from-the-planes", "gathered-cut"])
def test_a_saved_session_keeps_every_buffer(model, tmp_path, monkeypatch, places):
    """``save_session`` holds nothing of the live planes once it returns,
    whether it wrote from views of them or from a gathered cut: every store
    after the save reuses the plane's buffer."""
    import muser_kv.sessions.reading as reading

    monkeypatch.setattr(reading, "HOST_PLACES", places)
    live = muser_kv.make_prompt_cache(model, max_context=4096)
    model(mx.array([list(range(1, 41))]), cache=live)  # past the 16-row rings' wrap
    mx.eval([c.state for c in live])
    assert muser_kv.save_session(tmp_path / "s.safetensors", live).position == 40
    assert_stores_keep_buffers(model, live, 20)


def test_decode_right_after_a_restore_copies_no_ring(mlx_attention):
    """After an install (a restored session) the rings hold no copies of the rows
    their next tokens overwrite; taking them in the same graph as the first
    store would make MLX copy every ring once. They are taken and settled at
    the first update instead. Head-major rings and MLX's attention keep the
    CPU attention's temporaries out of the measurement (the CPU reference of
    muser-kv's decode attention gathers the window it reads in f32: a
    transient of its own, not a copy of the ring); a ring here is 2,048 x
    256 f16 = 1 MiB per plane."""
    model = tiny_model(mx.float16, sliding_window=2048, max_position_embeddings=4096,
                       num_hidden_layers=4, num_attention_heads=2)
    cache = muser_kv.make_prompt_cache(model, sliding_layout="head_major")
    rng = np.random.default_rng(0)
    depth = 3000  # wrapped: every ring full and rotated
    for c in cache:
        rows = min(depth, c.capacity)
        k = mx.array(rng.standard_normal((rows, 2, 128)).astype(np.float16))
        c.install(depth - rows, k, k)
    mx.eval([c.state for c in cache])
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in generate_step(mx.array([1, 2], mx.uint32), model, prompt_cache=cache, max_tokens=6):
        pass
    mx.synchronize()
    ring = cache[0].keys.nbytes
    assert ring == 2**20
    assert mx.get_peak_memory() - base < ring, "a ring was copied at the first stores"


@pytest.mark.parametrize("batched", [False, True], ids=["one", "batch"])
def test_a_fill_that_evaluates_only_state_holds_nothing_else(batched):
    """mlx-lm's prefill evaluates each cache's ``state`` after a chunk and not
    always the attention outputs (a last layer's feed nothing the state needs);
    a fill that writes K/V directly evaluates nothing else at all. The rows a
    ring retains from a wrapping chunk are copies of its staging shadow: left
    lazy, they held the shadow and the plane before the store (2x the ring).
    ``state`` hands them over to be evaluated."""
    import gc

    from muser_kv import LayerKind, MuseGeometry, make_cache_for
    from muser_kv.caches.batch import BatchKVCache

    g = MuseGeometry(num_layers=1, window=2048, max_context=16384, num_heads=4, kv_heads=2,
                     head_dim=128, layer_kinds=(LayerKind.SLIDING,))
    c = make_cache_for(g)[0]
    if batched:
        c = BatchKVCache.merge([c, make_cache_for(g)[0]])
    mx.eval(c.state)
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    x = mx.random.normal((2 if batched else 1, 2, 4096, 128)).astype(mx.float16)
    mx.eval(x)
    for _ in range(3):  # chunks wider than the ring: every one through the shadow
        c.update_and_fetch(x, x)
        mx.eval(c.state)
    del x
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - base
    retained = sum(s.retained_nbytes for s in c.seqs) if batched else c.retained_nbytes
    assert held <= retained + (64 << 10), (held, c.nbytes)
