#!/usr/bin/env bash
# Set-up on a fresh machine: a virtualenv (.venv, or $VENV) with torch 2.14.1,
# torchvision 0.29.1 and the build/test/example tools (diffusers and timm: tests
# and examples only, never imported by inplace_abn itself), then inplace_abn built
# in place (editable). The CUDA sources are compiled whenever nvcc is found,
# even without a GPU, so a CUDA compile error fails here.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  # torch's CUDA build makes the venv ~5.8 GB and the build ~0.5 GB: say so up
  # front rather than let pip stop halfway with "No space left on device".
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $((7 * 1024 * 1024)) ]; then
    echo "setup_env.sh: $((free_kb / 1024)) MB free in $PWD; the virtualenv and build need about 7 GB" >&2
    exit 1
  fi
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet torch==2.14.1 torchvision==0.29.1 ninja setuptools wheel pytest numpy tqdm matplotlib \
  onnx onnxruntime onnxscript diffusers==0.42.1 timm==1.0.31

export MAX_JOBS=${MAX_JOBS:-$(nproc)}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ -z "${INPLACE_ABN_NO_CUDA:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
  export CUDA_HOME INPLACE_ABN_FORCE_CUDA=1
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
    # No GPU: a compile check for one architecture keeps the build short.
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  fi
fi
"$PY" -m pip install --quiet --no-build-isolation -e .
"$PY" -c "import inplace_abn, torch; print('inplace_abn', inplace_abn.__version__, '| native:', inplace_abn.HAS_NATIVE, '| CUDA kernels built:', torch._C._dispatch_has_kernel_for_dispatch_key('inplace_abn::forward_', 'CUDA'))"
