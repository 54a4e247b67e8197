"""Where the host time of a small FP8-weight Linear's inference call goes (issue 22, target 5): the whole call as
bench_fp8_inference.py times it, then its pieces one at a time, each issued --iters times without waiting for the GPU
(timing.host_time_us), all pieces interleaved in --rounds rounds in a seeded new order (timing.run_rounds), medians.

Pieces (one shape, M x K x N, bfloat16, bias; the weight from fp8_model_init):
  nn.Linear                   torch.nn.Linear's call (the baseline)
  F.linear                    its functional call alone
  ours <recipe>               `with fp8_autocast(...): lin(x)` under no_grad (the benchmark's ours-new)
  ours <recipe>, exit update  the same with module.linear.INLINE_UPDATE = False (delayed: the update at the exit)
  module in one autocast      lin(x) with the autocast entered once outside the loop (no enter / exit per call)
  autocast enter+exit         an empty `with fp8_autocast(...)` (current scaling: nothing to update)
  _C.linear_inference         the op's typed entry with the module's arguments (no module, no autocast)
  inference_cast              the op's cast alone (torch.ops), current / delayed without and with the update
  fp8_gemm                    the op's GEMM alone (torch.ops)
  _scaled_mm                  torch._scaled_mm of the same FP8 operands (fast accumulation, bias)
  torch.empty                 one small allocation
Usage: python benchmarks/inference_host_breakdown.py [--shape 128,1280,1280] [--rounds 5] [--iters 200]
       [--json out.json]   (without CUDA: the CPU reference kernels at a tiny shape, a smoke test of the script)
"""
import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformer_fp8 as te  # noqa: E402
from transformer_fp8 import _C, recipe  # noqa: E402
from transformer_fp8.module import linear as linear_module  # noqa: E402
from transformer_fp8.ops import tfp8  # noqa: E402
from transformer_fp8.quantization import Role  # noqa: E402
from transformer_fp8.quantization.state import ScalingState  # noqa: E402
from timing import fmt_spread, host_time_us, run_rounds  # noqa: E402


def pieces(m: int, k: int, n: int, device: str) -> Dict[str, Callable[[], object]]:
    """{piece: a call of no arguments} for one shape (see the module docstring).

    Args:
        m, k, n: x [m, k] @ W [n, k]ᵀ + b. device: "cuda" (or "cpu" for a smoke run).
    Returns:
        The calls.
    """
    dtype, e4 = torch.bfloat16, torch.float8_e4m3fn
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype)
    with te.fp8_model_init(enabled=True):
        lins = {name: te.Linear(k, n, params_dtype=dtype, device=device) for name in ("delayed", "current")}
    plain = torch.nn.Linear(k, n, device=device, dtype=dtype)
    recipes = {"delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling()}
    calls: Dict[str, Callable[[], object]] = {"nn.Linear": lambda: plain(x),
                                              "F.linear": lambda: F.linear(x, plain.weight, plain.bias)}
    for name, lin in lins.items():
        def call(lin=lin, r=recipes[name]):
            with te.fp8_autocast(enabled=True, fp8_recipe=r):
                return lin(x)

        def exit_update(call=call):
            linear_module.INLINE_UPDATE = False
            try:
                return call()
            finally:
                linear_module.INLINE_UPDATE = True
        calls[f"ours {name}"] = call
        if name == "delayed":
            calls[f"ours {name}, exit update"] = exit_update
        for _ in range(3):  # (the delayed state calibrated; the recipe adopted)
            call()
    lin = lins["current"]
    current_autocast = te.fp8_autocast(enabled=True, fp8_recipe=recipes["current"])

    # (the autocast entered once around the measure's whole loop: see measures())
    calls["module in one autocast (current)"] = lambda: lin(x)

    def empty_autocast():
        with te.fp8_autocast(enabled=True, fp8_recipe=recipes["current"]):
            pass
    calls["autocast enter+exit"] = empty_autocast
    q = lin.quantizers._quantizers[Role.INPUT]
    fwd, slot = q.state, q.slot
    w = lin.weight
    calls["_C.linear_inference (current)"] = lambda: _C.linear_inference(
        x, w._data, w._scale_inv, fwd.scales[slot], e4, fwd.amaxes[slot], fwd.scale_inv_slots[slot], lin.bias, True,
        448.0, None, None, None, None, 0.0, True)
    calls["inference_cast current"] = lambda: tfp8.inference_cast(x, fwd.scales[slot], e4, fwd.amaxes[slot],
                                                                  fwd.scale_inv_slots[slot], True, 448.0)
    scratch = [torch.ones(1, device=device), torch.zeros(1, device=device), torch.ones(1, device=device)]
    calls["inference_cast delayed"] = lambda: tfp8.inference_cast(x, scratch[0], e4, scratch[1], scratch[2], False,
                                                                  448.0)
    state = ScalingState(3, 1024, device)  # (TE's default history length)
    state_args = state.inline_update_args(recipes["delayed"])[:4]
    calls["inference_cast delayed + update"] = lambda: tfp8.inference_cast(
        x, state.scales[0], e4, state.amaxes[0], scratch[2], False, 448.0, *state_args, 0.0, "max")
    xq = tfp8.inference_cast(x, scratch[0], e4, scratch[1], scratch[2], False, 448.0)
    calls["fp8_gemm"] = lambda: tfp8.fp8_gemm(xq, scratch[2], w._data, w._scale_inv, dtype, lin.bias)
    if device == "cuda":
        calls["_scaled_mm"] = lambda: torch._scaled_mm(xq, w._data.t(), scratch[2].reshape(()),
                                                       w._scale_inv.reshape(()), bias=plain.bias, out_dtype=dtype,
                                                       use_fast_accum=True)
    calls["torch.empty"] = lambda: torch.empty(1, device=device)
    calls["_autocast_for_module"] = current_autocast  # (not a piece: the context measures() enters)
    return calls


def measures(calls: Dict[str, Callable[[], object]], iters: int) -> Dict[str, Callable[[], float]]:
    """{piece: a measure returning host µs per call}; the one-autocast piece runs inside the autocast."""
    autocast = calls.pop("_autocast_for_module")
    out = {}
    for name, call in calls.items():
        if name.startswith("module in one autocast"):
            def measure(call=call):
                with autocast:
                    return host_time_us(call, iters=iters, warmup=10)
        else:
            def measure(call=call):
                return host_time_us(call, iters=iters, warmup=10)
        out[name] = measure
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="128,1280,1280", help="M,K,N")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m, k, n = (int(v) for v in args.shape.split(",")) if device == "cuda" else (16, 64, 32)
    te.set_fp8_min_gemm_size(0)
    with torch.no_grad():
        stats = run_rounds(measures(pieces(m, k, n, device), args.iters), args.rounds)
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "shape": [m, k, n], "rounds": args.rounds, "iters": args.iters}
    print(f"device: {info['device']}, torch {info['torch']}, M,K,N = {m},{k},{n}; host µs per call, median (min-max)")
    for name, s in stats.items():
        print(f"  {name:40} {fmt_spread(s, 2) if 'median' in s else s}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**info, "pieces": stats}, f, indent=1)


if __name__ == "__main__":
    main()
