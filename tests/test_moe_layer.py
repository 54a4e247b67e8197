"""transformer_fp8.moe: the router, the load-balancing loss and MoELayer / LayerNormMoE against a float64 loop over
the tokens (values and the gradients of the input and every parameter), with uneven and empty experts, top-1 and
top-2, with and without a shared expert; the aux loss against transformers' load_balancing_loss_func and its
gradient through aux_loss_coeff; FP8 inside fp8_autocast (CPU reference kernels; GPU: BF16, no host sync in the
step); torch.compile against eager; bad arguments refused naming them."""
import copy

import pytest
import torch
import torch.nn.functional as F

import transformer_fp8 as te
from tests.utils import FP8_RTOL, rel_error
from transformer_fp8 import recipe
from transformer_fp8.moe import LayerNormMoE, MoELayer, TopKRouter, load_balancing_loss
from transformer_fp8.moe.experts import swiglu
from transformer_fp8.moe.router import route

HIDDEN, FFN, SHARED_FFN = 32, 48, 64


# --- float64 references ------------------------------------------------------------------------------------------

def reference_route(logits, top_k, norm_topk_prob):
    """Top-k softmax routing of one token's logits [E], in float64: (probs [k], expert ids [k])."""
    probs = torch.softmax(logits.double(), dim=-1)
    top, ids = torch.topk(probs, top_k)
    return (top / top.sum() if norm_topk_prob else top), ids


def swiglu64(x, w1, w2):
    h = x @ w1.t()
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def reference_moe(x, params, top_k, norm_topk_prob, logits_dtype=torch.float64):
    """MoELayer in float64, one token at a time. params: float64 copies of the layer's parameters by name.
    logits_dtype: the router logits are rounded to it (the layer computes them in its input's dtype: a BF16 layer's
    routing decisions are those of BF16 logits, which near-ties between experts would otherwise flip)."""
    num_experts = params["router.weight"].shape[0]
    rows = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = token @ params["router.weight"].t()
        logits = logits + (logits.detach().to(logits_dtype).double() - logits.detach())  # (gradient: unrounded)
        probs, ids = reference_route(logits, top_k, norm_topk_prob)
        out = torch.zeros_like(token)
        for p, e in zip(probs, ids.tolist()):
            assert 0 <= e < num_experts
            out = out + p * swiglu64(token, params[f"experts.linear_fc1.weight{e}"],
                                     params[f"experts.linear_fc2.weight{e}"])
        if "shared_experts.linear_fc1.weight" in params:
            shared = swiglu64(token, params["shared_experts.linear_fc1.weight"],
                              params["shared_experts.linear_fc2.weight"])
            if "shared_experts.gate_weight" in params:
                shared = shared * torch.sigmoid(token @ params["shared_experts.gate_weight"][0])
            out = out + shared
        rows.append(out)
    return torch.stack(rows).view(x.shape)


