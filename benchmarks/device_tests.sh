#!/usr/bin/env bash
# On the lent H200 (after ../shared/tools/device-mlx-cuda.sh's install): the
# kernel selftest, the whole suite on MLX's CUDA backend, the race stress test
# with thousands of steps, and the dispatch count. Logs go to $OUT.
. "$(dirname "$0")/device_prelude.sh"
python3 -c 'import mlx.core as mx, muser_kv.kernels as k; print("mlx", mx.__version__, "device", mx.default_device(), "backend", k.get_backend().name)' | tee "$out/backend.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/backend.txt"
# every kernel on the GPU against the reference path on the GPU, bit for bit
python3 -m muser_kv.cli selftest 2>&1 | tee "$out/selftest.txt"
# NVRTC-only checks need the CUDA 13 cccl wheel, absent here; the real CUDA build runs instead
python3 -m pytest -q -p no:cacheprovider tests --deselect tests/test_kernels_nvrtc.py 2>&1 | tee "$out/tests.log" | tail -30
MUSER_KV_STRESS_STEPS=${STRESS_STEPS:-3000} python3 -m pytest -q -p no:cacheprovider tests/test_race_stress.py 2>&1 | tee "$out/stress.log" | tail -5
for dt in float16 float32; do python3 benchmarks/dispatches.py --dtype $dt; done 2>&1 | tee "$out/dispatches.txt"
