"""A tensor-parallel matmul whose all-reduce hides behind it, checked against plain torch.

    torchrun --nproc-per-node 2 examples/quickstart.py

One rank per GPU on NCCL in bf16; without CUDA, CPU ranks on gloo in fp32, where the call
takes the plain path (the matmul, then one all-reduce) unless ``TRITON_INTERPRET=1`` is set:
then the library's Triton kernel runs in Triton's interpreter (fp32 and fp16; bf16 is wrong
there, so bf16 on CPU always takes the plain path).
"""

import os

import torch
import torch.distributed as dist

import overlap

cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
M, K, N = (8192, 4096, 8192) if cuda else (256, 128, 256)  # K: this rank's input features
dtype = torch.bfloat16 if cuda else torch.float32
torch.manual_seed(dist.get_rank())  # every rank its own shard
x = torch.randn(M, K, device=device, dtype=dtype)  # x_shard [M, K]
w = torch.randn(K, N, device=device, dtype=dtype)  # w_shard [K, N]
y = overlap.matmul_allreduce(x, w)  # == dist.all_reduce(x @ w), the reduce hidden
ref = x @ w
dist.all_reduce(ref)
err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()  # bf16: ~4e-3
assert err < (2e-2 if cuda else 1e-5), f"relative error {err}"
print(f"rank {dist.get_rank()}: relative error {err:.1e}, {overlap.plan(x, w).describe()}")
dist.destroy_process_group()
