"""Host (CPU) cost per call of each op on tiny CUDA tensors: issue many calls, no sync inside, divide (median of
REPEATS such loops). A diagnostic for the per-call floor of the modules (run on the device): fp8_gemm's variants
against torch._scaled_mm (same 16x64x64 problem) and against its own early-exit path (M = 0: dispatch, checks and
output allocation, no cuBLASLt), te.Linear's FP8 path (forced) against nn.Linear, an empty torch.autograd.Function's
forward + backward against a native sum().backward() (the floor of a Python autograd node), and where the Linear's
host time goes (cProfile by function, torch.profiler by op)."""
import argparse
import cProfile
import pstats
import statistics

import torch

import transformer_fp8 as te
from transformer_fp8.ops import tfp8
from timing import host_time_us

REPEATS = 5


def host_us(fn, iters):
    """Median over REPEATS loops of `iters` calls of the host time per call, in microseconds."""
    return statistics.median(host_time_us(fn, iters) for _ in range(REPEATS))


def main():
    argparse.ArgumentParser(description=__doc__).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("op_host_cost.py needs a CUDA GPU")
    d, e4 = "cuda", torch.float8_e4m3fn
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
    lin = te.Linear(64, 64, params_dtype=torch.bfloat16, fp8_min_gemm_size=0)
    auto = te.Linear(64, 64, params_dtype=torch.bfloat16)
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

    cases["empty autograd.Function fwd+bwd"] = lambda: Identity.apply(xg).sum().backward()
    cases["native sum().backward()"] = lambda: xg.sum().backward()
    cases["te.Linear fwd+bwd"] = linear_fwd_bwd
    cases["te.Linear fwd+bwd auto path"] = auto_fwd_bwd
    cases["te.Linear fwd no_grad"] = linear_fwd_nograd
    ref = torch.nn.Linear(64, 64, device=d, dtype=torch.bfloat16)
    cases["nn.Linear fwd+bwd"] = lambda: ref(xg).sum().backward()
    us = {}
    for name, fn in cases.items():
        us[name] = host_us(fn, 100 if "Linear" in name else 400)
        print(f"{name:32s} {us[name]:8.1f} us", flush=True)
    print(f"fp8_gemm / torch._scaled_mm host time: {us['fp8_gemm'] / us['torch._scaled_mm']:.2f}")
    print(f"te.Linear / nn.Linear fwd+bwd host time: {us['te.Linear fwd+bwd'] / us['nn.Linear fwd+bwd']:.2f}")
    profile = cProfile.Profile()
    profile.runcall(lambda: [linear_fwd_bwd() for _ in range(200)])
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            linear_fwd_bwd()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
