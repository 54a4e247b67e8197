"""Our GEMM modules with LoRA adapters: LoraLinear, LoraLayerNormLinear, LoraLayerNormMLP.

attach_adapter turns a Linear / LayerNormLinear / LayerNormMLP into its LoRA subclass in place (its class is swapped,
as torch.nn.utils.parametrize does: the parameters, their names, the FP8 scaling state and the state dict stay; the
adapters are added under `lora.<target>`, e.g. `lora.q_proj.lora_A.weight`). detach_adapters swaps it back.
The base GEMMs run as before (FP8 inside fp8_autocast); each adapter adds scale * B A x to its rows of the output:
- LoraLinear: x is the input; the update rides in the FP8 GEMM's epilogue as its `residual` (or is added after
  the GEMM when the caller passes a residual of its own).
- LoraLayerNormLinear: x is the normalised input, which the module returns (return_layernorm_output; the norm runs
  once, its high-precision output then cast to FP8).
- LoraLayerNormMLP: fc1's adapters (gate_proj, up_proj) read the normalised input, fc2's (down_proj) the activation,
  which the fused MLP never hands out; so the MLP runs unfused: a LayerNormLinear (norm + FC1), the activation, a
  Linear (FC2; its update and the residual in the epilogue), both over the MLP's own parameters (not registered as
  submodules: the state dict keeps the MLP's names). For the backward it keeps what the fused MLP keeps, FC1's
  output, plus the BF16 normalised input for gate/up's A: the activation is recomputed for down_proj's A.
A frozen base weight (requires_grad False) gets no weight gradient: the modules' autograd Functions skip the wgrad
GEMM and the FP8 transpose of its input (tests/test_lora.py counts the ops).
"""
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..float8_tensor import Float8Tensor
from ..module.layernorm_linear import LayerNormLinear
from ..module.layernorm_mlp import LayerNormMLP
from ..module.linear import Linear
from ..ops import activation_high_precision, tfp8
from ..module.activation import fused_activation
from .adapter import (LoraAdapter, add_lora_update, add_up_projection, any_dropout, down_projection, lora_update,
                      sorted_adapters, stacked_a, up_projection)


class _LoraModule:
    """What the three LoRA classes share: the adapters by target name under `lora`, looked up per GEMM."""

    lora: nn.ModuleDict

    def lora_adapters(self, gemm: str) -> list[LoraAdapter]:
        """The adapters on one GEMM of this module.

        Args:
            gemm: the GEMM's weight name ("weight", "fc1_weight" or "fc2_weight").
        Returns:
            Its adapters, in output-row order.
        """
        return sorted_adapters(a for a in self.lora.values() if a.gemm == gemm)


