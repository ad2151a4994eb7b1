"""Does the same decode step give the same bits twice on this backend, SDPA alone and the real Muse Glimmer?

A restored session's planes are bitwise the live ones, so its next logits can
only match the live session's bits if the forward pass itself is
deterministic. Is it, for this dtype and head layout, with mlx-lm's own caches
as well as muser-kv's?

1. **SDPA**: ``mx.fast.scaled_dot_product_attention`` at decode (one query row,
   ``--heads`` query heads, K/V of ``kv_heads`` heads and ``L`` rows), called
   ``--calls`` times on the same evaluated inputs; the outputs' bits compared.
2. **Model** (``--model``): Muse Glimmer (``_harness.build_model``: random
   weights, the real geometry by default, ~17 GB in 2-byte weights), ``--runs``
   times from a new cache of each system: a
   ``--prompt``-token prefill in 2,048-token chunks, then ``--steps`` greedy
   decode steps; each run's logits compared bitwise with the first run's.
3. **Allocator**: SDPA at decode over rows ``[0, L)`` of planes allocating ``R``
   rows, the planes in a buffer of exactly their size, in a freed buffer one
   page larger that MLX's allocator recycled, allocated after the same decoys
   with MLX's buffer cache off (``mx.set_cache_limit(0)``), and allocating
   ``R + 8`` rows (so never a cuDNN read): which agree. On MLX CUDA the recycled buffer is read by
   the vector kernel, not cuDNN (``docs/performance.md``: why the repeated answers differ).
4. **Writes** (``--writes``): after a ``--prompt``-token fill, ``--steps`` decode
   steps of synthetic K/V through every layer's ``update_and_fetch`` and SDPA;
   per step the peak memory of its writes above what was held, against one plane: a write
   that cannot reuse its buffer copies the plane into a buffer the allocator
   picks (section 3). Steps waited for one by one, and pipelined as mlx-lm's
   ``generate_step`` runs them (the previous step's attention in flight).

5. **Repeats** (``--repeats``): a whole list written and read as a forward
   does, ``--runs`` times from new caches (growing and preallocated): three
   prefill chunks of synthetic K/V (200, 100 and 300 rows, across the 256- and
   512-row allocations), then ``--steps`` one-token steps, every layer's
   ``update_and_fetch`` and SDPA in one graph per step; the layers' queries
   independent (the test's way) or chained (each layer's query after the
   previous layer's output, a model's way). Per run the K/V rows handed to
   attention (copied) and the outputs are compared with run 1's: rows equal
   and outputs not is attention varying over the same rows. Run it under
   ``MLX_USE_CUDA_GRAPHS=0`` or ``MLX_CUDA_USE_CUDNN_SDPA=0`` to see which part
   of MLX CUDA varies (``bash benchmarks/device.sh repeats``).

    bash benchmarks/device.sh determinism                     # H200: SDPA, then the real model
    bash benchmarks/device.sh buffers                         # H200: sections 1, 3 and 4
    python3 benchmarks/determinism.py                          # SDPA only
    PYTHONPATH=. .venv/bin/python benchmarks/determinism.py --model --layers 4 --hidden 256 \\
        --intermediate 512 --vocab 1024 --heads 4 --kv-heads 2,1 --window 64 --lengths 256,4097 \\
        --prompt 300                                                          # CPU
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, List

import _harness as H
import mlx.core as mx
import numpy as np

import muser_kv
from muser_kv.core.geometry import LayerKind, canonical_rows


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--lengths", type=H.int_list, default=[4096, 4097, 32768, 131072],
                   help="SDPA key rows L (default 4096,4097,32768,131072)")
    p.add_argument("--kv-heads", dest="sdpa_kv_heads", type=H.int_list, default=[8, 2],
                   help="SDPA K/V heads (default 8,2)")
    p.add_argument("--head-dim", dest="sdpa_head_dim", type=int, default=128,
                   help="SDPA head dim (default 128)")
    p.add_argument("--calls", type=int, default=6, help="SDPA calls per cell (default 6)")
    p.add_argument("--model", action="store_true", help="also run the model check")
    p.add_argument("--writes", action="store_true",
                   help="also check that decode writes reuse the planes' buffers (section 4)")
    p.add_argument("--repeats", action="store_true",
                   help="also run a whole list's writes and reads several times (section 5)")
    p.add_argument("--prompt", type=int, default=4096, help="model prompt tokens (default 4096)")
    p.add_argument("--steps", type=int, default=4, help="greedy decode steps per run (default 4)")
    H.add_flags(p, ("layers", "hidden", "intermediate", "vocab", "heads", "window", "max_position"),
                dtype=None, dtypes="float16,bfloat16",
                blocks=("runs", 3, "model runs per system, each from a new cache"))
    return H.parse(p, argv)


def sdpa_rows(args) -> List[List[Any]]:
    heads, d, rows = args.heads, args.sdpa_head_dim, []
    for name in args.dtypes:
        dtype = H.DTYPES[name]
        for kv in args.sdpa_kv_heads:
            for length in args.lengths:
                q = mx.random.normal((1, heads, 1, d)).astype(dtype)
                k = mx.random.normal((1, kv, length, d)).astype(dtype)
                v = mx.random.normal((1, kv, length, d)).astype(dtype)
                mx.eval(q, k, v)
                outs = [H.bits(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088))
                        for _ in range(args.calls)]
                same = sum(bool((o == outs[0]).all()) for o in outs[1:])
                rows.append([name, heads, kv, length, f"{same} of {args.calls - 1}"])
    return rows


PAGE = 16384  # MLX CUDA's allocation page: a cached buffer up to two pages larger is reused


def recycle(nbytes: int, count: int) -> None:
    """Leave ``count`` freed buffers of ``nbytes`` plus one page in MLX's buffer cache:
    the next allocations of ``nbytes`` take them."""
    decoys = [mx.zeros((nbytes + PAGE,), mx.uint8) for _ in range(count)]
    mx.eval(decoys)
    del decoys


def allocator_rows(args) -> List[List[Any]]:
    """SDPA at decode over rows ``[0, L)`` of planes allocating ``R`` rows (256 x a power
    of two), the planes in a buffer of their own size, in a recycled buffer one page
    larger, allocated after the same decoys with MLX's buffer cache off
    (``mx.set_cache_limit(0)``: the decoys are returned, not cached), and allocating
    ``R + 8`` rows: which results agree."""
    heads, d, rows = args.heads, args.sdpa_head_dim, []
    for name in args.dtypes:
        dtype = H.DTYPES[name]
        for kv in args.sdpa_kv_heads:
            for length in args.lengths:
                alloc = canonical_rows(length, 2 * length)
                q = mx.random.normal((1, heads, 1, d)).astype(dtype)
                src = mx.random.normal((1, kv, alloc + 8, d)).astype(dtype)
                mx.eval(q, src)
                mx.clear_cache()
                exact = [mx.contiguous(src[:, :, :alloc, :]) for _ in range(2)]
                mx.eval(exact)
                recycle(exact[0].nbytes, 2)
                big = [mx.contiguous(src[:, :, :alloc, :]) for _ in range(2)]
                mx.eval(big)
                limit = mx.set_cache_limit(0)
                mx.clear_cache()
                recycle(exact[0].nbytes, 2)
                off = [mx.contiguous(src[:, :, :alloc, :]) for _ in range(2)]
                mx.eval(off)
                mx.set_cache_limit(limit)
                out = {}
                for label, (k, v) in (("own", exact), ("recycled", big), ("off", off),
                                      ("R+8", (src, src))):
                    out[label] = H.bits(mx.fast.scaled_dot_product_attention(
                        q, k[:, :, :length, :], v[:, :, :length, :], scale=0.088))
                pairs = (("own", "recycled"), ("own", "off"), ("recycled", "R+8"),
                         ("own", "R+8"))
                rows.append([name, kv, length, alloc] + [
                    "yes" if (out[a] == out[b]).all() else "no" for a, b in pairs])
    return rows


def write_rows(args) -> List[List[Any]]:
    """Per decode step, the peak memory of its writes above what was held before
    them, against one plane's bytes: a step at or above a plane copied one (its
    write could not reuse the buffer, so the copy's buffer came from the
    allocator: section 3). Each step's attention reads the rows after its writes
    are measured, so the next step's writes meet what a read leaves behind:
    waited for (``synchronous``), or still in flight (``pipelined``: the next
    step's writes are evaluated before the previous step is waited for, as
    mlx-lm's ``generate_step`` runs a decode; a GPU backend holds the buffers a
    kernel reads until it completes, so such a write may have to copy).
    Muse Glimmer's K/V geometry with tiny other dimensions; ``--prompt`` tokens of
    synthetic K/V written through every layer's ``update_and_fetch``, then
    ``--steps`` one-token steps, each layer's output read by SDPA, mlx-lm's way."""
    rows = []
    for name in args.dtypes:
        model = H.build_model(args, name, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=8, vocab_size=256)
        dtype = H.DTYPES[name]
        for system in H.SYSTEMS:
            for preallocate in ((False, True) if system == "muser-kv" else (False,)):
                for pipelined in (False, True):
                    extra, plane = _writes(model, system, preallocate, pipelined, dtype, args)
                    label = system + (" preallocated" if preallocate else "")
                    rows.append([name, label, "pipelined" if pipelined else "synchronous", plane,
                                 max(extra), sum(e >= plane for e in extra), args.steps])
        del model
        mx.clear_cache()
    return rows


def _writes(model, system: str, preallocate: bool, pipelined: bool, dtype, args):
    """One run of section 4: the extra bytes of each step's writes, and a plane's bytes."""
    a = model.args
    cache = (muser_kv.make_prompt_cache(model, preallocate=preallocate)
             if system == "muser-kv" else model.make_cache())
    kv = mx.random.normal((1, a.num_key_value_heads, args.prompt, a.head_dim)).astype(dtype)
    q = mx.random.normal((1, a.num_attention_heads, 1, a.head_dim)).astype(dtype)
    mx.eval(kv, q)
    for c in cache:
        c.update_and_fetch(kv, kv)
    mx.eval([c.state for c in cache])
    extra, outs = [], None
    for step in range(args.steps):
        one = kv[:, :, step:step + 1]
        mx.eval(one)
        if not pipelined:
            mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        read = [c.update_and_fetch(one, one) for c in cache]
        mx.async_eval(read)  # the writes alone: what they allocate is decided here
        if not pipelined:
            mx.synchronize()
        extra.append(max(0, mx.get_peak_memory() - base))
        outs = [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088)
                for k, v in read]  # then read, as attention does
        mx.async_eval(outs)
        if not pipelined:
            mx.eval(outs)
        del read
    mx.eval(outs)
    return extra, max(c.state[0].nbytes for c in cache)


#: section 5's prefill chunks: across the 256- and 512-row allocations
REPEAT_CHUNKS = (200, 100, 300)


def repeat_rows(args) -> List[List[Any]]:
    """Section 5: per dtype, allocation and query order, how many of ``--runs``
    runs gave run 1's K/V rows and run 1's outputs, and where the first output
    differed."""
    rows = []
    for name in args.dtypes:
        model = H.build_model(args, name, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=8, vocab_size=256)
        for preallocate in (False, True):
            for chained in (False, True):
                runs = [_repeat(model, preallocate, chained, H.DTYPES[name], args)
                        for _ in range(args.runs)]
                rows.append([name, "preallocated" if preallocate else "growing",
                             "chained" if chained else "independent",
                             *_agreement(runs), args.runs - 1])
        del model
        mx.clear_cache()
    return rows


def _agreement(runs: List[List[Any]]) -> List[Any]:
    """Runs whose every step's K/V rows equal run 1's; runs whose every output
    does; the first (step, layer) whose output differs from run 1's."""
    first, rows_same, outs_same, where = runs[0], 0, 0, "-"
    for run in runs[1:]:
        rows_same += all(np.array_equal(a, b) for s, t in zip(first, run)
                         for a, b in zip(s[0], t[0]))
        differing = [(step, layer) for step, (s, t) in enumerate(zip(first, run))
                     for layer, (a, b) in enumerate(zip(s[1], t[1])) if not np.array_equal(a, b)]
        outs_same += not differing
        if differing and where == "-":
            where = "step {}, layer {}".format(*differing[0])
    return [rows_same, outs_same, where]


