"""The tail of decode attention's tensor-core launch, its own text run on the CPU.

``kernels/attend_mma.h``'s ``fold_and_combine`` (the fold and the combine,
spread over every block of a fold group, with the counters that order them)
and the ``Block`` that decodes a block's task from the launch's ticket are
cut from the header as they are and compiled by g++ behind a small CUDA
stand-in: a block is ``THREADS`` std::threads (fewer than the GPU's 128: the
tail's loops stride by it) with a std::barrier for ``__syncthreads`` and a buffer for
its shared memory, atomics are std::atomic_ref, L2 loads plain loads. Blocks
run at once, at most ``slots`` of them (the GPU's resident blocks), each
taking the next task when it starts, as on the GPU.

Over chunk partials given directly (the first pass is the GPU check's), every
output element must be the rule's bits: each fold group's chunks in ascending
order against the group's max, then the folds against their common max and the
sink, ``acc += w * v`` in float32 (``-ffp-contract=off`` on both sides), ``expf``
the C library's on both sides. Partials a sequence does not hold are NaN and
must not be read. Cases the GPU check never reaches run here: rows per tile
not a multiple of anything (5 query heads a K/V head), several M tiles, a last
fold group of one chunk, spans, and as few resident blocks as a fold group has.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from host_kernels import build_library

from muser_kv.core import attention_cuda

ROWS, FOLD, CHUNK = attention_cuda.ROWS, attention_cuda.FOLD, 256
THREADS = 16  # a block's threads here: the tail's loops stride by THREADS (a row a thread: >= ROWS)
HEADER = Path(attention_cuda.__file__).resolve().parents[2] / "kernels" / "attend_mma.h"

SHIM = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <memory>
#include <semaphore>
#include <thread>
#include <vector>
#define __device__
#define __host__
#define __forceinline__ inline
#define MUSER_TL_PARAM
#define MUSER_TL_ARG
#define MUSER_STAMP(i) do {} while (0)
struct Dim { unsigned x; };
thread_local Dim threadIdx;
Dim gridDim;           // the launch's blocks (tasks)
unsigned host_sms;     // the SMs the tail counts its last wave by
thread_local std::barrier<>* block_barrier;
thread_local unsigned char* block_smem;
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float __ldcg(const float* p) { return *p; }
inline float2 __ldcg(const float2* p) { return *p; }
using std::max;
using std::min;
namespace muser_attend {
constexpr int WARPS = %(warps)d;
constexpr int THREADS = %(threads)d;
constexpr int ROWS = %(rows)d;
constexpr int TK = %(tk)d;
constexpr int STAGES = %(stages)d;
constexpr int FOLD = %(fold)d;
constexpr int RESIDENT = %(resident)d;
inline float neg_inf() { return -INFINITY; }
inline unsigned sm_count() { return host_sms; }
%(geometry)s
%(helpers)s
inline int wait_above(const int* ctr, int after, int* seen) {
  if (threadIdx.x == 0) {
    int v;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while ((v = std::atomic_ref<int>(*const_cast<int*>(ctr)).load(std::memory_order_acquire)) <= after) {
      if (std::chrono::steady_clock::now() > give_up) std::abort();  // a deadlock fails, not hangs
      std::this_thread::yield();
    }
    *seen = v;
  }
  __syncthreads();
  return *seen;
}
%(tail)s
}  // namespace muser_attend

template <int HD, int SPAN>
static void launch(const int32_t* params, int params_len, int blocks, const float* partials,
                   float* merged, int* counters, const float* sinks, float* out, int slots) {
  std::counting_semaphore<1 << 20> resident(slots);
  std::vector<std::thread> runners;
  for (int k = 0; k < blocks; ++k) {
    runners.emplace_back([&] {
      resident.acquire();
      std::barrier<> barrier(muser_attend::THREADS);
      std::vector<unsigned char> smem(muser_attend::smem_bytes(HD, SPAN) + 16);
      const uintptr_t at16 = (reinterpret_cast<uintptr_t>(smem.data()) + 15) & ~uintptr_t(15);
      unsigned char* base = reinterpret_cast<unsigned char*>(at16);
      const unsigned task = static_cast<unsigned>(atomicAdd(counters, 1));  // the ticket: taken on start
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < muser_attend::THREADS; ++t) {
        threads.emplace_back([&, t] {
          threadIdx.x = t;
          block_barrier = &barrier;
          block_smem = base;
          const muser_attend::Block at(params, params_len, SPAN, task);
          muser_attend::fold_and_combine<float, HD, SPAN>(at, sinks, params, params_len, partials, merged,
                                                           counters, out);
        });
      }
      for (auto& th : threads) th.join();
      resident.release();
    });
  }
  for (auto& r : runners) r.join();
}

extern "C" void run_tail(int hd, int span, const int32_t* params, int params_len, int blocks,
                         const float* partials, float* merged, int* counters, const float* sinks,
                         float* out, int slots, int sms) {
  gridDim.x = blocks;
  host_sms = sms;
  if (hd == 64 && span == 1) launch<64, 1>(params, params_len, blocks, partials, merged, counters, sinks, out, slots);
  if (hd == 64 && span == 4) launch<64, 4>(params, params_len, blocks, partials, merged, counters, sinks, out, slots);
  if (hd == 128 && span == 1) launch<128, 1>(params, params_len, blocks, partials, merged, counters, sinks, out, slots);
}
"""


