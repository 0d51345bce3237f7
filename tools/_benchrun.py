"""What the benchmark tools that compare the library with plain torch on ranks share
(``model_bench.py``, ``exchange_bench.py``): the common options, the launch (2 CPU ranks on
gloo with Triton's interpreter; torchrun on GPUs; ``--one-gpu``: two ranks on GPU 0 over
gloo, correctness only), the timing and the JSON report; and ``load``, a Python file as a
module, which ``gemm_sweep.py`` and ``kernel_report.py`` use too."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Bench = Callable[[argparse.Namespace, torch.device, bool], None]  # (args, device, timing?)


def load(path: str | os.PathLike, name: str) -> ModuleType:
    """The Python file at ``path`` executed as a module named ``name`` (an example, or another
    version of a library file for an A/B)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_options(ap: argparse.ArgumentParser, sizes: dict, out_default: str) -> None:
    """The size options (``sizes``' keys; None: the tool's defaults) and the common ones."""
    for name in sizes:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--out", default=out_default, help="JSON file (default: %(default)s)")
    ap.add_argument("--cpu", action="store_true", help="2 CPU ranks even with GPUs")
    ap.add_argument("--one-gpu", action="store_true", help="2 ranks on GPU 0 over gloo")


def fill_defaults(args: argparse.Namespace, small: dict, large: dict) -> bool:
    """Fills the options left None (small sizes, fp32 and few iterations on CPU); returns
    whether the run is on CPU ranks (``--cpu``, or no GPU and no ``--one-gpu``)."""
    cpu = args.cpu or not (args.one_gpu or torch.cuda.is_available())
    for k, v in (small if cpu else large).items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    for k, v in dict(dtype=("bf16", "fp32"), iters=(20, 2), warmup=(5, 1)).items():
        setattr(args, k, v[cpu] if getattr(args, k) is None else getattr(args, k))
    return cpu


def launch(args: argparse.Namespace, cpu: bool, bench: Bench, tool: str) -> None:
    """Runs ``bench``: on 2 spawned CPU ranks, or as this torchrun worker (NCCL, or gloo on
    GPU 0 with ``--one-gpu``); exits with how to launch it when torchrun or the GPUs are
    missing."""
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before overlap defines a kernel (spawn inherits)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_cpu_rank, args=(2, os.path.join(d, "init"), args, bench), nprocs=2)
        return
    from overlap.bench import need_gpus  # lazily: overlap reads TRITON_INTERPRET

    how = (f"torchrun --nproc-per-node=N tools/{tool} (N GPUs), or on one GPU: "
           f"NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 tools/{tool} --one-gpu "
           "(correctness only); --cpu: 2 CPU ranks")  # fmt: skip
    need_gpus(f"tools/{tool}", how)
    local = 0 if args.one_gpu else int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if args.one_gpu:
        os.environ.setdefault("NCCL_P2P_DISABLE", "1")  # the copy engines' host road
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=dev)
    try:
        bench(args, dev, not args.one_gpu)
    finally:
        dist.destroy_process_group()


