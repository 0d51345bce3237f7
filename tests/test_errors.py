"""No devices: bad arguments get a clear TypeError/ValueError naming the argument; world size 1
(torch.distributed not initialized) is the plain matmul."""

from __future__ import annotations

import pytest
import torch

import overlap


def _xw(M=8, K=16, N=12, dtype=torch.float32):
    return torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(collective="gather"), ValueError, "collective"),
        (dict(op="max"), ValueError, "op"),
        (dict(collective="all_to_all", op="avg"), ValueError, "op"),
        (dict(backend="mpi"), ValueError, "backend"),
        (dict(chunks=1), ValueError, "chunks"),
    ],
)
def test_bad_options(kwargs, exc, match):
    x, w = _xw()
    with pytest.raises(exc, match=match):
        overlap.matmul_collective(x, w, **kwargs)


def test_bad_tensors():
    x, w = _xw()
    with pytest.raises(TypeError, match="x must be"):
        overlap.matmul_allreduce(x.numpy(), w)
    with pytest.raises(TypeError, match="w must be"):
        overlap.matmul_allreduce(x, [1.0])
    with pytest.raises(ValueError, match="w must be 2-D"):
        overlap.matmul_allreduce(x, w[0])
    with pytest.raises(ValueError, match="K mismatch"):
        overlap.matmul_allreduce(x, torch.randn(15, 12))
    with pytest.raises(TypeError, match="w.dtype"):
        overlap.matmul_allreduce(x, w.half())
    with pytest.raises(TypeError, match="x.dtype"):
        overlap.matmul_allreduce(x.double(), w.double())
    with pytest.raises(TypeError, match="x.dtype"):
        overlap.matmul_allreduce(x.int(), w.int())
    with pytest.raises(ValueError, match="x must have"):
        overlap.matmul_allreduce(torch.tensor(1.0), w)
    with pytest.raises(ValueError, match="on meta"):
        overlap.matmul_allreduce(x, w.to("meta"))


def test_bad_out():
    x, w = _xw()
    with pytest.raises(ValueError, match="out must have shape"):
        overlap.matmul_allreduce(x, w, out=torch.empty(8, 13))
    with pytest.raises(TypeError, match="out.dtype"):
        overlap.matmul_allreduce(x, w, out=torch.empty(8, 12, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        overlap.matmul_allreduce(x, w, out=torch.empty(12, 8).t())
    with pytest.raises(TypeError, match="out must be"):
        overlap.matmul_allreduce(x, w, out=[0.0])


@pytest.mark.parametrize("collective", overlap.COLLECTIVES)
def test_world_size_one_is_the_plain_matmul(collective):
    assert not torch.distributed.is_initialized()
    x, w = torch.randn(2, 5, 16), torch.randn(12, 16).t()
    p = overlap.plan(x, w, collective)
    assert p.path == "fallback" and "world size 1" in p.reason
    out = torch.full((10, 12) if collective == "reduce_scatter" else (2, 5, 12), float("nan"))
    got = overlap.matmul_collective(x, w, collective, out=out)
    ref = (x.double() @ w.double()).reshape(out.shape)
    assert got is out and not torch.isnan(got).any()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_backend_choice_without_a_gpu():
    """The copy-engine transport needs CUDA tensors: on CPU "auto" and "ce" take the group's
    own collectives; the other backends pass through unchanged."""
    from overlap.api import _resolve_backend
    from overlap.plan import make_plan

    x = torch.randn(128, 16)
    p = make_plan(128, 64, 16, world_size=2, collective="reduce_scatter", dtype_bits=32,
                  interpreter=True, chunks=2)  # fmt: skip
    assert p.path == "overlap"
    assert _resolve_backend("auto", p, x, None) == "torch"
    assert _resolve_backend("ce", p, x, None) == "torch"
    assert _resolve_backend("cupy", p, x, None) == "cupy"


def test_backend_choice_by_road():
    """On CUDA, "auto" takes the copy-engine transport over P2P for any world size and
    through host memory for 2 ranks only (measured slower than sequential at 4); "ce" takes
    any road and raises without one; column-band plans go to NCCL."""
    from overlap.api import _by_route
    from overlap.plan import make_plan

    def rows(R, M=512):
        return make_plan(M, 256, 64, world_size=R, collective="reduce_scatter", dtype_bits=16,
                         interpreter=True, chunks=2 * R, num_sms=4)  # fmt: skip

    for R in (2, 4):
        assert rows(R).n_col_bands == 1
        assert _by_route("auto", "peer", rows(R)) == "ce"
        assert _by_route("ce", "host", rows(R)) == "ce"
        assert _by_route("auto", None, rows(R)) == "torch"
        with pytest.raises(ValueError, match="one host"):
            _by_route("ce", None, rows(R))
    assert _by_route("auto", "host", rows(2)) == "ce"
    assert _by_route("auto", "host", rows(4)) == "torch"
    cols = make_plan(16, 8192, 4096, world_size=2, collective="all_reduce", dtype_bits=16,
                     interpreter=True, chunks=4)  # fmt: skip
    assert cols.path == "overlap" and cols.n_col_bands > 1
    assert _by_route("auto", "peer", cols) == _by_route("ce", "peer", cols) == "torch"
