"""Greedy decode through a random-weight Muse-Glimmer-shaped model on muser-kv's caches.

Builds mlx-lm's own ``muse_glimmer.Model`` with the real KV geometry (2 KV heads
x 128, sliding RoPE layers with global NoPE layers at ``i % 4 == 3``) and a small
hidden size, prefills a seeded random prompt that crosses the sliding window,
and decodes greedily with mlx-lm's ``generate_step`` -- the real client -- using
``muser_kv.make_prompt_cache`` as the prompt cache. It prints prefill and decode
speed, the generated token ids, the bytes the cache holds (sliding rings,
preallocated, plus global planes, which grow with the sequence) beside the
bytes a preallocated list would take (the footprint formula), and the ring
state of one sliding and one global layer. ``--compare`` repeats the run on
mlx-lm's own caches (``model.make_cache()``) and prints the speed ratio and
whether the greedy tokens are identical, and where they first differ, how far
apart mlx-lm scores the two tokens (a report, not a check: past the wrap
mlx-lm's rotating cache may hold its rows at another rotation, attention sums
them in that order, and a near tie of random weights can break either way).

No tokenizer and no downloads: the weights are random and the prompt is random
token ids, so the generated ids carry no meaning; what matters is that both
caches hold the same rows and give the same ones.

The defaults keep all 52 layers but scale the real walk (2048 window, 512-token
prefill chunks, a 2600-token prompt) by 1/16 -- window 128, chunk 32, prompt
160 -- because attention over 2048 rows in 52 layers takes minutes on a small
CPU. The prompt still crosses the window, so one prefill chunk wraps the rings
and every decode step writes over the oldest row. The real window, on fewer
layers and query heads::

    .venv/bin/python examples/decode.py --layers 4 --heads 2 --window 2048 --prompt 2600 --chunk 512

Exit status 0 when the cache holds what its contract says, else 1 (each
failed check printed on stderr): every layer at the position after the last
token; every sliding ring holding the last ``min(window, positions)`` positions,
its oldest at physical row ``origin_logical % capacity``; every global plane
holding every position from 0; the rings' bytes exactly the footprint
formula's sliding part; every global plane's allocation holding its rows and
no more than the preallocated plane's.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.muse_glimmer import Model, ModelArgs
from tqdm import tqdm

import muser_kv

DTYPES = {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.bfloat16}

#: Muse Glimmer's KV geometry, kept as is: it is what the cache is built for.
KV_HEADS = 2
HEAD_DIM = 128
#: Glimmer's intermediate_size / hidden_size (19968 / 6656).
MLP_RATIO = 3
#: How many generated ids the report prints.
SHOW_TOKENS = 16


@dataclass
class DecodeRun:
    """One prefill + greedy decode: the generated ids and where the time went."""

    label: str
    tokens: List[int]
    logprobs: List[mx.array]  # one [vocab] vector per generated token
    prompt_len: int
    prefill_s: float  # start -> first generated token (the whole prompt is in the cache)
    decode_s: float  # first generated token -> last one

    @property
    def prefill_tps(self) -> float:
        return self.prompt_len / self.prefill_s

    @property
    def decode_tps(self) -> float:
        # The first token comes out of the prefill; the rest are decode steps.
        return (len(self.tokens) - 1) / self.decode_s

    def line(self) -> str:
        return (
            f"{self.label:<9} prefill {self.prompt_len:>6,} tok {self.prefill_s:7.2f} s "
            f"{self.prefill_tps:8.1f} tok/s | decode {len(self.tokens):>4} tok "
            f"{self.decode_s:6.2f} s {self.decode_tps:7.1f} tok/s"
        )


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=52,
                   help="decoder layers (Muse Glimmer's 52: 39 sliding RoPE, 13 global NoPE)")
    p.add_argument("--hidden", type=int, default=64,
                   help="hidden size (Muse Glimmer's is 6656); the MLP is 3x this, as in Glimmer")
    p.add_argument("--heads", type=int, default=4,
                   help=f"query heads, a multiple of {KV_HEADS} (Muse Glimmer has 32; few keep "
                        f"CPU attention cheap; the KV geometry is always {KV_HEADS} x {HEAD_DIM})")
    p.add_argument("--vocab", type=int, default=202048,
                   help="vocabulary size (Muse Glimmer's; only the embedding and the output "
                        "head depend on it)")
    p.add_argument("--window", type=int, default=128,
                   help="sliding window = ring capacity. Muse Glimmer's is 2048; the default "
                        "run is its 2048 / 512 / 2600 walk scaled by 1/16 to fit a CPU")
    p.add_argument("--prompt", type=int, default=160,
                   help="prompt length in tokens; keep it above --window so the rings wrap "
                        "during the prefill")
    p.add_argument("--tokens", type=int, default=32, help="tokens to decode (at least 2)")
    p.add_argument("--chunk", type=int, default=32,
                   help="prefill chunk, generate_step's prefill_step_size (window / 4, as "
                        "512 is for the real 2048 window)")
    p.add_argument("--max-context", type=int, default=8192,
                   help="positions the cache is built for: the NoPE planes grow up to this "
                        "many rows; a preallocated list takes them all at once (the model's "
                        "own is 131072: 1.83 GB of KV for 52 layers)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the prompt")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                   help="model dtype (muser-kv's planes are float16 whatever this is, so "
                        "only float16 stores the same K/V bits as mlx-lm's caches)")
    p.add_argument("--compare", action="store_true",
                   help="also run on mlx-lm's own caches; print the speed ratio and "
                        "whether the tokens match")
    ns = p.parse_args(argv)
    for name in ("layers", "hidden", "heads", "vocab", "window", "prompt", "chunk", "max_context"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if ns.heads % KV_HEADS:
        p.error(f"--heads must be a multiple of the {KV_HEADS} KV heads, got {ns.heads}")
    if ns.tokens < 2:
        p.error("--tokens must be at least 2 (the first comes out of the prefill)")
    if ns.prompt + ns.tokens > ns.max_context:
        p.error(f"--prompt + --tokens ({ns.prompt + ns.tokens}) exceeds --max-context "
                f"({ns.max_context}); the cache refuses writes past it")
    return ns


def build_model(ns: argparse.Namespace) -> Model:
    """mlx-lm's Muse Glimmer with random weights, the real KV geometry, small elsewhere."""
    args = ModelArgs(
        hidden_size=ns.hidden,
        num_hidden_layers=ns.layers,
        intermediate_size=MLP_RATIO * ns.hidden,
        num_attention_heads=ns.heads,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=ns.vocab,
        sliding_window=ns.window,
    )
    if ns.max_context > args.max_position_embeddings:
        raise SystemExit(
            f"--max-context {ns.max_context} exceeds the model's "
            f"max_position_embeddings {args.max_position_embeddings}"
        )
    mx.random.seed(ns.seed)
    model = Model(args)
    model.set_dtype(DTYPES[ns.dtype])
    mx.eval(model.parameters())
    return model


