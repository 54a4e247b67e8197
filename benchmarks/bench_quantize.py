"""Bandwidth of the FP8 cast kernels against a device-to-device copy, on BF16 inputs.

GB/s counts the bytes each op must read and write (BF16 in: 2 B/element, FP8 out: 1 B per output copy); "% copy" is
that rate over `torch.Tensor.copy_`'s (2 + 2 B/element) in the same run. Each op is timed per call with CUDA events
(median over --iters calls after a warm-up), cycling through enough input copies that L2 cannot serve them; per shape
the ops (the copy included) are measured in turn over --rounds rounds in a seeded new order each round
(timing.run_rounds), so that clock drift lands on all alike: the table shows the median over the rounds, the JSON
also min, max and every round.

Usage: python benchmarks/bench_quantize.py [--json bench_quantize.json] [--iters 50] [--rounds 5]
       python benchmarks/bench_quantize.py --device cpu --tiny --rounds 2 --iters 2  (a smoke test of the script)
"""
import argparse
import json
import statistics

import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from timing import gpu_time_ms, run_rounds

tfp8 = torch.ops.transformer_fp8
SHAPES = [(8192, 8192), (16384, 4096)]
TINY_SHAPES = [(64, 256)]  # --tiny (SwiGLU: output rows of one 128-wide tile)
DEV = "cuda"  # (main sets it from --device)
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
ROTATE_BYTES = 256 * 2**20  # > 5x the H100's 50 MB L2


