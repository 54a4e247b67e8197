"""Rerun every benchmark that feeds a published number (README "Performance", benchmarks/RESULTS.md) in one command.

Each benchmark runs in its own process with its own time limit; a benchmark that fails, times out or needs hardware
this machine lacks is reported in the summary, never fatal to the others. Each writes its JSON into one dated folder
(default benchmarks/results/<date>-reproduce-<mode>/) beside its log; the run ends with a summary table
(summary.md, summary.json): per benchmark its status, seconds, the published figures it feeds, and a few of its
medians with their [min, max] over the rounds.

Modes:
  --quick  the headline figures at reduced rounds (at most 7 minutes by default, --budget-s 420, after the build:
           a build of ~3 minutes and the quick run fit one 10-minute device call; what the budget cuts is reported)
  (none)   every benchmark at the rounds the published tables used (about 60-70 minutes on one H100; multi-GPU rows
           only where 2 GPUs are visible)
  --smoke  each changed script's CPU smoke mode (tiny sizes, --device cpu): checks the scripts, measures nothing
Usage: bash benchmarks/reproduce.sh [--quick | --smoke] [--out DIR] [--only NAME,...] [--list] [--dry-run]
"""
import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark process.

    Args:
        name: its name in the summary (also its JSON's and log's file names).
        command: the command after the Python interpreter, relative to the repository root; "{json}" is replaced by
            the JSON path, "{out}" by the output folder.
        timeout_s: its time limit.
        feeds: the published figures it reproduces (where to find them).
        gpus: GPUs it needs (skipped with fewer visible).
        json_name: the file it writes, if not <name>.json (e.g. a folder's summary.json).
    """
    name: str
    command: Sequence[str]
    timeout_s: int
    feeds: str
    gpus: int = 1
    json_name: Optional[str] = None


LLAMA_LIKE_FOR_LIKE = "ours-fp8,ours-fp8-hf-loss,hf-eager,hf-eager-chunked-loss"

# Ordered by priority: the README's headline rows first (a --budget-s that runs out skips the tail, not the head).
QUICK = [
    Benchmark("bench_llama", ["benchmarks/bench_llama.py", "--rounds", "2", "--steps", "5", "--variants",
                              LLAMA_LIKE_FOR_LIKE + ",ours-fp8-fused-adamw", "--json", "{json}"], 300,
              "README Llama 1.1B row; RESULTS 'Llama 1.1B step, variants interleaved in rounds'"),
    Benchmark("bench_modules", ["benchmarks/bench_modules.py", "--rounds", "3", "--no-compile", "--skip",
                                "inference", "host", "host-call", "--json", "{json}"], 150,
              "README Linear row (not its compiled column); RESULTS 'Modules' training table"),
    Benchmark("bench_transformer_layer", ["benchmarks/bench_transformer_layer.py", "--configs", "guide",
                                          "--no-compile", "--no-attention", "--rounds", "3", "--json", "{json}"], 150,
              "README Transformer layer row; RESULTS 'TransformerLayer' tables (guide)"),
    Benchmark("bench_gemm", ["benchmarks/bench_gemm.py", "--repeats", "5", "--json", "{json}"], 90,
              "README GEMM row; RESULTS 'FP8 GEMM'"),
    Benchmark("bench_quantize", ["benchmarks/bench_quantize.py", "--rounds", "3", "--iters", "20", "--json",
                                 "{json}"], 60, "RESULTS 'Casts, norms, activations'"),
    Benchmark("bench_block_scaling", ["benchmarks/bench_block_scaling.py", "--llama-stack", "--skip-gemm",
                                      "--skip-layers", "--rounds", "2", "--json", "{json}"], 180,
              "README block-scaling row; RESULTS 'Block scaling' Llama stack"),
    Benchmark("bench_moe", ["benchmarks/bench_moe.py", "--skip-gemm", "--rounds", "2", "--json", "{json}"], 180,
              "README MoE row; RESULTS 'MoE' layer table"),
]

FULL = [
    Benchmark("bench_llama", ["benchmarks/bench_llama.py", "--rounds", "3", "--steps", "10", "--variants",
                              LLAMA_LIKE_FOR_LIKE + ",ours-bf16,hf-compile", "--json", "{json}"], 600,
              "README Llama 1.1B row; RESULTS 'Llama'"),
    Benchmark("bench_llama_checkpointing", ["benchmarks/bench_llama.py", "--rounds", "3", "--steps", "5",
                                            "--variants", "ours-fp8,ours-fp8-checkpointed,hf-eager,"
                                            "hf-eager-checkpointed", "--json", "{json}"], 480,
              "RESULTS 'Llama' activation-checkpointing table; notebooks/performance_optimizations (section 4)"),
    Benchmark("bench_modules", ["benchmarks/bench_modules.py", "--rounds", "7", "--native-node-ab",
                                "--native-updates-ab", "--json", "{json}"], 1200,
              "README Linear row; RESULTS 'Modules' (training, inference grid, host time, NATIVE_NODE and "
              "NATIVE_UPDATES on/off)"),
    Benchmark("bench_transformer_layer", ["benchmarks/bench_transformer_layer.py", "--graphed", "--kernels",
                                          "--json", "{json}"], 1200,
              "README Transformer layer row; RESULTS 'TransformerLayer' layer and attention-alone tables, per-kernel "
              "split"),
    Benchmark("bench_gemm", ["benchmarks/bench_gemm.py", "--repeats", "30", "--json", "{json}"], 300,
              "README GEMM row; RESULTS 'FP8 GEMM'"),
    Benchmark("bench_quantize", ["benchmarks/bench_quantize.py", "--rounds", "5", "--json", "{json}"], 180,
              "RESULTS 'Casts, norms, activations'"),
    Benchmark("bench_attention", ["benchmarks/bench_attention.py", "--rounds", "5", "--json", "{json}"], 300,
              "RESULTS 'bench_attention.py' table"),
    Benchmark("attention_host_cost", ["benchmarks/attention_host_cost.py", "--rounds", "7", "--json", "{json}"],
              300, "RESULTS 'TransformerLayer': host cost per attention call at a small shape"),
    Benchmark("op_host_cost", ["benchmarks/op_host_cost.py", "--rounds", "5", "--json", "{json}"], 300,
              "RESULTS 'Overhead': host µs per op call"),
    Benchmark("bench_overhead", ["benchmarks/bench_overhead.py", "--rounds", "5", "--json", "{json}"], 900,
              "RESULTS 'Overhead': 24-layer stack, eager / graphed"),
    Benchmark("bench_block_scaling", ["benchmarks/bench_block_scaling.py", "--llama-stack", "--rounds", "3",
                                      "--json", "{json}"], 900,
              "README block-scaling row; RESULTS 'Block scaling'"),
    Benchmark("bench_moe", ["benchmarks/bench_moe.py", "--rounds", "5", "--json", "{json}"], 600,
              "README MoE row; RESULTS 'MoE'"),
    Benchmark("bench_lora", ["benchmarks/bench_lora.py", "--json", "{json}"], 900,
              "README LoRA row; RESULTS 'LoRA step'"),
    Benchmark("bench_decode", ["benchmarks/bench_decode.py", "--json", "{json}"], 900,
              "README decoding row; RESULTS 'Greedy decoding'"),
    Benchmark("bench_rope", ["benchmarks/bench_rope.py", "--json", "{json}"], 120, "RESULTS 'RoPE'"),
    Benchmark("bench_guide_recipes", ["benchmarks/bench_guide_recipes.py", "--rounds", "5", "--json", "{json}"], 600,
              "RESULTS 'The guide layer under every recipe, ours and TE's' (TE's rows where it is installed)"),
    Benchmark("finetune_llama", ["examples/finetune_llama.py", "--out", "{out}/finetune_llama"], 900,
              "README finetune_llama row; RESULTS 'Main example'", json_name="finetune_llama/summary.json"),
    Benchmark("bench_distributed", ["-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "benchmarks/bench_distributed.py", "--json", "{json}"], 600,
              "README tensor-parallel row; RESULTS 'Distributed' (2 GPUs)", gpus=2),
]

SMOKE = [  # (each script's CPU smoke mode: the changed scripts keep working; tests/test_benchmarks_smoke.py runs it)
    Benchmark("bench_modules", ["benchmarks/bench_modules.py", "--device", "cpu", "--tiny", "--rounds", "2",
                                "--no-compile", "--native-updates-ab", "--skip", "inference", "host-call", "--json",
                                "{json}"], 120,
              "smoke", gpus=0),
    Benchmark("bench_transformer_layer", ["benchmarks/bench_transformer_layer.py", "--device", "cpu", "--configs",
                                          "tiny", "--no-compile", "--no-attention", "--rounds", "1", "--json",
                                          "{json}"], 120, "smoke", gpus=0),
    Benchmark("bench_overhead", ["benchmarks/bench_overhead.py", "--device", "cpu", "--tiny", "--rounds", "1",
                                 "--skip", "sizes", "--json", "{json}"], 120, "smoke", gpus=0),
    Benchmark("bench_gemm", ["benchmarks/bench_gemm.py", "--device", "cpu", "--tiny", "--repeats", "2", "--json",
                             "{json}"], 120, "smoke", gpus=0),
    Benchmark("bench_quantize", ["benchmarks/bench_quantize.py", "--device", "cpu", "--tiny", "--rounds", "2",
                                 "--iters", "2", "--json", "{json}"], 120, "smoke", gpus=0),
    Benchmark("op_host_cost", ["benchmarks/op_host_cost.py", "--device", "cpu", "--rounds", "2", "--iters", "4",
                               "--no-profile", "--json", "{json}"], 120, "smoke", gpus=0),
    Benchmark("bench_guide_recipes", ["benchmarks/bench_guide_recipes.py", "--device", "cpu", "--tiny", "--impls",
                                      "ours", "--rounds", "2", "--steps", "1", "--warmup", "1", "--json", "{json}"],
              120, "smoke", gpus=0),
]


def visible_gpus() -> int:
    """How many CUDA devices this machine shows (0 without torch's CUDA), asked in a child process so that this
    process never initialises CUDA itself."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        return int(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return 0


def run_one(bench: Benchmark, out: Path, timeout_s: int) -> Dict[str, object]:
    """Run one benchmark in its own process group, its output to <out>/<name>.log.

    Args:
        bench: what to run. out: the output folder. timeout_s: its limit (the whole process group is killed then).
    Returns:
        {"status": "ok" | "failed (rc N)" | "timed out after N s", "seconds", "json": the JSON's path if written}.
    """
    json_path = out / (bench.json_name or f"{bench.name}.json")
    command = [sys.executable] + [part.replace("{json}", str(json_path)).replace("{out}", str(out))
                                  for part in bench.command]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.time()
    with open(out / f"{bench.name}.log", "w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            rc = process.wait(timeout=timeout_s)
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # (its own session: the benchmark and any children it started)
            process.wait()
            status = f"timed out after {timeout_s} s"
    result = {"status": status, "seconds": round(time.time() - start, 1)}
    if json_path.exists():
        result["json"] = str(json_path.relative_to(out))
    return result


def medians(data: object, path: str = "", found: Optional[List[str]] = None, limit: int = 6) -> List[str]:
    """Up to `limit` "path: median [min, max]" texts from a benchmark's JSON (every dict with median/min/max, depth
    first): the summary's glance at what was measured; the JSON holds the rest."""
    found = [] if found is None else found
    if len(found) >= limit:
        return found
    if isinstance(data, dict):
        if {"median", "min", "max"} <= data.keys() and not isinstance(data["median"], (dict, list)):
            found.append(f"{path}: {data['median']:.4g} [{data['min']:.4g}, {data['max']:.4g}]")
            return found
        for key, value in data.items():
            if key not in ("rounds", "order"):
                medians(value, f"{path}/{key}", found, limit)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            label = next((value[k] for k in ("variant", "module", "op", "model", "config")
                          if isinstance(value, dict) and isinstance(value.get(k), str)), i)
            medians(value, f"{path}[{label}]", found, limit)
    return found


def summary_text(results: Dict[str, Dict[str, object]], out: Path, mode: str, benches: Sequence[Benchmark]) -> str:
    """The summary table (markdown)."""
    lines = [f"# Reproduce run ({mode}), {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"Folder: {out}", "", "| benchmark | status | s | JSON | feeds | medians [min, max] (first few) |",
             "|---|---|---|---|---|---|"]
    for bench in benches:
        r = results[bench.name]
        glance = "; ".join(r.get("medians", [])) or "-"
        lines.append(f"| {bench.name} | {r['status']} | {r.get('seconds', '-')} | {r.get('json', '-')} | "
                     f"{bench.feeds} | {glance} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the chosen benchmarks and writes the summary.

    Args:
        argv: the command line's arguments (default sys.argv[1:]).
    Returns:
        0 when every benchmark that ran succeeded, 1 otherwise (skipped ones do not count as failures).
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the headline figures at reduced rounds (~8 min)")
    mode.add_argument("--smoke", action="store_true", help="the scripts' CPU smoke modes (no GPU needed)")
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<date>-reproduce-<mode>)")
    parser.add_argument("--only", help="comma-separated benchmark names (default: all of the mode)")
    parser.add_argument("--budget-s", type=int, help="stop starting benchmarks past this many seconds "
                        "(default 420 with --quick, none otherwise); the ones left are reported as skipped")
    parser.add_argument("--list", action="store_true", help="print the mode's benchmarks and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    mode_name = "quick" if args.quick else "smoke" if args.smoke else "full"
    benches = {"quick": QUICK, "smoke": SMOKE, "full": FULL}[mode_name]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = set(wanted) - {b.name for b in benches}
        if unknown:
            parser.error(f"--only: unknown {sorted(unknown)} in mode {mode_name}; expected some of "
                         f"{[b.name for b in benches]}")
        benches = [b for b in benches if b.name in wanted]
    if args.list or args.dry_run:
        for b in benches:
            print(f"{b.name:28s} limit {b.timeout_s:5d} s, {b.gpus} GPU(s): python {' '.join(b.command)}\n"
                  f"{'':28s} feeds: {b.feeds}")
        return 0
    budget = args.budget_s if args.budget_s is not None else (420 if args.quick else None)
    out = args.out or BENCH / "results" / f"{datetime.date.today():%Y-%m-%d}-reproduce-{mode_name}"
    out.mkdir(parents=True, exist_ok=True)
    gpus = visible_gpus() if any(b.gpus for b in benches) else 0
    results: Dict[str, Dict[str, object]] = {}
    start = time.time()
    for bench in benches:
        left = None if budget is None else budget - (time.time() - start)
        if bench.gpus > gpus:
            results[bench.name] = {"status": f"skipped (needs {bench.gpus} GPU(s), {gpus} visible)"}
        elif left is not None and left < 30:
            results[bench.name] = {"status": f"skipped (time budget of {budget} s spent)"}
        else:
            limit = bench.timeout_s if left is None else int(min(bench.timeout_s, left))
            print(f"== {bench.name} (limit {limit} s)", flush=True)
            results[bench.name] = run_one(bench, out, limit)
            if "json" in results[bench.name]:
                try:
                    results[bench.name]["medians"] = medians(json.loads((out / results[bench.name]["json"])
                                                                        .read_text()))
                except (OSError, ValueError) as err:
                    results[bench.name]["status"] += f"; JSON unreadable: {err}"
        print(f"   {bench.name}: {results[bench.name]['status']}", flush=True)
    text = summary_text(results, out, mode_name, benches)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({"mode": mode_name, "seconds": round(time.time() - start, 1),
                                                  "benchmarks": results}, indent=1))
    print("\n" + text)
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
