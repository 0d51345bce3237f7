"""transformers' ``generate()`` on a Llama tensor parallel through ``overlap.nn.parallelize``
against transformers' own tensor parallelism (``tp_plan="auto"``), on the same weights:
greedy decoding, eager and with a static cache, checked token for token and timed in one run.

A transformers ``LlamaForCausalLM`` (``--family qwen3``: ``Qwen3ForCausalLM``) built from a
config at ``model_bench.py``'s dims (``hf_bench._whole``'s config: 8B by default, ``--layers``
4, vocabulary 1024, no EOS so every sequence runs to ``--new-tokens``; no download), random
weights, bf16, saved once by rank 0 to a temporary directory that every rank then loads per
mode:

==========  ==================================================================================
``tf_tp``   ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(
            tp_plan="auto"))`` (the older ``tp_plan="auto"`` where transformers has no
            ``DistributedConfig``): transformers' tensor parallelism (DTensor), the reference;
            needs torchrun and ``accelerate``
``overlap`` a plain ``from_pretrained(dir)`` moved to the rank's device, then
            ``overlap.nn.parallelize(model)`` over the default group
``single``  a plain ``from_pretrained(dir)``, no tensor parallelism: every rank runs it whole
            (the reference where ``tf_tp`` could not run)
==========  ==================================================================================

A mode whose loading raises (``accelerate`` missing, ``tp_plan`` on gloo or CPU) is skipped
with the exception as the reason (``skipped``), not a crash.

Per ``--batch`` (1, 8) a fixed prompt batch of ``--prompt`` (128) random tokens per sequence
(no padding), ``generate(do_sample=False, min_new_tokens=max_new_tokens=--new-tokens)`` (64),
two ways (``cache``):

- ``eager``: transformers' default dynamic cache, nothing compiled;
- ``static``: ``cache_implementation="static"``, with transformers' own compile of the model's
  call for the decoding steps (``CompileConfig(mode="reduce-overhead")``: ``torch.compile``,
  CUDA graphs; the prefill eager), as transformers documents it; on CPU not compiled
  (``disable_compile``).

Each cell's first ``generate`` is the check: the generated ids must be the same on every rank
and equal the reference mode's (``tf_tp``'s, else ``single``'s) for the same batch and cache.
A mismatch records ``first_diff`` in the row, the first generated position where any
sequence differs: in fp32 (CPU) it fails the run (``failed``, exit non-zero); in bf16 the
reduction orders of the two tensor parallelisms may legitimately flip a near-tie after some
tokens, so it is recorded under ``diverged`` (cell: position) and not failed. A ``generate``
that raises is recorded under ``failed`` and the cell's mode is not timed. Then the modes take
turns (``_benchrun.time_turns``) for ``--warmup`` + ``--iters`` rounds (2 + 10; 1 + 2 on
CPU): host wall time of a whole ``generate`` (prefill included) up to a synchronize, divided
by the new tokens; the median, the slowest rank's. ``x_tf_tp`` is ``tf_tp``'s time over the mode's.

The JSON (``--out``, default ``bench_out/generate_bench.json``): ``config``, ``env`` (NCCL,
driver, CUDA, ``NCCL_P2P_DISABLE``, and the torch, transformers and accelerate versions),
``rows`` (mode, batch, cache, ``ms_per_token``, ``x_tf_tp``, ``first_diff``, ``paths``: the
library's calls by path in the check, ``rounds``), ``reference``, ``failed``, ``diverged``,
``skipped`` (mode: reason), ``errors`` (cell/mode: ``first_diff``), ``timing_meaningful``.

    torchrun --nproc-per-node=2 tools/generate_bench.py [--batch 1,8] [--out X.json]
    python tools/generate_bench.py --cpu   # 2 CPU ranks, gloo, tiny dims, fp32: tokens only
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from _benchrun import DTYPES, add_options, fill_defaults, launch, paths, time_turns, write_json
from hf_bench import FAMILIES, _whole
from model_bench import add_dims

import overlap

SMALL = dict(layers=2, prompt=16, new_tokens=8)
LARGE = dict(layers=4, prompt=128, new_tokens=64)
MODES = ("tf_tp", "overlap", "single")
CACHES = ("eager", "static")
BATCH, CPU_BATCH = (1, 8), (1, 2)


def _save(args, dtype, dev) -> str:
    """Rank 0 builds the model from the config and saves it to a temporary directory; every
    rank gets its path (one host: the ranks share the file system)."""
    import transformers

    where = [None]
    if dist.get_rank() == 0:
        config = _whole(args, dtype, torch.device("meta")).config  # (no memory, no init)
        config.eos_token_id = None  # every sequence runs to --new-tokens
        config.pad_token_id = 0
        cls = getattr(transformers, FAMILIES[args.family][1].replace("Model", "ForCausalLM"))
        torch.manual_seed(0)
        with torch.device(dev):
            model = cls(config).to(dtype)
        where[0] = tempfile.mkdtemp(prefix="generate_bench_")
        model.save_pretrained(where[0])
        del model
    dist.broadcast_object_list(where, src=0)
    dist.barrier()
    return where[0]


def _load(mode: str, path: str, dtype, dev):
    """Mode ``mode``'s model loaded from ``path`` (raises where it cannot be)."""
    import transformers
    from transformers import AutoModelForCausalLM

    if mode == "tf_tp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            R = dist.get_world_size()  # (else derived from WORLD_SIZE: 1 on spawned ranks)
            if hasattr(transformers, "DistributedConfig"):
                config = transformers.DistributedConfig(tp_plan="auto", tp_size=R)
                tp = dict(distributed_config=config)
            else:
                tp = dict(tp_plan="auto", tp_size=R)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **tp).eval()
        w = model.base_model.layers[0].self_attn.q_proj.weight
        rows, c = (w.to_local() if hasattr(w, "to_local") else w).shape[0], model.config
        if rows * R != c.num_attention_heads * c.head_dim:  # (not sharded: no TP at all)
            raise RuntimeError(f'tp_plan="auto" left q_proj with {rows} rows on {R} ranks')
        return model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    return overlap.nn.parallelize(model) if mode == "overlap" else model


