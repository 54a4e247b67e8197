"""Full Llama training step (forward, loss, backward, fused AdamW) of a ~1.1B Llama: ours in FP8 (each
LlamaDecoderLayer replaced by our TransformerLayer with convert_llama, fp8_autocast, BF16 parameters) vs Hugging Face
transformers in BF16, eager and torch.compile, in one run, with like-for-like loss rows (ours with HF's full-logits
loss, HF with our chunked loss). Prints a table (tokens/s, memory, loss) and writes JSON with every round.

Rounds (--rounds): by default every variant is built once and kept (all fit on an 80 GB GPU together: ~6.6 GiB of
parameters and AdamW state each), and each round times --steps steps of every variant, the variants in a seeded new
order each round, so that the GPU clock's drift under its power cap lands on all of them alike. --separate (or an out
of memory while building them all) builds, times and frees each variant in turn per round instead, the order
reversed every other round. The table prints the median tokens/s over the rounds and its range.

Config: vocab 32000 (untied head), hidden 2048, intermediate 8192, 16 layers, 32 heads / 8 KV heads; batch 4 x seq
2048 of random tokens; torch.optim.AdamW(fused=True) on the BF16 parameters for every variant but ours-fp8-fused-adamw
(BF16 moments).
Variants:
  ours-fp8 / ours-bf16  convert_llama, loss by causal_lm_loss (chunked LM head + cross-entropy: no [8192, 32000]
                        logits); inside / outside fp8_autocast
  ours-fp8-hf-loss      ours-fp8 with Hugging Face's loss, model(input_ids, labels=input_ids).loss (full logits): the
                        like-for-like row beside hf-eager
  hf-eager-chunked-loss hf-eager with our causal_lm_loss: the like-for-like row beside ours-fp8
  hf-eager              model(input_ids, labels=input_ids).loss
  hf-compile            regional compilation: each decoder layer, the final norm and the loss function compiled
                        (torch.compile, default mode); the causal-mask builder stays eager, so SDPA gets is_causal=True
                        and native GQA, as in eager
  ours-fp8-fused-adamw  (not run by default) ours-fp8 with our FusedAdamW (te.FusedAdamW: the same update, one fused
                        op) instead of torch.optim.AdamW(fused=True)
  ours-fp8-unfused-rope (not run by default) ours-fp8 with MultiheadAttention.fused_rope_split off: the separate QKV
                        split, RoPE kernels and V copy, and the dq / dk / dv copies into the QKV gradient (the path
                        before split_qkv_rope)
  ours-fp8-checkpointed / hf-eager-checkpointed  (not run by default) ours-fp8 and hf-eager with each decoder layer's
                        activations recomputed in the backward (integrations.gradient_checkpointing_enable)
  hf-compile-model      torch.compile(model) (not run by default): with torch < 2.14 transformers then materialises the
                        [b, 1, s, s] causal mask while tracing (it cannot tell compiling from exporting), so SDPA runs
                        with an explicit mask (no flash/cuDNN causal kernel) and K/V repeated to all heads
Columns: tokens/s and ms over the timed steps of a round (wall clock between two synchronisations: the steps run back
to back), median (min-max) over the rounds; peak GiB = torch.cuda.max_memory_allocated over the variant's steps minus
what the other variants kept allocated, the largest over the rounds; static GiB = the variant's own allocation before a
step (parameters + optimizer state; gradients are set to None); act GiB = allocated at the end of a
forward minus before it (what the forward keeps for the backward, and the loss's gradients for ours); the first step
(allocations, cuBLAS/cuDNN setup, compilation) is timed apart as `first_step_s`. `phase_ms`: GPU-timeline ms of the
forward (with the loss), backward, optimizer step and the gap to the next step (CUDA events; a phase longer than its
kernels is host-bound). --profile adds, per variant, the kernel time of each phase in one step and the operators with
the most GPU time (grouped by input shapes).
"""
import argparse
import gc
import json
import random
import time

import torch

import transformer_fp8 as te
from timing import spread
from transformer_fp8 import recipe
from transformer_fp8.integrations import causal_lm_loss, convert_llama, gradient_checkpointing_enable
from transformer_fp8.attention import MultiheadAttention
from transformer_fp8.module.attention import DotProductAttention

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
LLAMA_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
FP8_RECIPE = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
VARIANTS = ("ours-fp8", "ours-fp8-hf-loss", "ours-bf16", "hf-eager", "hf-eager-chunked-loss", "hf-compile",
            "hf-compile-model", "ours-fp8-torch-sdpa", "ours-fp8-checkpointed", "hf-eager-checkpointed",
            "ours-fp8-fused-adamw", "ours-fp8-unfused-rope")
DEFAULT_VARIANTS = VARIANTS[:6]
PROFILE_ROWS = 30
PHASES = ("forward", "backward", "optimizer", "between")


