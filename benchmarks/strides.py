"""Which plane row counts keep MLX's attention on its fast path?

MLX 0.32's CUDA attention ran ~10x slower at depth when a K/V view's row stride
(the plane's allocated rows) was not a multiple of 256. muser-kv therefore
allocates every plane's rows rounded up to 256 (``geometry.allocated_rows``).
This probe checks that rule on the machine at hand: 13 chained one-token SDPA
calls (a Muse decode step's global layers) over ``[1, kv_heads, L, D]`` views of
planes allocated with C rows, for

* ``C = L + 1`` (what an exact, unrounded plane one row larger would be),
* ``C = allocated_rows(L + 1)`` (what muser-kv allocates for a context of L + 1),
* ``C = L`` when L is itself a multiple of 256,

in both layouts (head-major ``[H, C, D]``, the global planes; token-major
``[C, H*D]``, the sliding rings). Printed: ms per step and the ratio of the
rounded allocation to ``C = L + 1`` (> 1: rounding is faster).

    python benchmarks/strides.py                      # GPU
    .venv/bin/python benchmarks/strides.py --depths 1000,2048 --repeats 3   # CPU, a sanity run
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402

from muser_kv.geometry import allocated_rows  # noqa: E402
from _common import DTYPES, int_list, median, now, print_header, print_table, write_json  # noqa: E402

CHAIN = 13


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int_list,
                   default=[1000, 2000, 2048, 32768, 100000, 131072, 131590],
                   help="live rows L (default 1000,2000,2048,32768,100000,131072,131590)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="timed steps per repeat (default 20)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def views(layout: str, rows: int, live: int, args, dtype) -> List[mx.array]:
    """CHAIN planes of ``rows`` allocated rows, viewed as ``[1, H, live, D]``."""
    h, d = args.kv_heads, args.head_dim
    out = []
    for i in range(CHAIN):
        if layout == "head_major":
            plane = mx.random.normal((1, h, rows, d)).astype(dtype)
            out.append(plane[:, :, :live, :])
        else:
            plane = mx.random.normal((rows, h * d)).astype(dtype)
            out.append(plane[:live].reshape(1, live, h, d).transpose(0, 2, 1, 3))
    mx.eval(out)
    return out


def step_ms(kv: List[mx.array], q: mx.array, args) -> float:
    scale = args.head_dim ** -0.5
    times = []
    for _ in range(args.repeats):
        t0 = now()
        for _ in range(args.steps):
            h = q
            for k in kv:
                h = mx.fast.scaled_dot_product_attention(h, k, k, scale=scale)
            mx.eval(h)
        times.append((now() - t0) / args.steps * 1e3)
    return median(times)


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    print_header("strides: ms per 13 chained decode SDPA calls over views of L rows in C", args)
    q = mx.random.normal((1, args.heads, 1, args.head_dim)).astype(dtype)
    rows, results = [], []
    for layout in ("head_major", "token_major"):
        for live in args.depths:
            cells = {"L+1": live + 1, "rounded": allocated_rows(live + 1)}
            if live % 256 == 0:
                cells["L"] = live
            ms = {}
            for name, capacity in cells.items():
                kv = views(layout, capacity, live, args, dtype)
                step_ms(kv, q, args)  # warm
                ms[name] = step_ms(kv, q, args)
                results.append({"layout": layout, "live": live, "capacity": capacity,
                                "cell": name, "ms": ms[name]})
                del kv
            rows.append([layout, live, ms["L+1"], cells["rounded"], ms["rounded"],
                         ms.get("L", float("nan")), ms["L+1"] / ms["rounded"]])
    print_table(["layout", "L", "C=L+1 ms", "rounded C", "rounded ms", "C=L ms",
                 "(L+1) / rounded"], rows, digits=3)
    write_json(args.json, {"benchmark": "strides", "args": vars(args), "results": results})
    return {"results": results}


if __name__ == "__main__":
    main()
