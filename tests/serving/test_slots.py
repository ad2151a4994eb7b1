"""SlotPool on the tiny Muse Glimmer (window 16): a shift rebuilds in staging
and equals a fresh prefill bit for bit; ERROR and failed rebuilds leave the live
session exactly as it was; slots never interfere; staging is never a slot; the
pool's planes are the footprint formula times slots + 1."""

import gc

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from helpers import live_bits
from oracle import bits

import muser_kv
from muser_kv import (
    ContextPolicy,
    ContextTooLong,
    LineageMismatch,
    Message,
    MuseGeometry,
    SlotPool,
    StaleSession,
    footprint,
    shift_chat,
)

CONTEXT = 64
RESERVE = 8
CHUNK = 24


@pytest.fixture(scope="module")
def model():
    return tiny_model(mx.float32)


class Conversation:
    """Deterministic messages with random token ids."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def __call__(self, role, n, image=False):
        return Message(role, tuple(int(t) for t in self.rng.integers(0, 256, n)), image)


def tokens_of(messages):
    return [t for m in messages for t in m.tokens]


def lbits(x):
    a = np.array(x)
    assert a.dtype == np.float32, a.dtype
    return a.view(np.uint32)


def state_bits(cache):
    """Every layer's ring state and whole planes as uint16 bits."""
    return [(c.meta_state, bits(c.keys).copy(), bits(c.values).copy()) for c in cache]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for p, q in zip(x, y):
            if isinstance(p, np.ndarray):
                np.testing.assert_array_equal(p, q)
            else:
                assert p == q


def fresh(model, tokens, chunk=CHUNK, context=CONTEXT):
    """A fresh cache prefilled with ``tokens`` in ``chunk``-wide chunks from 0."""
    cache = muser_kv.make_prompt_cache(model, context)
    for s in range(0, len(tokens), chunk):
        out = model(mx.array([tokens[s:s + chunk]], dtype=mx.uint32), cache=cache)
        logits = out[0, -1]
        mx.eval(logits, [c.state for c in cache])
    return logits, cache


def step(model, cache, token):
    logits = model(mx.array([[token]], dtype=mx.uint32), cache=cache)[0, -1]
    mx.eval(logits, [c.state for c in cache])
    return logits


def opening(seed=0):
    """system 6 | t1 = user 12 + assistant 10 | t2 = user 9 + tool 8 (image) | user 7:
    52 positions, + reserve 8 = 60 <= 64."""
    c = Conversation(seed)
    sys_ = c("system", 6)
    t1 = (c("user", 12), c("assistant", 10))
    t2 = (c("user", 9), c("tool", 8, image=True))
    u3 = c("user", 7)
    return c, sys_, t1, t2, u3


def pool_of(model, **kw):
    kw.setdefault("max_context", CONTEXT)
    kw.setdefault("output_reserve", RESERVE)
    kw.setdefault("prefill_chunk", CHUNK)
    return SlotPool(model, **kw)


def staging_ids(pool):
    return {id(c) for c in pool._staging}


# -- the shift ------------------------------------------------------------------------


def test_shift_rebuild_equals_fresh_prefill_bitwise(model):
    c, sys_, t1, t2, u3 = opening()
    pool = pool_of(model)
    first = [sys_, *t1, *t2, u3]
    r = pool.prefill(0, first)
    assert (r.rebuilt, r.dropped_turns, r.epoch, r.position, r.computed) == (False, 0, 0, 52, 52)
    np.testing.assert_array_equal(lbits(r.logits), lbits(fresh(model, tokens_of(first))[0]))
    decoded = [int(t) for t in c.rng.integers(0, 256, 3)]
    for t in decoded:
        pool.decode(0, t)
    assert pool.slot(0).pending == tuple(decoded) and pool.slot(0).position == 55

    a3 = Message("assistant", tuple(decoded) + (7, 9))
    u4 = c("user", 10)
    full = first + [a3, u4]  # 67 + 8 > 64: t1 must go
    r = pool.prefill(0, full)
    expected = shift_chat(full, CONTEXT, RESERVE)
    assert r.retained == expected.retained == (sys_, *t2, u3, a3, u4)
    assert (r.rebuilt, r.dropped_turns, r.epoch, r.position) == (True, 1, 1, 45)
    ref_logits, ref = fresh(model, tokens_of(r.retained))
    np.testing.assert_array_equal(lbits(r.logits), lbits(ref_logits))
    slot = pool.slot(0)
    assert (slot.epoch, slot.history, slot.pending, slot.dropped_turns) == (1, r.retained, (), 1)
    assert_same(state_bits(slot.cache), state_bits(ref))
    for t in (3, 141, 77, 5):  # the rebuilt rings continue exactly
        np.testing.assert_array_equal(lbits(pool.decode(0, t)), lbits(step(model, ref, t)))


