"""The workloads of a before/after comparison (benchmarks/ab_compare.py runs this file once per round and per tree).

Measures, with whichever transformer_fp8 is first on sys.path and only its public API (so that two versions of the
library run the same code):
- `linear_host_{delayed,current}_us`: host time of one FP8 te.Linear(1024, 1024) forward+backward at 128 tokens (the
  small-shape automatic path off; delayed runs the C++ node, current the autograd Function): the per-call Python and
  dispatch cost a refactor can add;
- GPU time per forward+backward (CUDA events around back-to-back calls) of te.Linear 8192x4096->4096,
  te.LayerNormMLP 8192x4096 (ffn 16384) and the performance guide's te.TransformerLayer (hidden 4096, ffn 16384,
  32 heads, seq 2048 x batch 4, fp16), each under DelayedScaling and Float8CurrentScaling.
Prints one JSON object {workload: value} on the last line of stdout (and writes it with --json).
"""
import argparse
import json
import sys
from typing import Callable, Dict

import torch

import transformer_fp8 as te
from transformer_fp8 import recipe
from timing import gpu_time_ms, host_time_us

RECIPES = {"delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling()}


def train_step(model: torch.nn.Module, x: torch.Tensor, fp8_recipe) -> Callable[[], None]:
    """gradients set to None, forward under fp8_autocast(fp8_recipe) and backward of a fixed upstream gradient.

    Args:
        model: the module. x: its input (a leaf that requires grad is made from it). fp8_recipe: the recipe.
    Returns:
        the step, a function of no arguments.
    """
    xi = x.detach().clone().requires_grad_()
    with torch.no_grad():
        dy = torch.randn_like(model(xi))

    def step() -> None:
        model.zero_grad(set_to_none=True)  # (as optimizer.zero_grad leaves them: no accumulation adds timed)
        xi.grad = None
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out = model(xi)
        out.backward(dy)
    return step


def modules(dtype: torch.dtype) -> Dict[str, tuple]:
    """{name: (module factory, input)} of the GPU-time workloads."""
    dev = "cuda"
    return {
        "linear_8192x4096x4096": (lambda: te.Linear(4096, 4096, params_dtype=dtype, device=dev),
                                  torch.randn(8192, 4096, device=dev, dtype=dtype)),
        "layernorm_mlp_8192x4096x16384": (lambda: te.LayerNormMLP(4096, 16384, params_dtype=dtype, device=dev),
                                          torch.randn(8192, 4096, device=dev, dtype=dtype)),
        "guide_layer_h4096_s2048_b4": (
            lambda: te.TransformerLayer(4096, 16384, 32, hidden_dropout=0.0, attention_dropout=0.0,
                                        params_dtype=torch.float16, device=dev),
            torch.randn(2048, 4, 4096, device=dev, dtype=torch.float16)),
    }


def measure(only_host: bool = False, device: str = "cuda") -> Dict[str, float]:
    """Args:
        only_host: measure the linear_host_* workloads only.
        device: "cuda"; "cpu" for the host workloads at 16 x 64 -> 64 on the CPU reference kernels (the same
            kernels in both trees); "meta" for them on meta tensors (the ops' fake kernels: no kernel work at all, so
            what is timed is the modules' Python and the dispatcher, the part a refactor changes).
    Returns:
        {workload: value}: µs for the linear_host_* ones, ms per forward+backward for the others."""
    te.set_fp8_min_gemm_size(0)
    torch.manual_seed(0)
    result = {}
    tokens, width = (128, 1024) if device == "cuda" else (16, 64)
    x_small = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    for recipe_name, fp8_recipe in RECIPES.items():  # (delayed: the C++ node; current: the autograd Function)
        small = te.Linear(width, width, params_dtype=torch.bfloat16, device=device)
        step = train_step(small, x_small, fp8_recipe)
        for _ in range(20):
            step()
        # at this size the host is slower than the GPU's kernels, so the launch queue never fills: the median of 9
        # samples of 100 calls each (short bursts from an idle GPU varied 300-535 µs between processes)
        host = [host_time_us(step, iters=100, warmup=5) for _ in range(9)]
        result[f"linear_host_{recipe_name}_us"] = round(sorted(host)[len(host) // 2], 1)
    if only_host or device != "cuda":
        return result
    for name, (factory, x) in modules(torch.bfloat16).items():
        for recipe_name, fp8_recipe in RECIPES.items():
            model = factory()
            result[f"{name}_{recipe_name}_ms"] = round(gpu_time_ms(train_step(model, x, fp8_recipe), warmup=5,
                                                                   iters=20, repeats=3), 4)
            del model
            torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--only-host", action="store_true", help="only the Linear host times")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu", "meta"],
                        help="cpu / meta: the host workloads only, on the CPU reference / fake kernels")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("ab_workloads.py needs a CUDA GPU (or --device cpu)")
    result = {"library": te.__file__, **measure(args.only_host, args.device)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
