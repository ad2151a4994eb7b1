#!/usr/bin/env bash
# On the lent H200: the whole suite on MLX CUDA, then decode and real-model
# memory at full geometry. Output: $OUT.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
b() { local name=$1 limit=$2; shift 2; echo "== $name: $*" | tee -a "$out/$name.md"
      timeout "$limit" python3 "$@" 2>&1 | tee -a "$out/$name.md" | tail -22; }
b decode 150 benchmarks/decode.py --repeats 2 --steps 32 --json "$out/decode_tm.json"
b decode 100 benchmarks/decode.py --repeats 2 --steps 32 --retain 0 --depths 2048,131072
b memory 100 benchmarks/generate_memory.py
timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=10 tests \
  --deselect tests/test_kernels_nvrtc.py 2>&1 | tee "$out/tests.log" | tail -25