def test_shift_of_a_first_request_and_its_continuation(model):
    c, sys_, t1, t2, u3 = opening(1)
    t0 = (c("user", 20), c("assistant", 15))
    pool = pool_of(model)
    r = pool.prefill(0, [sys_, *t0, *t1, *t2, u3])
    assert (r.dropped_turns, r.epoch, r.retained) == (1, 1, (sys_, *t1, *t2, u3))
    np.testing.assert_array_equal(lbits(r.logits), lbits(fresh(model, tokens_of(r.retained))[0]))
    a, u = c("assistant", 2), c("user", 1)  # 52 + 3 + 8 = 63: appended, no shift
    r2 = pool.prefill(0, [sys_, *t0, *t1, *t2, u3, a, u])  # the whole conversation, resent
    assert (r2.rebuilt, r2.epoch, r2.computed, r2.position) == (False, 1, 3, 55)
    _, ref = fresh(model, tokens_of(r.retained))
    ref_logits = model(mx.array([tokens_of([a, u])], dtype=mx.uint32), cache=ref)[0, -1]
    np.testing.assert_array_equal(lbits(r2.logits), lbits(ref_logits))  # one 3-token chunk


def test_error_policy_refuses_without_touching_the_slot(model):
    c, sys_, t1, t2, u3 = opening()
    pool = pool_of(model, policy=ContextPolicy.ERROR)
    pool.prefill(0, [sys_, *t1, *t2, u3])
    pool.decode(0, 11)
    pool.decode(0, 12)
    before, slot = state_bits(pool.slot(0).cache), pool.slot(0)
    too_long = [sys_, *t1, *t2, u3, Message("assistant", (11, 12)), c("user", 9)]
    with pytest.raises(ContextTooLong) as e:
        pool.prefill(0, too_long)
    assert (e.value.needed, e.value.available) == (52 + 2 + 9 + RESERVE, CONTEXT)
    assert "ContextPolicy.ERROR" in str(e.value)
    after = pool.slot(0)
    assert all(a is b for a, b in zip(after.cache, slot.cache))
    assert (after.epoch, after.history, after.pending, after.position) == (0, slot.history, (11, 12), 54)
    assert_same(state_bits(after.cache), before)
    ok = [sys_, *t1, *t2, u3, Message("assistant", (11, 12)), c("user", 1)]
    r = pool.prefill(0, ok)  # 55 + 8 = 63 fits
    assert (r.rebuilt, r.computed, r.epoch) == (False, 1, 0)


# -- failures -------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def fail_on_call(monkeypatch, n, only=None):
    """Make every regime's ``update_and_fetch`` raise on its ``n``-th call (counted
    over the caches whose ids are in ``only``, or all caches)."""
    calls = [0]
    for regime in (muser_kv.SlidingKVCache, muser_kv.GlobalKVCache):
        real = regime.update_and_fetch

        def update_and_fetch(self, keys, values, real=real):
            if only is None or id(self) in only:
                calls[0] += 1
                if calls[0] == n:
                    raise Boom(f"injected failure on call {n}")
            return real(self, keys, values)

        monkeypatch.setattr(regime, "update_and_fetch", update_and_fetch)
    return calls


