"""Block scaling (recipe.Float8BlockScaling) on the GPU: what cuBLASLt's block-scaled FP8 GEMM takes, its throughput
against our per-tensor FP8 GEMM and BF16 torch.matmul, the block cast's bandwidth, and a Linear / TransformerLayer
step under Float8BlockScaling vs DelayedScaling vs BF16. Prints tables and writes JSON (--json).

GEMM TFLOP/s (2·M·N·K per call): each candidate is a CUDA graph of several calls (about 4 TFLOP), replayed between
CUDA events; candidates are timed in turn, round after round in a seeded new order (timing.run_rounds), and the table
shows the median over the rounds. Block rows: "fprop" = a 1x128 x b 128x128 (activation x weight), "wgrad" = 1x128 x
1x128 (dyᵀ x xᵀ). Per-tensor rows: fp8_gemm with the split accumulator (what block scaling always uses) and with
fast accumulation (our per-tensor forward). Layer steps: forward + backward, gradients from None, timing.gpu_time_ms
(10 steps back to back) per round.
--llama-stack adds issue 21's Llama-1.1B-shaped stack of TransformerLayers (B4xS2048, full logits, fused AdamW):
tokens/s (median over rounds of 10 steps, recipes built and timed one after another) and peak GiB per recipe.
--stack-recipes picks the stack's rows (bf16, delayed, current, block, block-unfused: block scaling with
TFP8_BLOCK_FUSED=0, the norm and activation-gradient casts after their own kernels); --profile prints the top GPU
kernels of two block-scaled stack steps; --gemm-shapes llama1b times the stack's own GEMM shapes instead of the
Llama-8B ones; --stack-casts times the stack's block casts one by one (ms per call, GB/s).
Usage: python benchmarks/bench_block_scaling.py [--json out.json] [--rounds 5] [--skip-gemm] [--skip-layers]
[--llama-stack] [--stack-recipes delayed,block,block-unfused] [--profile] [--gemm-shapes llama1b] [--stack-casts]
"""
import argparse
import json
import os

import torch

import transformer_fp8 as te
from bench_gemm import graph_of, replay_ms
from bench_stack import FULL, LlamaStack
from timing import environment, gpu_time_ms, run_rounds
from transformer_fp8 import recipe

ops = torch.ops.transformer_fp8
E4M3 = torch.float8_e4m3fn
GEMM_SHAPES = {
    "llama8b": [  # (M, K, N): Llama-8B-like layer GEMMs at 8192 tokens
        (8192, 4096, 4096), (8192, 4096, 6144), (8192, 4096, 14336), (8192, 14336, 4096), (8192, 4096, 28672),
        (8192, 8192, 8192)],
    "llama1b": [  # the --llama-stack layer's GEMMs at 8192 tokens: qkv, proj, fc1 (swiglu), fc2
        (8192, 2048, 3072), (8192, 2048, 2048), (8192, 2048, 16384), (8192, 8192, 2048)],
}


def graph_ms(fn, calls):
    """A measure: ms per call of fn over one replay of a CUDA graph of `calls` calls (built on first use)."""
    state = {}

    def measure():
        if "graph" not in state:
            state["graph"] = graph_of(fn, calls)
        return replay_ms(state["graph"], calls)

    return measure


