"""How many Python calls one decode forward makes into the caches: no more
than mlx-lm's own caches make on the same model.

Decode time on a GPU is host time (graph building, dispatch), not bytes, so
the calls per token are an invariant of the cache design, counted here with a
``sys.setprofile`` hook (never a timing): every call into a ``muser_kv``
module during one forward of the default tiny Muse Glimmer (8 layers: 6
sliding, 2 global) past the wrap, against every call into mlx-lm's
``models/cache.py`` and ``models/base.py`` (its caches and mask helpers) for
mlx-lm's own caches on the same model at the same position.
"""

import os
import sys
from collections import Counter

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import pytest
from conftest import tiny_model
from mlx_lm.models import cache as mlx_cache

import muser_kv

PACKAGE = os.path.dirname(muser_kv.__file__) + os.sep
MLX_LM = {mlx_cache.__file__, mlx_base.__file__}


def calls_per_decode_forward(model, caches, counted) -> Counter:
    """The calls into files ``counted(filename)`` accepts during one decode
    forward, after a prompt that wraps the sliding window and two tokens."""
    window = model.args.sliding_window
    mx.eval(model(mx.array([list(range(1, 2 * window + 9))]), cache=caches))
    for t in (3, 4):
        mx.eval(model(mx.array([[t]]), cache=caches))
    calls: Counter = Counter()

    def hook(frame, event, arg):
        if event == "call" and counted(frame.f_code.co_filename):
            calls[(os.path.basename(frame.f_code.co_filename), frame.f_code.co_name)] += 1

    sys.setprofile(hook)
    try:
        out = model(mx.array([[5]]), cache=caches)
    finally:
        sys.setprofile(None)
    mx.eval(out)
    return calls


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_a_decode_forward_calls_the_caches_no_more_than_mlx_lm(dtype):
    model = tiny_model(dtype)
    ours = calls_per_decode_forward(model, muser_kv.make_prompt_cache(model),
                                    lambda f: f.startswith(PACKAGE))
    theirs = calls_per_decode_forward(model, mlx_cache.make_prompt_cache(model),
                                      lambda f: f in MLX_LM)
    assert sum(ours.values()) <= sum(theirs.values()), (
        f"muser-kv {sum(ours.values())} calls {dict(ours)}; "
        f"mlx-lm {sum(theirs.values())} calls {dict(theirs)}")


def batch_calls(model, b: int) -> int:
    """Calls into ``muser_kv`` in one decode forward of ``b`` sequences merged
    per layer as mlx-lm's ``BatchGenerator`` merges them (``cls.merge``), each
    past the wrap."""
    window = model.args.sliding_window
    lists = []
    for i in range(b):
        cache = muser_kv.make_prompt_cache(model)
        mx.eval(model(mx.array([list(range(1 + i, 2 * window + 9 + i))]), cache=cache))
        lists.append(cache)
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*lists)]
    for t in (3, 4):
        mx.eval(model(mx.full((b, 1), t), cache=batch))
    seen = [0]

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen[0] += 1

    sys.setprofile(hook)
    try:
        out = model(mx.full((b, 1), 5), cache=batch)
    finally:
        sys.setprofile(None)
    mx.eval(out)
    return seen[0]


def test_a_batch_decode_forward_adds_one_reservation_per_sequence_and_layer():
    """mlx-lm's batch caches keep one array per layer and make the same calls
    at any B; muser-kv's keep a ring per sequence, so each sequence costs its
    layer one call to reserve its row (``Ring.append``) and a sliding layer one
    more for retention (``SlidingKVCache.decode_row``), and nothing else grows
    with B."""
    model = tiny_model(mx.bfloat16)
    kinds = [c.kind for c in muser_kv.make_prompt_cache(model)]
    per_sequence = sum(2 if k is muser_kv.LayerKind.SLIDING else 1 for k in kinds)
    one, four = batch_calls(model, 1), batch_calls(model, 4)
    assert four - one <= 3 * per_sequence, (one, four, per_sequence)
