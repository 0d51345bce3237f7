"""No devices: the README's main example (``examples/tp_linear.py``) as a user runs it: 2 CPU
ranks on gloo, the real kernel in Triton's interpreter, its result checked against float64
by the example itself."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "tp_linear.py"


def test_readme_example_runs():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "relative error vs float64" in done.stdout
    assert done.stdout.count("through torch: 4 chunks") == 2, done.stdout  # both ranks overlap
    assert "ok: 2 CPU ranks" in done.stdout
