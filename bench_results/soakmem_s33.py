"""tools/soak.py with memory diagnostics (session 33): after call START, tracemalloc starts;
at START + SETTLE and at the end, a tracemalloc snapshot, gc object counts by type and RSS;
rank 0 writes the differences to MEMDIAG (env)."""
import collections, gc, os, sys, tracemalloc
sys.path.insert(0, "tools")
import soak

START, SETTLE = int(os.environ.get("START", 3000)), int(os.environ.get("SETTLE", 1000))
state = {}
orig = soak._sample


def counts():
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def sample(done):
    r = orig(done)
    if done >= START and "started" not in state:
        tracemalloc.start(12)
        state["started"] = done
    elif "started" in state and "a" not in state and done >= state["started"] + SETTLE:
        gc.collect()
        state["a"] = (done, tracemalloc.take_snapshot(), counts(), r["host_rss"], tracemalloc.get_traced_memory()[0])
    elif "a" in state:
        state["last"] = (done, r["host_rss"])
    return r


soak._sample = sample
real_destroy = soak.dist.destroy_process_group


def report():
    if "a" not in state:
        return
    gc.collect()
    done, rss = state["last"]
    snap, c1, traced = tracemalloc.take_snapshot(), counts(), tracemalloc.get_traced_memory()[0]
    d0, snap0, c0, rss0, traced0 = state["a"]
    calls = max(done - d0, 1)
    lines = [f"calls {d0} -> {done} ({calls}); host RSS {rss0} -> {rss}: {(rss - rss0) / calls:.1f} B/call; "
             f"traced (Python) {traced0} -> {traced}: {(traced - traced0) / calls:.1f} B/call"]
    lines.append("== objects by type, growth")
    for name, n in sorted(((k, c1[k] - c0.get(k, 0)) for k in c1), key=lambda kv: -kv[1])[:20]:
        lines.append(f"{n:+8d} {name}")
    lines.append("== tracemalloc growth by traceback (top 15)")
    for st in snap.compare_to(snap0, "traceback")[:15]:
        lines.append(f"{st.size_diff:+10d} B {st.count_diff:+7d} blocks")
        lines += ["    " + l for l in st.traceback.format()[-12:]]
    lines.append("== by line (top 25)")
    for st in snap.compare_to(snap0, "lineno")[:25]:
        lines.append(str(st))
    if soak.dist.get_rank() == 0:
        open(os.environ["MEMDIAG"], "w").write("\n".join(lines) + "\n")
        print("\n".join(lines[:40]))


def destroy():
    report()
    real_destroy()


soak.dist.destroy_process_group = destroy
soak.main()