def build(variant, seed, config, device):
    """-> (model in train mode, BF16 on `device`, the same weights for every variant; loss(input_ids) for one step)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config, use_cache=False)).to(torch.bfloat16).train()
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
        if variant == "ours-fp8-unfused-rope":
            for module in model.modules():
                if isinstance(module, MultiheadAttention):
                    module.fused_rope_split = False

        def loss(ids):
            with te.fp8_autocast(enabled=fp8, fp8_recipe=FP8_RECIPE):
                if variant == "ours-fp8-hf-loss":  # (Hugging Face's loss: full [b, s, vocab] logits)
                    return model(input_ids=ids, labels=ids).loss
                return causal_lm_loss(model, ids)
        return model, loss
    if variant == "hf-eager-chunked-loss":
        return model, lambda ids: causal_lm_loss(model, ids)
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


def profile_step(step):
    """One step under torch.profiler -> (rows (operator [input shapes], calls, GPU ms) with the most GPU time, the
    step's kernel ms, kernel ms per phase: forward and optimizer from their record_function ranges, backward the
    rest)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
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


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def allocated(device):
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


class Runner:
    """One variant's model, optimizer and batches, built and warmed up (--warmup steps, the first timed apart); then
    timed rounds of --steps steps each (`timed_round`)."""

    def __init__(self, variant, args, config, device):
        self.variant, self.args, self.device, self.cuda = variant, args, device, device.type == "cuda"
        synchronize(device)
        before_build = allocated(device)
        self.model, self.loss_fn = build(variant, args.seed, config, device)
        if variant == "ours-fp8-fused-adamw":
            self.optimizer = te.FusedAdamW(self.model.parameters(), lr=args.lr)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, fused=self.cuda)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        self.batches = [torch.randint(0, config["vocab_size"], (args.batch, args.seq), device=device,
                                      generator=generator) for _ in range(4)]
        self.losses, self.memory, self.index = [], {}, 0
        t0 = time.perf_counter()
        self.step()
        synchronize(device)
        self.first_step_s = time.perf_counter() - t0
        for _ in range(1, args.warmup):
            self.step()
        synchronize(device)
        self.static_bytes = allocated(device) - before_build  # (parameters, optimizer state; gradients are None)

    def step(self, marks=None):
        self.memory["before"] = allocated(self.device)
        record(marks)
        with torch.profiler.record_function("phase::forward"):
            loss = self.loss_fn(self.batches[self.index % len(self.batches)])
        record(marks)
        self.memory["after_forward"] = allocated(self.device)
        loss.backward()
        record(marks)
        with torch.profiler.record_function("phase::optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        record(marks)
        self.losses.append(loss.detach())
        self.index += 1

    def timed_round(self):
        """--steps steps back to back -> {tokens_per_s, step_ms, peak_gib (above the other variants' allocation),
        act_gib, phase_ms}."""
        args = self.args
        synchronize(self.device)
        others = allocated(self.device) - self.static_bytes  # (what the other variants keep allocated)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        marks = [] if self.cuda else None
        t0 = time.perf_counter()
        for _ in range(args.steps):
            self.step(marks)
        synchronize(self.device)
        elapsed = time.perf_counter() - t0
        result = dict(tokens_per_s=args.steps * args.batch * args.seq / elapsed, step_ms=1000 * elapsed / args.steps,
                      act_gib=round((self.memory["after_forward"] - self.memory["before"]) / 2**30, 2))
        if self.cuda:
            result.update(peak_gib=round((torch.cuda.max_memory_allocated() - others) / 2**30, 2),
                          phase_ms=phase_ms(marks))
        return result

    def free(self):
        del self.model, self.optimizer, self.batches, self.loss_fn
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def summarize(variant, rounds, runners):
    """A variant's row from its rounds' results and the Runner(s) that ran them."""
    last = runners[-1]
    row = dict(variant=variant, tokens_per_s=spread([r["tokens_per_s"] for r in rounds], 0),
               step_ms=spread([r["step_ms"] for r in rounds], 1),
               static_gib=round(last.static_bytes / 2**30, 2), act_gib=rounds[-1]["act_gib"],
               first_step_s=spread([r.first_step_s for r in runners], 1),
               first_loss=round(runners[0].losses[0].item(), 4), last_loss=round(last.losses[-1].item(), 4))
    if "peak_gib" in rounds[0]:
        row["peak_gib"] = max(r["peak_gib"] for r in rounds)
        row["peak_gib_rounds"] = [r["peak_gib"] for r in rounds]
        row["phase_ms"] = {p: spread([r["phase_ms"][p] for r in rounds], 2)["median"] for p in PHASES}
        row["phase_ms_rounds"] = [r["phase_ms"] for r in rounds]
    return row


def run_together(variants, args, config, device):
    """Every variant built once and kept; per round each times --steps steps, in a seeded new order each round.
    -> rows, or None after an out of memory while building (everything freed)."""
    runners, rows, results = {}, {}, {}
    try:
        for variant in variants:
            try:
                runners[variant] = Runner(variant, args, config, device)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as err:  # report and go on with the other variants
                rows[variant] = dict(variant=variant, error=f"{type(err).__name__}: {err}"[:300])
            print(f"built {variant}", flush=True)
        for runner in runners.values():  # (one untimed step each with all built: do they fit together?)
            runner.step()
        synchronize(device)
    except torch.cuda.OutOfMemoryError:
        for runner in runners.values():
            runner.free()
        runners.clear()
        gc.collect()
        torch.cuda.empty_cache()
        return None
    rng = random.Random(args.seed)
    for index in range(args.rounds):
        order = [v for v in variants if v in runners]
        rng.shuffle(order)
        for variant in order:
            try:
                results.setdefault(variant, []).append(runners[variant].timed_round())
                print(f"round {index + 1} {variant}: {results[variant][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
            except Exception as err:  # (an out of memory mid-run included: the variant is dropped, the others go on)
                rows[variant] = dict(variant=variant, error=f"{type(err).__name__}: {err}"[:300])
                runners.pop(variant).free()
    for variant, runner in runners.items():
        rows[variant] = summarize(variant, results[variant], [runner])
        if args.profile and device.type == "cuda":
            rows[variant]["profile"], rows[variant]["profiled_gpu_ms"], rows[variant]["kernel_ms"] = \
                profile_step(runner.step)
    for runner in runners.values():
        runner.free()
    return [rows[v] for v in variants]


def run_separate(variants, args, config, device):
    """Per round, each variant built, timed and freed in turn; the order reversed every other round."""
    results, runners_used, rows = {}, {}, {}
    for index in range(args.rounds):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        for variant in order:
            if variant in rows:  # (failed before)
                continue
            try:
                runner = Runner(variant, args, config, device)
                results.setdefault(variant, []).append(runner.timed_round())
                print(f"round {index + 1} {variant}: {results[variant][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
                if args.profile and device.type == "cuda" and index == args.rounds - 1:
                    rows[variant + ":profile"] = profile_step(runner.step)
                runner.free()
                runners_used.setdefault(variant, []).append(runner)
            except Exception as err:  # report and go on with the other variants
                rows[variant] = dict(variant=variant, error=f"{type(err).__name__}: {err}"[:300])
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    out = []
    for variant in variants:
        if variant in rows:
            out.append(rows[variant])
            continue
        row = summarize(variant, results[variant], runners_used[variant])
        if variant + ":profile" in rows:
            row["profile"], row["profiled_gpu_ms"], row["kernel_ms"] = rows[variant + ":profile"]
        out.append(row)
    return out


def print_profile(row):
    print(f"\n{row['variant']}: kernel time of one profiled step {row['profiled_gpu_ms']} ms {row['kernel_ms']} "
          f"(timed steps: {row['step_ms']['median']} ms {row.get('phase_ms')}); operators with the most GPU time:")
    for r in row["profile"]:
        print(f"  {r['gpu_ms']:>8.2f} ms {r['calls']:>5}x  {r['op']}")


def print_table(rows, args, mode, device_name):
    size = "tiny" if args.tiny else "1.1B"
    print(f"\nLlama {size} training step, batch {args.batch} x seq {args.seq}, {device_name}; "
          f"{args.rounds} rounds of {args.steps} steps ({mode}): median tokens/s (min-max)")
    print(f"{'variant':<22}{'tokens/s (range)':>26}{'step ms':>9}{'peak GiB':>10}{'static':>8}{'act':>7}"
          f"{'1st step s':>12}{'loss':>20}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<22}  {r['error']}")
            continue
        t = r["tokens_per_s"]
        tokens = f"{t['median']:,.0f} ({t['min']:,.0f}-{t['max']:,.0f})"
        print(f"{r['variant']:<22}{tokens:>26}{r['step_ms']['median']:>9}{str(r.get('peak_gib', '-')):>10}"
              f"{r['static_gib']:>8}{r['act_gib']:>7}{r['first_step_s']['median']:>12}"
              f"{r['first_loss']:>10} -> {r['last_loss']:<7}")
    for r in rows:
        if "profile" in r:
            print_profile(r)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, from {VARIANTS}")
    p.add_argument("--batch", type=int, default=None, help="default 4 (tiny: 2)")
    p.add_argument("--seq", type=int, default=None, help="default 2048 (tiny: 32)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant build, the first included")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per variant")
    p.add_argument("--separate", action="store_true",
                   help="build, time and free each variant per round instead of keeping all built")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="profile one more step of each variant (CUDA)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer Llama with vocab 256: a smoke test of the script")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke tests only (with --tiny)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; expected some of {VARIANTS}")
    for flag in ("warmup", "steps", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}: expected at least 1, got {getattr(args, flag)}")
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu: only with --tiny (the 1.1B model on the CPU reference kernels would take hours)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_llama.py needs a CUDA GPU (or --device cpu --tiny for a smoke test)")
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 2048)
    config = LLAMA_TINY if args.tiny else LLAMA_1B
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"

    mode = "separate" if args.separate else "together"
    rows = None if args.separate else run_together(variants, args, config, device)
    if rows is None:
        if not args.separate:
            print("out of memory building every variant at once: rounds of separate builds instead", flush=True)
            mode = "separate (together ran out of memory)"
        rows = run_separate(variants, args, config, device)
    print_table(rows, args, mode, device_name)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=config, batch=args.batch, seq=args.seq, steps=args.steps, rounds=args.rounds,
                           mode=mode, device=device_name, torch=torch.__version__, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
