"""No devices: the examples as a user runs them (the README's main example,
``examples/tp_linear.py``, and the decoder layer, ``examples/tp_transformer.py``): 2 CPU ranks
on gloo, the real kernel in Triton's interpreter, results checked against float64 by the
examples themselves."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300,
        env=env,
    )  # fmt: skip


def test_readme_example_runs():
    done = _run("tp_linear.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "relative error vs float64" in done.stdout
    assert done.stdout.count("through torch: 4 chunks") == 2, done.stdout  # both ranks overlap
    assert "ok: 2 CPU ranks" in done.stdout


def test_decoder_layer_example_runs():
    done = _run("tp_transformer.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for sp in (False, True):  # both ranks, both variants, every check printed
        assert done.stdout.count(f"sequence_parallel={sp}: relative errors") == 2, done.stdout
    assert "ok: 2 CPU ranks" in done.stdout