def reference_aux_loss(logits, top_k, mask=None):
    """transformers' load-balancing loss, from its definition, in float64 with a loop over the tokens."""
    t, e = logits.shape
    mask = torch.ones(t, dtype=torch.float64) if mask is None else mask.double().reshape(-1).repeat(t // mask.numel())
    counts, prob_sums = torch.zeros(e, dtype=torch.float64), torch.zeros(e, dtype=torch.float64)
    for row, m in zip(logits.double(), mask):
        probs = torch.softmax(row, -1)
        counts[torch.topk(probs, top_k).indices] += m
        prob_sums = prob_sums + m * probs
    total = mask.sum()
    return e * torch.sum(counts / total * prob_sums / total)


def make_layer(num_experts=4, top_k=2, shared=False, dtype=torch.float32, device="cpu", **kwargs):
    layer = MoELayer(HIDDEN, FFN, num_experts, top_k, shared_expert_ffn_hidden_size=SHARED_FFN if shared else None,
                     params_dtype=dtype, device=device, **kwargs)
    with torch.no_grad():  # (weights of a size whose outputs are O(1): errors relative to them are meaningful)
        for name, p in layer.named_parameters():
            p.normal_(0, 1.0 if name.startswith("router") else HIDDEN ** -0.5)
    return layer


def check_against_reference(layer, x, tol, grad_tol, aux_coeff=0.0):
    """The layer's output and the gradients of x and of every parameter against reference_moe (+ aux_coeff times
    the reference aux loss, whose gradient reaches the router)."""
    params = dict(layer.named_parameters())
    x = x.detach().requires_grad_()
    out = layer(x)
    x64 = x.detach().double().requires_grad_()
    params64 = {name: p.detach().double().requires_grad_() for name, p in params.items()}
    top_k, norm = layer.router.top_k, layer.router.norm_topk_prob
    ref = reference_moe(x64, params64, top_k, norm, logits_dtype=x.dtype)
    err = rel_error(out, ref)
    assert err <= tol, f"output: relative error {err:.2e}"
    grad = torch.randn_like(ref)
    (out * grad.to(out.dtype)).sum().backward()
    loss64 = (ref * grad).sum()
    if aux_coeff:
        loss64 = loss64 + aux_coeff * reference_aux_loss(x64.reshape(-1, HIDDEN) @ params64["router.weight"].t(),
                                                          top_k)
    names = ["x", *params64]
    wanted = torch.autograd.grad(loss64, [x64, *params64.values()], allow_unused=True, materialize_grads=True)
    for name, ours, want in zip(names, [x.grad, *(p.grad for p in params.values())], wanted):
        if want.norm() < 1e-9:  # (an expert no token went to; the router under top-1 renormalised: p / p = 1)
            assert ours is None or ours.abs().max() < 1e-5, f"d{name}: expected zero"
            continue
        assert ours is not None, f"d{name}: no gradient"
        err = rel_error(ours, want)
        assert err <= grad_tol, f"d{name}: relative error {err:.2e}"


# --- SwiGLU, router and aux loss ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)])
def test_swiglu_against_float64(dtype, tol):
    x = torch.randn(5, 3, 2 * 24, dtype=dtype, requires_grad=True)
    out = swiglu(x)
    x64 = x.detach().double().requires_grad_()
    gate, up = x64.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert out.dtype == dtype and rel_error(out, ref) < tol
    grad = torch.randn_like(ref)
    out.backward(grad.to(dtype))
    assert rel_error(x.grad, torch.autograd.grad(ref, x64, grad)[0]) < tol


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_route_matches_float64_per_token(top_k, norm_topk_prob):
    logits = torch.randn(9, 5)
    probs, ids = route(logits, top_k, norm_topk_prob)
    assert probs.dtype == torch.float32 and ids.dtype == torch.int64 and probs.shape == ids.shape == (9, top_k)
    for row, p, i in zip(logits, probs, ids):
        want_p, want_i = reference_route(row, top_k, norm_topk_prob)
        assert torch.equal(i, want_i)
        torch.testing.assert_close(p.double(), want_p, rtol=1e-6, atol=1e-7)


def test_router_is_high_precision_inside_fp8_autocast():
    router = TopKRouter(HIDDEN, 4, 2, device="cpu")
    x = torch.randn(3, 5, HIDDEN)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        logits, probs, ids = router(x)
    torch.testing.assert_close(logits, x.reshape(-1, HIDDEN) @ router.weight.t())
    assert logits.shape == (15, 4) and probs.shape == ids.shape == (15, 2)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_float64_definition(layers, masked):
    logits = [torch.randn(12, 6, requires_grad=True) for _ in range(layers)]
    mask = (torch.rand(12) > 0.3).float() if masked else None
    loss = load_balancing_loss(logits if layers > 1 else logits[0], 2, mask)
    want = reference_aux_loss(torch.cat([t.detach() for t in logits]), 2, mask)
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=0)
    loss.backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in logits)


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_equals_transformers(masked):
    transformers_mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    logits = tuple(torch.randn(2 * 7, 8) for _ in range(3))
    mask = (torch.rand(2, 7) > 0.3).long() if masked else None
    want = transformers_mixtral.load_balancing_loss_func(logits, 8, 2, mask)
    torch.testing.assert_close(load_balancing_loss(logits, 2, mask), want.float(), rtol=1e-6, atol=0)


# --- MoELayer ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("top_k,norm_topk_prob", [(1, True), (2, True), (2, False)])
def test_moe_layer_matches_float64_loop(top_k, norm_topk_prob, shared):
    layer = make_layer(num_experts=4, top_k=top_k, shared=shared, norm_topk_prob=norm_topk_prob)
    check_against_reference(layer, torch.randn(3, 7, HIDDEN), tol=1e-5, grad_tol=1e-5)


def test_uneven_and_empty_experts():
    """8 experts, 3 tokens, top-2: at most 6 experts get a token, the rest none; the empty experts' weights get no
    gradient, the others match the reference."""
    layer = make_layer(num_experts=8, top_k=2)
    x = torch.randn(3, HIDDEN)
    counts = torch.bincount(layer.router(x)[2].reshape(-1), minlength=8)
    assert (counts == 0).sum() >= 2 and counts.max() >= 1
    check_against_reference(layer, x, tol=1e-5, grad_tol=1e-5)


