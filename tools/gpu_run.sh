#!/usr/bin/env bash
# Usage: bash tools/gpu_run.sh MODE [MODE...]
# One device call: environment, then what MODE asks for; logs and JSON under $OUT (default
# bench_out/gpu). Modes:
#   suite    the GPU suite, one process per test (a hang costs one test's 150 s), 2+ GPUs;
#            with 4+ GPUs the 2-GPU tests run as two pairs at once (run_suite)
#   one_gpu  what one GPU can run: the launch-memo and host-road tests, the host profile, the
#            model and exchange benchmarks' correctness checks (two ranks on one GPU)
#   bench    the benchmark on the bench shapes, with NCCL as it is and with NCCL_P2P_DISABLE=1
#   soak     100 s of mixed calls, every result checked, memory tracked (2 GPUs)
#   soak1    the same with both ranks on one GPU over gloo (host road; correctness only)
#   timeline one traced all-reduce and reduce-scatter call (2 GPUs)
#   four     the example and the benchmark at R = 4 (4 GPUs)
# The 2-GPU suite does not fit one 600 s call on 2 GPUs: split it with PYTEST_K (a pytest -k
# expression) over two calls, or run it on 4. TEST_TIMEOUT: seconds per test (150 unless set).
set -u
usage() { sed -n '2,/^set -u/{/^#/s/^# \{0,1\}//p}' "$0"; }
case "${1:-}" in -h | --help) usage; exit 0 ;; "") usage >&2; exit 2 ;; esac
for mode in "$@"; do
  case $mode in suite | one_gpu | bench | soak | soak1 | timeline | four) ;;
    *) echo "tools/gpu_run.sh: unknown mode $mode (--help lists them)" >&2; exit 2 ;; esac
done
# the Python that holds the install (scripts/python: $PYTHON, an active venv, ./.venv, python3)
PY=$(cd "$(dirname "$0")/.." && pwd)/scripts/python
"$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null ||
  { echo "tools/gpu_run.sh needs CUDA GPUs and this machine has none" >&2; exit 1; }
OUT=${OUT:-bench_out/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
quiet() { grep -v "^W1\|OMP_NUM_THREADS\|^\*\*\*"; }
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  "$PY" -c "import cuda.bindings, cupy; print('cuda-bindings', cuda.bindings.__version__, 'cupy', cupy.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
big=4096x8192x4096,8192x8192x14336,16384x8192x4096,8192x4096x4096
run_tests() {  # lane test-id...: one process per test, its output in $OUT/one_test_LANE.log
  local lane=$1; shift
  for id in "$@"; do
    local t0=$SECONDS
    if timeout "${TEST_TIMEOUT:-150}" "$PY" -m pytest -m gpu "$id" -q -p no:cacheprovider > "$OUT/one_test_$lane.log" 2>&1; then
      echo "PASS $((SECONDS - t0))s $id"
    else
      echo "FAIL(rc=$?) $((SECONDS - t0))s $id"; tail -25 "$OUT/one_test_$lane.log"
    fi
  done 2>&1
}
run_suite() {  # [pytest -k expression]. With 4 GPUs or more: the 4-GPU tests first, then the
  # others as two lanes at once, GPUs 0-1 and 2-3 (about half the time; tests run slower
  # beside each other: give the longest TEST_TIMEOUT=300)
  local ids=() four=() i=0
  mapfile -t ids < <("$PY" -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider --collect-only ${1:+-k "$1"} 2>/dev/null | grep "::")
  if [ "$(nvidia-smi -L | wc -l)" -lt 4 ]; then
    run_tests all "${ids[@]}" | tee -a "$OUT/gpu_suite.log"
    return
  fi
  local a=() b=()
  for id in "${ids[@]}"; do
    case $id in
      *four_gpus*) four+=("$id") ;;
      *) if ((i++ % 2)); then b+=("$id"); else a+=("$id"); fi ;;
    esac
  done
  run_tests four "${four[@]}" | tee -a "$OUT/gpu_suite.log"
  CUDA_VISIBLE_DEVICES=0,1 run_tests a "${a[@]}" > "$OUT/suite_a.log" &
  CUDA_VISIBLE_DEVICES=2,3 run_tests b "${b[@]}" > "$OUT/suite_b.log"
  wait
  cat "$OUT/suite_a.log" "$OUT/suite_b.log" | tee -a "$OUT/gpu_suite.log"
  rm -f "$OUT/suite_a.log" "$OUT/suite_b.log"
}
run_bench() {  # name extra-args...
  local name=$1; shift
  timeout "${BENCH_TIMEOUT:-240}" "$PY" -m torch.distributed.run --nproc-per-node="${NPROC:-2}" -m overlap.bench \
    --out "$OUT/bench_$name.json" "$@" 2>&1 | quiet
}
for mode in "$@"; do
  case $mode in
    suite) run_suite "${PYTEST_K:-}" ;;
    one_gpu)
      run_suite one_gpu
      for c in all_reduce reduce_scatter all_gather; do
        shape=4096x8192x4096; [ $c = all_gather ] && shape=8192x8192x4096
        NCCL_P2P_DISABLE=1 timeout 120 "$PY" -m torch.distributed.run --nproc-per-node=2 tools/host_profile.py --one-gpu \
          --backend auto --collective $c --shape $shape --out "/tmp/host_$c.txt" > /dev/null 2>&1
        grep "^== \|host ms\|relative" "/tmp/host_$c.txt" | tee -a "$OUT/host_one_gpu.txt"
      done
      NCCL_P2P_DISABLE=1 timeout 240 "$PY" -m torch.distributed.run --nproc-per-node=2 tools/model_bench.py --one-gpu \
        --iters 3 --warmup 1 --out "$OUT/model_bench_one_gpu.json" 2>&1 | quiet | tail -8
      NCCL_P2P_DISABLE=1 timeout 240 "$PY" -m torch.distributed.run --nproc-per-node=2 tools/exchange_bench.py --one-gpu \
        --iters 3 --warmup 1 --out "$OUT/exchange_bench_one_gpu.json" 2>&1 | quiet | tail -10 ;;
    bench)
      run_bench nvlink --iters 20
      NCCL_P2P_DISABLE=1 run_bench no_p2p --iters 20 --shapes $big ;;
    soak)
      timeout 170 "$PY" -m torch.distributed.run --nproc-per-node=2 tools/soak.py --seconds 100 --out "$OUT/soak.json" 2>&1 | quiet | tail -25 ;;
    soak1)
      NCCL_P2P_DISABLE=1 timeout "${SOAK_TIMEOUT:-200}" "$PY" -m torch.distributed.run --nproc-per-node=2 tools/soak.py \
        --one-gpu --seconds "${SOAK_SECONDS:-120}" --out "$OUT/soak_one_gpu.json" 2>&1 | quiet | tail -25 ;;
    timeline)
      for c in all_reduce reduce_scatter; do
        timeout 60 "$PY" -m torch.distributed.run --nproc-per-node=2 tools/timeline.py --collective $c --out "$OUT/timeline_$c.json" 2>&1 | quiet | tail -2
      done ;;
    four)
      timeout 120 "$PY" examples/tp_linear.py 2>&1 | quiet | tee "$OUT/example.log"
      NPROC=4 run_bench four_nvlink --shapes $big --iters 10
      NPROC=4 NCCL_P2P_DISABLE=1 BENCH_TIMEOUT=200 run_bench four_no_p2p --shapes 4096x8192x4096,16384x8192x4096 --iters 5 ;;
  esac
done