class LoraLinear(_LoraModule, Linear):
    """transformer_fp8.Linear with LoRA adapters on row blocks of its output (see the module docstring)."""

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None, residual: torch.Tensor | None = None,
                residual_grad_relay: Any = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Linear.forward plus the adapters' update.

        Args:
            inp, is_first_microbatch, residual, residual_grad_relay: as transformer_fp8.Linear.forward.
        Returns:
            What Linear.forward returns (the output, or (output, bias) with return_bias), with the update added.
        """
        adapters = self.lora_adapters("weight")
        if not adapters:
            return super().forward(inp, is_first_microbatch, residual, residual_grad_relay)
        if residual is None:  # the update is the GEMM's residual: added in its epilogue
            update = lora_update(adapters, inp, self.weight.shape[0], inp.dtype)
            return super().forward(inp, is_first_microbatch, update)
        out = super().forward(inp, is_first_microbatch, residual, residual_grad_relay)
        if isinstance(out, tuple):  # (return_bias)
            return (add_lora_update(out[0], inp, adapters), *out[1:])
        return add_lora_update(out, inp, adapters)


class LoraLayerNormLinear(_LoraModule, LayerNormLinear):
    """transformer_fp8.LayerNormLinear with LoRA adapters reading the normalised input (see the module docstring).
    `return_layernorm_output` is on while adapters are attached; `_lora_returns_ln` is what the caller asked for."""

    _lora_returns_ln = False

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                residual_grad_relay: Any = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """LayerNormLinear.forward plus the adapters' update on the normalised input.

        Args:
            inp, is_first_microbatch, residual_grad_relay: as transformer_fp8.LayerNormLinear.forward.
        Returns:
            What LayerNormLinear.forward returns as the caller configured it, with the update added to the output.
        """
        out, *rest = super().forward(inp, is_first_microbatch, residual_grad_relay)
        ln_out = rest[-1]
        adapters = self.lora_adapters("weight")
        if adapters:
            out = add_lora_update(out, ln_out, adapters)
        rest = rest if self._lora_returns_ln else rest[:-1]
        return (out, *rest) if rest else out


class _ActivationAndDown(torch.autograd.Function):
    """(act(x), h = act(x) Aᵀ) for down_proj's adapters, saving x (which the activation's backward needs anyway) and
    the stacked A: act is recomputed in the backward for A's gradient instead of kept ([tokens, ffn] less per layer
    for one elementwise pass), and act's two gradients (from FC2 and from h) meet before one activation backward."""

    @staticmethod
    def forward(ctx, x, a_stacked, activation):
        x2d = x.reshape(-1, x.shape[-1])
        act = activation_high_precision(x2d, activation)
        h = F.linear(act if act.dtype == a_stacked.dtype else act.to(a_stacked.dtype), a_stacked)
        ctx.save_for_backward(x2d, a_stacked)
        ctx.activation, ctx.x_shape = activation, x.shape
        return act.view(*x.shape[:-1], act.shape[-1]), h.view(*x.shape[:-1], h.shape[-1])

    @staticmethod
    def backward(ctx, d_act, dh):
        x2d, a_stacked = ctx.saved_tensors
        d_act = d_act.reshape(-1, d_act.shape[-1])
        dh = dh.reshape(-1, dh.shape[-1])
        act = activation_high_precision(x2d, ctx.activation)  # (recomputed: see the class docstring)
        da = dh.t() @ (act if act.dtype == dh.dtype else act.to(dh.dtype))
        d_act = torch.addmm(d_act, dh.to(d_act.dtype), a_stacked.to(d_act.dtype))  # FC2's gradient + h's
        dx = tfp8.activation_bwd(d_act, x2d, ctx.activation)
        return dx.view(ctx.x_shape), da, None


def _no_init(weight):
    """The unfused views' weights are the MLP's: nothing to initialise."""


class LoraLayerNormMLP(_LoraModule, LayerNormMLP):
    """transformer_fp8.LayerNormMLP with LoRA adapters on FC1 (gate_proj, up_proj: rows of fc1_weight) and FC2
    (down_proj), run unfused (see the module docstring)."""

    def _unfused(self) -> tuple[LayerNormLinear, Linear]:
        """(norm + FC1, FC2) over this MLP's parameters, made once (again after the parameters were replaced or
        moved). Their FP8 scaling states are their own (not in the state dict: a loaded model calibrates anew)."""
        views = self.__dict__.get("_lora_views")
        if views is not None and views[0].weight is self.fc1_weight and views[1].weight is self.fc2_weight and \
                views[0].layer_norm_weight is self.layer_norm_weight and views[0].bias is self.fc1_bias and \
                views[0]._device == self.fc1_weight.device:
            return views
        common = dict(params_dtype=self.params_dtype, device="meta", init_method=_no_init,
                      fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, fp8_min_gemm_size=self.fp8_min_gemm_size)
        fc1 = LayerNormLinear(self.hidden_size, self.fc1_weight.shape[0], eps=self.eps, bias=self.fc1_bias is not None,
                              normalization=self.normalization, zero_centered_gamma=self.zero_centered_gamma,
                              return_layernorm_output=True, **common)
        fc2 = Linear(self.ffn_hidden_size, self.hidden_size, bias=False, **common)
        fc1.layer_norm_weight, fc1.layer_norm_bias = self.layer_norm_weight, self.layer_norm_bias
        fc1.weight, fc1.bias, fc2.weight = self.fc1_weight, self.fc1_bias, self.fc2_weight
        for view, weight in ((fc1, self.fc1_weight), (fc2, self.fc2_weight)):
            view._device = weight.device
            view._fp8_params = self._fp8_params or isinstance(weight, Float8Tensor)
            view.train(self.training)
        fc2._plain = fc2._plain and not fc2._fp8_params  # (Linear's one-call paths take high-precision weights)
        views = (fc1, fc2)
        self.__dict__["_lora_views"] = views
        return views

    def _mlp(self, inp, fc2_bias, is_first_microbatch, residual):
        fc1, fc2 = self._unfused()
        fc1_out, ln_out = fc1(inp, is_first_microbatch=is_first_microbatch)
        adapters = self.lora_adapters("fc1_weight")
        if adapters:
            fc1_out = add_lora_update(fc1_out, ln_out, adapters)
        adapters = self.lora_adapters("fc2_weight")
        if adapters and not any_dropout(adapters):
            act, h = _ActivationAndDown.apply(fc1_out, stacked_a(adapters), self.activation)
        else:
            act = fused_activation(fc1_out, self.activation)
            h = down_projection(adapters, act) if adapters else None
        if h is not None:  # down_proj's update joins the residual (its add in the up-projection's epilogue), which
            # FC2's epilogue adds
            residual = up_projection(adapters, h, self.hidden_size, act.dtype) if residual is None else \
                add_up_projection(residual, h, adapters)
        out = fc2(act, is_first_microbatch=is_first_microbatch, residual=residual)
        return (out if fc2_bias is None else out + fc2_bias), ln_out


