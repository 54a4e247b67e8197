"""TransformerLayer forward+backward per rank under fp8_autocast with tensor parallelism: TP=1 (rank 0 alone),
TP=2 and TP=2 + sequence parallelism, and the bytes the TP/SP collectives move per step. Prints a table and writes
JSON (--json, rank 0).

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py [--json out.json]        (2 GPUs, NCCL)
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --device cpu --tiny       (smoke test, gloo)

Config "guide": hidden 4096, ffn 16384, 32 heads, seq 2048, batch 4, BF16 parameters, sbhd, no dropout, delayed
scaling (amaxes reduced over the TP group). "tiny" (--tiny): hidden 64, ffn 128, 4 heads, seq 16, batch 2.
Bytes: per rank and step, the full buffer of each collective issued by transformer_fp8.distributed (the all-reduce's
tensor, the all-gather's output, the reduce-scatter's input), counted on one extra step; the amax all-reduce (a few
hundred bytes) is not included. Time: median over --iters steps (CUDA events on GPU), the slowest rank's.
"""
import argparse
import json
import os
import statistics
import time
import types

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device machines require it)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import transformer_fp8 as te  # noqa: E402
from transformer_fp8 import distributed as tpd  # noqa: E402
from transformer_fp8 import recipe  # noqa: E402

CONFIGS = {
    "guide": dict(hidden=4096, ffn=16384, heads=32, seq=2048, batch=4),
    "tiny": dict(hidden=64, ffn=128, heads=4, seq=16, batch=2),
}
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class CollectiveBytes:
    """Counts the bytes of the collectives transformer_fp8.distributed issues while `counting()` is active (it swaps
    that module's `dist` for a proxy whose collectives count, then call torch.distributed's)."""

    def __init__(self):
        self.bytes = {}

    def _wrap(self, name):
        real = getattr(dist, name)

        def counted(*args, **kwargs):
            full = args[1] if name == "reduce_scatter_tensor" else args[0]  # (output, input) or (tensor,)
            key = f"{name}[{str(full.dtype).removeprefix('torch.')}]"
            self.bytes[key] = self.bytes.get(key, 0) + full.numel() * full.element_size()
            return real(*args, **kwargs)
        return counted

    def counting(self):
        proxy = types.SimpleNamespace(**{n: getattr(dist, n) for n in dir(dist) if not n.startswith("__")})
        for name in COLLECTIVES:
            setattr(proxy, name, self._wrap(name))
        return _swapped(tpd, "dist", proxy)


class _swapped:
    def __init__(self, module, name, value):
        self.module, self.name, self.value = module, name, value

    def __enter__(self):
        self.saved = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.saved)


def step_ms(step, device, warmup, iters):
    """Median ms of step() (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_variant(c, tp_group, sequence_parallel, device, dtype, amax_group, args):
    """(ms per step, {collective: bytes per step}) of one TransformerLayer configuration on this rank."""
    tp = tp_group is not None
    size = dist.get_world_size(tp_group) if tp else 1
    torch.manual_seed(0)
    layer = te.TransformerLayer(c["hidden"], c["ffn"], c["heads"], hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=dtype, device=device, tp_group=tp_group, set_parallel_mode=tp,
                                sequence_parallel=sequence_parallel)
    seq = c["seq"] // size if sequence_parallel else c["seq"]  # SP: this rank's sequence block
    x = torch.randn(seq, c["batch"], c["hidden"], dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=16)

    def step():
        with te.fp8_autocast(fp8_recipe=fp8_recipe, fp8_group=amax_group):
            out = layer(x)
        out.backward(dy)
        layer.zero_grad(set_to_none=True)
        x.grad = None

    step()
    counter = CollectiveBytes()
    with counter.counting():
        step()
    ms = step_ms(step, device, args.warmup, args.iters)
    del layer, x, dy
    return ms, counter.bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny config (smoke test)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device, dtype, backend = torch.device("cuda"), torch.bfloat16, "nccl"
    else:
        device, dtype, backend = torch.device("cpu"), torch.float32, "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    name = "tiny" if args.tiny else "guide"
    c = CONFIGS[name]
    rank0_only = dist.new_group([0])  # every rank creates it; TP=1 runs on rank 0 and reduces amaxes there only
    world_group = dist.group.WORLD
    results = {}
    try:
        if rank == 0:
            results["TP=1"] = run_variant(c, None, False, device, dtype, rank0_only, args)
        dist.barrier()
        results[f"TP={world}"] = run_variant(c, world_group, False, device, dtype, world_group, args)
        results[f"TP={world}+SP"] = run_variant(c, world_group, True, device, dtype, world_group, args)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, results)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    rows = []
    for variant in results:
        times = [r[variant][0] for r in per_rank if variant in r]
        collectives = results[variant][1]
        rows.append(dict(variant=variant, ms=max(times), ms_per_rank=times, bytes=collectives,
                         total_bytes=sum(collectives.values())))
    base = rows[0]["ms"]
    for row in rows:
        row["vs_tp1"] = row["ms"] / base
    print(f"TransformerLayer fwd+bwd, config {name} {c}, FP8 (delayed scaling), {dtype}, {device.type}, "
          f"world {world}")
    print(f"{'variant':<10} {'ms/step':>10} {'vs TP=1':>8} {'MiB moved/step':>15}  collectives")
    for row in rows:
        detail = ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in sorted(row["bytes"].items())) or "-"
        print(f"{row['variant']:<10} {row['ms']:>10.2f} {row['vs_tp1']:>8.2f} "
              f"{row['total_bytes'] / 2**20:>15.1f}  {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=name, shape=c, dtype=str(dtype), device=device.type, world=world, rows=rows), f,
                      indent=2)


if __name__ == "__main__":
    main()
