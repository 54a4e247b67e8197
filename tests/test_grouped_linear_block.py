"""GroupedLinear under recipe.Float8BlockScaling (1x128 tiles for inputs and gradients, 128x128 weight blocks, the
block-scaled grouped GEMMs) against a float64 per-expert reference, values and gradients: uneven and empty groups as
lists and device tensors, groups of multiples of 128 (no padded copies), biases, output activations,
fuse_wgrad_accumulation, fp8_model_init with block weights, the weight cache, and what is refused.
The FP8 path runs on the CPU through the ops' reference kernels, and on the GPU (marked gpu) through the CUDA ones."""
import pytest
import torch

import transformer_fp8 as te
from tests.test_grouped_linear import FWD_TOL, GRAD_TOL, reference, run_against_reference
from tests.utils import assert_close_rel
from transformer_fp8 import grouped_gemm
from transformer_fp8.recipe import DelayedScaling, Float8BlockScaling, Format

SPLITS = {"uneven_empty": [37, 0, 100, 5, 0, 50], "tiles_of_128": [128, 0, 256, 128], "one_group": [300]}


def block_module(splits, in_features=160, out_features=256, device="cpu", **kwargs):
    module = te.GroupedLinear(len(splits), in_features, out_features, device=device, **kwargs)
    for b in module.biases:
        torch.nn.init.normal_(b, std=0.1)
    return module


def test_issue_case_runs_and_matches_float64():
    """The case that crashed ("a_scale_inv: expected a 1-D tensor of 1 elements, got shape (2, 512)")."""
    torch.manual_seed(0)
    module = te.GroupedLinear(4, 256, 256, device="cpu")
    run_against_reference(module, [128, 128, 0, 256], "cpu", torch.float32, Float8BlockScaling(), False, FWD_TOL,
                          GRAD_TOL)


@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("tensor_splits", (False, True))
def test_block_cpu_matches_float64(splits, tensor_splits):
    torch.manual_seed(1)
    run_against_reference(block_module(splits), splits, "cpu", torch.float32, Float8BlockScaling(), tensor_splits,
                          FWD_TOL, GRAD_TOL)


def test_block_hybrid_format_runs_e4m3_gradients():
    splits = [37, 0, 91]
    run_against_reference(block_module(splits), splits, "cpu", torch.float32,
                          Float8BlockScaling(fp8_format=Format.HYBRID), True, FWD_TOL, GRAD_TOL)


def test_block_host_tiles_of_128_skip_padded_copies(monkeypatch):
    def refuse(*args):
        raise AssertionError("padded copy made for groups of multiples of 128 rows")
    monkeypatch.setattr("transformer_fp8.module._grouped_linear_block.padded_groups", refuse)
    splits = SPLITS["tiles_of_128"]
    run_against_reference(block_module(splits), splits, "cpu", torch.float32, Float8BlockScaling(), False, FWD_TOL,
                          GRAD_TOL)


@pytest.mark.parametrize("activation", ("swiglu", "gelu"))
@pytest.mark.parametrize("bias", (False, True))
def test_block_output_activation_matches_float64(activation, bias, device="cpu"):
    splits = [37, 0, 100, 5]
    module = block_module(splits, bias=bias, device=device)
    run_against_reference(module, splits, device, torch.float32, Float8BlockScaling(), True, FWD_TOL, GRAD_TOL,
                          output_activation=activation)


def test_block_fuse_wgrad_accumulation():
    splits = [20, 0, 44]
    module = block_module(splits, in_features=32, out_features=128, bias=False, fuse_wgrad_accumulation=True)
    run_against_reference(module, splits, "cpu", torch.float32, Float8BlockScaling(), True, FWD_TOL, GRAD_TOL,
                          main_grad=True)
    assert all(w.grad is None for w in module.weights)


def test_block_fp8_model_init_weights(device="cpu"):
    splits = [16, 0, 140]
    with te.fp8_model_init(recipe=Float8BlockScaling()):
        module = te.GroupedLinear(3, 160, 128, bias=False, device=device)
    assert all(isinstance(w, te.Float8Tensor) and w.layout == "block_128x128" for w in module.weights)
    x = torch.randn(156, 160, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=Float8BlockScaling()):
        out = module(x, torch.tensor(splits, device=device))
    weights64 = [w.dequantize().double().requires_grad_() for w in module.weights]
    x64 = x.detach().double().requires_grad_()
    ref = reference(x64, weights64, [], splits)
    assert_close_rel(out, ref, FWD_TOL)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    assert_close_rel(x.grad, x64.grad, GRAD_TOL, "dx")


