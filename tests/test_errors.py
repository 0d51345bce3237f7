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


def test_repeated_calls_are_checked():
    """A call whose signature ran before finds what it runs in ``context.calls``: what the
    signature does not hold is still checked (``out``, ``chunks``' type), and a call that
    needs autograd gets it after the same call without it."""
    x, w = _xw(K=12)  # (N = K: out may alias x)
    for call in (overlap.matmul_allreduce, overlap.all_gather_matmul):
        call(x, w, out=torch.empty(8, 12), chunks=4)
        with pytest.raises(ValueError, match="share memory"):
            call(x, w, out=x, chunks=4)
        with pytest.raises(ValueError, match="out is on meta"):
            call(x, w, out=torch.empty(8, 12, device="meta"), chunks=4)
        with pytest.raises(TypeError, match="chunks must be an int"):
            call(x, w, chunks=4.0)
        call(x, w)
        xg = x.clone().requires_grad_()
        with pytest.raises(ValueError, match="out= does not support autograd"):
            call(xg, w, out=torch.empty(8, 12))
        g = torch.randn(8, 12)
        y = call(xg, w)
        y.backward(g)
        torch.testing.assert_close(y, x @ w)
        torch.testing.assert_close(xg.grad, g @ w.t())


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


def test_a_launcher_without_a_process_group_raises(monkeypatch):
    """Under torchrun (``WORLD_SIZE`` > 1) without ``init_process_group``, every op, layer,
    ``parallelize`` and ``plan`` raises naming it (world size 1 would return each rank's own
    un-summed product); ``WORLD_SIZE=1`` is world size 1."""
    from torch import nn

    x, w = _xw()
    w3, ids, splits = torch.randn(2, 16, 12), torch.zeros(8, dtype=torch.long), [8]
    uneven = dict(input_split_sizes=splits, output_split_sizes=splits)
    table, bags = torch.randn(5, 3), torch.tensor([0, 1])
    calls = [
        lambda: overlap.matmul_collective(x, w),
        lambda: overlap.matmul_allreduce(x, w),
        lambda: overlap.matmul_reduce_scatter(x.clone().requires_grad_(), w),
        lambda: overlap.matmul_all_to_all(x, w),
        lambda: overlap.matmul_all_to_all(x, w, **uneven),
        lambda: overlap.all_gather_matmul(x, w),
        lambda: overlap.grouped_matmul_all_to_all(x, w3, ids, **uneven),
        lambda: overlap.all_to_all_grouped_matmul(x, w3, ids, **uneven),
        lambda: overlap.embedding_bag_all_to_all([table], [bags], [bags]),
        lambda: overlap.plan(x, w),
        lambda: overlap.nn.ColumnParallelLinear(16, 12),
        lambda: overlap.nn.RowParallelLinear.from_linear(nn.Linear(16, 12)),
    ]
    try:
        import transformers

        config = transformers.LlamaConfig(hidden_size=16, num_attention_heads=2,
                                          num_key_value_heads=2, intermediate_size=32,
                                          num_hidden_layers=1, vocab_size=32)  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        calls.append(lambda: overlap.nn.parallelize(model))
    except ImportError:
        pass
    # calls decided before (world size 1, no WORLD_SIZE) are kept by their signature, which
    # holds w's address: a new w at a freed one would skip the check (a process's WORLD_SIZE
    # does not change outside tests)
    overlap.release()
    monkeypatch.setenv("WORLD_SIZE", "2")
    for i, call in enumerate(calls):
        with pytest.raises(RuntimeError, match="init_process_group"):
            call()
            pytest.fail(f"call {i} did not raise")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for call in calls:
        call()


def test_bad_group():
    x, w = _xw()
    for call in (overlap.matmul_collective, overlap.plan):
        with pytest.raises(TypeError, match="group must be"):
            call(x, w, group="tp")


def test_backend_choice_without_a_gpu():
    """The copy-engine transport needs CUDA tensors: on CPU "auto" and "ce" take the group's
    own collectives, and the plan names the transport it runs."""
    x, w = torch.randn(128, 16), torch.randn(16, 64)
    with _two_rank_world():
        for backend in ("auto", "ce", "torch"):
            p = overlap.plan(x, w, "reduce_scatter", chunks=2, backend=backend)
            assert p.transport == "torch" and not p.blocked, (backend, p)
        overlap.release()


def _two_rank_world():
    """A fake world of 2 ranks in this process (no collective runs in the callers)."""
    import contextlib

    import torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg  # noqa: F401 (registers "fake")

    @contextlib.contextmanager
    def world():
        store = dist.HashStore()
        dist.init_process_group("fake", store=store, rank=0, world_size=2)
        try:
            yield
        finally:
            dist.destroy_process_group()

    return world()


def test_transport_choice_by_road():
    """On CUDA outside capture, "auto" takes the copy engines over P2P for any world size and
    through host memory for 2 ranks only (measured slower than sequential at 4); "ce" takes
    any road and raises without one; column-band plans (decode-sized M), M not divisible by R,
    CPU calls and graph capture go to NCCL; "torch" and "cupy" are taken as asked."""
    from overlap.comm import HostTransport, PeerTransport, TorchTransport, select
    from overlap.comm.nccl import CupyTransport

    for R in (2, 4):
        kw = dict(eligible=True, world_size=R, rows_split=True, rows_divisible=True)
        assert select("auto", "peer", **kw) is PeerTransport
        assert select("ce", "host", **kw) is HostTransport
        assert select("auto", None, **kw) is TorchTransport
        assert select("ce", None, **{**kw, "eligible": False}) is TorchTransport  # CPU
        assert select("cupy", "peer", **kw) is CupyTransport
        with pytest.raises(ValueError, match="one host"):
            select("ce", None, **kw)
        for bad in (dict(rows_split=False), dict(rows_divisible=False), dict(eligible=False)):
            assert select("auto", "peer", **{**kw, **bad}) is TorchTransport
            assert select("ce", "peer", **{**kw, **bad}) is TorchTransport
        # a capture: the copy engines only where an eager call sized their buffers
        assert select("ce", "peer", **kw, fits=lambda cls: False) is TorchTransport
        assert select("ce", "peer", **kw, fits=lambda cls: True) is PeerTransport
    two = dict(eligible=True, rows_split=True, rows_divisible=True)
    assert select("auto", "host", world_size=2, **two) is HostTransport
    assert select("auto", "host", world_size=4, **two) is TorchTransport
