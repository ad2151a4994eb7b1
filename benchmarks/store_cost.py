"""Store cost against plane capacity, for a global (NoPE, head-major) cache.

The claim under test: storing one token costs the same whatever the plane's
capacity (``max_context``), within 1.2x, because the plane is updated in place
(MLX donates its buffer to the slice update) rather than copied.

For each capacity (default 2048, 8192, 32768, 131072) ``--layers`` global
muser-kv caches are built (default 13, the global layers one Muse decode step
stores into), filled to ``--fill`` tokens, warmed up, then ``--steps`` steps,
each one single-token ``update_and_fetch`` per layer, are timed in two modes:

* ``sync``: every layer's ``k, v = cache.update_and_fetch(x, x)``, then
  ``mx.eval`` of all of them, every step;
* ``pipelined``: mlx-lm's ``generate_step`` pattern: step t+1's stores (plus a
  tiny consumer of each returned k/v, standing in for attention) are built and
  ``mx.async_eval``-ed before waiting on step t. The benchmark drops its own
  references to the returned views before waiting, as a model does, so any
  extra reference that blocks the in-place update is not the benchmark's.

With ``--layers 1`` the pipelined loop is degenerate: a store is encoded while
the previous step's reader of the same plane is still in flight, and MLX keeps
an in-flight kernel's inputs alive, so it cannot donate the plane and copies
it. In a decode step the same plane is stored again only after every other
layer's work, by which time its reader has finished.

mlx-lm's ``KVCache`` (what Muse Glimmer uses for global layers; it grows in
256-row steps) does the same work as a reference row. Every cell builds fresh
caches, so every cell stores the same positions.

Printed: us/store (median of repeats), the ratio to capacity 2048, the ratio
``mlx-lm KVCache / this row`` (> 1: this row is faster), and peak memory during
the timed stores minus memory active before them: a copied plane shows up here
as about one plane of extra bytes.

    python benchmarks/store_cost.py                           # GPU, full
    python benchmarks/store_cost.py --steps 256 --repeats 3 --layers 4   # CPU
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

import muser_kv  # noqa: E402
from _common import (  # noqa: E402
    DTYPES, MB, PeakProbe, add_common_flags, int_list, median, now,
    print_header, print_table, ratio, settle, str_list, write_json,
)

REFERENCE = "mlx-lm KVCache"
OURS = "muser-kv global"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacities", type=int_list, default=[2048, 8192, 32768, 131072],
                   help="muser-kv plane capacities (max_context) (default 2048,8192,32768,131072)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed single-token stores per repeat (default 1024)")
    p.add_argument("--warmup", type=int, default=32, help="untimed stores per cell (default 32)")
    p.add_argument("--fill", type=int, default=256,
                   help="tokens in the cache before the stores (default 256)")
    p.add_argument("--modes", type=str_list, default=["sync", "pipelined"],
                   help="sync,pipelined (default both)")
    p.add_argument("--layers", type=int, default=13,
                   help="global caches stored into per step (default 13, as in Muse Glimmer)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    add_common_flags(p)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 1024
    for m in args.modes:
        if m not in ("sync", "pipelined"):
            p.error(f"unknown mode {m!r}")
    needed = args.fill + args.warmup + args.steps
    if needed > min(args.capacities):
        p.error(f"--fill + --warmup + --steps = {needed} exceeds the smallest capacity "
                f"{min(args.capacities)}")
    if args.fill < 1:
        p.error("--fill must be >= 1")
    return args


def make_cache(system: str, capacity: Optional[int], args) -> Any:
    if system == REFERENCE:
        return KVCache()
    geo = muser_kv.MuseGeometry(
        num_layers=1, max_context=capacity, kv_heads=args.kv_heads, head_dim=args.head_dim,
        num_heads=args.kv_heads, layer_kinds=(muser_kv.LayerKind.GLOBAL,),
    )
    return muser_kv.make_cache_for(geo)[0]


def consume(k: mx.array, v: mx.array) -> mx.array:
    """A tiny reader of the returned views (the stored row), standing in for attention."""
    return k[..., -1:, :] + v[..., -1:, :]


def store_sync(caches, x: mx.array, n: int) -> float:
    """Returns the host seconds spent inside ``update_and_fetch`` (graph building)."""
    host = 0.0
    for _ in range(n):
        out = []
        for cache in caches:
            h0 = now()
            out.extend(cache.update_and_fetch(x, x))
            host += now() - h0
        mx.eval(out)
        del out
    return host


def step(caches, x: mx.array) -> tuple:
    """One pipelined step: a store per layer, each read by a tiny consumer."""
    host, ys = 0.0, []
    for cache in caches:
        h0 = now()
        k, v = cache.update_and_fetch(x, x)
        host += now() - h0
        ys.append(consume(k, v))
        del k, v
    return host, ys


def store_pipelined(caches, x: mx.array, n: int) -> float:
    host, y = step(caches, x)
    mx.async_eval(y)
    for _ in range(n - 1):
        h, ny = step(caches, x)
        host += h
        mx.async_eval(ny)
        mx.eval(y)
        y = ny
    mx.eval(y)
    return host


RUNNERS: Dict[str, Callable] = {"sync": store_sync, "pipelined": store_pipelined}


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    mx.random.seed(args.seed)
    print_header(
        f"store cost: one-token update_and_fetch into each of {args.layers} global "
        "(NoPE, head-major) caches per step, vs capacity",
        args,
    )
    block = mx.random.normal((1, args.kv_heads, args.fill, args.head_dim)).astype(dtype)
    x = mx.random.normal((1, args.kv_heads, 1, args.head_dim)).astype(dtype)
    mx.eval(block, x)

    cells = [(OURS, c) for c in args.capacities] + [(REFERENCE, None)]
    results: List[Dict[str, Any]] = []
    rows = []
    summary = []
    for mode in args.modes:
        run = RUNNERS[mode]
        meas = {cell: {"us_per_store": [], "host_us_per_store": [], "peak_extra_bytes": [],
                       "cache_bytes": 0}
                for cell in cells}
        for r in range(args.repeats):
            order = cells if r % 2 == 0 else cells[::-1]
            for cell in order:
                system, capacity = cell
                caches = [make_cache(system, capacity, args) for _ in range(args.layers)]
                for cache in caches:
                    cache.update_and_fetch(block, block)
                mx.eval([cache.state for cache in caches])
                run(caches, x, args.warmup)
                stores = args.steps * args.layers
                with PeakProbe() as probe:
                    t0 = now()
                    host = run(caches, x, args.steps)
                    dt = now() - t0
                assert all(c.offset == args.fill + args.warmup + args.steps for c in caches)
                meas[cell]["us_per_store"].append(dt / stores * 1e6)
                meas[cell]["host_us_per_store"].append(host / stores * 1e6)
                meas[cell]["peak_extra_bytes"].append(probe.extra)
                meas[cell]["cache_bytes"] = sum(c.nbytes for c in caches)
                del caches, cache
                settle()
        base = median(meas[(OURS, min(args.capacities))]["us_per_store"])
        ref = median(meas[(REFERENCE, None)]["us_per_store"])
        ours_us = []
        for cell in cells:
            system, capacity = cell
            us = median(meas[cell]["us_per_store"])
            if system == OURS:
                ours_us.append(us)
            results.append({"system": system, "capacity": capacity, "mode": mode, **meas[cell]})
            rows.append([
                system, capacity if capacity else "grows", mode, us,
                max(meas[cell]["us_per_store"]),
                ratio(us, base) if system == OURS else float("nan"),
                ratio(ref, us),
                median(meas[cell]["host_us_per_store"]),
                max(meas[cell]["peak_extra_bytes"]) / MB,
                meas[cell]["cache_bytes"] / MB,
            ])
        spread = max(ours_us) / min(ours_us) if min(ours_us) > 0 else float("nan")
        summary.append(f"{mode}: muser-kv max/min us/store across capacities {spread:.2f}x "
                       f"(claim: flat within 1.2x); largest vs {min(args.capacities)}: "
                       f"{ours_us[args.capacities.index(max(args.capacities))] / base:.2f}x")

    print("Store cost (median of repeats)")
    print()
    print_table(["cache", "capacity", "mode", "us/store", "worst repeat",
                 f"vs cap {min(args.capacities)}", "KVCache / this", "host us", "peak+ MiB",
                 "cache MiB"], rows, digits=2)
    print("us/store: median over repeats; worst repeat: the slowest repeat's us/store;")
    print("host us: time inside update_and_fetch (Python + graph building), median;")
    print("peak+ = max over repeats of (peak memory during the timed stores "
          "- memory active before)")
    for line in summary:
        print(line)
    print()
    payload = {"benchmark": "store_cost", "args": vars(args), "results": results,
               "summary": summary}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