def cut(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end)]


def shim() -> str:
    """The header's geometry, Block, the tail's helpers and fold_and_combine,
    exactly as the header has them (only its shared memory's declaration and
    the wait's PTX load are the stand-in's)."""
    text = HEADER.read_text()
    smem = "  extern __shared__ __align__(16) unsigned char muser_attend_smem[];\n"
    tail = cut(text, "// Shared memory of the second half", "// Decode attention in one launch")
    resident = int(re.search(r"constexpr int RESIDENT = (\d+);", text).group(1))
    assert tail.count(smem) == 1
    return SHIM % dict(
        warps=attention_cuda.WARPS, threads=THREADS, rows=ROWS, tk=attention_cuda.TILE_KEYS,
        stages=attention_cuda.STAGES, fold=FOLD, resident=resident,
        geometry=cut(text, "__host__ __device__ constexpr int pitch(int hd)", "// The first pass for one block"),
        helpers=cut(text, "// Member j of m's share", "// Thread 0 waits until"),
        tail=tail.replace(smem, "  unsigned char* muser_attend_smem = block_smem;\n"))


@pytest.fixture(scope="module")
def lib():
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    out = build_library(shim(), ("-std=c++20", "-O2", "-ffp-contract=off", "-pthread", "-Wno-unknown-pragmas"))
    f32p = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
    i32p = np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS")
    out.run_tail.argtypes = [ctypes.c_int, ctypes.c_int, i32p, ctypes.c_int, ctypes.c_int, f32p, f32p, i32p,
                             f32p, f32p, ctypes.c_int, ctypes.c_int]
    return out


_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
_LIBM.expf.restype = ctypes.c_float
_LIBM.expf.argtypes = [ctypes.c_float]


def expf(x: np.ndarray) -> np.ndarray:
    """The C library's expf, element by element (the stand-in's expf)."""
    return np.array([_LIBM.expf(float(v)) for v in np.ravel(x)], np.float32).reshape(np.shape(x))


def weigh(m: np.ndarray):
    """Per row (last axis), sources on axis 0: the max, and each source's
    weight exp(m - max) (-inf for a source of max -inf)."""
    top = np.full(m.shape[1:], -np.inf, np.float32)
    for k in range(m.shape[0]):
        top = np.maximum(top, m[k])
    w = np.full(m.shape, -np.inf, np.float32)
    live = m != -np.inf
    w[live] = expf((m - top)[live])
    return top, w


def ascending(w: np.ndarray, v: np.ndarray) -> np.ndarray:
    """sum_k w[k] * v[k] in ascending k, in float32, -inf weights skipped."""
    acc = np.zeros(v.shape[1:], np.float32)
    for k in range(v.shape[0]):
        live = w[k] != -np.inf
        acc[live] = (acc[live] + (w[k][live] * v[k][live]).astype(np.float32)).astype(np.float32)
    return acc