def has_cuda_kernel(op):
    """Whether our op `op` has a CUDA kernel in this build (the fused norm / activation families are optional)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"transformer_fp8::{op}", "CUDA")


def median_ms(fn, inputs, iters, warmup=5):
    """Median ms per call of fn over `iters` calls, each between CUDA events (without CUDA: the wall clock of the
    calls, divided), cycling through `inputs`."""
    if DEV != "cuda":
        calls = iter(range(10**9))
        return gpu_time_ms(lambda: fn(inputs[next(calls) % len(inputs)]), warmup=1, iters=iters)
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(inputs[i % len(inputs)])
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def cases(m, n):
    """(name, function of the input, bytes moved per element, input kind: "bf16" or "fp8")."""
    scale, amax, scale_inv = (torch.ones(1, device=DEV) for _ in range(3))
    hidden = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    copy_out = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    out = [
        ("copy_ (bf16 -> bf16)", lambda x: copy_out.copy_(x), 4, "bf16"),
        ("torch (x * scale).to(e4m3)", lambda x: (x * scale).to(E4M3), 3, "bf16"),
        ("quantize", lambda x: tfp8.quantize(x, scale, E4M3, amax, scale_inv), 3, "bf16"),
        ("dequantize (e4m3 -> bf16)", lambda q: tfp8.dequantize(q, scale_inv, torch.bfloat16), 3, "fp8"),
        ("cast_transpose", lambda x: tfp8.cast_transpose(x, scale, E4M3, True, True, amax, scale_inv), 4, "bf16"),
        ("cast_transpose_dbias", lambda x: tfp8.cast_transpose_dbias(x, scale, E4M3, amax, scale_inv), 4, "bf16"),
        ("fp8_transpose", lambda q: tfp8.fp8_transpose(q), 2, "fp8"),
    ]
    fused = [
        ("layernorm_fwd", "layernorm_fwd -> e4m3",
         lambda x: tfp8.layernorm_fwd(x, hidden, hidden, 1e-5, False, scale, E4M3, amax, scale_inv)),
        ("rmsnorm_fwd", "rmsnorm_fwd -> e4m3",
         lambda x: tfp8.rmsnorm_fwd(x, hidden, 1e-5, False, scale, E4M3, amax, scale_inv)),
        ("activation_fwd", "activation_fwd(gelu) -> e4m3",
         lambda x: tfp8.activation_fwd(x, "gelu", scale, E4M3, amax, scale_inv)),
    ]
    out += [(name, fn, 3, "bf16") for op, name, fn in fused if DEV != "cuda" or has_cuda_kernel(op)]
    if DEV != "cuda" or has_cuda_kernel("activation_fwd_keep_input"):
        out += swiglu_cases(m, n, scale, amax, scale_inv)
    return out


def swiglu_cases(m, n, scale, amax, scale_inv):
    """LayerNormMLP's SwiGLU kernels under delayed scaling with the FP8-kept input, the input [m, n] = [gate | up]:
    the forward (reads 2 B, writes the FP8 output's 0.5 B, the kept copy's 1 B and its scales per input element) and
    the backward from the kept copy (reads the gradient's 1 B and the kept 1 B, writes d(input) and its transpose, 1 B
    each). The backward's operands are made once (its lambda ignores the rotated input)."""
    x = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
    _, kept, kept_scale_inv = tfp8.activation_fwd_keep_input(x, "swiglu", scale, E4M3, amax, scale_inv)
    grad = torch.randn(m, n // 2, device=DEV, dtype=torch.bfloat16)
    tile_scales = 4 / 128
    return [
        ("activation_fwd_keep_input(swiglu)",
         lambda x: tfp8.activation_fwd_keep_input(x, "swiglu", scale, E4M3, amax, scale_inv), 3.5 + tile_scales,
         "bf16"),
        ("dact_cast_transpose_kept(swiglu)",
         lambda _: tfp8.dact_cast_transpose_kept_input(grad, kept, kept_scale_inv, "swiglu", scale, E5M2, amax,
                                                       scale_inv), 4 + tile_scales, "bf16"),
    ]


def main(argv=None):
    """Times every op at every shape, prints the table and writes the JSON.

    Args:
        argv: the command line's arguments (default sys.argv[1:]).
    """
    global DEV
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_quantize.json")
    parser.add_argument("--iters", type=int, default=50, help="calls per measurement (their median)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median over them is reported")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="one tiny shape: a smoke test of the script")
    args = parser.parse_args(argv)
    for flag in ("iters", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: expected at least 1, got {getattr(args, flag)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_quantize.py needs a CUDA GPU (or --device cpu --tiny for a smoke test)")
    DEV = args.device
    device_name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    rows = []
    print(f"{device_name}; medians of {args.rounds} interleaved rounds")
    print(f"{'shape':>12} {'op':<30} {'us':>9} {'GB/s':>8} {'% copy':>7}")
    for m, n in TINY_SHAPES if args.tiny else SHAPES:
        copies = max(2, -(-ROTATE_BYTES // (m * n * 2))) if DEV == "cuda" else 2
        inputs = {"bf16": [torch.randn(m, n, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]}
        inputs["fp8"] = [x.to(E4M3) for x in inputs["bf16"]]
        ops = {name: (fn, bytes_per_element, kind) for name, fn, bytes_per_element, kind in cases(m, n)}
        stats = run_rounds({name: (lambda fn=fn, data=inputs[kind]: median_ms(fn, data, args.iters))
                            for name, (fn, _, kind) in ops.items()}, args.rounds, seed=m + n, on_error="raise")
        copy_gbps = None
        for name, (_, bytes_per_element, _) in ops.items():
            ms = stats[name]["median"]
            gbps = m * n * bytes_per_element / ms / 1e6
            copy_gbps = copy_gbps or gbps  # the first case is the copy
            row = dict(shape=[m, n], op=name, us=ms * 1e3, gb_per_s=gbps, pct_of_copy=100 * gbps / copy_gbps,
                       ms=stats[name])
            rows.append(row)
            print(f"{m:>6}x{n:<5} {name:<30} {row['us']:>9.1f} {gbps:>8.0f} {row['pct_of_copy']:>6.1f}%")
        del inputs
        if DEV == "cuda":
            torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(dict(device=device_name, rounds=args.rounds, iters=args.iters, rows=rows), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
