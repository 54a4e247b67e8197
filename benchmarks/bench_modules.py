"""FP8 modules vs their BF16 PyTorch equivalents on one GPU, in one run.

1. Training: Linear / LayerNormLinear / LayerNormMLP forward+backward time and peak memory at M = 8192 tokens,
   (hidden, ffn) = (4096, 16384) and (2048, 8192); ours in FP8 (DelayedScaling, HYBRID) vs torch BF16 eager and
   torch.compile.
2. Inference grid: forward under no_grad with cached FP8 weights (is_first_microbatch=False), M in {128, 256, 512},
   K, N in {1280, 5120, 10240, 20480}, vs BF16 nn.Linear: the FP8 path forced (fp8_min_gemm_size=0) and the default
   (small-shape automatic path: high precision below base.FP8_MIN_GEMM_SIZE). Time per call of 100 back-to-back calls
   inside one no_grad + fp8_autocast context, as in a model's forward; the three timed in turn over GRID_ROUNDS
   rounds, the median time of each and the median of the per-round ratios reported. A second nn.Linear of the same
   shape is timed with them as a control: its ratio to the first is the measurement's noise at that point.
3. Host (CPU) time of one Linear forward+backward at a tiny shape vs nn.Linear, the FP8 path forced.
Prints tables and writes JSON (--json).
"""
import argparse
import json
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

import transformer_fp8 as te
from timing import gpu_time_ms, host_time_us, interleaved, loop_time_ms, peak_gib
from transformer_fp8 import recipe
from transformer_fp8.module import base

DEV = "cuda"
DT = torch.bfloat16


class TorchLayerNormMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


def module_pairs(hidden, ffn):
    """(name, ours, torch BF16 equivalent) at one size."""
    kw = dict(params_dtype=DT, device=DEV)
    return [
        ("Linear", te.Linear(hidden, ffn, **kw), nn.Linear(hidden, ffn, device=DEV, dtype=DT)),
        ("LayerNormLinear", te.LayerNormLinear(hidden, ffn, **kw),
         nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, ffn)).to(DEV, DT)),
        ("LayerNormMLP", te.LayerNormMLP(hidden, ffn, **kw), TorchLayerNormMLP(hidden, ffn).to(DEV, DT)),
    ]


def train_step(module, x, dy, fp8, fp8_recipe=recipe.DelayedScaling()):
    def step():
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
            y = module(x)
        y.backward(dy)
    return step


def bench_training(tokens=8192):
    rows = []
    for hidden, ffn in [(4096, 16384), (2048, 8192)]:
        for name, ours, ref in module_pairs(hidden, ffn):
            x = torch.randn(tokens, hidden, device=DEV, dtype=DT, requires_grad=True)
            out_features = ours(x.detach()).shape[-1]
            dy = torch.randn(tokens, out_features, device=DEV, dtype=DT)
            compiled = torch.compile(ref)
            cases = {
                "fp8": train_step(ours, x, dy, True),
                "bf16_eager": train_step(ref, x, dy, False),
                "bf16_compile": train_step(compiled, x, dy, False),
            }
            row = {"module": name, "tokens": tokens, "hidden": hidden, "ffn": ffn}
            for case, fn in cases.items():
                row[f"{case}_ms"] = gpu_time_ms(fn)
                row[f"{case}_gib"] = peak_gib(fn)
            row["speedup_vs_eager"] = row["bf16_eager_ms"] / row["fp8_ms"]
            row["speedup_vs_compile"] = row["bf16_compile_ms"] / row["fp8_ms"]
            rows.append(row)
            print(f"{name:16s} M={tokens} h={hidden} ffn={ffn}: fp8 {row['fp8_ms']:.3f} ms {row['fp8_gib']:.2f} GiB | "
                  f"bf16 {row['bf16_eager_ms']:.3f} ms {row['bf16_eager_gib']:.2f} GiB | "
                  f"compiled {row['bf16_compile_ms']:.3f} ms | x{row['speedup_vs_eager']:.2f} / "
                  f"x{row['speedup_vs_compile']:.2f}", flush=True)
            del ours, ref, compiled
            torch.cuda.empty_cache()
    return rows


def median_ratio(times, ref_times):
    """Median over the rounds of the per-round time ratio."""
    return statistics.median(t / r for t, r in zip(times, ref_times))


# Rounds per grid point: most points are host-bound calls of 17-100 µs whose per-round ratios move by ~10% (the A/A
# column shows it); the median of 21 rounds moves ~sqrt(3) less than the median of 7.
GRID_ROUNDS = 21


