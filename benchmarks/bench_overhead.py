"""Host overhead at small sizes (issue 7): is the GPU kept busy?

1. Linear and TransformerLayer forward+backward at tokens 128 and 2048, hidden 1024 and 4096: host time per call (issue
   calls without synchronising, divide) and time per call (CUDA events around back-to-back calls: what a training
   loop sees), eager vs CUDA graphs (torch.cuda.graph around the whole step, FP8 scaling updates included) vs
   te.make_graphed_callables ("mgc": forward and backward graphs replayed from autograd) vs torch.compile, ours in
   FP8 (DelayedScaling, small-shape automatic path off) vs BF16 nn.Linear / a plain PyTorch pre-LN layer
   (nn.TransformerEncoderLayer). torch.compile at one size only (COMPILE_CASE: compile time). A mode
   that fails prints its error and is skipped.
2. A 24-layer TransformerLayer stack at hidden 1024, seq 512, batch 2 (launch-bound) fwd+bwd: eager, graphed and
   make_graphed_callables (the whole stack as one callable).
3. Kernel launches per Linear forward+backward (torch.profiler, CUDA kernels and memsets/copies).
Every step starts with its gradients set to None (as after optimizer.zero_grad(set_to_none=True)): no accumulation
adds are timed. Per size (and for the stack), every (model, mode) variant's two measures are taken in turn over
--rounds rounds in a seeded new order each round (timing.run_rounds), so that the host's and the GPU clock's drift
land on all alike; the tables print medians, the JSON keeps median, min, max and every round. A mode whose wall time
is no shorter than its host time is host-bound (the host issues slower than the GPU runs).
Prints tables and writes JSON (--json).
Usage: python benchmarks/bench_overhead.py [--rounds 5] [--skip sizes stack launches]
       python benchmarks/bench_overhead.py --device cpu --tiny --rounds 1  (a smoke test of the script: eager only)
"""
import argparse
import json

import torch
import torch.nn as nn

import transformer_fp8 as te
from transformer_fp8 import recipe
from transformer_fp8.module import base
from timing import host_time_us, loop_time_ms, run_rounds

DEV, DT = "cuda", torch.bfloat16  # (main sets DEV from --device; the functions read it when called)
SIZES = dict(hidden=(1024, 4096), tokens=(128, 2048), stack=dict(layers=24, hidden=1024, seq=512, batch=2))
TINY_SIZES = dict(hidden=(64,), tokens=(16,), stack=dict(layers=2, hidden=64, seq=16, batch=2))  # (--tiny)
COMPILE_CASE = ("Linear", 128, 1024)  # torch.compile is measured at this one size (compile time)
FP8_RECIPE = recipe.DelayedScaling()


def make_step(model, x, fp8):
    """One training step's work: gradients set to None (as optimizer.zero_grad(set_to_none=True) leaves them: no
    accumulation adds), forward (in fp8_autocast for ours) and backward of a fixed upstream gradient."""
    xi = x.detach().clone().requires_grad_()
    dy = torch.randn_like(x)

    def step():
        model.zero_grad(set_to_none=True)
        xi.grad = None
        with te.fp8_autocast(enabled=fp8, fp8_recipe=FP8_RECIPE):
            out = model(xi)
        out.backward(dy)
    return step


