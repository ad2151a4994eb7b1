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
// Blocks an SM runs at once (at D = 128 and one chunk a block: smem_bytes of
// 74,496 B and about 150 registers a thread): only where the tail is spread
// (fold_and_combine), never a bit or the waits' safety.
constexpr int RESIDENT = 3;

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

// What a block is: the params' header, and this block's task (b, h, span,
// mt) and sequence. Tasks are numbered in the order fold_and_combine's waits
// need: the fold groups in turn (every sequence's, K/V head's and M tile's
// first group, then every second group, ...), a group's spans of `span`
// chunks in a row; and a block takes the next task when it starts (`task`:
// the launch's ticket counter's count), so a block never waits for a task no
// block has taken while later ones run. The last groups, which combine, end
// the launch together. c: the span's first chunk; chunks: how many of its
// chunks are below max_chunks. A span never straddles two fold groups (span
// divides FOLD).
struct Block {
  int B, Hkv, G, n, CHUNK, max_chunks, window, nG, MT, mt, c, chunks, h, b;
  unsigned first;      // the task of the group's first block
  unsigned tasks;      // the launch's tasks (its blocks)
  const int32_t* seq;  // slot, end, held, origin, wrap

  __device__ __forceinline__ Block(const int32_t* params, int params_len, int span, unsigned task) {
    B = params[0], Hkv = params[1], G = params[2], n = params[3];
    CHUNK = params[5], max_chunks = params[6], window = params[7];
    nG = n * G;
    MT = (nG + ROWS - 1) / ROWS;
    // 32-bit unsigned: a 64-bit division is a long subroutine
    const unsigned units = static_cast<unsigned>(B * Hkv * MT);  // (b, h, mt)s
    const unsigned whole = static_cast<unsigned>(FOLD / span);  // a whole group's spans
    const unsigned spans = static_cast<unsigned>((max_chunks + span - 1) / span);
    tasks = units * spans;
    const unsigned gi = task / (units * whole);  // a last, partial group has fewer tasks, not more
    const unsigned members = min(spans - gi * whole, whole);  // the group's spans
    const unsigned rest = task - gi * units * whole;
    const unsigned unit = rest / members, j = rest % members;
    first = task - j;
    c = static_cast<int>(gi) * FOLD + static_cast<int>(j) * span;
    chunks = min(span, max_chunks - c);
    mt = static_cast<int>(unit % static_cast<unsigned>(MT));
    const unsigned bh = unit / static_cast<unsigned>(MT);
    h = static_cast<int>(bh % static_cast<unsigned>(Hkv));
    b = static_cast<int>(bh / static_cast<unsigned>(Hkv));
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

// Member j of m's share of `elems` elements: [share(j), share(j + 1)), in
// order, every element in exactly one share.
__device__ __forceinline__ int share(int elems, int j, int m) {
  return static_cast<int>(static_cast<long long>(elems) * j / m);
}

// The sum over sources s < `sources`, in ascending order, of w[s * ROWS] *
// src[s * step .. + 1] (a float pair), a source of weight -inf skipped unread:
// the fold's and the combine's arithmetic for one element (kernels/
// attend_merge.inc, attend_combine.inc). BATCH sources' loads in flight at
// once (the sources are in L2: other blocks wrote them).
template <int BATCH>
__device__ __forceinline__ float2 weighted_sum(const float* src, int64_t step, const float* w,
                                               int sources) {
  float2 acc = make_float2(0.0f, 0.0f);
#pragma unroll 1
  for (int s0 = 0; s0 < sources; s0 += BATCH) {
    float2 v[BATCH];
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      const int s = s0 + k;
      v[k] = s < sources && w[s * ROWS] != neg_inf()
                 ? __ldcg(reinterpret_cast<const float2*>(src + s * step))
                 : make_float2(0.0f, 0.0f);
    }
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      const int s = s0 + k;
      if (s < sources) {
        const float wk = w[s * ROWS];
        if (wk != neg_inf()) {
          acc.x += wk * v[k].x;
          acc.y += wk * v[k].y;
        }
      }
    }
  }
  return acc;
}

// Output element e (row e / (HD / 2), columns 2 * (e % (HD / 2)) and the
// next) of the M tile: sum / total in T (0 where the total is not > 0), row r
// at out + orow[r].
template <typename T, int HD>
__device__ __forceinline__ void write_pair(T* out, const int64_t* orow, int e, float2 sum, float total) {
  const int r = e / (HD / 2), d = 2 * (e % (HD / 2));
  T* o = out + orow[r] + d;
  o[0] = static_cast<T>(total > 0.0f ? sum.x / total : 0.0f);
  o[1] = static_cast<T>(total > 0.0f ? sum.y / total : 0.0f);
}

