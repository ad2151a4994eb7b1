"""What one decode token costs each layer, in graph primitives: exactly mlx-lm's.

One store + fetch (``make_mask(1)`` + ``update_and_fetch`` of one token) on a
sliding and a global layer in steady state, ours against mlx-lm's caches, with
the primitives of the lazy graph counted (``mx.export_to_dot``). On the GPU every
primitive but a view is a dispatch, and decode time is dispatch time, so this is
an invariant: a full ring costs two slice updates and nothing else (a whole
plane is read with no op), a growing plane two slice updates and two slices --
what mlx-lm's ``RotatingKVCache`` and ``KVCache`` cost -- and a batch of
sequences at one row costs the same.
"""

import re
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from muser_kv import LayerKind, MuseGeometry, make_cache_for
from muser_kv.caches.batch import BatchKVCache

H, D, WINDOW, DEPTH = 2, 128, 2048, 4096


def primitives(arrays) -> Counter:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        dot = Path(f.name).read_text()
    return Counter(re.findall(r'\{ \d+ \[label ="([^"]+)"', dot))


def steady(cache, dtype):
    x = mx.zeros((1, H, DEPTH, D), dtype)
    cache.update_and_fetch(x, x)
    for _ in range(2):
        cache.update_and_fetch(x[:, :, :1], x[:, :, :1])
    mx.eval([a for a in cache.state if isinstance(a, mx.array)])


def one_token(cache, dtype, window, batch=1):
    k = mx.zeros((batch, H, 1, D), dtype)
    mx.eval(k)
    mask = cache.make_mask(1, window_size=window, return_array=False)
    kk, vv = cache.update_and_fetch(k, k)
    return primitives([kk, vv] + ([mask] if isinstance(mask, mx.array) else []))


def ours(kind):
    return make_cache_for(MuseGeometry(num_layers=1, window=WINDOW, max_context=DEPTH + 16,
                                       num_heads=32, layer_kinds=(kind,)), retain=0)[0]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_a_decode_token_costs_mlx_lms_primitives(dtype):
    plane_dtype = "bfloat16" if dtype == mx.bfloat16 else "float16"
    for kind, theirs, window in ((LayerKind.SLIDING, RotatingKVCache(WINDOW), WINDOW),
                                 (LayerKind.GLOBAL, KVCache(), None)):
        cache = make_cache_for(MuseGeometry(num_layers=1, window=WINDOW, max_context=DEPTH + 16,
                                            num_heads=32, layer_kinds=(kind,)), retain=0,
                               plane_dtype=plane_dtype)[0]
        steady(cache, dtype)
        steady(theirs, dtype)
        mine, lm = one_token(cache, dtype, window), one_token(theirs, dtype, window)
        if kind is LayerKind.SLIDING:
            assert mine == Counter({"SliceUpdate": 2}), mine
        else:
            assert mine == Counter({"SliceUpdate": 2, "Slice": 2}), mine
        assert mine == lm, (kind, mine, lm)


def test_a_batch_at_one_row_costs_the_same():
    for kind, window in ((LayerKind.SLIDING, WINDOW), (LayerKind.GLOBAL, None)):
        singles = [ours(kind) for _ in range(3)]
        for c in singles:
            steady(c, mx.float16)
        batch = BatchKVCache.merge(singles)
        got = one_token(batch, mx.float16, window, batch=3)
        assert got["SliceUpdate"] == 2 and sum(got.values()) - got["Slice"] == 2, got
