import os, sys, collections, torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank, sp):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{29560+int(sp)}", rank=rank, world_size=2)
    import transformers, overlap
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   intermediate_size=128, num_hidden_layers=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    m = transformers.LlamaModel(cfg).float()
    m = overlap.nn.parallelize(m, sequence_parallel=sp)
    counts = {}
    def comp(name):
        def f(gm, ex):
            c = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            if rank == 0 and sp:
                for n in gm.graph.nodes:
                    if n.op == "call_function" and ("overlap" in str(n.target) or "copy" in str(n.target) or "empty_like" in str(n.target)):
                        print(name, n.name, n.target, [getattr(a, "meta", {}).get("val", a).shape if hasattr(getattr(a, "meta", {}).get("val", a), "shape") else a for a in n.args][:8], flush=True)
            counts.setdefault(name, []).append(c)
            return make_boxed_func(gm.forward)
        return f
    def backend(gm, ex):
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        return aot_module_simplified(gm, ex, fw_compiler=comp("fw"), bw_compiler=comp("bw"), partition_fn=min_cut_rematerialization_partition)
    run_ = torch.compile(m, fullgraph=True, backend=backend)
    ids = torch.randint(0, 128, (1, 32))
    h = run_(ids).last_hidden_state
    (h * torch.randn_like(h)).sum().backward()
    if rank == 0:
        for k, cs in counts.items():
            tot = sum(cs, collections.Counter())
            print(f"sp={sp} {k}: graphs {len(cs)}, nodes {sum(tot.values())}")
            for op, n in sorted(tot.items(), key=lambda t: -t[1]):
                if any(s in op for s in ("overlap", "cat", "clone", "copy", "contiguous", "mm", "bmm", "transpose", "permute", "view", "split", "_to_copy", "expand", "empty", "zeros", "add", "slice", "select", "index")):
                    print(f"   {n:4d} {op}")
    dist.destroy_process_group()
if __name__ == "__main__":
    for sp in (True,):
        mp.spawn(run, args=(sp,), nprocs=2)
