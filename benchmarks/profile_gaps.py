"""Where a training step's GPU time goes, gaps included (issue 22): one profiled step of a bench_llama.py variant.

Prints, for one step after warm-up (the second of two profiled back to back, so that the host is as far ahead as in a
training loop, not starting from an idle GPU):
- kernel time by category (GEMM, attention, casts/transposes, norms, activations, optimizer, loss, other) per phase
  (forward / backward / optimizer, from the profiler's record_function ranges of bench_llama.Runner.step), and the
  --top kernels by name per phase (total ms, launches, category);
- the GPU's idle time between consecutive kernels on the compute stream (gaps > --gap-us), summed per phase, and the
  largest gaps with the host operation that launched the kernel after each (what the GPU waited for);
- synchronising calls made during a step (torch.cuda.set_sync_debug_mode("warn")) and the caching allocator's
  cudaMalloc/cudaFree counts per step (a step that allocates new segments pays for it on the host).
`--trace FILE` keeps the profiler's Chrome trace (gzip it before carrying it back); `--analyse FILE` reads one
instead of running.

Run: python benchmarks/profile_gaps.py [--variant ours-fp8] [--json out.json] [--trace trace.json]
"""
import argparse
import collections
import json
import sys
import tempfile
import warnings
from types import SimpleNamespace

import torch

import bench_llama

