"""Block scaling (recipe.Float8BlockScaling) on the GPU: what cuBLASLt's block-scaled FP8 GEMM takes, its throughput
against our per-tensor FP8 GEMM and BF16 torch.matmul, the block cast's bandwidth, and a Linear / TransformerLayer
step under Float8BlockScaling vs DelayedScaling vs BF16. Prints tables and writes JSON (--json).

GEMM TFLOP/s (2·M·N·K per call): each candidate is a CUDA graph of several calls (about 4 TFLOP), replayed between
CUDA events; candidates are timed in turn, round after round in a seeded new order (timing.run_rounds), and the table
shows the median over the rounds. Block rows: "fprop" = a 1x128 x b 128x128 (activation x weight), "wgrad" = 1x128 x
1x128 (dyᵀ x xᵀ). Per-tensor rows: fp8_gemm with the split accumulator (what block scaling always uses) and with
fast accumulation (our per-tensor forward). Layer steps: forward + backward, gradients from None, timing.gpu_time_ms
(10 steps back to back) per round.
Usage: python benchmarks/bench_block_scaling.py [--json out.json] [--rounds 5] [--skip-layers]
"""
import argparse
import json

import torch

import transformer_fp8 as te
from timing import gpu_time_ms, run_rounds
from transformer_fp8 import recipe

ops = torch.ops.transformer_fp8
E4M3 = torch.float8_e4m3fn
GEMM_SHAPES = [  # (M, K, N): Llama-8B-like layer GEMMs at 8192 tokens
    (8192, 4096, 4096), (8192, 4096, 6144), (8192, 4096, 14336), (8192, 14336, 4096), (8192, 4096, 28672),
    (8192, 8192, 8192),
]


def graph_ms(fn, calls):
    """A measure: ms per call of fn over one replay of a CUDA graph of `calls` calls (built on first use)."""
    state = {}

    def measure():
        if "graph" not in state:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    fn()
            graph.replay()
            state["graph"] = graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        state["graph"].replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    return measure


def probe_cublaslt():
    """Which block-scaled GEMMs cuBLASLt runs on this GPU: each combination called once; 'ok' or the error."""
    m, k, n = 256, 512, 384
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    xq, xs, _, _ = ops.block_cast(x, E4M3, 1)
    wq, ws, _, _ = ops.block_cast(w, E4M3, 2)
    w1q, w1s, _, _ = ops.block_cast(w, E4M3, 1)
    x5q, x5s, _, _ = ops.block_cast(x, torch.float8_e5m2, 1)
    cases = {}
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        bias_dtype = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
        bias = torch.randn(n, device="cuda", dtype=bias_dtype)
        cases[f"1x128 x 128x128 -> {out_dtype}"] = lambda o=out_dtype: ops.block_fp8_gemm(xq, xs, 1, wq, ws, 2, o)
        cases[f"1x128 x 128x128 + bias -> {out_dtype}"] = (
            lambda o=out_dtype, b=bias: ops.block_fp8_gemm(xq, xs, 1, wq, ws, 2, o, b))
        cases[f"1x128 x 1x128 -> {out_dtype}"] = lambda o=out_dtype: ops.block_fp8_gemm(xq, xs, 1, w1q, w1s, 1, o)
        cases[f"128x128 x 1x128 -> {out_dtype}"] = lambda o=out_dtype: ops.block_fp8_gemm(wq, ws, 2, xq, xs, 1, o)
    cases["E5M2 1x128 x E4M3 128x128 -> bf16"] = lambda: ops.block_fp8_gemm(x5q, x5s, 1, wq, ws, 2, torch.bfloat16)
    acc = torch.zeros(m, n, device="cuda")
    cases["1x128 x 1x128 accumulate into f32"] = lambda: ops.block_fp8_gemm_accumulate(xq, xs, 1, w1q, w1s, 1, acc)
    cases["1x128 x 128x128, K=200 (padded to 208)"] = lambda: ops.block_fp8_gemm(
        *ops.block_cast(x[:, :200].contiguous(), E4M3, 1)[:2], 1, *ops.block_cast(w[:, :200].contiguous(), E4M3, 2)[:2],
        2, torch.bfloat16)
    results = {}
    for name, call in cases.items():
        try:
            call()
            torch.cuda.synchronize()
            results[name] = "ok"
        except RuntimeError as err:
            results[name] = str(err).splitlines()[0][:200]
    return results


