"""BF16 vs FP8 training loss of examples/finetune_llama.py at a chosen (small) size: the numerics ablation driver.

Runs the example's own `train` (same model init, data order and optimizer as the example) for each (recipe, seed)
and prints per-run final (mean of the last 10 steps) and held-out losses, and the per-step losses of every run to
--out as JSON. Recipes are names of RECIPE_VARIANTS (the example's three plus ablations). On a machine without CUDA
the FP8 runs go through the CPU reference kernels (emulated FP8).

    python benchmarks/loss_numerics.py --data /tmp/stdlib.jsonl --hidden 256 --layers 4 --seq 256 --batch 8 \
        --steps 200 --runs bf16 delayed block --seeds 0 1
"""
import argparse
import contextlib
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import finetune_llama as ex  # noqa: E402

import transformer_fp8 as te  # noqa: E402

Format = te.recipe.Format
RECIPE_VARIANTS = {  # name -> recipe factory (the example's three, then ablations)
    "delayed": ex.RECIPES["delayed"],
    "current": ex.RECIPES["current"],
    "block": ex.RECIPES["block"],
    "delayed_h1024": lambda: te.recipe.DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024),
    "delayed_e4m3": lambda: te.recipe.DelayedScaling(fp8_format=Format.E4M3, amax_history_len=16),
    "delayed_recent": lambda: te.recipe.DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1,
                                                       amax_compute_algo="most_recent"),
    "current_e4m3": lambda: te.recipe.Float8CurrentScaling(fp8_format=Format.E4M3),
    "block_hybrid": lambda: te.recipe.Float8BlockScaling(fp8_format=Format.HYBRID),
}
# a run "<recipe>+hp_<part>": our FP8 run with that part of every layer on its high-precision path (debug.disable_fp8)
HIGH_PRECISION_PARTS = {"qkv": ("self_attention.layernorm_qkv",), "proj": ("self_attention.proj",),
                        "mlp": ("layernorm_mlp",), "attn": ("self_attention.layernorm_qkv", "self_attention.proj")}
TE_PREFIX = "te_"  # a run "te_<recipe>": the example's model with Transformer Engine's layers (see swap_layers)


def import_te_first(runs):
    """Import Transformer Engine before anything loads cuDNN when a run of `runs` needs it: imported after torch has
    loaded its own cuDNN libraries, TE's loader picked a system libcudnn_cnn whose symbols did not match (H100 image,
    2026-11)."""
    if any(run.startswith(TE_PREFIX) for run in runs):
        try:
            importlib.import_module("transformer_engine.pytorch")
        except ImportError as error:
            print(f"transformer_engine: not importable ({error}); the te_* runs will fail", flush=True)


def te_recipe(te_recipe_module, name):
    """Transformer Engine's recipe object for one of the example's recipe names (the same settings as ours)."""
    fmt = te_recipe_module.Format
    if name == "delayed":
        return te_recipe_module.DelayedScaling(fp8_format=fmt.HYBRID, amax_history_len=16, amax_compute_algo="max")
    if name == "current":
        return te_recipe_module.Float8CurrentScaling(fp8_format=fmt.HYBRID)
    if name == "block":
        return te_recipe_module.Float8BlockScaling()
    raise ValueError(f"recipe: no Transformer Engine counterpart for {name!r}")


def swap_layers(model, te_pkg):
    """Replace the TransformerLayer inside every converted decoder layer (LlamaTransformerLayer.layer) by
    `te_pkg.TransformerLayer` built with the same arguments, holding the same weights (its state dict, FP8 state
    left out). te_pkg: transformer_engine.pytorch (or transformer_fp8 itself, for a test of the swap). Returns the
    number of layers swapped."""
    from transformer_fp8.integrations.llama import LlamaTransformerLayer

    config, count = model.config, 0
    for module in model.modules():
        if not isinstance(module, LlamaTransformerLayer):
            continue
        old, shape = module.layer, module.shape
        weight = old.self_attention.layernorm_qkv.weight
        new = te_pkg.TransformerLayer(
            config.hidden_size, config.intermediate_size, config.num_attention_heads, num_gqa_groups=shape.groups,
            kv_channels=shape.head_dim, layernorm_epsilon=config.rms_norm_eps, hidden_dropout=0.0,
            attention_dropout=0.0, self_attn_mask_type="causal", params_dtype=weight.dtype, fuse_qkv_params=True,
            zero_centered_gamma=False, qkv_weight_interleaved=False, bias=False, activation="swiglu",
            normalization="RMSNorm", device=weight.device, attn_input_format="bshd")
        state = {k: v for k, v in old.state_dict().items() if not k.endswith("_extra_state")}
        missing, unexpected = new.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"swap_layers: missing {missing}, unexpected {unexpected}")
        module.layer = new.train(old.training)
        count += 1
    return count


def keep_parts_high_precision(parts):
    """Make the example's FP8 conversion leave `parts` (keys of HIGH_PRECISION_PARTS) of every decoder layer on the
    high-precision path inside fp8_autocast."""
    from transformer_fp8.debug import disable_fp8
    from transformer_fp8.integrations.llama import LlamaTransformerLayer

    convert = ex.convert_to_fp8

    def convert_then_disable(model, args):
        convert(model, args)
        for layer in (m for m in model.modules() if isinstance(m, LlamaTransformerLayer)):
            for part in parts:
                for path in HIGH_PRECISION_PARTS[part]:
                    disable_fp8(layer.layer.get_submodule(path))

    ex.convert_to_fp8 = convert_then_disable


