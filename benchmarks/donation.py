"""When does MLX update a large plane in place? One-layer store loops that
separate muser-kv from MLX's own rules.

A store is O(row) only when MLX donates the plane's buffer to the slice
update, which it does only if nothing else holds that buffer at the moment the
update is *encoded*. A kernel that read the plane (attention, or the tiny
consumer here) holds it until MLX learns the kernel finished, and on the GPU
that news arrives on a worker thread, after ``mx.eval`` has returned. A store
loop with nothing between two stores of the same plane can therefore run ahead
of that news and make MLX copy the plane. This benchmark shows it is MLX's rule,
not the cache's: the same loop over a bare MLX array, and over mlx-lm's
``KVCache`` grown to the same size, behaves the same way.

Cells: system x capacity x mode, each ``--steps`` one-token stores into one
plane holding ``--fill`` tokens (mlx-lm's KVCache is grown to capacity - 1024
tokens, so its buffer is as large as ours):

* ``sync``: store, ``mx.eval`` of the returned views, next store;
* ``sync+synchronize``: the same with ``mx.synchronize()`` after each eval,
  which waits until MLX has processed the completions;
* ``pipelined``: the next store and its consumer are encoded before waiting on
  the previous (mlx-lm's generate_step pattern, with nothing else in the step).

Printed: us/store and peak memory above the memory before the loop, in
planes (K + V) -- 0 means every store was in place.

    python benchmarks/donation.py                 # GPU
    python benchmarks/donation.py --capacities 2048,32768 --steps 64   # CPU
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

import muser_kv  # noqa: E402
from _common import PeakProbe, int_list, median, now, print_header, print_table, settle, str_list  # noqa: E402

H, D = 2, 128


class Bare:
    """A bare MLX plane ``[1, H, C, D]`` and the one slice update a store is."""

    def __init__(self, capacity: int, fill: int):
        self.keys = mx.zeros((1, H, capacity, D), mx.float16)
        self.values = mx.zeros((1, H, capacity, D), mx.float16)
        self.offset = fill
        mx.eval(self.keys, self.values)

    def update_and_fetch(self, k, v):
        r = self.offset
        self.keys[..., r:r + 1, :] = k
        self.values[..., r:r + 1, :] = v
        self.offset += 1
        return self.keys[..., :r + 1, :], self.values[..., :r + 1, :]


def make(system: str, capacity: int, fill: int):
    if system == "bare mlx":
        return Bare(capacity, fill), 2 * H * capacity * D * 2
    if system == "mlx-lm KVCache":
        c = KVCache()
        depth = max(fill, capacity - 1024)
        block = mx.zeros((1, H, depth, D), mx.float16)
        c.update_and_fetch(block, block)
        mx.eval(c.keys, c.values)
        return c, c.keys.nbytes + c.values.nbytes
    geo = muser_kv.MuseGeometry(num_layers=1, max_context=capacity, kv_heads=H, head_dim=D,
                                num_heads=H, layer_kinds=(muser_kv.LayerKind.GLOBAL,))
    c = muser_kv.make_cache_for(geo)[0]
    block = mx.zeros((1, H, fill, D), mx.float16)
    c.update_and_fetch(block, block)
    mx.eval(c.state)
    return c, c.nbytes


def consume(k, v):
    return k[..., -1:, :] + v[..., -1:, :]


def loop(cache, x, n: int, mode: str) -> None:
    if mode == "pipelined":
        y = consume(*cache.update_and_fetch(x, x))
        mx.async_eval(y)
        for _ in range(n - 1):
            ny = consume(*cache.update_and_fetch(x, x))
            mx.async_eval(ny)
            mx.eval(y)
            y = ny
        mx.eval(y)
        return
    for _ in range(n):
        kv = cache.update_and_fetch(x, x)
        mx.eval(kv)
        del kv
        if mode == "sync+synchronize":
            mx.synchronize()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacities", type=int_list, default=[2048, 131072])
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--fill", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", type=str_list, default=["sync", "sync+synchronize", "pipelined"])
    p.add_argument("--systems", type=str_list, default=["muser-kv", "bare mlx", "mlx-lm KVCache"])
    args = p.parse_args(argv)
    print_header("donation: one-layer store loops, muser-kv against bare MLX and mlx-lm", args)
    x = mx.random.normal((1, H, 1, D)).astype(mx.float16)
    mx.eval(x)
    rows = []
    for mode in args.modes:
        for system in args.systems:
            for capacity in args.capacities:
                us, extra = [], []
                for _ in range(args.repeats):
                    cache, plane_bytes = make(system, capacity, args.fill)
                    loop(cache, x, 16, mode)  # warm up
                    mx.synchronize()
                    with PeakProbe() as probe:
                        t0 = now()
                        loop(cache, x, args.steps, mode)
                        mx.synchronize()
                        us.append((now() - t0) / args.steps * 1e6)
                    extra.append(probe.extra / plane_bytes)
                    del cache
                    settle()
                rows.append([mode, system, capacity, median(us), max(extra)])
    print_table(["mode", "cache", "capacity", "us/store", "peak+ (planes)"], rows)
    print("peak+ (planes): max over repeats of (peak during the loop - memory before) / "
          "the cache's K+V bytes; 0 = every store in place, >= 1 = a plane was copied")


if __name__ == "__main__":
    main()