def probe_cublaslt():
    """Which block-scaled GEMMs cuBLASLt runs on this GPU: each combination called once; 'ok' or the error."""
    m, k, n = 256, 512, 384
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    xq, xs, _, _ = ops.block_cast(x, E4M3, 1)
    wq, ws, _, _ = ops.block_cast(w, E4M3, 2)
    w1q, w1s, _, _ = ops.block_cast(w, E4M3, 1)
    x5q, x5s, _, _ = ops.block_cast(x, torch.float8_e5m2, 1)
    cases = {}
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        bias_dtype = torch.float16 if out_dtype == torch.float16 else torch.bfloat16
        bias = torch.randn(n, device="cuda", dtype=bias_dtype)
        cases[f"1x128 x 128x128 -> {out_dtype}"] = lambda o=out_dtype: ops.block_fp8_gemm(xq, xs, 1, wq, ws, 2, o)
        cases[f"1x128 x 128x128 + bias -> {out_dtype}"] = (
            lambda o=out_dtype, b=bias: ops.block_fp8_gemm(xq, xs, 1, wq, ws, 2, o, b))
        cases[f"1x128 x 1x128 -> {out_dtype}"] = lambda o=out_dtype: ops.block_fp8_gemm(xq, xs, 1, w1q, w1s, 1, o)
        cases[f"128x128 x 1x128 -> {out_dtype}"] = lambda o=out_dtype: ops.block_fp8_gemm(wq, ws, 2, xq, xs, 1, o)
    cases["E5M2 1x128 x E4M3 128x128 -> bf16"] = lambda: ops.block_fp8_gemm(x5q, x5s, 1, wq, ws, 2, torch.bfloat16)
    acc = torch.zeros(m, n, device="cuda")
    cases["1x128 x 1x128 accumulate into f32"] = lambda: ops.block_fp8_gemm_accumulate(xq, xs, 1, w1q, w1s, 1, acc)
    cases["1x128 x 128x128, K=200 (padded to 208)"] = lambda: ops.block_fp8_gemm(
        *ops.block_cast(x[:, :200].contiguous(), E4M3, 1)[:2], 1, *ops.block_cast(w[:, :200].contiguous(), E4M3, 2)[:2],
        2, torch.bfloat16)
    results = {}
    for name, call in cases.items():
        try:
            call()
            torch.cuda.synchronize()
            results[name] = "ok"
        except RuntimeError as err:
            results[name] = str(err).splitlines()[0][:200]
    return results


def gemm_table(rounds, shapes="llama8b"):
    rows = []
    for m, k, n in GEMM_SHAPES[shapes]:
        flops = 2.0 * m * n * k
        calls = max(3, min(50, int(4e12 / flops)))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xq, xs, _, _ = ops.block_cast(x, E4M3, 1)
        wq, ws, _, _ = ops.block_cast(w, E4M3, 2)
        w1q, w1s, _, _ = ops.block_cast(w, E4M3, 1)
        sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([0.03], device="cuda")
        pq, pw = (x * 32).to(E4M3), (w * 32 * 8).to(E4M3)
        measures = {
            "block fprop": graph_ms(lambda: ops.block_fp8_gemm(xq, xs, 1, wq, ws, 2, torch.bfloat16), calls),
            "block wgrad": graph_ms(lambda: ops.block_fp8_gemm(xq, xs, 1, w1q, w1s, 1, torch.bfloat16), calls),
            "per-tensor split": graph_ms(lambda: ops.fp8_gemm(pq, sa, pw, sb, torch.bfloat16), calls),
            "per-tensor fast": graph_ms(
                lambda: ops.fp8_gemm(pq, sa, pw, sb, torch.bfloat16, use_split_accumulator=False), calls),
            "bf16 matmul": graph_ms(lambda: torch.matmul(x, w.t()), calls),
        }
        timed = run_rounds(measures, rounds)
        row = {"shape": [m, k, n], "calls_per_graph": calls, "rounds": timed}
        row["tflops"] = {name: flops / (t["median"] * 1e-3) / 1e12 for name, t in timed.items() if "median" in t}
        rows.append(row)
    return rows