CATEGORIES = (("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "gemv", "cublas")),
              ("attention", ("fmha", "flash", "cudnn", "attn", "sdpa")),
              ("optimizer", ("adam", "multi_tensor")),
              ("cast/transpose", ("cast", "transpose", "quantize", "amax", "scale")),
              ("norm", ("norm",)),
              ("activation", ("act", "silu", "swiglu", "gelu")),
              ("rope", ("rope",)),
              ("loss", ("softmax", "cross_entropy", "nll", "log_")))


def category(kernel_name: str) -> str:
    """A kernel's category by substrings of its (lower-cased) name; "other" when none matches."""
    name = kernel_name.lower().replace("gpu_kernel_impl_nocast", "gpu_kernel_impl")  # (not a cast)
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other"


def phase_of(launch_us: float, ranges: dict) -> str:
    """The phase ("forward", "backward", "optimizer") whose host range launched a kernel, by the launch time."""
    for name in ("forward", "optimizer"):
        lo, hi = ranges.get(name, (None, None))
        if lo is not None and lo <= launch_us <= hi:
            return name
    return "backward"


def analyse(trace: dict, gap_us: float, top: int) -> dict:
    """Kernel categories per phase, the GPU's idle gaps and the host ops that launched the kernel after each, from
    a Chrome trace (torch.profiler's export_chrome_trace) of one step."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    marks = sorted((e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and
                    e["name"].startswith("phase::")), key=lambda e: e["ts"])
    ranges = {e["name"].split("::")[1]: (e["ts"], e["ts"] + e["dur"]) for e in marks}  # (the last step's)
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    cpu_ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    step_start = ranges.get("forward", (float("-inf"),))[0]  # only the last step: the one the host ran into busy
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and
                     launches.get(e.get("args", {}).get("correlation"), e["ts"]) >= step_start),
                    key=lambda e: e["ts"])
    by_phase = collections.defaultdict(collections.Counter)
    by_name = collections.defaultdict(collections.Counter)  # phase -> kernel name -> ms
    launches_by_name = collections.defaultdict(collections.Counter)
    for e in device:
        launch = launches.get(e.get("args", {}).get("correlation"), e["ts"])
        phase = phase_of(launch, ranges)
        by_phase[phase][category(e["name"]) if e["cat"] == "kernel" else e["cat"]] += e["dur"] / 1e3
        name = e["name"][:160]
        by_name[phase][name] += e["dur"] / 1e3
        launches_by_name[phase][name] += 1
    kernels = {phase: [dict(name=n, ms=round(ms, 3), launches=launches_by_name[phase][n], category=category(n))
                       for n, ms in names.most_common(top)] for phase, names in by_name.items()}
    gaps, gap_ms = [], collections.Counter()
    busy_until = device[0]["ts"] if device else 0.0
    previous = None
    for e in device:
        idle = e["ts"] - busy_until
        if previous is not None and idle > gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            phase = phase_of(launch if launch is not None else e["ts"], ranges)
            gap_ms[phase] += idle / 1e3
            host = ""
            if launch is not None:  # the innermost host ops running when the kernel after the gap was launched
                enclosing = [op["name"] for op in cpu_ops if op["ts"] <= launch <= op["ts"] + op["dur"]]
                host = " > ".join(enclosing[-3:])
            gaps.append(dict(idle_us=round(idle, 1), phase=phase, before=previous["name"][:80], after=e["name"][:80],
                             launched_by=host, launch_lag_us=round(e["ts"] - launch, 1) if launch else None))
        busy_until = max(busy_until, e["ts"] + e["dur"])
        previous = e
    gaps.sort(key=lambda g: -g["idle_us"])
    span = (busy_until - device[0]["ts"]) / 1e3 if device else 0.0
    return dict(span_ms=round(span, 2), kernel_ms={p: {k: round(v, 2) for k, v in c.most_common()}
                                                   for p, c in by_phase.items()},
                gap_ms={p: round(v, 2) for p, v in gap_ms.items()}, gap_count=len(gaps), largest_gaps=gaps[:top],
                kernels=kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="ours-fp8", choices=bench_llama.VARIANTS)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gap-us", type=float, default=20.0, help="report GPU idle gaps longer than this")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace", default=None, help="also write the Chrome trace here")
    parser.add_argument("--analyse", default=None, help="analyse this Chrome trace instead of running a step")
    parser.add_argument("--shapes", action="store_true",
                        help="record the host operators' input shapes in the trace (bytes per kernel offline)")
    args = parser.parse_args()
    if args.analyse:
        with open(args.analyse) as f:
            report(analyse(json.load(f), args.gap_us, args.top), args)
        return
    if not torch.cuda.is_available():
        sys.exit("profile_gaps.py: needs a CUDA device")
    runner_args = SimpleNamespace(seed=0, lr=1e-5, batch=args.batch, seq=args.seq, warmup=args.warmup, steps=1)
    runner = bench_llama.Runner(args.variant, runner_args, bench_llama.LLAMA_1B, torch.device("cuda"))
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.step()
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("default")
    stats1 = torch.cuda.memory_stats()
    syncs = collections.Counter(str(w.message).splitlines()[0][:120] for w in caught
                                if "synchroniz" in str(w.message).lower())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=args.shapes) as prof:
        runner.step()  # (a step issued from an idle GPU, then the analysed one, issued while that one runs)
        runner.step()
        torch.cuda.synchronize()
    trace_file = args.trace or tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(trace_file)
    with open(trace_file) as f:
        result = analyse(json.load(f), args.gap_us, args.top)
    result.update(variant=args.variant, device=torch.cuda.get_device_name(),
                  syncs_per_step=dict(syncs),
                  allocator_per_step={k: stats1.get(k, 0) - stats0.get(k, 0)
                                      for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")})
    report(result, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def report(result: dict, args: argparse.Namespace) -> None:
    """Print analyse()'s result (and the sync/allocator counts when measured)."""
    print(f"{args.variant} on {result.get('device', 'a trace')}: one step's kernels span {result['span_ms']} ms")
    for phase, cats in result["kernel_ms"].items():
        print(f"  {phase}: kernels {round(sum(cats.values()), 2)} ms {cats}; idle gaps {result['gap_ms'].get(phase, 0)}"
              " ms")
    if "syncs_per_step" in result:
        print(f"synchronising calls per step: {result['syncs_per_step'] or 'none'}")
        print(f"allocator per step: {result['allocator_per_step']}")
    for phase, rows in result.get("kernels", {}).items():
        print(f"top kernels, {phase}:")
        for k in rows:
            print(f"  {k['ms']:8.3f} ms {k['launches']:5d}x {k['category']:14s} {k['name'][:110]}")
    print(f"largest gaps (> {args.gap_us} us):")
    for g in result["largest_gaps"]:
        print(f"  {g['idle_us']:8.1f} us {g['phase']:9s} {g['before'][:40]:40s} -> {g['after'][:40]:40s} "
              f"launched in: {g['launched_by']}")


if __name__ == "__main__":
    main()
