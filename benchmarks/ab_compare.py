"""Before/after comparison of two builds of transformer_fp8 on one GPU, in one run, interleaved.

Each round runs, for each tree in a seeded new order, benchmarks/ab_workloads.py (Linear host time; Linear,
LayerNormMLP and guide-layer GPU time under delayed and current scaling) in a fresh process with that tree first on
PYTHONPATH, and with --llama the tree's own bench_llama.py (ours-fp8, 1.1B, B4 x S2048, one round of --llama-steps
steps). Reports per workload the median and range over the rounds and the after/before ratio of the medians.
The trees must be built in place (their transformer_fp8/_C*.so present), e.g. `python setup.py build_ext --inplace`.

Usage: python benchmarks/ab_compare.py --before OLD_TREE --after NEW_TREE [--rounds 3] [--llama] [--json out.json]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent


def run_workloads(tree: Path, only_host: bool, device: str) -> Dict[str, float]:
    """One process of ab_workloads.py with `tree`'s transformer_fp8 first on the path.

    Args:
        tree: a source tree with transformer_fp8 built in place. only_host: pass --only-host. device: --device.
    Returns:
        {workload: value}.
    """
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
    command = [sys.executable, str(HERE / "ab_workloads.py"), *(["--only-host"] if only_host else []),
               "--device", device]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ab_workloads.py on {tree} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result.pop("library").startswith(str(tree)):
        raise RuntimeError(f"ab_workloads.py on {tree} imported another transformer_fp8")
    return result


def run_llama(tree: Path, steps: int) -> Dict[str, float]:
    """The tree's own bench_llama.py, ours-fp8 only, one round.

    Args:
        tree: as run_workloads. steps: timed steps.
    Returns:
        {"llama_fp8_tokens_per_s": median, "llama_fp8_peak_gib": peak}.
    """
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        done = subprocess.run([sys.executable, str(tree / "benchmarks" / "bench_llama.py"), "--variants", "ours-fp8",
                               "--rounds", "1", "--steps", str(steps), "--json", out.name], env=env,
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"bench_llama.py on {tree} failed:\n{done.stderr[-3000:]}")
        row = json.load(open(out.name))["rows"][0]
    return {"llama_fp8_tokens_per_s": row["tokens_per_s"]["median"], "llama_fp8_peak_gib": row.get("peak_gib")}


def summarize(values: Dict[str, Dict[str, List[float]]]) -> Dict[str, dict]:
    """{workload: {"before": {median, min, max, rounds}, "after": ..., "ratio": after/before medians}}."""
    table = {}
    for workload in values["before"]:
        row = {}
        for side in ("before", "after"):
            v = [x for x in values[side][workload] if x is not None]
            row[side] = {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v} if v else None
        if row["before"] and row["after"] and row["before"]["median"]:
            row["ratio"] = round(row["after"]["median"] / row["before"]["median"], 4)
        table[workload] = row
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the old tree (built in place)")
    parser.add_argument("--after", type=Path, required=True, help="the new tree (built in place)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama", action="store_true", help="also the Llama 1.1B step (about a minute a run)")
    parser.add_argument("--llama-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-host", action="store_true", help="only the Linear host-time workloads")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu", "meta"],
                        help="cpu / meta: the host-time workloads on the CPU reference / fake kernels (no --llama)")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    if args.device != "cuda" and args.llama:
        parser.error("--llama: needs --device cuda")
    if args.rounds < 1:
        parser.error(f"--rounds: expected >= 1, got {args.rounds}")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    values: Dict[str, Dict[str, List[float]]] = {"before": {}, "after": {}}
    rng = random.Random(args.seed)
    for round_index in range(args.rounds):
        order = list(trees)
        rng.shuffle(order)
        for side in order:
            result = run_workloads(trees[side], args.only_host, args.device)
            if args.llama:
                result.update(run_llama(trees[side], args.llama_steps))
            for workload, value in result.items():
                values[side].setdefault(workload, []).append(value)
            print(f"round {round_index + 1} {side}: {result}", flush=True)
    table = summarize(values)
    print(f"\n{'workload':<44}{'before (median, range)':>30}{'after (median, range)':>30}{'after/before':>14}")
    for workload, row in table.items():
        cells = [f"{row[s]['median']:.4g} ({row[s]['min']:.4g}-{row[s]['max']:.4g})" if row[s] else "-"
                 for s in ("before", "after")]
        print(f"{workload:<44}{cells[0]:>30}{cells[1]:>30}{row.get('ratio', float('nan')):>14.3f}")
    if args.json:
        import torch  # (only to name the GPU in the JSON)
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "trees": {k: str(v) for k, v in trees.items()}, "rounds": args.rounds, "table": table}, f,
                      indent=1)


if __name__ == "__main__":
    main()
