// muser-kv decode attention, first pass, CUDA tensor-core form (header: file scope).
//
// One threadblock (4 warps, 128 threads) per (sequence b, K/V head h, SPAN
// consecutive chunks from c, M tile mt), taking its chunks in turn: the M tile
// is 16 query rows r = i*G + g (token i, head g of the group) of the n*G rows
// that share K/V head h. The chunk's CHUNK keys (by
// logical position) are split into tiles of 16; warp w owns the CHUNK/64
// consecutive tiles starting at key w*CHUNK/4 of the chunk and runs its own
// online softmax over them in ascending position; the 4 warps' (m, l, o) are
// then combined in warp order 0..3 through shared memory. Every sum is thus a
// fixed function of the chunk's keys and positions: not of the grid, B, the
// slot, the strides, the ring's origin or max_chunks.
//
// Data path per warp: cp.async (16 bytes a lane, coalesced rows) of a tile's
// K and V rows into a 2-stage shared ring, padded rows (D + 8 halves) so that
// ldmatrix reads are free of bank conflicts. S = Q K^T and O += P V run on
// mma.sync m16n8k16 (P in, f32 accumulate): Q's A fragments and K's B
// fragments by ldmatrix, P's A fragments straight from the S accumulators
// (FlashAttention-2's register reuse), V's B fragments by ldmatrix.trans.
//
// Positions a sequence does not hold, and positions before the first any of
// its queries sees, are never read: their shared rows are zeroed instead, and
// their scores are -inf whatever the row holds (a select, never a multiply).
// MUSER_ATTEND_TIMELINE (benchmarks/attention_mma_check.py --timeline defines it
// in its own build): each block's thread 0 stamps %globaltimer at its phases
// into an extra output, timeline[block * 16 + i] (15: the SM). Off, the stamps
// are nothing.
#ifdef MUSER_ATTEND_TIMELINE
#define MUSER_TL_PARAM , unsigned long long* timeline
#define MUSER_TL_ARG , timeline
#define MUSER_STAMP(i)                                                            \
  do {                                                                            \
    if (threadIdx.x == 0) {                                                       \
      unsigned long long t_;                                                      \
      unsigned int sm_;                                                           \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                      \
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));                            \
      timeline[static_cast<int64_t>(blockIdx.x) * 16 + (i)] = t_;                 \
      timeline[static_cast<int64_t>(blockIdx.x) * 16 + 15] = sm_;                 \
    }                                                                             \
  } while (0)
#else
#define MUSER_TL_PARAM
#define MUSER_TL_ARG
#define MUSER_STAMP(i) \
  do {                 \
  } while (0)
#endif

