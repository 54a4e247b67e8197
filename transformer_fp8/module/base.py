"""What every FP8 module shares: its scaling state, recipe adoption, the FP8 weight cast and cache, checkpoints.

Forward slots per GEMM: (input, weight); backward slots per GEMM: (grad_output). A `ScalingState` holds one set:
float32 amax_history [H, n] (row 0: this step's amax, max-accumulated by the casts), scale [n] (starts at 1),
scale_inv [n]. H is the recipe's amax_history_len (1 for current scaling).
Delayed scaling: each cast also writes 1/scale into its slot's `scale_invs[i]`, a one-element, 16-byte aligned
(cuBLASLt's scale pointers need it) snapshot that the GEMMs read and that FP8 tensors are saved or cached with. The
forward update gives the forward slots new snapshots (autocast.renew_scale_inv_snapshots), so a saved or cached tensor
keeps the scale it was cast with; gradient snapshots are reused (nothing outlives the backward that casts them).
Snapshots share one buffer (and so one autograd version counter): autograd Functions keep them as ctx attributes, not
through save_for_backward, whose version check would trip on writes to the other slots.
"""
import math
import os
import warnings

import torch
import torch.nn as nn

from .. import autocast
from ..float8_tensor import Float8Tensor
from ..ops import tfp8
from ._compiled_backward import file_backward_state
from ..recipe import FP8_MAX, Float8CurrentScaling


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


class ScalingState:
    """One set of FP8 slots, with one-element views of every slot made once (rebuilt when the tensors move).
    amax_group: a process group (the module's TP group under current scaling) over which each current-scaling amax
    is MAX-reduced before its scale is computed, or None.
    calibrated: False until the state's first update (delayed scaling). Until then a cast takes its slot's scale from
    the tensor's own amax (calibrate_scale) instead of the initial scale 1, under which gradients (~1e-4 and below)
    would flush to zero in E4M3. calibration_group: (group,) to MAX-reduce those amaxes over, as the update does
    (the autocast's fp8_group when the recipe reduces amaxes; (None,) = the default group), or None."""

    amax_group = None
    calibration_group = None

    def __init__(self, n, history_len, device):
        self.amax_history = torch.zeros(history_len, n, dtype=torch.float32, device=device)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.scale_inv = torch.ones(n, dtype=torch.float32, device=device)
        self.pending = False  # queued for the next update (see autocast.py)
        self.calibrated = False
        self._make_views()

    def _make_views(self):
        self.device = self.scale.device
        self.scales = self.scale.split(1)
        self.scale_inv_slots = self.scale_inv.split(1)
        self.amaxes = self.amax_history[0].split(1)
        self.histories = self.amax_history.split(1, dim=1)
        autocast.renew_scale_inv_snapshots([self])

    @property
    def history_len(self):
        return self.amax_history.shape[0]

    def to(self, device):
        if self.scale.device != device:
            self.amax_history, self.scale, self.scale_inv = (
                t.to(device) for t in (self.amax_history, self.scale, self.scale_inv))
            self._make_views()
            autocast.forget_update_plans()  # they group states by device

    def state_dict(self):
        return {"amax_history": self.amax_history, "scale": self.scale, "scale_inv": self.scale_inv}

    @classmethod
    def over(cls, amax_history, scale, scale_inv, calibrated):
        """A state over these float32 tensors ([H, n], [n], [n]; used as they are, not copied)."""
        self = cls.__new__(cls)
        self.amax_history, self.scale, self.scale_inv = amax_history, scale, scale_inv
        self.pending, self.calibrated = False, calibrated
        self._make_views()
        return self

    @classmethod
    def from_state_dict(cls, state, device):
        return cls.over(*(state[k].detach().to(device=device, dtype=torch.float32, copy=True)
                          for k in ("amax_history", "scale", "scale_inv")), calibrated=True)

    def set_current_scale(self, x, i, fp8_max):
        """Current scaling: slot i's scale from amax(x), MAX-reduced over amax_group if set (the update re-zeroes the
        amax slot). The amax goes through histories[i] ([1, 1]), the view the update reads: torch.compile makes
        overlapping views (amaxes[i]) separate graph inputs and loses writes through one of them in a backward."""
        amax = self.histories[i]
        tfp8.compute_amax(x, amax)
        if self.amax_group is not None:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.amax_group)
        tfp8.delayed_scaling_update([amax], [self.scales[i]], [self.scale_inv_slots[i]], fp8_max, 0.0, "most_recent")

    def calibrate_scale(self, x, i, fp8_max):
        """Delayed scaling before the first update: slot i's scale = fp8_max / amax(x) (amax MAX-reduced over
        calibration_group; a zero or non-finite amax keeps the scale). The amax stays in history row 0, where the
        cast accumulates it again and the update reads it. Returns a fresh scale_inv [1] for the cast to write (not
        the slot's snapshot: a later cast of the slot in the same step may calibrate another scale)."""
        amax = self.amaxes[i]
        tfp8.compute_amax(x, amax)
        if self.calibration_group is not None:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.calibration_group[0])
        usable = torch.isfinite(amax) & (amax > 0)
        self.scales[i].copy_(torch.where(usable, fp8_max / amax, self.scales[i]))
        return torch.empty(1, dtype=torch.float32, device=x.device)


