"""Mixture-of-experts benchmarks (issue 23): the grouped FP8 GEMM and an MoE layer, FP8 against BF16.

1. Grouped GEMM TFLOP/s, forward form (out [M, N] = x_g W_gᵀ per group) and weight-gradient form (dW_g = dy_gᵀ x_g),
   uneven group sizes (drawn once, seeded; the wgrad's rounded to multiples of 16, which its kernel needs; --splits
   skewed (default: rand**2 weights, one empty group) or router (a fresh top-k router's counts, close to balanced)):
   - fp8 grouped (op): tfp8.grouped_fp8_gemm / grouped_fp8_gemm_wgrad on grouped_gemm.BACKEND's kernel (auto: ours);
   - fp8 grouped (ours, large / small / alt / wide / solo / ping tiles, own kernel): the ops (grouped_fp8_gemm_sm90,
     _wgrad_sm90) directly, one CUTLASS tile configuration each, or our own forward kernel (tile 7;
     csrc/grouped_gemm.h);
   - fp8 grouped (torch kernel): torch._scaled_grouped_mm (rowwise scales, per-tensor ones expanded);
   - bf16 grouped: torch._grouped_mm on the same shapes;
   - fp8 loop: one tfp8.fp8_gemm (our cuBLASLt dense GEMM) per group, sizes known on the host;
   - fp8 dense: one tfp8.fp8_gemm of the same FLOPs (M x K x N): the target is grouped >= 85% of it;
   - where the time goes (where_the_time_goes): our kernel with equal groups, with one shared weight, as one group;
   - block scaling (recipe.Float8BlockScaling): the block-scaled grouped kernels (ours, and the BF16 fallback)
     against cuBLASLt's block-scaled dense GEMM of the same FLOPs.
2. MoE layer fwd + bwd (transformer_fp8.moe.MoELayer: router, moe_permute, GroupedLinear fc1 / SwiGLU / fc2,
   moe_unpermute): hidden 4096, 8 experts of ffn 14336, top-2, 8192 tokens, BF16 parameters: FP8 (delayed and current
   scaling; group sizes on the device (the grouped kernel, no host sync) or read on the host once per layer (the
   dense per-expert loop)) against the same layer outside fp8_autocast (its high-precision path: one F.linear per
   expert) and a BF16 composition on torch._grouped_mm (no host sync), and under block scaling (device splits).
   Target: FP8 >= 1.4x BF16. Rows that undo one
   of MoELayer's FP8 choices measure what it brings: the permutation without 16-row padding (padded wgrad copies),
   the SwiGLU as its own op (not fused into fc1's backward cast); rows "tiles: ..." run MoELayer with our kernel's
   tile configurations chosen per GEMM form (grouped_gemm.CUTLASS_TILE's dict): the kernel's own choice of session 3
   and single changes to it, beside the current choice (the plain row).
Times: GPU time per call (timing.gpu_time_ms; the GEMM rows' timed loops span >= GEMM_WINDOW_MS), variants interleaved
in rounds (timing.run_rounds): medians.

Usage: python benchmarks/bench_moe.py [--json bench_moe.json] [--rounds 5] [--skip-layer] [--skip-gemm]
       [--gemm-shapes mixtral,64-top2,deepseek-v2-lite] [--gemm-variants PREFIXES] [--layer-variants PREFIXES]
       [--splits skewed|router] [--profile top_kernels.txt]   (PREFIXES: starts of variant names separated by ';')
"""
import argparse
import functools
import json

import torch
import torch.nn.functional as F

from timing import gpu_time_ms, run_rounds
import transformer_fp8 as te
from transformer_fp8 import grouped_gemm
from transformer_fp8.grouped_gemm import group_offsets
from transformer_fp8.ops import tfp8
from transformer_fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

