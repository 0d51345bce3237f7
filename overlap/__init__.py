"""overlap: hide the collective that follows a matmul behind the matmul itself.

``import overlap`` works without a GPU, Triton's GPU backend, CuPy or cuda-python: kernels and
optional backends are imported on first use.
"""

from .api import matmul_all_to_all, matmul_allreduce, matmul_collective, matmul_reduce_scatter, plan
from .guard import RankMismatchError, configure
from .plan import COLLECTIVES, OPS, Plan
from .tuner import Tuned, tune

__all__ = [
    "COLLECTIVES",
    "OPS",
    "Plan",
    "RankMismatchError",
    "Tuned",
    "configure",
    "matmul_all_to_all",
    "matmul_allreduce",
    "matmul_collective",
    "matmul_reduce_scatter",
    "plan",
    "tune",
]
__version__ = "0.1.0"