@pytest.mark.parametrize("call", [3, 8 + 5])  # first chunk, and mid second chunk
def test_failure_mid_rebuild_leaves_the_live_session_unchanged(model, monkeypatch, call):
    c, sys_, t1, t2, u3 = opening()
    pool = pool_of(model)
    pool.prefill(0, [sys_, *t1, *t2, u3])
    pool.decode(0, 21)
    slot = pool.slot(0)
    before = state_bits(slot.cache)
    shifted = [sys_, *t1, *t2, u3, Message("assistant", (21, 4)), c("user", 10)]
    calls = fail_on_call(monkeypatch, call, staging_ids(pool))
    with pytest.raises(Boom):
        pool.prefill(0, shifted)
    assert calls[0] == call
    monkeypatch.undo()
    after = pool.slot(0)
    assert all(a is b for a, b in zip(after.cache, slot.cache))
    assert (after.epoch, after.history, after.pending, after.stale) == (0, slot.history, (21,), False)
    assert_same(state_bits(after.cache), before)
    assert pool.nbytes == pool.footprint.total_bytes  # staging restocked
    r = pool.prefill(0, shifted)
    assert (r.rebuilt, r.epoch, r.dropped_turns) == (True, 1, 1)
    np.testing.assert_array_equal(lbits(r.logits), lbits(fresh(model, tokens_of(r.retained))[0]))


def test_failed_decode_is_trimmed_back_exactly(model, monkeypatch):
    c, sys_, t1, t2, u3 = opening()
    pool = pool_of(model)
    pool.prefill(0, [sys_, *t1, *t2, u3])  # 52 positions: every ring wrapped
    pool.decode(0, 30)
    ref_logits, ref = fresh(model, tokens_of([sys_, *t1, *t2, u3]))
    step(model, ref, 30)
    before = live_bits(pool.slot(0).cache)
    fail_on_call(monkeypatch, 6)  # layers 0-4 wrote the token, layer 5 fails
    with pytest.raises(Boom):
        pool.decode(0, 31)
    monkeypatch.undo()
    slot = pool.slot(0)
    assert (slot.stale, slot.pending, slot.position) == (False, (30,), 53)
    assert_same(live_bits(slot.cache), before)
    for t in (31, 32):
        np.testing.assert_array_equal(lbits(pool.decode(0, t)), lbits(step(model, ref, t)))


def test_failed_append_that_cannot_be_undone_marks_the_slot_stale(model, monkeypatch):
    c, sys_, t1, t2, u3 = opening()
    pool = pool_of(model, prefill_chunk=64, retain=16)
    first = [sys_, *t1]
    pool.prefill(0, first)  # 28 positions
    more = first + [*t2, u3]  # 24 new tokens in one chunk: past the ring's retained depth (16)
    fail_on_call(monkeypatch, 6)
    with pytest.raises(Boom):
        pool.prefill(0, more)
    monkeypatch.undo()
    slot = pool.slot(0)
    assert slot.stale and slot.history == tuple(first)
    with pytest.raises(StaleSession):
        pool.decode(0, 1)
    r = pool.prefill(0, more)
    assert (r.rebuilt, r.epoch, r.dropped_turns) == (True, 0, 0)
    assert not pool.slot(0).stale
    np.testing.assert_array_equal(lbits(r.logits), lbits(fresh(model, tokens_of(more), 64)[0]))


# -- slots ------------------------------------------------------------------------------


def script(seed):
    """One conversation's requests: prefill, decodes, a shifting continuation, decodes."""
    c, sys_, t1, t2, u3 = opening(seed)
    decoded = [int(t) for t in c.rng.integers(0, 256, 2)]
    first = [sys_, *t1, *t2, u3]
    second = first + [Message("assistant", tuple(decoded)), c("user", 12)]
    return [("prefill", first), *(("decode", t) for t in decoded), ("prefill", second),
            ("decode", 9), ("decode", 10)]


def run_op(pool, slot, op):
    kind, arg = op
    out = pool.prefill(slot, arg).logits if kind == "prefill" else pool.decode(slot, arg)
    return lbits(out)


