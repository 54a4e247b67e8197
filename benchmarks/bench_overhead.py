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
Prints tables and writes JSON (--json).
"""
import argparse
import json

import torch
import torch.nn as nn

import transformer_fp8 as te
from transformer_fp8 import recipe
from transformer_fp8.module import base
from timing import host_time_us, loop_time_ms

DEV, DT = "cuda", torch.bfloat16
COMPILE_CASE = ("Linear", 128, 1024)  # torch.compile is measured at this one size (compile time)
FP8_RECIPE = recipe.DelayedScaling()


def make_step(model, x, fp8):
    """One training step's work: forward (in fp8_autocast for ours) and backward of a fixed upstream gradient."""
    xi = x.detach().clone().requires_grad_()
    dy = torch.randn_like(x)

    def step():
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
        graphed(xi).backward(dy)
    return step


def host_and_wall_us(fn, iters=50, host_iters=8):
    """(host µs per call: time to issue host_iters calls from an idle GPU, few enough not to fill the launch queue;
    wall µs per call: CUDA events around iters back-to-back calls, what a training loop sees)."""
    return host_time_us(fn, host_iters), loop_time_ms(fn, warmup=0, iters=iters, repeats=1) * 1e3


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
    """(name, model, input, fp8) of one size."""
    if kind == "Linear":
        x = torch.randn(tokens, hidden, device=DEV, dtype=DT)
        return [("bf16 nn.Linear", nn.Linear(hidden, hidden, device=DEV, dtype=DT), x, False),
                ("fp8 te.Linear", te.Linear(hidden, hidden, params_dtype=DT, device=DEV), x, True)]
    heads, batch = hidden // 128, 2
    x = torch.randn(tokens // batch, batch, hidden, device=DEV, dtype=DT)
    return [("bf16 plain layer", PlainLayer(hidden, 4 * hidden, heads), x, False),
            ("fp8 te.TransformerLayer", ours_layer(hidden, 4 * hidden, heads), x, True)]


def measure_modes(model, x, fp8, with_compile):
    """{mode: (host µs, wall µs) or an error string} for eager, graph, (with_compile) torch.compile and mgc
    (make_graphed_callables: last, it replaces the model's forward)."""
    result = {}
    builders = {"eager": lambda: make_step(model, x, fp8),
                "graph": lambda: graphed(make_step(model, x, fp8)),
                "compile": lambda: make_step(torch.compile(model), x, fp8),
                "mgc": lambda: graphed_callables_step(model, x, fp8)}
    for mode, build in builders.items():
        if mode == "compile" and not with_compile:
            result[mode] = "not measured at this size (compile time)"
            continue
        try:
            result[mode] = host_and_wall_us(build())
        except Exception as err:  # a mode that does not work for this model is reported, not fatal
            result[mode] = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
            torch.cuda.synchronize()
        torch._dynamo.reset()
    return result


def fmt(value):
    return f"{value[0]:8.1f} {value[1]:8.1f}" if isinstance(value, tuple) else f"{'n/a':>8s} {'n/a':>8s}"


def bench_small_sizes():
    rows = []
    print(f"{'module':26s} {'tokens':>6s} {'hidden':>6s} | {'eager host':>10s} {'wall':>6s} | "
          f"{'graph host':>10s} {'wall':>6s} | {'compile host':>12s} {'wall':>6s} | {'mgc host':>8s} {'wall':>6s}"
          f"   (µs per fwd+bwd)")
    for kind in ("Linear", "TransformerLayer"):
        for hidden in (1024, 4096):
            for tokens in (128, 2048):
                for name, model, x, fp8 in cases(kind, tokens, hidden):
                    modes = measure_modes(model, x, fp8, with_compile=(kind, tokens, hidden) == COMPILE_CASE)
                    rows.append({"module": name, "tokens": tokens, "hidden": hidden, **{
                        m: (list(v) if isinstance(v, tuple) else v) for m, v in modes.items()}})
                    print(f"{name:26s} {tokens:6d} {hidden:6d} | {fmt(modes['eager'])} | {fmt(modes['graph'])} | "
                          f"{fmt(modes['compile'])} | {fmt(modes['mgc'])}", flush=True)
                    for mode, v in modes.items():
                        if not isinstance(v, tuple) and not v.startswith("not measured"):
                            print(f"    {mode} failed: {v}")
                    del model
                torch.cuda.empty_cache()
    return rows


def bench_stack(layers=24, hidden=1024, seq=512, batch=2):
    x = torch.randn(seq, batch, hidden, device=DEV, dtype=DT)
    rows = []
    for name, make, fp8 in (("bf16 plain layers", lambda: PlainLayer(hidden, 4 * hidden, hidden // 128), False),
                            ("fp8 te.TransformerLayer", lambda: ours_layer(hidden, 4 * hidden, hidden // 128), True)):
        stack = nn.Sequential(*[make() for _ in range(layers)])
        row = {"model": name, "layers": layers}
        for mode, build in (("eager", lambda: make_step(stack, x, fp8)),
                            ("graph", lambda: graphed(make_step(stack, x, fp8))),
                            ("mgc", lambda: graphed_callables_step(stack, x, fp8))):
            try:
                row[mode] = list(host_and_wall_us(build(), iters=10, host_iters=2))
            except Exception as err:
                row[mode] = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
        rows.append(row)
        print(f"{layers}-layer stack h={hidden} s={seq} b={batch} {name:24s}: host/wall µs " + " | ".join(
            f"{mode} {fmt(tuple(v) if isinstance(v, list) else v)}" for mode, v in row.items()
            if mode in ("eager", "graph", "mgc")), flush=True)
        del stack
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench_overhead.json")
    parser.add_argument("--skip", nargs="*", default=[], choices=["sizes", "stack", "launches"])
    args = parser.parse_args()
    base.FP8_MIN_GEMM_SIZE = 0  # measure the FP8 path itself (no small-shape automatic path)
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name()}
    for part, run in (("launches", bench_launches), ("stack", bench_stack), ("sizes", bench_small_sizes)):
        if part not in args.skip:
            result[part] = run()
            with open(args.json, "w") as f:  # after each part: a run cut short keeps what it measured
                json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
