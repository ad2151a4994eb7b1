"""Global planes that grow with the sequence.

A growing list (``make_prompt_cache``'s default) and a preallocated one
(``preallocate=True``) fed the same tokens give the same
logits and hold the same live rows, bit for bit, across growths, ring wraps,
trims, speculative rollbacks, batches (members of different allocations merged,
extended, filtered and extracted), session files and prompt-cache files. A
growing plane holds a multiple of 256 rows, at most twice its live rows rounded
up to 256, and never more than the preallocated plane.
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from helpers import live_bits
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache, trim_prompt_cache
from oracle import bits

import muser_kv
from muser_kv.core.geometry import allocated_rows

CONTEXT = 1000  # off the 256-row granule: the last growth stops at 1,024 rows


@pytest.fixture(scope="module")
def model():
    return tiny_model(mx.float32, max_position_embeddings=1024)


def raw(x):
    """Any float array's bits (logits are f32, planes f16)."""
    a = np.array(x)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def ids(n, seed):
    return np.random.default_rng(seed).integers(0, 255, n).tolist()


def plane_rows(c):
    return c.keys.shape[0] if c.layout == "token_major" else c.keys.shape[1]


def assert_sized(cache, most=0):
    """Every global plane: 256-row multiples, within 2x of its live rows
    (rounded up to 256; of the most it has held, ``most``, after a trim, which
    never shrinks a plane), never past the preallocated plane."""
    for c in cache:
        rows = plane_rows(c)
        if c.kind is muser_kv.LayerKind.GLOBAL:
            assert rows % 256 == 0 and rows >= c.ring.len
            held = max(c.ring.len, most, 1)
            assert rows <= 2 * allocated_rows(held), (rows, c.ring.len)
            assert rows <= allocated_rows(c.max_context)
        else:
            assert rows == allocated_rows(c.capacity)


def assert_same(a, b):
    for x, y in zip(live_bits(a), live_bits(b)):
        assert x[0] == y[0] and x[1] == y[1]
        np.testing.assert_array_equal(x[2], y[2])
        np.testing.assert_array_equal(x[3], y[3])


class Pair:
    """A growing and a preallocated list driven alike; every call compares."""

    def __init__(self, model, **kw):
        self.model = model
        self.grow = muser_kv.make_prompt_cache(model, max_context=CONTEXT, **kw)
        self.fixed = muser_kv.make_prompt_cache(model, max_context=CONTEXT, preallocate=True, **kw)
        self.growths = 0
        self.most = 0

    def feed(self, tokens):
        before = plane_rows(self.grow[3])
        x = mx.array([tokens])
        a = self.model(x, cache=self.grow)
        b = self.model(x, cache=self.fixed)
        mx.eval(a, b)
        np.testing.assert_array_equal(raw(a), raw(b))
        self.most = max(self.most, self.grow[0].offset)
        assert_sized(self.grow, self.most)
        self.growths += plane_rows(self.grow[3]) != before
        return a

    def trim(self, n):
        assert trim_prompt_cache(self.grow, n) == trim_prompt_cache(self.fixed, n) == n

    def check(self):
        assert_same(self.grow, self.fixed)
        assert_sized(self.grow, self.most)


def test_a_fresh_list_allocates_one_granule_per_global_plane(model):
    grow = muser_kv.make_prompt_cache(model, max_context=CONTEXT)
    fixed = muser_kv.make_prompt_cache(model, max_context=CONTEXT, preallocate=True)
    for g, f in zip(grow, fixed):
        want = 256 if g.kind is muser_kv.LayerKind.GLOBAL else allocated_rows(g.capacity)
        assert plane_rows(g) == want and plane_rows(f) == allocated_rows(f.capacity)
    geometry = muser_kv.MuseGeometry.from_model_args(model.args, CONTEXT)
    assert sum(c.nbytes for c in fixed) == muser_kv.footprint(geometry, CONTEXT).slot_bytes
    assert sum(c.nbytes for c in grow) < sum(c.nbytes for c in fixed)
    with pytest.raises(TypeError, match="preallocate must be True or False"):
        muser_kv.make_prompt_cache(model, preallocate=1)


def test_growth_across_chunks_decode_and_wraps_is_invisible(model):
    """Chunks that cross 256 and 512 (a 300-token chunk doubles twice at once),
    decode across 768 -> 1,024, and rings wrapped all along: every logit equal,
    and then ContextOverflow at exactly max_context in both."""
    p = Pair(model)
    p.feed(ids(200, 0))
    p.feed(ids(300, 1))       # 200 -> 500 rows: 256 -> 512
    p.check()
    p.feed(ids(267, 2))       # 767 rows: 1,024 (the limit; 1000 rounded up)
    for t in ids(8, 3):       # decode across row 768
        p.feed([t])
    p.check()
    assert p.growths == 2 and plane_rows(p.grow[3]) == 1024
    p.feed(ids(CONTEXT - 775, 4))
    assert p.grow[0].offset == CONTEXT
    for cache in (p.grow, p.fixed):
        with pytest.raises(muser_kv.ContextOverflow, match="exceeds max_context 1000"):
            model(mx.array([[1]]), cache=cache)


