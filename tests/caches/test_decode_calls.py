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
#: muser-kv's decode attention: mlx-lm's is one call into its ``base.py`` over
#: one C++ call; ours, routed in its place, is the wrapper, the cache's read of
#: where its keys lie and the backend's attention (its arithmetic in
#: ``core/attention.py``: the reference on the CPU, two kernel launches on a GPU)
ATTENTION = {("mlx_lm_attention.py", "scaled_dot_product_attention"), ("base.py", "decode_read"),
             ("batch.py", "decode_read"), ("kernels.py", "attend")}
ATTENTION_FILE = os.path.join(PACKAGE, "core", "attention.py")


def split(calls: Counter):
    """(the caches' calls, the decode attention's calls): ``calls`` without and
    with ``ATTENTION`` (``core/attention.py`` is not counted: it computes)."""
    attention = Counter({k: n for k, n in calls.items() if k in ATTENTION})
    return calls - attention, attention


def calls_per_decode_forward(model, caches, counted) -> Counter:
    """The calls into files ``counted(filename)`` accepts during one decode
    forward, after a prompt that wraps the sliding window and two tokens."""
    window = model.args.sliding_window
    mx.eval(model(mx.array([list(range(1, 2 * window + 9))]), cache=caches))
    for t in (3, 4):
        mx.eval(model(mx.array([[t]]), cache=caches))
    calls: Counter = Counter()

    def hook(frame, event, arg):
        if event == "call" and counted(frame.f_code.co_filename) \
                and frame.f_code.co_filename != ATTENTION_FILE:
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
    caches, attention = split(ours)
    assert sum(caches.values()) <= sum(theirs.values()), (
        f"muser-kv {sum(caches.values())} calls {dict(caches)}; "
        f"mlx-lm {sum(theirs.values())} calls (its attention included) {dict(theirs)}")
    layers = len(model.layers)
    assert attention == Counter({k: layers for k in ATTENTION if k[0] != "batch.py"}), attention


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
    seen: Counter = Counter()

    def hook(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(PACKAGE) and name != ATTENTION_FILE:
            seen[(os.path.basename(name), frame.f_code.co_name)] += 1

    sys.setprofile(hook)
    try:
        out = model(mx.full((b, 1), 5), cache=batch)
    finally:
        sys.setprofile(None)
    mx.eval(out)
    return seen


def test_a_batch_decode_forward_adds_one_reservation_per_sequence_and_layer():
    """mlx-lm's batch caches keep one array per layer and make the same calls
    at any B; muser-kv's keep a ring per sequence, so each sequence costs its
    layer one call to reserve its row (``Ring.append``) and a sliding layer one
    more for retention (``SlidingKVCache.decode_row``), and nothing else grows
    with B (the decode attention's calls not at all)."""
    model = tiny_model(mx.bfloat16)
    kinds = [c.kind for c in muser_kv.make_prompt_cache(model)]
    per_sequence = sum(2 if k is muser_kv.LayerKind.SLIDING else 1 for k in kinds)
    one, four = split(batch_calls(model, 1)), split(batch_calls(model, 4))
    assert sum(four[0].values()) - sum(one[0].values()) <= 3 * per_sequence, (one, four)
    assert four[1] == one[1], "the decode attention's calls grew with B"
