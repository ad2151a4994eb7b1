"""Batched decode: what serving several sequences at once gives, muser-kv against mlx-lm.

The question: decode reads all the weights (~52 GiB for the real Muse Glimmer)
whatever the batch, so B sequences in one forward should cost about what one
does. With muser-kv's caches batched (``merge``, as mlx-lm's ``BatchGenerator``
merges them), is aggregate decode throughput at B = 1, 2, 4, 8 at least mlx-lm's
own batch caches', and what does it hold in memory?

Per context length and batch size, both systems get B sequences whose caches
are filled to the context with random K/V (directly, through each cache's own
``update_and_fetch``: a prefill's cost is not the question), merged into one
batch per layer (mlx-lm: ``BatchKVCache`` / ``BatchRotatingKVCache.merge``;
muser-kv: ``BatchKVCache.merge``), then decoded through the model as
``GenerationBatch`` does (build step t+1, ``async_eval`` it, then wait on step
t) in ``--blocks`` blocks of ``--steps`` steps, the two systems alternating
block by block so the machine's drift falls on both alike. Printed: aggregate
tok/s of the median block (B x steps / time), the ratio, and peak memory during
decode above everything but the system's own batch, plus that batch, beside the
footprint of B sequences (muser-kv's planes are preallocated).

    python benchmarks/batched.py                         # H200: real geometry, 8k and 32k, B 1..8
    .venv/bin/python benchmarks/batched.py --layers 4 --hidden 128 --intermediate 256 \\
        --vocab 512 --heads 4 --window 64 --contexts 256,512 --batches 1,2,4 --steps 4 --blocks 3   # CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
from _common import DTYPES, int_list, now, print_header, print_table, settle, write_json  # noqa: E402
from end_to_end import build_model, weight_bytes  # noqa: E402
from mlx_lm.models.cache import BatchKVCache as LmBatchKVCache  # noqa: E402
from mlx_lm.models.cache import BatchRotatingKVCache  # noqa: E402

import muser_kv  # noqa: E402
from muser_kv.caches.batch import BatchKVCache  # noqa: E402

GIB = 1 << 30
SYSTEMS = ("muser-kv", "mlx-lm")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int_list, default=[8192, 32768],
                   help="tokens each sequence holds (default 8192,32768)")
    p.add_argument("--batches", type=int_list, default=[1, 2, 4, 8],
                   help="batch sizes (default 1,2,4,8)")
    p.add_argument("--steps", type=int, default=16,
                   help="timed decode steps per block (default 16)")
    p.add_argument("--blocks", type=int, default=5,
                   help="timed blocks per system, alternating systems (default 5; the median "
                        "block is reported, so drift of the machine falls on both alike)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--fill-chunk", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE")
    g = p.add_argument_group("model geometry (defaults: the real Muse Glimmer)")
    for name in ("layers", "hidden", "intermediate", "vocab", "heads", "window", "max_position"):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    args = p.parse_args(argv)
    args.dtypes = [args.dtype]
    return args


def filled(model, system: str, context: int, args, key) -> List[Any]:
    """One sequence's caches, every layer at ``context`` tokens of random K/V."""
    a = model.args
    if system == "muser-kv":
        tokens = context + args.warmup + args.blocks * args.steps
        cache = muser_kv.make_prompt_cache(model, max_context=tokens)
    else:
        cache = model.make_cache()
    dtype = DTYPES[args.dtype]
    chunk = min(args.fill_chunk, context)
    block = mx.random.normal((1, a.num_key_value_heads, chunk, a.head_dim), key=key).astype(dtype)
    mx.eval(block)
    done = 0
    while done < context:
        n = min(chunk, context - done)
        x = block[:, :, :n]
        for c in cache:
            c.update_and_fetch(x, x)
        mx.eval([c.state for c in cache])
        done += n
    return cache