E4M3 = torch.float8_e4m3fn
# (experts, rows M, K, N) of an fc1 (gate | up), M = tokens x top-k: Mixtral-8x7B (8192 tokens, top-2), 64 small
# experts at top-2 (each expert's weights are read for ~256 rows: bound by memory bandwidth on an H100), and
# DeepSeek-V2-Lite's 64 routed experts (hidden 2048, ffn 1408, top-6; 8192 tokens)
GEMM_SHAPES = {"mixtral": (8, 16384, 4096, 28672), "64-top2": (64, 16384, 2048, 1536),
               "deepseek-v2-lite": (64, 49152, 2048, 2816)}
GEMM_WINDOW_MS = 5.0  # (10-call loops of ~80 µs GEMMs had single rounds at 0.3-0.5x: see timing.gpu_time_ms)
LAYER = dict(hidden=4096, ffn=14336, experts=8, top_k=2, tokens=8192)


def uneven_splits(groups: int, rows: int, align: int = 1, seed: int = 0) -> list[int]:
    """Group sizes summing to rows, drawn from a skewed distribution (one group gets none), multiples of align."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(groups, generator=gen) ** 2
    weights[groups // 2] = 0.0
    sizes = (weights / weights.sum() * rows / align).floor().long() * align
    sizes[torch.argmax(weights)] += rows - int(sizes.sum())
    return sizes.tolist()


def router_splits(groups: int, rows: int, align: int = 1, seed: int = 0, top_k: int = 2) -> list[int]:
    """Group sizes summing to rows as a freshly initialised top-k router draws them: rows / top_k tokens, i.i.d.
    normal logits, each token's top_k experts counted (close to balanced: a multinomial spread); multiples of align
    (floored, the remainder to the largest group)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows // top_k, groups, generator=gen)
    counts = torch.bincount(logits.topk(top_k, dim=1).indices.flatten(), minlength=groups)
    sizes = counts * rows // int(counts.sum()) // align * align
    sizes[torch.argmax(counts)] += rows - int(sizes.sum())
    return sizes.tolist()


SPLITS = ("skewed", "router")  # --splits: uneven_splits (the default) or router_splits
ROUTER_TOP_K = {"mixtral": 2, "64-top2": 2, "deepseek-v2-lite": 6}


def fp8(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * 0.5).to(E4M3)


