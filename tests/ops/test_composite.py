"""fp8_linear_fwd / fp8_linear_bwd: the same results, bit for bit, as the sequence of ops they stand for (casts and
GEMMs called one by one), on CPU (reference kernels) and CUDA; scale_inv and amax written as those ops write them;
opcheck (schema, fake kernels, aot dispatch)."""
import pytest
import torch

from tests.utils import scalar

ops = torch.ops.transformer_fp8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def forward_args(device, m=24, k=48, n=32, dtype=torch.bfloat16, bias=True, residual=False):
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
    return dict(x=x, weight=w, x_scale=scalar(100.0, device), w_scale=scalar(300.0, device), fp8_dtype=E4M3,
                x_amax=scalar(0.0, device), x_scale_inv=scalar(0.0, device), w_amax=scalar(0.0, device),
                w_scale_inv=scalar(0.0, device), x_transpose=True, w_transpose=True, out_dtype=dtype,
                bias=torch.randn(n, dtype=dtype, device=device) if bias else None,
                residual=torch.randn(m, n, dtype=dtype, device=device) if residual else None)


def stepwise_forward(a):
    """fp8_linear_fwd's contract, op by op."""
    xq, xqt = ops.cast_transpose(a["x"], a["x_scale"], a["fp8_dtype"], True, a["x_transpose"], a["x_amax"],
                                 a["x_scale_inv"])
    wq, wqt = ops.cast_transpose(a["weight"], a["w_scale"], a["fp8_dtype"], True, a["w_transpose"], a["w_amax"],
                                 a["w_scale_inv"])
    out = ops.fp8_gemm(xq, a["x_scale_inv"], wq, a["w_scale_inv"], a["out_dtype"], a["bias"],
                       use_split_accumulator=False, residual=a["residual"])[0]
    return out, xqt, wqt


def clone_args(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def assert_same(ours, ref):
    for o, r in zip(ours, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert torch.equal(o.view(torch.uint8) if o.element_size() == 1 else o,
                           r.view(torch.uint8) if r.element_size() == 1 else r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias,residual,transposes", [(True, False, (True, True)), (False, True, (True, False)),
                                                      (False, False, (False, False))])
def test_forward_equals_its_op_sequence(device, bias, residual, transposes):
    args = forward_args(device, bias=bias, residual=residual)
    args["x_transpose"], args["w_transpose"] = transposes
    ref_args = clone_args(args)
    out, xqt, wqt = ops.fp8_linear_fwd(**args)
    assert_same((out, xqt, wqt), stepwise_forward(ref_args))
    for name in ("x_amax", "x_scale_inv", "w_amax", "w_scale_inv"):
        assert torch.equal(args[name], ref_args[name]) and args[name].item() > 0, name
    assert (xqt.numel() > 0) == transposes[0] and (wqt.numel() > 0) == transposes[1]
    # and it is a linear layer: within FP8 tolerance of the float64 result
    ref = args["x"].double() @ args["weight"].double().t() + (args["bias"].double() if bias else 0) + (
        args["residual"].double() if residual else 0)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.06


def backward_args(device, m=24, k=48, n=32, dtype=torch.bfloat16, dgrad=True, wgrad=True, dbias=True,
                  main_grad=False):
    w_t = (torch.randn(k, n, device=device) * 8).to(E4M3)
    x_t = (torch.randn(k, m, device=device) * 8).to(E4M3)
    return dict(dy=torch.randn(m, n, dtype=dtype, device=device), dy_scale=scalar(5000.0, device), fp8_dtype=E5M2,
                dy_amax=scalar(0.0, device), dy_scale_inv=scalar(0.0, device), compute_dbias=dbias,
                w_t=w_t if dgrad else None, w_scale_inv=scalar(0.125, device), dx_dtype=dtype,
                x_t=x_t if wgrad else None, x_scale_inv=scalar(0.125, device), dw_dtype=dtype,
                main_grad=torch.randn(n, k, device=device) if main_grad else None)


def stepwise_backward(a):
    """fp8_linear_bwd's contract, op by op."""
    if a["compute_dbias"]:
        q, qt, dbias = ops.cast_transpose_dbias(a["dy"], a["dy_scale"], a["fp8_dtype"], a["dy_amax"],
                                                a["dy_scale_inv"])
    else:
        q, qt = ops.cast_transpose(a["dy"], a["dy_scale"], a["fp8_dtype"], a["w_t"] is not None,
                                   a["x_t"] is not None, a["dy_amax"], a["dy_scale_inv"])
        dbias = None
    dx = ops.fp8_gemm(q, a["dy_scale_inv"], a["w_t"], a["w_scale_inv"], a["dx_dtype"])[0] if a["w_t"] is not None \
        else None
    dw = None
    if a["x_t"] is not None and a["main_grad"] is not None:
        ops.fp8_gemm_accumulate(qt, a["dy_scale_inv"], a["x_t"], a["x_scale_inv"], a["main_grad"])
    elif a["x_t"] is not None:
        dw = ops.fp8_gemm(qt, a["dy_scale_inv"], a["x_t"], a["x_scale_inv"], a["dw_dtype"])[0]
    return dx, dw, dbias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dgrad,wgrad,dbias,main_grad", [(True, True, True, False), (True, True, False, True),
                                                         (True, False, False, False), (False, True, True, False)])
def test_backward_equals_its_op_sequence(device, dgrad, wgrad, dbias, main_grad):
    args = backward_args(device, dgrad=dgrad, wgrad=wgrad, dbias=dbias, main_grad=main_grad)
    ref_args = clone_args(args)
    dx, dw, db = ops.fp8_linear_bwd(**args)
    ref_dx, ref_dw, ref_db = stepwise_backward(ref_args)
    for ours, ref in ((dx, ref_dx), (dw, ref_dw), (db, ref_db)):
        if ref is None:
            assert ours.numel() == 0
        else:
            assert_same((ours,), (ref,))
    for name in ("dy_amax", "dy_scale_inv") + (("main_grad",) if main_grad else ()):
        assert torch.equal(args[name], ref_args[name]), name


@pytest.mark.parametrize("case", ["forward", "backward"])
def test_opcheck_cpu(case):
    # (test_schema compares inputs with torch.allclose, which has no float8 kernel; see test_gemm.py)
    if case == "forward":
        op, kwargs = ops.fp8_linear_fwd.default, forward_args("cpu", residual=True)
    else:
        op, kwargs = ops.fp8_linear_bwd.default, backward_args("cpu", main_grad=True)
    torch.library.opcheck(op, (), kwargs, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
