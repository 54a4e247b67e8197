"""Quantizers: how one tensor role of a module is cast to FP8 under a recipe.

A module never asks which recipe it runs: it asks its QuantizerSet (factory.py) for the quantizer of a role and casts
with it. The quantizer owns its slot of the module's forward or backward ScalingState (amax history, scale,
scale_inv snapshot) and knows the recipe's rules: the delayed one calibrates a fresh state from the tensor's own amax
until the state's first update and queues its state for the fused update; the current one takes the scale from the
tensor's own amax at every cast (MAX-reduced over the module's tensor-parallel group). A third recipe is one more
class here and one entry in factory.QUANTIZER_FOR_RECIPE.
"""
from typing import Any, Callable

import torch

from ..ops import activation_high_precision, tfp8
from ..recipe import FP8_MAX
from .operand import FP8Operand
from .roles import Role
from .state import ScalingState


def _slot_view(field: str, doc: str) -> property:
    """A read-only property of a quantizer: its slot of the ScalingState tensor `field` (a one-element view).

    Args:
        field: the ScalingState attribute (scales, amaxes, scale_invs, scale_inv_slots).
        doc: the property's docstring.
    Returns:
        The property.
    """
    return property(lambda self: getattr(self.state, field)[self.slot], doc=doc)


class Quantizer:
    """Casts one role's tensors to FP8 with per-tensor scales kept in slot `slot` of `state`.

    Attributes:
        role: the Role.
        fp8_dtype: the FP8 dtype of this role (the recipe's forward or backward format).
        state, slot: the ScalingState and the slot this role's scale, amax and scale_inv snapshot live in.
        layout: the FP8Operand layout the casts make ("tensor").
    Class attributes (capabilities the modules branch on, never the class itself):
        fused_per_tensor: the fused per-tensor ops (fp8_linear_fwd / _bwd, norm -> FP8, activation -> FP8) can take
            this quantizer's cast_args / output_args.
        updates_by_history: the scale comes from the amax history (delayed): the state is queued for the fused
            update and is calibrated by it.
        fused_norm_cast / fused_dact_cast: cast_normalized / cast_activation_grad run one fused kernel (norm ->
            FP8, activation gradient -> FP8) for this quantizer's own scales (block scaling).
    """

    __slots__ = ("role", "fp8_dtype", "fp8_max", "state", "slot")
    layout = "tensor"
    fused_per_tensor = True
    updates_by_history = False
    fused_norm_cast = False
    fused_dact_cast = False

    def __init__(self, role: Role, fp8_dtype: torch.dtype, state: ScalingState, slot: int, tp_group: Any = None,
                 recipe: Any = None):
        """Args:
            role: the Role this quantizer casts.
            fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
            state: the ScalingState holding the role's slot.
            slot: the role's slot in `state`.
            tp_group: the module's tensor-parallel group, or None (used by recipes that share amaxes over it).
            recipe: the recipe (read by classes with per-role settings, such as block scaling's block dims).
        """
        self.role, self.fp8_dtype, self.fp8_max = role, fp8_dtype, FP8_MAX[fp8_dtype]
        self.state, self.slot = state, slot

    @classmethod
    def history_len(cls, recipe: Any) -> int:
        """Returns:
            The amax history length of the states this class's quantizers use under `recipe`."""
        return recipe.amax_history_len

    @classmethod
    def same_scale_on_every_rank(cls, recipe: Any) -> bool:
        """Returns:
            Whether every tensor-parallel rank casts a role with the same scale under `recipe` (so that FP8 data
            cast on each rank's block can be all-gathered as one tensor)."""
        raise NotImplementedError

    # --- what every recipe defines ---
    @property
    def known_scale(self) -> bool:
        """Whether an op may write this role's FP8 output with a scale known before it runs (output_args)."""
        return False

    def cast_args(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Prepare a per-tensor cast of x (for the fused kernels that cast inside).

        Args:
            x: the high-precision tensor about to be cast.

        Returns:
            (scale [1], amax [1] to max-accumulate into or None, scale_inv [1] for the cast to write).
        """
        raise NotImplementedError

    # --- shared: the slot's one-element views of the state (torch.Tensor each) ---
    scale = _slot_view("scales", "The slot's scale, a one-element view of the state.")
    amax = _slot_view("amaxes", "The slot's amax (history row 0), a one-element view of the state.")
    scale_inv = _slot_view("scale_invs", "The slot's scale_inv snapshot (what the casts into this slot write and FP8 "
                                         "tensors are kept with).")
    scale_inv_slot = _slot_view("scale_inv_slots", "The slot's entry of the state's scale_inv vector (written by "
                                                   "the fused update).")

    def cast(self, x: torch.Tensor, *, rowwise: bool = True, transpose: bool = False) -> FP8Operand:
        """x [M, N] (contiguous, high precision) -> FP8Operand with data [M, N] (rowwise) and data_t [N, M]
        (transpose), from one fused cast(-transpose) kernel.

        Args:
            x: the tensor to cast.
            rowwise: make data (else data is None).
            transpose: make data_t (else data_t is None).

        Returns:
            The FP8Operand (per-tensor layout).
        """
        scale, amax, scale_inv = self.cast_args(x)
        q, qt = tfp8.cast_transpose(x, scale, self.fp8_dtype, rowwise, transpose, amax, scale_inv)
        return FP8Operand(q if rowwise else None, qt if transpose else None, scale_inv, self.fp8_dtype)

    def cast_with_dbias(self, x: torch.Tensor) -> tuple[FP8Operand, torch.Tensor]:
        """A gradient x [M, N] -> (FP8Operand with data and data_t, x summed over rows [N]: the bias gradient), in
        one fused kernel."""
        scale, amax, scale_inv = self.cast_args(x)
        q, qt, dbias = tfp8.cast_transpose_dbias(x, scale, self.fp8_dtype, amax, scale_inv)
        return FP8Operand(q, qt, scale_inv, self.fp8_dtype), dbias

    def output_args(self) -> tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor]:
        """(scale, fp8_dtype, amax, scale_inv) for an op that writes this role's FP8 output itself (norm, activation,
        GEMM epilogue). Only when known_scale; scale_inv is the slot's snapshot, for the op (or the caller) to write.
        """
        return self.state.scales[self.slot], self.fp8_dtype, self.state.amaxes[self.slot], \
            self.state.scale_invs[self.slot]

    def output_args_for(self, accumulate_amax: Callable[[torch.Tensor], None],
                        device: torch.device) -> tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None:
        """output_args() for an op about to write this role's FP8 output, where a scale can be had before the op runs
        without the output existing in high precision; else None (the caller computes the output, then casts it).

        Args:
            accumulate_amax: max-accumulates the amax of the output-to-be into the float32 [1] tensor it is given
                (chunk by chunk); called only where the scale comes from that amax (delayed scaling's first step).
            device: the output's device.

        Returns:
            (scale, fp8_dtype, amax, scale_inv) as output_args(), or None. Here: output_args() with a known scale.
        """
        return self.output_args() if self.known_scale else None

    def transpose_like(self, x: torch.Tensor, operand: FP8Operand) -> torch.Tensor:
        """x [N, K] (the tensor `operand` was cast from, say a weight) -> its FP8 transpose [K, N] with the
        operand's scale (1 / scale_inv; no amax update): the backward's recast of a weight whose forward kept no Wᵀ.
        """
        return tfp8.cast_transpose(x, torch.reciprocal(operand.scale_inv), self.fp8_dtype, False, True)[1]

    def cast_activation(self, x: torch.Tensor, activation: str, *, transpose: bool = False) -> FP8Operand:
        """act(x) cast like cast(): x [M, F] (or [M, 2F] for "swiglu"); here the activation in high precision, then the
        cast (a class with a fused kernel overrides it).

        Args:
            x: the activation's input (an FC1 output), contiguous.
            activation: "gelu", "relu" or "swiglu".
            transpose: make data_t as well.

        Returns:
            The FP8Operand of act(x).
        """
        return self.cast(activation_high_precision(x, activation), transpose=transpose)

    def cast_normalized(self, spec: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                        transpose: bool = False) -> tuple[FP8Operand, torch.Tensor | None, torch.Tensor]:
        """norm(x) cast in one kernel, never stored in high precision (only where fused_norm_cast).

        Args:
            spec: the norm's settings (module.norm.NormSpec: normalization, eps, zero_centered_gamma).
            x: the norm's input [M, K], contiguous.
            weight, bias: the norm's gamma [K] and beta [K] (LayerNorm) or None.
            transpose: make data_t as well.

        Returns:
            (FP8Operand of norm(x), mean [M] float32 or None for RMSNorm, rstd [M] float32).
        """
        raise NotImplementedError(f"{self!r}: no fused norm cast (check fused_norm_cast first)")

    def cast_activation_grad(self, grad: torch.Tensor, x: torch.Tensor, activation: str, *, transpose: bool = False,
                             with_dbias: bool = False) -> tuple[FP8Operand, torch.Tensor | None]:
        """act'(x) * grad cast in one kernel, never stored in high precision (only where fused_dact_cast).

        Args:
            grad: the gradient of act(x), [M, F].
            x: the activation's input, [M, F] (or [M, 2F] for "swiglu").
            activation: "gelu", "relu" or "swiglu".
            transpose: make data_t as well.
            with_dbias: also return the column sums of act'(x) * grad (a bias gradient), summed in float32.

        Returns:
            (the FP8Operand (data [M, F or 2F]), the column sums in grad's dtype or None).
        """
        raise NotImplementedError(f"{self!r}: no fused activation-gradient cast (check fused_dact_cast first)")

    def add_transpose(self, operand: FP8Operand, x: torch.Tensor) -> FP8Operand:
        """operand (cast from x by this quantizer) with data_t: a byte transpose of its data where the layout's
        transposed copy shares its scales (per-tensor), else recast from x (see BlockScalingQuantizer).

        Args:
            operand: the operand, data_t possibly missing.
            x: the high-precision tensor it was cast from.

        Returns:
            operand, with data_t.
        """
        return operand.with_transpose()

    def record_amax(self, x: torch.Tensor) -> None:
        """Calibration on the high-precision path (fp8_autocast(calibrating=True)): max-accumulate amax(x) into the
        slot, for the update to turn into a scale. Nothing for a quantizer whose scale does not come from history."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role.value}, fp8_dtype={self.fp8_dtype}, slot={self.slot})"


class DelayedScalingQuantizer(Quantizer):
    """DelayedScaling: the scale comes from the slot's amax history, updated once per step by the fused update.
    Before the state's first update (not calibrated) a cast takes its scale from the tensor's own amax instead
    (ScalingState.calibrate_scale), so that a fresh module's first step neither overflows nor flushes to zero."""

    __slots__ = ()
    updates_by_history = True

    @property
    def known_scale(self) -> bool:
        return self.state.calibrated

    @classmethod
    def same_scale_on_every_rank(cls, recipe):
        return recipe.reduce_amax  # (the update MAX-reduces the amaxes over the fp8_group, which holds the TP group)

    def cast_args(self, x):
        state, slot = self.state, self.slot
        scale_inv = state.scale_invs[slot] if state.calibrated else state.calibrate_scale(x, slot, self.fp8_max)
        return state.scales[slot], state.amaxes[slot], scale_inv

    def output_args_for(self, accumulate_amax, device):
        state, slot = self.state, self.slot
        if state.calibrated:
            return self.output_args()
        # (before the first update: the scale from the output's own amax, as cast_args takes its tensor's, and a
        # fresh scale_inv as there)
        scale_inv = state.calibrate_scale_by(slot, self.fp8_max, accumulate_amax, device)
        return state.scales[slot], self.fp8_dtype, state.amaxes[slot], scale_inv

    def record_amax(self, x):
        tfp8.compute_amax(x.detach().contiguous(), self.state.amaxes[self.slot])


class CurrentScalingQuantizer(Quantizer):
    """Float8CurrentScaling: the scale is fp8_max / amax(x) of the tensor being cast, its amax MAX-reduced over
    `amax_group` first (a tensor-parallel module's group, so that its ranks share one scale) when not None."""

    __slots__ = ("amax_group",)

    def __init__(self, role: Role, fp8_dtype: torch.dtype, state: ScalingState, slot: int, tp_group: Any = None,
                 recipe: Any = None):
        """Args:
            role, fp8_dtype, state, slot, recipe: as Quantizer's.
            tp_group: the process group the amaxes are MAX-reduced over (amax_group), or None.
        """
        super().__init__(role, fp8_dtype, state, slot)
        self.amax_group = tp_group

    @classmethod
    def history_len(cls, recipe):
        return 1

    @classmethod
    def same_scale_on_every_rank(cls, recipe):
        return True  # (the amax is MAX-reduced over the TP group before each cast)

    def cast_args(self, x):
        # (a fresh scale_inv: the slot's next cast may come before the backward that reads this one)
        scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
        self.state.set_current_scale(x, self.slot, self.fp8_max, self.amax_group)
        return self.state.scales[self.slot], None, scale_inv
