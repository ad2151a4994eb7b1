#!/usr/bin/env bash
# On the lent H200 (after ../shared/tools/device-mlx-cuda.sh's install), in three
# calls of under ten minutes each, every command under its own timeout so what
# finished comes back. Output: $OUT/*.md and logs.
#   bash benchmarks/device_final.sh bench   # decode, real-model memory, store cost
#   bash benchmarks/device_final.sh suite   # whole suite on CUDA, race stress, dispatches, sessions, prefill
#   bash benchmarks/device_final.sh final   # race stress in full, host work, decode x8, a 52-layer store step
. "$(dirname "$0")/device_prelude.sh"
case "${1:-bench}" in
bench)
  b decode 170 benchmarks/decode.py --repeats 2 --steps 32 --json "$out/decode_tm.json"
  b decode 90 benchmarks/decode.py --repeats 2 --steps 32 --retain 0 --depths 2048,131072
  b memory 110 benchmarks/generate_memory.py
  b store 110 benchmarks/store_cost.py --repeats 2
  b store 60 benchmarks/store_cost.py --repeats 2 --layers 1 --capacities 2048,131072
  ;;
suite)
  python3 -c 'import mlx.core as mx, muser_kv.kernels as k; print("mlx", mx.__version__, "device", mx.default_device(), "backend", k.get_backend().name)' | tee "$out/backend.txt"
  timeout 240 python3 -m pytest -q -p no:cacheprovider --durations=8 tests \
    --deselect tests/test_kernels_nvrtc.py 2>&1 | tee "$out/tests.log" | tail -20
  MUSER_KV_STRESS_STEPS=3000 timeout 190 python3 -m pytest -q -p no:cacheprovider \
    tests/test_race_stress.py 2>&1 | tee "$out/stress.log" | tail -4
  for dt in float16 float32; do timeout 30 python3 benchmarks/dispatches.py --dtype $dt; done 2>&1 | tee "$out/dispatches.txt"
  b donation 60 benchmarks/donation.py
  b sessions 90 benchmarks/sessions.py --repeats 1 --rollback-repeats 3
  b prefill 60 benchmarks/prefill.py --repeats 2
  ;;
final)
  MUSER_KV_STRESS_STEPS=3000 timeout 230 python3 -m pytest -q -p no:cacheprovider \
    tests/test_race_stress.py 2>&1 | tee "$out/stress.log" | tail -3
  for r in 16 0; do timeout 40 python3 benchmarks/host_overhead.py --retain $r; done 2>&1 | tee "$out/host.txt"
  b decode 200 benchmarks/decode.py --repeats 8 --steps 48 --json "$out/decode8.json"
  b store 80 benchmarks/store_cost.py --layers 52 --capacities 2048,131072 --steps 256 --repeats 2 --modes pipelined,sync
  ;;
esac
