"""Whatever builds a cache list at position n (a session load, a snapshot
restore, a store rebuild, a prompt-cache fetch, a batch extract, a trim), the
list hands attention what the live list at n hands it: the same rows in the
same allocation, so the same next logits bit for bit.

The logits are equal on the CPU whatever the allocation; on MLX CUDA they are
not, because its attention picks a kernel by the strides of the views it is
handed, and a head-major plane's head stride is its allocation. So the
allocation is asserted here, on every backend, beside the logits: the
allocations a write leaves are the first thing compared.

Positions are chosen where the allocations used to differ: 600 live rows
(a growing plane doubled to 1,024; a list built from its rows held 768) and
510 after a draft past 512 was trimmed (the live plane had doubled to 1,024).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import trim_prompt_cache
from model_zoo import ZOO, tiny

import muser_kv
from muser_kv.caches.batch import BatchKVCache
from muser_kv.serving.server.prompt_cache import ExactPromptCache

CONTEXT = 1024
N = 600
KEY = ("tiny", None, None)
DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16}
CASES = [(name, dt) for name in sorted(ZOO) for dt in ZOO[name].dtypes]


def long_model(name: str, dtype):
    """The conformance suite's tiny ``name`` model with room for ``CONTEXT`` positions."""
    return tiny(name, dtype, context=CONTEXT)


def bits(x: mx.array) -> np.ndarray:
    return np.array(x.view(mx.uint16) if x.dtype in (mx.float16, mx.bfloat16) else x)


def tokens(n: int, seed: int = 0):
    return np.random.default_rng(seed).integers(1, 128, n).tolist()


def new_list(model, preallocate: bool):
    return muser_kv.make_prompt_cache(model, max_context=CONTEXT, preallocate=preallocate)


def live(model, toks, preallocate: bool):
    """A list that reached ``len(toks)`` as a user's does: a prefill, then decode."""
    cache = new_list(model, preallocate)
    mx.eval(model(mx.array([toks[:-3]]), cache=cache))
    for t in toks[-3:]:
        mx.eval(model(mx.array([[t]]), cache=cache))
    return cache


def allocations(cache):
    return [c.planes.rows for c in cache]


def step(model, cache, token=7):
    """The next logits' bits, and the allocations attention read them from."""
    out = bits(model(mx.array([[token]]), cache=cache)[0, -1])
    return out, allocations(cache)


def builders(model, toks, reference, preallocate, tmp_path):
    """Every way to a list at ``len(toks)`` other than living there."""
    n = len(toks)
    path = tmp_path / "s.safetensors"
    muser_kv.save_session(path, reference)
    yield "load", muser_kv.load_session(path, model, preallocate=preallocate)
    snapshot = muser_kv.SessionSnapshot.capture(reference, model)
    into = new_list(model, preallocate)
    muser_kv.restore_into(into, snapshot)
    yield "restore_into", into
    store = muser_kv.KVStore()
    store.put(toks, reference, model)
    got, rebuilt = store.longest_prefix(toks + [5], model, into=new_list(model, preallocate))
    assert got == n
    yield "store", rebuilt
    prompts = ExactPromptCache()
    prompts.insert_cache(KEY, toks, copy.deepcopy(reference))
    fetched, rest = prompts.fetch_nearest_cache(KEY, toks + [7])
    assert rest == [7]
    yield "prompt cache", fetched
    yield "extract", [BatchKVCache.merge([c]).extract(0) for c in reference]


@pytest.mark.parametrize("preallocate", [False, True], ids=["growing", "preallocated"])
@pytest.mark.parametrize("name,dtype", CASES)
def test_every_builder_gives_the_live_lists_allocation_and_logits(name, dtype, preallocate,
                                                                  tmp_path):
    model = long_model(name, DTYPES[dtype])
    toks = tokens(N)
    reference = live(model, toks, preallocate)
    want = step(model, copy.deepcopy(reference))
    if not preallocate:
        grown = [r for r, c in zip(want[1], reference) if c.growing]
        assert grown and set(grown) == {1024}, "the live planes did not reach the case"
    for how, cache in builders(model, toks, reference, preallocate, tmp_path):
        got = step(model, cache)
        assert got[1] == want[1], f"{how}: allocations {got[1]} != live {want[1]}"
        assert np.array_equal(got[0], want[0]), f"{how}: next logits differ from the live list's"


@pytest.mark.parametrize("name,dtype", CASES)
def test_a_trimmed_list_is_the_live_list_at_its_new_offset(name, dtype):
    """A draft of 5 past 512 rows doubles the planes; trimmed back to 510, the
    next write settles them where the list that never drafted is."""
    model = long_model(name, DTYPES[dtype])
    toks = tokens(515)
    drafted = live(model, toks[:510], False)
    reference = copy.deepcopy(drafted)
    mx.eval(model(mx.array([toks[510:]]), cache=drafted))
    assert trim_prompt_cache(drafted, 5) == 5
    want, got = step(model, reference), step(model, drafted)
    assert got[1] == want[1], f"allocations {got[1]} != live {want[1]}"
    assert 512 in want[1] and np.array_equal(got[0], want[0])


@pytest.mark.parametrize("name", ["muse_glimmer", "gemma4_text", "gpt_oss"])
@pytest.mark.parametrize("preallocate", [False, True], ids=["growing", "preallocated"])
def test_a_batch_merged_at_its_positions_is_the_batch_that_decoded_there(name, preallocate):
    """Two sequences decoded together from 508 and 300 tokens to 514 and 306
    (the batch's planes double at 513), against a batch merged at 514 and 306
    from the same rows (each sequence extracted: a batch's rows differ from a
    lone sequence's on a GPU, whose matmuls round by batch size): the same
    allocation, the same batched next logits."""
    model = long_model(name, mx.bfloat16)
    a, b = tokens(514, 1), tokens(306, 2)
    singles = [live(model, a[:508], preallocate), live(model, b[:300], preallocate)]
    together = [BatchKVCache.merge(list(layer)) for layer in zip(*singles)]
    for t in range(6):
        mx.eval(model(mx.array([[a[508 + t]], [b[300 + t]]]), cache=together))
    apart = [BatchKVCache.merge([c.extract(0), c.extract(1)]) for c in together]
    nxt = mx.array([[7], [9]])
    want = bits(model(nxt, cache=together)[:, -1])
    got = bits(model(nxt, cache=apart)[:, -1])
    assert allocations(apart) == allocations(together)
    if not preallocate:
        assert {r for r, c in zip(allocations(apart), apart) if c.planes.growing} == {1024}
    assert np.array_equal(got, want)
