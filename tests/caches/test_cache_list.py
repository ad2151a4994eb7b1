"""A cache list is one unit (issue #10, items 8 and 10): a trim over it is all
or nothing whatever order its layer kinds come in, a list whose layers disagree
on position refuses every write, and a model that does not fit the list is
refused before anything is written. Through the public API only: mlx-lm's own
trim_prompt_cache and model forward, make_prompt_cache, update_and_fetch."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import trim_prompt_cache
from oracle import bits

import muser_kv
from muser_kv import CacheDiscontinuity, CacheListMismatch, CacheOutOfStep, LayerKind

CONTEXT = 128
GLOBAL_FIRST = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def state(cache):
    """Everything a refused operation must leave as it was."""
    return [(c.offset, c.meta_state, bits(c.keys).copy(), bits(c.values).copy())
            for c in cache]


def assert_state(cache, before):
    for c, (offset, meta, k, v) in zip(cache, before):
        assert c.offset == offset and c.meta_state == meta, c
        np.testing.assert_array_equal(bits(c.keys), k)
        np.testing.assert_array_equal(bits(c.values), v)


def prompt(n, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, 256, n)[None], mx.uint32)


@pytest.fixture(scope="module")
def global_first():
    return tiny_model(num_hidden_layers=4, layer_types=GLOBAL_FIRST)


# -- item 8: a trim over a list is all or nothing ------------------------------------


def test_a_refused_trim_prompt_cache_changes_no_layer(global_first):
    """Global, sliding, sliding, global: mlx-lm trims layer 0 (global, can) first;
    layer 1 (a wrapped ring retaining 2 rows) cannot trim 10. Before the fix the
    global layer was trimmed anyway: offsets [20, 30, 30, 30]."""
    cache = muser_kv.make_prompt_cache(global_first, CONTEXT, retain=2)
    global_first(prompt(30), cache=cache)
    mx.eval([c.state for c in cache])
    before = state(cache)
    with pytest.raises(ValueError, match=r"layer 1: can trim at most 2 tokens exactly, asked for 10"):
        trim_prompt_cache(cache, 10)
    assert [c.offset for c in cache] == [30, 30, 30, 30]
    assert_state(cache, before)
    # still one list in step: the next write is accepted and trims that fit still work
    global_first(prompt(1, seed=1), cache=cache)
    assert trim_prompt_cache(cache, 1) == 1
    assert [c.offset for c in cache] == [30, 30, 30, 30]


@pytest.mark.parametrize("layer_types", [GLOBAL_FIRST, None])
def test_trim_prompt_cache_is_exact_in_any_layer_order(layer_types):
    kw = dict(num_hidden_layers=4, layer_types=layer_types) if layer_types else {}
    model = tiny_model(**kw)
    cache = muser_kv.make_prompt_cache(model, CONTEXT)
    # the state at 33 is kept, then 7 more tokens are trimmed away again: the
    # cache must be that state, bit for bit (rings put back what the 7 overwrote)
    model(prompt(40)[:, :33], cache=cache)
    mx.eval([c.state for c in cache])
    at33 = [(c.meta_state, c.snapshot()) for c in cache]
    model(prompt(40)[:, 33:], cache=cache)
    assert [c.offset for c in cache] == [40] * len(cache)
    assert trim_prompt_cache(cache, 7) == 7
    for a, (meta, (start, k, v)) in zip(cache, at33):
        assert a.meta_state == meta
        got = a.snapshot()
        assert got[0] == start
        np.testing.assert_array_equal(bits(got[1]), bits(k))
        np.testing.assert_array_equal(bits(got[2]), bits(v))


def test_a_list_out_of_step_refuses_every_write(global_first):
    """A trim of one layer only (legal: the round is open) leaves the list out of
    step; every layer then refuses to write, through the model or alone, with a
    CacheDiscontinuity, and nothing changes. Finishing the round heals it."""
    cache = muser_kv.make_prompt_cache(global_first, CONTEXT)
    global_first(prompt(30), cache=cache)
    mx.eval([c.state for c in cache])
    cache[0].trim(2)
    assert [c.offset for c in cache] == [28, 30, 30, 30]
    before = state(cache)
    with pytest.raises(CacheDiscontinuity, match="out of step"):
        global_first(prompt(1), cache=cache)
    assert_state(cache, before)
    k = mx.zeros((1, 2, 1, 128), mx.float16)
    for c in cache:
        with pytest.raises(CacheOutOfStep, match="refuses every write"):
            c.update_and_fetch(k, k)
    assert_state(cache, before)
    for c in cache[1:]:
        c.trim(2)
    assert [c.offset for c in cache] == [28] * 4
    global_first(prompt(1), cache=cache)
    assert [c.offset for c in cache] == [29] * 4


def test_a_trim_of_another_size_mid_round_is_refused(global_first):
    cache = muser_kv.make_prompt_cache(global_first, CONTEXT)
    global_first(prompt(30), cache=cache)
    cache[0].trim(2)
    before = state(cache)
    with pytest.raises(CacheOutOfStep):
        cache[1].trim(3)  # the list would end at three positions
    assert_state(cache, before)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(1, 9), st.integers(0, 4)),  # n tokens, layers reached
    st.tuples(st.just("trim"), st.integers(0, 12), st.integers(0, 3))),  # n, first layer trimmed
    min_size=1, max_size=14))
def test_random_partial_writes_and_trims_never_leave_three_positions(ops):
    """Whatever a careless driver does -- writes that stop part-way down the list,
    trims of some layers -- the list holds at most two positions, laid out as a
    prefix and the rest, and every refused call changes nothing."""
    geo = muser_kv.MuseGeometry(num_layers=4, window=8, max_context=96, num_heads=2,
                                kv_heads=2, head_dim=16,
                                layer_kinds=[LayerKind(t) for t in GLOBAL_FIRST])
    cache = muser_kv.make_cache_for(geo, retain=4)
    rng = np.random.default_rng(0)
    for op, n, reach in ops:
        before = state(cache)
        try:
            if op == "write":
                k = mx.array(rng.standard_normal((1, 2, n, 16)).astype(np.float16))
                for c in cache[:reach]:
                    if c.offset + n > 96:
                        break
                    c.update_and_fetch(k, k)
            else:
                for c in cache[reach:]:
                    c.trim(n)
        except ValueError:
            pass  # refused (CacheOutOfStep, trim depth, ContextOverflow): see below
        positions = [c.offset for c in cache]
        levels = sorted(set(positions))
        assert len(levels) <= 2, positions
        if len(levels) == 2:  # a prefix at one level, the rest at the other
            head = positions[0]
            cut = next(i for i, p in enumerate(positions) if p != head)
            assert all(p != head for p in positions[cut:]), positions
        del before


# -- item 10: a list handed to a model it does not fit --------------------------------


@pytest.mark.parametrize("layers", [12, 4])
def test_a_model_that_does_not_fit_the_list_is_refused_before_any_write(model_f32, layers):
    """Built for 8 layers: a 12-layer model would run only 8 (zip), a 4-layer
    model would leave layers 4..7 behind. Both are refused at the model's first
    make_mask, before any layer writes."""
    cache = muser_kv.make_prompt_cache(model_f32, CONTEXT)
    model_f32(prompt(5), cache=cache)
    before = state(cache)
    other = tiny_model(num_hidden_layers=layers)
    with pytest.raises(CacheListMismatch,
                       match=rf"built for 8 caches .* of a 8-layer model.*model with {layers} layers"):
        other(prompt(3), cache=cache)
    assert_state(cache, before)
    model_f32(prompt(1), cache=cache)  # the right model still runs
    assert all(c.offset == 6 for c in cache)


def test_a_model_with_another_layer_pattern_is_refused(model_f32):
    cache = muser_kv.make_prompt_cache(model_f32, CONTEXT)
    other = tiny_model(layer_types=["full_attention"] + ["sliding_attention"] * 7)
    before = state(cache)
    with pytest.raises(CacheListMismatch, match=r"layer 0 is a sliding_attention cache"):
        other(prompt(3), cache=cache)
    assert_state(cache, before)


def test_a_driver_that_runs_part_of_the_list_is_refused_at_its_next_call():
    """What the protocol cannot see at once (a driver that calls update_and_fetch
    itself on the first 4 of 8 layers) is refused at the next call, before that
    call writes anything."""
    geo = muser_kv.MuseGeometry(num_layers=8, window=8, max_context=64, num_heads=2,
                                kv_heads=2, head_dim=16)
    cache = muser_kv.make_cache_for(geo)
    k = mx.ones((1, 2, 3, 16), mx.float16)
    for c in cache[:4]:
        c.make_mask(3, window_size=c.window)
        c.update_and_fetch(k, k)
    before = state(cache)
    with pytest.raises(CacheOutOfStep, match=r"layer 0 .*last layer at 0"):
        cache[0].make_mask(1, window_size=8)
    with pytest.raises(CacheOutOfStep):
        cache[0].update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert_state(cache, before)
    for c in cache[4:]:  # finishing the interrupted write is what the list accepts
        c.update_and_fetch(k, k)
    assert all(c.offset == 3 for c in cache)


def test_lists_from_separate_calls_are_separate(model_f32):
    """mlx-lm's speculative decoding concatenates the target's and the draft's
    lists and drives each part alone: each part is its own list."""
    target = muser_kv.make_prompt_cache(model_f32, CONTEXT)
    draft_model = tiny_model(num_hidden_layers=4, seed=3)
    draft = muser_kv.make_prompt_cache(draft_model, CONTEXT)
    both = target + draft
    model_f32(prompt(4), cache=both[:8])
    draft_model(prompt(6), cache=both[8:])
    assert [c.offset for c in both] == [4] * 8 + [6] * 4
    assert trim_prompt_cache(both[8:], 2) == 2
    draft_model(prompt(1), cache=both[8:])
    model_f32(prompt(1), cache=both[:8])


# -- a slice of a list, used or fresh, is refused before any write ---------

#: slices of an 8-layer list: a prefix (what mlx-lm's zip would run short), a
#: suffix, a middle, every other layer, the list reversed
SLICES = {"c[:4]": slice(None, 4), "c[4:]": slice(4, None), "c[2:6]": slice(2, 6),
          "c[::2]": slice(None, None, 2), "c[::-1]": slice(None, None, -1)}


def used_list(model, n=40):
    cache = muser_kv.make_prompt_cache(model)  # the user's defaults
    if n:
        mx.eval(model(mx.array([list(range(1, n + 1))]), cache=cache))
    return cache


@pytest.mark.parametrize("used", [40, 0], ids=["used", "fresh"])
@pytest.mark.parametrize("cut", SLICES)
def test_a_slice_of_a_list_is_refused_before_any_layer_writes(model_f32, used, cut):
    """The issue's case: c[:4] of a used 8-layer list ran 4 layers (wrong logits)
    and left the list [41]*4 + [40]*4. Every slice, of a used list or a fresh
    one, is refused before a layer writes; the whole list then runs on as if
    the slice had never been handed."""
    cache = used_list(model_f32, used)
    twin = used_list(model_f32, used)
    before = state(cache)
    with pytest.raises(CacheListMismatch):
        model_f32(mx.array([[7]]), cache=cache[SLICES[cut]])
    with pytest.raises(CacheListMismatch):  # a chunk as well as one token
        model_f32(prompt(3), cache=cache[SLICES[cut]])
    assert_state(cache, before)
    assert [c.offset for c in cache] == [used] * 8
    got, want = model_f32(mx.array([[7]]), cache=cache), model_f32(mx.array([[7]]), cache=twin)
    np.testing.assert_array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))


@pytest.mark.parametrize("cut", SLICES)
def test_a_slice_of_a_list_a_write_stopped_in_is_refused(model_f32, cut):
    """Whatever the list's history: [41]*4 + [40]*4 (a driver wrote its first 4
    layers) accepts the write that finishes it from a driver, but a model handed
    c[4:] would run its layers 0..3 on caches 4..7: refused before it writes."""
    cache = part_written(model_f32)
    before = state(cache)
    for tokens in (mx.array([[7]]), prompt(3)):
        with pytest.raises(CacheListMismatch):
            model_f32(tokens, cache=cache[SLICES[cut]])
    assert_state(cache, before)


def test_a_prefix_slice_names_the_list_it_cuts(model_f32):
    cache = used_list(model_f32)
    with pytest.raises(CacheListMismatch, match=r"handed 4 caches \(list indices \[0, 1, 2, 3\]\) "
                                                r"of a KV cache list of 8 .*hand the whole list"):
        model_f32(mx.array([[7]]), cache=cache[:4])


@pytest.mark.parametrize("used", [40, 0], ids=["used", "fresh"])
def test_generate_step_on_a_slice_writes_no_layer(model_f32, used):
    """mlx-lm's generate_step(..., prompt_cache=c[:4]) wrote half the list in its
    first forward before CacheOutOfStep came."""
    from mlx_lm.generate import generate_step

    cache = used_list(model_f32, used)
    before = state(cache)
    with pytest.raises(CacheListMismatch):
        next(generate_step(mx.array(list(range(50, 60))), model_f32, prompt_cache=cache[:4]))
    assert_state(cache, before)
    next(generate_step(mx.array([7]), model_f32, prompt_cache=cache))  # the whole list runs
    assert len({c.offset for c in cache}) == 1 and cache[0].offset > used


class Wrapped:
    """A user's wrapper around a cache (logging, say): it hands every call on,
    so ``make_mask`` runs one frame further from mlx-lm's mask helper."""

    def __init__(self, cache):
        self.inner = cache

    def make_mask(self, *args, **kwargs):
        return self.inner.make_mask(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("cut", SLICES)
def test_a_wrapper_between_the_model_and_the_cache_keeps_a_slice_refused(model_f32, cut):
    """The model is found however many wrappers (a few) stand between mlx-lm's
    mask helper and the cache's make_mask: no wrapper turns the check off."""
    cache = used_list(model_f32)
    twin = used_list(model_f32)
    wrapped = [Wrapped(Wrapped(c)) for c in cache]
    before = state(cache)
    with pytest.raises(CacheListMismatch):
        model_f32(prompt(3), cache=wrapped[SLICES[cut]])
    assert_state(cache, before)
    other = tiny_model(num_hidden_layers=12)
    with pytest.raises(CacheListMismatch, match="model with 12 layers"):
        other(prompt(3), cache=wrapped + [None] * 4)
    assert_state(cache, before)
    got, want = model_f32(mx.array([[7]]), cache=wrapped), model_f32(mx.array([[7]]), cache=twin)
    np.testing.assert_array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))