namespace muser_attend {

constexpr int WARPS = 4;     // warps per block; each owns CHUNK / 4 keys
constexpr int THREADS = 32 * WARPS;
constexpr int ROWS = 16;     // query rows per M tile (mma's M)
constexpr int TK = 16;       // keys per tile (two n8 tiles for S, one k16 step for PV)
constexpr int STAGES = 2;    // cp.async ring depth per warp (attention_cuda.STAGES)
constexpr int FOLD = 16;     // chunks folded into one partial (core.attention.FOLD)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8j..8j+7 give the row addresses of matrix j.
// Register j of lane (g = lane/4, t = lane%4) receives matrix j's row g,
// columns 2t, 2t+1 (.trans: rows 2t, 2t+1 of column g), lower index in the
// lower half.
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// d += a * b, m16n8k16, row.col, f32 accumulate. Fragments (lane = 4g + t):
// a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g];
// d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1].
template <typename P>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // Round (lo, hi) to P (nearest even) as one A register; lo/hi become the
  // rounded values, so that l sums exactly the weights the mma applies.
  static __device__ __forceinline__ unsigned short bits(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  static __device__ __forceinline__ uint32_t pack(float& lo, float& hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    lo = __low2float(v);
    hi = __high2float(v);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned short bits(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
  static __device__ __forceinline__ uint32_t pack(float& lo, float& hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    lo = __low2float(v);
    hi = __high2float(v);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <typename A, typename B>
struct Same {
  static constexpr bool value = false;
};
template <typename A>
struct Same<A, A> {
  static constexpr bool value = true;
};

// A query element as P's bits: a copy when the queries are of type P already,
// else one round to nearest even (through f32, exact for f32, f16, bf16).
template <typename T, typename P>
__device__ __forceinline__ unsigned short query_bits(const T* q, int64_t at) {
  if constexpr (Same<T, P>::value) {
    return reinterpret_cast<const unsigned short*>(q)[at];
  } else {
    return Mma<P>::bits(static_cast<float>(q[at]));
  }
}

// Dynamic shared memory the kernel needs for head_dim HD (the launcher's
// shared_memory): Q tile, each warp's K/V ring, the combine's weights.
__host__ __device__ constexpr int pitch(int hd) { return hd + 8; }  // halves per shared row
__host__ __device__ constexpr int q_bytes(int hd) { return ROWS * pitch(hd) * 2; }
__host__ __device__ constexpr int warp_bytes(int hd) { return STAGES * 2 * TK * pitch(hd) * 2; }
__host__ __device__ constexpr int comb_bytes() { return ROWS * 8 * 4; }
// A warp's (m, l, o) for the combine of the chunk's four warps: in the warp's
// own ring when the block has one chunk (the ring is no longer read then), in
// a region of its own when the next chunk's tiles are already in the ring.
__host__ __device__ constexpr int scratch_bytes(int hd) { return 4 * (2 * ROWS + ROWS * (hd + 8)); }
__host__ __device__ constexpr int smem_bytes(int hd, int span) {
  return q_bytes(hd) + WARPS * warp_bytes(hd) + comb_bytes() + (span > 1 ? WARPS * scratch_bytes(hd) : 0);
}

// The sequence's chunk range a block's (b, .., mt) sees: how many chunks hold
// a key some query sees (core.attention.KeyRead.chunks), at most max_chunks.
__device__ __forceinline__ int chunk_count(int end, int held, int n, int window, int chunk,
                                           int max_chunks) {
  const int start = end - held;
  const int lo = window > 0 ? max(start, end - n - window + 1) : start;
  if (chunk <= 0) return max_chunks;  // partials of NaN: carry them to the output
  return lo >= end ? 0 : min(max_chunks, (end - 1) / chunk - lo / chunk + 1);
}

// What a block is: the params' header, and this block's (b, h, span, mt) and
// sequence, decoded from blockIdx (the grid's order: mt fastest, then the
// span of `span` chunks, the K/V head, the sequence). c: the span's first
// chunk; chunks: how many of its chunks are below max_chunks. A span never
// straddles two fold groups (span divides FOLD).
struct Block {
  int B, Hkv, G, n, CHUNK, max_chunks, window, nG, MT, mt, c, chunks, h, b;
  const int32_t* seq;  // slot, end, held, origin, wrap

  __device__ __forceinline__ Block(const int32_t* params, int params_len, int span) {
    B = params[0], Hkv = params[1], G = params[2], n = params[3];
    CHUNK = params[5], max_chunks = params[6], window = params[7];
    nG = n * G;
    MT = (nG + ROWS - 1) / ROWS;
    // 32-bit unsigned: a 64-bit division is a long subroutine
    unsigned blk = blockIdx.x;
    mt = static_cast<int>(blk % static_cast<unsigned>(MT));
    blk /= static_cast<unsigned>(MT);
    const unsigned spans = static_cast<unsigned>((max_chunks + span - 1) / span);
    c = static_cast<int>(blk % spans) * span;
    chunks = min(span, max_chunks - c);
    blk /= spans;
    h = static_cast<int>(blk % static_cast<unsigned>(Hkv));
    b = static_cast<int>(blk / static_cast<unsigned>(Hkv));
    seq = params + (params_len - 5 * B) + 5 * (b < B ? b : 0);
  }
};

// The first pass for one block; see the top of this file and
// muser_kv/core/attention_cuda.py for the layout of params and partials.
// Queries of type T (f32, f16 or bf16: rounded to P for the mma), K/V of type
// P (f16 or bf16). Strides are in elements. params_len: params' length, whose
// header is 8 ints (B .. window) or 9 (the combine's sinks flag at [8]): the
// sequences' five ints each end it. Needs blockDim.x == THREADS and
// smem_bytes(HD, SPAN) bytes of dynamic shared memory. A block takes SPAN
// consecutive chunks in turn, each exactly as a block of its own would (its
// own partial, the same sums): the warps' copies run on into the next chunk's
// tiles while the block combines and writes the last one's.
template <typename T, typename P, int HD, int SPAN>
__device__ __forceinline__ void attend_partials(
    const Block& at, const T* queries, int64_t qs0, int64_t qs1, int64_t qs2, int64_t qs3,
    const P* keys, int64_t ks0, int64_t ks1, int64_t ks2, int64_t ks3,
    const P* values, int64_t vs0, int64_t vs1, int64_t vs2, int64_t vs3,
    const float* scale_in, const int32_t* params, int params_len, float* partials MUSER_TL_PARAM) {
  MUSER_STAMP(0);  // the block starts
  static_assert(HD % 16 == 0 && HD >= 16 && HD <= 256, "head_dim: a multiple of 16, at most 256");
  constexpr int PITCH = pitch(HD);
  constexpr int VPR = HD / 8;  // 16-byte vectors per K/V row
  constexpr int OUTW = HD + 2; // o, m, l
  constexpr int OPITCH = HD + 8;  // floats per row of a warp's o in the combine
  static_assert(scratch_bytes(HD) == 4 * (2 * ROWS + ROWS * OPITCH), "the combine's scratch");
  static_assert(scratch_bytes(HD) <= warp_bytes(HD), "combine scratch fits a warp's ring");
  static_assert(SPAN >= 1 && FOLD % SPAN == 0, "a span lies in one fold group");

  extern __shared__ __align__(16) unsigned char muser_attend_smem[];
  unsigned short* q_s = reinterpret_cast<unsigned short*>(muser_attend_smem);
  unsigned char* rings = muser_attend_smem + q_bytes(HD);
  float* comb = reinterpret_cast<float*>(rings + WARPS * warp_bytes(HD));
  // warp w's (m, l, o) for the combine: scr + w * scr_stride (see scratch_bytes)
  unsigned char* const scr = SPAN == 1 ? rings : reinterpret_cast<unsigned char*>(comb + ROWS * 8);
  constexpr int scr_stride = SPAN == 1 ? warp_bytes(HD) : scratch_bytes(HD);

  const int B = at.B, Hkv = at.Hkv, G = at.G, n = at.n, CHUNK = at.CHUNK, window = at.window;
  const int max_chunks = at.max_chunks, nG = at.nG, mt = at.mt, c = at.c, h = at.h, b = at.b;
  const int chunks = at.chunks;
  if (b >= B) return;

  const int32_t* seq = at.seq;
  const int slot = seq[0], end = seq[1], held = seq[2], origin = seq[3], wrap = seq[4];
  const int start = end - held;  // first position held
  const int lo = window > 0 ? max(start, end - n - window + 1) : start;  // first position seen

  const int tid = threadIdx.x;
  const int rows_out = min(ROWS, nG - ROWS * mt);
  // chunk c + j's partial: out + j * step
  float* out = partials + ((static_cast<int64_t>(b * Hkv + h) * max_chunks + c) * nG + ROWS * mt) * OUTW;
  const int64_t step = static_cast<int64_t>(nG) * OUTW;

  if (CHUNK <= 0 || CHUNK % (WARPS * TK) != 0) {  // not a tiling of the chunk: say so loudly
    for (int j = 0; j < chunks; ++j) {
      for (int e = tid; e < rows_out * OUTW; e += THREADS) out[j * step + e] = __int_as_float(0x7fc00000);
    }
    return;
  }
  const int first = lo / CHUNK;
  const int count = chunk_count(end, held, n, window, CHUNK, max_chunks);
  // chunks c .. c + live - 1 hold keys; the rest get m = -inf, l = 0, o = 0
  const int live = max(0, min(chunks, count - c));
  for (int j = live; j < chunks; ++j) {
    for (int e = tid; e < rows_out * OUTW; e += THREADS) {
      out[j * step + e] = (e % OUTW == HD) ? neg_inf() : 0.0f;
    }
  }
  if (live == 0) return;  // block-uniform

  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int per_chunk = CHUNK / (WARPS * TK);  // a warp's tiles of one chunk
  const int tiles = live * per_chunk;          // ... of the span, in turn
  const int warp_pos = (first + c) * CHUNK + warp * per_chunk * TK;
  // the first position of the warp's tile `tile` (chunk tile / per_chunk)
  auto tile_pos = [&](int tile) {
    return warp_pos + (tile / per_chunk) * CHUNK + (tile % per_chunk) * TK;
  };
  unsigned char* ring = rings + warp * warp_bytes(HD);

  // Positions each of this lane's two rows (g, g + 8) sees: [rlo, rhi].
  int rlo[2], rhi[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int R = ROWS * mt + g + 8 * k;
    if (R < nG) {
      const int qpos = end - n + R / G;
      rlo[k] = window > 0 ? max(start, qpos - window + 1) : start;
      rhi[k] = qpos;
    } else {
      rlo[k] = 1;
      rhi[k] = 0;  // sees nothing
    }
  }

  // 16-byte copies need 16-byte aligned rows; otherwise copy element by element
  // (slower, the same bits in shared memory).
  const bool vec16 =
      ((reinterpret_cast<unsigned long long>(keys) | reinterpret_cast<unsigned long long>(values)) &
       15) == 0 &&
      ks3 == 1 && vs3 == 1 && ((ks0 | ks1 | ks2 | vs0 | vs1 | vs2) & 7) == 0;
  const unsigned short* kraw = reinterpret_cast<const unsigned short*>(keys);
  const unsigned short* vraw = reinterpret_cast<const unsigned short*>(values);
  const int64_t kbase = static_cast<int64_t>(slot) * ks0 + static_cast<int64_t>(h) * ks1;
  const int64_t vbase = static_cast<int64_t>(slot) * vs0 + static_cast<int64_t>(h) * vs1;

  // A tile is loaded and computed iff it holds a position in [lo, end).
  auto tile_live = [&](int tile) {
    const int p0 = tile_pos(tile);
    return p0 + TK > lo && p0 < end;
  };
  auto issue = [&](int tile) {
    if (!tile_live(tile)) return;
    const int p0 = tile_pos(tile);
    unsigned short* k_s = reinterpret_cast<unsigned short*>(ring + (tile % STAGES) * 2 * TK * PITCH * 2);
    unsigned short* v_s = k_s + TK * PITCH;
    for (int e = lane; e < TK * VPR; e += 32) {
      const int key = e / VPR, col = (e % VPR) * 8;
      const int p = p0 + key;
      unsigned short* kd = k_s + key * PITCH + col;
      unsigned short* vd = v_s + key * PITCH + col;
      if (p >= lo && p < end) {
        // the ring's row of position p (p >= lo >= start: the offset is >= 0)
        const int64_t row = (static_cast<unsigned>(origin) + static_cast<unsigned>(p - start)) %
                            static_cast<unsigned>(wrap);
        const int64_t ko = kbase + row * ks2, vo = vbase + row * vs2;
        if (vec16) {
          cp_async16(smem_addr(kd), kraw + ko + col);
          cp_async16(smem_addr(vd), vraw + vo + col);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            kd[j] = kraw[ko + (col + j) * ks3];
            vd[j] = vraw[vo + (col + j) * vs3];
          }
        }
      } else {
        *reinterpret_cast<uint4*>(kd) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(vd) = make_uint4(0, 0, 0, 0);
      }
    }
  };

  // Prologue: the first STAGES tiles in flight, one commit group each (empty
  // groups included, so that group t is always tile t); the Q tile is read
  // while they fly.
#pragma unroll
  for (int st = 0; st < STAGES; ++st) {
    if (st < tiles) issue(st);
    cp_async_commit();
  }

  // Q tile [16][HD] as P's 16-bit patterns; rows past n*G are +0. Each row's
  // offset is computed once (comb is not used before the first chunk is
  // done); a thread's loads (up to 16) are all issued before it stores one: a
  // round trip to memory, behind the K/V copies just issued.
  int64_t* qrow = reinterpret_cast<int64_t*>(comb);
  if (tid < ROWS && ROWS * mt + tid < nG) {
    const int R = ROWS * mt + tid;
    qrow[tid] = b * qs0 + (h * G + R % G) * qs1 + (R / G) * qs2;
  }
  __syncthreads();
  constexpr int QPT = ROWS * HD / THREADS;  // elements a thread moves
  constexpr int QB = QPT < 16 ? QPT : 16;   // ... in flight at once
  static_assert(QPT * THREADS == ROWS * HD && QPT % QB == 0, "the Q tile's split");
#pragma unroll
  for (int k0 = 0; k0 < QPT; k0 += QB) {
    unsigned short v[QB];
#pragma unroll
    for (int k = 0; k < QB; ++k) {
      const int e = tid + (k0 + k) * THREADS;
      const int r = e / HD;
      v[k] = ROWS * mt + r < nG ? query_bits<T, P>(queries, qrow[r] + (e % HD) * qs3) : 0;
    }
#pragma unroll
    for (int k = 0; k < QB; ++k) {
      const int e = tid + (k0 + k) * THREADS;
      q_s[(e / HD) * PITCH + e % HD] = v[k];
    }
  }

  __syncthreads();  // q_s written
  MUSER_STAMP(1);

  float o[HD / 8][4];
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {neg_inf(), neg_inf()};
  float l[2] = {0.0f, 0.0f};  // this lane's share; the quad's sum at the end
  const float scale = scale_in[0];

  // ldmatrix row addresses of this lane (see ldsm_x4): Q as A (matrices: rows
  // 0-7|8-15 x cols 0-7, then cols 8-15), K as B of two n8 tiles (keys 0-7 x
  // d 0-7|8-15, then keys 8-15), V as B (keys 0-7|8-15 x d 0-7, then d 8-15).
  const int sel = lane / 8, r8 = lane % 8;
  const uint32_t q_lane = smem_addr(q_s + (r8 + 8 * (sel & 1)) * PITCH + 8 * (sel >> 1));
  const int k_off = (r8 + 8 * (sel >> 1)) * PITCH + 8 * (sel & 1);
  const int v_off = (r8 + 8 * (sel & 1)) * PITCH + 8 * (sel >> 1);

  // Chunk c + j is done: the warps' (m, l, o) combined in warp order 0..3 and
  // written as its partial; the accumulators start over for the next chunk.
  auto finish = [&](int j) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      l[k] += __shfl_xor_sync(0xffffffffu, l[k], 1);
      l[k] += __shfl_xor_sync(0xffffffffu, l[k], 2);
    }

    // This warp's (m, l, o) into its scratch.
    float* ms = reinterpret_cast<float*>(scr + warp * scr_stride);
    float* ls = ms + ROWS;
    float* os = ls + ROWS;  // [ROWS][OPITCH]
    if (t == 0) {
      ms[g] = m[0];
      ms[g + 8] = m[1];
      ls[g] = l[0];
      ls[g + 8] = l[1];
    }
#pragma unroll
    for (int jj = 0; jj < HD / 8; ++jj) {
      *reinterpret_cast<float2*>(os + g * OPITCH + 8 * jj + 2 * t) = make_float2(o[jj][0], o[jj][1]);
      *reinterpret_cast<float2*>(os + (g + 8) * OPITCH + 8 * jj + 2 * t) = make_float2(o[jj][2], o[jj][3]);
    }
    __syncthreads();

    // Combine warps 0..3 in order against their common max.
    if (tid < ROWS) {
      float top = neg_inf();
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        top = fmaxf(top, reinterpret_cast<const float*>(scr + w * scr_stride)[tid]);
      }
      comb[tid * 8] = top;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float mw = reinterpret_cast<const float*>(scr + w * scr_stride)[tid];
        comb[tid * 8 + 1 + w] = mw == neg_inf() ? 0.0f : expf(mw - top);
      }
    }
    __syncthreads();

    for (int e = tid; e < rows_out * OUTW; e += THREADS) {
      const int r = e / OUTW, col = e % OUTW;
      float acc;
      if (col == HD) {
        acc = comb[r * 8];
      } else {
        const int idx = col < HD ? 2 * ROWS + r * OPITCH + col : ROWS + r;  // o or l
        acc = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
          acc += comb[r * 8 + 1 + w] * reinterpret_cast<const float*>(scr + w * scr_stride)[idx];
        }
      }
      out[j * step + e] = acc;
    }
    if (SPAN > 1) {
      __syncthreads();  // every thread is done reading the scratch and comb
#pragma unroll
      for (int jj = 0; jj < HD / 8; ++jj) o[jj][0] = o[jj][1] = o[jj][2] = o[jj][3] = 0.0f;
      m[0] = m[1] = neg_inf();
      l[0] = l[1] = 0.0f;
    }
  };

  for (int tile = 0; tile < tiles; ++tile) {
    cp_async_wait<STAGES - 1>();  // this lane's copies of `tile` have landed
    __syncwarp();                 // ... and every lane's, visibly
    if (tile_live(tile)) {
      const int p0 = tile_pos(tile);
      const unsigned short* k_s =
          reinterpret_cast<const unsigned short*>(ring + (tile % STAGES) * 2 * TK * PITCH * 2);
      const uint32_t k_lane = smem_addr(k_s + k_off);
      const uint32_t v_lane = smem_addr(k_s + TK * PITCH + v_off);

      // S = Q K^T: s[nt] holds keys 8nt + 2t, +1 of rows g (0, 1) and g + 8 (2, 3).
      float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
      for (int ks = 0; ks < HD / 16; ++ks) {
        uint32_t a[4], kb[4];
        ldsm_x4(q_lane + ks * 32, a);
        ldsm_x4(k_lane + ks * 32, kb);
        Mma<P>::run(s[0], a, kb[0], kb[1]);
        Mma<P>::run(s[1], a, kb[2], kb[3]);
      }

      // Scale; -inf where the row does not see the key.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int p = p0 + 8 * nt + 2 * t + (j & 1);
          const int k = j >> 1;
          s[nt][j] = (p >= rlo[k] && p <= rhi[k]) ? s[nt][j] * scale : neg_inf();
        }
      }

      // Online softmax, row by row (k = 0: row g, k = 1: row g + 8).
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        float top = fmaxf(fmaxf(s[0][2 * k], s[0][2 * k + 1]), fmaxf(s[1][2 * k], s[1][2 * k + 1]));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
        const float m_new = fmaxf(m[k], top);
        const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // a row that saw nothing yet
        const float alpha = expf(m[k] - m_use);                   // 0 from -inf
        m[k] = m_new;
        s[0][2 * k] = expf(s[0][2 * k] - m_use);
        s[0][2 * k + 1] = expf(s[0][2 * k + 1] - m_use);
        s[1][2 * k] = expf(s[1][2 * k] - m_use);
        s[1][2 * k + 1] = expf(s[1][2 * k + 1] - m_use);
        l[k] *= alpha;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          o[j][2 * k] *= alpha;
          o[j][2 * k + 1] *= alpha;
        }
      }

      // P as the A operand of one k16 step (keys 0-15 of the tile), rounded to P.
      uint32_t pa[4];
      pa[0] = Mma<P>::pack(s[0][0], s[0][1]);
      pa[1] = Mma<P>::pack(s[0][2], s[0][3]);
      pa[2] = Mma<P>::pack(s[1][0], s[1][1]);
      pa[3] = Mma<P>::pack(s[1][2], s[1][3]);
      l[0] += (s[0][0] + s[0][1]) + (s[1][0] + s[1][1]);
      l[1] += (s[0][2] + s[0][3]) + (s[1][2] + s[1][3]);

      // O += P V, two n8 tiles of d per ldmatrix.trans.
