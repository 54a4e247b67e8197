"""Fused RoPE (ops rope_fwd / rope_bwd through apply_rotary_pos_emb) against the torch-op version it replaced.

Inputs: q [2048, 4, 32, 128] BF16 "sbhd" (64 MiB, larger than L2), contiguous and as a strided view of a fused QKV
output (32 query + 2 * 8 key/value heads); k [2048, 4, 8, 128] as such a view. Angles from RotaryPositionEmbedding.
Times are GPU time per call (timing.gpu_time_ms: CUDA events around --iters calls back to back, median of 5 such
loops): forward alone, and forward + backward (d(input) by torch.autograd.grad).
GB/s counts the fused forward's bytes (read t, write out); "copy" is t.clone() (the same bytes moved, no math).

Usage: python benchmarks/bench_rope.py [--json bench_rope.json] [--iters 50]
"""
import argparse
import json

import torch

from timing import gpu_time_ms
from transformer_fp8.module.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

S, B, H, G, D = 2048, 4, 32, 8, 128


def torch_rope(t, freqs, tensor_format="sbhd"):
    """The torch-op apply_rotary_pos_emb this op replaced: rotate-half with cat, mul and add in float32."""
    seq_len = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    rot_dim = freqs.shape[-1]
    f = freqs[:seq_len].float()
    f = f if tensor_format == "sbhd" else f.transpose(0, 1)
    x = t[..., :rot_dim].float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = (x * f.cos() + torch.cat((-x2, x1), dim=-1) * f.sin()).to(t.dtype)
    return torch.cat((rotated, t[..., rot_dim:]), dim=-1) if rot_dim < t.shape[-1] else rotated


def inputs():
    """(name, t) with t requiring grad through a leaf (autograd.grad stops at t)."""
    q = torch.randn(S, B, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qkv = torch.randn(S, B, (H + 2 * G) * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q_view, k_view, _ = qkv.split([H * D, G * D, G * D], dim=-1)
    return [("q contiguous", q), ("q view of qkv", q_view.unflatten(-1, (H, D))),
            ("k view of qkv", k_view.unflatten(-1, (G, D)))]


def time_pair(rope, t, freqs, grad, iters):
    """(forward ms, forward + backward ms)."""
    with torch.no_grad():
        fwd = gpu_time_ms(lambda: rope(t, freqs), iters=iters, repeats=5)
    fwd_bwd = gpu_time_ms(lambda: torch.autograd.grad(rope(t, freqs), t, grad), iters=iters, repeats=5)
    return fwd, fwd_bwd


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_rope.json")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    freqs = RotaryPositionEmbedding(D, device="cuda")(S)
    rows = []
    print(torch.cuda.get_device_name())
    print(f"{'input':<15} {'shape':<20} {'copy':>7} {'torch fwd':>10} {'fused fwd':>10} {'x':>5} {'torch f+b':>10} "
          f"{'fused f+b':>10} {'x':>5} {'fused GB/s':>10}   (ms)")
    for name, t in inputs():
        grad = torch.randn(t.shape, device="cuda", dtype=t.dtype)
        with torch.no_grad():
            copy = gpu_time_ms(t.clone, iters=args.iters, repeats=5)
        torch_fwd, torch_fb = time_pair(torch_rope, t, freqs, grad, args.iters)
        fused_fwd, fused_fb = time_pair(apply_rotary_pos_emb, t, freqs, grad, args.iters)
        gbps = 2 * t.numel() * t.element_size() / fused_fwd / 1e6
        row = dict(input=name, shape=list(t.shape), copy_ms=copy, torch_fwd_ms=torch_fwd, fused_fwd_ms=fused_fwd,
                   torch_fwd_bwd_ms=torch_fb, fused_fwd_bwd_ms=fused_fb, fused_fwd_gb_per_s=gbps)
        rows.append(row)
        print(f"{name:<15} {str(tuple(t.shape)):<20} {copy:>7.3f} {torch_fwd:>10.3f} {fused_fwd:>10.3f} "
              f"{torch_fwd / fused_fwd:>5.1f} {torch_fb:>10.3f} {fused_fb:>10.3f} {torch_fb / fused_fb:>5.1f} "
              f"{gbps:>10.0f}")
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
