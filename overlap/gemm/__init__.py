"""Triton GEMM kernels and their launchers. Imported lazily: it needs Triton."""

from .matmul import Fuse, chunked_matmul

__all__ = ["Fuse", "chunked_matmul"]
