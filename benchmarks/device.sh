#!/usr/bin/env bash
# On the lent H200 (after ../shared/tools/device-mlx-cuda.sh's install), one phase
# per device call (each well under ten minutes), every command under its own
# timeout so what finished comes back. Output: $OUT/*.md and logs.
#   bash benchmarks/device.sh suite [K N] # the selftest, then shard K of N of the suite on MLX
#                                        # CUDA (pytest --shard K/N, 12 xdist workers), each
#                                        # shard inside one ten-minute call
#   bash benchmarks/device.sh decode     # decode f16 + bf16, aligned + unaligned max_context
#   bash benchmarks/device.sh attention [own]  # decode attention: its bit tests on the GPU, one
#                                        # layer against cuDNN's (own: MLX's own kernels too) and the
#                                        # floor, decode over 52 layers
#   bash benchmarks/device.sh check      # the tensor-core launch: PASS, one layer with and without
#                                        # its fold and combine, at 131k and 32k, and its blocks'
#                                        # phases (--timeline), for each span (SPANS=1,2,4,8,16)
#   bash benchmarks/device.sh tail       # the launch's tail: one block's L2 read rate against many
#                                        # blocks' (l2_read.py), then PASS, B = 1 and 8 chained, and
#                                        # the tail's phases at 131k and 32k (--timeline 1)
#   bash benchmarks/device.sh spread     # decode attention in one call: PASS, B = 1 and 8 chained and
#                                        # the tail's phases at 131k and 32k, the host's cost of a call
#                                        # (host_attend.py), then decode.py's 52 layers
#   bash benchmarks/device.sh mixed      # batched decode at 131k, mixed lengths (16k..131k) beside
#                                        # an equal batch of the same rows, B = 2, 8, 16, 32
#   bash benchmarks/device.sh e2e DTYPE  # end to end on the real Muse Glimmer geometry
#   bash benchmarks/device.sh batched    # batched decode, B = 1, 2, 4, 8 at 8k and 32k
#   bash benchmarks/device.sh floor      # batched decode at 131072 against the floor, B = 1..16, bf16
#   bash benchmarks/device.sh profile    # one batched decode step profiled at 131072, B = 1..32, bf16
#   bash benchmarks/device.sh host       # serve's rings at 131072 against the floor, B = 1, 2, 8, 16;
#                                        # then the host's build of a step and its calls (host_step.py)
#   bash benchmarks/device.sh sessions   # save / load against raw disk, rollback
#   bash benchmarks/device.sh returning  # TTFT of a returning 32k chat through the server's prompt cache
#   bash benchmarks/device.sh disk       # save / load against raw disk only (sessions.py section 1)
#   bash benchmarks/device.sh resume     # 130k session: load + first token against re-prefill, real geometry
#   bash benchmarks/device.sh store      # one in-place store op per layer vs two slice updates; race check
#   bash benchmarks/device.sh determinism  # the same decode step twice: SDPA, then the real model
#   bash benchmarks/device.sh reuse      # KV store: regenerate / edit / branch at 32k and 130k
#   bash benchmarks/device.sh reuse23    # KV store: memory of 100 stored chats; a restart at 32k
# The session plan of 2026-12-02 (each well inside one ten-minute call):
#   bash benchmarks/device.sh floor131   # selftest; B = 1..16 at the full 131,072, serve's rings
#   bash benchmarks/device.sh tables     # 8k / 32k x B = 1..32; BatchGenerator 8k x B = 1..8;
#                                        # 32 chats of 2k at max_context 131,072
#   bash benchmarks/device.sh reuse130   # KV store at 130k after traffic; memory; restart at 32k
#   bash benchmarks/device.sh families   # Gemma 3 27B returning chat; BatchGenerator, both families
#   bash benchmarks/device.sh restart    # the first request after a restart: 32k (twice), 130k
#   bash benchmarks/device.sh serve32    # muser-kv serve and mlx_lm.server through HTTP: a 32k chat,
#                                        # traffic, regenerate / edit / branch, a restart (serve_http.py)
#   bash benchmarks/device.sh concurrent N [FLAGS]  # N (4, 8 or 16; one per call) chats at once,
#                                        # 2k-32k, staggered: muser-kv serve, mlx_lm.server, in-process
#                                        # BatchGenerator (serve_concurrent.py; FLAGS: more of its
#                                        # flags, e.g. --systems muser,reference)
#   bash benchmarks/device.sh reads      # in-process, B = 1, 4, 16 at 2k: the server's per-token
#                                        # log-probability read under mlx-lm's BatchGenerator and
#                                        # serve's ServeBatchGenerator, and steps/s (serve_concurrent.py)
#   bash benchmarks/device.sh concurrent130  # 4 chats at once, 2k-130k (serve_concurrent.py)
#   bash benchmarks/device.sh one130     # one 130k chat through HTTP against the in-process
#                                        # BatchGenerator; then serve with MLX's attention (cuDNN)
#   bash benchmarks/device.sh prefill32 "B..."  # a chat streams while a 32k prompt prefills: muser-kv
#                                        # serve at each --prefill-budget B (default "0 512"; "mlx-lm":
#                                        # mlx_lm.server), about 2 minutes each
#   bash benchmarks/device.sh buffers    # what decode attention depends on beside the rows: SDPA
#                                        # over own / recycled buffers, whether decode writes reuse
#                                        # the planes' buffers, tests/caches/test_owned_buffers.py
#   bash benchmarks/device.sh repeats    # a whole list's writes and reads three times (determinism.py
#                                        # section 5): MLX's defaults, CUDA graphs off, cuDNN SDPA off
#   bash benchmarks/device.sh soak [S]   # tests/serving/test_soak.py on the GPU, its traffic S
#                                        # seconds (default 420): every request a status, every
#                                        # 200 its solo tokens, RSS bounded, SIGTERM drained
#   bash benchmarks/device.sh handoff2   # NEEDS TWO GPUS (nvidia-h200-x2): a session handed between
#                                        # two ranks of an NCCL group (mlx.launch --backend nccl), on
#                                        # collectives (NCCL has no send/recv), against raw all_sum
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
# b NAME LIMIT SCRIPT ARGS...: one benchmark under a timeout, appended to $out/NAME.md
b() { local name=$1 limit=$2; shift 2; echo "== $name: $*" | tee -a "$out/$name.md"
      timeout "$limit" python3 "$@" 2>&1 | tee -a "$out/$name.md" | grep -v "it/s\]\|tok/s\]" | tail -40; }
