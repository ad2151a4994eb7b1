"""Does the attention over a cache's planes depend on what MLX's allocator had
cached? It must not: the same rows must give the same bits.

MLX's CUDA attention reads a decode step's K/V with cuDNN only when the planes
fill their buffer exactly, and with its vector kernel otherwise (the two round
differently); its allocator hands out a freed buffer up to two pages (32 KiB)
larger than asked (``benchmarks/determinism.py`` section 3). A run whose
allocator cache is filled with such larger buffers before every step is held to
the clean run's attention bit for bit: live (growing and preallocated),
deep-copied (mlx-lm's server prompt cache), and loaded from a session file.

Each run is made twice more: with its decode steps pipelined as mlx-lm's
``generate_step`` runs them (a step's writes evaluated while the previous
step's attention may still be in flight, which holds the planes' buffers, so
a write may not reuse them and copies the plane into whatever the allocator
hands out), and with MLX's buffer cache off (``mx.set_cache_limit(0)`` and one
``mx.clear_cache()``: a freed buffer is returned, never handed out again, so
every plane is allocated at its own size whatever ran before).

On the CPU every kernel reads any buffer alike, so these pass there by
construction. On MLX CUDA (the H200, MLX 0.32.4) they are marked as expected
to fail, not strictly, cache on or off: a cached f16 run failed at
the second decode step, and with the cache off five f16 runs did, where two
clean runs' attention outputs differed over bitwise-equal K/V rows. MLX CUDA's
decode attention does not repeat its bits over the same rows there, whatever
muser-kv allocates (docs/performance.md, "Through HTTP").
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


#: where the decoys are made: a stream of their own, so making them never waits
#: for a pipelined step in flight on the default stream
DECOYS = mx.new_stream(mx.default_device())


def recycle(model) -> None:
    """Leave freed buffers one page larger than every plane allocation up to 4,096
    rows in MLX's buffer cache (where it keeps any), two per plane of every layer."""
    a = model.args
    row = a.num_key_value_heads * a.head_dim * 2
    decoys = [mx.zeros((row * 256 * (1 << i) + PAGE,), mx.uint8, stream=DECOYS)
              for i in range(5) for _ in range(2 * a.num_hidden_layers)]
    mx.eval(decoys)
    del decoys


@pytest.fixture(params=["cached", "uncached"])
def allocator(request):
    """MLX's buffer cache as MLX leaves it, or off for the test."""
    if request.param == "cached":
        yield request.param
        return
    old = mx.set_cache_limit(0)
    mx.clear_cache()  # a limit keeps what is cached; nothing may be handed out again
    try:
        yield request.param
    finally:
        mx.set_cache_limit(old)


def rows(model, n: int, seed: int):
    """Keys, values and one query of ``n`` tokens, as a model's attention hands them."""
    a = model.args
    key = mx.random.key(seed)
    k, v, q = (mx.random.normal((1, h, n, a.head_dim), key=mx.random.split(key, 3)[i]).astype(
        model.layers[0].self_attn.q_proj.weight.dtype)
        for i, h in enumerate((a.num_key_value_heads, a.num_key_value_heads,
                               a.num_attention_heads)))
    return k, v, q


def forward(model, cache, kvq: tuple, poisoned: bool) -> list:
    """One forward's worth of writes of the evaluated ``kvq``, every layer in
    list order (the planes allocated between the decoys and the write, as in a
    forward), then each layer's attention over what it returned, mlx-lm's way:
    the outputs, evaluation started."""
    k, v, q = kvq
    n = k.shape[2]
    if poisoned:
        recycle(model)
    masks = [c.make_mask(n, window_size=None if c.kind is LayerKind.GLOBAL else c.window_size)
             for c in cache]
    outs = []
    for c, mask in zip(cache, masks):
        keys, values = c.update_and_fetch(k, v)
        outs.append(mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.088, mask=mask))
    mx.async_eval(outs)
    return outs


def bits(outs: list) -> list:
    return [np.array(o.view(mx.uint16)) for o in outs]


def made(model, n: int, seed: int) -> tuple:
    kvq = rows(model, n, seed)
    mx.eval(kvq)
    return kvq


def step(model, cache, n: int, seed: int, poisoned: bool) -> list:
    """One forward, waited for: its outputs' bits."""
    return bits(forward(model, cache, made(model, n, seed), poisoned))


def prefill(model, cache, poisoned: bool) -> list:
    return [step(model, cache, n, i, poisoned) for i, n in enumerate(PREFILL)]


def decode(model, cache, poisoned: bool, pipelined: bool = False) -> list:
    """``DECODE`` one-token steps, each waited for; or pipelined, as mlx-lm's
    ``generate_step`` runs them: a step's writes are evaluated before the previous
    step is waited for."""
    if not pipelined:
        return [step(model, cache, 1, 100 + i, poisoned) for i in range(DECODE)]
    inputs = [made(model, 1, 100 + i) for i in range(DECODE)]  # nothing waits in the loop
    outs = [forward(model, cache, kvq, poisoned) for kvq in inputs]
    return [bits(o) for o in outs]


def live(model, poisoned, preallocate, pipelined=False):
    cache = muser_kv.make_prompt_cache(model, max_context=CONTEXT, preallocate=preallocate)
    return prefill(model, cache, poisoned) + decode(model, cache, poisoned, pipelined)


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
    "growing-pipelined": lambda m, p, _t: live(m, p, False, pipelined=True),
    "preallocated-pipelined": lambda m, p, _t: live(m, p, True, pipelined=True),
}


@pytest.mark.parametrize("path", list(RUNS))
def test_attention_does_not_depend_on_the_allocator_cache(model, path, allocator, tmp_path,
                                                          request):
    if mx.cuda.is_available():
        request.applymarker(pytest.mark.xfail(
            strict=False, reason="MLX CUDA's decode attention varies over the same rows"))
    clean = RUNS[path.replace("-pipelined", "")](model, False, tmp_path)
    poisoned = RUNS[path](model, True, tmp_path)
    assert len(clean) == len(poisoned) == len(PREFILL) + DECODE
    for i, (a, b) in enumerate(zip(clean, poisoned)):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert np.array_equal(x, y), (
                f"{path}, MLX's buffer cache {allocator}: step {i}, layer {layer}: attention "
                "differs from a waited-for run's after the allocator's cache was filled with "
                "larger buffers")