def decode(model: Model, cache: list, prompt: mx.array, ns: argparse.Namespace,
           label: str) -> DecodeRun:
    """Prefill ``prompt`` in ``ns.chunk``-token steps, then decode ``ns.tokens``
    tokens greedily, all through mlx-lm's ``generate_step``. Two progress bars,
    each for what it names: the prefill bar counts prompt tokens and closes when
    the first token comes out (the whole prompt is in the cache then), the decode
    bar counts generated tokens from there."""
    total = prompt.size
    prefill = tqdm(total=total, desc=f"prefill ({label})", unit="tok", leave=False)
    decoding: Optional[tqdm] = None

    def progress(done: int, _total: int) -> None:
        if decoding is None:
            prefill.update(done - prefill.n)

    tokens: List[int] = []
    logprobs: List[mx.array] = []
    stamps: List[float] = []
    try:
        start = time.perf_counter()
        for token, lp in generate_step(
            prompt, model, prompt_cache=cache, max_tokens=ns.tokens,
            prefill_step_size=ns.chunk, prompt_progress_callback=progress,
        ):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            logprobs.append(lp)
            if decoding is None:  # the first token: the prefill is done
                prefill.update(total - prefill.n)
                prefill.close()
                decoding = tqdm(total=ns.tokens, desc=f"decode ({label})", unit="tok",
                                leave=False)
            decoding.update(1)
    finally:
        prefill.close()
        if decoding is not None:
            decoding.close()
    mx.eval([c.state for c in cache])
    return DecodeRun(label, tokens, logprobs, total, stamps[0] - start, stamps[-1] - stamps[0])


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where ``a`` and ``b`` differ (or where one ends), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_tokens(ours: DecodeRun, theirs: DecodeRun) -> str:
    """The report line on whether both runs generated the same ids.

    Up to the first difference both runs saw the same inputs, so their
    log-probabilities are comparable there; after it they are not.
    """
    diff = first_difference(ours.tokens, theirs.tokens)
    shared = min(len(ours.tokens), len(theirs.tokens))
    if diff is not None:
        shared = min(diff + 1, shared)
    drift = max(
        (float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
         for a, b in zip(ours.logprobs[:shared], theirs.logprobs[:shared])),
        default=0.0,
    )
    detail = f"max |logprob difference| over {shared} comparable steps {drift:.4g}"
    if diff is None:
        return f"tokens match mlx-lm: True ({len(ours.tokens)} of {len(theirs.tokens)}; {detail})"
    if diff >= min(len(ours.tokens), len(theirs.tokens)):
        return (f"tokens match mlx-lm: False (first difference at index {diff}: "
                f"{len(ours.tokens)} vs {len(theirs.tokens)} tokens; {detail})")
    a, b = ours.tokens[diff], theirs.tokens[diff]
    lp = theirs.logprobs[diff].astype(mx.float32)
    gap = float(lp[b] - lp[a])
    return (f"tokens match mlx-lm: False (first difference at index {diff}: muser-kv {a}, "
            f"mlx-lm {b}; mlx-lm scores them {gap:.4g} apart in log-probability; {detail})")


