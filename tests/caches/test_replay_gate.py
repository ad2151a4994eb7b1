"""The replay gate: a session saved at positions 1, 31,
32, 33, W-1, W, W+1 and restored into a fresh cache -- in this process and in
a new one -- continues with logits bitwise equal to the live session for 8
tokens. One run uses the real window W = 2,048. A restore packed at physical
origin 0 does not replay a wrapped session bitwise, so the gate can fail."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from helpers import continue_logits, restored_logits
from oracle import copy_array

import muser_kv
import muser_kv.caches.cachelist
from muser_kv import Ring

CONTINUE = 8
HERE = Path(__file__).resolve().parents[1]


def fork(cache):
    """An independent deep copy of a live cache (new buffers, same ring state)."""
    out = []
    for c in cache:
        keys, values = (copy_array(x) for x in c.state[:2])
        out.append(muser_kv.MuseKVCache.from_state((keys, values), c.meta_state))
    return out


def live_run(model, prompt, gates, chunk, tmp_path):
    """Prefill ``prompt`` in chunks, stopping at each gate position to save the
    session and record the live continuation of the next CONTINUE tokens."""
    max_context = model.args.max_position_embeddings
    cache = muser_kv.make_prompt_cache(model, max_context)
    live, pos = {}, 0
    for g in sorted(gates):
        while pos < g:
            n = min(chunk, g - pos)
            model(mx.array(prompt[None, pos:pos + n]), cache=cache)
            pos += n
        mx.eval([c.state for c in cache])
        path = tmp_path / f"session_{g}.safetensors"
        muser_kv.save_session(path, cache, metadata={"gate": str(g)})
        live[g] = (path, continue_logits(model, fork(cache), prompt[g:g + CONTINUE].tolist()))
    return live


def gates_for(window):
    return [1, 31, 32, 33, window - 1, window, window + 1]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_replay_gate_small_window(tmp_path, dtype):
    model = tiny_model(dtype, sliding_window=32, max_position_embeddings=256)
    prompt = np.random.default_rng(11).integers(0, 256, 80)
    live = live_run(model, prompt, gates_for(32), chunk=7, tmp_path=tmp_path)
    for g, (path, expect) in live.items():
        got = restored_logits(model, path, prompt[g:g + CONTINUE].tolist())
        np.testing.assert_array_equal(got.view(np.uint32), expect.view(np.uint32),
                                      err_msg=f"restore at position {g} did not replay bitwise")


@pytest.mark.slow
def test_replay_gate_real_window_in_a_new_process(tmp_path):
    """W = 2,048 (the real window; 4 layers and hidden 64 keep it affordable),
    prefilled in 512-token chunks; every gate restored in a fresh process."""
    kw = dict(sliding_window=2048, max_position_embeddings=2048 + 64,
              num_hidden_layers=4, num_attention_heads=2)
    model = tiny_model(mx.float32, **kw)
    prompt = np.random.default_rng(12).integers(0, 256, 2048 + 16)
    live = live_run(model, prompt, gates_for(2048), chunk=512, tmp_path=tmp_path)
    np.save(tmp_path / "prompt.npy", prompt)
    script = HERE / "replay_child.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    args = [sys.executable, str(script), str(tmp_path), repr(kw), str(CONTINUE)] + \
        [str(g) for g in live]
    subprocess.run(args, check=True, env=env, timeout=600)
    for g, (_, expect) in live.items():
        got = np.load(tmp_path / f"restored_{g}.npy")
        np.testing.assert_array_equal(got.view(np.uint32), expect.view(np.uint32),
                                      err_msg=f"new-process restore at {g} did not replay bitwise")


@pytest.mark.parametrize("attention", ["muser", "mlx"])
def test_restore_packed_at_origin_zero(tmp_path, attention):
    """The same rows, installed from physical row 0 instead of at rotation
    origin_logical % capacity, once the ring has wrapped: with MLX's
    attention (a negative control) the logits' bits change -- the rotation is
    part of its data; with muser-kv's decode attention they do not, since it
    reads the ring in logical order (the restore still installs the rotation,
    so either attention replays)."""
    before = muser_kv.decode_attention()
    muser_kv.set_decode_attention(attention)
    try:
        _packed_at_origin_zero(tmp_path, attention)
    finally:
        muser_kv.set_decode_attention(before)


def _packed_at_origin_zero(tmp_path, attention):
    # 128 rows: enough that a GPU attention kernel's per-thread partial sums
    # each cover several rows, so the rotation changes what is summed with what
    model = tiny_model(mx.float16, sliding_window=128, max_position_embeddings=256)
    prompt = np.random.default_rng(13).integers(0, 256, 200)
    g = 173  # wrapped: origin_logical 45, rotation 45
    live = live_run(model, prompt, [g], chunk=9, tmp_path=tmp_path)
    path, expect = live[g]
    cache = muser_kv.load_session(path, model)
    for i, c in enumerate(cache):
        ring = c.ring
        if ring.origin_physical == 0:
            continue
        start, k, v = c.snapshot()
        packed = Ring(ring.capacity, ring.len, start, 0, ring.layer)
        flat = (ring.len, c.kv_dim)
        pk, pv = c.backend.install(k.reshape(flat), v.reshape(flat), c.layout, packed,
                                   tuple(c.keys.shape))
        meta = list(c.meta_state)
        meta[10] = "0"  # origin_physical 0: the rows packed from row 0
        cache[i] = muser_kv.MuseKVCache.from_state((pk, pv), tuple(meta))
    muser_kv.caches.cachelist.bind(cache)  # the new caches form the list
    got = continue_logits(model, cache, prompt[g:g + CONTINUE].tolist())
    if attention == "muser":
        np.testing.assert_array_equal(got.view(np.uint32), expect.view(np.uint32))
        return
    assert not np.array_equal(got.view(np.uint32), expect.view(np.uint32))
    np.testing.assert_allclose(got, expect, atol=0.1)  # same numbers, other summation order