def test_slots_never_interfere(model):
    scripts = [script(10), script(11)]
    solo = []
    for s in scripts:
        pool = pool_of(model)
        solo.append(([run_op(pool, 0, op) for op in s], state_bits(pool.slot(0).cache)))
    pool = pool_of(model, slots=2)
    got = [[], []]
    for k in range(max(map(len, scripts))):  # interleaved, slot 1 first
        for i in (1, 0):
            if k < len(scripts[i]):
                got[i].append(run_op(pool, i, scripts[i][k]))
    for i in (0, 1):
        assert len(got[i]) == len(solo[i][0])
        for a, b in zip(got[i], solo[i][0]):
            np.testing.assert_array_equal(a, b)
        assert_same(state_bits(pool.slot(i).cache), solo[i][1])
        assert pool.slot(i).epoch == 1
    assert not np.array_equal(got[0][0], got[1][0])


def test_slot_indices_cannot_reach_staging(model):
    pool = pool_of(model, slots=2)
    for bad in (-1, 2, 4, True, 1.0, None, "0"):
        with pytest.raises(IndexError, match="staging session is not a slot"):
            pool.slot(bad)
        with pytest.raises(IndexError):
            pool.decode(bad, 1)
    for i, ops in enumerate((script(3), script(4))):
        for op in ops:
            run_op(pool, i, op)
            staging = staging_ids(pool)
            live = {id(c) for s in range(2) for c in pool.slot(s).cache}
            assert not staging & live and len(staging) == 8 and len(live) == 16


# -- lineage ------------------------------------------------------------------------------


def test_lineage_after_a_shift(model):
    c, sys_, t1, t2, u3 = opening(5)
    pool = pool_of(model)
    a3, u4 = c("assistant", 5), c("user", 10)
    r = pool.prefill(0, [sys_, *t1, *t2, u3, a3, u4])
    assert r.retained == (sys_, *t2, u3, a3, u4) and r.epoch == 1
    a4, u5 = c("assistant", 1), c("user", 1)
    refused = {
        "system changed": [c("system", 6), *t2, u3, a3, u4, a4, u5],
        "system dropped": [*t2, u3, a3, u4, a4, u5],
        "retained turn edited": [sys_, t2[0],
                                 Message("tool", t2[1].tokens[:-1] + ((t2[1].tokens[-1] + 1) % 256,), True),
                                 u3, a3, u4, a4, u5],
        "image flag changed": [sys_, t2[0], Message("tool", t2[1].tokens), u3, a3, u4, a4, u5],
        "oldest retained turn missing": [sys_, u3, a3, u4, a4, u5],
        "retained turns reordered": [sys_, u3, a3, *t2, u4, a4, u5],
        "a turn inside the run": [sys_, *t2, c("user", 1), u3, a3, u4, a4, u5],
        "not the dropped turn before it": [sys_, c("user", 3), *t2, u3, a3, u4, a4, u5],
        "dropped turn edited": [sys_, t1[0], c("assistant", 10), *t2, u3, a3, u4, a4, u5],
    }
    before = pool.slot(0)
    for name, messages in refused.items():
        with pytest.raises(LineageMismatch, match="slot 0 \\(epoch 1\\)"):
            pool.prefill(0, messages)
        after = pool.slot(0)
        assert (after.epoch, after.history, after.position) == (1, before.history, 45), name
    with pytest.raises(LineageMismatch, match="epoch 0"):
        pool.prefill(0, [sys_, *t2, u3, a3, u4, a4, u5], epoch=0)
    compact = pool.prefill(0, [sys_, *t2, u3, a3, u4, a4, u5], epoch=1)
    assert (compact.rebuilt, compact.computed, compact.epoch) == (False, 2, 1)
    a5, u6 = c("assistant", 1), c("user", 1)
    full = pool.prefill(0, [sys_, *t1, *t2, u3, a3, u4, a4, u5, a5, u6])  # resent whole
    assert (full.rebuilt, full.computed, full.position) == (False, 2, 49)


