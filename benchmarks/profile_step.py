"""Where does a batched decode step's time go: matmuls, attention per layer kind and mask, masks, stores, host?

MLX has no per-op profiler, so each component is timed in isolation with the
shapes, dtypes and strides of the real step, synchronized (``mx.eval``), the
median of ``--repeats`` runs. Per B, the system's batch (``batched.batch``:
every sequence at ``--context`` tokens of random K/V) is decoded through
mlx-lm's model, then:

* **step**: one whole decode step, synchronous (graph built, then evaluated),
  and pipelined (``GenerationBatch``'s pattern, what ``batched.py`` times);
* **host**: building the step's graph (the model's Python, the cache's
  bookkeeping, mask construction on the host) apart from its evaluation;
* **matmuls**: every ``nn.Linear`` of the model (and a tied embedding's
  ``as_linear``) on ``[B, 1, in]`` rows, in one evaluation (MoE experts are
  not ``nn.Linear``: they fall in "rest");
* **attention**: ``mx.fast.scaled_dot_product_attention`` on the very
  arguments the step handed it (recorded during a real step), all layers of a
  kind in one evaluation, once with the mask as handed and once without any;
* **masks**: the cache's ``make_mask`` calls the model made, re-made and evaluated;
* **stores**: every layer's ``update_and_fetch`` of one token per sequence;
* **rest** = the synchronous step - (host + matmuls + attention as handed +
  masks + stores): norms, RoPE, activations, sampling, launch gaps.

The parts are measured apart, so they need not add up exactly: "sum / step"
says how near they come (near 1: the profile accounts for the step).

    # H200, real geometry, bf16 (55.7 GB of weights), 131,072 context: ~5 min for
    # B 1..32 (muser-kv; B = 32 holds 58.5 GB of K/V); split 1,2,4,8 / 16,32 if near 600 s
    python3 benchmarks/profile_step.py --context 131072 --batches 1,2,4,8,16,32 --dtype bfloat16
    python3 benchmarks/profile_step.py --context 131072 --batches 1,2,8 --systems mlx-lm --dtype bfloat16
    python3 benchmarks/profile_step.py --context 32768 --batches 1,2,4,8,16,32 --dtype bfloat16
    PYTHONPATH=. .venv/bin/python benchmarks/profile_step.py --layers 4 --hidden 128 \\
        --intermediate 256 --vocab 512 --heads 4 --window 64 --context 1000 --batches 1,2,4 \\
        --max-position 1024 --repeats 3                                          # CPU
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import _harness as H
import batched
import mlx.core as mx
import mlx.nn as nn

SLIDING, GLOBAL = "sliding", "global"


def parse_args(argv=None):
    p = H.parser(__doc__)
    p.add_argument("--context", type=H.one_int, default=131072,
                   help="tokens each sequence holds (default 131072; decode ends at or below "
                        "max_position_embeddings, as in batched.py)")
    p.add_argument("--batches", type=H.int_list, default=[1, 2, 4, 8, 16, 32],
                   help="batch sizes (default 1,2,4,8,16,32)")
    p.add_argument("--systems", type=H.choice_list(*H.SYSTEMS), default=["muser-kv"],
                   help="whose batch caches (default muser-kv)")
    p.add_argument("--repeats", type=int, default=5, help="runs per component, the median (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--fill-chunk", type=int, default=4096)
    p.add_argument("--sliding-layout", choices=["token_major", "head_major"], default="token_major",
                   help="the sliding rings' layout (default token_major)")
    p.add_argument("--family", choices=["muse-glimmer", *H.FAMILIES], default="muse-glimmer",
                   help="the model: Muse Glimmer at the geometry flags (default), or a family")
    H.add_flags(p)
    return H.parse(p, argv)


def timed(run: Callable[[], Any], repeats: int) -> float:
    """Median ms of ``mx.eval(run())`` (one untimed run first)."""
    mx.eval(run())
    times = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = H.now()
        mx.eval(run())
        times.append(H.now() - t0)
    return H.median(times) * 1e3


def kind_of(cache: Any) -> str:
    kind = getattr(cache, "kind", None)
    if kind is not None:
        return SLIDING if kind.name == "SLIDING" else GLOBAL
    return SLIDING if hasattr(cache, "max_size") else GLOBAL


def form(mask: Any) -> str:
    if mask is None or isinstance(mask, str):
        return mask or "none"
    return "bool" if mask.dtype == mx.bool_ else f"add {H.dtype_name(mask.dtype)}"


def linears(model) -> List[Tuple[nn.Module, int]]:
    """Every matmul module of a decode step with its input width."""
    out = [(m, m.weight.shape[-1]) for _, m in model.named_modules()
           if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    if not any(name.endswith("lm_head") for name, _ in model.named_modules()):
        embed = model.model.embed_tokens
        out.append((embed.as_linear, model.args.hidden_size))  # a tied embedding
    return out


def record(model, cache: List[Any], tokens: mx.array):
    """One real decode step with every SDPA call's arguments and every
    ``make_mask`` call recorded (evaluated, then handed back)."""
    calls: List[Dict[str, Any]] = []
    masks: List[Tuple[Any, tuple, dict]] = []
    sdpa = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask=None, **kw):
        calls.append({"q": q, "k": k, "v": v, "scale": scale, "mask": mask, **kw})
        return sdpa(q, k, v, scale=scale, mask=mask, **kw)

    def watch(c):
        own = c.make_mask

        def make_mask(*a, **kw):
            masks.append((c, a, kw))
            return own(*a, **kw)
        return make_mask

    for c in cache:
        c.make_mask = watch(c)
    mx.fast.scaled_dot_product_attention = spy
    try:
        out = model(tokens[:, None], cache=cache)
        mx.eval(out, [x for c in calls for x in (c["q"], c["k"], c["v"])])
    finally:
        mx.fast.scaled_dot_product_attention = sdpa
        for c in cache:
            del c.make_mask
    return calls, masks


def profile(model, system: str, b: int, args) -> Dict[str, Any]:
    limit = batched.max_positions(model, args)
    steps = args.warmup + 6 * (args.repeats + 1) + 4
    fill = batched.filled(args.context, steps, limit)
    cache = batched.batch(model, system, fill, fill + steps, b, args)
    kinds = [kind_of(c) for c in cache]
    H.settle()
    tokens = mx.zeros((b,), dtype=mx.uint32)

    def forward(t):
        return mx.argmax(model(t[:, None], cache=cache)[:, -1, :], axis=-1).astype(mx.uint32)

    H.decode_steps(forward, tokens, args.warmup, pipelined=True)
    out: Dict[str, Any] = {"B": b, "filled": fill}
    # the whole step: synchronous (host build apart), and pipelined
    build, whole = [], []
    for _ in range(args.repeats):
        mx.synchronize()
        t0 = H.now()
        y = forward(tokens)
        t1 = H.now()
        mx.eval(y)
        whole.append(H.now() - t0)
        build.append(t1 - t0)
    out["step"], out["host"] = H.median(whole) * 1e3, H.median(build) * 1e3
    seconds = H.decode_steps(forward, tokens, args.repeats, pipelined=True)[1]
    out["pipelined"] = seconds / args.repeats * 1e3
    # stores: every layer's update_and_fetch of one token per sequence
    a, dtype = model.args, H.DTYPES[args.dtype]
    kv = mx.random.normal((b, a.num_key_value_heads, 1, a.head_dim)).astype(dtype)
    mx.eval(kv)
    out["stores"] = timed(lambda cache=cache: [x for c in cache for x in c.update_and_fetch(kv, kv)],
                          args.repeats)
    # matmuls: every Linear on B rows
    mods = linears(model)
    xs = {n: mx.random.normal((b, 1, n)).astype(dtype) for n in {n for _, n in mods}}
    mx.eval(list(xs.values()))
    out["matmuls"] = timed(lambda: [m(xs[n]) for m, n in mods], args.repeats)
    # attention and masks on what a real step handed
    calls, made = record(model, cache, tokens)
    out["masks"] = timed(lambda made=made: [m for c, p, kw in made for m in [c.make_mask(*p, **kw)]
                                            if isinstance(m, mx.array)], args.repeats)
    for kind in (SLIDING, GLOBAL):
        mine = [c for c, k in zip(calls, kinds) if k == kind]
        out[f"{kind}_layers"] = len(mine)
        out[f"{kind}_form"] = ",".join(sorted({form(c["mask"]) for c in mine})) or "-"
        for masked in (True, False):
            def attend(mine=mine, masked=masked):
                return [mx.fast.scaled_dot_product_attention(
                    c["q"], c["k"], c["v"], scale=c["scale"], mask=c["mask"] if masked else None,
                    **{k: v for k, v in c.items() if k not in ("q", "k", "v", "scale", "mask")})
                    for c in mine]
            out[f"{kind}_{'mask' if masked else 'none'}"] = timed(attend, args.repeats) if mine \
                else 0.0
        out[f"{kind}_rows"] = mine[0]["k"].shape[2] if mine else 0
    parts = (out["host"] + out["matmuls"] + out["sliding_mask"] + out["global_mask"]
             + out["masks"] + out["stores"])
    out["sum"], out["rest"] = parts, out["step"] - parts
    return out  # the batch and the recorded views go with this frame


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    H.print_header(f"one batched decode step, profiled: {args.family}", args)
    model = batched.build(args)
    print(H.describe(model))
    results: Dict[str, List[Dict[str, Any]]] = {}
    for system in args.systems:
        results[system] = []
        for b in args.batches:
            results[system].append(profile(model, system, b, args))
            H.settle()  # the last batch freed before the next is filled
        rows = [[r["B"], r["filled"], r["step"], r["pipelined"], r["host"], r["matmuls"],
                 f"{r['sliding_mask']:.2f} / {r['sliding_none']:.2f}",
                 f"{r['global_mask']:.2f} / {r['global_none']:.2f}",
                 f"{r['sliding_form']} / {r['global_form']}", r["masks"], r["stores"], r["sum"],
                 r["rest"], r["sum"] / r["step"]] for r in results[system]]
        print()
        first = results[system][0]
        H.table(["B", "filled", "step ms", "pipelined ms", "host ms", "matmuls ms",
                 f"sliding x{first['sliding_layers']} ms (handed / none)",
                 f"global x{first['global_layers']} ms (handed / none)", "mask handed",
                 "masks ms", "stores ms", "sum ms", "rest ms", "sum / step"], rows,
                title=f"{system}: one decode step at {args.context} tokens, median of "
                      f"{args.repeats}",
                note="step: built then evaluated (synchronous); pipelined: GenerationBatch's "
                     "pattern; host: building the step's graph; matmuls: every Linear on B rows; "
                     "attention: all layers of a kind on the step's own arguments, with the mask "
                     "the cache handed and with none; masks: the model's make_mask calls; stores: "
                     "every layer's one-token update_and_fetch; sum = host + matmuls + attention "
                     "(handed) + masks + stores; rest = step - sum (norms, RoPE, activations, "
                     "sampling, launch gaps)")
    payload = {"benchmark": "profile_step", "args": vars(args), "results": results}
    H.write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
