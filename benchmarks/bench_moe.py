"""Mixture-of-experts benchmarks (issue 23): the grouped FP8 GEMM and an MoE layer, FP8 against BF16.

1. Grouped GEMM TFLOP/s, forward form (out [M, N] = x_g W_gᵀ per group) and weight-gradient form (dW_g = dy_gᵀ x_g),
   uneven group sizes (drawn once, seeded; the wgrad's rounded to multiples of 16, which its kernel needs):
   - fp8 grouped: tfp8.grouped_fp8_gemm / grouped_fp8_gemm_wgrad (torch._scaled_grouped_mm's CUTLASS kernel);
   - bf16 grouped: torch._grouped_mm on the same shapes;
   - fp8 loop: one tfp8.fp8_gemm (our cuBLASLt dense GEMM) per group, sizes known on the host;
   - fp8 dense: one tfp8.fp8_gemm of the same FLOPs (M x K x N): the target is grouped >= 85% of it.
2. MoE layer fwd + bwd (transformer_fp8.moe.MoELayer: router, moe_permute, GroupedLinear fc1 / SwiGLU / fc2,
   moe_unpermute): hidden 4096, 8 experts of ffn 14336, top-2, 8192 tokens, BF16 parameters: FP8 (delayed and current
   scaling; group sizes on the device (the grouped kernel, no host sync) or read on the host once per layer (the
   dense per-expert loop)) against the same layer outside fp8_autocast (its high-precision path: one F.linear per
   expert) and a BF16 composition on torch._grouped_mm (no host sync). Target: FP8 >= 1.4x BF16.
Times: GPU time per call (timing.gpu_time_ms), variants interleaved in rounds (timing.run_rounds): medians.

Usage: python benchmarks/bench_moe.py [--json bench_moe.json] [--rounds 5] [--skip-layer]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from timing import gpu_time_ms, run_rounds
import transformer_fp8 as te
from transformer_fp8.grouped_gemm import group_offsets
from transformer_fp8.ops import tfp8
from transformer_fp8.recipe import DelayedScaling, Float8CurrentScaling

E4M3 = torch.float8_e4m3fn
# (experts, rows M, K, N): Mixtral-8x7B's fc1 (gate | up) and a 64-expert layer of small experts
GEMM_SHAPES = ((8, 16384, 4096, 28672), (64, 16384, 2048, 1536))
LAYER = dict(hidden=4096, ffn=14336, experts=8, top_k=2, tokens=8192)


def uneven_splits(groups: int, rows: int, align: int = 1, seed: int = 0) -> list[int]:
    """Group sizes summing to rows, drawn from a skewed distribution (one group gets none), multiples of align."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(groups, generator=gen) ** 2
    weights[groups // 2] = 0.0
    sizes = (weights / weights.sum() * rows / align).floor().long() * align
    sizes[torch.argmax(weights)] += rows - int(sizes.sum())
    return sizes.tolist()


def fp8(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * 0.5).to(E4M3)


def gemm_measures(groups: int, m: int, k: int, n: int, iters: int) -> tuple[dict, dict]:
    """({variant: measure() -> TFLOP/s}, info) for one shape."""
    splits, splits16 = uneven_splits(groups, m), uneven_splits(groups, m, 16)
    offs, offs16 = (group_offsets(torch.tensor(s, device="cuda")) for s in (splits, splits16))
    x, w, one = fp8(m, k), fp8(groups, n, k), torch.ones(1, device="cuda")
    xb, wb = x.bfloat16(), w.bfloat16()
    dense_w = fp8(n, k)
    dy_t, x_t = fp8(n, m), fp8(k, m)
    dy_tb, x_tb = dy_t.bfloat16(), x_t.bfloat16()
    flops = 2.0 * m * k * n

    def loop():
        start = 0
        for g, size in enumerate(splits):
            if size:
                tfp8.fp8_gemm(x[start:start + size], one, w[g], one, torch.bfloat16, use_split_accumulator=False)
            start += size

    fns = {
        "fprop fp8 grouped": lambda: tfp8.grouped_fp8_gemm(x, one, w, one, offs, torch.bfloat16, False),
        "fprop bf16 grouped": lambda: torch._grouped_mm(xb, wb.transpose(-2, -1), offs=offs),
        "fprop fp8 loop of dense": loop,
        "fprop fp8 dense (equal FLOPs)": lambda: tfp8.fp8_gemm(x, one, dense_w, one, torch.bfloat16,
                                                               use_split_accumulator=False),
        "wgrad fp8 grouped": lambda: tfp8.grouped_fp8_gemm_wgrad(dy_t, one, x_t, one, offs16, torch.bfloat16),
        "wgrad bf16 grouped": lambda: torch._grouped_mm(dy_tb, x_tb.t(), offs=offs16),
        "wgrad fp8 dense (equal FLOPs)": lambda: tfp8.fp8_gemm(dy_t, one, x_t, one, torch.bfloat16),
    }
    # (wgrad dense: [N, M] x [K, M]ᵀ -> [N, K], contracting over all M rows: the same FLOPs as the grouped wgrad)
    measures = {name: (lambda fn=fn: flops / gpu_time_ms(fn, warmup=3, iters=iters) / 1e9) for name, fn in fns.items()}
    return measures, {"groups": groups, "M": m, "K": k, "N": n, "splits": splits, "wgrad_splits": splits16}


def bf16_grouped_moe(layer: torch.nn.Module):
    """The same MoE computation in BF16 on torch._grouped_mm (differentiable, no host sync): router and permutation
    as MoELayer's, fc1 / SwiGLU / fc2 per group on the layer's own weights."""
    def forward(x):
        logits, probs, indices = layer.router(x)
        rows, row_id_map, counts = te.moe_permute(x, indices, map_type="index", return_tokens_per_expert=True,
                                                  num_experts=layer.num_experts)
        offs = group_offsets(counts)
        w1 = torch.stack(layer.experts.linear_fc1.weights)  # (a copy per call, as the FP8 path's stacked cast)
        w2 = torch.stack(layer.experts.linear_fc2.weights)
        h = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(-2, -1), offs=offs)
        return te.moe_unpermute(y, row_id_map, probs, map_type="index")

    return forward


