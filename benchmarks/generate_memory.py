"""Peak memory of a real decode at depth: mlx-lm's generate_step (pipelined)
and a synchronous loop on a 52-layer Muse-Glimmer-shaped model, with the caches
filled to the depth first. Prints weights + footprint beside the measured peak:
a store that copied a plane would show up as the difference.

    python benchmarks/generate_memory.py                       # GPU: depth 131,072
    python benchmarks/generate_memory.py --depth 8192 --layers 8 --tokens 8   # CPU
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import muse_glimmer
from mlx_lm.models.cache import KVCache, RotatingKVCache

import muser_kv


def build(ns):
    args = muse_glimmer.ModelArgs(
        hidden_size=ns.hidden, num_hidden_layers=ns.layers, intermediate_size=3 * ns.hidden,
        num_attention_heads=ns.heads, num_key_value_heads=2, head_dim=128, vocab_size=ns.vocab,
        sliding_window=ns.window, max_position_embeddings=ns.depth + ns.tokens + 16)
    mx.random.seed(0)
    model = muse_glimmer.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def fill_ours(cache, depth, rng):
    for c in cache:
        rows = min(depth, c.capacity)
        start = depth - rows
        k = mx.array(rng.standard_normal((rows, 2, 128)).astype(np.float16))
        c.install(start, k, k)
    mx.eval([c.state for c in cache])


def fill_theirs(model, depth, rng):
    cache = model.make_cache()
    for c in cache:
        n = depth if isinstance(c, KVCache) else min(depth, c.max_size)
        k = mx.array(rng.standard_normal((1, 2, n, 128)).astype(np.float16))
        c.update_and_fetch(k, k)
        if isinstance(c, RotatingKVCache):
            c.offset = depth  # the ring holds the last `window` positions of `depth`
    mx.eval([c.state for c in cache])
    return cache


def run(model, cache, ns, pipelined):
    prompt = mx.array([1, 2], mx.uint32)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    t = time.perf_counter()
    if pipelined:
        for _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=ns.tokens):
            pass
    else:
        y = prompt
        for _ in range(ns.tokens):
            logits = model(y[None], cache=cache)
            y = mx.argmax(logits[0, -1:], axis=-1).astype(mx.uint32)
            mx.eval(y)
    mx.synchronize()
    dt = (time.perf_counter() - t) / ns.tokens
    return before, mx.get_peak_memory(), dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=131072 - 128)
    ap.add_argument("--layers", type=int, default=52)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--sliding-layout", default="token_major", choices=["token_major", "head_major"])
    ns = ap.parse_args(argv)
    model = build(ns)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    max_context = model.args.max_position_embeddings
    geo = muser_kv.MuseGeometry.from_model_args(model.args, max_context)
    fp = muser_kv.footprint(geo, max_context).slot_bytes
    rng = np.random.default_rng(0)
    print(f"device {mx.default_device()}, {ns.layers} layers, depth {ns.depth}, max_context {max_context}, "
          f"weights {weights:,} B, footprint {fp:,} B, sliding layout {ns.sliding_layout}")
    print("| cache | mode | ms/token | active before (B) | peak (B) | peak - (weights + footprint) (MiB) | peak - before (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in ("muser-kv", "mlx-lm"):
        for pipelined in (False, True):
            mx.clear_cache()
            if name == "muser-kv":
                cache = muser_kv.make_prompt_cache(model, max_context, sliding_layout=ns.sliding_layout)
                fill_ours(cache, ns.depth, rng)
            else:
                cache = fill_theirs(model, ns.depth, rng)
            before, peak, dt = run(model, cache, ns, pipelined)
            mode = "pipelined (generate_step)" if pipelined else "sync"
            print(f"| {name} | {mode} | {dt * 1e3:.2f} | {before:,} | {peak:,} | "
                  f"{(peak - weights - fp) / 2**20:.1f} | {(peak - before) / 2**20:.1f} |")
            del cache
    return 0


if __name__ == "__main__":
    sys.exit(main())