def _agreed(mine) -> list:
    """Every rank's ``mine``."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _first_diff(got: list, want: list) -> int | None:
    """The first generated position where any sequence of ``got`` differs from ``want``'s
    (None: equal)."""
    where = []
    for g, w in zip(got, want, strict=True):
        diffs = [i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b]
        where += diffs[:1] or ([] if len(g) == len(w) else [min(len(g), len(w))])
    return min(where) if where else None


def _generate(model, ids, args, cache: str, cpu: bool):
    """A function that runs one ``generate`` of ``model`` on ``ids`` (up to a synchronize)
    and returns the generated ids as lists."""
    from transformers import CompileConfig

    kw = dict(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
              attention_mask=torch.ones_like(ids), pad_token_id=0)  # fmt: skip
    if cache == "static":
        kw["cache_implementation"] = "static"
        if cpu:
            kw["disable_compile"] = True
        else:
            kw["compile_config"] = CompileConfig(mode="reduce-overhead")

    def run():
        out = model.generate(ids, **kw)
        if ids.is_cuda:
            torch.cuda.synchronize()
        return out

    return lambda: run()[:, ids.shape[1] :].tolist()


def bench(args: argparse.Namespace, dev: torch.device, timing_meaningful: bool) -> None:
    """Every mode loaded, checked and timed (every rank); rank 0 prints and writes the JSON;
    exits non-zero where a mode failed."""
    import transformers

    R, rank, dtype = dist.get_world_size(), dist.get_rank(), DTYPES[args.dtype]
    cpu = dev.type == "cpu"
    torch._dynamo.config.cache_size_limit = 64
    path = _save(args, dtype, dev)
    models, skipped = {}, {}
    for mode in args.modes:
        try:
            models[mode] = _load(mode, path, dtype, dev)
            why = None
        except Exception as e:  # (accelerate missing, tp_plan on gloo or CPU, ...)
            why = f"{type(e).__name__}: {e}"
        whys = [w for w in _agreed(why) if w]
        if whys:
            skipped[mode] = whys[0]
            models.pop(mode, None)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    ref = next((m for m in ("tf_tp", "single") if m in models), None)
    rows, failed, diverged, errors = [], {}, {}, {}
    gen = torch.Generator().manual_seed(1)
    for B in args.batch:
        ids = torch.randint(0, 1024, (B, args.prompt), generator=gen)
        for cache in CACHES:
            fns, tokens, counts = {}, {}, {}
            for mode, model in models.items():
                key = f"B={B}/{cache}/{mode}"
                fn = _generate(model, ids.to(model.device), args, cache, cpu)
                try:
                    paths()
                    with torch.no_grad():
                        mine = fn()
                    counts[mode] = paths()
                    why = None
                except Exception as e:
                    mine, why = None, f"{type(e).__name__}: {e}"
                every = _agreed((mine, why))
                whys = [w for _, w in every if w]
                if whys:
                    failed[key] = whys[0]
                    continue
                if any(t != every[0][0] for t, _ in every):
                    failed[key] = "the ranks generated different ids"
                    continue
                tokens[mode] = mine
                fns[mode] = torch.no_grad()(fn)
            timed = time_turns(fns, args.iters, args.warmup, False) if fns else {}
            for mode in fns:
                key = f"B={B}/{cache}/{mode}"
                diff = None
                if ref in tokens and mode != ref:
                    diff = _first_diff(tokens[mode], tokens[ref])
                    errors[key] = diff
                    if diff is not None:
                        why = f"first differing generated token at position {diff}"
                        if dtype == torch.float32:
                            failed[key] = f"{why} against {ref}"
                        else:
                            diverged[key] = diff
                rows.append(dict(mode=mode, batch=B, cache=cache,
                                 ms_per_token=timed[mode][0] / args.new_tokens,
                                 first_diff=diff, paths=counts[mode],
                                 rounds=args.iters))  # fmt: skip
    for r in rows:
        base = [o for o in rows if o["mode"] == "tf_tp" and o["batch"] == r["batch"]
                and o["cache"] == r["cache"]]  # fmt: skip
        r["x_tf_tp"] = base[0]["ms_per_token"] / r["ms_per_token"] if base else None
    if rank == 0:
        _table(args, R, rows, ref, skipped, failed, diverged)
        extra = dict(reference=ref, failed=failed, diverged=diverged, skipped=skipped)
        write_json(args, dev, R, timing_meaningful, rows, errors, 0, extra)
        out = pathlib.Path(args.out)
        res = json.loads(out.read_text())
        try:
            import accelerate

            acc = accelerate.__version__
        except ImportError:
            acc = None
        res["env"].update(torch=torch.__version__, transformers=transformers.__version__,
                          accelerate=acc)  # fmt: skip
        out.write_text(json.dumps(res, indent=1) + "\n")
    if failed:
        raise SystemExit(f"generate_bench.py: {len(failed)} cells failed: {sorted(failed)}")


def _table(args, R: int, rows: list, ref, skipped: dict, failed: dict, diverged: dict) -> None:
    """Rank 0's table: ms per generated token (x tf_tp) per mode, batch and cache."""
    print(f"\n{args.family} {args.dims}, {args.layers} layers, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, {args.dtype}, {R} ranks; reference {ref}")  # fmt: skip
    print(f"{'mode':8s} {'batch':>5s} {'cache':6s} {'ms/token':>9s} {'x tf_tp':>8s}  first diff")
    for r in rows:
        x = "-" if r["x_tf_tp"] is None else f"{r['x_tf_tp']:.3f}"
        d = "-" if r["first_diff"] is None else str(r["first_diff"])
        print(f"{r['mode']:8s} {r['batch']:5d} {r['cache']:6s} {r['ms_per_token']:9.3f} "
              f"{x:>8s}  {d}")  # fmt: skip
    for m, why in skipped.items():
        print(f"{m}: not run ({why[:300]})")
    for k, pos in diverged.items():
        print(f"{k}: diverged from {ref} at generated token {pos} (bf16: not failed)")
    for k, why in failed.items():
        print(f"{k}: FAILED ({why[:300]})")


def main() -> None:
    """Parses the arguments; spawns 2 CPU ranks, or runs as a torchrun worker."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap, SMALL, "bench_out/generate_bench.json")
    add_dims(ap)
    ap.add_argument("--family", choices=tuple(FAMILIES), default="llama")
    ap.add_argument("--batch", default=None, help="batch sizes, comma-separated (default 1,8)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
    args = ap.parse_args()
    cpu = args.cpu or not (args.one_gpu or torch.cuda.is_available())
    for k, v in dict(iters=2 if cpu else 10, warmup=1 if cpu else 2).items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    cpu = fill_defaults(args, SMALL, LARGE)
    args.dims = args.dims or ("small" if cpu else "8b")
    args.batch = [int(b) for b in args.batch.split(",")] if args.batch else list(
        CPU_BATCH if cpu else BATCH)  # fmt: skip
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad or "overlap" not in args.modes or not args.batch:
        sys.exit(f"generate_bench.py: --modes from {MODES} with overlap (got {bad or args.modes})")
    args.modes.sort(key=MODES.index)
    launch(args, cpu, bench, "generate_bench.py")


if __name__ == "__main__":
    main()
