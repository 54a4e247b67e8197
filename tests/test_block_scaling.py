"""recipe.Float8BlockScaling end to end: the recipe's checks, BlockScalingQuantizer and the operand GEMM helpers, and
Linear / LayerNormLinear / LayerNormMLP / TransformerLayer under fp8_autocast(fp8_recipe=Float8BlockScaling()) against
float64 references (CPU and GPU), with every GEMM block-scaled."""
import pytest
import torch

import transformer_fp8 as te
from tests.module.helpers import (DEVICES, RELU_GRAD_TOL, check_against_reference, check_linear_against_reference,
                                  randomize_vectors)
from tests.module.test_transformer_layer import CASES, assert_errors, run_case
from tests.utils import FP8_RTOL, OpCalls, assert_close_rel
from transformer_fp8 import recipe
from transformer_fp8.quantization import (GEMM_ROLES, MLP_ROLES, BlockScalingQuantizer, FP8Operand, QuantizerSet,
                                          Role, gemm, gemm_accumulate, quantizer_class)

tfp8 = torch.ops.transformer_fp8
BLOCK_RECIPES = {
    "E4M3": recipe.Float8BlockScaling(),
    "HYBRID": recipe.Float8BlockScaling(fp8_format=recipe.Format.HYBRID),
    "fp32-scales-eps": recipe.Float8BlockScaling(
        fp8_quant_fwd_inp=recipe.QParams(power_2_scale=False, amax_epsilon=1e-6),
        fp8_quant_fwd_weight=recipe.QParams(power_2_scale=False),
        fp8_quant_bwd_grad=recipe.QParams(power_2_scale=False, amax_epsilon=1e-10)),
    "x-128x128-w-1x128": recipe.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
}


@pytest.fixture(autouse=True)
def _fp8_at_every_size():
    """The modules' small-GEMM fallback off: every GEMM of these small layers runs in FP8."""
    before = te.get_fp8_min_gemm_size()
    te.set_fp8_min_gemm_size(0)
    yield
    te.set_fp8_min_gemm_size(before)


class _GemmCalls:
    """Counts our GEMM ops' calls by kind inside `with`."""

    def __enter__(self):
        self._modes = [OpCalls(name) for name in ("block_fp8_gemm", "block_fp8_gemm_accumulate", "fp8_gemm",
                                                   "fp8_gemm_accumulate", "fp8_linear_fwd", "fp8_linear_bwd")]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self.block = len(self._modes[0].seen) + len(self._modes[1].seen)
        self.per_tensor = sum(len(m.seen) for m in self._modes[2:])
        self.block_dims = [(c["a_block_dim"], c["b_block_dim"]) for c in self._modes[0].seen + self._modes[1].seen]


# ---------------------------------------------------------------- the recipe


def test_recipe_defaults_are_te_s():
    r = recipe.Float8BlockScaling()
    assert r.fp8_format == recipe.Format.E4M3
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    assert r.fp8_quant_fwd_inp == recipe.QParams(power_2_scale=True, amax_epsilon=0.0)
    assert r.fp8_gemm_wgrad.use_split_accumulator and not r.fp8_dpa and not r.fp8_mha


