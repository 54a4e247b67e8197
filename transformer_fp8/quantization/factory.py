"""From a recipe to quantizers: QUANTIZER_FOR_RECIPE and QuantizerSet, a module's quantizers by role.

A QuantizerSet owns a module's two ScalingStates (forward roles, backward roles: the module's extra_state
checkpoint, what graphs.py, checkpoint.py and debug.py read) and one quantizer per role over them. A module builds
one when it first runs with a recipe (and again when the recipe object changes: the states are kept when the amax
history length allows) and asks it for `qset[Role.X]`; the per-step bookkeeping (queueing the forward state for the
fused update, the first step's calibration group, the backward's registration) is here, behind capabilities the
quantizer classes declare.
"""
from typing import Any

import torch

from ..float8_tensor import Float8Tensor
from ..recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from . import update
from .compiled_backward import file_backward_state, queue_backward_update
from .block import BlockScalingQuantizer
from .quantizer import CurrentScalingQuantizer, DelayedScalingQuantizer, Quantizer
from .roles import Role
from .state import ScalingState

# recipe class -> quantizer class. A new recipe: one entry and one Quantizer subclass.
QUANTIZER_FOR_RECIPE: dict[type, type[Quantizer]] = {
    DelayedScaling: DelayedScalingQuantizer,
    Float8CurrentScaling: CurrentScalingQuantizer,
    Float8BlockScaling: BlockScalingQuantizer,
}


def quantizer_class(recipe: Any) -> type[Quantizer]:
    """Returns:
        The Quantizer class of `recipe` (a TypeError naming the recipe when none is registered)."""
    cls = QUANTIZER_FOR_RECIPE.get(type(recipe))
    if cls is None:
        raise TypeError(f"recipe: expected one of {[c.__name__ for c in QUANTIZER_FOR_RECIPE]}, got {recipe!r}")
    return cls


def _bound_state(attr: str, doc: str) -> property:
    """A QuantizerSet property over the ScalingState in `attr` whose setter rebinds the set's quantizers to the new
    state (ScalingState get and set).

    Args:
        attr: the private attribute holding the state.
        doc: the property's docstring.
    Returns:
        The property.
    """
    def get(qset: "QuantizerSet") -> ScalingState:
        return getattr(qset, attr)

    def set_and_bind(qset: "QuantizerSet", state: ScalingState) -> None:
        setattr(qset, attr, state)
        qset._bind()

    return property(get, set_and_bind, doc=doc)


