"""The trim contract against every mlx-lm caller that trims: speculative
decoding (any draft length up to ``retain``, or an up-front refusal),
``trim_prompt_cache`` / ``can_trim_prompt_cache``, and deep copies (the server's
prompt cache copies the lists it reuses); and ``install``, the hook that makes
mlx-lm's own ``make_prompt_cache`` build muser-kv caches."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from helpers import live_bits, noisy_copy
from local_tokenizer import tokenizer
from mlx_lm.generate import generate_step, speculative_generate_step, stream_generate
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

import muser_kv

CONTEXT = 160


@pytest.fixture(scope="module")
def target():
    return tiny_model(mx.float32)


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, 0.002, 3)  # agrees now and then: rounds accepted and rolled back


def greedy(model, prompt, n, **kw):
    cache = muser_kv.make_prompt_cache(model, CONTEXT, **kw)
    return [t for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache)]


@pytest.mark.parametrize("num_draft", [2, 8, 20])
def test_speculative_decoding_with_the_default_retain_equals_greedy(target, draft, num_draft):
    """With muser-kv caches on the model and the draft (default ``retain``), every
    round's rollback is exact, for drafts longer than the window (16) too."""
    prompt = mx.array(np.random.default_rng(11).integers(0, 256, 24), mx.uint32)
    n = 2 * target.args.sliding_window + 8  # the rings wrap twice, every round rolls back
    cache = muser_kv.make_prompt_cache(target, CONTEXT) + muser_kv.make_prompt_cache(draft, CONTEXT)
    out = list(speculative_generate_step(prompt, target, draft, prompt_cache=cache, max_tokens=n,
                                         num_draft_tokens=num_draft, prefill_step_size=9))
    assert [t for t, _, _ in out] == greedy(target, prompt, n)
    accepted = sum(a for _, _, a in out)
    assert 0 < accepted < n  # rounds were both accepted and rolled back
    assert cache[0].ring.wrapped


def test_retain_zero_is_refused_before_the_first_token(target, draft):
    """A ring that keeps nothing is untrimmable from the start, so mlx-lm's
    speculative decoding refuses it up front instead of yielding wrong tokens
    once the ring wraps (what it did when ``is_trimmable`` flipped at the wrap)."""
    cache = (muser_kv.make_prompt_cache(target, CONTEXT, retain=0)
             + muser_kv.make_prompt_cache(draft, CONTEXT))
    assert not cache[0].ring.wrapped and not can_trim_prompt_cache(cache[:8])
    gen = speculative_generate_step(mx.array([1, 2, 3], mx.uint32), target, draft,
                                    prompt_cache=cache, num_draft_tokens=2)
    with pytest.raises(ValueError, match="trimmable"):
        next(gen)
    assert all(c.offset == 0 for c in cache)  # refused before any prefill


def test_trim_prompt_cache_on_an_untrimmable_list_changes_nothing(target):
    cache = muser_kv.make_prompt_cache(target, CONTEXT, retain=0)
    target(mx.array([list(range(10))]), cache=cache)  # not wrapped yet (window 16)
    before = live_bits(cache)
    assert not can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, 3) == 0  # mlx-lm's answer for an untrimmable list
    after = live_bits(cache)
    for a, b in zip(before, after):
        assert a[:2] == b[:2]
        np.testing.assert_array_equal(a[2], b[2])


def test_trim_beyond_the_depth_is_refused_before_any_layer_changes(target):
    cache = muser_kv.make_prompt_cache(target, CONTEXT, retain=4)
    target(mx.array([list(range(40))]), cache=cache)  # wrapped: depth 4
    assert can_trim_prompt_cache(cache)
    assert min(c.trimmable_depth() for c in cache) == 4
    before = live_bits(cache)
    with pytest.raises(ValueError, match="at most 4"):
        trim_prompt_cache(cache, 5)
    for a, b in zip(before, live_bits(cache)):
        assert a[:2] == b[:2]
        np.testing.assert_array_equal(a[2], b[2])
    assert trim_prompt_cache(cache, 4) == 4


def test_install_makes_mlx_lms_own_paths_build_muser_kv_caches(target, draft):
    """``install`` on both models: mlx-lm's ``stream_generate`` with a draft model
    builds muser-kv caches itself (``make_prompt_cache(model)``) and decodes
    speculatively past the wrap exactly (mlx-lm's own rotating caches stop
    trimming there); a draft longer than the default ``retain`` is sized by
    ``num_draft_tokens``."""
    num_draft = 80  # longer than the default retain (64)
    prompt = [5, 9, 200, 17, 3, 3, 41]
    n = 3 * target.args.sliding_window
    tok = tokenizer(target.args.vocab_size)
    try:
        for m in (target, draft):
            muser_kv.install(m, max_context=CONTEXT, num_draft_tokens=num_draft)
        out = [r.token for r in stream_generate(target, tok, prompt, max_tokens=n,
                                                draft_model=draft, num_draft_tokens=4)]
        cache = make_prompt_cache(target)
        assert isinstance(cache[0], muser_kv.SlidingKVCache) and cache[0].retain == num_draft
        assert cache[0].max_context == CONTEXT
        target(mx.array([list(range(50))]), cache=cache)  # wrapped
        before = live_bits(cache)
        target(mx.array([list(range(num_draft))]), cache=cache)  # a block, all rejected
        assert trim_prompt_cache(cache, num_draft) == num_draft  # the deepest rollback
        for a, b in zip(before, live_bits(cache)):
            assert a[:2] == b[:2]
            np.testing.assert_array_equal(a[2], b[2])
            np.testing.assert_array_equal(a[3], b[3])
    finally:
        for m in (target, draft):
            muser_kv.uninstall(m)
    assert out == greedy(target, mx.array(prompt, mx.uint32), n)
    assert not isinstance(make_prompt_cache(target)[0], muser_kv.MuseKVCache)  # uninstalled


def test_install_refuses_what_it_cannot_serve(target):
    from mlx_lm.models import llama

    llama_model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=64))
    with pytest.raises(muser_kv.UnsupportedModel, match="has no sliding-window layers"):
        muser_kv.install(llama_model)
    assert muser_kv.installed(llama_model) is None
    with pytest.raises(ValueError, match="retain=0"):
        muser_kv.install(target, retain=0, num_draft_tokens=4)
    with pytest.raises(ValueError, match="sliding_layout"):
        muser_kv.install(target, sliding_layout="diagonal")
    assert muser_kv.installed(target) is None  # nothing was set by a refused install


def test_a_deep_copied_list_is_independent_exact_and_one_unit(target):
    """What the server's prompt cache does with an entry it reuses."""
    cache = muser_kv.make_prompt_cache(target, CONTEXT)
    target(mx.array([list(range(30))]), cache=cache)  # wrapped
    for t in (3, 4, 5):
        target(mx.array([[t]]), cache=cache)
    copied = copy.deepcopy(cache)
    before = live_bits(cache)
    assert [c.trimmable_depth() for c in copied] == [c.trimmable_depth() for c in cache]
    a = target(mx.array([[7]]), cache=copied)
    b = target(mx.array([[7]]), cache=cache)
    np.testing.assert_array_equal(np.array(a), np.array(b))  # same state, same logits
    trim_prompt_cache(copied, 3)  # the copy moves; the original does not
    assert copied[0].offset == cache[0].offset - 3
    assert live_bits(cache)[0][0] != before[0][0]  # (the original took token 7 itself)
    with pytest.raises(muser_kv.CacheOutOfStep):
        copied[1].update_and_fetch(*[mx.zeros((1, 2, 1, 128))] * 2)  # the copy is one list
