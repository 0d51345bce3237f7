#!/usr/bin/env bash
# Install overlap, and what it needs that this machine lacks, into the Python that
# scripts/python runs (see there): $PYTHON, an active venv or conda env, or else python3; where
# that is a distribution's own Python, which pip may not change (PEP 668), a new ./.venv.
#
# - A torch that imports is kept as it is: never replaced, upgraded or downgraded.
# - Where torch sees CUDA GPUs (the GPU image: no network), overlap alone is installed.
# - Where torch is missing: torch 2.11.0 on a machine with an NVIDIA GPU, 2.13.0 without (the
#   versions the GPU and CPU runs are tested with), from the package index, or from
#   $TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu, the CPU-only build).
# - Then overlap with the test extra (pyproject.toml holds every version bound).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\n== %s\n' "$*"; }

# A distribution's Python: make (or reuse) ./.venv. It sees that Python's packages only where
# that Python already has a torch, which is then kept.
if [ -z "${PYTHON:-}${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ ! -x .venv/bin/python ] &&
  python3 -c "import os, sys, sysconfig
sys.exit(sys.prefix != sys.base_prefix
         or not os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))"; then
  say "$(command -v python3) is managed by the system (PEP 668): making a virtual environment in ./.venv"
  opts=()
  if python3 -c "import torch" 2>/dev/null; then opts=(--system-site-packages); fi
  if ! python3 -m venv "${opts[@]}" .venv; then
    rm -rf .venv
    echo "Could not make a virtual environment with $(command -v python3). On Debian or Ubuntu:" >&2
    echo "    sudo apt install python3-venv" >&2
    echo "then run this script again; or run it from an active venv or conda env." >&2
    exit 1
  fi
fi
PY=scripts/python
"$PY" -m pip --version >/dev/null

if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  # an error here (a torch that is installed but does not import) stops the script
  torch_version=$("$PY" -c "import torch; print(torch.__version__)")
  cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
  say "Keeping the installed torch $torch_version"
else
  cuda=0
  gpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  pin=$([ "$gpu" -gt 0 ] && echo 2.11.0 || echo 2.13.0)
  index=()
  if [ -n "${TORCH_INDEX:-}" ]; then index=(--index-url "$TORCH_INDEX"); fi
  if [ "$gpu" -gt 0 ]; then
    say "No torch yet; $gpu NVIDIA GPU(s) seen: installing torch==$pin (a CUDA build, several GB)." \
      "For another CUDA version: TORCH_INDEX=https://download.pytorch.org/whl/cu126 (for example)."
  elif [ -z "${TORCH_INDEX:-}" ]; then
    say "No torch yet, and no NVIDIA GPU seen: installing torch==$pin from the package index."
    cat <<'MSG'
   From PyPI that is the build with CUDA: several GB to download, an environment of about
   5.4 GB. The CPU-only build makes it about 2.2 GB. For it, stop now (Ctrl-C) and run:
       TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/install.sh
MSG
    if [ -t 0 ]; then sleep 10; fi
  else
    say "No torch yet: installing torch==$pin from $TORCH_INDEX"
  fi
  "$PY" -m pip install "torch==$pin" "${index[@]}"
  # (its metadata, not `import torch`: numpy comes with overlap below, and torch imported
  # without it warns "Failed to initialize NumPy")
  torch_version=$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))")
fi

if [ "$cuda" = 1 ]; then
  # the GPU image: its torch, triton, numpy and CUDA packages stay exactly as they are
  say "torch sees CUDA GPUs: installing overlap alone (--no-deps)"
  "$PY" -m pip install --no-deps --no-build-isolation -e .
  "$PY" -c "import pytest, hypothesis" 2>/dev/null ||
    echo "To run the tests: $PY -m pip install -e '.[test]'"
else
  say "Installing overlap and its test extra (pyproject.toml), keeping torch $torch_version"
  keep=$(mktemp)
  trap 'rm -f "$keep"' EXIT
  echo "torch==$torch_version" >"$keep"
  if ! "$PY" -m pip install -c "$keep" -e ".[test]"; then
    echo "overlap needs torch as pyproject.toml bounds it; this script never replaces the" \
      "installed torch $torch_version: change it yourself, then run the script again." >&2
    exit 1
  fi
fi

say "Installed"
"$PY" - <<'EOF'
import os, subprocess, sys
import numpy, torch, triton
import overlap

if torch.cuda.is_available():
    build = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) visible"
elif torch.version.cuda:
    build = f"CUDA {torch.version.cuda} build, no GPU visible: CPU ranks, Triton's interpreter"
else:
    build = "CPU-only build: CPU ranks, Triton's interpreter"


def size(path):
    return subprocess.run(["du", "-sh", path], capture_output=True, text=True).stdout.split()[0]


print(f"overlap {overlap.__version__} ({os.path.dirname(overlap.__file__)})")
print(f"torch {torch.__version__} ({build}), triton {triton.__version__}, numpy {numpy.__version__}")
print(f"python {sys.version.split()[0]}: {sys.executable}")
packages = os.path.dirname(os.path.dirname(torch.__file__))
env = sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, "conda-meta"))
if env:
    print(f"environment {sys.prefix}: {size(sys.prefix)}")
if not env or not packages.startswith(sys.prefix + os.sep):
    print(f"torch's packages {packages}: {size(packages)}")
EOF
echo "
Run:   scripts/python examples/tp_linear.py
Tests: scripts/python -m pytest -m quick    (a first check: about a minute)
       scripts/python -m pytest             (all tests without a GPU: 15 min on 2 free cores)"
if [ "$("$PY" -c 'import sys; print(sys.prefix)')" = "$PWD/.venv" ] && [ -z "${VIRTUAL_ENV:-}" ]; then
  echo "To use plain python instead of scripts/python:  source .venv/bin/activate"
fi