class QuantizerSet:
    """A module's quantizers under one recipe, by role, and the ScalingStates they share.

    Attributes:
        recipe: the recipe (None for a set that only holds states loaded from a checkpoint: adopt a recipe first).
        forward_roles, backward_roles: the roles, in slot order.
        fwd_dtype, bwd_dtype: the recipe's FP8 formats.
        fused_per_tensor: the fused per-tensor ops can take this set's quantizers (cast_args / output_args).
        updates_by_history: the delayed rules apply (queued for the fused update, calibrated by it).
        by_role: {Role: Quantizer} (read-only: what `qset[role]` reads, for hot paths that skip the method call).
    """

    __slots__ = ("recipe", "forward_roles", "backward_roles", "fwd_dtype", "bwd_dtype", "tp_group",
                 "quantizer_class", "fused_per_tensor", "updates_by_history", "_fwd_state", "_bwd_state",
                 "_quantizers", "by_role", "_native_bwd")

    def __init__(self, recipe: Any, forward_roles: tuple[Role, ...], backward_roles: tuple[Role, ...],
                 device: torch.device | str, tp_group: Any = None,
                 states: tuple[ScalingState | None, ScalingState | None] | None = None):
        """Args:
            recipe: a DelayedScaling or Float8CurrentScaling (any recipe of QUANTIZER_FOR_RECIPE), or None (states
                only, see from_states).
            forward_roles, backward_roles: the module's roles, in slot order.
            device: where new states are made.
            tp_group: the module's tensor-parallel group, or None.
            states: (forward, backward) ScalingStates to keep (when their amax history length suits the recipe),
                or None.
        """
        self.recipe, self.tp_group = recipe, tp_group
        self._native_bwd = None  # (linear_node_args' C++ update arguments, made once per gradient state)
        self.forward_roles, self.backward_roles = tuple(forward_roles), tuple(backward_roles)
        fwd, bwd = states if states is not None else (None, None)
        self._quantizers = self.by_role = {}
        if recipe is None:
            self.quantizer_class = None
            self.fused_per_tensor = self.updates_by_history = False
            self.fwd_dtype = self.bwd_dtype = None
            self._fwd_state, self._bwd_state = fwd, bwd
            return
        cls = self.quantizer_class = quantizer_class(recipe)
        self.fused_per_tensor, self.updates_by_history = cls.fused_per_tensor, cls.updates_by_history
        self.fwd_dtype, self.bwd_dtype = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
        history_len = cls.history_len(recipe)
        if fwd is None or fwd.history_len != history_len:
            fwd = ScalingState(len(self.forward_roles), history_len, device)
            bwd = ScalingState(len(self.backward_roles), history_len, device)
        self._fwd_state, self._bwd_state = fwd, bwd
        self._bind()

    @classmethod
    def from_states(cls, forward_roles: tuple[Role, ...], backward_roles: tuple[Role, ...], fwd: ScalingState,
                    bwd: ScalingState) -> "QuantizerSet":
        """A set over loaded states and no recipe yet (a module's set_extra_state before its first FP8 call)."""
        return cls(None, forward_roles, backward_roles, fwd.device, states=(fwd, bwd))

    def _bind(self):
        if self.recipe is None:
            return
        cls, group = self.quantizer_class, self.tp_group
        for roles, state, dtype in ((self.forward_roles, self._fwd_state, self.fwd_dtype),
                                    (self.backward_roles, self._bwd_state, self.bwd_dtype)):
            for slot, role in enumerate(roles):
                self._quantizers[role] = cls(role, dtype, state, slot, group, recipe=self.recipe)

    def __getitem__(self, role: Role) -> Quantizer:
        """Returns:
            The quantizer of `role` (a KeyError naming the role and the set's roles otherwise)."""
        try:
            return self._quantizers[role]
        except KeyError:
            if self.recipe is None:
                raise KeyError(f"{role}: this QuantizerSet has no recipe yet (states loaded from a checkpoint)")
            raise KeyError(f"{role}: not a role of this module (roles: "
                           f"{[str(r) for r in self.forward_roles + self.backward_roles]})") from None

    # --- the states (a checkpoint region swaps them for its recompute: the quantizers follow) ---
    fwd_state = _bound_state("_fwd_state", "The forward roles' ScalingState.")
    bwd_state = _bound_state("_bwd_state", "The backward roles' ScalingState.")

    def same_scale_on_every_rank(self) -> bool:
        """Returns:
            Whether the tensor-parallel ranks cast each role with one shared scale (see Quantizer)."""
        return self.quantizer_class.same_scale_on_every_rank(self.recipe)

    def to(self, device: torch.device) -> None:
        """Move both states to `device` (in place)."""
        self._fwd_state.to(device)
        self._bwd_state.to(device)

    def extra_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Returns:
            {"fwd": ..., "bwd": ...}: the states' tensors (the modules' checkpoint format)."""
        return {"fwd": self._fwd_state.state_dict(), "bwd": self._bwd_state.state_dict()}

    def uncalibrated_states(self) -> list[ScalingState]:
        """Returns:
            The states still waiting for their first fused update (delayed rules only; else none)."""
        if not self.updates_by_history:
            return []
        return [s for s in (self._fwd_state, self._bwd_state) if not s.calibrated]

    # --- per-step bookkeeping ---
    def begin_forward(self, autocast_state: Any) -> None:
        """At the start of an FP8 forward (delayed rules): queue the forward state for the update at the outermost
        autocast exit, give both states the calibration group of a first step, and under torch.compile file the
        gradient state for the compiled backward's registration (see compiled_backward.py).

        Args:
            autocast_state: the calling thread's autocast.STATE (its queue, recipe and fp8_group).
        """
        if not self.updates_by_history:
            return
        recipe, group = self.recipe, autocast_state.group
        if not self._fwd_state.pending:
            update.register_forward(autocast_state.forward_states, self._fwd_state, recipe, group)
        if not self._bwd_state.calibrated:  # (the forward state calibrates in this step too, or has already)
            reduces = recipe.reduce_amax and update.distributed_initialized()
            self._fwd_state.calibration_group = self._bwd_state.calibration_group = (group,) if reduces else None
        if torch.compiler.is_compiling():
            file_backward_state(self._bwd_state, recipe, group)

    def register_backward(self, group: Any) -> None:
        """After a backward's casts into the gradient state (delayed rules): queue it for the update after this
        backward; under torch.compile through the traced op queue_backward_update.

        Args:
            group: the fp8_group its forward ran with (saved by the forward, never the calling thread's).
        """
        if not self.updates_by_history:
            return
        state = self._bwd_state
        if torch.compiler.is_compiling():
            queue_backward_update(state.amaxes[0], id(state))
        else:
            update.register_backward(state, self.recipe, group)

    def scales_known_per_tensor(self) -> bool:
        """Returns:
            Whether every role's per-tensor scale is known before its cast: the fused per-tensor ops apply and both
            states have had their first fused update (delayed rules; the first step calibrates them in Python). The
            C++ Linear node's condition, tested in one call (a small layer's host time counts)."""
        return self.fused_per_tensor and self.updates_by_history and self._fwd_state.calibrated and \
            self._bwd_state.calibrated

    def linear_node_args(self, group: Any) -> tuple:
        """The C++ Linear node's scaling arguments in one call (a small layer's host time counts).

        Args:
            group: the autocast's fp8_group.
        Returns:
            Delayed scaling: (backward_registration(group), then output_args() of the INPUT, WEIGHT and GRAD_OUTPUT
            roles, then the gradient state's C++ update arguments (amax_history, scale, scale_inv, fp8_max, margin,
            use_max) where update.native_updates_apply(), else None, then None). Current scaling (no amax group:
            the node computes each scale from its tensor's amax): (None, then (scale, FP8 dtype, the slot's [1, 1]
            history view, the slot's scale_inv) of the three roles, None, then the forward and gradient FP8 maxima).
        """
        quantizers = self._quantizers
        x, w, dy = quantizers[Role.INPUT], quantizers[Role.WEIGHT], quantizers[Role.GRAD_OUTPUT]
        xs, ws, dys = x.state, w.state, dy.state  # (output_args() of each, inline)
        if not self.updates_by_history:
            return (None, (xs.scales[x.slot], x.fp8_dtype, xs.histories[x.slot], xs.scale_inv_slots[x.slot]),
                    (ws.scales[w.slot], w.fp8_dtype, ws.histories[w.slot], ws.scale_inv_slots[w.slot]),
                    (dys.scales[dy.slot], dy.fp8_dtype, dys.histories[dy.slot], dys.scale_inv_slots[dy.slot]),
                    None, (x.fp8_max, dy.fp8_max))
        bwd, native = self._bwd_state, None
        if update.native_updates_apply():
            native = self._native_bwd
            if native is None or native[0] is not bwd.amax_history:
                native = self._native_bwd = (bwd.amax_history, bwd.scale, bwd.scale_inv,
                                             *update.native_update_args(self.recipe, False))
        return ((bwd, self.recipe, group),
                (xs.scales[x.slot], x.fp8_dtype, xs.amaxes[x.slot], xs.scale_invs[x.slot]),
                (ws.scales[w.slot], w.fp8_dtype, ws.amaxes[w.slot], ws.scale_invs[w.slot]),
                (dys.scales[dy.slot], dy.fp8_dtype, dys.amaxes[dy.slot], dys.scale_invs[dy.slot]),
                native, None)

    def backward_registration(self, group: Any) -> tuple:
        """Returns:
            The arguments of update.register_backward for this set's gradient state (what the C++ Linear node calls
            after its backward; delayed rules only)."""
        return (self._bwd_state, self.recipe, group)

    def record_amaxes(self, tensors: tuple[torch.Tensor | None, ...], autocast_state: Any) -> None:
        """fp8_autocast(calibrating=True) on the high-precision path: max-accumulate the amax of tensors[i] (the
        tensor the FP8 path casts for forward role i; None or a Float8Tensor: skipped) and queue the forward state
        for the update at the autocast's exit (delayed rules; otherwise nothing)."""
        if not self.updates_by_history:
            return
        if not self._fwd_state.pending:
            update.register_forward(autocast_state.forward_states, self._fwd_state, self.recipe,
                                    autocast_state.group)
        for t, role in zip(tensors, self.forward_roles):
            if t is not None and not isinstance(t, Float8Tensor):
                self._quantizers[role].record_amax(t)

    def __repr__(self) -> str:
        roles = [str(r) for r in self.forward_roles], [str(r) for r in self.backward_roles]
        return f"QuantizerSet(recipe={type(self.recipe).__name__}, forward_roles={roles[0]}, backward_roles={roles[1]})"
