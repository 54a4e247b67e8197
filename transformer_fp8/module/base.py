"""What every FP8 module shares: its scaling state, recipe adoption, the FP8 weight cast and cache, checkpoints.

Forward slots per GEMM: (input, weight); backward slots per GEMM: (grad_output). A `ScalingState` holds one set:
float32 amax_history [H, n] (row 0: this step's amax, max-accumulated by the casts), scale [n] (starts at 1),
scale_inv [n]. H is the recipe's amax_history_len (1 for current scaling).
"""
import math

import torch
import torch.nn as nn

from .. import autocast
from ..float8_tensor import Float8Tensor
from ..ops import tfp8
from ..recipe import FP8_MAX, Float8CurrentScaling


class ScalingState:
    """One set of FP8 slots, with one-element views of every slot made once (rebuilt when the tensors move)."""

    def __init__(self, n, history_len, device):
        self.amax_history = torch.zeros(history_len, n, dtype=torch.float32, device=device)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.scale_inv = torch.ones(n, dtype=torch.float32, device=device)
        self.pending = False  # queued for the next update (see autocast.py)
        self._make_views()

    def _make_views(self):
        n = self.scale.numel()
        self.device = self.scale.device
        self.scales = [self.scale[i:i + 1] for i in range(n)]
        self.scale_invs = [self.scale_inv[i:i + 1] for i in range(n)]
        self.amaxes = [self.amax_history[0, i:i + 1] for i in range(n)]
        self.histories = [self.amax_history[:, i:i + 1] for i in range(n)]

    @property
    def history_len(self):
        return self.amax_history.shape[0]

    def to(self, device):
        if self.scale.device != device:
            self.amax_history, self.scale, self.scale_inv = (
                t.to(device) for t in (self.amax_history, self.scale, self.scale_inv))
            self._make_views()

    def state_dict(self):
        return {"amax_history": self.amax_history, "scale": self.scale, "scale_inv": self.scale_inv}

    @classmethod
    def from_state_dict(cls, state, device):
        self = cls.__new__(cls)
        self.amax_history, self.scale, self.scale_inv = (
            state[k].detach().to(device=device, dtype=torch.float32, copy=True)
            for k in ("amax_history", "scale", "scale_inv"))
        self.pending = False
        self._make_views()
        return self

    def set_current_scale(self, x, i, fp8_max):
        """Current scaling: slot i's scale from amax(x) (the update re-zeroes the amax slot)."""
        tfp8.compute_amax(x, self.amaxes[i])
        tfp8.delayed_scaling_update([self.histories[i]], [self.scales[i]], [self.scale_invs[i]], fp8_max, 0.0,
                                    "most_recent")


def cast_transpose(x, state, i, fp8_dtype, current, rowwise=True, transpose=True):
    """x [M, N] -> (q [M, N] or empty, qT [N, M] or empty, scale_inv [1]) with slot i of `state`.
    The returned scale_inv is a fresh snapshot: the update may change the state's scale_inv before it is used."""
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    if current:
        state.set_current_scale(x, i, FP8_MAX[fp8_dtype])
        q, qt = tfp8.cast_transpose(x, state.scales[i], fp8_dtype, rowwise, transpose, None, scale_inv)
    else:
        q, qt = tfp8.cast_transpose(x, state.scales[i], fp8_dtype, rowwise, transpose, state.amaxes[i], scale_inv)
    return q, qt, scale_inv


def fp8_output_args(state, i, fp8_dtype):
    """(scale, fp8_dtype, amax, scale_inv snapshot) for an op that emits FP8 into slot i (delayed scaling)."""
    return state.scales[i], fp8_dtype, state.amaxes[i], torch.empty(1, dtype=torch.float32, device=state.device)


def check_dtype(params_dtype):
    if params_dtype is None:
        return torch.get_default_dtype()
    if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point or params_dtype in FP8_MAX:
        raise TypeError(f"params_dtype: expected a high-precision floating dtype, got {params_dtype!r}")
    return params_dtype


def check_positive(**sizes):
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def check_input(inp, in_features, name="inp"):
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(inp).__name__}")
    if inp.dim() < 1 or inp.shape[-1] != in_features:
        raise ValueError(f"{name}: expected last dim {in_features}, got shape {tuple(inp.shape)}")


