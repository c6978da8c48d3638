#!/usr/bin/env bash
# GPU check of inplace_abn, for a machine with a CUDA GPU and this repository:
# builds the package in place with the CUDA kernels (Hopper only, to keep the
# build short), runs the CUDA tests and the GPU benchmark, and writes
# everything to OUTDIR. Finishes within 8 minutes (each step under `timeout`).
#
#   benchmarks/gpu_check.sh OUTDIR
#
# OUTDIR/env.txt      GPU, driver, torch
# OUTDIR/build.log    pip install -e . (INPLACE_ABN_FORCE_CUDA=1, TORCH_CUDA_ARCH_LIST=9.0)
# OUTDIR/tests.log    pytest -m cuda tests -q
# OUTDIR/bench.txt    python benchmarks/gpu_bench.py
# OUTDIR/summary.txt  exit status and duration of each step
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

TOTAL=470  # seconds, leaves a margin under 8 minutes
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
  echo "CUDA_HOME=${CUDA_HOME:-} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
} >"$OUT/env.txt" 2>&1

if step build "$OUT/build.log" 300 "$PY" -m pip install --no-build-isolation --no-deps -v -e .; then
  step tests "$OUT/tests.log" 150 "$PY" -m pytest -m cuda tests -q -rs
  step bench "$OUT/bench.txt" 400 "$PY" benchmarks/gpu_bench.py
else
  echo "build failed: tests and benchmark skipped" | tee -a "$OUT/summary.txt"
  tail -40 "$OUT/build.log"
fi
echo "total: $(($(date +%s) - T0)) s" | tee -a "$OUT/summary.txt"
