// muser-kv decode attention on tensor cores, in one launch: the body of
// mx.fast.cuda_kernel "muser_kv_attend_mma" (header kernels/attend_mma.h).
// Inputs: queries [B, Hq, n, D] (T), keys/values [S, Hkv, R, D] (P; any
// strides, in elements), scale float32 [1], sinks float32 [Hq] (or [1],
// unread), params int32, counters int32 (zeros); outputs: out [B, Hq, n, D]
// (T), partials float32 [B, Hkv, max_chunks, n*G, D + 2], merged float32
// [B, Hkv, ceil(max_chunks / FOLD), n*G, D + 2] (the folds: not written when
// the batch has one fold group and no sinks). Templates: T, P, HD (D),
// SPAN (chunks a block takes in turn: 1, 2, 4, 8 or 16). One block of
// muser_attend::THREADS threads per (b, h, SPAN chunks, 16-row M tile).
muser_attend::attend<T, P, HD, SPAN>(
    queries, queries_strides[0], queries_strides[1], queries_strides[2], queries_strides[3],
    keys, keys_strides[0], keys_strides[1], keys_strides[2], keys_strides[3],
    values, values_strides[0], values_strides[1], values_strides[2], values_strides[3],
    scale, sinks, params, static_cast<int>(params_shape[0]), counters, out, partials, merged
#ifdef MUSER_ATTEND_TIMELINE
    , timeline  // benchmarks/attention_mma_check.py --timeline's extra output
#endif
);
