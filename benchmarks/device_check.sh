#!/usr/bin/env bash
# One device call: build, GPU tests, sanitizers, Nsight Compute, benchmarks (METHOD.md:
# "one script that builds, checks and times in one call"). Logs go to $OUT (or ./out).
#
#   bash benchmarks/device_check.sh [build] [test] [test-matmul] [sanitize] [ncu] [bench-quant]
#       [bench-matmul] [bench-model] [bench-ops] [overhead] [qlora] [sharding] [harness]
#
# With no arguments: build test sanitize bench-matmul. Each step has its own time limit and
# a failing step does not stop the next; a short summary is printed last.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDAARCHS=${CUDAARCHS:-90a} CMAKE_BUILD_PARALLEL_LEVEL=16
steps=${*:-build test sanitize bench-matmul}
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
run() {  # run NAME LIMIT CMD...: time-limited, log in $OUT/NAME.log, GPU freed afterwards
  local name=$1 limit=$2; shift 2
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  pkill -f "benchmarks/cuda_profile.py" 2>/dev/null || true
  say "$name rc=$rc"; tail -4 "$OUT/$name.log" | cut -c1-300
}
for s in $steps; do
  case $s in
    build) run build 300 env JAX_FP4_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -e . ;;
    test) run test 400 python3 -m pytest -q -ra tests/test_cuda_kernels.py tests/test_cuda_matmul.py ;;
    test-matmul) run test_matmul 400 python3 -m pytest -q -ra -x tests/test_cuda_matmul.py tests/test_matmul_paths.py ;;
    test-gpu)  # every GPU test file, in 4 processes sharing the GPU
      for i in 0 1 2 3; do
        XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_FP4_TEST_SHARD=$i/4 timeout 420 python3 -m pytest -q -ra \
          ${GPU_TESTS:-tests/test_cuda_kernels.py tests/test_cuda_matmul.py tests/test_matmul_paths.py tests/test_cuda_stochastic.py} \
          ${GPU_TESTS_EXTRA:-} > "$OUT/test_gpu_$i.log" 2>&1 &
      done
      wait; say "test-gpu"; for i in 0 1 2 3; do tail -1 "$OUT/test_gpu_$i.log"; done ;;
    sanitize)
      run memcheck 200 env XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck python3 benchmarks/cuda_sanitize.py
      run racecheck 200 compute-sanitizer --tool racecheck python3 benchmarks/cuda_sanitize.py ;;
    ncu) run ncu 240 ncu --clock-control none --kernel-name regex:"wmatmul|gemm|gemv" \
           --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
           python3 benchmarks/cuda_profile.py wmatmul nvfp4 ;;
    bench-quant) run bench_quant 400 python3 benchmarks/bench_quant.py --results "$OUT/RESULTS_quant.md" ;;
    bench-matmul) run bench_matmul 500 python3 benchmarks/bench_matmul.py --shapes 8192x28672 28672x8192 \
           --ms 1 4 16 64 256 1024 --rule-ms 256 --scaled 4096 8192 --results "$OUT/RESULTS_matmul.md" ;;
    bench-model) run bench_model ${MODEL_LIMIT:-560} python3 benchmarks/bench_model.py --ms ${MODEL_MS:-1 16 64} \
           ${MODEL_ARGS:-} --results "$OUT/RESULTS_model.md" --json "$OUT/bench_model.json" ;;
    bench-ops) run bench_ops 400 python3 benchmarks/bench_matmul.py --shapes 4096x1024 4096x4096 \
           4096x14336 14336x4096 8192x28672 --ms 1 16 --tensor-scale --prepare --reference-formats \
           --rule-ms --scaled --results "$OUT/RESULTS_ops.md" ;;
    qlora) run qlora 300 python3 benchmarks/qlora_memory.py --json "$OUT/qlora_memory.json" ;;
    sharding)  # needs >= 2 GPUs: the partitioned lowering's tests, then tensor parallel 1 vs 2
      run test_sharding_gpu 200 python3 -m pytest -q -ra -x tests/test_sharding_gpu.py  # -x: a failed kernel on one GPU leaves the other waiting in its collective
      run bench_tp ${TP_LIMIT:-560} python3 benchmarks/bench_model.py --tp 1 2 ${TP_ARGS:-} --ms ${TP_MS:-1 4 16 64} --no-kernel-sum \
           --results "$OUT/RESULTS_tp.md" --json "$OUT/bench_tp.json" ;;
    overhead)  # a step's time outside the kernels, with XLA's command buffers on (default) and off
      # OVERHEAD_FLAGS: XLA_FLAGS variants separated by "|" (an empty one is XLA's default);
      # OVERHEAD_ARGS: more step_overhead.py arguments (e.g. --no-trace)
      IFS='|' read -r -a variants <<< "${OVERHEAD_FLAGS-|--xla_gpu_enable_command_buffer=|--xla_gpu_graph_min_graph_size=1}"
      for m in ${OVERHEAD_M:-1}; do for flags in "${variants[@]}"; do
        XLA_FLAGS="$flags" timeout 200 python3 benchmarks/step_overhead.py --m $m \
          --formats ${OVERHEAD_FORMATS:-nvfp4} ${OVERHEAD_ARGS:-} >> "$OUT/overhead.log" 2>&1
      done; done
      say "overhead"; grep -E "^(XLA_FLAGS|bf16|nvfp4|mxfp4|int4|nf4|bnb_fp4|#   host|#   kernel|Traceback|[A-Za-z]*Error)" "$OUT/overhead.log" | cut -c1-220 ;;
    harness)  # benchmarks/wmatmul_harness.cu linked against the kernels' units, and one run
      run harness_build 400 nvcc -std=c++17 -O3 -fmad=false --expt-relaxed-constexpr \
        -gencode=arch=compute_90a,code=sm_90a -Icsrc -diag-suppress 940,2473 \
        benchmarks/wmatmul_harness.cu csrc/cuda/wmatmul/launch.cu csrc/cuda/wmatmul/tma.cu \
        -o "$OUT/wmatmul_harness"
      run harness 120 "$OUT/wmatmul_harness" nvfp4 8192 28672 16 32 1 5 ;;
    *) say "unknown step $s" ;;
  esac
done
say done
