"""DotProductAttention's "cudnn" backend (the fused_attn ops, cuDNN graph API) against its "torch" backend (PyTorch's
fused SDPA kernels) on q, k, v that are views of one fused QKV output, as MultiheadAttention makes them, and FP8
attention (fp8_autocast with DelayedScaling(fp8_dpa=True): the fused_attn_fp8 ops, including the casts of q, k, v
and dO, the dequantization of out and dq/dk/dv, and the scaling update at each autocast exit / backward).

Shapes: sbhd, BF16, causal, head dim 128, 32 query heads, MHA (32 kv heads) and GQA (8 kv heads), s in 2048 / 4096.
Times are medians of CUDA-event timed calls: forward alone (no grad) and forward + backward (d(qkv) by autograd, so
the torch backend pays for its copies of the strided views and the three-way dqkv assembly). TFLOP/s counts the
causal forward's 2 * 2 * b * h * s * s * d / 2 FLOPs (backward: 2.5x that).

Usage: python benchmarks/bench_attention.py [--json bench_attention.json] [--iters 20]
"""
import argparse
import json

import torch

from timing import gpu_time_ms
from transformer_fp8 import DotProductAttention, fp8_autocast
from transformer_fp8.module.attention_cudnn import cudnn_attention_built
from transformer_fp8.module.qkv_split import split_qkv
from transformer_fp8.recipe import DelayedScaling

B, H, D = 2, 32, 128
CASES = [(2048, 32), (2048, 8), (4096, 32), (4096, 8)]  # (s, kv heads)


def run(module, qkv, groups):
    q, k, v = split_qkv(qkv, H, groups, D, interleaved=False)
    return module(q, k, v)


def time_backend(backend, s, groups, iters, fp8=False):
    """(forward ms, forward + backward ms) of one backend (fp8: FP8 attention, whatever the backend)."""
    module = DotProductAttention(H, D, num_gqa_groups=groups, attn_mask_type="causal", qkv_format="sbhd",
                                 attention_backend=backend)
    qkv = torch.randn(s, B, (H + 2 * groups) * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(s, B, H * D, device="cuda", dtype=torch.bfloat16)
    recipe = DelayedScaling(fp8_dpa=True)

    def forward():
        with fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            return run(module, qkv, groups)

    with torch.no_grad():
        fwd = gpu_time_ms(forward, iters=iters)
    fwd_bwd = gpu_time_ms(lambda: torch.autograd.grad(forward(), qkv, grad), iters=iters)
    return fwd, fwd_bwd


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_attention.json")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not cudnn_attention_built():
        raise SystemExit("bench_attention.py: the extension was built without the attention family (cudnn-frontend "
                         "headers): the cuDNN columns would time the PyTorch fallback")
    print(torch.cuda.get_device_name())
    print(f"{'s':>5} {'kv heads':>8} {'torch fwd':>10} {'cudnn fwd':>10} {'x':>5} {'torch f+b':>10} {'cudnn f+b':>10} "
          f"{'x':>5} {'cudnn fwd TFLOP/s':>18} {'fp8 fwd':>8} {'fp8 f+b':>8}   (ms)")
    rows = []
    for s, groups in CASES:
        torch_fwd, torch_fb = time_backend("torch", s, groups, args.iters)
        cudnn_fwd, cudnn_fb = time_backend("cudnn", s, groups, args.iters)
        fp8_fwd, fp8_fb = time_backend("cudnn", s, groups, args.iters, fp8=True)
        tflops = 2 * B * H * s * s * D / cudnn_fwd / 1e9  # causal: half of 4 * b * h * s^2 * d
        rows.append(dict(s=s, kv_heads=groups, torch_fwd_ms=torch_fwd, cudnn_fwd_ms=cudnn_fwd,
                         torch_fwd_bwd_ms=torch_fb, cudnn_fwd_bwd_ms=cudnn_fb, cudnn_fwd_tflops=tflops,
                         fp8_fwd_ms=fp8_fwd, fp8_fwd_bwd_ms=fp8_fb))
        print(f"{s:>5} {groups:>8} {torch_fwd:>10.3f} {cudnn_fwd:>10.3f} {torch_fwd / cudnn_fwd:>5.2f} "
              f"{torch_fb:>10.3f} {cudnn_fb:>10.3f} {torch_fb / cudnn_fb:>5.2f} {tflops:>18.0f} {fp8_fwd:>8.3f} "
              f"{fp8_fb:>8.3f}")
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
