"""One AdamW step over the parameters of bench_llama.py's 1.1B Llama (BF16 parameters, gradients and moments, as
bench_llama keeps them): torch.optim.AdamW(fused=True) against our te.FusedAdamW and te.optimizers.FusedAdam
(float32 moments, and float32 master weights), and Transformer Engine's FusedAdam in the same two settings where it
is installed, interleaved rounds (timing.run_rounds).
Prints ms per step (gpu_time_ms: steps back to back between two CUDA events) and the bandwidth it implies: the step
reads parameter, gradient and both moments and writes parameter and both moments, 7 x 2 bytes per parameter (TE's
FusedAdam with float32 moments: 22 bytes; with float32 master weights too: 28, the parameter written only).
Also prints how far apart the two leave the parameters after one step from the same state (||ours - torch's|| /
||torch's||; a BF16 rounding is up to 2**-9 relative).

Run: python benchmarks/bench_optim.py [--rounds 5] [--json out.json]   (--tiny: small shapes, CPU allowed)
"""
import argparse
import json

import torch

try:  # (Transformer Engine's FusedAdam rows where it is installed; imported first: it loads its own libraries)
    from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam
except (ImportError, OSError):
    TEFusedAdam = None

import transformer_fp8 as te  # noqa: E402
from timing import gpu_time_ms, run_rounds

BYTES_PER_PARAMETER = 7 * 2  # (BF16: 4 tensors read, 3 written)


def llama_shapes(tiny: bool) -> list:
    """The parameter shapes of bench_llama's Llama 1.1B (vocab 32000, hidden 2048, MLP 8192, 16 layers, 8 KV heads),
    or of a 2-layer toy."""
    vocab, hidden, mlp, layers, kv = (256, 64, 128, 2, 32) if tiny else (32000, 2048, 8192, 16, 512)
    layer = [(hidden,), (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (hidden,), (mlp, hidden),
             (mlp, hidden), (hidden, mlp)]
    return [(vocab, hidden)] + layer * layers + [(hidden,), (vocab, hidden)]


def make_params(shapes: list, device: str, seed: int = 0, grads: list | None = None) -> list:
    """BF16 parameters of `shapes` with gradients, the same values for the same seed (drawn on `device`: 1.1B
    values a variant take seconds on the GPU, minutes on the CPU).

    Args:
        shapes: the parameters' shapes.
        device: where to make them.
        seed: the generator's seed (the same seed, the same parameters and gradients).
        grads: gradients to share (another call's parameters' .grad, read-only to the optimizers: six variants of
            1.1B parameters fit an 80 GB GPU only with one copy of the gradients); None: drawn here.

    Returns:
        The parameters, each with its .grad set.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for i, shape in enumerate(shapes):
        p = torch.nn.Parameter(torch.randn(shape, generator=g, device=device).to(torch.bfloat16))
        grad = (torch.randn(shape, generator=g, device=device) * 1e-3).to(torch.bfloat16)  # (drawn either way: the
        p.grad = grads[i] if grads is not None else grad  # next parameter's values must not depend on `grads`)
        params.append(p)
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10, help="steps per timed measure")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        raise SystemExit("bench_optim.py: needs a CUDA GPU (or --tiny)")
    shapes = llama_shapes(args.tiny)
    torch_params = make_params(shapes, device)
    grads = [p.grad for p in torch_params]
    our_params = make_params(shapes, device, grads=grads)
    numel = sum(p.numel() for p in torch_params)
    optimizers = {"torch AdamW(fused=True)": torch.optim.AdamW(torch_params, lr=1e-4, fused=device == "cuda"),
                  "te.FusedAdamW": te.FusedAdamW(our_params, lr=1e-4)}
    for optimizer in optimizers.values():  # (one step each from the same state: compare the results)
        optimizer.step()
    diff = torch.stack([(a.float() - b.float()).norm() for a, b in zip(our_params, torch_params)]).norm()
    worst = (diff / torch.stack([b.float().norm() for b in torch_params]).norm()).item()
    optimizers["FusedAdam, f32 moments"] = te.optimizers.FusedAdam(make_params(shapes, device, grads=grads), lr=1e-4,
                                                                   weight_decay=0.01)
    optimizers["FusedAdam, f32 moments+master"] = te.optimizers.FusedAdam(
        make_params(shapes, device, grads=grads), lr=1e-4, weight_decay=0.01, master_weights=True)
    bytes_per_parameter = dict(zip(optimizers, (BYTES_PER_PARAMETER, BYTES_PER_PARAMETER, 22, 28)))
    if TEFusedAdam is not None and device == "cuda":  # (the same two settings, TE 2.x's defaults otherwise)
        optimizers["TE FusedAdam, f32 moments"] = TEFusedAdam(make_params(shapes, device, grads=grads), lr=1e-4,
                                                              weight_decay=0.01)
        optimizers["TE FusedAdam, f32 moments+master"] = TEFusedAdam(make_params(shapes, device, grads=grads),
                                                                     lr=1e-4, weight_decay=0.01, master_weights=True)
        bytes_per_parameter.update({"TE FusedAdam, f32 moments": 22, "TE FusedAdam, f32 moments+master": 28})
    measures = {name: (lambda o=optimizer: gpu_time_ms(o.step, warmup=2, iters=args.iters))
                for name, optimizer in optimizers.items()}
    results = run_rounds(measures, args.rounds)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"AdamW step over {len(shapes)} BF16 tensors, {numel / 1e9:.3f}B parameters, {name}; median (min-max) of "
          f"{args.rounds} interleaved rounds; ours vs torch after one step (relative, by norm): {worst:.2e}")
    for variant, r in results.items():
        ms = r["median"]
        print(f"  {variant:30s} {ms:8.3f} ms ({r['min']:.3f}-{r['max']:.3f})  "
              f"{bytes_per_parameter[variant] * numel / ms / 1e9:6.2f} TB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, parameters=numel, tensors=len(shapes), first_step_max_rel_diff=worst,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
