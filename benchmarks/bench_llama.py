"""Full Llama training step (forward, loss, backward, fused AdamW) of a ~1.1B Llama: ours in FP8 (each
LlamaDecoderLayer replaced by our TransformerLayer with convert_llama, fp8_autocast, BF16 parameters) vs Hugging Face
transformers in BF16, eager and torch.compile, in one run. Prints a table (tokens/s, memory, loss) and writes JSON.

Config: vocab 32000 (untied head), hidden 2048, intermediate 8192, 16 layers, 32 heads / 8 KV heads; batch 4 x seq
2048 of random tokens; torch.optim.AdamW(fused=True) on the BF16 parameters for every variant (BF16 moments).
Variants:
  ours-fp8 / ours-bf16  convert_llama, loss by causal_lm_loss (chunked LM head + cross-entropy: no [8192, 32000]
                        logits); inside / outside fp8_autocast
  hf-eager              model(input_ids, labels=input_ids).loss
  hf-compile            regional compilation: each decoder layer, the final norm and the loss function compiled
                        (torch.compile, default mode); the causal-mask builder stays eager, so SDPA gets is_causal=True
                        and native GQA, as in eager
  ours-fp8-checkpointed / hf-eager-checkpointed  (not run by default) ours-fp8 and hf-eager with each decoder layer's
                        activations recomputed in the backward (integrations.gradient_checkpointing_enable)
  hf-compile-model      torch.compile(model) (not run by default): with torch < 2.14 transformers then materialises the
                        [b, 1, s, s] causal mask while tracing (it cannot tell compiling from exporting), so SDPA runs
                        with an explicit mask (no flash/cuDNN causal kernel) and K/V repeated to all heads
Columns: tokens/s and ms over the timed steps; peak GiB = torch.cuda.max_memory_allocated over them; static GiB =
allocated before a step (parameters + optimizer state; gradients are set to None); act GiB = allocated at the end of a
forward minus before it (what the forward keeps for the backward, and the loss's gradients for ours); the first step
(allocations, cuBLAS/cuDNN setup, compilation) is timed apart as `first_step_s`. `phase_ms`: GPU-timeline ms of the
forward (with the loss), backward, optimizer step and the gap to the next step (CUDA events; a phase longer than its
kernels is host-bound). --profile adds, per variant, the kernel time of each phase in one step and the operators with
the most GPU time (grouped by input shapes).
"""
import argparse
import gc
import json
import time

import torch

import transformer_fp8 as te
from transformer_fp8 import recipe
from transformer_fp8.integrations import causal_lm_loss, convert_llama, gradient_checkpointing_enable
from transformer_fp8.module.attention import DotProductAttention

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
FP8_RECIPE = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
VARIANTS = ("ours-fp8", "ours-bf16", "hf-eager", "hf-compile", "hf-compile-model", "ours-fp8-torch-sdpa",
            "ours-fp8-checkpointed", "hf-eager-checkpointed")
DEFAULT_VARIANTS = VARIANTS[:4]
PROFILE_ROWS = 30
PHASES = ("forward", "backward", "optimizer", "between")


