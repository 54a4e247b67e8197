"""TransformerLayer forward+backward per rank under fp8_autocast with tensor parallelism: TP=1 (rank 0 alone, in the
same run), TP=2, TP=2 + sequence parallelism (the norm outputs all-gathered in FP8), and TP=2 + SP with per-rank
scales (DelayedScaling(reduce_amax=False): the norm outputs all-gathered in BF16), and the bytes the TP/SP
collectives move per step. Prints a table and writes JSON (--json, rank 0). Target: TP=2 at most 0.6x TP=1's time.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py [--json out.json]        (2 GPUs, NCCL)
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --device cpu --tiny       (smoke test, gloo)

Config "guide": hidden 4096, ffn 16384, 32 heads, seq 2048, batch 4, BF16 parameters, sbhd, no dropout, delayed
scaling (amaxes reduced over the TP group). "tiny" (--tiny): hidden 64, ffn 128, 4 heads, seq 16, batch 2, the FP8
path at every size (base.FP8_MIN_GEMM_SIZE = 0: no small-shape automatic path).
Bytes: per rank and step, the full buffer of each collective issued by transformer_fp8.distributed (the all-reduce's
tensor, the all-gather's output, the reduce-scatter's input), counted on one extra step; the amax all-reduce (a few
hundred bytes) is not included. "sent": what each rank sends of those in a ring algorithm, (n-1)/n of the buffer for
an all-gather or reduce-scatter and twice that for an all-reduce (n ranks): the figure to compare across variants.
Time: the slowest rank's, two ways (CUDA events on GPU): "ms" the median over --iters steps each timed alone (the
GPU idles while the host issues the step's first kernels), "ms_b2b" the mean step of --iters steps issued back to
back (a training loop's steady state). The target is checked on both.
"""
import argparse
import json
import os
import statistics
import time
import types

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device machines require it)
# One hardware queue: kernels start in issue order across streams, so a collective started before a GEMM it should
# overlap (the dgrad sums, see module/_column_parallel.py) gets its SMs first (as Megatron / TE set it for TP).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import transformer_fp8 as te  # noqa: E402
from transformer_fp8 import distributed as tpd  # noqa: E402
from transformer_fp8 import recipe  # noqa: E402
from transformer_fp8.module import base  # noqa: E402
from timing import loop_time_ms, step_alone_ms  # noqa: E402  (benchmarks/timing.py: the script's folder is on sys.path)

CONFIGS = {
    "guide": dict(hidden=4096, ffn=16384, heads=32, seq=2048, batch=4),
    "tiny": dict(hidden=64, ffn=128, heads=4, seq=16, batch=2),
}
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
TARGET_TP2_VS_TP1 = 0.6


def sent_bytes(collectives, world):
    """Bytes each rank sends per step in a ring algorithm, from {collective[dtype]: buffer bytes}."""
    share = (world - 1) / world
    return sum(v * share * (2 if k.startswith("all_reduce") else 1) for k, v in collectives.items())


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
    """(median ms of step() timed alone, mean ms of `iters` steps back to back): CUDA events on a GPU (timing.py),
    wall clock on CPU."""
    if device.type == "cuda":
        return step_alone_ms(step, warmup, iters), loop_time_ms(step, warmup=0, iters=iters, repeats=1)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), statistics.mean(times)


def run_variant(c, tp_group, sequence_parallel, device, dtype, amax_group, fp8_recipe, args):
    """((ms alone, ms back to back) per step, {collective: bytes per step}) of one TransformerLayer configuration on
    this rank."""
    tp = tp_group is not None
    size = dist.get_world_size(tp_group) if tp else 1
    torch.manual_seed(0)
    layer = te.TransformerLayer(c["hidden"], c["ffn"], c["heads"], hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=dtype, device=device, tp_group=tp_group, set_parallel_mode=tp,
                                sequence_parallel=sequence_parallel)
    seq = c["seq"] // size if sequence_parallel else c["seq"]  # SP: this rank's sequence block
    x = torch.randn(seq, c["batch"], c["hidden"], dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn_like(x)

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
    if args.tiny:
        base.FP8_MIN_GEMM_SIZE = 0
    shared_scales = recipe.DelayedScaling(amax_history_len=16)
    per_rank_scales = recipe.DelayedScaling(amax_history_len=16, reduce_amax=False)
    rank0_only = dist.new_group([0])  # every rank creates it; TP=1 runs on rank 0 and reduces amaxes there only
    world_group = dist.group.WORLD
    results = {}
    try:
        if rank == 0:
            results["TP=1"] = run_variant(c, None, False, device, dtype, rank0_only, shared_scales, args)
        dist.barrier()
        results[f"TP={world}"] = run_variant(c, world_group, False, device, dtype, world_group, shared_scales, args)
        results[f"TP={world}+SP"] = run_variant(c, world_group, True, device, dtype, world_group, shared_scales,
                                                args)
        results[f"TP={world}+SP per-rank scales"] = run_variant(c, world_group, True, device, dtype, world_group,
                                                                per_rank_scales, args)
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
        rows.append(dict(variant=variant, ms=max(t[0] for t in times), ms_b2b=max(t[1] for t in times),
                         ms_per_rank=times, bytes=collectives, total_bytes=sum(collectives.values()),
                         sent_bytes=sent_bytes(collectives, world)))
    for row in rows:
        row["vs_tp1"] = row["ms"] / rows[0]["ms"]
        row["vs_tp1_b2b"] = row["ms_b2b"] / rows[0]["ms_b2b"]
    print(f"TransformerLayer fwd+bwd, config {name} {c}, FP8 (delayed scaling), {dtype}, {device.type}, "
          f"world {world}")
    print(f"{'variant':<24} {'ms alone':>9} {'vs TP=1':>8} {'ms b2b':>8} {'vs TP=1':>8} {'buffers MiB':>12} "
          f"{'sent MiB':>9}  collectives (buffers)")
    for row in rows:
        detail = ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in sorted(row["bytes"].items())) or "-"
        print(f"{row['variant']:<24} {row['ms']:>9.2f} {row['vs_tp1']:>8.2f} {row['ms_b2b']:>8.2f} "
              f"{row['vs_tp1_b2b']:>8.2f} {row['total_bytes'] / 2**20:>12.1f} "
              f"{row['sent_bytes'] / 2**20:>9.1f}  {detail}")
    best = {timing: min(row[timing] for row in rows[1:]) for timing in ("vs_tp1", "vs_tp1_b2b")}
    target_met = {timing: ratio <= TARGET_TP2_VS_TP1 for timing, ratio in best.items()}
    for timing, label in (("vs_tp1", "steps alone"), ("vs_tp1_b2b", "back to back")):
        print(f"target TP={world} <= {TARGET_TP2_VS_TP1}x TP=1 ({label}, best TP variant): "
              f"{'met' if target_met[timing] else 'NOT met'} ({best[timing]:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=name, shape=c, dtype=str(dtype), device=device.type, world=world, rows=rows,
                           target_tp_vs_tp1=TARGET_TP2_VS_TP1, target_met=target_met), f, indent=2)


if __name__ == "__main__":
    main()
