"""muser_kv.KVStore: every position it says it can rebuild is the live list's
state there, bit for bit (every live row, every ring's rotation, the next
logits), across wraps, layer plans, plane dtypes and both sliding layouts.

The oracle for which positions are rebuildable is the module doc's rule, kept
here as simply as it can be said: a put point always; a chunk boundary ``b``
when every position of its window ``[b - window, b)`` lies in a chunk some put
saw whole in its rings, and some put reached ``b`` (its global rows)."""

from __future__ import annotations

import copy
import importlib
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from model_zoo import tiny

import muser_kv
from muser_kv import KVStore
from muser_kv.sessions import reading, restore
from muser_kv.sessions.store import CHUNK, chunks, planner
from muser_kv.sessions.store import rows as rows_module
from muser_kv.sessions.store.landing import GRAIN, Landing
from muser_kv.sessions.store.memory import MemoryTier

CONTEXT = 1024
#: positions the producer passes through: every chunk boundary, and the put
#: points (prompt ends one short of their last token, as the server stores them)
PUTS = (300, 511, 600, 703, 900)
ENDS = sorted(set(PUTS) | {256, 512, 768})


def bits(x: mx.array) -> np.ndarray:
    return np.array(x.view(mx.uint16) if x.dtype in (mx.float16, mx.bfloat16) else x)


def state(cache):
    """Every layer's ``(start, key bits, value bits, ring)``: what a rebuild must equal."""
    out = []
    for c in cache:
        start, k, v = c.snapshot()
        r = c.ring
        out.append((start, bits(k), bits(v), (r.len, r.origin_logical, r.origin_physical)))
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0] and g[3] == w[3], f"layer {i}: start/ring {g[0], g[3]} != {w[0], w[3]}"
        assert g[1].shape == w[1].shape and (g[1] == w[1]).all(), f"layer {i}: keys differ"
        assert (g[2] == w[2]).all(), f"layer {i}: values differ"


def next_logits(model, cache, token=7):
    return bits(model(mx.array([[token]]), cache=cache)[0, -1])


def zoo_model(name: str, dtype):
    return tiny(name, dtype, context=CONTEXT)


PLANS = {
    # Muse Glimmer, a window far below a chunk (wraps ~100 times) and one above it
    "glimmer-w8": lambda dtype: tiny_model(dtype, num_hidden_layers=4, head_dim=32,
                                           sliding_window=8, max_position_embeddings=CONTEXT),
    "glimmer-w300": lambda dtype: tiny_model(dtype, num_hidden_layers=4, head_dim=32,
                                             sliding_window=300, max_position_embeddings=CONTEXT),
    "gemma3_text": lambda dtype: zoo_model("gemma3_text", dtype),
    "gemma4_text": lambda dtype: zoo_model("gemma4_text", dtype),
    "gpt_oss": lambda dtype: zoo_model("gpt_oss", dtype),
}


def new_list(model, layout="token_major"):
    return muser_kv.make_prompt_cache(model, max_context=CONTEXT, sliding_layout=layout)


def converse(model, tokens, store, layout="token_major", puts=PUTS, ends=ENDS):
    """Prefill ``tokens`` through every position of ``ends``, putting at ``puts``;
    the live state (and a copy of the list) at each end."""
    cache = new_list(model, layout)
    states, lists, at = {}, {}, 0
    for end in ends:
        model(mx.array([tokens[at:end]]), cache=cache)
        mx.eval([c.state for c in cache])
        at = end
        states[end] = state(cache)
        lists[end] = copy.deepcopy(cache)
        if end in puts:
            store.put(tokens[:end], cache)
    return states, lists


