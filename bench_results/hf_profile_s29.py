"""Diagnostic (not committed): why hf_bench's compiled SP training step is slower than eager SP.
torchrun --nproc-per-node=2 .scratch/hf_profile.py OUT.json [modes]
Per mode: host ms per step with the GPU busy (a long sleep queued first: host never waits unless
something syncs), the GPU profile of 2 steps (kinds, top kernels, timeline), the calls' paths."""
import argparse, copy, json, os, sys, time
sys.path.insert(0, "tools")
import torch, torch.distributed as dist
import hf_bench, model_bench
from _benchrun import paths
import overlap

def main():
    out = sys.argv[1]
    modes = (sys.argv[2] if len(sys.argv) > 2 else "plain_sp,overlap_sp,overlap_sp_c,plain_c,overlap_c").split(",")
    local = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(local); dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    args = argparse.Namespace(dims="8b", family="llama", layers=2, seq=8192)
    torch._dynamo.config.cache_size_limit = 64
    whole = hf_bench._whole(args, torch.bfloat16, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, whole.config.vocab_size, (1, args.seq), device=dev, generator=gen)
    g = torch.randn(1, args.seq, whole.config.hidden_size, dtype=torch.bfloat16, device=dev, generator=gen)
    res = {}
    for mode in modes:
        t0 = time.time()
        model = overlap.nn.parallelize(copy.deepcopy(whole), sequence_parallel="_sp" in mode)
        run = hf_bench._compile_layers(model) if mode.endswith("_c") else model
        plain = mode.startswith("plain")
        step = hf_bench._forced(plain, lambda run=run: hf_bench._step(run, ids, g))
        for _ in range(3):
            step()
        torch.cuda.synchronize(); dist.barrier()
        host = []
        for _ in range(5):
            torch.cuda._sleep(300_000_000)
            t = time.perf_counter(); step(); host.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize(); dist.barrier()
        overlap.stats(reset=True)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        calls = paths()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(5):
            step()
        ev[1].record(); torch.cuda.synchronize()
        prof = model_bench._profile(step, f"{out}.{mode}.trace.json.gz" if dist.get_rank() == 0 else None)
        r = dict(host_ms=sorted(host), step_ms=ev[0].elapsed_time(ev[1]) / 5,
                 paths=calls, prep_s=time.time() - t0, **prof)
        res[mode] = r
        if dist.get_rank() == 0:
            print(f"== {mode}: step {r['step_ms']:.2f} ms, host {[round(h,2) for h in r['host_ms']]}, "
                  f"gpu wall {r.get('wall_ms',0):.2f} compute {r.get('compute_ms',0):.2f} "
                  f"exposed {r.get('exposed_comm_ms',0):.2f} idle {r.get('idle_ms',0):.2f} paths {calls}", flush=True)
            print("   kinds", {k: round(v, 2) for k, v in r["kinds"].items()})
            for k, v in r["top"][:12]:
                print(f"   {v:7.3f} {k[:110]}")
            print("   gaps", r.get("gaps", [])[:5], flush=True)
    if dist.get_rank() == 0:
        json.dump(res, open(out, "w"), indent=1, default=str)
    dist.destroy_process_group()

main()