// Each source's (max, sum) pair of rows 0 .. rows_out - 1 (at src + s * step
// + r * (HD + 2) + HD) into shared w and l, [slots][ROWS], for the sources s <
// `sources`; the rest (-inf, 0). Every thread calls it.
template <int HD>
__device__ __forceinline__ void stage_maxes(float* w, float* l, const float* src, int64_t step,
                                            int sources, int rows_out, int slots) {
  for (int i = threadIdx.x; i < slots * ROWS; i += THREADS) {
    const int s = i / ROWS, r = i % ROWS;
    const float2 ml = s < sources && r < rows_out
                          ? __ldcg(reinterpret_cast<const float2*>(src + s * step + r * (HD + 2) + HD))
                          : make_float2(neg_inf(), 0.0f);
    w[i] = ml.x;
    l[i] = ml.y;
  }
}

// One row's weights (thread r, over stage_maxes' w and l at w + r, l + r):
// top = the sources' max (raised to `least` where that is above it), each
// source's max replaced by its weight exp(m - top) (-inf where m is), and
// the sum of weight * sum in ascending order, returned: the fold's and the
// combine's rule (kernels/attend_merge.inc, attend_combine.inc).
__device__ __forceinline__ float weigh_row(float* w, const float* l, int sources, float least, float& top) {
  top = neg_inf();
  for (int s = 0; s < sources; ++s) {
    const float m = w[s * ROWS];
    if (m > top) top = m;
  }
  if (least > top) top = least;
  float total = 0.0f;
  for (int s = 0; s < sources; ++s) {
    const float m = w[s * ROWS];
    float wt = neg_inf();
    if (m != neg_inf()) {
      wt = expf(m - top);
      total += wt * l[s * ROWS];
    }
    w[s * ROWS] = wt;
  }
  return total;
}

// Thread 0 waits until *ctr > after (acquire), then the block goes on with
// the count it saw (`seen`: a shared int): what the blocks that counted wrote
// (and fenced) before counting is read after. The fence after the acquire is
// what orders the other writer threads' stores (each fenced before its
// block's barrier) for this block's threads.
__device__ __forceinline__ int wait_above(const int* ctr, int after, int* seen) {
  if (threadIdx.x == 0) {
    int v;
    while (true) {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(ctr) : "memory");
      if (v > after) break;
      __nanosleep(64);
    }
    __threadfence();
    *seen = v;
  }
  __syncthreads();
  return *seen;
}

// The GPU's SMs (%nsmid: at least their count).
__device__ __forceinline__ unsigned sm_count() {
  unsigned n;
  asm("mov.u32 %0, %%nsmid;" : "=r"(n));
  return n;
}

// Shared memory of the second half, in floats from the block's K/V rings
// (no longer read), after the counters' flags (4 ints): each output row's
// offset (int64, ROWS), the fold's max (ROWS), each row's total (ROWS), then
// the weights: each chunk's weight and sum [FOLD][ROWS] each for the fold, or
// each fold's weight and sum [groups][ROWS] each for the combine.
constexpr int TAIL_FIXED = 2 * ROWS + 2 * ROWS;  // orow (as floats), ftop, totals
__host__ __device__ constexpr int ring_floats(int hd) { return WARPS * warp_bytes(hd) / 4 - 4; }