def merged(system: str, caches: List[List[Any]]) -> List[Any]:
    layers = len(caches[0])
    if system == "muser-kv":
        return [BatchKVCache.merge([c[i] for c in caches]) for i in range(layers)]
    out = []
    for i in range(layers):
        layer = [c[i] for c in caches]
        kind = BatchRotatingKVCache if hasattr(layer[0], "max_size") else LmBatchKVCache
        out.append(kind.merge(layer))
    return out


def decode(model, cache: List[Any], batch: int, steps: int, vocab: int) -> float:
    """``steps`` pipelined decode steps (GenerationBatch's pattern); seconds."""
    tokens = mx.zeros((batch,), dtype=mx.uint32)

    def forward(t):
        logits = model(t[:, None], cache=cache)[:, -1, :]
        return mx.argmax(logits, axis=-1).astype(mx.uint32)

    t0 = now()
    nxt = forward(tokens)
    mx.async_eval(nxt)
    for _ in range(steps - 1):
        cur = nxt
        nxt = forward(cur)
        mx.async_eval(nxt)
        mx.eval(cur)
    mx.eval(nxt)
    return now() - t0


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    print_header("batched decode: aggregate tok/s, muser-kv's batch vs mlx-lm's batch caches",
                 args)
    model = build_model(args, args.dtype)
    weights = weight_bytes(model)
    geometry = muser_kv.MuseGeometry.from_model_args(model.args)
    print(f"{model.args.num_hidden_layers} layers, hidden {model.args.hidden_size}: "
          f"{weights / GIB:.2f} GiB of {args.dtype} weights")
    key = mx.random.key(args.seed)
    rows, results = [], []
    for context in args.contexts:
        slot = muser_kv.footprint(geometry, context + args.warmup + args.blocks * args.steps).slot_bytes
        for b in args.batches:
            order = SYSTEMS if (b + context) % 2 == 0 else SYSTEMS[::-1]
            caches = {}
            for system in order:
                singles = [filled(model, system, context, args, key) for _ in range(b)]
                caches[system] = merged(system, singles)
                del singles
                settle()
                decode(model, caches[system], b, args.warmup, model.args.vocab_size)
            settle()
            rates: Dict[str, List[float]] = {s: [] for s in SYSTEMS}
            peaks = {s: 0 for s in SYSTEMS}
            for block in range(args.blocks):
                for system in (order if block % 2 == 0 else order[::-1]):
                    cache = caches[system]
                    held = sum(c.nbytes for c in cache)
                    others = mx.get_active_memory() - held
                    mx.reset_peak_memory()
                    seconds = decode(model, cache, b, args.steps, model.args.vocab_size)
                    peaks[system] = max(peaks[system], mx.get_peak_memory() - others)
                    rates[system].append(b * args.steps / seconds)
                    settle()
            cell: Dict[str, Dict[str, Any]] = {
                s: {"tok_s": statistics.median(rates[s]), "block_tok_s": rates[s],
                    "peak_bytes": peaks[s], "cache_bytes": sum(c.nbytes for c in caches[s])}
                for s in SYSTEMS}
            del caches, cache
            settle()
            ours, theirs = cell["muser-kv"], cell["mlx-lm"]
            rows.append([context, b, ours["tok_s"], theirs["tok_s"], ours["tok_s"] / theirs["tok_s"],
                         ours["peak_bytes"] / GIB, b * slot / GIB, theirs["peak_bytes"] / GIB])
            results.append({"context": context, "batch": b, "systems": cell,
                            "footprint_bytes": b * slot})
    print()
    print_table(["context", "B", "muser-kv tok/s", "mlx-lm tok/s", "muser / mlx-lm",
                 "muser-kv peak GiB", "B x footprint GiB", "mlx-lm peak GiB"], rows, digits=2)
    print("tok/s: aggregate over the batch, median block; peak: peak memory during the timed "
          "decode above everything but the system's own batch, plus that batch (caches, "
          "activations, temporaries); muser-kv's planes are preallocated (B x footprint)")
    payload = {"benchmark": "batched", "args": vars(args), "results": results}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
