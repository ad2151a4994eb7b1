// muser-kv kernel header: file-scope helpers of every kernel. It goes to
// mx.fast.metal_kernel / mx.fast.cuda_kernel as `header` (MLX writes it before
// the generated function; the host harness at file scope); prelude.h, by
// contrast, is prepended to each body's source.
//
// muser_kv_to_plane<P>(x): one element of the input type T in the plane type
// P, as MLX's astype makes it. An input already of the plane type is copied:
// its bits, NaN payloads included, where a round trip through f32 could change
// them. Any other input is rounded to nearest even, once:
//   Metal  through float (exact for half and bfloat), then static_cast<P>;
//          for float inputs that is astype's own cast. (MLX's copy kernels
//          cast half <-> bfloat directly; the clang shim that CI compiles the
//          Metal text with refuses that cast, and the value is the same.)
//   CUDA   static_cast<P>(x), what MLX's CastOp does;
//   host   muser_kv_host_plane<P>, MLX's CPU conversion (tests/host_kernels.py).
#ifndef MUSER_KV_CONVERT_H  // once per program, however many kernels share it
#define MUSER_KV_CONVERT_H
#if defined(__METAL_VERSION__)
#define MUSER_KV_ROUND(P, x) static_cast<P>(static_cast<float>(x))
#elif defined(MUSER_KV_HOST)
#define MUSER_KV_ROUND(P, x) muser_kv_host_plane<P>(static_cast<float>(x))
#else
#define MUSER_KV_ROUND(P, x) static_cast<P>(x)
#endif
template <typename P, typename T>
struct muser_kv_plane_of {
  static P from(T x) { return MUSER_KV_ROUND(P, x); }
};
template <typename P>
struct muser_kv_plane_of<P, P> {  // already the plane type: the bits themselves
  static P from(P x) { return x; }
};
template <typename P, typename T>
inline P muser_kv_to_plane(T x) {
  return muser_kv_plane_of<P, T>::from(x);
}
#endif  // MUSER_KV_CONVERT_H
