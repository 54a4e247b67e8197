"""Per-parameter gradient error of the FP8 recipes against a float32 reference, on the example's converted Llama.

The example's model (examples/finetune_llama.py: random init from --seed, our TransformerLayers) is trained --warm
steps in BF16 (so that the weights are no longer at their init), copied to float32 for the reference gradient, and
for each variant (bf16, or an FP8 recipe of loss_numerics.RECIPE_VARIANTS) the gradient of one held batch is
compared with the reference, per parameter: relative error ||g - g_ref|| / ||g_ref|| and the projection
<g, g_ref> / ||g_ref||^2 (1: unbiased in the reference's direction; below 1: the gradient is shrunk). Delayed
recipes first run --calib forward/backward passes on the batch (no optimizer step) so that their scales are those of
this batch. Prints one row per parameter kind (mean over layers) and per variant.

    python benchmarks/loss_grad_error.py --data /tmp/stdlib.jsonl --variants bf16 delayed block current
"""
import argparse
import contextlib
import copy
import importlib
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loss_numerics as ln  # noqa: E402

ex, te = ln.ex, ln.te


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=None, help="intermediate size (default 2.75 x hidden)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warm", type=int, default=30, help="BF16 training steps before the measurement")
    p.add_argument("--calib", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=None, help="the example's --warmup-steps (default: its own)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-fc1-fp8", choices=("on", "off"), default="on")
    p.add_argument("--variants", nargs="+", default=["bf16", "delayed", "block", "current"])
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="write the rows here")
    return p.parse_args(argv)


def kind(name):
    """A parameter name without its layer index (model.layers.3.layer.x -> layers.layer.x)."""
    return ".".join(part for part in name.split(".") if not part.isdigit())


def gradients(model, batch, recipe, calib, args):
    """{name: float32 gradient} of the example's loss on `batch` (recipe None: no fp8_autocast)."""
    passes = calib + 1 if recipe is not None else 1
    for _ in range(passes):
        model.zero_grad(set_to_none=True)
        if recipe is None:
            ctx = contextlib.nullcontext()
        elif recipe.startswith(ln.TE_PREFIX):
            te_pkg = importlib.import_module("transformer_engine.pytorch")
            te_recipe = ln.te_recipe(importlib.import_module("transformer_engine.common.recipe"),
                                     recipe[len(ln.TE_PREFIX):])
            ctx = te_pkg.fp8_autocast(enabled=True, fp8_recipe=te_recipe)
        else:
            ctx = te.fp8_autocast(enabled=True, fp8_recipe=ln.RECIPE_VARIANTS[recipe]())
        with ctx:
            loss = ex.training_loss(model, batch, args)
        loss.backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def main(argv=None):
    a = parse(argv)
    te.set_fp8_min_gemm_size(0)
    ln.import_te_first(a.variants)
    eargs = ln.example_args(argparse.Namespace(data=a.data, steps=a.warm, seq=a.seq, batch=a.batch, lr=a.lr,
                                               keep_fc1_fp8=a.keep_fc1_fp8, device=a.device,
                                               warmup_steps=a.warmup_steps), a.seed, "delayed")
    device, _, _ = ex.device_and_defaults(eargs)
    model_config = dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                        num_key_value_heads=a.kv_heads, intermediate_size=a.ffn or (a.hidden * 11 // 4 // 64) * 64)
    tokenizer = ex.ByteTokenizer()
    tokens = ex.tokenize(ex.read_documents(a.data), tokenizer)
    model = ex.build_model(eargs, model_config, tokenizer.vocab_size, device)
    ex.convert_to_fp8(model, eargs)
    optimizer = ex.MasterWeightAdamW(model.parameters(), lr=a.lr)
    batches = ex.RandomWindows(tokens, a.batch, a.seq, a.seed)
    for step in range(a.warm):
        optimizer.set_lr(ex.lr_at(step, eargs))
        ex.training_loss(model, batches.next().to(device), eargs).backward()
        optimizer.step(1.0)
        optimizer.zero_grad()
    batch = batches.next().to(device)
    reference = copy.deepcopy(model).float()
    ref = gradients(reference, batch, None, 0, eargs)
    del reference
    rows = {}
    for variant in a.variants:
        m = copy.deepcopy(model)
        try:
            if variant.startswith(ln.TE_PREFIX):
                ln.swap_layers(m, importlib.import_module("transformer_engine.pytorch"))
            grads = gradients(m, batch, None if variant == "bf16" else variant, a.calib, eargs)
        except Exception as error:  # (one failed variant must not lose the others' rows)
            print(f"{variant}: FAILED {type(error).__name__}: {error}", flush=True)
            continue
        per_kind = defaultdict(list)
        for name, g_ref in ref.items():
            g = grads[name]
            err = ((g - g_ref).norm() / g_ref.norm()).item()
            proj = ((g * g_ref).sum() / (g_ref * g_ref).sum()).item()
            per_kind[kind(name)].append((err, proj))
        rows[variant] = {k: tuple(sum(v[i] for v in vals) / len(vals) for i in range(2))
                         for k, vals in per_kind.items()}
        del m
    done = list(rows)
    print(f"{'parameter':<58}" + "".join(f"{v:>22}" for v in done))
    for k in rows[done[0]]:
        print(f"{k:<58}" + "".join(f"{rows[v][k][0]:>12.4f} ({rows[v][k][1]:.3f})" for v in done))
    if a.json:
        Path(a.json).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
