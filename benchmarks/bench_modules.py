"""FP8 modules vs their BF16 PyTorch equivalents on one GPU, in one run. Every table's variants are measured in turn,
round after round (a seeded new order each round: timing.run_rounds), so that the GPU clock's drift under its power
cap and the host's speed drift land on all of them alike; tables print the median and the range over the rounds, and
the JSON keeps every round's value.

1. Training: Linear / LayerNormLinear / LayerNormMLP forward+backward time and peak memory at M = 8192 tokens,
   (hidden, ffn) = (4096, 16384) and (2048, 8192); ours in FP8 (DelayedScaling, HYBRID) vs torch BF16 eager and
   torch.compile. Each step starts with the gradients set to None (zero_grad(set_to_none=True), as a training loop
   does), so no accumulation adds are timed and the memory is that of a real step. Time: GPU time per step, CUDA
   events around 10 steps back to back (timing.gpu_time_ms), per round; and, where the step can be captured, the
   same step replayed from a CUDA graph (timing.graph_time_ms, "graph" variants of the same rounds): a step whose
   back-to-back time exceeds its graph time by more than 10% is flagged host-bound (timing.host_bound). Peak GiB
   above what was allocated before.
2. Inference grid: forward under no_grad with cached FP8 weights (is_first_microbatch=False), M in {128, 256, 512},
   K, N in {1280, 5120, 10240, 20480}, vs BF16 nn.Linear: the FP8 path forced (fp8_min_gemm_size=0) and the default
   (small-shape automatic path: high precision below base.FP8_MIN_GEMM_SIZE). Time per call of 100 back-to-back calls
   inside one no_grad + fp8_autocast context, as in a model's forward; the variants timed in turn over --grid-rounds
   rounds, the median time of each and the median of the per-round ratios reported. A second nn.Linear of the same
   shape is timed with them as a control: its ratio to the first is the measurement's noise at that point. Each
   point's calls are also replayed from a CUDA graph once after the rounds: a back-to-back time more than 10% above
   it is flagged host-bound (most points below M·K·N ~ 1e10 are: there the ratio compares host paths).
3. Host (CPU) time of one Linear forward+backward at a tiny shape vs nn.Linear, the FP8 path forced; --native-node-ab
   adds our Linear with its C++ autograd node switched off (linear.NATIVE_NODE = False) as a variant of the same rounds.
4. Host time per forward call at 128x1280x1280 under no_grad + fp8_autocast (--rounds rounds of 1000 calls):
   nn.Linear, ours (with and without is_first_microbatch=False) and F.linear alone.
Prints tables and writes JSON (--json).
Usage: python benchmarks/bench_modules.py [--rounds 7] [--grid-rounds 21] [--skip training inference host host-call]
       python benchmarks/bench_modules.py --device cpu --tiny --rounds 2 --grid-rounds 2  (a smoke test of the script)
"""
import argparse
import json
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

import transformer_fp8 as te
from timing import (fmt_spread, gpu_time_ms, graph_capture_error, graph_time_ms, host_bound, host_time_us,
                    interleaved, loop_time_ms, peak_gib, run_rounds, spread)
from transformer_fp8 import recipe
from transformer_fp8.module import base
from transformer_fp8.module import linear as linear_module
from transformer_fp8.quantization import update

DEV = "cuda"  # (main sets it from --device; the functions read it when called)
DT = torch.bfloat16
TINY = dict(training_sizes=((64, 128),), training_tokens=32, grid_sizes=(64, 128), grid_m=(16,),
            host_call_shape=(16, 64, 64))  # --tiny: the script's paths at sizes a CPU runs in seconds


class TorchLayerNormMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


def module_pairs(hidden, ffn):
    """(name, ours, torch BF16 equivalent) at one size."""
    kw = dict(params_dtype=DT, device=DEV)
    return [
        ("Linear", te.Linear(hidden, ffn, **kw), nn.Linear(hidden, ffn, device=DEV, dtype=DT)),
        ("LayerNormLinear", te.LayerNormLinear(hidden, ffn, **kw),
         nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, ffn)).to(DEV, DT)),
        ("LayerNormMLP", te.LayerNormMLP(hidden, ffn, **kw), TorchLayerNormMLP(hidden, ffn).to(DEV, DT)),
    ]


def train_step(module, x, dy, fp8, fp8_recipe=recipe.DelayedScaling()):
    """One training step of `module`: gradients set to None first (module's and the input's, as
    optimizer.zero_grad(set_to_none=True) and a fresh batch would leave them), forward (under fp8_autocast when fp8),
    backward of dy."""
    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
            y = module(x)
        y.backward(dy)
    return step


