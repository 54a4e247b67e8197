"""The performance guide's TransformerLayer, forward + backward, under every recipe: ours and Transformer Engine's
(when it is installed) built from the same TE-API code and timed in interleaved rounds (issue 21 section 2: the guide
layer with Float8BlockScaling vs DelayedScaling vs BF16, TE's rows beside ours).

Layer: TransformerLayer(hidden 4096, ffn 16384, 32 heads), LayerNorm, GELU, bias, no mask, no dropout, BF16
parameters, input [seq 2048, batch 4, 4096] (sbhd), as bench_transformer_layer.py's "guide" config. One step =
zero_grad(set_to_none) + forward under the variant's fp8_autocast + backward of a fixed upstream gradient.
Variants: {ours, te} x {bf16, delayed, current, block} (`--impls`, `--recipes`). Every variant's layer is built and
warmed up first; each round then times `--steps` back-to-back steps of every variant (CUDA events around them) in a
seeded new order (timing.run_rounds): ms per step, median and spread of the rounds. Peak GiB: max_memory_allocated
during the variant's own warm-up, above what was allocated before its layer was built.

Run: python benchmarks/bench_guide_recipes.py [--impls ours,te] [--recipes bf16,delayed,block] [--rounds 5]
[--json out.json]; `--tiny --device cpu` is a smoke test of the script.
"""
import argparse
import json
import sys

import torch

from bench_stack import add_variant_arguments, build_variants, load_impl, make_recipe
from timing import fmt_spread, run_rounds

RECIPES = ("bf16", "delayed", "current", "block")
GUIDE = dict(hidden=4096, ffn=16384, heads=32, seq=2048, batch=4)
TINY = dict(hidden=256, ffn=512, heads=4, seq=32, batch=2)


class GuideVariant:
    """One (impl, recipe): its layer, input and upstream gradient, built and warmed up; `round(steps)` -> ms/step."""

    def __init__(self, impl: str, recipe_name: str, shape: dict, device: str, warmup: int, seed: int):
        te, recipe_module = load_impl(impl)
        self.te, self.recipe, self.device = te, make_recipe(recipe_module, recipe_name), device
        cuda = device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        torch.manual_seed(seed)
        self.layer = te.TransformerLayer(shape["hidden"], shape["ffn"], shape["heads"], hidden_dropout=0.0,
                                         attention_dropout=0.0, self_attn_mask_type="no_mask",
                                         params_dtype=torch.bfloat16, device=device)
        self.x = torch.randn(shape["seq"], shape["batch"], shape["hidden"], device=device, dtype=torch.bfloat16,
                             requires_grad=True)
        self.dy = torch.randn_like(self.x)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup):
            self.step()
        if cuda:
            torch.cuda.synchronize()
            self.peak_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
        else:
            self.peak_gib = float("nan")

    def step(self) -> None:
        """One forward + backward (gradients from None)."""
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None
        with self.te.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe):
            y = self.layer(self.x)
        y.backward(self.dy)

    def round(self, steps: int) -> float:
        """ms per step over `steps` back-to-back steps (CUDA events; the wall clock on the CPU)."""
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                self.step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / steps
        import time
        begin = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - begin) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_arguments(parser, RECIPES, rounds=5, tiny_help="a small layer: a smoke test")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_guide_recipes.py: no CUDA device (use --tiny --device cpu for a smoke test)")
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        sys.exit(f"bench_guide_recipes.py: --recipes: expected names from {RECIPES}, got {unknown}")
    shape = TINY if args.tiny else GUIDE
    impls = [i for i in args.impls.split(",") if i]
    variants, skipped = build_variants(
        impls, recipes, lambda impl, name: GuideVariant(impl, name, shape, args.device, args.warmup, args.seed))
    timings = run_rounds({k: (lambda v=v: v.round(args.steps)) for k, v in variants.items()}, args.rounds,
                         seed=args.seed)
    print(f"Guide TransformerLayer fwd+bwd ({shape}), {args.rounds} interleaved rounds of {args.steps} steps")
    print("| variant | ms per step, median (min-max) | peak GiB |\n|---|---|---|")
    for key, variant in variants.items():
        print(f"| {key} | {fmt_spread(timings[key], 3)} | {variant.peak_gib:.2f} |")
    for key, why in skipped.items():
        print(f"| {key} | skipped: {why} | |")
    if args.json:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        result = {"device": device, "shape": shape, "rounds": args.rounds, "steps": args.steps,
                  "variants": {k: {**timings[k], "peak_gib": round(v.peak_gib, 3)} for k, v in variants.items()},
                  "skipped": skipped}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