case "${1:-suite}" in
suite)
  python3 -c 'import mlx.core as mx, muser_kv.core.kernels as k; print("mlx", mx.__version__, "device", mx.default_device(), "backend", k.get_backend().name)' | tee "$out/backend.txt"
  timeout 120 python3 -m muser_kv selftest 2>&1 | tee "$out/selftest.txt"
  echo "selftest exit ${PIPESTATUS[0]}" | tee -a "$out/selftest.txt"
  shard="${2:-1}/${3:-1}"
  # peak-memory tests run alone: workers sharing the GPU disturb what they measure
  # many servers start at once on one GPU (the conformance suite's 30): more than CI's 90 s each
  MUSER_KV_TEST_SERVER_TIMEOUT=${SERVER_TIMEOUT:-300} \
  timeout 480 python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-12}" --shard "$shard" \
    -o addopts="-ra" --ignore tests/caches/test_no_plane_copy.py tests 2>&1 \
    | tee "$out/tests_${2:-1}_of_${3:-1}.log" | tail -60
  if [ "${2:-1}" = "${3:-1}" ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/caches/test_no_plane_copy.py 2>&1 \
      | tee "$out/tests_alone.log" | tail -5
  fi
  ;;
decode)
  for dt in float16 bfloat16; do
    b decode 200 benchmarks/decode.py --dtype $dt --depths 32768,131072 \
      --max-contexts 100000,131590,132096 --repeats 3 --json "$out/decode_$dt.json"
  done
  ;;