def graphed(step):
    """Capture step() in a CUDA graph after a warm-up on a side stream; returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def graphed_callables_step(model, x, fp8):
    """make_graphed_callables on `model` (its forward is replaced: graph it last), then the step: replayed forward,
    backward of a fixed upstream gradient (no fp8_autocast: the graphs carry their own)."""
    graphed = te.make_graphed_callables(model, (x.detach().clone().requires_grad_(),), fp8_enabled=fp8,
                                        fp8_recipe=FP8_RECIPE)
    xi = x.detach().clone().requires_grad_()
    dy = torch.randn_like(x)

    def step():
        graphed.zero_grad(set_to_none=True)
        xi.grad = None
        graphed(xi).backward(dy)
    return step


def host_and_wall_measures(fn, iters=50, host_iters=8):
    """{"host_us": a measure, "wall_us": a measure} of fn, each a function of no argument returning µs per call.
    host: the time to issue host_iters calls from an idle GPU (few enough not to fill the launch queue); wall: CUDA
    events around iters back-to-back calls (what a training loop sees)."""
    return {"host_us": lambda: host_time_us(fn, host_iters, warmup=3),  # (the step is warm from earlier rounds)
            "wall_us": lambda: loop_time_ms(fn, warmup=0, iters=iters, repeats=1) * 1e3}


def timed_modes(builders, rounds, seed, iters=50, host_iters=8):
    """Build every variant's step (a builder that fails is reported with its error), then time every step's host and
    wall measures in interleaved rounds.

    Args:
        builders: {variant name: a function of no argument returning the step}. rounds: timed rounds.
        seed: the rounds' order seed. iters, host_iters: as in host_and_wall_measures.
    Returns:
        {variant: {"host_us": spread, "wall_us": spread} or an error string}.
    """
    result, measures = {}, {}
    for name, build in builders.items():
        try:
            step = build()
            step()  # (a first call: one that fails is reported here, not in the rounds)
            for what, measure in host_and_wall_measures(step, iters, host_iters).items():
                measures[f"{name}|{what}"] = measure
        except Exception as err:  # a mode that does not work for this model is reported, not fatal
            result[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"
            if DEV == "cuda":
                torch.cuda.synchronize()
    stats = run_rounds(measures, rounds, seed=seed)
    for key, value in stats.items():
        name, what = key.rsplit("|", 1)
        if "error" in value:
            result[name] = value["error"]
        elif not isinstance(result.get(name), str):
            result.setdefault(name, {})[what] = value
    return {name: result[name] for name in builders if name in result}


class PlainLayer(nn.Module):
    """Plain PyTorch pre-LN block (BF16), [s, b, h], causal self-attention, GELU MLP, no dropout."""

    def __init__(self, hidden, ffn, heads):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, activation="gelu", norm_first=True,
                                                device=DEV, dtype=DT)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[0], device=x.device, dtype=x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


def ours_layer(hidden, ffn, heads):
    return te.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DT,
                               device=DEV)


def cases(kind, tokens, hidden):
    """(name, model factory, input, fp8) of one size."""
    if kind == "Linear":
        x = torch.randn(tokens, hidden, device=DEV, dtype=DT)
        return [("bf16 nn.Linear", lambda: nn.Linear(hidden, hidden, device=DEV, dtype=DT), x, False),
                ("fp8 te.Linear", lambda: te.Linear(hidden, hidden, params_dtype=DT, device=DEV), x, True)]
    heads, batch = max(1, hidden // 128), 2
    x = torch.randn(tokens // batch, batch, hidden, device=DEV, dtype=DT)
    return [("bf16 plain layer", lambda: PlainLayer(hidden, 4 * hidden, heads), x, False),
            ("fp8 te.TransformerLayer", lambda: ours_layer(hidden, 4 * hidden, heads), x, True)]


def mode_builders(name, make_model, x, fp8, with_compile):
    """{"<name> | <mode>": step builder} for eager, graph (CUDA), (with_compile) torch.compile and mgc
    (make_graphed_callables, CUDA; on a model of its own: it replaces the model's forward)."""
    model = make_model()
    builders = {"eager": lambda: make_step(model, x, fp8)}
    if DEV == "cuda":
        builders["graph"] = lambda: graphed(make_step(model, x, fp8))
        if with_compile:
            builders["compile"] = lambda: make_step(torch.compile(make_model()), x, fp8)
        builders["mgc"] = lambda: graphed_callables_step(make_model(), x, fp8)
    return {f"{name} | {mode}": build for mode, build in builders.items()}


MODES = ("eager", "graph", "compile", "mgc")


def fmt(value):
    """'host wall' medians of a timed mode, or n/a."""
    if isinstance(value, dict):
        return f"{value['host_us']['median']:8.1f} {value['wall_us']['median']:8.1f}"
    return f"{'n/a':>8s} {'n/a':>8s}"


def split_modes(timed, name):
    """{mode: result} of one model from timed_modes' {"<name> | <mode>": result}."""
    return {mode: timed.get(f"{name} | {mode}", "not measured (compile: one size only; graphs: CUDA only)")
            for mode in MODES}


def bench_small_sizes(rounds, sizes=SIZES):
    """Host and wall µs per fwd+bwd of Linear and TransformerLayer, ours FP8 vs BF16, per mode. Returns the rows."""
    rows = []
    print(f"{'module':26s} {'tokens':>6s} {'hidden':>6s} | {'eager host':>10s} {'wall':>6s} | "
          f"{'graph host':>10s} {'wall':>6s} | {'compile host':>12s} {'wall':>6s} | {'mgc host':>8s} {'wall':>6s}"
          f"   (µs per fwd+bwd, medians of {rounds} rounds)")
    for kind in ("Linear", "TransformerLayer"):
        for hidden in sizes["hidden"]:
            for tokens in sizes["tokens"]:
                builders, names = {}, []
                for name, make_model, x, fp8 in cases(kind, tokens, hidden):
                    builders.update(mode_builders(name, make_model, x, fp8, (kind, tokens, hidden) == COMPILE_CASE))
                    names.append(name)
                timed = timed_modes(builders, rounds, seed=tokens * hidden)
                torch._dynamo.reset()
                for name in names:
                    modes = split_modes(timed, name)
                    rows.append({"module": name, "tokens": tokens, "hidden": hidden, **modes})
                    print(f"{name:26s} {tokens:6d} {hidden:6d} | {fmt(modes['eager'])} | {fmt(modes['graph'])} | "
                          f"{fmt(modes['compile'])} | {fmt(modes['mgc'])}", flush=True)
                    for mode, v in modes.items():
                        if isinstance(v, str) and not v.startswith("not measured"):
                            print(f"    {mode} failed: {v}")
                if DEV == "cuda":
                    torch.cuda.empty_cache()
    return rows


def bench_stack(rounds, layers=24, hidden=1024, seq=512, batch=2):
    """Host and wall µs per fwd+bwd of a stack of layers, ours FP8 vs plain BF16, eager / graph / mgc, in rounds."""
    x = torch.randn(seq, batch, hidden, device=DEV, dtype=DT)
    heads = max(1, hidden // 128)
    models = (("bf16 plain layers", lambda: nn.Sequential(*[PlainLayer(hidden, 4 * hidden, heads)
                                                              for _ in range(layers)]), False),
              ("fp8 te.TransformerLayer", lambda: nn.Sequential(*[ours_layer(hidden, 4 * hidden, heads)
                                                                    for _ in range(layers)]), True))
    builders = {}
    for name, make_model, fp8 in models:
        builders.update(mode_builders(name, make_model, x, fp8, with_compile=False))
    timed = timed_modes(builders, rounds, seed=layers, iters=10 if DEV == "cuda" else 2, host_iters=2)
    rows = []
    for name, _, _ in models:
        modes = split_modes(timed, name)
        rows.append({"model": name, "layers": layers, **{m: v for m, v in modes.items() if m != "compile"}})
        print(f"{layers}-layer stack h={hidden} s={seq} b={batch} {name:24s}: host/wall µs (medians of {rounds} "
              f"rounds) " + " | ".join(f"{mode} {fmt(modes[mode])}" for mode in ("eager", "graph", "mgc")), flush=True)
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def count_launches(step, steps=5):
    """GPU activities (kernels, memsets, copies) per call of step(), from torch.profiler."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = {}
    for e in kernels:
        names[e.name[:60]] = names.get(e.name[:60], 0) + 1
    return len(kernels) / steps, {n: c / steps for n, c in sorted(names.items(), key=lambda kv: -kv[1])}


def bench_launches(tokens=16, hidden=64):
    x = torch.randn(tokens, hidden, device=DEV, dtype=DT)
    result = {}
    for name, model, fp8 in (("bf16 nn.Linear", nn.Linear(hidden, hidden, device=DEV, dtype=DT), False),
                             ("fp8 te.Linear", te.Linear(hidden, hidden, params_dtype=DT, device=DEV), True)):
        per_call, names = count_launches(make_step(model, x, fp8))
        result[name] = {"launches": per_call, "kernels": names}
        print(f"GPU launches per Linear fwd+bwd ({tokens}x{hidden}), {name}: {per_call:.1f}")
        for n, c in names.items():
            print(f"    {c:4.1f}  {n}")
    return result


def main(argv=None):
    """Runs the parts that --skip leaves and writes the JSON after each.

    Args:
        argv: the command line's arguments (default sys.argv[1:]).
    """
    global DEV
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_overhead.json")
    parser.add_argument("--skip", nargs="*", default=[], choices=["sizes", "stack", "launches"])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test of the script")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_overhead.py needs a CUDA GPU (or --device cpu --tiny for a smoke test)")
    DEV = args.device
    sizes = TINY_SIZES if args.tiny else SIZES
    base.FP8_MIN_GEMM_SIZE = 0  # measure the FP8 path itself (no small-shape automatic path)
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "rounds": args.rounds,
              "tiny": args.tiny}
    skip = set(args.skip) | ({"launches"} if DEV != "cuda" else set())  # (launch counts come from CUDA activity)
    parts = (("launches", bench_launches), ("stack", lambda: bench_stack(args.rounds, **sizes["stack"])),
             ("sizes", lambda: bench_small_sizes(args.rounds, sizes)))
    for part, run in parts:
        if part not in skip:
            result[part] = run()
            with open(args.json, "w") as f:  # after each part: a run cut short keeps what it measured
                json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
