"""One TransformerLayer's whole training step with its optimizer: time and peak memory (issue 22, target 3).

The layer of Transformer Engine issue 1119 (hidden 4096, ffn 16384 GELU, 32 heads / 8 GQA groups, kv_channels 128,
LayerNorm, bias, no mask, no dropout; sbhd input seq 1024 x batch 32, BF16 parameters). One step =
zero_grad(set_to_none) + forward + backward(dy) + fused AdamW (BF16 moments, as torch keeps them for BF16 parameters).

Variants: `torch-bf16` (the same pre-LN layer in plain PyTorch: nn.LayerNorm, nn.Linear, SDPA, tanh GELU; the BF16
layer a user already has), {ours, te} x {bf16, delayed} through the TE-compatible API (`te` only where Transformer
Engine is installed).
Each variant is built, warmed up and measured for memory ALONE (the others freed): peak GiB =
torch.cuda.max_memory_allocated during its warm-up steps minus what was allocated before its layer was built
(parameters + gradients + optimizer state + activations + transients; the input and dy are allocated before), of the
first step (delayed scaling has no scale yet: its casts take each tensor's own amax; AdamW's moments are made at its
end, so they do not count in its peak) and of the later ones; the larger is the step's peak. Then all variants are
rebuilt and timed in interleaved rounds (timing.run_rounds: a new seeded order each round): ms per step = CUDA
events around `--steps` steps back to back / steps. Ratios: each row's peak / torch-bf16's (target: ours FP8 <= 0.9x).

Run: python benchmarks/bench_layer_step.py [--impls ours,te] [--recipes bf16,delayed] [--rounds 5] [--json out.json]
`--tiny` (a small layer; `--device cpu` allowed) checks the script.
"""
import argparse
import gc
import json

import torch

from bench_stack import load_impl, make_recipe
from bench_transformer_layer import TorchPreLNLayer
from timing import fmt_spread, run_rounds

FULL = dict(hidden=4096, ffn=16384, heads=32, groups=8, d=128, seq=1024, batch=32)
TINY = dict(hidden=128, ffn=256, heads=4, groups=2, d=32, seq=32, batch=2)
TARGET_PEAK_RATIO = 0.9  # issue 22 target 3: ours FP8 peak <= 0.9x the plain BF16 layer's


