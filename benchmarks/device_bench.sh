#!/usr/bin/env bash
# On the lent H200 (after ../shared/tools/device-mlx-cuda.sh's install): every
# benchmark at full Muse geometry, most important first, each under a timeout
# so that what finished comes back. Output: $OUT/*.md (Markdown tables).
. "$(dirname "$0")/device_prelude.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_no_plane_copy.py tests/test_replay_gate.py \
  tests/test_model_oracle.py tests/test_speculative.py 2>&1 | tee "$out/tests_focused.log" | tail -8
b decode 150 benchmarks/decode.py --repeats 2 --steps 32 --json "$out/decode_tm.json"
b decode 150 benchmarks/decode.py --repeats 2 --steps 32 --sliding-layout head_major --json "$out/decode_hm.json"
b decode 100 benchmarks/decode.py --repeats 2 --steps 32 --sliding-layout head_major --retain 0 --depths 2048,131072
b memory 100 benchmarks/generate_memory.py
b memory 60 benchmarks/generate_memory.py --sliding-layout head_major
b store 60 benchmarks/store_cost.py
b prefill 60 benchmarks/prefill.py --repeats 2
b prefill 40 benchmarks/prefill.py --repeats 2 --sliding-layout head_major
b sessions 120 benchmarks/sessions.py --repeats 1 --rollback-repeats 3
