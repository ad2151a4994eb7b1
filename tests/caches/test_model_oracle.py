"""The real client: mlx-lm's Muse Glimmer model driven by mlx-lm's own
generate_step, with our cache against mlx-lm's caches (outputs) and a numpy
full-history oracle (cache contents, bitwise, after every update)."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.generate import generate_step
from oracle import FullHistory, bits

import muser_kv

# Logit tolerances. Our planes are f16 by contract; an f32 model's mlx-lm cache
# keeps K/V in f32, so every K/V element differs by up to one f16 rounding
# (relative 2^-11 ~ 4.9e-4) and attention sums rows in another order; through
# 8 layers and a softcapped head that moves log-probabilities by ~1e-3 here.
# For an f16 model both caches store the same f16 bits and differ only in
# summation order (ring rotation vs concatenation), ~f16 epsilon on logits of
# magnitude ~5 after f16 matmuls. The bounds below are a few times what was
# observed and far below the gaps between competing tokens we compare.
TOLERANCE = {mx.float32: 1e-2, mx.float16: 6e-2}


class Tap:
    """Wraps one of our caches; records every update in the oracle and checks
    the cache's logical contents against it, bitwise, after each update."""

    def __init__(self, cache: muser_kv.MuseKVCache, checks: list):
        self._cache = cache
        self.oracle = FullHistory(cache.window)
        self._checks = checks

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def update_and_fetch(self, keys, values):
        out = self._cache.update_and_fetch(keys, values)
        self.oracle.append(keys, values)
        start, k, v = self._cache.snapshot()
        s, ok, ov = self.oracle.live()
        assert start == s and self._cache.offset == self.oracle.position
        np.testing.assert_array_equal(bits(k), bits(ok))
        np.testing.assert_array_equal(bits(v), bits(ov))
        self._checks.append(self._cache.layer)
        return out


def generate(model, cache, prompt, chunk, n):
    toks, lps = [], []
    for t, lp in generate_step(prompt, model, prompt_cache=cache, max_tokens=n,
                               prefill_step_size=chunk):
        toks.append(t)
        lps.append(np.array(lp.astype(mx.float32)))
    return toks, lps


def forced(model, cache, prompt, chunk, tokens):
    """mlx-lm's caches fed exactly what generate_step fed ours (the same prefill
    chunks, then our tokens one by one): log-probabilities at every step."""
    rest = prompt
    while rest.size > 1:
        n = min(chunk, rest.size - 1)
        model(rest[None, :n], cache=cache)
        rest = rest[n:]
    lps = []
    for t in [rest] + [mx.array([x], mx.uint32) for x in tokens[:-1]]:
        logits = model(t[None], cache=cache)[:, -1, :]
        lps.append(np.array((logits - mx.logsumexp(logits, keepdims=True))[0].astype(mx.float32)))
    return lps


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("chunk", [5, 16, 37])
def test_generate_step_matches_mlx_lm_and_oracle(dtype, chunk):
    model = tiny_model(dtype)
    window = model.args.sliding_window
    prompt = mx.array(np.random.default_rng(chunk).integers(0, 256, 4 * window), mx.uint32)
    decode = 40  # decode runs the rings through more than two more windows
    tol = TOLERANCE[dtype]
    checks: list = []
    cache = [Tap(c, checks) for c in muser_kv.make_prompt_cache(model, max_context=160)]
    tokens, ours = generate(model, cache, prompt, chunk, decode)
    theirs = forced(model, model.make_cache(), prompt, chunk, tokens)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a, b, atol=tol, rtol=0, err_msg=f"step {step}")
        top2 = np.sort(b)[-2:]
        if top2[1] - top2[0] > tol:  # a clear winner: greedy must pick the same token
            assert tokens[step] == int(np.argmax(b)), f"step {step}: greedy token differs"
    # and mlx-lm's own greedy run agrees until its first near-tie
    theirs_tokens, _ = generate(model, model.make_cache(), prompt, chunk, decode)
    for step, (x, y) in enumerate(zip(tokens, theirs_tokens)):
        if x != y:
            top2 = np.sort(theirs[step])[-2:]
            assert top2[1] - top2[0] < tol, f"step {step}: tokens differ at a clear margin"
            break
    # every layer was checked after every forward call
    calls = -(-(len(prompt) - 1) // chunk) + decode + 1  # generate_step runs one step ahead
    assert len(checks) == calls * model.args.num_hidden_layers
    ring = cache[0].ring
    assert ring.len == window and ring.origin_logical == len(prompt) + decode - window
    assert ring.origin_physical == ring.origin_logical % window


def test_logits_match_a_full_recompute(model_f32):
    """Last-position logits after a wrapped prefill equal a cache-free forward
    over the whole sequence (the model's own windowed mask)."""
    prompt = mx.array(np.random.default_rng(3).integers(0, 256, 70), mx.uint32)
    cache = muser_kv.make_prompt_cache(model_f32, max_context=128)
    for s in range(0, 70, 23):
        logits = model_f32(prompt[None, s:s + 23], cache=cache)
    full = model_f32(prompt[None])
    np.testing.assert_allclose(np.array(logits[0, -1]), np.array(full[0, -1]),
                               atol=TOLERANCE[mx.float32], rtol=0)


@pytest.mark.slow
def test_real_window_1900_plus_512_chunk():
    """A walk on the real 2,048 window: len 1,900 + a 512 chunk advances
    both origins by 364; contents bitwise vs the oracle, logits vs mlx-lm."""
    # CPU attention over ~2k rows is the cost here: 4 layers (3 sliding, 1
    # global) and 2 query heads keep the real window affordable.
    model = tiny_model(mx.float32, sliding_window=2048, max_position_embeddings=4096,
                       num_hidden_layers=4, num_attention_heads=2)
    prompt = mx.array(np.random.default_rng(1).integers(0, 256, 2412 + 4), mx.uint32)
    checks: list = []
    ours = [Tap(c, checks) for c in muser_kv.make_prompt_cache(model, max_context=4096)]
    theirs = model.make_cache()
    for s, e in ((0, 1900), (1900, 2412), (2412, 2413), (2413, 2414)):
        a = model(prompt[None, s:e], cache=ours)
        b = model(prompt[None, s:e], cache=theirs)
        np.testing.assert_allclose(np.array(a[0, -1].astype(mx.float32)),
                                   np.array(b[0, -1].astype(mx.float32)),
                                   atol=TOLERANCE[mx.float32], rtol=0)
        if e == 2412:
            r = ours[0].ring
            assert (r.len, r.origin_logical, r.origin_physical) == (2048, 364, 364)
    assert len(checks) == 4 * 4


def test_head_major_rings_hold_the_same_contents(model_f16):
    """The optional head-major ring layout: same contents bitwise (checked after
    every update) and the same tokens as the default token-major rings."""
    prompt = mx.array(np.random.default_rng(8).integers(0, 256, 50), mx.uint32)
    runs = []
    for layout in ("token_major", "head_major"):
        checks: list = []
        cache = [Tap(c, checks) for c in
                 muser_kv.make_prompt_cache(model_f16, max_context=128, sliding_layout=layout)]
        runs.append(generate(model_f16, cache, prompt, 9, 24))
        assert cache[0].layout == layout and checks
    (t1, l1), (t2, l2) = runs
    assert t1 == t2
    np.testing.assert_allclose(np.stack(l1), np.stack(l2), atol=TOLERANCE[mx.float16], rtol=0)