#pragma unroll
      for (int jj = 0; jj < HD / 16; ++jj) {
        uint32_t vb[4];
        ldsm_x4_trans(v_lane + jj * 32, vb);
        Mma<P>::run(o[2 * jj], pa, vb[0], vb[1]);
        Mma<P>::run(o[2 * jj + 1], pa, vb[2], vb[3]);
      }
    }
    __syncwarp();  // every lane is done reading this stage before it is refilled
    if (tile + STAGES < tiles) issue(tile + STAGES);
    cp_async_commit();
    if (SPAN > 1 && tile % per_chunk == per_chunk - 1 && tile + 1 < tiles) {
      finish(tile / per_chunk);  // the next chunk's first tiles are in flight meanwhile
    }
  }
  cp_async_wait<0>();
  __syncwarp();
  MUSER_STAMP(2);  // this warp's tiles are done
  finish(live - 1);
}

// Copies `floats` floats (a source's rows; an even count, `src` 8-byte
// aligned) from global memory (L2: other blocks wrote them) to shared `dst`
// (16-byte aligned): 16-byte cp.async when `src` is 16-byte aligned (every
// copy in flight at once, no register held), else 8-byte loads.
__device__ __forceinline__ void stage_rows(float* dst, const float* src, int floats) {
  const int tid = threadIdx.x;
  if ((reinterpret_cast<unsigned long long>(src) & 15) == 0) {
#pragma unroll 1
    for (int i = tid; i < floats / 4; i += THREADS) cp_async16(smem_addr(dst + 4 * i), src + 4 * i);
    if (tid == 0 && floats % 4) {
      *reinterpret_cast<float2*>(dst + floats - 2) = __ldcg(reinterpret_cast<const float2*>(src + floats - 2));
    }
  } else {
#pragma unroll 4
    for (int i = tid; i < floats / 2; i += THREADS) {
      reinterpret_cast<float2*>(dst)[i] = __ldcg(reinterpret_cast<const float2*>(src) + i);
    }
  }
}