def host_split_moe(layer: torch.nn.Module):
    """The MoELayer's computation with the group sizes read on the host once (counts.tolist(): one sync per layer, as
    Transformer Engine's m_splits lists are), so that GroupedLinear runs its dense per-expert loop."""
    from transformer_fp8.moe.experts import swiglu

    def forward(x):
        logits, probs, indices = layer.router(x)
        rows, row_id_map, counts = te.moe_permute(x, indices, map_type="index", return_tokens_per_expert=True,
                                                  num_experts=layer.num_experts)
        splits = counts.tolist()
        hidden = layer.experts.linear_fc1(rows, splits)
        y = layer.experts.linear_fc2(swiglu(hidden), splits)
        return te.moe_unpermute(y, row_id_map, probs, map_type="index")

    return forward


def layer_measures(iters: int) -> tuple[dict, dict]:
    from transformer_fp8.moe import MoELayer

    c = LAYER
    torch.manual_seed(0)
    layer = MoELayer(c["hidden"], c["ffn"], c["experts"], c["top_k"], params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(c["tokens"], c["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    bf16_grouped = bf16_grouped_moe(layer)

    host_split = host_split_moe(layer)

    def step(recipe=None, fn=None):
        def run():
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                out = layer(x) if fn is None else fn(x)
            out.backward(grad)
        return run

    fns = {"fp8 delayed (device splits: grouped kernel, no sync)": step(DelayedScaling()),
           "fp8 current (device splits)": step(Float8CurrentScaling()),
           "fp8 delayed (host splits: dense loop, one sync)": step(DelayedScaling(), host_split),
           "fp8 current (host splits)": step(Float8CurrentScaling(), host_split),
           "bf16 (MoELayer, F.linear per expert)": step(), "bf16 (torch._grouped_mm)": step(fn=bf16_grouped)}
    measures = {name: (lambda fn=fn: gpu_time_ms(fn, warmup=2, iters=iters)) for name, fn in fns.items()}
    return measures, dict(c)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--skip-layer", action="store_true")
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm": [], "layer": None}
    print(f"# {results['gpu']}, torch {results['torch']}")
    for shape in GEMM_SHAPES:
        measures, info = gemm_measures(*shape, iters=args.iters)
        stats = run_rounds(measures, args.rounds)
        info["tflops"] = stats
        results["gemm"].append(info)
        print(f"\n## grouped GEMM: {info['groups']} experts, M={info['M']} K={info['K']} N={info['N']}, uneven splits "
              f"{info['splits']}\n| variant | TFLOP/s (median) |\n|---|---|")
        for name, s in stats.items():
            print(f"| {name} | {s.get('median', s.get('error'))} |")
        dense = stats["fprop fp8 dense (equal FLOPs)"].get("median")
        grouped = stats["fprop fp8 grouped"].get("median")
        if dense and grouped:
            print(f"fprop fp8 grouped / dense: {grouped / dense:.2f}")
    if not args.skip_layer:
        measures, info = layer_measures(args.iters)
        stats = run_rounds(measures, args.rounds)
        info["ms"] = stats
        results["layer"] = info
        print(f"\n## MoE layer fwd+bwd: {LAYER}\n| variant | ms (median) | speedup vs bf16 F.linear | vs bf16 "
              "grouped |\n|---|---|---|---|")
        base = stats["bf16 (MoELayer, F.linear per expert)"].get("median")
        grouped = stats["bf16 (torch._grouped_mm)"].get("median")
        for name, s in stats.items():
            ms = s.get("median")
            ratio = lambda b: f"{b / ms:.2f}x" if ms and b else "-"  # noqa: E731
            print(f"| {name} | {ms if ms else s.get('error')} | {ratio(base)} | {ratio(grouped)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
