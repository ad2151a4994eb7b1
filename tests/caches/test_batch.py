"""Batched sequences: mlx-lm's batch protocol over muser-kv's caches.

Each sequence of a batch keeps its own exact ring state: driven directly, every
step's mask and rows give each real query exactly the rows a numpy oracle of
that sequence says it may see, and every sequence extracted at any point holds
exactly the oracle's rows (bitwise); through mlx-lm's own ``BatchGenerator`` and
``batch_generate``, every sequence's greedy tokens equal its solo run with
mlx-lm's single-sequence caches.
"""

import copy

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from local_tokenizer import tokenizer
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from oracle import FullHistory, bits

import muser_kv
from muser_kv import LayerKind, MuseGeometry, make_cache_for
from muser_kv.caches.batch import BatchKVCache
from muser_kv.caches.masks import DecodeMask

H, D = 2, 128
WINDOW, CONTEXT = 8, 96


def single(kind, retain=16, layout="token_major"):
    g = MuseGeometry(num_layers=1, window=WINDOW, max_context=CONTEXT, num_heads=4, kv_heads=H,
                     head_dim=D, layer_kinds=(kind,))
    return make_cache_for(g, retain, layout)[0]


def rows(n, seed, batch=1):
    rng = np.random.default_rng(seed)
    k = mx.array((rng.standard_normal((batch, H, n, D)) * 3).astype(np.float16))
    v = mx.array((rng.standard_normal((batch, H, n, D)) * 3).astype(np.float16))
    return k, v


def as_mask(mask, b, n, rows_, read=None):
    """Sequence ``b``'s ``[n, rows_]`` bool visibility from any form a batch hands
    (a ``DecodeMask``: from where the batch says sequence ``b``'s keys lie, ``read``)."""
    if isinstance(mask, DecodeMask):
        s = read.sequences[b]
        assert n == 1 and s.slot == b
        out = np.zeros((n, rows_), bool)
        for p in range(s.first(n, read.window), s.end):
            out[0, (s.origin + p - (s.end - s.held)) % s.wrap] = True
        return out
    if mask is None:
        return np.ones((n, rows_), bool)
    if isinstance(mask, str):
        assert mask == "causal"
        return np.arange(rows_)[None] <= (rows_ - n + np.arange(n))[:, None]
    a = np.array(mask) if mask.dtype == mx.bool_ else np.array(mask.astype(mx.float32))
    if a.dtype != bool:  # the additive form: 0 where a key is seen, -inf where not
        assert set(np.unique(a)) <= {0.0, -np.inf}, np.unique(a)
        a = a == 0
    a = a.reshape((1,) * (4 - a.ndim) + a.shape)
    return np.broadcast_to(a[min(b, a.shape[0] - 1), 0], (n, rows_))


class Sequence:
    """One sequence of a batch under test, with its oracle."""

    def __init__(self, kind, prefill=0, seed=0):
        self.cache = single(kind)
        self.oracle = FullHistory(WINDOW if kind is LayerKind.SLIDING else None)
        if prefill:
            for s in range(0, prefill, 5):
                k, v = rows(min(5, prefill - s), seed + s)
                self.cache.update_and_fetch(k, v)
                self.oracle.append(k, v)


def check_contents(batch: BatchKVCache, seqs):
    for b, s in enumerate(seqs):
        alone = batch.extract(b)
        start, k, v = alone.snapshot()
        s_, ok, ov = s.oracle.live()
        assert start == s_ and alone.offset == s.oracle.position
        if not ok.size:
            assert k.shape[0] == 0
            continue
        np.testing.assert_array_equal(bits(k), bits(ok))
        np.testing.assert_array_equal(bits(v), bits(ov))


