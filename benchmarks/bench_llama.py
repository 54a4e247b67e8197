"""Full Llama training step (forward, loss, backward, fused AdamW) of a ~1.1B Llama: ours in FP8 (each
LlamaDecoderLayer replaced by our TransformerLayer with convert_llama, fp8_autocast, BF16 parameters) vs Hugging Face
transformers in BF16, eager and torch.compile, in one run. Prints a table (tokens/s, peak GiB, loss) and writes JSON.

Config: vocab 32000, hidden 2048, intermediate 8192, 16 layers, 32 heads / 8 KV heads; batch 4 x seq 2048 of random
tokens; torch.optim.AdamW(fused=True) on the BF16 parameters. Peak GiB is torch.cuda.max_memory_allocated over the
timed steps (parameters, gradients, optimizer state and activations). The first step of each variant (allocations,
cuBLAS/cuDNN setup, compilation for torch.compile) is timed apart as `first_step_s`.
"""
import argparse
import gc
import json
import time

import torch

import transformer_fp8 as te
from transformer_fp8 import recipe
from transformer_fp8.integrations import convert_llama

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5)
FP8_RECIPE = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
VARIANTS = ("ours-fp8", "ours-bf16", "hf-eager", "hf-compile")


def build(variant, seed):
    """-> (model in train mode, BF16 on cuda, the same weights for every variant; forward context factory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B, use_cache=False)).to(torch.bfloat16).train()
    if variant.startswith("ours"):
        convert_llama(model)
    if variant == "hf-compile":
        model = torch.compile(model)
    fp8 = variant == "ours-fp8"
    return model, lambda: te.fp8_autocast(enabled=fp8, fp8_recipe=FP8_RECIPE)


def measure(variant, args):
    model, context = build(variant, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    batches = [torch.randint(0, LLAMA_1B["vocab_size"], (args.batch, args.seq), device="cuda", generator=generator)
               for _ in range(4)]
    losses = []

    def step(i):
        batch = batches[i % len(batches)]
        with context():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(0)
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    row = dict(variant=variant, tokens_per_s=round(args.steps * args.batch * args.seq / elapsed),
               step_ms=round(1000 * elapsed / args.steps, 1),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), first_step_s=round(first_step_s, 1),
               first_loss=round(losses[0].item(), 4), last_loss=round(losses[-1].item(), 4))
    del model, optimizer, batches, losses
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {VARIANTS}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps, the first included")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; expected some of {VARIANTS}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_llama.py needs a CUDA GPU")

    rows = []
    for variant in variants:
        try:
            rows.append(measure(variant, args))
        except Exception as err:  # report and go on with the other variants
            rows.append(dict(variant=variant, error=f"{type(err).__name__}: {err}"[:300]))
            gc.collect()
            torch.cuda.empty_cache()
        print(rows[-1], flush=True)

    print(f"\nLlama 1.1B training step, batch {args.batch} x seq {args.seq}, {torch.cuda.get_device_name()}")
    print(f"{'variant':<12}{'tokens/s':>10}{'step ms':>9}{'peak GiB':>10}{'1st step s':>12}{'loss':>17}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12}  {r['error']}")
        else:
            print(f"{r['variant']:<12}{r['tokens_per_s']:>10,}{r['step_ms']:>9}{r['peak_gib']:>10}"
                  f"{r['first_step_s']:>12}{r['first_loss']:>8} -> {r['last_loss']:<7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=LLAMA_1B, batch=args.batch, seq=args.seq, steps=args.steps,
                           device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
