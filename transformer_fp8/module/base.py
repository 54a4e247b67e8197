"""What every FP8 module shares: its quantizers (recipe adoption), the FP8 weight cast and cache, checkpoints.

A module declares `forward_roles` / `backward_roles` (quantization.roles); on its first FP8 call under a recipe it
builds a QuantizerSet over them (`self.quantizers`), which owns the forward and backward ScalingStates
(`fp8_fwd` / `fp8_bwd` read them; their slot order is the roles' order, the checkpoint format) and one quantizer per
role. The module casts with `self.quantizers[Role.X]` and never asks which recipe it runs (see quantization/).
"""
import math
import os
import warnings

import torch
import torch.nn as nn

from .. import autocast
from ..float8_tensor import Float8Tensor
from ..ops import tfp8
from ..quantization import FP8Operand, QuantizerSet, ScalingState, quantizer_class  # noqa: F401  (ScalingState:
# re-exported, its former home)
from ..recipe import FP8_MAX


def _threshold_from_env(default):
    """The environment variable TFP8_MIN_GEMM_SIZE as an int >= 0, or `default` when unset."""
    text = os.environ.get("TFP8_MIN_GEMM_SIZE")
    if text is None or not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"TFP8_MIN_GEMM_SIZE: expected an int >= 0 (GEMM work M*K*N), got {text!r}")
    return value


# Small-shape automatic path: inside fp8_autocast, a module on a CUDA input whose GEMM work M*K*N (summed over its
# GEMMs) is below this runs its high-precision path instead: there FP8's extra casts and launches cost more than the
# GEMM saves. H100, no_grad Linear with cached FP8 weights vs BF16 nn.Linear (benchmarks/bench_modules.py): FP8 takes
# 1.0-1.5x the time at M*K*N ~ 1.3e10, 0.8-1.2x at 2.7e10, 0.70-0.93x at 5.4e10, ~0.7x from 1.1e11.
# Set per module with `fp8_min_gemm_size=` (0 always uses FP8), or change this default: set_fp8_min_gemm_size(n), or
# the environment variable TFP8_MIN_GEMM_SIZE (read at import). Read at each call. The first fallback of the process
# warns (FP8FallbackWarning); every module counts its FP8 and high-precision calls (see _runs_fp8).
FP8_MIN_GEMM_SIZE = _threshold_from_env(2 ** 35)


def set_fp8_min_gemm_size(size: int) -> None:
    """Set the default small-shape threshold: inside fp8_autocast, a module on a CUDA input whose GEMM work M*K*N is
    below it runs high precision (modules with their own `fp8_min_gemm_size` keep theirs).

    Args:
        size: an int >= 0; 0 runs FP8 at every size. The default is 2**35 (or TFP8_MIN_GEMM_SIZE at import).
    """
    global FP8_MIN_GEMM_SIZE
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size: expected an int >= 0, got {size!r}")
    FP8_MIN_GEMM_SIZE = size


def get_fp8_min_gemm_size() -> int:
    """Returns:
        The default small-shape threshold on M*K*N (see set_fp8_min_gemm_size)."""
    return FP8_MIN_GEMM_SIZE


class FP8FallbackWarning(UserWarning):
    """A module inside fp8_autocast ran its high-precision path because its GEMMs are small (once per process)."""


_fallback_warned = False  # (one warning per process: see FP8ModuleBase._note_small_shape)

# A weight of at least this many elements has its FP8 Wᵀ cast in the backward (from the weight, with the forward's
# scale) rather than kept from the forward: that frees one byte per element for the whole step (Llama 1.1B, batch
# 4 x 2048 on the H100: peak 15.66 -> 14.77 GiB, tokens/s 94.8k -> 93.3k). Smaller weights keep the forward's Wᵀ,
# which costs no extra launches where the host time is what counts. Read at each call.
MIN_RECAST_WEIGHT_NUMEL = 2 ** 22


def keeps_weight_transpose(weight, is_first_microbatch):
    """Whether the forward makes (and the backward reuses) the FP8 Wᵀ of `weight`: cached weights and those under
    MIN_RECAST_WEIGHT_NUMEL elements; bigger uncached weights have Wᵀ cast again in the backward."""
    return is_first_microbatch is not None or weight.numel() < MIN_RECAST_WEIGHT_NUMEL


