"""Greedy decoding of a 1.1B Llama (TinyLlama's shape, random init): tokens/s and peak memory of ours (convert_model)
in BF16 and with FP8 weights, against Hugging Face transformers in BF16, in one run. Prints a table, writes JSON.

Config: hidden 2048, 22 layers, 32 heads / 4 KV heads, ffn 5632, vocab 32000; prompts of 128 random tokens, 256 new
tokens (no EOS stop), batch 1 and 16.
Variants:
  hf-bf16-dynamic         model.generate(), DynamicCache (transformers' default)
  hf-bf16-static-compile  model.generate(cache_implementation="static"): transformers compiles the decode step
  ours-bf16-dynamic       convert_model(model), model.generate() (our layers keep the DynamicCache)
  ours-fp8-dynamic        convert_model under fp8_model_init (FP8 weights), model.generate() inside fp8_autocast
  ours-bf16-graph         integrations.GreedyDecoder: StaticCache, the decode step one CUDA graph (captured in the
                          first, untimed call; the timed calls reset the cache and replay it)
  ours-fp8-graph          the same with FP8 weights inside fp8_autocast (captured with the step)
  ours-fp8-static-eager   (not run by default) greedy_generate without the CUDA graph
  ours-bf16-static-compile (not run by default) our converted model through generate(cache_implementation="static"),
                          which transformers then compiles as it does its own
Columns: ms per new token and tokens/s (batch x new tokens / wall time of the whole call, prompt included; median of
--repeats calls after one untimed call, which compiles or captures); first call s (its wall time: compilation and
capture included; the same prompts every call); peak GiB = torch.cuda.max_memory_allocated during a timed call
(weights, cache and activations); weights GiB = allocated before it; same tokens = the fraction of generated tokens
equal to hf-bf16-dynamic's at the same batch (random weights have near-tie logits: BF16 roundings may part
sequences, FP8 more so).
--device cpu --tiny runs a tiny config on the CPU, to check the script.
"""
import argparse
import gc
import json
import statistics
import time

import torch

import transformer_fp8 as te
from transformer_fp8 import recipe
from transformer_fp8.integrations import GreedyDecoder, convert_model

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
TINY = dict(LLAMA_1B, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
FP8_RECIPE = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
VARIANTS = ("hf-bf16-dynamic", "hf-bf16-static-compile", "ours-bf16-dynamic", "ours-fp8-dynamic", "ours-bf16-graph",
            "ours-fp8-graph", "ours-fp8-static-eager", "ours-bf16-static-compile")
DEFAULT_VARIANTS = VARIANTS[:6]


def build(variant, config, device, seed):
    """-> generate(input_ids, new_tokens) -> token ids, for the variant's model (the same weights for every
    variant)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16).eval()
    fp8 = "-fp8-" in variant
    if variant.startswith("ours"):
        with te.fp8_model_init(enabled=fp8):
            convert_model(model)
    settings = dict(do_sample=False, pad_token_id=0)
    if variant.endswith("-graph") or variant.endswith("-static-eager"):
        decoders = {}  # one per new-token count: its static cache and graph are reused by the later calls

        def decode(ids, n):
            if n not in decoders:
                decoders[n] = GreedyDecoder(model, n, fp8_enabled=fp8, fp8_recipe=FP8_RECIPE,
                                            cuda_graph=variant.endswith("-graph"))
            return decoders[n](ids)
        return decode
    if variant.endswith("-static-compile"):
        settings["cache_implementation"] = "static"

    def generate(ids, n):
        with te.fp8_autocast(enabled=fp8, fp8_recipe=FP8_RECIPE):
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **settings)
    return generate


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variant, batch, args, config, device):
    generate = build(variant, config, device, args.seed)
    prompts = torch.randint(1, config["vocab_size"], (batch, args.prompt), device=device,
                            generator=torch.Generator(device).manual_seed(args.seed + batch))
    synchronize(device)
    t0 = time.perf_counter()
    tokens = generate(prompts, args.new_tokens)
    synchronize(device)
    first_s = time.perf_counter() - t0
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        tokens = generate(prompts, args.new_tokens)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    row = dict(variant=variant, batch=batch, ms_per_token=round(1000 * seconds / args.new_tokens, 2),
               tokens_per_s=round(batch * args.new_tokens / seconds, 1), first_s=round(first_s, 1),
               peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
               weights_gib=round(weights / 2**30, 2) if device.type == "cuda" else None,
               new_tokens=int(tokens.shape[1] - args.prompt))
    del generate
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, tokens[:, args.prompt:].cpu()


def print_table(rows, title):
    print(f"\n{title}")
    print(f"{'variant':<25}{'batch':>6}{'ms/token':>10}{'tokens/s':>10}{'first s':>9}{'peak GiB':>10}{'weights':>9}"
          f"{'same tokens':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<25}{r['batch']:>6}  {r['error']}")
            continue
        same = "" if r.get("same_tokens") is None else f"{r['same_tokens']:.2f}"
        print(f"{r['variant']:<25}{r['batch']:>6}{r['ms_per_token']:>10}{r['tokens_per_s']:>10,}{r['first_s']:>9}"
              f"{str(r['peak_gib']):>10}{str(r['weights_gib']):>9}{same:>13}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, from {VARIANTS}")
    p.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny config (to check the script, e.g. on the CPU)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; expected some of {VARIANTS}")
    batches = [int(b) for b in args.batches.split(",") if b]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU (or --device cpu --tiny to check the script)")
    config = TINY if args.tiny else LLAMA_1B

    rows, reference = [], {}
    for batch in batches:
        for variant in variants:
            try:
                row, tokens = measure(variant, batch, args, config, device)
                if variant == "hf-bf16-dynamic":
                    reference[batch] = tokens
                if batch in reference and tokens.shape == reference[batch].shape:
                    row["same_tokens"] = round((tokens == reference[batch]).float().mean().item(), 3)
            except Exception as err:  # report and go on with the other rows
                row = dict(variant=variant, batch=batch, error=f"{type(err).__name__}: {err}"[:300])
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_table(rows, f"Llama {'tiny' if args.tiny else '1.1B'} greedy decoding, prompt {args.prompt}, "
                      f"{args.new_tokens} new tokens, {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=config, prompt=args.prompt, new_tokens=args.new_tokens, repeats=args.repeats,
                           device=name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
