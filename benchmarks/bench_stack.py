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
import collections
import importlib
import json
import re
import sys

import torch

from timing import environment, fmt_spread, run_rounds

RECIPES = ("bf16", "delayed", "current", "block", "bf16-recompute", "block-generic")
# "block-generic" (ours only): Float8BlockScaling with every block cast on the generic kernel (TFP8_BLOCK_WIDE=0 set
# around its steps): the A/B of the wide kernel (csrc/quantize_block_wide.cuh) in interleaved rounds of one process
RECIPE_ENV = {"block-generic": {"TFP8_BLOCK_WIDE": "0"}}
# "bf16-recompute" (ours only): BF16 with the modules' recompute_in_backward on: norm(x) and act(fc1_out) recomputed
# in the backward instead of kept (module/_high_precision.py); "bf16": the modules' defaults (kept, as TE's)
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
    if name in ("bf16", "bf16-recompute"):
        return None
    if name == "delayed":
        return recipe_module.DelayedScaling(fp8_format=recipe_module.Format.HYBRID, amax_history_len=16)
    if name == "current":
        return recipe_module.Float8CurrentScaling()
    if name in ("block", "block-generic"):
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


def _storage_of(t: torch.Tensor):
    """(storage key, bytes) of the memory t keeps alive; FP8 tensor subclasses: their inner tensors' storages."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        parts = [_storage_of(getattr(t, n)) for n in names if isinstance(getattr(t, n), torch.Tensor)]
        return tuple(p[0] for p in parts), sum(p[1] for p in parts)
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # (a tensor subclass without storage: its own elements)
        return ("object", id(t)), t.numel() * t.element_size()
    return (t.device, storage.data_ptr()), storage.nbytes()


def saved_for_backward(model: torch.nn.Module, step_forward) -> dict:
    """What one forward of `model` (run by step_forward(), which returns the loss) saves for the backward through
    autograd (saved_tensors_hooks: save_for_backward of autograd Functions and C++ nodes, not tensors a Function keeps
    on its ctx otherwise), by the innermost module running when it was saved, layer indices folded ("layers.*").
    Tensors sharing a storage count once (the storage's whole size: a view keeps its base alive), under the module
    that saved it first; parameters are left out.

    Args:
        model: the model whose modules the saves are attributed to.
        step_forward: runs the forward and returns the loss.
    Returns:
        {module name: {"MiB": total, "tensors": [[shape, dtype, MiB], ...]}} per forward (over all layers), plus
        "(total)" (MiB) and, on CUDA, "(allocated after forward)" (MiB allocated after the forward above what was
        allocated before it).
    """
    params = {_storage_of(p)[0] for p in model.parameters()}
    names = {m: re.sub(r"\.\d+(\.|$)", r".*\1", n) or "(stack)" for n, m in model.named_modules()}
    running, seen, report = [], set(), {}

    def enter(module, *_):
        running.append(names[module])

    def leave(module, *_):
        running.pop()

    def pack(t):
        key, nbytes = _storage_of(t)
        if key not in seen and key not in params:
            seen.add(key)
            entry = report.setdefault(running[-1] if running else "(outside modules)", {"MiB": 0.0, "tensors": []})
            entry["MiB"] += nbytes / 2**20
            entry["tensors"].append([list(t.shape), str(t.dtype).replace("torch.", ""), round(nbytes / 2**20, 3)])
        return t

    hooks = [m.register_forward_pre_hook(enter) for m in model.modules()]
    hooks += [m.register_forward_hook(leave) for m in model.modules()]
    cuda = next(model.parameters()).is_cuda
    before = torch.cuda.memory_allocated() if cuda else 0
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step_forward()
        if cuda:
            torch.cuda.synchronize()
            report["(allocated after forward)"] = (torch.cuda.memory_allocated() - before) / 2**20
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    report["(total)"] = sum(v["MiB"] for v in report.values() if isinstance(v, dict))
    return report


def print_saved(key: str, report: dict) -> None:
    """One variant's saved_for_backward report as a table (per module: MiB, and the tensors merged by shape)."""
    print(f"\nSaved for backward per forward, {key}: total {report['(total)']:.1f} MiB" +
          (f"; allocated after the forward {report['(allocated after forward)']:.1f} MiB"
           if "(allocated after forward)" in report else ""))
    print("| module | MiB | tensors (shape dtype x count) |\n|---|---|---|")
    for name, entry in report.items():
        if not isinstance(entry, dict):
            continue
        kinds = {}
        for shape, dtype, _ in entry["tensors"]:
            kinds[f"{shape} {dtype}"] = kinds.get(f"{shape} {dtype}", 0) + 1
        print(f"| {name} | {entry['MiB']:.1f} | {', '.join(f'{k} x{n}' for k, n in kinds.items())} |")


def kernel_split(variant, steps: int = 2, top: int = 0) -> dict:
    """GPU kernel time per step of `variant` by category (profile_gaps.category: gemm, attention, norm, activation,
    cast/transpose, optimizer, loss, other) over `steps` profiled steps after its warm-up, with "kernels" (their sum)
    and "step" (the steps' wall time between CUDA events): ms per step. CUDA only.

    Args:
        variant: a built, warmed-up Variant.
        steps: profiled steps.
        top: also list the `top` kernels by GPU time under "top": [kernel name, ms per step, launches per step].
    """
    from torch.profiler import ProfilerActivity, profile

    from profile_gaps import category
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            variant.loss = variant.step().detach()
        end.record()
        end.synchronize()
    split, kernels = collections.Counter(), []
    for avg in prof.key_averages():
        if avg.device_type == torch.autograd.DeviceType.CUDA and avg.self_device_time_total > 0:
            ms = avg.self_device_time_total / 1e3 / steps
            split[category(avg.key)] += ms
            kernels.append([avg.key[:160], round(ms, 3), avg.count / steps])
    result = {k: round(v, 3) for k, v in sorted(split.items())}
    result["kernels"] = round(sum(split.values()), 3)
    result["step"] = round(start.elapsed_time(end) / steps, 3)
    if top:
        result["top"] = sorted(kernels, key=lambda row: -row[1])[:top]
    return result


def print_kernel_splits(splits: dict) -> None:
    """The kernel_split of every variant as one table (ms per step)."""
    columns = sorted({k for split in splits.values() for k in split} - {"kernels", "step", "top"}) + ["kernels", "step"]
    print("\nKernel time per step by category, ms (torch.profiler, one profiled pair of steps per variant)")
    print("| variant | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for key, split in splits.items():
        print(f"| {key} | " + " | ".join(f"{split.get(c, 0.0):.2f}" for c in columns) + " |")
    for key, split in splits.items():
        if split.get("top"):
            print(f"\nTop kernels of {key} (ms per step, launches per step)")
            for name, ms, launches in split["top"]:
                print(f"  {ms:8.3f} {launches:6.1f}  {name[:120]}")


class Variant:
    """One (impl, recipe): its model, optimizer and step, built and warmed up; `round(steps)` -> tokens/s."""

    def __init__(self, impl: str, recipe_name: str, shape: dict, device: str, warmup: int, seed: int):
        te, recipe_module = load_impl(impl)
        self.te, self.recipe = te, make_recipe(recipe_module, recipe_name)
        self.device, self.tokens_per_step = device, shape["batch"] * shape["seq"]
        self.env = RECIPE_ENV.get(recipe_name, {})
        cuda = device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        torch.manual_seed(seed)
        dims = {k: shape[k] for k in ("layers", "hidden", "ffn", "heads", "groups", "vocab")}
        self.model = LlamaStack(te, device=device, **dims)
        if recipe_name == "bf16-recompute":
            modules = [m for m in self.model.modules() if hasattr(m, "recompute_in_backward")]
            if impl != "ours" or not modules:
                raise ValueError("bf16-recompute: a variant of ours only (modules with recompute_in_backward)")
            for m in modules:
                m.recompute_in_backward = True
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

    def forward(self) -> torch.Tensor:
        """The step's forward under the variant's fp8_autocast; returns the loss."""
        with self.te.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe):
            return self.model(self.tokens)

    def step(self) -> torch.Tensor:
        """One training step; returns the loss (not synchronised)."""
        with environment(self.env):
            loss = self.forward()
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


def add_variant_arguments(parser: argparse.ArgumentParser, recipes: tuple, rounds: int, tiny_help: str) -> None:
    """The arguments every {impl} x {recipe} benchmark takes (this script and bench_guide_recipes.py).

    Args:
        parser: where to add them. recipes: the recipe names offered. rounds: --rounds' default.
        tiny_help: what --tiny builds.
    """
    parser.add_argument("--impls", default="ours,te", help="comma-separated: ours, te (te skipped if not installed)")
    parser.add_argument("--recipes", default=",".join(recipes), help=f"comma-separated from {recipes}")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help=tiny_help)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))


