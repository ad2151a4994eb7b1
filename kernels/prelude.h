// muser-kv kernel prelude: one kernel body, three ways to run it.
//
// It is prepended to every body's *source* (not a header): on Metal,
// mx.fast.metal_kernel adds `thread_position_in_grid` to the generated
// signature only when that token appears in the source.
//
//   __METAL_VERSION__  mx.fast.metal_kernel (Apple GPU)
//   __CUDACC__ / NVRTC mx.fast.cuda_kernel (NVIDIA GPU); the body sits inside
//                      namespace mlx::core::cu
//   MUSER_KV_HOST      g++ on the CPU, in CI: the harness loops the grid and
//                      defines the thread index and muser_kv_host_plane<P>
//   (the header, convert.h, is file scope on all three)
//
// Bodies follow four rules so that all three agree bit for bit:
//   * thread ids only through KIDX_GLOBAL_X; bounds-checked; no `return`
//     (on the host the body is the inside of a loop);
//   * runtime scalars arrive in an int32 `params` array, read as params[i]:
//     positions, and head geometry and layout too (kv_heads, head_dim,
//     head_major, appended last), so that MLX compiles one program per kernel
//     and type pair, never per geometry or layout;
//   * element types are the only template values: input `T`, plane `P`
//     (float16 or bfloat16); conversion only via TO_PLANE (convert.h, the
//     kernels' header): a copy when T is P, else one round to nearest even,
//     as MLX's astype does;
//   * fixed-width integers (uint32_t, int64_t), no `uint`.
#if defined(__METAL_VERSION__)
#define KIDX_GLOBAL_X ((uint32_t)thread_position_in_grid.x)
#elif defined(MUSER_KV_HOST)
#define KIDX_GLOBAL_X (muser_kv_tid)
#else
#define KIDX_GLOBAL_X ((uint32_t)(blockIdx.x * blockDim.x + threadIdx.x))
#endif
#define TO_PLANE(x) muser_kv_to_plane<P>(x)
// Float helpers the attention bodies use, the same function on every backend:
// MUSER_KV_EXP (f32 exp), MUSER_KV_NEG_INF (-infinity as f32).
#if defined(__METAL_VERSION__)
#define MUSER_KV_EXP(x) metal::exp(x)
#define MUSER_KV_NEG_INF (-INFINITY)
#elif defined(MUSER_KV_HOST)
#define MUSER_KV_EXP(x) std::exp(x)
#define MUSER_KV_NEG_INF (-INFINITY)
#else
#define MUSER_KV_EXP(x) expf(x)
#define MUSER_KV_NEG_INF (-__int_as_float(0x7f800000))
#endif
