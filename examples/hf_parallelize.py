"""Shard a Hugging Face model over 2 ranks by its own tensor-parallel plan, in one call.

    python examples/hf_parallelize.py

Spawns 2 CPU ranks (gloo; the kernels run in Triton's interpreter), builds a tiny Llama from
its config (no download), parallelizes a copy with sequence parallelism and compares its
logits with the whole model's, then which path the calls took. Needs ``transformers``.
"""

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

import overlap


def run(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)  # the same whole model on every rank
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, num_hidden_layers=2, vocab_size=128)  # fmt: skip
    model = LlamaForCausalLM(config)
    sharded = overlap.nn.parallelize(copy.deepcopy(model), sequence_parallel=True)
    ids = torch.randint(0, config.vocab_size, (2, 8))  # [batch, sequence]
    err = (sharded(ids).logits - model(ids).logits).abs().max().item()
    q = sharded.model.layers[0].self_attn.q_proj
    print(f"rank {rank}: q_proj {type(q).__name__} weight {list(q.weight.shape)}, "
          f"max |logits - unsharded logits| {err:.1e}", flush=True)  # fmt: skip
    assert err < 1e-5
    if rank == 0:
        print(overlap.stats(), flush=True)  # which path the layers' calls took
    dist.destroy_process_group()
    # skip the interpreter's finalization, which gloo's worker threads can abort ("terminate
    # called without an active exception", SIGABRT after a correct run; torch PR 179291)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined (spawn inherits)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run, args=(os.path.join(d, "init"),), nprocs=2)