// acc[j] for element e = threadIdx.x + j * THREADS of `elems` (row e / PER_ROW,
// columns 2 * (e % PER_ROW) and the next): the sum over sources s < `sources`,
// in ascending order, of weight[s * ROWS + row] * src[s * step + row * OUTW +
// col], a source of weight -inf skipped: the fold's and the combine's
// arithmetic (kernels/attend_merge.inc, attend_combine.inc). The sources'
// `floats` floats each come into shared `stage`, `batch` sources at a time,
// all of a batch's copies in flight at once, in loops that stay loops (this
// code runs once a launch). Block-uniform arguments; every thread calls it.
template <int E, int PER_ROW, int OUTW>
__device__ __forceinline__ void staged_sums(float (&acc)[E][2], const float* src, int64_t step,
                                            const float* weight, int elems, int sources,
                                            int floats, float* stage, int batch) {
  const int tid = threadIdx.x;
  const int spitch = (floats + 3) & ~3;  // a source's floats in the stage (16-byte aligned)
#pragma unroll
  for (int j = 0; j < E; ++j) acc[j][0] = acc[j][1] = 0.0f;
#pragma unroll 1
  for (int s0 = 0; s0 < sources; s0 += batch) {
    const int nb = min(batch, sources - s0);
    __syncthreads();  // the last batch is read: the stage may be refilled
#pragma unroll 1
    for (int k = 0; k < nb; ++k) stage_rows(stage + k * spitch, src + (s0 + k) * step, floats);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll 1
    for (int k = 0; k < nb; ++k) {
      const float* in = stage + k * spitch;
      const float* wk = weight + (s0 + k) * ROWS;
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const int e = tid + j * THREADS;
        if (e < elems) {
          const int r = e / PER_ROW, col = 2 * (e % PER_ROW);
          const float w = wk[r];
          if (w != neg_inf()) {
            const float2 v = *reinterpret_cast<const float2*>(in + r * OUTW + col);
            acc[j][0] += w * v.x;
            acc[j][1] += w * v.y;
          }
        }
      }
    }
  }
}