def _cpu_rank(rank: int, world: int, init_file: str, args, bench: Bench) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        bench(args, torch.device("cpu"), False)
    finally:
        dist.destroy_process_group()
    # gloo's threads once aborted interpreter finalization (SIGABRT after a finished run, as
    # in tests/_dist.py): leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative norm error (0 for two empty tensors)."""
    if want.numel() == 0:
        return 0.0 if got.numel() == 0 else float("nan")
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def time_ms(fn: Callable[[], object], iters: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls after ``warmup``, the slowest rank's."""
    return time_turns({"": fn}, iters, warmup, cuda)[""][0]


def paths() -> dict:
    """This rank's calls of the library since the last look (``overlap.stats``, reset), by
    path: ``replayed`` (a recorded graph), ``updated`` (a recorded graph updated for new
    addresses), ``overlap`` (overlapped eagerly: a first sighting or a capture) and
    ``plain``."""
    import overlap

    out = {"replayed": 0, "updated": 0, "overlap": 0, "plain": 0}
    for by_how in overlap.stats(reset=True).values():
        for how, n in by_how.items():
            kind = how.split()[0].rstrip(":")  # (another word: a diagnostic copy's own count)
            out[kind] = out.get(kind, 0) + n
    return out


def time_turns(fns: dict, iters: int, warmup: int, cuda: bool, calls: int = 1) -> dict:
    """Per function of ``fns``: the median milliseconds of its 1st, 2nd, ... ``calls``-th call
    in a turn (each call alone: it starts on an idle GPU and is waited for) over ``iters``
    rounds after ``warmup``, the slowest rank's. In every round each function takes one turn
    of ``calls`` calls, in reverse order every other round, so that the GPU's clocks, which
    drift with its power and heat (H100s at their 700 W cap ran between 1140 and 1980 MHz in
    one model bench), weigh on every function alike; a turn's first call shows what a
    switch from the other functions costs, its last the steady state."""
    times: dict = {k: [[] for _ in range(calls)] for k in fns}
    order = list(fns)
    for i in range(warmup + iters):
        for k in order if i % 2 == 0 else order[::-1]:
            for j in range(calls):
                if cuda:
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    ev[0].record(), fns[k](), ev[1].record(), ev[1].synchronize()
                    t = ev[0].elapsed_time(ev[1])
                else:
                    t0 = time.perf_counter()
                    fns[k]()
                    t = (time.perf_counter() - t0) * 1e3
                times[k][j] += [t] if i >= warmup else []
    mine = {k: [statistics.median(v) for v in per] for k, per in times.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: [max(e[k][j] for e in every) for j in range(calls)] for k in fns}


def time_steps(ready: dict, iters: int, warmup: int, cuda: bool, calls: int) -> dict:
    """Every mode's two steps (``ready[mode] = (prefill, train)``) timed taking turns of
    ``calls`` steps (``time_turns``: the modes see the GPU's clock drift alike). Per mode:
    ``prefill_ms`` and ``train_ms`` (the last step of a turn, median), ``prefill_turn_ms`` and
    ``train_turn_ms`` (every step's: the first runs after the other modes' steps) and
    ``paths``, the library's calls by path over every step, per step kind."""
    counts: dict = {mode: {} for mode in ready}

    def counted(mode, i: int):
        by = counts[mode].setdefault(("prefill", "train")[i], {})

        def step():
            paths()
            ready[mode][i]()
            for how, n in paths().items():
                by[how] = by.get(how, 0) + n

        return step

    fns = {(mode, i): counted(mode, i) for i in range(2) for mode in ready}
    t = time_turns(fns, iters, warmup, cuda, calls=calls)
    return {mode: dict(prefill_ms=t[(mode, 0)][-1], train_ms=t[(mode, 1)][-1],
                       prefill_turn_ms=t[(mode, 0)], train_turn_ms=t[(mode, 1)],
                       paths=counts[mode]) for mode in ready}  # fmt: skip


def environment(dev: torch.device) -> dict:
    """What timings depend on beyond torch and Triton: NCCL's, the driver's and CUDA's
    versions (None where absent) and the road the environment sets (``NCCL_P2P_DISABLE``:
    "1" sends NCCL, and the library's copy engines, through host memory)."""
    nccl = driver = None
    if dev.type == "cuda":
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # (a torch built without NCCL)
            pass
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                     "-i", str(dev.index or 0)]  # fmt: skip
            done = subprocess.run(query, capture_output=True, text=True, timeout=30)
            driver = done.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    p2p = os.environ.get("NCCL_P2P_DISABLE")
    road = "host memory (NCCL_P2P_DISABLE=1)" if p2p == "1" else "P2P where the GPUs have it"
    return dict(nccl=nccl, driver=driver, cuda=torch.version.cuda, NCCL_P2P_DISABLE=p2p, road=road)


def write_json(args, dev, R: int, timing_meaningful: bool, rows, errors, tol: float,
               extra: dict | None = None) -> None:  # fmt: skip
    """Rank 0's JSON (configuration, device, versions, environment, date, rows, errors, and
    ``extra``'s keys), after the tool's table; says so when the timings mean nothing."""
    import triton

    if not timing_meaningful:
        print("timings mean nothing here (CPU, or two ranks sharing one GPU): correctness only")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    date = datetime.datetime.now().isoformat(timespec="seconds")
    out = dict(config={k: v for k, v in vars(args).items() if k != "out"}, world_size=R,
               backend=dist.get_backend(), device=name, torch=torch.__version__,
               triton=triton.__version__, date=date, timing_meaningful=timing_meaningful,
               env=environment(dev), tolerance=tol, errors=errors, rows=rows,
               **(extra or {}))  # fmt: skip
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
