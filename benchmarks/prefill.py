"""Chunked prefill across the wrap: muser-kv vs mlx-lm's Muse Glimmer caches.

A prompt of ``--prompt`` tokens (default 3 x window) is fed in ``--chunk``-token
chunks (default 512; mlx-lm's ``generate_step`` defaults to 2048) through L
layers. Per layer and chunk, as Muse Glimmer's attention does:

    k, v = cache.update_and_fetch(k_new, v_new)
    out  = mx.fast.scaled_dot_product_attention(q, k, v, scale=..., mask=mask)

with masks made once per layer kind from its first cache, before any layer runs
(``make_mask(N, window_size=W)`` for sliding layers, ``make_mask(N)`` for global
ones, ``return_array=False`` as mlx-lm passes it). Layer i+1's q/k/v are cheap
functions of layer i's output. After each chunk the output and every cache's
``state`` are evaluated (mlx-lm's ``generate_step`` evaluates ``c.state``).

Sliding layers wrap once the prompt passes the window: muser-kv then attends
over a staging shadow (old rows in logical order + the chunk), mlx-lm's
``RotatingKVCache`` over its concatenated temporal-order copy.

Printed: ms per chunk (mean) for chunks that end inside the window and chunks
past it, whole-prompt ms, and ``mlx-lm / muser-kv`` (> 1: muser-kv faster);
peak memory during the prefill minus the memory active before it, the cache
sizes at the end, and the peak above what is held at the end (transients).
muser-kv's caches are allocated (zero-filled, at ``--max-context``, default the
prompt length) before the clock starts; mlx-lm's grow during the prefill.

    python benchmarks/prefill.py                                               # GPU, full
    python benchmarks/prefill.py --window 256 --chunk 64 --layers 4 --repeats 2   # CPU
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
from _common import (  # noqa: E402
    DTYPES,
    MB,
    SYSTEMS,
    PeakProbe,
    add_common_flags,
    add_model_flags,
    attend_layers,
    make_caches,
    median,
    now,
    print_header,
    print_table,
    ratio,
    settle,
    write_json,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 3 x window)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--max-context", type=int, default=None,
                   help="muser-kv capacity (default: the prompt length)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed whole prefills per system first (default 1)")
    add_model_flags(p)
    add_common_flags(p)
    args = p.parse_args(argv)
    if args.prompt is None:
        args.prompt = 3 * args.window
    if args.max_context is None:
        args.max_context = args.prompt
    elif args.max_context < args.prompt:
        p.error("--max-context must be >= --prompt")
    return args


def chunks(args):
    start = 0
    while start < args.prompt:
        n = min(args.chunk, args.prompt - start)
        yield start, n
        start += n


def prefill(caches: List[Any], x: mx.array, args):
    times = []
    h = None
    for start, n in chunks(args):
        t0 = now()
        h = attend_layers(caches, x[:, :, :n], args)
        mx.eval(h, [c.state for c in caches])
        times.append(now() - t0)
    return times, h


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    mx.random.seed(args.seed)
    print_header(
        "prefill: chunked, across the wrap, muser-kv vs mlx-lm "
        "(ratio = mlx-lm / muser-kv; > 1: muser-kv faster)",
        args,
    )
    x = mx.random.normal((1, args.heads, args.chunk, args.head_dim)).astype(dtype)
    mx.eval(x)
    spans = list(chunks(args))
    inside = [i for i, (s, n) in enumerate(spans) if s + n <= args.window]
    past = [i for i, (s, n) in enumerate(spans) if s + n > args.window]

    runs: Dict[str, List[Dict[str, Any]]] = {s: [] for s in SYSTEMS}
    last_h: Dict[str, mx.array] = {}
    for r in range(args.warmup + args.repeats):
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        for s in order:
            caches = make_caches(s, args)
            before_bytes = sum(c.nbytes for c in caches)
            with PeakProbe() as probe:
                times, h = prefill(caches, x, args)
            last_h[s] = h.astype(mx.float32)
            if r >= args.warmup:
                runs[s].append({
                    "chunk_s": times,
                    "peak_extra_bytes": probe.extra,
                    "peak_above_end_bytes": max(0, probe.peak - probe.after),
                    "cache_bytes_before": before_bytes,
                    "cache_bytes_after": sum(c.nbytes for c in caches),
                })
            assert all(c.offset == args.prompt for c in caches)
            del caches
            settle()

    def ms(s: str, idx: List[int]) -> float:
        if not idx:
            return float("nan")
        return median([sum(run["chunk_s"][i] for i in idx) / len(idx) * 1e3 for run in runs[s]])

    def total(s: str) -> float:
        return median([sum(run["chunk_s"]) * 1e3 for run in runs[s]])

    rows = []
    for label, idx in ((f"chunks ending <= window ({len(inside)})", inside),
                       (f"chunks past the window ({len(past)})", past)):
        o, t = ms("muser-kv", idx), ms("mlx-lm", idx)
        rows.append([label, "ms/chunk", o, t, ratio(t, o)])
    o, t = total("muser-kv"), total("mlx-lm")
    rows.append([f"whole prompt ({args.prompt} tokens)", "ms", o, t, ratio(t, o)])
    print("Prefill time (median of repeats)")
    print()
    print_table(["chunks", "unit", "muser-kv", "mlx-lm", "mlx-lm / muser-kv"], rows, digits=2)

    mem_rows = []
    for s in SYSTEMS:
        last = runs[s][-1]
        mem_rows.append([
            s,
            last["cache_bytes_before"] / MB,
            last["cache_bytes_after"] / MB,
            max(run["peak_extra_bytes"] for run in runs[s]) / MB,
            max(run["peak_above_end_bytes"] for run in runs[s]) / MB,
        ])
    print("Prefill memory (max over repeats)")
    print()
    print_table(["cache", "cache MiB before", "cache MiB after", "peak+ MiB", "peak above end MiB"],
                mem_rows, digits=1)
    print("peak+ = peak during the prefill - memory active before it (mlx-lm's includes its "
          "cache growing; muser-kv's planes exist before)")
    print("peak above end = peak - memory active at the end (transients: shadows, concatenations, "
          "attention temporaries)")
    print()
    diff = mx.abs(last_h["muser-kv"] - last_h["mlx-lm"]).max().item()
    print(f"Same work check: max |h(muser-kv) - h(mlx-lm)| of the last chunk's output: {diff:.2e}")
    print()
    payload = {"benchmark": "prefill", "last_chunk_max_abs_diff": diff, "args": vars(args), "chunks": spans, "runs": runs,
               "inside_window_chunks": inside, "past_window_chunks": past}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