TRAINING_SIZES = ((4096, 16384), (2048, 8192))  # (hidden, ffn)


def bench_training(rounds, tokens=8192, sizes=TRAINING_SIZES, compile_torch=True):
    """The training table: per size and module, ours FP8 / BF16 eager / BF16 compiled in interleaved rounds, each
    also replayed from a CUDA graph where capturable (the host-bound flag). Returns the rows."""
    rows = []
    for hidden, ffn in sizes:
        for name, ours, ref in module_pairs(hidden, ffn):
            x = torch.randn(tokens, hidden, device=DEV, dtype=DT, requires_grad=True)
            out_features = ours(x.detach()).shape[-1]
            dy = torch.randn(tokens, out_features, device=DEV, dtype=DT)
            compiled = torch.compile(ref) if compile_torch else None
            cases = {
                "fp8": train_step(ours, x, dy, True),
                "bf16_eager": train_step(ref, x, dy, False),
            }
            if compiled is not None:
                cases["bf16_compile"] = train_step(compiled, x, dy, False)
            row = {"module": name, "tokens": tokens, "hidden": hidden, "ffn": ffn}
            for case, fn in cases.items():  # (memory is not timing: once each; also the compile and the warm-up)
                row[f"{case}_gib"] = round(peak_gib(fn), 3)
            measures = {case: (lambda fn=fn: gpu_time_ms(fn, warmup=2, iters=10)) for case, fn in cases.items()}
            for case, fn in cases.items():  # (the same step from a CUDA graph, in the same rounds, where capturable)
                row[f"{case}_graph_error"] = graph_capture_error(fn)
                if row[f"{case}_graph_error"] is None:
                    measures[f"{case}_graph"] = lambda fn=fn: graph_time_ms(fn, calls=3, warmup=1, repeats=3)
            times = run_rounds(measures, rounds, seed=hidden)
            for case in cases:
                row[f"{case}_ms"] = times[case]
                graph = times.get(f"{case}_graph", {})
                row[f"{case}_graph_ms"] = graph if graph else None
                row[f"{case}_host_bound"] = host_bound(times[case].get("median"), graph.get("median"))
            if all("error" not in times[c] for c in cases):
                ratios = {ref_case: spread([r / f for r, f in zip(times[ref_case]["rounds"], times["fp8"]["rounds"])])
                          for ref_case in cases if ref_case != "fp8"}  # per-round ratios: drift cancels
                row["speedup_vs_eager"] = ratios["bf16_eager"]
                row["speedup_vs_compile"] = ratios.get("bf16_compile")
                print(f"{name:16s} M={tokens} h={hidden} ffn={ffn}: " + " | ".join(
                    f"{case} {fmt_spread(times[case], 3)} ms{' HOST-BOUND' if row[f'{case}_host_bound'] else ''}, "
                    f"graph {fmt_spread(row[f'{case}_graph_ms'], 3) if row[f'{case}_graph_ms'] else 'n/a'} ms, "
                    f"{row[f'{case}_gib']:.2f} GiB" for case in cases) + " | " + " / ".join(
                    f"x{fmt_spread(r)} vs {case}" for case, r in ratios.items()), flush=True)
            else:
                print(f"{name:16s} h={hidden}: " + "; ".join(f"{c} {fmt_spread(times[c], 3)}" for c in cases),
                      flush=True)
            rows.append(row)
            del ours, ref, compiled, cases
            if DEV == "cuda":
                torch.cuda.empty_cache()
    return rows


def median_ratio(times, ref_times):
    """Median over the rounds of the per-round time ratio."""
    return statistics.median(t / r for t, r in zip(times, ref_times))


def ratio_range(times, ref_times):
    """[min, max] over the rounds of the per-round time ratio."""
    ratios = [t / r for t, r in zip(times, ref_times)]
    return [round(min(ratios), 3), round(max(ratios), 3)]


# Rounds per grid point: most points are host-bound calls of 17-100 µs whose per-round ratios move by ~10% (the A/A
# column shows it); the median of 21 rounds moves ~sqrt(3) less than the median of 7.
GRID_ROUNDS = 21


def grid_graph_ms(call):
    """GPU time per call of one inference-grid call replayed from a CUDA graph (10 calls a graph, median of 5
    replays), or None where it cannot be captured (or without CUDA): the grid's host-bound flag compares with it."""
    if graph_capture_error(call) is not None:
        return None
    return graph_time_ms(call, calls=10, warmup=2, repeats=5)


