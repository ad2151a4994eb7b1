"""Serving B sequences at once: what aggregate decode tok/s and memory does muser-kv's batch give against mlx-lm's?

Decode reads all the weights (~52 GiB for the real Muse Glimmer) whatever the
batch, so B sequences in one forward should cost about what one does. Per
context and B, each system gets B sequences' caches filled with random K/V
(through their own ``update_and_fetch``: a prefill is not the question), merged
into one batch per layer as ``BatchGenerator`` merges them (muser-kv:
``BatchKVCache.merge``; mlx-lm: ``BatchKVCache`` / ``BatchRotatingKVCache.merge``),
then decoded through the model (``_harness.build_model``) as ``GenerationBatch``
does (pipelined) in ``--blocks`` alternating blocks of ``--steps`` steps.
Printed: aggregate tok/s of the median block (B x steps / time), the ratio, and
the peak during decode above everything but the system's own batch, plus that
batch, beside the footprint of B sequences (muser-kv's planes are preallocated).

    bash benchmarks/device.sh batched                    # H200: real geometry, 8k and 32k, B 1..8
    PYTHONPATH=. .venv/bin/python benchmarks/batched.py --layers 4 --hidden 128 --intermediate 256 \\
        --vocab 512 --heads 4 --window 64 --contexts 256,512 --batches 1,2,4 --steps 8 \\
        --max-position 1024                                                     # CPU
"""

from __future__ import annotations

from typing import Any, Dict, List

import _harness as H
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache as LmBatchKVCache
from mlx_lm.models.cache import BatchRotatingKVCache

import muser_kv
from muser_kv.caches.batch import BatchKVCache


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--contexts", type=H.int_list, default=[8192, 32768],
                   help="tokens each sequence holds (default 8192,32768)")
    p.add_argument("--batches", type=H.int_list, default=[1, 2, 4, 8],
                   help="batch sizes (default 1,2,4,8)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per block (default 16)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--fill-chunk", type=int, default=4096)
    H.add_flags(p, blocks=("blocks", 5, "timed blocks per system, alternating; the median block"))
    return H.parse(p, argv)


def batch(model, system: str, context: int, b: int, args) -> List[Any]:
    """B sequences' caches, every layer at ``context`` tokens of random K/V, merged."""
    a, tokens = model.args, context + args.warmup + args.blocks * args.steps
    singles = [H.fill(H.prompt_cache(system, model, tokens), context, a.num_key_value_heads,
                      a.head_dim, H.DTYPES[args.dtype], args.fill_chunk, mx.random.key(args.seed))
               for _ in range(b)]
    out = []
    for i in range(len(singles[0])):
        layer = [c[i] for c in singles]
        kind = (BatchKVCache if system == "muser-kv" else
                BatchRotatingKVCache if hasattr(layer[0], "max_size") else LmBatchKVCache)
        out.append(kind.merge(layer))
    return out


def decode(model, cache: List[Any], b: int, steps: int) -> float:
    """``steps`` pipelined decode steps (GenerationBatch's pattern); seconds."""
    def forward(t):
        return mx.argmax(model(t[:, None], cache=cache)[:, -1, :], axis=-1).astype(mx.uint32)

    return H.decode_steps(forward, mx.zeros((b,), dtype=mx.uint32), steps, pipelined=True)[1]


def block(model, caches, b: int, args, system: str, _block: int) -> Dict[str, float]:
    """One timed block: aggregate tok/s, and the peak above all but this batch, plus it."""
    held = sum(c.nbytes for c in caches[system])
    with H.PeakProbe() as probe:
        seconds = decode(model, caches[system], b, args.steps)
    return {"tok_s": b * args.steps / seconds, "peak": probe.extra + held}


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    H.print_header("batched decode: aggregate tok/s, muser-kv's batch vs mlx-lm's batch caches", args)
    model = H.build_model(args)
    print(H.describe(model))
    geometry = muser_kv.MuseGeometry.from_model_args(model.args)
    rows, results = [], []
    for context in args.contexts:
        tokens = context + args.warmup + args.blocks * args.steps
        slot = muser_kv.footprint(geometry, tokens).slot_bytes
        for b in args.batches:
            caches = {}
            for s in H.order(b + context):
                caches[s] = batch(model, s, context, b, args)
                H.settle()
                decode(model, caches[s], b, args.warmup)
            H.settle()
            blocks = H.alternate(args.blocks, lambda s, i, c=caches, b=b: block(model, c, b, args, s, i),
                                 first=b + context)
            cell = {s: {"tok_s": H.median([x["tok_s"] for x in blocks[s]]),
                        "block_tok_s": [x["tok_s"] for x in blocks[s]],
                        "peak_bytes": max(x["peak"] for x in blocks[s]),
                        "cache_bytes": sum(c.nbytes for c in caches[s])} for s in H.SYSTEMS}
            del caches
            H.settle()
            ours, theirs = cell["muser-kv"], cell["mlx-lm"]
            rows.append([context, b, ours["tok_s"], theirs["tok_s"], ours["tok_s"] / theirs["tok_s"],
                         ours["peak_bytes"] / H.GIB, b * slot / H.GIB, theirs["peak_bytes"] / H.GIB])
            results.append({"context": context, "batch": b, "systems": cell,
                            "footprint_bytes": b * slot})
    print()
    H.table(["context", "B", "muser-kv tok/s", "mlx-lm tok/s", "muser / mlx-lm", "muser-kv peak GiB",
             "B x footprint GiB", "mlx-lm peak GiB"], rows,
            note="tok/s: aggregate over the batch, median block; peak: peak memory during the timed "
                 "decode above everything but the system's own batch, plus that batch (caches, "
                 "activations, temporaries); muser-kv's planes are preallocated (B x footprint)")
    payload = {"benchmark": "batched", "args": vars(args), "results": results}
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