def bench_inference_grid():
    rows = []
    sizes = [1280, 5120, 10240, 20480]
    for k in sizes:
        for n in sizes:
            forced = te.Linear(k, n, params_dtype=DT, device=DEV, fp8_min_gemm_size=0)
            auto = te.Linear(k, n, params_dtype=DT, device=DEV)
            ref = nn.Linear(k, n, device=DEV, dtype=DT)
            twin = nn.Linear(k, n, device=DEV, dtype=DT)  # (an A/A control: how far two identical layers' ratio moves)
            for m in (128, 256, 512):
                x = torch.randn(m, k, device=DEV, dtype=DT)

                def fwd(module, **kwargs):
                    return lambda: module(x, **kwargs)

                for module in (forced, auto):
                    with torch.no_grad(), te.fp8_autocast():
                        module(x, is_first_microbatch=True)
                # As in a model's forward, one no_grad + fp8_autocast context covers many layer calls (nn.Linear
                # ignores it). The four are timed in turn, round after round: the host speed drifts, and at the
                # host-bound points a drift between two separate measurements would read as a ratio.
                with torch.no_grad(), te.fp8_autocast():
                    t_fp8, t_auto, t_bf16, t_twin = interleaved(
                        lambda fn: loop_time_ms(fn, warmup=5, iters=100, repeats=1),
                        [fwd(forced, is_first_microbatch=False), fwd(auto, is_first_microbatch=False), fwd(ref),
                         fwd(twin)], GRID_ROUNDS)
                rows.append({"M": m, "K": k, "N": n, "MKN": m * k * n, "fp8_ms": statistics.median(t_fp8),
                             "auto_ms": statistics.median(t_auto), "bf16_ms": statistics.median(t_bf16),
                             "ratio": median_ratio(t_fp8, t_bf16), "auto_ratio": median_ratio(t_auto, t_bf16),
                             "control_ratio": median_ratio(t_twin, t_bf16)})
            del forced, auto, ref, twin
    print(f"{'M':>5} {'K':>6} {'N':>6} {'M*K*N':>9} {'fp8 ms':>8} {'auto ms':>8} {'bf16 ms':>8} {'fp8/bf16':>8} "
          f"{'auto/bf16':>9} {'twin/bf16':>9}")
    for r in sorted(rows, key=lambda r: r["MKN"]):
        print(f"{r['M']:5d} {r['K']:6d} {r['N']:6d} {r['MKN']:9.2e} {r['fp8_ms']:8.4f} {r['auto_ms']:8.4f} "
              f"{r['bf16_ms']:8.4f} {r['ratio']:8.2f} {r['auto_ratio']:9.2f} {r['control_ratio']:9.2f}")
    for key, what in (("ratio", "FP8 forced"), ("auto_ratio", f"default (threshold {base.FP8_MIN_GEMM_SIZE:.2e})"),
                      ("control_ratio", "control (a second nn.Linear)")):
        worst = max(rows, key=lambda r: r[key])
        print(f"worst {what} / bf16 time ratio: {worst[key]:.2f} at M={worst['M']} K={worst['K']} N={worst['N']}")
    return rows


def bench_host_overhead(tokens=16, hidden=64, layers=(1, 8)):
    """Host time per Linear forward+backward, the FP8 path forced: one Linear per training step (the per-step work —
    autocast exit, the two scale updates, the backward callback — all charged to it), and a stack of 8 Linears per
    step (per-step work shared, as in a model). Divided by the number of layers; medians over interleaved rounds and
    the median of the per-round ratios. Also our stack captured with te.make_graphed_callables (FP8 inside the graphs;
    the remedy for host-bound small models, as with TE), against the same eager nn.Linear."""
    rows = []
    for n in layers:
        def stack():
            return nn.Sequential(*[te.Linear(hidden, hidden, params_dtype=DT, device=DEV, fp8_min_gemm_size=0)
                                   for _ in range(n)])
        ours = stack()
        ref = nn.Sequential(*[nn.Linear(hidden, hidden, device=DEV, dtype=DT) for _ in range(n)])
        x = torch.randn(tokens, hidden, device=DEV, dtype=DT, requires_grad=True)
        dy = torch.randn(tokens, hidden, device=DEV, dtype=DT)
        graphed = te.make_graphed_callables(stack(), (x,), fp8_enabled=True, fp8_recipe=recipe.DelayedScaling())
        train_step(graphed, x, dy, False)()  # (its first step calibrates the FP8 scales eagerly, then graphs replay)
        # (each variant its own input leaf: a leaf's gradient accumulator made while the graphs were captured runs on
        # the capture's stream, and other variants' backwards into it would synchronise on every step)
        x_ours, x_ref = (x.detach().clone().requires_grad_() for _ in range(2))
        t_fp8, t_bf16, t_graphed = interleaved(
            lambda step: host_time_us(step, iters=200),
            [train_step(ours, x_ours, dy, True), train_step(ref, x_ref, dy, False), train_step(graphed, x, dy, False)],
            7)
        row = {"tokens": tokens, "hidden": hidden, "layers": n, "fp8_us": statistics.median(t_fp8) / n,
               "bf16_us": statistics.median(t_bf16) / n, "fp8_graphed_us": statistics.median(t_graphed) / n,
               "ratio": median_ratio(t_fp8, t_bf16), "graphed_ratio": median_ratio(t_graphed, t_bf16),
               "ratio_range": [round(min(a / b for a, b in zip(t_fp8, t_bf16)), 2),
                               round(max(a / b for a, b in zip(t_fp8, t_bf16)), 2)],
               "rounds_us": {"fp8": [round(t / n, 1) for t in t_fp8], "bf16": [round(t / n, 1) for t in t_bf16]}}
        print(f"host time per Linear fwd+bwd ({tokens}x{hidden}, {n} Linear per step): fp8 {row['fp8_us']:.1f} us, "
              f"nn.Linear {row['bf16_us']:.1f} us, ratio {row['ratio']:.2f} (rounds {row['ratio_range'][0]:.2f}-"
              f"{row['ratio_range'][1]:.2f}); fp8 CUDA-graphed {row['fp8_graphed_us']:.1f} us, ratio "
              f"{row['graphed_ratio']:.2f}")
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_modules.json")
    parser.add_argument("--skip", nargs="*", default=[], choices=["training", "inference", "host"])
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name()}
    if "training" not in args.skip:
        result["training"] = bench_training()
    if "inference" not in args.skip:
        result["inference_grid"] = bench_inference_grid()
    if "host" not in args.skip:
        result["host_overhead"] = bench_host_overhead()
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