def check_step(batch: BatchKVCache, seqs, n, real, seed):
    """One update of the batch: every real query sees exactly its oracle's rows."""
    if real is not None:
        batch.prepare(lengths=real, right_padding=[n - r for r in real])
    mask = batch.make_mask(n, window_size=WINDOW if batch.kind is LayerKind.SLIDING else None)
    k, v = rows(n, seed, batch=len(seqs))
    before = [s.oracle.position for s in seqs]
    keys, values = batch.update_and_fetch(k, v)
    read = batch.decode_read(keys, values)
    assert read is not None or not isinstance(mask, DecodeMask)
    if real is not None:
        batch.finalize()
    got_k = np.array(keys).transpose(0, 2, 1, 3)  # [B, rows, H, D]
    got_v = np.array(values).transpose(0, 2, 1, 3)
    assert keys.shape[0] == len(seqs)
    for b, s in enumerate(seqs):
        r = n if real is None else real[b]
        s.oracle.append(k[b:b + 1, :, :r], v[b:b + 1, :, :r])
        full = as_mask(mask, b, n, keys.shape[2], read)
        for i in range(r):
            vis = s.oracle.visible(before[b] + i)
            want_k = sorted(bits(s.oracle.keys[p]).tobytes() for p in vis)
            seen_k = sorted(bits(got_k[b, j]).tobytes() for j in np.nonzero(full[i])[0])
            assert seen_k == want_k, f"sequence {b} query {before[b] + i}: wrong visible keys"
            want_v = sorted(bits(s.oracle.values[p]).tobytes() for p in vis)
            seen_v = sorted(bits(got_v[b, j]).tobytes() for j in np.nonzero(full[i])[0])
            assert seen_v == want_v
        for i in range(r, n):  # a padding query still sees some row: no all-masked row (NaN)
            assert full[i].any()
        assert batch.seqs[b].offset == s.oracle.position


OPS = st.one_of(
    st.tuples(st.just("decode"), st.integers(1, 12)),
    st.tuples(st.just("chunk"), st.integers(2, 19)),
    st.tuples(st.just("padded"), st.integers(1, 13)),
    st.tuples(st.just("filter"), st.integers(0, 7)),
    st.tuples(st.just("extend"), st.integers(0, 30)),
    st.tuples(st.just("trim"), st.integers(1, 6)),
)


@pytest.mark.parametrize("kind", [LayerKind.SLIDING, LayerKind.GLOBAL])
@settings(max_examples=25, deadline=None)
@given(prefills=st.lists(st.integers(0, 30), min_size=1, max_size=4), ops=st.lists(OPS, max_size=9),
       data=st.data())
def test_batch_steps_match_each_sequences_oracle(kind, prefills, ops, data):
    seqs = [Sequence(kind, p, seed=10 * i) for i, p in enumerate(prefills)]
    batch = muser_kv.SlidingKVCache.merge([s.cache for s in seqs])
    check_contents(batch, seqs)
    seed = 1000
    for op, arg in ops:
        seed += 1
        room = min(CONTEXT - s.oracle.position for s in seqs)
        if op == "decode":
            for _ in range(min(arg, room)):
                check_step(batch, seqs, 1, None, seed)
                seed += 1
        elif op == "chunk" and room >= arg:
            check_step(batch, seqs, arg, None, seed)
        elif op == "padded" and room >= arg:
            real = [data.draw(st.integers(0, arg)) for _ in seqs]
            check_step(batch, seqs, arg, real, seed)
        elif op == "filter" and len(seqs) > 1:
            keep = sorted(set(i % len(seqs) for i in range(arg, arg + len(seqs) - 1)))
            batch.filter(keep)
            seqs = [seqs[i] for i in keep]
        elif op == "extend":
            new = Sequence(kind, arg, seed=seed)
            batch.extend(BatchKVCache.merge([new.cache]))
            seqs.append(new)
        elif op == "trim":
            depth = batch.trimmable_depth()
            if arg <= depth:
                assert batch.trim(arg) == arg
                for s in seqs:
                    s.oracle.keys, s.oracle.values = s.oracle.keys[:-arg], s.oracle.values[:-arg]
            else:
                with pytest.raises(ValueError, match="can trim at most"):
                    batch.trim(arg)
        check_contents(batch, seqs)


def test_batch_decode_writes_the_planes_in_place():
    """A decode step is one scatter per plane into the planes' own buffer (MLX
    donates it): no plane is copied, and the layout's memory order stays."""
    for kind, prefills in ((LayerKind.SLIDING, (3, 11, 20)), (LayerKind.GLOBAL, (3, 11, 20)),
                           (LayerKind.SLIDING, (11, 11, 11)), (LayerKind.GLOBAL, (5, 5, 5))):
        # (sequences at one row take one slice update, others one scatter: both in place)
        seqs = [Sequence(kind, p, seed=p) for p in prefills]
        batch = BatchKVCache.merge([s.cache for s in seqs])
        mx.eval(batch.state)

        def address(x):
            mx.eval(x)
            return np.asarray(x).__array_interface__["data"][0]

        # MLX CUDA lets go of the buffers a kernel read on its completion worker,
        # after mx.eval has returned; a store built before that finds its plane
        # still held and copies it. A synchronize drains the worker (a pipelined
        # loop's copies are tests/caches/test_no_plane_copy.py's to catch).

        before = address(batch.planes.k), address(batch.planes.v)
        order = memoryview(batch.planes.k).strides
        for t in range(12):
            out = batch.update_and_fetch(*rows(1, t, batch=3))
            mx.eval(out)
            del out
            mx.synchronize()
        assert (address(batch.planes.k), address(batch.planes.v)) == before
        assert memoryview(batch.planes.k).strides == order


