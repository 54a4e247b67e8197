"""GPU time of the high-precision activation kernels (activation_fwd without an FP8 output, activation_bwd) at the
Llama-shaped stack's MLP shape (bench_stack.py: 8192 tokens x ffn 8192, SwiGLU over a [8192, 16384] FC1 output),
in GB/s of the bytes each call must move. With --fp8: LayerNormMLP's FP8 SwiGLU kernels instead (the forward with and
without the E4M3-kept input, the d(SwiGLU) cast-transpose from the kept input and from the 16-bit input).

The process runs whichever kernels its library takes: the [rows, cols] kernels of csrc/activation_rows.cu, or with
TFP8_ACTIVATION_FLAT=1 in the environment the flat kernels of csrc/activation_elementwise.cu (read once per process).
Compare the two by running the script in both settings one after the other, several times (see --json).

Run: python benchmarks/bench_activation.py [--tokens 8192] [--ffn 8192] [--activations swiglu,gelu]
[--dtypes bfloat16] [--fp8] [--rounds 3] [--json out.json]
"""
import argparse
import json
import os
import statistics
import sys

import torch

from timing import gpu_time_ms
from transformer_fp8.ops import tfp8


def measure(activation: str, dtype: torch.dtype, tokens: int, ffn: int) -> dict:
    """{"fwd_ms", "bwd_ms", "fwd_GBps", "bwd_GBps"} of one activation at [tokens, ffn] outputs (SwiGLU: 2 * ffn
    inputs)."""
    width = 2 * ffn if activation == "swiglu" else ffn
    x = torch.randn(tokens, width, device="cuda", dtype=dtype) * 2
    dy = torch.randn(tokens, ffn, device="cuda", dtype=dtype)
    fwd = gpu_time_ms(lambda: tfp8.activation_fwd(x, activation), warmup=5, iters=50, repeats=5)
    bwd = gpu_time_ms(lambda: tfp8.activation_bwd(dy, x, activation), warmup=5, iters=50, repeats=5)
    size = dtype.itemsize
    fwd_bytes = (x.numel() + dy.numel()) * size  # (reads x, writes y: dy's size)
    bwd_bytes = (2 * x.numel() + dy.numel()) * size  # (reads dy and x, writes dx)
    return {"fwd_ms": round(fwd, 4), "bwd_ms": round(bwd, 4), "fwd_GBps": round(fwd_bytes / fwd / 1e6, 1),
            "bwd_GBps": round(bwd_bytes / bwd / 1e6, 1)}


def measure_fp8_swiglu(tokens: int, ffn: int, rounds: int) -> dict:
    """{kernel: {"us", "GBps", "us_rounds"}} of the FP8 SwiGLU kernels at [tokens, ffn] outputs (a [tokens, 2 * ffn]
    BF16 input), the kernels interleaved over `rounds` rounds, the median reported. Bytes: what each call must read and
    write (the kept input's float32 scale per 128 values included)."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    scale, amax, scale_inv = (torch.ones(1, device="cuda") for _ in range(3))
    x = torch.randn(tokens, 2 * ffn, device="cuda", dtype=torch.bfloat16) * 2
    dy = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
    _, kept, kept_scale_inv = tfp8.activation_fwd_keep_input(x, "swiglu", scale, e4m3, amax, scale_inv)
    n_in, n_out = x.numel(), dy.numel()
    tile_scales = n_in // 128 * 4
    kernels = {
        "fwd_keep_input": (lambda: tfp8.activation_fwd_keep_input(x, "swiglu", scale, e4m3, amax, scale_inv),
                           2 * n_in + n_out + n_in + tile_scales),
        "fwd_fp8": (lambda: tfp8.activation_fwd(x, "swiglu", scale, e4m3, amax, scale_inv), 2 * n_in + n_out),
        "dact_cast_transpose_kept_input": (
            lambda: tfp8.dact_cast_transpose_kept_input(dy, kept, kept_scale_inv, "swiglu", scale, e5m2, amax,
                                                        scale_inv),
            2 * n_out + n_in + tile_scales + 2 * n_in),
        "dact_cast_transpose": (lambda: tfp8.dact_cast_transpose(dy, x, "swiglu", scale, e5m2, amax, scale_inv),
                                2 * n_out + 2 * n_in + 2 * n_in),
    }
    times = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, (fn, _) in kernels.items():
            times[name].append(gpu_time_ms(fn, warmup=3, iters=20, repeats=3) * 1e3)
    rows = {}
    for name, (_, moved) in kernels.items():
        us = statistics.median(times[name])
        rows[name] = {"us": round(us, 1), "GBps": round(moved / us / 1e3, 1), "us_rounds": [round(t, 1) for t in
                                                                                             times[name]]}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--activations", default="swiglu,gelu")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--fp8", action="store_true", help="the FP8 SwiGLU kernels instead (see above)")
    parser.add_argument("--rounds", type=int, default=3, help="--fp8: interleaved rounds (their median is reported)")
    parser.add_argument("--json", default=None, help="append one JSON line with this run's rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_activation.py: needs a CUDA GPU")
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.fp8:
        rows = measure_fp8_swiglu(args.tokens, args.ffn, args.rounds)
        for name, row in rows.items():
            print(f"fp8 swiglu [{args.tokens}, {args.ffn}] {name}: {row['us']} us, {row['GBps']} GB/s")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"device": torch.cuda.get_device_name(), "kernels": "fp8-swiglu",
                                    "tokens": args.tokens, "ffn": args.ffn, "rows": rows}) + "\n")
        return
    kernels = "flat" if os.environ.get("TFP8_ACTIVATION_FLAT") else "rows"
    rows = {}
    for activation in [a for a in args.activations.split(",") if a]:
        for name in [d for d in args.dtypes.split(",") if d]:
            rows[f"{activation}/{name}"] = measure(activation, getattr(torch, name), args.tokens, args.ffn)
            print(f"{kernels} {activation} {name} [{args.tokens}, {args.ffn}]: {rows[f'{activation}/{name}']}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"device": torch.cuda.get_device_name(), "kernels": kernels, "tokens": args.tokens,
                                "ffn": args.ffn, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