def test_epochs_reset_and_regenerate(model):
    c, sys_, t1, t2, u3 = opening(6)
    pool = pool_of(model)
    first = [sys_, *t1, *t2, u3]
    assert pool.prefill(0, first).epoch == 0
    pool.decode(0, 1)
    regen = pool.prefill(0, first)  # the reply is discarded: rebuilt, same epoch
    assert (regen.rebuilt, regen.epoch, regen.dropped_turns) == (True, 0, 0)
    np.testing.assert_array_equal(lbits(regen.logits), lbits(fresh(model, tokens_of(first))[0]))
    edited = pool.prefill(0, first + [Message("assistant", (2, 3)), c("user", 1)])
    assert edited.rebuilt is False  # nothing pending: a plain append
    pool.decode(0, 4)
    diverged = pool.prefill(0, list(edited.retained) + [Message("assistant", (5,))])
    assert (diverged.rebuilt, diverged.epoch) == (True, 0)  # pending (4,) is not a prefix
    epochs = [pool.prefill(0, list(diverged.retained) + [c("assistant", 4), c("user", 9)]).epoch]
    epochs.append(pool.prefill(0, list(pool.slot(0).history) + [c("assistant", 14), c("user", 9)]).epoch)
    assert epochs == [1, 2]
    pool.reset(0)
    slot = pool.slot(0)
    assert (slot.epoch, slot.history, slot.position, slot.dropped_turns) == (3, (), 0, 0)
    other = [c("system", 2), c("user", 3)]
    r = pool.prefill(0, other, epoch=3)  # a new conversation is welcome
    np.testing.assert_array_equal(lbits(r.logits), lbits(fresh(model, tokens_of(other))[0]))


def test_refusals_before_any_work(model):
    pool = pool_of(model)
    with pytest.raises(ValueError, match="at least one message"):
        pool.prefill(0, [])
    with pytest.raises(ValueError, match="vocabulary"):
        pool.prefill(0, [Message("user", (1, 256))])
    with pytest.raises(ValueError, match="no tokens"):
        pool.prefill(0, [Message("user", ())])
    with pytest.raises(ContextTooLong) as e:  # even SHIFT cannot split the newest turn
        pool.prefill(0, [Message("system", (1,) * 10), Message("user", (2,) * 50)])
    assert (e.value.needed, e.value.available) == (68, 64)
    with pytest.raises(muser_kv.SystemAfterTurns):
        pool.prefill(0, [Message("user", (1,)), Message("system", (1,))])
    with pytest.raises(ValueError, match="token id"):
        pool.decode(0, 256)
    assert pool.slot(0).position == 0 and pool.slot(0).epoch == 0
    pool.prefill(0, [Message("user", (3,) * 56)], output_reserve=0)
    with pytest.raises(ValueError, match="output_reserve"):
        pool.prefill(0, [Message("user", (3,) * 56)], output_reserve=64)
    for t in range(8):
        pool.decode(0, t)
    with pytest.raises(ContextTooLong, match="decoding one more token"):
        pool.decode(0, 9)
    assert pool.slot(0).position == 64


# -- memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
@pytest.mark.parametrize("context", [8, 64])
def test_pool_nbytes_is_footprint_times_slots_plus_staging(model, slots, context):
    pool = SlotPool(model, slots, context)
    geometry = MuseGeometry.from_model_args(model.args, context)
    assert pool.nbytes == footprint(geometry, context, slots + 1).total_bytes
    one = sum(c.nbytes for c in muser_kv.make_prompt_cache(model, context))
    assert pool.nbytes == (slots + 1) * one == pool.footprint.total_bytes


@pytest.mark.parametrize("slots", [0, 5, True, 2.0])
def test_pool_serves_one_to_four_slots(model, slots):
    with pytest.raises(ValueError, match="1 to 4 slots"):
        SlotPool(model, slots, CONTEXT)