def form(mask):
    """What attention is handed: "lengths" (muser-kv's decode attention reads
    them), "none", "causal", "additive" (in the planes' float16) or "bool"."""
    if isinstance(mask, DecodeMask):
        return "lengths"
    if mask is None or isinstance(mask, str):
        return mask or "none"
    if mask.dtype == mx.bool_:
        return "bool"
    assert mask.dtype == mx.float16, mask.dtype
    return "additive"


@pytest.mark.parametrize("kind", [LayerKind.SLIDING, LayerKind.GLOBAL])
def test_a_batch_decode_step_hands_attention_the_lengths_not_a_mask(kind):
    """With muser-kv's decode attention, a batch's decode step at any lengths
    gets a ``DecodeMask`` (never an array: the lengths go as integers), and
    ``return_array`` callers still get the bool form."""
    window = WINDOW if kind is LayerKind.SLIDING else None
    for prefills in ((3, 3, 3), (5, 6), (0, 4), (9, 20, 31)):
        batch = BatchKVCache.merge([Sequence(kind, p, seed=p).cache for p in prefills])
        assert form(batch.make_mask(1, window_size=window)) == "lengths", prefills
        assert form(batch.make_mask(1, window_size=window, return_array=True)) == "bool"


@pytest.mark.parametrize("kind", [LayerKind.SLIDING, LayerKind.GLOBAL])
def test_a_batch_hands_no_mask_where_every_sequence_sees_every_row(kind, mlx_attention):
    """With MLX's attention: level sequences (a ring not full yet, a full one,
    a plane), or rings that are all full at different positions: decode gets no
    mask, a chunk at most "causal"; unequal ones the additive form, never the
    bool one."""
    window = WINDOW if kind is LayerKind.SLIDING else None
    cases = {(3, 3, 3): "none", (20, 20): "none", (5, 6): "additive", (0, 4): "additive"}
    if kind is LayerKind.SLIDING:
        cases[(9, 20, 31)] = "none"  # every ring full: every row read is live
    for prefills, want in cases.items():
        batch = BatchKVCache.merge([Sequence(kind, p, seed=p).cache for p in prefills])
        assert form(batch.make_mask(1, window_size=window)) == want, prefills
        assert form(batch.make_mask(1, window_size=window, return_array=True)) == "bool"
    level = BatchKVCache.merge([Sequence(kind, 3, seed=i).cache for i in range(2)])
    assert form(level.make_mask(4, window_size=window)) == "causal"  # inside the window
    apart = BatchKVCache.merge([Sequence(kind, p, seed=p).cache for p in (3, 5)])
    assert form(apart.make_mask(4, window_size=window)) == "additive"
    apart.prepare(lengths=[4, 1], right_padding=[0, 3])
    assert form(apart.make_mask(4, window_size=window)) == "additive"


@pytest.mark.parametrize("attention", ["muser", "mlx"])
def test_a_batched_decode_step_hands_each_layer_kind_one_mask(model, monkeypatch, attention):
    """Through mlx-lm's model, with MLX's attention: equal lengths hand every
    layer no mask; unequal ones hand one additive mask per layer kind, shared
    by its layers. With muser-kv's, no layer reaches MLX's attention at all."""
    before = muser_kv.decode_attention()
    muser_kv.set_decode_attention(attention)
    try:
        _hands_masks(model, monkeypatch, attention)
    finally:
        muser_kv.set_decode_attention(before)


