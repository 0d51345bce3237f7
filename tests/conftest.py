"""Test tiers (see README "Tests"):

- no devices: plan properties, argument checks (test_plan.py, test_errors.py);
- Triton interpreter on CPU tensors: the real kernel (test_kernel.py);
- 2, 4 and 8 CPU ranks on gloo: the real chunk plan, signal protocol and collectives end to end
  (test_distributed.py);
- GPU, marker ``gpu``, deselected by default: NCCL on CUDA devices (test_gpu.py).

Triton reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
imports overlap.gemm; spawned ranks inherit it.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