def test_decode_grows_one_copy_per_doubling(model):
    p = Pair(model)
    p.feed(ids(250, 5))
    for t in ids(270, 6):     # 250 -> 520 one token at a time: 256 -> 512 -> 1,024
        p.feed([t])
    assert p.growths == 2
    p.check()


def test_trims_and_rollbacks_across_a_growth(model):
    """A trim back below a growth keeps the larger plane (rows past the offset
    are never read); writes after it, a checkpoint rolled back across a growth
    and an mlx-lm trim over the list all stay equal to the preallocated list."""
    p = Pair(model, retain=32)
    p.feed(ids(250, 7))
    p.feed(ids(10, 8))        # 260: grown to 512
    p.trim(20)                # 240: below the first granule again
    p.check()
    assert plane_rows(p.grow[3]) == 512
    p.feed(ids(30, 9))
    p.check()
    cps = [muser_kv.checkpoint(c, block_len=8) for c in (p.grow, p.fixed)]
    before = plane_rows(p.grow[3])
    p.feed(ids(8, 10))        # 278 -> 286
    for cp in cps:
        cp.rollback()
    p.check()
    p.feed(ids(250, 11))      # 520: grown to 1,024
    assert plane_rows(p.grow[3]) > before
    cps = [muser_kv.checkpoint(c, block_len=8) for c in (p.grow, p.fixed)]
    p.feed(ids(8, 12))
    for cp in cps:
        cp.rollback()
    p.check()
    p.feed(ids(5, 13))
    p.check()


def test_a_session_file_loads_sized_for_its_rows(model, tmp_path):
    """A saved session loads into planes sized for its rows (or the whole
    max_context with preallocate=True), and both continue exactly like the
    live list, across the next growth too."""
    p = Pair(model)
    p.feed(ids(300, 14))
    muser_kv.save_session(tmp_path / "s.safetensors", p.grow)
    loaded = muser_kv.load_session(tmp_path / "s.safetensors", model)
    whole = muser_kv.load_session(tmp_path / "s.safetensors", model, preallocate=True)
    assert plane_rows(loaded[3]) == 512 and plane_rows(whole[3]) == 1024
    assert_same(loaded, p.fixed)
    for t in ids(230, 15):    # 300 -> 530: the loaded plane grows to 1,024
        want = p.feed([t])
        for cache in (loaded, whole):
            got = model(mx.array([[t]]), cache=cache)
            np.testing.assert_array_equal(raw(got), raw(want))
    assert plane_rows(loaded[3]) == 1024
    assert_same(loaded, p.fixed)
    # an install into an existing growing list sizes it for the rows installed
    fresh = muser_kv.make_prompt_cache(model, max_context=CONTEXT)
    for c, src in zip(fresh, p.grow):
        c.install(*src.snapshot())
    assert_sized(fresh)
    assert_same(fresh, p.fixed)


def test_a_prompt_cache_file_restores_a_growing_list(model, tmp_path):
    """mlx-lm's prompt-cache files hold a growing plane at its allocation;
    ``from_state`` restores it growing, and it goes on growing exactly."""
    p = Pair(model)
    p.feed(ids(260, 16))
    save_prompt_cache(str(tmp_path / "p.safetensors"), p.grow)
    restored = load_prompt_cache(str(tmp_path / "p.safetensors"))
    assert plane_rows(restored[3]) == 512 and restored[3].growing
    for t in ids(260, 17):
        want = p.feed([t])
        got = model(mx.array([[t]]), cache=restored)
        np.testing.assert_array_equal(raw(got), raw(want))
    assert plane_rows(restored[3]) == 1024
    assert_same(restored, p.fixed)
    # a state whose live rows do not fit its planes is refused
    c = p.grow[3]
    meta = list(c.meta_state)
    meta[8] = "900"           # len 900 in 1,024 rows: fits
    muser_kv.MuseKVCache.from_state(c.state[:2], meta)
    short = (c.state[0][:, :256], c.state[1][:, :256])
    with pytest.raises(ValueError, match="state keys must be"):
        muser_kv.MuseKVCache.from_state(short, meta)


# -- batches --------------------------------------------------------------------------


