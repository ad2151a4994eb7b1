"""A 130,000-token session saved: how soon does load_session + the first token answer, against re-prefilling it?

Of the real Muse Glimmer (``_harness.build_model``, ``--dtype``), cold and warm,
against re-prefilling it through mlx-lm's ``generate_step``; and are the
restored planes and next log-probs bitwise the live session's? One run:

1. warm-up (untimed): a ``--warmup``-token prompt through every path below
   (prefill across the wrap, save, load, one decode step), so nothing below compiles;
2. **prefill**: ``generate_step(prompt, model, prompt_cache=make_prompt_cache(model),
   max_tokens=1)`` over ``--prompt`` random tokens, timed to the first token ``y0``
   (the cache built before the clock starts): what re-prefilling costs;
3. **save**: ``muser_kv.save_session(path, cache, model=model)`` (fsync'd, atomic);
4. **resume**, ``--repeats`` alternating blocks of one cold (the file's pages
   dropped first: ``posix_fadvise(DONTNEED)`` on that file only) and one warm
   (straight after a read of it): ``load_session(path, model)`` (every digest
   verified, every layer installed and evaluated), then the first token,
   ``generate_step(mx.array([y0]), model, prompt_cache=restored, max_tokens=1)``,
   its log-probabilities evaluated; timed as load, first token and their sum;
5. **live**: the same one-token step on the live cache: every resume's
   log-probabilities must equal its bits.

Printed: prefill TTFT, save, load, first token, load + first token and the
speed-up (prefill TTFT / (load + first token)), cold and warm, beside the
targets (load + first token < 1.0 s, >= 20x), and whether the bits matched.

    bash benchmarks/device.sh resume bfloat16                  # H200: real geometry, 130,000 tokens
    python3 benchmarks/resume.py --dtype float16 --repeats 5
    PYTHONPATH=. .venv/bin/python benchmarks/resume.py --layers 8 --hidden 256 --intermediate 512 \\
        --vocab 1024 --heads 4 --window 256 --max-position 4096 --prompt 3000 --warmup 600   # CPU
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, List, Tuple

import _harness as H
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import muser_kv

TARGET_S = 1.0  # the goal: load_session + the first token under a second ...
TARGET_X = 20.0  # ... and at least 20x sooner than the prefill


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--prompt", type=int, default=130_000, help="prompt tokens (default 130,000)")
    H.add_prefill_flags(p)
    p.add_argument("--dir", default=None, help="where the session file goes (default: a temp dir)")
    H.add_flags(p, dtype="bfloat16", blocks=("repeats", 3, "resumes, cold and warm each"))
    return H.parse(p, argv)


def first_token(prompt: mx.array, model, cache: List[Any], step: int) -> Tuple[int, mx.array]:
    """mlx-lm's ``generate_step`` to its first token: ``(token, logprobs)``, evaluated."""
    token, logprobs = next(generate_step(prompt, model, prompt_cache=cache, max_tokens=1,
                                         prefill_step_size=step))
    mx.eval(logprobs)
    return int(token), logprobs


def resume(path: str, model, y0: int, step: int) -> Dict[str, Any]:
    t0 = H.now()
    restored = muser_kv.load_session(path, model)
    t1 = H.now()
    _, logprobs = first_token(mx.array([y0]), model, restored, step)
    t2 = H.now()
    del restored
    H.settle()
    return {"load": t1 - t0, "first": t2 - t1, "logprobs": logprobs}


def same_planes(path: str, model, live: List[Any]) -> bool:
    """An untimed load's planes and rings against the live list's, bit for bit
    (reading GPU planes on the host moves them to unified memory: never in a
    timed resume)."""
    restored = muser_kv.load_session(path, model)
    same = all(np.array_equal(H.bits(a), H.bits(b)) and x.meta_state == y.meta_state
               for x, y in zip(restored, live) for a, b in zip(x.kv_state, y.kv_state))
    del restored
    H.settle()
    return same