def _hands_masks(model, monkeypatch, attention):
    handed = []
    sdpa = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask=None, **kw):
        handed.append(mask)
        return sdpa(q, k, v, scale=scale, mask=mask, **kw)

    rng = np.random.default_rng(3)
    for lengths, masks in (((21, 21, 21), 0), ((21, 7, 30), 2)):
        caches = []
        for n in lengths:
            cache = muser_kv.make_prompt_cache(model, max_context=128)
            model(mx.array(rng.integers(0, 255, (1, n)), mx.uint32), cache=cache)
            caches.append(cache)
        batch = [BatchKVCache.merge(list(layer)) for layer in zip(*caches)]
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
        handed.clear()
        mx.eval(model(mx.zeros((len(lengths), 1), mx.uint32), cache=batch))
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", sdpa)
        if attention == "muser":
            assert handed == [], lengths
            continue
        assert len(handed) == len(batch)
        arrays = {id(m): m for m in handed if m is not None}
        assert len(arrays) == masks and all(form(m) != "bool" for m in arrays.values()), lengths
        assert (masks == 0) == all(m is None for m in handed)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("sequences", [1, 2])
def test_merge_extract_and_filter_keep_the_layouts_memory_order(layout, sequences):
    """Planes stay in their layout's memory order however a batch is made and
    unmade (a merge into one slot is an update covering the whole array, which
    MLX answers with the update itself: the order must not come from it)."""
    def order(planes):
        mx.eval(planes.k)
        strides = memoryview(planes.k).strides  # bytes, attention-shaped [S, H, R, D]
        r, d = planes.rows, planes.head_dim
        if layout == "token_major":
            assert strides[1:] == (d * 2, H * d * 2, 2), strides
        else:
            assert strides[1:] == (r * d * 2, d * 2, 2), strides

    singles = [single(LayerKind.SLIDING, layout=layout) for _ in range(sequences)]
    for i, c in enumerate(singles):
        c.update_and_fetch(*rows(11 + i, i))
    batch = BatchKVCache.merge(singles)
    order(batch.planes)
    batch.update_and_fetch(*rows(1, 9, batch=sequences))
    order(batch.planes)
    alone = batch.extract(0)
    order(alone.planes)
    if sequences > 1:
        batch.filter([1])
        order(batch.planes)


def test_batch_refuses_what_it_does_not_take():
    a, b = single(LayerKind.SLIDING), single(LayerKind.SLIDING)
    batch = BatchKVCache.merge([a, b])
    with pytest.raises(ValueError, match="right-padded prompts"):
        batch.prepare(left_padding=[0, 2])
    with pytest.raises(ValueError, match="expected batch 2, got 3"):
        batch.update_and_fetch(*rows(1, 0, batch=3))
    with pytest.raises(ValueError, match="expected"):
        BatchKVCache.merge([a, single(LayerKind.GLOBAL)])
    with pytest.raises(ValueError, match="ascending"):
        batch.filter([1, 0])
    with pytest.raises(muser_kv.ContextOverflow):
        batch.update_and_fetch(*rows(CONTEXT + 1, 0, batch=2))
    assert batch.offsets() == [0, 0]  # nothing changed


def test_deepcopy_is_independent():
    seqs = [Sequence(LayerKind.SLIDING, p, seed=p) for p in (9, 14)]
    batch = BatchKVCache.merge([s.cache for s in seqs])
    other = copy.deepcopy(batch)
    batch.update_and_fetch(*rows(3, 5, batch=2))
    for s in seqs:
        s.oracle.append(*rows(3, 5, batch=2))  # (what batch got; other got nothing)
    assert other.offsets() == [9, 14] and batch.offsets() == [12, 17]
    twins = [Sequence(LayerKind.SLIDING, p, seed=p) for p in (9, 14)]
    check_contents(other, twins)


# -- mlx-lm as the client ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model(mx.float32)


#: On a GPU a batched forward multiplies other matrix shapes than one sequence's,
#: so logits differ in the last bits and a near tie may flip (with mlx-lm's own
#: batch caches as with ours); on the CPU every token agrees.
NEAR_TIE = 1e-3


def solo(model, prompt, n, logprobs=None):
    """mlx-lm's own single-sequence caches, greedy (log-probabilities kept in
    ``logprobs`` when given)."""
    out = []
    for (t, lp), _ in zip(generate_step(mx.array(prompt, mx.uint32), model,
                                        prompt_cache=model.make_cache(), max_tokens=n), range(n)):
        out.append(int(t))
        if logprobs is not None:
            logprobs.append(np.array(lp))
    return out


