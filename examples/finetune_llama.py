"""Train the same Llama model from the same seed in BF16 and in FP8 (transformer_fp8), and compare the two runs.

Runs with no arguments and no network: on a GPU a Llama of 0.36B parameters (hidden 2048, 8 layers, 16 heads / 4 KV
heads, sequences of 1024) initialised locally; without CUDA a tiny one (hidden 64, 2 layers) whose FP8 GEMMs run on the
CPU reference kernels (emulated FP8).
Data: examples/data/corpus.txt through a byte-level tokenizer that needs no download.
  --model DIR   a local Hugging Face checkpoint (from_pretrained, with its tokenizer through AutoTokenizer)
  --data PATH   a local .txt (one document) or .jsonl (one document per line, field "text"); the bundled corpus
                (60 KB) repeats many times in 200 steps: `python examples/stdlib_corpus.py stdlib.jsonl` writes 16 MB
                of Python's own standard-library sources (no download) for a comparison of BF16 and FP8 losses

The FP8 run is the BF16 run plus two things: a conversion and `fp8_autocast` around the forward. The conversion is
--fp8-layers transformer (default): `convert_llama(model)`, each LlamaDecoderLayer becomes a transformer_fp8
TransformerLayer (fused norm + FP8 GEMMs, fused attention); or --fp8-layers linear: `convert_linear_layers(model)`,
every nn.Linear but lm_head becomes a transformer_fp8.Linear. Parameters are BF16 in both runs; AdamW updates FP32
master copies of them (fused AdamW on CUDA). Both runs compute the loss with --loss chunked (default):
`causal_lm_loss(model, batch)`, the LM head and cross-entropy chunk by chunk, never holding the [tokens, vocab] logits;
--loss model: `model(input_ids=batch, labels=batch).loss`. --grad-accum N passes is_first_microbatch to the FP8
layers (weights cast once per step); --fuse-wgrad makes those layers accumulate their weight gradients into FP32
`weight.main_grad`, which the optimizer reads. --activation-checkpointing recomputes each decoder layer in the
backward (both runs; transformer_fp8.checkpoint in the FP8 one). Prints loss, tokens/s and peak GPU memory of each
run; writes loss.png and summary.json under --out; --save-hf OUT writes each trained model as a plain Hugging Face
checkpoint (OUT/bf16, OUT/fp8). After training each run writes a greedy sample (--sample-tokens new tokens, default 60,
0: none) after a prompt from the held-out data with `model.generate` (KV cache): the BF16 run with its BF16 weights,
the FP8 run with its trained weights cast to FP8 (`cast_frozen_weights_to_fp8`: Float8Tensor weights, one byte each,
cast after --save-hf) inside fp8_autocast. Needs transformers (and optionally tqdm, matplotlib).
Bad arguments (a --model folder that does not exist, non-positive counts, --device cuda without a GPU) are refused
before anything loads, with a message naming the flag.
"""
import argparse
import contextlib
import gc
import json
import math
import time
from pathlib import Path

import torch

import transformer_fp8 as te
from transformer_fp8.integrations import (causal_lm_loss, convert_linear_layers, convert_llama,
                                          gradient_checkpointing_enable, microbatch, save_hf_pretrained)
from transformer_fp8.lora import cast_frozen_weights_to_fp8

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
PARAMS_DTYPE = torch.bfloat16
# Model size and run length by device: (model config, seq_len, batch_size, steps)
GPU_DEFAULTS = (dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                     intermediate_size=5632), 1024, 16, 200)
CPU_DEFAULTS = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=176), 64, 4, 20)
SAMPLE_PROMPT_TOKENS = 32  # the samples' prompt: the first held-out tokens


# --- data ------------------------------------------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS = 256 and EOS = 257."""
    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        """The text of the byte tokens of ids (BOS/EOS left out; broken UTF-8 sequences as U+FFFD)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def read_documents(path):
    """A .txt file is one document; a .jsonl file holds one document per line in its "text" field."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f if line.strip()]
    return [path.read_text(encoding="utf-8")]