// The M tile's output rows: res[r * HD + d] / total[r] in T (0 where the
// total is not > 0), row r at out + orow[r]. One loop for every path.
template <typename T, int HD>
__device__ __forceinline__ void write_rows(T* out, const int64_t* orow, const float* res,
                                           const float* total, int rows_out) {
#pragma unroll 1
  for (int e = threadIdx.x; e < rows_out * (HD / 2); e += THREADS) {
    const int r = e / (HD / 2), d = 2 * (e % (HD / 2));
    const float t = total[r];
    const float2 x = *reinterpret_cast<const float2*>(res + r * HD + d);
    T* o = out + orow[r] + d;
    o[0] = static_cast<T>(t > 0.0f ? x.x / t : 0.0f);
    o[1] = static_cast<T>(t > 0.0f ? x.y / t : 0.0f);
  }
}

// Shared memory of the second half, in floats from the block's K/V rings
// (no longer read), after the two counters' flags (4 ints): each output
// row's offset (int64, ROWS), the fold's max (ROWS), each row's total (ROWS),
// then the weights: the fold's [FOLD][ROWS], or the combine's weight and sum
// [groups][ROWS] each; then the stage (staged_sums), as many sources as fit.
constexpr int TAIL_FIXED = 2 * ROWS + 2 * ROWS;  // orow (as floats), ftop, totals
__host__ __device__ constexpr int ring_floats(int hd) { return WARPS * warp_bytes(hd) / 4 - 4; }
__host__ __device__ constexpr int stage_pitch(int hd) { return (ROWS * (hd + 2) + 3) & ~3; }