def cast_table(rounds):
    rows = []
    for m, k in [(8192, 4096), (8192, 14336)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor([1.0], device="cuda")
        measures = {
            "block 1x128 + own transposed tiles": graph_ms(lambda: ops.block_cast(x, E4M3, 1, True, True), 20),
            "block 128x128 + transposed": graph_ms(lambda: ops.block_cast(x, E4M3, 2, True, True), 20),
            "per-tensor cast_transpose": graph_ms(lambda: ops.cast_transpose(x, scale, E4M3), 20),
        }
        timed = run_rounds(measures, rounds)
        moved = m * k * (2 + 1 + 1)  # read bf16, write two FP8 copies (scales are small)
        rows.append({"shape": [m, k], "rounds": timed,
                     "gb_per_s": {n: moved / (t["median"] * 1e-3) / 1e9 for n, t in timed.items() if "median" in t}})
    return rows


def stack_cast_table(rounds, tokens=8192, hidden=2048, ffn=8192):
    """The Llama-1.1B-shaped stack's block casts at `tokens` tokens, each alone, CUDA-graph replays: ms per call and
    GB/s of the bytes the call must move at least (its inputs read once, its FP8 outputs written; scales not
    counted). Rows: the plain 1x128 cast (+ its transposed tiles) of a norm output and of d(fc1); the 128x128 cast
    (+ transposed) of the fc1 weight; SwiGLU -> 1x128 cast (block_activation_cast); d(SwiGLU) -> 1x128 cast fused
    (dact_block_cast) and unfused (activation_bwd, then block_cast: charged the fused call's bytes, so that the two
    GB/s compare); RMSNorm -> 1x128 cast fused (norm_block_cast) and unfused (rmsnorm_fwd, then block_cast)."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, **bf16)
    fc1_out = torch.randn(tokens, 2 * ffn, **bf16)
    d_act = torch.randn(tokens, ffn, **bf16)
    d_fc1 = torch.randn(tokens, 2 * ffn, **bf16)
    w_fc1 = torch.randn(2 * ffn, hidden, **bf16) * 0.02
    gamma = torch.rand(hidden, **bf16) + 0.5
    cases = {  # name -> (call, bytes moved at least)
        f"1x128 + T, {tokens}x{hidden}": (lambda: ops.block_cast(x, E4M3, 1, True, True), x.numel() * 4),
        f"1x128 + T, {tokens}x{2 * ffn} (d fc1)": (lambda: ops.block_cast(d_fc1, E4M3, 1, True, True),
                                                    d_fc1.numel() * 4),
        f"128x128 + T, {2 * ffn}x{hidden} (fc1 weight)": (lambda: ops.block_cast(w_fc1, E4M3, 2, True, True),
                                                           w_fc1.numel() * 4),
        "SwiGLU -> 1x128 + T (block_activation_cast)": (
            lambda: ops.block_activation_cast(fc1_out, "swiglu", E4M3, True, True), fc1_out.numel() * 3),
        "d(SwiGLU) -> 1x128 + T, fused (dact_block_cast)": (
            lambda: ops.dact_block_cast(d_act, fc1_out, "swiglu", E4M3, True, True),
            d_act.numel() * 2 + fc1_out.numel() * 4),
        "d(SwiGLU) -> 1x128 + T, unfused (activation_bwd + block_cast)": (
            lambda: ops.block_cast(ops.activation_bwd(d_act, fc1_out, "swiglu"), E4M3, 1, True, True),
            d_act.numel() * 2 + fc1_out.numel() * 4),
        "RMSNorm -> 1x128 + T, fused (norm_block_cast)": (
            lambda: ops.norm_block_cast(x, gamma, None, "RMSNorm", 1e-5, False, E4M3, True, True), x.numel() * 4),
        "RMSNorm -> 1x128 + T, unfused (rmsnorm_fwd + block_cast)": (
            lambda: ops.block_cast(ops.rmsnorm_fwd(x, gamma, 1e-5)[0], E4M3, 1, True, True), x.numel() * 4),
    }
    timed = run_rounds({name: graph_ms(call, 10) for name, (call, _) in cases.items()}, rounds)
    return [{"case": name, "ms": t.get("median"), "gb_per_s": moved / (t["median"] * 1e-3) / 1e9 if "median" in t
             else None, "rounds": t} for (name, (_, moved)), t in zip(cases.items(), timed.values())]


def layer_step(module, x, fp8_recipe):
    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        if fp8_recipe is None:
            out = module(x)
        else:
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                out = module(x)
        out.backward(torch.ones_like(out))
    return step


def layer_table(rounds):
    recipes = {"BF16": None, "DelayedScaling": recipe.DelayedScaling(),
               "Float8BlockScaling": recipe.Float8BlockScaling()}
    configs = {
        "Linear 4096->4096, 8192 tokens": (lambda: te.Linear(4096, 4096, params_dtype=torch.bfloat16),
                                           (8192, 4096)),
        "LayerNormMLP 4096->14336 (swiglu), 8192 tokens": (
            lambda: te.LayerNormMLP(4096, 14336, activation="swiglu", normalization="RMSNorm",
                                    params_dtype=torch.bfloat16), (8192, 4096)),
        "TransformerLayer guide (4096, ffn 16384, 32 heads, s2048 b4)": (
            lambda: te.TransformerLayer(4096, 16384, 32, params_dtype=torch.bfloat16), (2048, 4, 4096)),
    }
    rows = []
    for name, (build, shape) in configs.items():
        module = build().cuda()
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        measures = {r: (lambda s=layer_step(module, x, fr): gpu_time_ms(s, warmup=3, iters=10)) for r, fr in
                    recipes.items()}
        rows.append({"config": name, "rounds": run_rounds(measures, rounds)})
        del module, x
        torch.cuda.empty_cache()
    return rows


# The Llama-1.1B-shaped stack (issue 21's measure): bench_stack.py's, built from our package on the GPU.
STACK_SHAPE = dict(device="cuda", **{k: FULL[k] for k in ("layers", "hidden", "ffn", "heads", "groups", "vocab")})


# --stack-recipes name -> (row name, recipe factory, environment while it runs)
STACK_RECIPES = {
    "bf16": ("BF16", lambda: None, {}),
    "delayed": ("DelayedScaling", lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16),
                {}),
    "current": ("Float8CurrentScaling", recipe.Float8CurrentScaling, {}),
    "block": ("Float8BlockScaling (fused norm / dact casts: the default)", recipe.Float8BlockScaling,
              {"TFP8_BLOCK_FUSED": "1"}),
    "block-unfused": ("Float8BlockScaling, unfused norm / dact casts (TFP8_BLOCK_FUSED=0)", recipe.Float8BlockScaling,
                      {"TFP8_BLOCK_FUSED": "0"}),
}


def stack_step(fp8_recipe, batch=4, seq=2048):
    """A fresh LlamaStack and its training step (forward, loss, backward, fused AdamW) under fp8_recipe."""
    torch.manual_seed(0)
    model = LlamaStack(te, **STACK_SHAPE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tokens = torch.randint(0, 32000, (batch, seq), device="cuda")

    def step():
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def llama_stack_table(rounds, steps=10, batch=4, seq=2048, names=tuple(STACK_RECIPES)):
    """tokens/s and peak GiB of a training step (forward, loss, backward, fused AdamW) per recipe."""
    results = {}
    for key in names:
        name, make_recipe, env = STACK_RECIPES[key]
        with environment(env):
            results[name] = stack_row(stack_step(make_recipe(), batch, seq), rounds, steps, batch * seq)
        torch.cuda.empty_cache()
    return results


def stack_row(step, rounds, steps, tokens_per_step):
    """Times `step`: 3 warm-up steps, then rounds of `steps` steps -> tokens/s per round, median, peak GiB, loss."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    per_round = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            loss = step()
        end.record()
        end.synchronize()
        per_round.append(tokens_per_step * steps / (start.elapsed_time(end) * 1e-3))
    return {"tokens_per_s": per_round, "median_tokens_per_s": sorted(per_round)[len(per_round) // 2],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss)}


KERNEL_KINDS = (  # (kind, substrings of a kernel name), first match wins
    ("GEMM", ("gemm", "nvjet", "sm90_xmma", "cutlass", "matmul")),
    ("block cast", ("block_cast_kernel", "row_stats_kernel")),
    ("attention", ("flash", "fmha", "attn", "sdpa", "cudnn")),
    ("norm", ("norm_",)),
    ("activation", ("act", "swiglu", "gelu")),
)


def kernel_kind(name):
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lowered for k in keys)), "other")


