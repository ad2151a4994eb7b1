"""What TTFT, decode tok/s and peak memory does muser-kv give through generate_step on a real geometry?

For f16 and bf16 checkpoints and long prompts, through mlx-lm's own
``generate_step``: does ``muser_kv.make_prompt_cache(model)`` cost anything
against ``model.make_cache()``? One model per ``--dtypes`` (``_harness.build_model``:
real geometry by default, ~17 GB in 2-byte weights; ``--family gemma3-27b`` or
``gpt-oss-20b``: those checkpoints' shapes, random weights). Per prompt, both systems
prefill the same random prompt to their first token (TTFT; the first system
flipped per prompt), each cache built before the clock starts (muser-kv's
planes preallocated for ``--max-context``, default the model's 131,072); both
generators are kept and decode ``--blocks`` alternating blocks of ``--tokens``.

Printed: TTFT, decode tok/s (all blocks), "prefill peak" (the peak above
everything else held then, plus the system's own preallocated planes), cache
bytes at the end; the ratios (above 1: muser-kv faster), the peak difference
against the cache difference (what muser-kv preallocates beyond what mlx-lm has
grown to), and the first differing greedy token (random weights: near-ties make
equality a weak signal, so it is reported, not asserted).

    bash benchmarks/device.sh e2e bfloat16                         # H200: 8k, 32k, 130k
    python3 benchmarks/end_to_end.py --family gemma3-27b --dtypes bfloat16 --prompts 8192,32768,130000
    python3 benchmarks/end_to_end.py --dtypes bfloat16 --prompts 130000 --tokens 128 --blocks 4
    PYTHONPATH=. .venv/bin/python benchmarks/end_to_end.py --layers 2 --hidden 64 --intermediate 128 \\
        --vocab 256 --heads 4 --window 16 --prompts 100,300 --tokens 4 --blocks 2 \\
        --max-position 512 --prefill-step 32                                # CPU
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

import _harness as H
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from tqdm import tqdm


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--prompts", type=H.int_list, default=[8192, 32768, 130000],
                   help="prompt lengths (default 8192,32768,130000)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per decode block (default 64)")
    p.add_argument("--max-context", type=int, default=None,
                   help="muser-kv's max_context (default: the model's max_position_embeddings)")
    p.add_argument("--family", choices=["muse-glimmer", *H.FAMILIES], default="muse-glimmer",
                   help="the model: Muse Glimmer at the geometry flags (default), or a family "
                        "at its real checkpoint's shapes")
    H.add_prefill_flags(p)
    H.add_flags(p, dtype=None, dtypes="float16,bfloat16",
                blocks=("blocks", 3, "alternating decode blocks per system"))
    return H.parse(p, argv)


class Run:
    """One system's generation over one prompt: prefill to the first token, then
    decode blocks on demand (the generator and its cache are kept in between)."""

    def __init__(self, system: str, model, prompt: mx.array, args):
        self.system = system
        self.cache = H.prompt_cache(system, model, args.max_context)
        mx.eval([c.state for c in self.cache if system == "muser-kv"])
        own = sum(c.nbytes for c in self.cache)  # preallocated planes (0 for mlx-lm)
        with H.PeakProbe() as probe:
            t0 = H.now()
            self.gen = generate_step(prompt, model, prompt_cache=self.cache,
                                     max_tokens=args.tokens * args.blocks + 1,
                                     prefill_step_size=args.prefill_step)
            self.tokens = [int(next(self.gen)[0])]
            self.ttft = H.now() - t0
        self.peak, self.decode_s = probe.extra + own, 0.0

    def decode(self, n: int, progress: Optional[tqdm] = None) -> None:
        t0 = H.now()
        for _ in range(n):
            self.tokens.append(int(next(self.gen)[0]))
            if progress is not None:
                progress.update(1)
        self.decode_s += H.now() - t0

    def result(self) -> Dict[str, Any]:
        rate = (len(self.tokens) - 1) / self.decode_s if self.decode_s else float("nan")
        return {"system": self.system, "ttft_s": self.ttft, "decode_tok_s": rate,
                "prefill_peak_bytes": self.peak, "cache_bytes": sum(c.nbytes for c in self.cache),
                "tokens": self.tokens,
                "plane_dtype": str(self.cache[0].dtype) if self.system == "muser-kv" else None}


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    H.print_header(f"end to end: mlx-lm generate_step on {args.family}, muser-kv vs "
                   "model.make_cache()", args)
    rng = np.random.default_rng(args.seed)
    results: List[Dict[str, Any]] = []
    rows, checks = [], []
    for dtype in args.dtypes:
        t = H.now()
        if args.family == "muse-glimmer":
            model = H.build_model(args, dtype)
        else:
            model = H.build_family(args.family, dtype, args.seed)
            args.max_context = args.max_context or H.FAMILY_CONTEXT[args.family]
        vocab = model.args.vocab_size
        print(f"{H.describe(model)}; built in {H.now() - t:.1f} s")
        if args.warmup:
            warm = mx.array(rng.integers(0, vocab, args.warmup), mx.uint32)
            for s in H.SYSTEMS:
                Run(s, model, warm, args).decode(2)
        total = len(args.prompts) * len(H.SYSTEMS) * args.tokens * args.blocks
        with tqdm(total=total, desc=f"{dtype} decode", unit="tok", file=sys.stderr) as bar:
            for i, n in enumerate(args.prompts):
                prompt = mx.array(rng.integers(0, vocab, n), mx.uint32)
                runs = {s: Run(s, model, prompt, args) for s in H.order(i)}
                H.alternate(args.blocks, lambda s, _, runs=runs: runs[s].decode(args.tokens, bar),
                            first=i)
                out = {s: {**runs[s].result(), "dtype": dtype, "prompt": n} for s in H.SYSTEMS}
                del runs
                H.settle()
                for s in H.SYSTEMS:
                    results.append(out[s])
                    rows.append([dtype, n, s, out[s]["ttft_s"], out[s]["decode_tok_s"],
                                 out[s]["prefill_peak_bytes"] / H.GIB, out[s]["cache_bytes"] / H.GIB])
                ours, theirs = out["muser-kv"], out["mlx-lm"]
                peak_diff = ours["prefill_peak_bytes"] - theirs["prefill_peak_bytes"]
                cache_diff = ours["cache_bytes"] - theirs["cache_bytes"]
                checks.append([dtype, n, ours["decode_tok_s"] / theirs["decode_tok_s"],
                               theirs["ttft_s"] / ours["ttft_s"], peak_diff / H.GIB,
                               cache_diff / H.GIB, "yes" if peak_diff <= cache_diff else "NO",
                               H.first_difference(ours["tokens"], theirs["tokens"])])
        del model
        H.settle()
    print()
    H.table(["dtype", "prompt", "cache", "TTFT s", "decode tok/s", "prefill peak GiB", "cache GiB"],
            rows, digits=3, note="prefill peak: peak memory during the prefill above everything "
            "else held then, plus the system's own preallocated planes (its cache, activations "
            "and temporaries)")
    H.table(["dtype", "prompt", "decode muser/mlx-lm", "TTFT mlx-lm/muser", "peak diff GiB",
             "cache diff GiB", "peak diff <= cache diff", "first token difference"], checks,
            digits=3, note="ratios above 1: muser-kv faster; cache diff = muser-kv's preallocated "
            "planes minus what mlx-lm's caches hold at the end; first token difference: index of "
            "the first differing greedy token (None: all equal)")
    payload = {"benchmark": "end_to_end", "args": vars(args), "results": results}
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