def gemm_measures(groups: int, m: int, k: int, n: int, iters: int, variants: tuple[str, ...] = (),
                  draw=uneven_splits) -> tuple[dict, dict]:
    """({variant: measure() -> TFLOP/s}, info) for one shape; only the variants whose names start with one of
    `variants` when given; group sizes from draw(groups, rows, align)."""
    splits, splits16 = draw(groups, m), draw(groups, m, 16)
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

    ones = {rows: torch.ones(rows, device="cuda") for rows in {n * groups, k * groups}}
    # the wgrad as a 3d x 3d batched GEMM: every group padded to the largest (sizes known on the host)
    rows_max = max(splits16)
    dy3, x3 = fp8(groups, n, rows_max), fp8(groups, k, rows_max)

    def wgrad_bf16_on_fp8():  # (the exact BF16 images of the FP8 operands; the conversions included)
        return torch._grouped_mm(dy_t.to(torch.bfloat16), x_t.to(torch.bfloat16).t(), offs=offs16)

    scale_x, scale_w = torch.ones(m, device="cuda"), torch.ones(groups * n, device="cuda").view(groups, n)

    def ours(tile, fast=True, wgrad=False):
        if wgrad:
            return lambda: tfp8.grouped_fp8_gemm_wgrad_sm90(dy_t, one, x_t, one, offs16, fast, tile)
        return lambda: tfp8.grouped_fp8_gemm_sm90(x, one, w, one, offs, fast, tile)

    fns = {
        "fprop fp8 grouped": lambda: tfp8.grouped_fp8_gemm(x, one, w, one, offs, torch.bfloat16, False),
        "fprop fp8 grouped (torch kernel)": lambda: torch._scaled_grouped_mm(
            x, w.transpose(-2, -1), scale_x, scale_w, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True),
        "fprop fp8 grouped (ours, large tiles)": ours(1),
        "fprop fp8 grouped (ours, small tiles)": ours(2),
        "fprop fp8 grouped (ours, alt tiles)": ours(3),
        "fprop fp8 grouped (ours, wide tiles)": ours(4),
        "fprop fp8 grouped (ours, solo tiles)": ours(5),
        "fprop fp8 grouped (ours, ping tiles)": ours(6),
        "fprop fp8 grouped (ours, own kernel)": ours(7),
        "fprop-shape split accumulator (torch kernel)": lambda: torch._scaled_grouped_mm(
            x, w.transpose(-2, -1), scale_x, scale_w, offs=offs, out_dtype=torch.bfloat16),
        "fprop-shape split accumulator (ours, large tiles)": ours(1, fast=False),
        "fprop-shape split accumulator (ours, small tiles)": ours(2, fast=False),
        "fprop-shape split accumulator (ours, alt tiles)": ours(3, fast=False),
        "fprop-shape split accumulator (ours, wide tiles)": ours(4, fast=False),
        "fprop-shape split accumulator (ours, solo tiles)": ours(5, fast=False),
        "fprop-shape split accumulator (fp8 dense, equal FLOPs)": lambda: tfp8.fp8_gemm(
            x, one, dense_w, one, torch.bfloat16, use_split_accumulator=True),
        "wgrad fp8 grouped (ours, split, large tiles)": ours(1, fast=False, wgrad=True),
        "wgrad fp8 grouped (ours, split, small tiles)": ours(2, fast=False, wgrad=True),
        "wgrad fp8 grouped (ours, split, alt tiles)": ours(3, fast=False, wgrad=True),
        "wgrad fp8 grouped (ours, split, wide tiles)": ours(4, fast=False, wgrad=True),
        "wgrad fp8 grouped (ours, split, solo tiles)": ours(5, fast=False, wgrad=True),
        "wgrad fp8 grouped (ours, fast accumulation, large tiles)": ours(1, fast=True, wgrad=True),
        "wgrad fp8 grouped (ours, fast accumulation, small tiles)": ours(2, fast=True, wgrad=True),
        "wgrad fp8 grouped (ours, fast accumulation, wide tiles)": ours(4, fast=True, wgrad=True),
        "fprop bf16 grouped": lambda: torch._grouped_mm(xb, wb.transpose(-2, -1), offs=offs),
        "fprop fp8 loop of dense": loop,
        "fprop fp8 dense (equal FLOPs)": lambda: tfp8.fp8_gemm(x, one, dense_w, one, torch.bfloat16,
                                                               use_split_accumulator=False),
        "wgrad op (grouped_fp8_gemm_wgrad's choice)": lambda: tfp8.grouped_fp8_gemm_wgrad(dy_t, one, x_t, one, offs16,
                                                                                          torch.bfloat16),
        "wgrad fp8 grouped (torch FP8 kernel, split accumulator)": lambda: torch._scaled_grouped_mm(
            dy_t, x_t.t(), ones[n * groups], ones[k * groups], offs=offs16, out_dtype=torch.bfloat16),
        "wgrad fp8 grouped (torch FP8 kernel, fast accumulation)": lambda: torch._scaled_grouped_mm(
            dy_t, x_t.t(), ones[n * groups], ones[k * groups], offs=offs16, out_dtype=torch.bfloat16,
            use_fast_accum=True),
        "wgrad bf16 kernel on fp8 values (+ conversions)": wgrad_bf16_on_fp8,
        "wgrad fp8 3d batched, groups padded to the largest": lambda: torch._scaled_grouped_mm(
            dy3, x3.transpose(-2, -1), ones[n * groups].view(groups, n), ones[k * groups].view(groups, k),
            out_dtype=torch.bfloat16),
        "wgrad bf16 grouped": lambda: torch._grouped_mm(dy_tb, x_tb.t(), offs=offs16),
        "wgrad fp8 dense (equal FLOPs)": lambda: tfp8.fp8_gemm(dy_t, one, x_t, one, torch.bfloat16),
    }
    fns.update(where_the_time_goes(groups, m, k, n, x, w, one))
    fns.update(block_scaled_fns(groups, m, k, n))
    if variants:
        fns = {name: fn for name, fn in fns.items() if name.startswith(variants)}
    # (wgrad dense: [N, M] x [K, M]ᵀ -> [N, K], contracting over all M rows: the same FLOPs as the grouped wgrad)
    measures = {name: (lambda fn=fn: flops / gpu_time_ms(fn, warmup=3, iters=iters, min_window_ms=GEMM_WINDOW_MS) / 1e9)
                for name, fn in fns.items()}
    return measures, {"groups": groups, "M": m, "K": k, "N": n, "splits": splits, "wgrad_splits": splits16,
                      "wgrad_3d_rows_per_group": rows_max}


