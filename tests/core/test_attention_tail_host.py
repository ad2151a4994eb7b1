"""The tail of decode attention's tensor-core launch, its own text run on the CPU.

``kernels/attend_mma.h``'s ``stage_rows``, ``staged_sums`` and ``write_rows``
(the fold's and the combine's weighted sums, the output's division and write)
are cut from the header as they are and compiled by g++ behind a small CUDA
stand-in: one std::thread per CUDA thread (128), ``__syncthreads`` a
std::barrier, cp.async a copy, L2 loads plain loads. Each sum must be the
rule's bits: over the sources in ascending order, ``acc += w * v`` in float32
(``-ffp-contract=off`` on both sides), a source of weight -inf skipped unread
(its values are NaN here), whatever the batch the stage takes, for row counts
and alignments the GPU check's cases never reach: an odd number of rows (a
source of 2 mod 4 floats) and sources only 8-byte aligned (``step`` of an odd
count of pairs), which a model with 5 query heads a K/V head gives at n = 1.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest
from host_kernels import build_library

from muser_kv.core import attention_cuda

THREADS, ROWS = attention_cuda.THREADS, attention_cuda.ROWS
HEADER = Path(attention_cuda.__file__).resolve().parents[2] / "kernels" / "attend_mma.h"

SHIM = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#define __device__
#define __host__
#define __forceinline__ inline
struct Dim { unsigned x; };
thread_local Dim threadIdx;
static std::barrier<>* block_barrier;
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float __ldcg(const float* p) { return *p; }
inline float2 __ldcg(const float2* p) { return *p; }
using std::max;
using std::min;
namespace muser_attend {
constexpr int THREADS = %(threads)d;
constexpr int ROWS = %(rows)d;
inline float neg_inf() { return -INFINITY; }
inline uintptr_t smem_addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }
inline void cp_async16(uintptr_t dst, const void* src) { std::memcpy(reinterpret_cast<void*>(dst), src, 16); }
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
%(helpers)s
}  // namespace muser_attend

template <typename F>
static void block(F body) {
  std::barrier<> barrier(muser_attend::THREADS);
  block_barrier = &barrier;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < muser_attend::THREADS; ++t) {
    threads.emplace_back([&body, t] { threadIdx.x = t; body(t); });
  }
  for (auto& th : threads) th.join();
}

template <int E, int PER_ROW, int OUTW>
static void sums(const float* src, long long step, const float* weight, int elems, int sources,
                 int floats, int batch, float* out) {
  std::vector<float> stage_mem(static_cast<size_t>(batch) * ((floats + 3) & ~3) + 4);
  float* stage = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(stage_mem.data()) + 15) & ~uintptr_t(15));
  block([&](unsigned t) {
    float acc[E][2];
    muser_attend::staged_sums<E, PER_ROW, OUTW>(acc, src, step, weight, elems, sources, floats, stage, batch);
    for (int j = 0; j < E; ++j) {
      out[(t * E + j) * 2] = acc[j][0];
      out[(t * E + j) * 2 + 1] = acc[j][1];
    }
  });
}

extern "C" void run_sums(int hd, int fold, const float* src, long long step, const float* weight,
                         int elems, int sources, int floats, int batch, float* out) {
  constexpr int T = muser_attend::THREADS, R = muser_attend::ROWS;
  if (hd == 128 && fold) sums<(R * 65 + T - 1) / T, 65, 130>(src, step, weight, elems, sources, floats, batch, out);
  if (hd == 128 && !fold) sums<(R * 64 + T - 1) / T, 64, 130>(src, step, weight, elems, sources, floats, batch, out);
  if (hd == 64 && fold) sums<(R * 33 + T - 1) / T, 33, 66>(src, step, weight, elems, sources, floats, batch, out);
  if (hd == 64 && !fold) sums<(R * 32 + T - 1) / T, 32, 66>(src, step, weight, elems, sources, floats, batch, out);
}

extern "C" void run_write(int hd, float* out, const long long* orow, const float* res, const float* total,
                          int rows_out) {
  const int64_t* rows = reinterpret_cast<const int64_t*>(orow);
  block([&](unsigned) {
    if (hd == 128) muser_attend::write_rows<float, 128>(out, rows, res, total, rows_out);
    if (hd == 64) muser_attend::write_rows<float, 64>(out, rows, res, total, rows_out);
  });
}
"""


def helpers_text() -> str:
    """stage_rows .. write_rows, exactly as the header has them."""
    text = HEADER.read_text()
    start = text.index("__device__ __forceinline__ void stage_rows(")
    end = text.index("// Shared memory of the second half")
    return text[start:end]


