"""Speculative rollback past the wrap: mlx-lm's own speculative_generate_step
with our cache yields exactly the tokens of plain greedy generation, and the
checkpoint API undoes a block bit for bit without copying a plane."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from helpers import noisy_copy
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import trim_prompt_cache
from oracle import bits

import muser_kv

CONTEXT = 128


@pytest.fixture(scope="module")
def target():
    return tiny_model(mx.float32)


@pytest.mark.parametrize("draft_kind,num_draft",
                         [("independent", 3), ("same", 4), ("noisy", 2), ("noisy", 5)])
def test_speculative_generate_equals_greedy_past_the_wrap(target, draft_kind, num_draft):
    window = target.args.sliding_window
    draft = {"independent": lambda: tiny_model(mx.float32, seed=7, num_hidden_layers=4),
             "same": lambda: target,
             "noisy": lambda: noisy_copy(target, 0.02, 3)}[draft_kind]()
    prompt = mx.array(np.random.default_rng(5).integers(0, 256, 20), mx.uint32)
    n = 4 * window  # the rings wrap more than three times during generation
    greedy = [t for t, _ in generate_step(prompt, target, max_tokens=n,
                                          prompt_cache=muser_kv.make_prompt_cache(target, CONTEXT))]
    cache = muser_kv.make_prompt_cache(target, CONTEXT) + muser_kv.make_prompt_cache(draft, CONTEXT)
    out = list(speculative_generate_step(prompt, target, draft, prompt_cache=cache, max_tokens=n,
                                         num_draft_tokens=num_draft, prefill_step_size=7))
    assert [t for t, _, _ in out] == greedy
    accepted = sum(a for _, _, a in out)
    if draft_kind == "same":
        assert accepted >= n // 2
    if draft_kind == "independent":
        assert accepted < n // 4  # nearly every block was rolled back
    assert cache[0].ring.wrapped and cache[0].offset >= len(prompt) + n - 1


def state_bits(cache):
    """Ring planes whole (every row is live and the rotation is data); growing
    planes by their live rows (rollback rewinds their metadata only, so rows past
    the end keep whatever the undone block wrote, never read)."""
    out = []
    for c in cache:
        if c.ring.len == c.ring.capacity:
            k, v = c.keys, c.values
        else:
            _, k, v = c.snapshot()
        out.append((c.meta_state, bits(k).copy(), bits(v).copy()))
    return out


def assert_same_state(a, b):
    for (m1, k1, v1), (m2, k2, v2) in zip(a, b):
        assert m1 == m2
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)


def test_checkpoint_rollback_restores_every_bit(target):
    cache = muser_kv.make_prompt_cache(target, CONTEXT)
    prompt = mx.array(np.random.default_rng(1).integers(0, 256, 40), mx.uint32)
    target(prompt[None], cache=cache)  # wrapped: 40 > window 16
    target(prompt[None, :1], cache=cache)  # one decode token: the ring is rotated
    mx.eval([c.state for c in cache])
    before = state_bits(cache)
    for block in (1, 3, 16):
        cp = muser_kv.checkpoint(cache, block)
        target(prompt[None, :block], cache=cache)
        # what the rings hold: `retain` overwritten rows, a block of `retain` copied
        # ahead, and at most one older block on its way out -- never a plane
        assert cp.nbytes <= 3 * sum(c.retain for c in cache) * 256 * 2 * 2
        assert cp.rollback() == block
        assert_same_state(state_bits(cache), before)
    # the block can also be written token by token (the draft model's way)
    cp = muser_kv.checkpoint(cache, 4)
    for t in range(4):
        target(prompt[None, t:t + 1], cache=cache)
    cp.rollback()
    assert_same_state(state_bits(cache), before)
    # and mlx-lm's own trim gets the same exactness
    target(prompt[None, :5], cache=cache)
    assert trim_prompt_cache(cache, 5) == 5
    assert_same_state(state_bits(cache), before)


def test_checkpoint_commit_keeps_the_block(target):
    cache = muser_kv.make_prompt_cache(target, CONTEXT)
    target(mx.array([[1, 2, 3] * 7]), cache=cache)
    cp = muser_kv.checkpoint(cache, 4)
    target(mx.array([[4, 5]]), cache=cache)
    cp.commit()
    assert cache[0].offset == 23
    with pytest.raises(RuntimeError, match="already"):
        cp.rollback()


def test_checkpoint_refusals_change_nothing(target):
    cache = muser_kv.make_prompt_cache(target, CONTEXT)
    target(mx.array([list(range(30))]), cache=cache)
    with pytest.raises(ValueError, match=r"block_len must be in \[1, 16\]"):
        muser_kv.checkpoint(cache, 17)
    short = muser_kv.make_prompt_cache(target, CONTEXT, retain=2)
    muser_kv.checkpoint(short, 3).commit()  # nothing to overwrite yet: undoable
    target(mx.array([list(range(30))]), cache=short)  # full rings: 3 tokens overwrite 3 rows
    with pytest.raises(ValueError, match="retains 2 rows and can undo a block of at most 2"):
        muser_kv.checkpoint(short, 3)
    cp = muser_kv.checkpoint(cache, 2)
    target(mx.array([[1, 2, 3]]), cache=cache)  # wrote more than the block
    before = state_bits(cache)
    with pytest.raises(RuntimeError, match="more than its block of 2"):
        cp.rollback()
    assert_same_state(state_bits(cache), before)


def test_trim_beyond_retained_depth_is_refused(target):
    cache = muser_kv.make_prompt_cache(target, CONTEXT, retain=3)
    target(mx.array([list(range(40))]), cache=cache)
    assert cache[0].trimmable_depth() == 3 and cache[3].trimmable_depth() == 40
    with pytest.raises(ValueError, match="at most 3"):
        cache[0].trim(4)


def test_rows_retained_from_a_chunk_hold_no_shadow():
    """A draft block written as one chunk into a full ring is attended through
    the staging shadow; the rows it overwrites are retained as copies taken from
    that shadow. Those copies are evaluated with attention, so once attention's
    result exists nothing still holds the shadow (left lazy, each ring's copy
    kept its whole [window + B, H*D] shadow alive: 2 MiB per ring here)."""
    geo = muser_kv.MuseGeometry(num_layers=4, window=2048, max_context=4096)
    cache = muser_kv.make_cache_for(geo, preallocate=True)  # (a growth would hold memory too)
    h, d = geo.kv_heads, geo.head_dim
    fill = mx.random.normal((1, h, 2048, d)).astype(mx.float16)
    for c in cache:
        c.update_and_fetch(fill, fill)
    mx.eval([c.state for c in cache])
    del fill
    block = mx.random.normal((1, h, 8, d)).astype(mx.float16)
    q = mx.random.normal((1, 4, 8, d)).astype(mx.float16)
    mx.eval(block, q)
    before = mx.get_active_memory()
    outs = []
    for c in cache:
        mask = c.make_mask(8, window_size=geo.window if c.kind is muser_kv.LayerKind.SLIDING
                           else None, return_array=True)
        k, v = c.update_and_fetch(block, block)
        outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask))
        del k, v
    mx.eval(outs)
    mx.synchronize()  # on the GPU, MLX frees a finished kernel's inputs after eval returns
    held = mx.get_active_memory() - before
    retained = sum(c.retained_nbytes for c in cache)
    shadow = (2048 + 8) * h * d * 2 * 2  # one ring's K and V shadows
    assert sum(c.ring.len for c in cache) == 3 * 2048 + 2048 + 8
    assert held < retained + sum(o.nbytes for o in outs) + shadow // 2, (held, retained)


# -- issue #10, item 6: the depth is exact when the window is smaller than retain --


def ring_cache(window=8, retain=16, max_context=64):
    geo = muser_kv.MuseGeometry(num_layers=1, window=window, max_context=max_context,
                                num_heads=2, kv_heads=2, head_dim=16,
                                layer_kinds=(muser_kv.LayerKind.SLIDING,))
    return muser_kv.make_cache_for(geo, retain)


def token(i, n=1):
    rng = np.random.default_rng(100 + i)
    return mx.array(rng.standard_normal((1, 2, n, 16)).astype(np.float16))


def fed(tokens, **kw):
    cache = ring_cache(**kw)
    for t in tokens:
        cache[0].update_and_fetch(t, t)
    return cache


def same_rows(a, b):
    assert a[0].meta_state == b[0].meta_state
    for x, y in zip(a[0].snapshot()[1:], b[0].snapshot()[1:]):
        np.testing.assert_array_equal(bits(x), bits(y))
    ring = a[0].ring
    if ring.len == ring.capacity:  # every row live: the rotation is data too
        rows = ring.capacity
        np.testing.assert_array_equal(bits(a[0].keys[:rows]), bits(b[0].keys[:rows]))


def test_depth_is_exact_when_the_window_is_smaller_than_retain():
    """Window 8, retain 16, 20 single tokens: every row overwritten is held, so
    all 20 can be trimmed; before the fix the depth said 8, trim(12) was
    refused, and checkpoint(cache, 12) was accepted but could not roll back."""
    toks = [token(i) for i in range(40)]
    cache = fed(toks[:20])
    assert cache[0].trimmable_depth() == 20
    assert cache[0].trim(12) == 12
    same_rows(cache, fed(toks[:8]))
    # a block of 12 from position 10 (rows free, then retained): undone exactly
    cache = fed(toks[:10])
    before = state_bits(cache)
    cp = muser_kv.checkpoint(cache, 12)
    for t in toks[10:22]:
        cache[0].update_and_fetch(t, t)
    assert cp.rollback() == 12
    assert_same_state(state_bits(cache), before)


@settings(max_examples=60, deadline=None)
@given(window=st.sampled_from([4, 8, 16]), retain=st.sampled_from([1, 4, 16]),
       chunks=st.lists(st.integers(1, 20), min_size=1, max_size=8))
def test_the_depth_covers_retain_after_any_writes(window, retain, chunks):
    """README: trim(n) is exact for n <= retain even after the window wrapped.
    So after writes alone the depth is at least min(retain, position), and a
    trim that deep equals a cache that never saw the trimmed tokens."""
    cache, toks = ring_cache(window, retain), []
    for i, n in enumerate(chunks):
        if len(toks) + n > 64:
            break
        x = token(200 + i, n)
        cache[0].update_and_fetch(x, x)
        toks += [x[:, :, j:j + 1] for j in range(n)]
    n = min(retain, len(toks))
    assert cache[0].trimmable_depth() >= n
    cache[0].trim(n)
    same_rows(cache, fed(toks[:len(toks) - n], window=window, retain=retain))


@settings(max_examples=60, deadline=None)
@given(window=st.sampled_from([4, 8, 16]), retain=st.sampled_from([0, 2, 8, 16]),
       prefill=st.integers(0, 40), block=st.integers(1, 16),
       chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_checkpoint_accepts_only_blocks_it_can_undo(window, retain, prefill, block, chunks):
    """Whatever the window, retention, position and block: a checkpoint either
    refuses up front, or its rollback restores every bit (written one token at
    a time or in chunks, up to the block)."""
    toks = [token(i) for i in range(prefill)]
    cache = fed(toks, window=window, retain=retain)
    before = state_bits(cache)
    try:
        cp = muser_kv.checkpoint(cache, block)
    except ValueError as e:
        assert "can undo a block of at most" in str(e)
        assert_same_state(state_bits(cache), before)
        return
    written = 0
    for i, n in enumerate(chunks):
        n = min(n, block - written)
        if n == 0:
            break
        x = token(1000 + i, n)
        cache[0].update_and_fetch(x, x)
        written += n
        # the depth never under-reports what the checkpoint promises
        assert cache[0].trimmable_depth() >= written
    assert cp.rollback() == written
    assert_same_state(state_bits(cache), before)


# -- issue #10, item 7: a rollback restores the checkpoint's state or refuses ------


def prefilled(target, n=20):
    cache = muser_kv.make_prompt_cache(target, CONTEXT)
    target(mx.array(np.random.default_rng(2).integers(0, 256, n)[None], mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_rollback_refuses_after_a_trim_below_the_checkpoint(target):
    """checkpoint at 20, trim_prompt_cache(cache, 2), 3 new tokens: rolling back
    1 token would leave the new rows at 18 and 19 (it did, returning 1)."""
    cache = prefilled(target)
    cp = muser_kv.checkpoint(cache, 4)
    assert trim_prompt_cache(cache, 2) == 2
    target(mx.array([[7, 8, 9]]), cache=cache)
    before = state_bits(cache)
    with pytest.raises(RuntimeError, match=r"trimmed to position 18, below the checkpoint's "
                                           r"start 20.*the cache is unchanged"):
        cp.rollback()
    assert_same_state(state_bits(cache), before)
    assert cache[0].offset == 21


@pytest.mark.parametrize("at", [6, 20])  # rings not wrapped yet / wrapped
def test_rollback_refuses_after_a_snapshot_restore(target, at):
    """A restore replaces the session: rolling back would trim the other one
    (it did: 2 tokens off the other session, reporting success)."""
    cache = prefilled(target, at)
    other = prefilled(target, at + 2)
    snap = muser_kv.SessionSnapshot.capture(other)
    cp = muser_kv.checkpoint(cache, 4)
    target(mx.array([[1, 2]]), cache=cache)
    muser_kv.restore_into(cache, snap)
    before = state_bits(cache)
    with pytest.raises(RuntimeError, match="restored from a snapshot"):
        cp.rollback()
    assert_same_state(state_bits(cache), before)
    assert_same_state(before, state_bits(other))


def test_a_trim_inside_the_block_keeps_the_checkpoint_exact(target):
    cache = prefilled(target)
    before = state_bits(cache)
    cp = muser_kv.checkpoint(cache, 4)
    target(mx.array([[1, 2, 3]]), cache=cache)
    assert trim_prompt_cache(cache, 1) == 1  # back to 22, inside the block
    target(mx.array([[4, 5]]), cache=cache)
    assert cp.rollback() == 4
    assert_same_state(state_bits(cache), before)
