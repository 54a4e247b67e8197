"""Fine-tune a mixture-of-experts language model (Mixtral / Qwen2-MoE / Qwen3-MoE) with FP8 experts.

Runs with no arguments and no network: a small Mixtral-like model initialised locally (on a GPU: hidden 1024, 4
layers, 8 experts of ffn 2048, top-2; without CUDA a tiny one, hidden 64 and 4 experts, whose FP8 GEMMs run on the CPU
reference kernels). --family qwen2_moe / qwen3_moe picks those families' tiny layouts (Qwen2-MoE: a gated shared
expert); --model DIR loads a local Hugging Face checkpoint of one of the three instead.
Data: examples/data/corpus.txt (or --data PATH, a .txt file) through a byte-level tokenizer that needs no download.

The recipe: `convert_model(model)` turns every decoder layer into ours (FP8 attention projections; the sparse MoE
block becomes a LayerNormMoE: router in high precision, token permutation, grouped FP8 expert GEMMs), then every
forward runs inside `fp8_autocast`. The loss is transformers' own: the language-model loss plus
router_aux_loss_coef * the load-balancing loss (output_router_logits=True). Prints the loss, the aux loss and
tokens/s of every step; --save-hf DIR writes the trained model as a plain Hugging Face checkpoint.
Needs transformers.
"""
import argparse
import json
import time
from pathlib import Path

import torch

import transformer_fp8 as te
from transformer_fp8 import recipe
from transformer_fp8.integrations import convert_model

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
VOCAB = 258  # bytes 0..255, BOS 256, EOS 257
# family -> (transformers config class, model class, sizes of the tiny CPU model, of the GPU model)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
                dict(hidden_size=1024, intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, shared_expert_intermediate_size=64),
                  dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704, num_experts=16,
                       num_experts_per_tok=4, shared_expert_intermediate_size=2816)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=16),
                  dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=768, num_experts=16,
                       num_experts_per_tok=4, norm_topk_prob=True, head_dim=64)),
}
LAYERS_AND_HEADS = {"cpu": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                    "cuda": dict(num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4)}
RUN_DEFAULTS = {"cpu": dict(steps=8, batch_size=4, seq_len=64), "cuda": dict(steps=30, batch_size=8, seq_len=1024)}
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}


def positive_int(text: str) -> int:
    """argparse type: an int > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring); device-dependent defaults filled in."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="mixtral", help="the random model's family")
    parser.add_argument("--model", type=Path, help="a local Hugging Face Mixtral / Qwen-MoE checkpoint directory")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a .txt file")
    parser.add_argument("--steps", type=positive_int)
    parser.add_argument("--batch-size", type=positive_int)
    parser.add_argument("--seq-len", type=positive_int)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="delayed")
    parser.add_argument("--aux-loss-coef", type=float, default=0.01, help="router_aux_loss_coef")
    parser.add_argument("--no-fp8", action="store_true", help="the same run without fp8_autocast (for comparison)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-hf", type=Path, help="write the trained model as a Hugging Face checkpoint here")
    parser.add_argument("--summary", type=Path, help="write the run's losses and settings as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.model is not None and not args.model.is_dir():
        parser.error(f"--model {args.model}: not a directory")
    if not args.data.is_file():
        parser.error(f"--data {args.data}: not a file")
    for name, value in RUN_DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def token_stream(path: Path) -> torch.Tensor:
    """The file's UTF-8 bytes as token ids, between BOS and EOS (int64 [n])."""
    data = list(path.read_bytes())
    return torch.tensor([256, *data, 257], dtype=torch.int64)


def batches(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Endless random windows of seq_len tokens, [batch_size, seq_len] each."""
    if tokens.numel() <= seq_len:
        raise ValueError(f"--data: {tokens.numel()} tokens, fewer than --seq-len {seq_len} + 1")
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
        yield torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The Hugging Face model, BF16, on the device: from --model, or random with the family's sizes."""
    import transformers

    if args.model is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    else:
        config_class, model_class, cpu_sizes, gpu_sizes = FAMILIES[args.family]
        sizes = cpu_sizes if args.device == "cpu" else gpu_sizes
        config = getattr(transformers, config_class)(vocab_size=VOCAB, max_position_embeddings=max(args.seq_len, 128),
                                                     router_aux_loss_coef=args.aux_loss_coef,
                                                     **LAYERS_AND_HEADS[args.device], **sizes)
        model = getattr(transformers, model_class)(config)
    model.config.router_aux_loss_coef = args.aux_loss_coef
    return model.to(device=args.device, dtype=torch.bfloat16).train()


def fp8_module_counts(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of each transformer_fp8 class the model holds."""
    counts = {}
    for module in model.modules():
        if type(module).__module__.startswith("transformer_fp8."):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return counts


def train(model: torch.nn.Module, args: argparse.Namespace) -> list[dict]:
    """args.steps AdamW steps; returns each step's loss, aux loss and tokens/s."""
    generator = torch.Generator().manual_seed(args.seed)
    data = batches(token_stream(args.data), args.batch_size, args.seq_len, generator)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    fp8_recipe = RECIPES[args.recipe]()
    history = []
    for step in range(args.steps):
        batch = next(data).to(args.device)
        start = time.perf_counter()
        with te.fp8_autocast(enabled=not args.no_fp8, fp8_recipe=fp8_recipe):
            out = model(input_ids=batch, labels=batch, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss, aux = out.loss.item(), out.aux_loss.item()  # (the step's one host sync, for printing)
        tokens_per_s = batch.numel() / (time.perf_counter() - start)
        history.append(dict(step=step, loss=loss, aux_loss=aux, tokens_per_s=tokens_per_s))
        print(f"step {step:4d}  loss {loss:.4f}  aux {aux:.4f}  {tokens_per_s:,.0f} tokens/s", flush=True)
    return history


def main(argv: list[str] | None = None) -> dict:
    """Run the example (see the module docstring).

    Args:
        argv: command-line arguments (default: sys.argv[1:]).
    Returns:
        The summary: settings, the transformer_fp8 modules of the converted model, and the per-step history.
    """
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = convert_model(build_model(args))
    modules = fp8_module_counts(model)
    print(f"{model.config.model_type}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"transformer_fp8 modules {modules}, FP8 {'off' if args.no_fp8 else args.recipe}", flush=True)
    history = train(model, args)
    if args.save_hf is not None:
        model.save_pretrained(args.save_hf)
        print(f"saved a Hugging Face checkpoint to {args.save_hf}")
    summary = dict(model_type=model.config.model_type, device=args.device, fp8=not args.no_fp8, recipe=args.recipe,
                   steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, fp8_modules=modules,
                   history=history)
    if args.summary is not None:
        args.summary.write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
