"""How long, and in how many Python calls, does the host build a batched decode step, muser-kv against mlx-lm?

Per B, each system's batch (``batched.batch``: every sequence at ``--context``
tokens of the same random K/V) decodes through mlx-lm's model. Each step's
graph is built (the model's Python, the caches' bookkeeping, the masks), timed
apart from its evaluation, then evaluated: the minimum and the median over
``--steps`` steps of each block, the blocks alternating the systems
(``_harness.alternate``). One more step runs under ``sys.setprofile``, counting
the calls into the system's cache code: every function of ``muser_kv``, or of
mlx-lm's ``models/cache.py`` and ``models/base.py`` (its caches and mask
helpers). Above 1, "mlx-lm / muser": muser-kv builds the step faster. The
build is what a pipelined decode hides behind the previous step's evaluation;
where the device step is shorter than it, it is the step.

    # CPU, the real 52 layers at small widths (about 3 minutes on two cores)
    PYTHONPATH=. .venv/bin/python benchmarks/host_step.py --hidden 128 --intermediate 256 \\
        --vocab 512 --heads 4 --kv-heads 2 --head-dim 64 --window 256 --max-position 2048 \\
        --context 1000 --batches 1,4,16
    # H200, real geometry, bf16
    python3 benchmarks/host_step.py --context 131072 --batches 1,2,8,16 --dtype bfloat16 \\
        --sliding-layout head_major --fill-chunk 16384
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import _harness as H
import batched
import mlx.core as mx

#: the files whose functions count as a system's cache code
CODE = {"muser-kv": lambda f: "/muser_kv/" in f,
        "mlx-lm": lambda f: f.endswith(("mlx_lm/models/cache.py", "mlx_lm/models/base.py"))}


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--context", type=H.one_int, default=131072,
                   help="tokens each sequence holds (default 131072)")
    p.add_argument("--batches", type=H.int_list, default=[1, 2, 8, 16],
                   help="batch sizes (default 1,2,8,16)")
    p.add_argument("--systems", type=H.choice_list(*H.SYSTEMS), default=list(H.SYSTEMS),
                   help="muser-kv,mlx-lm (default both)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per block (default 40)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    p.add_argument("--fill-chunk", type=int, default=4096)
    p.add_argument("--sliding-layout", choices=["token_major", "head_major"], default="head_major",
                   help="the sliding rings' layout (default head_major, muser-kv serve's)")
    p.add_argument("--family", choices=["muse-glimmer", *H.FAMILIES], default="muse-glimmer")
    H.add_flags(p, blocks=("blocks", 3, "timed blocks per system, alternating"))
    return H.parse(p, argv)


def calls(step: Callable[[], Any], counts: Callable[[str], bool]) -> int:
    """How many Python calls ``step`` makes into functions whose file ``counts``."""
    seen = [0]

    def profile(frame, event, _arg):
        if event == "call" and counts(frame.f_code.co_filename.replace("\\", "/")):
            seen[0] += 1

    sys.setprofile(profile)
    try:
        out = step()
    finally:
        sys.setprofile(None)
    mx.eval(out)
    return seen[0]


def measure(model, b: int, args) -> Dict[str, Dict[str, Any]]:
    limit = batched.max_positions(model, args)
    steps = args.warmup + args.blocks * args.steps + 2
    fill = batched.filled(args.context, steps, limit)
    caches = {s: batched.batch(model, s, fill, fill + steps, b, args) for s in args.systems}
    tokens = mx.zeros((b, 1), dtype=mx.uint32)

    def forward(system: str) -> mx.array:
        return mx.argmax(model(tokens, cache=caches[system])[:, -1, :], axis=-1)

    for s in args.systems:
        for _ in range(args.warmup):
            mx.eval(forward(s))
    H.settle()

    def block(system: str, _block: int) -> List[float]:
        built = []
        for _ in range(args.steps):
            mx.synchronize()
            t0 = H.now()
            y = forward(system)
            built.append(H.now() - t0)
            mx.eval(y)
        return built

    times = H.alternate(args.blocks, block, tuple(args.systems))
    out: Dict[str, Dict[str, Any]] = {}
    for s in args.systems:
        every = [t for blk in times[s] for t in blk]
        out[s] = {"B": b, "filled": fill, "min_ms": min(every) * 1e3,
                  "median_ms": H.median(every) * 1e3,
                  "calls": calls(lambda s=s: forward(s), CODE[s])}
    caches.clear()
    H.settle()
    return out


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    H.print_header(f"building one batched decode step's graph: {args.family}", args)
    model = batched.build(args)
    print(H.describe(model))
    results = [measure(model, b, args) for b in args.batches]
    columns = ["B", "filled"]
    for s in args.systems:
        columns += [f"{s} min ms", f"{s} median ms", f"{s} calls"]
    both = set(H.SYSTEMS) <= set(args.systems)
    if both:
        columns += ["mlx-lm / muser (median)", "calls muser / mlx-lm"]
    rows = []
    for r in results:
        first = r[args.systems[0]]
        row: List[Any] = [first["B"], first["filled"]]
        for s in args.systems:
            row += [r[s]["min_ms"], r[s]["median_ms"], r[s]["calls"]]
        if both:
            row += [H.ratio(r["mlx-lm"]["median_ms"], r["muser-kv"]["median_ms"]),
                    H.ratio(r["muser-kv"]["calls"], r["mlx-lm"]["calls"])]
        rows.append(row)
    print()
    H.table(columns, rows,
            title=f"one decode step's graph built on the host, {args.steps} steps x "
                  f"{args.blocks} blocks per system",
            note="min / median: the graph's build alone, evaluation apart; calls: Python calls "
                 "into the system's cache code in one step (muser_kv; mlx-lm's models/cache.py "
                 "and models/base.py)")
    payload = {"benchmark": Path(__file__).stem, "args": vars(args), "results": results}
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
