#!/usr/bin/env bash
# The README's first command as a new user runs it, on fresh clones of this checkout's HEAD
# (commit first), on a machine without a GPU; CI runs this (.ci/run). Two cases:
#  1. the distribution's own python3 (PEP 668, $SYSTEM_PYTHON's directory first on PATH): the
#     install makes ./.venv and installs torch there, from the package index;
#  2. an active venv that sees an installed torch (--system-site-packages on the python3 this
#     script is started with): the install keeps that torch and makes no .venv.
# Each then runs the main example through scripts/python and collects every test (each test
# module imports in the installed environment).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
SYSTEM_PYTHON=${SYSTEM_PYTHON:-/usr/bin/python3}
fail() {
  echo "check_install: $*" >&2
  exit 1
}

use() { # clone, install with the environment given as arguments, run the example, collect
  local dir=$tmp/$1
  shift
  git clone -q "$src" "$dir"
  (cd "$dir" && env -u PYTHON -u VIRTUAL_ENV -u CONDA_PREFIX "$@" bash scripts/install.sh) ||
    fail "install.sh failed"
  (cd "$dir" && env -u PYTHON -u VIRTUAL_ENV -u CONDA_PREFIX "$@" \
    scripts/python examples/tp_linear.py >"$dir/example.log" 2>&1) ||
    fail "the example failed: $(tail -20 "$dir/example.log")"
  grep -q "ok: 2 CPU ranks" "$dir/example.log" || fail "the example did not finish: $dir"
  (cd "$dir" && env -u PYTHON -u VIRTUAL_ENV -u CONDA_PREFIX "$@" \
    scripts/python -m pytest --collect-only -q >"$dir/collect.log" 2>&1) ||
    fail "collecting the tests failed: $(tail -20 "$dir/collect.log")"
}

echo "== 1. $SYSTEM_PYTHON, managed by the system (PEP 668)"
managed=$("$SYSTEM_PYTHON" -c "import os, sysconfig
print(os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))")
[ "$managed" = True ] || fail "$SYSTEM_PYTHON is not externally managed: set SYSTEM_PYTHON"
! "$SYSTEM_PYTHON" -c "import torch" 2>/dev/null || fail "$SYSTEM_PYTHON has a torch already"
use system PATH="$(dirname "$SYSTEM_PYTHON"):$PATH"
"$tmp/system/.venv/bin/python" -c "import torch, sys
assert torch.__file__.startswith(sys.prefix), torch.__file__" || fail "torch is not in .venv"
echo "== 1: ok, $(du -sh "$tmp/system/.venv" | cut -f1) in .venv"

echo "== 2. a venv that sees the torch of $(command -v python3)"
before=$(python3 -c "import torch; print(torch.__version__, torch.__file__)") ||
  fail "python3 has no torch"
python3 -m venv --system-site-packages "$tmp/env"
use venv VIRTUAL_ENV="$tmp/env" PATH="$tmp/env/bin:$PATH"
[ ! -e "$tmp/venv/.venv" ] || fail "the install made a .venv in an active venv"
after=$("$tmp/env/bin/python" -c "import torch; print(torch.__version__, torch.__file__)")
[ "$before" = "$after" ] || fail "torch changed: $before -> $after"
echo "== 2: ok, torch kept: $after"