// The combine (kernels/attend_combine.inc) by the last fold of a (sequence,
// K/V head, M tile): `folds` folds at gin, `step` floats apart, against their
// common max (and the sink of each row's query head, when `sinks`): each
// row's total into `totals`, and the sums it divides, [rows_out][HD], into
// shared memory, whose address it returns. `wts`: the shared weights and
// stage (fold_and_combine's layout); query heads head0 + (row0 + r) % G.
template <int HD>
__device__ __forceinline__ float* combine_folds(const float* gin, int64_t step, int groups, int folds,
                                                int rows_out, int head0, int G, int row0,
                                                const float* sinks, float* wts,
                                                float* totals MUSER_TL_PARAM) {
  constexpr int OUTW = HD + 2;
  const int tid = threadIdx.x;
  const bool with_sinks = sinks != nullptr;
  float* cw = wts;                  // [groups][ROWS]: a fold's max, then its weight
  float* cl = cw + groups * ROWS;   // [groups][ROWS]: its sum
  constexpr int ML = 8;  // (m, l) pairs a thread has in flight
  for (int i0 = tid; i0 < folds * ROWS; i0 += ML * THREADS) {
    float2 ml[ML];
#pragma unroll
    for (int k = 0; k < ML; ++k) {
      const int i = i0 + k * THREADS, f = i / ROWS, r = i % ROWS;
      ml[k] = i < folds * ROWS && r < rows_out
                  ? __ldcg(reinterpret_cast<const float2*>(gin + f * step + r * OUTW + HD))
                  : make_float2(neg_inf(), 0.0f);
    }
#pragma unroll
    for (int k = 0; k < ML; ++k) {
      const int i = i0 + k * THREADS;
      if (i < folds * ROWS) {
        cw[i] = ml[k].x;
        cl[i] = ml[k].y;
      }
    }
  }
  __syncthreads();
  if (tid < rows_out) {
    const int qhead = head0 + (row0 + tid) % G;
    float top = neg_inf();
    for (int f = 0; f < folds; ++f) {
      const float m = cw[f * ROWS + tid];
      if (m > top) top = m;
    }
    const float sink = with_sinks ? sinks[qhead] : 0.0f;
    if (with_sinks && sink > top) top = sink;
    float total = 0.0f;
    for (int f = 0; f < folds; ++f) {
      const float m = cw[f * ROWS + tid];
      float w = neg_inf();
      if (m != neg_inf()) {
        w = expf(m - top);
        total += w * cl[f * ROWS + tid];
      }
      cw[f * ROWS + tid] = w;
    }
    if (with_sinks) total += expf(sink - top);
    totals[tid] = total;
  }
  MUSER_STAMP(11);  // the folds' weights
  constexpr int CE = (ROWS * (HD / 2) + THREADS - 1) / THREADS;  // a thread's elements
  const int elems = rows_out * (HD / 2);
  float* cstage = cl + groups * ROWS;
  float cacc[CE][2];
  staged_sums<CE, HD / 2, OUTW>(cacc, gin, step, cw, elems, folds, rows_out * OUTW, cstage,
                                (ring_floats(HD) - TAIL_FIXED - 2 * groups * ROWS) / stage_pitch(HD));
  MUSER_STAMP(12);  // the combine's sums
  __syncthreads();  // the stage is read: it takes the sums
#pragma unroll
  for (int j = 0; j < CE; ++j) {
    const int e = tid + j * THREADS;
    if (e < elems) {
      const int r = e / (HD / 2), d = 2 * (e % (HD / 2));
      *reinterpret_cast<float2*>(cstage + r * HD + d) = make_float2(cacc[j][0], cacc[j][1]);
    }
  }
  return cstage;
}