def build(variant, seed):
    """-> (model in train mode, BF16 on cuda, the same weights for every variant; loss(input_ids) for one step)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B, use_cache=False)).to(torch.bfloat16).train()
    if variant.startswith("ours"):
        convert_llama(model)
    if variant.endswith("-checkpointed"):  # (ours recompute through te.checkpoint)
        gradient_checkpointing_enable(model)
    if variant.startswith("ours"):
        fp8 = variant.startswith("ours-fp8")
        if variant == "ours-fp8-torch-sdpa":  # attention on PyTorch's SDPA instead of our cuDNN graph ops
            for module in model.modules():
                if isinstance(module, DotProductAttention):
                    module.attention_backend = "torch"

        def loss(ids):
            with te.fp8_autocast(enabled=fp8, fp8_recipe=FP8_RECIPE):
                return causal_lm_loss(model, ids)
        return model, loss
    if variant == "hf-compile":
        for layer in model.model.layers:
            layer.compile()
        model.model.norm.compile()
        model.loss_function = torch.compile(model.loss_function)
    forward = torch.compile(model) if variant == "hf-compile-model" else model
    return model, lambda ids: forward(input_ids=ids, labels=ids).loss


def record(marks):
    """Append a recorded CUDA timing event to marks (None: nothing)."""
    if marks is not None:
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()


def phase_ms(marks):
    """Events [before forward, after forward, after backward, after optimizer] per step -> mean ms of each phase
    (PHASES; "between": the last event of a step to the first of the next)."""
    n = len(marks) // 4
    ends = [(marks[4 * k + j], marks[4 * k + j + 1]) for k in range(n) for j in range(3)]
    ends += [(marks[4 * k + 3], marks[4 * k + 4]) for k in range(n - 1)]
    sums = dict.fromkeys(PHASES, 0.0)
    for index, (start, end) in enumerate(ends):
        phase = PHASES[index % 3] if index < 3 * n else "between"
        sums[phase] += start.elapsed_time(end)
    return {p: round(sums[p] / max(1, n - 1 if p == "between" else n), 2) for p in PHASES}


def profile_step(step, i):
    """One step under torch.profiler -> (rows (operator [input shapes], calls, GPU ms) with the most GPU time, the
    step's kernel ms, kernel ms per phase: forward and optimizer from their record_function ranges, backward the
    rest)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step(i)
        torch.cuda.synchronize()
    events = prof.key_averages(group_by_input_shape=True)
    ops = [e for e in events if e.device_type == DeviceType.CPU and e.self_device_time_total > 0]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    rows = [dict(op=f"{e.key} {str(e.input_shapes)[:90]}", calls=e.count,
                 gpu_ms=round(e.self_device_time_total / 1e3, 2)) for e in ops[:PROFILE_ROWS]]
    total = sum(e.self_device_time_total for e in ops) / 1e3
    ranges = {e.key: e.device_time_total / 1e3 for e in events if e.key.startswith("phase::")}
    forward, optimizer = ranges.get("phase::forward", 0.0), ranges.get("phase::optimizer", 0.0)
    kernels = dict(forward=round(forward, 1), backward=round(total - forward - optimizer, 1),
                   optimizer=round(optimizer, 1))
    return rows, round(total, 1), kernels


def measure(variant, args):
    model, loss_fn = build(variant, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    batches = [torch.randint(0, LLAMA_1B["vocab_size"], (args.batch, args.seq), device="cuda", generator=generator)
               for _ in range(4)]
    losses, memory = [], {}

    def step(i, marks=None):
        memory["before"] = torch.cuda.memory_allocated()
        record(marks)
        with torch.profiler.record_function("phase::forward"):
            loss = loss_fn(batches[i % len(batches)])
        record(marks)
        memory["after_forward"] = torch.cuda.memory_allocated()
        loss.backward()
        record(marks)
        with torch.profiler.record_function("phase::optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        record(marks)
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
    marks = []
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i, marks)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    row = dict(variant=variant, tokens_per_s=round(args.steps * args.batch * args.seq / elapsed),
               step_ms=round(1000 * elapsed / args.steps, 1),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
               static_gib=round(memory["before"] / 2**30, 2),
               act_gib=round((memory["after_forward"] - memory["before"]) / 2**30, 2),
               first_step_s=round(first_step_s, 1), first_loss=round(losses[0].item(), 4),
               last_loss=round(losses[-1].item(), 4), phase_ms=phase_ms(marks))
    if args.profile:
        row["profile"], row["profiled_gpu_ms"], row["kernel_ms"] = profile_step(step, args.warmup + args.steps)
    del model, optimizer, batches, losses, loss_fn
    gc.collect()
    torch.cuda.empty_cache()
    return row


def print_profile(row):
    print(f"\n{row['variant']}: kernel time of one profiled step {row['profiled_gpu_ms']} ms {row['kernel_ms']} "
          f"(timed steps: {row['step_ms']} ms {row['phase_ms']}); operators with the most GPU time:")
    for r in row["profile"]:
        print(f"  {r['gpu_ms']:>8.2f} ms {r['calls']:>5}x  {r['op']}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, from {VARIANTS}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps, the first included")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="profile one more step of each variant")
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
        print({k: v for k, v in rows[-1].items() if k != "profile"}, flush=True)

    print(f"\nLlama 1.1B training step, batch {args.batch} x seq {args.seq}, {torch.cuda.get_device_name()}")
    print(f"{'variant':<17}{'tokens/s':>10}{'step ms':>9}{'peak GiB':>10}{'static':>8}{'act':>7}{'1st step s':>12}"
          f"{'loss':>17}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<17}  {r['error']}")
        else:
            print(f"{r['variant']:<17}{r['tokens_per_s']:>10,}{r['step_ms']:>9}{r['peak_gib']:>10}{r['static_gib']:>8}"
                  f"{r['act_gib']:>7}{r['first_step_s']:>12}{r['first_loss']:>8} -> {r['last_loss']:<7}")
    for r in rows:
        if "profile" in r:
            print_profile(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=LLAMA_1B, batch=args.batch, seq=args.seq, steps=args.steps,
                           device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