def test_shifts_release_the_demoted_session(model):
    pool = pool_of(model)
    c = Conversation(9)
    history = [c("system", 4), c("user", 20)]
    pool.prefill(0, history)
    gc.collect()
    baseline = mx.get_active_memory()
    for _ in range(6):
        r = pool.prefill(0, list(pool.slot(0).history) + [c("assistant", 16), c("user", 20)])
        assert r.rebuilt
    gc.collect()
    assert pool.nbytes == pool.footprint.total_bytes
    assert pool.slot(0).epoch == 6
    assert mx.get_active_memory() - baseline < pool.footprint.slot_bytes // 2


# -- issue #10, item 12: a slot with no conversation refuses to decode ----------------


def test_decode_on_a_slot_never_prefilled_is_refused(model):
    """It returned logits, as if a token could follow nothing."""
    pool = muser_kv.SlotPool(model, slots=2, max_context=64)
    with pytest.raises(muser_kv.EmptySlot, match=r"slot 1 holds no conversation.*prefill it"):
        pool.decode(1, 5)
    assert pool.slot(1).position == 0 and pool.slot(1).pending == ()
    convo = Conversation(1)
    pool.prefill(0, [convo("user", 6)])
    assert pool.decode(0, 5).shape == (model.args.vocab_size,)
    pool.reset(0)  # an ended conversation is empty again
    with pytest.raises(muser_kv.EmptySlot):
        pool.decode(0, 5)


# -- issue #12: every busy slot in one batched forward -----------------------------------


def test_step_decodes_four_busy_slots_as_their_solo_runs(model):
    """Four conversations of different lengths (across the window), decoded
    greedily together with ``step``: each slot's tokens are its solo run's, and a
    step over some slots leaves the others bit for bit as they were."""
    pool = pool_of(model, slots=4)
    convs = [Conversation(20 + i) for i in range(4)]
    prompts = [[c("system", 4), c("user", n)] for c, n in zip(convs, (9, 17, 30, 41))]
    logits = {i: pool.prefill(i, p).logits for i, p in enumerate(prompts)}
    solo = []
    for p in prompts:
        last, cache = fresh(model, tokens_of(p))
        run = []
        for _ in range(12):
            t = int(mx.argmax(last))
            run.append(t)
            last = step(model, cache, t)
        solo.append(run)
    got = {i: [] for i in range(4)}
    for k in range(12):
        if k == 6:  # a step over two slots: the other two do not move
            idle = {i: live_bits(pool.slot(i).cache) for i in (1, 3)}
            busy = (0, 2)
        else:
            busy = (0, 1, 2, 3)
        tokens = {i: int(mx.argmax(logits[i])) for i in busy}
        out = pool.step(tokens)
        for i in busy:
            got[i].append(tokens[i])
            logits[i] = out[i]
        if k == 6:
            for i in (1, 3):
                assert_same(live_bits(pool.slot(i).cache), idle[i])
            for i in (1, 3):  # and catch up alone
                t = int(mx.argmax(logits[i]))
                got[i].append(t)
                logits[i] = pool.decode(i, t)
    for i in range(4):
        assert got[i] == solo[i][:len(got[i])] and len(got[i]) == 12, f"slot {i}"
        assert pool.slot(i).pending == tuple(got[i])
    assert pool.slot(3).cache[0].ring.wrapped


def test_step_refuses_before_any_work(model):
    pool = pool_of(model, slots=2)
    pool.prefill(0, [Conversation(1)("user", 5)])
    before = live_bits(pool.slot(0).cache)
    with pytest.raises(muser_kv.EmptySlot):
        pool.step({0: 3, 1: 4})  # slot 1 holds nothing
    with pytest.raises(IndexError):
        pool.step({0: 3, 2: 4})
    with pytest.raises(ValueError, match="token id"):
        pool.step({0: 10**6})
    assert_same(live_bits(pool.slot(0).cache), before)
    assert pool.step({}) == {}


def test_a_pool_reads_the_vocabulary_a_multimodal_model_keeps_in_its_text_args():
    """Muse Spark's args hold the language model's (``args.text``): the pool
    checks token ids against its vocabulary all the same."""
    from model_zoo import MAX_CONTEXT, tiny

    pool = SlotPool(tiny("muse_spark", mx.bfloat16), max_context=MAX_CONTEXT)
    assert pool.vocab_size == 128
