"""How fast does one threadblock read what a kernel just wrote (L2), against the bytes spread over blocks?

Decode attention's tail (``kernels/attend_mma.h``: the fold and the combine)
reads 66-266 KB of partials from L2 per (sequence, K/V head); done by one
block, its timeline showed about 10 GB/s whichever way the block loaded, so
it is spread over a fold group's blocks (``docs/performance.md``, "Decode
attention"). This asks the GPU directly:
each case launches ``blocks`` blocks of ``threads`` threads, each summing its
own ``KB`` of a float32 array an elementwise op wrote just before, and prints
the median block's time between its first load and its last (``%globaltimer``)
and the rate a block reads at. If many blocks of 8 KB each finish in the time
one block takes for 8 KB, a tail spread over blocks is that many times faster.

    python3 benchmarks/l2_read.py                       # GPU only (MLX CUDA)
    bash benchmarks/device.sh tail                      # with the tail's timelines
    python3 benchmarks/l2_read.py --cases 1x133x128,16x8.3x128
"""

from __future__ import annotations

import argparse
from typing import List, Tuple

import mlx.core as mx
import numpy as np

SOURCE = """
  const int n = params[0];
  const float* p = src + static_cast<long long>(blockIdx.x) * n;
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  float acc = 0.0f;
#pragma unroll 8
  for (int i = 2 * threadIdx.x; i < n; i += 2 * blockDim.x) {
    float2 v = __ldcg(reinterpret_cast<const float2*>(p + i));
    acc += v.x + v.y;
  }
  __syncthreads();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) {
    stamps[2 * blockIdx.x] = t0;
    stamps[2 * blockIdx.x + 1] = t1;
  }
"""
DEFAULT = "1x133x128,1x133x512,1x133x1024,2x133x128,1x266x128,1x66x128,8x16.6x128,16x8.3x128,32x8.3x128"


def parse_cases(text: str) -> List[Tuple[int, float, int]]:
    """``BLOCKSxKBxTHREADS,...`` -> [(blocks, KB, threads)]."""
    out = []
    for item in text.split(","):
        blocks, kb, threads = item.split("x")
        out.append((int(blocks), float(kb), int(threads)))
    return out


def make_kernel():
    return mx.fast.cuda_kernel(name="muser_kv_l2_read", input_names=["src", "params"],
                               output_names=["out", "stamps"], source=SOURCE)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=parse_cases, default=parse_cases(DEFAULT),
                   help=f"BLOCKSxKBxTHREADS,... (default {DEFAULT})")
    p.add_argument("--repeats", type=int, default=5, help="launches per case; the last is read")
    args = p.parse_args(argv)
    if not mx.cuda.is_available():
        raise SystemExit("l2_read.py: MLX CUDA only (it launches a CUDA kernel)")
    kernel = make_kernel()
    print(f"device {mx.default_device()}")
    for blocks, kb, threads in args.cases:
        floats = int(kb * 1024 / 4) // 2 * 2
        src = mx.random.normal((blocks * floats,))
        for _ in range(args.repeats):
            src = src + 1.0  # written just before the read: in L2
            _, stamps = kernel(inputs=[src, mx.array([floats], mx.int32)], grid=(blocks * threads, 1, 1),
                               threadgroup=(threads, 1, 1),
                               output_shapes=[(blocks * threads,), (2 * blocks,)],
                               output_dtypes=[mx.float32, mx.uint64])
            t = np.array(stamps).astype(np.int64).reshape(blocks, 2)
        us = float(np.median((t[:, 1] - t[:, 0]) / 1e3))
        print(f"{blocks:3d} blocks x {kb:6.1f} KB, {threads:4d} threads: {us:7.2f} us a block, "
              f"{kb * 1024 / us / 1e3:6.2f} GB/s a block")


if __name__ == "__main__":
    main()
