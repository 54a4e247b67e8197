"""Where an FP8-weight te.Linear's inference call spends its host time (issue 22, target 5): each piece of the call
timed alone, host microseconds per call (timing.host_time_us: calls issued without waiting for the GPU), medians of
interleaved rounds, at one small shape (the L20 grid's host-bound corner).

Pieces: nn.Linear's module call and F.linear (the reference); fp8_autocast's construction + enter + exit alone; our
module's call inside one open autocast; the whole call as a user writes it (one autocast per call); the pybind entry
_C.linear_inference with the arguments the module passes (captured from one call); the two ops it runs, each through
torch.ops (inference_cast, fp8_gemm); torch._scaled_mm of the same FP8 operands; one elementwise launch (x.add_(0)).

Usage: python benchmarks/host_breakdown_inference.py [--m 128 --k 1280 --n 1280] [--rounds 5] [--iters 500]
       [--json out.json]   (CUDA only)
"""
import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformer_fp8 as te  # noqa: E402
from transformer_fp8 import _C, recipe  # noqa: E402
from timing import host_time_us  # noqa: E402


def captured_args(module: torch.nn.Module, x: torch.Tensor, fp8_recipe) -> tuple:
    """The arguments the module passes to _C.linear_inference in one call under `fp8_recipe` (after warm-up calls).

    Args:
        module: an FP8-weight te.Linear. x: its input. fp8_recipe: the autocast's recipe.
    Returns:
        The positional arguments of that call.
    """
    seen = []
    real = _C.linear_inference

    def record(*args):
        seen.append(args)
        return real(*args)

    _C.linear_inference = record
    try:
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            module(x)
    finally:
        _C.linear_inference = real
    if not seen:
        raise RuntimeError("the module did not take its inference path")
    return seen[-1]


def pieces(m: int, k: int, n: int) -> Dict[str, Callable[[], object]]:
    """The timed pieces at [m, k] x [k, n], bfloat16, bias."""
    dtype = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    plain = torch.nn.Linear(k, n, device="cuda", dtype=dtype)
    with te.fp8_model_init():
        ours = te.Linear(k, n, params_dtype=dtype, device="cuda")
    calls: Dict[str, Callable[[], object]] = {
        "nn.Linear module": lambda: plain(x),
        "F.linear": lambda: F.linear(x, plain.weight, plain.bias),
        "x.add_(0) (one launch)": lambda: x.add_(0),
    }
    delayed, current = recipe.DelayedScaling(), recipe.Float8CurrentScaling()
    for name, rec in (("delayed", delayed), ("current", current)):
        for _ in range(3):
            with te.fp8_autocast(fp8_recipe=rec):
                ours(x)
        args = captured_args(ours, x, rec)

        def whole(rec=rec):
            with te.fp8_autocast(fp8_recipe=rec):
                return ours(x)

        def autocast_only(rec=rec):
            with te.fp8_autocast(fp8_recipe=rec):
                pass

        calls[f"{name}: whole call (autocast + module)"] = whole
        calls[f"{name}: autocast alone"] = autocast_only
        calls[f"{name}: _C.linear_inference alone"] = lambda args=args: _C.linear_inference(*args)
    # the ops underneath, with current scaling's arguments
    xq = torch.ops.transformer_fp8.inference_cast(args[0], args[3], args[4], args[5], args[6], True, args[9])
    w, w_si, x_si = args[1], args[2], args[6]
    calls["op inference_cast (current)"] = lambda: torch.ops.transformer_fp8.inference_cast(
        args[0], args[3], args[4], args[5], args[6], True, args[9])
    calls["op fp8_gemm (bias)"] = lambda: torch.ops.transformer_fp8.fp8_gemm(
        xq, x_si, w, w_si, dtype, plain.bias, False, None, None, False)
    calls["torch._scaled_mm (bias)"] = lambda: torch._scaled_mm(
        xq, w.t(), scale_a=x_si, scale_b=w_si, bias=plain.bias, out_dtype=dtype, use_fast_accum=True)
    return calls


def main() -> None:
    """Parse the arguments, time every piece in interleaved rounds, print (and write) the medians."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=128)
    parser.add_argument("--k", type=int, default=1280)
    parser.add_argument("--n", type=int, default=1280)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_breakdown_inference.py: needs CUDA")
    with torch.no_grad():  # (the module takes its inference path only where no gradient is needed)
        calls = pieces(args.m, args.k, args.n)
        samples: Dict[str, list] = {name: [] for name in calls}
        for r in range(args.rounds):
            names = list(calls)
            if r % 2:
                names.reverse()
            for name in names:
                samples[name].append(host_time_us(calls[name], iters=args.iters, warmup=20))
    result = {"device": torch.cuda.get_device_name(), "shape": [args.m, args.k, args.n], "rounds": args.rounds,
              "iters": args.iters, "host_us": {name: statistics.median(v) for name, v in samples.items()},
              "host_us_all": samples}
    print(f"{result['device']}  M,K,N = {args.m},{args.k},{args.n}  bfloat16, host us per call (median of "
          f"{args.rounds} rounds x {args.iters} calls)")
    for name, value in result["host_us"].items():
        spread = f"{min(samples[name]):.1f}-{max(samples[name]):.1f}"
        print(f"  {name:45s} {value:7.2f}  ({spread})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