// The second half of one launch: the chunk partials of a (sequence, K/V head,
// M tile) folded FOLD at a time, in ascending order against the group's max,
// by the last block of each group to finish (a counter per group), then the
// folds combined in ascending order against their common max (and the sink)
// by the last fold to finish, written in T: the arithmetic of
// kernels/attend_merge.inc and attend_combine.inc, statement for statement.
// Which block comes last changes no sum: every sum runs over the partials in
// ascending order, after all of them are written. Counters: zero at launch,
// (groups + 1) per (b, h, mt); integer atomics only. A fold of a sequence's
// single group is exact (its weight against itself is exp(0) = 1), so always
// folding gives every sequence one rule whatever max_chunks the batch has.
template <typename T, int HD, int SPAN>
__device__ __forceinline__ void fold_and_combine(const Block& at, const float* sinks,
                                                 const int32_t* params, int params_len,
                                                 const float* partials, float* merged,
                                                 int* counters, T* out MUSER_TL_PARAM) {
  MUSER_STAMP(3);  // the partial is written (or the block had no key)
  constexpr int OUTW = HD + 2;
  // chunks the fold's stage holds beside its weights
  constexpr int FOLD_BATCH = (ring_floats(HD) - TAIL_FIXED - FOLD * ROWS) / stage_pitch(HD);
  static_assert(FOLD_BATCH >= 1, "the fold stages at least one chunk");
  extern __shared__ __align__(16) unsigned char muser_attend_smem[];
  int* flags = reinterpret_cast<int*>(muser_attend_smem + q_bytes(HD));
  float* scratch = reinterpret_cast<float*>(flags + 4);  // the K/V rings, no longer read
  int64_t* orow = reinterpret_cast<int64_t*>(scratch);  // [ROWS]
  float* ftop = scratch + 2 * ROWS;                      // [ROWS]
  float* totals = ftop + ROWS;                           // [ROWS]
  float* wts = scratch + TAIL_FIXED;                     // the weights, then the stage

  const int Hkv = at.Hkv, G = at.G, n = at.n, max_chunks = at.max_chunks, nG = at.nG, MT = at.MT;
  const int mt = at.mt, c = at.c, h = at.h, b = at.b;
  if (b >= at.B) return;
  const bool with_sinks = params_len - 5 * at.B == 9 && params[8] != 0;
  const int count = chunk_count(at.seq[1], at.seq[2], n, at.window, at.CHUNK, max_chunks);
  const int tid = threadIdx.x;
  const int rows_out = min(ROWS, nG - ROWS * mt);
  const int groups = (max_chunks + FOLD - 1) / FOLD;
  const int gi = c / FOLD;
  int* ctr = counters + (static_cast<int64_t>(b * Hkv + h) * MT + mt) * (groups + 1);
  const int64_t step = static_cast<int64_t>(nG) * OUTW;  // one chunk (or fold) further
  const int floats = rows_out * OUTW;                     // a chunk's (or fold's) rows

  // This block's partial is written; the last of its group folds the group.
  __threadfence();
  __syncthreads();
  // (the block's chunks count at once: its span lies in group gi)
  if (tid == 0) flags[0] = atomicAdd(ctr + gi, at.chunks) + at.chunks == min(FOLD, max_chunks - gi * FOLD);
  __syncthreads();
  if (!flags[0]) return;
  __threadfence();
  MUSER_STAMP(4);  // the last of its group: the fold starts

  // Each output row's offset; the chunks' max scores, then their weights.
  const float* pin = partials + (static_cast<int64_t>(b * Hkv + h) * max_chunks * nG + ROWS * mt) * OUTW;
  const int c0 = gi * FOLD, c1 = min(c0 + FOLD, count);
  float* fw = wts;  // [FOLD][ROWS]: a chunk's max, then its weight (-inf: unseen)
  if (tid < rows_out) {
    const int R = ROWS * mt + tid;
    orow[tid] = ((static_cast<int64_t>(b) * Hkv * G + h * G + R % G) * n + R / G) * HD;
  }
  for (int i = tid; i < FOLD * ROWS; i += THREADS) {
    const int k = i / ROWS, r = i % ROWS;
    fw[i] = c0 + k < c1 && r < rows_out ? __ldcg(pin + (c0 + k) * step + r * OUTW + HD) : neg_inf();
  }
  __syncthreads();
  if (tid < rows_out) {
    float top = neg_inf();
    for (int k = 0; k < c1 - c0; ++k) {
      const float m = fw[k * ROWS + tid];
      if (m > top) top = m;
    }
    for (int k = 0; k < c1 - c0; ++k) {
      const float m = fw[k * ROWS + tid];
      fw[k * ROWS + tid] = m != neg_inf() ? expf(m - top) : neg_inf();
    }
    ftop[tid] = top;
  }
  constexpr int PAIRS = OUTW / 2;  // rows of o, m, l as 8-byte pairs (OUTW is even)
  constexpr int FE = (ROWS * PAIRS + THREADS - 1) / THREADS;  // a thread's elements
  const int pairs = rows_out * PAIRS;
  MUSER_STAMP(7);  // the fold's weights
  float* fstage = fw + FOLD * ROWS;
  float facc[FE][2];  // the group's chunks c0 .. c1 - 1 (c1 <= c0 + FOLD)
  staged_sums<FE, PAIRS, OUTW>(facc, pin + c0 * step, step, fw, pairs, c1 - c0, floats, fstage,
                               FOLD_BATCH);
  MUSER_STAMP(8);  // the fold's sums
  float* res = fstage;  // [rows_out][HD]: the sums the output divides by its row's total
  if (groups == 1 && !with_sinks) {
    // The batch's only fold: the combine would weigh it by exp(m - m) = 1 and
    // sum nothing else, so its output is this fold's o / l, bit for bit; it is
    // written here, without the counter and the second pass over L2.
    MUSER_STAMP(5);
    __syncthreads();  // the stage is read: it takes the sums
#pragma unroll
    for (int j = 0; j < FE; ++j) {
      const int e = tid + j * THREADS;
      const int r = e / PAIRS, d = 2 * (e % PAIRS);
      // + 0.0f: the combine's 0 + 1 * x, which makes a -0 of x +0 as there
      if (e < pairs && d < HD) {
        *reinterpret_cast<float2*>(fstage + r * HD + d) = make_float2(facc[j][0] + 0.0f, facc[j][1] + 0.0f);
      } else if (e < pairs) {
        totals[r] = facc[j][1] + 0.0f;  // the pair (m, l): l
      }
    }
  } else {
    float* mout = merged + ((static_cast<int64_t>(b * Hkv + h) * groups + gi) * nG + ROWS * mt) * OUTW;
#pragma unroll
    for (int j = 0; j < FE; ++j) {
      const int e = tid + j * THREADS;
      if (e < pairs) {
        const int r = e / PAIRS, col = 2 * (e % PAIRS);
        // the pair (m, l): the group's max, its weighted sum
        const float a0 = col == HD ? ftop[r] : facc[j][0];
        *reinterpret_cast<float2*>(mout + r * OUTW + col) = make_float2(a0, facc[j][1]);
      }
    }

    // This fold is written; the last fold combines them all.
    __threadfence();
    MUSER_STAMP(9);  // the fold is written and fenced
    __syncthreads();
    if (tid == 0) flags[1] = atomicAdd(ctr + groups, 1) == groups - 1;
    __syncthreads();
    if (!flags[1]) return;
    __threadfence();
    MUSER_STAMP(5);  // the last fold: the combine starts

    res = combine_folds<HD>(merged + (static_cast<int64_t>(b * Hkv + h) * groups * nG + ROWS * mt) * OUTW,
                            step, groups, (count + FOLD - 1) / FOLD, rows_out, h * G, G, ROWS * mt,
                            with_sinks ? sinks : nullptr, wts, totals MUSER_TL_ARG);
    MUSER_STAMP(10);  // the combine's sums are in shared memory
  }
  __syncthreads();
  write_rows<T, HD>(out, orow, res, totals, rows_out);
  MUSER_STAMP(6);  // the output is written
}

