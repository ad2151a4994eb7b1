"""Is decode attention's tensor-core launch (core.attention_cuda) right on the GPU, and how close to the HBM floor?

Run on an NVIDIA machine with mlx-cuda (nothing here runs elsewhere):

    python benchmarks/attention_mma_check.py [--bandwidth 4.8e12] [--depth 131072] [--batches 1,4]

1. **Correctness**: random queries and K/V, bf16 and f16, head_dim 128 (and
   64, 256), n = 1 and 4 query tokens, global and windowed layers, three or
   four sequences of mixed lengths in one batch: a full ring wrapped at a
   random origin, a ring part full and rotated, a plane (no wrap), a short
   one; K/V as strided views (token-major planes transposed, head-major planes
   sliced, a slot-offset view, and a misaligned view that takes the kernel's
   element-copy path); queries strided as mlx-lm hands them. Rows a sequence
   does not hold are NaN, and one case per type has sinks. The launch's
   output must match ``attention.reference`` and be the bits of the portable
   fold and combine kernels over its own partials; the partials, combined
   (``combine_partials``), must match the reference too; one case's partials must match the
   contract computed in float64 chunk by chunk; partials hold no NaN, a row
   that sees nothing is ``(o, m, l) = (0, -inf, 0)``; the same call twice, and
   a sequence alone against the same sequence in a batch at another slot and
   rotation, give the same bits.
2. **Timing**: one global layer of Muse Glimmer (Hkv = 2, G = 16, D = 128,
   bf16) at ``--depth`` keys, n = 1, batches ``--batches``: the whole launch,
   against the K/V bytes at ``--bandwidth`` (the floor) and against
   ``mx.fast.scaled_dot_product_attention`` on the same plane (checked there
   against the reference and the portable kernels' bits too); independent
   launches in one graph (which the GPU may overlap), then chained, each
   call's queries waiting on the last one's output, as a decode's layers are.

3. **Timeline** (``--timeline B,...``): one launch at ``--depth`` built with
   ``MUSER_ATTEND_TIMELINE``, every block stamping the GPU clock at its phases
   (start, Q tile, its tiles, the partial written, the fold, the combine):
   how long a block's path takes, and when the last blocks run.

Prints PASS or FAIL (exit status 1) for section 1, then the timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import mlx.core as mx
import numpy as np

from muser_kv.core import attention, attention_cuda
from muser_kv.core.attention import CHUNK, DecodeRead, KeyRead
from muser_kv.core.kernels import KernelBackend

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16}
TOL = {"bfloat16": 2.5e-2, "float16": 5e-3}


def sequences(rng, window: Optional[int]) -> List[dict]:
    """Mixed lengths: (wrap, held, end, origin)."""
    w = window or 0
    return [
        dict(wrap=1024 + w, held=1024 + w, end=5000 + w, origin=int(rng.integers(0, 1024 + w))),
        dict(wrap=900, held=600, end=2000, origin=700),   # rows 700..899, then 0..399
        dict(wrap=3000, held=3000, end=3000, origin=0),   # a plane
        dict(wrap=64, held=37, end=37, origin=0),         # short, less than a chunk
    ]


def kv_views(rng, specs, slots, hkv, d, dtype, layout):
    """keys or values ``[S, Hkv, R, D]`` as a strided view of a larger buffer;
    rows not held are NaN."""
    S = max(slots) + 2
    R = max(s["wrap"] for s in specs) + 5
    vals = np.full((S, hkv, R, d), np.nan, np.float32)
    for s, slot in zip(specs, slots):
        rows = (s["origin"] + np.arange(s["held"])) % s["wrap"]
        vals[slot][:, rows] = rng.standard_normal((hkv, s["held"], d)).astype(np.float32)
    if layout == "token":  # [S, R, H, D] transposed
        base = mx.array(vals.transpose(0, 2, 1, 3).copy()).astype(dtype)
        view = base.transpose(0, 2, 1, 3)
    elif layout == "head_sliced":  # [S, H, R + 40, D] sliced to R rows
        padded = np.full((S, hkv, R + 40, d), np.nan, np.float32)
        padded[:, :, :R] = vals
        view = mx.array(padded).astype(dtype)[:, :, :R, :]
    elif layout == "slot_offset":  # one slot more in front: a view with an offset
        padded = np.concatenate([np.full((1, hkv, R, d), np.nan, np.float32), vals])
        view = mx.array(padded).astype(dtype)[1:]
    elif layout == "misaligned":  # D + 3 columns, the last D: no 16-byte rows
        padded = np.full((S, hkv, R, d + 3), np.nan, np.float32)
        padded[..., 3:] = vals
        view = mx.array(padded).astype(dtype)[..., 3:]
    else:
        raise ValueError(layout)
    mx.eval(view)
    return view, vals


def run_first_pass(q, keys, values, seqs, window, scale, sinks=None):
    """``(out, partials, read, params)`` of one ``attend_mma`` launch."""
    b, hq, n, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    read = DecodeRead(keys, values, tuple(seqs), window)
    max_chunks = read.max_chunks(n)
    params = attention_cuda.kernel_params(b, hkv, g, n, d, CHUNK, max_chunks, window or 0, seqs,
                                          sinks=int(sinks is not None))
    out, partials = attention_cuda.attend_mma(q, keys, values, params, scale, max_chunks, n * g,
                                              sinks)
    return out, partials, read, params


def portable_combine(partials, params, n, g, dtype, sinks=None):
    """The portable kernels' fold (``attend_merge``) and combine (``attend_combine``)
    over the same partials: the arithmetic the fused tail follows, bit for bit."""
    return KernelBackend("cuda").combine(partials, params, n, dtype, sinks, fold=True)


def contract_partials(qf, kf, vf, seqs, n, g, window, scale, max_chunks):
    """float64 partials straight from the contract."""
    B, hq, _, d = qf.shape
    hkv = kf.shape[1]
    out = np.zeros((B, hkv, max_chunks, n * g, d + 2))
    out[..., d] = -np.inf
    for b, s in enumerate(seqs):
        first, count = s.chunks(n, window)
        start = s.end - s.held
        for c in range(count):
            pos = np.arange((first + c) * CHUNK, (first + c + 1) * CHUNK)
            for r in range(n * g):
                i, j = divmod(r, g)
                qpos = s.end - n + i
                rlo = max(start, qpos - window + 1) if window else start
                seen = pos[(pos >= rlo) & (pos <= qpos)]
                if seen.size == 0:
                    continue
                rows = (s.origin + seen - start) % s.wrap
                for h in range(hkv):
                    sc = scale * (kf[s.slot, h, rows].astype(np.float64) @ qf[b, h * g + j, i])
                    m = sc.max()
                    e = np.exp(sc - m)
                    out[b, h, c, r, :d] = e @ vf[s.slot, h, rows]
                    out[b, h, c, r, d], out[b, h, c, r, d + 1] = m, e.sum()
    return out


def check(name, ok, detail=""):
    print(f"  {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
    return ok


def correctness(rng) -> bool:
    good = True
    cases = []
    for dt in DTYPES:
        for n, window, layouts in ((1, None, ("token", "head_sliced")),
                                   (4, None, ("slot_offset", "token")),
                                   (1, 512, ("head_sliced", "misaligned")),
                                   (4, 512, ("misaligned", "slot_offset"))):
            cases.append((dt, dt, 128, 2, 16, n, window, layouts))
        cases.append((dt, dt, 64, 1, 5, 4, None, ("token", "token")))       # 20 rows: two M tiles
        cases.append((dt, dt, 256, 2, 8, 3, 300, ("head_sliced", "token")))
    # queries of another type than the planes (rounded to the planes' for the mma)
    cases.append(("bfloat16", "float32", 128, 2, 16, 1, None, ("token", "head_sliced")))
    cases.append(("float16", "bfloat16", 128, 2, 16, 4, 512, ("slot_offset", "token")))
    # 5 rows a tile (odd): the tail's sources are 8-byte aligned only, of an odd count of pairs
    cases.append(("bfloat16", "bfloat16", 128, 3, 5, 1, None, ("token", "head_sliced")))
    for dt, qt, d, hkv, g, n, window, (klayout, vlayout) in cases:
        dtype = DTYPES[dt]
        specs = sequences(rng, window)
        slots = [2, 0, 3, 1][: len(specs)]
        keys, kf = kv_views(rng, specs, slots, hkv, d, dtype, klayout)
        values, vf = kv_views(rng, specs, slots, hkv, d, dtype, vlayout)
        # the views' values as the kernel sees them (rounded to dtype)
        kf = np.array(mx.array(kf).astype(dtype).astype(mx.float32))
        vf = np.array(mx.array(vf).astype(dtype).astype(mx.float32))
        seqs = [KeyRead(slot, s["end"], s["held"], s["origin"], s["wrap"]) for s, slot in zip(specs, slots)]
        B = len(seqs)
        q = mx.array(rng.standard_normal((B, n, hkv * g, d)).astype(np.float32))
        q = q.astype(DTYPES.get(qt, mx.float32))
        q = q.transpose(0, 2, 1, 3)  # mlx-lm's layout: strided for n > 1
        scale = 1.0 / np.sqrt(d)
        sinks = (mx.array(rng.standard_normal(hkv * g).astype(np.float32)) if window == 512
                 and n == 4 else None)  # GPT-OSS's per-head logit, on one case per type
        fused, partials, read, params = run_first_pass(q, keys, values, seqs, window, scale, sinks)
        again, _, _, _ = run_first_pass(q, keys, values, seqs, window, scale, sinks)
        out = attention_cuda.combine_partials(partials, n, g, mx.float32)
        unfused = portable_combine(partials, params, n, g, q.dtype, sinks)
        want = attention.reference(q, read, scale, sinks).astype(mx.float32)
        mx.eval(partials, again, out, want, fused, unfused)
        p = np.array(partials)
        label = (f"K/V {dt}, queries {qt}, D={d} Hkv={hkv} G={g} n={n} window={window} "
                 f"K {klayout} V {vlayout}{' sinks' if sinks is not None else ''}")
        print(label)
        if sinks is None:
            err = float(np.abs(np.array(out) - np.array(want)).max())
            good &= check("combined partials match attention.reference", err <= TOL[dt],
                          f"max |err| {err:.2e}")
        ferr = float(np.abs(np.array(fused.astype(mx.float32)) - np.array(want)).max())
        good &= check("the launch's output matches attention.reference", ferr <= TOL[dt],
                      f"max |err| {ferr:.2e}")
        good &= check("the launch's output is the fold and combine kernels' bits",
                      np.array_equal(np.array(fused.astype(mx.float32)).view(np.uint32),
                                     np.array(unfused.astype(mx.float32)).view(np.uint32)))
        good &= check("the same launch twice: the same output bits",
                      np.array_equal(np.array(fused.astype(mx.float32)).view(np.uint32),
                                     np.array(again.astype(mx.float32)).view(np.uint32)))
        spans_same = True
        for span in attention_cuda.SPANS[1:]:
            fs, ps = attention_cuda.attend_mma(q, keys, values, params, scale, p.shape[2], n * g,
                                               sinks, span=span)
            spans_same &= (np.array_equal(np.array(ps).view(np.uint32), p.view(np.uint32))
                           and np.array_equal(np.array(fs.astype(mx.float32)).view(np.uint32),
                                              np.array(fused.astype(mx.float32)).view(np.uint32)))
        good &= check(f"blocks of {attention_cuda.SPANS[1:]} chunks: the same partials' and "
                      "output's bits", spans_same)
        good &= check("no NaN in the partials", not np.isnan(p).any())
        empty = p[..., d] == -np.inf
        good &= check("a row that sees nothing is (0, -inf, 0)",
                      bool((p[empty][:, :d] == 0).all() and (p[empty][:, d + 1] == 0).all()))
        good &= check("the same call twice: the same partials' bits",
                      np.array_equal(p.view(np.uint32), np.array(run_first_pass(
                          q, keys, values, seqs, window, scale, sinks)[1]).view(np.uint32)))
        if dt == qt == "bfloat16" and n == 4 and window:
            want_p = contract_partials(np.array(q.astype(mx.float32)), kf, vf, seqs, n, g, window,
                                       scale, p.shape[2])
            live = ~empty
            m_err = float(np.abs(p[..., d][live] - want_p[..., d][live]).max())
            l_rel = float(np.abs(p[..., d + 1][live] / want_p[..., d + 1][live] - 1).max())
            o_err = float(np.abs(p[..., :d][live] / p[..., d + 1][live][:, None]
                                 - want_p[..., :d][live] / want_p[..., d + 1][live][:, None]).max())
            good &= check("partials match the contract (float64)",
                          np.array_equal(empty, want_p[..., d] == -np.inf) and m_err < 1e-3
                          and l_rel < 1e-2 and o_err < TOL[dt],
                          f"m {m_err:.1e}, l rel {l_rel:.1e}, o/l {o_err:.1e}")
        # a sequence alone, at another slot and rotation, in another layout: the same bits
        s0, spec0 = seqs[1], specs[1]
        alone_spec = dict(spec0, origin=(spec0["origin"] + 123) % spec0["wrap"])
        ka, _ = kv_views(rng, [alone_spec], [1], hkv, d, dtype, vlayout)
        va, _ = kv_views(rng, [alone_spec], [1], hkv, d, dtype, klayout)
        rows_b = (s0.origin + np.arange(s0.held)) % s0.wrap
        rows_a = (alone_spec["origin"] + np.arange(s0.held)) % s0.wrap
        ka_np = np.array(ka.astype(mx.float32))
        va_np = np.array(va.astype(mx.float32))
        ka_np[1][:, rows_a] = kf[s0.slot][:, rows_b]
        va_np[1][:, rows_a] = vf[s0.slot][:, rows_b]
        ka = mx.array(ka_np).astype(dtype)
        va = mx.array(va_np).astype(dtype)
        alone = KeyRead(1, s0.end, s0.held, alone_spec["origin"], s0.wrap)
        oa, pa, _, _ = run_first_pass(q[1:2], ka, va, [alone], window, scale, sinks)
        pa = np.array(pa)
        c = pa.shape[2]
        good &= check("a sequence alone and in a batch: the same bits",
                      np.array_equal(pa[0].view(np.uint32), p[1, :, :c].view(np.uint32))
                      and bool((p[1, :, c:, :, d] == -np.inf).all())
                      and np.array_equal(np.array(oa.astype(mx.float32))[0].view(np.uint32),
                                         np.array(fused.astype(mx.float32))[1].view(np.uint32)))
    return good


def best_time(run, reps: int, trials: int = 3) -> float:
    """Seconds per call of ``run()`` (``reps`` calls, evaluated together), after a
    warm run, best of ``trials``."""
    mx.eval(run())
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        mx.eval(run())
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def time_calls(make, reps: int, trials: int = 3) -> float:
    """Seconds per call: ``reps`` independent calls in one graph."""
    return best_time(lambda: [make(i) for i in range(reps)], reps, trials)


def time_chained(call, q, reps: int, trials: int = 3) -> float:
    """Seconds per call when each call's queries wait on the previous call's
    output (``q + 0 * out``), as a decode's layers do: the launch's latency,
    where ``time_calls`` lets independent launches overlap."""
    def run():
        x = call(0, q)
        for i in range(1, reps):
            x = call(i, q + 0 * x)
        return x
    return best_time(run, reps, trials)


def time_batch(b: int, depth: int, bandwidth: float, reps: int, span: int = 1) -> None:
    hkv, g, d, n = 2, 16, 128, 1
    dtype = mx.bfloat16
    keys = mx.random.normal((b, hkv, depth, d)).astype(dtype)
    values = mx.random.normal((b, hkv, depth, d)).astype(dtype)
    q = mx.random.normal((b, hkv * g, n, d)).astype(dtype)
    mx.eval(keys, values, q)
    seqs = [KeyRead(i, depth, depth, 0, depth) for i in range(b)]
    read = DecodeRead(keys, values, tuple(seqs), None)
    max_chunks = read.max_chunks(n)
    params = attention_cuda.kernel_params(b, hkv, g, n, d, CHUNK, max_chunks, 0, seqs)
    scales = [mx.array([0.088 + 1e-6 * i], dtype=mx.float32) for i in range(reps)]
    mx.eval(params, scales)

    def first(i):
        return attention_cuda.attend_mma(q, keys, values, params, scales[i % reps], max_chunks,
                                         n * g, span=span)[0]

    def sdpa(i):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.088 + 1e-6 * i)

    # at depth too: the launch against the reference, and against the portable kernels' bits
    out, partials = attention_cuda.attend_mma(q, keys, values, params, scales[0], max_chunks, n * g,
                                              span=span)
    want = attention.reference(q, read, float(scales[0].item()))
    unfused = portable_combine(partials, params, n, g, q.dtype)
    err = float(mx.abs(out.astype(mx.float32) - want.astype(mx.float32)).max().item())
    same = bool(mx.array_equal(out, unfused).item())
    kv_bytes = 2 * b * hkv * depth * d * 2
    out_bytes = b * hkv * max_chunks * n * g * (d + 2) * 4
    floor = kv_bytes / bandwidth
    t_first = time_calls(first, reps)
    t_sdpa = time_calls(sdpa, reps)
    c_first = time_chained(lambda i, x: attention_cuda.attend_mma(
        x, keys, values, params, scales[i % reps], max_chunks, n * g, span=span)[0], q, reps)
    c_sdpa = time_chained(lambda i, x: mx.fast.scaled_dot_product_attention(
        x, keys, values, scale=0.088 + 1e-6 * i), q, reps)
    _, _, blocks = attention_cuda.launch_geometry(b, hkv, max_chunks, n * g, span)
    print(f"  B={b:>2} span {span:>2}: one launch {t_first * 1e6:8.1f} us "
          f"({kv_bytes / t_first / 1e12:5.2f} TB/s of K/V, floor {floor * 1e6:6.1f} us "
          f"= {kv_bytes / 1e6:,.0f} MB K/V at {bandwidth / 1e12:.2f} TB/s, {floor / t_first:4.0%} "
          f"of it; {blocks} blocks, {out_bytes / 1e6:,.1f} MB partials); "
          f"mx.fast SDPA {t_sdpa * 1e6:8.1f} us; vs reference {err:.1e} "
          f"({'ok' if err <= TOL['bfloat16'] else 'FAIL'}), "
          f"portable kernels' bits {'same' if same else 'DIFFER'}")
    print(f"         chained (each on the last one's output): one launch {c_first * 1e6:8.1f} us "
          f"({floor / c_first:4.0%} of the floor); mx.fast SDPA {c_sdpa * 1e6:8.1f} us; "
          f"SDPA / launch {c_sdpa / c_first:.2f}")


_TAIL = """fold_and_combine<T, HD, SPAN>(at, sinks, params, params_len, partials, merged,
const_cast<int*>(counters), out MUSER_TL_ARG);"""  # as attention_cuda.compact leaves it


def use_stages(stages: int, tail: bool = True) -> None:
    """Build the kernel with another ``cp.async`` ring depth (a tuning knob: the
    header's ``STAGES``, the launcher's shared memory, a kernel name of its own
    so MLX compiles it anew); ``tail=False``: the first pass alone (the partials;
    the output is not written), to time the fold and combine by difference."""
    header = _HEADER.replace("constexpr int STAGES = 2;", f"constexpr int STAGES = {stages};")
    assert stages == 2 or header != _HEADER
    if not tail:
        assert _TAIL in header
        header = header.replace(_TAIL, "")
    attention_cuda.STAGES = stages
    attention_cuda.kernel_header = lambda: header
    attention_cuda.kernel_name = lambda d, span=1: f"muser_kv_attend_mma_d{d}_x{span}" + (
        "" if stages == 2 else f"_s{stages}") + ("" if tail else "_first")
    attention_cuda._built.clear()


_HEADER = attention_cuda.kernel_header()


def timing(depth: int, batches: List[int], bandwidth: float, reps: int,
           stages: List[int], spans: List[int]) -> None:
    for st in stages:
        for tail in (True, False):
            use_stages(st, tail)
            print(f"\nTiming: one global layer, Hkv=2 G=16 D=128 bf16, {depth:,} keys, n=1, "
                  f"STAGES={st} ({attention_cuda.shared_bytes(128):,} B shared a block, "
                  f"{attention_cuda.shared_bytes(128, 2):,} with a span)"
                  + ("" if tail else ": the first pass alone (checks meaningless)"))
            for b in batches:
                for span in spans:
                    time_batch(b, depth, bandwidth, reps, span)
    use_stages(2)


def timeline(depth: int, b: int, span: int = 1) -> None:
    """One launch built with ``MUSER_ATTEND_TIMELINE``: every block's thread 0
    stamps the GPU's clock at its phases (kernels/attend_mma.h), so where a
    block's time goes, and when the last ones run, is read off the blocks
    themselves."""
    hkv, g, d, n = 2, 16, 128, 1
    keys = mx.random.normal((b, hkv, depth, d)).astype(mx.bfloat16)
    values = mx.random.normal((b, hkv, depth, d)).astype(mx.bfloat16)
    q = mx.random.normal((b, hkv * g, n, d)).astype(mx.bfloat16)
    seqs = [KeyRead(i, depth, depth, 0, depth) for i in range(b)]
    chunks = DecodeRead(keys, values, tuple(seqs), None).max_chunks(n)
    params = attention_cuda.kernel_params(b, hkv, g, n, d, CHUNK, chunks, 0, seqs)
    kernel = mx.fast.cuda_kernel(
        name=f"muser_kv_attend_mma_d{d}_x{span}_timeline", input_names=attention_cuda.INPUT_NAMES,
        output_names=attention_cuda.OUTPUT_NAMES + ["timeline"],
        source=attention_cuda.kernel_source(),
        header="#define MUSER_ATTEND_TIMELINE 1\n" + attention_cuda.kernel_header(),
        ensure_row_contiguous=False, shared_memory=attention_cuda.shared_bytes(d, span))
    grid, threadgroup, blocks = attention_cuda.launch_geometry(b, hkv, chunks, n * g, span)
    groups = -(-chunks // attention.FOLD)

    def launch():
        counters = mx.zeros((attention_cuda.counter_count(b, hkv, chunks, n * g),), mx.int32)
        return kernel(
            inputs=[q, keys, values, mx.array([d ** -0.5], mx.float32),
                    mx.array([0.0], mx.float32), params, counters],
            template=[("T", mx.bfloat16), ("P", mx.bfloat16), ("HD", d), ("SPAN", span)], grid=grid,
            threadgroup=threadgroup, init_value=0,
            output_shapes=[(b, hkv * g, n, d), (b, hkv, chunks, n * g, d + 2),
                           (b, hkv, groups, n * g, d + 2), (blocks * 16,)],
            output_dtypes=[mx.bfloat16, mx.float32, mx.float32, mx.uint64])[3]

    mx.eval(keys, values, q, launch())  # compiled, warm
    stamps = np.array(launch()).astype(np.int64).reshape(blocks, 16)
    t = (stamps[:, :15] - stamps[:, 0].min()) / 1e3  # us from the first block's start
    t[stamps[:, :15] == 0] = np.nan
    sms = len(set(stamps[:, 15].tolist()))

    def med(x):
        x = x[~np.isnan(x)]
        return f"{np.median(x):6.1f}" if x.size else "     -"
    print(f"\nTimeline: {depth:,} keys, B = {b}, span {span}: {blocks} blocks on {sms} SMs, the launch's span "
          f"{np.nanmax(t):.1f} us (starts {np.nanmin(t[:, 0]):.1f}..{np.nanmax(t[:, 0]):.1f} us)")
    print(f"  per block, median us: params + Q tile {med(t[:, 1] - t[:, 0])}, warp 0's tiles "
          f"{med(t[:, 2] - t[:, 1])}, the warps' combine + the write {med(t[:, 3] - t[:, 2])}, "
          f"start to written {med(t[:, 3] - t[:, 0])}")
    print(f"  every block: its group's partials awaited {med(t[:, 4] - t[:, 3])}, the fold's weights "
          f"{med(t[:, 7] - t[:, 4])}, its share {med(t[:, 8] - t[:, 7])}; combining blocks "
          f"({int((~np.isnan(t[:, 5])).sum())}): the folds awaited {med(t[:, 5] - t[:, 8])}, the combine "
          f"{med(t[:, 6] - t[:, 5])}; the last output at {np.nanmax(t[:, 6]):.1f} us")
    last = int(np.nanargmax(t[:, 6]))  # the block that wrote the output last
    w = t[last]

    def span(a, z):
        return f"{w[z] - w[a]:.1f}" if not np.isnan(w[z] - w[a]) else "-"
    if np.isnan(w[11]):  # no combine: the batch's only fold wrote the output
        print(f"  the last output's block (a single fold): the group awaited {span(3, 4)}, its weights "
              f"{span(4, 7)}, its share summed and written {span(7, 6)}")
    else:
        print(f"  the last output's block: the group awaited {span(3, 4)}, the fold's weights {span(4, 7)}, "
              f"its share {span(7, 8)}, the folds awaited {span(8, 5)}; the combine's weights {span(5, 11)}, "
              f"its share summed and written {span(11, 6)}")
    # blocks resident at once on one SM (occupancy as it ran): the most [start,
    # written] intervals that overlap on any SM
    most = 0
    for sm in set(stamps[:, 15].tolist()):
        on = (stamps[:, 15] == sm) & ~np.isnan(t[:, 3])
        events = sorted([(x, 1) for x in t[on, 0]] + [(x, -1) for x in t[on, 3]],
                        key=lambda e: (e[0], e[1]))
        level = 0
        for _, step in events:
            level += step
            most = max(most, level)
    print(f"  blocks resident at once on an SM: at most {most}")
    ends = np.sort(t[:, 3][~np.isnan(t[:, 3])])
    if ends.size:
        print("  partials written by: " + ", ".join(f"{int(f * 100)} % at {ends[int(f * (len(ends) - 1))]:.1f} us"
                                                    for f in (0.1, 0.5, 0.9, 1.0)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s (H200 4.8e12, H100 3.35e12)")
    p.add_argument("--depth", type=int, default=131072)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-check", action="store_true", help="the timings alone")
    p.add_argument("--timeline", default="", help="B values: one launch each at --depth, its blocks' "
                   "phases stamped (MUSER_ATTEND_TIMELINE)")
    p.add_argument("--stages", default="2", help="cp.async ring depths to time (e.g. 2,3,4)")
    p.add_argument("--spans", default="1", help="chunks a block takes in turn, to time (e.g. 1,2,4)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"device: {mx.default_device()}")
    ok = True
    if not args.skip_check:
        ok = correctness(np.random.default_rng(args.seed))
        print("PASS" if ok else "FAIL")
    spans = [int(x) for x in args.spans.split(",")]
    for b in [int(x) for x in args.timeline.split(",") if x]:
        for span in spans:
            timeline(args.depth, b, span)
    if not args.skip_timing:
        timing(args.depth, [int(x) for x in args.batches.split(",")], args.bandwidth, args.reps,
               [int(x) for x in args.stages.split(",")], spans)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