def gemm_table(rounds):
    rows = []
    for m, k, n in GEMM_SHAPES:
        flops = 2.0 * m * n * k
        calls = max(3, min(50, int(4e12 / flops)))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xq, xs, _, _ = ops.block_cast(x, E4M3, 1)
        wq, ws, _, _ = ops.block_cast(w, E4M3, 2)
        w1q, w1s, _, _ = ops.block_cast(w, E4M3, 1)
        sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([0.03], device="cuda")
        pq, pw = (x * 32).to(E4M3), (w * 32 * 8).to(E4M3)
        measures = {
            "block fprop": graph_ms(lambda: ops.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.bfloat16), calls),
            "block wgrad": graph_ms(lambda: ops.block_fp8_gemm(xq, xs, 1, w1q, w1s, 1, torch.bfloat16), calls),
            "per-tensor split": graph_ms(lambda: ops.fp8_gemm(pq, sa, pw, sb, torch.bfloat16), calls),
            "per-tensor fast": graph_ms(
                lambda: ops.fp8_gemm(pq, sa, pw, sb, torch.bfloat16, use_split_accumulator=False), calls),
            "bf16 matmul": graph_ms(lambda: torch.matmul(x, w.t()), calls),
        }
        timed = run_rounds(measures, rounds)
        row = {"shape": [m, k, n], "calls_per_graph": calls, "rounds": timed}
        row["tflops"] = {name: flops / (t["median"] * 1e-3) / 1e12 for name, t in timed.items() if "median" in t}
        rows.append(row)
    return rows


def cast_table(rounds):
    rows = []
    for m, k in [(8192, 4096), (8192, 14336)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor([1.0], device="cuda")
        measures = {
            "block 1x128 + own transposed tiles": graph_ms(lambda: ops.block_cast(x, E4M3, 1, True, True), 20),
            "block 128x128 + transposed": graph_ms(lambda: ops.block_cast(x, E4M3, 2, True, True), 20),
            "per-tensor cast_transpose": graph_ms(lambda: ops.cast_transpose(x, scale, E4M3), 20),
        }
        timed = run_rounds(measures, rounds)
        moved = m * k * (2 + 1 + 1)  # read bf16, write two FP8 copies (scales are small)
        rows.append({"shape": [m, k], "rounds": timed,
                     "gb_per_s": {n: moved / (t["median"] * 1e-3) / 1e9 for n, t in timed.items() if "median" in t}})
    return rows


def layer_step(module, x, fp8_recipe):
    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        if fp8_recipe is None:
            out = module(x)
        else:
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                out = module(x)
        out.backward(torch.ones_like(out))
    return step


def layer_table(rounds):
    recipes = {"BF16": None, "DelayedScaling": recipe.DelayedScaling(),
               "Float8BlockScaling": recipe.Float8BlockScaling()}
    configs = {
        "Linear 4096->4096, 8192 tokens": (lambda: te.Linear(4096, 4096, params_dtype=torch.bfloat16),
                                           (8192, 4096)),
        "LayerNormMLP 4096->14336 (swiglu), 8192 tokens": (
            lambda: te.LayerNormMLP(4096, 14336, activation="swiglu", normalization="RMSNorm",
                                    params_dtype=torch.bfloat16), (8192, 4096)),
        "TransformerLayer guide (4096, ffn 16384, 32 heads, s2048 b4)": (
            lambda: te.TransformerLayer(4096, 16384, 32, params_dtype=torch.bfloat16), (2048, 4, 4096)),
    }
    rows = []
    for name, (build, shape) in configs.items():
        module = build().cuda()
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        measures = {r: (lambda s=layer_step(module, x, fr): gpu_time_ms(s, warmup=3, iters=10)) for r, fr in
                    recipes.items()}
        rows.append({"config": name, "rounds": run_rounds(measures, rounds)})
        del module, x
        torch.cuda.empty_cache()
    return rows


def print_tables(result):
    print("\ncuBLASLt block-scaled GEMM on", result["device"])
    for name, outcome in result["probe"].items():
        print(f"  {name}: {outcome}")
    print("\n| M×K×N | block fprop | block wgrad | per-tensor split | per-tensor fast | BF16 matmul | fprop / fast | "
          "fprop / split |")
    print("|---|---|---|---|---|---|---|---|")
    for row in result["gemm"]:
        t = row["tflops"]
        ratio = lambda a, b: f"{t[a] / t[b]:.3f}" if a in t and b in t else "-"  # noqa: E731
        cells = " | ".join(f"{t[c]:.1f}" if c in t else "error" for c in
                           ("block fprop", "block wgrad", "per-tensor split", "per-tensor fast", "bf16 matmul"))
        print(f"| {'×'.join(map(str, row['shape']))} | {cells} | {ratio('block fprop', 'per-tensor fast')} | "
              f"{ratio('block fprop', 'per-tensor split')} |")
    print("\n| cast (bf16 in, FP8 + transposed FP8 out) | GB/s |")
    print("|---|---|")
    for row in result["cast"]:
        for name, gbs in row["gb_per_s"].items():
            print(f"| {row['shape'][0]}×{row['shape'][1]} {name} | {gbs:.0f} |")
    for row in result.get("layers", []):
        print(f"\n{row['config']}: ms per fwd+bwd step (median [min, max] over rounds)")
        for r, t in row["rounds"].items():
            print(f"  {r}: " + (f"{t['median']:.3f} [{t['min']:.3f}, {t['max']:.3f}]" if "median" in t else t["error"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-layers", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "probe": probe_cublaslt(), "gemm": gemm_table(args.rounds),
              "cast": cast_table(args.rounds)}
    if not args.skip_layers:
        result["layers"] = layer_table(args.rounds)
    print_tables(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
