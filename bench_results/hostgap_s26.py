"""Where an eager step's bench time exceeds its GPU time (session 26 diagnosis): per mode and
phase, host issue time of fn() vs GPU elapsed (events), allocator counters, and the longest CUDA
runtime calls on the host under a CPU+CUDA profile of bench-style iterations."""
import gc, json, os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import torch, torch.distributed as dist
import model_bench as mb

def main():
    dims = sys.argv[1]; out = sys.argv[2]
    local = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(local); dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    R, rank = dist.get_world_size(), dist.get_rank()
    hidden, ffn, heads, kv = mb.DIMS[dims]; dtype = torch.bfloat16; seq = 8192
    with torch.device(dev):
        torch.manual_seed(0)
        ref = [mb.Block(hidden, ffn, heads, kv, True).to(dtype) for _ in range(2)]
        x = torch.randn(seq, hidden, dtype=dtype); g = torch.randn(seq, hidden, dtype=dtype)
    for b in ref: mb.interleave(b, R)
    mine = slice(rank * seq // R, (rank + 1) * seq // R)
    res = {}
    for mode in sys.argv[3].split(","):
        xs, gs = (x[mine], g[mine]) if mode in mb.SP else (x, g)
        model = mb.build(mode, ref, None)
        for phase in ("prefill", "train"):
            def fn():
                if phase == "train":
                    mb._step(model, xs, gs)
                else:
                    with torch.no_grad():
                        model(xs)
            for _ in range(3): fn()
            torch.cuda.synchronize(); dist.barrier()
            st0 = torch.cuda.memory_stats()
            rows = []
            for i in range(8):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                t0 = time.perf_counter(); ev[0].record(); fn(); t1 = time.perf_counter(); ev[1].record(); ev[1].synchronize(); t2 = time.perf_counter()
                rows.append(((t1 - t0) * 1e3, ev[0].elapsed_time(ev[1]), (t2 - t0) * 1e3))
            st1 = torch.cuda.memory_stats()
            alloc = {k: st1.get(k, 0) - st0.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")}
            gc.disable()
            rows_nogc = []
            for i in range(8):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                t0 = time.perf_counter(); ev[0].record(); fn(); t1 = time.perf_counter(); ev[1].record(); ev[1].synchronize()
                rows_nogc.append(((t1 - t0) * 1e3, ev[0].elapsed_time(ev[1])))
            gc.enable()
            # GPU alone: 3 iterations queued behind a sleep
            torch.cuda.synchronize(); dist.barrier()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            torch.cuda._sleep(200_000_000); ev[0].record()
            for _ in range(3): fn()
            ev[1].record(); ev[1].synchronize(); queued = ev[0].elapsed_time(ev[1]) / 3
            # host profile of 2 bench-style iterations
            from torch.profiler import ProfilerActivity, profile
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    e0 = torch.cuda.Event(); e0.record(); fn(); e1 = torch.cuda.Event(); e1.record(); e1.synchronize()
            top = []
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(("cuda", "cu")) and e.cpu_time_total > 150:
                    top.append((round(e.cpu_time_total / 1e3, 3), e.name))
            top.sort(reverse=True)
            py = sorted(((round(e.cpu_time_total / 1e3, 3), e.key) for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU), reverse=True)[:25]
            if rank == 0 and mode in ("overlap_sp", "plain_sp", "nocomm"):
                prof.export_chrome_trace(f"{out}.{dims}.{mode}.{phase}.json")
            r = dict(issue=[round(a, 3) for a, _, _ in rows], gpu=[round(b, 3) for _, b, _ in rows],
                     med_issue=statistics.median(a for a, _, _ in rows), med_gpu=statistics.median(b for _, b, _ in rows),
                     med_gpu_nogc=statistics.median(b for _, b in rows_nogc), med_issue_nogc=statistics.median(a for a, _ in rows_nogc),
                     queued=queued, alloc=alloc, long_runtime_calls=top[:12], cpu_ops=py)
            every = [None] * R; dist.all_gather_object(every, r)
            res[f"{dims}/{mode}/{phase}"] = every
            if rank == 0:
                for k, rr in enumerate(every):
                    print(f"{dims} {mode:11s} {phase:7s} rank{k}: issue {rr['med_issue']:7.2f} gpu(bench) {rr['med_gpu']:7.2f} nogc {rr['med_gpu_nogc']:7.2f} (issue {rr['med_issue_nogc']:6.2f}) queued {rr['queued']:7.2f} alloc {rr['alloc']}", flush=True)
                    print("    long runtime calls:", rr["long_runtime_calls"][:6], flush=True)
        del model; torch.cuda.empty_cache()
    if rank == 0:
        json.dump(res, open(f"{out}.{dims}.json", "w"), indent=1)
    dist.destroy_process_group()

main()
