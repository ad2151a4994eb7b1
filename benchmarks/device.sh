#!/usr/bin/env bash
# On the lent H200 (after ../shared/tools/device-mlx-cuda.sh's install), one phase
# per device call (each well under ten minutes), every command under its own
# timeout so what finished comes back. Output: $OUT/*.md and logs.
#   bash benchmarks/device.sh suite      # whole suite on MLX CUDA, the selftest
#   bash benchmarks/device.sh decode     # decode f16 + bf16, aligned + unaligned max_context; strides
#   bash benchmarks/device.sh e2e DTYPE  # end to end on the real Muse Glimmer geometry
. "$(dirname "$0")/device_prelude.sh"
case "${1:-suite}" in
suite)
  python3 -c 'import mlx.core as mx, muser_kv.kernels as k; print("mlx", mx.__version__, "device", mx.default_device(), "backend", k.get_backend().name)' | tee "$out/backend.txt"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests --deselect tests/test_kernels_nvrtc.py \
    2>&1 | tee "$out/tests.log" | tail -15
  if python3 -m muser_kv.cli selftest --help >/dev/null 2>&1; then
    timeout 120 python3 -m muser_kv.cli selftest 2>&1 | tee "$out/selftest.txt"
  fi
  ;;
decode)
  for dt in float16 bfloat16; do
    b decode 200 benchmarks/decode.py --dtype $dt --depths 32768,131072 \
      --max-contexts 100000,131590,132096 --repeats 3 --json "$out/decode_$dt.json"
  done
  b strides 120 benchmarks/strides.py
  ;;
e2e)
  b e2e 560 benchmarks/end_to_end.py --dtypes "${2:-float16}" --json "$out/e2e_${2:-float16}.json"
  ;;
esac