attention)
  # muser-kv's decode attention on this GPU: the launch checked against the reference and the
  # portable kernels' bits, its bit tests, one layer against MLX's (cuDNN's, then MLX's own
  # kernels) and the bytes floor, equal and mixed lengths; decode over 52 layers
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
    *H200*) bw=4.8e12 ;; *) bw=3.35e12 ;; esac
  b attention_check 150 benchmarks/attention_mma_check.py --bandwidth $bw --batches 1,4,8 \
    --stages ${STAGES_LIST:-2}
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/core/test_attention.py \
    tests/caches/test_batch.py 2>&1 | tee "$out/attention_tests.log" | tail -12
  b attention 150 benchmarks/attention.py --contexts 32768,131072 --batches 1,8,32 \
    --bandwidth $bw --json "$out/attention_cudnn.json"
  b attention 150 benchmarks/attention.py --contexts 131072 --batches 2,8,16,32 \
    --lengths-from 16384 --bandwidth $bw --json "$out/attention_mixed_cudnn.json"
  if [ "${2:-}" = own ]; then  # MLX's own kernels too (MLX_CUDA_USE_CUDNN_SDPA=0)
    MLX_CUDA_USE_CUDNN_SDPA=0 b attention 100 benchmarks/attention.py --contexts 32768,131072 \
      --batches 1,8 --repeats 3 --json "$out/attention_mlx.json"
  fi
  b decode 200 benchmarks/decode.py --dtype bfloat16 --depths 32768,131072 \
    --max-contexts 131590 --repeats 3 --modes pipelined --json "$out/decode_attention.json"
  ;;
check)
  # the tensor-core launch alone: PASS, then one layer at 131k and 32k, with and without its tail
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
    *H200*) bw=4.8e12 ;; *) bw=3.35e12 ;; esac
  b attention_check 240 benchmarks/attention_mma_check.py --bandwidth $bw --batches 1,8 \
    --timeline 1,8 --spans ${SPANS:-1,2,4,8,16}
  b attention_check 120 benchmarks/attention_mma_check.py --bandwidth $bw --batches 1,8 \
    --depth 32768 --skip-check --timeline 1,8 --spans ${SPANS:-1,2,4,8,16}
  ;;
tail)
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
    *H200*) bw=4.8e12 ;; *) bw=3.35e12 ;; esac
  b l2_read 60 benchmarks/l2_read.py
  b tail 240 benchmarks/attention_mma_check.py --bandwidth $bw --batches 1,8 --timeline 1 --spans 1
  b tail 100 benchmarks/attention_mma_check.py --bandwidth $bw --batches 1,8 --depth 32768 --skip-check \
    --timeline 1 --spans 1
  ;;
spread)
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in
    *H200*) bw=4.8e12 ;; *) bw=3.35e12 ;; esac
  b spread 240 benchmarks/attention_mma_check.py --bandwidth $bw --batches 1,8 --timeline 1 --spans 1
  b spread 100 benchmarks/attention_mma_check.py --bandwidth $bw --batches 1,8 --depth 32768 --skip-check \
    --timeline 1 --spans 1
  b spread 60 benchmarks/host_attend.py --include
  b spread 120 benchmarks/decode.py --dtype bfloat16 --depths 32768,131072 --max-contexts 131590 --repeats 3 \
    --modes pipelined
  ;;
mixed)
  b mixed 580 benchmarks/batched.py --contexts 131072 --batches ${2:-2,8,16,32} --systems muser-kv \
    --lengths-from 16384 --dtype bfloat16 --blocks 2 --sliding-layout head_major \
    --fill-chunk 32768 --json "$out/mixed.json"
  ;;
e2e)
  b e2e 560 benchmarks/end_to_end.py --dtypes "${2:-float16}" --json "$out/e2e_${2:-float16}.json"
  ;;
batched)
  b batched 560 benchmarks/batched.py --json "$out/batched.json"
  ;;
floor)
  b floor 580 benchmarks/batched.py --contexts 131072 --batches 1,2,4,8,16 --dtype bfloat16 \
    --blocks 3 --json "$out/floor.json"
  ;;
host)
  # muser-kv alone at 131k (mlx-lm's B = 16 beside it does not fit in one call); the floor
  # is measured in the same run
  b floor_head 380 benchmarks/batched.py --contexts 131072 --batches 1,2,8,16 --dtype bfloat16 \
    --systems muser-kv --blocks 3 --sliding-layout head_major --fill-chunk 16384 \
    --json "$out/floor_head.json"
  b host_step 170 benchmarks/host_step.py --context 32768 --batches 1,2,8,16 --dtype bfloat16 \
    --fill-chunk 16384 --json "$out/host_step.json"
  ;;
profile)
  b profile 580 benchmarks/profile_step.py --context 131072 --batches 1,2,4,8,16,32 \
    --dtype bfloat16 --json "$out/profile.json"
  ;;
