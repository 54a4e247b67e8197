"""LoRA fine-tuning on FP8 base weights with transformer_fp8.lora, saved in PEFT's format and reloaded by PEFT.

Runs with no arguments and no network: on a GPU the Llama of examples/finetune_llama.py (0.36B parameters, hidden 2048,
8 layers, random init), without CUDA a tiny one (hidden 64, 2 layers) whose FP8 GEMMs run on the CPU reference
kernels (emulated FP8). --model DIR takes a local Hugging Face checkpoint instead (the case LoRA is for: adapting a
pretrained model). Data: examples/data/corpus.txt (or --data), byte-level tokens unless --model brings a tokenizer.

Each run (--precision both: "bf16" then "fp8", from the same weights and batches):
  1. convert_llama(model): each decoder layer becomes our TransformerLayer;
  2. add_lora(model, r, alpha, target_modules=...): LoRA adapters on the Hugging Face projections (q_proj, ...),
     every other parameter frozen; the fp8 run also stores the frozen GEMM weights in FP8 (fp8_weights=True) and
     runs the forward inside fp8_autocast (base GEMMs in FP8, no weight gradients for them);
  3. AdamW on the adapters only (lora_parameters), with a progress bar; the loss by causal_lm_loss;
  4. save_lora(model, OUT/adapter-<precision>): adapter_config.json + adapter_model.safetensors;
  5. the plain Hugging Face model (same base weights, transformer_fp8 not involved) with
     peft.PeftModel.from_pretrained(hf_model, that folder): its held-out loss, its logits' largest difference from
     our adapted model's, and a greedy sample from a prompt (random-init models write noise; --model models text).
Writes loss.png (the runs' loss curves) and summary.json under --out. Needs transformers and peft (and optionally tqdm,
matplotlib).
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (finetune_llama.py beside this file, run from anywhere)
import finetune_llama as base  # noqa: E402
from transformer_fp8.integrations import causal_lm_loss, convert_llama  # noqa: E402
from transformer_fp8.lora import add_lora, lora_parameters, save_lora  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPU_STEPS, CPU_STEPS = 200, 20
ADAPTER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def train(precision, args, model_config, tokenizer, train_tokens, eval_tokens, device):
    """One LoRA run ("bf16" or "fp8"): train, evaluate, save the adapter; returns (summary, the adapted model)."""
    fp8 = precision == "fp8"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = convert_llama(base.build_model(args, model_config, tokenizer.vocab_size, device))
    add_lora(model, r=args.rank, alpha=args.alpha, dropout=args.dropout, target_modules=args.targets,
             fp8_weights=fp8, dtype=ADAPTER_DTYPES[args.adapter_dtype])
    params = lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    batches = base.RandomWindows(train_tokens, args.batch_size, args.seq_len, args.seed)
    progress = base.Progress(0, args.steps, f"LoRA {precision}", every=max(1, args.steps // 20))
    losses, t0 = [], None
    for step in range(args.steps):
        if step == min(1, args.steps - 1):  # (the first step, with its allocations and calibration, is not timed)
            base.synchronize(device)
            t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = base.lr_at(step, args)
        with base.fp8_context(fp8):
            loss = causal_lm_loss(model, batches.next().to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
        progress.update(step, lambda: losses[-1].item())
    base.synchronize(device)
    elapsed = time.perf_counter() - t0 if t0 is not None and args.steps > 1 else None
    progress.close()
    losses = torch.stack(losses).tolist()
    adapter_dir = save_lora(model, Path(args.out) / f"adapter-{precision}")
    summary = {"precision": precision, "losses": losses,
               "final_loss": sum(losses[-10:]) / len(losses[-10:]),
               "eval_loss": base.evaluate(model, eval_tokens, args, fp8, device),
               "tokens_per_s": args.batch_size * args.seq_len * (args.steps - 1) / elapsed if elapsed else None,
               "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
               "trainable_params": sum(p.numel() for p in params), "adapter_dir": str(adapter_dir)}
    return summary, model


def decode(tokenizer, ids):
    """Token ids -> text (the byte tokenizer: its bytes, special tokens dropped)."""
    if isinstance(tokenizer, base.ByteTokenizer):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    return tokenizer.decode(ids, skip_special_tokens=True)


@torch.no_grad()
def reload_with_peft(summary, ours, args, model_config, tokenizer, eval_tokens, device):
    """The plain Hugging Face model + PEFT on the saved adapter: held-out loss, logits against ours, a sample."""
    from peft import PeftModel

    hf = base.build_model(args, model_config, tokenizer.vocab_size, device).eval()
    peft_model = PeftModel.from_pretrained(hf, summary["adapter_dir"]).eval()
    batch = eval_tokens[:args.seq_len].view(1, -1).to(device)
    ours.eval()
    difference = (peft_model(input_ids=batch).logits.float() - ours(input_ids=batch).logits.float()).abs().max()
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    prompt = torch.tensor([bos + list(tokenizer.encode(args.prompt, add_special_tokens=False))], device=device)
    generated = peft_model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                    max_new_tokens=args.new_tokens, do_sample=False, use_cache=True,
                                    pad_token_id=tokenizer.eos_token_id)
    sample = decode(tokenizer, generated[0, prompt.shape[1]:].tolist())
    hf_args = copy.copy(args)
    hf_args.loss = "model"  # (the PEFT model through its own loss)
    summary.update(peft_eval_loss=base.evaluate(peft_model, eval_tokens, hf_args, False, device),
                   peft_max_logit_difference=difference.item(), peft_sample=args.prompt + sample)
    print(f"[{summary['precision']}] PEFT on the plain Hugging Face model: held-out loss "
          f"{summary['peft_eval_loss']:.4f} (ours {summary['eval_loss']:.4f}), largest logit difference from ours "
          f"{difference.item():.3g}\n  sample: {summary['peft_sample']!r}")


def plot_losses(runs, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs.values():
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=f"LoRA, {run['precision'].upper()} base",
                linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("LoRA fine-tuning: BF16 vs FP8 base weights (transformer_fp8.lora)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curves: {path}")


def print_table(runs):
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    print(f"{'run':<6}{'final loss':>12}{'eval loss':>11}{'PEFT eval':>11}{'tokens/s':>12}{'peak GiB':>10}")
    for run in runs.values():
        print(f"{run['precision']:<6}{fmt(run['final_loss'], '.4f'):>12}{fmt(run['eval_loss'], '.4f'):>11}"
              f"{fmt(run.get('peft_eval_loss'), '.4f'):>11}{fmt(run['tokens_per_s'], ',.0f'):>12}"
              f"{fmt(run['peak_memory_gib'], '.2f'):>10}")


def probability(text):
    """argparse type: a float in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {text}")
    return value


