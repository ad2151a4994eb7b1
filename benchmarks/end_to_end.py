"""End to end on mlx-lm's real Muse Glimmer: what a user feels, muser-kv against mlx-lm.

The question: with a real model, through mlx-lm's own ``generate_step``, does
``muser_kv.make_prompt_cache(model)`` cost anything against ``model.make_cache()``
-- time to first token, decode tokens/s, peak memory -- for f16 and bf16
checkpoints and long prompts?

The model is ``muse_glimmer.Model(ModelArgs(...))`` with random weights, at the
real geometry by default (hidden 6656, 52 layers, vocab 202,048: about 17 GB in
2-byte weights), cast to each ``--dtypes`` in turn (one model at a time). Per
prompt length, both systems run the same random prompt, alternating which goes
first; each builds its cache before the clock starts (muser-kv's planes are
preallocated there: ``--max-context``, default the model's 131,072), then
``generate_step`` prefills in ``--prefill-step`` chunks (mlx-lm's default 2,048)
and decodes ``--tokens`` more tokens.

Per prompt, each system prefills (timed to its first token: TTFT; its peak
memory above everything else held then, plus its own preallocated planes:
"prefill peak"), both generators are kept, and decode is then timed in
``--blocks`` alternating blocks of ``--tokens`` tokens per system, so clock and
thermal drift fall on both alike (decode on this machine moves by +-15% from
one minute to the next). Printed: TTFT, decode tok/s (all blocks), peak, cache
bytes at the end, and the checks: decode ratio (muser-kv / mlx-lm tok/s), and
the peak difference against the difference in cache bytes (what muser-kv
preallocates beyond what mlx-lm has grown to). Greedy tokens are compared too;
with random weights near-ties make exact equality a weak signal at this size,
so the first differing index is printed, not asserted.

    python benchmarks/end_to_end.py                                   # H200: 8k, 32k, 130k; f16, bf16
    python benchmarks/end_to_end.py --dtypes bfloat16 --prompts 130000 --tokens 128 --blocks 4
    .venv/bin/python benchmarks/end_to_end.py --layers 8 --hidden 256 --intermediate 512 \\
        --vocab 1024 --heads 4 --window 256 --prompts 1000,3000 --tokens 16      # CPU, reduced
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    DTYPES,
    int_list,
    now,
    print_header,
    print_table,
    settle,
    str_list,
    write_json,
)
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import muse_glimmer  # noqa: E402
from tqdm import tqdm  # noqa: E402

import muser_kv  # noqa: E402

GIB = 1 << 30
SYSTEMS = ("muser-kv", "mlx-lm")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", type=str_list, default=["float16", "bfloat16"],
                   help="model dtypes, one model each (default float16,bfloat16)")
    p.add_argument("--prompts", type=int_list, default=[8192, 32768, 130000],
                   help="prompt lengths (default 8192,32768,130000)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per decode block (default 64)")
    p.add_argument("--blocks", type=int, default=3,
                   help="alternating decode blocks per system (default 3)")
    p.add_argument("--prefill-step", type=int, default=2048,
                   help="generate_step's prefill_step_size (default 2048, mlx-lm's)")
    p.add_argument("--max-context", type=int, default=None,
                   help="muser-kv's max_context (default: the model's max_position_embeddings)")
    p.add_argument("--warmup", type=int, default=None,
                   help="an untimed run per system and dtype first, of this many prompt tokens "
                        "(default: window + 2 prefill steps, so every prefill path -- in place "
                        "and across the wrap -- and decode are compiled before timing; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE")
    add_geometry_flags(p)
    args = p.parse_args(argv)
    for d in args.dtypes:
        if d not in ("float16", "bfloat16", "float32"):
            p.error(f"unknown dtype {d!r}")
    if args.warmup is None:
        args.warmup = (args.window or muse_glimmer.ModelArgs().sliding_window) + 2 * args.prefill_step
    return args


def add_geometry_flags(p: argparse.ArgumentParser) -> None:
    """The model's geometry (what ``build_model`` reads), defaults the real Muse Glimmer's."""
    g = p.add_argument_group("model geometry (defaults: the real Muse Glimmer)")
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--hidden", type=int, default=None)
    g.add_argument("--intermediate", type=int, default=None)
    g.add_argument("--vocab", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--window", type=int, default=None)
    g.add_argument("--max-position", type=int, default=None)


def build_model(args: argparse.Namespace, dtype: str) -> muse_glimmer.Model:
    overrides = {"num_hidden_layers": args.layers, "hidden_size": args.hidden,
                 "intermediate_size": args.intermediate, "vocab_size": args.vocab,
                 "num_attention_heads": args.heads, "sliding_window": args.window,
                 "max_position_embeddings": args.max_position}
    model_args = muse_glimmer.ModelArgs(**{k: v for k, v in overrides.items() if v is not None})
    mx.random.seed(args.seed)
    model = muse_glimmer.Model(model_args)
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    return model


def weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def make_cache(system: str, model, args) -> List[Any]:
    if system == "muser-kv":
        return muser_kv.make_prompt_cache(model, max_context=args.max_context)
    return model.make_cache()


class Run:
    """One system's generation over one prompt: prefill to the first token, then
    decode blocks on demand (the generator and its cache are kept in between)."""

    def __init__(self, system: str, model, prompt: mx.array, args):
        self.system = system
        self.cache = make_cache(system, model, args)
        mx.eval([c.state for c in self.cache if system == "muser-kv"])
        settle()
        own = sum(c.nbytes for c in self.cache)  # preallocated planes (0 for mlx-lm)
        base = mx.get_active_memory() - own  # weights, and whatever else is held now
        mx.reset_peak_memory()
        total = args.tokens * args.blocks + 1
        t0 = now()
        self.gen = generate_step(prompt, model, prompt_cache=self.cache, max_tokens=total,
                                 prefill_step_size=args.prefill_step)
        self.tokens = [int(next(self.gen)[0])]
        self.ttft = now() - t0
        self.peak = mx.get_peak_memory() - base
        self.decode_s = 0.0

    def decode(self, n: int, progress: Optional[tqdm] = None) -> None:
        t0 = now()
        for _ in range(n):
            self.tokens.append(int(next(self.gen)[0]))
            if progress is not None:
                progress.update(1)
        self.decode_s += now() - t0

    def result(self) -> Dict[str, Any]:
        return {
            "system": self.system, "ttft_s": self.ttft,
            "decode_tok_s": (len(self.tokens) - 1) / self.decode_s if self.decode_s else float("nan"),
            "prefill_peak_bytes": self.peak, "cache_bytes": sum(c.nbytes for c in self.cache),
            "tokens": self.tokens,
            "plane_dtype": str(self.cache[0].dtype) if self.system == "muser-kv" else None,
        }


def first_difference(a: List[int], b: List[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    print_header("end to end: mlx-lm generate_step on Muse Glimmer, muser-kv vs model.make_cache()",
                 args)
    rng = np.random.default_rng(args.seed)
    results: List[Dict[str, Any]] = []
    rows, checks = [], []
    for dtype in args.dtypes:
        t = now()
        model = build_model(args, dtype)
        weights = weight_bytes(model)
        vocab = model.args.vocab_size
        print(f"{dtype}: {model.args.num_hidden_layers} layers, hidden {model.args.hidden_size}, "
              f"vocab {vocab}: {weights / GIB:.2f} GiB of weights, built in {now() - t:.1f} s; "
              f"muser-kv planes {muser_kv.plane_dtype_for(model)}")
        if args.warmup:
            warm = mx.array(rng.integers(0, vocab, args.warmup), mx.uint32)
            for s in SYSTEMS:
                w = Run(s, model, warm, args)
                w.decode(2)
                del w
        total = len(args.prompts) * len(SYSTEMS) * args.tokens * args.blocks
        with tqdm(total=total, desc=f"{dtype} decode", unit="tok", file=sys.stderr) as bar:
            for i, n in enumerate(args.prompts):
                prompt = mx.array(rng.integers(0, vocab, n), mx.uint32)
                order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
                runs = {}
                for s in order:
                    bar.set_postfix_str(f"prompt {n}: {s} prefill")
                    runs[s] = Run(s, model, prompt, args)
                for blk in range(args.blocks):
                    for s in (order if blk % 2 == 0 else order[::-1]):
                        bar.set_postfix_str(f"prompt {n}: {s} decode")
                        runs[s].decode(args.tokens, bar)
                med = {}
                for s in SYSTEMS:
                    out = runs[s].result()
                    out.update(dtype=dtype, prompt=n)
                    results.append(out)
                    med[s] = out
                    rows.append([dtype, n, s, out["ttft_s"], out["decode_tok_s"],
                                 out["prefill_peak_bytes"] / GIB, out["cache_bytes"] / GIB])
                del runs
                settle()
                ours, theirs = med["muser-kv"], med["mlx-lm"]
                peak_diff = ours["prefill_peak_bytes"] - theirs["prefill_peak_bytes"]
                cache_diff = ours["cache_bytes"] - theirs["cache_bytes"]
                checks.append([dtype, n, ours["decode_tok_s"] / theirs["decode_tok_s"],
                               theirs["ttft_s"] / ours["ttft_s"], peak_diff / GIB,
                               cache_diff / GIB, "yes" if peak_diff <= cache_diff else "NO",
                               first_difference(ours["tokens"], theirs["tokens"])])
        del model
        settle()
    print()
    print_table(["dtype", "prompt", "cache", "TTFT s", "decode tok/s", "prefill peak GiB",
                 "cache GiB"], rows, digits=3)
    print("prefill peak: peak memory during the prefill above everything else held then, "
          "plus the system's own preallocated planes (its cache, activations and temporaries)")
    print()
    print_table(["dtype", "prompt", "decode muser/mlx-lm", "TTFT mlx-lm/muser", "peak diff GiB",
                 "cache diff GiB", "peak diff <= cache diff", "first token difference"],
                checks, digits=3)
    print("ratios above 1: muser-kv faster; cache diff = muser-kv's preallocated planes minus "
          "what mlx-lm's caches hold at the end; first token difference: index of the first "
          "differing greedy token (None: all equal)")
    payload = {"benchmark": "end_to_end", "args": vars(args), "results": results}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
