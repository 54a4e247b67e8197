"""Bandwidth of the FP8 cast kernels against a device-to-device copy, on BF16 inputs.

GB/s counts the bytes each op must read and write (BF16 in: 2 B/element, FP8 out: 1 B per output copy); "% copy" is
that rate over `torch.Tensor.copy_`'s (2 + 2 B/element) in the same run. Each op is timed per call with CUDA events
(median over --iters calls after a warm-up), cycling through enough input copies that L2 cannot serve them.

Usage: python benchmarks/bench_quantize.py [--json bench_quantize.json] [--iters 50]
"""
import argparse
import json
import statistics

import torch

import transformer_fp8  # noqa: F401  (registers the ops)

tfp8 = torch.ops.transformer_fp8
SHAPES = [(8192, 8192), (16384, 4096)]
E4M3 = torch.float8_e4m3fn
ROTATE_BYTES = 256 * 2**20  # > 5x the H100's 50 MB L2


def has_cuda_kernel(op):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"transformer_fp8::{op}", "CUDA")


def median_ms(fn, inputs, iters, warmup=5):
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
    scale, amax, scale_inv = (torch.ones(1, device="cuda") for _ in range(3))
    hidden = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    copy_out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
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
    out += [(name, fn, 3, "bf16") for op, name, fn in fused if has_cuda_kernel(op)]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_quantize.json")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}")
    print(f"{'shape':>12} {'op':<30} {'us':>9} {'GB/s':>8} {'% copy':>7}")
    for m, n in SHAPES:
        copies = max(2, -(-ROTATE_BYTES // (m * n * 2)))
        inputs = {"bf16": [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]}
        inputs["fp8"] = [x.to(E4M3) for x in inputs["bf16"]]
        copy_gbps = None
        for name, fn, bytes_per_element, kind in cases(m, n):
            ms = median_ms(fn, inputs[kind], args.iters)
            gbps = m * n * bytes_per_element / ms / 1e6
            copy_gbps = copy_gbps or gbps  # the first case is the copy
            row = dict(shape=[m, n], op=name, us=ms * 1e3, gb_per_s=gbps, pct_of_copy=100 * gbps / copy_gbps)
            rows.append(row)
            print(f"{m:>6}x{n:<5} {name:<30} {row['us']:>9.1f} {gbps:>8.0f} {row['pct_of_copy']:>6.1f}%")
        del inputs
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
