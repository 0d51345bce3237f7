#!/usr/bin/env bash
# One device call: environment, GPU test suite, benchmarks. Results under $OUT (or ./gpu_out).
# Usage on a 2-GPU machine: bash tools/gpu_run.sh [suite|bench|all|final|verify|sweep|probe]
#   final: example, suite, main bench; verify: example, suite, decode/all-to-all/socket rows
#   probe: soak, timelines, NCCL CTA limits, fp32 GEMM (after `suite`, in a second call)
#   check: suite and soak; measure (= ce_final): example, both benches, timelines, suite
#   tune: both benches with overlap.tune choosing each row's plan (suite_tune: suite first)
#   graphs: suite, then decode and one large shape timed as CUDA-graph replays
#   nccl_env: NCCL protocol / channel settings on two large shapes (contention probe)
#   host: host time per call (tools/host_profile.py); verify_host: example, suite, host
#   benches: main bench (NVLink, no P2P) and the tuned bench on the large shapes
#   check_final: three GPU tests, one bench shape, NCCL_SHM_USE_CUDA_MEMCPY=1 without P2P
#   host_final: the copy-engine transport through host memory (no P2P): tests, bench
#   ce: the copy-engine transport: its tests, the large shapes through it and through NCCL,
#       and two timelines
#   gather: example, both benches, timelines, the copy-engine tests (~400 s); rest: the other
#       GPU tests (~380 s). measure/ce_final ran past 600 s once the suite had 19 tests.
#   four (4 GPUs): the example and the benchmark at R = 4, NVLink and without P2P
#   host_ce: where the host time of a call through the copy-engine transport goes (not yet run)
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
what=${1:-all}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  python3 -c "import cuda.bindings, cupy; print('cuda-bindings', cuda.bindings.__version__, 'cupy', cupy.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
run_bench() {  # mode-name extra-args...
  local name=$1; shift
  timeout ${BENCH_TIMEOUT:-240} torchrun --nproc-per-node=${NPROC:-2} -m overlap.bench --out "$OUT/bench_$name.json" "$@" \
    2>&1 | grep -v "^W1\|OMP_NUM_THREADS\|^\*\*\*"  # the JSON holds every number
}
run_suite() {  # [pytest -k expression]: one process per test, so a hang costs one test's timeout
  local ids
  ids=$(python3 -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider --collect-only ${1:+-k "$1"} 2>/dev/null | grep "::")
  for id in $ids; do
    local t0=$SECONDS
    if timeout 150 python3 -m pytest -m gpu "$id" -q -p no:cacheprovider > "$OUT/one_test.log" 2>&1; then
      echo "PASS $((SECONDS - t0))s $id"
    else
      echo "FAIL(rc=$?) $((SECONDS - t0))s $id"; tail -25 "$OUT/one_test.log"
    fi
  done 2>&1 | tee -a "$OUT/gpu_suite.log"
}
run_example() {
  timeout 120 python3 examples/tp_linear.py 2>&1 | grep -v "^W1\|OMP_NUM\|^\*\*\*" | tee "$OUT/example.log"
}
run_timelines() {  # name-prefix [timeline.py args...]: all-reduce and reduce-scatter
  local name=$1; shift
  for c in all_reduce reduce_scatter; do
    timeout 60 torchrun --nproc-per-node=2 tools/timeline.py --collective $c --out "$OUT/${name}_$c.json" "$@" 2>&1 | grep -v "^W1\|OMP_NUM\|^\*\*\*" | tail -2
  done
}
big=4096x8192x4096,8192x8192x14336,16384x8192x4096,8192x4096x4096
if [ "$what" = suite ] || [ "$what" = all ]; then
  run_suite
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  run_bench nvlink
  NCCL_P2P_DISABLE=1 run_bench no_p2p
fi
if [ "$what" = final ]; then
  run_example
  run_suite
  run_bench nvlink --iters 30
  NCCL_P2P_DISABLE=1 run_bench no_p2p --iters 30
  run_bench a2a_nvlink --collectives all_to_all --chunks 4 --shapes $big --iters 10
  NCCL_P2P_DISABLE=1 run_bench a2a_no_p2p --collectives all_to_all --chunks 4 --shapes $big --iters 10
fi
if [ "$what" = verify ]; then  # after GPU code changed: correctness first, then extra rows
  run_example
  run_suite
  dec=16x8192x4096,128x8192x4096
  run_bench decode_nvlink --shapes $dec --iters 200
  NCCL_P2P_DISABLE=1 run_bench decode_no_p2p --shapes $dec --iters 200
  run_bench a2a_default_nvlink --collectives all_to_all --shapes $big --iters 10
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 run_bench net_transport --collectives all_reduce,reduce_scatter --shapes $big --iters 10
fi
if [ "$what" = probe ]; then
  timeout 150 torchrun --nproc-per-node=2 tools/soak.py --seconds 75 --out "$OUT/soak.json" 2>&1 | grep -v "^W1\|OMP_NUM\|^\*\*\*" | tail -25
  run_timelines timeline
  run_bench ctas --collectives all_reduce,reduce_scatter --shapes 4096x8192x4096,16384x8192x4096 --max-ctas 0,4,8,16 --iters 10
  timeout 100 python3 tools/gemm_sweep.py "$OUT/gemm_fp32.json" --fp32 2>&1 | tail -8
fi
if [ "$what" = check ]; then
  run_suite
  timeout 170 torchrun --nproc-per-node=2 tools/soak.py --seconds 100 --out "$OUT/soak.json" 2>&1 | grep -v "^W1\|OMP_NUM\|^\*\*\*" | tail -25