def profile_stack(key="block", steps=2, top=25):
    """The GPU kernels of `steps` stack steps under STACK_RECIPES[key] (after 3 warm-up steps): the top kernels by
    GPU time and the time per kind, ms per step."""
    name, make_recipe, env = STACK_RECIPES[key]
    with environment(env):
        step = stack_step(make_recipe())
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        us = event.self_cuda_time_total if us is None else us
        if us > 0:
            kernels.append({"name": event.key, "ms_per_step": us / 1e3 / steps, "calls_per_step": event.count / steps,
                            "kind": kernel_kind(event.key)})
    kernels.sort(key=lambda k: -k["ms_per_step"])
    kinds = {}
    for k in kernels:
        kinds[k["kind"]] = kinds.get(k["kind"], 0.0) + k["ms_per_step"]
    torch.cuda.empty_cache()
    return {"recipe": name, "top": kernels[:top], "ms_per_kind": kinds,
            "total_ms_per_step": sum(k["ms_per_step"] for k in kernels)}


def print_tables(result):
    print("\ncuBLASLt block-scaled GEMM on", result["device"])
    for name, outcome in result["probe"].items():
        print(f"  {name}: {outcome}")
    print("\n| M×K×N | block fprop | block wgrad | per-tensor split | per-tensor fast | BF16 matmul | fprop / fast | "
          "fprop / split |")
    print("|---|---|---|---|---|---|---|---|")
    for row in result["gemm"]:
        t = row["tflops"]
        ratio = lambda a, b: f"{t[a] / t[b]:.3f}" if a in t and b in t else "-"  # noqa: E731
        cells = " | ".join(f"{t[c]:.1f}" if c in t else "error" for c in
                           ("block fprop", "block wgrad", "per-tensor split", "per-tensor fast", "bf16 matmul"))
        print(f"| {'×'.join(map(str, row['shape']))} | {cells} | {ratio('block fprop', 'per-tensor fast')} | "
              f"{ratio('block fprop', 'per-tensor split')} |")
    print("\n| cast (bf16 in, FP8 + transposed FP8 out) | GB/s |")
    print("|---|---|")
    for row in result["cast"]:
        for name, gbs in row["gb_per_s"].items():
            print(f"| {row['shape'][0]}×{row['shape'][1]} {name} | {gbs:.0f} |")
    if result.get("stack_casts"):
        print("\n| stack cast (8192 tokens) | ms per call | GB/s (least bytes) |")
        print("|---|---|---|")
        for row in result["stack_casts"]:
            print(f"| {row['case']} | " + (f"{row['ms']:.4f} | {row['gb_per_s']:.0f} |" if row["ms"] is not None
                                          else f"{row['rounds'].get('error')} | |"))
    if "llama_stack" in result:
        print("\nLlama-1.1B-shaped stack (16 TransformerLayers, B4xS2048, full logits, fused AdamW)")
        print("| recipe | tokens/s (median) | peak GiB | loss |")
        print("|---|---|---|---|")
        for name, r in result["llama_stack"].items():
            print(f"| {name} | {r['median_tokens_per_s']:.0f} | {r['peak_gib']:.2f} | {r['loss']:.4f} |")
    for prof in result.get("profile", []):
        print(f"\nGPU kernels of a stack step, {prof['recipe']}: {prof['total_ms_per_step']:.2f} ms per step; by kind: "
              + ", ".join(f"{k} {ms:.2f}" for k, ms in sorted(prof["ms_per_kind"].items(), key=lambda kv: -kv[1])))
        print("| ms / step | calls / step | kind | kernel |")
        print("|---|---|---|---|")
        for k in prof["top"]:
            print(f"| {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} | {k['kind']} | {k['name'][:110]} |")
    for row in result.get("layers", []):
        print(f"\n{row['config']}: ms per fwd+bwd step (median [min, max] over rounds)")
        for r, t in row["rounds"].items():
            print(f"  {r}: " + (f"{t['median']:.3f} [{t['min']:.3f}, {t['max']:.3f}]" if "median" in t else t["error"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-layers", action="store_true")
    parser.add_argument("--skip-gemm", action="store_true", help="no probe and GEMM table")
    parser.add_argument("--llama-stack", action="store_true", help="also the Llama-1.1B-shaped stack (tokens/s)")
    parser.add_argument("--stack-recipes", default=",".join(STACK_RECIPES),
                        help=f"comma-separated stack rows, of {', '.join(STACK_RECIPES)}")
    parser.add_argument("--profile", action="store_true", help="the top GPU kernels of block-scaled stack steps")
    parser.add_argument("--gemm-shapes", choices=sorted(GEMM_SHAPES), default="llama8b")
    parser.add_argument("--skip-cast", action="store_true", help="no cast table")
    parser.add_argument("--stack-casts", action="store_true",
                        help="also the stack's block casts one by one (ms per call, GB/s): stack_cast_table")
    args = parser.parse_args()
    names = [n for n in args.stack_recipes.split(",") if n]
    unknown = set(names) - set(STACK_RECIPES)
    if unknown:
        parser.error(f"--stack-recipes: unknown {sorted(unknown)}; expected some of {list(STACK_RECIPES)}")
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "probe": {}, "gemm": [],
              "cast": [] if args.skip_cast else cast_table(args.rounds),
              "env": {k: v for k, v in os.environ.items() if k.startswith("TFP8_")}}
    if args.stack_casts:
        result["stack_casts"] = stack_cast_table(args.rounds)
    if not args.skip_gemm:
        result["probe"], result["gemm"] = probe_cublaslt(), gemm_table(args.rounds, args.gemm_shapes)
    if not args.skip_layers:
        result["layers"] = layer_table(args.rounds)
    if args.llama_stack:
        result["llama_stack"] = llama_stack_table(args.rounds, names=names)
    if args.profile:
        result["profile"] = [profile_stack("block")] + ([profile_stack("block-unfused")] if "block-unfused" in names
                                                        else [])
    print_tables(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