// The last pass: the chunk partials of a (sequence b, K/V head h, M tile mt)
// folded FOLD at a time, in ascending order against the group's max, then the
// folds combined in ascending order against their common max (and the sink):
// the arithmetic of kernels/attend_merge.inc and attend_combine.inc,
// statement for statement. A group in the launch's last wave of tasks (the
// GPU's resident blocks: the launch ends with it, nothing to overlap) is
// spread: once all its partials are written (its counter), each of its blocks
// folds a share of the elements (each row's weights and sum it computes
// whole). An earlier group is folded by the block that wrote its last
// partial, alone, while other blocks stream: there a block waiting for its
// group would only hold a slot they need. The (b, h, mt)'s last group
// combines the folds once all are written (a counter), its blocks a share
// each when it is spread. A batch with one fold group and no sinks writes the
// output at the fold (its combine would weigh it by exp(0) = 1: the same
// bits). Which block takes which share,
// or which group combines, changes no sum: each runs over the partials in
// ascending order after all of them are written. Waiting is deadlock-free: a
// block waits only for its own group's blocks, whose tasks are consecutive
// (Block: tasks are taken in order), so only the group at the front of the
// queue can be partly running, and it has fewer blocks than the GPU runs at
// once; the last group waits for earlier groups, whose tasks are all taken.
// So a launch needs FOLD / SPAN of its blocks resident at once (16 at span 1:
// any GPU of 16 SMs or more), or a spread group would wait for ever.
// Counters (zero at launch), per (b, h, mt): each group's partials written
// [groups], each group's shares folded [groups], folds written [1]; integer
// atomics only.
template <typename T, int HD, int SPAN>
__device__ __forceinline__ void fold_and_combine(const Block& at, const float* sinks,
                                                 const int32_t* params, int params_len,
                                                 const float* partials, float* merged,
                                                 int* counters, T* out MUSER_TL_PARAM) {
  MUSER_STAMP(3);  // the partial is written (or the block had no key)
  constexpr int OUTW = HD + 2;
  constexpr int PAIRS = HD / 2;  // output pairs a row
  static_assert(THREADS >= ROWS, "a thread a row for the weights");
  static_assert(TAIL_FIXED + 2 * FOLD * ROWS <= ring_floats(HD), "the fold's weights fit the rings");
  extern __shared__ __align__(16) unsigned char muser_attend_smem[];
  int* flags = reinterpret_cast<int*>(muser_attend_smem + q_bytes(HD));
  float* scratch = reinterpret_cast<float*>(flags + 4);  // the K/V rings, no longer read
  int64_t* orow = reinterpret_cast<int64_t*>(scratch);  // [ROWS]
  float* ftop = scratch + 2 * ROWS;                      // [ROWS]
  float* totals = ftop + ROWS;                           // [ROWS]
  float* wts = scratch + TAIL_FIXED;                     // the weights and sums

  const int Hkv = at.Hkv, G = at.G, n = at.n, max_chunks = at.max_chunks, nG = at.nG, MT = at.MT;
  const int mt = at.mt, c = at.c, h = at.h, b = at.b;
  const bool with_sinks = params_len - 5 * at.B == 9 && params[8] != 0;
  const int count = chunk_count(at.seq[1], at.seq[2], n, at.window, at.CHUNK, max_chunks);
  const int tid = threadIdx.x;
  const int rows_out = min(ROWS, nG - ROWS * mt);
  const int groups = (max_chunks + FOLD - 1) / FOLD;
  const int gi = c / FOLD;
  const int gchunks = min(FOLD, max_chunks - gi * FOLD);  // the group's chunks (its blocks')
  // a spread group's blocks share the work; else the last block alone
  const bool spread = at.first + RESIDENT * sm_count() >= gridDim.x;
  const int members = spread ? (gchunks + SPAN - 1) / SPAN : 1, j = spread ? (c - gi * FOLD) / SPAN : 0;
  int* ctr = counters + 1 + (static_cast<int64_t>(b * Hkv + h) * MT + mt) * (2 * groups + 1);
  const int64_t step = static_cast<int64_t>(nG) * OUTW;  // one chunk (or fold) further
  const int elems = rows_out * PAIRS;
  const int lo = share(elems, j, members), hi = share(elems, j + 1, members);

  // This block's partials are written; the group is folded once all are.
  __threadfence();
  __syncthreads();
  if (tid == 0) flags[1] = atomicAdd(ctr + gi, at.chunks) + at.chunks;
  if (spread) {
    wait_above(ctr + gi, gchunks - 1, flags);
  } else {
    __syncthreads();
    if (flags[1] != gchunks) return;  // not the group's last block
    __threadfence();
  }
  MUSER_STAMP(4);  // the group's partials are written: the fold starts

  // Each output row's offset; each row's chunk max and sum, then its weights,
  // the group's max and the group's sum.
  const float* pin = partials + (static_cast<int64_t>(b * Hkv + h) * max_chunks * nG + ROWS * mt) * OUTW;
  const int c0 = gi * FOLD, c1 = min(c0 + FOLD, count);
  float* fw = wts;               // [FOLD][ROWS]: a chunk's max, then its weight (-inf: unseen)
  float* fl = fw + FOLD * ROWS;  // [FOLD][ROWS]: its sum
  if (tid < rows_out) {
    const int R = ROWS * mt + tid;
    orow[tid] = ((static_cast<int64_t>(b) * Hkv * G + h * G + R % G) * n + R / G) * HD;
  }
  stage_maxes<HD>(fw, fl, pin + c0 * step, step, c1 - c0, rows_out, FOLD);
  __syncthreads();
  if (tid < rows_out) totals[tid] = weigh_row(fw + tid, fl + tid, c1 - c0, neg_inf(), ftop[tid]);
  __syncthreads();
  MUSER_STAMP(7);  // the fold's weights

  // This block's share of the fold, elements lo .. hi - 1 of the M tile's o:
  // the output, when the batch has this one fold and no sinks (the combine
  // would weigh it by exp(m - m) = 1 and sum nothing else, so the output is
  // this fold's o / l bit for bit; + 0.0f: the combine's 0 + 1 * x, which
  // makes a -0 of x +0 as there), else `merged`, with (max, sum) of the rows
  // whose first element is in the share.
  const bool only = groups == 1 && !with_sinks;
  float* mout = merged + ((static_cast<int64_t>(b * Hkv + h) * groups + gi) * nG + ROWS * mt) * OUTW;
#pragma unroll 1
  for (int e = lo + tid; e < hi; e += THREADS) {
    const int r = e / PAIRS, d = 2 * (e % PAIRS);
    const float2 s = weighted_sum<FOLD>(pin + c0 * step + r * OUTW + d, step, fw + r, c1 - c0);
    if (only) {
      write_pair<T, HD>(out, orow, e, make_float2(s.x + 0.0f, s.y + 0.0f), totals[r] + 0.0f);
    } else {
      *reinterpret_cast<float2*>(mout + r * OUTW + d) = s;
      if (d == 0) *reinterpret_cast<float2*>(mout + r * OUTW + HD) = make_float2(ftop[r], totals[r]);
    }
  }
  if (only) {
    MUSER_STAMP(6);  // the output is written
    return;
  }
  __threadfence();
  __syncthreads();
  MUSER_STAMP(8);  // the share is summed, written and fenced
  if (tid == 0 && atomicAdd(ctr + groups + gi, 1) == members - 1) {
    __threadfence();  // the group's last share: the group is folded
    atomicAdd(ctr + 2 * groups, 1);
  }
  if (gi != groups - 1) return;  // the last group combines, once every group is folded
  wait_above(ctr + 2 * groups, groups - 1, flags);
  MUSER_STAMP(5);  // every fold is written: the combine starts

  // The combine: each row's folds against their common max (and the sink of
  // the row's query head), then this block's share of the elements.
  const float* gin = merged + (static_cast<int64_t>(b * Hkv + h) * groups * nG + ROWS * mt) * OUTW;
  const int folds = (count + FOLD - 1) / FOLD;
  float* cw = wts;                 // [groups][ROWS]: a fold's max, then its weight
  float* cl = cw + groups * ROWS;  // [groups][ROWS]: its sum
  stage_maxes<HD>(cw, cl, gin, step, folds, rows_out, folds);
  __syncthreads();
  if (tid < rows_out) {
    const float sink = with_sinks ? sinks[h * G + (ROWS * mt + tid) % G] : neg_inf();
    float top;
    const float total = weigh_row(cw + tid, cl + tid, folds, sink, top);
    totals[tid] = with_sinks ? total + expf(sink - top) : total;
  }
  __syncthreads();
  MUSER_STAMP(11);  // the folds' weights
#pragma unroll 1
  for (int e = lo + tid; e < hi; e += THREADS) {
    const int r = e / PAIRS, d = 2 * (e % PAIRS);
    write_pair<T, HD>(out, orow, e, weighted_sum<8>(gin + r * OUTW + d, step, cw + r, folds), totals[r]);
  }
  MUSER_STAMP(6);  // the output is written
}

