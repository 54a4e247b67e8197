"""Host (CPU) cost per call of each op on tiny CUDA tensors: issue many calls, no sync inside, divide; every case is
measured in turn over --rounds rounds in a seeded new order each round (timing.run_rounds: the host's speed drifts by
10-20% within a run), medians printed, median/min/max and every round in the JSON (--json).
A diagnostic for the per-call floor of the modules (run on the device): fp8_gemm's variants against torch._scaled_mm
(same 16x64x64 problem) and against its own early-exit path (M = 0: dispatch, checks and output allocation, no
cuBLASLt), te.Linear's FP8 path (forced) against nn.Linear, an empty torch.autograd.Function's forward + backward
against a native sum().backward() (the floor of a Python autograd node), and where the Linear's host time goes (cProfile
by function, torch.profiler by op; --no-profile skips them).
Usage: python benchmarks/op_host_cost.py [--rounds 5] [--json op_host_cost.json] [--no-profile]
       python benchmarks/op_host_cost.py --device cpu --rounds 1 --iters 5 --no-profile  (a smoke test of the script)
"""
import argparse
import cProfile
import json
import pstats

import torch

import transformer_fp8 as te
from transformer_fp8.ops import tfp8
from timing import fmt_spread, host_time_us, run_rounds, spread


def main(argv=None):
    """Measures every case in rounds, prints medians (and, unless --no-profile, the profiles), writes the JSON.

    Args:
        argv: the command line's arguments (default sys.argv[1:]).
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians reported")
    parser.add_argument("--iters", type=int, default=400, help="calls per measurement (a quarter for the Linears)")
    parser.add_argument("--json", default="op_host_cost.json")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile and torch.profiler tables")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the script")
    args = parser.parse_args(argv)
    for flag in ("rounds", "iters"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: expected at least 1, got {getattr(args, flag)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("op_host_cost.py needs a CUDA GPU (or --device cpu for a smoke test)")
    d, e4 = args.device, torch.float8_e4m3fn
    x = torch.randn(16, 64, device=d, dtype=torch.bfloat16)
    one = torch.ones(1, device=d)
    amax = torch.zeros(1, device=d)
    sinv = torch.empty(1, device=d)
    q = x.to(e4)
    w = torch.randn(64, 64, device=d, dtype=torch.bfloat16).to(e4)
    hist = torch.zeros(16, 4, device=d)
    sc, si = torch.ones(4, device=d), torch.ones(4, device=d)
    gamma = torch.ones(64, device=d, dtype=torch.bfloat16)
    q_empty = torch.empty(0, 64, device=d, dtype=e4)
    acc = torch.zeros(16, 64, device=d)
    hists = [torch.zeros(16, 4, device=d) for _ in range(300)]
    scs, sis = [torch.ones(4, device=d) for _ in hists], [torch.ones(4, device=d) for _ in hists]
    cases = {
        "torch.add (baseline)": lambda: torch.add(x, x),
        "torch.empty(1)": lambda: torch.empty(1, device=d),
        "quantize": lambda: tfp8.quantize(x, one, e4, amax, sinv),
        "cast_transpose": lambda: tfp8.cast_transpose(x, one, e4, True, True, amax, sinv),
        "fp8_transpose": lambda: tfp8.fp8_transpose(q),
        "fp8_gemm": lambda: tfp8.fp8_gemm(q, one, w, one, torch.bfloat16),
        "torch._scaled_mm": lambda: torch._scaled_mm(q, w.t(), one, one, out_dtype=torch.bfloat16),
        "fp8_gemm M=0 (no GEMM)": lambda: tfp8.fp8_gemm(q_empty, one, w, one, torch.bfloat16),
        "fp8_gemm bias": lambda: tfp8.fp8_gemm(q, one, w, one, torch.bfloat16, gamma),
        "fp8_gemm e4m3 out + amax": lambda: tfp8.fp8_gemm(q, one, w, one, e4, out_scale=one, out_amax=amax),
        "fp8_gemm_accumulate": lambda: tfp8.fp8_gemm_accumulate(q, one, w, one, acc),
        "layernorm_fwd fp8": lambda: tfp8.layernorm_fwd(x, gamma, gamma, 1e-5, False, one, e4, amax, sinv),
        "activation_fwd gelu": lambda: tfp8.activation_fwd(x, "gelu"),
        "delayed_scaling_update x1": lambda: tfp8.delayed_scaling_update([hist], [sc], [si], 448.0, 0.0, "max"),
        "delayed_scaling_update x300": lambda: tfp8.delayed_scaling_update(hists, scs, sis, 448.0, 0.0, "max"),
    }
    lin = te.Linear(64, 64, params_dtype=torch.bfloat16, fp8_min_gemm_size=0, device=d)
    auto = te.Linear(64, 64, params_dtype=torch.bfloat16, device=d)
    xg = x.clone().requires_grad_()

    def linear_fwd_bwd():
        with te.fp8_autocast():
            y = lin(xg)
        y.sum().backward()

    def linear_fwd_nograd():
        with torch.no_grad(), te.fp8_autocast():
            lin(x)

    def auto_fwd_bwd():
        with te.fp8_autocast():
            y = auto(xg)
        y.sum().backward()

    class Identity(torch.autograd.Function):
        """Does nothing: its forward + backward is the host cost of a Python autograd node."""

        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def fresh(step, *modules):
        """step() with the gradients set to None first, as optimizer.zero_grad leaves them (no accumulation adds
        timed; the same few µs of Python on every side)."""
        def call():
            xg.grad = None
            for module in modules:
                module.zero_grad(set_to_none=True)
            step()
        return call

    ref = torch.nn.Linear(64, 64, device=d, dtype=torch.bfloat16)
    cases["empty autograd.Function fwd+bwd"] = fresh(lambda: Identity.apply(xg).sum().backward())
    cases["native sum().backward()"] = fresh(lambda: xg.sum().backward())
    cases["te.Linear fwd+bwd"] = fresh(linear_fwd_bwd, lin)
    cases["te.Linear fwd+bwd auto path"] = fresh(auto_fwd_bwd, auto)
    cases["te.Linear fwd no_grad"] = linear_fwd_nograd
    cases["nn.Linear fwd+bwd"] = fresh(lambda: ref(xg).sum().backward(), ref)
    measures = {name: (lambda fn=fn, iters=max(1, args.iters // 4) if "Linear" in name else args.iters:
                       host_time_us(fn, iters, warmup=min(20, iters))) for name, fn in cases.items()}
    stats = run_rounds(measures, args.rounds, seed=0)
    print(f"host µs per call, median (min-max) over {args.rounds} interleaved rounds")
    for name, value in stats.items():
        print(f"{name:32s} {fmt_spread(value, 1)} us", flush=True)
    ratios = {}
    for key, (top, bottom) in {"fp8_gemm / torch._scaled_mm": ("fp8_gemm", "torch._scaled_mm"),
                               "te.Linear / nn.Linear fwd+bwd": ("te.Linear fwd+bwd", "nn.Linear fwd+bwd")}.items():
        if "error" not in stats[top] and "error" not in stats[bottom]:  # (per-round ratios: the drift cancels)
            ratios[key] = [a / b for a, b in zip(stats[top]["rounds"], stats[bottom]["rounds"])]
            print(f"{key} host time: {fmt_spread(spread(ratios[key]))}")
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if d == "cuda" else "cpu", torch=torch.__version__,
                       rounds=args.rounds, iters=args.iters, us=stats,
                       ratios={k: spread(v) for k, v in ratios.items()}), f, indent=1)
    print(f"wrote {args.json}")
    if args.no_profile or d != "cuda":  # (the profiles read CUDA activity)
        return
    profile = cProfile.Profile()  # (diagnostics: where the Linear's host time goes)
    profile.runcall(lambda: [cases["te.Linear fwd+bwd"]() for _ in range(200)])
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            cases["te.Linear fwd+bwd"]()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