def test_skewed_routing_sends_every_token_to_two_experts():
    """A router that prefers experts 1 and 3 for every token: two full groups, the others empty."""
    layer = make_layer(num_experts=6, top_k=2)
    x = torch.randn(10, HIDDEN).abs() + 0.5
    with torch.no_grad():
        layer.router.weight.copy_(-torch.rand(6, HIDDEN) * 0.1)
        layer.router.weight[1] = layer.router.weight[3] = torch.rand(HIDDEN) + 1
    counts = torch.bincount(layer.router(x)[2].reshape(-1), minlength=6)
    assert counts.tolist() == [0, 10, 0, 10, 0, 0]
    check_against_reference(layer, x, tol=1e-5, grad_tol=1e-5)


def test_aux_loss_coeff_adds_the_aux_loss_gradient_in_training():
    layer = make_layer(num_experts=4, top_k=2, aux_loss_coeff=0.5).train()
    check_against_reference(layer, torch.randn(2, 5, HIDDEN), tol=1e-5, grad_tol=1e-5, aux_coeff=0.5)
    x = torch.randn(2, 5, HIDDEN)
    want = reference_aux_loss(x.reshape(-1, HIDDEN).double() @ layer.router.weight.detach().double().t(), 2)
    layer(x)
    torch.testing.assert_close(layer.aux_loss.double(), want, rtol=1e-5, atol=0)


def test_aux_loss_is_not_added_in_eval():
    layer = make_layer(num_experts=4, top_k=2, aux_loss_coeff=0.5).eval()
    check_against_reference(layer, torch.randn(2, 5, HIDDEN), tol=1e-5, grad_tol=1e-5)
    assert layer.aux_loss is None


def test_jitter_noise_only_in_training():
    layer = make_layer(num_experts=4, top_k=2, jitter_noise=0.1)
    x = torch.randn(4, HIDDEN)
    with torch.no_grad():
        assert torch.equal(layer.eval()(x), layer(x))
        assert not torch.equal(layer.train()(x), layer.eval()(x))


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_layernorm_moe_is_norm_then_moe_plus_residual(normalization):
    layer = LayerNormMoE(HIDDEN, FFN, 4, 2, eps=1e-6, normalization=normalization, device="cpu",
                         shared_expert_ffn_hidden_size=SHARED_FFN)
    with torch.no_grad():
        layer.layer_norm_weight.uniform_(0.5, 1.5)
    norm = (te.RMSNorm if normalization == "RMSNorm" else te.LayerNorm)(HIDDEN, eps=1e-6, device="cpu")
    norm.load_state_dict({k.removeprefix("layer_norm_"): v for k, v in layer.state_dict().items()
                          if k.startswith("layer_norm_")})
    x, residual = torch.randn(2, 3, HIDDEN), torch.randn(2, 3, HIDDEN)
    names = {"layer_norm_weight", "layer_norm_bias"}
    moe = MoELayer(HIDDEN, FFN, 4, 2, device="cpu", shared_expert_ffn_hidden_size=SHARED_FFN)
    moe.load_state_dict({k: v for k, v in layer.state_dict().items() if k not in names}, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, residual=residual), moe(norm(x)) + residual)
        torch.testing.assert_close(layer(x), moe(norm(x)))


def test_parameter_names_are_megatrons():
    names = set(dict(make_layer(num_experts=2, shared=True).named_parameters()))
    assert names == {"router.weight", "experts.linear_fc1.weight0", "experts.linear_fc1.weight1",
                     "experts.linear_fc2.weight0", "experts.linear_fc2.weight1", "shared_experts.linear_fc1.weight",
                     "shared_experts.linear_fc2.weight", "shared_experts.gate_weight"}


@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_on_cpu_reference_kernels(fp8_recipe):
    layer = make_layer(num_experts=4, top_k=2, shared=True)
    x = torch.randn(4, 8, HIDDEN)
    with te.fp8_autocast(fp8_recipe=fp8_recipe):
        layer(x)  # (delayed scaling: the first step calibrates)
    with te.fp8_autocast(fp8_recipe=fp8_recipe):
        check_against_reference(layer, x, tol=2 * FP8_RTOL[torch.float8_e4m3fn],
                                grad_tol=2 * FP8_RTOL[torch.float8_e5m2])
    gemms = [layer.experts.linear_fc1, layer.experts.linear_fc2, layer.shared_experts.linear_fc1,
             layer.shared_experts.linear_fc2]
    assert all(m._fp8_call_counts == [2, 0] for m in gemms), [m._fp8_call_counts for m in gemms]


