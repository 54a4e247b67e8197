"""adamw_step_: the CPU reference against float64 AdamW and torch.optim.AdamW, the CUDA kernel bit for bit against
the CPU reference (vector and one-element paths, unaligned tensors, tails, more tensors than one launch takes),
opcheck, argument errors."""
import math

import numpy as np
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.utils import assert_close_rel

ops = torch.ops.transformer_fp8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
# ||err|| / ||ref|| of one AdamW step in float32 (a dozen roundings, ~2**-24 each, a cancelling sum in the moment),
# then one rounding to the dtype (at most 2**-9 relative for bf16, 2**-12 for fp16; ~1/3 of that by norm).
STEP_RTOL = {torch.float32: 1e-6, torch.bfloat16: 3e-3, torch.float16: 4e-4}


def make_state(shapes, dtype, device="cpu", seed=0, step=3):
    """(params, grads, exp_avgs, exp_avg_sqs) of random values, moments as after `step` - 1 earlier steps."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    params = [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 1e-2).to(dtype).to(device) for s in shapes]
    exp_avgs = [(torch.randn(s, generator=g) * 1e-3).to(dtype).to(device) for s in shapes]
    exp_avg_sqs = [(torch.rand(s, generator=g) * 1e-4).to(dtype).to(device) for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


def clone_all(state):
    return tuple([t.clone() for t in lst] for lst in state)


def ref_adamw64(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, maximize=False):
    """The AdamW step (torch.optim.AdamW's formulas) in float64 -> (param, exp_avg, exp_avg_sq)."""
    p, g, m, v = (t.double() for t in (param, grad, exp_avg, exp_avg_sq))
    g = -g if maximize else g
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(1 - beta2 ** step) + eps
    return p - lr / (1 - beta1 ** step) * m / denom, m, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("maximize", [False, True])
def test_cpu_reference_matches_float64(dtype, maximize):
    state = make_state([(33, 17), (5,), (64, 8)], dtype)
    before = clone_all(state)
    ops.adamw_step_(*state, **HYPER, step=4, maximize=maximize)
    for i in range(3):
        want = ref_adamw64(*(lst[i] for lst in before), **HYPER, step=4, maximize=maximize)
        for got, ref in zip((state[0][i], state[2][i], state[3][i]), want):
            assert got.dtype == dtype
            assert_close_rel(got, ref, STEP_RTOL[dtype])


def test_cpu_reference_follows_torch_adamw_over_steps():
    """float32 parameters, five steps: the same trajectory as torch.optim.AdamW (which rounds differently: lerp)."""
    torch.manual_seed(1)
    ours = [torch.randn(40, 9), torch.randn(7)]
    theirs = [p.clone().requires_grad_() for p in ours]
    moments = [[torch.zeros_like(p) for p in ours] for _ in range(2)]
    optimizer = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(1, 6):
        grads = [torch.randn_like(p) for p in ours]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        optimizer.step()
        ops.adamw_step_(ours, grads, *moments, **HYPER, step=step)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


def test_cpu_reference_is_ieee_float32_op_by_op():
    """float32: the CPU reference equals numpy's float32 arithmetic (IEEE, each operation rounded) bit for bit, the
    rounding the CUDA kernel's __f*_rn intrinsics make (the GPU test compares the two)."""
    state = make_state([(300, 7)], torch.float32, seed=5)
    p, g, m, v = (lst[0].numpy().copy() for lst in state)
    ops.adamw_step_(*state, **HYPER, step=5)
    f32 = np.float32
    lr_wd, b1, omb1, b2, omb2, eps, step_size, inv_bc2 = (f32(x) for x in (
        HYPER["lr"] * HYPER["weight_decay"], HYPER["beta1"], 1 - HYPER["beta1"], HYPER["beta2"], 1 - HYPER["beta2"],
        HYPER["eps"], HYPER["lr"] / (1 - HYPER["beta1"] ** 5), 1 / math.sqrt(1 - HYPER["beta2"] ** 5)))
    p = p - lr_wd * p
    m = b1 * m + omb1 * g
    v = b2 * v + (omb2 * g) * g
    p = p - (step_size * m) / (np.sqrt(v) * inv_bc2 + eps)
    for got, want in zip((state[0][0], state[2][0], state[3][0]), (p, m, v)):
        assert np.array_equal(got.numpy(), want)


def test_opcheck_cpu():
    torch.library.opcheck(ops.adamw_step_.default, (*make_state([(6, 5), (3,)], torch.bfloat16), 1e-3, 0.9, 0.999,
                                                     1e-8, 0.01, 2, False))


@pytest.mark.parametrize("change,error,match", [
    (lambda s: (s[0], s[1][:1], s[2], s[3]), ValueError, r"grads: expected 2 tensors"),
    (lambda s: (s[0], s[1], s[2], s[3] + [s[3][0]]), ValueError, r"exp_avg_sqs: expected 2 tensors"),
    (lambda s: (s[0], [s[1][0].float(), s[1][1]], s[2], s[3]), TypeError, r"grads\[0\]: expected torch.bfloat16"),
    (lambda s: (s[0], s[1], [s[2][0][:2], s[2][1]], s[3]), ValueError, r"exp_avgs\[0\]: expected shape \(4, 6\)"),
    (lambda s: ([s[0][0].t(), s[0][1]], s[1], s[2], s[3]), ValueError, r"params\[0\]: expected a contiguous"),
    (lambda s: ([s[0][0].int(), s[0][1]], s[1], s[2], s[3]), TypeError, r"params\[0\]: expected a float32, float16"),
])
def test_cpu_rejects_bad_lists(change, error, match):
    state = make_state([(4, 6), (3,)], torch.bfloat16)
    with pytest.raises(error, match=match):
        ops.adamw_step_(*change(state), **HYPER, step=1)


@pytest.mark.parametrize("name,value,match", [("step", 0, r"step: expected >= 1"),
                                              ("beta1", 1.0, r"beta1: expected 0 <= beta1 < 1"),
                                              ("lr", -1.0, r"lr: expected >= 0"),
                                              ("weight_decay", -0.1, r"weight_decay: expected >= 0")])
def test_cpu_rejects_bad_scalars(name, value, match):
    args = dict(HYPER, step=1)
    args[name] = value
    with pytest.raises(ValueError, match=match):
        ops.adamw_step_(*make_state([(4,)], torch.float32), **args)


def unaligned(t):
    """A contiguous copy of t whose data starts one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


# Shapes: whole chunks (16384 elements), a chunk plus a tail, below one vector, empty, several chunks, a last chunk
# where some threads have one vector left after their pairs (16384 + 2048 + 24: 259 bf16 vectors, 515 float32 ones).
CUDA_SHAPES = [(4096, 4), (16384 + 13,), (3,), (0, 4), (3, 16384 * 2 + 8), (127, 129), (16384 + 2048 + 24,),
               (8192 + 13,)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("maximize", [False, True])
def test_cuda_matches_cpu_reference_bitwise(dtype, maximize):
    state = make_state(CUDA_SHAPES, dtype, seed=2)
    on_gpu = tuple([t.cuda() for t in lst] for lst in state)
    ops.adamw_step_(*state, **HYPER, step=7, maximize=maximize)
    ops.adamw_step_(*on_gpu, **HYPER, step=7, maximize=maximize)
    for cpu_list, gpu_list in zip(state, on_gpu):
        for a, b in zip(cpu_list, gpu_list):
            assert torch.equal(a, b.cpu())


@pytest.mark.gpu
def test_cuda_unaligned_tensors_and_many_launches():
    """Tensors one element off 16-byte alignment (the one-element path), and 450 tensors (three launches)."""
    shapes = [(1000,), (64, 33)] + [(17 * (i % 5) + 1,) for i in range(448)]
    state = make_state(shapes, torch.bfloat16, seed=3)
    on_gpu = tuple([unaligned(t.cuda()) if i < 2 else t.cuda() for i, t in enumerate(lst)] for lst in state)
    ops.adamw_step_(*state, **HYPER, step=2)
    ops.adamw_step_(*on_gpu, **HYPER, step=2)
    for cpu_list, gpu_list in zip(state, on_gpu):
        for a, b in zip(cpu_list, gpu_list):
            assert torch.equal(a, b.cpu())


@pytest.mark.gpu
def test_cuda_error_vs_float64_no_worse_than_torch_fused_adamw():
    """BF16 parameters and moments over 20 steps: our update's error against a float64 AdamW run is within that of
    torch.optim.AdamW(fused=True) on the same BF16 tensors (both round to BF16 after each step)."""
    torch.manual_seed(4)
    p64 = torch.randn(256, 1024, dtype=torch.float64, device="cuda")
    m64, v64 = torch.zeros_like(p64), torch.zeros_like(p64)
    ours = [p64.bfloat16()]
    ours_m, ours_v = [torch.zeros_like(ours[0])], [torch.zeros_like(ours[0])]
    theirs = ours[0].clone().requires_grad_()
    optimizer = torch.optim.AdamW([theirs], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    for step in range(1, 21):
        grad = torch.randn_like(p64) * 1e-2
        grad_bf16 = grad.bfloat16()
        p64, m64, v64 = ref_adamw64(p64, grad_bf16, m64, v64, 1e-3, 0.9, 0.95, 1e-8, 0.1, step)
        ops.adamw_step_(ours, [grad_bf16], ours_m, ours_v, 1e-3, 0.9, 0.95, 1e-8, 0.1, step)
        theirs.grad = grad_bf16.clone()
        optimizer.step()
    our_error = (ours[0].double() - p64).norm() / p64.norm()
    their_error = (theirs.detach().double() - p64).norm() / p64.norm()
    assert our_error <= their_error * 1.05 + 1e-6, (our_error.item(), their_error.item())


@pytest.mark.gpu
def test_opcheck_cuda():
    state = make_state([(6, 5), (3,), (16384 + 9,)], torch.bfloat16, "cuda")
    torch.library.opcheck(ops.adamw_step_.default, (*state, 1e-3, 0.9, 0.999, 1e-8, 0.01, 2, False))


@pytest.mark.gpu
def test_cuda_rejects_cpu_and_mixed_tensors():
    state = tuple([t.cuda() for t in lst] for lst in make_state([(4, 6), (3,)], torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"exp_avgs\[1\]: expected a tensor on cuda"):
        ops.adamw_step_(state[0], state[1], [state[2][0], state[2][1].cpu()], state[3], **HYPER, step=1)
    with pytest.raises(RuntimeError, match=r"params\[1\]: expected (torch.bfloat16|BFloat16) \(params\[0\]'s dtype"):
        ops.adamw_step_([state[0][0], state[0][1].half()], state[1], state[2], state[3], **HYPER, step=1)


def ref_adam64(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, bias_correction=True,
               decoupled=True):
    """Adam in float64 with TE FusedAdam's options (L2 decay when not decoupled) -> (param, exp_avg, exp_avg_sq)."""
    p, g, m, v = (t.double() for t in (param, grad, exp_avg, exp_avg_sq))
    if decoupled:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if bias_correction else (1.0, 1.0)
    return p - lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps), m, v


