"""A Llama-1.1B-shaped stack of TransformerLayers trained through the TE-compatible API: ours and Transformer Engine's
(when it is installed) built from the same code, every recipe, timed in interleaved rounds (issues 21 and 22).

The stack (issue 22's measure): token embedding, 16 TransformerLayers (hidden 2048, ffn 8192 SwiGLU, RMSNorm, 32 heads
/ 8 KV groups, no bias, causal), final RMSNorm, untied LM head over vocab 32000 with full FP32 logits and
cross-entropy; batch 4 x sequence 2048 (sbhd); one step = forward + loss + backward + fused AdamW on the BF16
parameters (BF16 moments) + zero_grad(set_to_none=True).

Variants: {ours, te} x {bf16, delayed, current, block} (`--impls`, `--recipes`); every variant's model is built once,
warmed up, then each round times `--steps` steps of every variant in a seeded new order (timing.run_rounds), so the
GPU clock's drift lands on all alike. tokens/s = tokens of the round's steps / the round's wall time between two CUDA
events (the steps run back to back). Peak GiB: torch.cuda.max_memory_allocated during the variant's own warm-up steps
minus what was allocated before its model was built (the other variants' models stay allocated; each variant's
warm-up runs alone, after a reset of the peak counter). Static GiB: the variant's parameters + optimizer state.

Run: python benchmarks/bench_stack.py [--impls ours,te] [--recipes bf16,delayed,current,block] [--rounds 3]
[--json out.json]. `--tiny` (2 small layers, CPU allowed with --device cpu) is a smoke test of the script.
"""
import argparse
import importlib
import json
import sys

import torch

from timing import fmt_spread, run_rounds

RECIPES = ("bf16", "delayed", "current", "block")
FULL = dict(layers=16, hidden=2048, ffn=8192, heads=32, groups=8, vocab=32000, batch=4, seq=2048)
TINY = dict(layers=2, hidden=256, ffn=512, heads=4, groups=2, vocab=512, batch=2, seq=64)


def load_impl(impl: str):
    """-> (the TE-API module namespace, its recipe module) for "ours" (transformer_fp8) or "te" (Transformer
    Engine's PyTorch API); raises ImportError when the package is not installed."""
    if impl == "ours":
        import transformer_fp8 as te
        from transformer_fp8 import recipe
        return te, recipe
    if impl == "te":
        te = importlib.import_module("transformer_engine.pytorch")
        recipe = importlib.import_module("transformer_engine.common.recipe")
        return te, recipe
    raise ValueError(f"impl: expected 'ours' or 'te', got {impl!r}")


def make_recipe(recipe_module, name: str):
    """The recipe object for `name` (None: BF16, fp8_autocast disabled) from either package's recipe module."""
    if name == "bf16":
        return None
    if name == "delayed":
        return recipe_module.DelayedScaling(fp8_format=recipe_module.Format.HYBRID, amax_history_len=16)
    if name == "current":
        return recipe_module.Float8CurrentScaling()
    if name == "block":
        return recipe_module.Float8BlockScaling()
    raise ValueError(f"recipe: expected one of {RECIPES}, got {name!r}")


