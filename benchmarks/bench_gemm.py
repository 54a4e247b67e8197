"""FP8 GEMM throughput: transformer_fp8.fp8_gemm vs torch._scaled_mm (same FP8 inputs, BF16 output) and BF16 torch.mm.

Each timing replays a CUDA graph of several calls (about 4 TFLOP of work, 3 to 50 calls: no host overhead in the
figure) between CUDA events, after a warm-up; the candidates' replays are interleaved in `--repeats` rounds, a seeded
new order each round (timing.run_rounds), and the median over the rounds is reported as TFLOP/s (2·M·N·K per call),
with min and max (and every round) in the JSON. Inputs are random E4M3.
Usage: python benchmarks/bench_gemm.py [--json bench_gemm.json] [--repeats 30]
       python benchmarks/bench_gemm.py --device cpu --tiny --repeats 2  (a smoke test: eager calls, wall clock)
"""
import argparse
import json
from typing import Callable

import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from timing import gpu_time_ms, run_rounds, spread

ops = torch.ops.transformer_fp8
SHAPES = [  # (M, K, N)
    (8192, 8192, 8192), (8192, 4096, 4096), (8192, 4096, 12288), (8192, 4096, 16384), (8192, 16384, 4096),
    (32768, 4096, 16384), (512, 20480, 20480), (512, 5120, 5120), (128, 1280, 1280), (2048, 768, 3072),
]
TINY_SHAPES = [(32, 64, 32)]  # --tiny
DEV = "cuda"  # (main sets it from --device)


def graph_of(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of fn (after a warm-up that picks algorithms and fills the allocator).

    Args:
        fn: one call of the work. calls: how many calls the graph holds.
    Returns:
        The graph, replayed 3 times already.
    """
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    """Milliseconds per call of one replay of `graph` (of `calls` calls), between CUDA events.

    Args:
        graph: a graph from graph_of. calls: the calls it holds.
    Returns:
        The replay's GPU time divided by calls.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def time_ms(fns, calls, rounds, seed=0):
    """Milliseconds per call of each fn over `rounds` interleaved rounds (a seeded new order each round, so that the
    GPU clock's drift lands on every candidate alike): {name: timing.spread of its rounds}. On CUDA each measure is
    one replay of a graph of `calls` calls; without CUDA, `calls` eager calls on the wall clock (smoke tests)."""
    if DEV == "cuda":
        graphs = {name: graph_of(fn, calls) for name, fn in fns.items()}
        measures = {name: (lambda graph=graph: replay_ms(graph, calls)) for name, graph in graphs.items()}
    else:
        measures = {name: (lambda fn=fn: gpu_time_ms(fn, warmup=1, iters=calls)) for name, fn in fns.items()}
    return run_rounds(measures, rounds, seed=seed, on_error="raise")


def bench_shape(m, k, n, repeats):
    """One row: TFLOP/s of each candidate at M×K×N (median over the rounds, and its spread)."""
    a = (torch.randn(m, k, device=DEV) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device=DEV) * 4).to(torch.float8_e4m3fn)
    sa = torch.tensor([0.5], device=DEV)
    sb = torch.tensor([0.03], device=DEV)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    candidates = {
        "ours_fast": lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, use_split_accumulator=False),
        "scaled_mm_fast": lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                   use_fast_accum=True),
        "ours_split": lambda: ops.fp8_gemm(a, sa, b, sb, torch.bfloat16, use_split_accumulator=True),
        "scaled_mm_split": lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                    use_fast_accum=False),
        "bf16_mm": lambda: torch.mm(a16, b16.t()),
    }
    flops = 2.0 * m * n * k
    calls = min(50, max(3, round(4e12 / flops)))
    row = {"M": m, "K": k, "N": n, "calls_per_replay": calls}
    for name, stats in time_ms(candidates, calls, repeats, seed=m + k + n).items():
        tflops = spread([flops / (ms * 1e-3) / 1e12 for ms in stats["rounds"]], 6)
        row[name], row[f"{name}_spread"] = tflops["median"], tflops
    for mode in ("fast", "split"):  # (None where a median rounds to 0, as on the CPU)
        ours, ref = row[f"ours_{mode}"], row[f"scaled_mm_{mode}"]
        row[f"ratio_{mode}"] = ours / ref if ref else None  # the ratio of the medians
        # the median of the rounds' own ratios: a clock step between rounds (H100s throttle under long FP8 GEMMs)
        # moves both sides of a round's ratio, where it can split the two medians
        pairs = zip(row[f"ours_{mode}_spread"]["rounds"], row[f"scaled_mm_{mode}_spread"]["rounds"])
        paired = [o / r for o, r in pairs if r]
        row[f"paired_ratio_{mode}"] = spread(paired, 4)["median"] if paired else None
    return row


def main(argv=None):
    """Times every shape, prints the table and writes the JSON.

    Args:
        argv: the command line's arguments (default sys.argv[1:]).
    """
    global DEV
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_gemm.json", help="where to write the results")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved rounds (one replay each); median reported")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="one tiny shape: a smoke test of the script")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gemm.py needs a CUDA GPU (or --device cpu --tiny for a smoke test)")
    DEV = args.device
    torch.manual_seed(0)
    header = (f"{'M':>6} {'K':>6} {'N':>6} | {'ours':>7} {'_scaled_mm':>10} {'ratio':>6} {'paired':>6} | "
              f"{'ours':>7} {'_scaled_mm':>10} {'ratio':>6} {'paired':>6} | {'bf16 mm':>7}")
    print("TFLOP/s, BF16 output. Left: fast accumulation (use_fast_accum=True); middle: split accumulator. ratio: of "
          "the medians; paired: the median of each round's ratio.")
    print(header)
    print("-" * len(header))
    rows = []
    for m, k, n in TINY_SHAPES if args.tiny else SHAPES:
        r = bench_shape(m, k, n, args.repeats)
        rows.append(r)
        print(f"{m:>6} {k:>6} {n:>6} | {r['ours_fast']:>7.1f} {r['scaled_mm_fast']:>10.1f} "
              f"{r['ratio_fast'] or 0:>6.3f} {r['paired_ratio_fast'] or 0:>6.3f} | "
              f"{r['ours_split']:>7.1f} {r['scaled_mm_split']:>10.1f} {r['ratio_split'] or 0:>6.3f} "
              f"{r['paired_ratio_split'] or 0:>6.3f} | "
              f"{r['bf16_mm']:>7.1f}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "unit": "TFLOP/s",
                   "out_dtype": "bfloat16", "rounds": args.repeats, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
