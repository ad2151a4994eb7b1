"""Does mx.compile remove per-token store overhead? One sliding ring's store +
fetch three ways, same work: today's slice assignment with Python positions,
mx.slice_update with positions passed as arrays (what a compiled step needs),
and that function under mx.compile. Graph building plus execution, evaluated
every 256 tokens, microseconds per token.

    python benchmarks/compile_store.py [--tokens 4000]
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

C, H, D = 2048, 2, 128
KV = H * D


def view(plane: mx.array) -> mx.array:
    return plane.reshape(1, C, H, D).transpose(0, 2, 1, 3)


def assigned(pk, pv, k, v, row: int):
    pk[row:row + 1] = k.reshape(1, KV)
    pv[row:row + 1] = v.reshape(1, KV)
    return pk, pv, view(pk), view(pv)


def dynamic(pk, pv, k, v, row: mx.array):
    pk = mx.slice_update(pk, k.reshape(1, KV), row, (0,))
    pv = mx.slice_update(pv, v.reshape(1, KV), row, (0,))
    return pk, pv, view(pk), view(pv)


def bench(step, positions, tokens: int) -> float:
    pk = mx.zeros((C, KV), mx.float16)
    pv = mx.zeros((C, KV), mx.float16)
    k = mx.zeros((1, H, 1, D), mx.float16)
    mx.eval(pk, pv, k)
    for i in range(64):  # warm up (and let mx.compile trace once)
        pk, pv, *_ = step(pk, pv, k, k, positions[i % C])
    mx.eval(pk, pv)
    t = time.perf_counter()
    for i in range(tokens):
        pk, pv, *_ = step(pk, pv, k, k, positions[i % C])
        if i % 256 == 255:
            mx.eval(pk, pv)
    mx.eval(pk, pv)
    return (time.perf_counter() - t) / tokens * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ns = ap.parse_args(argv)
    ints = list(range(C))
    arrays = [mx.array([i], mx.int32) for i in ints]
    mx.eval(arrays)
    rows = [
        ("slice assignment, Python positions (today)", bench(assigned, ints, ns.tokens)),
        ("mx.slice_update, positions as arrays", bench(dynamic, arrays, ns.tokens)),
        ("the same under mx.compile", bench(mx.compile(dynamic), arrays, ns.tokens)),
    ]
    print(f"device {mx.default_device()}: one ring store + fetch per token, us/token")
    for name, us in rows:
        print(f"  {name:45} {us:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
