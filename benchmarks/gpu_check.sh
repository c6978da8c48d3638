#!/usr/bin/env bash
# GPU check of inplace_abn, for a machine with a CUDA GPU and this repository:
# builds the package in place with the CUDA kernels (Hopper only, to keep the
# build short), runs the CUDA tests and the GPU benchmark, and writes
# everything to OUTDIR, each step under `timeout`.
#
#   benchmarks/gpu_check.sh OUTDIR
#
# OUTDIR/env.txt      GPU, driver, torch
# OUTDIR/build.log    pip install -e . (INPLACE_ABN_FORCE_CUDA=1, TORCH_CUDA_ARCH_LIST=9.0)
# OUTDIR/tests.log    pytest -m cuda tests -q
# OUTDIR/bench.txt    python benchmarks/gpu_bench.py --no-search
# OUTDIR/memcheck.log compute-sanitizer memcheck over the small CUDA tests
# OUTDIR/racecheck.log compute-sanitizer racecheck (shared-memory reductions)
# OUTDIR/summary.txt  exit status and duration of each step
#
# GPU_CHECK_SECONDS (default 470) bounds the whole run; GPU_CHECK_STEPS
# (default "tests bench memcheck racecheck") picks the steps after the build.
set -u
OUT=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
export INPLACE_ABN_FORCE_CUDA=1
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

TOTAL=${GPU_CHECK_SECONDS:-470}
STEPS=${GPU_CHECK_STEPS:-tests bench memcheck racecheck}
T0=$(date +%s)
left() { echo $((TOTAL - ($(date +%s) - T0))); }
: >"$OUT/summary.txt"
step() {  # step NAME LOG MAX_SECONDS CMD...
  local name=$1 log=$2 max=$3
  shift 3
  local budget
  budget=$(left)
  [ "$budget" -gt "$max" ] && budget=$max
  if [ "$budget" -le 5 ]; then
    echo "$name: skipped (out of time)" | tee -a "$OUT/summary.txt"
    return 1
  fi
  local s rc
  s=$(date +%s)
  timeout --kill-after=10 "$budget" "$@" >"$log" 2>&1
  rc=$?
  echo "$name: rc=$rc$([ $rc -eq 124 ] && echo ' (timed out)') in $(($(date +%s) - s)) s (limit $budget s)" |
    tee -a "$OUT/summary.txt"
  return $rc
}

{
  date -u
  nvidia-smi || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no device")'
  command -v nvcc && nvcc --version | tail -2
  command -v compute-sanitizer && compute-sanitizer --version | tail -1
  echo "CUDA_HOME=${CUDA_HOME:-} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
} >"$OUT/env.txt" 2>&1

if step build "$OUT/build.log" 300 "$PY" -m pip install --no-build-isolation --no-deps -v -e .; then
  # the small tests only under the sanitizers: they slow every kernel 10-100 times
  SMALL="not realistic and not beyond and not graph and not opcheck"
  SAN=(compute-sanitizer --error-exitcode 99 --print-limit 20)
  # our kernels only, where this compute-sanitizer can filter by name
  compute-sanitizer --help 2>/dev/null | grep -q -- --kernel-name && SAN+=(--kernel-name kns=inplace_abn)
  for st in $STEPS; do
    case $st in
      tests) step tests "$OUT/tests.log" 200 "$PY" -m pytest -m cuda tests -q -rs --durations=8 -p no:cacheprovider ;;
      bench) step bench "$OUT/bench.txt" 200 "$PY" benchmarks/gpu_bench.py --no-search ;;
      memcheck) step memcheck "$OUT/memcheck.log" 150 "${SAN[@]}" --tool memcheck "$PY" -m pytest tests/test_cuda.py \
        -q -x -p no:cacheprovider -k "$SMALL and (float32 or bfloat16 or agrees or empty or relu or preserve)" ;;
      racecheck) step racecheck "$OUT/racecheck.log" 90 "${SAN[@]}" --tool racecheck "$PY" -m pytest \
        tests/test_cuda.py -q -x -p no:cacheprovider -k "agrees_with_cpu or (groupnorm and float32 and 4d)" ;;
    esac
  done
else
  echo "build failed: tests and benchmark skipped" | tee -a "$OUT/summary.txt"
  tail -40 "$OUT/build.log"
fi
echo "total: $(($(date +%s) - T0)) s" | tee -a "$OUT/summary.txt"