def bench_inference_grid(rounds=GRID_ROUNDS, sizes=(1280, 5120, 10240, 20480), m_values=(128, 256, 512)):
    """The inference grid (no_grad, cached FP8 weights): per (M, K, N), ours FP8 forced, ours default and nn.Linear
    (and a control nn.Linear) in interleaved rounds. Returns the rows."""
    rows = []
    for k in sizes:
        for n in sizes:
            forced = te.Linear(k, n, params_dtype=DT, device=DEV, fp8_min_gemm_size=0)
            auto = te.Linear(k, n, params_dtype=DT, device=DEV)
            ref = nn.Linear(k, n, device=DEV, dtype=DT)
            twin = nn.Linear(k, n, device=DEV, dtype=DT)  # (an A/A control: how far two identical layers' ratio moves)
            for m in m_values:
                x = torch.randn(m, k, device=DEV, dtype=DT)

                def fwd(module, **kwargs):
                    return lambda: module(x, **kwargs)

                for module in (forced, auto):
                    with torch.no_grad(), te.fp8_autocast():
                        module(x, is_first_microbatch=True)
                # As in a model's forward, one no_grad + fp8_autocast context covers many layer calls (nn.Linear
                # ignores it). The four are timed in turn, round after round, in a new seeded order each round: the
                # host speed drifts, and at the host-bound points a drift between two separate measurements would
                # read as a ratio.
                calls = [fwd(forced, is_first_microbatch=False), fwd(auto, is_first_microbatch=False), fwd(ref),
                         fwd(twin)]
                with torch.no_grad(), te.fp8_autocast():
                    t_fp8, t_auto, t_bf16, t_twin = interleaved(
                        lambda fn: loop_time_ms(fn, warmup=5, iters=100, repeats=1), calls, rounds, shuffle=True,
                        seed=m * k * n)
                    graph_fp8, graph_auto, graph_bf16 = (grid_graph_ms(fn) for fn in calls[:3])
                rows.append({"M": m, "K": k, "N": n, "MKN": m * k * n, "fp8_ms": statistics.median(t_fp8),
                             "auto_ms": statistics.median(t_auto), "bf16_ms": statistics.median(t_bf16),
                             "fp8_spread_ms": spread(t_fp8), "auto_spread_ms": spread(t_auto),
                             "bf16_spread_ms": spread(t_bf16),
                             "ratio": median_ratio(t_fp8, t_bf16), "auto_ratio": median_ratio(t_auto, t_bf16),
                             "control_ratio": median_ratio(t_twin, t_bf16),
                             "fp8_graph_ms": graph_fp8, "auto_graph_ms": graph_auto, "bf16_graph_ms": graph_bf16,
                             "fp8_host_bound": host_bound(statistics.median(t_fp8), graph_fp8),
                             "auto_host_bound": host_bound(statistics.median(t_auto), graph_auto),
                             "bf16_host_bound": host_bound(statistics.median(t_bf16), graph_bf16),
                             "ratio_range": ratio_range(t_fp8, t_bf16), "auto_ratio_range": ratio_range(t_auto, t_bf16),
                             "control_ratio_range": ratio_range(t_twin, t_bf16),
                             "rounds_ms": {"fp8": t_fp8, "auto": t_auto, "bf16": t_bf16, "twin": t_twin}})
            del forced, auto, ref, twin
    print(f"{'M':>5} {'K':>6} {'N':>6} {'M*K*N':>9} {'fp8 ms':>8} {'auto ms':>8} {'bf16 ms':>8} {'fp8/bf16':>8} "
          f"{'auto/bf16 (range)':>18} {'twin/bf16 (range)':>18}  host-bound (fp8 auto bf16: b2b > 1.1x graph)")
    for r in sorted(rows, key=lambda r: r["MKN"]):
        print(f"{r['M']:5d} {r['K']:6d} {r['N']:6d} {r['MKN']:9.2e} {r['fp8_ms']:8.4f} {r['auto_ms']:8.4f} "
              f"{r['bf16_ms']:8.4f} {r['ratio']:8.2f} {r['auto_ratio']:6.2f} ({r['auto_ratio_range'][0]:.2f}-"
              f"{r['auto_ratio_range'][1]:.2f}) {r['control_ratio']:6.2f} ({r['control_ratio_range'][0]:.2f}-"
              f"{r['control_ratio_range'][1]:.2f})  " + " ".join(
                  {True: "HOST", False: "gpu", None: "n/a"}[r[f"{v}_host_bound"]] for v in ("fp8", "auto", "bf16")))
    for key, what in (("ratio", "FP8 forced"), ("auto_ratio", f"default (threshold {base.FP8_MIN_GEMM_SIZE:.2e})"),
                      ("control_ratio", "control (a second nn.Linear)")):
        worst = max(rows, key=lambda r: r[key])
        print(f"worst {what} / bf16 time ratio (median of {rounds} rounds): {worst[key]:.2f} at M={worst['M']} "
              f"K={worst['K']} N={worst['N']}")
    return rows


