"""Host time of a training step (issue 22: where the step's time goes when the GPU waits for the host).

For one bench_llama.py variant after warm-up:
- issue time of the forward (with the loss) and of the backward, each issued while the GPU is held busy by a sleep
  kernel queued first (torch.cuda._sleep), so that no launch waits for the GPU: the host's own cost of issuing that
  phase (median of --repeats);
- the same phases' GPU time (CUDA events, the GPU not waiting for the host: issued behind a sleep as well);
- cProfile of --profile-steps whole steps: the functions with the most own time, and with the most cumulative time
  among transformer_fp8's, per step.
A phase whose issue time exceeds its GPU time cannot keep the GPU busy by itself in eager mode.

Run: python benchmarks/profile_host.py [--variant ours-fp8] [--json out.json]
"""
import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from types import SimpleNamespace

import torch

import bench_llama

SLEEP_CYCLES = 2_000_000_000  # ~1 s at H100/H200 clocks: longer than any phase's issue time


def phase_times(runner, repeats: int) -> dict:
    """{phase: (median host ms to issue it, median GPU ms)} for "forward" and "backward"."""
    host = {"forward": [], "backward": []}
    gpu = {"forward": [], "backward": []}
    for _ in range(repeats):
        ids = runner.batches[0]
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, mid = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        loss = runner.loss_fn(ids)
        host["forward"].append((time.perf_counter() - t0) * 1e3)
        mid.record()
        torch.cuda.synchronize()
        gpu["forward"].append(start.elapsed_time(mid))
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        loss.backward()
        host["backward"].append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu["backward"].append(start.elapsed_time(end))
        runner.optimizer.zero_grad(set_to_none=True)
    return {p: dict(host_ms=round(statistics.median(host[p]), 2), gpu_ms=round(statistics.median(gpu[p]), 2))
            for p in host}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="ours-fp8", choices=bench_llama.VARIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_host.py: needs a CUDA device")
    runner_args = SimpleNamespace(seed=0, lr=1e-5, batch=4, seq=2048, warmup=3, steps=1)
    runner = bench_llama.Runner(args.variant, runner_args, bench_llama.LLAMA_1B, torch.device("cuda"))
    phases = phase_times(runner, args.repeats)
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.profile_steps):
        runner.step()
    torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime")
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2]):
        rows.append(dict(function=f"{path.split('site-packages/')[-1]}:{line}({name})",
                         calls=calls // args.profile_steps, own_ms=round(own * 1e3 / args.profile_steps, 3),
                         cumulative_ms=round(cumulative * 1e3 / args.profile_steps, 3)))
    print(f"{args.variant} on {torch.cuda.get_device_name()}: host ms to issue / GPU ms, per phase: {phases}")
    print(f"cProfile, per step (profiler overhead included), top {args.top} by own time:")
    for r in rows[:args.top]:
        print(f"  {r['own_ms']:8.3f} own {r['cumulative_ms']:9.3f} cum {r['calls']:6d}x  {r['function'][-110:]}")
    ours = [r for r in rows if "transformer_fp8" in r["function"]]
    ours.sort(key=lambda r: -r["cumulative_ms"])
    print("transformer_fp8 by cumulative time:")
    for r in ours[:args.top]:
        print(f"  {r['own_ms']:8.3f} own {r['cumulative_ms']:9.3f} cum {r['calls']:6d}x  {r['function'][-110:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(variant=args.variant, device=torch.cuda.get_device_name(), phases=phases,
                           profile=rows[:200]), f, indent=1)


if __name__ == "__main__":
    main()