def part_written(model):
    """A used list that a driver wrote on its first 4 layers only: out of step."""
    cache = used_list(model)
    k = mx.ones((1, 2, 1, 128), mx.float16)
    for c in cache[:4]:
        c.update_and_fetch(k, k)
    mx.eval([c.state for c in cache])
    return cache


def part_trimmed(model):
    """A used list whose first layer alone was trimmed (a trim round left open)."""
    cache = used_list(model)
    cache[0].trim(2)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("make", [part_written, part_trimmed])
def test_trim_prompt_cache_refuses_a_list_out_of_step(model_f32, make):
    """trim_prompt_cache(c, 1) on [41]*4 + [40]*4 returned 1 and left
    [40]*4 + [39]*4. A list out of step is not trimmable: mlx-lm's
    trim_prompt_cache returns 0 and changes nothing."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    cache = make(model_f32)
    before = state(cache)
    assert not can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, 1) == 0
    assert_state(cache, before)
    # an in-step list is trimmable as ever
    fresh = used_list(model_f32)
    assert can_trim_prompt_cache(fresh) and trim_prompt_cache(fresh, 1) == 1


@pytest.mark.parametrize("cut", ["c[:4]", "c[4:]", "c[::-1]"])
def test_a_session_of_a_slice_is_refused_at_save(model_f32, tmp_path, cut):
    """save_session(path, c[:4]) wrote a 4-layer file that loading refused:
    refused at save now, before the disk is touched; so is a snapshot, and a
    restore into a slice."""
    cache = used_list(model_f32)
    path = tmp_path / "s.safetensors"
    with pytest.raises(CacheListMismatch, match=r"a session of a KV cache list: handed"):
        muser_kv.save_session(path, cache[SLICES[cut]])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CacheListMismatch):
        muser_kv.SessionSnapshot.capture(cache[SLICES[cut]])
    snapshot = muser_kv.SessionSnapshot.capture(cache)
    before = state(cache)
    with pytest.raises(CacheListMismatch):
        muser_kv.restore_into(cache[SLICES[cut]], snapshot)
    assert_state(cache, before)
    muser_kv.save_session(path, cache)  # the whole list saves and loads
    loaded = muser_kv.load_session(path, model_f32)
    assert [c.offset for c in loaded] == [40] * 8
