"""``overlap.stats()``: every call of a public op counted by the path it took, and the one-time
notice (Python's ``logging``) when a cause the user can change kept calls off the overlapped
path. In one process: world size 1, and a fake world of 2 ranks (torch's "fake" backend: its
collectives do nothing), where CPU tensors without the interpreter take the plain path."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

import overlap


@contextlib.contextmanager
def _fake_world():
    from torch.testing._internal.distributed import fake_pg  # noqa: F401 (registers "fake")

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        overlap.release()
        dist.destroy_process_group()


def test_counts_by_op_and_path_and_reset():
    overlap.stats(reset=True)
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    for _ in range(3):
        overlap.matmul_allreduce(x, w)
    overlap.all_gather_matmul(x, w)
    got = overlap.stats(reset=True)
    assert got == {
        "matmul_allreduce": {"plain: world size 1: nothing to communicate": 3},
        "all_gather_matmul": {"plain: world size 1: nothing to communicate": 1},
    }, got
    assert "matmul_allreduce" in str(got) and "3" in str(got)
    assert overlap.stats() == {}


def test_every_op_is_counted_by_the_name_the_user_called():
    """Each public op counts its calls under its own name, eagerly and under autograd (the
    custom op's path), whatever collective runs underneath."""
    overlap.stats(reset=True)
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    w3, ids, splits = torch.randn(2, 4, 6), torch.zeros(8, dtype=torch.long), [8]
    uneven = dict(input_split_sizes=splits, output_split_sizes=splits)
    calls = {
        "matmul_collective": lambda x: overlap.matmul_collective(x, w, "reduce_scatter"),
        "matmul_allreduce": lambda x: overlap.matmul_allreduce(x, w),
        "matmul_reduce_scatter": lambda x: overlap.matmul_reduce_scatter(x, w),
        "matmul_all_to_all": lambda x: overlap.matmul_all_to_all(x, w),
        "all_gather_matmul": lambda x: overlap.all_gather_matmul(x, w),
        "grouped_matmul_all_to_all": lambda x: overlap.grouped_matmul_all_to_all(
            x, w3, ids, **uneven),
        "all_to_all_grouped_matmul": lambda x: overlap.all_to_all_grouped_matmul(
            x, w3, ids, **uneven),
    }  # fmt: skip
    for name, call in calls.items():
        for grad in (False, True):
            call(x.clone().requires_grad_(grad))
            got = overlap.stats(reset=True)
            assert got == {name: {"plain: world size 1: nothing to communicate": 1}}, (grad, got)
    for grad in (False, True):  # the uneven all-to-all through both of its public names
        overlap.matmul_all_to_all(x.clone().requires_grad_(grad), w, **uneven)
        overlap.matmul_collective(x.clone().requires_grad_(grad), w, "all_to_all", **uneven)
        assert set(overlap.stats(reset=True)) == {"matmul_all_to_all", "matmul_collective"}
    table = torch.randn(5, 3)
    overlap.embedding_bag_all_to_all([table], [torch.tensor([0, 1])], [torch.tensor([0, 1])])
    assert set(overlap.stats(reset=True)) == {"embedding_bag_all_to_all"}


def test_plain_path_for_a_changeable_reason_is_logged_once(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    overlap.stats(reset=True)
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    with _fake_world(), caplog.at_level(logging.WARNING, logger="overlap"):
        for _ in range(2):
            overlap.matmul_reduce_scatter(x, w)
    how = "plain: CPU tensors and TRITON_INTERPRET is not 1"
    assert overlap.stats(reset=True) == {"matmul_reduce_scatter": {how: 2}}
    notices = [r.getMessage() for r in caplog.records if r.name == "overlap"]
    assert len(notices) == 1 and "TRITON_INTERPRET" in notices[0], notices


def test_expected_plain_path_is_not_logged(caplog):
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    with caplog.at_level(logging.WARNING, logger="overlap"):
        overlap.matmul_allreduce(x, w)  # world size 1: nothing to say
    assert not [r for r in caplog.records if r.name == "overlap"]


def test_bfloat16_in_the_interpreter_names_the_installed_triton():
    import importlib.metadata

    overlap.stats(reset=True)
    x, w = torch.randn(64, 32).bfloat16(), torch.randn(32, 48).bfloat16()
    with _fake_world():
        overlap.matmul_allreduce(x, w, chunks=2)
    ((how, n),) = overlap.stats(reset=True)["matmul_allreduce"].items()
    version = importlib.metadata.version("triton")
    assert how.startswith("plain: the Triton interpreter") and f"(triton {version})" in how, how


def test_a_call_before_init_process_group_does_not_answer_for_one_after(monkeypatch):
    """The calls' memo (``context.calls``) keeps what a call was decided to run; a call made
    at world size 1, before the process group, must be planned again once there is one."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    overlap.matmul_allreduce(x, w)
    overlap.stats(reset=True)
    with _fake_world():
        overlap.matmul_allreduce(x, w)
    assert overlap.stats(reset=True) == {
        "matmul_allreduce": {"plain: CPU tensors and TRITON_INTERPRET is not 1": 1}
    }


def test_the_layers_count_the_ops_of_their_table(monkeypatch):
    """Forward and backward of each layer (docs/api.md's table) on a fake world of 2 ranks:
    counted under the public ops that run them."""
    from overlap.nn import ColumnParallelLinear, RowParallelLinear

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    overlap.stats(reset=True)
    with _fake_world():
        for cls, sp, ops in (
            (ColumnParallelLinear, False, {"matmul_allreduce"}),  # (the backward's)
            (RowParallelLinear, False, {"matmul_allreduce"}),
            (ColumnParallelLinear, True, {"all_gather_matmul", "matmul_reduce_scatter"}),
            (RowParallelLinear, True, {"matmul_reduce_scatter", "all_gather_matmul"}),
        ):
            layer = cls(8, 8, bias=False, sequence_parallel=sp)
            x = torch.randn(4, 8 // 2 if cls is RowParallelLinear else 8, requires_grad=True)
            layer(x).sum().backward()
            got = overlap.stats(reset=True)
            assert set(got) == ops and all(sum(h.values()) == 1 for h in got.values()), (
                cls.__name__, sp, got)  # fmt: skip