def fp8_weight(cache, name, weight, quantizer, need_transpose, is_first_microbatch):
    """FP8 copy of a weight [N, K] for the forward GEMM: an FP8Operand with data [N, K] and data_t [K, N] or None.
    Call inside an autograd Function's forward (grad mode off: the weight goes to the cast as it is).

    Args:
        cache: the module's weight cache (a dict: name -> FP8Operand).
        name: the weight's name (its cache key).
        weight: the high-precision weight or a Float8Tensor.
        quantizer: the weight role's quantizer.
        need_transpose: the backward's dgrad needs Wᵀ: makes data_t, except for an uncached weight of at least
            MIN_RECAST_WEIGHT_NUMEL elements (the backward then casts Wᵀ itself, see fp8_weight_transpose).
        is_first_microbatch: True: cast and cache; False: reuse the cache (no cast); None: cast, no cache.

    Returns:
        The FP8Operand.
    """
    if is_first_microbatch is False:
        cached = cache.get(name)
        if cached is not None:
            if need_transpose and cached.data_t is None:
                cached = FP8Operand(cached.data, tfp8.fp8_transpose(cached.data), cached.scale_inv, cached.fp8_dtype)
                cache[name] = cached
            return cached
    need_transpose = need_transpose and keeps_weight_transpose(weight, is_first_microbatch)
    if isinstance(weight, Float8Tensor):
        qt = weight.transpose_data() if need_transpose else None  # (kept on it: see keep_transpose_)
        operand = FP8Operand(weight._data, qt, weight._scale_inv, weight._data.dtype)
    else:
        operand = quantizer.cast(weight, transpose=need_transpose)
    if is_first_microbatch is not None:
        cache[name] = operand
    return operand


def fp8_weight_transpose(weight, operand, quantizer):
    """Returns:
        The forward's weight operand with data_t (Wᵀ [K, N], for a dgrad GEMM): as it is when it has one (a cached
        or kept copy), else the weight cast again with the operand's scale (no amax update), or a Float8Tensor's
        data transposed."""
    if operand.data_t is not None:
        return operand
    if isinstance(weight, Float8Tensor):
        data_t = weight.transpose_data()
    else:
        data_t = quantizer.transpose_like(weight, operand)
    return FP8Operand(None, data_t, operand.scale_inv, operand.fp8_dtype)