def run_batch(model, monkeypatch, prompts, max_tokens, **kw):
    """mlx-lm's BatchGenerator over muser-kv caches (prefill batches of 2, a
    generation batch of 3, so sequences are merged, extended, filtered and
    extracted); every token and log-probability, and the finished caches."""
    monkeypatch.setattr(model, "make_cache", lambda: muser_kv.make_prompt_cache(
        model, max_context=CONTEXT, **kw), raising=False)
    gen = BatchGenerator(model, max_tokens=64, completion_batch_size=3, prefill_batch_size=2,
                         prefill_step_size=128)
    uids = gen.insert(prompts, max_tokens)
    got = {u: [] for u in uids}
    finished = {}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append((r.token, raw(r.logprobs).tobytes()))
            if r.finish_reason is not None:
                finished[r.uid] = r.prompt_cache
    gen.close()
    return [got[u] for u in uids], [finished[u] for u in uids]


def test_batch_generator_with_growing_planes_equals_preallocated(model, monkeypatch):
    """Members of different allocations (prompts of 40 to 600 tokens) merged
    into prefill batches, extended into the generation batch (which grows as
    its longest member does: 250 + 12 crosses 256), filtered as they finish and
    extracted: every token and log-probability equals the preallocated run, bit
    for bit, and each extracted cache is sized for its own rows."""
    prompts = [ids(n, 20 + i) for i, n in enumerate((250, 40, 600, 130, 300))]
    max_tokens = [12, 30, 9, 20, 14]
    grow, grow_caches = run_batch(model, monkeypatch, prompts, max_tokens)
    fixed, fixed_caches = run_batch(model, monkeypatch, prompts, max_tokens, preallocate=True)
    assert grow == fixed
    for g, f in zip(grow_caches, fixed_caches):
        assert_sized(g)
        assert g[3].growing and not f[3].growing
        assert_same(g, f)


def test_batch_merge_extend_extract_across_capacities(model):
    """Directly: members holding 256 and 512 rows merge into planes sized for
    the longest, decode across 512 grows the batch once, ``extend`` admits a
    member larger than the batch, ``filter`` drops one; each extracted
    sequence equals its preallocated twin."""
    from muser_kv.caches.batch import BatchKVCache

    lengths = [100, 300, 20]
    pairs = [Pair(model) for _ in lengths]
    for p, n in zip(pairs, lengths):
        p.feed(ids(n, n))
    layer = 3  # a global layer
    grow = BatchKVCache.merge([p.grow[layer] for p in pairs[:2]])
    fixed = BatchKVCache.merge([p.fixed[layer] for p in pairs[:2]])
    assert grow.planes.rows == 512 and fixed.planes.rows == 1024
    big = Pair(model)
    big.feed(ids(700, 700))
    k = mx.random.normal((2, 2, 1, 128)).astype(mx.float16)
    for step in range(220):   # 300 -> 520 rows: the batch grows to 1,024
        a = grow.update_and_fetch(k, k)
        b = fixed.update_and_fetch(k, k)
        for s, seq in enumerate(grow.seqs):
            n = seq.ring.len
            np.testing.assert_array_equal(bits(a[0][s, :, :n]), bits(b[0][s, :, :n]))
        if step == 100:
            grow.extend(BatchKVCache.merge([big.grow[layer]]))
            fixed.extend(BatchKVCache.merge([big.fixed[layer]]))
            k = mx.random.normal((3, 2, 1, 128)).astype(mx.float16)
    assert grow.planes.rows == 1024
    grow.filter([0, 2])
    fixed.filter([0, 2])
    for i in range(2):
        g, f = grow.extract(i), fixed.extract(i)
        assert g.growing and plane_rows(g) == allocated_rows(g.ring.len)
        start, gk, gv = g.snapshot()
        start_f, fk, fv = f.snapshot()
        assert start == start_f
        np.testing.assert_array_equal(bits(gk), bits(fk))
        np.testing.assert_array_equal(bits(gv), bits(fv))


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_fit_gives_back_a_growths_headroom_and_nothing_else(model, layout):
    """A list that is kept rather than written (a prompt-cache entry) is fitted:
    each growing plane moves to its live rows rounded up to 256, the rows bit
    for bit; the list then decodes and grows exactly like the preallocated one.
    Preallocated planes and rings are left as they are."""
    p = Pair(model, sliding_layout=layout)
    p.feed(ids(520, 17))      # 520 rows: grown to 1,024
    assert plane_rows(p.grow[3]) == 1024
    for cache in (p.grow, p.fixed):
        for c in cache:
            c.fit()
    assert plane_rows(p.grow[3]) == 768 and plane_rows(p.fixed[3]) == 1024
    assert all(plane_rows(c) == allocated_rows(c.capacity)
               for c in p.grow if c.kind is muser_kv.LayerKind.SLIDING)
    p.check()
    for t in ids(260, 18):    # 520 -> 780: grows again, past 768
        p.feed([t])
    p.check()
    assert plane_rows(p.grow[3]) == 1024