def make_variant_state(shapes, param_dtype, moment_dtype, masters, device="cpu", seed=0):
    """(params, grads, exp_avgs, exp_avg_sqs, master_params or None) with the moments in moment_dtype and, when
    masters, float32 master weights (the params their rounding)."""
    params, grads, exp_avgs, exp_avg_sqs = make_state(shapes, torch.float32, device, seed)
    master_params = [p.clone() for p in params] if masters else None
    cast = ([p.to(param_dtype) for p in params], [g.to(param_dtype) for g in grads],
            [m.to(moment_dtype) for m in exp_avgs], [v.to(moment_dtype) for v in exp_avg_sqs])
    return (*cast, master_params)


# (param dtype, moment dtype, master weights, bias correction, decoupled decay)
VARIANTS = [(torch.bfloat16, torch.float32, False, True, True), (torch.bfloat16, torch.float32, True, True, True),
            (torch.float16, torch.float16, True, True, True), (torch.bfloat16, torch.bfloat16, False, False, True),
            (torch.float32, torch.float32, False, True, False), (torch.bfloat16, torch.float32, True, False, False)]


@pytest.mark.parametrize("param_dtype,moment_dtype,masters,bias_correction,decoupled", VARIANTS)
def test_cpu_variants_match_float64(param_dtype, moment_dtype, masters, bias_correction, decoupled):
    params, grads, exp_avgs, exp_avg_sqs, master_params = make_variant_state([(33, 17), (5,)], param_dtype,
                                                                             moment_dtype, masters)
    before = [(master_params or params)[i].clone() for i in range(2)]
    m0, v0 = [m.clone() for m in exp_avgs], [v.clone() for v in exp_avg_sqs]
    ops.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, **HYPER, step=3, maximize=False,
                    master_params=master_params, bias_correction=bias_correction, decoupled_weight_decay=decoupled)
    for i in range(2):
        want_p, want_m, want_v = ref_adam64(before[i], grads[i], m0[i], v0[i], **HYPER, step=3,
                                            bias_correction=bias_correction, decoupled=decoupled)
        assert exp_avgs[i].dtype == moment_dtype and params[i].dtype == param_dtype
        assert_close_rel(exp_avgs[i], want_m, STEP_RTOL[moment_dtype])
        assert_close_rel(exp_avg_sqs[i], want_v, STEP_RTOL[moment_dtype])
        if masters:
            assert master_params[i].dtype == torch.float32
            assert_close_rel(master_params[i], want_p, STEP_RTOL[torch.float32])
            assert torch.equal(params[i], master_params[i].to(param_dtype))  # (the master, rounded)
        else:
            assert_close_rel(params[i], want_p, STEP_RTOL[param_dtype])


