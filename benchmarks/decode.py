"""What do the cache and attention cost a decode token, muser-kv against mlx-lm's own caches?

At depths 2k-131k, sync and pipelined (``_harness.decode_steps``), for f16 and
bf16 K/V and any ``--max-contexts``, in the K/V loop of Muse Glimmer's
attention (``_harness.attend_layers``: per layer ``update_and_fetch``, then SDPA
with the model's masks; each layer's and each step's input a function of the
last output). The caches are filled to each depth (chunks, then single tokens:
mlx-lm's rings in their steady state), then ``--steps`` tokens are timed after
``--warmup``, in ``--repeats`` alternating blocks. muser-kv's caches are sized
for each of ``--max-contexts`` exactly as given (default: the largest depth
plus the tokens decoded; sizes off a multiple of 256 too, where MLX CUDA's
attention once hit a 10x cliff); mlx-lm's grow with the depth, measured again
beside each.

Three systems: muser-kv's caches with muser-kv's decode attention (the
default), the same caches with MLX's attention (``muser-kv+mlx``: cuDNN's
or MLX's own kernels, as ``MLX_CUDA_USE_CUDNN_SDPA`` says) and mlx-lm's
caches (MLX's attention).

Printed: ms/token and ``mlx-lm / muser-kv`` (> 1: muser-kv faster); host
graph-build ms/token; the peak during the timed steps above what was active
before (a transient plane copy would show here); the caches' bytes beside
``footprint().slot_bytes``; how far apart the systems' final hidden states are.

    bash benchmarks/device.sh decode                                         # H200
    python3 benchmarks/decode.py --depths 32768,130000 --max-contexts 131072,131190 --dtype bfloat16
    PYTHONPATH=. .venv/bin/python benchmarks/decode.py --depths 2048,8000 --max-contexts 8192,8300 \\
        --layers 4 --heads 8 --steps 8 --warmup 2 --repeats 2                 # CPU
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import _harness as H
import mlx.core as mx

import muser_kv

#: muser-kv's caches with its decode attention, the same caches with MLX's, mlx-lm's caches
SYSTEMS = ("muser-kv", "muser-kv+mlx", "mlx-lm")
ATTENTION = {"muser-kv": "muser", "muser-kv+mlx": "mlx", "mlx-lm": "mlx"}


def step(caches: List[Any], q0: mx.array, args, attention: str, h: mx.array) -> mx.array:
    """One decode step of ``caches`` under ``attention`` (``set_decode_attention``)."""
    muser_kv.set_decode_attention(attention)
    return H.attend_layers(caches, (q0 + h) * 0.5, args)


def parse_args(argv=None):
    p = H.parser(__doc__)
    H.add_decode_flags(p, "2048,8192,32768,131072")
    p.add_argument("--max-contexts", type=H.int_list, default=None,
                   help="muser-kv capacities, exactly as given (default: max depth + decoded "
                        "tokens); each depth runs at every one that holds it")
    H.add_flags(p, H.KV, blocks=("repeats", 3, "timed blocks per system and cell; the median"))
    H.add_cache_flags(p)
    args = H.parse(p, argv)
    if min(args.depths) <= H.SETTLE_TOKENS:
        p.error(f"depths must exceed {H.SETTLE_TOKENS}")
    args.decoded = len(args.modes) * (args.warmup + args.repeats * args.steps)
    args.max_contexts = args.max_contexts or [max(args.depths) + args.decoded]
    for depth in args.depths:
        if not any(depth + args.decoded <= m for m in args.max_contexts):
            p.error(f"depth {depth} + {args.decoded} decoded tokens fits none of --max-contexts "
                    f"{args.max_contexts}")
    args.max_context = max(args.max_contexts)
    return args


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    dtype = H.DTYPES[args.dtype]
    mx.random.seed(args.seed)
    H.print_header("decode: ms/token, muser-kv vs mlx-lm (ratio = mlx-lm / muser-kv; > 1: muser-kv "
                   "faster)", args, f"muser-kv planes {H.plane_dtype(args)}, sized exactly for "
                   f"max_context in {args.max_contexts} (rows allocated in multiples of 256)")
    q0 = mx.random.normal((1, args.heads, 1, args.head_dim)).astype(dtype)
    mx.eval(q0)
    results: List[Dict[str, Any]] = []
    time_rows, mem_rows, checks = [], [], {}
    for depth, max_context in [(d, m) for d in args.depths for m in args.max_contexts
                               if d + args.decoded <= m]:
        args.max_context = max_context
        slot = muser_kv.footprint(H.geometry(args), args.max_context).slot_bytes
        caches = {s: H.fill(H.make_caches(s.split("+")[0], args), depth, args.kv_heads,
                            args.head_dim, dtype, args.fill_chunk, mx.random.key(args.seed + 1),
                            H.SETTLE_TOKENS)
                  for s in SYSTEMS}
        sizes = {s: sum(c.nbytes for c in caches[s]) for s in SYSTEMS}
        H.settle()
        mem_rows.append([depth, max_context, sizes["muser-kv"] / H.MB, slot / H.MB,
                         sizes["mlx-lm"] / H.MB])
        state = {s: q0 for s in SYSTEMS}  # the running hidden state per system
        steppers = {s: functools.partial(step, caches[s], q0, args, ATTENTION[s]) for s in SYSTEMS}
        for mode in args.modes:
            blocks = H.decode_blocks(steppers, state, args, mode == "pipelined")
            cell = {s: {k: [b[k] for b in blocks[s]] for k in blocks[s][0]} for s in SYSTEMS}
            ours, mlx_attn, theirs = (H.median(cell[s]["ms_per_token"]) for s in SYSTEMS)
            results.append({"depth": depth, "max_context": max_context, "mode": mode,
                            "systems": cell, "cache_bytes": sizes,
                            "ratio_mlx_lm_over_muser_kv": H.ratio(theirs, ours),
                            "ratio_mlx_attention_over_muser_attention": H.ratio(mlx_attn, ours)})
            time_rows.append([depth, max_context, mode, ours, mlx_attn, theirs,
                              H.ratio(mlx_attn, ours), H.ratio(theirs, ours)]
                             + [H.median(cell[s]["build_ms_per_token"]) for s in SYSTEMS]
                             + [max(cell[s]["peak_extra_bytes"]) / H.MB for s in SYSTEMS])
        assert all(caches[s][0].offset == depth + args.decoded for s in SYSTEMS)
        checks[f"{depth}@{max_context}"] = max(mx.abs(
            state[s].astype(mx.float32) - state["mlx-lm"].astype(mx.float32)).max().item()
            for s in SYSTEMS[:2])
        del caches, state, steppers
        H.settle()

    H.table(["depth", "max_context", "mode", "muser-kv ms/tok", "muser-kv+mlx ms/tok",
             "mlx-lm ms/tok", "muser-kv+mlx / muser-kv", "mlx-lm / muser-kv"]
            + [f"{s} build ms" for s in SYSTEMS] + [f"{s} peak+ MiB" for s in SYSTEMS],
            time_rows, title="Decode time (median of blocks; build = host time spent building the "
            "step graph)", note="peak+ = max over blocks of (peak memory during the timed steps "
            "- memory active before them)")
    H.table(["depth", "max_context", "muser-kv nbytes MiB", "footprint MiB", "mlx-lm nbytes MiB"],
            mem_rows, digits=1, title="Cache memory at the start of decode (all layers)")
    print("Same work check: max |h(muser-kv) - h(mlx-lm)| of the final hidden state (both decoded "
          "the same tokens over the same cache contents): "
          + ", ".join(f"depth {d}: {x:.2e}" for d, x in checks.items()))
    print()
    payload = {"benchmark": "decode", "args": vars(args), "results": results,
               "final_state_max_abs_diff": checks}
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