def _repeat(model, preallocate: bool, chained: bool, dtype, args) -> List[Any]:
    """One run of section 5: per step, the K/V rows each layer handed attention
    (copied in the same graph, so no write is kept from reusing its buffer) and
    each layer's output, as bits."""
    a = model.args
    cache = muser_kv.make_prompt_cache(model, max_context=4096, preallocate=preallocate)
    steps = []
    for i, n in enumerate(REPEAT_CHUNKS + (1,) * args.steps):
        key = mx.random.key(args.seed + i)
        k, v, q = (mx.random.normal((1, h, n, a.head_dim), key=part).astype(dtype)
                   for h, part in zip((a.num_key_value_heads, a.num_key_value_heads,
                                       a.num_attention_heads), mx.random.split(key, 3)))
        mx.eval(k, v, q)
        masks = [c.make_mask(n, window_size=None if c.kind is LayerKind.GLOBAL else c.window_size)
                 for c in cache]  # before the writes, as a model asks
        outs, copies = [], []
        for c, mask in zip(cache, masks):
            keys, values = c.update_and_fetch(k, v)
            query = q if not (chained and outs) else q + 0 * outs[-1][..., -1:, :]
            outs.append(mx.fast.scaled_dot_product_attention(query, keys, values, scale=0.088,
                                                             mask=mask))
            # one row more: a copy, never a view of the planes
            copies.append(mx.concatenate([keys, values, keys[:, :, :1]], axis=2))
        mx.eval(outs, copies)
        steps.append(([H.bits(x) for x in copies], [H.bits(o) for o in outs]))
    return steps