def default_init(weight):
    """nn.Linear's weight init."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class FP8ModuleBase(nn.Module):
    """Base of the FP8 modules. Subclasses call `_fp8_begin(autocast.STATE)` at the start of an FP8 forward."""

    def __init__(self, num_gemms, params_dtype, device, fuse_wgrad_accumulation):
        super().__init__()
        self.params_dtype = check_dtype(params_dtype)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self._device = torch.device(device)
        self._n_fwd, self._n_bwd = 2 * num_gemms, num_gemms
        self.fp8_fwd = self.fp8_bwd = None
        self._fp8_recipe = None
        self._weight_cache = {}
        self.register_load_state_dict_pre_hook(_allow_missing_extra_state)

    # --- parameters ---
    def _weight_param(self, shape, init_method):
        """A weight parameter: high precision, or a Float8Tensor inside fp8_model_init."""
        weight = torch.empty(shape, dtype=self.params_dtype, device=self._device)
        (init_method or default_init)(weight)
        if autocast.STATE.model_init:
            weight = Float8Tensor.from_hp(weight)
        return nn.Parameter(weight)

    def _vector_param(self, size, value):
        return nn.Parameter(torch.full((size,), float(value), dtype=self.params_dtype, device=self._device))

    # --- per-call FP8 setup ---
    def _fp8_begin(self, state):
        """Adopt the active recipe and queue the forward state for the update (delayed scaling)."""
        recipe = state.recipe
        if recipe is not self._fp8_recipe:
            self._adopt_recipe(recipe)
        if not self.fp8_current and not self.fp8_fwd.pending:
            autocast.register_forward(self.fp8_fwd, recipe, state.group)
        return recipe

    def _adopt_recipe(self, recipe):
        self.fp8_current = isinstance(recipe, Float8CurrentScaling)
        history_len = 1 if self.fp8_current else recipe.amax_history_len
        if self.fp8_fwd is None or self.fp8_fwd.history_len != history_len:
            device = self._param_device()
            self.fp8_fwd = ScalingState(self._n_fwd, history_len, device)
            self.fp8_bwd = ScalingState(self._n_bwd, history_len, device)
        self.fwd_dtype, self.bwd_dtype = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
        self._fp8_recipe = recipe

    def _param_device(self):
        return next(self.parameters()).device

    # --- weights ---
    def _fp8_weight(self, name, weight, slot, need_transpose, is_first_microbatch):
        """FP8 copy of a weight [N, K]: (q [N, K], qT [K, N] or None, scale_inv [1]).
        is_first_microbatch True: cast and cache; False: reuse the cache (no cast); None: cast, no cache."""
        if is_first_microbatch is False:
            cached = self._weight_cache.get(name)
            if cached is not None:
                if need_transpose and cached[1] is None:
                    cached = (cached[0], tfp8.fp8_transpose(cached[0]), cached[2])
                    self._weight_cache[name] = cached
                return cached
        if isinstance(weight, Float8Tensor):
            q, scale_inv = weight._data, weight._scale_inv
            qt = tfp8.fp8_transpose(q) if need_transpose else None
        else:
            q, qt, scale_inv = cast_transpose(weight.detach(), self.fp8_fwd, slot, self.fwd_dtype, self.fp8_current,
                                              transpose=need_transpose)
            qt = qt if need_transpose else None
        if is_first_microbatch is not None:
            self._weight_cache[name] = (q, qt, scale_inv)
        return q, qt, scale_inv

    def _main_grad(self, weight):
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None:
            raise RuntimeError("fuse_wgrad_accumulation=True needs weight.main_grad (an FP32 tensor of the weight's "
                               "shape) to accumulate into; it is missing")
        return main_grad

    # --- checkpoints and device moves ---
    def get_extra_state(self):
        if self.fp8_fwd is None:
            return None
        return {"fwd": self.fp8_fwd.state_dict(), "bwd": self.fp8_bwd.state_dict()}

    def set_extra_state(self, state):
        if state is None:
            return
        device = self._param_device()
        self.fp8_fwd = ScalingState.from_state_dict(state["fwd"], device)
        self.fp8_bwd = ScalingState.from_state_dict(state["bwd"], device)
        self._fp8_recipe = None
        self._weight_cache.clear()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.fp8_fwd is not None:
            device = self._param_device()
            self.fp8_fwd.to(device)
            self.fp8_bwd.to(device)
        self._weight_cache.clear()
        return self


def _allow_missing_extra_state(module, state_dict, prefix, *args):
    """A state dict without FP8 state (e.g. from nn.Linear) loads with strict=True: the FP8 state starts fresh."""
    state_dict.setdefault(prefix + "_extra_state", None)