LORA_CLASSES = {Linear: LoraLinear, LayerNormLinear: LoraLayerNormLinear, LayerNormMLP: LoraLayerNormMLP}
BASE_CLASSES = {lora: base for base, lora in LORA_CLASSES.items()}


def attach_adapter(module: nn.Module, adapter: LoraAdapter, name: str) -> None:
    """Add `adapter` to `module` under lora.<adapter target>, turning it into its LoRA class first.

    Args:
        module: a Linear, LayerNormLinear or LayerNormMLP (or one with adapters already), without tensor parallelism.
        adapter: the adapter (its gemm names one of module's GEMM weights).
        name: module's qualified name (for the error messages).
    Raises:
        NotImplementedError: another module type, or tensor parallelism.
        ValueError: an adapter with that target is already attached.
    """
    cls = type(module)
    if cls not in LORA_CLASSES and cls not in BASE_CLASSES:
        raise NotImplementedError(f"{name}: LoRA adapters go on transformer_fp8 Linear, LayerNormLinear and "
                                  f"LayerNormMLP modules, got {cls.__name__}")
    if getattr(module, "tp", None) is not None:
        raise NotImplementedError(f"{name}: LoRA on tensor-parallel modules is not supported")
    target = adapter.hf_name.rsplit(".", 1)[-1]
    if cls in LORA_CLASSES:
        module.__class__ = LORA_CLASSES[cls]
        module.lora = nn.ModuleDict()
        if cls is LayerNormLinear:
            module._lora_returns_ln, module.return_layernorm_output = module.return_layernorm_output, True
    if target in module.lora:
        raise ValueError(f"{name}: already has a LoRA adapter for {adapter.hf_name} (merge_lora or remove_lora "
                         f"first)")
    module.lora[target] = adapter


def detach_adapters(module: nn.Module) -> None:
    """Remove the adapters of a LoRA module and give it back its base class (no merge: see merge_lora).

    Args:
        module: a LoRA module (is_lora_module).
    """
    base = BASE_CLASSES[type(module)]
    if base is LayerNormLinear:
        module.return_layernorm_output = module._lora_returns_ln
        del module._lora_returns_ln
    module.__dict__.pop("_lora_views", None)
    del module.lora
    module.__class__ = base


def is_lora_module(module: nn.Module) -> bool:
    """Whether module carries LoRA adapters (one of the LoRA classes).

    Args:
        module: any module.
    Returns:
        True for LoraLinear, LoraLayerNormLinear and LoraLayerNormMLP.
    """
    return type(module) in BASE_CLASSES
