"""Host (CPU) time per call of attention at small shapes, where the host's work decides the step time: our
fused_attn_fwd op against aten::_scaled_dot_product_cudnn_attention (the op PyTorch's cuDNN SDPA calls), our
DotProductAttention forward against F.scaled_dot_product_attention (default dispatch, and under
sdpa_kernel(CUDNN_ATTENTION)), and a whole forward + backward of each. All on the same contiguous bhsd tensors
(ours with qkv_format="bhsd", attention_backend="cudnn"), no mask.

Each figure is timing.host_time_us (issue --iters calls without synchronising, divide the wall time); the cases are
measured in turn over --rounds rounds in a seeded new order each round (timing.run_rounds): medians and ranges printed,
every round in the JSON. The device host's speed moves between runs: compare within one run.
Usage: python benchmarks/attention_host_cost.py [--rounds 7] [--iters 300] [--json attention_host_cost.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer_fp8  # noqa: F401  (registers the ops)
from timing import fmt_spread, host_time_us, run_rounds
from transformer_fp8.module.attention import DotProductAttention
from transformer_fp8.module.attention_cudnn import cudnn_attention_built

tfp8 = torch.ops.transformer_fp8
SHAPES = {  # name: (batch, query heads, kv heads, seq, head dim)
    "b1 h2 s128 d128": (1, 2, 2, 128, 128),
    "b2 h8/2 s128 d64": (2, 8, 2, 128, 64),
}


def cases(b, h, g, s, d):
    """{case name: a function of no argument doing one call} at one shape."""
    def leaf(heads):
        return torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = leaf(h), leaf(g), leaf(g)
    dy = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    gqa = g != h
    ours = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="no_mask", qkv_format="bhsd",
                               attention_backend="cudnn")

    def no_grad(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    def fwd_bwd(forward):
        def call():
            forward().backward(dy)
            q.grad = k.grad = v.grad = None  # (no accumulation adds: each step's gradients are fresh)
        return call

    def torch_cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    result = {
        "ours fused_attn_fwd op": no_grad(lambda: tfp8.fused_attn_fwd(q, k, v, scale, False)),
        "ours DotProductAttention fwd": no_grad(lambda: ours(q, k, v)),
        "F.sdpa fwd, default dispatch": no_grad(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)),
        "F.sdpa fwd, sdpa_kernel(CUDNN)": no_grad(torch_cudnn),
        "ours DotProductAttention fwd+bwd": fwd_bwd(lambda: ours(q, k, v)),
        "F.sdpa fwd+bwd, default dispatch": fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)),
        "F.sdpa fwd+bwd, sdpa_kernel(CUDNN)": fwd_bwd(torch_cudnn),
    }
    if not gqa:  # (the aten op takes no GQA: equal head counts only)
        result["aten::_scaled_dot_product_cudnn_attention"] = no_grad(
            lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, scale=scale))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=300, help="calls per measurement")
    parser.add_argument("--json", default="attention_host_cost.json")
    args = parser.parse_args()
    for flag in ("rounds", "iters"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: expected at least 1, got {getattr(args, flag)}")
    if not torch.cuda.is_available():
        raise SystemExit("attention_host_cost.py needs a CUDA GPU")
    if not cudnn_attention_built():
        raise SystemExit("attention_host_cost.py: the extension was built without the attention family (cudnn-frontend "
                         "headers): our rows would time the PyTorch fallback")
    torch.manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}: host µs per call, median (min-max) over {args.rounds} rounds of "
          f"{args.iters} calls")
    for shape, dims in SHAPES.items():
        measures = {name: (lambda fn=fn: host_time_us(fn, iters=args.iters)) for name, fn in cases(*dims).items()}
        stats = run_rounds(measures, args.rounds, seed=sum(dims))
        rows.append(dict(shape=shape, dims=dict(zip(("b", "h", "g", "s", "d"), dims)), us=stats))
        print(f"\n{shape}")
        for name, v in stats.items():
            print(f"  {name:<44} {fmt_spread(v, 1)}")
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rounds=args.rounds,
                       iters=args.iters, rows=rows), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
