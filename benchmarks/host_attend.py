"""What does one decode attention call cost the host, muser-kv's launch against MLX's SDPA?

A 52-layer decode step on MLX CUDA is host-bound when each layer's calls cost
more host time than its kernels take on the GPU (``decode.py``'s step did not
move when the attention launch got faster). This times the two halves of that
host time per call, on one global layer's shapes (bf16, 32 query heads, 2 K/V
heads x 128, ``--depth`` keys):

- **build**: the Python call that adds the op to the graph (``KernelBackend.attend``
  with its params, ``attention_cuda.launch`` alone, and MLX's
  ``scaled_dot_product_attention`` on the same planes), best of ``--repeats``
  x ``--calls`` calls, no evaluation;
- **eval**: ``--calls`` calls chained (each on the last one's output), built, then
  evaluated: the evaluation's host time per op (MLX encodes every op on the host;
  the kernels are short at a small ``--depth``, so the GPU waits on the host).

``--include``: the same launch with the header handed to MLX as one
``#include`` line of the file (NVRTC reads it from disk), so MLX builds and
hashes a few hundred bytes a call instead of the whole header.

    python3 benchmarks/host_attend.py --depth 512 --calls 520      # MLX CUDA only
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import mlx.core as mx

from muser_kv.core import attention, attention_cuda, kernels
from muser_kv.core.attention import DecodeRead, KeyRead


def best(fn: Callable[[], None], repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def measure(call: Callable[[mx.array], mx.array], q: mx.array, calls: int,
            repeats: int) -> Tuple[float, float, float]:
    """(build, eval, build + eval of a chain), us a call, each the best of ``repeats``."""
    def build() -> None:
        for _ in range(calls):
            call(q)

    evals: List[float] = []

    def chain() -> None:
        x = q
        for _ in range(calls):
            x = call(x)
        t0 = time.perf_counter()
        mx.eval(x)
        evals.append(time.perf_counter() - t0)
    b = best(build, repeats) / calls * 1e6
    total = best(chain, repeats) / calls * 1e6
    return b, min(evals) / calls * 1e6, total


def include_kernel(d: int) -> Callable:
    """The launch's kernel with the header as one #include of the file (its
    digest in the name, so MLX's PTX cache follows the file's content)."""
    path = Path(attention_cuda.__file__).resolve().parents[2] / "kernels" / "attend_mma.h"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return mx.fast.cuda_kernel(
        name=f"muser_kv_attend_mma_inc_{digest}_d{d}", input_names=attention_cuda.INPUT_NAMES,
        output_names=attention_cuda.OUTPUT_NAMES, source=attention_cuda.kernel_source(),
        header=f'#include "{path}"\n', ensure_row_contiguous=False,
        shared_memory=attention_cuda.shared_bytes(d, 1))


def main(argv=None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=512)
    p.add_argument("--calls", type=int, default=520)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--include", action="store_true")
    args = p.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("host_attend.py: MLX CUDA only")
    hkv, g, d, n, depth = 2, 16, 128, 1, args.depth
    keys = mx.random.normal((1, hkv, depth, d)).astype(mx.bfloat16)
    values = mx.random.normal((1, hkv, depth, d)).astype(mx.bfloat16)
    q = mx.random.normal((1, hkv * g, n, d)).astype(mx.bfloat16)
    mx.eval(keys, values, q)
    read = DecodeRead(keys, values, (KeyRead(0, depth, depth, 0, depth),), None)
    backend = kernels.get_backend("cuda")
    chunks = read.max_chunks(n)
    params = attention_cuda.kernel_params(1, hkv, g, n, d, attention.CHUNK, chunks, 0, read.sequences)
    scale = mx.array([d ** -0.5], mx.float32)
    inc = include_kernel(d) if args.include else None
    pool = attention_cuda.Counters()

    def launch_inc(x: mx.array) -> mx.array:
        counters = pool.take(attention_cuda.counter_count(1, hkv, chunks, n * g))
        return inc(inputs=[x, keys, values, scale, attention_cuda.NO_SINKS, params, counters],
                   template=[("T", x.dtype), ("P", keys.dtype), ("HD", d), ("SPAN", 1)],
                   grid=attention_cuda.launch_geometry(1, hkv, chunks, n * g)[0], threadgroup=(128, 1, 1),
                   output_shapes=[(1, hkv * g, n, d), (1, hkv, chunks, n * g, d + 2),
                                  (1, hkv, -(-chunks // attention.FOLD), n * g, d + 2)],
                   output_dtypes=[x.dtype, mx.float32, mx.float32])[0]

    calls: Dict[str, Callable[[mx.array], mx.array]] = {
        "KernelBackend.attend": lambda x: backend.attend(x, read, d ** -0.5),
        "attention_cuda.launch": lambda x: attention_cuda.launch(
            x, keys, values, params, scale, chunks, n * g, attention_cuda.NO_SINKS)[0],
        "mx.fast SDPA": lambda x: mx.fast.scaled_dot_product_attention(x, keys, values, scale=d ** -0.5),
    }
    if inc is not None:
        calls["launch, #include header"] = launch_inc
    out: Dict[str, float] = {}
    print(f"device {mx.default_device()}, depth {depth}, {args.calls} calls, best of {args.repeats}")
    for name, call in calls.items():
        mx.eval(call(q))  # compiled, warm
        b, e, total = measure(call, q, args.calls, args.repeats)
        out[name] = b
        print(f"  {name:26s} build {b:6.2f} us a call; chained build + eval {total:6.2f} us a call, "
              f"the eval alone {e:6.2f}")
    return out


if __name__ == "__main__":
    main()
