#!/usr/bin/env bash
# Install overlap and what it needs on this machine.
# - A machine whose torch already sees CUDA GPUs (the GPU image): install overlap alone, change
#   nothing else (no network there; torch, triton, cuda-python, cupy are on the image).
# - Otherwise (CPU development, CI): the CPU build of torch 2.13.0, triton 3.6.0 (its
#   interpreter runs the kernels), numpy < 2.4 (triton 3.6's interpreter fails on 2.4), pytest,
#   hypothesis, ruff; then overlap.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e .
else
  $PY -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4" "pytest>=8" "hypothesis>=6" ruff
  $PY -m pip install -q --no-deps -e .
fi
$PY -c "import overlap, torch, triton; print('overlap', overlap.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