sessions)
  b sessions 300 benchmarks/sessions.py --repeats 1 --rollback-repeats 3 --json "$out/sessions.json"
  ;;
returning)
  b returning_chat 560 benchmarks/returning_chat.py --json "$out/returning_chat.json"
  ;;
disk)
  b disk 300 benchmarks/sessions.py --skip 2,3 --json "$out/disk.json"
  ;;
resume)
  b resume 560 benchmarks/resume.py --dtype "${2:-bfloat16}" --json "$out/resume_${2:-bfloat16}.json"
  ;;
reuse)
  b store_reuse 580 benchmarks/store_reuse.py --parts 1 --history 32768,130000 \
    --json "$out/store_reuse_1.json"
  ;;
reuse23)
  b store_reuse 580 benchmarks/store_reuse.py --parts 2,3 --history 32768 \
    --json "$out/store_reuse_23.json"
  ;;
floor131)
  # cold (MLX's PTX cache, /tmp/mlx, emptied first) at 4, 8 and 16 workers, then warm at the default
  for j in 4 8 16 0; do
    [ "$j" = 0 ] || rm -rf /tmp/mlx
    s=$SECONDS; timeout 40 python3 -m muser_kv selftest $([ "$j" = 0 ] || echo --jobs $j) \
      > "$out/selftest_$j.txt" 2>&1
    echo "selftest jobs=$j exit $? wall $((SECONDS - s)) s" | tee -a "$out/selftest.txt"
    tail -3 "$out/selftest_$j.txt" | tee -a "$out/selftest.txt"
  done
  b floor 470 benchmarks/batched.py --contexts 131072 --batches 1,2,4,8,16 --dtype bfloat16 \
    --blocks 3 --sliding-layout head_major --fill-chunk 32768 --json "$out/floor.json"
  ;;
tables)
  b tables 230 benchmarks/batched.py --contexts 8192,32768 --batches 1,2,4,8,16,32 \
    --dtype bfloat16 --blocks 3 --sliding-layout head_major --fill-chunk 32768 \
    --json "$out/tables.json"
  b generator 200 benchmarks/batched.py --generator --prompt 8192 --batches 1,2,4,8 \
    --dtype bfloat16 --blocks 2 --sliding-layout head_major --json "$out/generator.json"
  b chats32 140 benchmarks/batched.py --generator --prompt 2048 --batches 32 --tokens 128 \
    --list-context 131072 --dtype bfloat16 --blocks 2 --sliding-layout head_major \
    --json "$out/chats32.json"
  ;;
reuse130)
  b reuse130 330 benchmarks/store_reuse.py --parts 1 --history 130000 --traffic 10 \
    --dtype bfloat16 --json "$out/reuse130.json"
  b reuse23 260 benchmarks/store_reuse.py --parts 2,3 --history 32768 --dtype bfloat16 \
    --json "$out/reuse23.json"
  ;;
restart)
  for i in 1 2; do
    b restart 200 benchmarks/store_reuse.py --parts 3 --history 32768 --dtype bfloat16 \
      --json "$out/restart_32k_$i.json"
  done
  b restart 300 benchmarks/store_reuse.py --parts 3 --history 130000 --dtype bfloat16 \
    --json "$out/restart_130k.json"
  ;;
families)
  b gemma_chat 230 benchmarks/returning_chat.py --family gemma3-27b --history 32768 --answer 160 \
    --divergences 4,150 --paths batched --repeats 1 --dtype bfloat16 --json "$out/gemma_chat.json"
  for f in gemma3-27b gpt-oss-20b; do
    b "gen_$f" 160 benchmarks/batched.py --generator --family $f --prompt 8192,32768 \
      --batches 1,4 --batch-tokens 40000 --blocks 1 --dtype bfloat16 --sliding-layout head_major \
      --json "$out/gen_$f.json"
  done
  ;;
serve32)
  b serve32 560 benchmarks/serve_http.py --history 32768 --geometry glimmer-real --dtype bfloat16 \
    --traffic 10 --logs "$out" --json "$out/serve32.json"
  ;;
