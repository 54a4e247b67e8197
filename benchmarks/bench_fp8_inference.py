"""Small FP8 Linears in inference (issue 22, target 5): te.Linear with FP8 weights (fp8_model_init), under
torch.no_grad(), ONE `with fp8_autocast(enabled=True, fp8_recipe=...)` per call as a user writes it, on the L20 grid
(M 128 and 512; K, N each of 1280, 5120, 20480; float16 and bfloat16 activations), against nn.Linear.

Variants (all under torch.no_grad(), the same shapes, dtype and bias):
  ours-new       te.Linear through its inference path (module.linear.INFERENCE_PATH = True: one call of the op
                 fp8_linear_inference, csrc/linear_inference.cpp: two launches, the input's cast with its scaling
                 bookkeeping (op inference_cast: current scaling's amax and scale, delayed scaling's update of the
                 module's state) and the GEMM)
  ours-exit      (delayed only) the same path with module.linear.INLINE_UPDATE = False: the state queued for the
                 update at the autocast's exit (the fused update launched from Python there), as before the inline
                 update: its gain, measured in the same run
  ours-old       the same module through the autograd Function's path (INFERENCE_PATH = False, set around each call
                 of the variant): the gain of the new path, measured in the same run
  nn-linear      torch.nn.Linear of the activation dtype, eager
  nn-compile     the same nn.Linear's F.linear under torch.compile(dynamic=True) (one compilation per dtype)
  scaled-mm      torch._scaled_mm of an input already in FP8 and the weight's FP8 data (fast accumulation, bias in the
                 epilogue): the GEMM alone, no cast, no module: a lower bound for the FP8 path
  te             Transformer Engine's te.Linear under its fp8_model_init and fp8_autocast, if installed (skipped
                 otherwise)
  ours-graph     (GPU time only) ours-new's call, fp8_autocast included, captured in a CUDA graph and replayed
                 (timing.graph_time_ms): what the GPU does per call with no host work. A user graphs an inference
                 call with torch.cuda.graph / torch.cuda.make_graphed_callables on the same callable (our
                 make_graphed_callables graphs forward+backward pairs and replays them with grad mode on only).
                 (Captured, the op's cast runs as its op sequence unless TFP8_INFERENCE_CAPTURE=kernel: see
                 csrc/quantize_inference_binding.cpp.)
Measures per variant and point, in interleaved rounds (timing.run_rounds: a new seeded order each round):
  time per call as the user sees it: `--iters` calls back to back between two CUDA events (timing.gpu_time_ms),
  ms per call; host time per call (timing.host_time_us: the calls issued without waiting for the GPU), µs.
Ratios: the variant's median time per call / nn-linear's (same dtype); the targets are <= 1.5 at every point and
<= 1.0 where M*K*N >= 5e10.

Usage: python benchmarks/bench_fp8_inference.py [--recipes delayed,current] [--dtypes float16,bfloat16]
       [--rounds 3] [--iters 100] [--json out.json] [--quick]  (--quick: M 128, K, N 1280/5120, one round: a smoke
       run; on a machine without CUDA the script runs the CPU reference kernels at a tiny size, to check itself)
"""
import argparse
import contextlib
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformer_fp8 as te  # noqa: E402
from transformer_fp8 import recipe  # noqa: E402
from transformer_fp8.module import linear as linear_module  # noqa: E402
from timing import fmt_spread, gpu_time_ms, graph_time_ms, host_time_us, run_rounds  # noqa: E402