def with_setting(owner, name, value, step):
    """step() with owner.name set to value for its duration (a module switch: linear.NATIVE_NODE,
    update.NATIVE_UPDATES)."""
    def run():
        saved = getattr(owner, name)
        setattr(owner, name, value)
        try:
            step()
        finally:
            setattr(owner, name, saved)
    return run


HOST_RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}


def bench_host_overhead(rounds, native_node_ab=False, tokens=16, hidden=64, layers=(1, 8), native_updates_ab=False,
                        recipe_name="delayed"):
    """Host time per Linear forward+backward, the FP8 path forced: one Linear per training step (the per-step work —
    autocast exit, the two scale updates, the backward callback — all charged to it), and a stack of 8 Linears per
    step (per-step work shared, as in a model). Divided by the number of layers; medians over interleaved rounds and
    the median of the per-round ratios. Also our stack captured with te.make_graphed_callables (FP8 inside the graphs;
    the remedy for host-bound small models, as with TE), against the same eager nn.Linear. native_node_ab: also ours
    with the C++ autograd node off (the node on/off table). native_updates_ab: also ours with the scaling updates on
    their Python path (update.NATIVE_UPDATES off). recipe_name: the FP8 steps' recipe (HOST_RECIPES)."""
    rows = []
    for n in layers:
        def stack():
            return nn.Sequential(*[te.Linear(hidden, hidden, params_dtype=DT, device=DEV, fp8_min_gemm_size=0)
                                   for _ in range(n)])
        ours = stack()
        ref = nn.Sequential(*[nn.Linear(hidden, hidden, device=DEV, dtype=DT) for _ in range(n)])
        x = torch.randn(tokens, hidden, device=DEV, dtype=DT, requires_grad=True)
        dy = torch.randn(tokens, hidden, device=DEV, dtype=DT)
        # (each variant its own input leaf: a leaf's gradient accumulator made while the graphs were captured runs on
        # the capture's stream, and other variants' backwards into it would synchronise on every step)
        x_ours, x_ref, x_off = (x.detach().clone().requires_grad_() for _ in range(3))
        fp8_recipe = HOST_RECIPES[recipe_name]()
        steps = {"fp8": train_step(ours, x_ours, dy, True, fp8_recipe), "bf16": train_step(ref, x_ref, dy, False)}
        if DEV == "cuda":  # (CUDA graphs need a GPU)
            graphed = te.make_graphed_callables(stack(), (x,), fp8_enabled=True, fp8_recipe=fp8_recipe)
            train_step(graphed, x, dy, False)()  # (its first step calibrates the FP8 scales eagerly, then replays)
            steps["fp8_graphed"] = train_step(graphed, x, dy, False)
        if native_node_ab:
            steps["fp8_no_native_node"] = with_setting(linear_module, "NATIVE_NODE", False,
                                                        train_step(ours, x_off, dy, True, fp8_recipe))
        if native_updates_ab:
            x_py = x.detach().clone().requires_grad_()
            steps["fp8_python_updates"] = with_setting(update, "NATIVE_UPDATES", False,
                                                       train_step(ours, x_py, dy, True, fp8_recipe))
        names = list(steps)
        iters, warmup = (200, 20) if DEV == "cuda" else (5, 2)  # (the CPU: a smoke test)
        per_round = interleaved(lambda step: host_time_us(step, iters=iters, warmup=warmup),
                                [steps[k] for k in names], rounds, shuffle=True, seed=n)
        t = {k: [v / n for v in vals] for k, vals in zip(names, per_round)}
        row = {"tokens": tokens, "hidden": hidden, "layers": n, "recipe": recipe_name}
        for k in names:
            row[f"{k}_us"] = spread(t[k], 1)
            if k != "bf16":
                row[f"{k}_ratio"] = spread([a / b for a, b in zip(t[k], t["bf16"])], 3)
        print(f"host time per Linear fwd+bwd ({tokens}x{hidden}, {recipe_name} scaling, {n} Linear per step; medians "
              f"of {rounds} rounds, "
              f"range): nn.Linear {fmt_spread(row['bf16_us'], 1)} us; " + "; ".join(
                  f"{k} {fmt_spread(row[k + '_us'], 1)} us, ratio {fmt_spread(row[k + '_ratio'])}"
                  for k in names if k != "bf16"), flush=True)
        rows.append(row)
    return rows