def assert_tokens_equal(got, want, logprobs, what):
    """Equal, or (on a GPU only) equal up to a near tie of the solo run."""
    if got == want:
        return
    first = next(i for i, (a, b) in enumerate(zip(got + [None], want + [None])) if a != b)
    assert mx.default_device() != mx.cpu, f"{what}: tokens differ at {first} on the CPU"
    top2 = np.sort(logprobs[first])[-2:]
    assert top2[1] - top2[0] < NEAR_TIE, f"{what}: tokens differ at {first} at a clear margin"


def install_ours(monkeypatch, model, **kw):
    made = []

    def make_cache():
        made.append(muser_kv.make_prompt_cache(model, max_context=128, **kw))
        return made[-1]

    monkeypatch.setattr(model, "make_cache", make_cache, raising=False)
    return made


def test_batch_generator_equals_solo_runs(model, monkeypatch):
    """Prompts of different lengths crossing the wrap (window 16), sequences
    finishing at different times, new ones admitted mid-generation (prefill
    batches of 2 into a generation batch of 3): every sequence's greedy tokens
    equal its own solo run; every finished sequence's extracted cache is at its
    position, with a ring that wrapped."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 255, n).tolist() for n in (5, 23, 40, 9, 31)]
    max_tokens = [30, 12, 25, 40, 7]
    logprobs = [[] for _ in prompts]
    want = [solo(model, p, n, lp) for p, n, lp in zip(prompts, max_tokens, logprobs)]
    install_ours(monkeypatch, model, batch_slots=3)
    gen = BatchGenerator(model, max_tokens=64, completion_batch_size=3, prefill_batch_size=2,
                         prefill_step_size=8)
    uids = gen.insert(prompts, max_tokens)
    got = {u: [] for u in uids}
    finished = {}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r.prompt_cache
    gen.close()
    for u, p, w, lp in zip(uids, prompts, want, logprobs):
        assert_tokens_equal(got[u], w, lp, f"sequence {u}")
        cache = finished[u]
        assert all(isinstance(c, muser_kv.MuseKVCache) for c in cache)
        assert {c.offset for c in cache} == {len(p) + len(w)}
        assert cache[0].ring.wrapped


def test_batch_generate_with_fresh_and_prefilled_caches(model, monkeypatch):
    """``batch_generate`` with some prompts' caches already filled by muser-kv
    (their last token still to come, as mlx-lm expects)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 255, n).tolist() for n in (12, 33, 20)]
    install_ours(monkeypatch, model)
    caches = []
    for p in prompts:
        c = muser_kv.make_prompt_cache(model, max_context=128)
        model(mx.array([p[:-3]]), cache=c)
        caches.append(c)
    tok = tokenizer(model.args.vocab_size)
    out = batch_generate(model, tok, [p[-3:] for p in prompts], prompt_caches=caches,
                         max_tokens=20, return_token_ids=True)
    for p, ids in zip(prompts, out.token_ids):
        lp = []
        want = solo(model, p, 20, lp)
        eos = next((i for i, t in enumerate(want) if t in tok.eos_token_ids), len(want))
        assert_tokens_equal(ids[:eos], want[:eos], lp, "batch_generate")


def test_extend_consumes_the_other_batch_one_layer_at_a_time():
    """mlx-lm extends its decoding batch layer by layer with a prefilled batch it
    holds until the loop ends: each layer's extend releases the other batch's
    planes once their rows are copied, so a join holds one layer's second copy
    at a time (``muser-kv serve --kv-memory`` counts that much), not every layer's."""
    layers = 4
    ours = [BatchKVCache.merge([single(LayerKind.GLOBAL)], slots=2) for _ in range(layers)]
    theirs = []
    for _ in range(layers):
        one = single(LayerKind.GLOBAL)
        one.update_and_fetch(*rows(40, 1))
        theirs.append(BatchKVCache.merge([one], slots=2))
        del one
    mx.eval([c.planes.k for c in ours + theirs])
    per_layer = theirs[0].nbytes
    before = mx.get_active_memory()
    for a, b in zip(ours, theirs):  # theirs stays alive, as mlx-lm's list does
        a.extend(b)
        assert not b.seqs and mx.get_active_memory() - before < per_layer
    assert all(len(a) == 2 and a.offset.tolist()[1] == 40 for a in ours)
    with pytest.raises(AttributeError):
        _ = theirs[0].planes