def where_the_time_goes(groups: int, m: int, k: int, n: int, x: torch.Tensor, w: torch.Tensor,
                        one: torch.Tensor) -> dict:
    """Forward variants of our kernel (pingpong 128x128, fast accumulation) that remove one cost at a time, to split
    the gap to the dense GEMM: equal groups of m / groups rows (no uneven tiles: whole 128-row tiles when m / groups
    is a multiple of 128), the same equal groups on one shared weight (b's group stride 0: the weights are read from
    memory once, then from L2), and one group of all m rows (the grouped kernel's own speed on a dense problem);
    also the other tiles on the equal groups."""
    equal = group_offsets(torch.full((groups,), m // groups, device="cuda"))
    shared = w[:1].expand(groups, n, k)  # (stride 0 over the groups)
    whole = group_offsets(torch.tensor([m], device="cuda"))
    return {
        "fprop ours small tiles, equal groups": lambda: tfp8.grouped_fp8_gemm_sm90(x, one, w, one, equal, True, 2),
        "fprop ours small tiles, equal groups, one shared weight": lambda: tfp8.grouped_fp8_gemm_sm90(
            x, one, shared, one, equal, True, 2),
        "fprop ours small tiles, one group of all rows": lambda: tfp8.grouped_fp8_gemm_sm90(x, one, w[:1], one, whole,
                                                                                            True, 2),
        "fprop ours large tiles, equal groups": lambda: tfp8.grouped_fp8_gemm_sm90(x, one, w, one, equal, True, 1),
        "fprop ours wide tiles, equal groups": lambda: tfp8.grouped_fp8_gemm_sm90(x, one, w, one, equal, True, 4),
        "fprop ours solo tiles, equal groups": lambda: tfp8.grouped_fp8_gemm_sm90(x, one, w, one, equal, True, 5),
        "fprop ours ping tiles, equal groups": lambda: tfp8.grouped_fp8_gemm_sm90(x, one, w, one, equal, True, 6),
    }


def block_scaled_fns(groups: int, m: int, k: int, n: int) -> dict:
    """recipe.Float8BlockScaling's GEMMs on the same shapes: the block-scaled grouped kernels (ours: 1x128 x 128x128
    forward, 1x128 x 1x128 wgrad on groups padded to 128 rows; the BF16 fallback: dequantize + torch._grouped_mm)
    and cuBLASLt's block-scaled dense GEMM of the same FLOPs."""
    splits = uneven_splits(groups, m)
    splits128 = uneven_splits(groups, m, 128)
    offs, offs128 = (group_offsets(torch.tensor(s, device="cuda")) for s in (splits, splits128))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, sa, _, _ = tfp8.block_cast(x, E4M3, 1, True, False, 0.0, False)
    wq, sw, _, _ = tfp8.block_cast(torch.randn(groups * n, k, device="cuda", dtype=torch.bfloat16), E4M3, 2, True,
                                   False, 0.0, False)
    kb = -(-k // 128)
    b, sb = wq.view(groups, n, k), sw.view(groups, n // 128, -1)[:, :, :kb]
    _, _, dy_t, s_dy = tfp8.block_cast(torch.randn(m, n, device="cuda", dtype=torch.bfloat16), E4M3, 1, False, True,
                                       0.0, False)
    _, _, x_t, s_x = tfp8.block_cast(x, E4M3, 1, False, True, 0.0, False)
    dense_w, dense_sw = wq[:n], sw[:n // 128]

    def fallback():
        grouped_gemm.BACKEND = "torch"
        try:
            return tfp8.grouped_block_fp8_gemm(a, sa, b, sb, offs, torch.bfloat16)
        finally:
            grouped_gemm.BACKEND = "auto"

    return {
        "block fprop fp8 grouped (ours)": lambda: tfp8.grouped_block_fp8_gemm_sm90(a, sa, b, sb, offs),
        "block fprop bf16 fallback (dequantize + torch._grouped_mm)": fallback,
        "block fprop fp8 dense (cuBLASLt, equal FLOPs)": lambda: tfp8.block_fp8_gemm(a, sa, 1, dense_w, dense_sw, 2,
                                                                                     torch.bfloat16),
        "block wgrad fp8 grouped (ours, groups of multiples of 128)": lambda: tfp8.grouped_block_fp8_gemm_wgrad_sm90(
            dy_t, s_dy, x_t, s_x, offs128),
        "block wgrad fp8 dense (cuBLASLt, equal FLOPs)": lambda: tfp8.block_fp8_gemm(dy_t, s_dy, 1, x_t, s_x, 1,
                                                                                     torch.bfloat16),
    }


def wgrad_precision(groups: int, m: int, k: int, n: int, block: int = 256) -> dict:
    """The wgrad kernels' errors against float64 (the FP8 inputs' exact products summed in float64), on the first
    `block` rows of N and K of every group: {variant: (norm-wise relative error, largest error / largest value)}.
    The fast-accumulation / split trade-off of issue 23, on the benchmark's shape and uneven 16-row groups."""
    splits16 = uneven_splits(groups, m, 16)
    offs16 = group_offsets(torch.tensor(splits16, device="cuda"))
    torch.manual_seed(1)
    dy_t, x_t, one = fp8(n, m), fp8(k, m), torch.ones(1, device="cuda")
    ref, start = [], 0
    for size in splits16:
        ref.append(dy_t[:block, start:start + size].double() @ x_t[:block, start:start + size].double().T)
        start += size
    ref = torch.stack(ref)
    ones_n, ones_k = torch.ones(groups * n, device="cuda"), torch.ones(groups * k, device="cuda")
    variants = {
        "ours, split accumulator": lambda: tfp8.grouped_fp8_gemm_wgrad_sm90(dy_t, one, x_t, one, offs16, False, 1),
        "ours, fast accumulation": lambda: tfp8.grouped_fp8_gemm_wgrad_sm90(dy_t, one, x_t, one, offs16, True, 1),
        "torch kernel, split accumulator": lambda: torch._scaled_grouped_mm(
            dy_t, x_t.t(), ones_n, ones_k, offs=offs16, out_dtype=torch.bfloat16),
        "torch kernel, fast accumulation": lambda: torch._scaled_grouped_mm(
            dy_t, x_t.t(), ones_n, ones_k, offs=offs16, out_dtype=torch.bfloat16, use_fast_accum=True),
        "bf16 kernel on fp8 values": lambda: torch._grouped_mm(dy_t.bfloat16(), x_t.bfloat16().t(), offs=offs16),
    }
    errors = {}
    for name, fn in variants.items():
        out = fn()[:, :block, :block].double()
        errors[name] = ((out - ref).norm().item() / ref.norm().item(),
                        (out - ref).abs().max().item() / ref.abs().max().item())
    return errors


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


def variant_moe(layer: torch.nn.Module, host_splits: bool = False, align_size: int = 16,
                fused_swiglu: bool = True):
    """The MoELayer's computation with one of its choices changed: the group sizes read on the host once
    (counts.tolist(): one sync per layer, as Transformer Engine's m_splits lists are; GroupedLinear then runs its dense
    per-expert loop), the permutation without padding (align_size 1: each GroupedLinear's weight gradient goes
    through padded copies of its FP8 input and gradient), or the SwiGLU as its own op between fc1 and fc2 (not in
    fc1's backward cast)."""
    from transformer_fp8.moe.experts import swiglu

    def forward(x):
        logits, probs, indices = layer.router(x)
        rows, row_id_map, counts = te.moe_permute(x, indices, map_type="index", return_tokens_per_expert=True,
                                                  num_experts=layer.num_experts, align_size=align_size)
        splits = counts.tolist() if host_splits else counts
        aligned = align_size % 16 == 0
        if fused_swiglu:
            y = layer.experts(rows, splits, splits_aligned=aligned)
        else:
            hidden = layer.experts.linear_fc1(rows, splits, splits_aligned=aligned)
            y = layer.experts.linear_fc2(swiglu(hidden), splits, splits_aligned=aligned)
        return te.moe_unpermute(y, row_id_map, probs, map_type="index")

    return forward


def make_layer_step(recipe=None, variant: str = "layer", layer: torch.nn.Module | None = None,
                    tiles: dict | None = None):
    """(run(): one fwd + bwd of the benchmark's MoE layer, the layer) for a recipe (None: BF16) and a variant:
    "layer" (MoELayer itself), "host", "host unaligned", "unaligned", "unfused swiglu" (variant_moe), "bf16 grouped"
    (bf16_grouped_moe), "fast wgrad" (MoELayer, the FP8 wgrad kernel with fast accumulation), "torch kernel" (MoELayer
    with grouped_gemm.BACKEND = "torch"); tiles: grouped_gemm.CUTLASS_TILE during the step (None: 0, the kernel's
    choice)."""
    from transformer_fp8.moe import MoELayer

    c = LAYER
    if layer is None:
        layer = MoELayer(c["hidden"], c["ffn"], c["experts"], c["top_k"], params_dtype=torch.bfloat16,
                         device="cuda")
    x = torch.randn(c["tokens"], c["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    fns = {"layer": None, "torch kernel": None, "host": variant_moe(layer, host_splits=True),
           "host unaligned": variant_moe(layer, host_splits=True, align_size=1),
           "unaligned": variant_moe(layer, align_size=1), "unfused swiglu": variant_moe(layer, fused_swiglu=False),
           "bf16 grouped": bf16_grouped_moe(layer)}
    fn = fns.get(variant)
    fast_wgrad = variant == "fast wgrad"  # (MoELayer with grouped_gemm.WGRAD_FAST_ACCUMULATION on)
    backend = "torch" if variant == "torch kernel" else "auto"  # (MoELayer on torch._scaled_grouped_mm)

    def run():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        grouped_gemm.WGRAD_FAST_ACCUMULATION, grouped_gemm.BACKEND = fast_wgrad, backend
        grouped_gemm.CUTLASS_TILE = tiles or 0
        try:
            with te.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                out = layer(x) if fn is None else fn(x)
            out.backward(grad)
        finally:
            grouped_gemm.WGRAD_FAST_ACCUMULATION, grouped_gemm.BACKEND = False, "auto"
            grouped_gemm.CUTLASS_TILE = 0
    return run, layer


# Our kernel's tile choices per (form, fast accumulation), grouped_gemm.CUTLASS_TILE's dict: the choice of
# session 3 (forward pingpong 128x128, dgrad / wgrad cooperative 128x192 c2x1), and single changes to it
TILES_SESSION3 = {("rows", True): 2, ("rows", False): 3, ("contraction", False): 3, ("contraction", True): 1}
TILE_VARIANTS = {
    "session 3's": TILES_SESSION3,
    # the auto choice since session 7 at this layer's groups of 2048 rows (forward solo; ping is auto below 1024)
    "session 8's": {("rows", True): 5, ("rows", False): 4, ("contraction", False): 4, ("contraction", True): 1},
    "forward large": {**TILES_SESSION3, ("rows", True): 1},
    "forward wide": {**TILES_SESSION3, ("rows", True): 4},
    "forward solo": {**TILES_SESSION3, ("rows", True): 5},
    "dgrad wide": {**TILES_SESSION3, ("rows", False): 4},
    "dgrad solo": {**TILES_SESSION3, ("rows", False): 5},
    "wgrad wide": {**TILES_SESSION3, ("contraction", False): 4},
    "forward + dgrad wide": {**TILES_SESSION3, ("rows", True): 4, ("rows", False): 4},
}
LAYER_VARIANTS = {  # name: (recipe, variant of make_layer_step[, tiles])
    "fp8 delayed (device splits: grouped kernel, no sync)": (DelayedScaling, "layer"),
    "fp8 delayed (device splits, torch's grouped kernel)": (DelayedScaling, "torch kernel"),
    "fp8 current (device splits)": (Float8CurrentScaling, "layer"),
    "fp8 block scaling (device splits: block-scaled grouped kernels, no sync)": (Float8BlockScaling, "layer"),
    "fp8 delayed (device splits, unaligned permute: padded wgrad copies)": (DelayedScaling, "unaligned"),
    "fp8 delayed (device splits, SwiGLU as its own op)": (DelayedScaling, "unfused swiglu"),
    "fp8 delayed (device splits, wgrad FP8 fast accumulation)": (DelayedScaling, "fast wgrad"),
    "fp8 delayed (host splits: dense loop, one sync)": (DelayedScaling, "host"),
    "fp8 current (host splits)": (Float8CurrentScaling, "host"),
    "fp8 delayed (host splits, unaligned permute)": (DelayedScaling, "host unaligned"),
    **{f"fp8 delayed (device splits, tiles: {name})": (DelayedScaling, "layer", tiles)
       for name, tiles in TILE_VARIANTS.items()},
    "bf16 (MoELayer, F.linear per expert)": (None, "layer"),
    "bf16 (torch._grouped_mm)": (None, "bf16 grouped"),
}


def layer_measures(iters: int, variants: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """({variant: measure() -> ms per fwd + bwd}, the layer's shape); one layer (same weights) for all; only the
    variants whose names start with one of `variants` when given."""
    torch.manual_seed(0)
    _, layer = make_layer_step()
    measures = {}
    for name, (recipe, variant, *tiles) in LAYER_VARIANTS.items():
        if variants and not name.startswith(variants):
            continue
        run, _ = make_layer_step(recipe and recipe(), variant, layer, *tiles)
        measures[name] = lambda fn=run: gpu_time_ms(fn, warmup=2, iters=iters)
    return measures, dict(LAYER)


def profile_layer(names: list[str], path: str | None, steps: int = 3, top: int = 25) -> str:
    """The top CUDA kernels (self CUDA time) of `steps` fwd + bwd of each named layer variant, as text tables
    (written to `path` too)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    _, layer = make_layer_step()
    text = []
    for name in names:
        recipe, variant, *tiles = LAYER_VARIANTS[name]
        run, _ = make_layer_step(recipe and recipe(), variant, layer, *tiles)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=90)
        text.append(f"### {name}: {steps} steps\n{table}")
    out = "\n".join(text)
    if path:
        with open(path, "w") as f:
            f.write(out)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--gemm-shapes", default=",".join(GEMM_SHAPES),
                        help=f"comma-separated grouped GEMM shapes, from {list(GEMM_SHAPES)}")
    parser.add_argument("--gemm-variants", default="", metavar="PREFIXES",
                        help="name prefixes separated by ';': only the grouped GEMM variants they start (default all)")
    parser.add_argument("--layer-variants", default="", metavar="PREFIXES",
                        help="name prefixes separated by ';': only the MoE layer variants they start (default all)")
    parser.add_argument("--splits", default="skewed", choices=SPLITS,
                        help="the GEMM tables' group sizes: skewed (rand**2 weights, one empty group: the stress "
                             "case) or router (a fresh top-k router's counts: close to balanced)")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="also profile 3 steps of the FP8 delayed layer (device and host splits): top kernels "
                             "printed and written to FILE")
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "splits": args.splits, "gemm": [],
               "layer": None,
               "grouped_backend": "cutlass" if grouped_gemm.use_cutlass(torch.device("cuda")) else "torch"}
    print(f"# {results['gpu']}, torch {results['torch']}, grouped kernel (BACKEND auto): {results['grouped_backend']}")
    shape_names = [] if args.skip_gemm else [name for name in args.gemm_shapes.split(",") if name]
    for name in shape_names:
        if name not in GEMM_SHAPES:
            parser.error(f"--gemm-shapes: expected names from {list(GEMM_SHAPES)}, got {name!r}")
    for shape_name in shape_names:
        draw = uneven_splits if args.splits == "skewed" else functools.partial(
            router_splits, top_k=ROUTER_TOP_K[shape_name])
        measures, info = gemm_measures(*GEMM_SHAPES[shape_name], iters=args.iters,
                                       variants=tuple(p for p in args.gemm_variants.split(";") if p), draw=draw)
        info["shape"] = shape_name
        stats = run_rounds(measures, args.rounds)
        info["tflops"] = stats
        results["gemm"].append(info)
        print(f"\n## grouped GEMM: {info['groups']} experts, M={info['M']} K={info['K']} N={info['N']}, "
              f"{args.splits} splits {info['splits']}\n| variant | TFLOP/s (median) |\n|---|---|")
        for name, s in stats.items():
            print(f"| {name} | {s.get('median', s.get('error'))} |")
        dense = stats.get("fprop fp8 dense (equal FLOPs)", {}).get("median")
        for name in [k for k in stats if k.startswith("fprop fp8 grouped") or k.startswith("fprop ours")]:
            grouped = stats[name].get("median")
            if dense and grouped:
                print(f"{name} / dense: {grouped / dense:.2f}")
        block_dense = stats.get("block fprop fp8 dense (cuBLASLt, equal FLOPs)", {}).get("median")
        block_grouped = stats.get("block fprop fp8 grouped (ours)", {}).get("median")
        if block_dense and block_grouped:
            print(f"block fprop fp8 grouped (ours) / block dense: {block_grouped / block_dense:.2f}")
        if grouped_gemm.use_cutlass(torch.device("cuda")) and not args.gemm_variants:
            info["wgrad_precision"] = wgrad_precision(*GEMM_SHAPES[shape_name])
            print("| wgrad kernel | relative error (norm) | largest error / largest value |\n|---|---|---|")
            for name, (rel, worst) in info["wgrad_precision"].items():
                print(f"| {name} | {rel:.2e} | {worst:.2e} |")
    if not args.skip_layer:
        measures, info = layer_measures(args.iters, tuple(p for p in args.layer_variants.split(";") if p))
        stats = run_rounds(measures, args.rounds)
        info["ms"] = stats
        results["layer"] = info
        print(f"\n## MoE layer fwd+bwd: {LAYER}\n| variant | ms (median) | speedup vs bf16 F.linear | vs bf16 "
              "grouped |\n|---|---|---|---|")
        base = stats.get("bf16 (MoELayer, F.linear per expert)", {}).get("median")
        grouped = stats.get("bf16 (torch._grouped_mm)", {}).get("median")
        for name, s in stats.items():
            ms = s.get("median")
            ratio = lambda b: f"{b / ms:.2f}x" if ms and b else "-"  # noqa: E731
            print(f"| {name} | {ms if ms else s.get('error')} | {ratio(base)} | {ratio(grouped)} |")
    if args.profile:
        print(profile_layer(["fp8 delayed (device splits: grouped kernel, no sync)",
                             "fp8 delayed (host splits: dense loop, one sync)"], args.profile))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
