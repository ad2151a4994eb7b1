"""Per-token decode cost: muser-kv vs mlx-lm's Muse Glimmer caches, same work.

For each of L layers (Muse pattern: layer i is global NoPE iff i % 4 == 3) one
decode step does what Muse Glimmer's attention does with its cache:

    k, v = cache.update_and_fetch(k_new, v_new)
    out  = mx.fast.scaled_dot_product_attention(q, k, v, scale=..., mask=mask)

with q ``[1, heads, 1, head_dim]`` and k/v ``[1, kv_heads, 1, head_dim]``. The
masks are made the way the model makes them: once per layer kind, from the first
cache of that kind, before any layer runs (``make_mask(1, window_size=W)`` for
sliding layers, ``make_mask(1, window_size=None)`` for global ones, with
``return_array=False`` as mlx-lm's ``create_attention_mask`` passes). Layer
i+1's q, k_new and v_new are cheap functions of layer i's output, and step
t+1's input is a function of step t's output, so each step is a real dependent
sequence.

The caches are first filled to each depth (big ``update_and_fetch`` chunks,
then a few single-token updates so mlx-lm's ``RotatingKVCache`` is in its
steady, max_size ring state), then ``--steps`` tokens are timed after
``--warmup`` in two modes:

* ``sync``: ``mx.eval`` after every step;
* ``pipelined``: mlx-lm's ``generate_step`` pattern: build step t+1 and
  ``mx.async_eval`` it before waiting on step t.

Printed: ms/token for both and ``mlx-lm / ours`` (> 1 means muser-kv is
faster); host graph-build ms/token; peak memory during the timed steps minus the
memory active before them (a transient plane copy would show up here); and the
cache sizes beside ``footprint(geometry, max_context).slot_bytes``.

muser-kv's caches are sized once for each of ``--max-contexts``, taken exactly
as given (default: one size, the largest depth plus the tokens this run
decodes, not rounded: whatever an application asks for, including sizes off a
multiple of 256, where MLX CUDA's attention once hit a 10x cliff); mlx-lm's grow
with the depth. Each depth runs at every max context that holds it, and
mlx-lm's caches are measured again beside each, in the same run.

    python benchmarks/decode.py                                        # GPU, full
    python benchmarks/decode.py --depths 32768,130000 --max-contexts 131072,131190 --dtype bfloat16
    python benchmarks/decode.py --depths 2048,8192 --layers 4 --steps 8 --warmup 2 --repeats 2  # CPU
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
    geometry,
    int_list,
    make_caches,
    median,
    now,
    on_gpu,
    plane_dtype,
    print_header,
    print_table,
    ratio,
    settle,
    str_list,
    write_json,
)

import muser_kv  # noqa: E402

SETTLE_TOKENS = 4  # single-token updates that end the fill (steady ring state)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int_list, default=[2048, 8192, 32768, 131072],
                   help="context depths to decode at (default 2048,8192,32768,131072)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed decode steps per repeat (default 64 on GPU, 16 on CPU)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps per mode (default 4)")
    p.add_argument("--modes", type=str_list, default=["sync", "pipelined"],
                   help="sync,pipelined (default both)")
    p.add_argument("--max-contexts", type=int_list, default=None,
                   help="muser-kv capacities, exactly as given (default: max depth + decoded "
                        "tokens); each depth runs at every one that holds it")
    p.add_argument("--fill-chunk", type=int, default=4096,
                   help="chunk size used to fill the caches to each depth (default 4096)")
    add_model_flags(p)
    add_common_flags(p)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 64 if on_gpu() else 16
    for m in args.modes:
        if m not in ("sync", "pipelined"):
            p.error(f"unknown mode {m!r}")
    if min(args.depths) <= SETTLE_TOKENS:
        p.error(f"depths must exceed {SETTLE_TOKENS}")
    args.decoded = len(args.modes) * (args.warmup + args.repeats * args.steps)
    if args.max_contexts is None:
        args.max_contexts = [max(args.depths) + args.decoded]
    for depth in args.depths:
        if not any(depth + args.decoded <= m for m in args.max_contexts):
            p.error(f"depth {depth} + {args.decoded} decoded tokens fits none of --max-contexts "
                    f"{args.max_contexts}")
    args.max_context = max(args.max_contexts)
    return args


# -- caches -------------------------------------------------------------------


def fill(caches: List[Any], depth: int, args, dtype) -> None:
    """Fill every layer to ``depth`` tokens: big chunks, then SETTLE_TOKENS singles."""
    chunk = min(args.fill_chunk, depth)
    # The same contents for both systems (a fixed key), so their outputs can be compared.
    key = mx.random.key(args.seed + 1)
    block = mx.random.normal((1, args.kv_heads, chunk, args.head_dim), key=key).astype(dtype)
    one = block[:, :, :1]
    mx.eval(block)
    done, target = 0, depth - SETTLE_TOKENS
    while done < target:
        n = min(chunk, target - done)
        x = block[:, :, :n]
        for c in caches:
            c.update_and_fetch(x, x)
        mx.eval([c.state for c in caches])
        done += n
    for _ in range(SETTLE_TOKENS):
        for c in caches:
            c.update_and_fetch(one, one)
        mx.eval([c.state for c in caches])
    assert all(c.offset == depth for c in caches), [c.offset for c in caches]


def cache_bytes(caches: List[Any]) -> int:
    return sum(c.nbytes for c in caches)


# -- one decode step ----------------------------------------------------------


def next_input(q0: mx.array, h: mx.array) -> mx.array:
    return (q0 + h) * 0.5


def run_sync(caches, q0, h, steps, args):
    build = 0.0
    t0 = now()
    for _ in range(steps):
        b0 = now()
        h = attend_layers(caches, next_input(q0, h), args)
        build += now() - b0
        mx.eval(h)
    return h, now() - t0, build


def run_pipelined(caches, q0, h, steps, args):
    """mlx-lm generate_step: build and async_eval step t+1, then wait on step t."""
    build = 0.0
    t0 = now()
    b0 = now()
    h = attend_layers(caches, next_input(q0, h), args)
    build += now() - b0
    mx.async_eval(h)
    for _ in range(steps - 1):
        b0 = now()
        nh = attend_layers(caches, next_input(q0, h), args)
        build += now() - b0
        mx.async_eval(nh)
        mx.eval(h)
        h = nh
    mx.eval(h)
    return h, now() - t0, build


RUNNERS = {"sync": run_sync, "pipelined": run_pipelined}


# -- main -----------------------------------------------------------------------


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    mx.random.seed(args.seed)
    print_header(
        "decode: ms/token, muser-kv vs mlx-lm (ratio = mlx-lm / muser-kv; > 1: muser-kv faster)",
        args,
        f"muser-kv planes {plane_dtype(args)}, sized exactly for max_context in "
        f"{args.max_contexts} (rows allocated in multiples of 256)",
    )
    q0 = mx.random.normal((1, args.heads, 1, args.head_dim)).astype(dtype)
    mx.eval(q0)

    results: List[Dict[str, Any]] = []
    time_rows, mem_rows, check_rows = [], [], []
    cells = [(d, m) for d in args.depths for m in args.max_contexts if d + args.decoded <= m]
    for depth, max_context in cells:
        args.max_context = max_context
        slot = muser_kv.footprint(geometry(args), max_context).slot_bytes
        caches = {}
        sizes = {}
        for s in SYSTEMS:
            caches[s] = make_caches(s, args)
            fill(caches[s], depth, args, dtype)
            sizes[s] = cache_bytes(caches[s])
        settle()
        mem_rows.append([depth, max_context, sizes["muser-kv"] / MB, slot / MB,
                         sizes["mlx-lm"] / MB])
        state = {s: q0 for s in SYSTEMS}  # running hidden state per system
        for mode in args.modes:
            run = RUNNERS[mode]
            cell = {s: {"ms_per_token": [], "build_ms_per_token": [], "peak_extra_bytes": []}
                    for s in SYSTEMS}
            for s in SYSTEMS:  # warmup
                state[s], _, _ = run(caches[s], q0, state[s], args.warmup, args)
            for r in range(args.repeats):
                order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
                for s in order:
                    with PeakProbe() as probe:
                        state[s], dt, build = run(caches[s], q0, state[s], args.steps, args)
                    cell[s]["ms_per_token"].append(dt / args.steps * 1e3)
                    cell[s]["build_ms_per_token"].append(build / args.steps * 1e3)
                    cell[s]["peak_extra_bytes"].append(probe.extra)
            ours = median(cell["muser-kv"]["ms_per_token"])
            theirs = median(cell["mlx-lm"]["ms_per_token"])
            results.append({
                "depth": depth, "max_context": max_context, "mode": mode, "systems": cell,
                "cache_bytes": sizes, "ratio_mlx_lm_over_muser_kv": ratio(theirs, ours),
            })
            time_rows.append([
                depth, max_context, mode, ours, theirs, ratio(theirs, ours),
                median(cell["muser-kv"]["build_ms_per_token"]),
                median(cell["mlx-lm"]["build_ms_per_token"]),
                max(cell["muser-kv"]["peak_extra_bytes"]) / MB,
                max(cell["mlx-lm"]["peak_extra_bytes"]) / MB,
            ])
        for s in SYSTEMS:
            assert caches[s][0].offset == depth + len(args.modes) * (
                args.warmup + args.repeats * args.steps)
        # Same inputs, same contents: both systems must have computed the same thing.
        diff = mx.abs(state["muser-kv"].astype(mx.float32)
                      - state["mlx-lm"].astype(mx.float32)).max().item()
        check_rows.append([f"{depth}@{max_context}", diff])
        del caches, state
        settle()

    print("Decode time (median of repeats; build = host time spent building the step graph)")
    print()
    print_table(
        ["depth", "max_context", "mode", "muser-kv ms/tok", "mlx-lm ms/tok", "mlx-lm / muser-kv",
         "muser-kv build ms", "mlx-lm build ms", "muser-kv peak+ MiB", "mlx-lm peak+ MiB"],
        time_rows, digits=2,
    )
    print("peak+ = max over repeats of (peak memory during the timed steps "
          "- memory active before them)")
    print()
    print("Cache memory at the start of decode (all layers)")
    print()
    print_table(
        ["depth", "max_context", "muser-kv nbytes MiB", "footprint MiB", "mlx-lm nbytes MiB"],
        mem_rows, digits=1,
    )
    print("Same work check: max |h(muser-kv) - h(mlx-lm)| of the final hidden state "
          "(both decoded the same tokens over the same cache contents): "
          + ", ".join(f"depth {d}: {x:.2e}" for d, x in check_rows))
    print()
    payload = {"benchmark": "decode", "args": vars(args), "results": results,
               "final_state_max_abs_diff": dict(check_rows)}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