def bench_host_call(rounds, m=128, k=1280, n=1280, iters=1000):
    """Host time per forward call at one small shape under no_grad + fp8_autocast (the default, high-precision path
    there): nn.Linear, ours with is_first_microbatch=False (as the grid calls it) and without, F.linear alone;
    `rounds` interleaved rounds of `iters` calls each (medians, ranges)."""
    ours = te.Linear(k, n, params_dtype=DT, device=DEV)
    ref = nn.Linear(k, n, device=DEV, dtype=DT)
    x = torch.randn(m, k, device=DEV, dtype=DT)
    calls = {"nn.Linear": lambda: ref(x), "ours, is_first_microbatch=False": lambda: ours(x, is_first_microbatch=False),
             "ours": lambda: ours(x), "F.linear": lambda: F.linear(x, ref.weight, ref.bias)}
    with torch.no_grad(), te.fp8_autocast():
        result = run_rounds({name: (lambda fn=fn: host_time_us(fn, iters=iters)) for name, fn in calls.items()},
                            rounds, seed=1)
    print(f"host time per forward call, {m}x{k}x{n}, no_grad + fp8_autocast, {rounds} rounds of {iters} calls (us, "
          f"median (range)): " + "; ".join(f"{name} {fmt_spread(v)}" for name, v in result.items()), flush=True)
    return {"M": m, "K": k, "N": n, "iters": iters, "us": result}


def main(argv=None):
    """Runs the tables that --skip leaves and writes the JSON after each.

    Args:
        argv: the command line's arguments (default sys.argv[1:]).
    """
    global DEV
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_modules.json")
    parser.add_argument("--skip", nargs="*", default=[], choices=["training", "inference", "host", "host-call"])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the training, host and host-call tables")
    parser.add_argument("--grid-rounds", type=int, default=GRID_ROUNDS, help="rounds per inference grid point")
    parser.add_argument("--native-node-ab", action="store_true",
                        help="host table: also ours with the C++ autograd node off (linear.NATIVE_NODE = False)")
    parser.add_argument("--native-updates-ab", action="store_true",
                        help="host table: also ours with the scaling updates' Python path (update.NATIVE_UPDATES off)")
    parser.add_argument("--host-recipe", default="delayed", choices=sorted(HOST_RECIPES),
                        help="host table: the FP8 steps' recipe")
    parser.add_argument("--no-compile", action="store_true", help="training table: no torch.compile baseline")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test of the script")
    args = parser.parse_args(argv)
    for name in ("rounds", "grid_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected at least 1, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_modules.py needs a CUDA GPU (or --device cpu --tiny for a smoke test)")
    DEV = args.device
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
              "rounds": args.rounds, "grid_rounds": args.grid_rounds, "tiny": args.tiny}
    train_kw = dict(sizes=TINY["training_sizes"], tokens=TINY["training_tokens"]) if args.tiny else {}
    grid_kw = dict(sizes=TINY["grid_sizes"], m_values=TINY["grid_m"]) if args.tiny else {}
    call_kw = dict(zip(("m", "k", "n"), TINY["host_call_shape"]), iters=20) if args.tiny else {}
    parts = (("training", "training",
              lambda: bench_training(args.rounds, compile_torch=not args.no_compile, **train_kw)),
             ("inference", "inference_grid", lambda: bench_inference_grid(args.grid_rounds, **grid_kw)),
             ("host", "host_overhead", lambda: bench_host_overhead(args.rounds, args.native_node_ab,
                                                                   native_updates_ab=args.native_updates_ab,
                                                                   recipe_name=args.host_recipe)),
             ("host-call", "host_call", lambda: bench_host_call(2 * args.rounds + 1, **call_kw)))
    for part, key, run in parts:
        if part not in args.skip:
            result[key] = run()
            with open(args.json, "w") as f:  # after each part: a run cut short keeps what it measured
                json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
