"""Does the attention over a cache's planes depend on what MLX's allocator had
cached? It must not: the same rows must give the same bits.

MLX's CUDA attention reads a decode step's K/V with cuDNN only when the planes
fill their buffer exactly, and with its vector kernel otherwise (the two round
differently); its allocator hands out a freed buffer up to two pages (32 KiB)
larger than asked (``benchmarks/determinism.py`` section 3). A run whose
allocator cache is filled with such larger buffers before every step is held to
the clean run's attention bit for bit: live (growing and preallocated),
deep-copied (mlx-lm's server prompt cache), and loaded from a session file.

On the CPU every kernel reads any buffer alike, so these pass there by
construction; on MLX CUDA they fail today (the growing f16 case on the H200,
at the second decode step), which is the open part of making repeated answers
of ``muser-kv serve`` identical: they are marked as expected to fail there,
not strictly, until planes own buffers of exactly their size.
"""

import copy

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model

import muser_kv
from muser_kv.core.geometry import LayerKind

PAGE = 16384  # MLX CUDA's allocation page
CONTEXT = 4096
PREFILL = (200, 100, 300)  # crosses the 256- and 512-row allocations
DECODE = 6


@pytest.fixture(scope="module", params=[mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def model(request):
    return tiny_model(request.param, max_position_embeddings=CONTEXT)


def recycle(model) -> None:
    """Leave freed buffers one page larger than every plane allocation up to 4,096
    rows in MLX's buffer cache, two per plane of every layer."""
    a = model.args
    row = a.num_key_value_heads * a.head_dim * 2
    decoys = [mx.zeros((row * 256 * (1 << i) + PAGE,), mx.uint8)
              for i in range(5) for _ in range(2 * a.num_hidden_layers)]
    mx.eval(decoys)
    del decoys


def rows(model, n: int, seed: int):
    """Keys, values and one query of ``n`` tokens, as a model's attention hands them."""
    a = model.args
    key = mx.random.key(seed)
    k, v, q = (mx.random.normal((1, h, n, a.head_dim), key=mx.random.split(key, 3)[i]).astype(
        model.layers[0].self_attn.q_proj.weight.dtype)
        for i, h in enumerate((a.num_key_value_heads, a.num_key_value_heads,
                               a.num_attention_heads)))
    return k, v, q


def step(model, cache, n: int, seed: int, poisoned: bool) -> list:
    """One forward's worth of writes, every layer in list order (the planes
    allocated between the decoys and the write, as in a forward), then each
    layer's attention over what it returned, mlx-lm's way; the outputs' bits."""
    k, v, q = rows(model, n, seed)
    mx.eval(k, v, q)
    if poisoned:
        recycle(model)
    masks = [c.make_mask(n, window_size=None if c.kind is LayerKind.GLOBAL else c.window_size)
             for c in cache]
    outs = []
    for c, mask in zip(cache, masks):
        keys, values = c.update_and_fetch(k, v)
        outs.append(mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.088, mask=mask))
    mx.eval(outs)
    return [np.array(o.view(mx.uint16)) for o in outs]


def prefill(model, cache, poisoned: bool) -> list:
    return [step(model, cache, n, i, poisoned) for i, n in enumerate(PREFILL)]


def decode(model, cache, poisoned: bool) -> list:
    return [step(model, cache, 1, 100 + i, poisoned) for i in range(DECODE)]


def live(model, poisoned, preallocate):
    cache = muser_kv.make_prompt_cache(model, max_context=CONTEXT, preallocate=preallocate)
    return prefill(model, cache, poisoned) + decode(model, cache, poisoned)


def copied(model, poisoned, _tmp):
    cache = muser_kv.make_prompt_cache(model, max_context=CONTEXT)
    out = prefill(model, cache, poisoned)
    if poisoned:
        recycle(model)
    return out + decode(model, copy.deepcopy(cache), poisoned)


def loaded(model, poisoned, tmp):
    cache = muser_kv.make_prompt_cache(model, max_context=CONTEXT)
    out = prefill(model, cache, poisoned)
    path = tmp / f"s{int(poisoned)}.safetensors"
    muser_kv.save_session(path, cache, model=model)
    if poisoned:
        recycle(model)
    return out + decode(model, muser_kv.load_session(path, model, CONTEXT), poisoned)


RUNS = {
    "growing": lambda m, p, _t: live(m, p, False),
    "preallocated": lambda m, p, _t: live(m, p, True),
    "deep-copied": copied,
    "loaded": loaded,
}


@pytest.mark.xfail(mx.cuda.is_available(), strict=False,
                   reason="MLX CUDA: a recycled larger buffer gets the vector kernel, not cuDNN")
@pytest.mark.parametrize("path", list(RUNS))
def test_attention_does_not_depend_on_the_allocator_cache(model, path, tmp_path):
    clean = RUNS[path](model, False, tmp_path)
    poisoned = RUNS[path](model, True, tmp_path)
    for i, (a, b) in enumerate(zip(clean, poisoned)):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert np.array_equal(x, y), (
                f"{path}: step {i}, layer {layer}: attention differs after the allocator's "
                "cache was filled with larger buffers")
