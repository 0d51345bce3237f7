"""Triton GEMM kernels and their launchers. Imported lazily: it needs Triton."""

from .matmul import chunked_matmul

__all__ = ["chunked_matmul"]