def cast_args(x, state, i, fp8_dtype, current):
    """(scale, amax or None, scale_inv) for a cast of x into slot i of `state`.
    Delayed scaling: the cast writes scale_inv into the slot's snapshot state.scale_invs[i] (before the state's first
    update: the scale calibrated from x and a fresh scale_inv, see ScalingState.calibrate_scale). Current scaling
    sets the slot's scale from amax(x) first and the cast writes a fresh scale_inv (the slot's next cast may come
    before the backward that reads this one)."""
    if not current:
        scale_inv = state.scale_invs[i] if state.calibrated else state.calibrate_scale(x, i, FP8_MAX[fp8_dtype])
        return state.scales[i], state.amaxes[i], scale_inv
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    state.set_current_scale(x, i, FP8_MAX[fp8_dtype])
    return state.scales[i], None, scale_inv


def cast_transpose(x, state, i, fp8_dtype, current, rowwise=True, transpose=True):
    """x [M, N] -> (q [M, N] or empty, qT [N, M] or empty, scale_inv [1]) with slot i of `state` (see cast_args)."""
    scale, amax, scale_inv = cast_args(x, state, i, fp8_dtype, current)
    q, qt = tfp8.cast_transpose(x, scale, fp8_dtype, rowwise, transpose, amax, scale_inv)
    return q, qt, scale_inv


def fp8_output_args(state, i, fp8_dtype):
    """(scale, fp8_dtype, amax, scale_inv) for an op that emits FP8 into slot i (delayed scaling); scale_inv is the
    slot's snapshot state.scale_invs[i] (see cast_transpose)."""
    return state.scales[i], fp8_dtype, state.amaxes[i], state.scale_invs[i]