@pytest.fixture(scope="module")
def lib():
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    out = build_library(SHIM % dict(threads=THREADS, rows=ROWS, helpers=helpers_text()),
                        ("-std=c++20", "-O2", "-ffp-contract=off", "-pthread", "-Wno-unknown-pragmas"))
    f32p = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
    out.run_sums.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, f32p,
                             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, f32p]
    out.run_write.argtypes = [ctypes.c_int, f32p, np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS"),
                              f32p, f32p, ctypes.c_int]
    return out


def expected_sums(src, step, weight, rows_out, outw, per_row, sources):
    """The rule: per element, sources ascending, acc = f32(acc + f32(w * v)), -inf skipped."""
    e = np.arange(rows_out * per_row)
    r, col = e // per_row, 2 * (e % per_row)
    acc = np.zeros((e.size, 2), np.float32)
    for s in range(sources):
        w = weight[s * ROWS + r]
        v = np.stack([src[s * step + r * outw + col], src[s * step + r * outw + col + 1]], axis=1)
        live = w != -np.inf
        acc[live] = (acc[live] + (w[live, None] * v[live]).astype(np.float32)).astype(np.float32)
    return acc


@pytest.mark.parametrize("hd", [128, 64])
@pytest.mark.parametrize("fold", [True, False], ids=["fold", "combine"])
@pytest.mark.parametrize("rows_out", [16, 5, 1])
@pytest.mark.parametrize("sources,batch", [(16, 8), (9, 8), (33, 7), (5, 1), (7, 3)])
@pytest.mark.parametrize("offset", [0, 2], ids=["aligned", "8-byte"])
def test_staged_sums_are_the_rule_bit_for_bit(lib, hd, fold, rows_out, sources, batch, offset):
    rng = np.random.default_rng(hd * 1000 + rows_out * 100 + sources + batch + offset)
    outw = hd + 2
    per_row = outw // 2 if fold else hd // 2
    step = (rows_out + 3) * outw  # rows of other tiles between sources (odd pairs at rows_out + 3 odd)
    floats = rows_out * outw
    base = np.full(offset + sources * step + 8, np.nan, np.float32)
    src = base[offset:]
    for s in range(sources):
        src[s * step:s * step + floats] = rng.standard_normal(floats).astype(np.float32)
    weight = np.exp(rng.standard_normal(sources * ROWS)).astype(np.float32)
    dead = rng.random(sources * ROWS) < 0.2
    weight[dead] = -np.inf
    for s in range(sources):  # a skipped source's values are never read: NaN there
        for r in range(rows_out):
            if weight[s * ROWS + r] == -np.inf:
                src[s * step + r * outw:s * step + (r + 1) * outw] = np.nan
    elems = rows_out * per_row
    e_per = -(-ROWS * per_row // THREADS)
    out = np.zeros(THREADS * e_per * 2, np.float32)
    lib.run_sums(hd, int(fold), src.ctypes.data, step, weight, elems, sources, floats, batch, out)
    got = out.reshape(THREADS, e_per, 2).transpose(1, 0, 2).reshape(-1, 2)[:elems]
    want = expected_sums(src, step, weight, rows_out, outw, per_row, sources)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
        f"first difference at element {np.argwhere(got.view(np.uint32) != want.view(np.uint32))[0]}"


@pytest.mark.parametrize("hd", [128, 64])
@pytest.mark.parametrize("rows_out", [16, 5])
def test_write_rows_divides_every_row_by_its_total(lib, hd, rows_out):
    rng = np.random.default_rng(hd + rows_out)
    res = rng.standard_normal(ROWS * hd).astype(np.float32)
    total = np.exp(rng.standard_normal(ROWS)).astype(np.float32)
    total[1] = 0.0  # a row that saw nothing: 0
    orow = (rng.permutation(ROWS) * hd * 2).astype(np.int64)  # rows anywhere in the output
    out = np.full(ROWS * hd * 2, -7.0, np.float32)
    lib.run_write(hd, out, orow, res, total, rows_out)
    for r in range(ROWS):
        row = out[orow[r]:orow[r] + hd]
        if r >= rows_out:
            assert (row == -7.0).all()  # rows past the tile's are not written
            continue
        part = res[r * hd:(r + 1) * hd]
        want = part / total[r] if total[r] > 0 else np.zeros_like(part)
        assert np.array_equal(row.view(np.uint32), want.view(np.uint32)), r