def check_te_swap(args, model_config, tokenizer, train_tokens, device):
    """Print the BF16 loss of one batch through our layers and through Transformer Engine's (swap_layers): the same
    model, so they must agree to BF16 rounding. Returns True."""
    import copy
    model = ex.build_model(args, model_config, tokenizer.vocab_size, device)
    ex.convert_to_fp8(model, args)
    swapped = copy.deepcopy(model)
    swap_layers(swapped, importlib.import_module("transformer_engine.pytorch"))
    batch = ex.RandomWindows(train_tokens, args.batch_size, args.seq_len, 123).next().to(device)
    with torch.no_grad():
        ours, theirs = ex.training_loss(model, batch, args).item(), ex.training_loss(swapped, batch, args).item()
    print(f"TE swap check (BF16, one batch): ours {ours:.5f}, Transformer Engine's layers {theirs:.5f}", flush=True)
    del model, swapped
    return True


def use_te(te_pkg, te_recipe_module):
    """Make the example's FP8 runs use Transformer Engine: its layers after our conversion, its fp8_autocast."""
    convert = ex.convert_to_fp8

    def convert_then_swap(model, args):
        convert(model, args)
        swap_layers(model, te_pkg)

    def te_context(fp8, recipe="delayed"):
        if not fp8:
            return contextlib.nullcontext()
        return te_pkg.fp8_autocast(enabled=True, fp8_recipe=te_recipe(te_recipe_module, recipe))

    ex.convert_to_fp8, ex.fp8_context = convert_then_swap, te_context
    return convert


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=None, help="intermediate size (default 2.75 x hidden)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=None, help="the example's --warmup-steps (default: its own)")
    p.add_argument("--runs", nargs="+", default=["bf16", "delayed"],
                   help="bf16, converted, or a name of RECIPE_VARIANTS (an FP8 run)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--keep-fc1-fp8", choices=("on", "off"), default="on")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="/tmp/loss_numerics.json")
    return p.parse_args(argv)


def example_args(a, seed, recipe):
    """The example's argparse namespace for one run."""
    argv = ["--data", a.data, "--steps", str(a.steps), "--seq-len", str(a.seq), "--batch-size", str(a.batch),
            "--lr", str(a.lr), "--seed", str(seed), "--sample-tokens", "0", "--keep-fc1-fp8", a.keep_fc1_fp8,
            "--recipe", recipe, "--out", "/tmp/loss_numerics_out"]
    if a.device:
        argv += ["--device", a.device]
    if getattr(a, "warmup_steps", None):
        argv += ["--warmup-steps", str(a.warmup_steps)]
    return ex.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    import_te_first(a.runs)
    if a.threads:
        torch.set_num_threads(a.threads)
    te.set_fp8_min_gemm_size(0)  # (FP8 at every size: the small-GEMM fallback would hide the numerics)
    ex.RECIPES.update(RECIPE_VARIANTS)
    model_config = dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                        num_key_value_heads=a.kv_heads, intermediate_size=a.ffn or (a.hidden * 11 // 4 // 64) * 64)
    tokenizer = ex.ByteTokenizer()
    tokens = ex.tokenize(ex.read_documents(a.data), tokenizer)
    n_eval = min(tokens.numel() // 10, 8 * a.batch * a.seq)
    train_tokens, eval_tokens = tokens[:tokens.numel() - n_eval], tokens[tokens.numel() - n_eval:]
    results = []
    ours = (ex.convert_to_fp8, ex.fp8_context)
    checked_te = False
    for seed in a.seeds:
        for run in a.runs:
            precision = run if run in ("bf16", "converted") else "fp8"
            recipe, *hp_parts = run.split("+hp_")
            recipe = recipe[len(TE_PREFIX):] if recipe.startswith(TE_PREFIX) else recipe
            args = example_args(a, seed, recipe if precision == "fp8" else "delayed")
            device, _, _ = ex.device_and_defaults(args)
            ex.convert_to_fp8, ex.fp8_context = ours
            t0 = time.perf_counter()
            try:
                if run.startswith(TE_PREFIX):
                    if not checked_te:
                        checked_te = check_te_swap(args, model_config, tokenizer, train_tokens, device)
                    use_te(importlib.import_module("transformer_engine.pytorch"),
                           importlib.import_module("transformer_engine.common.recipe"))
                if hp_parts:
                    keep_parts_high_precision(hp_parts)
                s = ex.train(precision, args, model_config, tokenizer, train_tokens, eval_tokens, device)
            except Exception as error:  # (one failed variant must not lose the others' rows)
                print(f"seed {seed} {run}: FAILED {type(error).__name__}: {error}", flush=True)
                continue
            row = {"run": run, "seed": seed, "final_loss": s["final_loss"], "eval_loss": s["eval_loss"],
                   "losses": s["losses"], "seconds": time.perf_counter() - t0,
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
            results.append(row)
            print(f"seed {seed} {run:<16} final {row['final_loss']:.4f} eval {row['eval_loss']:.4f} "
                  f"({row['seconds']:.0f} s)", flush=True)
            Path(a.out).write_text(json.dumps({"config": vars(a), "model": model_config, "results": results}))
    return results


if __name__ == "__main__":
    main()