@pytest.mark.parametrize("fp8", (False, True))
def test_host_splits_give_the_same_step(fp8):
    layer = make_layer(num_experts=4, top_k=2)
    x = torch.randn(37, HIDDEN)
    results = []
    for host_splits in (False, True):
        layer.host_splits = host_splits
        xg = x.clone().requires_grad_()
        layer.zero_grad()
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.Float8CurrentScaling()):
            out = layer(xg)
        out.sum().backward()
        results.append((out, xg.grad, [p.grad.clone() for p in layer.parameters()]))
    (out0, dx0, dps0), (out1, dx1, dps1) = results
    assert torch.equal(out0, out1) and torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(dps0, dps1))


@pytest.mark.parametrize("fp8", (False, True))
def test_torch_compile_matches_eager(fp8):
    """torch.compile(MoELayer) (graph breaks where the high-precision experts read the device counts, and at the
    weights' storage check of the FP8 path; not fullgraph) gives eager's output and parameter gradients bit for bit,
    and the input gradient up to the order in which its branches (router, experts, shared expert) are summed."""
    fp8_recipe = recipe.DelayedScaling()
    eager = make_layer(num_experts=4, top_k=2, shared=True)
    compiled_layer = copy.deepcopy(eager)
    x = torch.randn(2, 24, HIDDEN)
    if fp8:  # (one eager step each makes the FP8 state, as the compiled forward needs)
        for layer in (eager, compiled_layer):
            with te.fp8_autocast(fp8_recipe=fp8_recipe):
                layer(x).sum().backward()
            layer.zero_grad()
    compiled = torch.compile(compiled_layer, backend="aot_eager")
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
        out_eager, out_compiled = eager(xe), compiled(xc)
    grad = torch.randn_like(out_eager)
    out_eager.backward(grad)
    out_compiled.backward(grad)
    assert torch.equal(out_eager, out_compiled)
    assert rel_error(xc.grad, xe.grad) < 1e-6
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled_layer.parameters()):
        assert torch.equal(p_eager.grad, p_compiled.grad), name


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=0), "top_k"), (dict(top_k=5), "top_k"), (dict(jitter_noise=1.0), "jitter_noise"),
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff"), (dict(num_experts=0), "num_experts"),
])
def test_bad_arguments_are_refused(kwargs, match):
    args = dict(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_experts=4, top_k=2, device="cpu") | kwargs
    with pytest.raises(ValueError, match=match):
        MoELayer(**args)


def test_the_package_exports_moe():
    assert te.moe.MoELayer is MoELayer and te.moe.LayerNormMoE is LayerNormMoE
    assert {"moe", "GroupedLinear", "moe_permute", "moe_unpermute"} <= set(te.__all__)


def test_wrong_hidden_size_is_refused():
    with pytest.raises(ValueError, match="hidden_states"):
        make_layer()(torch.randn(3, HIDDEN + 1))


def block_layer(dtype=torch.float32, device="cpu"):
    """A layer whose GroupedLinears take block scaling (out_features multiples of 128: fc1 2 x 64, fc2 128)."""
    layer = MoELayer(128, 64, 4, 2, params_dtype=dtype, device=device)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0, 1.0 if name.startswith("router") else 128 ** -0.5)
    return layer


def test_block_scaling_on_cpu_reference_kernels():
    layer = block_layer()
    with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
        check_against_reference(layer, torch.randn(4, 16, 128), tol=2 * FP8_RTOL[torch.float8_e4m3fn],
                                grad_tol=2 * FP8_RTOL[torch.float8_e5m2])
    assert all(m._fp8_call_counts == [1, 0] for m in (layer.experts.linear_fc1, layer.experts.linear_fc2))


# --- GPU -----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_block_scaling_bf16_against_float64():
    layer = block_layer(torch.bfloat16, "cuda")
    with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
        check_against_reference(layer, torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16),
                                tol=2 * FP8_RTOL[torch.float8_e4m3fn], grad_tol=2 * FP8_RTOL[torch.float8_e5m2])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_recipe", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_gpu_fp8_bf16_against_float64(fp8_recipe):
    layer = make_layer(num_experts=8, top_k=2, shared=True, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4, 64, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with te.fp8_autocast(fp8_recipe=fp8_recipe):
        layer(x)
    with te.fp8_autocast(fp8_recipe=fp8_recipe):
        check_against_reference(layer, x, tol=2 * FP8_RTOL[torch.float8_e4m3fn],
                                grad_tol=2 * FP8_RTOL[torch.float8_e5m2])


@pytest.mark.gpu
def test_gpu_step_never_synchronises_with_the_host():
    layer = make_layer(num_experts=8, top_k=2, shared=True, dtype=torch.bfloat16, device="cuda",
                       aux_loss_coeff=0.01).train()
    x = torch.randn(512, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # (the first FP8 step calibrates the scales)
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            layer(x).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            out = layer(x)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()