def target_list(text):
    """argparse type: comma-separated Hugging Face module names."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated module names such as q_proj,v_proj, got {text!r}")
    return names


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local Hugging Face checkpoint directory (default: a small Llama, random init)")
    p.add_argument("--data", default=str(base.DEFAULT_DATA), help="local .txt or .jsonl (field 'text')")
    p.add_argument("--precision", choices=("both", "bf16", "fp8"), default="both",
                   help="base weights and GEMMs: bf16, fp8 (FP8 weights under fp8_autocast), or both runs")
    p.add_argument("--device", type=base.device_name,
                   help="cuda, cuda:N or cpu (default: cuda if available); cpu trains a tiny model")
    p.add_argument("--rank", type=base.positive_int, default=16, help="LoRA rank r")
    p.add_argument("--alpha", type=base.positive_float, default=32.0, help="LoRA alpha (scale alpha / r)")
    p.add_argument("--dropout", type=probability, default=0.0, help="dropout on the adapters' input")
    p.add_argument("--targets", type=target_list, default=list(TARGETS),
                   help=f"comma-separated Hugging Face module names (default {','.join(TARGETS)})")
    p.add_argument("--adapter-dtype", choices=tuple(ADAPTER_DTYPES), default="float32",
                   help="dtype of the adapters and their optimizer state (float32: as PEFT keeps them)")
    p.add_argument("--steps", type=base.positive_int, help=f"optimizer steps (default {GPU_STEPS} on GPU, "
                                                           f"{CPU_STEPS} on CPU)")
    p.add_argument("--batch-size", type=base.positive_int, help="sequences per step (default 16 GPU, 4 CPU)")
    p.add_argument("--seq-len", type=base.positive_int, help="tokens per sequence (default 1024 GPU, 64 CPU)")
    p.add_argument("--lr", type=base.positive_float, help="peak learning rate (default 1e-3; 2e-4 with --model)")
    p.add_argument("--warmup-steps", type=base.positive_int,
                   help="steps of the linear learning-rate warmup (default: 20%% of --steps)")
    p.add_argument("--max-grad-norm", type=base.positive_float, default=1.0)
    p.add_argument("--prompt", default="The ", help="prompt of the generated sample")
    p.add_argument("--new-tokens", type=base.positive_int, default=40, help="tokens of the generated sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="finetune_lora_out", help="folder for the adapters, summary.json and loss.png")
    p.set_defaults(resume=None, loss="chunked")  # (what finetune_llama's helpers read)
    args = p.parse_args(argv)
    base.check_paths_and_device(p, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("finetune_lora.py needs transformers and peft: pip install transformers peft")
    device, model_config, _ = base.device_and_defaults(args)
    args.steps = args.steps or (GPU_STEPS if device.type == "cuda" else CPU_STEPS)
    args.lr = args.lr or (2e-4 if args.model else 1e-3)
    if device.type == "cpu":
        print("No CUDA device (or --device cpu): the FP8 run goes through the CPU reference kernels (emulated FP8, "
              "slow: for checking, not for speed)" + ("" if args.model else "; the model is a tiny Llama"))
    if args.model:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        tokenizer = base.ByteTokenizer()
    tokens = base.tokenize(base.read_documents(args.data), tokenizer)
    n_eval = min(tokens.numel() // 10, 8 * args.batch_size * args.seq_len)
    train_tokens, eval_tokens = tokens[:tokens.numel() - n_eval], tokens[tokens.numel() - n_eval:]
    if eval_tokens.numel() < args.seq_len:
        raise ValueError(f"data: {eval_tokens.numel()} held-out tokens, need at least seq_len = {args.seq_len}")
    print(f"data: {args.data}: {train_tokens.numel():,} training / {eval_tokens.numel():,} held-out tokens; LoRA "
          f"r={args.rank} on {','.join(args.targets)}; {args.steps} steps x {args.batch_size} x {args.seq_len} "
          f"tokens on {device}")

    runs = {}
    for precision in (("bf16", "fp8") if args.precision == "both" else (args.precision,)):
        summary, model = train(precision, args, model_config, tokenizer, train_tokens, eval_tokens, device)
        reload_with_peft(summary, model, args, model_config, tokenizer, eval_tokens, device)
        runs[precision] = summary
        del model
    out = Path(args.out)
    print_table(runs)
    plot_losses(runs, out / "loss.png")
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "args": vars(args), "runs": runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"summary: {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()
