"""Does the same decode step give the same bits twice on this backend?

The question: a restored session's planes are bitwise the live ones, so its
next logits can only match the live session's bits if the forward pass itself
is deterministic. Is it, for this dtype and head layout, with mlx-lm's own
caches as well as muser-kv's?

1. **SDPA**: ``mx.fast.scaled_dot_product_attention`` at decode (one query row,
   ``--heads`` query heads, K/V of ``kv_heads`` heads and ``L`` rows), called
   ``--calls`` times on the same evaluated inputs; the outputs' bits compared.
2. **Model** (``--model``): ``mlx_lm.models.muse_glimmer.Model`` with random
   weights (``--layers`` etc.; defaults: the real geometry, ~17 GB in 2-byte
   weights), ``--runs`` times from a new cache of each system: a
   ``--prompt``-token prefill in 2,048-token chunks, then ``--steps`` greedy
   decode steps; each run's logits compared bitwise with the first run's.

    python benchmarks/determinism.py                          # SDPA only
    python benchmarks/determinism.py --model --dtypes float16,bfloat16
    .venv/bin/python benchmarks/determinism.py --model --layers 4 --hidden 256 \\
        --intermediate 512 --vocab 1024 --heads 4 --kv-heads 2,1 --window 64   # CPU, reduced
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from _common import DTYPES, print_header, print_table, write_json  # noqa: E402
from end_to_end import add_geometry_flags, build_model  # noqa: E402

import muser_kv  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--lengths", default="4096,4097,32768,131072",
                   help="SDPA key rows L, comma-separated")
    p.add_argument("--kv-heads", default="8,2", help="SDPA K/V heads, comma-separated")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--model", action="store_true", help="also run the model check")
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    add_geometry_flags(p)
    return p.parse_args(argv)


def bits(x: mx.array) -> np.ndarray:
    return np.array(x.view(mx.uint16) if x.dtype.size == 2 else x.view(mx.uint32))


def sdpa_rows(args: argparse.Namespace) -> List[List[Any]]:
    heads = args.heads or 32
    rows = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for kv in (int(h) for h in args.kv_heads.split(",")):
            for length in (int(n) for n in args.lengths.split(",")):
                q = mx.random.normal((1, heads, 1, args.head_dim)).astype(dtype)
                k = mx.random.normal((1, kv, length, args.head_dim)).astype(dtype)
                v = mx.random.normal((1, kv, length, args.head_dim)).astype(dtype)
                mx.eval(q, k, v)
                outs = [bits(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088))
                        for _ in range(args.calls)]
                same = sum(bool((o == outs[0]).all()) for o in outs[1:])
                rows.append([name, heads, kv, length, f"{same} of {args.calls - 1}"])
    return rows


def model_rows(args: argparse.Namespace) -> List[List[Any]]:
    rows = []
    rng = np.random.default_rng(args.seed)
    for name in args.dtypes.split(","):
        model = build_model(args, name)
        prompt = mx.array(rng.integers(0, model.args.vocab_size, args.prompt)[None])
        for system in ("mlx-lm", "muser-kv"):
            runs = []
            for _ in range(args.runs):
                cache = (muser_kv.make_prompt_cache(model) if system == "muser-kv"
                         else model.make_cache())
                for a in range(0, args.prompt, 2048):
                    out = model(prompt[:, a:a + 2048], cache=cache)
                logits = [out[:, -1, :]]
                for _ in range(args.steps):
                    y = mx.argmax(logits[-1], axis=-1)
                    logits.append(model(y[None], cache=cache)[:, -1, :])
                mx.eval(logits)
                runs.append([bits(x) for x in logits])
                del cache
            for step in range(args.steps + 1):
                same = sum(bool((r[step] == runs[0][step]).all()) for r in runs[1:])
                rows.append([name, system, "prefill" if step == 0 else f"decode {step}",
                             f"{same} of {args.runs - 1}"])
        del model
        mx.clear_cache()
    return rows


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    mx.random.seed(args.seed)
    print_header("determinism: the same step twice, bits compared", args)
    out: Dict[str, Any] = {"sdpa": sdpa_rows(args)}
    print(f"\n1. SDPA at decode, {args.calls} calls on the same inputs: how many equal the first")
    print_table(["dtype", "q heads", "kv heads", "L", "bitwise = call 1"], out["sdpa"])
    if args.model:
        out["model"] = model_rows(args)
        print(f"\n2. Model, {args.runs} runs from new caches (prefill {args.prompt:,} tokens, then "
              f"{args.steps} greedy steps): how many runs' logits equal run 1's")
        print_table(["dtype", "cache", "step", "bitwise = run 1"], out["model"])
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
