"""Host (CPU) cost per call of each op on tiny CUDA tensors: issue many calls, no sync inside, divide.
A diagnostic for the per-call floor of the modules (run on the device): then te.Linear's FP8 path (forced) against
nn.Linear, and where its host time goes (cProfile by function, torch.profiler by op)."""
import cProfile
import pstats

import torch

import transformer_fp8 as te
from transformer_fp8.ops import tfp8
from timing import host_time_us


def main():
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
    cases = {
        "torch.add (baseline)": lambda: torch.add(x, x),
        "torch.empty(1)": lambda: torch.empty(1, device=d),
        "quantize": lambda: tfp8.quantize(x, one, e4, amax, sinv),
        "cast_transpose": lambda: tfp8.cast_transpose(x, one, e4, True, True, amax, sinv),
        "fp8_transpose": lambda: tfp8.fp8_transpose(q),
        "fp8_gemm": lambda: tfp8.fp8_gemm(q, one, w, one, torch.bfloat16),
        "torch._scaled_mm": lambda: torch._scaled_mm(q, w.t(), one, one, out_dtype=torch.bfloat16),
        "layernorm_fwd fp8": lambda: tfp8.layernorm_fwd(x, gamma, gamma, 1e-5, False, one, e4, amax, sinv),
        "activation_fwd gelu": lambda: tfp8.activation_fwd(x, "gelu"),
        "delayed_scaling_update x1": lambda: tfp8.delayed_scaling_update([hist], [sc], [si], 448.0, 0.0, "max"),
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

    cases["te.Linear fwd+bwd"] = linear_fwd_bwd
    cases["te.Linear fwd+bwd auto path"] = auto_fwd_bwd
    cases["te.Linear fwd no_grad"] = linear_fwd_nograd
    ref = torch.nn.Linear(64, 64, device=d, dtype=torch.bfloat16)
    cases["nn.Linear fwd+bwd"] = lambda: ref(xg).sum().backward()
    for name, fn in cases.items():
        print(f"{name:28s} {host_time_us(fn, 500 if 'Linear' in name else 2000):8.1f} us", flush=True)
    profile = cProfile.Profile()
    profile.runcall(lambda: [linear_fwd_bwd() for _ in range(200)])
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            linear_fwd_bwd()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
