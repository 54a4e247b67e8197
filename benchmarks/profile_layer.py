"""Where one TransformerLayer fwd+bwd spends GPU time and memory (the bench_transformer_layer configs).

Prints the kernels by total GPU time (torch.profiler) and, at the step's memory peak, the live allocations with the
line of our package (or the benchmark) that made them (torch.cuda.memory history). Diagnostic only: no targets.
Usage: python benchmarks/profile_layer.py [--config guide|gqa] [--bf16] [--top N]
"""
import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

import transformer_fp8 as te
from bench_transformer_layer import CONFIGS, TorchPreLNLayer, train_step
from transformer_fp8.module.transformer import TransformerLayer

DEV, DT = "cuda", torch.bfloat16
PACKAGE = os.path.dirname(te.__file__)


def kernel_table(step, top):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gaps(prof)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    print(f"\nGPU time by kernel (one step, total {total / 1e3:.2f} ms)")
    for e in events[:top]:
        print(f"{e.device_time_total / 1e3:8.3f} ms {e.count:4d}x  {e.key[:110]}")


def gaps(prof, top=8):
    """GPU idle time inside the step: the span of all kernels minus their union, and the longest idle gaps (the
    GPU waiting for the host) with the kernel before each."""
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    host_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None]
    idle, busy_until, before = [], kernels[0][0], kernels[0][2]
    for start, end, name in kernels:
        if start > busy_until:
            idle.append((start - busy_until, busy_until, start, before))
        if end > busy_until:
            busy_until, before = end, name
    span = busy_until - kernels[0][0]
    print(f"\nkernel span {span / 1e3:.2f} ms, GPU idle inside it {sum(g[0] for g in idle) / 1e3:.2f} ms "
          f"in {len(idle)} gaps; longest, with the host's top-level ops running during the gap:")
    for gap, start, end, name in sorted(idle, reverse=True)[:top]:
        print(f"{gap:8.1f} us after {name[:100]}")
        for e in host_ops:
            if e.time_range.end > start and e.time_range.start < end:
                print(f"{'':12}host {e.name[:80]} {e.time_range.elapsed_us():.0f} us, the longest of its ops:")
                for child in sorted(_descendants(e), key=lambda c: -c.time_range.elapsed_us())[:top]:
                    print(f"{'':16}{child.name[:80]} {child.time_range.elapsed_us():.0f} us")


def _descendants(event):
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def origin(frames):
    """The innermost frame in our package or the benchmarks: where the allocation came from."""
    for f in frames:
        name = f.get("filename", "")
        if name.startswith(PACKAGE) or "benchmarks" in name:
            return f"{os.path.relpath(name, os.path.dirname(PACKAGE))}:{f['line']} {f['name']}"
    return "?"


def memory_at_peak(step, top):
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, at_peak = {}, 0, 0, {}
    for trace in snapshot["device_traces"]:
        for ev in trace:
            if ev["action"] == "alloc":
                live[ev["addr"]] = (ev["size"], origin(ev.get("frames", [])))
                total += ev["size"]
            elif ev["action"] == "free_completed" and ev["addr"] in live:
                total -= live.pop(ev["addr"])[0]
            if total > peak:
                peak, at_peak = total, dict(live)
    by_origin = {}
    for size, where in at_peak.values():
        n, s = by_origin.get(where, (0, 0))
        by_origin[where] = (n + 1, s + size)
    print(f"\nmemory above the {base / 2**30:.2f} GiB before the step: peak {peak / 2**30:.3f} GiB, live then:")
    for where, (n, s) in sorted(by_origin.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{s / 2**20:9.1f} MiB {n:4d}x  {where}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="guide", choices=sorted(CONFIGS))
    parser.add_argument("--plain", action="store_true", help="profile the plain PyTorch BF16 layer instead")
    parser.add_argument("--bf16", action="store_true", help="our layer without fp8_autocast")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    c = CONFIGS[args.config]
    x = torch.randn(c["seq"], c["batch"], c["hidden"], device=DEV, dtype=DT, requires_grad=True)
    dy = torch.randn_like(x)
    if args.plain:
        layer = TorchPreLNLayer(c["hidden"], c["ffn"], c["heads"], c["groups"], c["d"]).to(DEV, DT)
    else:
        layer = TransformerLayer(c["hidden"], c["ffn"], c["heads"], num_gqa_groups=c["groups"], kv_channels=c["d"],
                                 hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="no_mask",
                                 params_dtype=DT, device=DEV)
    step = train_step(layer, x, dy, fp8=not (args.plain or args.bf16))
    for _ in range(3):
        step()
    kernel_table(step, args.top)
    memory_at_peak(step, args.top)


if __name__ == "__main__":
    main()
