"""The high-precision (fp8 disabled) path of LayerNormLinear / LayerNormMLP with lean saves (module/_high_precision.py):
what it keeps for the backward, that its outputs and gradients are those of autograd's composition
(recompute_in_backward=False), and float64 references."""
import pytest
import torch

import transformer_fp8 as te
from tests.ops.test_activation import CUDA_VS_CPU_RTOL, HP_RTOL, ops, random_pair, ref_backward, ref_forward
from tests.utils import assert_close_rel
from tests.module.helpers import DEVICES, params64, randomize_vectors, reference_forward
from tests.utils import rel_error

M, HIDDEN, FFN = 96, 64, 128  # (FFN a multiple of 128: the activation kernels' widest case)
MLP_CASES = [("RMSNorm", "swiglu", False), ("LayerNorm", "gelu", True), ("LayerNorm", "relu", True)]
DTYPES = [torch.bfloat16, torch.float32]


def _saved_bytes(module, x):
    """Bytes of the distinct non-parameter storages one forward of module(x) saves for the backward (a view keeps
    its whole base alive: counted at the base's size)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    return sum(storages.values()), out


def _make(kind, device, dtype, normalization="RMSNorm", activation="swiglu", bias=False, **kw):
    if kind == "mlp":
        module = te.LayerNormMLP(HIDDEN, FFN, normalization=normalization, activation=activation, bias=bias,
                                 params_dtype=dtype, device=device, **kw)
    else:
        module = te.LayerNormLinear(HIDDEN, FFN, normalization=normalization, bias=bias, params_dtype=dtype,
                                    device=device, **kw)
    randomize_vectors(module)
    module.recompute_in_backward = True  # (opt-in; the default keeps autograd's composition)
    return module


def _run(module, x, dy, recompute):
    """(output, input gradient, parameter gradients by name) of one forward + backward."""
    module.recompute_in_backward = recompute
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalization,activation,bias", MLP_CASES)
def test_mlp_saves_input_stats_and_fc1_output_only(device, dtype, normalization, activation, bias):
    module = _make("mlp", device, dtype, normalization, activation, bias)
    x = torch.randn(M, HIDDEN, device=device, dtype=dtype, requires_grad=True)
    size = dtype.itemsize
    fc1_width = 2 * FFN if activation == "swiglu" else FFN
    stats = M * 4 * (2 if normalization == "LayerNorm" else 1)  # (float32 rstd, and mean for LayerNorm)
    lean, _ = _saved_bytes(module, x)
    assert lean == M * HIDDEN * size + stats + M * fc1_width * size
    module.recompute_in_backward = False  # autograd's composition also keeps norm(x) and act(fc1_out)
    full, _ = _saved_bytes(module, x)
    assert full == lean + M * HIDDEN * size + M * FFN * size


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_layernorm_linear_saves_no_norm_output(device, dtype, normalization):
    module = _make("linear", device, dtype, normalization)
    x = torch.randn(M, HIDDEN, device=device, dtype=dtype, requires_grad=True)
    stats = M * 4 * (2 if normalization == "LayerNorm" else 1)
    lean, _ = _saved_bytes(module, x)
    assert lean == M * HIDDEN * dtype.itemsize + stats
    module.recompute_in_backward = False
    full, _ = _saved_bytes(module, x)
    assert full == lean + M * HIDDEN * dtype.itemsize


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("kind,normalization,activation,bias",
                         [("mlp", *case) for case in MLP_CASES] + [("linear", "RMSNorm", None, False),
                                                                   ("linear", "LayerNorm", None, True)])
def test_same_outputs_and_gradients_as_the_composition(device, dtype, zero_centered_gamma, kind, normalization,
                                                       activation, bias):
    """Recomputing norm(x) and act(fc1_out) runs the forward's kernels on the same inputs: the same bits, so every
    output and gradient equals autograd's composition (which keeps them) exactly; both are checked against float64
    math too (a lean path that dropped a term would fail there even if the composition did the same)."""
    torch.manual_seed(0)
    extra = {"activation": activation} if kind == "mlp" else {}
    module = _make(kind, device, dtype, normalization, bias=bias, zero_centered_gamma=zero_centered_gamma, **extra)
    x = torch.randn(3, M // 3, HIDDEN, device=device, dtype=dtype)
    dy = torch.randn(3, M // 3, FFN if kind == "linear" else HIDDEN, device=device, dtype=dtype)
    lean, full = _run(module, x, dy, True), _run(module, x, dy, False)
    assert torch.equal(lean[0], full[0]) and torch.equal(lean[1], full[1])
    for name, grad in lean[2].items():
        assert torch.equal(grad, full[2][name]), name
    p64 = params64(module)
    x64 = x.double().requires_grad_()
    reference_forward(module, x64, p64).backward(dy.double())
    # (16 bits: every intermediate is rounded, ~2**-9 (BF16) / 2**-12 (FP16) relative each, and the input gradient
    # chains five of them; ReLU's step flips a few entries, which moves a gradient by a whole term whatever the
    # mantissa: measured up to 0.022 (BF16) and 0.025 (FP16, LayerNorm + ReLU on the newest torch's CPU); float32:
    # ~1e-6)
    tol = {torch.bfloat16: 5e-2, torch.float16: 5e-2}.get(dtype, 1e-4)
    assert rel_error(lean[0], reference_forward(module, x.double(), p64).detach()) < tol
    assert rel_error(lean[1], x64.grad) < tol
    for name, grad in lean[2].items():
        assert rel_error(grad, p64[name].grad) < tol, name


@pytest.mark.parametrize("device", DEVICES)
def test_transformer_layer_bf16_step_matches_the_composition(device):
    """A whole TransformerLayer (RMSNorm, SwiGLU, GQA, no bias, residuals) in BF16: lean saves change no bit. (On
    CUDA the fused attention's backward may accumulate dq in a varying order: the gradients it feeds, the QKV
    projection's and the input's, are compared within BF16 rounding there; the output and the MLP's gradients,
    computed before it, bit for bit.)"""
    layer = te.TransformerLayer(HIDDEN, FFN, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                                bias=False, activation="swiglu", normalization="RMSNorm", params_dtype=torch.bfloat16,
                                device=device)
    randomize_vectors(layer)
    x = torch.randn(16, 2, HIDDEN, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    results = []
    for recompute in (True, False):
        for m in layer.modules():
            if hasattr(m, "recompute_in_backward"):
                m.recompute_in_backward = recompute
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = layer(xg)
        out.backward(dy)
        results.append({"output": out.detach(), "input": xg.grad, **{n: p.grad for n, p in layer.named_parameters()}})
    for name, lean in results[0].items():
        if device == "cpu" or name == "output" or name.startswith("layernorm_mlp."):
            assert torch.equal(lean, results[1][name]), name
        else:
            assert rel_error(lean, results[1][name]) < 1e-2, name


@pytest.mark.parametrize("setting", ["return_layernorm_output", "fuse_wgrad_accumulation", "no_grad", "off"])
def test_cases_that_keep_the_composition(setting):
    """Where the norm output is returned, the wgrad goes to main_grad, no gradient is recorded or the attribute is
    off, the composition runs (it saves norm(x) and act(fc1_out), or nothing under no_grad)."""
    kw = {setting: True} if setting in ("return_layernorm_output", "fuse_wgrad_accumulation") else {}
    module = _make("mlp", "cpu", torch.bfloat16, **kw)
    if setting == "fuse_wgrad_accumulation":
        for p in module.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    module.recompute_in_backward = setting != "off"
    x = torch.randn(M, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    if setting == "no_grad":
        with torch.no_grad():
            saved, _ = _saved_bytes(module, x)
        assert saved == 0
        return
    saved, _ = _saved_bytes(module, x)
    size = 2
    assert saved == 2 * M * HIDDEN * size + M * 4 + M * 2 * FFN * size + M * FFN * size


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(33, 2048), (3, 5, 4096), (1, 1024), (7, 2056)])
def test_cuda_rows_kernels_match_the_cpu_reference(activation, dtype, shape):
    """activation_fwd / activation_bwd with rows of >= 1024 outputs take the [rows, cols] kernels of
    csrc/activation_rows.cu (16-byte vectors where the width allows, two rows per thread: odd row counts leave one
    alone): against the CPU reference kernels and float64 math, as the flat kernels' tests."""
    width = shape[-1] * (2 if activation == "swiglu" else 1)
    dy, x = random_pair((*shape[:-1], width), activation, dtype, "cuda")
    y = ops.activation_fwd(x, activation)
    assert rel_error(y.cpu(), ops.activation_fwd(x.cpu(), activation)) <= CUDA_VS_CPU_RTOL[dtype]
    assert_close_rel(y.cpu(), ref_forward(x.cpu(), activation), HP_RTOL[dtype])
    dx = ops.activation_bwd(dy, x, activation)
    assert rel_error(dx.cpu(), ops.activation_bwd(dy.cpu(), x.cpu(), activation)) <= CUDA_VS_CPU_RTOL[dtype]
    assert_close_rel(dx.cpu(), ref_backward(dy.cpu(), x.cpu(), activation), 4 * HP_RTOL[dtype])
