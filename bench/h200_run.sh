#!/usr/bin/env bash
# One device call on an H200: GPU tests, the bench and/or the GEMV tile sweep, in the order
# given, with logs and results under $OUT.
#   bash bench/h200_run.sh tests,bench,sweep [bench args]
# A sweep run before the bench hands its tile table to it (SPECSCOPE_GEMV_TUNED).
# A Triton cache from an earlier call (.triton_cache.tgz, carried) saves the compiles.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
PARTS=$1; shift
mkdir -p ~/.triton
[ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C ~/.triton
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv | tee "$OUT/smi.txt"
for part in ${PARTS//,/ }; do
  case $part in
    tests) timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py \
             tests/test_fused.py 2>&1 | tee "$OUT/tests.log" ;;
    bench) [ -f "$OUT/sweep.json" ] && export SPECSCOPE_GEMV_TUNED="$OUT/sweep.json"
           timeout "${BENCH_S:-400}" python3 bench/gpu_h200.py --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" ;;
    sweep) timeout "${SWEEP_S:-200}" python3 bench/gemv_sweep.py --out "$OUT/sweep.json" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" ;;
  esac
done
ls -la "$OUT"