class LlamaStack(torch.nn.Module):
    """Embedding, `layers` TransformerLayers of the given TE-API namespace, final RMSNorm, untied LM head."""

    def __init__(self, te, layers: int, hidden: int, ffn: int, heads: int, groups: int, vocab: int, device: str):
        super().__init__()
        dt = torch.bfloat16
        self.embed = torch.nn.Embedding(vocab, hidden, device=device, dtype=dt)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(hidden, ffn, heads, num_gqa_groups=groups, hidden_dropout=0.0, attention_dropout=0.0,
                                bias=False, activation="swiglu", normalization="RMSNorm", params_dtype=dt,
                                self_attn_mask_type="causal", device=device) for _ in range(layers))
        self.norm = te.RMSNorm(hidden, params_dtype=dt, device=device)
        self.head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dt)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> the mean next-token cross-entropy (full FP32 logits)."""
        x = self.embed(tokens).transpose(0, 1).contiguous()  # sbhd
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)).float()
        return torch.nn.functional.cross_entropy(logits[:-1].reshape(-1, logits.shape[-1]),
                                                 tokens.t()[1:].reshape(-1))


class Variant:
    """One (impl, recipe): its model, optimizer and step, built and warmed up; `round(steps)` -> tokens/s."""

    def __init__(self, impl: str, recipe_name: str, shape: dict, device: str, warmup: int, seed: int):
        te, recipe_module = load_impl(impl)
        self.te, self.recipe = te, make_recipe(recipe_module, recipe_name)
        self.device, self.tokens_per_step = device, shape["batch"] * shape["seq"]
        cuda = device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        torch.manual_seed(seed)
        dims = {k: shape[k] for k in ("layers", "hidden", "ffn", "heads", "groups", "vocab")}
        self.model = LlamaStack(te, device=device, **dims)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=cuda)
        self.tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup):
            self.loss = self.step().detach()
        if cuda:
            torch.cuda.synchronize()
            self.static_gib = (torch.cuda.memory_allocated() - before) / 2**30
            self.peak_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
        else:
            self.static_gib = self.peak_gib = float("nan")

    def step(self) -> torch.Tensor:
        """One training step; returns the loss (not synchronised)."""
        with self.te.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe):
            loss = self.model(self.tokens)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def round(self, steps: int) -> float:
        """tokens/s over `steps` back-to-back steps (CUDA events; the wall clock on the CPU)."""
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                self.loss = self.step().detach()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) * 1e-3
        else:
            import time
            begin = time.perf_counter()
            for _ in range(steps):
                self.loss = self.step().detach()
            seconds = time.perf_counter() - begin
        return self.tokens_per_step * steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="ours,te", help="comma-separated: ours, te (te skipped if not installed)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated from {RECIPES}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="2 small layers: a smoke test")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_stack.py: no CUDA device (use --tiny --device cpu for a smoke test)")
    shape = TINY if args.tiny else FULL
    recipes = [r for r in args.recipes.split(",") if r]
    for name in recipes:
        if name not in RECIPES:
            sys.exit(f"bench_stack.py: --recipes: expected names from {RECIPES}, got {name!r}")
    variants, skipped = {}, {}
    impls = [i for i in args.impls.split(",") if i]
    for impl in sorted(impls, key=lambda i: i != "te"):  # (TE imported first: it loads its cuDNN libraries itself)
        try:
            load_impl(impl)
        except (ImportError, OSError) as err:
            skipped[impl] = f"not installed or not loadable ({type(err).__name__}: {err})"[:300]
    for impl in impls:
        if impl in skipped:
            continue
        for name in recipes:
            key = f"{impl}/{name}"
            try:
                variants[key] = Variant(impl, name, shape, args.device, args.warmup, args.seed)
            except Exception as err:  # noqa: BLE001  (a recipe one package refuses is reported, the rest go on)
                skipped[key] = f"{type(err).__name__}: {err}"[:300]
    measures = {key: (lambda v=v: v.round(args.steps)) for key, v in variants.items()}
    timed = run_rounds(measures, args.rounds, seed=args.seed)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nLlama-1.1B-shaped stack ({shape}) on {device_name}, tokens/s median [min, max] of {args.rounds} "
          f"interleaved rounds x {args.steps} steps")
    print("| variant | tokens/s | peak GiB | static GiB | loss after warm-up + rounds |\n|---|---|---|---|---|")
    rows = {}
    for key, v in variants.items():
        stats = timed[key]
        rows[key] = {**stats, "peak_gib": round(v.peak_gib, 3), "static_gib": round(v.static_gib, 3),
                     "loss": float(v.loss)}
        speed = stats.get("error") or fmt_spread(stats, 0)
        print(f"| {key} | {speed} | {v.peak_gib:.2f} | {v.static_gib:.2f} | {float(v.loss):.4f} |")
    for key, why in skipped.items():
        print(f"| {key} | skipped: {why} | | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "shape": shape, "rounds": args.rounds, "steps": args.steps,
                       "torch": torch.__version__, "rows": rows, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