def test_block_weights_under_a_per_tensor_recipe_are_refused():
    with te.fp8_model_init(recipe=Float8BlockScaling()):
        module = te.GroupedLinear(2, 32, 128, bias=False, device="cpu")
    with te.fp8_autocast(fp8_recipe=DelayedScaling()), pytest.raises(TypeError, match="Float8BlockScaling"):
        module(torch.randn(32, 32), [16, 16])


def test_per_tensor_fp8_weights_under_block_scaling_are_refused():
    with te.fp8_model_init():
        module = te.GroupedLinear(2, 32, 128, bias=False, device="cpu")
    with te.fp8_autocast(fp8_recipe=Float8BlockScaling()), pytest.raises(TypeError, match="block-scaled FP8"):
        module(torch.randn(32, 32), [16, 16])


@pytest.mark.parametrize("recipe, message", (
    (Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1), r"got \(2, 1, 1\)"),
    (Float8BlockScaling(w_block_scaling_dim=1, grad_block_scaling_dim=2), r"got \(1, 1, 2\)"),
))
def test_unbuilt_block_settings_are_refused(recipe, message):
    module = te.GroupedLinear(2, 32, 128, device="cpu")
    with te.fp8_autocast(fp8_recipe=recipe), pytest.raises(NotImplementedError, match=message):
        module(torch.randn(32, 32), [16, 16])


def test_out_features_not_a_multiple_of_128_is_refused():
    module = te.GroupedLinear(2, 32, 48, device="cpu")
    with te.fp8_autocast(fp8_recipe=Float8BlockScaling()), pytest.raises(NotImplementedError, match="multiple of 128"):
        module(torch.randn(32, 32), [16, 16])


def test_block_weight_cache_follows_is_first_microbatch():
    splits = [16, 48]
    module = block_module(splits, in_features=32, out_features=128)
    x = torch.randn(64, 32)
    with te.fp8_autocast(fp8_recipe=Float8BlockScaling()):
        first = module(x, splits, is_first_microbatch=True)
        with torch.no_grad():
            for w in module.weights:
                w.mul_(2)
        cached = module(x, splits, is_first_microbatch=False)
        fresh = module(x, splits)
    torch.testing.assert_close(cached, first)
    assert not torch.allclose(fresh, first)


# --- CUDA ---
def cutlass_built():
    return torch._C._dispatch_has_kernel_for_dispatch_key("transformer_fp8::grouped_block_fp8_gemm_sm90", "CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ("auto", "torch"))
@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("tensor_splits", (False, True))
def test_cuda_block_matches_float64(backend, splits, tensor_splits, monkeypatch):
    monkeypatch.setattr(grouped_gemm, "BACKEND", backend)
    torch.manual_seed(2)
    module = block_module(splits, device="cuda", params_dtype=torch.bfloat16)
    run_against_reference(module, splits, "cuda", torch.bfloat16, Float8BlockScaling(), tensor_splits, FWD_TOL,
                          GRAD_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ("swiglu", "gelu"))
def test_cuda_block_output_activation_and_fused_wgrad(activation):
    splits = [300, 0, 17, 195]
    module = block_module(splits, device="cuda", bias=False, fuse_wgrad_accumulation=True)
    run_against_reference(module, splits, "cuda", torch.float32, Float8BlockScaling(), True, FWD_TOL, GRAD_TOL,
                          main_grad=True, output_activation=activation)


@pytest.mark.gpu
def test_cuda_block_fp8_model_init():
    test_block_fp8_model_init_weights(device="cuda")


@pytest.mark.gpu
def test_cuda_block_step_never_syncs():
    module = te.GroupedLinear(8, 256, 256, params_dtype=torch.bfloat16)
    m_splits = torch.tensor([100, 0, 28, 300, 12, 0, 60, 12], device="cuda")
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for step in range(3):
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with te.fp8_autocast(fp8_recipe=Float8BlockScaling()):
                module(x, m_splits, output_activation="swiglu").sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
