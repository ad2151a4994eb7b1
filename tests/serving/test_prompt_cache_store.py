"""``ExactPromptCache`` with a ``KVStore`` behind it, driven in-process with the
calls mlx-lm's server makes: where the entries cannot give a prompt back
exactly (a regenerate whose answer was longer than the rings retain, an edited
message, a branch from an earlier turn, an evicted entry), the store rebuilds
the deepest stored point, bit for bit the list that was there; a store that
fails is a fresh prefill, never a failed request."""

from __future__ import annotations

import copy
from typing import List

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model

import muser_kv
from muser_kv import KVStore
from muser_kv.serving.server.prompt_cache import ExactPromptCache

KEY = ("tiny", None, None)


@pytest.fixture(scope="module")
def model():
    return tiny_model(mx.bfloat16, num_hidden_layers=4, head_dim=32, sliding_window=16,
                      max_position_embeddings=2048)


def ids(n: int, seed: int) -> List[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 255, n)]


def fed(model, cache, tokens, decode=0):
    """``tokens`` prefilled, then ``decode`` greedy tokens; the tokens the list holds."""
    logits = model(mx.array(tokens)[None], cache=cache)
    held = list(tokens)
    for _ in range(decode):
        y = int(mx.argmax(logits[0, -1]).item())
        held.append(y)
        logits = model(mx.array([[y]]), cache=cache)
    mx.eval([c.state for c in cache])
    return held


def bits(x):
    return np.array(x.view(mx.uint16))


def served(model, pcache, tokens):
    """What the server does with a prompt: fetch, then prefill the rest."""
    cache, rest = pcache.fetch_nearest_cache(KEY, tokens)
    if cache is None:
        cache = muser_kv.make_prompt_cache(model, retain=8)
    out = model(mx.array(rest)[None], cache=cache)
    return len(tokens) - len(rest), bits(out[0, -1]), cache


def setup(model, store):
    """A prompt cache keeping one entry (the last inserted: the others are
    evicted, as another user's requests would), the store behind it."""
    pcache = ExactPromptCache(max_size=1)
    pcache.attach(store, lambda key: model if key == KEY else None)
    return pcache


def test_regenerate_edit_and_branch_are_rebuilt_from_the_store(model):
    store = KVStore()
    pcache = setup(model, store)
    # turn 1: a 600-token prompt; the server inserts the prompt less its last
    # token, then the finished answer (40 tokens: deeper than the 8 rows retained)
    p1 = ids(600, 1)
    live = muser_kv.make_prompt_cache(model, retain=8)
    fed(model, live, p1[:-1])
    at_prompt = copy.deepcopy(live)
    pcache.insert_cache(KEY, p1[:-1], copy.deepcopy(live))
    turn1 = p1[:-1] + fed(model, live, p1[-1:], decode=40)
    at_answer = copy.deepcopy(live)
    pcache.insert_cache(KEY, turn1, copy.deepcopy(live))
    # regenerate: the same prompt again, the entries cannot trim 41 tokens back
    reused, logits, _ = served(model, pcache, p1)
    assert reused == 599
    assert (logits == bits(model(mx.array(p1[-1:])[None], cache=copy.deepcopy(at_prompt))[0, -1])).all()
    # turn 2, then its last message edited: back to the end of turn 1
    p2 = turn1 + ids(50, 2)
    edited = turn1 + ids(45, 3)
    pcache.insert_cache(KEY, p2[:-1], _list(model, p2[:-1]))
    reused, logits, _ = served(model, pcache, edited)
    assert reused == len(turn1)
    want = model(mx.array(edited[len(turn1):])[None], cache=copy.deepcopy(at_answer))
    assert (logits == bits(want[0, -1])).all()
    # a branch from turn 1's prompt: a new answer to the same question
    branch = p1 + ids(30, 4)
    reused, _, _ = served(model, pcache, branch)
    assert reused == 600 if branch[600] == turn1[600] else reused == 599
    assert store.stats().hits == 3


def _list(model, tokens):
    cache = muser_kv.make_prompt_cache(model, retain=8)
    fed(model, cache, tokens)
    return cache


def test_an_evicted_entry_is_rebuilt_and_a_failing_store_is_a_fresh_prefill(model, monkeypatch):
    store = KVStore()
    pcache = setup(model, store)
    p = ids(700, 5)
    cache = _list(model, p)
    pcache.insert_cache(KEY, p, cache)
    pcache.trim_to(n_sequences=0)  # every entry evicted
    reused, _, _ = served(model, pcache, p + [1])
    assert reused == 700

    def broken(*a, **k):
        raise OSError("the store's disk is gone")

    monkeypatch.setattr(store, "longest_prefix", broken)
    monkeypatch.setattr(store, "put", broken)
    pcache.trim_to(n_sequences=0)
    reused, _, _ = served(model, pcache, p + [1])
    assert reused == 0
    pcache.insert_cache(KEY, p, _list(model, p))  # a failed put is a log line


def test_lists_with_a_draft_models_caches_stay_out_of_the_store(model):
    store = KVStore()
    pcache = ExactPromptCache(max_size=10)
    pcache.attach(store, lambda key: None)  # the provider says: a draft model is loaded
    p = ids(300, 6)
    pcache.insert_cache(KEY, p, _list(model, p))
    assert store.stats().puts == 0


def test_a_full_disk_under_the_store_leaves_every_request_served(model, tmp_path, monkeypatch):
    """ENOSPC on the store's directory: its puts fail (a log line), the memory
    tier still serves this process, and a restarted one (nothing on disk)
    prefills afresh: no request fails, none is answered from a torn chunk."""
    import errno
    import os

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    store = KVStore(str(tmp_path / "store"), write_behind=False)
    pcache = setup(model, store)
    p = ids(700, 7)
    monkeypatch.setattr(os, "fsync", full)
    pcache.insert_cache(KEY, p, _list(model, p))
    pcache.trim_to(n_sequences=0)
    reused, _, _ = served(model, pcache, p + [1])
    assert reused == 700  # the memory tier
    monkeypatch.undo()
    store.close()
    restarted = KVStore(str(tmp_path / "store"))
    reused, _, _ = served(model, setup(model, restarted), p + [1])
    assert reused == 0
    assert restarted.stats().tiers[1].chunks == 0
