"""Serving B sequences at once: what tok/s and memory does muser-kv's batch give against mlx-lm's, how near the floor?

Decode reads all the weights (55.7 GB for the real Muse Glimmer in bf16)
whatever the batch, plus every live K/V row of every sequence, so B sequences in
one forward should cost about what one does. Per context and B, each system
gets one batch per layer of B sequences, each at the same context of random K/V
(muser-kv: ``BatchKVCache.merge`` of empty caches, ``batch_slots`` = B; mlx-lm:
its ``BatchKVCache`` / ``BatchRotatingKVCache``), filled through the batch's own
``update_and_fetch`` in ``--fill-chunk`` chunks (a prefill is not the question;
no single-sequence copies are held beside the batch), then decoded through the
model as ``GenerationBatch`` does (pipelined) in ``--blocks`` alternating blocks
of ``--steps`` steps.

**The floor, measured in the same run**: one pass that reads every weight of the
model and every live K/V row of the batch (a sum over each array, all in one
evaluation: the rows a decode step must read, at the speed this device reads
them), timed as a third system in the same alternation. Each step is reported
as a fraction of it (``floor ms / step ms``; 1.0 = at the floor). MLX's reduction
reads more slowly than its matmuls (2.6 TB/s against 4.0 on the H200) and a
batch's strided views more slowly still, so the table also gives the same bytes
at ``--bandwidth`` (default 4.0 TB/s, the H200's B = 1 weight matmuls).

**Reaching the model's full context**: every system decodes ``--warmup`` +
``--blocks`` x ``--steps`` tokens past the fill. A context that leaves no room
for them below the model's ``max_position_embeddings`` is filled to
``max_position_embeddings`` minus those steps instead, so the last step ends
exactly at the model's full context (the table's ``filled`` column is where
decode began; ``--contexts 131072`` fills to 131,072 - 3 - 5 x 16 = 130,989).

Printed: aggregate tok/s of the median block (B x steps / time), the ratio, ms
per step, the fraction of the floor; then the peak during decode above
everything but the system's own batch, plus that batch, against B x footprint
(one sequence's preallocated planes) plus the step's activations (an upper
estimate: two pipelined steps of one layer's hidden, MLP and attention rows
and the logits, in float32), and whether the peak is within it.

``--generator``: instead, mlx-lm's ``BatchGenerator`` (what the server runs)
end to end with B prompts of ``--prompt`` tokens (each length of a list, each B;
``--batch-tokens`` skips the cells of more tokens; ``--sliding-layout head_major``
is ``muser-kv serve``'s), mlx-lm's caches against
muser-kv's lists (``caches=``), ``--blocks`` alternating runs: prefill to every
sequence's first token, decode tok/s of the rest, peak above what was held
before (muser-kv's preallocated planes included).

``--family gemma3-27b|gpt-oss-20b``: that checkpoint's shapes (random weights)
instead of Muse Glimmer at the geometry flags.

    # H200, real geometry, bf16 (55.7 GB of weights). Rough times: 131072 x 1,2,4,8,16
    # ~ 8 min (both systems; B = 32 does not fit both: 2 x 58.5 GB of K/V + weights);
    # 131072 x 32 muser-kv only ~ 3 min; 8k and 32k x 1..32 ~ 6 min; generator 16k ~ 5 min
    python3 benchmarks/batched.py --contexts 131072 --batches 1,2,4,8,16 --dtype bfloat16 --blocks 3
    python3 benchmarks/batched.py --contexts 131072 --batches 32 --systems muser-kv --dtype bfloat16 --blocks 3
    python3 benchmarks/batched.py --contexts 8192,32768 --batches 1,2,4,8,16,32 --dtype bfloat16 --blocks 3
    python3 benchmarks/batched.py --generator --prompt 16384 --batches 1,8 --dtype bfloat16 --blocks 2
    python3 benchmarks/batched.py --family gemma3-27b --contexts 32768 --batches 1,8 --dtype bfloat16 --blocks 3
    bash benchmarks/device.sh batched                    # H200: real geometry, 8k and 32k, B 1..8
    PYTHONPATH=. .venv/bin/python benchmarks/batched.py --layers 4 --hidden 128 --intermediate 256 \\
        --vocab 512 --heads 4 --window 64 --contexts 256,1024 --batches 1,2,4 --steps 8 \\
        --max-position 1024                                                     # CPU
    PYTHONPATH=. .venv/bin/python benchmarks/batched.py --generator --layers 4 --hidden 128 \\
        --intermediate 256 --vocab 512 --heads 4 --window 64 --prompt 300 --tokens 8 \\
        --batches 1,3 --max-position 1024 --prefill-step 128 --blocks 2        # CPU
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import _harness as H
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache as LmBatchKVCache
from mlx_lm.models.cache import BatchRotatingKVCache

import muser_kv
from muser_kv.caches.batch import BatchKVCache

FLOOR = "floor"


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--contexts", type=H.int_list, default=[8192, 32768],
                   help="tokens each sequence holds (default 8192,32768)")
    p.add_argument("--batches", type=H.int_list, default=[1, 2, 4, 8],
                   help="batch sizes (default 1,2,4,8)")
    p.add_argument("--systems", type=H.choice_list(*H.SYSTEMS), default=list(H.SYSTEMS),
                   help="muser-kv,mlx-lm (default both; one alone where both do not fit)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per block (default 16)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--fill-chunk", type=int, default=4096)
    p.add_argument("--lengths-from", type=int, default=None, metavar="N",
                   help="mixed lengths: sequence b of B holds N + (context - N) * b / (B - 1) "
                        "tokens (as a server's chats do), each cell beside an equal-length batch "
                        "holding the same total rows (their mean); muser-kv's batches prefill "
                        "right-padded (prepare), mlx-lm's left-padded as its BatchGenerator does")
    p.add_argument("--sliding-layout", choices=["token_major", "head_major"], default="token_major",
                   help="the sliding rings' layout (default token_major; muser-kv serve: head_major)")
    p.add_argument("--floor-repeats", type=int, default=3,
                   help="floor passes per block, the median (default 3)")
    p.add_argument("--bandwidth", type=float, default=4.0e12,
                   help="bytes per second of the second floor, the bytes a step must read over "
                        "this rate (default 4.0e12: what the H200's B = 1 weight matmuls reach, "
                        "benchmarks/profile_step.py)")
    p.add_argument("--family", choices=["muse-glimmer", *H.FAMILIES], default="muse-glimmer",
                   help="the model: Muse Glimmer at the geometry flags (default), or a family "
                        "at its real checkpoint's shapes")
    g = p.add_argument_group("--generator: mlx-lm's BatchGenerator end to end")
    g.add_argument("--generator", action="store_true",
                   help="run BatchGenerator over B prompts instead of the decode loop")
    g.add_argument("--prompt", type=H.int_list, default=[16384],
                   help="tokens per prompt, one or more lengths (default 16384); each length "
                        "runs every --batches B")
    g.add_argument("--batch-tokens", type=int, default=None,
                   help="skip a cell whose B x prompt exceeds this (default: none skipped; "
                        "mlx-lm's batch prefill materializes B x heads x step x context scores)")
    g.add_argument("--tokens", type=int, default=48, help="tokens generated per sequence (default 48)")
    g.add_argument("--prefill-step", type=int, default=2048,
                   help="BatchGenerator's prefill_step_size (default 2048, mlx-lm's)")
    g.add_argument("--list-context", type=int, default=None,
                   help="max_context of muser-kv's lists (default: prompt + tokens; a server's is "
                        "the model's 131,072: global planes grow with the chat, so memory follows "
                        "its length either way)")
    H.add_flags(p, blocks=("blocks", 5, "timed blocks per system, alternating; the median block"))
    return H.parse(p, argv)


def build(args):
    if args.family == "muse-glimmer":
        return H.build_model(args)
    return H.build_family(args.family, args.dtype, args.seed)


def max_positions(model, args) -> int:
    """The model's full context: its ``max_position_embeddings`` (or the checkpoint's)."""
    return (getattr(model.args, "max_position_embeddings", None)
            or H.FAMILY_CONTEXT.get(args.family) or 1 << 62)


def filled(context: int, decode: int, limit: int) -> int:
    """Where decode begins: ``context``, or lower so that ``decode`` steps end at ``limit``."""
    start = min(context, limit - decode)
    if start < 1:
        raise SystemExit(f"{decode} decode steps do not fit the model's {limit} positions")
    return start


def spread(fill: int, b: int, lengths_from: Optional[int]) -> List[int]:
    """Each sequence's tokens: ``fill`` each, or spread from ``lengths_from`` to ``fill``."""
    if lengths_from is None or b == 1:
        return [fill] * b
    lo = min(lengths_from, fill)
    return [lo + (fill - lo) * i // (b - 1) for i in range(b)]


def batch(model, system: str, fill: int, max_context: int, b: int, args,
          lengths: Optional[List[int]] = None) -> List[Any]:
    """One batch per layer of ``b`` sequences, each filled to ``fill`` tokens (or
    to ``lengths[i]``) of the same random K/V through the batch's own
    ``update_and_fetch``: muser-kv's right-padded (``prepare``), mlx-lm's
    left-padded, as each system's BatchGenerator holds a batch of chats."""
    lengths = lengths or [fill] * b
    fill = max(lengths)
    if system == "muser-kv":
        single = muser_kv.make_prompt_cache(model, max_context=max_context,
                                            sliding_layout=args.sliding_layout)
        caches: List[Any] = [BatchKVCache.merge([c] * b, slots=b) for c in single]
        del single
    else:
        pad = [fill - n for n in lengths]
        caches = [BatchRotatingKVCache(c.max_size, pad) if hasattr(c, "max_size")
                  else LmBatchKVCache(pad) for c in model.make_cache()]
    a, dtype = model.args, H.DTYPES[args.dtype]
    block = mx.random.normal((1, a.num_key_value_heads, min(args.fill_chunk, fill), a.head_dim),
                             key=mx.random.key(args.seed)).astype(dtype)
    block = mx.broadcast_to(block, (b,) + block.shape[1:])
    mx.eval(block)
    done = 0
    mixed = system == "muser-kv" and len(set(lengths)) > 1
    while done < fill:
        n = min(block.shape[2], fill - done)
        real = [max(0, min(n, x - done)) for x in lengths]
        for c in caches:
            if mixed:
                c.prepare(lengths=real, right_padding=[n - r for r in real])
            c.update_and_fetch(block[:, :, :n], block[:, :, :n])
            if mixed:
                c.finalize()
        mx.eval([c.state for c in caches])
        done += n
    return caches


def footprint(model, max_context: int) -> int:
    """One sequence's preallocated planes: the most each slot of a batch holds
    (growing global planes stay within them)."""
    return sum(c.nbytes for c in muser_kv.make_prompt_cache(model, max_context=max_context,
                                                            preallocate=True))


def live_kv(caches: Sequence[BatchKVCache]) -> List[mx.array]:
    """Every live K/V row of a muser-kv batch, as attention's views read them:
    each sequence's own rows where lengths differ."""
    out: List[mx.array] = []
    for c in caches:
        lens = [s.ring.len for s in c.seqs]
        if len(set(lens)) == 1:
            out.extend(c.planes.prefix(lens[0], slots=len(c.seqs)))
            continue
        for b, n in enumerate(lens):
            out.extend(c.planes.prefix(n, slot=b))
    return out


def floor_pass(reads: Callable[[], List[mx.array]], repeats: int) -> Dict[str, float]:
    """The median time of one evaluation that sums every one of ``reads()``."""
    times = []
    for _ in range(repeats):
        arrays = reads()
        H.settle()
        t0 = H.now()
        mx.eval([mx.sum(x) for x in arrays])
        times.append(H.now() - t0)
    return {"ms": H.median(times) * 1e3}


def decode(model, cache: List[Any], b: int, steps: int) -> float:
    """``steps`` pipelined decode steps (GenerationBatch's pattern); seconds."""
    def forward(t):
        return mx.argmax(model(t[:, None], cache=cache)[:, -1, :], axis=-1).astype(mx.uint32)

    return H.decode_steps(forward, mx.zeros((b,), dtype=mx.uint32), steps, pipelined=True)[1]


def block(model, caches, b: int, args, system: str, _block: int) -> Dict[str, float]:
    """One timed block: aggregate tok/s, and the peak above all but this batch, plus it."""
    held = sum(c.nbytes for c in caches[system])
    with H.PeakProbe() as probe:
        seconds = decode(model, caches[system], b, args.steps)
    return {"tok_s": b * args.steps / seconds, "peak": probe.extra + held}


def activations(model, b: int, rows: int, kv_itemsize: int) -> int:
    """An upper estimate of a decode step's activations, two steps in flight
    (pipelined): one layer's hidden, MLP and projection rows and the logits in
    float32, plus the largest attention's temporaries (float32 scores over
    ``rows`` keys, and one copy of the K/V it reads, as a strided view may need)."""
    a = model.args
    heads, kv = a.num_attention_heads, a.num_key_value_heads
    per_row = (4 * a.hidden_size + 3 * a.intermediate_size + (heads + 2 * kv) * a.head_dim
               + 2 * a.vocab_size) * 4
    attention = heads * rows * 4 + 2 * rows * kv * a.head_dim * kv_itemsize
    return 2 * b * (per_row + attention)


def decode_main(args, model) -> Dict[str, Any]:
    limit = max_positions(model, args)
    weights = [v for _, v in tree_flatten(model.parameters())]
    weight_bytes = sum(w.nbytes for w in weights)
    steps = args.warmup + args.blocks * args.steps
    systems = tuple(args.systems)
    rows, mem, results = [], [], []
    cells = []
    for context in args.contexts:
        fill = filled(context, steps, limit)
        for b in args.batches:
            lengths = spread(fill, b, args.lengths_from)
            cells.append((context, fill, b, lengths))
            if len(set(lengths)) > 1:  # beside it: the same total rows at equal lengths
                mean = sum(lengths) // b
                cells.append((context, fill, b, [mean] * b))
    for context, fill, b, lengths in cells:
        slot = footprint(model, fill + steps)
        caches: Dict[str, List[Any]] = {}
        for s in H.order(b + context, systems):
            caches[s] = batch(model, s, fill, fill + steps, b, args, lengths)
            H.settle()
            decode(model, caches[s], b, args.warmup)
        H.settle()
        if "muser-kv" in caches:  # views made per pass: a view held would keep the
            ours = caches["muser-kv"]  # planes from being updated in place

            def reads(ours=ours) -> List[mx.array]:
                return weights + live_kv(ours)
        else:  # as many bytes as the live rows, in one buffer
            rows_kv = [mx.zeros((max(1, sum(_live_kv_bytes(model, n) for n in lengths) // 2),),
                                mx.bfloat16)]
            mx.eval(rows_kv)

            def reads(rows_kv=rows_kv) -> List[mx.array]:
                return weights + rows_kv
        kv_bytes = sum(x.nbytes for x in reads()) - weight_bytes
        floor_pass(reads, 1)  # compiled and warm

        def run(s: str, i: int, c=caches, b=b, reads=reads) -> Dict[str, float]:
            if s == FLOOR:
                return floor_pass(reads, args.floor_repeats)
            return block(model, c, b, args, s, i)

        blocks = H.alternate(args.blocks, run, systems=systems + (FLOOR,), first=b + context)
        floor_ms = H.median([x["ms"] for x in blocks[FLOOR]])
        cell: Dict[str, Any] = {}
        for s in systems:
            tok_s = H.median([x["tok_s"] for x in blocks[s]])
            cell[s] = {"tok_s": tok_s, "block_tok_s": [x["tok_s"] for x in blocks[s]],
                       "ms_per_step": 1e3 * b / tok_s, "of_floor": floor_ms * tok_s / (1e3 * b),
                       "peak_bytes": max(x["peak"] for x in blocks[s]),
                       "cache_bytes": sum(c.nbytes for c in caches[s])}
        del caches
        H.settle()
        act = activations(model, b, fill + steps, H.DTYPES[args.dtype].size)

        def get(s: str, k: str, cell=cell) -> float:
            return cell[s][k] if s in cell else float("nan")
        bytes_ms = 1e3 * (weight_bytes + kv_bytes) / args.bandwidth
        rows.append([context, "/".join(map(str, sorted(set(lengths)))) if len(set(lengths)) < 4
                     else f"{min(lengths)}..{max(lengths)}", b, get("muser-kv", "tok_s"), get("mlx-lm", "tok_s"),
                     get("muser-kv", "tok_s") / get("mlx-lm", "tok_s"),
                     get("muser-kv", "ms_per_step"), get("mlx-lm", "ms_per_step"), floor_ms,
                     get("muser-kv", "of_floor"), get("mlx-lm", "of_floor"), bytes_ms,
                     bytes_ms / get("muser-kv", "ms_per_step"),
                     bytes_ms / get("mlx-lm", "ms_per_step")])
        bound = b * slot + act
        peak = get("muser-kv", "peak_bytes")
        mem.append([context, b, peak / H.GIB, b * slot / H.GIB, act / H.GIB, bound / H.GIB,
                    "-" if peak != peak else ("yes" if peak <= bound else "NO"),
                    get("mlx-lm", "peak_bytes") / H.GIB])
        print("cell: " + " | ".join(f"{x:.4g}" if isinstance(x, float) else str(x)
                                    for x in rows[-1] + mem[-1][2:]), flush=True)
        results.append({"context": context, "filled": fill, "lengths": lengths, "batch": b,
                        "systems": cell,
                        "floor_ms": floor_ms, "floor_bytes": weight_bytes + kv_bytes,
                        "bytes_floor_ms": bytes_ms, "bandwidth": args.bandwidth,
                        "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                        "footprint_bytes": b * slot, "activation_bytes": act})
    print()
    H.table(["context", "lengths", "B", "muser-kv tok/s", "mlx-lm tok/s", "muser / mlx-lm",
             "muser ms/step", "mlx-lm ms/step", "pass ms", "muser of pass", "mlx-lm of pass",
             "bytes ms", "muser of bytes", "mlx-lm of bytes"],
            rows, note="tok/s: aggregate over the batch, median block; filled: where decode began "
                       "(the steps end at or below max_position_embeddings); pass: one pass "
                       "summing every weight and every live K/V row of the batch, median, in the "
                       "same alternation (MLX's reduction reads slower than its matmuls, and a "
                       "batch's strided views slower still: from B = 16 at 131k it outlasts the "
                       "step, and is no floor there); bytes: the same bytes at --bandwidth; "
                       "of X = X ms / step ms (1.0: at it)")
    H.table(["context", "B", "muser-kv peak GiB", "B x footprint GiB", "activations GiB",
             "bound GiB", "peak <= bound", "mlx-lm peak GiB"], mem, digits=3,
            note="peak: peak memory during the timed decode above everything but the system's "
                 "own batch, plus that batch; bound = B x footprint (the batch's preallocated "
                 "planes) + activations (an upper estimate of two pipelined steps')")
    return {"benchmark": "batched", "args": vars(args), "results": results}


def _live_kv_bytes(model, fill: int) -> int:
    """One sequence's live K/V bytes at ``fill`` tokens (muser-kv's planes' rows)."""
    single = muser_kv.make_prompt_cache(model, max_context=fill + 1)
    total = 0
    for c in single:
        rows = min(fill, c.capacity)
        total += 2 * rows * c.kv_heads * c.head_dim * c.dtype.size
    return total


# -- --generator: BatchGenerator end to end ------------------------------------------------


def generate(model, system: str, prompts: List[List[int]], args) -> Dict[str, float]:
    """One BatchGenerator run over ``prompts``: prefill to every first token, decode tok/s."""
    b = len(prompts)
    caches = None
    own = 0
    if system == "muser-kv":
        context = args.list_context or len(prompts[0]) + args.tokens
        caches = [muser_kv.make_prompt_cache(model, max_context=context, batch_slots=b,
                                             sliding_layout=args.sliding_layout)
                  for _ in prompts]
        mx.eval([c.state for cache in caches for c in cache])
        own = sum(c.nbytes for cache in caches for c in cache)
    with H.PeakProbe() as probe:
        gen = BatchGenerator(model, max_tokens=args.tokens, completion_batch_size=b,
                             prefill_batch_size=b, prefill_step_size=args.prefill_step)
        t0 = H.now()
        gen.insert(prompts, [args.tokens] * b, caches=caches)
        counts: Dict[int, int] = {}
        first = None
        while responses := gen.next_generated():
            for r in responses:
                counts[r.uid] = counts.get(r.uid, 0) + 1
            if first is None and len(counts) == b:
                first = H.now()
        end = H.now()
        gen.close()
    decoded = sum(counts.values()) - b
    first = first or end
    return {"prefill_s": first - t0, "decode_tok_s": decoded / (end - first) if end > first
            else float("nan"), "peak": probe.extra + own}


def generator_main(args, model) -> Dict[str, Any]:
    limit = max_positions(model, args)
    rng = np.random.default_rng(args.seed)
    rows, results = [], []
    for length in args.prompt:
        prompt = filled(length, args.tokens, limit)
        for b in args.batches:
            if args.batch_tokens is not None and b * prompt > args.batch_tokens:
                print(f"skipped: B = {b} x {prompt} tokens > --batch-tokens {args.batch_tokens}")
                continue
            prompts = [rng.integers(0, model.args.vocab_size, prompt).tolist() for _ in range(b)]
            for s in args.systems:  # warm: compiled, untimed
                generate(model, s, [p[:args.prefill_step + 8] for p in prompts], args)
            H.settle()

            def runs(s: str, _i: int, p=prompts) -> Dict[str, float]:
                return generate(model, s, p, args)

            blocks = H.alternate(args.blocks, runs, systems=tuple(args.systems), first=b)
            cell = {s: {k: [x[k] for x in blocks[s]] for k in ("prefill_s", "decode_tok_s", "peak")}
                    for s in args.systems}
            for s in args.systems:
                rows.append([b, prompt, s, " / ".join(f"{x:.2f}" for x in cell[s]["prefill_s"]),
                             " / ".join(f"{x:.1f}" for x in cell[s]["decode_tok_s"]),
                             max(cell[s]["peak"]) / H.GIB])
            if len(args.systems) == 2:
                ours, theirs = cell["muser-kv"], cell["mlx-lm"]
                rows.append([b, prompt, "muser / mlx-lm",
                             f"{H.median(theirs['prefill_s']) / H.median(ours['prefill_s']):.3f}x",
                             f"{H.median(ours['decode_tok_s']) / H.median(theirs['decode_tok_s']):.3f}x",
                             float("nan")])
            print("cell: " + " | ".join(str(x) for x in rows[-1]), flush=True)
            results.append({"batch": b, "prompt": prompt, "systems": cell})
    print()
    H.table(["B", "prompt", "system", "prefill+first s (by run)", "decode tok/s (by run)",
             "peak GiB"], rows,
            note="BatchGenerator over B prompts (prefill_batch_size = completion_batch_size = B): "
                 "prefill to every sequence's first token, aggregate decode tok/s of the rest; "
                 "peak above what was held before, muser-kv's lists' planes included; "
                 "ratios of the medians (above 1: muser-kv faster)")
    return {"benchmark": "batched_generator", "args": vars(args), "results": results}


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    what = "BatchGenerator end to end" if args.generator else "batched decode against the floor"
    H.print_header(f"{what}: aggregate tok/s, muser-kv's batch vs mlx-lm's batch caches, "
                   f"{args.family}", args)
    model = build(args)
    print(H.describe(model))
    payload = generator_main(args, model) if args.generator else decode_main(args, model)
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