def oracle(puts, window):
    """The positions the module doc's rule makes rebuildable."""
    seen = set()
    for p in puts:
        held = max(0, p - window)
        for j in range(p // CHUNK):
            if CHUNK * j >= held:
                seen.update(range(CHUNK * j, CHUNK * (j + 1)))
    out = set(puts)
    for b in range(CHUNK, max(puts) + 1, CHUNK):
        if all(q in seen for q in range(max(0, b - window), b)):
            out.add(b)
    return sorted(out)


def tokens_for(seed=0, n=CONTEXT - 8):
    return np.random.default_rng(seed).integers(0, 128, n).tolist()


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_every_rebuildable_position_is_the_live_list_there(plan, dtype):
    model = PLANS[plan](dtype)
    store = KVStore()
    tokens = tokens_for()
    states, lists = converse(model, tokens, store)
    window = restore.cache_geometry(new_list(model)).window
    rebuildable = store.rebuildable(tokens, model, like=new_list(model))
    assert rebuildable == oracle(PUTS, window)
    for n in rebuildable:
        got_n, cache = store.longest_prefix(tokens[:n + 1], model, into=new_list(model))
        assert got_n == n
        assert_same(state(cache), states[n])
        assert (next_logits(model, cache) == next_logits(model, lists[n])).all(), f"position {n}"


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_a_rebuild_is_exact_in_both_sliding_layouts(layout):
    model = PLANS["glimmer-w300"](mx.bfloat16)
    store = KVStore()
    tokens = tokens_for(1)
    states, lists = converse(model, tokens, store, layout=layout)
    for n in (256, 703):
        got, cache = store.longest_prefix(tokens[:n + 1], model, into=new_list(model, layout))
        assert got == n
        assert_same(state(cache), states[n])
        assert (next_logits(model, cache) == next_logits(model, lists[n])).all()


def test_the_deepest_rebuildable_position_is_found_and_a_miss_is_a_fresh_list():
    model = PLANS["glimmer-w8"](mx.float16)
    store = KVStore()
    tokens = tokens_for(2)
    converse(model, tokens, store)
    for length, want in ((900 + 5, 900), (901, 900), (900, 703), (704, 703), (301, 300), (300, 0),
                         (2, 0)):
        n, cache = store.longest_prefix(tokens[:length], model, into=new_list(model))
        assert n == want, f"{length} tokens: rebuilt at {n}, expected {want}"
        assert {c.offset for c in cache} == {n}
    other = tokens[:450] + [(t + 1) % 128 for t in tokens[450:]]  # diverges at 450
    n, _ = store.longest_prefix(other, model, into=new_list(model))
    assert n == 300


def test_positions_a_caller_already_has_are_not_rebuilt(monkeypatch):
    """``beyond``: the server's prompt cache already reuses that many tokens; the
    store installs nothing unless it can go deeper (a returning turn the
    entries serve costs lookups, not a rebuild)."""
    model = PLANS["glimmer-w8"](mx.float16)
    store = KVStore()
    tokens = tokens_for(12)
    converse(model, tokens, store)
    installs = []
    path = importlib.import_module("muser_kv.sessions.restore")  # every restore's install
    real = path.Install.finish
    monkeypatch.setattr(path.Install, "finish",
                        lambda self: (installs.append(self.cache[0].offset), real(self)))
    for beyond, want in ((0, 703), (600, 703), (702, 703), (703, 0), (900, 0)):
        n, cache = store.longest_prefix(tokens[:704], model, into=new_list(model), beyond=beyond)
        assert n == want, f"beyond {beyond}: {n}, expected {want}"
        assert {c.offset for c in cache} == {n}
    assert installs == [703, 703, 703]


def test_two_conversations_sharing_three_chunks_store_them_once():
    model = PLANS["glimmer-w8"](mx.bfloat16)
    store = KVStore()
    shared = tokens_for(3, 3 * CHUNK)
    a = shared + tokens_for(4, 200)
    b = shared + tokens_for(5, 200)
    ca, cb = new_list(model), new_list(model)
    model(mx.array([a]), cache=ca)
    model(mx.array([b]), cache=cb)
    first = store.put(a, ca)
    before = store.stats().tiers[0].bytes
    second = store.put(b, cb)
    after = store.stats().tiers[0].bytes
    glob = [c for c in ca if c.kind is muser_kv.LayerKind.GLOBAL]
    chunk_bytes = sum(2 * CHUNK * c.kv_dim * 2 for c in glob)  # K and V, 2-byte rows
    assert second.found == 3 and first.found == 0
    assert first.copied_bytes >= 3 * chunk_bytes
    assert second.copied_bytes == first.copied_bytes - 3 * chunk_bytes
    assert after - before == second.copied_bytes  # its point alone (the index has r = 200)
    assert store.put(b, cb).copied == 0  # a repeated put: lookups only
    n, cache = store.longest_prefix(b + [1], model, into=new_list(model))
    assert n == len(b)
    assert_same(state(cache), state(cb))


def test_regenerate_and_edit_reuse_the_deepest_put_point():
    """A chat past many wraps (window 8): the client regenerates the last answer
    (the same prompt again) and then edits its last message. Each reuses the
    deepest put point and prefills only the rest, and its first token's logits
    equal those of the live list continued the same way."""
    model = PLANS["glimmer-w8"](mx.float16)
    store = KVStore()
    history = tokens_for(6, 620)
    prompt2 = history + tokens_for(7, 60)
    puts = (len(history) - 1, len(history), len(prompt2) - 1)  # as the server inserts them
    states, lists = converse(model, prompt2, store, puts=puts, ends=sorted(puts) + [len(prompt2)])
    # regenerate: the same prompt again
    n, cache = store.longest_prefix(prompt2, model, into=new_list(model))
    assert n == len(prompt2) - 1
    rest = prompt2[n:]
    live = lists[n]
    assert (bits(model(mx.array([rest]), cache=cache)[0, -1])
            == bits(model(mx.array([rest]), cache=live)[0, -1])).all()
    # edit the last message: everything after the history differs
    edited = history + tokens_for(8, 45)
    n, cache = store.longest_prefix(edited, model, into=new_list(model))
    assert n == len(history)
    rest = edited[n:]
    live = copy.deepcopy(lists[len(history)])
    assert (bits(model(mx.array([rest]), cache=cache)[0, -1])
            == bits(model(mx.array([rest]), cache=live)[0, -1])).all()


def test_a_put_that_does_not_match_its_list_is_refused_before_anything_is_kept():
    model = PLANS["glimmer-w8"](mx.float16)
    store = KVStore()
    tokens = tokens_for(9, 300)
    cache = new_list(model)
    model(mx.array([tokens]), cache=cache)
    with pytest.raises(ValueError, match="holds \\[300\\] tokens, got 299"):
        store.put(tokens[:-1], cache)
    orphan = muser_kv.make_cache_for(muser_kv.MuseGeometry.from_model(model, CONTEXT))
    with pytest.raises(ValueError, match="does not know its model"):
        store.put([], orphan)
    with pytest.raises(TypeError, match="muser-kv caches"):
        store.put(tokens, model.make_cache())
    assert store.stats().tiers[0].chunks == 0 and store.stats().puts == 0
    with pytest.raises(ValueError, match="empty list"):
        store.longest_prefix(tokens, model, into=cache)


def test_rows_of_one_model_or_dtype_are_never_read_into_another():
    f16 = PLANS["glimmer-w8"](mx.float16)
    store = KVStore()
    tokens = tokens_for(10, 600)
    cache = new_list(f16)
    f16(mx.array([tokens]), cache=cache)
    store.put(tokens, cache)
    assert store.longest_prefix(tokens + [1], f16, into=new_list(f16))[0] == 600
    bf16 = PLANS["glimmer-w8"](mx.bfloat16)
    assert store.longest_prefix(tokens + [1], bf16, into=new_list(bf16))[0] == 0
    other = tiny_model(mx.float16, seed=1, num_hidden_layers=4, head_dim=32, sliding_window=8,
                       max_position_embeddings=CONTEXT)
    assert store.longest_prefix(tokens + [1], other, into=new_list(other))[0] == 0


def glimmer(seed):
    return tiny_model(mx.float16, seed=seed, num_hidden_layers=4, head_dim=32, sliding_window=8,
                      max_position_embeddings=CONTEXT)


@pytest.mark.parametrize("tier", ["memory", "dir", "redis"])
def test_a_list_is_put_under_its_own_models_scope_or_refused(tier, tmp_path, request):
    """A list made for B put with model=A is refused before any tier holds a
    byte of it: its rows would be rebuilt into A's lists, and a byte tier keeps
    them for every later process running A."""
    location = {"memory": None, "dir": str(tmp_path / "store"),
                "redis": lambda: request.getfixturevalue("redis_server").url}[tier]
    location = location() if callable(location) else location
    a, b = glimmer(0), glimmer(1)
    tokens = tokens_for(16, 450)
    cache_b = muser_kv.make_prompt_cache(b)
    b(mx.array([tokens]), cache=cache_b)
    mx.eval([c.state for c in cache_b])
    live = state(cache_b)
    store = KVStore(location)

    def reopen(store):  # a later process, where the store outlives one
        if location is None:
            return store
        store.close()
        return KVStore(location)

    with pytest.raises(muser_kv.ModelMismatch, match="made for another model than model="):
        store.put(tokens, cache_b, model=a)
    store.flush()
    s = store.stats()
    assert s.puts == 0 and [t.chunks for t in s.tiers] == [0] * len(s.tiers)
    assert_same(state(cache_b), live)  # the list is untouched
    store = reopen(store)
    assert store.longest_prefix(tokens + [1], a)[0] == 0
    # the list's own model, named or not, and a model of the same weights: its scope
    store.put(tokens, cache_b, model=b)
    store.put(tokens, cache_b)
    store.put(tokens, cache_b, model=glimmer(1))
    store = reopen(store)
    assert store.longest_prefix(tokens + [1], a)[0] == 0
    n, rebuilt = store.longest_prefix(tokens + [1], b)
    assert n == 450
    assert_same(state(rebuilt), live)
    store.close()


def test_redis_keys_of_another_type_are_dropped_and_a_later_put_stores_them_again(redis_server):
    """Every key of a stored state replaced by a Redis list (``DEL k; RPUSH k a
    b``): a lookup misses, and the next put (after that lookup, or without one)
    stores every object again, whole."""
    import redis

    model = glimmer(0)
    tokens = tokens_for(17, 450)
    cache = muser_kv.make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    live = state(cache)
    store = KVStore(redis_server.url)
    store.put(tokens, cache)
    store.close()
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(client.scan_iter(match="muser-kv:chunk:*"))
    assert len(keys) >= 3  # the global chunk, the point, the indexes
    for look_first in (True, False):
        for k in keys:
            client.delete(k)
            client.rpush(k, b"a", b"b")
        store = KVStore(redis_server.url)  # a later process: nothing in its memory
        if look_first:
            assert store.longest_prefix(tokens + [1], model)[0] == 0
        store.put(tokens, cache)
        store.close()
        assert sorted(client.scan_iter(match="muser-kv:chunk:*", _type="string")) == keys
        store = KVStore(redis_server.url)
        n, rebuilt = store.longest_prefix(tokens + [1], model)
        assert n == 450
        assert_same(state(rebuilt), live)
        store.close()


def test_the_memory_tier_keeps_its_byte_bound_and_a_gap_is_passed_over():
    model = PLANS["glimmer-w8"](mx.float16)
    tokens = tokens_for(11, 900)
    probe = KVStore()
    states, _ = converse(model, tokens, probe)
    full = probe.stats().tiers[0].bytes
    store = KVStore(memory_bytes=full // 2)
    converse(model, tokens, store)
    s = store.stats().tiers[0]
    assert s.bytes <= full // 2 and s.chunks < probe.stats().tiers[0].chunks
    for length in (301, 512, 601, 704, 901):  # whatever survives is exact, or a miss
        n, cache = store.longest_prefix(tokens[:length], model, into=new_list(model))
        if n:
            assert_same(state(cache), states[n])


def test_threads_putting_and_rebuilding_each_see_whole_states():
    model = PLANS["glimmer-w8"](mx.float16)
    store = KVStore()
    convs = [tokens_for(20 + i, 700) for i in range(3)]
    recorded = {}
    for i, t in enumerate(convs):
        cache = new_list(model)
        model(mx.array([t]), cache=cache)
        recorded[i] = state(cache)
        store.put(t, cache)
    errors = []

    def reader(i):
        try:
            for _ in range(3):
                n, cache = store.longest_prefix(convs[i] + [1], model, into=new_list(model))
                assert n == 700
                assert_same(state(cache), recorded[i])
        except BaseException as e:  # reported below
            errors.append(e)

    def writer():
        try:
            for t in convs:
                cache = new_list(model)
                model(mx.array([t[:650]]), cache=cache)
                store.put(t[:650], cache)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)] + [threading.Thread(target=writer)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_a_new_store_over_the_same_directory_rebuilds_and_passes_over_what_is_not_its_key(
        tmp_path, caplog):
    """The directory tier: a store opened anew (a restart) rebuilds every put point
    bit for bit from disk; an object whose bytes the tier verifies but which is not
    what its key promises (another point's bytes) is passed over with a log line,
    and the lookup falls back to a shallower point, still exact."""
    model = PLANS["glimmer-w8"](mx.bfloat16)
    tokens = tokens_for(13)
    first = KVStore(tmp_path / "store")
    states, _ = converse(model, tokens, first)
    first.close()
    assert first.stats().read_bytes == 0  # what it rebuilt, it had in memory
    again = KVStore(tmp_path / "store", memory_bytes=0)  # every read from the directory
    for n in PUTS:
        got, cache = again.longest_prefix(tokens[:n + 1], model, into=new_list(model))
        assert got == n
        assert_same(state(cache), states[n])
    read = again.stats()
    assert read.read_bytes > 0 and read.read_s > 0
    # the point at 900 replaced by the bytes of the point at 703
    scope = planner.Scopes().of(new_list(model), model)[0]
    names = chunks.chain(scope, tokens, 900 // CHUNK)
    point_900 = chunks.object_key("P", names[3], tokens[768:900])
    point_703 = chunks.object_key("P", names[2], tokens[512:703])
    tier = again.tiers[0]
    assert tier.put(point_900, tier.get(point_703), replace=True)
    got, cache = again.longest_prefix(tokens[:901], model, into=new_list(model))
    assert got == 703
    assert_same(state(cache), states[703])
    assert "holds another point" in caplog.text
    again.close()


def _extent(a: mx.array):
    """The bytes ``a`` occupies in its buffer (the CPU's: numpy reads it in place)."""
    start = np.asarray(a.view(mx.uint16)).__array_interface__["data"][0]
    return start, start + a.nbytes


def test_a_put_keeps_each_object_in_buffers_of_its_own_and_a_rebuild_joins_once_per_block(
        monkeypatch):
    """Rows are kept layer-major, one block per plane for all the layers of a
    kind: a put gathers a run of chunks at once and cuts it into chunks that
    share no buffer (the memory tier counts and frees each alone), and a rebuild
    joins each block once per plane, whatever the number of layers or chunks."""
    model = tiny_model(mx.float16, num_hidden_layers=8, head_dim=32, sliding_window=600,
                       max_position_embeddings=CONTEXT)  # 2 global layers, 6 sliding
    store = KVStore()
    tokens = tokens_for(14, 900)
    cache = new_list(model)
    model(mx.array([tokens]), cache=cache)
    store.put(tokens, cache)
    kept = store.memory.objects()
    objects = [obj for obj in kept if not isinstance(obj, chunks.Index)]
    rows = [r for o in objects for r in ((o.globals, *o.fragments) if isinstance(o, chunks.Point)
                                         else (o,))]
    assert {r.shape for r in rows if r.layers == (3, 7)} == {(((0, 1), 64),)}
    assert {r.shape for r in rows if len(r.layers) == 6} == {(((0, 1, 2, 3, 4, 5), 64),)}
    extents = sorted(_extent(a) for r in rows for a in r.arrays() if a.nbytes)
    assert all(a[1] <= b[0] for a, b in zip(extents, extents[1:])), "stored rows share a buffer"
    other = sum(o.nbytes for o in kept if isinstance(o, chunks.Index)) + sum(
        8 * len(o.tail) for o in objects if isinstance(o, chunks.Point))
    assert sum(e[1] - e[0] for e in extents) + other == store.stats().tiers[0].bytes
    joined = []
    real = rows_module._join
    monkeypatch.setattr(rows_module, "_join", lambda blocks: joined.append(len(blocks))
                        or real(blocks))
    n, rebuilt = store.longest_prefix(tokens + [1], model, into=new_list(model))
    assert n == 900
    assert_same(state(rebuilt), state(cache))
    # the globals: 3 chunks and the point's tail; the window [300, 900): a chunk, 2 runs
    assert joined == [4, 4, 3, 3]


def test_rows_of_layers_of_two_widths_keep_a_block_each_and_round_trip_their_bytes():
    dims = (24, 128, 24)  # a [2, 5, 24] block of 480 bytes: the next array starts after padding
    assert chunks.blocks_of(dims) == ((0, 2), (1,))
    rng = np.random.default_rng(0)

    def block(at, count, dim):
        k, v = (mx.array(rng.integers(0, 1 << 16, (len(at), count, dim), dtype=np.uint16))
                .view(mx.bfloat16) for _ in range(2))
        return chunks.Block(at, k, v)

    rows = chunks.Rows(256, 5, (1, 4, 9), (block((0, 2), 5, 24), block((1,), 5, 128)))
    assert rows.kv_dims == dims and rows.nbytes == 2 * 5 * (2 * 24 + 128) * 2
    blob = chunks.encode(rows, "bf16le")
    payload = mx.array(np.frombuffer(blob, dtype=np.uint8))  # what a tier's read lands in
    base = np.asarray(payload).ctypes.data
    for back in (chunks.decode(blob, "bf16le"), chunks.decode(payload, "bf16le")):
        assert back.shape == rows.shape and (back.start, back.count, back.layers) == (256, 5, (1, 4, 9))
        for got, want in zip(back.arrays(), rows.arrays()):
            assert got.shape == want.shape and (bits(got) == bits(want)).all()
        part = back.part(257, 259)
        assert part.count == 2 and (bits(part.blocks[1].values) == bits(rows.blocks[1].values)[:, 1:3]).all()
    # decoded from a buffer, every array is an aligned view of it, not a copy
    for got in back.arrays():
        at = np.asarray(got.view(mx.uint16)).ctypes.data - base
        assert 0 <= at < len(blob) and at % chunks.ALIGN == 0
    with pytest.raises(chunks.ChunkFormatError, match="truncated"):
        chunks.decode(blob[:-2], "bf16le")
    with pytest.raises(chunks.ChunkFormatError, match=f"format {chunks.FORMAT}, got b'MKVS' 1"):
        chunks.decode(bytes(blob[:4]) + (1).to_bytes(2, "little") + bytes(blob[6:]), "bf16le")


def test_a_rebuild_checks_the_lists_model_without_sampling_its_weights_again(monkeypatch):
    model = PLANS["glimmer-w8"](mx.float16)
    other = tiny_model(mx.float16, seed=1, num_hidden_layers=4, head_dim=32, sliding_window=8,
                       max_position_embeddings=CONTEXT)
    store = KVStore()
    tokens = tokens_for(15, 300)
    cache = new_list(model)
    model(mx.array([tokens]), cache=cache)
    store.put(tokens, cache)
    store.longest_prefix(tokens + [1], other, into=new_list(other))  # both fingerprints known
    sampled = []
    real = muser_kv.sessions.snapshot.model_fingerprint
    for module in (muser_kv.sessions.snapshot, muser_kv.sessions.restore):
        monkeypatch.setattr(module, "model_fingerprint", lambda m: sampled.append(m) or real(m))
    assert store.longest_prefix(tokens + [1], model, into=new_list(model))[0] == 300
    with pytest.raises(muser_kv.ModelMismatch):  # rows of model into other's list
        store.longest_prefix(tokens + [1], model, into=new_list(other))
    assert sampled == []


def test_encoded_size_is_the_length_of_the_encoding():
    model = PLANS["glimmer-w300"](mx.bfloat16)
    cache = new_list(model)
    scope, _ = planner.Scopes().of(cache, model)
    for layers, start, count in [(scope.global_layers, 0, 256), (scope.sliding_layers, 768, 256),
                                 (scope.global_layers, 512, 13), (scope.sliding_layers, 5, 1)]:
        rows = chunks.shaped_rows(scope, layers, start, count)
        assert chunks.encoded_size(rows, "bf16le") == len(chunks.encode(rows, "bf16le"))
        point = chunks.Point((1, 2, 3), rows, (rows.part(start, start + count // 2),))
        assert chunks.encoded_size(point, "bf16le") == len(chunks.encode(point, "bf16le"))
    index = chunks.Index(frozenset({0, 7, 255}))
    assert chunks.encoded_size(index, "bf16le") == len(chunks.encode(index, "bf16le"))


def test_a_prepared_store_rebuilds_from_disk_into_buffers_made_ahead(tmp_path, monkeypatch):
    """``prepare`` takes the model's fingerprint and makes landing buffers of the
    sizes its chunks have: the first rebuild after a restart takes its chunks'
    buffers from that stock and samples no weight, and is exact all the same
    (a stocked buffer is rounded up past its payload: the decode is of a slice)."""
    model = PLANS["glimmer-w300"](mx.float16)
    tokens = tokens_for(21)
    first = KVStore(tmp_path / "store")
    states, _ = converse(model, tokens, first)
    first.close()
    again = KVStore(tmp_path / "store", memory_bytes=0)
    again.prepare(model)
    stocked = again.landing.nbytes
    assert stocked > 0
    on_demand, sampled = [], []
    real_bytes, real_fingerprint = reading.host_bytes, planner.model_fingerprint
    monkeypatch.setattr(reading, "host_bytes", lambda n: on_demand.append(n) or real_bytes(n))
    monkeypatch.setattr(planner, "model_fingerprint",
                        lambda m: sampled.append(m) or real_fingerprint(m))
    got, cache = again.longest_prefix(tokens[:901], model, into=new_list(model))
    assert got == 900
    assert_same(state(cache), states[900])
    assert sampled == []
    assert len(on_demand) <= 1  # the point's: points come in every size, and are not stocked
    assert again.stats().read_bytes > sum(on_demand)
    left = again.landing.nbytes
    assert left < stocked and again.restock() == stocked - left  # what the lookup took, again
    deadline = time.monotonic() + 30
    while again.landing.nbytes < stocked:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    again.close()
    assert again.landing.nbytes == 0


def test_the_landing_stock_keeps_its_bound_and_hands_out_each_buffer_once():
    landing = Landing(max_bytes=5 * GRAIN)
    landing.plan({100: 2, 3 * GRAIN: 4})  # 2 of one grain, then what fits of 3 grains: 1
    landing.restock(wait=True)
    assert landing.nbytes == 2 * GRAIN + 3 * GRAIN
    a, view_a = landing.take(100)
    b, view_b = landing.take(100)
    assert a.size == b.size == GRAIN and view_a.nbytes == view_b.nbytes == 100
    view_a[:] = 1
    view_b[:] = 2
    assert (np.asarray(a)[:100] == 1).all() and (np.asarray(b)[:100] == 2).all()
    c, view_c = landing.take(100)  # the stock of that size is spent: made now, exactly
    assert c.size == 100 and view_c.flags.writeable
    assert landing.nbytes == 3 * GRAIN
    assert landing.restock(max_bytes=GRAIN + 1, wait=True) == GRAIN  # one of the two taken
    assert landing.nbytes == 4 * GRAIN
    landing.close()
    landing.restock(wait=True)
    assert landing.nbytes == 0
    with pytest.raises(ValueError, match="landing_bytes"):
        Landing(max_bytes=-1)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_a_put_takes_a_lists_rows_through_the_caches_live_rows(layout):
    """``live_rows(start, stop)`` is the snapshot's rows ``[start, stop)`` bit for
    bit, past a wrap and in both sliding layouts; rows
    a cache does not hold are refused, and the cache is left as it was."""
    model = PLANS["glimmer-w300"](mx.float16)
    tokens = tokens_for(22, 700)
    cache = new_list(model, layout)
    model(mx.array([tokens]), cache=cache)
    for c in cache:
        start, k, v = c.snapshot()
        end = start + k.shape[0]
        for lo, hi in [(start, end), (start + 1, end - 3), (end - 256, end - 1)]:
            keys, values = c.live_rows(lo, hi)
            assert keys.shape == values.shape == (hi - lo, c.kv_dim)
            assert (bits(keys) == bits(k[lo - start:hi - start].reshape(hi - lo, -1))).all()
            assert (bits(values) == bits(v[lo - start:hi - start].reshape(hi - lo, -1))).all()
        before = state([c])
        for lo, hi in [(start - 1, end) if start else (0, end + 1), (end, end), (end - 1, end + 1)]:
            with pytest.raises(ValueError, match="not live"):
                c.live_rows(lo, hi)
        assert_same(state([c]), before)


def test_rebuildable_and_longest_prefix_walk_one_rule_past_a_hole_in_the_chain():
    """A global chunk gone from the middle of a chain (evicted, say) takes every
    position above it with it, and ``longest_prefix`` takes the deepest
    position ``rebuildable`` lists, whichever way each walks the chain."""
    model = PLANS["glimmer-w300"](mx.float16)
    store = KVStore()
    tokens = tokens_for(23)
    states, _ = converse(model, tokens, store)
    window = restore.cache_geometry(new_list(model)).window
    scope = planner.Scopes().of(new_list(model), model)[0]
    names = chunks.chain(scope, tokens, 3)
    store.memory.delete(chunks.object_key("G", names[2]))  # the chunk [256, 512)
    below = [n for n in oracle(PUTS, window) if n < 2 * CHUNK]
    assert below and store.rebuildable(tokens, model, like=new_list(model)) == below
    for length in (302, 512, 513, 700, 901):
        n, cache = store.longest_prefix(tokens[:length], model, into=new_list(model))
        assert n == max([p for p in below if p <= length - 1], default=0)
        if n:
            assert_same(state(cache), states[n])


def test_the_writer_never_reads_the_memory_tiers_arrays_on_the_host(tmp_path, monkeypatch):
    """Where a host read moves a GPU array's buffer (MLX CUDA: into managed
    memory, whose pages a later rebuild faults back), the byte tier's writer
    encodes copies: no array it reads shares a byte with one the memory tier
    keeps, and what it wrote rebuilds bit for bit."""
    from muser_kv.sessions import managed

    monkeypatch.setattr(managed, "host_reads_move", lambda: True)
    kept, shared, encoded = [], [], []
    encode, put = chunks.encode, MemoryTier.put

    def keeps(self, key, obj):
        kept.extend(_extent(a) for a in chunks.arrays_of(obj))
        return put(self, key, obj)

    def spied(obj, encoding):
        # every array the memory tier keeps is alive (nothing is evicted): an array
        # read here shares no byte with one of them, at the time it is read
        alive = list(kept)
        for lo, hi in (_extent(a) for a in chunks.arrays_of(obj)):
            encoded.append(lo)
            shared.extend((lo, hi) for k in alive if lo < k[1] and k[0] < hi)
        return encode(obj, encoding)

    monkeypatch.setattr(chunks, "encode", spied)
    monkeypatch.setattr(MemoryTier, "put", keeps)
    model = PLANS["glimmer-w8"](mx.bfloat16)
    tokens = tokens_for(21)
    store = KVStore(tmp_path / "store")
    states, _ = converse(model, tokens, store)
    store.flush()
    assert encoded and kept and not shared
    store.close()
    again = KVStore(tmp_path / "store", memory_bytes=0)  # every read from the directory
    for n in PUTS:
        got, cache = again.longest_prefix(tokens[:n + 1], model, into=new_list(model))
        assert got == n
        assert_same(state(cache), states[n])
    again.close()
