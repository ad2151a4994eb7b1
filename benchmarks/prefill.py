"""What does a chunked prefill across the wrap cost, muser-kv against mlx-lm's caches, and what memory does it hold?

A ``--prompt``-token prompt (default 3 x window) in ``--chunk``-token chunks
through the K/V loop (``_harness.attend_layers``), output and every ``state``
evaluated after each chunk, as ``generate_step`` does; ``--warmup`` +
``--repeats`` whole prefills per system, alternating. Past the window, muser-kv
attends over a staging shadow (old rows in logical order + the chunk), mlx-lm's
``RotatingKVCache`` over its concatenated copy. muser-kv's planes (for
``--max-context``, default the prompt) exist before the clock starts; mlx-lm's
caches grow during the prefill.

Printed: mean ms per chunk inside the window and past it, whole-prompt ms,
``mlx-lm / muser-kv`` (> 1: muser-kv faster); the caches' bytes before and after,
the peak above what was active before, the peak above what is held at the end.

    python3 benchmarks/prefill.py                                                     # H200
    PYTHONPATH=. .venv/bin/python benchmarks/prefill.py --window 256 --chunk 64 --layers 4 \\
        --heads 8 --repeats 2                                                         # CPU
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, List

import _harness as H
import mlx.core as mx


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 3 x window)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--max-context", type=int, default=None,
                   help="muser-kv capacity (default: the prompt length)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed whole prefills per system first (default 1)")
    H.add_flags(p, H.KV, blocks=("repeats", 3, "timed prefills per system; the median"))
    H.add_cache_flags(p)
    args = H.parse(p, argv)
    args.prompt = args.prompt or 3 * args.window
    args.max_context = args.max_context or args.prompt
    if args.max_context < args.prompt:
        p.error("--max-context must be >= --prompt")
    return args


def prefill(x: mx.array, args, spans, last_h, system: str, _block: int) -> Dict[str, Any]:
    """One whole prefill through a new cache: its chunk times and memory (its last output
    in ``last_h``)."""
    caches = H.make_caches(system, args)
    before = sum(c.nbytes for c in caches)
    times = []
    with H.PeakProbe() as probe:
        for _, n in spans:
            t0 = H.now()
            h = H.attend_layers(caches, x[:, :, :n], args)
            mx.eval(h, [c.state for c in caches])
            times.append(H.now() - t0)
    assert all(c.offset == args.prompt for c in caches)
    out = {"chunk_s": times, "peak_extra_bytes": probe.extra, "cache_bytes_before": before,
           "peak_above_end_bytes": max(0, probe.peak - probe.after),
           "cache_bytes_after": sum(c.nbytes for c in caches)}
    last_h[system] = h.astype(mx.float32)
    del caches
    H.settle()
    return out


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    mx.random.seed(args.seed)
    H.print_header("prefill: chunked, across the wrap, muser-kv vs mlx-lm "
                   "(ratio = mlx-lm / muser-kv; > 1: muser-kv faster)", args)
    x = mx.random.normal((1, args.heads, args.chunk, args.head_dim)).astype(H.DTYPES[args.dtype])
    mx.eval(x)
    spans = [(s, min(args.chunk, args.prompt - s)) for s in range(0, args.prompt, args.chunk)]
    inside = [i for i, (s, n) in enumerate(spans) if s + n <= args.window]
    past = [i for i, (s, n) in enumerate(spans) if s + n > args.window]
    last_h: Dict[str, mx.array] = {}
    runs = H.alternate(args.warmup + args.repeats, partial(prefill, x, args, spans, last_h))
    runs = {s: r[args.warmup:] for s, r in runs.items()}

    def ms(s: str, idx: List[int]) -> float:
        return H.median([sum(r["chunk_s"][i] for i in idx) / len(idx) * 1e3
                         for r in runs[s]]) if idx else float("nan")

    rows = []
    for label, idx in ((f"chunks ending <= window ({len(inside)})", inside),
                       (f"chunks past the window ({len(past)})", past)):
        o, t = ms("muser-kv", idx), ms("mlx-lm", idx)
        rows.append([label, "ms/chunk", o, t, H.ratio(t, o)])
    o, t = (H.median([sum(r["chunk_s"]) * 1e3 for r in runs[s]]) for s in H.SYSTEMS)
    rows.append([f"whole prompt ({args.prompt} tokens)", "ms", o, t, H.ratio(t, o)])
    H.table(["chunks", "unit", "muser-kv", "mlx-lm", "mlx-lm / muser-kv"], rows,
            title="Prefill time (median of repeats)")
    mem_rows = [[s, runs[s][-1]["cache_bytes_before"] / H.MB, runs[s][-1]["cache_bytes_after"] / H.MB,
                 max(r["peak_extra_bytes"] for r in runs[s]) / H.MB,
                 max(r["peak_above_end_bytes"] for r in runs[s]) / H.MB] for s in H.SYSTEMS]
    H.table(["cache", "cache MiB before", "cache MiB after", "peak+ MiB", "peak above end MiB"],
            mem_rows, digits=1, title="Prefill memory (max over repeats)",
            note="peak+ = peak during the prefill - memory active before it (mlx-lm's includes its "
                 "cache growing; muser-kv's planes exist before)\npeak above end = peak - memory "
                 "active at the end (transients: shadows, concatenations, attention temporaries)")
    diff = mx.abs(last_h["muser-kv"] - last_h["mlx-lm"]).max().item()
    print(f"Same work check: max |h(muser-kv) - h(mlx-lm)| of the last chunk's output: {diff:.2e}")
    print()
    payload = {"benchmark": "prefill", "last_chunk_max_abs_diff": diff, "args": vars(args),
               "chunks": spans, "runs": runs, "inside_window_chunks": inside,
               "past_window_chunks": past}
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