@pytest.mark.parametrize("change,match", [
    (lambda s: (*s[:4], [s[4][0]]), r"master_params: expected none or 2 tensors"),
    (lambda s: (*s[:4], [s[4][0].bfloat16(), s[4][1]]), r"master_params\[0\]: expected torch.float32"),
    (lambda s: (s[0], s[1], [s[2][0].half(), s[2][1]], s[3], s[4]), r"exp_avgs\[0\]: expected torch.bfloat16 \(the "),
    (lambda s: (s[0], s[1], s[2], [s[3][0].bfloat16(), s[3][1]], s[4]), r"exp_avg_sqs\[0\]: expected torch.float32"),
    (lambda s: ([p.float() for p in s[0]], [g.float() for g in s[1]], *s[2:]), r"master_params: float32 parameters"),
])
def test_cpu_rejects_bad_masters_and_moments(change, match):
    state = make_variant_state([(4, 6), (3,)], torch.bfloat16, torch.float32, True)
    params, grads, exp_avgs, exp_avg_sqs, master_params = change(state)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, **HYPER, step=1, master_params=master_params)


@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype,moment_dtype,masters,bias_correction,decoupled", VARIANTS)
def test_cuda_variants_match_cpu_reference_bitwise(param_dtype, moment_dtype, masters, bias_correction, decoupled):
    shapes = CUDA_SHAPES + [(1000,)]
    cpu = make_variant_state(shapes, param_dtype, moment_dtype, masters, seed=6)
    gpu = tuple(None if lst is None else [t.cuda() for t in lst] for lst in cpu)
    gpu = (*gpu[:4], None if gpu[4] is None else [unaligned(t) if t.shape == (1000,) else t for t in gpu[4]])
    for state in (cpu, gpu):
        ops.adamw_step_(*state[:4], **HYPER, step=5, maximize=False, master_params=state[4],
                        bias_correction=bias_correction, decoupled_weight_decay=decoupled)
    for cpu_list, gpu_list in zip(cpu, gpu):
        for a, b in zip(cpu_list or [], gpu_list or []):
            assert torch.equal(a, b.cpu())
