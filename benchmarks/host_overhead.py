"""Host time one decode token costs each layer's cache: building the graph of
make_mask(1) + update_and_fetch(one token) over a Muse step (52 layers, 3 of
every 4 sliding), evaluated after every step as a decode is. On the H200 decode
is bound by this host work (docs/performance.md), so it is measured on its
own, ours against mlx-lm's caches, alternating step by step in one run.

    python benchmarks/host_overhead.py [--steps 800] [--retain 16] [--layers 52]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

import muser_kv

H, D, WINDOW = 2, 128, 2048


def step(caches, windows, k) -> float:
    """Seconds spent building one step's cache graph (then evaluated, untimed)."""
    t0 = time.perf_counter()
    out = []
    for c, w in zip(caches, windows):
        c.make_mask(1, window_size=w, return_array=False)
        out.append(c.update_and_fetch(k, k))
    dt = time.perf_counter() - t0
    mx.eval(out)
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--retain", type=int, default=muser_kv.DEFAULT_RETAIN)
    ap.add_argument("--layers", type=int, default=52)
    ns = ap.parse_args(argv)
    kinds = [muser_kv.LayerKind.GLOBAL if i % 4 == 3 else muser_kv.LayerKind.SLIDING
             for i in range(ns.layers)]
    windows = [None if k is muser_kv.LayerKind.GLOBAL else WINDOW for k in kinds]
    geo = muser_kv.MuseGeometry(num_layers=ns.layers, window=WINDOW, layer_kinds=tuple(kinds),
                                max_context=WINDOW + ns.steps + 64)
    ours = muser_kv.make_cache_for(geo, ns.retain)
    theirs = [KVCache() if w is None else RotatingKVCache(WINDOW) for w in windows]
    fill = mx.zeros((1, H, WINDOW, D), mx.float16)
    k = mx.zeros((1, H, 1, D), mx.float16)
    for c in ours + theirs:
        c.update_and_fetch(fill, fill)  # rings full, in their steady state
    mx.eval([c.state for c in ours + theirs], k)
    a, b = [], []
    for _ in range(ns.steps):
        a.append(step(ours, windows, k))
        b.append(step(theirs, windows, k))
    ours_us = statistics.median(a) / ns.layers * 1e6
    theirs_us = statistics.median(b) / ns.layers * 1e6
    print(f"device {mx.default_device()}: host us per layer per decode token "
          f"(median of {ns.steps} alternating steps, {ns.layers} layers, retain={ns.retain})")
    print(f"muser-kv {ours_us:.2f} us | mlx-lm {theirs_us:.2f} us | "
          f"muser-kv / mlx-lm {ours_us / theirs_us:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