def run(args, directory: str) -> Dict[str, Any]:
    model = H.build_model(args)
    vocab = model.args.vocab_size
    rng = np.random.default_rng(args.seed)
    path = os.path.join(directory, "session.safetensors")
    print(f"{H.describe(model)}; prompt {args.prompt:,} tokens", flush=True)

    # 1. warm-up: every path below, once
    warm = mx.array(rng.integers(0, vocab, args.warmup))
    cache = muser_kv.make_prompt_cache(model)
    y, _ = first_token(warm, model, cache, args.prefill_step)
    muser_kv.save_session(path, cache, model=model)
    resume(path, model, y, args.prefill_step)
    del cache
    H.settle()

    # 2. prefill
    prompt = mx.array(rng.integers(0, vocab, args.prompt))
    cache = muser_kv.make_prompt_cache(model)
    mx.eval([a for c in cache for a in c.kv_state])
    t0 = H.now()
    y0, _ = first_token(prompt, model, cache, args.prefill_step)
    ttft = H.now() - t0

    # 3. save
    t0 = H.now()
    muser_kv.save_session(path, cache, model=model)
    save = H.now() - t0
    size = os.path.getsize(path)

    # 4. resume, cold and warm, alternating
    def one(kind: str, _block: int) -> Dict[str, Any]:
        if kind == "cold":
            H.evict(path)
        return resume(path, model, y0, args.prefill_step)

    runs = H.alternate(args.repeats, one, ("cold", "warm"))
    planes_same = same_planes(path, model, cache)

    # 5. live
    _, live = first_token(mx.array([y0]), model, cache, args.prefill_step)
    same = {k: all(np.array_equal(H.bits(r["logprobs"]), H.bits(live)) for r in v)
            for k, v in runs.items()}
    diff = {k: max(float(mx.max(mx.abs(r["logprobs"].astype(mx.float32)
                                       - live.astype(mx.float32)))) for r in v)
            for k, v in runs.items()}
    first = runs["cold"][0]["logprobs"]
    agree = all(np.array_equal(H.bits(r["logprobs"]), H.bits(first)) for v in runs.values() for r in v)

    rows, out = [], {"prompt": args.prompt, "dtype": args.dtype, "file_bytes": size,
                     "prefill_ttft_s": ttft, "save_s": save, "resume": {}}
    for kind, rs in runs.items():
        load = H.median([r["load"] for r in rs])
        first = H.median([r["first"] for r in rs])
        total = H.median([r["load"] + r["first"] for r in rs])
        speedup = ttft / total
        out["resume"][kind] = {"load_s": load, "first_token_s": first, "total_s": total,
                               "speedup": speedup, "bitwise": same[kind],
                               "planes_bitwise": planes_same, "max_abs_diff": diff[kind],
                               "all_s": [r["load"] + r["first"] for r in rs]}
        rows.append([kind, f"{ttft:.3f}", f"{save:.3f}", f"{load:.3f}", f"{first:.3f}",
                     f"{total:.3f}", "yes" if total < TARGET_S else "NO", f"{speedup:.1f}",
                     "yes" if speedup >= TARGET_X else "NO", "yes" if planes_same else "NO",
                     "yes" if same[kind] else "NO", f"{diff[kind]:.3g}"])
    print()
    H.table(["page cache", "prefill TTFT s", "save s", "load s", "first token s",
             "load + first token s", f"< {TARGET_S:g} s", "speed-up (prefill / resume)",
             f">= {TARGET_X:g}x", "planes + rings bitwise = live", "log-probs bitwise = live",
             "max |diff| vs live"], rows,
            title=f"session file {size / H.GB:.3f} GB; median of {args.repeats} resumes per row")
    print(f"every resume's log-probs bitwise equal to each other: {'yes' if agree else 'NO'}")
    out["resumes_agree"] = agree
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    H.print_header("resume a session: load_session + first token against re-prefilling", args)
    with tempfile.TemporaryDirectory(prefix="muser-kv-resume-", dir=args.dir) as d:
        out = run(args, d)
    H.write_json(args.json, out)
    return 0 if all(r["bitwise"] for r in out["resume"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
