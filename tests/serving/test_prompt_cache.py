"""The server's prompt cache (``muser_kv.prompt_cache.ExactPromptCache``), driven
in-process with the calls mlx-lm's server makes (``fetch_nearest_cache``,
``insert_cache``) on entries built the way the server builds them: a prefill,
then decode steps, on mlx-lm's Muse Glimmer (tiny geometry, window 16).

What is compared with what, and why: a reused entry is exact when the cache it
hands back is the cache the sequence had at that position, so its logits are
compared bitwise with a cache *built the same way up to that position* (the
same prefill, the same decode steps). Not with a fresh prefill of the same
tokens: a chunked prefill sums attention in another order than a cache built
token by token (whose ring is also rotated), so its logits differ in the last
bits, and that is not what reuse promises.
"""

from __future__ import annotations

import copy
from typing import List, Sequence

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.models.cache import LRUPromptCache

import muser_kv
from muser_kv.serving.server import prompt_cache as pc
from muser_kv.serving.server.prompt_cache import ExactPromptCache, exact_trim_depth

KEY = ("tiny", None, None)  # the server's model key: (model path, adapter, draft)
WINDOW = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model(mx.float32)


def prompt(n: int, seed: int = 0) -> List[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 255, n)]


def build(model, tokens: Sequence[int], decode: int = 0, caches: str = "muser", retain: int = 16):
    """A cache as the server leaves it: ``tokens`` prefilled in one chunk, then
    ``decode`` greedy tokens fed one at a time. Returns (cache, every token it holds)."""
    cache = (muser_kv.make_prompt_cache(model, retain=retain) if caches == "muser"
             else model.make_cache())
    logits = model(mx.array(tokens)[None], cache=cache)
    held = list(tokens)
    for _ in range(decode):
        y = int(mx.argmax(logits[0, -1]).item())
        held.append(y)
        logits = model(mx.array([[y]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache, held


def logits_after(model, cache, rest: Sequence[int]) -> np.ndarray:
    out = model(mx.array(rest)[None], cache=cache)
    mx.eval(out)
    return np.array(out)


def offsets(cache) -> List[int]:
    return [c.offset for c in cache]


# -- a longer entry past the wrap -------------------------------------------------------------


def test_a_longer_entry_within_its_exact_depth_is_reused_exactly(model):
    entry, held = build(model, prompt(40), decode=10)  # 50 tokens: every ring wrapped
    depth = exact_trim_depth(entry)
    assert 3 <= depth < 50, depth
    lru = ExactPromptCache()
    lru.insert_cache(KEY, held, entry)
    ask = held[:47] + prompt(5, seed=1)  # diverges 3 tokens before the entry's end
    cache, rest = lru.fetch_nearest_cache(KEY, ask)
    assert rest == ask[47:] and offsets(cache) == [47] * 8
    reference, _ = build(model, prompt(40), decode=7)  # the same state, built the same way
    assert np.array_equal(logits_after(model, cache, rest), logits_after(model, reference, rest))
    assert offsets(lru.trie.get(KEY, held).prompt_cache) == [50] * 8  # the entry is untouched


def test_a_longer_entry_past_its_exact_depth_is_passed_over(model):
    base = prompt(40)
    shorter, _ = build(model, base[:20])  # wrapped too
    entry, held = build(model, base, decode=10)
    depth = exact_trim_depth(entry)
    cut = 50 - depth - 1  # one token more to trim than the entry can give back exactly
    assert cut > 20
    ask = held[:cut] + prompt(5, seed=2)
    theirs = LRUPromptCache()  # mlx-lm's: the trim is attempted and refused, the request fails
    theirs.insert_cache(KEY, held, copy.deepcopy(entry))
    with pytest.raises(ValueError, match="can trim at most"):
        theirs.fetch_nearest_cache(KEY, ask)

    lru = ExactPromptCache()
    lru.insert_cache(KEY, held, entry)
    assert lru.fetch_nearest_cache(KEY, ask) == (None, ask)  # a fresh prefill, no error
    lru.insert_cache(KEY, base[:20], shorter)
    cache, rest = lru.fetch_nearest_cache(KEY, ask)  # the shorter entry instead
    assert rest == ask[20:] and offsets(cache) == [20] * 8
    reference, _ = build(model, base[:20])
    assert np.array_equal(logits_after(model, cache, rest), logits_after(model, reference, rest))


def test_the_entry_reusing_most_wins_and_equal_reuse_prefers_no_trim(model):
    base = prompt(40)
    at_39, _ = build(model, base[:39])
    entry, held = build(model, base, decode=4)
    lru = ExactPromptCache()
    lru.insert_cache(KEY, base[:39], at_39)
    lru.insert_cache(KEY, held, entry)
    # the prompt itself: the entry at 39 reuses 39 as it is; the longer one needs a trim of 5
    cache, rest = lru.fetch_nearest_cache(KEY, base)
    assert rest == base[39:] and cache[0].offset == 39
    # one token further: only the longer entry (trimmed by 3) reuses 41
    ask = held[:41] + [7]
    cache, rest = lru.fetch_nearest_cache(KEY, ask)
    assert rest == [7] and cache[0].offset == 41


# -- insertion keeps what a trim cannot give back ---------------------------------------------


def test_prefixes_a_wrapped_entry_cannot_be_trimmed_back_to_survive_its_insertion(model):
    base = prompt(40)
    far, _ = build(model, base[:20])
    near, near_held = build(model, base, decode=8)
    entry, held = build(model, base, decode=10)
    depth = exact_trim_depth(entry)
    assert held[:48] == near_held and 50 - 20 + 1 > depth >= 50 - 48 + 1
    for cls in (LRUPromptCache, ExactPromptCache):
        lru = cls()
        lru.insert_cache(KEY, base[:20], copy.deepcopy(far))
        lru.insert_cache(KEY, near_held, copy.deepcopy(near))
        lru.insert_cache(KEY, held, copy.deepcopy(entry))
        kept = sorted(len(t) for lrus in lru._lru._lrus.values() for _, t in lrus)
        if cls is LRUPromptCache:
            assert kept == [50]  # mlx-lm drops both prefixes of a trimmable cache
        else:
            assert kept == [20, 50] and len(lru) == 2  # the far prefix stays, the near one goes
            assert lru.nbytes == sum(c.nbytes for c in far) + sum(c.nbytes for c in entry)
    ask = base[:20] + prompt(4, seed=3)
    cache, rest = lru.fetch_nearest_cache(KEY, ask)
    assert rest == ask[20:] and cache[0].offset == 20


def test_an_entry_is_keyed_by_the_tokens_its_caches_hold(model):
    # mlx-lm's speculative path stores a cache one token short of its key
    entry, held = build(model, prompt(40), decode=6)
    key = held + [9]
    ask = key + [3, 4]
    theirs = LRUPromptCache()
    theirs.insert_cache(KEY, key, copy.deepcopy(entry))
    cache, rest = theirs.fetch_nearest_cache(KEY, ask)
    assert cache[0].offset == 46 and rest == [3, 4]  # token 9 would never reach the model

    lru = ExactPromptCache()
    lru.insert_cache(KEY, key, entry)
    cache, rest = lru.fetch_nearest_cache(KEY, ask)
    assert cache[0].offset == 46 and rest == [9, 3, 4]
    reference, _ = build(model, prompt(40), decode=6)
    assert np.array_equal(logits_after(model, cache, rest), logits_after(model, reference, rest))
    ahead, _ = build(model, prompt(10))
    lru.insert_cache(KEY, prompt(9), ahead)  # holds more than its key says: not kept
    assert len(lru) == 1


# -- never an empty remainder, never a failed request ------------------------------------------


def test_a_prompt_equal_to_an_entry_is_reused_one_token_short(model):
    entry, held = build(model, prompt(40), decode=10)
    theirs = LRUPromptCache()
    theirs.insert_cache(KEY, held, copy.deepcopy(entry))
    assert theirs.fetch_nearest_cache(KEY, held)[1] == []  # mlx-lm's server then fails
    lru = ExactPromptCache()
    lru.insert_cache(KEY, held, entry)
    cache, rest = lru.fetch_nearest_cache(KEY, held)
    assert rest == held[-1:] and cache[0].offset == 49
    reference, _ = build(model, prompt(40), decode=9)
    assert np.array_equal(logits_after(model, cache, rest), logits_after(model, reference, rest))


def test_without_retained_rows_a_wrapped_entry_is_reused_only_as_a_prefix(model):
    entry, held = build(model, prompt(40), decode=2, retain=0)
    assert exact_trim_depth(entry) == 0
    lru = ExactPromptCache()
    lru.insert_cache(KEY, held, entry)
    assert lru.fetch_nearest_cache(KEY, held) == (None, held)
    assert lru.fetch_nearest_cache(KEY, held[:41] + [5]) == (None, held[:41] + [5])
    cache, rest = lru.fetch_nearest_cache(KEY, held + [5])
    assert rest == [5] and cache[0].offset == 42


def test_a_trim_refused_within_the_claimed_depth_prefills_afresh(model, monkeypatch):
    entry, held = build(model, prompt(40), decode=10)
    lru = ExactPromptCache()
    lru.insert_cache(KEY, held, entry)
    monkeypatch.setattr(pc, "exact_trim_depth", lambda caches: 10 ** 6)  # a depth that lies
    ask = held[:5] + [1, 2]
    assert lru.fetch_nearest_cache(KEY, ask) == (None, ask)
    assert offsets(lru.trie.get(KEY, held).prompt_cache) == [50] * 8


# -- mlx-lm's own caches: mlx-lm's behaviour -----------------------------------------------------


def script(model, cls):
    """Inserts and fetches over mlx-lm's caches, before and past the wrap; what came back."""
    lru = cls()
    out = []
    short = prompt(10, seed=5)
    for tokens, decode in ((short[:6], 0), (short, 2), (prompt(40), 0), (prompt(40), 6)):
        cache, held = build(model, tokens, decode=decode, caches="mlx-lm")
        lru.insert_cache(KEY, held, cache)
        out.append(("len", len(lru)))
    long_, _ = build(model, prompt(40), decode=6, caches="mlx-lm")
    for ask in (short[:8] + [1], short + [4], prompt(40)[:39] + [2], prompt(40)[:20], prompt(40)):
        cache, rest = lru.fetch_nearest_cache(KEY, ask)
        out.append((rest, None if cache is None else offsets(cache)))
    return out


def test_mlx_lm_caches_get_mlx_lm_behaviour(model):
    ours, theirs = script(model, ExactPromptCache), script(model, LRUPromptCache)
    assert ours == theirs
    # a prefix dropped before the wrap, kept past it; an exact hit returns no tokens
    assert [n for _, n in ours[:4]] == [1, 1, 2, 3] and ([], [40] * 8) in ours[4:]


def test_an_entry_holds_its_rows_not_a_growths_headroom():
    """The sequential path inserts the very list it decoded with, whose growing
    global planes may allocate up to twice their rows: the entry is fitted to
    its rows (rounded up to 256), counted so, and reused exactly."""
    model = tiny_model(mx.float32, max_position_embeddings=1024)
    entry, held = build(model, prompt(510), decode=10)  # 520 rows: planes grown to 1,024
    glob = [c for c in entry if c.kind is muser_kv.LayerKind.GLOBAL]
    assert glob and all(c.planes.rows == 1024 for c in glob)
    grown = sum(c.nbytes for c in entry)
    lru = ExactPromptCache()
    lru.insert_cache(KEY, held, entry)
    assert all(c.planes.rows == 768 for c in glob)
    assert lru.nbytes == sum(c.nbytes for c in entry) < grown
    ask = held + prompt(3, seed=2)
    cache, rest = lru.fetch_nearest_cache(KEY, ask)
    reference, _ = build(model, prompt(510), decode=10)
    assert np.array_equal(logits_after(model, cache, rest), logits_after(model, reference, rest))
