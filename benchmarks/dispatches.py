"""Count what one decode token costs each layer's cache in GPU dispatches.

Builds one store + fetch (update_and_fetch of one token, plus the mask) for a
sliding and a global layer in steady state -- ours and mlx-lm's caches -- and
counts the primitives in the lazy graph (mx.export_to_dot). View primitives
(Slice, Reshape of contiguous data, Transpose, Squeeze, ExpandDims) launch no
kernel in MLX; everything else is one dispatch (Concatenate: one per input).

    python benchmarks/dispatches.py [--dtype float16|float32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from muser_kv import LayerKind, MuseGeometry, kernels, make_cache_for  # noqa: E402

VIEWS = {"Slice", "Reshape", "Transpose", "Squeeze", "ExpandDims", "Broadcast", "Depends"}
H, D = 2, 128


def count(arrays) -> Counter:
    """Primitive name -> dispatches (a Concatenate launches one copy per input)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        dot = Path(f.name).read_text()
    nodes = dict(re.findall(r'\{ (\d+) \[label ="([^"]+)"', dot))
    indegree = Counter(re.findall(r'-> (\d+)\n', dot))
    out: Counter = Counter()
    for node, name in nodes.items():
        out[name] += indegree[node] if name == "Concatenate" else 1
    return out


def dispatches(c: Counter) -> int:
    return sum(n for name, n in c.items() if name not in VIEWS)


def steady(cache, n_fill, dtype):
    cache.update_and_fetch(mx.zeros((1, H, n_fill, D), dtype), mx.zeros((1, H, n_fill, D), dtype))
    for _ in range(2):
        cache.update_and_fetch(mx.zeros((1, H, 1, D), dtype), mx.zeros((1, H, 1, D), dtype))
    mx.eval([x for x in cache.state if isinstance(x, mx.array)])


def one_token(cache, dtype, window):
    k = mx.zeros((1, H, 1, D), dtype)
    v = mx.zeros((1, H, 1, D), dtype)
    mx.eval(k, v)
    mask = cache.make_mask(1, window_size=window, return_array=False)
    kk, vv = cache.update_and_fetch(k, v)
    outs = [kk, vv] + ([mask] if isinstance(mask, mx.array) else [])
    return count(outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16", choices=["float16", "float32", "bfloat16"])
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=8192)
    ap.add_argument("--json")
    ns = ap.parse_args(argv)
    dtype = getattr(mx, ns.dtype)
    rows = []
    # one layer of each kind, each a list of its own (a layer of a longer list
    # is driven with its list)
    ours = [make_cache_for(MuseGeometry(num_layers=1, window=ns.window, max_context=ns.depth + 16,
                                        num_heads=32, layer_kinds=(kind,)))[0]
            for kind in (LayerKind.SLIDING, LayerKind.GLOBAL)]
    for name, cache, window in (("ours sliding (ring)", ours[0], ns.window),
                                ("ours global (NoPE)", ours[1], None)):
        steady(cache, ns.depth, dtype)
        c = one_token(cache, dtype, window)
        rows.append((name, dispatches(c), dict(c)))
    try:
        from mlx_lm.models.cache import KVCache, RotatingKVCache
    except ImportError:
        pass
    else:
        for name, cache, window in (("mlx-lm RotatingKVCache", RotatingKVCache(ns.window), ns.window),
                                    ("mlx-lm KVCache", KVCache(), None)):
            steady(cache, ns.depth, dtype)
            c = one_token(cache, dtype, window)
            rows.append((name, dispatches(c), dict(c)))
    print(f"backend {kernels.get_backend().name}, device {mx.default_device()}, K/V {ns.dtype}, "
          f"window {ns.window}, depth {ns.depth}: one decode token, store + fetch + mask")
    print(f"{'cache':26} {'dispatches':>10}  primitives")
    for name, n, c in rows:
        print(f"{name:26} {n:>10}  " + ", ".join(f"{k} x{v}" for k, v in sorted(c.items())))
    if ns.json:
        Path(ns.json).write_text(json.dumps([{"cache": r[0], "dispatches": r[1], "primitives": r[2]}
                                             for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