concurrent)
  b "concurrent${2:-4}" 560 benchmarks/serve_concurrent.py --clients "${2:-4}" --history 32768 \
    --min-history 2048 --answer 256 --stagger 0.5 --geometry glimmer-real --dtype bfloat16 \
    --model-dir "${MODEL_DIR:-/tmp/glimmer-real-bf16}" --logs "$out" \
    --json "$out/concurrent${2:-4}.json" "${@:3}"
  ;;
reads)
  b reads 400 benchmarks/serve_concurrent.py --scenario reads --clients 1,4,16,1 --min-history 2048 \
    --history 4096 --answer 256 --geometry glimmer-real --dtype bfloat16 \
    --model-dir "${MODEL_DIR:-/tmp/glimmer-real-bf16}" --json "$out/reads.json"
  ;;
one130)
  for attn in muser mlx; do
    if [ $attn = muser ]; then systems=muser,reference; flags=""
    else systems=muser; flags="--cuda-attention cudnn"; fi
    MUSER_KV_ATTENTION=$attn b one130 330 benchmarks/serve_concurrent.py --clients 1 \
      --history 130000 --min-history 130000 --answer 256 --systems $systems \
      --serve-flags "$flags" --geometry glimmer-real --dtype bfloat16 \
      --model-dir "${MODEL_DIR:-/tmp/glimmer-real-bf16}" --logs "$out/one130_$attn" \
      --json "$out/one130_$attn.json"
  done
  ;;
concurrent130)
  b concurrent130 560 benchmarks/serve_concurrent.py --clients 4 --history 130000 \
    --min-history 2048 --answer 128 --stagger 0.5 --geometry glimmer-real --dtype bfloat16 \
    --model-dir "${MODEL_DIR:-/tmp/glimmer-real-bf16}" --logs "$out" --json "$out/concurrent130.json"
  ;;
prefill32)
  for budget in ${2:-0 512}; do
    if [ "$budget" = mlx-lm ]; then systems=mlx-lm; flags=""; else systems=muser
      flags="--prefill-budget $budget"; fi
    b prefill32 280 benchmarks/serve_concurrent.py --scenario prefill --history 32768 \
      --min-history 2048 --answer 1024 --stagger 3 --systems "$systems" --serve-flags "$flags" \
      --geometry glimmer-real --dtype bfloat16 --model-dir "${MODEL_DIR:-/tmp/glimmer-real-bf16}" \
      --logs "$out/prefill32_$budget" --json "$out/prefill32_$budget.json"
  done
  ;;
soak)
  secs=${2:-420}
  MUSER_KV_SOAK_SECONDS=$secs MUSER_KV_TEST_SERVER_TIMEOUT=${SERVER_TIMEOUT:-300} \
  timeout $((secs + 150)) python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" \
    tests/serving/test_soak.py 2>&1 | tee "$out/soak.log" | tail -40
  ;;
handoff2)
  # two GPUs, one per rank: on a one-GPU machine NCCL's init fails and nothing runs
  nvidia-smi -L | tee "$out/gpus.txt"
  b handoff2 560 benchmarks/handoff.py --backend nccl --depths 2048,32768 --layers 52 \
    --repeats 3 --settle 0.2 --json "$out/handoff2.json"
  ;;
determinism)
  b determinism 300 benchmarks/determinism.py --model --json "$out/determinism.json"
  ;;
repeats)
  for env in MLX_DEFAULTS=1 MLX_USE_CUDA_GRAPHS=0 MLX_CUDA_USE_CUDNN_SDPA=0; do
    echo "== $env" | tee -a "$out/repeats.md"
    env "$env" timeout 150 python3 benchmarks/determinism.py --lengths 4097 --calls 2 --repeats \
      --steps 6 --runs 3 --json "$out/repeats_${env%%=*}.json" 2>&1 | tee -a "$out/repeats.md" \
      | tail -14
  done
  ;;
buffers)
  b buffers 300 benchmarks/determinism.py --lengths 4097,32768,131072 --calls 2 --writes \
    --prompt 4600 --steps 8 --json "$out/buffers.json"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rxX tests/caches/test_owned_buffers.py \
    2>&1 | tee "$out/owned_buffers.log" | tail -15
  ;;
store)
  b store 240 benchmarks/store_ceiling.py --repeats 5 --race-steps 0 --json "$out/store.json"
  b store 320 benchmarks/store_ceiling.py --race-only --race-steps 10000 --json "$out/store_race.json"
  ;;
esac
