"""A row-parallel linear layer (Megatron style) whose all-reduce hides behind its matmul.

Each rank holds a slice of the input features: ``x_shard [M, K / R]`` and
``weight_shard [N, K / R]``; the layer's output is ``all_reduce(x_shard @ weight_shard.t())``.

    python examples/tp_linear.py

With 2 or more CUDA GPUs it relaunches itself under torchrun, one rank per GPU (NCCL). Without,
it spawns 2 CPU ranks on gloo and runs the real Triton kernel in Triton's interpreter.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import overlap


def layer(x_shard: torch.Tensor, weight_shard: torch.Tensor) -> torch.Tensor:
    """``x_shard [M, K / R]``, ``weight_shard [N, K / R]`` -> ``[M, N]``, summed over ranks."""
    return overlap.matmul_allreduce(x_shard, weight_shard.t())


def run(rank: int, world: int, device: torch.device, M: int, N: int, K: int, chunks) -> None:
    torch.manual_seed(rank)
    x_shard = torch.randn(
        M,
        K // world,
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
    )
    weight_shard = torch.randn(N, K // world, device=device, dtype=x_shard.dtype)
    p = overlap.plan(x_shard, weight_shard.t(), chunks=chunks)
    y = overlap.matmul_collective(x_shard, weight_shard.t(), chunks=chunks)
    ref = x_shard.double() @ weight_shard.double().t()
    dist.all_reduce(ref)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    line = f"rank {rank}: {p.describe()}\nrank {rank}: relative error vs float64 {err:.2e}"
    if device.type == "cuda":

        def timed(fn):
            for _ in range(3):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            start.record()
            for _ in range(10):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 10

        def plain():
            out = x_shard @ weight_shard.t()
            dist.all_reduce(out)

        t_plain, t_ovl = timed(plain), timed(lambda: layer(x_shard, weight_shard))
        line += f"\nrank {rank}: matmul + all_reduce {t_plain:.3f} ms, overlap {t_ovl:.3f} ms"
    print(line, flush=True)
    tol = 2e-2 if x_shard.dtype == torch.bfloat16 else 1e-5
    assert err < tol, f"relative error {err} above {tol}"
    if rank == 0:
        print(overlap.stats(), flush=True)  # which path each op's calls took, and why


def _cpu_rank(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    run(rank, world, torch.device("cpu"), M=256, N=192, K=256, chunks=4)
    dist.destroy_process_group()
    # skip the interpreter's finalization, which gloo's worker threads can abort ("terminate
    # called without an active exception", SIGABRT after a correct run; torch PR 179291)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    if "RANK" in os.environ:  # a torchrun worker
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        run(
            dist.get_rank(),
            dist.get_world_size(),
            torch.device("cuda", local),
            M=8192,
            N=8192,
            K=8192,
            chunks=None,
        )
        dist.destroy_process_group()
    elif torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        n = torch.cuda.device_count()
        os.execvp(
            sys.executable,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={n}",
                os.path.abspath(__file__),
            ],
        )
    else:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined (spawn inherits)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_cpu_rank, args=(2, os.path.join(d, "init")), nprocs=2)
        print("ok: 2 CPU ranks, overlap path with the Triton interpreter")


if __name__ == "__main__":
    main()
