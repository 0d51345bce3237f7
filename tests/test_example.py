"""No devices: the examples as a user runs them (the README's main example,
``examples/tp_linear.py``, its quickstart under torchrun, ``examples/quickstart.py``, the
decoder layer, ``examples/tp_transformer.py``, and a Hugging Face model through
``overlap.nn.parallelize``, ``examples/hf_parallelize.py``): 2 CPU ranks on gloo, the real
kernel in Triton's interpreter, results checked by the examples themselves, and the path
counts or plans they print (``overlap.stats``, ``Plan.describe``)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    # this checkout's overlap, whatever an editable install elsewhere points at
    env["PYTHONPATH"] = str(EXAMPLES.parent) + os.pathsep + env.get("PYTHONPATH", "")
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
    assert re.search(r"matmul_collective +overlap via torch +1\n", done.stdout), done.stdout


@pytest.mark.parametrize("interpret", ["1", None])
def test_quickstart_runs_under_torchrun(interpret):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(EXAMPLES.parent) + os.pathsep + env.get("PYTHONPATH", "")
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLES / "quickstart.py")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # as the README says: the kernel in the interpreter, else the plain path (same result)
    plan = "on 2 ranks through torch: " if interpret else "fallback (CPU tensors and TRITON"
    assert done.stdout.count(plan) == 2, done.stdout


def test_decoder_layer_example_runs():
    done = _run("tp_transformer.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for sp in (False, True):  # both ranks, both variants, every check printed
        assert done.stdout.count(f"sequence_parallel={sp}: relative errors") == 2, done.stdout
    assert "ok: 2 CPU ranks" in done.stdout
    assert "overlap via torch" in done.stdout and "plain:" not in done.stdout, done.stdout


def test_hf_parallelize_example_runs():
    pytest.importorskip("transformers")  # (the test extra installs it; CI does)
    done = _run("hf_parallelize.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("max |logits - unsharded logits|") == 2, done.stdout
    assert re.search(r"all_gather_matmul +overlap via torch", done.stdout), done.stdout