// Decode attention in one launch: a block takes the next task from the
// ticket (counters[0]) as it starts, computes its chunk partials
// (attend_partials, SPAN chunks a block), then its shares of the fold and the
// combine (fold_and_combine).
template <typename T, typename P, int HD, int SPAN>
__device__ __forceinline__ void attend(
    const T* queries, int64_t qs0, int64_t qs1, int64_t qs2, int64_t qs3,
    const P* keys, int64_t ks0, int64_t ks1, int64_t ks2, int64_t ks3,
    const P* values, int64_t vs0, int64_t vs1, int64_t vs2, int64_t vs3,
    const float* scale_in, const float* sinks, const int32_t* params, int params_len,
    const int32_t* counters, T* out, float* partials, float* merged MUSER_TL_PARAM) {
  __shared__ unsigned task;
  if (threadIdx.x == 0) task = atomicAdd(reinterpret_cast<unsigned*>(const_cast<int32_t*>(counters)), 1u);
  __syncthreads();
  const Block at(params, params_len, SPAN, task);
  if (task >= at.tasks) return;  // a grid larger than its tasks: no group counts this block
  attend_partials<T, P, HD, SPAN>(at, queries, qs0, qs1, qs2, qs3, keys, ks0, ks1, ks2, ks3, values,
                                  vs0, vs1, vs2, vs3, scale_in, params, params_len,
                                  partials MUSER_TL_ARG);
  // counters: an input MLX made zero for this launch alone (the launcher's), counted here
  fold_and_combine<T, HD, SPAN>(at, sinks, params, params_len, partials, merged,
                                const_cast<int*>(counters), out MUSER_TL_ARG);
}

}  // namespace muser_attend