@pytest.mark.parametrize("kwargs,match", [
    (dict(fp8_dpa=True), "fp8_dpa: FP8 attention is not available"),
    (dict(fp8_mha=True), "fp8_mha"),
    (dict(x_block_scaling_dim=3), "x_block_scaling_dim: expected 1"),
    (dict(w_block_scaling_dim=True), "w_block_scaling_dim: expected 1"),
    (dict(x_block_scaling_dim=2), "x_block_scaling_dim, w_block_scaling_dim: both 2"),
    (dict(grad_block_scaling_dim=2), "grad_block_scaling_dim, w_block_scaling_dim"),
    (dict(w_block_scaling_dim=1, x_block_scaling_dim=2, grad_block_scaling_dim=2), "grad_block_scaling_dim, x_block"),
    (dict(fp8_gemm_dgrad=recipe.MMParams(use_split_accumulator=False)), "fp8_gemm_dgrad: block scaling needs"),
    (dict(fp8_quant_bwd_grad=(True, 0.0)), "fp8_quant_bwd_grad: expected a recipe.QParams"),
    (dict(fp8_format="E4M3"), "fp8_format: expected a recipe.Format"),
])
def test_recipe_refuses_bad_fields(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        recipe.Float8BlockScaling(**kwargs)


@pytest.mark.parametrize("kwargs,match", [(dict(amax_epsilon=-1.0), "amax_epsilon: expected a finite"),
                                          (dict(amax_epsilon=float("inf")), "amax_epsilon: expected a finite"),
                                          (dict(power_2_scale=1), "power_2_scale: expected a bool")])
def test_qparams_refuse_bad_fields(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        recipe.QParams(**kwargs)


# ---------------------------------------------------------------- quantizer and operand GEMMs


def test_quantizer_per_role_layouts_and_settings():
    r = recipe.Float8BlockScaling(fp8_format=recipe.Format.HYBRID, x_block_scaling_dim=2, w_block_scaling_dim=1,
                                  fp8_quant_fwd_weight=recipe.QParams(power_2_scale=False, amax_epsilon=0.5))
    assert quantizer_class(r) is BlockScalingQuantizer
    qs = QuantizerSet(r, *MLP_ROLES, "cpu")
    assert not qs.fused_per_tensor and not qs.updates_by_history and not qs.same_scale_on_every_rank()
    assert qs[Role.FC1_INPUT].layout == qs[Role.FC2_INPUT].layout == "block_128x128"
    assert qs[Role.FC2_WEIGHT].layout == "block_1x128" and qs[Role.FC2_WEIGHT].qparams.amax_epsilon == 0.5
    assert qs[Role.FC1_GRAD_OUTPUT].layout == "block_1x128" and qs[Role.FC1_GRAD_OUTPUT].fp8_dtype == torch.float8_e5m2
    with pytest.raises(NotImplementedError, match="no per-tensor scale"):
        qs[Role.FC1_INPUT].cast_args(torch.randn(4, 4))
    with pytest.raises(NotImplementedError, match="known_scale is False"):
        qs[Role.FC1_INPUT].output_args()


def test_cast_is_block_cast_with_the_roles_settings():
    qs = QuantizerSet(recipe.Float8BlockScaling(fp8_quant_fwd_inp=recipe.QParams(power_2_scale=False)),
                      *GEMM_ROLES, "cpu")
    x = torch.randn(70, 300)
    operand = qs[Role.INPUT].cast(x, transpose=True)
    q, s, qt, st = tfp8.block_cast(x, torch.float8_e4m3fn, 1, True, True, 0.0, False)
    assert operand.layout == "block_1x128"
    assert torch.equal(operand.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(operand.scale_inv, s)
    assert torch.equal(operand.data_t.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(operand.scale_inv_t, st)
    dy = torch.randn(70, 40)
    dy_op, dbias = qs[Role.GRAD_OUTPUT].cast_with_dbias(dy)
    assert dy_op.data is not None and dy_op.data_t is not None
    torch.testing.assert_close(dbias, dy.sum(0))


def test_weight_transposes_share_block_scales():
    """A 128x128 weight's transposed copy, by byte transpose (with_transpose) or by recast (transpose_like), is the
    data transposed with the block scales transposed."""
    qs = QuantizerSet(recipe.Float8BlockScaling(), *GEMM_ROLES, "cpu")
    w = torch.randn(200, 300)
    wq = qs[Role.WEIGHT]
    by_cast = wq.cast(w, transpose=True)
    by_transpose = wq.cast(w).with_transpose()
    operand = wq.cast(w)
    by_recast = wq.transpose_like(w, operand)
    for data_t, scale_inv_t in ((by_transpose.data_t, by_transpose.scale_inv_t), (by_recast, operand.scale_inv_t)):
        assert torch.equal(data_t.view(torch.uint8), by_cast.data_t.view(torch.uint8))
        assert torch.equal(scale_inv_t, by_cast.scale_inv_t)
    with pytest.raises(NotImplementedError, match="needs a recast"):
        qs[Role.INPUT].cast(torch.randn(16, 128)).with_transpose()


def test_operand_gemms_route_block_layouts():
    qs = QuantizerSet(recipe.Float8BlockScaling(), *GEMM_ROLES, "cpu")
    x, w, dy = torch.randn(48, 256), torch.randn(64, 256), torch.randn(48, 64)
    xo, wo = qs[Role.INPUT].cast(x, transpose=True), qs[Role.WEIGHT].cast(w, transpose=True)
    dyo = qs[Role.GRAD_OUTPUT].cast(dy, transpose=True)
    bias, residual = torch.randn(64), torch.randn(48, 64)
    with _GemmCalls() as calls:
        y = gemm(xo, wo, torch.float32, bias=bias, residual=residual)  # (a float32 bias: added after the GEMM)
        dx = gemm(dyo, wo, torch.float32, transpose_b=True)
        main_grad = torch.zeros(64, 256)
        gemm_accumulate(dyo, xo, main_grad, transpose_a=True, transpose_b=True)
    assert calls.per_tensor == 0 and calls.block_dims == [(1, 2), (1, 2), (1, 1)]
    assert_close_rel(y, x @ w.t() + bias + residual, FP8_RTOL[torch.float8_e4m3fn])
    assert_close_rel(dx, dy @ w, FP8_RTOL[torch.float8_e4m3fn])
    assert_close_rel(main_grad, dy.t() @ x, FP8_RTOL[torch.float8_e4m3fn])
    per_tensor = FP8Operand(torch.zeros(48, 256, dtype=torch.float8_e4m3fn), None, torch.ones(1), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="do not mix in one GEMM"):
        gemm(per_tensor, wo, torch.float32)


# ---------------------------------------------------------------- modules


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", sorted(BLOCK_RECIPES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead_shape,in_f,out_f", [((32,), 64, 48), ((3, 7), 256, 160)])  # 21 tokens: not % 16
def test_linear_matches_reference(device, recipe_name, bias, lead_shape, in_f, out_f):
    with _GemmCalls() as calls:
        check_linear_against_reference(device, BLOCK_RECIPES[recipe_name], bias, lead_shape, in_f, out_f)
    x_dim, w_dim = (2, 1) if recipe_name == "x-128x128-w-1x128" else (1, 2)
    assert calls.per_tensor == 0 and calls.block_dims == [(x_dim, w_dim), (1, w_dim), (1, x_dim)] * 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_matches_reference(device, normalization, monkeypatch):
    monkeypatch.setenv("TFP8_BLOCK_FUSED", "1")  # (the fused norm cast; the unfused path: test_fused_casts_match_...)
    m = te.LayerNormLinear(128, 96, normalization=normalization, params_dtype=torch.bfloat16, device=device)
    randomize_vectors(m)
    x = torch.randn(2, 40, 128, dtype=torch.bfloat16, device=device)
    with _GemmCalls() as calls, OpCalls("norm_block_cast") as fused_norm:
        check_against_reference(m, x, torch.randn(2, 40, 96, dtype=torch.bfloat16, device=device),
                                BLOCK_RECIPES["HYBRID"])
    assert calls.per_tensor == 0 and calls.block == 6
    assert len(fused_norm.seen) == 2  # (the norm writes block-FP8 itself, with its transposed copy; once a step)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
def test_layernorm_mlp_matches_reference(device, activation, monkeypatch):
    monkeypatch.setenv("TFP8_BLOCK_FUSED", "1")  # (the fused casts; the unfused path: test_fused_casts_match_...)
    m = te.LayerNormMLP(128, 192, activation=activation, normalization="RMSNorm", params_dtype=torch.bfloat16,
                        device=device)
    randomize_vectors(m)
    x = torch.randn(48, 128, dtype=torch.bfloat16, device=device)
    with _GemmCalls() as calls, OpCalls("block_activation_cast") as fused, OpCalls("activation_fwd") as unfused, \
            OpCalls("norm_block_cast") as fused_norm, OpCalls("dact_block_cast") as fused_dact, \
            OpCalls("activation_bwd") as unfused_dact:
        check_against_reference(m, x, torch.randn(48, 128, dtype=torch.bfloat16, device=device),
                                BLOCK_RECIPES["E4M3"], grad_tol=RELU_GRAD_TOL if activation == "relu" else 0.2)
    assert calls.per_tensor == 0 and calls.block == 12
    assert len(fused.seen) == 2 and not unfused.seen  # (the activation is cast by the fused kernel, once per step)
    # the norm and the activation gradient (with fc1's bias gradient) are cast by their fused kernels too
    assert len(fused_norm.seen) == 2 and len(fused_dact.seen) == 2 and not unfused_dact.seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation,normalization,bias", [("swiglu", "RMSNorm", False), ("gelu", "LayerNorm", True)])
def test_fused_casts_match_unfused(device, activation, normalization, bias, monkeypatch):
    """The unfused casts (TFP8_BLOCK_FUSED=0: norm, then block_cast; activation_bwd, then block_cast) and the fused
    kernels (the default) give the same step up to the unfused path's rounding of the norm output and of d(fc1) to
    the parameters' dtype."""
    torch.manual_seed(0)
    m = te.LayerNormMLP(256, 384, activation=activation, normalization=normalization, bias=bias,
                        params_dtype=torch.float32, device=device)
    randomize_vectors(m)
    x = torch.randn(64, 256, device=device)
    dy = torch.randn(64, 256, device=device)
    results = []
    for fused in ("1", "0"):
        monkeypatch.setenv("TFP8_BLOCK_FUSED", fused)
        m.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()), OpCalls("norm_block_cast") as seen:
            out = m(xr)
        out.backward(dy)
        assert bool(seen.seen) == (fused == "1")
        results.append([out.detach(), xr.grad] + [p.grad for p in m.parameters()])
    for got, want in zip(*results):  # float32 parameters: the unfused path rounds nothing in between either
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_fused_casts_are_the_default(monkeypatch):
    """Block scaling's 1x128 quantizers take the fused norm / activation-gradient casts unless TFP8_BLOCK_FUSED=0;
    128x128 blocks never do."""
    from transformer_fp8.quantization.block import BlockScalingQuantizer
    from transformer_fp8.quantization.roles import Role
    from transformer_fp8.quantization.state import ScalingState
    monkeypatch.delenv("TFP8_BLOCK_FUSED", raising=False)
    state = ScalingState(1, 1, torch.device("cpu"))
    x_q = BlockScalingQuantizer(Role.INPUT, torch.float8_e4m3fn, state, 0)
    w_q = BlockScalingQuantizer(Role.WEIGHT, torch.float8_e4m3fn, state, 0)
    assert x_q.fused_norm_cast and x_q.fused_dact_cast and not w_q.fused_norm_cast
    monkeypatch.setenv("TFP8_BLOCK_FUSED", "0")
    assert not x_q.fused_norm_cast and not x_q.fused_dact_cast


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=["gpt", "llama"])
def test_transformer_layer_matches_plain_layer(device, case):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with _GemmCalls() as calls:
        errors = run_case(device, dtype, case, recipe.Float8BlockScaling())
    assert_errors(*errors, 0.1, 0.25)
    assert calls.per_tensor == 0 and calls.block == 12  # qkv, proj, fc1, fc2: fprop, dgrad, wgrad each


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w_dim", [2, 1])
@pytest.mark.parametrize("first_grad", [True, False])
def test_cached_weight_microbatches_and_main_grad(device, w_dim, first_grad):
    """is_first_microbatch caching (a cached weight cast without its transpose, in a no-grad first microbatch, gets
    it later: 128x128 by byte transpose, 1x128 recast) and fuse_wgrad_accumulation (the wgrad accumulates into
    main_grad) under block scaling."""
    fp8_recipe = recipe.Float8BlockScaling(w_block_scaling_dim=w_dim, x_block_scaling_dim=1)
    m = te.Linear(128, 64, params_dtype=torch.float32, device=device, fuse_wgrad_accumulation=True)
    m.weight.main_grad = torch.zeros(64, 128, device=device)
    xs = [torch.randn(32, 128, device=device) for _ in range(2)]
    if not first_grad:
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=fp8_recipe):
            m(xs[0], is_first_microbatch=True)
    outs = []
    for i, x in enumerate(xs):
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            out = m(x, is_first_microbatch=i == 0 and first_grad)
        out.backward(torch.ones_like(out))
        outs.append(out.detach())
    ref_wgrad = sum(torch.ones(32, 64, device=device).t() @ x for x in xs)
    assert_close_rel(m.weight.main_grad, ref_wgrad, FP8_RTOL[torch.float8_e4m3fn])
    assert_close_rel(outs[1], xs[1] @ m.weight.t() + m.bias, FP8_RTOL[torch.float8_e4m3fn])


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_linear_matches_eager(device):
    m = te.Linear(128, 64, params_dtype=torch.float32, device=device)
    x = torch.randn(32, 128, device=device)

    def step(module, inp):
        with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
            return module(inp)

    eager = step(m, x)
    compiled = torch.compile(step, fullgraph=False)(m, x)
    torch.testing.assert_close(compiled, eager)
