"""DotProductAttention's "cudnn" backend (the fused_attn ops, cuDNN graph API) against its "torch" backend (PyTorch's
fused SDPA kernels) on q, k, v that are views of one fused QKV output, as MultiheadAttention makes them, and FP8
attention (fp8_autocast with DelayedScaling(fp8_dpa=True): the fused_attn_fp8 ops, including the casts of q, k, v
and dO, the dequantization of out and dq/dk/dv, and the scaling update at each autocast exit / backward).

Shapes: sbhd, BF16, causal, head dim 128, 32 query heads, MHA (32 kv heads) and GQA (8 kv heads), s in 2048 / 4096.
Times are GPU time per call (CUDA events around 20 calls back to back, timing.gpu_time_ms): forward alone (no grad)
and forward + backward (d(qkv) by autograd, so the torch backend pays for its copies of the strided views and the
three-way dqkv assembly). Per shape the six measurements (3 backends x fwd, fwd+bwd) are taken in turn over --rounds
rounds in a seeded new order each round (timing.run_rounds); medians printed, ranges and every round in the JSON.
TFLOP/s counts the causal forward's 2 * 2 * b * h * s * s * d / 2 FLOPs (backward: 2.5x that).

Usage: python benchmarks/bench_attention.py [--json bench_attention.json] [--iters 20] [--rounds 5]
"""
import argparse
import json

import torch

from timing import gpu_time_ms, run_rounds
from transformer_fp8 import DotProductAttention, fp8_autocast
from transformer_fp8.module.attention_cudnn import cudnn_attention_built
from transformer_fp8.module.qkv_split import split_qkv
from transformer_fp8.recipe import DelayedScaling

B, H, D = 2, 32, 128
CASES = [(2048, 32), (2048, 8), (4096, 32), (4096, 8)]  # (s, kv heads)


def run(module, qkv, groups):
    q, k, v = split_qkv(qkv, H, groups, D, interleaved=False)
    return module(q, k, v)


def backend_measures(backend, s, groups, iters, fp8=False):
    """{"fwd": measure, "fwd_bwd": measure} of one backend (fp8: FP8 attention, whatever the backend); each measure
    returns GPU ms per call."""
    module = DotProductAttention(H, D, num_gqa_groups=groups, attn_mask_type="causal", qkv_format="sbhd",
                                 attention_backend=backend)
    qkv = torch.randn(s, B, (H + 2 * groups) * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(s, B, H * D, device="cuda", dtype=torch.bfloat16)
    recipe = DelayedScaling(fp8_dpa=True)

    def forward():
        with fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            return run(module, qkv, groups)

    def fwd():
        with torch.no_grad():
            return gpu_time_ms(forward, warmup=2, iters=iters)

    return {"fwd": fwd,
            "fwd_bwd": lambda: gpu_time_ms(lambda: torch.autograd.grad(forward(), qkv, grad), warmup=2, iters=iters)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_attention.json")
    parser.add_argument("--iters", type=int, default=20, help="calls back to back per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians reported")
    args = parser.parse_args()
    for flag in ("iters", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: expected at least 1, got {getattr(args, flag)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU")
    if not cudnn_attention_built():
        raise SystemExit("bench_attention.py: the extension was built without the attention family (cudnn-frontend "
                         "headers): the cuDNN columns would time the PyTorch fallback")
    print(torch.cuda.get_device_name())
    print(f"{'s':>5} {'kv heads':>8} {'torch fwd':>10} {'cudnn fwd':>10} {'x':>5} {'torch f+b':>10} {'cudnn f+b':>10} "
          f"{'x':>5} {'cudnn fwd TFLOP/s':>18} {'fp8 fwd':>8} {'fp8 f+b':>8}   (ms)")
    rows = []
    for s, groups in CASES:
        measures = {}
        for name, backend, fp8 in (("torch", "torch", False), ("cudnn", "cudnn", False), ("fp8", "cudnn", True)):
            for part, measure in backend_measures(backend, s, groups, args.iters, fp8).items():
                measures[f"{name}_{part}"] = measure
        stats = run_rounds(measures, args.rounds, seed=s * groups)
        failed = {k: v["error"] for k, v in stats.items() if "error" in v}
        if failed:
            raise SystemExit(f"bench_attention.py: s={s} kv heads={groups}: {failed}")
        ms = {k: v["median"] for k, v in stats.items()}
        tflops = 2 * B * H * s * s * D / ms["cudnn_fwd"] / 1e9  # causal: half of 4 * b * h * s^2 * d
        rows.append(dict(s=s, kv_heads=groups, torch_fwd_ms=ms["torch_fwd"], cudnn_fwd_ms=ms["cudnn_fwd"],
                         torch_fwd_bwd_ms=ms["torch_fwd_bwd"], cudnn_fwd_bwd_ms=ms["cudnn_fwd_bwd"],
                         cudnn_fwd_tflops=tflops, fp8_fwd_ms=ms["fp8_fwd"], fp8_fwd_bwd_ms=ms["fp8_fwd_bwd"],
                         spread_ms=stats))
        print(f"{s:>5} {groups:>8} {ms['torch_fwd']:>10.3f} {ms['cudnn_fwd']:>10.3f} "
              f"{ms['torch_fwd'] / ms['cudnn_fwd']:>5.2f} {ms['torch_fwd_bwd']:>10.3f} {ms['cudnn_fwd_bwd']:>10.3f} "
              f"{ms['torch_fwd_bwd'] / ms['cudnn_fwd_bwd']:>5.2f} {tflops:>18.0f} {ms['fp8_fwd']:>8.3f} "
              f"{ms['fp8_fwd_bwd']:>8.3f}", flush=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rounds=args.rounds, iters=args.iters, rows=rows), f,
                  indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