def tokenize(documents, tokenizer):
    """One 1-D int64 tensor: the documents' token ids, each wrapped in BOS/EOS where the tokenizer has them."""
    ids = []
    for doc in documents:
        ids += [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ids += tokenizer.encode(doc, add_special_tokens=False)
        ids += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return torch.tensor(ids, dtype=torch.long)


class RandomWindows:
    """Batches [batch_size, seq_len] of random windows of a token stream, from a seeded generator (resumable)."""

    def __init__(self, tokens, batch_size, seq_len, seed):
        if tokens.numel() <= seq_len:
            raise ValueError(f"data: {tokens.numel()} training tokens, need more than seq_len = {seq_len}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self):
        starts = torch.randint(0, self.tokens.numel() - self.seq_len + 1, (self.batch_size,), generator=self.generator)
        return torch.stack([self.tokens[s:s + self.seq_len] for s in starts.tolist()])

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


# --- model and optimizer ---------------------------------------------------------------------------------------------

def build_model(args, model_config, vocab_size, device, positions=0):
    """The model, BF16, in train mode; the same weights on every call (seeded init or the checkpoint's). A random-init
    model gets max(seq_len, positions) positions (positions: what a generated sample needs beyond training's)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=PARAMS_DTYPE)
    else:
        torch.manual_seed(args.seed)
        config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max(args.seq_len, positions),
                             **model_config, bos_token_id=ByteTokenizer.bos_token_id,
                             eos_token_id=ByteTokenizer.eos_token_id)
        model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model.to(device=device, dtype=PARAMS_DTYPE).train()


def convert_to_fp8(model, args):
    """The FP8 run's conversion (--fp8-layers); with --fuse-wgrad the GEMM weights get FP32 `main_grad`s."""
    if args.fp8_layers == "transformer":
        convert_llama(model, params_dtype=PARAMS_DTYPE, fuse_wgrad_accumulation=args.fuse_wgrad)
        for m in model.modules():
            if isinstance(m, te.LayerNormMLP):
                m.keep_activation_input_in_fp8 = args.keep_fc1_fp8 == "on"
    else:
        convert_linear_layers(model, params_dtype=PARAMS_DTYPE, fuse_wgrad_accumulation=args.fuse_wgrad)
    if args.fuse_wgrad:
        attach_main_grads(model)


def fp8_module_counts(model):
    """{class name: count} of the transformer_fp8 modules inside model (empty for the BF16 run)."""
    names = [type(m).__name__ for m in model.modules() if type(m).__module__.startswith("transformer_fp8.")]
    return {name: names.count(name) for name in sorted(set(names))}


def attach_main_grads(model):
    """Give each GEMM weight (2-D parameter) of the FP8 modules built with fuse_wgrad_accumulation an FP32
    `main_grad` (unless it has one)."""
    for module in model.modules():
        if getattr(module, "fuse_wgrad_accumulation", False):
            for weight in module.parameters(recurse=False):
                if weight.dim() == 2 and getattr(weight, "main_grad", None) is None:
                    weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)


class MasterWeightAdamW:
    """AdamW on FP32 master copies of (BF16) parameters, copied back into them after each step.

    A parameter's gradient is its FP32 `main_grad` when it has one (layers with fuse_wgrad_accumulation write it and
    produce no .grad), else its `.grad`.
    """

    def __init__(self, params, lr, weight_decay=0.01):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.adamw = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay,
                                       fused=self.masters[0].is_cuda)

    def set_lr(self, lr):
        for group in self.adamw.param_groups:
            group["lr"] = lr

    def step(self, max_grad_norm):
        for p, master in zip(self.params, self.masters):
            grad = p.main_grad if hasattr(p, "main_grad") else p.grad
            master.grad = None if grad is None else grad.float()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.masters, max_grad_norm)
        self.adamw.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                p.copy_(master)
        return grad_norm

    def zero_grad(self):
        for p, master in zip(self.params, self.masters):
            p.grad = master.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()

    def state_dict(self):
        return {"masters": [m.detach().clone() for m in self.masters], "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state):
        with torch.no_grad():
            for master, saved in zip(self.masters, state["masters"]):
                master.copy_(saved)
            for p, master in zip(self.params, self.masters):
                p.copy_(master)
        self.adamw.load_state_dict(state["adamw"])


def lr_at(step, args):
    """Linear warmup over --warmup-steps (default: the first 20% of the steps; a shorter one let the default model's
    loss jump in the warm-up, and FP8 runs drift from BF16 by seed: benchmarks/RESULTS.md), then cosine decay to 10%
    of --lr."""
    warmup = args.warmup_steps or max(1, args.steps // 5)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


# --- training --------------------------------------------------------------------------------------------------------

def training_loss(model, batch, args):
    """Mean next-token loss of the batch [b, s] (--loss chunked: causal_lm_loss; model: the model's own loss)."""
    if args.loss == "chunked":
        return causal_lm_loss(model, batch)
    return model(input_ids=batch, labels=batch).loss


RECIPES = {  # --recipe: the FP8 scaling of the fp8 run
    "delayed": lambda: te.recipe.DelayedScaling(fp8_format=te.recipe.Format.HYBRID, amax_history_len=16,
                                                amax_compute_algo="max"),
    "current": lambda: te.recipe.Float8CurrentScaling(fp8_format=te.recipe.Format.HYBRID),
    "block": lambda: te.recipe.Float8BlockScaling(),  # (E4M3, 1x128 tiles for activations and gradients, 128x128
}                                                     # blocks for weights: TE's defaults)


def fp8_context(fp8, recipe="delayed"):
    """fp8_autocast with the recipe named `recipe` (a key of RECIPES) when fp8, else a no-op context."""
    if not fp8:
        return contextlib.nullcontext()
    return te.fp8_autocast(enabled=True, fp8_recipe=RECIPES[recipe]())


@torch.no_grad()
def evaluate(model, tokens, args, fp8, device, max_batches=8):
    """Mean loss over consecutive non-overlapping windows of the held-out tokens (None if there are too few)."""
    n = min(tokens.numel() // args.seq_len, max_batches * args.batch_size)
    if n == 0:
        return None
    windows = tokens[:n * args.seq_len].view(n, args.seq_len)
    model.eval()
    losses = []
    for batch in windows.split(args.batch_size):
        batch = batch.to(device)
        with fp8_context(fp8, getattr(args, "recipe", "delayed")):
            losses.append(training_loss(model, batch, args).float())
    model.train()
    return torch.stack(losses).mean().item()


class Progress:
    """A tqdm bar over the steps, or a plain print every `every` steps when tqdm is missing."""

    def __init__(self, start, total, desc, every):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, desc=desc, unit="step")
        except ImportError:
            self.bar = None
        self.desc, self.total, self.every = desc, total, every

    def update(self, step, loss):
        """step: the step just finished (0-based); loss: a function that gives its loss (a host sync: called rarely)."""
        last = step + 1 == self.total
        if self.bar is not None:
            self.bar.update(1)
            if step % self.every == 0 or last:
                self.bar.set_postfix(loss=f"{loss():.4f}")
        elif step % self.every == 0 or last:
            print(f"[{self.desc}] step {step + 1}/{self.total}  loss {loss():.4f}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def save_hf_checkpoint(model, tokenizer, folder):
    """The trained model (converted or not) as a plain Hugging Face checkpoint, with the KV cache switched back on
    in its config (training turned it off) and the tokenizer when it is a Hugging Face one."""
    model.config.use_cache = True
    save_hf_pretrained(model, folder)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)
    print(f"Hugging Face checkpoint: {folder}")


def sample_prompt(train_tokens, eval_tokens):
    """The samples' prompt: the first SAMPLE_PROMPT_TOKENS held-out tokens (training tokens when fewer are held
    out)."""
    tokens = eval_tokens if eval_tokens.numel() >= SAMPLE_PROMPT_TOKENS else train_tokens
    return tokens[:SAMPLE_PROMPT_TOKENS]


@torch.no_grad()
def generate_sample(model, fp8, prompt, tokenizer, new_tokens, device):
    """A greedy continuation of `prompt` (1-D token ids) by `model.generate` with the KV cache: exactly `new_tokens`
    tokens (EOS suppressed until then). The FP8 run first stores its trained GEMM weights as FP8 Float8Tensors
    (cast_frozen_weights_to_fp8, in place: the model is done training) and generates inside fp8_autocast, so every
    GEMM of its decoder layers reads FP8 weights; the BF16 run generates as trained.

    Returns:
        {"weights", "fp8_weight_tensors" (how many were cast), "prompt", "prompt_ids", "text" (the new tokens'
        text), "token_ids" (the new tokens), "new_tokens", "tokens_per_s"}.
    """
    model.eval()
    fp8_weight_tensors = 0
    if fp8:
        for param in model.parameters():
            param.requires_grad_(False)
        fp8_weight_tensors = cast_frozen_weights_to_fp8(model)
    ids = prompt.view(1, -1).to(device)
    pad = getattr(tokenizer, "pad_token_id", None)  # (one prompt: no padding, but generate wants an id)
    pad = pad if pad is not None else tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    synchronize(device)
    start = time.perf_counter()
    with fp8_context(fp8):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=pad)
    synchronize(device)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    return {"weights": "fp8" if fp8 else "bf16", "fp8_weight_tensors": fp8_weight_tensors,
            "prompt": tokenizer.decode(prompt.tolist(), skip_special_tokens=True), "prompt_ids": prompt.tolist(),
            "text": tokenizer.decode(new, skip_special_tokens=True), "token_ids": new, "new_tokens": len(new),
            "tokens_per_s": len(new) / seconds}


def checkpoint_path(folder, precision, step):
    return Path(folder) / f"{precision}-step{step:06d}.pt"


def latest_checkpoint(folder, precision):
    paths = sorted(Path(folder).glob(f"{precision}-step*.pt"))
    if not paths:
        raise FileNotFoundError(f"--resume: no {precision}-step*.pt checkpoint in {folder}")
    return paths[-1]


def train(precision, args, model_config, tokenizer, train_tokens, eval_tokens, device):
    """One run (precision "bf16", "fp8", or "converted": the FP8 run's converted model trained in BF16, without
    fp8_autocast); returns its summary (losses per step, tokens/s, peak memory, the sample,
    ...)."""
    fp8 = precision == "fp8"
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(args, model_config, tokenizer.vocab_size, device,
                        positions=SAMPLE_PROMPT_TOKENS + args.sample_tokens)  # (the sample's positions, too)
    if precision in ("fp8", "converted"):
        convert_to_fp8(model, args)
    if args.activation_checkpointing:
        gradient_checkpointing_enable(model)
    optimizer = MasterWeightAdamW(model.parameters(), lr=args.lr)
    batches = RandomWindows(train_tokens, args.batch_size, args.seq_len, args.seed)
    losses, start = [], 0
    if args.resume:
        path = latest_checkpoint(args.resume, precision)
        state = torch.load(path, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["batches"])
        losses, start = state["losses"], state["step"]
        print(f"[{precision}] resumed from {path} at step {start}")

    step_losses = []  # device tensors: no host sync per step
    progress = Progress(start, args.steps, precision, every=max(1, args.steps // 20))
    timed_from, t0 = min(start + 1, args.steps - 1), None  # the first step (allocations, cuBLAS init) is not timed
    for step in range(start, args.steps):
        if step == timed_from:
            synchronize(device)
            t0 = time.perf_counter()
        optimizer.set_lr(lr_at(step, args))
        step_loss = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            batch = batches.next().to(device)
            with fp8_context(fp8, args.recipe), microbatch(model, is_first=micro == 0):
                loss = training_loss(model, batch, args)
            (loss / args.grad_accum).backward()
            step_loss += loss.detach().float() / args.grad_accum
        optimizer.step(args.max_grad_norm)
        optimizer.zero_grad()
        step_losses.append(step_loss)
        progress.update(step, lambda: step_loss.item())
        if args.save and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            torch.save({"step": step + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "batches": batches.state_dict(), "losses": losses + torch.stack(step_losses).tolist()},
                       checkpoint_path(args.save, precision, step + 1))
    synchronize(device)
    elapsed = time.perf_counter() - t0 if t0 is not None else None
    progress.close()

    losses = losses + torch.stack(step_losses).tolist() if step_losses else losses
    timed_steps = args.steps - timed_from
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    summary = {
        "precision": precision, "recipe": args.recipe if fp8 else None,
        "losses": losses,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,  # mean of the last 10 steps
        "eval_loss": evaluate(model, eval_tokens, args, fp8, device),
        "tokens_per_s": tokens_per_step * timed_steps / elapsed if elapsed else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "fp8_modules": fp8_module_counts(model),
    }
    if args.save_hf:
        save_hf_checkpoint(model, tokenizer, Path(args.save_hf) / precision)
    del optimizer
    if args.sample_tokens:  # (after --save-hf: the FP8 run's sample casts its weights to FP8 in place)
        summary["sample"] = generate_sample(model, fp8, sample_prompt(train_tokens, eval_tokens), tokenizer,
                                            args.sample_tokens, device)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return summary


# --- reporting -------------------------------------------------------------------------------------------------------

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
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=run["precision"].upper(), linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Llama fine-tuning: BF16 vs FP8 (transformer_fp8)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curves: {path}")


def print_samples(runs):
    for run in runs.values():
        sample = run.get("sample")
        if sample is not None:
            print(f"[{run['precision']}] greedy sample, {sample['new_tokens']} tokens with {sample['weights'].upper()} "
                  f"weights ({sample['tokens_per_s']:.1f} tokens/s):\n  prompt: {sample['prompt']!r}\n"
                  f"  continuation: {sample['text']!r}")


def print_table(runs):
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    print(f"{'run':<6}{'final loss':>12}{'eval loss':>11}{'tokens/s':>12}{'peak GiB':>10}")
    for run in runs.values():
        print(f"{run['precision']:<6}{fmt(run['final_loss'], '.4f'):>12}{fmt(run['eval_loss'], '.4f'):>11}"
              f"{fmt(run['tokens_per_s'], ',.0f'):>12}{fmt(run['peak_memory_gib'], '.2f'):>10}")


# --- entry point -----------------------------------------------------------------------------------------------------

def _int_at_least(minimum, expected):
    """An argparse type: an int >= minimum; `expected` describes it in the error (argparse names the flag)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value
    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")


def positive_float(text):
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def device_name(text):
    """argparse type: 'cpu', 'cuda' or 'cuda:N' (whether a GPU is there is checked after parsing)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    return text


def check_paths_and_device(p, args):
    """Refuse, through the parser (exit status 2, the flag named), what would otherwise fail deep inside a library:
    a --model folder that does not exist (transformers would read it as a Hub repo id), a missing --data file or
    --resume folder, and --device cuda on a machine without a usable GPU."""
    if args.model is not None:
        model = Path(args.model)
        if not model.exists():
            p.error(f"--model: the folder {args.model} does not exist (expected a local Hugging Face checkpoint "
                    f"folder with config.json; this example downloads nothing)")
        if not model.is_dir():
            p.error(f"--model: {args.model} is a file; expected a local Hugging Face checkpoint folder")
        if not (model / "config.json").is_file():
            p.error(f"--model: {args.model} has no config.json; expected a Hugging Face checkpoint folder "
                    f"(save_pretrained's output)")
    if not Path(args.data).is_file():
        p.error(f"--data: the file {args.data} does not exist (expected a .txt or .jsonl file)")
    if args.resume is not None and not Path(args.resume).is_dir():
        p.error(f"--resume: the folder {args.resume} does not exist (expected a --save folder of an earlier run)")
    if args.device is not None and torch.device(args.device).type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {args.device}: no CUDA GPU is available here (torch.cuda.is_available() is False; "
                    f"torch {torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu or leave "
                    f"--device out")
        index = torch.device(args.device).index
        if index is not None and index >= torch.cuda.device_count():
            p.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local Hugging Face checkpoint directory (default: a small Llama, random init)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="local .txt or .jsonl (field 'text')")
    p.add_argument("--precision", choices=("both", "bf16", "fp8", "converted"), default="both",
                   help="both: bf16 then fp8; converted: the fp8 run's model (our layers) in BF16, without "
                        "fp8_autocast, which tells the FP8 numerics apart from the layers' own differences")
    p.add_argument("--recipe", choices=tuple(RECIPES), default="delayed",
                   help="FP8 scaling of the fp8 run: delayed (DelayedScaling, HYBRID), current "
                        "(Float8CurrentScaling) or block (Float8BlockScaling: 1x128 tiles, 128x128 weight blocks); "
                        "the sample after training runs with per-tensor FP8 weights under delayed scaling")
    p.add_argument("--keep-fc1-fp8", choices=("on", "off"), default="on",
                   help="FP8 run, --fp8-layers transformer: LayerNormMLP's keep_activation_input_in_fp8 (on: FC1's "
                        "output kept for the backward in E4M3 1x128 tiles; off: in 16 bits)")
    p.add_argument("--fp8-layers", choices=("transformer", "linear"), default="transformer",
                   help="FP8 run: replace each LlamaDecoderLayer by our TransformerLayer (default), or only swap the "
                        "nn.Linear layers for our Linear")
    p.add_argument("--loss", choices=("chunked", "model"), default="chunked",
                   help="chunked: LM head + cross-entropy by causal_lm_loss, chunk by chunk (no full logits); model: "
                        "model(input_ids, labels=input_ids).loss")
    p.add_argument("--device", type=device_name,
                   help="cuda, cuda:N or cpu (default: cuda if available); cpu trains a tiny model")
    p.add_argument("--steps", type=positive_int, help="optimizer steps (default 200 on GPU, 20 on CPU)")
    p.add_argument("--batch-size", type=positive_int, help="sequences per micro-batch (default 16 on GPU, 4 on CPU)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default 1024 on GPU, 64 on CPU)")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=positive_float,
                   help="peak learning rate (default from scratch: 3e-4 on GPU, 1e-3 on CPU; 2e-5 with --model)")
    p.add_argument("--warmup-steps", type=positive_int,
                   help="steps of the linear learning-rate warmup (default: 20%% of --steps)")
    p.add_argument("--max-grad-norm", type=positive_float, default=1.0)
    p.add_argument("--fuse-wgrad", action="store_true",
                   help="FP8 layers accumulate weight gradients into FP32 main_grad (fuse_wgrad_accumulation)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in the backward (transformers' activation "
                        "checkpointing, through transformer_fp8.checkpoint: FP8 layers recompute in FP8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="folder for checkpoints (<precision>-step<N>.pt), written every --save-every "
                                  "steps and after the last")
    p.add_argument("--save-every", type=positive_int, default=100)
    p.add_argument("--save-hf", metavar="OUT", help="after training, write each run as a plain Hugging Face checkpoint "
                   "to OUT/<precision> (loads with transformers' from_pretrained, no transformer_fp8 needed)")
    p.add_argument("--sample-tokens", type=non_negative_int, default=60, metavar="N",
                   help="after training, generate N tokens greedily from a held-out prompt with each run (FP8 run: "
                        "FP8 weights inside fp8_autocast) into summary.json; 0: no sample")
    p.add_argument("--resume", help="folder of --save checkpoints: each run continues from its latest one up to "
                                    "--steps (pass the same arguments as the first run)")
    p.add_argument("--out", default="finetune_out", help="folder for summary.json and loss.png")
    args = p.parse_args(argv)
    check_paths_and_device(p, args)
    return args


def device_and_defaults(args):
    """The run's device (--device, else CUDA when there is one) and its defaults (GPU_DEFAULTS or CPU_DEFAULTS):
    fills args.seq_len and args.batch_size where not given. Returns (device, model config, default steps)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_config, seq_len, batch_size, steps = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    args.seq_len, args.batch_size = args.seq_len or seq_len, args.batch_size or batch_size
    return device, model_config, steps


def main(argv=None):
    args = parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("finetune_llama.py needs transformers: pip install transformers")
    device, model_config, steps = device_and_defaults(args)
    args.steps = args.steps or steps
    args.lr = args.lr or (2e-5 if args.model else 3e-4 if device.type == "cuda" else 1e-3)
    if device.type == "cpu":
        print("No CUDA device: training a tiny Llama (hidden 64, 2 layers) on the CPU; the FP8 run goes through the "
              "CPU reference kernels (emulated FP8, slow: for checking, not for speed)." if not args.model else
              "Training on the CPU: the FP8 run goes through the CPU reference kernels (emulated FP8, slow).")
    elif not te.cuda_kernels_available() and args.precision != "bf16":
        raise SystemExit("transformer_fp8 was built without its CUDA kernels: rebuild it with nvcc (tools/setup.sh)")

    if args.model:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        tokenizer = ByteTokenizer()
    tokens = tokenize(read_documents(args.data), tokenizer)
    n_eval = min(tokens.numel() // 10, 8 * args.batch_size * args.seq_len)
    train_tokens, eval_tokens = tokens[:tokens.numel() - n_eval], tokens[tokens.numel() - n_eval:]
    print(f"data: {args.data}: {train_tokens.numel():,} training / {eval_tokens.numel():,} held-out tokens; "
          f"{args.steps} steps x {args.grad_accum} x {args.batch_size} x {args.seq_len} tokens on {device}")

    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
    precisions = ("bf16", "fp8") if args.precision == "both" else (args.precision,)
    runs = {p: train(p, args, model_config, tokenizer, train_tokens, eval_tokens, device) for p in precisions}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print_table(runs)
    print_samples(runs)
    plot_losses(runs, out / "loss.png")
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "args": {k: v for k, v in vars(args).items()}, "runs": runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"summary: {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()