def keeps_weight_transpose(weight, is_first_microbatch):
    """Whether the forward makes (and the backward reuses) the FP8 Wᵀ of `weight`: cached weights and those under
    MIN_RECAST_WEIGHT_NUMEL elements; bigger uncached weights have Wᵀ cast again in the backward."""
    return is_first_microbatch is not None or weight.numel() < MIN_RECAST_WEIGHT_NUMEL


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
    """Base of the FP8 modules. Subclasses call `_fp8_begin(autocast.STATE)` at the start of an FP8 forward."""

    def __init__(self, num_gemms, params_dtype, device, fuse_wgrad_accumulation, gemm_n, fp8_min_gemm_size):
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
        self._n_fwd, self._n_bwd = 2 * num_gemms, num_gemms
        self.fp8_fwd = self.fp8_bwd = None
        self._fp8_recipe = None
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
        param = nn.Parameter(Float8Tensor.from_hp(weight, **autocast.STATE.model_init_options))
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
        if not self.fp8_current:
            if not self.fp8_fwd.pending:
                autocast.register_forward(self.fp8_fwd, recipe, state.group)
            if not self.fp8_bwd.calibrated:  # (the forward state calibrates in this step too, or has already)
                reduces = recipe.reduce_amax and autocast.distributed_initialized()
                self.fp8_fwd.calibration_group = self.fp8_bwd.calibration_group = (state.group,) if reduces else None
            if torch.compiler.is_compiling():  # (for the compiled backward: see _compiled_backward.py)
                file_backward_state(self.fp8_bwd, recipe, state.group)
        return recipe

    def _calibrate(self, *tensors):
        """Inside fp8_autocast(calibrating=True), on the high-precision path: max-accumulate the amax of tensors[i]
        (the tensor the FP8 path casts into forward slot i; None or a Float8Tensor: skipped) into slot i and queue
        the forward state for the update at the autocast's exit (delayed scaling; current scaling: nothing)."""
        state = autocast.STATE
        if isinstance(state.recipe, Float8CurrentScaling):
            return
        if state.recipe is not self._fp8_recipe:
            self._adopt_recipe(state.recipe)
        if not self.fp8_fwd.pending:
            autocast.register_forward(self.fp8_fwd, state.recipe, state.group)
        for t, amax in zip(tensors, self.fp8_fwd.amaxes):
            if t is not None and not isinstance(t, Float8Tensor):
                tfp8.compute_amax(t.detach().contiguous(), amax)

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
        self.fp8_current = isinstance(recipe, Float8CurrentScaling)
        history_len = 1 if self.fp8_current else recipe.amax_history_len
        if self.fp8_fwd is None or self.fp8_fwd.history_len != history_len:
            if torch.compiler.is_compiling():  # (a compiled backward's writes to a state made in its graph are lost)
                raise RuntimeError(f"{type(self).__name__}: torch.compile(fullgraph=True) needs the module's FP8 "
                                   "scaling state before the compiled call: run one forward eagerly inside "
                                   "fp8_autocast with this recipe first (or load a checkpoint saved with it)")
            device = self._param_device()
            self.fp8_fwd = ScalingState(self._n_fwd, history_len, device)
            self.fp8_bwd = ScalingState(self._n_bwd, history_len, device)
        tp = getattr(self, "tp", None)  # (TP modules: current-scaling amaxes are shared over the TP group)
        self.fp8_fwd.amax_group = self.fp8_bwd.amax_group = tp.group if tp is not None and self.fp8_current else None
        self.fwd_dtype, self.bwd_dtype = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
        self._fp8_recipe = recipe

    def _param_device(self):
        return next(self.parameters()).device

    # --- weights ---
    def _fp8_weight(self, name, weight, slot, need_transpose, is_first_microbatch):
        """FP8 copy of a weight [N, K] for the forward GEMM: (q [N, K], qT [K, N] or None, scale_inv [1]). Call inside
        an autograd Function's forward (grad mode off: the weight goes to the cast as it is).
        is_first_microbatch True: cast and cache; False: reuse the cache (no cast); None: cast, no cache.
        need_transpose (the backward's dgrad needs Wᵀ) makes qT, except for an uncached weight of at least
        MIN_RECAST_WEIGHT_NUMEL elements: then qT is None and the backward casts Wᵀ itself (_fp8_weight_transpose)."""
        if is_first_microbatch is False:
            cached = self._weight_cache.get(name)
            if cached is not None:
                if need_transpose and cached[1] is None:
                    cached = (cached[0], tfp8.fp8_transpose(cached[0]), cached[2])
                    self._weight_cache[name] = cached
                return cached
        need_transpose = need_transpose and keeps_weight_transpose(weight, is_first_microbatch)
        if isinstance(weight, Float8Tensor):
            q, scale_inv = weight._data, weight._scale_inv
            qt = weight.transpose_data() if need_transpose else None  # (kept on it: see keep_transpose_)
        else:
            q, qt, scale_inv = cast_transpose(weight, self.fp8_fwd, slot, self.fwd_dtype, self.fp8_current,
                                              transpose=need_transpose)
            qt = qt if need_transpose else None
        if is_first_microbatch is not None:
            self._weight_cache[name] = (q, qt, scale_inv)
        return q, qt, scale_inv

    def _fp8_weight_transpose(self, weight, qt, scale_inv):
        """Wᵀ [K, N] in FP8 for a dgrad GEMM: qt when the forward has one (a cached copy), else the weight cast again
        with the forward's scale (1 / scale_inv; no amax update), or a Float8Tensor's data transposed."""
        if qt is not None:
            return qt
        if isinstance(weight, Float8Tensor):
            return weight.transpose_data()
        return tfp8.cast_transpose(weight, torch.reciprocal(scale_inv), self.fwd_dtype, False, True)[1]

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
