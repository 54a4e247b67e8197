"""Session 12 probe (call 4, run with main's library of session 11): host time per FP8 Linear fwd+bwd step with the
delayed-scaling updates' Python paths switched off, the upper bound of what moving them to C++ could save; variants
interleaved in 7 rounds, medians. Then the torch profiler's and cProfile's view of one-Linear steps.

On a library with the C++ updates (session 12 on), the Python path is forced (update.NATIVE_UPDATES = False) so that the
switches below still reach the updates. Usage (CUDA only): PYTHONPATH=. python <this file>
"""
import cProfile
import pstats
import statistics
import sys

import torch
import torch.nn as nn

sys.path.insert(0, "benchmarks")
import transformer_fp8 as te  # noqa: E402
from timing import host_time_us  # noqa: E402
from transformer_fp8 import _C, recipe  # noqa: E402
from transformer_fp8 import autocast as ac  # noqa: E402
from transformer_fp8.quantization import update  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
update.NATIVE_UPDATES = False
real_register_forward = update.register_forward
real_registrar = ac.register_backward


def step_of(module, x, dy, fp8, fwd_update=True, bwd_update=True):
    """A training step of `module`; fwd_update / bwd_update False: that update's registration is a no-op."""
    r = recipe.DelayedScaling()

    def step():
        update.register_forward = real_register_forward if fwd_update else (lambda *a: None)
        _C.set_backward_registrar(real_registrar if bwd_update else (lambda *a: None))
        module.zero_grad(set_to_none=True)
        x.grad = None
        with te.fp8_autocast(enabled=fp8, fp8_recipe=r):
            y = module(x)
        y.backward(dy)
    return step


def main():
    for n in (1, 8):
        ours = nn.Sequential(*[te.Linear(64, 64, params_dtype=DT, device=DEV, fp8_min_gemm_size=0) for _ in range(n)])
        ref = nn.Sequential(*[nn.Linear(64, 64, device=DEV, dtype=DT) for _ in range(n)])
        xs = [torch.randn(16, 64, device=DEV, dtype=DT, requires_grad=True) for _ in range(5)]
        dy = torch.randn(16, 64, device=DEV, dtype=DT)
        steps = {"nn.Linear": step_of(ref, xs[0], dy, False), "ours": step_of(ours, xs[1], dy, True),
                 "ours no bwd update": step_of(ours, xs[2], dy, True, bwd_update=False),
                 "ours no fwd update": step_of(ours, xs[3], dy, True, fwd_update=False),
                 "ours no updates": step_of(ours, xs[4], dy, True, False, False)}
        for s in steps.values():
            for _ in range(30):
                s()
        res = {k: [] for k in steps}
        names = list(steps)
        for r in range(7):
            for k in names[r % 5:] + names[:r % 5]:
                res[k].append(host_time_us(steps[k], iters=300, warmup=20) / n)
        base = res["nn.Linear"]
        print(f"{n} Linear per step, us per Linear, median (min-max) / ratio to nn.Linear (median of per-round "
              f"ratios):")
        for k, v in res.items():
            ratio = statistics.median(a / b for a, b in zip(v, base))
            print(f"  {k:20s} {statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})  x{ratio:.2f}")
        update.register_forward = real_register_forward
        _C.set_backward_registrar(real_registrar)

    ours = nn.Sequential(te.Linear(64, 64, params_dtype=DT, device=DEV, fp8_min_gemm_size=0))
    x = torch.randn(16, 64, device=DEV, dtype=DT, requires_grad=True)
    s = step_of(ours, x, torch.randn(16, 64, device=DEV, dtype=DT), True)
    for _ in range(30):
        s()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(50):
            s()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        s()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