def one_run(model, prompt: mx.array, args, system: str, _run: int) -> List[np.ndarray]:
    """From a new cache: the prefill in 2,048-token chunks, then greedy steps; the logits' bits."""
    cache = H.prompt_cache(system, model)
    for a in range(0, args.prompt, 2048):
        out = model(prompt[:, a:a + 2048], cache=cache)
    logits = [out[:, -1, :]]
    for _ in range(args.steps):
        logits.append(model(mx.argmax(logits[-1], axis=-1)[None], cache=cache)[:, -1, :])
    mx.eval(logits)
    return [H.bits(x) for x in logits]


def model_rows(args) -> List[List[Any]]:
    rows, rng = [], np.random.default_rng(args.seed)
    for name in args.dtypes:
        model = H.build_model(args, name)
        prompt = mx.array(rng.integers(0, model.args.vocab_size, args.prompt)[None])
        systems = H.SYSTEMS[::-1]
        runs = H.alternate(args.runs, partial(one_run, model, prompt, args), systems)
        for system in systems:
            for step in range(args.steps + 1):
                same = sum(bool((r[step] == runs[system][0][step]).all()) for r in runs[system][1:])
                rows.append([name, system, "prefill" if step == 0 else f"decode {step}",
                             f"{same} of {args.runs - 1}"])
        del model, runs
        mx.clear_cache()
    return rows


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    mx.random.seed(args.seed)
    H.print_header("determinism: the same step twice, bits compared", args)
    out: Dict[str, Any] = {"sdpa": sdpa_rows(args)}
    H.table(["dtype", "q heads", "kv heads", "L", "bitwise = call 1"], out["sdpa"],
            title=f"1. SDPA at decode, {args.calls} calls on the same inputs: how many equal the first")
    out["allocator"] = allocator_rows(args)
    H.table(["dtype", "kv heads", "L", "R", "own = recycled", "own = cache off", "recycled = R+8",
             "own = R+8"], out["allocator"],
            title="3. SDPA at decode over planes of R rows in a buffer of their own size, in a "
            "recycled one a page larger, allocated with MLX's buffer cache off, and over planes "
            "of R + 8 rows: bitwise equal?")
    if args.writes:
        out["writes"] = write_rows(args)
        H.table(["dtype", "cache", "steps", "largest plane B", "most extra B in a step",
                 "steps that copied", "of"], out["writes"],
                title=f"4. Decode writes after a {args.prompt:,}-token fill: does each step reuse "
                      "the planes' buffers? (peak memory of a step's writes above what was held)")
    if args.repeats:
        out["repeats"] = repeat_rows(args)
        H.table(["dtype", "planes", "queries", "K/V rows = run 1", "outputs = run 1",
                 "first output differing", "of"], out["repeats"],
                title=f"5. A whole list's writes and reads, {args.runs} runs from new caches "
                      f"(prefill chunks {', '.join(map(str, REPEAT_CHUNKS))}, then "
                      f"{args.steps} steps): how many runs equal run 1")
    if args.model:
        out["model"] = model_rows(args)
        H.table(["dtype", "cache", "step", "bitwise = run 1"], out["model"],
                title=f"2. Model, {args.runs} runs from new caches, the systems alternating (prefill "
                      f"{args.prompt:,} tokens, then {args.steps} greedy steps): how many runs' "
                      "logits equal run 1's")
    H.write_json(args.json, {"benchmark": "determinism", "args": vars(args), **out})
    return out


if __name__ == "__main__":
    main()
