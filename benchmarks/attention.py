"""How near the bytes floor is one layer's decode attention, muser-kv's against MLX's?

One global layer of Muse Glimmer (2 K/V heads x 128, 32 query heads, bf16) at
each ``--contexts`` depth, for each ``--batches`` B: B sequences at that depth,
or with ``--lengths-from N`` spread from N to it (a server's chats), in one
``[B, H, rows, D]`` plane as a batch holds them. Timed, alternating, in one
process: muser-kv's decode attention (``backend.attend``: the kernels on a GPU),
MLX's ``scaled_dot_product_attention`` over the same views (with the additive
mask mixed lengths need; cuDNN's or MLX's own kernels as
``MLX_CUDA_USE_CUDNN_SDPA`` says), and the floor: one pass summing every live
K/V row (the bytes a step must read, at the speed this device reads them), and
those bytes at ``--bandwidth``. Each attention is ``--calls`` calls per
evaluation (a step's layers), the median of ``--repeats``.

    python3 benchmarks/attention.py --contexts 32768,131072 --batches 1,8      # GPU
    MLX_CUDA_USE_CUDNN_SDPA=0 python3 benchmarks/attention.py ...              # MLX's own
    PYTHONPATH=. .venv/bin/python benchmarks/attention.py --contexts 4096 --batches 1,3 \\
        --lengths-from 1000 --calls 2 --repeats 2                              # CPU
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List

import _harness as H
import mlx.core as mx

from muser_kv.core import attention
from muser_kv.core.attention import DecodeRead, KeyRead
from muser_kv.core.kernels import get_backend


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=H.int_list, default=[32768, 131072])
    p.add_argument("--batches", type=H.int_list, default=[1, 2, 8, 16, 32])
    p.add_argument("--lengths-from", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(H.DTYPES), default="bfloat16")
    p.add_argument("--calls", type=int, default=13, help="calls per evaluation (default 13: "
                   "Muse Glimmer's global layers)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bandwidth", type=float, default=4.8e12)
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def lengths_of(context: int, b: int, lo) -> List[int]:
    if lo is None or b == 1:
        return [context] * b
    return [lo + (context - lo) * i // (b - 1) for i in range(b)]


def cell(context: int, b: int, args) -> Dict[str, Any]:
    dtype = H.DTYPES[args.dtype]
    lens = lengths_of(context, b, args.lengths_from)
    rows = -(-max(lens) // 256) * 256
    h, d = args.kv_heads, args.head_dim
    key = mx.random.key(context + b)
    k = mx.random.normal((b, h, rows, d), key=key).astype(dtype)
    v = mx.random.normal((b, h, rows, d), key=mx.random.split(key)[0]).astype(dtype)
    q = mx.random.normal((b, args.heads, 1, d)).astype(dtype)
    mx.eval(k, v, q)
    view_k, view_v = k[:, :, :max(lens)], v[:, :, :max(lens)]
    read = DecodeRead(view_k, view_v, tuple(KeyRead(i, n, n, 0, rows) for i, n in enumerate(lens)),
                      None)
    mask = None
    if len(set(lens)) > 1:
        seen = mx.arange(max(lens))[None] < mx.array(lens)[:, None]
        mask = mx.where(seen, 0, -mx.inf).astype(dtype).reshape(b, 1, 1, max(lens))
        mx.eval(mask)
    backend, scale = get_backend(), d ** -0.5

    def ours() -> List[mx.array]:
        return [backend.attend(q * (1 + i), read, scale) for i in range(args.calls)]

    def theirs() -> List[mx.array]:
        return [mx.fast.scaled_dot_product_attention(q * (1 + i), view_k, view_v, scale=scale,
                                                     mask=mask) for i in range(args.calls)]

    def floor() -> List[mx.array]:
        parts = [x[i:i + 1, :, :n] for x in (k, v) for i, n in enumerate(lens)]
        return [mx.sum(p) for p in parts for _ in range(args.calls)]

    fns = {"muser-kv": ours, "mlx": theirs, "floor": floor}
    for f in fns.values():
        mx.eval(f())
    times: Dict[str, List[float]] = {s: [] for s in fns}
    for r in range(args.repeats):
        for s in H.order(r, tuple(fns)):
            mx.synchronize()
            t0 = H.now()
            mx.eval(fns[s]())
            times[s].append((H.now() - t0) / args.calls * 1e6)
    us = {s: H.median(t) for s, t in times.items()}
    kv_bytes = sum(2 * h * n * d * dtype.size for n in lens)
    got = ours()[0]
    want = theirs()[0]
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    return {"context": context, "batch": b, "lengths": lens, "us": us, "kv_bytes": kv_bytes,
            "bytes_us": kv_bytes / args.bandwidth * 1e6, "max_abs_diff": diff}


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    print(f"# one layer's decode attention, {args.heads} heads / {args.kv_heads} K/V x "
          f"{args.head_dim}, {args.dtype}; backend {get_backend().name}, chunk {attention.CHUNK}; "
          f"{args.calls} calls per evaluation, median of {args.repeats}")
    results, rows = [], []
    for context in args.contexts:
        for b in args.batches:
            r = cell(context, b, args)
            results.append(r)
            us = r["us"]
            lens = r["lengths"]
            rows.append([context, b, f"{min(lens)}..{max(lens)}", us["muser-kv"], us["mlx"],
                         us["floor"], r["bytes_us"], us["mlx"] / us["muser-kv"],
                         us["floor"] / us["muser-kv"], r["bytes_us"] / us["muser-kv"],
                         r["max_abs_diff"]])
            print("cell: " + " | ".join(f"{x:.4g}" if isinstance(x, float) else str(x)
                                        for x in rows[-1]), flush=True)
    H.table(["context", "B", "lengths", "muser-kv us", "mlx us", "sum pass us", "bytes us",
             "mlx / muser-kv", "muser of pass", "muser of bytes", "max |diff|"], rows,
            title="One layer's decode attention (us per call)",
            note="sum pass: one pass summing every live K/V row; bytes: the live K/V bytes at "
                 "--bandwidth; of X = X / muser-kv's time (1.0: at it)")
    payload = {"benchmark": "attention", "args": vars(args), "results": results}
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