def build_variants(impls: list, recipes: list, make) -> tuple:
    """Every (impl, recipe) variant that builds: TE first (it loads its cuDNN libraries itself), a package that does
    not import and a recipe one package refuses reported, not raised.

    Args:
        impls: "ours" / "te". recipes: recipe names. make: make(impl, recipe) -> a built variant.
    Returns:
        ({"impl/recipe": variant}, {impl or "impl/recipe": why it was skipped}).
    """
    variants, skipped = {}, {}
    for impl in sorted(impls, key=lambda i: i != "te"):
        try:
            load_impl(impl)
        except (ImportError, OSError) as err:
            skipped[impl] = f"not installed or not loadable ({type(err).__name__}: {err})"[:300]
    for impl in impls:
        for name in recipes if impl not in skipped else []:
            key = f"{impl}/{name}"
            try:
                variants[key] = make(impl, name)
            except Exception as err:  # noqa: BLE001  (a recipe one package refuses is reported, the rest go on)
                skipped[key] = f"{type(err).__name__}: {err}"[:300]
    return variants, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_arguments(parser, RECIPES, rounds=3, tiny_help="2 small layers: a smoke test")
    parser.add_argument("--saved", action="store_true",
                        help="also report what one forward saves for the backward, by module (saved_for_backward)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile two steps of every variant: kernel time by category (CUDA only)")
    parser.add_argument("--profile-top", type=int, default=0,
                        help="with --profile: also list this many kernels by GPU time per variant")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_stack.py: no CUDA device (use --tiny --device cpu for a smoke test)")
    if args.profile and args.device != "cuda":
        sys.exit("bench_stack.py: --profile needs --device cuda")
    shape = TINY if args.tiny else FULL
    recipes = [r for r in args.recipes.split(",") if r]
    for name in recipes:
        if name not in RECIPES:
            sys.exit(f"bench_stack.py: --recipes: expected names from {RECIPES}, got {name!r}")
    impls = [i for i in args.impls.split(",") if i]
    variants, skipped = build_variants(
        impls, recipes, lambda impl, name: Variant(impl, name, shape, args.device, args.warmup, args.seed))
    saved = {}
    if args.saved:  # (after the warm-up: scaling state calibrated, FP8 weight caches built)
        for key, v in variants.items():
            saved[key] = saved_for_backward(v.model, v.forward)
            v.optimizer.zero_grad(set_to_none=True)
            print_saved(key, saved[key])
    splits = {key: kernel_split(v, top=args.profile_top) for key, v in variants.items()} if args.profile else {}
    if splits:
        print_kernel_splits(splits)
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
                       "torch": torch.__version__, "rows": rows, "skipped": skipped, "saved": saved,
                       "kernel_split_ms": splits}, f, indent=1)


if __name__ == "__main__":
    main()