def main_grad_of(weight):
    """Returns:
        weight.main_grad (FP32, the weight's shape), which fuse_wgrad_accumulation accumulates the wgrad into; a
        RuntimeError saying so when it is missing."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError("fuse_wgrad_accumulation=True needs weight.main_grad (an FP32 tensor of the weight's "
                           "shape) to accumulate into; it is missing")
    return main_grad


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


def check_residual(residual, inp, out_features, tp):
    """A forward's residual argument: the output's shape and dtype (the input's), no sequence parallelism (the
    residual is then this rank's sequence block, the GEMM output the full sequence)."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual: expected a tensor, got {type(residual).__name__}")
    if tp is not None and tp.sequence_parallel:
        raise ValueError("residual: not supported with sequence parallelism (add it to the output instead)")
    shape = (*inp.shape[:-1], out_features)
    if tuple(residual.shape) != shape or residual.dtype != inp.dtype or residual.device != inp.device:
        raise ValueError(f"residual: expected shape {shape}, dtype {inp.dtype} and device {inp.device} (the "
                         f"output's), got {tuple(residual.shape)}, {residual.dtype}, {residual.device}")


def residual_rows(residual):
    """residual [..., N] -> [M, N] contiguous (the GEMM's C), or None."""
    return None if residual is None else residual.reshape(-1, residual.shape[-1]).contiguous()


def pack_outputs(module, out, bias, ln_out):
    """out, then the unadded bias (return_bias) and the norm's output (return_layernorm_output) when asked for."""
    extra = ((bias,) if module.return_bias else ()) + ((ln_out,) if module.return_layernorm_output else ())
    return (out, *extra) if extra else out


def default_init(weight):
    """nn.Linear's weight init."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class FP8ModuleBase(nn.Module):
    """Base of the FP8 modules. Subclasses declare `forward_roles` / `backward_roles` (tuples of quantization.Role,
    in slot order) and call `_fp8_begin(autocast.STATE)` at the start of an FP8 forward."""

    forward_roles: tuple = ()
    backward_roles: tuple = ()

    def __init__(self, params_dtype, device, fuse_wgrad_accumulation, gemm_n, fp8_min_gemm_size):
        """gemm_n: sum of the module's GEMM output widths, so that M*K*N summed over its GEMMs = inp.numel() * gemm_n.
        fp8_min_gemm_size: None (FP8_MIN_GEMM_SIZE, read at each call) or an int >= 0 (see FP8_MIN_GEMM_SIZE)."""
        super().__init__()
        if fp8_min_gemm_size is not None and (isinstance(fp8_min_gemm_size, bool) or
                                              not isinstance(fp8_min_gemm_size, int) or fp8_min_gemm_size < 0):
            raise ValueError(f"fp8_min_gemm_size: expected None or an int >= 0, got {fp8_min_gemm_size!r}")
        self.params_dtype = check_dtype(params_dtype)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.fp8_min_gemm_size, self._gemm_n = fp8_min_gemm_size, gemm_n
        self._fp8_params = autocast.STATE.model_init  # Float8Tensor weights: always the FP8 path
        self._device = torch.device(device)
        self.quantizers = None  # a QuantizerSet, made at the first FP8 call (or by set_extra_state)
        self._fp8_recipe = None  # the recipe self.quantizers were made for (None: none yet)
        self._weight_cache = {}
        self._last_forward_fp8 = False  # (see _check_recompute_precision)
        # forwards inside fp8_autocast: [FP8, high precision] (a list: an increment costs no nn.Module.__setattr__)
        self._fp8_call_counts = [0, 0]
        self.fp8_disabled = False  # True: the high-precision path even inside fp8_autocast (debug.disable_fp8)
        self.register_load_state_dict_pre_hook(_allow_missing_extra_state)

    # --- parameters ---
    def _weight_param(self, shape, init_method, tp=None, shard_dim=0, shard_blocks=1):
        """A weight parameter: high precision, or a Float8Tensor inside fp8_model_init. With tp (a
        distributed.TensorParallel), the full `shape` is initialised and this rank's shard kept (see tp.shard)."""
        weight = torch.empty(shape, dtype=self.params_dtype, device=self._device)
        (init_method or default_init)(weight)
        if tp is not None:
            weight = tp.shard(weight, shard_dim, shard_blocks)
        if not autocast.STATE.model_init:
            return nn.Parameter(weight)
        param = nn.Parameter(Float8Tensor.from_hp(weight))
        if autocast.STATE.preserve_init_val:
            param._high_precision_init_val = weight.cpu()
        return param

    def _vector_param(self, size, value):
        return nn.Parameter(torch.full((size,), float(value), dtype=self.params_dtype, device=self._device))

    # --- per-call FP8 setup ---
    def _runs_fp8(self, inp, rows_factor=1):
        """Inside fp8_autocast (the caller checks): False when the small-shape automatic path applies (CUDA input,
        high-precision weights, inp.numel() * rows_factor * gemm_n < fp8_min_gemm_size) or fp8_disabled is set, True
        otherwise; counts the call in _fp8_call_counts.
        rows_factor: GEMM rows per input row (the TP size where the module all-gathers a sequence-parallel input)."""
        if self.fp8_disabled:
            self._count_call(fp8=False)
            return False
        if not self._fp8_params and inp.is_cuda:
            threshold = FP8_MIN_GEMM_SIZE if self.fp8_min_gemm_size is None else self.fp8_min_gemm_size
            work = inp.numel() * rows_factor * self._gemm_n
            if work < threshold:
                self._note_small_shape(work)
                return False
        self._count_call(fp8=True)
        return True

    def _count_call(self, fp8):
        """One more forward inside fp8_autocast, FP8 or high precision. Not while torch.compile traces: a counter
        changed in the graph becomes a guarded constant, which would recompile the graph at every call."""
        if not torch.compiler.is_compiling():
            self._fp8_call_counts[0 if fp8 else 1] += 1

    def _note_small_shape(self, work):
        """Count a high-precision call inside fp8_autocast, and warn at the process's first small-shape fallback
        (M*K*N = work below the threshold)."""
        global _fallback_warned
        self._count_call(fp8=False)
        if _fallback_warned or self.fp8_disabled or torch.compiler.is_compiling():  # (Dynamo cannot trace a warning)
            return
        _fallback_warned = True
        name = getattr(self, "_tfp8_name", None)
        threshold = FP8_MIN_GEMM_SIZE if self.fp8_min_gemm_size is None else self.fp8_min_gemm_size
        warnings.warn(
            f"{type(self).__name__}{f' {name!r}' if name else ''} ({self.extra_repr()}) ran in high precision inside "
            f"fp8_autocast: its GEMM work M*K*N = {work:.3g} is below the small-shape threshold {threshold:.3g}, "
            "where FP8's casts cost more than its GEMM saves. To run FP8 at every size pass fp8_min_gemm_size=0 to "
            "the module, or call transformer_fp8.set_fp8_min_gemm_size(0) (environment: TFP8_MIN_GEMM_SIZE=0). "
            "Warned once per process; transformer_fp8.debug.report(model) counts each module's FP8 and "
            "high-precision calls (docs/small_shapes.md).", FP8FallbackWarning, stacklevel=2)

    def _fp8_begin(self, state):
        """Adopt the active recipe and queue the forward state for the update (delayed scaling); inside a checkpoint
        region's forward, have the region record the forward scales (see checkpoint.py)."""
        recipe = state.recipe
        if recipe is not self._fp8_recipe:
            self._adopt_recipe(recipe)
        if not self._last_forward_fp8:  # (nn.Module.__setattr__ costs microseconds: set only on a change)
            self._last_forward_fp8 = True
        if state.checkpoint is not None and state.checkpoint.recording:
            state.checkpoint.record(self, "fp8_fwd")
        self.quantizers.begin_forward(state)
        return recipe

    def _calibrate(self, *tensors):
        """Inside fp8_autocast(calibrating=True), on the high-precision path: max-accumulate the amax of tensors[i]
        (the tensor the FP8 path casts for forward_roles[i]; None or a Float8Tensor: skipped) and queue the forward
        state for the update at the autocast's exit (recipes whose scales come from an amax history; else nothing:
        see QuantizerSet.record_amaxes)."""
        state = autocast.STATE
        if not quantizer_class(state.recipe).updates_by_history:  # (nothing to record: no state is made)
            return
        if state.recipe is not self._fp8_recipe:
            self._adopt_recipe(state.recipe)
        self.quantizers.record_amaxes(tensors, state)

    def _check_recompute_precision(self):
        """Call on a forward's high-precision path when self._last_forward_fp8. Outside fp8_autocast, inside a
        running backward, after an FP8 forward: an activation-checkpointing recompute (torch.utils.checkpoint) that
        would give the backward a high-precision forward's tensors. Refused; transformer_fp8.checkpoint recomputes in
        FP8."""
        if autocast.STATE.enabled:
            return
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError(f"{type(self).__name__}: its forward ran in FP8 and is recomputed in the backward "
                               "outside fp8_autocast (torch.utils.checkpoint?); checkpoint FP8 modules with "
                               "transformer_fp8.checkpoint(function, *args), which recomputes them in FP8 with the "
                               "forward's scales (Hugging Face models: "
                               "transformer_fp8.integrations.gradient_checkpointing_enable(model))")
        self._last_forward_fp8 = False

    def _adopt_recipe(self, recipe):
        """Build the QuantizerSet for `recipe`, keeping the existing states when their history length suits it."""
        old = self.quantizers
        states = None if old is None else (old.fwd_state, old.bwd_state)
        needs_new = states is None or states[0].history_len != quantizer_class(recipe).history_len(recipe)
        if needs_new and torch.compiler.is_compiling():  # (a compiled backward's writes to a state made in its graph
            raise RuntimeError(f"{type(self).__name__}: torch.compile(fullgraph=True) needs the module's FP8 "  # lost)
                               "scaling state before the compiled call: run one forward eagerly inside "
                               "fp8_autocast with this recipe first (or load a checkpoint saved with it)")
        tp = getattr(self, "tp", None)  # (TP modules: quantizers that share amaxes do so over the TP group)
        self.quantizers = QuantizerSet(recipe, self.forward_roles, self.backward_roles,
                                       self._param_device() if needs_new else states[0].device,
                                       tp.group if tp is not None else None, states)
        self.fwd_dtype, self.bwd_dtype = self.quantizers.fwd_dtype, self.quantizers.bwd_dtype
        self._fp8_recipe = recipe

    # --- the scaling states (read by checkpoints, graphs, debug and tests; a checkpoint region swaps them) ---
    @property
    def fp8_fwd(self):
        """The forward roles' ScalingState, or None before the first FP8 call."""
        return None if self.quantizers is None else self.quantizers.fwd_state

    @fp8_fwd.setter
    def fp8_fwd(self, state):
        self.quantizers.fwd_state = state

    @property
    def fp8_bwd(self):
        """The backward roles' ScalingState, or None before the first FP8 call."""
        return None if self.quantizers is None else self.quantizers.bwd_state

    @fp8_bwd.setter
    def fp8_bwd(self, state):
        self.quantizers.bwd_state = state

    def _param_device(self):
        return next(self.parameters()).device

    # --- checkpoints and device moves ---
    def get_extra_state(self):
        return None if self.quantizers is None else self.quantizers.extra_state()

    def set_extra_state(self, state):
        if state is None:
            return
        device = self._param_device()
        self.quantizers = QuantizerSet.from_states(self.forward_roles, self.backward_roles,
                                                   ScalingState.from_state_dict(state["fwd"], device),
                                                   ScalingState.from_state_dict(state["bwd"], device))
        self._fp8_recipe = None
        self._weight_cache.clear()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.quantizers is not None:
            self.quantizers.to(self._param_device())
        self._weight_cache.clear()
        return self


def _allow_missing_extra_state(module, state_dict, prefix, *args):
    """A state dict without FP8 state (e.g. from nn.Linear) loads with strict=True: the FP8 state starts fresh."""
    state_dict.setdefault(prefix + "_extra_state", None)