// Decode attention in one launch: each block's chunk partials (attend_partials,
// SPAN chunks a block), then the fold and the combine by the last blocks
// (fold_and_combine).
template <typename T, typename P, int HD, int SPAN>
__device__ __forceinline__ void attend(
    const T* queries, int64_t qs0, int64_t qs1, int64_t qs2, int64_t qs3,
    const P* keys, int64_t ks0, int64_t ks1, int64_t ks2, int64_t ks3,
    const P* values, int64_t vs0, int64_t vs1, int64_t vs2, int64_t vs3,
    const float* scale_in, const float* sinks, const int32_t* params, int params_len,
    const int32_t* counters, T* out, float* partials, float* merged MUSER_TL_PARAM) {
  const Block at(params, params_len, SPAN);
  attend_partials<T, P, HD, SPAN>(at, queries, qs0, qs1, qs2, qs3, keys, ks0, ks1, ks2, ks3, values,
                                  vs0, vs1, vs2, vs3, scale_in, params, params_len,
                                  partials MUSER_TL_ARG);
  // counters: an input MLX made zero for this launch alone (the launcher's), counted here
  fold_and_combine<T, HD, SPAN>(at, sinks, params, params_len, partials, merged,
                                const_cast<int*>(counters), out MUSER_TL_ARG);
}

}  // namespace muser_attend