def ring_line(cache: Sequence[muser_kv.MuseKVCache], kind: muser_kv.LayerKind, name: str) -> str:
    layer = next((c for c in cache if c.kind is kind), None)
    if layer is None:
        return f"{name} layer: none in this model"
    r = layer.ring
    return (
        f"{name} layer {layer.layer} ring: capacity={r.capacity} len={r.len} "
        f"origin_logical={r.origin_logical} origin_physical={r.origin_physical}"
    )


def held_line(cache: Sequence[muser_kv.MuseKVCache], geometry: muser_kv.MuseGeometry,
              max_context: int) -> str:
    """The bytes the list holds, by kind, beside what a preallocated list takes."""
    rings = [c for c in cache if c.kind is muser_kv.LayerKind.SLIDING]
    planes = [c for c in cache if c.kind is muser_kv.LayerKind.GLOBAL]
    row = geometry.kind_row_bytes(muser_kv.LayerKind.GLOBAL)
    rows = sorted({c.nbytes // row for c in planes})
    held = sum(c.nbytes for c in cache)
    preallocated = muser_kv.footprint(geometry, max_context).slot_bytes
    grown = (f" + {len(planes)} global planes {sum(c.nbytes for c in planes):,} B (growing: "
             f"{' / '.join(f'{r:,}' for r in rows)} rows allocated for "
             f"{max((c.offset for c in planes), default=0):,} held)") if planes else ""
    return (f"cache bytes held: {held:,} B = {len(rings)} sliding rings "
            f"{sum(c.nbytes for c in rings):,} B (preallocated){grown}\n"
            f"a preallocated list would take: {preallocated:,} B "
            f"(footprint(geometry, {max_context}).slot_bytes; make_prompt_cache(..., "
            "preallocate=True))")


def contract_failures(cache: Sequence[muser_kv.MuseKVCache], geometry: muser_kv.MuseGeometry,
                      max_context: int, positions: int) -> List[str]:
    """What the cache holds against its contract, after ``positions`` tokens
    went through it: an empty list when every check holds."""
    failed = []
    kinds = muser_kv.LayerKind
    fp = muser_kv.footprint(geometry, max_context)
    for c in cache:
        r = c.ring
        if c.offset != positions:
            failed.append(f"layer {c.layer} is at position {c.offset}, expected {positions}")
        if c.kind is kinds.SLIDING:
            name, held = "sliding", min(geometry.window, positions)
            want = (held, positions - held, (positions - held) % r.capacity)
        else:
            name, want = "global", (positions, 0, 0)
        got = (r.len, r.origin_logical, r.origin_physical)
        if got != want:
            failed.append(f"{name} layer {c.layer} ring (len, origin_logical, "
                          f"origin_physical) = {got}, expected {want}")
    rings = sum(c.nbytes for c in cache if c.kind is kinds.SLIDING)
    if rings != fp.swa_bytes:
        failed.append(f"sliding rings hold {rings:,} B, the footprint formula's sliding part "
                      f"is {fp.swa_bytes:,} B")
    row = geometry.kind_row_bytes(kinds.GLOBAL)
    most = fp.nope_bytes // max(geometry.global_layers, 1)  # one preallocated global plane
    for c in cache:
        if c.kind is kinds.GLOBAL and not c.ring.len * row <= c.nbytes <= most:
            failed.append(f"global layer {c.layer} allocates {c.nbytes:,} B for {c.ring.len} "
                          f"rows of {row} B: expected at least those rows, at most the "
                          f"preallocated plane's {most:,} B")
    return failed


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = parse_args(argv)

    t = time.perf_counter()
    model = build_model(ns)
    geometry = muser_kv.MuseGeometry.from_model_args(model.args, ns.max_context)
    prompt = mx.array(np.random.default_rng(ns.seed).integers(0, ns.vocab, ns.prompt), mx.int32)
    print(
        f"model: mlx-lm muse_glimmer, random weights, {ns.dtype}: {geometry.num_layers} layers "
        f"({geometry.sliding_layers} sliding RoPE, {geometry.global_layers} global NoPE), "
        f"hidden {ns.hidden}, {ns.heads} query / {geometry.kv_heads} KV heads x "
        f"{geometry.head_dim}, vocab {ns.vocab:,}, window {geometry.window} "
        f"(built in {time.perf_counter() - t:.1f} s)"
    )
    wraps = "crosses" if ns.prompt > ns.window else "does NOT cross"
    print(
        f"prompt: {ns.prompt:,} random ids (seed {ns.seed}, {wraps} the window), "
        f"prefill chunk {ns.chunk}, decode {ns.tokens}, max_context {ns.max_context:,}"
    )

    cache = muser_kv.make_prompt_cache(model, max_context=ns.max_context)
    ours = decode(model, cache, prompt, ns, "muser-kv")
    print(ours.line())
    print(f"tokens (first {min(SHOW_TOKENS, len(ours.tokens))} of {len(ours.tokens)}): "
          f"{ours.tokens[:SHOW_TOKENS]}")

    print(held_line(cache, geometry, ns.max_context))
    print(ring_line(cache, muser_kv.LayerKind.SLIDING, "sliding"))
    print(ring_line(cache, muser_kv.LayerKind.GLOBAL, "global"))
    failed = contract_failures(cache, geometry, ns.max_context, ns.prompt + ns.tokens)
    print(f"cache contract (positions, rings, bytes): {'FAILED' if failed else 'holds'}")
    for line in failed:
        print(f"  {line}", file=sys.stderr)

    if ns.compare:
        del cache
        mx.clear_cache()
        theirs = decode(model, model.make_cache(), prompt, ns, "mlx-lm")
        print(theirs.line())
        prefill = ours.prefill_tps / theirs.prefill_tps
        decoded = ours.decode_tps / theirs.decode_tps
        print(f"speed ratio muser-kv / mlx-lm: prefill {prefill:.2f}x, decode {decoded:.2f}x")
        print(compare_tokens(ours, theirs))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