fi
if [ "$what" = graphs ]; then
  run_suite
  dec=16x8192x4096,128x8192x4096
  run_bench graph_decode_nvlink --graph --shapes $dec --chunks 2,4 --iters 100
  NCCL_P2P_DISABLE=1 run_bench graph_decode_no_p2p --graph --shapes $dec --chunks 2,4 --iters 100
  run_bench graph_large_nvlink --graph --shapes 4096x8192x4096 --collectives all_reduce,reduce_scatter --iters 20
fi
if [ "$what" = nccl_env ]; then
  two=4096x8192x4096,16384x8192x4096
  for v in "NCCL_PROTO=Simple" "NCCL_PROTO=LL128" "NCCL_MIN_NCHANNELS=32"; do
    export "$v"
    run_bench "env_${v//=/_}" --collectives all_reduce,reduce_scatter --shapes $two --iters 10
    unset "${v%%=*}"
  done
fi
if [ "$what" = host ] || [ "$what" = verify_host ]; then  # host time per call, and where it goes
  if [ "$what" = verify_host ]; then run_example; run_suite; fi
  for b in torch cupy; do
    timeout 120 torchrun --nproc-per-node=2 tools/host_profile.py --backend $b \
      --out "$OUT/host_$b.txt" > /dev/null 2>&1
    grep "host ms\|^== " "$OUT/host_$b.txt"
  done
fi
if [ "$what" = benches ]; then  # the current-code tables of BENCHMARKS.md
  run_bench nvlink --iters 20
  NCCL_P2P_DISABLE=1 run_bench no_p2p --iters 20 --shapes $big
  run_bench tuned_gpu_nvlink --tune --iters 20 --shapes $big --collectives all_reduce,reduce_scatter
fi
if [ "$what" = tune ] || [ "$what" = suite_tune ]; then  # overlap.tune per row
  [ "$what" = suite_tune ] && run_suite
  run_bench tuned_nvlink --tune --iters 20
  NCCL_P2P_DISABLE=1 run_bench tuned_no_p2p --tune --iters 20 --shapes $big
fi
if [ "$what" = sweep ]; then  # chunk counts x backends, to choose the defaults
  for b in torch cupy; do
    run_bench sweep_nvlink_$b --backend $b --collectives all_reduce,reduce_scatter --chunks 2,4,8 --iters 10 --shapes $big
    NCCL_P2P_DISABLE=1 run_bench sweep_no_p2p_$b --backend $b --collectives all_reduce,reduce_scatter --chunks 2,4,8 --iters 10 --shapes 4096x8192x4096,8192x8192x14336
  done
fi
if [ "$what" = ce ]; then
  run_bench ce --shapes $big --iters 20 --backend ce
  run_bench torch --shapes $big --iters 20 --backend torch --collectives all_reduce,reduce_scatter
  run_timelines timeline_ce --backend ce
  run_suite "ce or auto or copy"
  run_suite "not (ce or auto or copy)"
fi
if [ "$what" = measure ] || [ "$what" = ce_final ]; then  # the numbers of BENCHMARKS.md
  run_example
  run_bench nvlink --iters 20
  NCCL_P2P_DISABLE=1 run_bench no_p2p --iters 20 --shapes $big
  run_timelines timeline
  run_suite "ce or auto or copy"
  run_suite "not (ce or auto or copy)"
fi
if [ "$what" = gather ]; then  # first of two calls (then `rest`): example, benches, timelines, ce tests
  run_example
  run_bench nvlink --iters 20
  NCCL_P2P_DISABLE=1 BENCH_TIMEOUT=100 run_bench no_p2p --shapes $big --iters 10
  run_timelines timeline
  run_suite "ce or auto or copy"
fi
if [ "$what" = four ]; then  # a 4-GPU machine: the example, both roads at R = 4 (err column)
  run_example
  NPROC=4 run_bench four_nvlink --shapes $big --iters 10
  NPROC=4 NCCL_P2P_DISABLE=1 BENCH_TIMEOUT=200 run_bench four_no_p2p \
    --shapes 4096x8192x4096,16384x8192x4096 --iters 5
fi
if [ "$what" = host_ce ]; then  # host time per call through the copy-engine transport
  for c in all_reduce reduce_scatter; do
    timeout 120 torchrun --nproc-per-node=2 tools/host_profile.py --backend auto --collective $c \
      --out "$OUT/host_ce_$c.txt" > /dev/null 2>&1
    grep "host ms\|^== " "$OUT/host_ce_$c.txt"
  done
fi
if [ "$what" = rest ]; then  # the GPU tests `gather` leaves out (~380 s)
  run_suite "not (ce or auto or copy)"
fi
if [ "$what" = check_final ]; then  # after test-harness changes: a few tests, one bench shape, an NCCL knob
  run_suite "copy_engine or backward or (graph and auto)"
  run_bench one --shapes 4096x8192x4096 --iters 10
  NCCL_P2P_DISABLE=1 NCCL_SHM_USE_CUDA_MEMCPY=1 run_bench shm_cudamemcpy --shapes 4096x8192x4096,8192x8192x14336 --collectives all_reduce,reduce_scatter --iters 10
fi
if [ "$what" = host_final ]; then
  run_suite "copy_engine_transport"
  NCCL_P2P_DISABLE=1 BENCH_TIMEOUT=100 run_bench no_p2p --shapes $big --iters 10
  run_suite "suite_two_gpus and ce and no_p2p"
fi