class LayerStep:
    """One variant's layer, optimizer and step; `peak_gib` measured during warm-up when built alone."""

    def __init__(self, impl: str, recipe_name: str, shape: dict, x: torch.Tensor, dy: torch.Tensor, warmup: int):
        cuda = x.is_cuda
        if cuda:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        torch.manual_seed(0)
        c = shape
        if impl == "torch":
            self.layer = TorchPreLNLayer(c["hidden"], c["ffn"], c["heads"], c["groups"], c["d"]).to(x.device, x.dtype)
            self.te, self.recipe = None, None
        else:
            self.te, recipe_module = load_impl(impl)
            self.recipe = make_recipe(recipe_module, recipe_name)
            self.layer = self.te.TransformerLayer(c["hidden"], c["ffn"], c["heads"], num_gqa_groups=c["groups"],
                                                  kv_channels=c["d"], hidden_dropout=0.0, attention_dropout=0.0,
                                                  self_attn_mask_type="no_mask", params_dtype=x.dtype,
                                                  device=x.device.type)
        self.optimizer = torch.optim.AdamW(self.layer.parameters(), lr=1e-5, fused=cuda)
        self.x, self.dy, self.before = x, dy, before
        self.static_gib = self.peak_gib = self.first_gib = self.steady_gib = float("nan")
        self.warm_up(warmup)

    def warm_up(self, steps: int) -> None:
        """`steps` steps (at least 2); sets static_gib, first_gib (the peak of the first step: delayed scaling's
        step casts without a known scale), steady_gib (the peak of the later ones) and peak_gib (the
        larger), all above what was allocated before the layer was built."""
        if steps <= 0:
            return
        peaks = []
        for steps_here in (1, max(1, steps - 1)):
            if self.x.is_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            for _ in range(steps_here):
                self.step()
            if self.x.is_cuda:
                torch.cuda.synchronize()
                peaks.append((torch.cuda.max_memory_allocated() - self.before) / 2**30)
        if self.x.is_cuda:
            self.static_gib = (torch.cuda.memory_allocated() - self.before) / 2**30
            self.first_gib, self.steady_gib = peaks
            self.peak_gib = max(peaks)

    def step(self) -> None:
        """zero_grad + forward + backward + optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        self.x.grad = None
        if self.te is None:
            y = self.layer(self.x)
        else:
            with self.te.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe):
                y = self.layer(self.x)
        y.backward(self.dy)
        self.optimizer.step()

    def ms_per_step(self, steps: int) -> float:
        """Milliseconds per step over `steps` steps issued back to back (CUDA events; wall clock on the CPU)."""
        if not self.x.is_cuda:
            import time
            t0 = time.perf_counter()
            for _ in range(steps):
                self.step()
            return (time.perf_counter() - t0) * 1e3 / steps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            self.step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps


def variant_names(impls, recipes):
    names = ["torch-bf16"]
    for impl in impls:
        try:
            load_impl(impl)
        except ImportError as err:
            print(f"skipping {impl}: {err}")
            continue
        names += [f"{impl}-{r}" for r in recipes]
    return names


def build(name, shape, x, dy, warmup):
    impl, recipe_name = name.split("-", 1)
    return LayerStep(impl, recipe_name, shape, x, dy, warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default="ours,te", help="comma-separated, from ours, te (te skipped if not installed)")
    p.add_argument("--recipes", default="bf16,delayed", help="comma-separated, from bf16, delayed, current, block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps per round and variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a small layer (a smoke test of the script)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device (use --device cpu --tiny to check the script)")
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu: only with --tiny (the full layer needs a GPU)")
    shape = TINY if args.tiny else FULL
    names = variant_names([i for i in args.impls.split(",") if i], [r for r in args.recipes.split(",") if r])
    torch.manual_seed(0)
    x = torch.randn(shape["seq"], shape["batch"], shape["hidden"], device=args.device, dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x)
    memory = {}
    for name in names:  # each alone: the others' layers and optimizer states are freed
        variant = build(name, shape, x, dy, args.warmup)
        memory[name] = {k: round(getattr(variant, k), 3) for k in ("peak_gib", "first_gib", "steady_gib",
                                                                    "static_gib")}
        del variant
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    variants = {name: build(name, shape, x, dy, args.warmup) for name in names}
    times = run_rounds({name: (lambda v=v: v.ms_per_step(args.steps)) for name, v in variants.items()}, args.rounds)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    base = memory["torch-bf16"]["peak_gib"]
    print(f"layer step with AdamW on {device}, {shape}, {args.rounds} interleaved rounds x {args.steps} steps")
    print("| variant | ms/step median (range) | peak GiB | first step | later steps | static GiB | peak / torch-bf16 |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for name in names:
        ratio = memory[name]["peak_gib"] / base if base == base and base > 0 else float("nan")
        rows.append(dict(variant=name, ms=times[name], **memory[name], peak_ratio=round(ratio, 3)))
        mem = memory[name]
        print(f"| {name} | {fmt_spread(times[name])} | {mem['peak_gib']:.2f} | {mem['first_gib']:.2f} | "
              f"{mem['steady_gib']:.2f} | {mem['static_gib']:.2f} | {ratio:.3f} |")
    if "ours-delayed" in memory and base == base:
        met = memory["ours-delayed"]["peak_gib"] <= TARGET_PEAK_RATIO * base
        print(f"target: ours FP8 peak <= {TARGET_PEAK_RATIO} x torch-bf16's: {'met' if met else 'not met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, shape=shape, rounds=args.rounds, steps=args.steps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
