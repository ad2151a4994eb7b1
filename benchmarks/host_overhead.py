"""Host time one decode token costs each layer's cache: building the graph of
make_mask(1) + update_and_fetch(one token), nothing evaluated. On the H200
decode is bound by this host work (docs/performance.md), so it is measured on
its own, ours against mlx-lm's caches in the same run.

    python benchmarks/host_overhead.py [--calls 2000] [--retain 16]
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

import muser_kv

H, D, WINDOW = 2, 128, 64


def per_call_us(caches, windows, calls: int) -> float:
    k = mx.zeros((1, H, 1, D), mx.float16)
    mx.eval(k)

    def loop(n):
        for _ in range(n):
            for c, w in zip(caches, windows):
                c.make_mask(1, window_size=w, return_array=False)
                c.update_and_fetch(k, k)

    loop(20)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        loop(calls // len(caches))
        best = min(best, (time.perf_counter() - t) / (calls // len(caches) * len(caches)))
    return best * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--retain", type=int, default=muser_kv.DEFAULT_RETAIN)
    ns = ap.parse_args(argv)
    windows = [WINDOW, WINDOW, WINDOW, None]  # the Muse pattern: 3 sliding, 1 global
    fill = mx.zeros((1, H, 100, D), mx.float16)
    geo = muser_kv.MuseGeometry(num_layers=4, window=WINDOW, max_context=100 + ns.calls + 64)
    ours = muser_kv.make_cache_for(geo, ns.retain)
    theirs = [RotatingKVCache(WINDOW), RotatingKVCache(WINDOW), RotatingKVCache(WINDOW), KVCache()]
    for c in ours + theirs:
        c.update_and_fetch(fill, fill)  # rings full, in their steady state
    mx.eval([c.state for c in ours + theirs])
    a = per_call_us(ours, windows, ns.calls)
    b = per_call_us(theirs, windows, ns.calls)
    print(f"device {mx.default_device()}: host us per layer per decode token "
          f"(best of 3, {ns.calls} calls, retain={ns.retain})")
    print(f"muser-kv {a:.1f} us | mlx-lm {b:.1f} us | muser-kv / mlx-lm {a / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