RECIPES = {"delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling()}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
GRID_M, GRID_KN = (128, 512), (1280, 5120, 20480)
BIG_WORK = 5e10  # M*K*N from which the target is <= 1.0x nn.Linear


def te_available() -> bool:
    """Returns:
        Whether Transformer Engine's PyTorch API imports (it is not installed on the device by default)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001  (missing, or installed without its libraries: skipped either way)
        return False
    return True


@contextlib.contextmanager
def module_flag(name: str, enabled: bool):
    """module.linear's flag `name` (INFERENCE_PATH, INLINE_UPDATE) set to `enabled` inside, restored after."""
    saved = getattr(linear_module, name)
    setattr(linear_module, name, enabled)
    try:
        yield
    finally:
        setattr(linear_module, name, saved)


def variants_for(m: int, k: int, n: int, dtype: torch.dtype, fp8_recipe, device: str,
                 compiled: Dict[torch.dtype, Callable], with_te: bool) -> Dict[str, Callable[[], object]]:
    """The calls of one grid point: {variant: a function of no arguments doing one call as its user would}.

    Args:
        m, k, n: x [m, k] @ W [n, k]ᵀ + b. dtype: the activations' (and nn.Linear's) dtype. fp8_recipe: ours' recipe.
        device: "cuda" (or "cpu" for a smoke run). compiled: dtype -> the torch.compile'd F.linear (filled here).
        with_te: add the Transformer Engine variant.
    Returns:
        {variant: call}.
    """
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype)
    with te.fp8_model_init(enabled=True):
        ours = te.Linear(k, n, params_dtype=dtype, device=device)
    plain = torch.nn.Linear(k, n, device=device, dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(ours.weight.dequantize())
        plain.bias.copy_(ours.bias)

    def ours_call():
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            return ours(x)

    def ours_old_call():
        with module_flag("INFERENCE_PATH", False):
            return ours_call()

    def ours_exit_call():
        with module_flag("INLINE_UPDATE", False):
            return ours_call()

    if dtype not in compiled:
        # (one compiled function per dtype, dynamic shapes; both dtypes' graphs count against one code object's
        # recompile limit, 8 by default, which the grid's shapes would pass: raised so that no point falls back)
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
        compiled[dtype] = torch.compile(lambda a, w, b: F.linear(a, w, b), dynamic=True)
    linear_compiled = compiled[dtype]
    calls = {"ours-new": ours_call, "ours-old": ours_old_call, "nn-linear": lambda: plain(x),
             "nn-compile": lambda: linear_compiled(x, plain.weight, plain.bias)}
    if isinstance(fp8_recipe, recipe.DelayedScaling):
        calls["ours-exit"] = ours_exit_call
    if device == "cuda":
        w_data, w_scale_inv = ours.weight._data, ours.weight._scale_inv
        x_scale_inv = (x.abs().amax().float() / 448.0).reshape(())
        x_fp8 = (x.float() / x_scale_inv).to(torch.float8_e4m3fn)
        w_scale = w_scale_inv.reshape(())
        calls["scaled-mm"] = lambda: torch._scaled_mm(x_fp8, w_data.t(), x_scale_inv, w_scale, bias=plain.bias,
                                                      out_dtype=dtype, use_fast_accum=True)
    if with_te:
        calls["te"] = te_linear_call(x, k, n, dtype, fp8_recipe)
    return calls


def te_linear_call(x: torch.Tensor, k: int, n: int, dtype: torch.dtype, fp8_recipe) -> Callable[[], object]:
    """Transformer Engine's te.Linear with FP8 weights, one fp8_autocast per call (its recipe of the same kind).

    Args:
        x: the input. k, n: in and out features. dtype: params_dtype. fp8_recipe: ours (delayed or current).
    Returns:
        The call.
    """
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as tep
    their_recipe = te_recipe.DelayedScaling() if isinstance(fp8_recipe, recipe.DelayedScaling) else \
        te_recipe.Float8CurrentScaling()
    with tep.fp8_model_init(enabled=True, recipe=their_recipe):
        module = tep.Linear(k, n, params_dtype=dtype, device="cuda")

    def call():
        with tep.fp8_autocast(enabled=True, fp8_recipe=their_recipe):
            return module(x)
    return call


def measure_point(calls: Dict[str, Callable[[], object]], rounds: int, iters: int, seed: int,
                  with_graph: bool) -> Dict[str, dict]:
    """Every variant's time per call (ms) and host time per call (µs), interleaved in rounds.

    Args:
        calls: variants_for's. rounds, iters: per measure. seed: run_rounds' order. with_graph: add ours-graph.
    Returns:
        {variant: {"time_ms": spread, "host_us": spread}} (ours-graph: time_ms only).
    """
    measures = {}
    for name, call in calls.items():
        measures[f"{name}|time_ms"] = lambda call=call: gpu_time_ms(call, warmup=5, iters=iters)
        measures[f"{name}|host_us"] = lambda call=call: host_time_us(call, iters=iters, warmup=5)
    if with_graph:
        ours = calls["ours-new"]
        measures["ours-graph|time_ms"] = lambda: graph_time_ms(ours, calls=20, warmup=3, repeats=3)
    with torch.no_grad():
        for call in calls.values():  # (first calls: compilation, cuBLASLt plans, the delayed scales' first update)
            for _ in range(3):
                call()
        stats = run_rounds(measures, rounds, seed=seed)
    result: Dict[str, dict] = {}
    for key, value in stats.items():
        name, what = key.split("|")
        result.setdefault(name, {})[what] = value
    return result


def grid(quick: bool, device: str) -> List[tuple]:
    """The (m, k, n) points: the L20 grid, or a smoke subset (--quick), or tiny CPU shapes without CUDA."""
    if device != "cuda":
        return [(16, 64, 32)]
    if quick:
        return [(128, k, n) for k in GRID_KN[:2] for n in GRID_KN[:2]]
    return [(m, k, n) for m in GRID_M for k in GRID_KN for n in GRID_KN]


def ratio(point: Dict[str, dict], name: str) -> float | None:
    """The variant's median time per call / nn-linear's, or None."""
    try:
        return point[name]["time_ms"]["median"] / point["nn-linear"]["time_ms"]["median"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def paired_ratio(point: Dict[str, dict], name: str) -> float | None:
    """The median over the rounds of the variant's time / nn-linear's in the same round, or None: a round where the
    host slowed moves both sides of its own ratio, where it can split the two medians of `ratio`."""
    try:
        pairs = zip(point[name]["time_ms"]["rounds"], point["nn-linear"]["time_ms"]["rounds"])
        return statistics.median(ours / ref for ours, ref in pairs)
    except (KeyError, TypeError, ZeroDivisionError, statistics.StatisticsError):
        return None


def print_table(rows: List[dict]) -> None:
    """One line per point and variant: time per call, host time, ratio to nn-linear."""
    print(f"{'recipe':8} {'dtype':9} {'M':>4} {'K':>6} {'N':>6} {'variant':11} {'ms/call (min-max)':>24} "
          f"{'host µs (min-max)':>24} {'/nn':>6}")
    for row in rows:
        for name, stats in row["variants"].items():
            r = ratio(row["variants"], name)
            host = fmt_spread(stats["host_us"], 1) if "host_us" in stats else "-"
            print(f"{row['recipe']:8} {row['dtype']:9} {row['m']:>4} {row['k']:>6} {row['n']:>6} {name:11} "
                  f"{fmt_spread(stats['time_ms'], 4):>24} {host:>24} {'' if r is None else f'{r:.2f}':>6}")


def summary(rows: List[dict]) -> Dict[str, object]:
    """Worst ratios of ours-new, ours-exit and ours-old over the grid, and the points missing the targets."""
    out: Dict[str, object] = {}
    for name in ("ours-new", "ours-exit", "ours-old"):
        ratios = [(ratio(r["variants"], name), r) for r in rows]
        ratios = [(x, r) for x, r in ratios if x is not None]
        if not ratios:
            continue
        misses = [f"{r['recipe']} {r['dtype']} {r['m']}x{r['k']}x{r['n']}: {x:.2f}" for x, r in ratios
                  if x > 1.5 or (r["m"] * r["k"] * r["n"] >= BIG_WORK and x > 1.0)]
        paired = [(paired_ratio(r["variants"], name), r) for r in rows]
        paired = [(x, r) for x, r in paired if x is not None]
        paired_misses = [f"{r['recipe']} {r['dtype']} {r['m']}x{r['k']}x{r['n']}: {x:.2f}" for x, r in paired
                         if x > 1.5 or (r["m"] * r["k"] * r["n"] >= BIG_WORK and x > 1.0)]
        out[name] = {"worst_ratio": round(max(x for x, _ in ratios), 3),
                     "best_ratio": round(min(x for x, _ in ratios), 3), "target_misses": misses,
                     "worst_paired_ratio": round(max(x for x, _ in paired), 3) if paired else None,
                     "paired_target_misses": paired_misses}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="delayed,current", help="comma-separated: delayed, current")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated: float16, bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=100, help="calls per measure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke subset of the grid, one round")
    parser.add_argument("--no-compile", action="store_true", help="skip the nn-compile variant")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    te.set_fp8_min_gemm_size(0)
    with_te = device == "cuda" and te_available()
    rounds = 1 if args.quick else args.rounds
    compiled: Dict[torch.dtype, Callable] = {}
    rows: List[dict] = []
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "te_installed": with_te, "rounds": rounds, "iters": args.iters}

    def write_json() -> None:  # (after every point: a run cut short keeps what it measured)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({**info, "summary": summary(rows), "rows": rows}, f, indent=1)
    # (shapes outermost, smallest first: a run cut short keeps every recipe and dtype of the shapes it reached)
    for m, k, n in grid(args.quick, device):
        for dtype_name in args.dtypes.split(","):
            for recipe_name in args.recipes.split(","):
                calls = variants_for(m, k, n, DTYPES[dtype_name], RECIPES[recipe_name], device, compiled, with_te)
                if args.no_compile:
                    calls.pop("nn-compile")
                point = measure_point(calls, rounds, args.iters, args.seed, device == "cuda")
                rows.append({"recipe": recipe_name, "dtype": dtype_name, "m": m, "k": k, "n": n, "variants": point})
                write_json()
                del calls
                if device == "cuda":
                    torch.cuda.empty_cache()
    print(f"device: {info['device']}, torch {info['torch']}, Transformer Engine: "
          f"{'yes' if with_te else 'not installed (skipped)'}")
    print_table(rows)
    print(json.dumps(summary(rows), indent=1))
    write_json()


if __name__ == "__main__":
    main()