def rule(partials, counts, sinks, g, hd):
    """The output [B, Hkv, nG, D] the launch must give, by the rule."""
    b_, hkv, _, ng, _ = partials.shape
    out = np.zeros((b_, hkv, ng, hd), np.float32)
    for b in range(b_):
        folds = -(-counts[b] // FOLD)
        for h in range(hkv):
            fo, fm, fl = [], [], []
            for f in range(folds):
                p = partials[b, h, f * FOLD:min(f * FOLD + FOLD, counts[b])]
                top, w = weigh(p[..., hd])
                fo.append(ascending(w[..., None].repeat(hd, -1), p[..., :hd]))
                fm.append(top)
                fl.append(ascending(w, p[..., hd + 1]))
            if not folds:
                continue
            m = np.stack(fm)
            top = m.max(axis=0)
            if sinks is not None:
                sink = sinks[h * g + np.arange(ng) % g]
                top = np.maximum(top, sink)
            top = top.astype(np.float32)
            w = np.full(m.shape, -np.inf, np.float32)
            live = m != -np.inf
            w[live] = expf((m - top)[live])
            total = ascending(w, np.stack(fl))
            if sinks is not None:
                total = (total + expf(sink - top)).astype(np.float32)
            o = ascending(w[..., None].repeat(hd, -1), np.stack(fo))
            safe = np.where(total > 0, total, np.float32(1))[:, None]
            out[b, h] = np.where(total[:, None] > 0, (o / safe).astype(np.float32), np.float32(0))
    return out


CASES = [  # hd, span, B, Hkv, G, n, max_chunks, counts, sinks, slots
    (64, 1, 1, 1, 16, 1, 1, [1], False, 16),
    (64, 1, 2, 2, 5, 1, 17, [17, 3], False, 16),
    (64, 1, 2, 1, 16, 2, 40, [40, 21], True, 16),
    (64, 1, 1, 2, 16, 1, 12, [12], False, 12),  # as many resident blocks as a group has
    (64, 4, 2, 2, 5, 1, 33, [33, 16], False, 16),
    (64, 4, 1, 1, 16, 2, 16, [16], True, 16),
    (128, 1, 1, 2, 16, 1, 37, [37], False, 64),
    (128, 1, 1, 1, 3, 1, 5, [0], False, 16),  # a sequence that sees nothing: zeros
]


@pytest.mark.parametrize("sms", [1000, 4, 1], ids=["spread", "last-wave", "alone"])
@pytest.mark.parametrize("hd,span,b,hkv,g,n,max_chunks,counts,with_sinks,slots", CASES)
def test_fold_and_combine_are_the_rule_bit_for_bit(lib, hd, span, b, hkv, g, n, max_chunks, counts,
                                                   with_sinks, slots, sms):
    """``sms``: every group spread (its blocks share the fold and the combine),
    the groups of the last ``RESIDENT * sms`` tasks spread and earlier ones
    folded by their last block, or (1 SM) almost none spread."""
    rng = np.random.default_rng(hd + span * 7 + max_chunks * 31 + b * 1000 + g)
    ng = n * g
    partials = rng.standard_normal((b, hkv, max_chunks, ng, hd + 2)).astype(np.float32)
    partials[..., hd] *= 4  # maxes that differ
    partials[..., hd + 1] = np.abs(partials[..., hd + 1]) + 0.5
    unseen = rng.random((b, hkv, max_chunks, ng)) < 0.15  # a row that saw no key of the chunk
    partials[unseen] = 0.0
    partials[..., hd][unseen] = -np.inf
    for i, c in enumerate(counts):  # chunks a sequence does not hold: never read
        partials[i, :, c:] = np.nan
    sinks = (rng.standard_normal(hkv * g) * 2).astype(np.float32) if with_sinks else None
    if sinks is not None:
        sinks[::2] += 40  # heads whose sink is above every fold's max: it sets the weights' max
    params = [b, hkv, g, n, hd, CHUNK, max_chunks, 0, int(with_sinks)]
    for i, c in enumerate(counts):  # end = held = c chunks' keys: chunk_count gives c
        params += [i, c * CHUNK, c * CHUNK, 0, c * CHUNK]
    params = np.array(params, np.int32)
    groups = -(-max_chunks // FOLD)
    merged = np.full((b, hkv, groups, ng, hd + 2), np.nan, np.float32)
    counters = np.zeros(attention_cuda.counter_count(b, hkv, max_chunks, ng), np.int32)
    out = np.full((b, hkv * g, n, hd), np.nan, np.float32)
    _, _, blocks = attention_cuda.launch_geometry(b, hkv, max_chunks, ng, span)
    lib.run_tail(hd, span, params, params.size, blocks, partials, merged, counters,
                 sinks if sinks is not None else np.zeros(1, np.float32), out, slots, sms)
    assert counters[0] == blocks  # every block took one ticket
    want = rule(partials, counts, sinks, g, hd)  # [B, Hkv, nG, D], row r = i * G + g
    want = want.reshape(b, hkv, n, g, hd).transpose(0, 1, 3, 2, 4).reshape(b, hkv * g, n, hd)
    assert not np.isnan(out).any(), "an output element was not written (or read a NaN partial)"
    bad = np.argwhere(out.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{len(bad)} elements differ, the first at {bad[0]}: {out[tuple(bad[0])]} " \
                          f"against {want[tuple(bad[0])]}"
