"""GPU time of the high-precision activation kernels (activation_fwd without an FP8 output, activation_bwd) at the
Llama-shaped stack's MLP shape (bench_stack.py: 8192 tokens x ffn 8192, SwiGLU over a [8192, 16384] FC1 output),
in GB/s of the bytes each call must move.

The process runs whichever kernels its library takes: the [rows, cols] kernels of csrc/activation_rows.cu, or with
TFP8_ACTIVATION_FLAT=1 in the environment the flat kernels of csrc/activation_elementwise.cu (read once per process).
Compare the two by running the script in both settings one after the other, several times (see --json).

Run: python benchmarks/bench_activation.py [--tokens 8192] [--ffn 8192] [--activations swiglu,gelu]
[--dtypes bfloat16] [--json out.json]
"""
import argparse
import json
import os
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--activations", default="swiglu,gelu")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--json", default=None, help="append one JSON line with this run's rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_activation.py: needs a CUDA GPU")
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
