"""Before/after host cost of an FP8 Linear forward+backward on meta tensors, in CPU time of the measuring thread.

The same workload as ab_workloads.py's `linear_host_*` on `--device meta` (te.Linear(64, 64), bf16, 16 tokens,
fp8_min_gemm_size=0, one fp8_autocast per step, delayed and current scaling), but timed with time.thread_time():
on a shared, loaded machine the wall clock counts the other processes' time slices, the thread's CPU time much less.
Each round runs both trees, alternating which goes first, each in a fresh process with that tree first on
PYTHONPATH; a process reports the minimum of `--samples` samples of 100 steps. Prints the per-round values and the
after/before ratio of the medians of the rounds' minima.

Usage: python benchmarks/ab_host_cpu_time.py --before OLD_TREE --after NEW_TREE [--rounds 8] [--samples 25]
(the trees built in place, as for ab_compare.py; one process: --measure, with the tree on PYTHONPATH)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict


def measure(samples: int) -> Dict[str, object]:
    """Returns:
        {"library": the transformer_fp8 imported, "delayed" / "current": µs per step (min over the samples)}."""
    import torch

    import transformer_fp8 as te
    from transformer_fp8 import recipe
    te.set_fp8_min_gemm_size(0)
    torch.manual_seed(0)
    result: Dict[str, object] = {"library": te.__file__}
    x0 = torch.randn(16, 64, device="meta", dtype=torch.bfloat16)
    for name, fp8_recipe in (("delayed", recipe.DelayedScaling()), ("current", recipe.Float8CurrentScaling())):
        linear = te.Linear(64, 64, params_dtype=torch.bfloat16, device="meta")
        x = x0.clone().requires_grad_()
        dy = torch.randn(16, 64, device="meta", dtype=torch.bfloat16)

        def step():
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                out = linear(x)
            out.backward(dy)
        for _ in range(50):
            step()
        times = []
        for _ in range(samples):
            start = time.thread_time()
            for _ in range(100):
                step()
            times.append((time.thread_time() - start) * 1e4)  # (µs per step)
        result[name] = round(min(times), 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="the old tree (built in place)")
    parser.add_argument("--after", help="the new tree (built in place)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--samples", type=int, default=25)
    parser.add_argument("--measure", action="store_true", help="(internal) measure the tree on PYTHONPATH")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.samples)))
        return
    if not args.before or not args.after:
        parser.error("--before and --after are required")
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    values: Dict[str, Dict[str, list]] = {side: {"delayed": [], "current": []} for side in trees}
    for round_index in range(args.rounds):
        for side in (("before", "after") if round_index % 2 == 0 else ("after", "before")):
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", "--samples",
                                   str(args.samples)], env={**os.environ, "PYTHONPATH": trees[side]},
                                  capture_output=True, text=True, check=True, cwd="/")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if not result["library"].startswith(trees[side]):
                raise RuntimeError(f"{side}: imported {result['library']}, not {trees[side]}")
            for name in ("delayed", "current"):
                values[side][name].append(result[name])
            print(f"round {round_index + 1} {side}: delayed {result['delayed']} µs, current {result['current']} µs",
                  flush=True)
    for name in ("delayed", "current"):
        before, after = statistics.median(values["before"][name]), statistics.median(values["after"][name])
        print(f"{name}: before {before:.1f} µs, after {after:.1f} µs, after/before {after / before:.4f}")


if __name__ == "__main__":
    main()
